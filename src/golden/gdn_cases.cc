// GDN goldens (docs/gdn.md): GDN as KDA's scalar-gate case through the recurrence
// ("gdn.recurrent"), FLA's chunkwise form ("gdn.chunkwise_fla"), the continuous-batching
// decode and the speculative verify over a state pool from the engines' packed inputs
// ("gdn.decode", "gdn.verify"), and the
// cached-replay decode ("gdn.replay_decode", serving/cached_replay.h). Reference at
// num::golden_bits bits, rounded once to F64.
//
// Parameters: the keys of a "kda.recurrent" case (gate, beta, layout, ...: every option that
// changes the values), meaning the same with the gate and dt_bias one per value head, and
// beside them the family's own (the chunk form; the pool and the slot table; the replay
// cache's ring length and the rows' tables). The decode families store what the engines'
// kernels take: mixed_qkv (q, k, v packed along the channel axis), the raw gate `a` and beta
// `b` (GDN's gating: the softplus gate with A_log and dt_bias, sigmoid beta), A_log, dt_bias.
#include <cmath>
#include <string>

#include "golden/kda_family.h"
#include "golden/pool_tensors.h"
#include "k3ref/kda/gdn.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/serving/cached_replay.h"
#include "k3ref/serving/decode.h"

namespace k3ref::golden {
namespace {

using nlohmann::json;
using num::Format;
using G = num::golden_float;

// GDN's inputs drawn in a fixed order (q, k, v, g, beta, initial_state, A_log, dt_bias) and
// rounded to the goldens' storage (bf16 values, the state bf16-exact in F32, fp32 A_log and
// dt_bias): KDA's draw with the gate and dt_bias one per value head.
kda::Inputs<double> draw_gdn_inputs(const KdaParams& p, num::Random& rng) {
  const std::int64_t N = p.cu_seqlens.empty() ? p.B : static_cast<std::int64_t>(p.cu_seqlens.size()) - 1;
  const double k_half_width = p.qk_l2norm ? 1.0 : 1.0 / std::sqrt(static_cast<double>(p.K));
  kda::Inputs<double> in;
  in.q = draw_uniform_rounded(rng, {p.B, p.T, p.H, p.K}, -1, 1, Format::bf16);
  in.k = draw_uniform_rounded(rng, {p.B, p.T, p.H, p.K}, -k_half_width, k_half_width, Format::bf16);
  in.v = draw_uniform_rounded(rng, {p.B, p.T, p.HV, p.V}, -1, 1, Format::bf16);
  in.g = draw_uniform_rounded(rng, {p.B, p.T, p.HV}, p.g_lo, p.g_hi, Format::bf16);
  in.beta = draw_uniform_rounded(rng, {p.B, p.T, p.HV}, p.beta_lo, p.beta_hi, Format::bf16);
  if (p.initial_state) {
    const bool v_first = kda::state_layouts.parse(p.state_layout) == kda::StateLayout::v_first;
    in.initial_state = draw_uniform_rounded(rng, v_first ? Shape{N, p.HV, p.V, p.K} : Shape{N, p.HV, p.K, p.V}, -1, 1,
                                            Format::bf16);
  }
  if (p.A_log) in.A_log = draw_uniform_rounded(rng, {p.HV}, 0, std::log(16.0), Format::fp32);
  if (p.dt_bias) in.dt_bias = draw_uniform_rounded(rng, {p.HV}, -1, 1, Format::fp32);
  if (!p.cu_seqlens.empty()) in.cu_seqlens = p.cu_seqlens;
  return in;
}

Tensor<double> to_double(const Tensor<G>& t) { return round_to_double(t); }
Tensor<std::int64_t> ints(const std::vector<std::int64_t>& v) {
  return Tensor<std::int64_t>({static_cast<std::int64_t>(v.size())}, v);
}
template <class S>
Tensor<S> flat(const std::vector<S>& v) {
  return Tensor<S>({static_cast<std::int64_t>(v.size())}, v);
}

// The GDN recurrence case `name` of this family's catalogue.
Case gdn_recurrence_case(const std::string& name);

io::SafetensorsFile generate_forward(const Case& c) {
  const bool chunk = c.op == "gdn.chunkwise_fla";
  const Case base = chunk ? gdn_recurrence_case(c.params.at("base_case")) : c;
  num::Random rng(base.seed);
  const kda::Inputs<double> in = draw_gdn_inputs(kda_params_from_json(base.params), rng);
  const kda::Inputs<G> lifted = kda::lift<G>(in);
  const auto opt = kda_golden_options(c.params);
  kda::Outputs<G> exact;
  if (chunk) {
    kda::ChunkwiseOptions copt;
    copt.form = kda::ChunkForm::fla;
    copt.chunk_size = c.params.at("chunk_size");
    copt.sub_chunk = c.params.at("sub_chunk");
    exact = gdn::chunkwise_forward(lifted, opt, copt).out;
  } else {
    exact = gdn::recurrent_forward(lifted, opt);
  }
  io::SafetensorsFile f;
  add_kda_inputs(f, in);
  kda::Outputs<double> out;
  out.o = to_double(exact.o);
  out.final_state = to_double(*exact.final_state);
  kda::add_outputs(f, out);
  f.metadata = metadata_of(c, golden_float_precision(), f, "o,final_state");
  return f;
}

// A pool of `slots` slots with the given stride padding and offset in the case's layout:
// bf16-exact states in [-1, 1], pool_padding elsewhere.
serving::StatePool<double> draw_gdn_pool(const json& p, std::int64_t HV, std::int64_t K, std::int64_t V,
                                         num::Random& rng) {
  const json& pj = p.at("pool");
  serving::PoolLayout L =
      serving::dense_pool_layout(pj.at("slots"), HV, K, V, kda::state_layouts.parse(p.at("state_layout").get<std::string>()));
  L.slot_stride += pj.at("stride_padding").get<std::int64_t>();
  L.offset = pj.at("offset");
  auto pool = serving::StatePool<double>::zeros(L, pool_padding);
  for (std::int64_t s = 0; s < L.slots; ++s)
    serving::write_slot(pool, s, draw_uniform_rounded(rng, {HV, K, V}, -1, 1, Format::bf16));
  return pool;
}

template <class To, class From>
Tensor<To> convert(const Tensor<From>& t) {
  return t.template map<To>([](const From& x) { return To(x); });
}
template <class To, class From>
serving::StatePool<To> convert(const serving::StatePool<From>& p) {
  return {p.layout, convert<To>(flat(p.buffer)).values()};
}

// The packed tensors of inputs [B, T, ...]: mixed_qkv, a (the raw gate), b (raw beta).
void add_packed_inputs(io::SafetensorsFile& f, const kda::Inputs<double>& in, bool rows) {
  Tensor<double> mixed = gdn::pack_mixed_qkv(in.q, in.k, in.v), a = in.g, b = in.beta;
  if (rows) {  // the replay decode's one token per row: [N, ...] without the token axis
    mixed = Tensor<double>({mixed.dim(0), mixed.dim(2)}, mixed.values());
    a = Tensor<double>({a.dim(0), a.dim(2)}, a.values());
    b = Tensor<double>({b.dim(0), b.dim(2)}, b.values());
  }
  f.tensors.emplace_back("mixed_qkv", io::from_f64(mixed, DType::BF16));
  f.tensors.emplace_back("a", io::from_f64(a, DType::BF16));
  f.tensors.emplace_back("b", io::from_f64(b, DType::BF16));
  f.tensors.emplace_back("A_log", io::from_f64(*in.A_log, DType::F32));
  f.tensors.emplace_back("dt_bias", io::from_f64(*in.dt_bias, DType::F32));
  if (in.cu_seqlens) f.tensors.emplace_back("cu_seqlens", io::from_i64(ints(*in.cu_seqlens), DType::I64));
}

io::SafetensorsFile generate_decode(const Case& c) {
  const json& p = c.params;
  const KdaParams kp = kda_params_from_json(p);
  num::Random rng(c.seed);
  const kda::Inputs<double> in = draw_gdn_inputs(kp, rng);
  const serving::StatePool<double> pool = draw_gdn_pool(p, kp.HV, kp.K, kp.V, rng);
  auto work = convert<G>(pool);
  io::SafetensorsFile f;
  add_packed_inputs(f, in, false);
  add_pool_tensors(f, pool);
  const kda::Inputs<G> run = gdn::to_kda(kda::lift<G>(in));
  Tensor<G> o;
  if (c.op == "gdn.decode") {
    const auto slots = p.at("slot_of_sequence").get<std::vector<std::int64_t>>();
    o = serving::continuous_batching_decode(run, kda_golden_options(p), work, slots);
    f.tensors.emplace_back("slot_of_sequence", io::from_i64(ints(slots), DType::I64));
  } else {  // gdn.verify, the states written in place
    const auto rows = p.at("state_indices").get<std::vector<std::vector<std::int64_t>>>();
    std::vector<std::int64_t> table;
    for (const auto& r : rows) table.insert(table.end(), r.begin(), r.end());
    const Tensor<std::int64_t> idx({static_cast<std::int64_t>(rows.size()), static_cast<std::int64_t>(rows.at(0).size())}, table);
    const auto accepted = p.at("num_accepted").get<std::vector<std::int64_t>>();
    o = serving::speculative_verify(run, kda_golden_options(p), work, idx, accepted, serving::StateWrites::in_place).o;
    f.tensors.emplace_back("state_indices", io::from_i64(idx, DType::I64));
    f.tensors.emplace_back("num_accepted", io::from_i64(ints(accepted), DType::I64));
  }
  f.tensors.emplace_back("o", io::from_f64(to_double(o), DType::F64));
  f.tensors.emplace_back("pool_out", io::from_f64(to_double(flat(work.buffer)), DType::F64));
  f.metadata = metadata_of(c, golden_float_precision(), f, "o,pool_out", "pool_geometry");
  return f;
}

// The replay decode: one token per row (B = N rows, T = 1), the checkpoints in a pool, the
// ring caches drawn whole (entries at and past a row's write position too: a kernel must
// not read them), the log gates of the cache in [-1, 0].
io::SafetensorsFile generate_replay(const Case& c) {
  const json& p = c.params;
  const KdaParams kp = kda_params_from_json(p);
  const std::int64_t L = p.at("L");
  num::Random rng(c.seed);
  const kda::Inputs<double> in = draw_gdn_inputs(kp, rng);
  const serving::StatePool<double> pool = draw_gdn_pool(p, kp.HV, kp.K, kp.V, rng);
  const std::int64_t slots = pool.layout.slots;
  // Cached keys are normalised ones when the kernel normalises: entries about K^-1/2 either way.
  const double k_half_width = 1.0 / std::sqrt(static_cast<double>(kp.K));
  const Tensor<double> d_cache = draw_uniform_rounded(rng, {slots, kp.HV, L, kp.V}, -1, 1, Format::bf16);
  const Tensor<double> k_cache = draw_uniform_rounded(rng, {slots, kp.H, L, kp.K}, -k_half_width, k_half_width, Format::bf16);
  const Tensor<double> g_cache = draw_uniform_rounded(rng, {slots, kp.HV, L}, -1, 0, Format::fp32);
  serving::ReplayCache<G> cache{convert<G>(pool), convert<G>(d_cache), convert<G>(k_cache),
                                convert<G>(Tensor<double>({slots, kp.HV, L, 1}, g_cache.values())),
                                serving::ReplayGate::log_decay};
  const auto rows = p.at("state_indices").get<std::vector<std::int64_t>>();
  const auto write_pos = p.at("write_pos").get<std::vector<std::int64_t>>();
  const Tensor<G> o = serving::cached_replay_decode(gdn::to_kda(kda::lift<G>(in)), kda_golden_options(p), cache, rows, write_pos);
  io::SafetensorsFile f;
  add_packed_inputs(f, in, true);
  add_pool_tensors(f, pool);
  f.tensors.emplace_back("d_cache", io::from_f64(d_cache, DType::BF16));
  f.tensors.emplace_back("k_cache", io::from_f64(k_cache, DType::BF16));
  f.tensors.emplace_back("g_cache", io::from_f64(g_cache, DType::F32));
  f.tensors.emplace_back("state_indices", io::from_i64(ints(rows), DType::I64));
  f.tensors.emplace_back("write_pos", io::from_i64(ints(write_pos), DType::I64));
  f.tensors.emplace_back("o", io::from_f64(to_double(Tensor<G>({o.dim(0), kp.HV, kp.V}, o.values())), DType::F64));
  f.tensors.emplace_back("pool_out", io::from_f64(to_double(flat(cache.checkpoint.buffer)), DType::F64));
  f.tensors.emplace_back("d_cache_out", io::from_f64(to_double(cache.d), DType::F64));
  f.tensors.emplace_back("k_cache_out", io::from_f64(to_double(cache.k), DType::F64));
  f.tensors.emplace_back("g_cache_out", io::from_f64(to_double(Tensor<G>({slots, kp.HV, L}, cache.g.values())), DType::F64));
  f.metadata = metadata_of(c, golden_float_precision(), f, "o,pool_out,d_cache_out,k_cache_out,g_cache_out", "pool_geometry");
  return f;
}

io::SafetensorsFile generate_gdn(const Case& c) {
  if (c.op == "gdn.decode" || c.op == "gdn.verify") return generate_decode(c);
  if (c.op == "gdn.replay_decode") return generate_replay(c);
  return generate_forward(c);
}

// GDN's own gating (the softplus gate on raw a with A_log and dt_bias, sigmoid beta), with
// the raw values in [-4, 4].
void gated(KdaParams& p) {
  p.gate = "softplus";
  p.g_lo = -4;
  p.g_hi = 4;
  p.A_log = true;
  p.dt_bias = true;
  p.beta = "sigmoid";
  p.beta_lo = -4;
  p.beta_hi = 4;
}

std::vector<Case> gdn_recurrence_cases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, auto&& configure) {
    KdaParams p;
    configure(p);
    cases.push_back(make_case(name, "gdn.recurrent", to_json(p)));
  };
  add("gdn_t1", [](KdaParams& p) { p.T = 1; p.K = 16; p.V = 8; });
  // Log decays as given (FLA's chunk_gated_delta_rule takes g so), batch, K != V.
  add("gdn_b2_t37", [](KdaParams& p) { p.B = 2; p.T = 37; p.H = 2; p.HV = 2; p.K = 32; p.V = 16; });
  add("gdn_t100_no_initial_state", [](KdaParams& p) { p.T = 100; p.K = 32; p.V = 32; p.g_lo = -2; p.initial_state = false; });
  // GDN's gating in the kernel, the L2 norm, varlen with an empty sequence, HV = 2H, V-first.
  add("gdn_gated_varlen_gva", [](KdaParams& p) {
    p.T = 45; p.H = 1; p.HV = 2; p.K = 16; p.V = 32; p.cu_seqlens = {0, 5, 5, 30, 45}; gated(p); p.qk_l2norm = true;
    p.state_layout = "v_first"; });
  return cases;
}

