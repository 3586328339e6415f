#include "k3ref/io/sha256.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <vector>

#include "k3ref/error.h"

namespace k3ref::io {
namespace {

// FIPS 180-4 §4.2.2: first 32 bits of the fractional parts of the cube roots of the
// first 64 primes.
constexpr std::array<std::uint32_t, 64> round_constants = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// Incremental hasher: absorb() any number of times, then finish() once.
class Sha256 {
 public:
  void absorb(std::span<const std::uint8_t> bytes) {
    // An empty span may carry a null pointer, which memcpy must never see, even for 0 bytes.
    if (bytes.empty()) return;
    total_bytes_ += bytes.size();
    std::size_t i = 0;
    // Top up a partly filled block first, then hash whole blocks straight from the input.
    if (buffered_ > 0) {
      const std::size_t take = std::min(bytes.size(), block_.size() - buffered_);
      std::memcpy(block_.data() + buffered_, bytes.data(), take);
      buffered_ += take;
      i = take;
      if (buffered_ < block_.size()) return;
      compress(block_.data());
      buffered_ = 0;
    }
    for (; i + 64 <= bytes.size(); i += 64) compress(bytes.data() + i);
    std::memcpy(block_.data(), bytes.data() + i, bytes.size() - i);
    buffered_ = bytes.size() - i;
  }

  std::string finish() {
    // §5.1.1: append bit '1', zeros to 56 mod 64 bytes, then the message length in bits
    // as a big-endian 64-bit integer.
    const std::uint64_t total_bits = total_bytes_ * 8;
    std::array<std::uint8_t, 72> padding{};
    padding[0] = 0x80;
    const std::size_t zeros_and_marker = (buffered_ < 56 ? 56 : 120) - buffered_;
    for (int b = 0; b < 8; ++b)
      padding[zeros_and_marker + b] = static_cast<std::uint8_t>(total_bits >> (56 - 8 * b));
    absorb(std::span(padding.data(), zeros_and_marker + 8));

    static constexpr char hex_digits[] = "0123456789abcdef";
    std::string hex;
    hex.reserve(64);
    for (std::uint32_t word : state_)
      for (int shift = 28; shift >= 0; shift -= 4) hex.push_back(hex_digits[(word >> shift) & 0xf]);
    return hex;
  }

 private:
  void compress(const std::uint8_t* block) {
    std::array<std::uint32_t, 64> schedule;
    for (int t = 0; t < 16; ++t)
      schedule[t] = std::uint32_t{block[4 * t]} << 24 | std::uint32_t{block[4 * t + 1]} << 16 |
                    std::uint32_t{block[4 * t + 2]} << 8 | std::uint32_t{block[4 * t + 3]};
    for (int t = 16; t < 64; ++t) {
      const std::uint32_t s0 =
          std::rotr(schedule[t - 15], 7) ^ std::rotr(schedule[t - 15], 18) ^ (schedule[t - 15] >> 3);
      const std::uint32_t s1 =
          std::rotr(schedule[t - 2], 17) ^ std::rotr(schedule[t - 2], 19) ^ (schedule[t - 2] >> 10);
      schedule[t] = schedule[t - 16] + s0 + schedule[t - 7] + s1;
    }
    std::uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
    std::uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int t = 0; t < 64; ++t) {
      const std::uint32_t sigma1 = std::rotr(e, 6) ^ std::rotr(e, 11) ^ std::rotr(e, 25);
      const std::uint32_t choose = (e & f) ^ (~e & g);
      const std::uint32_t t1 = h + sigma1 + choose + round_constants[t] + schedule[t];
      const std::uint32_t sigma0 = std::rotr(a, 2) ^ std::rotr(a, 13) ^ std::rotr(a, 22);
      const std::uint32_t majority = (a & b) ^ (a & c) ^ (b & c);
      const std::uint32_t t2 = sigma0 + majority;
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a; state_[1] += b; state_[2] += c; state_[3] += d;
    state_[4] += e; state_[5] += f; state_[6] += g; state_[7] += h;
  }

  // §5.3.3: initial hash value.
  std::array<std::uint32_t, 8> state_ = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                         0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::array<std::uint8_t, 64> block_{};
  std::size_t buffered_ = 0;
  std::uint64_t total_bytes_ = 0;
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
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FileError("sha256: cannot open " + path.string() + ": " + std::strerror(errno));
  Sha256 hasher;
  std::vector<std::uint8_t> chunk(1 << 16);
  for (;;) {
    const ::ssize_t got = ::read(fd, chunk.data(), chunk.size());
    if (got == 0) break;
    if (got < 0) {
      if (errno == EINTR) continue;
      const int read_errno = errno;
      ::close(fd);
      throw FileError("sha256: cannot read " + path.string() + ": " + std::strerror(read_errno));
    }
    hasher.absorb(std::span(chunk.data(), static_cast<std::size_t>(got)));
  }
  ::close(fd);
  return hasher.finish();
}

}  // namespace k3ref::io
