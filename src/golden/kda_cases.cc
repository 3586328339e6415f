// The KDA recurrence goldens ("kda.recurrent"): parameters, deterministic input generation,
// and the reference computed at golden precision (num::golden_bits). The parameters, the
// options they describe and the input generator are shared with every KDA-based family
// (golden/kda_family.h).
#include <cmath>
#include <string>

#include "golden/kda_family.h"
#include "k3ref/error.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/kda/recurrent.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {

using nlohmann::json;
using num::Format;

json to_json(const KdaParams& p) {
  json j = {{"B", p.B}, {"T", p.T}, {"H", p.H}, {"HV", p.HV}, {"K", p.K}, {"V", p.V},
            {"initial_state", p.initial_state}, {"gate", p.gate}, {"gate_base", p.gate_base},
            {"g_range", {p.g_lo, p.g_hi}}, {"A_log", p.A_log}, {"dt_bias", p.dt_bias}, {"beta", p.beta},
            {"beta_range", {p.beta_lo, p.beta_hi}}, {"qk_l2norm", p.qk_l2norm}, {"state_layout", p.state_layout},
            {"all_states", p.all_states}};
  j["cu_seqlens"] = p.cu_seqlens.empty() ? json(nullptr) : json(p.cu_seqlens);
  j["lower_bound"] = p.lower_bound ? json(*p.lower_bound) : json(nullptr);
  j["scale"] = p.scale ? json(*p.scale) : json(nullptr);
  return j;
}

KdaParams kda_params_from_json(const json& j) {
  KdaParams p;
  p.B = j.at("B");
  p.T = j.at("T");
  p.H = j.at("H");
  p.HV = j.at("HV");
  p.K = j.at("K");
  p.V = j.at("V");
  if (!j.at("cu_seqlens").is_null()) p.cu_seqlens = j.at("cu_seqlens").get<std::vector<std::int64_t>>();
  p.initial_state = j.at("initial_state");
  p.gate = j.at("gate");
  p.gate_base = j.at("gate_base");
  p.g_lo = j.at("g_range")[0];
  p.g_hi = j.at("g_range")[1];
  if (!j.at("lower_bound").is_null()) p.lower_bound = j.at("lower_bound").get<double>();
  p.A_log = j.at("A_log");
  p.dt_bias = j.at("dt_bias");
  p.beta = j.at("beta");
  p.beta_lo = j.at("beta_range")[0];
  p.beta_hi = j.at("beta_range")[1];
  p.qk_l2norm = j.at("qk_l2norm");
  if (!j.at("scale").is_null()) p.scale = j.at("scale").get<double>();
  p.state_layout = j.at("state_layout");
  p.all_states = j.at("all_states");
  return p;
}

namespace {

template <class S>
kda::Options<S> options_of(const KdaParams& p) {
  kda::Options<S> opt;
  if (p.scale) opt.scale = S(*p.scale);
  opt.qk_l2norm = p.qk_l2norm;
  opt.gate = kda::gate_forms.parse(p.gate);
  opt.gate_base = kda::gate_bases.parse(p.gate_base);
  if (p.lower_bound) opt.lower_bound = S(*p.lower_bound);
  opt.beta = kda::beta_forms.parse(p.beta);
  opt.state_layout = kda::state_layouts.parse(p.state_layout);
  opt.output_final_state = true;
  opt.output_all_states = p.all_states;
  return opt;
}

}  // namespace

kda::Options<num::golden_float> kda_golden_options(const json& kda_params) {
  return options_of<num::golden_float>(kda_params_from_json(kda_params));
}
kda::Options<double> kda_double_options(const json& kda_params) { return options_of<double>(kda_params_from_json(kda_params)); }