Case gdn_recurrence_case(const std::string& name) {
  for (Case& c : gdn_recurrence_cases())
    if (c.name == name) return c;
  throw InvalidArgument("golden: a gdn.chunkwise_fla case refers to unknown GDN recurrence case '" + name + "'");
}

std::vector<Case> gdn_default_cases() {
  std::vector<Case> cases = gdn_recurrence_cases();
  // FLA's chunk form (C = 64) on the inputs of recurrence cases: T past one chunk, varlen.
  for (const std::string base : {"gdn_t100_no_initial_state", "gdn_gated_varlen_gva", "gdn_b2_t37"}) {
    json params = gdn_recurrence_case(base).params;
    params["base_case"] = base;
    params["form"] = "fla";
    params["chunk_size"] = 64;
    params["sub_chunk"] = 16;
    cases.push_back(make_case("gdn_chunkwise_fla_c64" + base.substr(3), "gdn.chunkwise_fla", params));
  }
  auto add_serving = [&](const std::string& name, const std::string& op, auto&& configure, const json& own) {
    KdaParams p;
    p.initial_state = false;  // the pool holds the states
    gated(p);
    configure(p);
    json params = to_json(p);
    params.update(own);
    cases.push_back(make_case(name, op, params));
  };
  auto pool = [](std::int64_t slots, std::int64_t stride_padding, std::int64_t offset) {
    return json{{"slots", slots}, {"stride_padding", stride_padding}, {"offset", offset}};
  };
  // Decode, one token per sequence, slots out of order; then V-first with a padded stride, an
  // offset, HV = 2H, an empty sequence, a 5-token chunked prefill and a padded entry.
  add_serving("gdn_decode_k_first", "gdn.decode",
              [](KdaParams& p) { p.T = 4; p.K = 8; p.V = 12; p.HV = 2; p.cu_seqlens = {0, 1, 2, 3, 4}; p.qk_l2norm = true; },
              {{"pool", pool(7, 0, 0)}, {"slot_of_sequence", {5, 0, 3, 6}}});
  add_serving("gdn_decode_v_first_padded_prefill", "gdn.decode",
              [](KdaParams& p) { p.T = 7; p.H = 2; p.HV = 4; p.K = 12; p.V = 8; p.cu_seqlens = {0, 1, 1, 6, 7};
                                 p.state_layout = "v_first"; },
              {{"pool", pool(6, 5, 3)}, {"slot_of_sequence", {2, 0, 5, -1}}});
  // Speculative verify, in place: a 3-token draft window per sequence, accepted counts 1, 2
  // and L choosing the entering column, a window column -1 (that state not stored), V-first,
  // HV = 2H, a padded stride.
  add_serving("gdn_verify_accepted_1_2_L", "gdn.verify",
              [](KdaParams& p) { p.T = 9; p.H = 1; p.HV = 2; p.K = 8; p.V = 12; p.cu_seqlens = {0, 3, 6, 9};
                                 p.qk_l2norm = true; p.state_layout = "v_first"; },
              {{"pool", pool(10, 3, 0)}, {"state_indices", {{3, 7, 0}, {1, 4, -1}, {8, 2, 9}}}, {"num_accepted", {1, 2, 3}}});
  // The replay decode: rows at write positions 0, a middle one and L - 1 (the flush), padded
  // rows (state index 0 and -1) among them, slots named out of order, one slot not named.
  // The engines' layout (V-first checkpoints, L2 norm in the kernel), then K-first with HV = 2H.
  add_serving("gdn_replay_decode_v_first", "gdn.replay_decode",
              [](KdaParams& p) { p.B = 6; p.T = 1; p.HV = 2; p.K = 8; p.V = 12; p.qk_l2norm = true; p.state_layout = "v_first"; },
              {{"pool", pool(6, 0, 0)}, {"L", 4}, {"state_indices", {3, 0, 5, 1, -1, 2}}, {"write_pos", {0, 2, 3, 1, 0, 2}}});
  add_serving("gdn_replay_decode_k_first_gva", "gdn.replay_decode",
              [](KdaParams& p) { p.B = 4; p.T = 1; p.H = 2; p.HV = 4; p.K = 8; p.V = 4; },
              {{"pool", pool(5, 0, 0)}, {"L", 3}, {"state_indices", {4, -1, 2, 1}}, {"write_pos", {2, 1, 0, 1}}});
  // Shaped as the engines' kernels take them: a contiguous V-first pool (TokenSpeed addresses page i
  // at i HV V K) with a padded entry; a K-first verify of equal windows (vLLM's pool, TokenSpeed's
  // dense MTP batch) without padding; a replay with K = 32 (vLLM's tl.dot needs K/2 >= 16), a
  // padded slot stride and an offset.
  add_serving("gdn_decode_v_first_engine", "gdn.decode",
              [](KdaParams& p) { p.T = 4; p.K = 16; p.V = 8; p.HV = 2; p.cu_seqlens = {0, 1, 2, 3, 4}; p.qk_l2norm = true;
                                 p.state_layout = "v_first"; },
              {{"pool", pool(6, 0, 2)}, {"slot_of_sequence", {3, -1, 0, 5}}});
  add_serving("gdn_verify_k_first_engine", "gdn.verify",
              [](KdaParams& p) { p.T = 9; p.H = 1; p.HV = 2; p.K = 16; p.V = 8; p.cu_seqlens = {0, 3, 6, 9};
                                 p.qk_l2norm = true; },
              {{"pool", pool(10, 2, 0)}, {"state_indices", {{3, 7, 0}, {1, 4, 6}, {8, 2, 9}}}, {"num_accepted", {1, 2, 3}}});
  add_serving("gdn_replay_decode_engine", "gdn.replay_decode",
              [](KdaParams& p) { p.B = 5; p.T = 1; p.HV = 2; p.K = 32; p.V = 16; p.qk_l2norm = true; p.state_layout = "v_first"; },
              {{"pool", pool(6, 3, 1)}, {"L", 4}, {"state_indices", {3, 0, 5, -1, 2}}, {"write_pos", {0, 2, 3, 1, 1}}});
  return cases;
}

}  // namespace

Family family_gdn() {
  return {"gdn",
          {{"gdn.recurrent", generate_gdn, golden_float_precision(), {"recurrent", "chunk"}},
           {"gdn.chunkwise_fla", generate_gdn, golden_float_precision(), {"chunk"}},
           {"gdn.decode", generate_gdn, golden_float_precision(), {"recurrent"}},
           {"gdn.verify", generate_gdn, golden_float_precision(), {"recurrent"}},
           {"gdn.replay_decode", generate_gdn, golden_float_precision(), {"recurrent"}}},
          gdn_default_cases};
}

}  // namespace k3ref::golden
