#include "k3ref/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "k3ref/error.h"
#include "k3ref/io/file.h"

namespace k3ref::io {
namespace {

using nlohmann::json;

std::string one_line(std::string_view text) { return printable(text); }
std::string quote_name(std::string_view name) { return excerpt(name); }

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

// The header, validated while it is parsed: a SAX handler that knows the schema
//   { name: {"dtype": string, "shape": [int, ...], "data_offsets": [uint, uint]}, ...,
//     "__metadata__": {key: string, ...} }
// and stops at the first event that leaves it. Nothing outside the schema is ever
// built: no JSON document, no value nested deeper than the schema's three levels
// (max_header_depth), no value that an error message would have to serialise. Memory is
// the tensors' names and shapes; time is linear in the header (duplicate names through a
// hash set, the tiling check after one sort).
class HeaderParser final : public json::json_sax_t {
 public:
  HeaderParser(const std::string& file, std::uint64_t data_buffer_bytes)
      : file_(file), data_buffer_bytes_(data_buffer_bytes) {}

  // The error that stopped the parse (empty when none).
  const std::string& error() const { return error_; }
  HeaderContents take() { return std::move(contents_); }

  bool null() override { return scalar("null"); }
  bool boolean(bool value) override { return scalar(value ? "true" : "false"); }
  bool number_integer(number_integer_t value) override {
    if (where_ == Where::shape) return extent(value < 0, static_cast<std::uint64_t>(value), std::to_string(value));
    return scalar(std::to_string(value));
  }
  bool number_unsigned(number_unsigned_t value) override {
    if (where_ == Where::shape) return extent(false, value, std::to_string(value));
    if (where_ == Where::offsets) {
      if (offset_count_ == 2) return fail_tensor("data_offsets must be an array [begin, end], found more than 2 values");
      offsets_[offset_count_++] = value;
      return true;
    }
    return scalar(std::to_string(value));
  }
  bool number_float(number_float_t, const string_t& text) override { return scalar(text); }
  bool string(string_t& value) override {
    if (where_ == Where::entry_value && key_ == Key::dtype) {
      const std::optional<DType> dtype = dtype_from_name(value);
      if (!dtype) return fail_tensor("unknown dtype " + excerpt(value));
      dtype_ = *dtype;
      dtype_text_ = value;
      where_ = Where::entry;
      return true;
    }
    if (where_ == Where::metadata_value) {
      contents_.metadata.emplace(std::move(metadata_key_), std::move(value));
      where_ = Where::metadata;
      return true;
    }
    return mismatch("the string " + excerpt(value));
  }
  bool binary(binary_t&) override { return scalar("binary data"); }

  // Nesting is checked by the schema: an object or array where the schema has none is
  // rejected at its opening bracket, naming the tensor and field. deeper() only guards
  // the schema's own levels.
  bool start_object(std::size_t) override {
    switch (where_) {
      case Where::document: where_ = Where::top; return deeper();
      case Where::top_value:
        if (is_metadata_) {
          where_ = Where::metadata;
        } else {
          where_ = Where::entry;
          seen_dtype_ = seen_shape_ = seen_offsets_ = false;
          shape_.clear();
          offset_count_ = 0;
        }
        return deeper();
      default: return structured("an object");
    }
  }
  bool start_array(std::size_t) override {
    if (where_ == Where::entry_value && key_ == Key::shape) {
      where_ = Where::shape;
      return deeper();
    }
    if (where_ == Where::entry_value && key_ == Key::offsets) {
      where_ = Where::offsets;
      return deeper();
    }
    return structured("an array");
  }
  bool end_array() override {
    --depth_;
    if (where_ == Where::offsets && offset_count_ != 2)
      return fail_tensor("data_offsets must be an array [begin, end], found " + std::to_string(offset_count_) +
                         " value(s)");
    where_ = Where::entry;  // only shape and data_offsets arrays get this far
    return true;
  }
  bool end_object() override {
    --depth_;
    switch (where_) {
      case Where::metadata: where_ = Where::top; return true;
      case Where::entry: where_ = Where::top; return finish_entry();
      default: where_ = Where::done; return true;  // the top-level object
    }
  }

  bool key(string_t& key) override {
    switch (where_) {
      case Where::top:
        if (!names_.insert(key).second) {
          tensor_ = std::move(key);
          return fail_tensor("appears more than once in the header");
        }
        is_metadata_ = key == "__metadata__";
        if (!is_metadata_ && ++tensor_count_ > max_tensors)
          return fail("header declares more than " + std::to_string(max_tensors) + " tensors (the limit)");
        tensor_ = std::move(key);
        where_ = Where::top_value;
        return true;
      case Where::metadata:
        if (contents_.metadata.count(key))
          return fail("tensor '__metadata__': key " + excerpt(key) + " appears more than once");
        metadata_key_ = std::move(key);
        where_ = Where::metadata_value;
        return true;
      default: {  // Where::entry
        bool* seen = key == "dtype" ? &seen_dtype_ : key == "shape" ? &seen_shape_ : key == "data_offsets" ? &seen_offsets_ : nullptr;
        if (!seen) return fail_tensor("unexpected key " + excerpt(key) + " (only dtype, shape, data_offsets)");
        if (*seen) return fail_tensor("key " + excerpt(key) + " appears more than once");
        *seen = true;
        key_ = key == "dtype" ? Key::dtype : key == "shape" ? Key::shape : Key::offsets;
        where_ = Where::entry_value;
        return true;
      }
    }
  }

