// KDA gradient goldens ("kda.backward"). Each case reuses a recurrence case's inputs
// (drawn in memory from that case's parameters and seed, so the same bytes as its file
// holds) or, without `base_case`, draws its own from its seed; it draws upstream gradients
// d_o (bf16 values, as a training kernel receives them) and d_final_state (fp32 container,
// bf16 values) from its own stream, and stores every input's gradient at golden precision:
// dq, dk, dv, dg (with respect to g as stored: the raw gate when the gate is applied in
// the kernel), dbeta (before its activation), d_initial_state, dA_log and ddt_bias. Beside
// them, the chunkwise backward's stages at C = 64 (the state entering each chunk and the
// gradient with respect to it), and for a case with `splits` the context-parallel
// backward's per-rank entering states and entering state gradients, so one rank of a
// kernel can be checked alone.
//
// Three derivations are computed and must agree before a file is written: the adjoint
// recurrence (stored), the chunkwise backward and, with splits, the context-parallel
// backward (gathered); tests/golden_crosscheck_backward.py checks the stored gradients
// again with complex-step derivatives of an independent NumPy forward.
#include <cmath>
#include <string>

#include "golden/kda_family.h"
#include "k3ref/kcp/backward.h"
#include "k3ref/kda/backward.h"
#include "k3ref/kda/chunkwise_backward.h"
#include "k3ref/kda/kda_io.h"

