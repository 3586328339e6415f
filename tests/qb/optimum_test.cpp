// Tests of the exact balanced-assignment optimum (include/k3ref/qb/optimum.h): min-cost
// flow and the simplex agree, with each other and with brute force; both duals certify
// optimality (strong duality, complementary slackness); the optimum moves as the LP says
// under row and column shifts; and the solver's duality gap is >= 0.
#include "test_support.h"

#include <bit>
#include <functional>

#include "k3ref/qb/optimum.h"
#include "k3ref/qb/solver.h"

namespace k3ref::qb {
namespace {

using test::Q;

// Brute force: every way to give each token k experts, keep the balanced ones.
Q brute_force_optimum(const Tensor<Q>& s, std::int64_t k) {
  const std::int64_t m = s.dim(0), n = s.dim(1), q = m * k / n;
  std::vector<std::int64_t> load(static_cast<std::size_t>(n), 0);
  std::optional<Q> best;
  std::function<void(std::int64_t, Q)> visit = [&](std::int64_t i, Q sum) {
    if (i == m) {
      for (std::int64_t l : load)
        if (l != q) return;
      if (!best || sum > *best) best = sum;
      return;
    }
    for (std::uint32_t subset = 0; subset < (1u << n); ++subset) {
      if (std::popcount(subset) != k) continue;
      Q add(0);
      bool fits = true;
      for (std::int64_t j = 0; j < n; ++j)
        if (subset >> j & 1u) {
          add += s(i, j);
          fits = fits && load[j] < q;
        }
      if (!fits) continue;
      for (std::int64_t j = 0; j < n; ++j) load[j] += subset >> j & 1u;
      visit(i + 1, sum + add);
      for (std::int64_t j = 0; j < n; ++j) load[j] -= subset >> j & 1u;
    }
  };
  visit(0, Q(0));
  return *best;
}

// (alpha, beta) certifies `chosen`: s_ij >= alpha_i + beta_j on it, <= off it.
bool complementary_slackness(const Tensor<Q>& s, const BalancedOptimum<Q>& opt) {
  for (std::int64_t i = 0; i < s.dim(0); ++i)
    for (std::int64_t j = 0; j < s.dim(1); ++j) {
      const Q reduced = s(i, j) - opt.alpha[i] - opt.beta[j];
      if (opt.chosen(i, j) ? reduced < Q(0) : reduced > Q(0)) return false;
    }
  return true;
}

TEST(QbOptimum, SmallCaseByHand) {
  // m = 4, n = 2, k = 1, q = 2, scores [3,0] [2,0] [1,0] [0,1]: expert 0 takes tokens 0, 1,
  // expert 1 tokens 2, 3: 3 + 2 + 0 + 1 = 6 (any other split loses at least 1).
  const Tensor<Q> s({4, 2}, std::vector<Q>{3, 0, 2, 0, 1, 0, 0, 1});
  for (const auto& opt : {optimum_by_min_cost_flow(s, 1), optimum_by_simplex(s, 1)}) {
    EXPECT_EQ(opt.value, Q(6));
    EXPECT_EQ(opt.chosen.values(), (std::vector<std::uint8_t>{1, 0, 1, 0, 0, 1, 0, 1}));
    EXPECT_EQ(dual_objective(s, opt.alpha, opt.beta, 1), Q(6));
  }
}

RC_GTEST_PROP(QbOptimumProperties, TwoMethodsAgreeAndCertifyThemselves, ()) {
  const auto sz = test::random_qb_sizes(10, 5);
  const bool tie_free = *rc::gen::arbitrary<bool>();
  const Tensor<Q> s = tie_free ? test::tie_free_scores(sz.m, sz.n) : test::tie_heavy_scores(sz.m, sz.n);
  const auto flow = optimum_by_min_cost_flow(s, sz.k);
  const auto simplex = optimum_by_simplex(s, sz.k);
  const std::int64_t q = sz.m * sz.k / sz.n;
  RC_ASSERT(flow.value == simplex.value);
  for (const auto* opt : {&flow, &simplex}) {
    RC_ASSERT(is_balanced(opt->chosen, sz.k, q));
    RC_ASSERT(mask_objective(s, opt->chosen) == opt->value);
    RC_ASSERT(dual_objective(s, opt->alpha, opt->beta, sz.k) == opt->value);  // zero duality gap
    RC_ASSERT(complementary_slackness(s, *opt));
  }
  // Distinct 40-bit scores: the optimal assignment is unique (two balanced assignments with
  // equal sums would need an exact integer relation), so both methods find the same one.
  if (tie_free) RC_ASSERT(flow.chosen == simplex.chosen);
}

RC_GTEST_PROP(QbOptimumProperties, AgreesWithBruteForceOnTinyInstances, ()) {
  const auto sz = test::random_qb_sizes(6, 4);
  const Tensor<Q> s = test::any_scores(sz.m, sz.n);
  RC_ASSERT(optimum_by_min_cost_flow(s, sz.k).value == brute_force_optimum(s, sz.k));
}

RC_GTEST_PROP(QbOptimumProperties, ShiftsMoveTheOptimumByTheConstraintTotals, ()) {
  // Adding c to row i adds c k to every feasible objective; to column j adds c q. The set of
  // optimal assignments is unchanged.
  const auto sz = test::random_qb_sizes();
  const std::int64_t q = sz.m * sz.k / sz.n;
  const Tensor<Q> s = test::tie_free_scores(sz.m, sz.n);
  const Q c = test::small_rational(-64, 64, test::qb_denominators);
  const std::int64_t i0 = *rc::gen::inRange<std::int64_t>(0, sz.m), j0 = *rc::gen::inRange<std::int64_t>(0, sz.n);
  Tensor<Q> row = s, col = s;
  for (std::int64_t j = 0; j < sz.n; ++j) row(i0, j) += c;
  for (std::int64_t i = 0; i < sz.m; ++i) col(i, j0) += c;
  const auto base = optimum_by_min_cost_flow(s, sz.k);
  const auto by_row = optimum_by_min_cost_flow(row, sz.k), by_col = optimum_by_min_cost_flow(col, sz.k);
  RC_ASSERT(by_row.value == base.value + c * Q(sz.k));
  RC_ASSERT(by_col.value == base.value + c * Q(q));
  RC_ASSERT(by_row.chosen == base.chosen);
  RC_ASSERT(by_col.chosen == base.chosen);
}

RC_GTEST_PROP(QbOptimumProperties, SolverDualityGapIsNonNegativeAndNonIncreasing, ()) {
  const auto sz = test::random_qb_sizes();
  const Tensor<Q> s = test::any_scores(sz.m, sz.n);
  const Q optimum = optimum_by_simplex(s, sz.k).value;
  Q previous_gap;
  bool first = true;
  for (const auto& it : alternating_solver(s, sz.k, 5)) {
    const Q gap = dual_objective(s, it.alpha, it.beta, sz.k) - optimum;
    RC_ASSERT(gap >= Q(0));
    if (!first) RC_ASSERT(gap <= previous_gap);
    previous_gap = gap;
    first = false;
  }
}

TEST(QbOptimum, RejectsImpossibleShapes) {
  EXPECT_THROW(optimum_by_min_cost_flow(Tensor<Q>({5, 2}), 1), InvalidArgument);  // q = 5/2
  EXPECT_THROW(optimum_by_simplex(Tensor<Q>({4, 2}), 2), InvalidArgument);        // k = n
}

}  // namespace
}  // namespace k3ref::qb
