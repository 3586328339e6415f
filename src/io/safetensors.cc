#include "k3ref/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "k3ref/error.h"
#include "k3ref/num/float_format.h"

namespace k3ref::io {
namespace {

using nlohmann::json;

// Quoted for a one-line message: control characters (a newline in a tensor name, a raw
// byte echoed by the JSON parser) are escaped so an error is always one line.
std::string one_line(std::string_view text) {
  static constexpr char hex_digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += hex_digits[c >> 4];
      out += hex_digits[c & 0xf];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string quote_name(std::string_view name) { return "'" + one_line(name) + "'"; }

[[noreturn]] void throw_file_error(const std::string& file, const std::string& detail) {
  throw FileError(one_line(file) + ": " + detail);
}
[[noreturn]] void throw_tensor_error(const std::string& file, std::string_view tensor, const std::string& detail) {
  throw FileError(one_line(file) + ": tensor " + quote_name(tensor) + ": " + detail);
}

std::uint64_t read_u64_le(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

void append_u64_le(std::vector<std::uint8_t>& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

// RFC 3629 UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF. Returns the
// offset of the first bad byte. nlohmann's lexer also rejects bad UTF-8, but only inside
// strings it reaches; checking up front gives one clear message for every case.
std::optional<std::size_t> first_invalid_utf8(std::span<const std::uint8_t> text) {
  std::size_t i = 0;
  while (i < text.size()) {
    const std::uint8_t lead = text[i];
    std::size_t continuation_count;
    std::uint8_t second_min = 0x80, second_max = 0xbf;
    if (lead < 0x80) {
      ++i;
      continue;
    } else if (lead >= 0xc2 && lead <= 0xdf) {
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
      return i;
    }
    if (i + continuation_count >= text.size()) return i;  // truncated sequence
    if (text[i + 1] < second_min || text[i + 1] > second_max) return i;
    for (std::size_t k = 2; k <= continuation_count; ++k)
      if (text[i + k] < 0x80 || text[i + k] > 0xbf) return i;
    i += continuation_count + 1;
  }
  return std::nullopt;
}

// nlohmann's parser keeps the last of duplicate keys without a word; this callback sees
// every key and records the first duplicate, at any depth, with the tensor it is in.
class DuplicateKeyFinder {
 public:
  bool operator()(int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        keys_of_open_objects_.emplace_back();
        break;
      case json::parse_event_t::object_end:
        keys_of_open_objects_.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (keys_of_open_objects_.size() == 1) current_top_level_key_ = key;
        if (!keys_of_open_objects_.back().insert(key).second && !duplicate_) {
          duplicate_ = Duplicate{key, keys_of_open_objects_.size() == 1 ? key : current_top_level_key_,
                                 keys_of_open_objects_.size() == 1};
        }
        break;
      }
      default:
        break;
    }
    return true;
  }

  struct Duplicate {
    std::string key;
    std::string top_level_key;  // the tensor (or "__metadata__") the key belongs to
    bool at_top_level;
  };
  const std::optional<Duplicate>& duplicate() const { return duplicate_; }

 private:
  std::vector<std::set<std::string>> keys_of_open_objects_;
  std::string current_top_level_key_;
  std::optional<Duplicate> duplicate_;
};

// Where one tensor lives, as the header declares it (offsets into the data buffer).
struct TensorLayout {
  std::string name;
  DType dtype;
  Shape shape;
  std::uint64_t begin;
  std::uint64_t end;
};

struct HeaderContents {
  std::map<std::string, std::string> metadata;
  std::vector<TensorLayout> tensors;  // by (begin, end), tiling [0, data buffer size)
};

std::uint64_t unsigned_offset(const json& value, const std::string& file, const std::string& tensor) {
  if (!value.is_number_unsigned())
    throw_tensor_error(file, tensor, "data_offsets must hold non-negative integers, found " + one_line(value.dump()));
  return value.get<std::uint64_t>();
}

TensorLayout parse_tensor_entry(const std::string& file, const std::string& name, const json& entry,
                                std::uint64_t data_buffer_bytes) {
  if (!entry.is_object()) throw_tensor_error(file, name, "entry must be a JSON object, found " + std::string(entry.type_name()));
  for (const auto& [key, value] : entry.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      throw_tensor_error(file, name, "unexpected key " + quote_name(key) + " (only dtype, shape, data_offsets)");
  for (const char* required : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(required)) throw_tensor_error(file, name, std::string("missing \"") + required + "\"");

  const json& dtype_value = entry["dtype"];
  if (!dtype_value.is_string()) throw_tensor_error(file, name, "dtype must be a string, found " + one_line(dtype_value.dump()));
  const std::string& dtype_text = dtype_value.get_ref<const std::string&>();
  const std::optional<DType> dtype = dtype_from_name(dtype_text);
  if (!dtype) throw_tensor_error(file, name, "unknown dtype " + quote_name(dtype_text));

  const json& shape_value = entry["shape"];
  if (!shape_value.is_array()) throw_tensor_error(file, name, "shape must be an array, found " + one_line(shape_value.dump()));
  Shape shape;
  shape.reserve(shape_value.size());  // bounded by the header, already in memory
  for (const json& extent : shape_value) {
    if (extent.is_number_unsigned()) {
      const std::uint64_t e = extent.get<std::uint64_t>();
      if (e > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        throw_tensor_error(file, name, "extent " + std::to_string(e) + " in shape does not fit in 63 bits");
      shape.push_back(static_cast<std::int64_t>(e));
    } else if (extent.is_number_integer()) {
      shape.push_back(extent.get<std::int64_t>());  // negative: checked_numel reports it
    } else {
      throw_tensor_error(file, name, "shape must hold integers, found " + one_line(shape_value.dump()));
    }
  }
  std::int64_t numel;
  try {
    numel = checked_numel(shape, "shape");
  } catch (const InvalidArgument& e) {
    throw_tensor_error(file, name, e.what());
  }

  const json& offsets_value = entry["data_offsets"];
  if (!offsets_value.is_array() || offsets_value.size() != 2)
    throw_tensor_error(file, name, "data_offsets must be an array [begin, end], found " + one_line(offsets_value.dump()));
  const std::uint64_t begin = unsigned_offset(offsets_value[0], file, name);
  const std::uint64_t end = unsigned_offset(offsets_value[1], file, name);
  if (begin > end)
    throw_tensor_error(file, name, "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] run backwards");

  // numel <= 2^63 - 1 and element size <= 8, so compare by division to stay in 64 bits.
  const std::uint64_t element_bytes = dtype_size(*dtype);
  const std::uint64_t span_bytes = end - begin;
  if (span_bytes % element_bytes != 0 || span_bytes / element_bytes != static_cast<std::uint64_t>(numel))
    throw_tensor_error(file, name,
                       "shape " + shape_to_string(shape) + " of " + dtype_text + " needs " + std::to_string(numel) +
                           " x " + std::to_string(element_bytes) + " bytes but data_offsets [" + std::to_string(begin) +
                           ", " + std::to_string(end) + "] span " + std::to_string(span_bytes));
  if (end > data_buffer_bytes)
    throw_tensor_error(file, name,
                       "data_offsets end " + std::to_string(end) + " lies beyond the data buffer of " +
                           std::to_string(data_buffer_bytes) + " bytes");
  return TensorLayout{name, *dtype, std::move(shape), begin, end};
}

// Validates the header text against a data buffer of `data_buffer_bytes` bytes.
HeaderContents parse_header(std::span<const std::uint8_t> header_bytes, std::uint64_t data_buffer_bytes,
                            const std::string& file) {
  if (const auto bad = first_invalid_utf8(header_bytes))
    throw_file_error(file, "header is not valid UTF-8 (byte " + std::to_string(*bad) + " of the header)");

  // nlohmann skips a leading byte-order mark; the reference reader (serde_json) does not,
  // so accepting one would admit files that Python cannot load.
  if (header_bytes.size() >= 3 && header_bytes[0] == 0xef && header_bytes[1] == 0xbb && header_bytes[2] == 0xbf)
    throw_file_error(file, "header starts with a UTF-8 byte-order mark, which the reference reader rejects");

  DuplicateKeyFinder duplicate_finder;
  json header;
  try {
    header = json::parse(header_bytes.begin(), header_bytes.end(), std::ref(duplicate_finder));
  } catch (const json::exception& e) {
    throw_file_error(file, std::string("header is not valid JSON: ") + one_line(e.what()));
  }
  if (!header.is_object()) throw_file_error(file, std::string("header must be a JSON object, found ") + header.type_name());
  if (const auto& duplicate = duplicate_finder.duplicate()) {
    if (duplicate->at_top_level) throw_tensor_error(file, duplicate->key, "appears more than once in the header");
    throw_tensor_error(file, duplicate->top_level_key, "key " + quote_name(duplicate->key) + " appears more than once");
  }

  HeaderContents contents;
  contents.tensors.reserve(header.size());
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object())
        throw_file_error(file, std::string("__metadata__ must be an object of strings, found ") + entry.type_name());
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string())
          throw_file_error(file, "__metadata__ entry " + quote_name(key) + " must be a string, found " + one_line(value.dump()));
        contents.metadata.emplace(key, value.get<std::string>());
      }
      continue;
    }
    contents.tensors.push_back(parse_tensor_entry(file, name, entry, data_buffer_bytes));
  }

