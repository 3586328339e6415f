// KDA layer goldens (docs/kda-layer.md): the whole mixer from hidden states to hidden states
// ("layer.kda": prefill over documents, with cu_seqlens or an attention mask), its fused
// decode over a state pool and a conv pool ("layer.kda_decode") and its target verify with
// per-token state and conv tapes ("layer.kda_verify"). Reference at num::golden_bits bits
// through include/k3ref/layer/kda_layer.h, rounded once to F64.
//
// Every option that changes a value is a parameter of the case (the layer's sizes, which
// pieces are present, the gate, beta and norm forms, the documents, the mask, the pools and
// slot tables), and every weight is a tensor of the file: a reader rebuilds the layer from
// the file and its parameters alone. Weights and hidden states are bf16 values (A_log and
// dt_bias fp32, states fp32 holding bf16 values), drawn in the order of draw_weights.
#include <cmath>
#include <string>

#include "golden/kda_family.h"
#include "k3ref/layer/kda_layer.h"

namespace k3ref::golden {
namespace {

using nlohmann::json;
using num::Format;
using G = num::golden_float;

struct LayerParams {
  std::int64_t D, H, HV, K, V, W;  // W = 0: no short convolution
  bool conv_bias, A_log, dt_bias, norm_weight, output_norm, g_bias;
  std::int64_t f_rank, g_rank;     // 0: full rank; g_rank -1: no output gate
  std::string gate, beta, activation;
  bool qk_l2norm;
  std::optional<double> lower_bound;
};

LayerParams layer_params(const json& p) {
  LayerParams l;
  l.D = p.at("D");
  l.H = p.at("H");
  l.HV = p.at("HV");
  l.K = p.at("K");
  l.V = p.at("V");
  l.W = p.at("conv_size");
  l.conv_bias = p.at("conv_bias");
  l.A_log = p.at("A_log");
  l.dt_bias = p.at("dt_bias");
  l.norm_weight = p.at("norm_weight");
  l.output_norm = p.at("output_norm");
  l.g_bias = p.at("g_bias");
  l.f_rank = p.at("f_rank");
  l.g_rank = p.at("g_rank");
  l.gate = p.at("gate");
  l.beta = p.at("beta");
  l.activation = p.at("activation");
  l.qk_l2norm = p.at("qk_l2norm");
  if (p.at("norm_eps") != 1e-5) throw InvalidArgument("layer.kda: only FLA's norm_eps 1e-5 (held exactly) is generated");
  if (!p.at("lower_bound").is_null()) l.lower_bound = p.at("lower_bound").get<double>();
  return l;
}

// The weights, drawn in this order; each a bf16 value (A_log, dt_bias fp32).
layer::Weights<double> draw_weights(const LayerParams& l, num::Random& rng) {
  auto bf16 = [&](const Shape& s, double lo, double hi) { return draw_uniform_rounded(rng, s, lo, hi, Format::bf16); };
  auto fp32 = [&](const Shape& s, double lo, double hi) { return draw_uniform_rounded(rng, s, lo, hi, Format::fp32); };
  const double in = 1.0 / std::sqrt(static_cast<double>(l.D));  // nn.Linear's init range
  const std::int64_t HK = l.H * l.K, HVV = l.HV * l.V;
  layer::Weights<double> w;
  w.q_proj = bf16({HK, l.D}, -in, in);
  w.k_proj = bf16({HK, l.D}, -in, in);
  w.v_proj = bf16({HVV, l.D}, -in, in);
  if (l.W > 0) {
    w.q_conv = bf16({HK, l.W}, -0.5, 0.5);
    w.k_conv = bf16({HK, l.W}, -0.5, 0.5);
    w.v_conv = bf16({HVV, l.W}, -0.5, 0.5);
    if (l.conv_bias) {
      w.q_conv_bias = bf16({HK}, -0.5, 0.5);
      w.k_conv_bias = bf16({HK}, -0.5, 0.5);
      w.v_conv_bias = bf16({HVV}, -0.5, 0.5);
    }
  }
  if (l.f_rank > 0) w.f_a = bf16({l.f_rank, l.D}, -in, in);
  const double f_in = 1.0 / std::sqrt(static_cast<double>(l.f_rank > 0 ? l.f_rank : l.D));
  w.f_b = bf16({l.HV * l.K, l.f_rank > 0 ? l.f_rank : l.D}, -f_in, f_in);
  w.b_proj = bf16({l.HV, l.D}, -2 * in, 2 * in);
  if (l.A_log) w.A_log = fp32({l.HV}, 0, std::log(16.0));
  if (l.dt_bias) w.dt_bias = fp32({l.HV * l.K}, -1, 1);
  if (l.g_rank >= 0) {
    if (l.g_rank > 0) w.g_a = bf16({l.g_rank, l.D}, -in, in);
    const double g_in = 1.0 / std::sqrt(static_cast<double>(l.g_rank > 0 ? l.g_rank : l.D));
    w.g_b = bf16({HVV, l.g_rank > 0 ? l.g_rank : l.D}, -g_in, g_in);
    if (l.g_bias) w.g_bias = bf16({HVV}, -1, 1);
  }
  if (l.norm_weight) w.norm_weight = bf16({l.V}, 0.5, 1.5);
  w.o_proj = bf16({l.D, HVV}, -1.0 / std::sqrt(static_cast<double>(HVV)), 1.0 / std::sqrt(static_cast<double>(HVV)));
  return w;
}

template <class S>
Tensor<S> up(const Tensor<double>& t) {
  return t.map<S>([](double x) { return S(x); });
}
template <class S>
std::optional<Tensor<S>> up(const std::optional<Tensor<double>>& t) {
  return t ? std::optional<Tensor<S>>(up<S>(*t)) : std::nullopt;
}

layer::Weights<G> lift_weights(const layer::Weights<double>& w) {
  return layer::Weights<G>{up<G>(w.q_proj), up<G>(w.k_proj), up<G>(w.v_proj), up<G>(w.q_conv), up<G>(w.k_conv),
                           up<G>(w.v_conv), up<G>(w.q_conv_bias), up<G>(w.k_conv_bias), up<G>(w.v_conv_bias),
                           up<G>(w.f_a), up<G>(w.f_b), up<G>(w.b_proj), up<G>(w.A_log), up<G>(w.dt_bias),
                           up<G>(w.g_a), up<G>(w.g_b), up<G>(w.g_bias), up<G>(w.norm_weight), up<G>(w.o_proj)};
}

layer::Options<G> layer_options(const LayerParams& l) {
  layer::Options<G> o;
  o.H = l.H;
  o.HV = l.HV;
  o.gate = kda::gate_forms.parse(l.gate);
  if (l.lower_bound) o.lower_bound = G(*l.lower_bound);
  o.beta = kda::beta_forms.parse(l.beta);
  o.output_norm = l.output_norm;
  o.qk_l2norm = l.qk_l2norm;
  o.activation = l.activation == "silu" ? layer::ConvActivation::silu : layer::ConvActivation::none;
  return o;  // norm_eps: the default 1e-5, exact
}

void add_weights(io::SafetensorsFile& f, const layer::Weights<double>& w) {
  auto put = [&](const char* name, const std::optional<Tensor<double>>& t, DType d) {
    if (t) f.tensors.emplace_back(name, io::from_f64(*t, d));
  };
  const auto B = DType::BF16;
  put("q_proj", w.q_proj, B);
  put("k_proj", w.k_proj, B);
  put("v_proj", w.v_proj, B);
  put("q_conv", w.q_conv, B);
  put("k_conv", w.k_conv, B);
  put("v_conv", w.v_conv, B);
  put("q_conv_bias", w.q_conv_bias, B);
  put("k_conv_bias", w.k_conv_bias, B);
  put("v_conv_bias", w.v_conv_bias, B);
  put("f_a", w.f_a, B);
  put("f_b", w.f_b, B);
  put("b_proj", w.b_proj, B);
  put("A_log", w.A_log, DType::F32);
  put("dt_bias", w.dt_bias, DType::F32);
  put("g_a", w.g_a, B);
  put("g_b", w.g_b, B);
  put("g_bias", w.g_bias, B);
  put("norm_weight", w.norm_weight, B);
  put("o_proj", w.o_proj, B);
}

Tensor<std::int64_t> ints(const std::vector<std::int64_t>& v) {
  return Tensor<std::int64_t>({static_cast<std::int64_t>(v.size())}, v);
}
Tensor<double> flat(const std::vector<G>& b) { return round_to_double(Tensor<G>({static_cast<std::int64_t>(b.size())}, b)); }

io::SafetensorsFile generate_forward(const Case& c, const LayerParams& l, num::Random& rng, const layer::Weights<double>& w) {
  const json& p = c.params;
  const std::int64_t B = p.at("B"), T = p.at("T"), C = 2 * l.H * l.K + l.HV * l.V, M = std::max<std::int64_t>(l.W - 1, 0);
  const Tensor<double> x = draw_uniform_rounded(rng, {B, T, l.D}, -1, 1, Format::bf16);
  std::optional<std::vector<std::int64_t>> cu;
  if (!p.at("cu_seqlens").is_null()) cu = p.at("cu_seqlens").get<std::vector<std::int64_t>>();
  std::optional<Tensor<std::int64_t>> mask;
  if (!p.at("attention_mask").is_null()) {
    std::vector<std::int64_t> m;
    for (const auto& row : p.at("attention_mask")) m.insert(m.end(), row.begin(), row.end());
    mask = Tensor<std::int64_t>({B, T}, m);
  }
  const std::int64_t N = cu ? static_cast<std::int64_t>(cu->size()) - 1 : B;
  std::optional<layer::LayerState<double>> initial;
  if (p.at("initial_state"))
    initial = layer::LayerState<double>{draw_uniform_rounded(rng, {N, l.HV, l.K, l.V}, -1, 1, Format::bf16),
                                        draw_uniform_rounded(rng, {N, C, M}, -1, 1, Format::bf16)};
  std::optional<layer::LayerState<G>> initial_g;
  if (initial) initial_g = layer::LayerState<G>{up<G>(initial->recurrent), up<G>(initial->conv)};
  const auto out = layer::kda_layer_forward(up<G>(x), lift_weights(w), layer_options(l), initial_g, cu, mask);
  io::SafetensorsFile f;
  add_weights(f, w);
  f.tensors.emplace_back("hidden_states", io::from_f64(x, DType::BF16));
  if (cu) f.tensors.emplace_back("cu_seqlens", io::from_i64(ints(*cu), DType::I64));
  if (mask) f.tensors.emplace_back("attention_mask", io::from_i64(*mask, DType::I64));
  if (initial) {
    f.tensors.emplace_back("initial_state", io::from_f64(initial->recurrent, DType::F32));
    f.tensors.emplace_back("initial_conv_state", io::from_f64(initial->conv, DType::F32));
  }
  f.tensors.emplace_back("y", io::from_f64(round_to_double(out.y), DType::F64));
  f.tensors.emplace_back("final_state", io::from_f64(round_to_double(out.final.recurrent), DType::F64));
  f.tensors.emplace_back("final_conv_state", io::from_f64(round_to_double(out.final.conv), DType::F64));
  f.metadata = metadata_of(c, golden_float_precision(), f, "y,final_state,final_conv_state");
  return f;
}

// Decode and verify: the pools (dense slots; K-first or V-first), the tokens, the tables.
io::SafetensorsFile generate_pooled(const Case& c, const LayerParams& l, num::Random& rng, const layer::Weights<double>& w) {
  const json& p = c.params;
  const std::int64_t slots = p.at("slots"), C = 2 * l.H * l.K + l.HV * l.V, M = std::max<std::int64_t>(l.W - 1, 0);
  const auto cu = p.at("cu_seqlens").get<std::vector<std::int64_t>>();
  const auto layout = kda::state_layouts.parse(p.at("state_layout").get<std::string>());
  serving::StatePool<double> pool = serving::StatePool<double>::zeros(serving::dense_pool_layout(slots, l.HV, l.K, l.V, layout));
  for (std::int64_t s = 0; s < slots; ++s)
    serving::write_slot(pool, s, draw_uniform_rounded(rng, {l.HV, l.K, l.V}, -1, 1, Format::bf16));
  const Tensor<double> conv_pool = draw_uniform_rounded(rng, {slots, C, M}, -1, 1, Format::bf16);
  const Tensor<double> x = draw_uniform_rounded(rng, {cu.back(), l.D}, -1, 1, Format::bf16);
  serving::StatePool<G> gpool{pool.layout, {}};
  for (double v : pool.buffer) gpool.buffer.push_back(G(v));
  Tensor<G> gconv = up<G>(conv_pool);
  io::SafetensorsFile f;
  add_weights(f, w);
  f.tensors.emplace_back("hidden_states", io::from_f64(x, DType::BF16));
  f.tensors.emplace_back("cu_seqlens", io::from_i64(ints(cu), DType::I64));
  f.tensors.emplace_back("pool", io::from_f64(Tensor<double>({static_cast<std::int64_t>(pool.buffer.size())}, pool.buffer), DType::F32));
  f.tensors.emplace_back("pool_geometry", io::from_i64(ints({slots, pool.layout.slot_stride, 0, layout == kda::StateLayout::v_first}),
                                                       DType::I64));
  f.tensors.emplace_back("conv_pool", io::from_f64(conv_pool, DType::F32));
  std::string outputs;
  if (c.op == "layer.kda_decode") {
    const auto slot_of = p.at("slot_of_sequence").get<std::vector<std::int64_t>>();
    f.tensors.emplace_back("slot_of_sequence", io::from_i64(ints(slot_of), DType::I64));
    const Tensor<G> y = layer::kda_layer_decode(up<G>(x), lift_weights(w), layer_options(l), gpool, gconv, cu, slot_of);
    f.tensors.emplace_back("y", io::from_f64(round_to_double(y), DType::F64));
    outputs = "y";
  } else {
    const VerifyTables tables = verify_tables(p);
    const Tensor<std::int64_t>& idx = tables.state_indices;
    const std::vector<std::int64_t>& accepted = tables.num_accepted;
    const auto writes = tables.in_place ? serving::StateWrites::in_place : serving::StateWrites::per_token_output;
    f.tensors.emplace_back("state_indices", io::from_i64(idx, DType::I64));
    f.tensors.emplace_back("num_accepted", io::from_i64(ints(accepted), DType::I64));
    const auto out = layer::kda_layer_verify(up<G>(x), lift_weights(w), layer_options(l), gpool, gconv, cu, idx, accepted, writes);
    f.tensors.emplace_back("y", io::from_f64(round_to_double(out.y), DType::F64));
    outputs = "y";
    if (out.token_states) {
      f.tensors.emplace_back("token_states", io::from_f64(round_to_double(*out.token_states), DType::F64));
      f.tensors.emplace_back("conv_tape", io::from_f64(round_to_double(*out.conv_tape), DType::F64));
      outputs += ",token_states,conv_tape";
    }
  }
  f.tensors.emplace_back("pool_out", io::from_f64(flat(gpool.buffer), DType::F64));
  f.tensors.emplace_back("conv_pool_out", io::from_f64(round_to_double(gconv), DType::F64));
  f.metadata = metadata_of(c, golden_float_precision(), f, outputs + ",pool_out,conv_pool_out", "pool_geometry");
  return f;
}

io::SafetensorsFile generate_layer(const Case& c) {
  const LayerParams l = layer_params(c.params);
  num::Random rng(c.seed);
  const layer::Weights<double> w = draw_weights(l, rng);
  if (c.op == "layer.kda") return generate_forward(c, l, rng, w);
  return generate_pooled(c, l, rng, w);
}

// FLA KimiDeltaAttention's defaults at small sizes: short conv (width 4, no bias), low-rank
// gate f_b(f_a(x)) of rank V, softplus gate with A_log and dt_bias, sigmoid beta, L2 norm,
// gated RMSNorm (weight, sigmoid gate of rank V with bias), output projection.
json fla_layer(std::int64_t D, std::int64_t H, std::int64_t HV, std::int64_t K, std::int64_t V) {
  return {{"D", D}, {"H", H}, {"HV", HV}, {"K", K}, {"V", V}, {"conv_size", 4}, {"conv_bias", false},
          {"f_rank", V}, {"g_rank", V}, {"g_bias", true}, {"A_log", true}, {"dt_bias", true},
          {"norm_weight", true}, {"output_norm", true}, {"gate", "softplus"}, {"lower_bound", nullptr},
          {"beta", "sigmoid"}, {"qk_l2norm", true}, {"activation", "silu"}, {"norm_eps", 1e-5}};
}
// K3's choices: the lower-bound gate at -5.
json k3_layer(std::int64_t D, std::int64_t H, std::int64_t HV, std::int64_t K, std::int64_t V) {
  json j = fla_layer(D, H, HV, K, V);
  j["gate"] = "lower_bound";
  j["lower_bound"] = -5.0;
  return j;
}

json with(json base, const json& more) {
  base.update(more);
  return base;
}

std::vector<Case> layer_default_cases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, const std::string& op, const json& params) {
    cases.push_back(make_case(name, op, params));
  };
  auto batch = [](std::int64_t B, std::int64_t T, bool initial) {
    return json{{"B", B}, {"T", T}, {"cu_seqlens", nullptr}, {"attention_mask", nullptr}, {"initial_state", initial}};
  };
  auto packed = [](const std::vector<std::int64_t>& cu, bool initial) {
    return json{{"B", 1}, {"T", cu.back()}, {"cu_seqlens", cu}, {"attention_mask", nullptr}, {"initial_state", initial}};
  };
  // Prefill. FLA's layer, two rows, no states.
  add("kda_layer_fla_b2", "layer.kda", with(fla_layer(16, 2, 2, 8, 8), batch(2, 9, false)));
  // torchtitan's KimiDeltaAttention (kimi_k3/model.py): H = HV, K = V, the low-rank output
  // gate without a bias (its g_b_proj has none), K3's lower-bound gate; two rows, no states
  // (its forward reads neither cu_seqlens nor a cache).
  add("kda_layer_torchtitan_b2", "layer.kda", with(with(k3_layer(16, 2, 2, 8, 8), {{"g_bias", false}}), batch(2, 9, false)));
  // GVA (HV = 3H), K != V, K3's gate, conv bias, allow_neg_eigval (2 sigmoid beta), entering
  // states, documents of 0, 1, 5, 0 and 5 tokens.
  add("kda_layer_gva_varlen_states", "layer.kda",
      with(with(k3_layer(16, 1, 3, 8, 4), {{"conv_bias", true}, {"beta", "two_sigmoid"}}),
           packed({0, 0, 1, 6, 6, 11}, true)));
  // An all-ones attention mask with packed cu_seqlens: the mask is not read (a layer that
  // derives cu_seqlens from it runs one document across the boundaries).
  {
    json p = with(k3_layer(16, 2, 4, 8, 4), packed({0, 5, 6, 13}, true));
    p["attention_mask"] = json::array({std::vector<std::int64_t>(13, 1)});
    add("kda_layer_all_ones_mask_with_cu_seqlens", "layer.kda", p);
  }
  // A padding mask without cu_seqlens (left and inner padding): each row's tokens one document.
  {
    json p = with(fla_layer(16, 1, 2, 8, 8), batch(2, 6, false));
    p["attention_mask"] = {{0, 0, 1, 1, 1, 1}, {1, 1, 1, 0, 1, 0}};
    add("kda_layer_padding_mask", "layer.kda", p);
  }
  // The optional pieces off: no short conv (SiLU on the projections), full-rank gate, no
  // A_log (lower bound without it), no dt_bias, no output gate, no norm weight.
  add("kda_layer_no_conv_full_rank", "layer.kda",
      with(k3_layer(12, 1, 2, 8, 4), with({{"conv_size", 0}, {"f_rank", 0}, {"g_rank", -1}, {"g_bias", false},
                                           {"A_log", false}, {"dt_bias", false}, {"norm_weight", false}},
                                          packed({0, 3, 10}, true))));
  // Decode: one token per sequence, slots out of order, a padded lane (-1), an empty
  // sequence, V-first pool (FLA's layer keeps V-first states).
  auto pooled = [](std::int64_t slots, const std::vector<std::int64_t>& cu, const std::string& layout) {
    return json{{"slots", slots}, {"cu_seqlens", cu}, {"state_layout", layout}};
  };
  add("kda_layer_decode_gva_pad_lane", "layer.kda_decode",
      with(k3_layer(16, 1, 2, 8, 4), with(pooled(6, {0, 1, 2, 2, 3, 4}, "v_first"), {{"slot_of_sequence", {4, -1, 0, 2, 5}}})));
  // A chunked prefill of 4 tokens beside a decode token, K-first pool, FLA's gate.
  add("kda_layer_decode_chunked_prefill", "layer.kda_decode",
      with(fla_layer(16, 2, 2, 8, 8), with(pooled(4, {0, 4, 5}, "k_first"), {{"slot_of_sequence", {3, 1}}})));
  // Verify of a 3-token window in place: accepted counts 1, 3 and 2 pick the entering
  // columns; a -1 column stores nothing; a padded lane.
  add("kda_layer_verify_in_place", "layer.kda_verify",
      with(k3_layer(16, 1, 2, 8, 4),
           with(pooled(12, {0, 3, 6, 9, 12}, "v_first"),
                {{"state_indices", {{0, 1, 2}, {3, 4, 5}, {6, 7, -1}, {-1, 9, 10}}}, {"num_accepted", {1, 3, 2, 1}},
                 {"writes", "in_place"}})));
  // Verify with per-token tapes (the pools only read): the rows a rollback takes.
  add("kda_layer_verify_per_token_tapes", "layer.kda_verify",
      with(k3_layer(16, 2, 4, 8, 4),
           with(pooled(6, {0, 4, 6}, "k_first"),
                {{"state_indices", {{1, 2, 3, 4}, {5, 0, -1, -1}}}, {"num_accepted", {2, 1}}, {"writes", "per_token_output"}})));
  return cases;
}

}  // namespace

Family family_kda_layer() {
  return {"kda_layer",
          {{"layer.kda", generate_layer, golden_float_precision(), {"kda-layer"}},
           {"layer.kda_decode", generate_layer, golden_float_precision(), {"kda-layer"}},
           {"layer.kda_verify", generate_layer, golden_float_precision(), {"kda-layer"}}},
          layer_default_cases};
}

}  // namespace k3ref::golden
