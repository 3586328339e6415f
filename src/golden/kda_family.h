// What the KDA-based golden families (recurrence, chunkwise, backward, context-parallel,
// serving) share, defined once in src/golden/kda_cases.cc: the parameters of a KDA case, the
// options they describe, and the one input generator. A family that needs the inputs of a
// recurrence case draws them here, in memory, from that case's parameters and seed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "golden/catalogue.h"
#include "k3ref/io/safetensors.h"
#include "k3ref/kda/options.h"
#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {

// Everything a KDA case varies. Serialised into the parameters as is (to_json).
struct KdaParams {
  std::int64_t B = 1, T = 16, H = 1, HV = 1, K = 16, V = 16;
  std::vector<std::int64_t> cu_seqlens;  // empty: no varlen
  bool initial_state = true;
  std::string gate = "log_decay";  // log_decay | softplus | lower_bound
  std::string gate_base = "e";
  double g_lo = -1, g_hi = 0;      // range of the stored g (log decay, or raw gate)
  std::optional<double> lower_bound;
  bool A_log = false, dt_bias = false;
  std::string beta = "as_given";
  double beta_lo = 0, beta_hi = 1;
  bool qk_l2norm = false;
  std::optional<double> scale;
  std::string state_layout = "k_first";
  bool all_states = false;
};

nlohmann::json to_json(const KdaParams& p);
// Reads the KDA keys of `j` (other keys are ignored: a family's own parameters sit beside them).
KdaParams kda_params_from_json(const nlohmann::json& j);

// The options a KDA case's parameters describe, in the golden tier and in double.
kda::Options<num::golden_float> kda_golden_options(const nlohmann::json& kda_params);
kda::Options<double> kda_double_options(const nlohmann::json& kda_params);

// How drawn KDA inputs are stored: the format each group of values is rounded to and the
// dtype it is written as. The default is the goldens' storage (bf16 values for q, k, v, g,
// beta and initial_state, the state written as F32; fp32 A_log and dt_bias); `k3ref inputs
// --dtype` picks others. The draws from the stream do not depend on it, only the rounding.
struct KdaInputStorage {
  num::Format values = num::Format::bf16;  // q, k, v, g, beta
  num::Format state = num::Format::bf16;   // initial_state
  num::Format params = num::Format::fp32;  // A_log, dt_bias
  DType values_dtype = DType::BF16, state_dtype = DType::F32, params_dtype = DType::F32;
};

// The inputs of a KDA case, drawn from `rng` in a fixed order (q, k, v, g, beta,
// initial_state, A_log, dt_bias) and rounded to their storage formats (`storage`; by
// default the goldens': see KdaInputStorage).
kda::Inputs<double> draw_kda_inputs(const KdaParams& p, num::Random& rng, const KdaInputStorage& storage = {});

// The recurrence case `name` of the catalogue; `who` names the caller in the error when
// there is none.
Case recurrence_case(const std::string& name, const std::string& who);
// The inputs recurrence case `c` stores, drawn in memory from its parameters and seed.
kda::Inputs<double> recurrence_inputs(const Case& c);

// The slot tables of a speculative-verify case (serving.verify, layer.kda_verify), read from
// its parameters: state_indices [N, L] from the rows "state_indices", "num_accepted", and
// "writes" ("in_place" or "per_token_output").
struct VerifyTables {
  Tensor<std::int64_t> state_indices;
  std::vector<std::int64_t> num_accepted;
  bool in_place = true;
};
VerifyTables verify_tables(const nlohmann::json& params);

// Appends the inputs in their storage dtypes (by default the goldens': BF16; initial_state,
// A_log, dt_bias F32; cu_seqlens always I64), in kda::input_names order.
void add_kda_inputs(io::SafetensorsFile& file, const kda::Inputs<double>& in, const KdaInputStorage& storage = {});

}  // namespace k3ref::golden