  // Stable: tensors of zero bytes sharing an offset keep the header's (sorted) key order.
  std::stable_sort(contents.tensors.begin(), contents.tensors.end(), [](const TensorLayout& a, const TensorLayout& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  std::uint64_t covered_up_to = 0;
  const TensorLayout* previous = nullptr;
  for (const TensorLayout& tensor : contents.tensors) {
    if (tensor.begin > covered_up_to)
      throw_tensor_error(file, tensor.name,
                         "starts at byte " + std::to_string(tensor.begin) + " of the data buffer, leaving a gap after byte " +
                             std::to_string(covered_up_to) +
                             (previous ? " where tensor " + quote_name(previous->name) + " ends" : std::string()));
    if (tensor.begin < covered_up_to)
      throw_tensor_error(file, tensor.name,
                         "data_offsets [" + std::to_string(tensor.begin) + ", " + std::to_string(tensor.end) +
                             "] overlap tensor " + quote_name(previous->name) + " ending at byte " +
                             std::to_string(covered_up_to));
    covered_up_to = tensor.end;
    previous = &tensor;
  }
  if (covered_up_to != data_buffer_bytes)
    throw_file_error(file, "data buffer has " + std::to_string(data_buffer_bytes) + " bytes but the tensors cover only " +
                               std::to_string(covered_up_to) +
                               (previous ? " (last tensor " + quote_name(previous->name) + ")" : std::string(" (no tensors)")));
  return contents;
}

// Header length from the first 8 bytes of a file of `file_bytes` bytes, checked.
std::uint64_t checked_header_length(const std::uint8_t* prefix, std::uint64_t file_bytes, const std::string& file) {
  const std::uint64_t header_length = read_u64_le(prefix);
  if (header_length > max_header_bytes)
    throw_file_error(file, "header length " + std::to_string(header_length) + " exceeds the limit of " +
                               std::to_string(max_header_bytes) + " bytes");
  if (header_length > file_bytes - 8)
    throw_file_error(file, "header length " + std::to_string(header_length) + " exceeds the " +
                               std::to_string(file_bytes - 8) + " bytes after the length prefix");
  return header_length;
}

// Closes a file descriptor on every path out of a scope.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now, reporting the error (close can report a deferred write error).
  int close() {
    const int result = ::close(fd_);
    fd_ = -1;
    return result;
  }

 private:
  int fd_;
};

std::string errno_text(int error_number) { return std::strerror(error_number); }

// Reads exactly `count` bytes or throws FileError naming the file.
void read_exactly(int fd, std::uint8_t* out, std::size_t count, const std::string& file, const char* what) {
  while (count > 0) {
    const ::ssize_t got = ::read(fd, out, count);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw_file_error(file, std::string("cannot read ") + what + ": " + errno_text(errno));
    }
    if (got == 0) throw_file_error(file, std::string("file ended while reading ") + what + " (was it truncated?)");
    out += got;
    count -= static_cast<std::size_t>(got);
  }
}

