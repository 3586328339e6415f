// Quantile Balancing (QB): the alternating solver on a score matrix (docs/qb.md).
//
// Scores s: [m tokens, n experts], top-k routing, target load q = m k / n per expert.
// One iteration, from the expert biases beta of the previous one (zero at the start):
//
//   alpha_i = the (k+1)-th largest of s_i - beta          (per-token cutoff)
//   beta_j  = the (q+1)-th largest of s_:j - alpha        (per-expert bias)
//   selection_i = the top-k of s_i - beta  (with the new beta)
//
// This is exact block-coordinate descent on the dual of the balanced assignment LP
// (proofs/qb_dual.md): every iterate (alpha, beta) is dual feasible, its dual objective
// never increases and never falls below the LP optimum.
//
// Tie rule (documented in docs/qb.md, tested in tests/qb/solver_test.cpp). Ties are
// structural: alpha_i is one of row i's own biased scores, and a token that sits exactly
// at the cutoff of two experts gives both of them the same biased score at the next
// iteration. The k experts of token i are the first k in the order
//   1. biased score s_ij - beta_j, larger first;
//   2. then the raw score s_ij, larger first (the token's own preference decides);
//   3. then the expert index, smaller first.
// Thresholds (alpha, beta) are values, so they need no tie rule. Rule 2 keeps the
// selection equivariant under a permutation of the experts whenever each row's raw scores
// are distinct; only inputs with equal raw scores in a row ever reach rule 3.
//
// Everything is a template over the scalar: exact with num::rational, and also exact in
// double when the scores lie on a grid 2^-p Z and every iterate stays below 2^(53-p) in
// magnitude (iterates are alternating sums of scores; see docs/qb.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "k3ref/error.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::qb {

// m tokens, n experts, top-k, q = m k / n.
struct RoutingShape {
  std::int64_t m = 0, n = 0, k = 0, q = 0;
};

// Checks 1 <= k < n, m >= 1 and that n divides m k (q must be an integer); throws
// InvalidArgument naming `what` otherwise.
RoutingShape routing_shape(std::int64_t m, std::int64_t n, std::int64_t k, const std::string& what);

// Tokens per expert for a selection [m, k] of expert indices in [0, n).
std::vector<std::int64_t> expert_loads(const Tensor<std::int32_t>& selection, std::int64_t n);

// MaxVio = max load / mean load - 1, exact in S (loads are integers).
template <class S>
S max_vio(const std::vector<std::int64_t>& loads) {
  if (loads.empty()) throw InvalidArgument("qb::max_vio: argument 'loads' is empty");
  const std::int64_t total = std::accumulate(loads.begin(), loads.end(), std::int64_t{0});
  if (total <= 0) throw InvalidArgument("qb::max_vio: argument 'loads' sums to zero");
  const std::int64_t top = *std::max_element(loads.begin(), loads.end());
  return S(top) * S(static_cast<std::int64_t>(loads.size())) / S(total) - S(1);
}

// The r-th largest (1-based) of `values`, a value (no tie rule needed).
template <class S>
S rth_largest(std::vector<S> values, std::int64_t r) {
  if (r < 1 || r > static_cast<std::int64_t>(values.size()))
    throw InvalidArgument("qb::rth_largest: r = " + std::to_string(r) + " outside [1, " +
                          std::to_string(values.size()) + "]");
  std::nth_element(values.begin(), values.begin() + (r - 1), values.end(), std::greater<S>());
  return values[static_cast<std::size_t>(r - 1)];
}

namespace detail {
template <class S>
void check_scores(const Tensor<S>& scores, const char* fn) {
  if (scores.rank() != 2) throw InvalidArgument(std::string(fn) + ": argument 'scores' must be [m, n]");
}
template <class S>
void check_beta(const Tensor<S>& scores, const std::vector<S>& beta, const char* fn) {
  if (static_cast<std::int64_t>(beta.size()) != scores.dim(1))
    throw InvalidArgument(std::string(fn) + ": argument 'beta' has " + std::to_string(beta.size()) +
                          " entries, scores have " + std::to_string(scores.dim(1)) + " experts");
}
}  // namespace detail

// The tie rule: experts of one row, in selection order (see the header comment).
// Returns the first `count` experts of that order.
template <class S>
std::vector<std::int32_t> ordered_experts(const S* raw_row, const std::vector<S>& beta, std::int64_t count) {
  const std::int64_t n = static_cast<std::int64_t>(beta.size());
  std::vector<S> biased(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) biased[j] = raw_row[j] - beta[j];
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  auto before = [&](std::int32_t a, std::int32_t b) {
    if (biased[a] != biased[b]) return biased[a] > biased[b];
    if (raw_row[a] != raw_row[b]) return raw_row[a] > raw_row[b];
    return a < b;
  };
  std::partial_sort(order.begin(), order.begin() + count, order.end(), before);
  order.resize(static_cast<std::size_t>(count));
  return order;
}

