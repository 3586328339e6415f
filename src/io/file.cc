#include "k3ref/io/file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <random>
#include <cstring>
#include <optional>

#include "k3ref/error.h"

namespace k3ref::io {
namespace {

constexpr char hex_digits[] = "0123456789abcdef";

void append_hex_byte(std::string& out, unsigned char c) {
  out += "\\x";
  out += hex_digits[c >> 4];
  out += hex_digits[c & 0xf];
}

// Length of the valid UTF-8 sequence starting at text[i], or 0 if the byte there does not
// start one (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
std::size_t utf8_sequence_length(std::string_view text, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  std::size_t continuation_count;
  unsigned char second_min = 0x80, second_max = 0xbf;
  if (lead < 0x80) return 1;
  if (lead >= 0xc2 && lead <= 0xdf) {
    continuation_count = 1;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    continuation_count = 2;
    if (lead == 0xe0) second_min = 0xa0;  // overlong
    if (lead == 0xed) second_max = 0x9f;  // surrogates
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    continuation_count = 3;
    if (lead == 0xf0) second_min = 0x90;  // overlong
    if (lead == 0xf4) second_max = 0x8f;  // above U+10FFFF
  } else {
    return 0;
  }
  if (i + continuation_count >= text.size()) return 0;  // truncated sequence
  if (byte(i + 1) < second_min || byte(i + 1) > second_max) return 0;
  for (std::size_t k = 2; k <= continuation_count; ++k)
    if (byte(i + k) < 0x80 || byte(i + k) > 0xbf) return 0;
  return continuation_count + 1;
}

// Code point of a valid sequence of `length` bytes at text[i].
char32_t code_point(std::string_view text, std::size_t i, std::size_t length) {
  const auto byte = [&](std::size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(text[k])); };
  if (length == 1) return byte(i);
  char32_t cp = byte(i) & (0x7f >> length);
  for (std::size_t k = 1; k < length; ++k) cp = cp << 6 | (byte(i + k) & 0x3f);
  return cp;
}

// Characters a terminal acts on or that break a line: C0, DEL, C1 (the 8-bit CSI U+009B
// among them), the Unicode line and paragraph separators, and the bidirectional
// overrides and isolates that reorder what is displayed.
bool is_unsafe_for_terminal(char32_t cp) {
  return cp < 0x20 || (cp >= 0x7f && cp <= 0x9f) || cp == 0x2028 || cp == 0x2029 || (cp >= 0x202a && cp <= 0x202e) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

// printable() of text[0, limit), where `limit` never cuts a character.
std::string printable_prefix(std::string_view text, std::size_t limit, std::size_t* consumed) {
  std::string out;
  std::size_t i = 0;
  while (i < text.size()) {
    const std::size_t length = utf8_sequence_length(text, i);
    const std::size_t step = length == 0 ? 1 : length;
    if (i + step > limit) break;
    if (length == 0 || is_unsafe_for_terminal(code_point(text, i, length))) {
      for (std::size_t k = 0; k < step; ++k) append_hex_byte(out, static_cast<unsigned char>(text[i + k]));
    } else {
      out.append(text.substr(i, step));
    }
    i += step;
  }
  if (consumed) *consumed = i;
  return out;
}

std::string errno_text(int error_number) { return std::strerror(error_number); }

[[noreturn]] void throw_file_error(const std::filesystem::path& path, const std::string& detail) {
  throw FileError(printable(path.string()) + ": " + detail);
}

}  // namespace

std::string printable(std::string_view text) { return printable_prefix(text, text.size(), nullptr); }

std::string excerpt(std::string_view text, std::size_t max_bytes) {
  std::size_t consumed = 0;
  std::string out = "'" + printable_prefix(text, max_bytes, &consumed) + "'";
  if (consumed < text.size()) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

std::optional<std::size_t> first_invalid_utf8(std::string_view text) {
  for (std::size_t i = 0; i < text.size();) {
    if (static_cast<unsigned char>(text[i]) < 0x80) {  // ASCII, nearly every header byte
      ++i;
      continue;
    }
    const std::size_t length = utf8_sequence_length(text, i);
    if (length == 0) return i;
    i += length;
  }
  return std::nullopt;
}

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

int FileDescriptor::close() {
  const int result = ::close(fd_);
  fd_ = -1;
  return result;
}

RegularFile open_regular_file(const std::filesystem::path& path, std::uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer. O_NOCTTY: a
  // terminal device never becomes the controlling terminal.
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
  if (fd.get() < 0) throw_file_error(path, "cannot open: " + errno_text(errno));
  struct ::stat status;
  if (::fstat(fd.get(), &status) != 0) throw_file_error(path, "cannot stat: " + errno_text(errno));
  if (!S_ISREG(status.st_mode)) {
    const char* kind = S_ISDIR(status.st_mode)    ? "a directory"
                       : S_ISFIFO(status.st_mode) ? "a FIFO"
                       : S_ISCHR(status.st_mode)  ? "a character device"
                       : S_ISBLK(status.st_mode)  ? "a block device"
                       : S_ISSOCK(status.st_mode) ? "a socket"
                                                  : "not a regular file";
    throw_file_error(path, std::string("is ") + kind + ", only regular files are read");
  }
  const std::uint64_t size = static_cast<std::uint64_t>(status.st_size);
  if (size > max_bytes)
    throw_file_error(path, "file has " + std::to_string(size) + " bytes, over the limit of " + std::to_string(max_bytes) +
                               " bytes for this kind of file");
  // Reads of a regular file never block, but clear the flag so no read can return EAGAIN.
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0)
    throw_file_error(path, "cannot clear O_NONBLOCK: " + errno_text(errno));
  return RegularFile{std::move(fd), size};
}

void read_exactly(int fd, std::uint8_t* out, std::size_t count, const std::string& file, const std::string& what) {
  while (count > 0) {
    const ::ssize_t got = ::read(fd, out, count);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw FileError(printable(file) + ": cannot read " + what + ": " + errno_text(errno));
    }
    if (got == 0) throw FileError(printable(file) + ": file ended while reading " + what + " (was it truncated?)");
    out += got;
    count -= static_cast<std::size_t>(got);
  }
}

