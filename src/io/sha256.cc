#include "k3ref/io/sha256.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "k3ref/error.h"
#include "k3ref/io/file.h"

// The digest comes from nettle where it is installed (.ci/packages: nettle-dev), else from
// OpenSSL's libcrypto: the GPU image (docs/gpu_check.md) has OpenSSL's headers and not
// nettle's, and its `meson setup` configures this file's library too (meson.build).
#if K3REF_SHA256_NETTLE
#include <nettle/sha2.h>
#else
#include <openssl/evp.h>
#endif

namespace k3ref::io {
namespace {

constexpr std::size_t digest_bytes = 32;

// Incremental hasher: absorb() any number of times, then finish() once.
class Sha256 {
 public:
#if K3REF_SHA256_NETTLE
  Sha256() { sha256_init(&context_); }

  void absorb(std::span<const std::uint8_t> bytes) {
    // An empty span may carry a null pointer, which is passed on to no library.
    if (!bytes.empty()) sha256_update(&context_, bytes.size(), bytes.data());
  }

  std::string finish() {
    std::array<std::uint8_t, digest_bytes> digest;
    sha256_digest(&context_, digest.size(), digest.data());
    return to_hex(digest);
  }

 private:
  sha256_ctx context_;
#else
  Sha256() : context_(EVP_MD_CTX_new()) {
    if (!context_ || EVP_DigestInit_ex(context_, EVP_sha256(), nullptr) != 1) {
      EVP_MD_CTX_free(context_);
      throw std::runtime_error("sha256: OpenSSL could not start a SHA-256 digest");
    }
  }
  ~Sha256() { EVP_MD_CTX_free(context_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void absorb(std::span<const std::uint8_t> bytes) {
    // An empty span may carry a null pointer, which is passed on to no library.
    if (!bytes.empty() && EVP_DigestUpdate(context_, bytes.data(), bytes.size()) != 1)
      throw std::runtime_error("sha256: OpenSSL's SHA-256 update failed");
  }

  std::string finish() {
    std::array<std::uint8_t, digest_bytes> digest;
    unsigned int length = 0;
    if (EVP_DigestFinal_ex(context_, digest.data(), &length) != 1 || length != digest.size())
      throw std::runtime_error("sha256: OpenSSL's SHA-256 finish failed");
    return to_hex(digest);
  }

 private:
  EVP_MD_CTX* context_;
#endif

  static std::string to_hex(const std::array<std::uint8_t, digest_bytes>& digest) {
    static constexpr char hex_digits[] = "0123456789abcdef";
    std::string hex;
    hex.reserve(2 * digest.size());
    for (std::uint8_t byte : digest) {
      hex.push_back(hex_digits[byte >> 4]);
      hex.push_back(hex_digits[byte & 0xf]);
    }
    return hex;
  }
};

}  // namespace

std::string sha256_hex(std::span<const std::uint8_t> bytes) {
  Sha256 hasher;
  hasher.absorb(bytes);
  return hasher.finish();
}

std::string sha256_file_hex(const std::filesystem::path& path) {
  // POSIX read(2) rather than iostreams: a directory or an I/O error must surface as an
  // errno, not as a silently short stream.
  // FileDescriptor closes the file on every way out, a throwing hasher's included.
  const FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw FileError("sha256: cannot open " + path.string() + ": " + std::strerror(errno));
  Sha256 hasher;
  std::vector<std::uint8_t> chunk(1 << 16);
  for (;;) {
    const ::ssize_t got = ::read(fd.get(), chunk.data(), chunk.size());
    if (got == 0) break;
    if (got < 0) {
      if (errno == EINTR) continue;
      const int read_errno = errno;
      throw FileError("sha256: cannot read " + path.string() + ": " + std::strerror(read_errno));
    }
    hasher.absorb(std::span(chunk.data(), static_cast<std::size_t>(got)));
  }
  return hasher.finish();
}

}  // namespace k3ref::io