kda::Inputs<double> draw_kda_inputs(const KdaParams& p, num::Random& rng, const KdaInputStorage& storage) {
  const std::int64_t N = p.cu_seqlens.empty() ? p.B : static_cast<std::int64_t>(p.cu_seqlens.size()) - 1;
  // Without the in-kernel L2 norm, k is drawn with entries in [-1/sqrt(K), 1/sqrt(K)] so
  // that beta ||k||^2 stays in the stable range of the delta rule, as normalised keys do.
  const double k_half_width = p.qk_l2norm ? 1.0 : 1.0 / std::sqrt(static_cast<double>(p.K));
  kda::Inputs<double> in;
  const Format values = storage.values;
  in.q = draw_uniform_rounded(rng, {p.B, p.T, p.H, p.K}, -1, 1, values);
  in.k = draw_uniform_rounded(rng, {p.B, p.T, p.H, p.K}, -k_half_width, k_half_width, values);
  in.v = draw_uniform_rounded(rng, {p.B, p.T, p.HV, p.V}, -1, 1, values);
  in.g = draw_uniform_rounded(rng, {p.B, p.T, p.HV, p.K}, p.g_lo, p.g_hi, values);
  in.beta = draw_uniform_rounded(rng, {p.B, p.T, p.HV}, p.beta_lo, p.beta_hi, values);
  if (p.initial_state) {
    // By default values exact in bf16 although stored as F32 (FLA's chunk_kda wants an fp32 state).
    const bool v_first = kda::state_layouts.parse(p.state_layout) == kda::StateLayout::v_first;
    const Shape shape = v_first ? Shape{N, p.HV, p.V, p.K} : Shape{N, p.HV, p.K, p.V};
    in.initial_state = draw_uniform_rounded(rng, shape, -1, 1, storage.state);
  }
  // A = exp(A_log) in [1, 16], as Mamba-style initialisations give.
  if (p.A_log) in.A_log = draw_uniform_rounded(rng, {p.HV}, 0, std::log(16.0), storage.params);
  if (p.dt_bias) in.dt_bias = draw_uniform_rounded(rng, {p.HV, p.K}, -1, 1, storage.params);
  if (!p.cu_seqlens.empty()) in.cu_seqlens = p.cu_seqlens;
  return in;
}

kda::Inputs<double> recurrence_inputs(const Case& c) {
  num::Random rng(c.seed);
  return draw_kda_inputs(kda_params_from_json(c.params), rng);
}

void add_kda_inputs(io::SafetensorsFile& file, const kda::Inputs<double>& in, const KdaInputStorage& storage) {
  file.tensors.emplace_back("q", io::from_f64(in.q, storage.values_dtype));
  file.tensors.emplace_back("k", io::from_f64(in.k, storage.values_dtype));
  file.tensors.emplace_back("v", io::from_f64(in.v, storage.values_dtype));
  file.tensors.emplace_back("g", io::from_f64(in.g, storage.values_dtype));
  file.tensors.emplace_back("beta", io::from_f64(in.beta, storage.values_dtype));
  if (in.initial_state) file.tensors.emplace_back("initial_state", io::from_f64(*in.initial_state, storage.state_dtype));
  if (in.A_log) file.tensors.emplace_back("A_log", io::from_f64(*in.A_log, storage.params_dtype));
  if (in.dt_bias) file.tensors.emplace_back("dt_bias", io::from_f64(*in.dt_bias, storage.params_dtype));
  if (in.cu_seqlens)
    file.tensors.emplace_back(
        "cu_seqlens", io::from_i64(Tensor<std::int64_t>({static_cast<std::int64_t>(in.cu_seqlens->size())},
                                                        *in.cu_seqlens), DType::I64));
}