std::vector<std::uint8_t> read_regular_file(const std::filesystem::path& path, std::uint64_t max_bytes) {
  RegularFile file = open_regular_file(path, max_bytes);
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(file.size));
  read_exactly(file.fd.get(), bytes.data(), bytes.size(), path.string(), "the file");
  return bytes;
}

void check_output_path(const std::filesystem::path& path, const OutputCheck& check) {
  const std::string where = check.option + " " + printable(path.string());
  auto refuse = [&](const std::string& rule) { throw FileError(where + ": " + rule); };
  if (path.empty()) refuse("empty path");
  if (!check.force && !is_valid_utf8(path.string()))
    refuse("the name is not valid UTF-8 (messages and metadata could not name it; --force writes it anyway)");

  const std::filesystem::path directory = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  struct ::stat status;
  if (::stat(directory.c_str(), &status) != 0)
    refuse("directory " + printable(directory.string()) + " is not usable: " + errno_text(errno));
  if (!S_ISDIR(status.st_mode)) refuse(printable(directory.string()) + " is not a directory");
  if (::access(directory.c_str(), W_OK | X_OK) != 0)
    refuse("directory " + printable(directory.string()) + " is not writable: " + errno_text(errno));

  // Every write goes through "<name>.tmp.<pid>.<random>": refuse now, before any work, a name
  // whose temporary would exceed the file system's limit on a name.
  const std::size_t name_bytes = path.filename().string().size();
  if (name_bytes + max_temporary_suffix_bytes > max_name_bytes)
    refuse("the name has " + std::to_string(name_bytes) + " bytes; k3ref writes it through a temporary of up to " +
           std::to_string(name_bytes + max_temporary_suffix_bytes) + ", beyond the " + std::to_string(max_name_bytes) +
           "-byte limit on a name");
  if (::lstat(path.c_str(), &status) != 0) {
    if (errno == ENOENT) return;  // a new file
    refuse("cannot stat: " + errno_text(errno));
  }
  if (S_ISDIR(status.st_mode)) refuse("is a directory");
  if (!check.force) {
    if (S_ISLNK(status.st_mode))
      refuse("is a symbolic link; writing would replace the link, not its target (--force replaces it)");
    if (!S_ISREG(status.st_mode))
      refuse("exists and is not a regular file (a device, FIFO or socket); writing would replace it (--force does)");
  }
  struct ::stat target;
  if (check.force || ::stat(path.c_str(), &target) != 0) return;
  for (const std::filesystem::path& input : check.inputs) {
    struct ::stat input_status;
    if (::stat(input.c_str(), &input_status) == 0 && input_status.st_dev == target.st_dev &&
        input_status.st_ino == target.st_ino)
      refuse("is the input " + printable(input.string()) + "; writing would overwrite it (--force does)");
  }
}

void check_distinct_outputs(const std::vector<std::pair<std::filesystem::path, std::string>>& outputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i)
    for (std::size_t j = i + 1; j < outputs.size(); ++j) {
      const auto& [a, a_option] = outputs[i];
      const auto& [b, b_option] = outputs[j];
      if (a.empty() || b.empty()) continue;
      struct ::stat sa, sb;
      const bool same_file = ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
                             sa.st_ino == sb.st_ino;
      if (same_file || std::filesystem::absolute(a).lexically_normal() == std::filesystem::absolute(b).lexically_normal())
        throw FileError(a_option + " " + printable(a.string()) + " and " + b_option + " " + printable(b.string()) +
                        " name the same file: one would replace the other");
    }
}

std::string temporary_name_for(const std::filesystem::path& target) {
  static thread_local std::mt19937_64 random(std::random_device{}() ^ static_cast<std::uint64_t>(::getpid()));
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, ".tmp.%ld.%08llx", static_cast<long>(::getpid()),
                static_cast<unsigned long long>(random() & 0xffffffffull));
  return target.string() + suffix;
}

bool is_temporary_name(std::string_view name, std::string* target) {
  // "<target>.tmp.<pid>.<8 hex>"
  const std::size_t at = name.rfind(".tmp.");
  if (at == std::string_view::npos || at == 0) return false;
  const std::string_view rest = name.substr(at + 5);
  const std::size_t dot = rest.find('.');
  if (dot == std::string_view::npos || dot == 0 || rest.size() - dot - 1 != 8) return false;
  const std::string_view pid = rest.substr(0, dot), hex = rest.substr(dot + 1);
  if (pid.find_first_not_of("0123456789") != std::string_view::npos ||
      hex.find_first_not_of("0123456789abcdef") != std::string_view::npos)
    return false;
  if (target) *target = std::string(name.substr(0, at));
  return true;
}

DirectoryLock::DirectoryLock(const std::filesystem::path& directory, const std::string& what)
    : fd_(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)) {
  if (fd_.get() < 0) throw FileError(what + " " + printable(directory.string()) + ": cannot open: " + errno_text(errno));
  if (::flock(fd_.get(), LOCK_EX | LOCK_NB) != 0) {
    const int error_number = errno;
    throw FileError(what + " " + printable(directory.string()) +
                    (error_number == EWOULDBLOCK ? ": another k3ref is writing there now (it holds the directory's "
                                                   "lock); wait for it, or write elsewhere"
                                                 : ": cannot lock: " + errno_text(error_number)));
  }
}

}  // namespace k3ref::io
