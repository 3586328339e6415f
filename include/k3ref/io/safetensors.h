// Reading and writing the safetensors format (https://github.com/huggingface/safetensors):
//
//   [8 bytes]  N, little-endian u64: length of the header
//   [N bytes]  JSON object, UTF-8: for every tensor
//                "name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}
//              offsets relative to the start of the data buffer, plus optionally
//                "__metadata__": {"key": "value", ...}   (strings only)
//   [rest]     the data buffer: every tensor's little-endian element bytes
//
// The reader trusts nothing in the file: every inconsistency is a FileError naming the
// file and, where one is involved, the tensor, quoting at most a short printable excerpt
// of any value. It is linear in the file and allocates nothing that the bytes actually
// present do not account for (limits below; docs/robustness.md). Like the reference implementation it
// requires the tensors, sorted by offset, to tile the data buffer exactly (no gaps, no
// overlaps, nothing left over). The writer is deterministic: the same SafetensorsFile
// always gives the same bytes, which the manifests' SHA-256 digests rely on.
//
// This is the container only: a RawTensor's bytes go in and out as they are. Decoding and
// encoding its elements is k3ref/tensor/convert.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "k3ref/tensor/convert.h"

namespace k3ref::io {

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;             // "__metadata__"; omitted from the file when empty
  std::vector<std::pair<std::string, RawTensor>> tensors;  // file order: by data offset

  // The tensor called `name`, or nullptr.
  const RawTensor* find(std::string_view name) const;
  // The tensor called `name`; FileError naming `file_for_errors` and the tensor if absent.
  const RawTensor& at(std::string_view name, const std::string& file_for_errors) const;

  friend bool operator==(const SafetensorsFile&, const SafetensorsFile&) = default;
};

// Largest header accepted, as in the reference implementation: a bound on what a
// hostile length prefix can make the reader allocate.
inline constexpr std::uint64_t max_header_bytes = 100'000'000;
// Most tensors one file may declare. Checkpoint shards hold thousands; the bound keeps a
// hostile header of tiny entries from costing more than about 100 MB of names and shapes.
inline constexpr std::size_t max_tensors = 131'072;
// Most dimensions one tensor may have (the operators use at most 5).
inline constexpr std::size_t max_rank = 64;
// Deepest nesting of the header's schema: top object, tensor entry, shape array. Anything
// deeper is rejected at its opening bracket, while parsing.
inline constexpr int max_header_depth = 3;

// Reads and validates a whole file. Tensor bytes are read straight into their RawTensor,
// so memory is the file size once, not twice.
SafetensorsFile read_safetensors(const std::filesystem::path& path);

// Validates and decodes an in-memory file; `name_for_errors` is the file name used in
// error messages. Tensors come back ordered by data offset (tensors of zero bytes that
// share an offset: by name, as the header's key order gives them).
SafetensorsFile parse_safetensors(std::span<const std::uint8_t> bytes, const std::string& name_for_errors);

// The file's bytes: tensors laid out contiguously in the order given, header JSON with
// sorted keys and no whitespace, padded with spaces to a multiple of 8 bytes (as the
// reference writer does, so the data buffer starts 8-byte aligned). Throws
// InvalidArgument on duplicate names, a tensor named "__metadata__", a byte count that
// does not match shape x dtype, or names or metadata that are not valid UTF-8.
std::vector<std::uint8_t> serialize_safetensors(const SafetensorsFile& file);

// Writes "<path>.tmp.<pid>", fsyncs it, renames it over `path` and fsyncs the directory
// (best effort). On any I/O failure the temporary file is removed and FileError naming
// `path` is thrown; whatever was at `path` before is untouched, never left partial.
// Invalid contents (see serialize_safetensors) throw InvalidArgument naming `path`
// before anything is written.
void write_safetensors_atomic(const std::filesystem::path& path, const SafetensorsFile& file);
void write_file_atomic(const std::filesystem::path& path, std::span<const std::uint8_t> bytes);

}  // namespace k3ref::io
