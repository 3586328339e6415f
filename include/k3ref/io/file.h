// Opening files that come from anywhere, checking paths before writing to them, and
// quoting untrusted text in one-line error messages.
//
// Reading: regular files only. A FIFO, a device or a directory is refused before a
// single byte is read (the open does not block: O_NONBLOCK, cleared once fstat has shown
// a regular file), and the size is known from fstat before anything is allocated.
//
// Writing: an output path is checked before any computing starts, so that a run which
// cannot write its result fails at once and a run which could destroy something else
// (the input, a device node, a FIFO, a symlink's target) does not start.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace k3ref::io {

// Longest excerpt of an untrusted value quoted in an error message, in bytes of input.
inline constexpr std::size_t max_excerpt_bytes = 60;

// `text` made safe for a one-line message on a terminal: C0 and C1 control characters,
// DEL and bytes that are not valid UTF-8 become \xNN (so no newline, no terminal escape
// sequence, no stray byte reaches the terminal). Nothing is cut.
std::string printable(std::string_view text);

// A quoted, printable excerpt of an untrusted value: at most `max_bytes` bytes of it,
// cut at a character boundary, followed by "... (N bytes)" when cut.
std::string excerpt(std::string_view text, std::size_t max_bytes = max_excerpt_bytes);

// Offset of the first byte of `text` that is not part of valid UTF-8 (RFC 3629: no
// overlong forms, no surrogates, nothing above U+10FFFF), or nullopt.
std::optional<std::size_t> first_invalid_utf8(std::string_view text);
inline bool is_valid_utf8(std::string_view text) { return !first_invalid_utf8(text); }

// An open file descriptor, closed on every path out of a scope.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor();
  int get() const { return fd_; }
  // Closes now and returns close()'s result (close can report a deferred write error).
  int close();

 private:
  int fd_ = -1;
};

// A regular file opened for reading, with its size at the time of opening.
struct RegularFile {
  FileDescriptor fd;
  std::uint64_t size = 0;
};

// Opens `path` for reading without blocking; FileError naming the file unless it is a
// regular file of at most `max_bytes` bytes.
RegularFile open_regular_file(const std::filesystem::path& path, std::uint64_t max_bytes);

// Reads exactly `count` bytes or throws FileError naming `file` and `what`.
void read_exactly(int fd, std::uint8_t* out, std::size_t count, const std::string& file, const std::string& what);

// The whole of a regular file of at most `max_bytes` bytes (see open_regular_file).
std::vector<std::uint8_t> read_regular_file(const std::filesystem::path& path, std::uint64_t max_bytes);

// What an output path may be.
struct OutputCheck {
  // Refuse an output that is one of these files (same device and inode).
  std::vector<std::filesystem::path> inputs;
  // --force: allow a symlink, a device, a FIFO or a socket at the path (it is replaced by
  // a regular file), an input (overwritten after it was read), a name that is not UTF-8.
  bool force = false;
  // How the path was given, for messages ("--out").
  std::string option = "--out";
};

// Throws FileError, one line naming the option, the path and the rule, unless `path` can
// be written as a regular file without destroying something it was not asked to: its
// directory exists; the path is not a directory; and, unless `force`, the name is valid
// UTF-8, nothing other than a regular file (or nothing) is at the path, and it is not one
// of the inputs.
void check_output_path(const std::filesystem::path& path, const OutputCheck& check);

// Names of a file system's directory entries have at most this many bytes (NAME_MAX), and a
// write's temporary (temporary_name_for) adds at most this many to the target's.
inline constexpr std::size_t max_name_bytes = 255;
inline constexpr std::size_t max_temporary_suffix_bytes = 5 + 10 + 1 + 8;  // ".tmp." pid "." 8 hex

// Throws FileError naming both options when two outputs of one command are the same file
// (the same path, or two names of one existing file). Empty paths are not outputs.
void check_distinct_outputs(const std::vector<std::pair<std::filesystem::path, std::string>>& outputs);

// "<target>.tmp.<pid>.<8 random hex>": the name a write creates (O_EXCL) and renames into
// place; is_temporary_name recognises one and gives its target's name.
std::string temporary_name_for(const std::filesystem::path& target);
bool is_temporary_name(std::string_view name, std::string* target = nullptr);

// An exclusive, non-blocking lock of a directory (flock on the directory itself, so no lock
// file is left behind), held for the object's life: two k3ref runs writing one directory
// cannot interleave; the second gets FileError naming `what` and the directory.
class DirectoryLock {
 public:
  DirectoryLock(const std::filesystem::path& directory, const std::string& what);

 private:
  FileDescriptor fd_;
};

}  // namespace k3ref::io