// alpha_i = (k+1)-th largest of s_i - beta.
template <class S>
std::vector<S> token_cutoffs(const Tensor<S>& scores, const std::vector<S>& beta, std::int64_t k) {
  detail::check_scores(scores, "qb::token_cutoffs");
  detail::check_beta(scores, beta, "qb::token_cutoffs");
  const std::int64_t m = scores.dim(0), n = scores.dim(1);
  std::vector<S> alpha(static_cast<std::size_t>(m)), row(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < m; ++i) {
    const S* s = scores.data() + i * n;
    for (std::int64_t j = 0; j < n; ++j) row[j] = s[j] - beta[j];
    alpha[i] = rth_largest(row, k + 1);
  }
  return alpha;
}

// beta_j = (q+1)-th largest of s_:j - alpha.
template <class S>
std::vector<S> expert_biases(const Tensor<S>& scores, const std::vector<S>& alpha, std::int64_t q) {
  detail::check_scores(scores, "qb::expert_biases");
  const std::int64_t m = scores.dim(0), n = scores.dim(1);
  if (static_cast<std::int64_t>(alpha.size()) != m)
    throw InvalidArgument("qb::expert_biases: argument 'alpha' has " + std::to_string(alpha.size()) +
                          " entries, scores have " + std::to_string(m) + " tokens");
  std::vector<S> beta(static_cast<std::size_t>(n)), column(static_cast<std::size_t>(m));
  for (std::int64_t j = 0; j < n; ++j) {
    for (std::int64_t i = 0; i < m; ++i) column[i] = scores.data()[i * n + j] - alpha[i];
    beta[j] = rth_largest(column, q + 1);
  }
  return beta;
}

// The top-k experts of every token under bias beta, by the tie rule: [m, k] indices,
// each row in selection order (best first).
template <class S>
Tensor<std::int32_t> route(const Tensor<S>& scores, const std::vector<S>& beta, std::int64_t k) {
  detail::check_scores(scores, "qb::route");
  detail::check_beta(scores, beta, "qb::route");
  const std::int64_t m = scores.dim(0), n = scores.dim(1);
  if (k < 1 || k > n) throw InvalidArgument("qb::route: argument 'k' outside [1, n]");
  Tensor<std::int32_t> selection({m, k});
  for (std::int64_t i = 0; i < m; ++i) {
    const auto top = ordered_experts(scores.data() + i * n, beta, k);
    std::copy(top.begin(), top.end(), selection.data() + i * k);
  }
  return selection;
}

// The dual objective of the balanced assignment LP at (alpha, beta):
//   D = k sum alpha + q sum beta + sum_ij max(0, s_ij - alpha_i - beta_j).
// Every (alpha, beta) is feasible (the positive parts are the optimal slack), so D is an
// upper bound on the LP optimum (weak duality).
template <class S>
S dual_objective(const Tensor<S>& scores, const std::vector<S>& alpha, const std::vector<S>& beta, std::int64_t k) {
  detail::check_scores(scores, "qb::dual_objective");
  detail::check_beta(scores, beta, "qb::dual_objective");
  const std::int64_t m = scores.dim(0), n = scores.dim(1);
  const RoutingShape shape = routing_shape(m, n, k, "qb::dual_objective");
  S total(0);
  for (std::int64_t i = 0; i < m; ++i) total += S(k) * alpha[i];
  for (std::int64_t j = 0; j < n; ++j) total += S(shape.q) * beta[j];
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      const S slack = scores.data()[i * n + j] - alpha[i] - beta[j];
      if (slack > S(0)) total += slack;
    }
  return total;
}

// Sum of the selected scores (the primal objective of a selection).
template <class S>
S selection_objective(const Tensor<S>& scores, const Tensor<std::int32_t>& selection) {
  const std::int64_t n = scores.dim(1);
  S total(0);
  for (std::int64_t i = 0; i < selection.dim(0); ++i)
    for (std::int64_t r = 0; r < selection.dim(1); ++r) total += scores.data()[i * n + selection(i, r)];
  return total;
}

// One iterate of the solver.
template <class S>
struct Iterate {
  std::vector<S> alpha;             // [m] token cutoffs
  std::vector<S> beta;              // [n] expert biases
  Tensor<std::int32_t> selection;   // [m, k] top-k of s - beta, by the tie rule
  std::vector<std::int64_t> loads;  // [n] tokens per expert
};

