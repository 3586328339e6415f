// The Stable LatentMoE goldens (op moe.latent, docs/latent-moe.md): B batches of m tokens
// routed online (the QB bias of batch t-1 routes batch t), bf16-exact inputs, every stage
// at golden precision (num::golden_bits) rounded once to F64.
#include <cmath>
#include <string>

#include "golden/catalogue.h"
#include "k3ref/moe/latent_moe.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {
namespace {

using nlohmann::json;
using G = num::golden_float;
using num::Format;

Tensor<double> draw(num::Random& rng, const Shape& shape, double scale) {
  return draw_uniform_rounded(rng, shape, -scale, scale, Format::bf16);
}

Tensor<G> lift(const Tensor<double>& t) {
  return t.numel() == 0 ? Tensor<G>() : t.template map<G>([](double x) { return G(x); });
}

Tensor<std::int64_t> widen(const Tensor<std::int32_t>& t) {
  return t.template map<std::int64_t>([](std::int32_t x) { return std::int64_t{x}; });
}

// Rows [b * rows, (b + 1) * rows) of a [B, rows, cols] tensor as [rows, cols].
template <class T>
Tensor<T> batch_of(const Tensor<T>& t, std::int64_t b) {
  const std::int64_t rows = t.dim(1), cols = t.dim(2);
  Tensor<T> out({rows, cols});
  std::copy(t.data() + b * rows * cols, t.data() + (b + 1) * rows * cols, out.data());
  return out;
}

// Stacks per-batch [rows, cols] (or [cols]) values into [B, rows, cols] (or [B, cols]).
struct Stack {
  Shape shape;
  std::vector<double> values;
  template <class T>
  void add(const Tensor<T>& t) {
    if (shape.empty()) {
      shape = {0};
      shape.insert(shape.end(), t.shape().begin(), t.shape().end());
    }
    ++shape[0];
    for (const T& v : t.values()) {
      if constexpr (std::is_arithmetic_v<T>) values.push_back(static_cast<double>(v));
      else values.push_back(num::to_double_rne(v));
    }
  }
  template <class T>
  void add(const std::vector<T>& v) {
    add(Tensor<T>({static_cast<std::int64_t>(v.size())}, v));
  }
  Tensor<double> tensor() const { return Tensor<double>(shape, values); }
};

io::SafetensorsFile generate_latent_moe(const Case& c) {
  const json& p = c.params;
  const std::int64_t B = p.at("batches"), m = p.at("m"), d = p.at("d"), l = p.at("l"), n = p.at("n"), f = p.at("f"),
                     k = p.at("k"), fs = p.at("shared_f");
  const bool given = p.at("router") == "given";
  num::Random rng(c.seed);
  // Scales keep every pre-activation of order one: weights uniform in +-1 / sqrt(fan-in).
  auto fan = [](std::int64_t in) { return 1.0 / std::sqrt(static_cast<double>(in)); };
  io::SafetensorsFile file;
  const Tensor<double> x = draw(rng, {B, m, d}, 1.0);
  file.tensors.emplace_back("x", io::from_f64(x, DType::BF16));
  Tensor<double> affinities_in, router;
  if (given) {
    // Affinities i / (levels + 1), 1 <= i <= levels: few values, so ties are common.
    const std::int64_t levels = p.at("affinity_levels");
    affinities_in = Tensor<double>({B, m, n});
    for (double& a : affinities_in.values())
      a = static_cast<double>(1 + rng.below(static_cast<std::uint64_t>(levels))) / static_cast<double>(levels + 1);
    file.tensors.emplace_back("affinities", io::from_f64(affinities_in, DType::BF16));
  } else {
    router = draw(rng, {n, d}, 2 * fan(d));
    // Expert 2r + 1 gets the router row of expert 2r for r < duplicate_pairs: equal raw
    // affinities and equal QB biases, so only the expert index (tie rule 3) orders them.
    const std::int64_t pairs = p.at("duplicate_pairs");
    for (std::int64_t r = 0; r < pairs; ++r)
      for (std::int64_t e = 0; e < d; ++e) router(2 * r + 1, e) = router(2 * r, e);
    file.tensors.emplace_back("router", io::from_f64(router, DType::BF16));
  }
  const Tensor<double> down = draw(rng, {l, d}, fan(d)), up = draw(rng, {d, l}, fan(l));
  const Tensor<double> norm_weight = draw_uniform_rounded(rng, {l}, 0.5, 1.5, Format::bf16);
  const Tensor<double> w1 = draw(rng, {n, f, l}, 2 * fan(l)), w3 = draw(rng, {n, f, l}, 2 * fan(l)),
                       w2 = draw(rng, {n, l, f}, fan(f));
  for (const auto& [name, t] : {std::pair<const char*, const Tensor<double>*>{"down", &down}, {"up", &up},
                                {"norm_weight", &norm_weight}, {"w1", &w1}, {"w3", &w3}, {"w2", &w2}})
    file.tensors.emplace_back(name, io::from_f64(*t, DType::BF16));
  Tensor<double> shared_w1, shared_w3, shared_w2;
  if (fs > 0) {
    shared_w1 = draw(rng, {fs, d}, 2 * fan(d));
    shared_w3 = draw(rng, {fs, d}, 2 * fan(d));
    shared_w2 = draw(rng, {d, fs}, fan(fs));
    file.tensors.emplace_back("shared_w1", io::from_f64(shared_w1, DType::BF16));
    file.tensors.emplace_back("shared_w3", io::from_f64(shared_w3, DType::BF16));
    file.tensors.emplace_back("shared_w2", io::from_f64(shared_w2, DType::BF16));
  }

  moe::LatentMoeWeights<G> w{lift(router), lift(down),      lift(up),        lift(norm_weight), lift(w1),
                             lift(w3),     lift(w2),        lift(shared_w1), lift(shared_w3),   lift(shared_w2)};
  moe::LatentMoeOptions<G> opt;
  opt.k = k;
  opt.routed_scaling_factor = G(p.at("routed_scaling_factor")[0].get<std::int64_t>()) /
                              G(p.at("routed_scaling_factor")[1].get<std::int64_t>());
  opt.renormalize = p.at("renormalize");
  opt.norm = p.at("norm");
  opt.eps = G(p.at("eps").get<double>());
  opt.capacity = p.at("capacity");
  qb::OnlineOptions<G> qbo;
  qbo.iterations_per_batch = p.at("iterations_per_batch");
  std::vector<Tensor<G>> xs, as;
  for (std::int64_t b = 0; b < B; ++b) {
    xs.push_back(lift(batch_of(x, b)));
    as.push_back(given ? lift(batch_of(affinities_in, b)) : moe::router_affinities(xs.back(), w.router));
  }
  const std::string activation = p.at("activation");
  const auto routed = activation == "situ"
                          ? moe::latent_moe_online(xs, as, w, opt, qbo, moe::SituGlu{p.at("situ_beta").get<double>(), p.at("situ_linear_beta").get<double>()})
                          : moe::latent_moe_online(xs, as, w, opt, qbo, moe::SwiGlu{});

  Stack bias, affinities, selection, weights, kept, loads, kept_loads, latent, aggregate, normalised,
      routed_output, shared_output, output;
  std::vector<double> vio;
  for (std::int64_t b = 0; b < B; ++b) {
    const auto& r = routed[b];
    bias.add(r.bias);
    affinities.add(as[b]);
    selection.add(widen(r.selection));
    weights.add(r.weights);
    kept.add(r.kept.template map<std::int64_t>([](std::uint8_t v) { return std::int64_t{v}; }));
    loads.add(r.loads);
    kept_loads.add(r.kept_loads);
    vio.push_back(num::to_double_rne(qb::max_vio<G>(r.loads)));
    latent.add(r.latent);
    aggregate.add(r.aggregate);
    normalised.add(r.normalised);
    routed_output.add(r.routed_output);
    shared_output.add(r.shared_output);
    output.add(r.output);
  }
  auto ints = [](const Stack& s, DType dtype) {
    return io::from_i64(s.tensor().template map<std::int64_t>([](double v) { return static_cast<std::int64_t>(v); }), dtype);
  };
  std::string outputs = "bias,selection,weights,kept,loads,kept_loads,max_vio,latent,aggregate,normalised,routed_output,output";
  file.tensors.emplace_back("bias", io::from_f64(bias.tensor(), DType::F64));
  if (!given) {
    file.tensors.emplace_back("router_affinities", io::from_f64(affinities.tensor(), DType::F64));
    outputs += ",router_affinities";
  }
  file.tensors.emplace_back("selection", ints(selection, DType::I32));
  file.tensors.emplace_back("weights", io::from_f64(weights.tensor(), DType::F64));
  file.tensors.emplace_back("kept", ints(kept, DType::U8));
  file.tensors.emplace_back("loads", ints(loads, DType::I32));
  file.tensors.emplace_back("kept_loads", ints(kept_loads, DType::I32));
  file.tensors.emplace_back("max_vio", io::from_f64(Tensor<double>({B}, vio), DType::F64));
  for (const auto& [name, s] : {std::pair<const char*, const Stack*>{"latent", &latent}, {"aggregate", &aggregate},
                                {"normalised", &normalised}, {"routed_output", &routed_output}})
    file.tensors.emplace_back(name, io::from_f64(s->tensor(), DType::F64));
  if (fs > 0) {
    file.tensors.emplace_back("shared_output", io::from_f64(shared_output.tensor(), DType::F64));
    outputs += ",shared_output";
  }
  file.tensors.emplace_back("output", io::from_f64(output.tensor(), DType::F64));
  file.metadata = metadata_of(c, golden_float_precision(), file, outputs);
  return file;
}

struct MoeCase {
  std::int64_t batches = 3, m = 16, d = 16, l = 8, n = 8, f = 8, k = 2, shared_f = 0;
  std::string router = "sigmoid";  // or "given" (affinities on a few levels)
  std::int64_t affinity_levels = 0, duplicate_pairs = 0, capacity = 0;
  std::string activation = "swiglu";
  bool norm = true;
};

Case moe_case(const std::string& name, const MoeCase& s) {
  json p = {{"batches", s.batches},
            {"m", s.m},
            {"d", s.d},
            {"l", s.l},
            {"n", s.n},
            {"f", s.f},
            {"k", s.k},
            {"shared_f", s.shared_f},
            {"router", s.router},
            {"score_function", "sigmoid"},
            {"affinity_levels", s.affinity_levels},
            {"duplicate_pairs", s.duplicate_pairs},
            {"capacity", s.capacity},
            {"activation", s.activation},
            {"situ_beta", 4.0},
            {"situ_linear_beta", 25.0},
            {"norm", s.norm},
            {"eps", 1e-5},
            {"renormalize", true},
            {"routed_scaling_factor", {5, 2}},
            {"iterations_per_batch", 2},
            {"warm_start", true},
            {"center_bias", true},
            {"tie_rule", "biased desc, raw desc, expert index asc"},
            {"capacity_rule", "expert keeps its first routes in token order; dropped routes add nothing, no renormalisation"}};
  return make_case(name, "moe.latent", p);
}

std::vector<Case> moe_default_cases() {
  std::vector<Case> cases;
  MoeCase small;
  small.batches = 1;
  small.m = 8;
  cases.push_back(moe_case("latent_moe_m8_d16_l8_n8_k2", small));
  MoeCase online;  // QB state carried over 4 batches, a shared expert, two tied expert pairs
  online.batches = 4;
  online.shared_f = 8;  // one shared expert of the routed size, as K3 (torchtitan: num_shared_experts x f)
  online.duplicate_pairs = 2;
  cases.push_back(moe_case("latent_moe_b4_m16_d16_l8_n8_k2_shared_ties", online));
  MoeCase ties;  // affinities on 3 levels, a capacity of q: ties and dropped tokens
  ties.batches = 3;
  ties.m = 12;
  ties.n = 6;
  ties.router = "given";
  ties.affinity_levels = 3;
  ties.capacity = 4;  // q = m k / n
  cases.push_back(moe_case("latent_moe_b3_m12_n6_k2_given_ties_capacity", ties));
  MoeCase plain = small;  // without the Stable norm, SiTU-GLU
  plain.batches = 2;
  plain.norm = false;
  plain.activation = "situ";
  cases.push_back(moe_case("latent_moe_b2_m8_n8_k2_situ_no_norm", plain));
  // K3's proportions scaled down: latent = d / 2, 2x the active experts of a k = 4 layer,
  // expert intermediate f / l = 3072 / 3584 (here 56 / 64), SiTU-GLU, a shared expert.
  MoeCase k3;
  k3.batches = 2;
  k3.m = 32;
  k3.d = 128;
  k3.l = 64;
  k3.n = 64;
  k3.f = 56;
  k3.k = 8;
  k3.shared_f = 56;
  k3.activation = "situ";
  cases.push_back(moe_case("latent_moe_k3_b2_m32_d128_l64_n64_k8", k3));
  return cases;
}

}  // namespace

Family family_moe() {
  return {"moe", {{"moe.latent", generate_latent_moe, golden_float_precision(), {"latent-moe"}}}, moe_default_cases};
}

}  // namespace k3ref::golden
