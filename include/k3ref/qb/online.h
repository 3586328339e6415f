// QB online, as a trainer runs it, and DeepSeek's auxiliary-loss-free sign update as the
// baseline, on the same batches.
//
// Online: batch t is routed with the bias computed on batch t-1 (zero for batch 0); the
// bias for batch t+1 is then computed on batch t (the alternating solver, warm-started
// from the bias that routed batch t). A batch never sees the bias it produced.
// Gating weights come from the unbiased affinities: for token i with selected experts E_i,
//   w_ij = routed_scaling_factor * s_ij / sum_{j' in E_i} s_ij',
// so the bias changes which experts are selected, never the weights of a given selection.
// Affinities are sigmoid scores of router logits (sigmoid_scores below, for the
// floating-point tiers); exact tests pass affinities directly.
//
// Sign update (DeepSeek-V3, auxiliary-loss-free balancing): selection = top-k of s + b,
// b_j <- b_j + gamma * sign(mean load - load_j). Here it is written with beta = -b so both
// methods share qb::route and its tie rule: beta_j <- beta_j + gamma * sign(load_j - mean).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "k3ref/num/scalar.h"
#include "k3ref/qb/solver.h"

namespace k3ref::qb {

template <class S>
S sigmoid(const S& x) {
  static_assert(num::scalar_traits<S>::has_transcendentals, "qb::sigmoid needs exp: not available in exact tiers");
  using std::exp;
  return S(1) / (S(1) + exp(-x));
}

template <class S>
Tensor<S> sigmoid_scores(const Tensor<S>& logits) {
  return logits.template map<S>([](const S& x) { return sigmoid(x); });
}

// Gating weights [m, k] of a selection, from the unbiased affinities.
template <class S>
Tensor<S> gating_weights(const Tensor<S>& affinities, const Tensor<std::int32_t>& selection,
                         const S& routed_scaling_factor) {
  const std::int64_t m = selection.dim(0), k = selection.dim(1), n = affinities.dim(1);
  Tensor<S> weights({m, k});
  for (std::int64_t i = 0; i < m; ++i) {
    S total(0);
    for (std::int64_t r = 0; r < k; ++r) total += affinities.data()[i * n + selection(i, r)];
    if (total == S(0)) throw InvalidArgument("qb::gating_weights: token " + std::to_string(i) + " has zero total affinity");
    for (std::int64_t r = 0; r < k; ++r)
      weights(i, r) = routed_scaling_factor * affinities.data()[i * n + selection(i, r)] / total;
  }
  return weights;
}

template <class S>
struct OnlineOptions {
  std::int64_t k = 1;
  S routed_scaling_factor = S(1);
  int iterations_per_batch = 1;  // solver iterations run on each batch to get the next bias
  bool warm_start = true;        // start them from the bias that routed the batch (else from 0)
  bool center_bias = true;       // subtract the mean bias (changes no selection, keeps beta bounded)
};

// One routed batch.
template <class S>
struct RoutedBatch {
  std::vector<S> bias;              // [n] beta that routed this batch (from the previous batch)
  Tensor<std::int32_t> selection;   // [m, k]
  Tensor<S> weights;                // [m, k]
  std::vector<std::int64_t> loads;  // [n]
  S max_vio;
};

namespace detail {
template <class S>
RoutedBatch<S> route_batch(const Tensor<S>& affinities, const std::vector<S>& bias, std::int64_t k,
                           const S& routed_scaling_factor) {
  RoutedBatch<S> out;
  out.bias = bias;
  out.selection = route(affinities, bias, k);
  out.weights = gating_weights(affinities, out.selection, routed_scaling_factor);
  out.loads = expert_loads(out.selection, affinities.dim(1));
  out.max_vio = max_vio<S>(out.loads);
  return out;
}
template <class S>
void check_batches(const std::vector<Tensor<S>>& batches, std::int64_t k, const char* fn) {
  for (const auto& b : batches) {
    check_scores(b, fn);
    if (b.dim(1) != batches.front().dim(1))
      throw InvalidArgument(std::string(fn) + ": batches disagree on the number of experts");
    routing_shape(b.dim(0), b.dim(1), k, fn);
  }
}
}  // namespace detail

// The bias QB computes on one batch for the next, from the bias that routed it.
template <class S>
std::vector<S> qb_next_bias(const Tensor<S>& affinities, const std::vector<S>& bias, const OnlineOptions<S>& opt) {
  std::vector<S> start = opt.warm_start ? bias : std::vector<S>(bias.size(), S(0));
  auto trace = alternating_solver(affinities, opt.k, opt.iterations_per_batch, start);
  std::vector<S> next = trace.empty() ? start : trace.back().beta;
  if (opt.center_bias) {
    S mean(0);
    for (const S& b : next) mean += b;
    mean /= S(static_cast<std::int64_t>(next.size()));
    for (S& b : next) b -= mean;
  }
  return next;
}

template <class S>
std::vector<RoutedBatch<S>> route_online_qb(const std::vector<Tensor<S>>& batches, const OnlineOptions<S>& opt) {
  detail::check_batches(batches, opt.k, "qb::route_online_qb");
  std::vector<RoutedBatch<S>> out;
  if (batches.empty()) return out;
  std::vector<S> bias(static_cast<std::size_t>(batches.front().dim(1)), S(0));
  for (const auto& batch : batches) {
    out.push_back(detail::route_batch(batch, bias, opt.k, opt.routed_scaling_factor));
    bias = qb_next_bias(batch, bias, opt);  // used from the next batch on
  }
  return out;
}

template <class S>
std::vector<RoutedBatch<S>> route_online_sign_update(const std::vector<Tensor<S>>& batches, std::int64_t k,
                                                     const S& gamma, const S& routed_scaling_factor) {
  detail::check_batches(batches, k, "qb::route_online_sign_update");
  std::vector<RoutedBatch<S>> out;
  if (batches.empty()) return out;
  const std::int64_t n = batches.front().dim(1);
  std::vector<S> beta(static_cast<std::size_t>(n), S(0));
  for (const auto& batch : batches) {
    out.push_back(detail::route_batch(batch, beta, k, routed_scaling_factor));
    const std::int64_t total = batch.dim(0) * k;  // mean load = total / n, compared exactly
    for (std::int64_t j = 0; j < n; ++j) {
      const std::int64_t scaled = out.back().loads[j] * n - total;
      if (scaled > 0) beta[j] += gamma;
      if (scaled < 0) beta[j] -= gamma;
    }
  }
  return out;
}

}  // namespace k3ref::qb
