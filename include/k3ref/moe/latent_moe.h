// Stable LatentMoE, the routed-expert layer of K3, with the router bias from Quantile
// Balancing (docs/latent-moe.md).
//
// For a token x (width d), with n routed experts of intermediate size f acting in a latent
// of width l:
//
//   s      = sigmoid(W_r x)                    affinities [n]; the router reads the FULL x
//   E      = top-k of s - beta                 qb::route and its tie rule (docs/qb.md)
//   w_j    = c s_j / sum_{j' in E} s_j'        from the unbiased s (c = routed scaling factor;
//                                              without renormalisation w_j = c s_j)
//   u      = W_down x                          latent [l]
//   a      = sum_{j in E, kept} w_j E_j(u)     E_j(u) = W2_j glu(W1_j u, W3_j u)
//   y      = W_up RMSNorm(a) + S(x)            Stable: the norm of the AGGREGATE, before up;
//                                              S the shared expert at full width (optional)
//
// beta is the expert bias in k3ref's sign (selection by s - beta; torchtitan's
// expert_bias_E is -beta). It changes the selection only, never the weight of a selected
// expert. Capacity (0: none, as in torchtitan's dropless layer): expert j keeps its first
// `capacity` routes in token order; a dropped route adds nothing and the token's other
// weights are not renormalised.
//
// The transcendental points (the GLU's activation, the norm's square root) are a policy, as
// in attnres: SwiGlu and SituGlu with std math for double and high_precision<Bits>;
// BilinearGlu (glu(g, u) = g u) keeps every stage rational, so the plumbing (routing,
// capacity, aggregation, projections) is tested with == in num::rational with the norm off.
// The router's sigmoid is a separate stage (router_affinities): the layer takes affinities,
// so exact tests give them directly.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "k3ref/error.h"
#include "k3ref/qb/online.h"
#include "k3ref/qb/solver.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::moe {

// glu(g, u) = silu(g) u = g sigmoid(g) u.
struct SwiGlu {
  template <class S>
  S glu(const S& gate, const S& up) const {
    return gate * qb::sigmoid(gate) * up;
  }
  template <class S>
  S sqrt(const S& x) const {
    using std::sqrt;
    return sqrt(x);
  }
};

// K3's SiTU-GLU: glu(g, u) = b tanh(g / b) sigmoid(g) * b2 tanh(u / b2) (b2 = 0: the
// linear branch unclipped).
struct SituGlu {
  double beta = 4.0, linear_beta = 25.0;
  template <class S>
  S glu(const S& gate, const S& up) const {
    using std::tanh;
    const S b(beta), b2(linear_beta);
    const S clipped_up = linear_beta > 0 ? b2 * tanh(up / b2) : up;
    return b * tanh(gate / b) * qb::sigmoid(gate) * clipped_up;
  }
  template <class S>
  S sqrt(const S& x) const {
    using std::sqrt;
    return sqrt(x);
  }
};

// glu(g, u) = g u: no transcendental, so every stage but the norm is exact in rationals.
struct BilinearGlu {
  template <class S>
  S glu(const S& gate, const S& up) const {
    return gate * up;
  }
};

template <class S>
struct LatentMoeWeights {
  Tensor<S> router;       // [n, d]   W_r
  Tensor<S> down;         // [l, d]   W_down
  Tensor<S> up;           // [d, l]   W_up
  Tensor<S> norm_weight;  // [l]      RMSNorm gain (unused without the norm)
  Tensor<S> w1, w3;       // [n, f, l] gate and up of each expert
  Tensor<S> w2;           // [n, l, f] down of each expert
  // The shared expert at full width, empty when there is none: [fs, d], [fs, d], [d, fs].
  Tensor<S> shared_w1, shared_w3, shared_w2;

  std::int64_t experts() const { return w1.dim(0); }
  bool has_shared() const { return shared_w1.numel() > 0; }
};

template <class S>
struct LatentMoeOptions {
  std::int64_t k = 1;
  S routed_scaling_factor = S(1);
  bool renormalize = true;    // w_j = c s_j / sum over the selection (torchtitan's route_norm)
  bool norm = true;           // Stable LatentMoE: RMSNorm of the aggregate before W_up
  S eps = S(1) / S(100000);   // RMSNorm's epsilon (1e-5 in S)
  std::int64_t capacity = 0;  // routes per expert; 0: no capacity (dropless)
};

// Every stage of one batch of m tokens.
template <class S>
struct LatentMoeResult {
  std::vector<S> bias;              // [n] beta that routed the batch
  Tensor<std::int32_t> selection;   // [m, k] best first (the tie rule)
  Tensor<S> weights;                // [m, k]
  Tensor<std::uint8_t> kept;        // [m, k] 1 unless dropped by capacity
  std::vector<std::int64_t> loads;  // [n] routes selected per expert (before capacity)
  std::vector<std::int64_t> kept_loads;  // [n] routes computed per expert (after capacity)
  Tensor<S> latent;                 // [m, l] W_down x
  Tensor<S> aggregate;              // [m, l] sum of the kept weighted expert outputs
  Tensor<S> normalised;             // [m, l] RMSNorm(aggregate) (= aggregate without the norm)
  Tensor<S> routed_output;          // [m, d] W_up normalised
  Tensor<S> shared_output;          // [m, d] the shared expert (zero without one)
  Tensor<S> output;                 // [m, d] routed + shared
};