namespace k3ref::golden {
namespace {

using nlohmann::json;
using G = num::golden_float;
using num::Format;

inline constexpr std::int64_t backward_chunk_size = 64;

// Largest |a - b| over max(|b|) of a tensor pair: the derivations' agreement.
G relative_gap(const Tensor<G>& a, const Tensor<G>& b) {
  using std::abs;
  G gap(0), scale(0);
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    gap = std::max(gap, G(abs(a.data()[i] - b.data()[i])));
    scale = std::max(scale, G(abs(b.data()[i])));
  }
  return scale == G(0) ? gap : gap / scale;
}

void require_agreement(const kda::Gradients<G>& a, const kda::Gradients<G>& b, const std::string& what,
                       const std::string& case_name) {
  const std::pair<const Tensor<G>*, const Tensor<G>*> pairs[] = {
      {&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}, {&a.dg, &b.dg}, {&a.dbeta, &b.dbeta},
      {&a.d_initial_state, &b.d_initial_state}};
  for (auto [x, y] : pairs)
    if (relative_gap(*x, *y) > G(1e-60))
      throw std::runtime_error("golden: case '" + case_name + "': the " + what +
                  " backward disagrees with the adjoint recurrence beyond 1e-60");
}

Tensor<G> stack_ranks(const std::vector<Tensor<G>>& per_rank) {
  Shape shape{static_cast<std::int64_t>(per_rank.size())};
  shape.insert(shape.end(), per_rank.front().shape().begin(), per_rank.front().shape().end());
  std::vector<G> data;
  for (const Tensor<G>& t : per_rank) data.insert(data.end(), t.values().begin(), t.values().end());
  return Tensor<G>(shape, std::move(data));
}

io::SafetensorsFile generate_kda_backward(const Case& c) {
  const json& kda_params = c.params;  // the KDA keys sit beside the backward parameters
  // The case's own stream: its inputs when it names no recurrence case, then the upstream gradients.
  num::Random rng(c.seed);
  const kda::Inputs<double> in =
      c.params.contains("base_case")
          ? recurrence_inputs(recurrence_case(c.params.at("base_case").get<std::string>(), "backward case " + c.name))
          : draw_kda_inputs(kda_params_from_json(kda_params), rng);
  const kda::Options<G> opt = kda_golden_options(kda_params);

  const std::int64_t B = in.v.dim(0), T = in.v.dim(1), HV = in.v.dim(2), V = in.v.dim(3), K = in.q.dim(3);
  const std::int64_t N = in.cu_seqlens ? static_cast<std::int64_t>(in.cu_seqlens->size()) - 1 : B;
  const bool v_first = opt.state_layout == kda::StateLayout::v_first;
  const Tensor<double> d_o = draw_uniform_rounded(rng, {B, T, HV, V}, -1, 1, Format::bf16);
  Tensor<double> d_final =
      draw_uniform_rounded(rng, v_first ? Shape{N, HV, V, K} : Shape{N, HV, K, V}, -1, 1, Format::bf16);
  // A kernel in context-parallel mode returns no final state: then the loss has no such term.
  if (!c.params.value("final_state_gradient", true)) d_final = Tensor<double>(d_final.shape());
  auto up = [](const Tensor<double>& t) { return t.map<G>([](double x) { return G(x); }); };
  const kda::Inputs<G> gin = kda::lift<G>(in);
  const kda::Cotangents<G> cot{up(d_o), up(d_final)};

  const kda::Gradients<G> grad = kda::recurrent_backward(gin, opt, cot);
  const auto chunked = kda::chunkwise_backward(gin, opt, cot, backward_chunk_size);
  require_agreement(chunked.gradients, grad, "chunkwise", c.name);

  io::SafetensorsFile file;
  add_kda_inputs(file, in);
  file.tensors.emplace_back("d_o", io::from_f64(d_o, DType::BF16));
  file.tensors.emplace_back("d_final_state", io::from_f64(d_final, DType::F32));
  std::string names;
  auto output = [&](const char* name, const Tensor<G>& t) {
    file.tensors.emplace_back(name, io::from_f64(round_to_double(t), DType::F64));
    names += (names.empty() ? "" : ",") + std::string(name);
  };
  output("dq", grad.dq);
  output("dk", grad.dk);
  output("dv", grad.dv);
  output("dg", grad.dg);
  output("dbeta", grad.dbeta);
  output("d_initial_state", grad.d_initial_state);
  if (grad.dA_log) output("dA_log", *grad.dA_log);
  if (grad.ddt_bias) output("ddt_bias", *grad.ddt_bias);
  output("chunk_states", chunked.stages.chunk_states);
  output("chunk_state_gradients", chunked.stages.chunk_state_gradients);
  file.tensors.emplace_back("chunk_starts", io::from_i64(chunked.stages.chunk_starts, DType::I64));

  if (c.params.contains("splits")) {
    const auto splits = c.params.at("splits").get<std::vector<std::int64_t>>();
    const auto cp = kcp::context_parallel_backward(gin, opt, splits, cot);
    require_agreement(cp.gradients, grad, "context-parallel", c.name);
    file.tensors.emplace_back("splits", io::from_i64(Tensor<std::int64_t>({static_cast<std::int64_t>(splits.size())},
                                                                          splits), DType::I64));
    output("cp_entering_states", stack_ranks(cp.entering_states));
    output("cp_entering_state_gradients", stack_ranks(cp.state.entering_gradients));
  }
  file.metadata = metadata_of(c, golden_float_precision(), file, names, "chunk_starts");
  return file;
}

std::vector<Case> kda_backward_default_cases() {
  // Recurrence cases a training kernel (FLA's chunk_kda) supports: T not a multiple of 16
  // or 64, batch, K = V = 128, head size 100, varlen with empty and 1-token sequences, GVA,
  // decays at -5, L2 norm, sigmoid beta, the softplus and lower-bound gates in the kernel,
  // and FLA's chunk-like mix. Two carry context-parallel splits (cutting documents
  // mid-way, and an empty rank).
  struct Pick {
    std::string base;
    std::vector<std::int64_t> splits;  // empty: no context-parallel part
  };
  const std::vector<Pick> picks = {{"kda_b2_t37", {}},
                                   {"kda_t100", {}},
                                   {"kda_k128_t65", {}},
                                   {"kda_k100_v72", {}},
                                   {"kda_gva_h2_hv6", {}},
                                   {"kda_varlen", {0, 10, 18, 18, 60, 83}},
                                   {"kda_varlen_gva", {0, 20, 45}},
                                   {"kda_decay_at_minus5", {}},
                                   {"kda_qk_l2norm", {}},
                                   {"kda_beta_sigmoid", {}},
                                   {"kda_gate_softplus", {}},
                                   {"kda_gate_lower_bound", {}},
                                   {"kda_fla_chunk_like", {}}};
  std::vector<Case> cases;
  // For a context-parallel kernel across 2 devices (FLA's cp mode): T divisible by 2, no
  // initial state and no final-state gradient (the mode supports neither), a document
  // crossing the split at 48 and a 1-token document.
  {
    json p = recurrence_case("kda_varlen", "a backward case").params;
    p["T"] = 96;
    p["K"] = 64;
    p["V"] = 64;
    p["cu_seqlens"] = {0, 30, 31, 96};
    p["initial_state"] = false;
    // Its own inputs (no base case): drawn from its own seed.
    p["splits"] = {0, 48, 96};
    p["final_state_gradient"] = false;
    cases.push_back(make_case("kda_backward_cp2_varlen", "kda.backward", p));
  }
  for (const Pick& pick : picks) {
    json params = recurrence_case(pick.base, "a backward case").params;
    params["base_case"] = pick.base;
    if (!pick.splits.empty()) params["splits"] = pick.splits;
    cases.push_back(make_case("kda_backward" + pick.base.substr(3), "kda.backward", params));
  }
  return cases;
}

}  // namespace

Family family_kda_backward() {
  return {"kda_backward", {{"kda.backward", generate_kda_backward, golden_float_precision(), {"chunk"}}}, kda_backward_default_cases};
}

}  // namespace k3ref::golden
