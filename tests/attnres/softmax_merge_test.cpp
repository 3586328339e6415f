// The online-softmax merge of AttnRes's two-phase inference (proofs/attnres_merge.md).
// Exact: scores given as their exponentials (ExactWeights) in rationals, so the identity
// merge(stats(A), stats(B)) == stats(A ∪ B) is checked with ==, for any split and any
// grouping. At 256 bits with the real exponential: equal to rounding.
#include "test_support.h"

#include <algorithm>
#include <numeric>

#include "k3ref/attnres/softmax_merge.h"
#include "k3ref/num/scalar.h"

namespace k3ref::attnres {
namespace {

using Q = num::rational;
using HP = num::high_precision<256>;

// Rationals over denominators 1, 2, 3, 4, 7, 8.
constexpr std::array<int, 6> denominators{1, 2, 3, 4, 7, 8};

// n sources of [T, d] values; scores are positive weights p/q ("e^s").
struct Case {
  std::vector<Tensor<Q>> values;
  std::vector<std::vector<Q>> weights;
  Sources<Q> sources(const std::vector<std::size_t>& which) const {
    Sources<Q> s;
    for (std::size_t j : which) {
      s.scores.push_back(weights[j]);
      s.values.push_back(&values[j]);
    }
    return s;
  }
};

Case random_case(std::size_t n) {
  const std::int64_t T = *rc::gen::inRange(1, 4), d = *rc::gen::inRange(1, 5);
  Case c;
  for (std::size_t j = 0; j < n; ++j) {
    Tensor<Q> v({T, d});
    for (Q& x : v.values()) x = test::small_rational(-8, 8, denominators);
    c.values.push_back(v);
    std::vector<Q> w(T);
    for (Q& x : w) x = test::small_rational(1, 16, denominators);  // positive
    c.weights.push_back(w);
  }
  return c;
}

std::vector<std::size_t> iota(std::size_t n) {
  std::vector<std::size_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// Merges the statistics of `groups` (each a set of source indices) along a random binary tree.
SoftmaxStats<Q> merge_tree(const Case& c, std::vector<SoftmaxStats<Q>> parts) {
  while (parts.size() > 1) {
    const std::size_t i = *rc::gen::inRange<std::size_t>(0, parts.size() - 1);
    // Either order of the operands: the merge is also commutative.
    SoftmaxStats<Q> m = *rc::gen::arbitrary<bool>() ? merge<ExactWeights>(parts[i], parts[i + 1])
                                                    : merge<ExactWeights>(parts[i + 1], parts[i]);
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(i), parts.begin() + static_cast<std::ptrdiff_t>(i) + 2);
    parts.insert(parts.begin() + static_cast<std::ptrdiff_t>(i), std::move(m));
  }
  (void)c;
  return parts[0];
}

RC_GTEST_PROP(AttnResMergeExact, TwoPhaseEqualsDirectForAnySplit, ()) {
  const std::size_t n = *rc::gen::inRange<std::size_t>(2, 9);
  const Case c = random_case(n);
  const std::size_t completed = *rc::gen::inRange<std::size_t>(1, n);  // completed blocks, then the rest
  const std::vector<std::size_t> all = iota(n);
  std::vector<std::size_t> first(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(completed));
  std::vector<std::size_t> rest(all.begin() + static_cast<std::ptrdiff_t>(completed), all.end());
  const SoftmaxStats<Q> direct = stats_of<ExactWeights>(c.sources(all));
  const SoftmaxStats<Q> merged =
      merge<ExactWeights>(stats_of<ExactWeights>(c.sources(first)), stats_of<ExactWeights>(c.sources(rest)));
  RC_ASSERT(merged == direct);
  // And the normalised output equals the direct weighted average.
  RC_ASSERT(normalised(merged) == softmax_average<ExactWeights>(c.sources(all)).h);
}

RC_GTEST_PROP(AttnResMergeExact, MergeIsAssociativeOverAnyGrouping, ()) {
  const std::size_t n = *rc::gen::inRange<std::size_t>(2, 9);
  const Case c = random_case(n);
  // A random partition of the sources (any subsets, not only contiguous runs), then a
  // random bracketing of the merges.
  std::vector<std::size_t> perm = iota(n);
  for (std::size_t i = n; i-- > 1;) std::swap(perm[i], perm[*rc::gen::inRange<std::size_t>(0, i + 1)]);
  std::vector<SoftmaxStats<Q>> parts;
  for (std::size_t begin = 0; begin < n;) {
    const std::size_t len = *rc::gen::inRange<std::size_t>(1, n - begin + 1);
    std::vector<std::size_t> group(perm.begin() + static_cast<std::ptrdiff_t>(begin),
                                   perm.begin() + static_cast<std::ptrdiff_t>(begin + len));
    parts.push_back(stats_of<ExactWeights>(c.sources(group)));
    begin += len;
  }
  RC_ASSERT(merge_tree(c, parts) == stats_of<ExactWeights>(c.sources(iota(n))));
}

RC_GTEST_PROP(AttnResMergeExact, ConstantShiftOfAllScoresChangesNothing, ()) {
  const std::size_t n = *rc::gen::inRange<std::size_t>(1, 9);
  Case c = random_case(n);
  const Average<Q> before = softmax_average<ExactWeights>(c.sources(iota(n)));
  const SoftmaxStats<Q> st_before = stats_of<ExactWeights>(c.sources(iota(n)));
  // Adding c to every score of a token multiplies every weight by e^c (any positive factor).
  const Q factor = test::small_rational(1, 50, denominators);
  for (auto& w : c.weights)
    for (Q& x : w) x *= factor;
  const Average<Q> after = softmax_average<ExactWeights>(c.sources(iota(n)));
  const SoftmaxStats<Q> st_after = stats_of<ExactWeights>(c.sources(iota(n)));
  RC_ASSERT(after.h == before.h);
  RC_ASSERT(after.alpha == before.alpha);
  RC_ASSERT(st_after.output == st_before.output);  // (o, l) unchanged, m moves with the shift
  RC_ASSERT(st_after.sum == st_before.sum);
  for (std::size_t t = 0; t < st_before.max.size(); ++t) RC_ASSERT(st_after.max[t] == st_before.max[t] * factor);
}

// Any deterministic exponential, as long as it is applied to s - max: the shift cancels
// exactly before the exponential is taken. The exponential here is exp in double, converted
// back exactly, so the scores can be arbitrary rationals.
struct DoubleExp {
  static Q exp_diff(const Q& s, const Q& m) { return Q(std::exp((s - m).convert_to<double>())); }
};

RC_GTEST_PROP(AttnResMergeExact, ConstantShiftOfLogDomainScoresChangesNothing, ()) {
  const std::size_t n = *rc::gen::inRange<std::size_t>(1, 9);
  Case c = random_case(n);
  for (auto& w : c.weights)
    for (Q& x : w) x = test::small_rational(-40, 40, denominators);  // now ordinary (log-domain) scores
  const Average<Q> before = softmax_average<DoubleExp>(c.sources(iota(n)));
  const Q shift = test::small_rational(-1000, 1000, denominators);
  for (auto& w : c.weights)
    for (Q& x : w) x += shift;
  const Average<Q> after = softmax_average<DoubleExp>(c.sources(iota(n)));
  RC_ASSERT(after.h == before.h);
  RC_ASSERT(after.alpha == before.alpha);
}

RC_GTEST_PROP(AttnResMergeExact, PermutingSourcesPermutesTheWeights, ()) {
  const std::size_t n = *rc::gen::inRange<std::size_t>(2, 9);
  const Case c = random_case(n);
  std::vector<std::size_t> perm = iota(n);
  for (std::size_t i = n; i-- > 1;) std::swap(perm[i], perm[*rc::gen::inRange<std::size_t>(0, i + 1)]);
  const Average<Q> a = softmax_average<ExactWeights>(c.sources(iota(n)));
  const Average<Q> b = softmax_average<ExactWeights>(c.sources(perm));
  RC_ASSERT(a.h == b.h);
  for (std::int64_t t = 0; t < a.alpha.dim(0); ++t)
    for (std::size_t j = 0; j < n; ++j) RC_ASSERT(b.alpha(t, static_cast<std::int64_t>(j)) == a.alpha(t, static_cast<std::int64_t>(perm[j])));
  RC_ASSERT(stats_of<ExactWeights>(c.sources(perm)) == stats_of<ExactWeights>(c.sources(iota(n))));
}

RC_GTEST_PROP(AttnResMergeExact, WeightsArePositiveAndSumToOne, ()) {
  const std::size_t n = *rc::gen::inRange<std::size_t>(1, 9);
  const Case c = random_case(n);
  const Average<Q> a = softmax_average<ExactWeights>(c.sources(iota(n)));
  for (std::int64_t t = 0; t < a.alpha.dim(0); ++t) {
    Q sum(0);
    for (std::int64_t j = 0; j < a.alpha.dim(1); ++j) {
      RC_ASSERT(a.alpha(t, j) > 0);
      sum += a.alpha(t, j);
    }
    RC_ASSERT(sum == 1);
  }
}

// The real exponential at 256 bits: the merge differs from the direct statistics only by
// rounding (under one ulp of 2^-256 relative): measured at most 1.16e-79 over the CI seed's
// 100 cases and seeds 1-10 (2026-12-01); the bound is 4x that.
RC_GTEST_PROP(AttnResMergeHighPrecision, TwoPhaseEqualsDirectToRounding, ()) {
  const std::size_t n = *rc::gen::inRange<std::size_t>(2, 9);
  const Case c = random_case(n);
  std::vector<Tensor<HP>> values;
  std::vector<std::vector<HP>> scores;
  for (std::size_t j = 0; j < n; ++j) {
    values.push_back(c.values[j].map<HP>([](const Q& x) { return HP(x.convert_to<HP>()); }));
    std::vector<HP> s;
    for (std::size_t t = 0; t < c.weights[j].size(); ++t) s.push_back(HP(test::small_rational(-60, 60, denominators).convert_to<HP>()));
    scores.push_back(s);
  }
  const std::size_t split = *rc::gen::inRange<std::size_t>(1, n);
  Sources<HP> all, first, rest;
  for (std::size_t j = 0; j < n; ++j) {
    all.scores.push_back(scores[j]);
    all.values.push_back(&values[j]);
    Sources<HP>& part = j < split ? first : rest;
    part.scores.push_back(scores[j]);
    part.values.push_back(&values[j]);
  }
  const Tensor<HP> direct = softmax_average<StandardMath>(all).h;
  const Tensor<HP> merged = normalised(merge<StandardMath>(stats_of<StandardMath>(first), stats_of<StandardMath>(rest)));
  for (std::int64_t i = 0; i < direct.numel(); ++i)
    RC_ASSERT(abs(direct.values()[i] - merged.values()[i]) <= HP(4.6e-79) * (1 + abs(direct.values()[i])));
}

TEST(AttnResMerge, RejectsEmptyAndMismatchedSources) {
  Sources<double> none;
  EXPECT_THROW(stats_of<StandardMath>(none), InvalidArgument);
  Tensor<double> a({2, 3}), b({2, 4});
  Sources<double> mixed{{{0.0, 0.0}, {0.0, 0.0}}, {&a, &b}};
  EXPECT_THROW(softmax_average<StandardMath>(mixed), InvalidArgument);
  Sources<double> short_scores{{{0.0}}, {&a}};
  EXPECT_THROW(stats_of<StandardMath>(short_scores), InvalidArgument);
}

}  // namespace
}  // namespace k3ref::attnres
