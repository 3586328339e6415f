// Context-parallel KDA goldens ("kcp.context_parallel"): a packed multi-document sequence
// split over P ranks at arbitrary token positions. Besides the inputs, the outputs and the
// final states (the same as the single-device recurrence), each file holds what a real
// implementation exchanges and merges, rank by rank: the fragment pair (M, S~) each rank
// computes from a zero state, the rank on which its first document began, and the merged
// state it enters with. Reference at num::golden_bits bits, rounded to F64.
//
// The parameters are those of a "kda.recurrent" case (so the file is also a KDA golden)
// plus the split positions.
#include <cmath>
#include <string>

#include "k3ref/golden/catalogue.h"
#include "k3ref/kcp/context_parallel.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {
namespace {

using nlohmann::json;
using num::Format;

struct KcpParams {
  std::int64_t T = 0, H = 1, HV = 1, K = 16, V = 16;
  std::vector<std::int64_t> cu_seqlens, splits;
  std::string gate = "log_decay", gate_base = "e", beta = "as_given";
  double g_lo = -1, g_hi = 0, beta_lo = 0, beta_hi = 1;
  std::optional<double> lower_bound;
  bool A_log = false, dt_bias = false, qk_l2norm = false;
};

json to_json(const KcpParams& p) {
  // The keys of a kda.recurrent case (B = 1, no initial state, K-first, scale K^-1/2), then the split.
  return json{{"B", 1}, {"T", p.T}, {"H", p.H}, {"HV", p.HV}, {"K", p.K}, {"V", p.V},
              {"cu_seqlens", p.cu_seqlens}, {"initial_state", false}, {"gate", p.gate}, {"gate_base", p.gate_base},
              {"g_range", {p.g_lo, p.g_hi}}, {"lower_bound", p.lower_bound ? json(*p.lower_bound) : json(nullptr)},
              {"A_log", p.A_log}, {"dt_bias", p.dt_bias}, {"beta", p.beta}, {"beta_range", {p.beta_lo, p.beta_hi}},
              {"qk_l2norm", p.qk_l2norm}, {"scale", nullptr}, {"state_layout", "k_first"}, {"all_states", false},
              {"splits", p.splits}, {"merge", "origin_rank"}};
}

KcpParams from_json(const json& j) {
  KcpParams p;
  p.T = j.at("T");
  p.H = j.at("H");
  p.HV = j.at("HV");
  p.K = j.at("K");
  p.V = j.at("V");
  p.cu_seqlens = j.at("cu_seqlens").get<std::vector<std::int64_t>>();
  p.splits = j.at("splits").get<std::vector<std::int64_t>>();
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
  return p;
}

kda::Inputs<double> make_inputs(const KcpParams& p, std::uint64_t seed) {
  num::Random rng(seed);
  const double k_half_width = p.qk_l2norm ? 1.0 : 1.0 / std::sqrt(static_cast<double>(p.K));
  kda::Inputs<double> in;
  in.q = draw_uniform_rounded(rng, {1, p.T, p.H, p.K}, -1, 1, Format::bf16);
  in.k = draw_uniform_rounded(rng, {1, p.T, p.H, p.K}, -k_half_width, k_half_width, Format::bf16);
  in.v = draw_uniform_rounded(rng, {1, p.T, p.HV, p.V}, -1, 1, Format::bf16);
  in.g = draw_uniform_rounded(rng, {1, p.T, p.HV, p.K}, p.g_lo, p.g_hi, Format::bf16);
  in.beta = draw_uniform_rounded(rng, {1, p.T, p.HV}, p.beta_lo, p.beta_hi, Format::bf16);
  if (p.A_log) in.A_log = draw_uniform_rounded(rng, {p.HV}, 0, std::log(16.0), Format::fp32);
  if (p.dt_bias) in.dt_bias = draw_uniform_rounded(rng, {p.HV, p.K}, -1, 1, Format::fp32);
  in.cu_seqlens = p.cu_seqlens;
  return in;
}

Tensor<std::int64_t> ints(const std::vector<std::int64_t>& v) {
  return Tensor<std::int64_t>({static_cast<std::int64_t>(v.size())}, v);
}

}  // namespace