std::optional<num::Format> float_format_of(DType dtype) {
  switch (dtype) {
    case DType::F64: return num::Format::fp64;
    case DType::F32: return num::Format::fp32;
    case DType::F16: return num::Format::fp16;
    case DType::BF16: return num::Format::bf16;
    case DType::F8_E4M3: return num::Format::fp8_e4m3;
    case DType::F8_E5M2: return num::Format::fp8_e5m2;
    default: return std::nullopt;
  }
}

std::uint64_t load_element_le(const std::uint8_t* p, std::size_t element_bytes) {
  std::uint64_t v = 0;
  for (std::size_t i = element_bytes; i-- > 0;) v = v << 8 | p[i];
  return v;
}

void store_element_le(std::uint8_t* p, std::size_t element_bytes, std::uint64_t v) {
  for (std::size_t i = 0; i < element_bytes; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

// Checks a RawTensor's byte count against its shape; returns the element count.
std::size_t checked_element_count(const RawTensor& raw, const std::string& what) {
  const std::int64_t numel = checked_numel(raw.shape, what);
  const std::size_t element_bytes = dtype_size(raw.dtype);
  if (raw.bytes.size() % element_bytes != 0 || raw.bytes.size() / element_bytes != static_cast<std::uint64_t>(numel))
    throw InvalidArgument(what + ": " + std::to_string(raw.bytes.size()) + " bytes do not hold shape " +
                          shape_to_string(raw.shape) + " of " + std::string(dtype_name(raw.dtype)));
  return static_cast<std::size_t>(numel);
}

// Integer element `i` of an integer or BOOL tensor, sign-extended.
std::int64_t load_integer(const RawTensor& raw, std::size_t i, const std::string& what) {
  const std::uint8_t* p = raw.bytes.data() + i * dtype_size(raw.dtype);
  switch (raw.dtype) {
    case DType::I64: return static_cast<std::int64_t>(load_element_le(p, 8));
    case DType::I32: return static_cast<std::int32_t>(static_cast<std::uint32_t>(load_element_le(p, 4)));
    case DType::U8: return *p;
    case DType::BOOL:
      if (*p > 1) throw InvalidArgument(what + ": BOOL element " + std::to_string(i) + " has byte " + std::to_string(*p) + ", not 0 or 1");
      return *p;
    default: throw InvalidArgument(what + ": " + std::string(dtype_name(raw.dtype)) + " is not an integer dtype");
  }
}

// Range of values an integer or BOOL dtype holds.
std::pair<std::int64_t, std::int64_t> integer_range(DType dtype) {
  switch (dtype) {
    case DType::I64: return {std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max()};
    case DType::I32: return {std::numeric_limits<std::int32_t>::min(), std::numeric_limits<std::int32_t>::max()};
    case DType::U8: return {0, 255};
    default: return {0, 1};  // BOOL
  }
}

// 2^63 as a double: the first double above the int64 range.
constexpr double two_to_63 = 9223372036854775808.0;

// The int64 a double holds exactly, or nullopt (fractional, NaN, infinite, out of range).
std::optional<std::int64_t> exact_int64(double x) {
  if (!(x >= -two_to_63 && x < two_to_63) || std::trunc(x) != x) return std::nullopt;
  return static_cast<std::int64_t>(x);
}

std::string format_double(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", x);
  return text;
}

void write_all_atomic(const std::filesystem::path& path, std::span<const std::uint8_t> bytes, const char* caller) {
  const std::string target = path.string();
  const std::string temporary = target + ".tmp." + std::to_string(::getpid());
  const auto fail = [&](const std::string& step, int error_number, bool remove_temporary) {
    if (remove_temporary) ::unlink(temporary.c_str());
    throw FileError(std::string(caller) + ": cannot write " + one_line(target) + ": " + step + ": " +
                    errno_text(error_number));
  };

  FileDescriptor fd(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0666));
  if (fd.get() < 0) fail("cannot create temporary file " + one_line(temporary), errno, false);
  std::size_t written = 0;
  while (written < bytes.size()) {
    const ::ssize_t n = ::write(fd.get(), bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error_number = errno;
      fd.close();
      fail("writing " + one_line(temporary), error_number, true);
    }
    written += static_cast<std::size_t>(n);
  }
  if (::fsync(fd.get()) != 0) {
    const int error_number = errno;
    fd.close();
    fail("fsync of " + one_line(temporary), error_number, true);
  }
  if (fd.close() != 0) fail("closing " + one_line(temporary), errno, true);
  if (::rename(temporary.c_str(), target.c_str()) != 0) fail("renaming " + one_line(temporary) + " into place", errno, true);

  // Make the rename itself durable. Best effort: the new file is already in place, so a
  // failure here is not reported as a failed write.
  const std::filesystem::path directory = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  const int directory_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (directory_fd >= 0) {
    ::fsync(directory_fd);
    ::close(directory_fd);
  }
}

}  // namespace

