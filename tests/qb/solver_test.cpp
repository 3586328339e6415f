// Tests of the QB alternating solver (include/k3ref/qb/solver.h): the tie rule, the
// invariances, the quantile property at fixed points, and exactness of the double tier.
// Properties run on 100 random instances each (RapidCheck's default), in exact rationals.
#include "test_support.h"

#include <cmath>
#include <set>

#include "k3ref/num/random.h"
#include "k3ref/qb/optimum.h"
#include "k3ref/qb/solver.h"

namespace k3ref::qb {
namespace {

using test::Q;

Tensor<Q> matrix(std::int64_t m, std::int64_t n, std::vector<Q> v) { return Tensor<Q>({m, n}, std::move(v)); }

std::vector<Q> biased_row(const Tensor<Q>& s, std::int64_t i, const std::vector<Q>& beta) {
  std::vector<Q> row(beta.size());
  for (std::size_t j = 0; j < beta.size(); ++j) row[j] = s(i, static_cast<std::int64_t>(j)) - beta[j];
  return row;
}

// ---- small facts, derived by hand --------------------------------------------------------

TEST(QbShape, RejectsWhatTheMathematicsDoesNot) {
  EXPECT_EQ(routing_shape(12, 6, 2, "t").q, 4);              // 12 * 2 / 6
  EXPECT_EQ(routing_shape(4480, 896, 16, "t").q, 80);        // the K3 shape: 4480 * 16 / 896
  EXPECT_THROW(routing_shape(4096, 896, 16, "t"), InvalidArgument);  // 4096 * 16 / 896 = 73.14...
  EXPECT_THROW(routing_shape(4, 4, 4, "t"), InvalidArgument);        // k = n: no (k+1)-th score
  EXPECT_THROW(routing_shape(4, 4, 0, "t"), InvalidArgument);
  EXPECT_THROW(routing_shape(0, 4, 1, "t"), InvalidArgument);
}

TEST(QbMetrics, MaxVioIsMaxOverMeanMinusOne) {
  // loads {6, 2, 4, 4}: mean 4, max 6 -> 6 / 4 - 1 = 1/2.
  EXPECT_EQ(max_vio<Q>({6, 2, 4, 4}), Q(1) / Q(2));
  EXPECT_EQ(max_vio<Q>({3, 3, 3}), Q(0));
  EXPECT_EQ(max_vio<double>({6, 2, 4, 4}), 0.5);
  Tensor<std::int32_t> sel({3, 2}, std::vector<std::int32_t>{0, 1, 0, 2, 0, 3});
  EXPECT_EQ(expert_loads(sel, 4), (std::vector<std::int64_t>{3, 1, 1, 1}));
  EXPECT_THROW(expert_loads(sel, 3), InvalidArgument);  // index 3 outside [0, 3)
}

TEST(QbSolver, RthLargestIsAValue) {
  EXPECT_EQ(rth_largest<Q>({Q(1), Q(3), Q(3), Q(2)}, 1), Q(3));
  EXPECT_EQ(rth_largest<Q>({Q(1), Q(3), Q(3), Q(2)}, 2), Q(3));  // equal values: no tie rule needed
  EXPECT_EQ(rth_largest<Q>({Q(1), Q(3), Q(3), Q(2)}, 3), Q(2));
  EXPECT_THROW(rth_largest<Q>({Q(1)}, 2), InvalidArgument);
}

TEST(QbSolver, TieRuleBiasedThenRawThenIndex) {
  // Row [1, 1, 0], beta 0: experts 0 and 1 tie on biased and raw score -> index: 0 first.
  const Tensor<Q> a = matrix(1, 3, {Q(1), Q(1), Q(0)});
  EXPECT_EQ(ordered_experts(a.data(), std::vector<Q>{0, 0, 0}, 3), (std::vector<std::int32_t>{0, 1, 2}));
  // Row [1/2, 1, 0], beta [0, 1/2, 0]: biased [1/2, 1/2, 0]; raw 1 > 1/2 -> expert 1 first.
  const Tensor<Q> b = matrix(1, 3, {Q(1) / 2, Q(1), Q(0)});
  EXPECT_EQ(ordered_experts(b.data(), std::vector<Q>{0, Q(1) / 2, 0}, 2), (std::vector<std::int32_t>{1, 0}));
  // The biased score decides first: beta [0, 1, 0] makes expert 1's biased score 0 < 1/2.
  EXPECT_EQ(ordered_experts(b.data(), std::vector<Q>{0, 1, 0}, 1), (std::vector<std::int32_t>{0}));
}

TEST(QbSolver, OneIterationByHand) {
  // m = 4, n = 2, k = 1, q = 2. Scores (rows): [3,0] [2,0] [1,0] [0,1].
  // beta = 0: alpha_i = 2nd largest of the row = 0, 0, 0, 0.
  // beta_j = 3rd largest of s_:j - alpha: column 0 {3,2,1,0} -> 1; column 1 {0,0,0,1} -> 0.
  // Selection by s - beta: rows [2,0] [1,0] [0,0] [-1,1]: expert 0, 0, then a tie 0 = 0
  // in row 2 (biased), raw 1 > 0 -> expert 0; row 3 -> expert 1. Loads {3, 1}.
  const Tensor<Q> s = matrix(4, 2, {Q(3), Q(0), Q(2), Q(0), Q(1), Q(0), Q(0), Q(1)});
  const auto trace = alternating_solver(s, 1, 2);
  EXPECT_EQ(trace[0].alpha, (std::vector<Q>{0, 0, 0, 0}));
  EXPECT_EQ(trace[0].beta, (std::vector<Q>{1, 0}));
  EXPECT_EQ(trace[0].selection.values(), (std::vector<std::int32_t>{0, 0, 0, 1}));
  EXPECT_EQ(trace[0].loads, (std::vector<std::int64_t>{3, 1}));
  // Iteration 2: alpha = 2nd largest of s - beta = [0,0] -> rows [2,0] [1,0] [0,0] [-1,1]:
  // alpha = 0, 0, 0, -1. beta_0 = 3rd of {3,2,1,1} = 1; beta_1 = 3rd of {0,0,0,2} = 0.
  EXPECT_EQ(trace[1].alpha, (std::vector<Q>{0, 0, 0, -1}));
  EXPECT_EQ(trace[1].beta, (std::vector<Q>{1, 0}));
  // D = k sum alpha + q sum beta + sum (s - alpha - beta)_+ = -1 + 2 * 1 + slack, slack =
  // (3-0-1) + (2-0-1) + (1-0-1) + (1-(-1)-0) = 2 + 1 + 0 + 2 = 5, so D = 6. The LP optimum
  // (expert 0 takes tokens 0, 1; expert 1 takes 2, 3) is 3 + 2 + 0 + 1 = 6: this iterate is
  // dual optimal, yet beta did not move, so it is a fixed point whose selection stays
  // unbalanced {3, 1}: row 2 ties (biased 0 = 0) and the tie rule gives expert 0.
  EXPECT_EQ(trace[1].selection.values(), (std::vector<std::int32_t>{0, 0, 0, 1}));
  EXPECT_EQ(dual_objective(s, trace[1].alpha, trace[1].beta, 1), Q(6));
  EXPECT_EQ(optimum_by_min_cost_flow(s, 1).value, Q(6));
}

// ---- properties in exact arithmetic --------------------------------------------------------

RC_GTEST_PROP(QbSolverProperties, EveryTokenGetsExactlyKDistinctTopExperts, ()) {
  const auto sz = test::random_qb_sizes();
  const Tensor<Q> s = test::any_scores(sz.m, sz.n);
  const auto trace = alternating_solver(s, sz.k, 4);
  for (const auto& it : trace) {
    std::int64_t total = 0;
    for (std::int64_t l : it.loads) total += l;
    RC_ASSERT(total == sz.m * sz.k);
    for (std::int64_t i = 0; i < sz.m; ++i) {
      std::set<std::int32_t> chosen;
      for (std::int64_t r = 0; r < sz.k; ++r) chosen.insert(it.selection(i, r));
      RC_ASSERT(static_cast<std::int64_t>(chosen.size()) == sz.k);
      // Every selected biased score is >= every unselected one, and >= alpha of the next
      // iteration's row cutoff semantics: the k-th selected is >= the (k+1)-th largest.
      const auto row = biased_row(s, i, it.beta);
      Q worst_selected = row[it.selection(i, 0)];
      for (std::int32_t j : chosen) worst_selected = std::min(worst_selected, row[j]);
      for (std::int64_t j = 0; j < sz.n; ++j)
        if (!chosen.count(static_cast<std::int32_t>(j))) RC_ASSERT(row[j] <= worst_selected);
      RC_ASSERT(worst_selected >= rth_largest(row, sz.k + 1));
    }
  }
}

RC_GTEST_PROP(QbSolverProperties, AddingAConstantToATokenChangesNothingButItsCutoff, ()) {
  const auto sz = test::random_qb_sizes();
  const Tensor<Q> s = test::any_scores(sz.m, sz.n);
  const std::int64_t i0 = *rc::gen::inRange<std::int64_t>(0, sz.m);
  const Q c = test::small_rational(-64, 64, test::qb_denominators);
  Tensor<Q> shifted = s;
  for (std::int64_t j = 0; j < sz.n; ++j) shifted(i0, j) += c;
  const auto a = alternating_solver(s, sz.k, 4), b = alternating_solver(shifted, sz.k, 4);
  for (std::size_t t = 0; t < a.size(); ++t) {
    RC_ASSERT(a[t].selection == b[t].selection);  // exact equality, ties included
    RC_ASSERT(a[t].beta == b[t].beta);
    for (std::int64_t i = 0; i < sz.m; ++i) RC_ASSERT(b[t].alpha[i] == a[t].alpha[i] + (i == i0 ? c : Q(0)));
  }
}

RC_GTEST_PROP(QbSolverProperties, AddingAConstantToAnExpertChangesOnlyTiedChoices, ()) {
  // Shift column j0 by c and start from beta0 + c e_j0: every biased score s - beta is
  // unchanged, so alpha is unchanged and beta shifts by c e_j0; the selection can differ only
  // where rule 2 (raw score) breaks a tie of equal biased scores.
  const auto sz = test::random_qb_sizes();
  const Tensor<Q> s = test::any_scores(sz.m, sz.n);
  const std::int64_t j0 = *rc::gen::inRange<std::int64_t>(0, sz.n);
  const Q c = test::small_rational(-64, 64, test::qb_denominators);
  Tensor<Q> shifted = s;
  for (std::int64_t i = 0; i < sz.m; ++i) shifted(i, j0) += c;
  std::vector<Q> start(static_cast<std::size_t>(sz.n), Q(0)), start_shifted = start;
  start_shifted[j0] = c;
  const auto a = alternating_solver(s, sz.k, 4, start), b = alternating_solver(shifted, sz.k, 4, start_shifted);
  for (std::size_t t = 0; t < a.size(); ++t) {
    RC_ASSERT(a[t].alpha == b[t].alpha);
    for (std::int64_t j = 0; j < sz.n; ++j) RC_ASSERT(b[t].beta[j] == a[t].beta[j] + (j == j0 ? c : Q(0)));
    for (std::int64_t i = 0; i < sz.m; ++i) {
      const auto row = biased_row(s, i, a[t].beta);
      std::multiset<Q> va, vb;
      for (std::int64_t r = 0; r < sz.k; ++r) {
        va.insert(row[a[t].selection(i, r)]);
        vb.insert(row[b[t].selection(i, r)]);
      }
      RC_ASSERT(va == vb);  // same biased values selected: any difference is a tie
    }
  }
}

RC_GTEST_PROP(QbSolverProperties, PermutingTokensPermutesTheResult, ()) {
  const auto sz = test::random_qb_sizes();
  const Tensor<Q> s = test::any_scores(sz.m, sz.n);  // ties allowed: no rule involves tokens
  const auto perm = test::random_permutation(sz.m);
  Tensor<Q> p({sz.m, sz.n});
  for (std::int64_t i = 0; i < sz.m; ++i)
    for (std::int64_t j = 0; j < sz.n; ++j) p(i, j) = s(perm[i], j);
  const auto a = alternating_solver(s, sz.k, 4), b = alternating_solver(p, sz.k, 4);
  for (std::size_t t = 0; t < a.size(); ++t) {
    RC_ASSERT(a[t].beta == b[t].beta);
    RC_ASSERT(a[t].loads == b[t].loads);
    for (std::int64_t i = 0; i < sz.m; ++i) {
      RC_ASSERT(b[t].alpha[i] == a[t].alpha[perm[i]]);
      for (std::int64_t r = 0; r < sz.k; ++r) RC_ASSERT(b[t].selection(i, r) == a[t].selection(perm[i], r));
    }
  }
}

RC_GTEST_PROP(QbSolverProperties, PermutingExpertsPermutesTheResultWhenRawScoresDiffer, ()) {
  // With distinct raw scores in every row, rule 3 (index) never decides, so the rule is
  // equivariant. Selections are compared as sets (order within the top k follows values).
  const auto sz = test::random_qb_sizes();
  const Tensor<Q> s = test::tie_free_scores(sz.m, sz.n);
  const auto perm = test::random_permutation(sz.n);  // new expert j is old expert perm[j]
  Tensor<Q> p({sz.m, sz.n});
  for (std::int64_t i = 0; i < sz.m; ++i)
    for (std::int64_t j = 0; j < sz.n; ++j) p(i, j) = s(i, perm[j]);
  const auto a = alternating_solver(s, sz.k, 4), b = alternating_solver(p, sz.k, 4);
  for (std::size_t t = 0; t < a.size(); ++t) {
    RC_ASSERT(a[t].alpha == b[t].alpha);
    for (std::int64_t j = 0; j < sz.n; ++j) {
      RC_ASSERT(b[t].beta[j] == a[t].beta[perm[j]]);
      RC_ASSERT(b[t].loads[j] == a[t].loads[perm[j]]);
    }
    for (std::int64_t i = 0; i < sz.m; ++i)
      for (std::int64_t r = 0; r < sz.k; ++r) RC_ASSERT(perm[b[t].selection(i, r)] == a[t].selection(i, r));
  }
}

// A tie-free fixed point built on purpose: a balanced assignment X (the optimum of random
// scores), margins s - alpha - beta > 0 on X, < 0 off X, except one zero per row and per
// column off X (the (k+1)-th of the row, the (q+1)-th of the column). Then one iteration from
// beta returns (alpha, beta) exactly and the quantile property holds: every load is q.
RC_GTEST_PROP(QbSolverProperties, TieFreeFixedPointIsBalancedAndOptimal, ()) {
  const auto sz = test::random_qb_sizes();
  const std::int64_t q = sz.m * sz.k / sz.n;
  const Tensor<std::uint8_t> X = optimum_by_min_cost_flow(test::tie_free_scores(sz.m, sz.n), sz.k).chosen;
  std::vector<Q> alpha(static_cast<std::size_t>(sz.m)), beta(static_cast<std::size_t>(sz.n));
  for (Q& a : alpha) a = test::small_rational(-64, 64, test::qb_denominators);
  for (Q& b : beta) b = test::small_rational(-64, 64, test::qb_denominators);
  Tensor<std::uint8_t> zero({sz.m, sz.n}, 0);
  for (std::int64_t i = 0; i < sz.m; ++i) {
    std::vector<std::int64_t> off;
    for (std::int64_t j = 0; j < sz.n; ++j)
      if (!X(i, j)) off.push_back(j);
    zero(i, *rc::gen::elementOf(off)) = 1;
  }
  for (std::int64_t j = 0; j < sz.n; ++j) {
    bool covered = false;
    std::vector<std::int64_t> off;
    for (std::int64_t i = 0; i < sz.m; ++i) {
      covered = covered || zero(i, j);
      if (!X(i, j)) off.push_back(i);
    }
    if (!covered) zero(*rc::gen::elementOf(off), j) = 1;
  }
  Tensor<Q> s({sz.m, sz.n});
  for (std::int64_t i = 0; i < sz.m; ++i)
    for (std::int64_t j = 0; j < sz.n; ++j) {
      const Q margin = Q(*rc::gen::inRange(1, 1000)) / Q(64);
      s(i, j) = alpha[i] + beta[j] + (X(i, j) ? margin : zero(i, j) ? Q(0) : -margin);
    }
  const auto it = alternating_solver(s, sz.k, 1, beta).front();
  RC_ASSERT(it.alpha == alpha);
  RC_ASSERT(it.beta == beta);
  RC_ASSERT(it.loads == std::vector<std::int64_t>(static_cast<std::size_t>(sz.n), q));
  RC_ASSERT(selection_mask(it.selection, sz.n) == X);
  const Q optimum = optimum_by_min_cost_flow(s, sz.k).value;
  RC_ASSERT(selection_objective(s, it.selection) == optimum);
  RC_ASSERT(dual_objective(s, alpha, beta, sz.k) == optimum);
}

// Whatever fixed point a random run reaches: if no tie sits at any row's k-th/(k+1)-th or
// any column's q-th/(q+1)-th boundary, every expert gets exactly q tokens.
RC_GTEST_PROP(QbSolverProperties, RandomFixedPointsWithoutBoundaryTiesAreBalanced, ()) {
  const auto sz = test::random_qb_sizes();
  const std::int64_t q = sz.m * sz.k / sz.n;
  const Tensor<Q> s = test::tie_free_scores(sz.m, sz.n);
  const auto run = run_until_repeat(s, sz.k, 100);
  RC_ASSERT(run.repeat_of.has_value());
  const auto& last = run.trace.back();
  if (run.period() != 1 || run.drift() != Q(0)) return;
  bool tie_free = true;
  for (std::int64_t i = 0; i < sz.m; ++i) {
    const auto row = biased_row(s, i, last.beta);
    tie_free = tie_free && rth_largest(row, sz.k) != rth_largest(row, sz.k + 1);
  }
  for (std::int64_t j = 0; j < sz.n; ++j) {
    std::vector<Q> col(static_cast<std::size_t>(sz.m));
    for (std::int64_t i = 0; i < sz.m; ++i) col[i] = s(i, j) - last.alpha[i];
    tie_free = tie_free && rth_largest(col, q) != rth_largest(col, q + 1);
  }
  RC_CLASSIFY(tie_free, "tie-free fixed point");
  if (tie_free) {
    RC_ASSERT(last.loads == std::vector<std::int64_t>(static_cast<std::size_t>(sz.n), q));
    RC_ASSERT(dual_objective(s, last.alpha, last.beta, sz.k) == selection_objective(s, last.selection));
  }
}

RC_GTEST_PROP(QbSolverProperties, DualObjectiveDecreasesAndBoundsTheOptimum, ()) {
  // Block-coordinate descent on the dual (proofs/qb_dual.md): D never increases and never
  // falls below the LP optimum; a balanced selection's objective never exceeds it.
  const auto sz = test::random_qb_sizes();
  const Tensor<Q> s = test::any_scores(sz.m, sz.n);
  const Q optimum = optimum_by_min_cost_flow(s, sz.k).value;
  const auto trace = alternating_solver(s, sz.k, 6);
  Q previous = dual_objective(s, std::vector<Q>(static_cast<std::size_t>(sz.m), Q(0)),
                              std::vector<Q>(static_cast<std::size_t>(sz.n), Q(0)), sz.k);
  for (const auto& it : trace) {
    const Q d = dual_objective(s, it.alpha, it.beta, sz.k);
    RC_ASSERT(d <= previous);
    RC_ASSERT(d >= optimum);
    previous = d;
    const auto mask = selection_mask(it.selection, sz.n);
    if (is_balanced(mask, sz.k, sz.m * sz.k / sz.n)) RC_ASSERT(mask_objective(s, mask) <= optimum);
  }
}

RC_GTEST_PROP(QbSolverProperties, RepeatDetectionIsConsistent, ()) {
  const auto sz = test::random_qb_sizes();
  const Tensor<Q> s = test::any_scores(sz.m, sz.n);
  const auto run = run_until_repeat(s, sz.k, 100);
  RC_ASSERT(run.repeat_of.has_value());  // small exact instances always settle within 100
  const auto& earlier = run.beta_at(*run.repeat_of);
  for (std::int64_t j = 0; j < sz.n; ++j) RC_ASSERT(run.trace.back().beta[j] == earlier[j] + run.drift());
  // Once repeated, the run continues periodically: one more step from the last state
  // equals the step after the repeated one (shifted by the drift).
  const auto next = solver_step(s, run.trace.back().beta, routing_shape(sz.m, sz.n, sz.k, "t"));
  const auto& after_repeat = run.trace[static_cast<std::size_t>(*run.repeat_of)];
  RC_ASSERT(next.selection == after_repeat.selection);
  for (std::int64_t j = 0; j < sz.n; ++j) RC_ASSERT(next.beta[j] == after_repeat.beta[j] + run.drift());
}

// ---- floating point ----------------------------------------------------------------------

TEST(QbSolverDouble, ExactOnDyadicScores) {
  // Scores on the grid 2^-12 in [0, 16): every iterate is an alternating sum of scores, a
  // multiple of 2^-12 far below 2^41 in magnitude, so double subtraction is exact and the
  // double run equals the rational run bit for bit.
  num::Random rng(0x7162);
  for (int trial = 0; trial < 20; ++trial) {
    const std::int64_t m = 48, n = 16, k = 3;
    Tensor<double> s({m, n});
    for (double& x : s.values()) x = std::ldexp(static_cast<double>(rng.below(1 << 16)), -12);
    const Tensor<Q> sq = s.map<Q>([](double x) { return Q(x); });
    const auto a = alternating_solver(s, k, 8);
    const auto b = alternating_solver(sq, k, 8);
    for (std::size_t t = 0; t < a.size(); ++t) {
      ASSERT_EQ(a[t].selection, b[t].selection);
      for (std::int64_t i = 0; i < m; ++i) ASSERT_EQ(Q(a[t].alpha[i]), b[t].alpha[i]);
      for (std::int64_t j = 0; j < n; ++j) ASSERT_EQ(Q(a[t].beta[j]), b[t].beta[j]);
    }
  }
}

TEST(QbSolverErrors, NamesTheArgument) {
  const Tensor<Q> s({4, 2});
  EXPECT_THROW(alternating_solver(s, 1, 1, std::vector<Q>{0, 0, 0}), InvalidArgument);  // beta of 3 for 2 experts
  EXPECT_THROW(alternating_solver(s, 2, 1), InvalidArgument);                           // k = n
  EXPECT_THROW(alternating_solver(Tensor<Q>({4}), 1, 1), InvalidArgument);              // not [m, n]
  EXPECT_THROW(expert_biases(s, std::vector<Q>{0}, 2), InvalidArgument);
}

}  // namespace
}  // namespace k3ref::qb
