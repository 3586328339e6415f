// Tests of the backward state pass: the adjoint fragments and the reverse scan give the
// gradient of a loss with respect to every rank's entering state and every document's
// initial state; checked against central finite differences of the single-device
// recurrence. The loss L = <dO, o> + <dF, final_state> is the general case (any loss's
// state gradient is this one with dO = dL/do, dF = dL/dfinal) and it is affine in the
// states, so in rationals a central difference with step 1 is exact and the check is ==;
// at 256 bits with real gates the difference is rounding only.
#include "test_support.h"

#include "k3ref/kcp/backward.h"

#if __has_include("k3ref/num/dual.h")
#include "k3ref/num/dual.h"
#define K3REF_KCP_HAVE_DUAL 1
#endif

namespace k3ref::kcp {
namespace {

using namespace test;

template <class S>
S dot(const Tensor<S>& a, const Tensor<S>& b) {
  S sum(0);
  for (std::int64_t i = 0; i < a.numel(); ++i) sum += a.data()[i] * b.data()[i];
  return sum;
}

template <class S>
Tensor<S> tokens(const Tensor<S>& t, std::int64_t t0, std::int64_t t1) {
  return detail::slice_tokens(t, t0, t1);
}

// L of the single-device recurrence.
template <class S>
S loss(const kda::Inputs<S>& in, const kda::Options<S>& opt, const Tensor<S>& d_o, const Tensor<S>& d_f) {
  const auto out = kda::recurrent_forward(in, opt);
  return dot(d_o, out.o) + dot(d_f, *out.final_state);
}

// The part of L that depends on the state at position `a` (before token a), as a function
// of that state X: the recurrence run from token a, the document holding token a starting
// from X, later documents from their own initial states. Nothing of the split is used.
template <class S>
S suffix_loss(const kda::Inputs<S>& in, const kda::Options<S>& opt, std::int64_t a, const Tensor<S>& X,
              const Tensor<S>& d_o, const Tensor<S>& d_f) {
  const auto& cu = *in.cu_seqlens;
  const std::int64_t T = cu.back(), N = static_cast<std::int64_t>(cu.size()) - 1, first = document_of(cu, a);
  kda::Inputs<S> part = in;
  part.q = tokens(in.q, a, T);
  part.k = tokens(in.k, a, T);
  part.v = tokens(in.v, a, T);
  part.g = tokens(in.g, a, T);
  part.beta = tokens(in.beta, a, T);
  std::vector<std::int64_t> local{0};
  for (std::int64_t n = first + 1; n < N; ++n) local.push_back(cu[static_cast<std::size_t>(n)] - a);
  local.push_back(T - a);
  part.cu_seqlens = local;
  const std::int64_t docs = N - first, block = X.numel();
  Tensor<S> h0({docs, X.dim(0), X.dim(1), X.dim(2)});
  for (std::int64_t j = 0; j < docs; ++j)
    for (std::int64_t i = 0; i < block; ++i)
      h0.data()[j * block + i] = j == 0 ? X.data()[i] : in.initial_state->data()[(first + j) * block + i];
  part.initial_state = h0;
  const auto out = kda::recurrent_forward(part, opt);
  const Tensor<S> df(Shape{docs, X.dim(0), X.dim(1), X.dim(2)},
                     std::vector<S>(d_f.data() + first * block, d_f.data() + d_f.numel()));
  return dot(tokens(d_o, a, T), out.o) + dot(df, *out.final_state);
}

// Central difference (f(x + h e_i) - f(x - h e_i)) / 2h for every entry i of x.
template <class S, class F>
Tensor<S> central_difference(const Tensor<S>& x, const S& h, F&& f) {
  Tensor<S> grad(x.shape());
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    Tensor<S> up = x, down = x;
    up.data()[i] += h;
    down.data()[i] -= h;
    grad.data()[i] = (f(up) - f(down)) / (S(2) * h);
  }
  return grad;
}

template <class S>
void check_against_finite_differences(const kda::Inputs<S>& in, const kda::Options<S>& opt,
                                      const std::vector<std::int64_t>& splits, Merge merge, const Tensor<S>& d_o,
                                      const Tensor<S>& d_f, const S& h, double tolerance) {
  const auto res = context_parallel_state_backward(in, opt, splits, d_o, std::optional<Tensor<S>>(d_f), merge);
  auto close = [&](const Tensor<S>& a, const Tensor<S>& b) {
    if constexpr (num::is_exact_v<S>) return a == b;
    else return max_relative_difference(a, b) <= tolerance;
  };
  // Every document's initial state.
  const Tensor<S> fd_h0 = central_difference(*in.initial_state, h, [&](const Tensor<S>& x) {
    kda::Inputs<S> moved = in;
    moved.initial_state = x;
    return loss(moved, opt, d_o, d_f);
  });
  RC_ASSERT(close(res.initial_state_gradient, fd_h0));
  // Every continuing rank's entering state, at the state the single device has there.
  auto all_opt = opt;
  all_opt.output_all_states = true;
  const auto states = *kda::recurrent_forward(in, all_opt).all_states;
  for (std::size_t r = 0; r < res.plan.ranks.size(); ++r) {
    const RankSlice& s = res.plan.ranks[r];
    if (s.empty() || !s.continues) continue;
    const std::int64_t block = res.entering_gradients[r].numel();
    const Tensor<S> X(res.entering_gradients[r].shape(),
                      std::vector<S>(states.data() + (s.begin - 1) * block, states.data() + s.begin * block));
    const Tensor<S> fd = central_difference(X, h, [&](const Tensor<S>& x) { return suffix_loss(in, opt, s.begin, x, d_o, d_f); });
    RC_ASSERT(close(res.entering_gradients[r], fd));
  }
}

void exact_case(Merge merge) {
  const std::int64_t H = *rc::gen::inRange(1, 3);
  const Sizes s{H, H * *rc::gen::inRange(1, 3), *rc::gen::inRange<std::int64_t>(1, 3), *rc::gen::inRange<std::int64_t>(1, 3)};
  const auto cu = random_documents(4, 5);
  const auto in = random_packed_inputs(s, cu, true);
  const auto opt = exact_options();
  const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1;
  const auto d_o = random_tensor({1, cu.back(), s.HV, s.V}, -3, 3);
  const auto d_f = random_tensor({N, s.HV, s.K, s.V}, -3, 3);
  check_against_finite_differences(in, opt, random_splits(cu.back(), 6), merge, d_o, d_f, Q(1), 0);
}

RC_GTEST_PROP(KcpBackward, ExactGradientsWithMirrorPass, ()) { exact_case(Merge::origin_rank); }
RC_GTEST_PROP(KcpBackward, ExactGradientsWithSequentialReverseScan, ()) { exact_case(Merge::sequential_scan); }
RC_GTEST_PROP(KcpBackward, ExactGradientsWithTreeReverseScan, ()) { exact_case(Merge::tree_scan); }

// Real gates at 256 bits: central differences with step 2^-40.
RC_GTEST_PROP(KcpBackward, RealGateGradientsAgreeWithFiniteDifferencesAtHighPrecision, ()) {
  const Sizes s{1, *rc::gen::element<std::int64_t>(1, 2), 2, *rc::gen::inRange<std::int64_t>(1, 3)};
  const auto cu = random_documents(3, 5);
  const auto c = random_real_gate_case(s, cu);
  const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1;
  const auto d_o = lift<HP>(random_tensor({1, cu.back(), s.HV, s.V}, -3, 3));
  const auto d_f = lift<HP>(random_tensor({N, s.HV, s.K, s.V}, -3, 3));
  const auto merge = *rc::gen::element(Merge::origin_rank, Merge::sequential_scan, Merge::tree_scan);
  check_against_finite_differences(c.in, c.opt, random_splits(cu.back(), 5), merge, d_o, d_f, HP(1) / HP(1ull << 40), 1e-50);
}

#ifdef K3REF_KCP_HAVE_DUAL
// A second, independent derivative: forward-mode dual numbers over rationals run the
// single-device recurrence itself with a random direction E on the initial states (and on
// the state at each continuing rank's first token); the tangent of L is <gradient, E>.
RC_GTEST_PROP(KcpBackward, GradientsAgreeWithForwardModeDualNumbersExactly, ()) {
  using D = num::Dual<Q>;
  const Sizes s = random_sizes();
  const auto cu = random_documents(4, 5);
  const auto in = random_packed_inputs(s, cu, true);
  const auto opt = exact_options();
  const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1;
  const auto d_o = random_tensor({1, cu.back(), s.HV, s.V}, -3, 3);
  const auto d_f = random_tensor({N, s.HV, s.K, s.V}, -3, 3);
  const auto splits = random_splits(cu.back(), 6);
  const auto res = context_parallel_state_backward(in, opt, splits, d_o, std::optional<Tensor<Q>>(d_f));

  auto up = [](const Tensor<Q>& t) { return t.map<D>([](const Q& x) { return D(x); }); };
  kda::Inputs<D> din{up(in.q), up(in.k), up(in.v), up(in.g), up(in.beta), up(*in.initial_state), std::nullopt,
                     std::nullopt, in.cu_seqlens};
  kda::Options<D> dopt;
  dopt.gate = kda::GateForm::decay_factor;
  dopt.scale = D(Q(1, 2));
  const kda::Inputs<D> din_plain = din;  // no tangent: for the entering-state directions
  const auto E = random_tensor(in.initial_state->shape(), -3, 3);
  for (std::int64_t i = 0; i < E.numel(); ++i) din.initial_state->data()[i].tangent() = E.data()[i];
  const D L = loss(din, dopt, up(d_o), up(d_f));
  RC_ASSERT(L.tangent() == dot(res.initial_state_gradient, E));

  auto all_opt = opt;
  all_opt.output_all_states = true;
  const auto states = *kda::recurrent_forward(in, all_opt).all_states;
  for (std::size_t r = 0; r < res.plan.ranks.size(); ++r) {
    const RankSlice& rs = res.plan.ranks[r];
    if (rs.empty() || !rs.continues) continue;
    const std::int64_t block = res.entering_gradients[r].numel();
    Tensor<D> X(res.entering_gradients[r].shape());
    const auto Er = random_tensor(X.shape(), -3, 3);
    for (std::int64_t i = 0; i < block; ++i) X.data()[i] = D(states.data()[(rs.begin - 1) * block + i], Er.data()[i]);
    const D Lr = suffix_loss(din_plain, dopt, rs.begin, X, up(d_o), up(d_f));
    RC_ASSERT(Lr.tangent() == dot(res.entering_gradients[r], Er));
  }
}
#endif

// The full context-parallel backward, rank by rank, gathered: every gradient equals the
// single-device adjoint recurrence (kda::recurrent_backward) exactly, for every merge.
RC_GTEST_PROP(KcpBackward, GatheredRankGradientsEqualTheSingleDeviceBackward, ()) {
  const std::int64_t H = *rc::gen::inRange(1, 3);
  const Sizes s{H, H * *rc::gen::inRange(1, 3), *rc::gen::inRange<std::int64_t>(1, 3), *rc::gen::inRange<std::int64_t>(1, 3)};
  const auto cu = random_documents(4, 5);
  const auto in = random_packed_inputs(s, cu, *rc::gen::arbitrary<bool>());
  const auto opt = exact_options();
  const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1;
  kda::Cotangents<Q> cot{random_tensor({1, cu.back(), s.HV, s.V}, -3, 3), std::nullopt};
  if (*rc::gen::arbitrary<bool>()) cot.d_final_state = random_tensor({N, s.HV, s.K, s.V}, -3, 3);
  const auto merge = *rc::gen::element(Merge::origin_rank, Merge::sequential_scan, Merge::tree_scan);
  const auto want = kda::recurrent_backward(in, opt, cot);
  const auto got = context_parallel_backward(in, opt, random_splits(cu.back(), 6), cot, merge).gradients;
  RC_ASSERT(first_differing_gradient(got, want) == std::string());
}

// One token: the adjoint sweep is M_t^T (G + q^ dO^T) with M_t written out.
RC_GTEST_PROP(KcpBackward, AdjointOfOneTokenIsTheTransposedTransition, ()) {
  const Sizes s{1, 1, *rc::gen::inRange<std::int64_t>(1, 4), *rc::gen::inRange<std::int64_t>(1, 4)};
  const auto in = random_packed_inputs(s, {0, 1}, false);
  const auto opt = exact_options();
  const auto d = kda::validate(kda::shapes_of(in, opt));
  const auto p = kda::prepare(in, opt, d);
  const auto d_o = random_tensor({1, 1, 1, s.V}, -3, 3);
  const auto G = random_tensor({1, s.K, s.V}, -3, 3);
  const auto got = adjoint_run(p, d, 0, 1, d_o, G);
  const Tensor<Q> m = token_transition(&p.k(0, 0, 0, 0), p.beta(0, 0, 0), &p.decay(0, 0, 0, 0), s.K);
  for (std::int64_t i = 0; i < s.K; ++i)
    for (std::int64_t j = 0; j < s.V; ++j) {
      Q expect(0);
      for (std::int64_t l = 0; l < s.K; ++l) expect += m(l, i) * (G(0, l, j) + p.scale * p.q(0, 0, 0, l) * d_o(0, 0, 0, j));
      RC_ASSERT(got(0, i, j) == expect);
    }
}

}  // namespace
}  // namespace k3ref::kcp
