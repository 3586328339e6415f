#include "k3ref/kda/kda_io.h"

#include "k3ref/error.h"
#include "k3ref/tensor/convert.h"

namespace k3ref::kda {

Inputs<double> inputs_from_file(const io::SafetensorsFile& file, const std::string& file_name) {
  auto required = [&](const char* name) { return io::to_f64(file.at(name, file_name), file_name + ": tensor '" + name + "'"); };
  auto optional = [&](const char* name) -> std::optional<Tensor<double>> {
    if (const io::RawTensor* t = file.find(name)) return io::to_f64(*t, file_name + ": tensor '" + name + "'");
    return std::nullopt;
  };
  Inputs<double> in{required("q"), required("k"), required("v"), required("g"), required("beta"),
                    optional("initial_state"), optional("A_log"), optional("dt_bias"), std::nullopt};
  if (const io::RawTensor* cu = file.find("cu_seqlens")) {
    const Tensor<std::int64_t> offsets = io::to_i64(*cu, file_name + ": tensor 'cu_seqlens'");
    if (offsets.rank() != 1)
      throw FileError(file_name + ": tensor 'cu_seqlens': expected 1 dimension, got shape " +
                      shape_to_string(offsets.shape()));
    in.cu_seqlens = offsets.values();
  }
  return in;
}

void add_outputs(io::SafetensorsFile& file, const Outputs<double>& out) {
  file.tensors.emplace_back("o", io::from_f64(out.o, DType::F64));
  if (out.final_state) file.tensors.emplace_back("final_state", io::from_f64(*out.final_state, DType::F64));
  if (out.all_states) file.tensors.emplace_back("all_states", io::from_f64(*out.all_states, DType::F64));
}

}  // namespace k3ref::kda
