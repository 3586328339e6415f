// KDA inputs and outputs as safetensors files, with the tensor names of FLA's API
// (q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens; o, final_state,
// all_states). Values enter as doubles (every stored dtype converts exactly) and can be
// lifted exactly to any scalar tier.
#pragma once

#include <string>

#include "k3ref/io/safetensors.h"
#include "k3ref/kda/options.h"

namespace k3ref::kda {

inline constexpr const char* input_names[] = {"q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias",
                                              "cu_seqlens"};

// Reads the inputs; q, k, v, g, beta are required. Throws FileError naming the file and
// the tensor on a missing or non-numeric tensor.
Inputs<double> inputs_from_file(const io::SafetensorsFile& file, const std::string& file_name);

// Lifts double inputs exactly to another scalar tier.
template <class S>
Inputs<S> lift(const Inputs<double>& in) {
  auto up = [](const Tensor<double>& t) { return t.template map<S>([](double x) { return S(x); }); };
  auto up_opt = [&](const std::optional<Tensor<double>>& t) {
    return t ? std::optional<Tensor<S>>(up(*t)) : std::nullopt;
  };
  return Inputs<S>{up(in.q), up(in.k), up(in.v), up(in.g), up(in.beta),
                   up_opt(in.initial_state), up_opt(in.A_log), up_opt(in.dt_bias), in.cu_seqlens};
}

// Output tensors in F64 (already rounded to double by the caller).
void add_outputs(io::SafetensorsFile& file, const Outputs<double>& out);

}  // namespace k3ref::kda