  bool parse_error(std::size_t, const std::string&, const json::exception& e) override {
    if (error_.empty()) error_ = "header is not valid JSON: " + excerpt(e.what(), 200);
    return false;
  }

 private:
  // Where the parser is in the schema; the next event must fit there.
  enum class Where { document, top, top_value, metadata, metadata_value, entry, entry_value, shape, offsets, done };
  enum class Key { dtype, shape, offsets };

  bool fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }
  bool fail_tensor(const std::string& detail) { return fail("tensor " + quote_name(tensor_) + ": " + detail); }

  bool deeper() {
    if (++depth_ > max_header_depth)
      return fail("header nests values deeper than the schema's " + std::to_string(max_header_depth) + " levels");
    return true;
  }

  // A value that is not where the schema allows it; `found` describes it briefly.
  bool mismatch(const std::string& found) {
    switch (where_) {
      case Where::document: return fail("header must be a JSON object, found " + found);
      case Where::top_value:
        if (is_metadata_) return fail("__metadata__ must be an object of strings, found " + found);
        return fail_tensor("entry must be a JSON object, found " + found);
      case Where::metadata_value:
        return fail("__metadata__ entry " + excerpt(metadata_key_) + " must be a string, found " + found);
      case Where::entry_value:
        if (key_ == Key::dtype) return fail_tensor("dtype must be a string, found " + found);
        if (key_ == Key::shape) return fail_tensor("shape must be an array, found " + found);
        return fail_tensor("data_offsets must be an array [begin, end], found " + found);
      case Where::shape: return fail_tensor("shape must hold integers, found " + found);
      case Where::offsets: return fail_tensor("data_offsets must hold non-negative integers, found " + found);
      default: return fail("unexpected " + found + " in the header");
    }
  }
  bool scalar(const std::string& text) { return mismatch(excerpt(text)); }
  bool structured(const char* kind) { return mismatch(kind); }