const RawTensor* SafetensorsFile::find(std::string_view name) const {
  for (const auto& [tensor_name, tensor] : tensors)
    if (tensor_name == name) return &tensor;
  return nullptr;
}

const RawTensor& SafetensorsFile::at(std::string_view name, const std::string& file_for_errors) const {
  if (const RawTensor* tensor = find(name)) return *tensor;
  throw_tensor_error(file_for_errors, name, "not found in the file");
}

SafetensorsFile parse_safetensors(std::span<const std::uint8_t> bytes, const std::string& name_for_errors) {
  if (bytes.size() < 8)
    throw_file_error(name_for_errors, "file has " + std::to_string(bytes.size()) +
                                          " bytes, too short for the 8-byte header length");
  const std::uint64_t header_length = checked_header_length(bytes.data(), bytes.size(), name_for_errors);
  const std::span<const std::uint8_t> data_buffer = bytes.subspan(8 + header_length);
  HeaderContents header = parse_header(bytes.subspan(8, header_length), data_buffer.size(), name_for_errors);

  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  file.tensors.reserve(header.tensors.size());
  for (TensorLayout& layout : header.tensors) {
    const auto tensor_bytes = data_buffer.subspan(layout.begin, layout.end - layout.begin);
    file.tensors.emplace_back(std::move(layout.name), RawTensor{layout.dtype, std::move(layout.shape),
                                                                {tensor_bytes.begin(), tensor_bytes.end()}});
  }
  return file;
}

