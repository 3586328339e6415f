// Tests of QB online (include/k3ref/qb/online.h): the bias of batch t routes batch t+1 and
// never its own batch; gating weights come from the unbiased affinities; the sign-update
// baseline moves each bias by exactly +-gamma or 0. Exact rationals unless stated.
#include "test_support.h"

#include <cmath>

#include "k3ref/num/scalar.h"
#include "k3ref/qb/online.h"

namespace k3ref::qb {
namespace {

using test::Q;

// Affinities in (0, 1): p / 64, 1 <= p <= 63, as sigmoid scores are.
std::vector<Tensor<Q>> random_batches(std::int64_t count, std::int64_t m, std::int64_t n) {
  std::vector<Tensor<Q>> batches;
  for (std::int64_t b = 0; b < count; ++b) {
    Tensor<Q> s({m, n});
    for (Q& x : s.values()) x = Q(*rc::gen::inRange(1, 64)) / Q(64);
    batches.push_back(std::move(s));
  }
  return batches;
}

OnlineOptions<Q> random_options(std::int64_t k) {
  OnlineOptions<Q> opt;
  opt.k = k;
  opt.routed_scaling_factor = Q(*rc::gen::inRange(1, 11)) / Q(4);
  opt.iterations_per_batch = *rc::gen::inRange(1, 4);
  opt.warm_start = *rc::gen::arbitrary<bool>();
  opt.center_bias = *rc::gen::arbitrary<bool>();
  return opt;
}

RC_GTEST_PROP(QbOnlineProperties, BiasOfBatchTRoutesBatchTPlusOneOnly, ()) {
  const auto sz = test::random_qb_sizes(10, 5);
  const auto opt = random_options(sz.k);
  auto batches = random_batches(4, sz.m, sz.n);
  const auto routed = route_online_qb(batches, opt);
  RC_ASSERT(routed[0].bias == std::vector<Q>(static_cast<std::size_t>(sz.n), Q(0)));
  for (std::size_t t = 0; t + 1 < batches.size(); ++t)
    RC_ASSERT(routed[t + 1].bias == qb_next_bias(batches[t], routed[t].bias, opt));
  for (std::size_t t = 0; t < batches.size(); ++t)
    RC_ASSERT(routed[t].selection == route(batches[t], routed[t].bias, sz.k));
  // Replacing batch 2 changes nothing routed before it, nor the bias that routes it.
  auto changed = batches;
  changed[2] = random_batches(1, sz.m, sz.n).front();
  const auto again = route_online_qb(changed, opt);
  for (std::size_t t = 0; t < 2; ++t) RC_ASSERT(again[t].selection == routed[t].selection);
  RC_ASSERT(again[2].bias == routed[2].bias);
}

RC_GTEST_PROP(QbOnlineProperties, WeightsAreNormalisedUnbiasedAffinities, ()) {
  const auto sz = test::random_qb_sizes(10, 5);
  const auto opt = random_options(sz.k);
  const auto batches = random_batches(3, sz.m, sz.n);
  const auto routed = route_online_qb(batches, opt);
  for (std::size_t t = 0; t < batches.size(); ++t) {
    const auto& b = routed[t];
    for (std::int64_t i = 0; i < sz.m; ++i) {
      Q sum(0), affinity_sum(0);
      for (std::int64_t r = 0; r < sz.k; ++r) {
        sum += b.weights(i, r);
        affinity_sum += batches[t](i, b.selection(i, r));
      }
      RC_ASSERT(sum == opt.routed_scaling_factor);
      for (std::int64_t r = 0; r < sz.k; ++r)
        RC_ASSERT(b.weights(i, r) * affinity_sum == opt.routed_scaling_factor * batches[t](i, b.selection(i, r)));
    }
  }
}

RC_GTEST_PROP(QbOnlineProperties, WeightsDependOnTheSelectionOnlyNotOnTheBias, ()) {
  // Two biases that differ by a constant select the same experts and give the same weights;
  // a bias that changes the selection changes the weights only through it.
  const auto sz = test::random_qb_sizes(10, 5);
  const auto s = random_batches(1, sz.m, sz.n).front();
  std::vector<Q> beta(static_cast<std::size_t>(sz.n)), shifted(beta.size());
  const Q c = test::small_rational(-64, 64, test::qb_denominators);
  for (std::size_t j = 0; j < beta.size(); ++j) {
    beta[j] = test::small_rational(-64, 64, test::qb_denominators);
    shifted[j] = beta[j] + c;
  }
  const Q scale(5, 2);
  const auto a = route(s, beta, sz.k), b = route(s, shifted, sz.k);
  RC_ASSERT(a == b);
  RC_ASSERT(gating_weights(s, a, scale) == gating_weights(s, b, scale));
}

RC_GTEST_PROP(QbOnlineProperties, SignUpdateMovesEachBiasByGammaTowardsBalance, ()) {
  const auto sz = test::random_qb_sizes(10, 5);
  const auto batches = random_batches(4, sz.m, sz.n);
  const Q gamma(1, 1000);  // DeepSeek-V3's update speed
  const auto routed = route_online_sign_update(batches, sz.k, gamma, Q(1));
  const Q mean = Q(sz.m * sz.k) / Q(sz.n);
  for (std::size_t t = 0; t + 1 < routed.size(); ++t)
    for (std::int64_t j = 0; j < sz.n; ++j) {
      const Q step = routed[t + 1].bias[j] - routed[t].bias[j];
      const Q load = Q(routed[t].loads[j]);
      // beta = -b: an overloaded expert's beta rises by gamma (its selection score falls).
      RC_ASSERT(step == (load > mean ? gamma : load < mean ? -gamma : Q(0)));
    }
}

TEST(QbOnline, QbBalancesAStationaryStreamAfterOneBatch) {
  // Identical batches: the bias computed on batch 0 is the solver's first iterate on it, so
  // batch 1 is routed exactly as iteration 1 of the offline solver routes the same scores.
  Tensor<Q> s({8, 4});
  const int values[] = {60, 50, 10, 5, 58, 40, 20, 1, 55, 30, 25, 2, 52, 45, 12, 3,
                        49, 44, 13, 4, 47, 33, 17, 6, 46, 35, 9, 7, 41, 38, 11, 8};
  for (int e = 0; e < 32; ++e) s.data()[e] = Q(values[e]) / Q(64);
  OnlineOptions<Q> opt;
  opt.k = 1;
  opt.center_bias = false;
  const auto routed = route_online_qb(std::vector<Tensor<Q>>{s, s}, opt);
  // Without a bias every token prefers expert 0 (column 0 is each row's maximum): loads {8,0,0,0}.
  EXPECT_EQ(routed[0].loads, (std::vector<std::int64_t>{8, 0, 0, 0}));
  EXPECT_EQ(routed[0].max_vio, Q(3));  // 8 / (8 / 4) - 1
  const auto offline = alternating_solver(s, 1, 1).front();
  EXPECT_EQ(routed[1].bias, offline.beta);
  EXPECT_EQ(routed[1].selection, offline.selection);
}

TEST(QbOnline, SigmoidScores) {
  const Tensor<double> logits({1, 3}, std::vector<double>{0.0, 2.0, -2.0});
  const auto s = sigmoid_scores(logits);
  EXPECT_EQ(s(0, 0), 0.5);
  EXPECT_NEAR(s(0, 1) + s(0, 2), 1.0, 4.4e-16);  // sigmoid(x) + sigmoid(-x) = 1; measured 1.11e-16, bound 4x
  using HP = num::high_precision<256>;
  // Double: exp (<= 1 ulp in glibc), the add and the division (0.5 ulp each) give a relative
  // error below 2.5 * 2^-53 ~ 2.8e-16 on a value below 1.
  EXPECT_NEAR(s(0, 1), static_cast<double>(sigmoid(HP(2))), 3e-16);
}

}  // namespace
}  // namespace k3ref::qb
