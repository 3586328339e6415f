// The golden catalogue: named cases, each fully described by its parameters and seed,
// and the generator that turns a case into a safetensors file. Generation is
// deterministic: the same case gives the same bytes on every platform.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "k3ref/io/safetensors.h"
#include "k3ref/kda/options.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {

// Bumped whenever a change alters the bytes of any generated file.
inline constexpr const char* generator_version = "1";

struct Case {
  std::string name;       // file stem, unique in a suite
  std::string op;         // operator, e.g. "kda.recurrent"
  std::uint64_t seed = 0;
  nlohmann::json params;  // everything the generator needs besides the seed
};

// An operator family's generator: a case to its golden file.
struct Generator {
  std::string op;
  std::function<io::SafetensorsFile(const Case&)> generate;
  std::string reference_precision;  // recorded in the manifest
};

// Golden inputs: uniform in [lo, hi] from the project's own stream, then rounded to
// `format`, so the stored value is exactly what the reference consumes. Integer
// arithmetic and IEEE operations in a fixed order: the same bytes everywhere.
Tensor<double> draw_uniform_rounded(num::Random& rng, const Shape& shape, double lo, double hi, num::Format format);

// The `__metadata__` every golden file carries (docs/golden-format.md): the case, its
// operator, seed, parameters, the generator version, the reference precision and the
// names of the output tensors.
std::map<std::string, std::string> metadata_of(const Case& c, const std::string& reference_precision,
                                               const std::string& outputs);
// "256-bit binary float": the reference precision of the goldens computed at golden_bits.
std::string golden_float_precision();

// All registered generators (one per operator family).
const std::vector<Generator>& generators();
const Generator& generator_for(const std::string& op);

// The committed suite ("default") or a larger one generated on demand ("extended").
std::vector<Case> suite(const std::string& name);
std::vector<std::string> suite_names();

// KDA recurrence cases (src/golden/kda_cases.cc).
std::vector<Case> kda_default_cases();
io::SafetensorsFile generate_kda_recurrent(const Case&);
// The options a KDA case's parameters describe, in the golden tier and in double.
kda::Options<num::golden_float> kda_golden_options(const nlohmann::json& kda_params);
kda::Options<double> kda_double_options(const nlohmann::json& kda_params);
// A golden-precision tensor rounded to double (round to nearest even), as goldens store it.
Tensor<double> round_to_double(const Tensor<num::golden_float>& t);

// The double-precision recurrence run on a KDA case's stored inputs with the case's
// options: what the double tier gives against the golden's 256-bit outputs.
kda::Outputs<double> kda_recurrent_in_double(const Case&, const io::SafetensorsFile& golden_file);

// Chunkwise KDA stage goldens (src/golden/kda_chunkwise_cases.cc): "kda.chunkwise_flashkda"
// (C = 16) and "kda.chunkwise_fla" (C = 64), on the inputs of recurrence cases.
std::vector<Case> kda_chunkwise_default_cases();
io::SafetensorsFile generate_kda_chunkwise(const Case&);

// Quantile Balancing cases (src/golden/qb_cases.cc): solver iterates ("qb.solver") and the
// online form against the sign-update baseline ("qb.online").
std::vector<Case> qb_default_cases();
io::SafetensorsFile generate_qb_solver(const Case&);
io::SafetensorsFile generate_qb_online(const Case&);

// AttnRes cases (src/golden/attnres_cases.cc): full and block forms, and the phase-1
// statistics of two-phase inference ("attnres.full", "attnres.block", "attnres.phase1").
std::vector<Case> attnres_default_cases();
io::SafetensorsFile generate_attnres(const Case&);

// Context-parallel KDA cases (src/golden/kcp_cases.cc): "kcp.context_parallel", per-rank
// fragments, merged entering states and outputs of a packed sequence split over P ranks.
std::vector<Case> kcp_default_cases();
io::SafetensorsFile generate_kcp_context_parallel(const Case&);

// KDA gradient goldens (src/golden/kda_backward_cases.cc), "kda.backward": the inputs of a
// recurrence case, upstream gradients d_o and d_final_state, every input's gradient, the
// chunkwise backward's stage tensors (C = 64) and, for a case with `splits`, the
// context-parallel backward's per-rank entering states and state gradients.
std::vector<Case> kda_backward_default_cases();
io::SafetensorsFile generate_kda_backward(const Case&);

// Serving goldens (src/golden/serving_cases.cc): "serving.decode" and "serving.verify" over a
// state pool, "serving.checkpoints" at chunk / page / hash-block boundaries.
std::vector<Case> serving_default_cases();
io::SafetensorsFile generate_serving(const Case&);

}  // namespace k3ref::golden