SafetensorsFile read_safetensors(const std::filesystem::path& path) {
  const std::string file_name = path.string();
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw_file_error(file_name, "cannot open: " + errno_text(errno));
  struct ::stat status;
  if (::fstat(fd.get(), &status) != 0) throw_file_error(file_name, "cannot stat: " + errno_text(errno));
  if (!S_ISREG(status.st_mode)) throw_file_error(file_name, "not a regular file");
  const std::uint64_t file_bytes = static_cast<std::uint64_t>(status.st_size);
  if (file_bytes < 8)
    throw_file_error(file_name, "file has " + std::to_string(file_bytes) + " bytes, too short for the 8-byte header length");

  std::uint8_t prefix[8];
  read_exactly(fd.get(), prefix, 8, file_name, "the header length");
  const std::uint64_t header_length = checked_header_length(prefix, file_bytes, file_name);
  std::vector<std::uint8_t> header_bytes(header_length);  // <= max_header_bytes and <= file size
  read_exactly(fd.get(), header_bytes.data(), header_bytes.size(), file_name, "the header");
  HeaderContents header = parse_header(header_bytes, file_bytes - 8 - header_length, file_name);
  header_bytes = {};

  // The tensors tile the data buffer in this order, so one sequential pass reads them all.
  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  file.tensors.reserve(header.tensors.size());
  for (TensorLayout& layout : header.tensors) {
    RawTensor tensor{layout.dtype, std::move(layout.shape), std::vector<std::uint8_t>(layout.end - layout.begin)};
    read_exactly(fd.get(), tensor.bytes.data(), tensor.bytes.size(), file_name, ("tensor " + quote_name(layout.name)).c_str());
    file.tensors.emplace_back(std::move(layout.name), std::move(tensor));
  }
  return file;
}

