// libFuzzer target: the golden manifest reader. Any input must parse or raise FileError.
#include "k3ref/error.h"
#include "golden/suite.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    (void)k3ref::golden::parse_manifest(std::span(data, size), "MANIFEST.json");
  } catch (const k3ref::FileError&) {
  }
  return 0;
}
