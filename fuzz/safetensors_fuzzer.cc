// libFuzzer target: the safetensors reader. Any input must either parse or raise a
// FileError; a file that parses must convert and re-serialise to a file that parses to
// the same contents.
#include <cstdlib>

#include "k3ref/error.h"
#include "k3ref/io/safetensors.h"
#include "k3ref/tensor/convert.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace k3ref;
  io::SafetensorsFile file;
  try {
    file = io::parse_safetensors(std::span(data, size), "fuzz.safetensors");
  } catch (const FileError&) {
    return 0;
  }
  for (const auto& [name, t] : file.tensors) {
    try {
      if (t.dtype == DType::I64 || t.dtype == DType::I32 || t.dtype == DType::U8 || t.dtype == DType::BOOL)
        (void)io::to_i64(t, name);
      (void)io::to_f64(t, name);
    } catch (const FileError&) {
    } catch (const InvalidArgument&) {
    }
  }
  std::vector<std::uint8_t> again;
  try {
    again = io::serialize_safetensors(file);
  } catch (const InvalidArgument&) {
    return 0;  // e.g. names the writer refuses; the reader accepted them, which is allowed
  }
  if (!(io::parse_safetensors(again, "reserialised") == file)) std::abort();
  return 0;
}