template <class S>
Iterate<S> solver_step(const Tensor<S>& scores, const std::vector<S>& beta_in, const RoutingShape& shape) {
  Iterate<S> it;
  it.alpha = token_cutoffs(scores, beta_in, shape.k);
  it.beta = expert_biases(scores, it.alpha, shape.q);
  it.selection = route(scores, it.beta, shape.k);
  it.loads = expert_loads(it.selection, shape.n);
  return it;
}

// Seconds per element of iterations x m x n, for progress estimates: alternating_solver at
// m = 4096 tokens, n = 64 experts, k = 4, 8 iterations, on the idle 2-core development
// machine, the middle of three runs.
inline constexpr double solver_seconds_per_element = 30e-9;

// `iterations` iterations from beta0 (zero when empty); element t is iteration t + 1.
template <class S>
std::vector<Iterate<S>> alternating_solver(const Tensor<S>& scores, std::int64_t k, int iterations,
                                           std::vector<S> beta0 = {}) {
  detail::check_scores(scores, "qb::alternating_solver");
  const RoutingShape shape = routing_shape(scores.dim(0), scores.dim(1), k, "qb::alternating_solver");
  if (iterations < 0) throw InvalidArgument("qb::alternating_solver: argument 'iterations' is negative");
  if (beta0.empty()) beta0.assign(static_cast<std::size_t>(shape.n), S(0));
  detail::check_beta(scores, beta0, "qb::alternating_solver");
  std::vector<Iterate<S>> trace;
  trace.reserve(static_cast<std::size_t>(iterations));
  std::vector<S> beta = std::move(beta0);
  for (int t = 0; t < iterations; ++t) {
    trace.push_back(solver_step(scores, beta, shape));
    beta = trace.back().beta;
  }
  return trace;
}

// Long-run behaviour. The next iterate depends only on beta, and shifting every beta_j by
// a constant c shifts every alpha_i by -c and leaves the selection unchanged (q n = m k
// keeps D unchanged too). So the state is beta modulo a constant: the run stops at the
// first state seen before, which is a fixed point (period 1, drift 0), a fixed point up
// to a uniform drift of the biases (period 1, drift != 0), or a cycle (period > 1).
template <class S>
struct LongRun {
  std::vector<S> beta0;           // the starting biases (iteration 0)
  std::vector<Iterate<S>> trace;  // iterations 1..trace.size()
  std::optional<int> repeat_of;   // iteration (0 = the start) whose state the last iteration repeats
  const std::vector<S>& beta_at(int t) const { return t == 0 ? beta0 : trace[static_cast<std::size_t>(t - 1)].beta; }
  int period() const { return repeat_of ? static_cast<int>(trace.size()) - *repeat_of : 0; }
  // beta(last) - beta(repeat_of): the same constant for every expert when a repeat was found.
  S drift() const { return repeat_of ? trace.back().beta[0] - beta_at(*repeat_of)[0] : S(0); }
};

// Runs until the state repeats (exact comparison: meant for exact scalars or for
// floating-point runs known to be exact) or `max_iterations` is reached.
template <class S>
LongRun<S> run_until_repeat(const Tensor<S>& scores, std::int64_t k, int max_iterations, std::vector<S> beta0 = {}) {
  detail::check_scores(scores, "qb::run_until_repeat");
  const RoutingShape shape = routing_shape(scores.dim(0), scores.dim(1), k, "qb::run_until_repeat");
  if (beta0.empty()) beta0.assign(static_cast<std::size_t>(shape.n), S(0));
  detail::check_beta(scores, beta0, "qb::run_until_repeat");
  auto normalised = [](const std::vector<S>& beta) {
    std::vector<S> v(beta.size());
    for (std::size_t j = 0; j < beta.size(); ++j) v[j] = beta[j] - beta[0];
    return v;
  };
  LongRun<S> run;
  run.beta0 = beta0;
  std::map<std::vector<S>, int> seen;  // normalised beta -> iteration
  seen.emplace(normalised(beta0), 0);
  std::vector<S> beta = std::move(beta0);
  for (int t = 1; t <= max_iterations; ++t) {
    run.trace.push_back(solver_step(scores, beta, shape));
    beta = run.trace.back().beta;
    auto [where, inserted] = seen.emplace(normalised(beta), t);
    if (!inserted) {
      run.repeat_of = where->second;
      break;
    }
  }
  return run;
}

}  // namespace k3ref::qb
