// Context-parallel KDA goldens ("kcp.context_parallel"): a packed multi-document sequence
// split over P ranks at arbitrary token positions. Besides the inputs, the outputs and the
// final states (the same as the single-device recurrence), each file holds what a real
// implementation exchanges and merges, rank by rank: the fragment pair (M, S~) each rank
// computes from a zero state, the rank on which its first document began, and the merged
// state it enters with. Reference at num::golden_bits bits, rounded to F64.
//
// The parameters are those of a "kda.recurrent" case (so the file is also a KDA golden)
// plus the split positions; the inputs come from the shared KDA input generator.
#include <cmath>
#include <string>

#include "golden/kda_family.h"
#include "k3ref/kcp/context_parallel.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {
namespace {

using nlohmann::json;
using num::Format;

// A kda.recurrent parameter object (B = 1, no initial state, K-first, scale K^-1/2) plus
// the split positions and the merge.
json kcp_params(KdaParams p, const std::vector<std::int64_t>& splits) {
  p.B = 1;
  p.initial_state = false;
  json j = to_json(p);
  j["splits"] = splits;
  j["merge"] = "origin_rank";
  return j;
}

Tensor<std::int64_t> ints(const std::vector<std::int64_t>& v) {
  return Tensor<std::int64_t>({static_cast<std::int64_t>(v.size())}, v);
}

io::SafetensorsFile generate_kcp_context_parallel(const Case& c) {
  const KdaParams p = kda_params_from_json(c.params);
  const auto splits = c.params.at("splits").get<std::vector<std::int64_t>>();
  num::Random rng(c.seed);
  const kda::Inputs<double> in = draw_kda_inputs(p, rng);
  using G = num::golden_float;
  const auto cp = kcp::context_parallel_forward(kda::lift<G>(in), kda_golden_options(c.params), splits, kcp::Merge::origin_rank);
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
  add_kda_inputs(file, in);
  file.tensors.emplace_back("splits", io::from_i64(ints(splits), DType::I64));
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
      metadata_of(c, golden_float_precision(), file, "o,final_state,fragment_transition,fragment_state,entering_state",
                  "origin_rank");
  return file;
}

std::vector<Case> kcp_default_cases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, const KdaParams& p, const std::vector<std::int64_t>& splits) {
    cases.push_back(make_case(name, "kcp.context_parallel", kcp_params(p, splits)));
  };
  {  // P = 2: three documents, the middle one cut by the rank boundary.
    KdaParams p;
    p.T = 61;
    p.HV = 2;
    p.cu_seqlens = {0, 23, 40, 61};
    const std::vector<std::int64_t> splits = {0, 29, 61};
    add("kcp_p2_docs", p, splits);
  }
  {  // P = 4, FLA's chunk configuration (softplus gate, sigmoid beta, L2 norm, GVA): an empty
     // document, a document ending exactly at a rank boundary, a one-token document, a
     // document spanning two ranks from the middle of one.
    KdaParams p;
    p.T = 90;
    p.H = 2;
    p.HV = 4;
    p.cu_seqlens = {0, 7, 7, 50, 51, 90};
    const std::vector<std::int64_t> splits = {0, 19, 50, 70, 90};
    p.gate = "softplus";
    p.g_lo = -4;
    p.g_hi = 4;
    p.A_log = p.dt_bias = true;
    p.beta = "sigmoid";
    p.beta_lo = -4;
    p.beta_hi = 4;
    p.qk_l2norm = true;
    add("kcp_p4_docs_fla_gate", p, splits);
  }
  {  // P = 8, FlashKDA's gate (lower bound -5, base 2): one document over five ranks,
     // a one-token rank, slices not aligned to any chunk size.
    KdaParams p;
    p.T = 100;
    p.H = 2;
    p.HV = 2;
    p.K = 32;
    p.V = 32;
    p.cu_seqlens = {0, 37, 38, 100};
    const std::vector<std::int64_t> splits = {0, 13, 26, 37, 45, 46, 64, 81, 100};
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
    add("kcp_p8_docs_lower_bound_gate", p, splits);
  }
  return cases;
}

}  // namespace

Family family_kcp() {
  return {"kcp", {{"kcp.context_parallel", generate_kcp_context_parallel, golden_float_precision(), {"chunk"}}}, kcp_default_cases};
}

}  // namespace k3ref::golden
