// The exact optimum of the balanced assignment LP that QB is the dual of:
//
//   maximise   sum_ij s_ij x_ij
//   subject to sum_j x_ij = k  (every token gets exactly k experts)
//              sum_i x_ij = q  (every expert gets exactly q = m k / n tokens)
//              0 <= x_ij <= 1
//
// Its constraint matrix is the incidence matrix of a bipartite graph, totally unimodular,
// so the optimum is attained at a 0/1 assignment. Two independent exact methods:
//   - successive shortest paths on the min-cost flow network (source -> token, cap k;
//     token -> expert, cap 1, cost -s_ij; expert -> sink, cap q), shortest paths by
//     Bellman-Ford, so costs may be negative; the dual is read from node potentials;
//   - a bounded-variable primal simplex on a dense tableau (two phases, Bland's rule), the
//     dual read from the artificial columns (B^-1).
// Both are exact with num::rational (the simplex requires an exact scalar).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "k3ref/num/scalar.h"
#include "k3ref/qb/solver.h"

namespace k3ref::qb {

template <class S>
struct BalancedOptimum {
  S value;                       // optimal sum of selected scores
  Tensor<std::uint8_t> chosen;   // [m, n] optimal 0/1 assignment
  std::vector<S> alpha, beta;    // an optimal dual: D(alpha, beta) == value
};

// Sum of s over a 0/1 mask.
template <class S>
S mask_objective(const Tensor<S>& scores, const Tensor<std::uint8_t>& chosen) {
  S total(0);
  for (std::int64_t e = 0; e < scores.numel(); ++e)
    if (chosen.data()[e]) total += scores.data()[e];
  return total;
}

// A selection [m, k] as a 0/1 mask [m, n].
inline Tensor<std::uint8_t> selection_mask(const Tensor<std::int32_t>& selection, std::int64_t n) {
  Tensor<std::uint8_t> mask({selection.dim(0), n}, 0);
  for (std::int64_t i = 0; i < selection.dim(0); ++i)
    for (std::int64_t r = 0; r < selection.dim(1); ++r) mask(i, selection(i, r)) = 1;
  return mask;
}

// True when every token has k experts and every expert q tokens.
inline bool is_balanced(const Tensor<std::uint8_t>& chosen, std::int64_t k, std::int64_t q) {
  const std::int64_t m = chosen.dim(0), n = chosen.dim(1);
  for (std::int64_t i = 0; i < m; ++i) {
    std::int64_t c = 0;
    for (std::int64_t j = 0; j < n; ++j) c += chosen(i, j);
    if (c != k) return false;
  }
  for (std::int64_t j = 0; j < n; ++j) {
    std::int64_t c = 0;
    for (std::int64_t i = 0; i < m; ++i) c += chosen(i, j);
    if (c != q) return false;
  }
  return true;
}

// ---- method 1: min-cost flow, successive shortest paths ---------------------------------

template <class S>
BalancedOptimum<S> optimum_by_min_cost_flow(const Tensor<S>& scores, std::int64_t k) {
  detail::check_scores(scores, "qb::optimum_by_min_cost_flow");
  const RoutingShape shape = routing_shape(scores.dim(0), scores.dim(1), k, "qb::optimum_by_min_cost_flow");
  const std::int64_t m = shape.m, n = shape.n;
  // Nodes: 0 source, 1..m tokens, m+1..m+n experts, m+n+1 sink. Edge e and e^1 are a pair.
  struct Edge {
    std::int64_t to, cap;
    S cost;
  };
  std::vector<Edge> edges;
  const std::int64_t nodes = m + n + 2, source = 0, sink = m + n + 1;
  std::vector<std::vector<std::int64_t>> out(static_cast<std::size_t>(nodes));
  auto add = [&](std::int64_t a, std::int64_t b, std::int64_t cap, const S& cost) {
    out[a].push_back(static_cast<std::int64_t>(edges.size()));
    edges.push_back({b, cap, cost});
    out[b].push_back(static_cast<std::int64_t>(edges.size()));
    edges.push_back({a, 0, -cost});
  };
  for (std::int64_t i = 0; i < m; ++i) add(source, 1 + i, k, S(0));
  std::vector<std::int64_t> pair_edge(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      pair_edge[i * n + j] = static_cast<std::int64_t>(edges.size());
      add(1 + i, 1 + m + j, 1, -scores.data()[i * n + j]);
    }
  for (std::int64_t j = 0; j < n; ++j) add(1 + m + j, sink, shape.q, S(0));

  // Bellman-Ford (queue form) over residual edges; `from_all` starts every node at 0
  // (a virtual source joined to all), which yields feasible potentials at the end.
  auto shortest = [&](bool from_all, std::vector<std::optional<S>>& dist, std::vector<std::int64_t>& via) {
    dist.assign(static_cast<std::size_t>(nodes), std::nullopt);
    via.assign(static_cast<std::size_t>(nodes), -1);
    std::deque<std::int64_t> queue;
    std::vector<char> queued(static_cast<std::size_t>(nodes), 0);
    std::vector<std::int64_t> relaxations(static_cast<std::size_t>(nodes), 0);
    for (std::int64_t v = 0; v < nodes; ++v)
      if (from_all || v == source) {
        dist[v] = S(0);
        queue.push_back(v);
        queued[v] = 1;
      }
    while (!queue.empty()) {
      const std::int64_t u = queue.front();
      queue.pop_front();
      queued[u] = 0;
      for (std::int64_t e : out[u]) {
        const Edge& ed = edges[e];
        if (ed.cap <= 0) continue;
        if (from_all && (u == source || u == sink || ed.to == source || ed.to == sink)) continue;
        const S cand = *dist[u] + ed.cost;
        if (!dist[ed.to] || cand < *dist[ed.to]) {
          dist[ed.to] = cand;
          via[ed.to] = e;
          if (++relaxations[ed.to] > nodes)
            throw InvalidArgument("qb::optimum_by_min_cost_flow: negative cycle in the residual graph");
          if (!queued[ed.to]) {
            queue.push_back(ed.to);
            queued[ed.to] = 1;
          }
        }
      }
    }
  };

  std::vector<std::optional<S>> dist;
  std::vector<std::int64_t> via;
  std::int64_t flow = 0;
  while (flow < m * k) {
    shortest(false, dist, via);
    if (!dist[sink]) throw InvalidArgument("qb::optimum_by_min_cost_flow: no balanced assignment exists");
    std::int64_t push = m * k - flow;
    for (std::int64_t v = sink; v != source; v = edges[via[v] ^ 1].to) push = std::min(push, edges[via[v]].cap);
    for (std::int64_t v = sink; v != source; v = edges[via[v] ^ 1].to) {
      edges[via[v]].cap -= push;
      edges[via[v] ^ 1].cap += push;
    }
    flow += push;
  }
  BalancedOptimum<S> result;
  result.chosen = Tensor<std::uint8_t>({m, n}, 0);
  result.value = S(0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      if (edges[pair_edge[i * n + j]].cap == 0) {
        result.chosen(i, j) = 1;
        result.value += scores.data()[i * n + j];
      }
  // Potentials d with reduced costs >= 0 on residual token/expert edges give
  // alpha_i = d(token i), beta_j = -d(expert j): s_ij <= alpha_i + beta_j off the
  // assignment, >= on it (complementary slackness).
  shortest(true, dist, via);
  result.alpha.resize(static_cast<std::size_t>(m));
  result.beta.resize(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < m; ++i) result.alpha[i] = *dist[1 + i];
  for (std::int64_t j = 0; j < n; ++j) result.beta[j] = -*dist[1 + m + j];
  return result;
}

// ---- method 2: bounded-variable primal simplex ------------------------------------------

template <class S>
BalancedOptimum<S> optimum_by_simplex(const Tensor<S>& scores, std::int64_t k) {
  static_assert(num::is_exact_v<S>, "qb::optimum_by_simplex compares pivots with zero: use an exact scalar");
  detail::check_scores(scores, "qb::optimum_by_simplex");
  const RoutingShape shape = routing_shape(scores.dim(0), scores.dim(1), k, "qb::optimum_by_simplex");
  const std::int64_t m = shape.m, n = shape.n;
  // Columns: x_ij at i*n + j (bounds [0, 1]), then one artificial per row (bounds [0, inf)
  // in phase 1, fixed at 0 in phase 2). Rows: m token rows, then n expert rows.
  const std::int64_t rows = m + n, structural = m * n, cols = structural + rows;
  std::vector<std::vector<S>> tab(static_cast<std::size_t>(rows), std::vector<S>(static_cast<std::size_t>(cols), S(0)));
  std::vector<S> value(static_cast<std::size_t>(rows));  // values of the basic variables
  std::vector<std::int64_t> basis(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      tab[i][i * n + j] = S(1);
      tab[m + j][i * n + j] = S(1);
    }
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    tab[r][structural + r] = S(1);
    basis[r] = structural + r;
    value[r] = S(r < m ? k : shape.q);
  }
  enum class Bound : std::uint8_t { lower, upper, basic };
  std::vector<Bound> status(static_cast<std::size_t>(cols), Bound::lower);
  for (std::int64_t r = 0; r < rows; ++r) status[structural + r] = Bound::basic;
  // Upper bounds: 1 for x, none (phase 1) or 0 (phase 2) for artificials.
  bool artificial_fixed = false;
  auto has_upper = [&](std::int64_t c) { return c < structural || artificial_fixed; };
  auto upper = [&](std::int64_t c) { return c < structural ? S(1) : S(0); };

  auto run_phase = [&](const std::vector<S>& cost) {
    const std::int64_t max_pivots = 100000;
    for (std::int64_t pivots = 0;; ++pivots) {
      if (pivots > max_pivots) throw InvalidArgument("qb::optimum_by_simplex: pivot limit reached");
      // Reduced costs d_c = cost_c - sum_r cost_{B_r} tab[r][c]; Bland: first eligible column.
      std::int64_t enter = -1;
      int direction = 0;
      for (std::int64_t c = 0; c < cols && enter < 0; ++c) {
        if (status[c] == Bound::basic) continue;
        if (has_upper(c) && upper(c) == S(0)) continue;  // fixed variable
        S d = cost[c];
        for (std::int64_t r = 0; r < rows; ++r)
          if (tab[r][c] != S(0)) d -= cost[basis[r]] * tab[r][c];
        if (status[c] == Bound::lower && d > S(0)) enter = c, direction = 1;
        if (status[c] == Bound::upper && d < S(0)) enter = c, direction = -1;
      }
      if (enter < 0) return;
      // Ratio test: x_enter moves by direction * theta; x_B(r) moves by -direction * theta * tab[r][enter].
      std::optional<S> step;
      std::int64_t leave_row = -1;
      bool leave_to_upper = false;
      if (has_upper(enter)) step = upper(enter);  // bound flip
      for (std::int64_t r = 0; r < rows; ++r) {
        const S rate = S(direction) * tab[r][enter];  // decrease of x_B(r) per unit step
        if (rate == S(0)) continue;
        std::optional<S> limit;
        bool to_upper = false;
        if (rate > S(0)) {
          limit = value[r] / rate;
        } else if (has_upper(basis[r])) {
          limit = (upper(basis[r]) - value[r]) / (-rate);
          to_upper = true;
        }
        if (!limit) continue;
        const bool better = !step || *limit < *step ||
                            (*limit == *step && leave_row >= 0 && basis[r] < basis[leave_row]);
        if (better) {
          step = *limit;
          leave_row = r;
          leave_to_upper = to_upper;
        }
      }
      if (!step) throw InvalidArgument("qb::optimum_by_simplex: unbounded (cannot happen for this LP)");
      const S theta = *step;
      for (std::int64_t r = 0; r < rows; ++r) value[r] -= S(direction) * theta * tab[r][enter];
      if (leave_row < 0) {  // x_enter goes to its other bound
        status[enter] = direction > 0 ? Bound::upper : Bound::lower;
        continue;
      }
      const S entering_value = direction > 0 ? theta : upper(enter) - theta;
      status[basis[leave_row]] = leave_to_upper ? Bound::upper : Bound::lower;
      status[enter] = Bound::basic;
      basis[leave_row] = enter;
      value[leave_row] = entering_value;
      const S pivot = tab[leave_row][enter];
      for (S& x : tab[leave_row]) x /= pivot;
      for (std::int64_t r = 0; r < rows; ++r) {
        if (r == leave_row || tab[r][enter] == S(0)) continue;
        const S factor = tab[r][enter];
        for (std::int64_t c = 0; c < cols; ++c)
          if (tab[leave_row][c] != S(0)) tab[r][c] -= factor * tab[leave_row][c];
      }
    }
  };

  std::vector<S> cost(static_cast<std::size_t>(cols), S(0));
  for (std::int64_t c = structural; c < cols; ++c) cost[c] = S(-1);
  run_phase(cost);
  for (std::int64_t r = 0; r < rows; ++r)
    if (basis[r] >= structural && value[r] != S(0))
      throw InvalidArgument("qb::optimum_by_simplex: no balanced assignment exists");
  artificial_fixed = true;
  for (std::int64_t c = 0; c < cols; ++c) cost[c] = c < structural ? scores.data()[c] : S(0);
  run_phase(cost);

  BalancedOptimum<S> result;
  result.chosen = Tensor<std::uint8_t>({m, n}, 0);
  for (std::int64_t c = 0; c < structural; ++c)
    if (status[c] == Bound::upper) result.chosen.data()[c] = 1;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (basis[r] >= structural) continue;
    if (value[r] == S(1)) {
      result.chosen.data()[basis[r]] = 1;
    } else if (value[r] != S(0)) {
      throw InvalidArgument("qb::optimum_by_simplex: fractional vertex (the matrix is unimodular: a bug)");
    }
  }
  result.value = mask_objective(scores, result.chosen);
  // y = c_B B^-1; the artificial column of row r holds B^-1 e_r.
  result.alpha.assign(static_cast<std::size_t>(m), S(0));
  result.beta.assign(static_cast<std::size_t>(n), S(0));
  for (std::int64_t r = 0; r < rows; ++r) {
    S y(0);
    for (std::int64_t b = 0; b < rows; ++b) y += cost[basis[b]] * tab[b][structural + r];
    (r < m ? result.alpha[r] : result.beta[r - m]) = y;
  }
  return result;
}

}  // namespace k3ref::qb