io::SafetensorsFile generate_kcp_context_parallel(const Case& c) {
  const KcpParams p = from_json(c.params);
  const kda::Inputs<double> in = make_inputs(p, c.seed);
  using G = num::golden_float;
  const auto cp = kcp::context_parallel_forward(kda::lift<G>(in), kda_golden_options(c.params), p.splits, kcp::Merge::origin_rank);
  auto to_double = [](const Tensor<G>& t) { return t.map<double>([](const G& x) { return num::to_double_rne(x); }); };
  // Stack per-rank tensors [A, B, C] into [P, A, B, C].
  auto stack = [&](auto&& pick) {
    const std::int64_t P = cp.plan.num_ranks();
    Tensor<G> first = pick(std::size_t{0});
    Shape shape{P};
    shape.insert(shape.end(), first.shape().begin(), first.shape().end());
    std::vector<G> data;
    for (std::int64_t r = 0; r < P; ++r) {
      const Tensor<G> t = pick(static_cast<std::size_t>(r));
      data.insert(data.end(), t.values().begin(), t.values().end());
    }
    return to_double(Tensor<G>(shape, std::move(data)));
  };
  std::vector<std::int64_t> origin;
  for (const auto& s : cp.plan.ranks) origin.push_back(s.origin_rank);

  io::SafetensorsFile file;
  file.tensors.emplace_back("q", io::from_f64(in.q, DType::BF16));
  file.tensors.emplace_back("k", io::from_f64(in.k, DType::BF16));
  file.tensors.emplace_back("v", io::from_f64(in.v, DType::BF16));
  file.tensors.emplace_back("g", io::from_f64(in.g, DType::BF16));
  file.tensors.emplace_back("beta", io::from_f64(in.beta, DType::BF16));
  if (in.A_log) file.tensors.emplace_back("A_log", io::from_f64(*in.A_log, DType::F32));
  if (in.dt_bias) file.tensors.emplace_back("dt_bias", io::from_f64(*in.dt_bias, DType::F32));
  file.tensors.emplace_back("cu_seqlens", io::from_i64(ints(p.cu_seqlens), DType::I64));
  file.tensors.emplace_back("splits", io::from_i64(ints(p.splits), DType::I64));
  file.tensors.emplace_back("origin_rank", io::from_i64(ints(origin), DType::I64));
  file.tensors.emplace_back("fragment_transition",
                            io::from_f64(stack([&](std::size_t r) { return cp.fragments[r].transition; }), DType::F64));
  file.tensors.emplace_back("fragment_state",
                            io::from_f64(stack([&](std::size_t r) { return cp.fragments[r].state; }), DType::F64));
  file.tensors.emplace_back("entering_state",
                            io::from_f64(stack([&](std::size_t r) { return cp.entering_states[r]; }), DType::F64));
  file.tensors.emplace_back("o", io::from_f64(to_double(cp.out.o), DType::F64));
  file.tensors.emplace_back("final_state", io::from_f64(to_double(*cp.out.final_state), DType::F64));
  file.metadata =
      metadata_of(c, golden_float_precision(), "o,final_state,fragment_transition,fragment_state,entering_state");
  return file;
}

std::vector<Case> kcp_default_cases() {
  std::vector<Case> cases;
  std::uint64_t seed = 0x6b6370;  // "kcp"
  auto add = [&](const std::string& name, const KcpParams& p) {
    cases.push_back(Case{name, "kcp.context_parallel", seed++, to_json(p)});
  };
  {  // P = 2: three documents, the middle one cut by the rank boundary.
    KcpParams p;
    p.T = 61;
    p.HV = 2;
    p.cu_seqlens = {0, 23, 40, 61};
    p.splits = {0, 29, 61};
    add("kcp_p2_docs", p);
  }
  {  // P = 4, FLA's chunk configuration (softplus gate, sigmoid beta, L2 norm, GVA): an empty
     // document, a document ending exactly at a rank boundary, a one-token document, a
     // document spanning two ranks from the middle of one.
    KcpParams p;
    p.T = 90;
    p.H = 2;
    p.HV = 4;
    p.cu_seqlens = {0, 7, 7, 50, 51, 90};
    p.splits = {0, 19, 50, 70, 90};
    p.gate = "softplus";
    p.g_lo = -4;
    p.g_hi = 4;
    p.A_log = p.dt_bias = true;
    p.beta = "sigmoid";
    p.beta_lo = -4;
    p.beta_hi = 4;
    p.qk_l2norm = true;
    add("kcp_p4_docs_fla_gate", p);
  }
  {  // P = 8, FlashKDA's gate (lower bound -5, base 2): one document over five ranks,
     // a one-token rank, slices not aligned to any chunk size.
    KcpParams p;
    p.T = 100;
    p.H = 2;
    p.HV = 2;
    p.K = 32;
    p.V = 32;
    p.cu_seqlens = {0, 37, 38, 100};
    p.splits = {0, 13, 26, 37, 45, 46, 64, 81, 100};
    p.gate = "lower_bound";
    p.gate_base = "2";
    p.lower_bound = -5;
    p.g_lo = -4;
    p.g_hi = 4;
    p.A_log = p.dt_bias = true;
    p.beta = "sigmoid";
    p.beta_lo = -4;
    p.beta_hi = 4;
    p.qk_l2norm = true;
    add("kcp_p8_docs_lower_bound_gate", p);
  }
  return cases;
}

}  // namespace k3ref::golden
