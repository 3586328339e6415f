// SHA-256 (FIPS 180-4) of bytes and of files, computed by nettle or OpenSSL's libcrypto
// (src/io/sha256.cc): manifests record the digest of every golden file so a reader can
// tell a corrupted or substituted file from a genuine one.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

namespace k3ref::io {

// Lower-case hexadecimal digest (64 characters) of `bytes`.
std::string sha256_hex(std::span<const std::uint8_t> bytes);

// Digest of a file's contents, read in fixed-size chunks so memory does not grow with
// the file. Throws FileError naming the file when it cannot be opened or read.
std::string sha256_file_hex(const std::filesystem::path& path);

}  // namespace k3ref::io
