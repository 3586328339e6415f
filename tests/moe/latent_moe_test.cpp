// Tests of Stable LatentMoE (include/k3ref/moe/latent_moe.h). The plumbing (routing, tie
// rule, capacity, aggregation, projections, shared expert, the online QB bias) is tested with
// == in exact rationals (BilinearGlu, norm off); the norm and the transcendental GLUs in 256
// bits against a dense per-token evaluation written from the definition.
#include "test_support.h"

#include <algorithm>
#include <numeric>

#include "k3ref/moe/latent_moe.h"
#include "k3ref/num/scalar.h"

namespace k3ref::moe {
namespace {

using test::HP;
using test::Q;

struct Sizes {
  std::int64_t m, d, l, n, f, k, fs;
};

Sizes random_moe_sizes() {
  Sizes s;
  s.n = *rc::gen::inRange(2, 7);
  s.k = *rc::gen::inRange<std::int64_t>(1, s.n);
  s.m = s.n * *rc::gen::inRange(1, 4);  // n | m k
  s.d = *rc::gen::inRange(1, 5);
  s.l = *rc::gen::inRange(1, 4);
  s.f = *rc::gen::inRange(1, 4);
  s.fs = *rc::gen::inRange(0, 3);
  return s;
}

template <class S>
LatentMoeWeights<S> random_weights(const Sizes& s) {
  auto t = [](const Shape& shape) { return test::random_tensor(shape, -3, 3); };
  LatentMoeWeights<Q> w;
  w.router = t({s.n, s.d});
  w.down = t({s.l, s.d});
  w.up = t({s.d, s.l});
  w.norm_weight = t({s.l});
  w.w1 = t({s.n, s.f, s.l});
  w.w3 = t({s.n, s.f, s.l});
  w.w2 = t({s.n, s.l, s.f});
  if (s.fs > 0) {
    w.shared_w1 = t({s.fs, s.d});
    w.shared_w3 = t({s.fs, s.d});
    w.shared_w2 = t({s.d, s.fs});
  }
  if constexpr (std::is_same_v<S, Q>) {
    return w;
  } else {
    auto lift = [](const Tensor<Q>& x) { return x.numel() == 0 ? Tensor<S>() : test::lift<S>(x); };
    return {lift(w.router), lift(w.down), lift(w.up), lift(w.norm_weight), lift(w.w1), lift(w.w3), lift(w.w2),
            lift(w.shared_w1), lift(w.shared_w3), lift(w.shared_w2)};
  }
}

// Affinities p / 64 in (0, 1), as sigmoid scores are; `levels` > 0 draws from that many values.
Tensor<Q> random_affinities(std::int64_t m, std::int64_t n, int levels = 0) {
  Tensor<Q> a({m, n});
  for (Q& x : a.values()) x = levels > 0 ? Q(*rc::gen::inRange(1, levels + 1)) / Q(levels + 1) : Q(*rc::gen::inRange(1, 64)) / Q(64);
  return a;
}

// The layer written densely from the definition, per token: y = W_up N(sum_j g_j E_j(W_down x)) + S(x),
// g_j the weight of expert j when selected and kept, else 0. No shared code with latent_moe
// beyond the GLU and the norm's square root.
template <class S, class Math>
Tensor<S> dense_output(const Tensor<S>& x, const LatentMoeWeights<S>& w, const Tensor<std::int32_t>& selection,
                       const Tensor<S>& weights, const Tensor<std::uint8_t>& kept, const LatentMoeOptions<S>& opt,
                       const Math& math) {
  const std::int64_t m = x.dim(0), d = x.dim(1), l = w.down.dim(0), f = w.w1.dim(1), n = w.w1.dim(0);
  Tensor<S> y({m, d}, S(0));
  for (std::int64_t i = 0; i < m; ++i) {
    std::vector<S> gate_of(n, S(0));
    for (std::int64_t r = 0; r < opt.k; ++r)
      if (kept(i, r)) gate_of[selection(i, r)] = weights(i, r);
    std::vector<S> u(l, S(0)), a(l, S(0));
    for (std::int64_t c = 0; c < l; ++c)
      for (std::int64_t e = 0; e < d; ++e) u[c] += w.down(c, e) * x(i, e);
    for (std::int64_t j = 0; j < n; ++j) {
      std::vector<S> h(f);
      for (std::int64_t p = 0; p < f; ++p) {
        S g(0), v(0);
        for (std::int64_t c = 0; c < l; ++c) {
          g += w.w1(j, p, c) * u[c];
          v += w.w3(j, p, c) * u[c];
        }
        h[p] = math.glu(g, v);
      }
      for (std::int64_t c = 0; c < l; ++c) {
        S e(0);
        for (std::int64_t p = 0; p < f; ++p) e += w.w2(j, c, p) * h[p];
        a[c] += gate_of[j] * e;
      }
    }
    if (opt.norm) {
      if constexpr (requires { math.sqrt(S(1)); }) {
        S ms(0);
        for (const S& v : a) ms += v * v;
        const S rms = math.sqrt(ms / S(l) + opt.eps);
        for (std::int64_t c = 0; c < l; ++c) a[c] = w.norm_weight(c) * a[c] / rms;
      }
    }
    for (std::int64_t e = 0; e < d; ++e)
      for (std::int64_t c = 0; c < l; ++c) y(i, e) += w.up(e, c) * a[c];
    if (w.has_shared()) {
      const std::int64_t fs = w.shared_w1.dim(0);
      for (std::int64_t p = 0; p < fs; ++p) {
        S g(0), v(0);
        for (std::int64_t e = 0; e < d; ++e) {
          g += w.shared_w1(p, e) * x(i, e);
          v += w.shared_w3(p, e) * x(i, e);
        }
        const S h = math.glu(g, v);
        for (std::int64_t e = 0; e < d; ++e) y(i, e) += w.shared_w2(e, p) * h;
      }
    }
  }
  return y;
}

LatentMoeOptions<Q> exact_options(const Sizes& s) {
  LatentMoeOptions<Q> opt;
  opt.k = s.k;
  opt.routed_scaling_factor = Q(*rc::gen::inRange(1, 11)) / Q(4);
  opt.renormalize = *rc::gen::arbitrary<bool>();
  opt.norm = false;
  opt.capacity = *rc::gen::inRange<std::int64_t>(0, s.m + 1);
  return opt;
}

RC_GTEST_PROP(LatentMoeExact, EqualsTheDenseDefinition, ()) {
  const Sizes s = random_moe_sizes();
  const auto w = random_weights<Q>(s);
  const auto x = test::random_tensor({s.m, s.d}, -3, 3);
  const auto a = random_affinities(s.m, s.n, *rc::gen::element(0, 2, 3));
  std::vector<Q> bias(s.n);
  for (Q& b : bias) b = Q(*rc::gen::inRange(-8, 9)) / Q(16);
  const auto opt = exact_options(s);
  const auto r = latent_moe(x, a, bias, w, opt, BilinearGlu{});
  RC_ASSERT(r.output == dense_output(x, w, r.selection, r.weights, r.kept, opt, BilinearGlu{}));
  // The selection is qb::route's (the tie rule); the weights come from the unbiased
  // affinities of the selection only: c s_j / sum_{j' selected} s_j' (or c s_j).
  RC_ASSERT(r.selection == qb::route(a, bias, s.k));
  for (std::int64_t i = 0; i < s.m; ++i) {
    Q total(0);
    for (std::int64_t p = 0; p < s.k; ++p) total += a(i, r.selection(i, p));
    for (std::int64_t p = 0; p < s.k; ++p) {
      const Q share = opt.renormalize ? a(i, r.selection(i, p)) / total : a(i, r.selection(i, p));
      RC_ASSERT(r.weights(i, p) == opt.routed_scaling_factor * share);
    }
  }
}

RC_GTEST_PROP(LatentMoeExact, CapacityKeepsTheFirstRoutesInTokenOrder, ()) {
  const Sizes s = random_moe_sizes();
  const auto w = random_weights<Q>(s);
  const auto x = test::random_tensor({s.m, s.d}, -3, 3);
  const auto a = random_affinities(s.m, s.n, 2);
  auto opt = exact_options(s);
  opt.capacity = *rc::gen::inRange<std::int64_t>(1, s.m + 1);
  const auto r = latent_moe(x, a, std::vector<Q>(s.n, Q(0)), w, opt, BilinearGlu{});
  for (std::int64_t j = 0; j < s.n; ++j) {
    RC_ASSERT(r.kept_loads[j] == std::min(r.loads[j], opt.capacity));
    // Kept routes of expert j are exactly the first kept_loads[j] of its routes, token order.
    std::int64_t seen = 0;
    for (std::int64_t i = 0; i < s.m; ++i)
      for (std::int64_t p = 0; p < s.k; ++p)
        if (r.selection(i, p) == j) RC_ASSERT((r.kept(i, p) == 1) == (seen++ < opt.capacity));
  }
  // A capacity of at least every load drops nothing: the dropless layer.
  opt.capacity = s.m;
  auto dropless = opt;
  dropless.capacity = 0;
  RC_ASSERT(latent_moe(x, a, std::vector<Q>(s.n, Q(0)), w, opt, BilinearGlu{}).output ==
            latent_moe(x, a, std::vector<Q>(s.n, Q(0)), w, dropless, BilinearGlu{}).output);
}

RC_GTEST_PROP(LatentMoeExact, PermutingExpertsChangesNothingWhenAffinitiesAreDistinct, ()) {
  const Sizes s = random_moe_sizes();
  const auto w = random_weights<Q>(s);
  const auto x = test::random_tensor({s.m, s.d}, -3, 3);
  // Distinct affinities per row: a random permutation of 1..n over n + 1.
  Tensor<Q> a({s.m, s.n});
  for (std::int64_t i = 0; i < s.m; ++i) {
    const auto order = *rc::gen::unique<std::vector<int>>(s.n, rc::gen::inRange(1, 64));
    for (std::int64_t j = 0; j < s.n; ++j) a(i, j) = Q(order[j]) / Q(64);
  }
  std::vector<Q> bias(s.n);
  for (Q& b : bias) b = Q(*rc::gen::inRange(-8, 9)) / Q(16);
  auto opt = exact_options(s);
  opt.capacity = 0;  // capacity breaks ties between experts by token order, not by index: unaffected, but kept simple
  std::vector<std::int64_t> perm(s.n);
  std::iota(perm.begin(), perm.end(), 0);
  perm = *rc::gen::elementOf(std::vector<std::vector<std::int64_t>>{perm, std::vector<std::int64_t>(perm.rbegin(), perm.rend())});
  auto pw = w;
  Tensor<Q> pa({s.m, s.n});
  std::vector<Q> pbias(s.n);
  for (std::int64_t j = 0; j < s.n; ++j) {
    const std::int64_t from = perm[j];
    pbias[j] = bias[from];
    for (std::int64_t i = 0; i < s.m; ++i) pa(i, j) = a(i, from);
    for (std::int64_t p = 0; p < s.f; ++p)
      for (std::int64_t c = 0; c < s.l; ++c) {
        pw.w1(j, p, c) = w.w1(from, p, c);
        pw.w3(j, p, c) = w.w3(from, p, c);
        pw.w2(j, c, p) = w.w2(from, c, p);
      }
  }
  RC_ASSERT(latent_moe(x, a, bias, w, opt, BilinearGlu{}).output == latent_moe(x, pa, pbias, pw, opt, BilinearGlu{}).output);
}

TEST(LatentMoeExact, TiesGoToTheSmallerExpertIndex) {
  // All affinities equal, no bias: only rule 3 decides, every token takes experts 0..k-1.
  const Sizes s{4, 2, 2, 4, 1, 2, 0};
  LatentMoeWeights<Q> w;
  w.router = Tensor<Q>({s.n, s.d}, Q(1));
  w.down = Tensor<Q>({s.l, s.d}, Q(1));
  w.up = Tensor<Q>({s.d, s.l}, Q(1));
  w.norm_weight = Tensor<Q>({s.l}, Q(1));
  w.w1 = Tensor<Q>({s.n, s.f, s.l}, Q(1));
  w.w3 = Tensor<Q>({s.n, s.f, s.l}, Q(1));
  w.w2 = Tensor<Q>({s.n, s.l, s.f}, Q(1));
  LatentMoeOptions<Q> opt;
  opt.k = 2;
  opt.norm = false;
  opt.capacity = 2;  // every token asks for experts 0 and 1: tokens 2 and 3 are dropped
  const auto r = latent_moe(Tensor<Q>({s.m, s.d}, Q(1)), Tensor<Q>({s.m, s.n}, Q(1) / Q(2)), std::vector<Q>(s.n, Q(0)), w, opt,
                            BilinearGlu{});
  for (std::int64_t i = 0; i < s.m; ++i) {
    EXPECT_EQ(r.selection(i, 0), 0);
    EXPECT_EQ(r.selection(i, 1), 1);
    EXPECT_EQ(r.kept(i, 0), i < 2 ? 1 : 0);
  }
  // Kept token: u = W_down x = (2, 2); each expert's gate and up are 4, glu = 16, W2 gives
  // (16, 16); weights 1/2 each: a = (16, 16); y = W_up a = 32 per entry. Dropped tokens give 0.
  EXPECT_EQ(r.output(0, 0), Q(32));
  EXPECT_EQ(r.output(3, 1), Q(0));
}

RC_GTEST_PROP(LatentMoeExact, OnlineRoutesEachBatchWithThePreviousBatchsBias, ()) {
  Sizes s = random_moe_sizes();
  if (s.k == s.n) s.k = s.n - 1;  // QB needs k < n
  const auto w = random_weights<Q>(s);
  auto opt = exact_options(s);
  opt.capacity = 0;
  std::vector<Tensor<Q>> xs, as;
  for (int b = 0; b < 3; ++b) {
    xs.push_back(test::random_tensor({s.m, s.d}, -3, 3));
    as.push_back(random_affinities(s.m, s.n));
  }
  qb::OnlineOptions<Q> qbo;
  qbo.iterations_per_batch = *rc::gen::inRange(1, 3);
  const auto online = latent_moe_online(xs, as, w, opt, qbo, BilinearGlu{});
  qbo.k = s.k;
  qbo.routed_scaling_factor = opt.routed_scaling_factor;
  const auto qb_only = qb::route_online_qb(as, qbo);  // the QB online reference, alone
  for (std::size_t b = 0; b < xs.size(); ++b) {
    RC_ASSERT(online[b].bias == qb_only[b].bias);
    RC_ASSERT(online[b].selection == qb_only[b].selection);
    RC_ASSERT(online[b].output == latent_moe(xs[b], as[b], qb_only[b].bias, w, opt, BilinearGlu{}).output);
  }
}

// 256-bit: the Stable norm and the transcendental GLUs, against the dense definition (the
// two sum in different orders, so they agree to the precision, not bit for bit).
template <class Math>
void check_floating(const Math& math) {
  const Sizes s = random_moe_sizes();
  const auto w = random_weights<HP>(s);
  const auto x = test::lift<HP>(test::random_tensor({s.m, s.d}, -3, 3));
  const auto a = router_affinities(x, w.router);
  LatentMoeOptions<HP> opt;
  opt.k = s.k;
  opt.routed_scaling_factor = HP(5) / HP(2);
  opt.norm = true;
  const auto r = latent_moe(x, a, std::vector<HP>(s.n, HP(0)), w, opt, math);
  const auto dense = dense_output(x, w, r.selection, r.weights, r.kept, opt, math);
  RC_ASSERT(test::max_relative_difference(r.output, dense) < 1e-60);
}

RC_GTEST_PROP(LatentMoeFloating, SwiGluStableNormAgreesWithTheDenseDefinition, ()) { check_floating(SwiGlu{}); }
RC_GTEST_PROP(LatentMoeFloating, SituGluStableNormAgreesWithTheDenseDefinition, ()) { check_floating(SituGlu{}); }

TEST(LatentMoeFloating, DoubleIsWithinRoundingOf256Bits) {
  num::Random rng(test::test_seed(7));
  const Sizes s{16, 8, 4, 8, 6, 2, 4};
  LatentMoeWeights<double> wd;
  auto draw = [&](const Shape& shape) { return test::bf16_tensor(rng, shape, -1, 1); };
  wd = {draw({s.n, s.d}), draw({s.l, s.d}), draw({s.d, s.l}), draw({s.l}), draw({s.n, s.f, s.l}), draw({s.n, s.f, s.l}),
        draw({s.n, s.l, s.f}), draw({s.fs, s.d}), draw({s.fs, s.d}), draw({s.d, s.fs})};
  const auto x = draw({s.m, s.d});
  auto lift = [](const Tensor<double>& t) { return test::lift<HP>(t); };
  const LatentMoeWeights<HP> wh{lift(wd.router), lift(wd.down), lift(wd.up), lift(wd.norm_weight), lift(wd.w1), lift(wd.w3),
                                lift(wd.w2), lift(wd.shared_w1), lift(wd.shared_w3), lift(wd.shared_w2)};
  LatentMoeOptions<double> od;
  od.k = s.k;
  od.eps = 1e-5;
  LatentMoeOptions<HP> oh;
  oh.k = s.k;
  oh.eps = HP(1) / HP(100000);
  const auto rd = latent_moe(x, router_affinities(x, wd.router), std::vector<double>(s.n, 0.0), wd, od, SwiGlu{});
  const auto rh = latent_moe(lift(x), router_affinities(lift(x), wh.router), std::vector<HP>(s.n, HP(0)), wh, oh, SwiGlu{});
  EXPECT_EQ(rd.selection, rh.selection);
  // Measured 1.9e-16 (K3REF_SEED unset): a few ulps of accumulated rounding at these widths.
  EXPECT_LT(test::rel_rms(rd.output, rh.output), 2e-15);
}

}  // namespace
}  // namespace k3ref::moe
