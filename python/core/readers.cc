// k3ref._core: the C++ safetensors reader (the one `k3ref kda`, `compare` and `golden verify`
// use) and the working-memory estimate of `k3ref kda --memory-budget`, so that the Python
// package checks its own reader against the C++ one (tests/python/test_reader_parity.py) and
// refuses a computation past its budget by the same rule as the command (io/memory_budget.h).
#include "k3ref/io/memory_budget.h"
#include "k3ref/io/safetensors.h"
#include "core.h"

namespace k3ref::python {
namespace {

// {"metadata": {str: str}, "tensors": [(name, dtype, shape), ...]} in file order, or
// ValueError (the reader's one-line FileError).
py::dict read_safetensors(const std::string& path) {
  io::SafetensorsFile file;
  {
    py::gil_scoped_release release;
    file = io::read_safetensors(path);
  }
  py::dict metadata;
  // Names and values are UTF-8 (the reader checked): decoded strictly.
  for (const auto& [k, v] : file.metadata) metadata[py::str(k)] = py::str(v);
  py::list tensors;
  for (const auto& [name, t] : file.tensors)
    tensors.append(py::make_tuple(py::str(name), std::string(dtype_name(t.dtype)), py::tuple(py::cast(t.shape))));
  py::dict r;
  r["metadata"] = metadata;
  r["tensors"] = tensors;
  return r;
}

double working_memory(std::int64_t outputs, std::int64_t inputs, std::int64_t sequence_heads, std::int64_t threads,
                      std::int64_t K, std::int64_t V, std::int64_t chunk_size, const std::string& precision) {
  const bool high = num::precision_tiers.parse(precision) != num::Tier::double_;
  return io::working_memory(io::WorkShape{outputs, inputs, sequence_heads, threads, K, V, chunk_size}, high);
}

}  // namespace

void register_readers(py::module_& m) {
  m.def("read_safetensors", &read_safetensors, py::arg("path"));
  m.def("working_memory", &working_memory, py::arg("outputs"), py::arg("inputs"), py::arg("sequence_heads"),
        py::arg("threads"), py::arg("K"), py::arg("V"), py::arg("chunk_size"), py::arg("precision"));
  m.def("default_memory_budget", &io::default_memory_budget);
  m.def("parse_memory_budget", [](const std::string& text, const std::string& option) {
    return io::parse_memory_budget(text, option);
  }, py::arg("text"), py::arg("option"));
  m.attr("bytes_per_element_double") = io::bytes_per_element(false);
  m.attr("bytes_per_element_mp256") = io::bytes_per_element(true);
}

}  // namespace k3ref::python