// x [m, a] times w^T, w [b, a]: [m, b]. Sums in index order.
template <class S>
Tensor<S> linear(const Tensor<S>& x, const Tensor<S>& w) {
  if (x.rank() != 2 || w.rank() != 2 || x.dim(1) != w.dim(1))
    throw InvalidArgument("moe::linear: shapes " + shape_to_string(x.shape()) + " and " + shape_to_string(w.shape()) +
                          " do not compose (x [m, a], w [b, a])");
  const std::int64_t m = x.dim(0), a = x.dim(1), b = w.dim(0);
  Tensor<S> out({m, b});
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t o = 0; o < b; ++o) {
      S acc(0);
      for (std::int64_t e = 0; e < a; ++e) acc += x.data()[i * a + e] * w.data()[o * a + e];
      out(i, o) = acc;
    }
  return out;
}

// s = sigmoid(x W_r^T): [m, n] (floating tiers only).
template <class S>
Tensor<S> router_affinities(const Tensor<S>& x, const Tensor<S>& router) {
  return qb::sigmoid_scores(linear(x, router));
}

// One GLU expert on one input row: W2 glu(W1 v, W3 v), with W1, W3 [f, a] and W2 [a', f]
// given as row-major pointers.
template <class S, class Math>
std::vector<S> glu_expert(const S* v, std::int64_t a, const S* w1, const S* w3, const S* w2, std::int64_t f,
                          std::int64_t out_width, const Math& math) {
  std::vector<S> hidden(static_cast<std::size_t>(f));
  for (std::int64_t h = 0; h < f; ++h) {
    S gate(0), up(0);
    for (std::int64_t e = 0; e < a; ++e) {
      gate += w1[h * a + e] * v[e];
      up += w3[h * a + e] * v[e];
    }
    hidden[h] = math.glu(gate, up);
  }
  std::vector<S> out(static_cast<std::size_t>(out_width), S(0));
  for (std::int64_t o = 0; o < out_width; ++o) {
    S acc(0);
    for (std::int64_t h = 0; h < f; ++h) acc += w2[o * f + h] * hidden[h];
    out[o] = acc;
  }
  return out;
}

// g ⊙ a / sqrt(mean(a²) + eps) per row.
template <class S, class Math>
Tensor<S> rms_norm(const Tensor<S>& a, const Tensor<S>& gain, const S& eps, const Math& math) {
  const std::int64_t m = a.dim(0), l = a.dim(1);
  if (gain.numel() != l) throw InvalidArgument("moe::rms_norm: gain has " + std::to_string(gain.numel()) + " entries, rows " + std::to_string(l));
  Tensor<S> out({m, l});
  for (std::int64_t i = 0; i < m; ++i) {
    S ms(0);
    for (std::int64_t e = 0; e < l; ++e) ms += a(i, e) * a(i, e);
    const S inv = S(1) / math.sqrt(ms / S(l) + eps);
    for (std::int64_t e = 0; e < l; ++e) out(i, e) = gain.data()[e] * (a(i, e) * inv);
  }
  return out;
}

// Capacity: expert j keeps its first `capacity` routes in token order (0: keeps all).
inline Tensor<std::uint8_t> capacity_mask(const Tensor<std::int32_t>& selection, std::int64_t n, std::int64_t capacity) {
  const std::int64_t m = selection.dim(0), k = selection.dim(1);
  Tensor<std::uint8_t> kept({m, k}, std::uint8_t{1});
  if (capacity <= 0) return kept;
  std::vector<std::int64_t> taken(static_cast<std::size_t>(n), 0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t r = 0; r < k; ++r) {
      auto& t = taken[static_cast<std::size_t>(selection(i, r))];
      kept(i, r) = t < capacity ? 1 : 0;
      ++t;
    }
  return kept;
}

namespace detail {
template <class S>
void check_weights(const Tensor<S>& x, const Tensor<S>& affinities, const LatentMoeWeights<S>& w, std::int64_t k) {
  auto fail = [](const std::string& what) { throw InvalidArgument("moe::latent_moe: " + what); };
  if (x.rank() != 2 || affinities.rank() != 2 || affinities.dim(0) != x.dim(0)) fail("x must be [m, d] and affinities [m, n]");
  const std::int64_t d = x.dim(1), n = affinities.dim(1);
  if (w.down.rank() != 2 || w.down.dim(1) != d) fail("down must be [l, d]");
  const std::int64_t l = w.down.dim(0);
  if (w.up.rank() != 2 || w.up.dim(0) != d || w.up.dim(1) != l) fail("up must be [d, l]");
  if (w.w1.rank() != 3 || w.w1.dim(0) != n || w.w1.dim(2) != l || w.w3.shape() != w.w1.shape())
    fail("w1 and w3 must be [n, f, l] with n the affinities' experts");
  if (w.w2.rank() != 3 || w.w2.dim(0) != n || w.w2.dim(1) != l || w.w2.dim(2) != w.w1.dim(1)) fail("w2 must be [n, l, f]");
  if (w.has_shared() && (w.shared_w1.rank() != 2 || w.shared_w1.dim(1) != d || w.shared_w3.shape() != w.shared_w1.shape() ||
                         w.shared_w2.rank() != 2 || w.shared_w2.dim(0) != d || w.shared_w2.dim(1) != w.shared_w1.dim(0)))
    fail("the shared expert must be [fs, d], [fs, d], [d, fs]");
  if (k < 1 || k > n) fail("k outside [1, n]");
}
}  // namespace detail

