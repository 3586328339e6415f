// Serving goldens (docs/serving.md): continuous-batching decode over a state pool
// ("serving.decode"), speculative-decoding verify ("serving.verify") and state checkpoints
// at chunk / page / hash-block boundaries with their off-by-one neighbours
// ("serving.checkpoints"), and speculative-decoding rollback by replay of the cached projected
// inputs and by snapshots ("serving.rollback", kcp/replay.h). Reference at num::golden_bits bits through the serving
// references (include/k3ref/serving/), rounded once to F64.
//
// Each case's parameters hold the keys of a "kda.recurrent" case (the options: gate, beta,
// layout, ...) and, beside them, the pool and the slot tables: one parameter object. The pool is stored
// whole, as one flat F32 buffer (bf16-exact values), padding included: the padding holds
// 2^100, so a kernel that reads it produces outputs no tolerance accepts, and `pool_out`
// (the whole buffer after the call) says that every element outside the named slots is
// unchanged.
#include <cmath>
#include <string>

#include "golden/kda_family.h"
#include "golden/pool_tensors.h"
#include "k3ref/kcp/replay.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/serving/checkpoint.h"
#include "k3ref/serving/decode.h"

namespace k3ref::golden {
namespace {

using nlohmann::json;
using num::Format;
using G = num::golden_float;

// What a serving case varies besides its tables.
struct Shape5 {
  std::int64_t T = 0, H = 1, HV = 1, K = 8, V = 4;
};

// The KDA keys of a serving case, those of a kda.recurrent case.
json kda_json(const Shape5& s, const std::vector<std::int64_t>& cu, bool initial_state, const std::string& layout,
              const json& gate = json::object()) {
  json j = {{"B", 1}, {"T", s.T}, {"H", s.H}, {"HV", s.HV}, {"K", s.K}, {"V", s.V},
            {"cu_seqlens", cu.empty() ? json(nullptr) : json(cu)}, {"initial_state", initial_state},
            {"gate", "log_decay"}, {"gate_base", "e"}, {"g_range", {-1.0, 0.0}}, {"lower_bound", nullptr},
            {"A_log", false}, {"dt_bias", false}, {"beta", "as_given"}, {"beta_range", {0.0, 1.0}},
            {"qk_l2norm", false}, {"scale", nullptr}, {"state_layout", layout}, {"all_states", false}};
  for (const auto& [key, value] : gate.items()) j[key] = value;
  return j;
}

struct Drawn {
  kda::Inputs<double> in;
  std::int64_t HV, K, V;
};

// The inputs as every KDA family draws them (draw_kda_inputs).
Drawn draw_inputs(const json& kp, num::Random& rng) {
  const KdaParams p = kda_params_from_json(kp);
  return Drawn{draw_kda_inputs(p, rng), p.HV, p.K, p.V};
}

serving::PoolLayout pool_layout_of(const json& p, const Drawn& d) {
  const json& pj = p.at("pool");
  serving::PoolLayout L = serving::dense_pool_layout(pj.at("slots"), d.HV, d.K, d.V,
                                                     kda::state_layouts.parse(p.at("state_layout").get<std::string>()));
  L.slot_stride = pj.at("slot_stride");
  L.offset = pj.at("offset");
  return L;
}

// Slots hold bf16-exact states in [-1, 1]; everything else of the buffer holds the padding value.
serving::StatePool<double> draw_pool(const serving::PoolLayout& L, num::Random& rng) {
  serving::StatePool<double> pool = serving::StatePool<double>::zeros(L, pool_padding);
  for (std::int64_t s = 0; s < L.slots; ++s)
    serving::write_slot(pool, s, draw_uniform_rounded(rng, {L.HV, L.K, L.V}, -1, 1, Format::bf16));
  return pool;
}

template <class S>
serving::StatePool<S> lift_pool(const serving::StatePool<double>& p) {
  serving::StatePool<S> out{p.layout, {}};
  for (double x : p.buffer) out.buffer.push_back(S(x));
  return out;
}

Tensor<double> to_double(const Tensor<G>& t) { return round_to_double(t); }
Tensor<double> buffer_tensor(const std::vector<G>& b) {
  return to_double(Tensor<G>({static_cast<std::int64_t>(b.size())}, b));
}
Tensor<std::int64_t> ints(const std::vector<std::int64_t>& v) { return Tensor<std::int64_t>({static_cast<std::int64_t>(v.size())}, v); }

io::SafetensorsFile generate_pool_case(const Case& c) {
  const json& p = c.params;
  num::Random rng(c.seed);
  const Drawn d = draw_inputs(p, rng);
  const serving::StatePool<double> pool = draw_pool(pool_layout_of(p, d), rng);
  const auto opt = kda_golden_options(p);
  auto work = lift_pool<G>(pool);
  const kda::Inputs<G> in = kda::lift<G>(d.in);
  io::SafetensorsFile f;
  add_kda_inputs(f, d.in);
  add_pool_tensors(f, pool);
  std::string outputs;
  if (c.op == "serving.decode") {
    const auto slots = p.at("slot_of_sequence").get<std::vector<std::int64_t>>();
    f.tensors.emplace_back("slot_of_sequence", io::from_i64(ints(slots), DType::I64));
    const Tensor<G> o = serving::continuous_batching_decode(in, opt, work, slots);
    f.tensors.emplace_back("o", io::from_f64(to_double(o), DType::F64));
    f.tensors.emplace_back("pool_out", io::from_f64(buffer_tensor(work.buffer), DType::F64));
    outputs = "o,pool_out";
  } else {
    const VerifyTables tables = verify_tables(p);
    const Tensor<std::int64_t>& idx = tables.state_indices;
    const std::vector<std::int64_t>& accepted = tables.num_accepted;
    const auto writes = tables.in_place ? serving::StateWrites::in_place : serving::StateWrites::per_token_output;
    f.tensors.emplace_back("state_indices", io::from_i64(idx, DType::I64));
    f.tensors.emplace_back("num_accepted", io::from_i64(ints(accepted), DType::I64));
    const auto out = serving::speculative_verify(in, opt, work, idx, accepted, writes);
    f.tensors.emplace_back("o", io::from_f64(to_double(out.o), DType::F64));
    outputs = "o";
    if (out.token_states) {
      f.tensors.emplace_back("token_states", io::from_f64(to_double(*out.token_states), DType::F64));
      outputs += ",token_states";
    }
    f.tensors.emplace_back("pool_out", io::from_f64(buffer_tensor(work.buffer), DType::F64));
    outputs += ",pool_out";
  }
  f.metadata = metadata_of(c, golden_float_precision(), f, outputs, "pool_geometry");
  return f;
}

io::SafetensorsFile generate_checkpoint_case(const Case& c) {
  const json& p = c.params;
  num::Random rng(c.seed);
  const Drawn d = draw_inputs(p, rng);
  if (!d.in.initial_state) throw InvalidArgument("serving.checkpoints: case " + c.name + " needs an initial state");
  const std::int64_t T = d.in.q.dim(1);
  std::vector<std::int64_t> bounds;
  for (const auto& [kind, block] : p.at("blocks").items()) {
    const auto b = serving::block_boundaries(T, block.get<std::int64_t>());
    bounds.insert(bounds.end(), b.begin(), b.end());
  }
  bounds = serving::with_neighbours(bounds, T);
  const auto opt = kda_golden_options(p);
  const kda::Inputs<G> in = kda::lift<G>(d.in);
  const auto single = kda::recurrent_forward(in, opt);
  const auto states = serving::checkpoints(in, opt, bounds);
  std::vector<G> stacked;
  for (const auto& s : states) stacked.insert(stacked.end(), s.values().begin(), s.values().end());
  Shape shape{static_cast<std::int64_t>(states.size())};
  shape.insert(shape.end(), states.at(0).shape().begin(), states.at(0).shape().end());
  io::SafetensorsFile f;
  add_kda_inputs(f, d.in);
  f.tensors.emplace_back("checkpoint_positions", io::from_i64(ints(bounds), DType::I64));
  f.tensors.emplace_back("o", io::from_f64(to_double(single.o), DType::F64));
  f.tensors.emplace_back("final_state", io::from_f64(to_double(*single.final_state), DType::F64));
  f.tensors.emplace_back("checkpoints", io::from_f64(to_double(Tensor<G>(shape, stacked)), DType::F64));
  f.metadata = metadata_of(c, golden_float_precision(), f, "o,final_state,checkpoints");
  return f;
}

// Rollback of one sequence's draft window (kcp/replay.h): the layer (short convolutions with
// SiLU, K3's gate and beta), the pre-draft state (KDA and conv states), the L draft tokens'
// projected inputs, the bonus token and the accepted count a in [0, L] (draft tokens accepted,
// the bonus token not counted). Outputs: the verification pass's outputs, the snapshot after
// every draft position, and the state replay rebuilds (a accepted tokens then the bonus token)
// with the bonus token's output.
io::SafetensorsFile generate_rollback_case(const Case& c) {
  const json& p = c.params;
  const std::int64_t H = p.at("H"), HV = p.at("HV"), K = p.at("K"), V = p.at("V"), W = p.at("W"), L = p.at("L");
  const std::int64_t a = p.at("accepted");
  num::Random rng(c.seed);
  const double kw = 1.0;  // the layer normalises q and k
  auto bf16 = [&](const Shape& shape, double lo, double hi) { return draw_uniform_rounded(rng, shape, lo, hi, Format::bf16); };
  kcp::DecodeLayer<double> layer;
  layer.H = H;
  layer.HV = HV;
  layer.K = K;
  layer.V = V;
  layer.conv_q = bf16({H * K, W}, -1, 1);
  layer.conv_k = bf16({H * K, W}, -1, 1);
  layer.conv_v = bf16({HV * V, W}, -1, 1);
  layer.activation = kcp::ConvActivation::silu;
  layer.options.qk_l2norm = true;
  layer.options.gate = kda::GateForm::lower_bound;
  layer.options.lower_bound = -5.0;
  layer.options.beta = kda::BetaForm::sigmoid;
  layer.A_log = draw_uniform_rounded(rng, {HV}, 0, std::log(16.0), Format::fp32);
  layer.dt_bias = draw_uniform_rounded(rng, {HV, K}, -1, 1, Format::fp32);
  kcp::DecodeState<double> pre{bf16({HV, K, V}, -1, 1), bf16({H * K, W - 1}, -kw, kw), bf16({H * K, W - 1}, -kw, kw),
                               bf16({HV * V, W - 1}, -1, 1)};
  auto tokens = [&](std::int64_t n) {
    kcp::ProjectedTokens<double> t;
    t.q = bf16({n, H * K}, -kw, kw);
    t.k = bf16({n, H * K}, -kw, kw);
    t.v = bf16({n, HV * V}, -1, 1);
    t.g = bf16({n, HV, K}, -4, 4);
    t.beta = bf16({n, HV}, -4, 4);
    return t;
  };
  const auto draft = tokens(L);
  const auto bonus = tokens(1);

  auto lift = [](const Tensor<double>& t) { return t.map<G>([](double x) { return G(x); }); };
  kcp::DecodeLayer<G> gl;
  gl.H = H;
  gl.HV = HV;
  gl.K = K;
  gl.V = V;
  gl.conv_q = lift(layer.conv_q);
  gl.conv_k = lift(layer.conv_k);
  gl.conv_v = lift(layer.conv_v);
  gl.activation = layer.activation;
  gl.options.qk_l2norm = true;
  gl.options.gate = kda::GateForm::lower_bound;
  gl.options.lower_bound = G(-5);
  gl.options.beta = kda::BetaForm::sigmoid;
  gl.A_log = lift(*layer.A_log);
  gl.dt_bias = lift(*layer.dt_bias);
  const kcp::DecodeState<G> gpre{lift(pre.kda), lift(pre.conv_q), lift(pre.conv_k), lift(pre.conv_v)};
  auto lift_tokens = [&](const kcp::ProjectedTokens<double>& t) {
    return kcp::ProjectedTokens<G>{lift(t.q), lift(t.k), lift(t.v), lift(t.g), lift(t.beta)};
  };
  const auto gdraft = lift_tokens(draft);
  const auto verify = kcp::decode_run(gl, gpre, gdraft);
  const auto snaps = kcp::snapshot_states(gl, gpre, gdraft);
  const auto replayed = kcp::replay_accepted(gl, gpre, gdraft, a, std::optional<kcp::ProjectedTokens<G>>(lift_tokens(bonus)));
  // Replay without the bonus token is snapshot a, bit for bit (the same operations in order).
  if (!(kcp::replay_accepted(gl, gpre, gdraft, a).state == snaps.at(static_cast<std::size_t>(a))))
    throw InvalidArgument("serving.rollback: replay and snapshot disagree for case " + c.name);

  auto stack = [&](auto pick) {
    std::vector<G> data;
    Shape shape{static_cast<std::int64_t>(snaps.size())};
    const Tensor<G>& first = pick(snaps[0]);
    shape.insert(shape.end(), first.shape().begin(), first.shape().end());
    for (const auto& s : snaps) data.insert(data.end(), pick(s).values().begin(), pick(s).values().end());
    return to_double(Tensor<G>(shape, data));
  };
  io::SafetensorsFile f;
  auto put = [&](const std::string& name, const Tensor<double>& t, DType d) { f.tensors.emplace_back(name, io::from_f64(t, d)); };
  put("conv_q", layer.conv_q, DType::BF16);
  put("conv_k", layer.conv_k, DType::BF16);
  put("conv_v", layer.conv_v, DType::BF16);
  put("A_log", *layer.A_log, DType::F32);
  put("dt_bias", *layer.dt_bias, DType::F32);
  put("pre_draft_state", pre.kda, DType::F32);
  put("pre_draft_conv_q", pre.conv_q, DType::BF16);
  put("pre_draft_conv_k", pre.conv_k, DType::BF16);
  put("pre_draft_conv_v", pre.conv_v, DType::BF16);
  for (const auto& [prefix, t] : {std::pair{"draft", &draft}, std::pair{"bonus", &bonus}}) {
    put(std::string(prefix) + "_q", t->q, DType::BF16);
    put(std::string(prefix) + "_k", t->k, DType::BF16);
    put(std::string(prefix) + "_v", t->v, DType::BF16);
    put(std::string(prefix) + "_g", t->g, DType::BF16);
    put(std::string(prefix) + "_beta", t->beta, DType::BF16);
  }
  f.tensors.emplace_back("accepted", io::from_i64(ints({a}), DType::I64));
  put("verify_o", to_double(verify.o), DType::F64);
  put("snapshot_states", stack([](const kcp::DecodeState<G>& s) -> const Tensor<G>& { return s.kda; }), DType::F64);
  put("snapshot_conv_q", stack([](const kcp::DecodeState<G>& s) -> const Tensor<G>& { return s.conv_q; }), DType::F64);
  put("snapshot_conv_k", stack([](const kcp::DecodeState<G>& s) -> const Tensor<G>& { return s.conv_k; }), DType::F64);
  put("snapshot_conv_v", stack([](const kcp::DecodeState<G>& s) -> const Tensor<G>& { return s.conv_v; }), DType::F64);
  put("rollback_state", to_double(replayed.state.kda), DType::F64);
  put("rollback_conv_q", to_double(replayed.state.conv_q), DType::F64);
  put("rollback_conv_k", to_double(replayed.state.conv_k), DType::F64);
  put("rollback_conv_v", to_double(replayed.state.conv_v), DType::F64);
  const std::int64_t row = HV * V;
  put("bonus_o",
      to_double(Tensor<G>({HV, V}, std::vector<G>(replayed.o.values().begin() + a * row, replayed.o.values().end()))),
      DType::F64);
  f.metadata = metadata_of(c, golden_float_precision(), f,
                           "verify_o,snapshot_states,snapshot_conv_q,snapshot_conv_k,snapshot_conv_v,rollback_state,"
                           "rollback_conv_q,rollback_conv_k,rollback_conv_v,bonus_o");
  return f;
}

json pool_json(std::int64_t slots, std::int64_t stride_padding, std::int64_t offset, const Shape5& s) {
  return {{"slots", slots}, {"slot_stride", s.HV * s.K * s.V + stride_padding}, {"offset", offset}};
}

io::SafetensorsFile generate_serving(const Case& c) {
  if (c.op == "serving.checkpoints") return generate_checkpoint_case(c);
  if (c.op == "serving.rollback") return generate_rollback_case(c);
  return generate_pool_case(c);
}

std::vector<Case> serving_default_cases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, const std::string& op, const json& params) {
    cases.push_back(make_case(name, op, params));
  };
  // The KDA keys and, beside them, the serving case's own (one parameter object).
  auto add_kda = [&](const std::string& name, const std::string& op, json kda, const json& own) {
    kda.update(own);
    add(name, op, kda);
  };
  // Decode: one token per sequence, as an engine's decode step; the slots named out of
  // order; unnamed slots between them. K != V everywhere, so a K/V layout swap cannot hide.
  {
    Shape5 s{4, 1, 2, 8, 12};
    add_kda("serving_decode_k_first", "serving.decode",
        kda_json(s, {0, 1, 2, 3, 4}, false, "k_first"), {{"pool", pool_json(7, 0, 0, s)},
         {"slot_of_sequence", {5, 0, 3, 6}}});
  }
  {  // V-first, a padded slot stride and a misaligned start, grouped value heads (HV = 2H).
    Shape5 s{3, 2, 4, 12, 8};
    add_kda("serving_decode_v_first_padded_gva", "serving.decode",
        kda_json(s, {0, 1, 2, 3}, false, "v_first"), {{"pool", pool_json(5, 7, 3, s)},
         {"slot_of_sequence", {4, 1, 2}}});
  }
  {  // An empty sequence (nothing read or written) and a chunked prefill of 5 tokens.
    Shape5 s{7, 1, 2, 8, 12};
    add_kda("serving_decode_empty_and_prefill", "serving.decode",
        kda_json(s, {0, 1, 1, 6, 7}, false, "k_first"), {{"pool", pool_json(6, 2, 0, s)},
         {"slot_of_sequence", {2, 0, 5, 1}}});
  }
  {  // A padded batch entry (pad_slot -1 with a token): zero outputs, no slot touched.
    Shape5 s{3, 1, 2, 8, 12};
    add_kda("serving_decode_pad_slot", "serving.decode",
        kda_json(s, {0, 1, 2, 3}, false, "k_first"), {{"pool", pool_json(4, 0, 0, s)},
         {"slot_of_sequence", {1, -1, 3}}});
  }
  {  // Kimi K3's options as the engines run them (the safe gate, beta's sigmoid and the L2 norm in
     // kernel), K != V, an empty sequence, a 3-token prefill, a padded entry, a padded stride.
    Shape5 s{5, 1, 2, 16, 8};
    const json gate = {{"gate", "lower_bound"}, {"lower_bound", -5.0}, {"g_range", {-4.0, 4.0}}, {"A_log", true},
                       {"dt_bias", true}, {"beta", "sigmoid"}, {"beta_range", {-4.0, 4.0}}, {"qk_l2norm", true}};
    add_kda("serving_decode_safe_gate_engine", "serving.decode",
        kda_json(s, {0, 1, 1, 4, 5}, false, "k_first", gate), {{"pool", pool_json(6, 3, 1, s)},
         {"slot_of_sequence", {4, 0, 2, -1}}});
  }
  // Verify: L = 4 draft tokens, accepted counts 1, 2 and L choosing the entering column.
  {
    Shape5 s{12, 1, 2, 8, 12};
    add_kda("serving_verify_accepted_1_2_L", "serving.verify",
        kda_json(s, {0, 4, 8, 12}, false, "k_first"), {{"pool", pool_json(16, 0, 0, s)},
         {"state_indices", {{3, 7, 0, 11}, {1, 12, 5, 9}, {13, 2, 8, 4}}}, {"num_accepted", {1, 2, 4}},
         {"writes", "in_place"}});
  }
  {  // V-first, padded and misaligned pool, HV = 2H, real gates; a shorter window (2 of 3
     // columns), an empty sequence, accepted count L = 3.
    Shape5 s{5, 2, 4, 12, 8};
    const json gate = {{"gate", "lower_bound"}, {"lower_bound", -5.0}, {"g_range", {-4.0, 4.0}}, {"A_log", true},
                       {"dt_bias", true}, {"beta", "sigmoid"}, {"beta_range", {-4.0, 4.0}}, {"qk_l2norm", true}};
    add_kda("serving_verify_v_first_padded_gva", "serving.verify",
        kda_json(s, {0, 3, 3, 5}, false, "v_first", gate), {{"pool", pool_json(10, 5, 2, s)},
         {"state_indices", {{6, 0, 8}, {1, 2, 3}, {9, 4, 7}}}, {"num_accepted", {3, 1, 2}}, {"writes", "in_place"}});
  }
  {  // The per-token output (FLA inplace_final_state=False): row bos + t, the pool only read.
    Shape5 s{6, 1, 2, 8, 12};
    add_kda("serving_verify_per_token_output", "serving.verify",
        kda_json(s, {0, 3, 6}, false, "k_first"), {{"pool", pool_json(6, 0, 0, s)},
         {"state_indices", {{0, 4, 2}, {5, 1, 3}}}, {"num_accepted", {3, 2}}, {"writes", "per_token_output"}});
  }
  {  // The per-token output with the softplus gate, beta's sigmoid and the L2 norm in kernel, V-first,
     // a contiguous pool at offset 1, ragged windows (3, 2, 3): SGLang's target verify.
    Shape5 s{8, 1, 2, 16, 8};
    const json gate = {{"gate", "softplus"}, {"g_range", {-4.0, 4.0}}, {"A_log", true}, {"dt_bias", true},
                       {"beta", "sigmoid"}, {"beta_range", {-4.0, 4.0}}, {"qk_l2norm", true}};
    add_kda("serving_verify_per_token_engine", "serving.verify",
        kda_json(s, {0, 3, 5, 8}, false, "v_first", gate), {{"pool", pool_json(6, 0, 1, s)},
         {"state_indices", {{2, 0, 4}, {1, 3, 5}, {5, 4, 0}}}, {"num_accepted", {2, 1, 3}},
         {"writes", "per_token_output"}});
  }
  {  // Padding: a padded sequence (entering entry -1) and a window column -1 (state not stored).
    Shape5 s{5, 1, 2, 8, 12};
    add_kda("serving_verify_pad_slots", "serving.verify",
        kda_json(s, {0, 2, 5}, false, "k_first"), {{"pool", pool_json(6, 0, 0, s)},
         {"state_indices", {{-1, 0, 1}, {2, 3, -1}}}, {"num_accepted", {1, 2}}, {"writes", "in_place"}});
  }
  // Checkpoints: every chunk (64, FLA's chunk_kda), page (16) and hash-block (32, a 512-token
  // block scaled down) boundary and its neighbours, with an initial state.
  {
    Shape5 s{130, 1, 2, 16, 8};
    add_kda("serving_checkpoints_chunk_page_hash", "serving.checkpoints",
        kda_json(s, {}, true, "k_first"), {{"blocks", {{"chunk", 64}, {"hash_block", 32}, {"page", 16}}}});
  }
  {  // V-first, FLA's chunk configuration (softplus gate, sigmoid beta, L2 norm), HV = 2H.
    Shape5 s{70, 1, 2, 16, 8};
    const json gate = {{"gate", "softplus"}, {"g_range", {-4.0, 4.0}}, {"A_log", true}, {"dt_bias", true},
                       {"beta", "sigmoid"}, {"beta_range", {-4.0, 4.0}}, {"qk_l2norm", true}};
    add_kda("serving_checkpoints_v_first_gates", "serving.checkpoints",
        kda_json(s, {}, true, "v_first", gate), {{"blocks", {{"chunk", 64}, {"page", 16}}}});
  }
  // Rollback of a 3-token draft window with 0 (every draft rejected: back to the pre-draft
  // state, then the bonus token), 1 and L = 3 draft tokens accepted.
  for (std::int64_t a : {0, 1, 3})
    add("serving_rollback_accepted_" + std::string(a == 3 ? "L" : std::to_string(a)), "serving.rollback",
        {{"H", 1}, {"HV", 2}, {"K", 8}, {"V", 12}, {"W", 4}, {"L", 3}, {"accepted", a}});
  return cases;
}

}  // namespace

Family family_serving() {
  return {"serving",
          {{"serving.decode", generate_serving, golden_float_precision(), {"recurrent"}},
           {"serving.verify", generate_serving, golden_float_precision(), {"recurrent"}},
           {"serving.checkpoints", generate_serving, golden_float_precision(), {"chunk"}},
           {"serving.rollback", generate_serving, golden_float_precision(), {"recurrent"}}},
          serving_default_cases};
}

}  // namespace k3ref::golden