std::vector<std::uint8_t> serialize_safetensors(const SafetensorsFile& file) {
  json header = json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  std::uint64_t data_bytes = 0;
  for (const auto& [name, tensor] : file.tensors) {
    const std::string what = "serialize_safetensors: tensor " + quote_name(name);
    if (name == "__metadata__") throw InvalidArgument(what + ": the name is reserved for metadata");
    if (header.contains(name)) throw InvalidArgument(what + ": name appears more than once");
    checked_element_count(tensor, what);
    header[name] = {{"dtype", std::string(dtype_name(tensor.dtype))},
                    {"shape", tensor.shape},
                    {"data_offsets", {data_bytes, data_bytes + tensor.bytes.size()}}};
    data_bytes += tensor.bytes.size();
  }

  std::string header_text;
  try {
    header_text = header.dump();  // compact; std::map key order, so deterministic
  } catch (const json::type_error& e) {
    throw InvalidArgument(std::string("serialize_safetensors: a tensor name or metadata string is not valid UTF-8: ") +
                          one_line(e.what()));
  }
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  std::vector<std::uint8_t> out;
  out.reserve(8 + header_text.size() + data_bytes);
  append_u64_le(out, header_text.size());
  out.insert(out.end(), header_text.begin(), header_text.end());
  for (const auto& [name, tensor] : file.tensors) out.insert(out.end(), tensor.bytes.begin(), tensor.bytes.end());
  return out;
}

void write_file_atomic(const std::filesystem::path& path, std::span<const std::uint8_t> bytes) {
  write_all_atomic(path, bytes, "write_file_atomic");
}

void write_safetensors_atomic(const std::filesystem::path& path, const SafetensorsFile& file) {
  std::vector<std::uint8_t> bytes;
  try {
    bytes = serialize_safetensors(file);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument("write_safetensors_atomic(" + one_line(path.string()) + "): " + e.what());
  }
  write_all_atomic(path, bytes, "write_safetensors_atomic");
}

Tensor<double> to_f64(const RawTensor& raw, const std::string& what) {
  const std::size_t count = checked_element_count(raw, what);
  std::vector<double> values(count);
  if (const auto format = float_format_of(raw.dtype)) {
    const std::size_t element_bytes = dtype_size(raw.dtype);
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t bits = load_element_le(raw.bytes.data() + i * element_bytes, element_bytes);
      values[i] = raw.dtype == DType::F64 ? std::bit_cast<double>(bits) : num::decode(*format, bits);
    }
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      const std::int64_t v = load_integer(raw, i, what);
      const double x = static_cast<double>(v);
      if (exact_int64(x) != v)
        throw InvalidArgument(what + ": " + std::string(dtype_name(raw.dtype)) + " element " + std::to_string(i) +
                              " = " + std::to_string(v) + " is not exactly representable as a double");
      values[i] = x;
    }
  }
  return Tensor<double>(raw.shape, std::move(values));
}