// The layer on one batch: x [m, d], affinities [m, n] (router_affinities(x, W_r) in the
// floating tiers), bias beta [n].
template <class S, class Math>
LatentMoeResult<S> latent_moe(const Tensor<S>& x, const Tensor<S>& affinities, const std::vector<S>& bias,
                              const LatentMoeWeights<S>& w, const LatentMoeOptions<S>& opt, const Math& math) {
  detail::check_weights(x, affinities, w, opt.k);
  const std::int64_t m = x.dim(0), d = x.dim(1), n = affinities.dim(1), l = w.down.dim(0), f = w.w1.dim(1), k = opt.k;
  LatentMoeResult<S> r;
  r.bias = bias;
  r.selection = qb::route(affinities, bias, k);
  if (opt.renormalize) {
    r.weights = qb::gating_weights(affinities, r.selection, opt.routed_scaling_factor);
  } else {
    r.weights = Tensor<S>({m, k});
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t q = 0; q < k; ++q) r.weights(i, q) = opt.routed_scaling_factor * affinities(i, r.selection(i, q));
  }
  r.kept = capacity_mask(r.selection, n, opt.capacity);
  r.loads = qb::expert_loads(r.selection, n);
  r.kept_loads.assign(static_cast<std::size_t>(n), 0);
  r.latent = linear(x, w.down);
  r.aggregate = Tensor<S>({m, l}, S(0));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t q = 0; q < k; ++q) {
      if (!r.kept(i, q)) continue;
      const std::int64_t j = r.selection(i, q);
      ++r.kept_loads[static_cast<std::size_t>(j)];
      const auto e = glu_expert(r.latent.data() + i * l, l, w.w1.data() + j * f * l, w.w3.data() + j * f * l,
                                w.w2.data() + j * l * f, f, l, math);
      for (std::int64_t c = 0; c < l; ++c) r.aggregate(i, c) += r.weights(i, q) * e[c];
    }
  if (opt.norm) {
    if constexpr (requires { math.sqrt(S(1)); }) {
      r.normalised = rms_norm(r.aggregate, w.norm_weight, opt.eps, math);
    } else {
      throw InvalidArgument("moe::latent_moe: the norm needs a square root, which this math policy has not");
    }
  } else {
    r.normalised = r.aggregate;
  }
  r.routed_output = linear(r.normalised, w.up);
  r.shared_output = Tensor<S>({m, d}, S(0));
  if (w.has_shared()) {
    const std::int64_t fs = w.shared_w1.dim(0);
    for (std::int64_t i = 0; i < m; ++i) {
      const auto e = glu_expert(x.data() + i * d, d, w.shared_w1.data(), w.shared_w3.data(), w.shared_w2.data(), fs, d, math);
      for (std::int64_t c = 0; c < d; ++c) r.shared_output(i, c) = e[c];
    }
  }
  r.output = Tensor<S>({m, d});
  for (std::int64_t e = 0; e < m * d; ++e) r.output.data()[e] = r.routed_output.data()[e] + r.shared_output.data()[e];
  return r;
}

// Online, as a trainer runs it: batch t is routed with the QB bias computed on batch t-1
// (zero for batch 0), then the bias for t+1 is computed on batch t (qb::qb_next_bias: the
// alternating solver from the bias that routed it, mean-centred). The QB shape needs
// n | m k. `qb.k` is taken from `opt.k`.
template <class S, class Math>
std::vector<LatentMoeResult<S>> latent_moe_online(const std::vector<Tensor<S>>& x, const std::vector<Tensor<S>>& affinities,
                                                  const LatentMoeWeights<S>& w, const LatentMoeOptions<S>& opt,
                                                  qb::OnlineOptions<S> qb_options, const Math& math) {
  if (x.size() != affinities.size()) throw InvalidArgument("moe::latent_moe_online: x and affinities have different batch counts");
  qb_options.k = opt.k;
  std::vector<LatentMoeResult<S>> out;
  if (x.empty()) return out;
  std::vector<S> bias(static_cast<std::size_t>(affinities.front().dim(1)), S(0));
  for (std::size_t t = 0; t < x.size(); ++t) {
    qb::routing_shape(affinities[t].dim(0), affinities[t].dim(1), opt.k, "moe::latent_moe_online");
    out.push_back(latent_moe(x[t], affinities[t], bias, w, opt, math));
    bias = qb::qb_next_bias(affinities[t], bias, qb_options);
  }
  return out;
}

}  // namespace k3ref::moe
