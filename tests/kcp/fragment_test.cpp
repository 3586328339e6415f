// Tests of fragment pairs (eq. 17): the pair built through the recurrence against its
// definition, eq. 17 at every token, the algebra of composition, and the scans.
// Everything exact (==) in rationals with decays given as rationals.
#include "test_support.h"

#include <cstdio>

#include "k3ref/kcp/fragment.h"
#include "k3ref/num/random.h"

namespace k3ref::kcp {
namespace {

using namespace test;

struct Prepared {
  kda::Dims d;
  kda::PreparedInputs<Q> p;
};

Prepared prepare_exact(const kda::Inputs<Q>& in) {
  const auto opt = exact_options();
  Prepared r;
  r.d = kda::validate(kda::shapes_of(in, opt));
  r.p = kda::prepare(in, opt, r.d);
  return r;
}

// A fragment with arbitrary rational entries (not necessarily from KDA tokens).
Fragment<Q> random_fragment(std::int64_t HV, std::int64_t K, std::int64_t V) {
  return Fragment<Q>{random_tensor({HV, K, K}, -3, 3), random_tensor({HV, K, V}, -3, 3)};
}

// Tensor [K, K] -> [1, K, K] etc.
Tensor<Q> as_head(const Tensor<Q>& m) {
  Shape s{1};
  s.insert(s.end(), m.shape().begin(), m.shape().end());
  return Tensor<Q>(s, m.values());
}

// ---- the pair against its definition ----------------------------------------------------

// M = M_{t1-1} ... M_{t0} with M_t = (I - beta k k^T) Diag(a) written out, and
// S~ = the same affine steps from zero written out: independent of kda::recurrent_core.
RC_GTEST_PROP(KcpFragment, RunFragmentEqualsTheOrderedProductOfTokenTransitions, ()) {
  const Sizes s = random_sizes();
  const std::int64_t T = *rc::gen::inRange(0, 9);
  const auto in = random_packed_inputs(s, {0, T}, false);
  const auto pr = prepare_exact(in);
  const std::int64_t t0 = *rc::gen::inRange<std::int64_t>(0, T + 1), t1 = *rc::gen::inRange<std::int64_t>(t0, T + 1);
  const Fragment<Q> f = run_fragment(pr.p, pr.d, t0, t1);
  for (std::int64_t hv = 0; hv < s.HV; ++hv) {
    const std::int64_t h = hv / (s.HV / s.H);
    Fragment<Q> expect = identity_fragment<Q>(1, s.K, s.V);
    for (std::int64_t t = t0; t < t1; ++t) {
      const Tensor<Q> m = token_transition(&pr.p.k(0, t, h, 0), pr.p.beta(0, t, hv), &pr.p.decay(0, t, hv, 0), s.K);
      Fragment<Q> token{as_head(m), Tensor<Q>({1, s.K, s.V})};
      for (std::int64_t i = 0; i < s.K; ++i)
        for (std::int64_t j = 0; j < s.V; ++j) token.state(0, i, j) = pr.p.beta(0, t, hv) * pr.p.k(0, t, h, i) * pr.p.v(0, t, hv, j);
      expect = compose(token, expect);
    }
    for (std::int64_t i = 0; i < s.K; ++i) {
      for (std::int64_t j = 0; j < s.K; ++j) RC_ASSERT(f.transition(hv, i, j) == expect.transition(0, i, j));
      for (std::int64_t j = 0; j < s.V; ++j) RC_ASSERT(f.state(hv, i, j) == expect.state(0, i, j));
    }
  }
}

// Eq. 17: S^t = S~^t + M^{t<-1} S^0 for every t of a segment and every entering state.
RC_GTEST_PROP(KcpFragment, Eq17HoldsAtEveryTokenForAnyEnteringState, ()) {
  const Sizes s = random_sizes();
  const std::int64_t T = *rc::gen::inRange(1, 9);
  auto in = random_packed_inputs(s, {0, T}, true);
  auto opt = exact_options();
  opt.output_all_states = true;
  const auto run = kda::recurrent_forward(in, opt);
  const auto pr = prepare_exact(in);
  const Tensor<Q> S0({s.HV, s.K, s.V}, in.initial_state->values());
  for (std::int64_t t = 1; t <= T; ++t) {
    const Tensor<Q> predicted = apply(run_fragment(pr.p, pr.d, 0, t), S0);
    for (std::int64_t i = 0; i < predicted.numel(); ++i)
      RC_ASSERT(predicted.data()[i] == run.all_states->data()[(t - 1) * predicted.numel() + i]);
  }
}

// The fragment of a concatenation is the composition of the fragments.
RC_GTEST_PROP(KcpFragment, ConcatenatedRunsCompose, ()) {
  const Sizes s = random_sizes();
  const std::int64_t T = *rc::gen::inRange(0, 10);
  const auto pr = prepare_exact(random_packed_inputs(s, {0, T}, false));
  std::int64_t a = *rc::gen::inRange<std::int64_t>(0, T + 1), b = *rc::gen::inRange<std::int64_t>(0, T + 1),
               c = *rc::gen::inRange<std::int64_t>(0, T + 1);
  std::int64_t x[] = {a, b, c};
  std::sort(x, x + 3);
  RC_ASSERT(run_fragment(pr.p, pr.d, x[0], x[2]) ==
            compose(run_fragment(pr.p, pr.d, x[1], x[2]), run_fragment(pr.p, pr.d, x[0], x[1])));
}

// ---- algebra ------------------------------------------------------------------------------

RC_GTEST_PROP(KcpFragment, CompositionIsAssociative, ()) {
  const Sizes s = random_sizes();
  const auto f1 = random_fragment(s.HV, s.K, s.V), f2 = random_fragment(s.HV, s.K, s.V),
             f3 = random_fragment(s.HV, s.K, s.V);
  RC_ASSERT(compose(f3, compose(f2, f1)) == compose(compose(f3, f2), f1));
}

RC_GTEST_PROP(KcpFragment, IdentityIsNeutralOnBothSides, ()) {
  const Sizes s = random_sizes();
  const auto f = random_fragment(s.HV, s.K, s.V);
  const auto e = identity_fragment<Q>(s.HV, s.K, s.V);
  RC_ASSERT(compose(f, e) == f);
  RC_ASSERT(compose(e, f) == f);
}

// Plain linear attention (M = I): composition is the sum of the states, so it commutes.
RC_GTEST_PROP(KcpFragment, LinearAttentionFragmentsCommute, ()) {
  const Sizes s = random_sizes();
  auto f1 = identity_fragment<Q>(s.HV, s.K, s.V), f2 = f1;
  f1.state = random_tensor({s.HV, s.K, s.V}, -3, 3);
  f2.state = random_tensor({s.HV, s.K, s.V}, -3, 3);
  const auto c = compose(f2, f1);
  RC_ASSERT(c == compose(f1, f2));
  for (std::int64_t i = 0; i < c.state.numel(); ++i) RC_ASSERT(c.state.data()[i] == f1.state.data()[i] + f2.state.data()[i]);
}

// The document-boundary rule: (0, h0) is a left zero (whatever came before is forgotten),
// and what follows sees only h0.
RC_GTEST_PROP(KcpFragment, ResetForgetsEverythingBefore, ()) {
  const Sizes s = random_sizes();
  const auto f = random_fragment(s.HV, s.K, s.V), g = random_fragment(s.HV, s.K, s.V);
  const auto h0 = random_tensor({s.HV, s.K, s.V}, -3, 3);
  const auto reset = reset_fragment<Q>(s.HV, s.K, s.V, h0);
  RC_ASSERT(compose(reset, f) == reset);
  const auto after = compose(g, reset);
  RC_ASSERT(after.transition == Tensor<Q>({s.HV, s.K, s.K}));
  RC_ASSERT(after.state == apply(g, h0));
}

// A concrete counterexample to commutativity, found by enumerating one-token KDA fragments
// with K = V = 1 in a fixed order: k, beta in {0, 1/2, 1}, a in {1/2, 1}, v in {0, 1}. The
// first pair (x, y), x before y in that order, with y o x != x o y is recorded in
// proofs/kcp_composition.md and checked here.
TEST(KcpFragment, NonCommutativityCounterexampleIsFoundAndIsTheRecordedOne) {
  struct Token {
    Q k, beta, a, v;
  };
  std::vector<Token> tokens;
  for (Q k : {Q(0), Q(1, 2), Q(1)})
    for (Q beta : {Q(0), Q(1, 2), Q(1)})
      for (Q a : {Q(1, 2), Q(1)})
        for (Q v : {Q(0), Q(1)}) tokens.push_back({k, beta, a, v});
  auto fragment_of = [](const Token& t) {
    Fragment<Q> f{Tensor<Q>({1, 1, 1}), Tensor<Q>({1, 1, 1})};
    f.transition(0, 0, 0) = token_transition(&t.k, t.beta, &t.a, 1)(0, 0);  // (1 - beta k^2) a
    f.state(0, 0, 0) = t.beta * t.k * t.v;
    return f;
  };
  std::optional<std::pair<Token, Token>> found;
  for (std::size_t i = 0; i < tokens.size() && !found; ++i)
    for (std::size_t j = i + 1; j < tokens.size() && !found; ++j)
      if (compose(fragment_of(tokens[j]), fragment_of(tokens[i])) != compose(fragment_of(tokens[i]), fragment_of(tokens[j])))
        found = std::pair{tokens[i], tokens[j]};
  ASSERT_TRUE(found.has_value());
  const auto [x, y] = *found;
  std::printf("counterexample: x = (k %s, beta %s, a %s, v %s), y = (k %s, beta %s, a %s, v %s)\n",
              x.k.str().c_str(), x.beta.str().c_str(), x.a.str().c_str(), x.v.str().c_str(), y.k.str().c_str(),
              y.beta.str().c_str(), y.a.str().c_str(), y.v.str().c_str());
  // Recorded: x = (k 0, beta 0, a 1/2, v 0) is the pure decay (1/2, 0); y = (k 1/2, beta 1/2,
  // a 1/2, v 1) is ((1 - 1/8) 1/2, 1/4) = (7/16, 1/4). y o x = (7/32, 7/16 * 0 + 1/4) = (7/32, 1/4),
  // x o y = (7/32, 1/2 * 1/4 + 0) = (7/32, 1/8): the write of y is decayed only if x comes after.
  EXPECT_EQ(x.k, Q(0));
  EXPECT_EQ(x.beta, Q(0));
  EXPECT_EQ(x.a, Q(1, 2));
  EXPECT_EQ(x.v, Q(0));
  EXPECT_EQ(y.k, Q(1, 2));
  EXPECT_EQ(y.beta, Q(1, 2));
  EXPECT_EQ(y.a, Q(1, 2));
  EXPECT_EQ(y.v, Q(1));
  const auto yx = compose(fragment_of(y), fragment_of(x)), xy = compose(fragment_of(x), fragment_of(y));
  EXPECT_EQ(yx.transition(0, 0, 0), Q(7, 32));
  EXPECT_EQ(yx.state(0, 0, 0), Q(1, 4));
  EXPECT_EQ(xy.state(0, 0, 0), Q(1, 8));
}

// ---- scans --------------------------------------------------------------------------------

// Tree-shaped and sequential prefix scans agree on fragments of random splits of a
// sequence, and the inclusive prefix is the fragment of the whole prefix.
RC_GTEST_PROP(KcpFragment, TreeScanEqualsSequentialScanAndPrefixFragments, ()) {
  const Sizes s = random_sizes();
  const std::int64_t T = *rc::gen::inRange(0, 13);
  const auto pr = prepare_exact(random_packed_inputs(s, {0, T}, false));
  const auto splits = random_splits(T, 12);
  std::vector<Fragment<Q>> f;
  for (std::size_t r = 0; r + 1 < splits.size(); ++r) f.push_back(run_fragment(pr.p, pr.d, splits[r], splits[r + 1]));
  const auto seq = inclusive_scan_sequential(f);
  const auto tree = inclusive_scan_tree(f, s.HV, s.K, s.V);
  const auto tree_ex = exclusive_scan_tree(f, s.HV, s.K, s.V);
  RC_ASSERT(seq.size() == f.size());
  for (std::size_t r = 0; r < f.size(); ++r) {
    RC_ASSERT(tree[r] == seq[r]);
    RC_ASSERT(seq[r] == run_fragment(pr.p, pr.d, 0, splits[r + 1]));
    RC_ASSERT(tree_ex[r] == (r == 0 ? identity_fragment<Q>(s.HV, s.K, s.V) : seq[r - 1]));
  }
}

// Scans over arbitrary (non-KDA) fragments, lengths 0..17 (not powers of two).
RC_GTEST_PROP(KcpFragment, TreeScanEqualsSequentialScanOnArbitraryFragments, ()) {
  const std::int64_t n = *rc::gen::inRange(0, 18), K = *rc::gen::inRange(1, 3), V = *rc::gen::inRange(1, 3);
  std::vector<Fragment<Q>> f;
  for (std::int64_t i = 0; i < n; ++i) f.push_back(random_fragment(1, K, V));
  const auto seq = inclusive_scan_sequential(f);
  const auto tree = inclusive_scan_tree(f, 1, K, V);
  for (std::int64_t i = 0; i < n; ++i) RC_ASSERT(tree[static_cast<std::size_t>(i)] == seq[static_cast<std::size_t>(i)]);
}

// The order of the operands matters: a scan that composes them the wrong way round
// (earlier o later) gives a different prefix on some input, and the tests find one.
TEST(KcpFragment, ComposingInTheWrongOrderIsCaught) {
  int differing = 0, cases = 0;
  num::Random rng(20261130);
  auto r = [&](int lo, int hi) { return Q(rng.between(lo, hi)) / Q(rng.between(1, 4)); };
  for (; cases < 200; ++cases) {
    Fragment<Q> a{Tensor<Q>({1, 2, 2}), Tensor<Q>({1, 2, 2})}, b = a;
    for (auto* f : {&a, &b}) {
      for (Q& x : f->transition.values()) x = r(-3, 3);
      for (Q& x : f->state.values()) x = r(-3, 3);
    }
    if (compose(b, a) != compose(a, b)) ++differing;
  }
  std::printf("wrong operand order detected on %d of %d random pairs\n", differing, cases);
  EXPECT_GT(differing, cases / 2);
}

}  // namespace
}  // namespace k3ref::kcp