RawTensor from_f64(const Tensor<double>& values, DType dtype) {
  const std::size_t element_bytes = dtype_size(dtype);
  RawTensor raw{dtype, values.shape(), std::vector<std::uint8_t>(values.values().size() * element_bytes)};
  const auto format = float_format_of(dtype);
  for (std::size_t i = 0; i < values.values().size(); ++i) {
    const double x = values.values()[i];
    std::uint64_t bits;
    if (format) {
      bits = dtype == DType::F64 ? std::bit_cast<std::uint64_t>(x) : num::encode(*format, x);
    } else {
      const auto [lowest, highest] = integer_range(dtype);
      const std::optional<std::int64_t> integer = exact_int64(x);
      if (!integer || *integer < lowest || *integer > highest)
        throw InvalidArgument("from_f64: element " + std::to_string(i) + " = " + format_double(x) +
                              " is not an integer in [" + std::to_string(lowest) + ", " + std::to_string(highest) +
                              "], cannot store it as " + std::string(dtype_name(dtype)));
      bits = static_cast<std::uint64_t>(*integer);
    }
    store_element_le(raw.bytes.data() + i * element_bytes, element_bytes, bits);
  }
  return raw;
}

Tensor<std::int64_t> to_i64(const RawTensor& raw, const std::string& what) {
  const std::size_t count = checked_element_count(raw, what);
  std::vector<std::int64_t> values(count);
  if (is_floating(raw.dtype)) {
    const Tensor<double> doubles = to_f64(raw, what);
    for (std::size_t i = 0; i < count; ++i) {
      const double x = doubles.values()[i];
      const std::optional<std::int64_t> integer = exact_int64(x);
      if (!integer)
        throw InvalidArgument(what + ": " + std::string(dtype_name(raw.dtype)) + " element " + std::to_string(i) +
                              " = " + format_double(x) + " is not an integer in the int64 range");
      values[i] = *integer;
    }
  } else {
    for (std::size_t i = 0; i < count; ++i) values[i] = load_integer(raw, i, what);
  }
  return Tensor<std::int64_t>(raw.shape, std::move(values));
}

RawTensor from_i64(const Tensor<std::int64_t>& values, DType dtype) {
  if (is_floating(dtype)) {
    // Through double: exact only when the value is a double, otherwise two roundings.
    std::vector<double> doubles(values.values().size());
    for (std::size_t i = 0; i < doubles.size(); ++i) {
      const std::int64_t v = values.values()[i];
      doubles[i] = static_cast<double>(v);
      if (exact_int64(doubles[i]) != v)
        throw InvalidArgument("from_i64: element " + std::to_string(i) + " = " + std::to_string(v) +
                              " is not exactly a double, cannot round it once to " + std::string(dtype_name(dtype)));
    }
    return from_f64(Tensor<double>(values.shape(), std::move(doubles)), dtype);
  }
  const std::size_t element_bytes = dtype_size(dtype);
  RawTensor raw{dtype, values.shape(), std::vector<std::uint8_t>(values.values().size() * element_bytes)};
  const auto [lowest, highest] = integer_range(dtype);
  for (std::size_t i = 0; i < values.values().size(); ++i) {
    const std::int64_t v = values.values()[i];
    if (v < lowest || v > highest)
      throw InvalidArgument("from_i64: element " + std::to_string(i) + " = " + std::to_string(v) + " is outside [" +
                            std::to_string(lowest) + ", " + std::to_string(highest) + "], cannot store it as " +
                            std::string(dtype_name(dtype)));
    store_element_le(raw.bytes.data() + i * element_bytes, element_bytes, static_cast<std::uint64_t>(v));
  }
  return raw;
}

}  // namespace k3ref::io