namespace {

io::SafetensorsFile generate_kda_recurrent(const Case& c) {
  const kda::Inputs<double> in = recurrence_inputs(c);
  using G = num::golden_float;
  const kda::Outputs<G> exact = kda::recurrent_forward(kda::lift<G>(in), kda_golden_options(c.params));
  kda::Outputs<double> out;
  out.o = round_to_double(exact.o);
  if (exact.final_state) out.final_state = round_to_double(*exact.final_state);
  if (exact.all_states) out.all_states = round_to_double(*exact.all_states);

  io::SafetensorsFile file;
  add_kda_inputs(file, in);
  kda::add_outputs(file, out);
  file.metadata =
      metadata_of(c, golden_float_precision(), file, exact.all_states ? "o,final_state,all_states" : "o,final_state");
  return file;
}

std::vector<Case> kda_default_cases() {
  std::vector<Case> cases;
  // Each case starts from a small well-conditioned default.
  auto add = [&](const std::string& name, auto&& configure) {
    KdaParams p;
    configure(p);
    cases.push_back(make_case(name, "kda.recurrent", to_json(p)));
  };
  // Shapes and edges of T.
  add("kda_t1", [](KdaParams& p) { p.T = 1; });
  add("kda_b2_t37", [](KdaParams& p) { p.B = 2; p.T = 37; p.H = 2; p.HV = 2; p.K = 32; p.V = 32; });
  add("kda_t64_no_initial_state", [](KdaParams& p) { p.T = 64; p.K = 32; p.V = 32; p.initial_state = false; });
  add("kda_t100", [](KdaParams& p) { p.T = 100; p.K = 64; p.V = 64; p.g_lo = -2; });
  add("kda_k128_t65", [](KdaParams& p) { p.T = 65; p.K = 128; p.V = 128; p.g_lo = -1.5; });
  add("kda_k100_v72", [](KdaParams& p) { p.T = 40; p.K = 100; p.V = 72; p.H = 1; });
  add("kda_k100_v100", [](KdaParams& p) { p.T = 23; p.K = 100; p.V = 100; });
  // Grouped value heads.
  add("kda_gva_h2_hv6", [](KdaParams& p) { p.T = 33; p.H = 2; p.HV = 6; p.K = 32; p.V = 32; });
  // Varlen with empty and short sequences.
  add("kda_varlen", [](KdaParams& p) { p.T = 83; p.H = 2; p.HV = 2; p.K = 32; p.V = 32;
                                       p.cu_seqlens = {0, 1, 1, 18, 50, 50, 83}; });
  add("kda_varlen_no_initial_state", [](KdaParams& p) { p.T = 70; p.K = 32; p.V = 16; p.initial_state = false;
                                                        p.cu_seqlens = {0, 0, 2, 66, 70}; });
  add("kda_varlen_gva", [](KdaParams& p) { p.T = 45; p.H = 1; p.HV = 4; p.K = 16; p.V = 32;
                                           p.cu_seqlens = {0, 16, 17, 45}; });
  // Decays: none, at the safe-gate lower bound -5, beyond it.
  add("kda_decay_zero", [](KdaParams& p) { p.T = 50; p.K = 32; p.V = 32; p.g_lo = 0; p.g_hi = 0; });
  add("kda_decay_at_minus5", [](KdaParams& p) { p.T = 50; p.K = 32; p.V = 32; p.g_lo = -5; p.g_hi = -5; });
  add("kda_decay_minus5_to_0", [](KdaParams& p) { p.T = 50; p.K = 32; p.V = 32; p.g_lo = -5; p.g_hi = 0; });
  add("kda_decay_minus8", [](KdaParams& p) { p.T = 50; p.K = 32; p.V = 32; p.g_lo = -8; p.g_hi = -7; });
  // Beta.
  add("kda_beta_near0", [](KdaParams& p) { p.T = 40; p.K = 32; p.V = 32; p.beta_lo = 0; p.beta_hi = 1.0 / 64; });
  add("kda_beta_near2", [](KdaParams& p) { p.T = 40; p.K = 32; p.V = 32; p.qk_l2norm = true;
                                           p.beta_lo = 1.9; p.beta_hi = 2; });
  add("kda_beta_sigmoid", [](KdaParams& p) { p.T = 40; p.K = 32; p.V = 32; p.beta = "sigmoid";
                                             p.beta_lo = -4; p.beta_hi = 4; });
  add("kda_beta_two_sigmoid", [](KdaParams& p) { p.T = 40; p.K = 32; p.V = 32; p.qk_l2norm = true;
                                                 p.beta = "two_sigmoid"; p.beta_lo = 4; p.beta_hi = 8; });
  // Stages inside the kernel.
  add("kda_qk_l2norm", [](KdaParams& p) { p.T = 40; p.K = 64; p.V = 32; p.qk_l2norm = true; });
  add("kda_gate_softplus", [](KdaParams& p) { p.T = 40; p.H = 2; p.HV = 2; p.K = 32; p.V = 32; p.gate = "softplus";
                                              p.g_lo = -4; p.g_hi = 4; p.A_log = true; p.dt_bias = true; });
  add("kda_gate_lower_bound", [](KdaParams& p) { p.T = 40; p.H = 2; p.HV = 2; p.K = 32; p.V = 32;
                                                 p.gate = "lower_bound"; p.lower_bound = -5; p.g_lo = -4; p.g_hi = 4;
                                                 p.A_log = true; p.dt_bias = true; });
  add("kda_gate_lower_bound_base2", [](KdaParams& p) { p.T = 40; p.H = 2; p.HV = 2; p.K = 32; p.V = 32;
                                                       p.gate = "lower_bound"; p.gate_base = "2"; p.lower_bound = -5;
                                                       p.g_lo = -4; p.g_hi = 4; p.A_log = true; p.dt_bias = true; });
  add("kda_gate_lower_bound_no_A_log", [](KdaParams& p) { p.T = 40; p.K = 32; p.V = 32; p.gate = "lower_bound";
                                                          p.lower_bound = -5; p.g_lo = -4; p.g_hi = 4;
                                                          p.dt_bias = true; });
  add("kda_gate_lower_bound_minus8", [](KdaParams& p) { p.T = 40; p.K = 32; p.V = 32; p.gate = "lower_bound";
                                                        p.lower_bound = -8; p.g_lo = -4; p.g_hi = 4; p.A_log = true;
                                                        p.dt_bias = true; });
  // Options of the API.
  add("kda_state_v_first", [](KdaParams& p) { p.T = 30; p.K = 32; p.V = 16; p.state_layout = "v_first"; });
  add("kda_scale_half", [](KdaParams& p) { p.T = 30; p.K = 32; p.V = 32; p.scale = 0.5; });
  add("kda_all_states", [](KdaParams& p) { p.T = 20; p.H = 1; p.HV = 2; p.K = 16; p.V = 8; p.all_states = true; });
  // What the real kernels are configured with.
  add("kda_flashkda_like", [](KdaParams& p) { p.T = 80; p.H = 2; p.HV = 2; p.K = 128; p.V = 128;
                                              p.cu_seqlens = {0, 17, 80}; p.gate = "lower_bound"; p.gate_base = "2";
                                              p.lower_bound = -5; p.g_lo = -4; p.g_hi = 4; p.A_log = true;
                                              p.dt_bias = true; p.beta = "sigmoid"; p.beta_lo = -4; p.beta_hi = 4;
                                              p.qk_l2norm = true; p.state_layout = "v_first"; });
  add("kda_fla_chunk_like", [](KdaParams& p) { p.T = 130; p.H = 2; p.HV = 4; p.K = 64; p.V = 64;
                                               p.gate = "softplus"; p.g_lo = -4; p.g_hi = 4; p.A_log = true;
                                               p.dt_bias = true; p.beta = "sigmoid"; p.beta_lo = -4; p.beta_hi = 4;
                                               p.qk_l2norm = true; });
  return cases;
}

}  // namespace

VerifyTables verify_tables(const nlohmann::json& p) {
  const auto rows = p.at("state_indices").get<std::vector<std::vector<std::int64_t>>>();
  std::vector<std::int64_t> flat;
  for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  return VerifyTables{
      Tensor<std::int64_t>({static_cast<std::int64_t>(rows.size()), static_cast<std::int64_t>(rows.at(0).size())}, flat),
      p.at("num_accepted").get<std::vector<std::int64_t>>(), p.at("writes") == "in_place"};
}

Case recurrence_case(const std::string& name, const std::string& who) {
  for (Case& c : kda_default_cases())
    if (c.name == name) return c;
  throw InvalidArgument("golden: " + who + " refers to unknown recurrence case '" + name + "'");
}

Family family_kda() {
  return {"kda", {{"kda.recurrent", generate_kda_recurrent, golden_float_precision(), {"recurrent"}}}, kda_default_cases};
}

}  // namespace k3ref::golden