  bool extent(bool negative, std::uint64_t magnitude, const std::string& text) {
    if (negative) return fail_tensor("shape: negative extent " + text + " (extents must be >= 0)");
    if (magnitude > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      return fail_tensor("extent " + text + " in shape does not fit in 63 bits");
    if (shape_.size() == max_rank)
      return fail_tensor("shape has more than " + std::to_string(max_rank) + " dimensions (the rank limit)");
    shape_.push_back(static_cast<std::int64_t>(magnitude));
    return true;
  }

  // The entry is complete: check it as a whole, against the data buffer.
  bool finish_entry() {
    for (auto [seen, required] : {std::pair{seen_dtype_, "dtype"}, {seen_shape_, "shape"}, {seen_offsets_, "data_offsets"}})
      if (!seen) return fail_tensor(std::string("missing \"") + required + "\"");
    // Every product of extents must fit in 63 bits, zero or not: code that computes strides
    // or a product of some dimensions (B x H, say) from a zero-element shape must not
    // overflow either. So the product of the non-zero extents is checked.
    std::int64_t nonzero_product = 1;
    bool has_zero = false;
    for (std::int64_t e : shape_) {
      if (e == 0) {
        has_zero = true;
        continue;
      }
      if (__builtin_mul_overflow(nonzero_product, e, &nonzero_product))
        return fail_tensor("element count of shape " + shape_to_string(shape_) +
                           " overflows 63 bits (so does the product of its non-zero extents)");
    }
    const std::uint64_t numel = has_zero ? 0 : static_cast<std::uint64_t>(nonzero_product);
    const std::uint64_t begin = offsets_[0], end = offsets_[1];
    if (begin > end)
      return fail_tensor("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] run backwards");
    const std::uint64_t element_bytes = dtype_size(dtype_);
    const std::uint64_t span_bytes = end - begin;
    std::uint64_t needed_bytes;
    if (__builtin_mul_overflow(numel, element_bytes, &needed_bytes) || needed_bytes != span_bytes)
      return fail_tensor("shape " + shape_to_string(shape_) + " of " + dtype_text_ + " needs " + std::to_string(numel) +
                         " x " + std::to_string(element_bytes) + " bytes but data_offsets [" + std::to_string(begin) +
                         ", " + std::to_string(end) + "] span " + std::to_string(span_bytes));
    if (end > data_buffer_bytes_)
      return fail_tensor("data_offsets end " + std::to_string(end) + " lies beyond the data buffer of " +
                         std::to_string(data_buffer_bytes_) + " bytes");
    contents_.tensors.push_back(TensorLayout{std::move(tensor_), dtype_, std::move(shape_), begin, end});
    shape_ = {};
    return true;
  }

  const std::string& file_;
  const std::uint64_t data_buffer_bytes_;
  std::string error_;
  HeaderContents contents_;
  Where where_ = Where::document;
  int depth_ = 0;
  std::unordered_set<std::string> names_;
  std::size_t tensor_count_ = 0;
  bool is_metadata_ = false;
  std::string tensor_, metadata_key_;
  // The entry being parsed.
  Key key_ = Key::dtype;
  bool seen_dtype_ = false, seen_shape_ = false, seen_offsets_ = false;
  DType dtype_ = DType::F64;
  std::string dtype_text_;
  Shape shape_;
  std::uint64_t offsets_[2] = {0, 0};
  std::size_t offset_count_ = 0;
};

// Validates the header text against a data buffer of `data_buffer_bytes` bytes.
HeaderContents parse_header(std::span<const std::uint8_t> header_bytes, std::uint64_t data_buffer_bytes,
                            const std::string& file) {
  const std::string_view text(reinterpret_cast<const char*>(header_bytes.data()), header_bytes.size());
  if (const auto bad = first_invalid_utf8(text))
    throw_file_error(file, "header is not valid UTF-8 (byte " + std::to_string(*bad) + " of the header)");
  // JSON holds no raw NUL anywhere, and nlohmann's lexer takes one for the end of the
  // input, which would accept a header whose bytes after the NUL are garbage.
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw_file_error(file, "header holds a NUL byte at byte " + std::to_string(nul) +
                               " of the header (JSON allows none; pad with spaces)");
  // nlohmann skips a leading byte-order mark; the reference reader (serde_json) does not,
  // so accepting one would admit files that Python cannot load.
  if (text.starts_with("\xef\xbb\xbf"))
    throw_file_error(file, "header starts with a UTF-8 byte-order mark, which the reference reader rejects");

  HeaderParser parser(file, data_buffer_bytes);
  const bool parsed = json::sax_parse(text.begin(), text.end(), &parser);
  if (!parsed || !parser.error().empty()) {
    if (parser.error().empty()) throw_file_error(file, "header is not valid JSON");
    throw_file_error(file, parser.error());
  }
  HeaderContents contents = parser.take();

  // One sort, then one pass: the tensors must tile the data buffer. Zero-byte tensors
  // sharing an offset are ordered by name, as the reference writer's sorted keys give them.
  std::sort(contents.tensors.begin(), contents.tensors.end(), [](const TensorLayout& a, const TensorLayout& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
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

std::string errno_text(int error_number) { return std::strerror(error_number); }

void write_all_atomic(const std::filesystem::path& path, std::span<const std::uint8_t> bytes, const char* caller) {
  const std::string target = path.string();
  std::string temporary = temporary_name_for(path);
  const auto fail = [&](const std::string& step, int error_number, bool remove_temporary) {
    if (remove_temporary) ::unlink(temporary.c_str());
    throw FileError(std::string(caller) + ": cannot write " + one_line(target) + ": " + step + ": " +
                    errno_text(error_number));
  };

  // A fresh name, created exclusively: never a file, link or FIFO someone placed at the name.
  FileDescriptor fd;
  for (int attempt = 0; attempt < 16; ++attempt) {
    fd = FileDescriptor(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666));
    if (fd.get() >= 0 || errno != EEXIST) break;
    temporary = temporary_name_for(path);
  }
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
  // Regular files only, opened without blocking: a FIFO or a device is refused at once.
  RegularFile opened = open_regular_file(path, std::numeric_limits<std::uint64_t>::max());
  const int fd = opened.fd.get();
  const std::uint64_t file_bytes = opened.size;
  if (file_bytes < 8)
    throw_file_error(file_name, "file has " + std::to_string(file_bytes) + " bytes, too short for the 8-byte header length");

  std::uint8_t prefix[8];
  read_exactly(fd, prefix, 8, file_name, "the header length");
  const std::uint64_t header_length = checked_header_length(prefix, file_bytes, file_name);
  std::vector<std::uint8_t> header_bytes(header_length);  // <= max_header_bytes and <= file size
  read_exactly(fd, header_bytes.data(), header_bytes.size(), file_name, "the header");
  HeaderContents header = parse_header(header_bytes, file_bytes - 8 - header_length, file_name);
  header_bytes = {};

  // The tensors tile the data buffer in this order, so one sequential pass reads them all;
  // their sizes add up to the data buffer, which fstat measured.
  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  file.tensors.reserve(header.tensors.size());
  for (TensorLayout& layout : header.tensors) {
    RawTensor tensor{layout.dtype, std::move(layout.shape), std::vector<std::uint8_t>(layout.end - layout.begin)};
    read_exactly(fd, tensor.bytes.data(), tensor.bytes.size(), file_name, "tensor " + quote_name(layout.name));
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

}  // namespace k3ref::io
