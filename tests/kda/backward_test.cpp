// Tests of the KDA backward (kda/backward.h). Two independent derivatives must agree:
// the analytic adjoint recurrence and forward-mode automatic differentiation (num::Dual)
// through the templated forward, which knows nothing about gradients. A random direction
// E over every input gives one exact identity per case: the tangent of
//   L = sum o . dO + sum S_T . dF
// along E equals <gradient, E>. Exactly (==) in rationals with decays given as rationals;
// to 1e-54 relative at 200 bits with real gates; and central finite differences at 256
// bits agree to their own truncation error.
#include <cmath>

#include "test_support.h"
#include "k3ref/kda/backward.h"
#include "k3ref/num/dual.h"
#include "k3ref/num/random.h"

namespace k3ref::kda {
namespace {

using namespace test;
using test::lift;

using Q = num::rational;
using HP = num::high_precision<200>;
using HP256 = num::high_precision<256>;

struct Sizes {
  std::int64_t B, T, H, HV, K, V;
};

// Shapes with GVA, batches or varlen (empty sequences included), tiny heads.
struct Case {
  Inputs<Q> in;
  Sizes s;
  std::int64_t N;
};

Case random_case(bool with_initial_state, std::int64_t max_t = 6) {
  const std::int64_t H = *rc::gen::inRange(1, 3);
  Sizes s{1, 0, H, H * *rc::gen::inRange(1, 3), *rc::gen::inRange<std::int64_t>(1, 4),
          *rc::gen::inRange<std::int64_t>(1, 4)};
  std::optional<std::vector<std::int64_t>> cu;
  if (*rc::gen::arbitrary<bool>()) {
    cu = std::vector<std::int64_t>{0};
    const int n = *rc::gen::inRange(1, 4);
    for (int i = 0; i < n; ++i) cu->push_back(cu->back() + *rc::gen::inRange<std::int64_t>(0, max_t / 2 + 1));
    s.T = cu->back();
  } else {
    s.B = *rc::gen::inRange<std::int64_t>(1, 3);
    s.T = *rc::gen::inRange<std::int64_t>(0, max_t + 1);
  }
  const std::int64_t N = cu ? static_cast<std::int64_t>(cu->size()) - 1 : s.B;
  const test::Sizes heads{s.H, s.HV, s.K, s.V};
  Inputs<Q> in = random_exact_tokens(s.B, s.T, heads);
  if (with_initial_state) in.initial_state = random_exact_state(N, heads, false);
  in.cu_seqlens = cu;
  return {in, s, N};
}

template <class T>
T dot(const Tensor<T>& a, const Tensor<T>& b) {
  T sum(0);
  for (std::int64_t i = 0; i < a.numel(); ++i) sum += a.data()[i] * b.data()[i];
  return sum;
}

template <class To, class From>
Options<To> lift(const Options<From>& o) {
  return convert_options<To>(o);
}

// L = sum o . dO + sum S_T . dF by the forward itself.
template <class S>
S loss(const Inputs<S>& in, const Options<S>& opt, const Cotangents<S>& cot) {
  auto o = opt;
  o.output_final_state = true;
  const auto out = recurrent_forward(in, o);
  S L = dot(out.o, cot.d_o);
  if (cot.d_final_state) L += dot(*out.final_state, *cot.d_final_state);
  return L;
}

// Every input tensor of a case, in a fixed order, with the gradient tensor matching it.
template <class S>
std::vector<std::pair<Tensor<S>*, const Tensor<S>*>> pair_up(Inputs<S>& in, const Gradients<S>& g) {
  std::vector<std::pair<Tensor<S>*, const Tensor<S>*>> r{
      {&in.q, &g.dq}, {&in.k, &g.dk}, {&in.v, &g.dv}, {&in.g, &g.dg}, {&in.beta, &g.dbeta}};
  if (in.initial_state) r.push_back({&*in.initial_state, &g.d_initial_state});
  if (in.A_log) r.push_back({&*in.A_log, &*g.dA_log});
  if (in.dt_bias) r.push_back({&*in.dt_bias, &*g.ddt_bias});
  return r;
}

// Seeds the tangents of a dual copy of `in` with E (same structure as `in`) and returns
// the tangent of the loss, and <gradient, E> with the sum of |gradient_i E_i| (the scale
// the relative tolerance is measured against).
template <class S>
struct DirectionalCheck {
  S by_dual, by_adjoint, magnitude;
};

template <class S>
DirectionalCheck<S> directional(const Inputs<S>& in, const Options<S>& opt, const Cotangents<S>& cot,
                                const Gradients<S>& grad, const Inputs<S>& E) {
  using D = num::Dual<S>;
  Inputs<D> din = lift<D>(in);
  Inputs<S> e = E;
  Inputs<S> in_copy = in;
  const auto targets = pair_up(in_copy, grad);
  const auto dirs = pair_up(e, grad);
  auto dual_targets = std::vector<Tensor<D>*>{&din.q, &din.k, &din.v, &din.g, &din.beta};
  if (din.initial_state) dual_targets.push_back(&*din.initial_state);
  if (din.A_log) dual_targets.push_back(&*din.A_log);
  if (din.dt_bias) dual_targets.push_back(&*din.dt_bias);
  DirectionalCheck<S> r{S(0), S(0), S(0)};
  for (std::size_t t = 0; t < dirs.size(); ++t) {
    const Tensor<S>& dir = *dirs[t].first;
    const Tensor<S>& g = *targets[t].second;
    for (std::int64_t i = 0; i < dir.numel(); ++i) {
      dual_targets[t]->data()[i].tangent() = dir.data()[i];
      r.by_adjoint += g.data()[i] * dir.data()[i];
      using std::abs;
      r.magnitude += abs(g.data()[i] * dir.data()[i]);
    }
  }
  Cotangents<D> dcot{lift<D>(cot.d_o), lift<D>(cot.d_final_state)};
  r.by_dual = loss(din, lift<D>(opt), dcot).tangent();
  return r;
}

template <class S>
Inputs<S> random_direction(const Inputs<S>& in, int lo, int hi) {
  Inputs<S> e = in;
  auto fill = [&](Tensor<S>& t) {
    for (S& x : t.values()) x = S(small_rational(lo, hi));
  };
  fill(e.q), fill(e.k), fill(e.v), fill(e.g), fill(e.beta);
  if (e.initial_state) fill(*e.initial_state);
  if (e.A_log) fill(*e.A_log);
  if (e.dt_bias) fill(*e.dt_bias);
  return e;
}

template <class S>
Cotangents<S> random_cotangents(const Case& c, bool with_final, StateLayout layout) {
  Cotangents<S> cot{lift<S>(random_tensor({c.s.B, c.s.T, c.s.HV, c.s.V}, -3, 3)), std::nullopt};
  if (with_final)
    cot.d_final_state = lift<S>(random_tensor(
        layout == StateLayout::k_first ? Shape{c.N, c.s.HV, c.s.K, c.s.V} : Shape{c.N, c.s.HV, c.s.V, c.s.K}, -3, 3));
  return cot;
}

// ---- exact: adjoint == forward-mode dual numbers ---------------------------------------------

RC_GTEST_PROP(KdaBackwardExact, AdjointEqualsDualNumbersAlongARandomDirection, ()) {
  const auto layout = *rc::gen::element(StateLayout::k_first, StateLayout::v_first);
  Case c = random_case(*rc::gen::arbitrary<bool>());
  if (c.in.initial_state && layout == StateLayout::v_first) {  // same values, V-first shape
    Tensor<Q> t({c.N, c.s.HV, c.s.V, c.s.K});
    c.in.initial_state = random_tensor(t.shape(), -4, 4);
  }
  const auto opt = exact_options(layout);
  const auto cot = random_cotangents<Q>(c, *rc::gen::arbitrary<bool>(), layout);
  const auto grad = recurrent_backward(c.in, opt, cot);
  const auto check = directional(c.in, opt, cot, grad, random_direction(c.in, -3, 3));
  RC_ASSERT(check.by_dual == check.by_adjoint);
}

// Every entry of the gradient, one Jacobian column at a time (one-hot directions).
TEST(KdaBackwardExact, EveryGradientEntryEqualsItsDualNumberColumn) {
  num::Random rng(20261130);
  auto fill = [&](const Shape& shape, int lo, int hi) {
    Tensor<Q> t(shape);
    for (Q& x : t.values()) x = Q(static_cast<int>(rng.between(lo, hi))) / Q(4);
    return t;
  };
  // B = 1, T = 5, H = 1, HV = 2 (GVA), K = 3, V = 2; decays 1/4 .. 1.
  Inputs<Q> in{fill({1, 5, 1, 3}, -8, 8), fill({1, 5, 1, 3}, -4, 4), fill({1, 5, 2, 2}, -8, 8),
               fill({1, 5, 2, 3}, 1, 4),  fill({1, 5, 2}, 0, 8),     fill({1, 2, 3, 2}, -8, 8),
               std::nullopt,              std::nullopt,          std::nullopt};
  const auto opt = exact_options(StateLayout::k_first);
  const Cotangents<Q> cot{fill({1, 5, 2, 2}, -4, 4), fill({1, 2, 3, 2}, -4, 4)};
  const auto grad = recurrent_backward(in, opt, cot);
  using D = num::Dual<Q>;
  const Tensor<Q>* gradients[] = {&grad.dq, &grad.dk, &grad.dv, &grad.dg, &grad.dbeta, &grad.d_initial_state};
  int checked = 0;
  for (int which = 0; which < 6; ++which)
    for (std::int64_t i = 0; i < gradients[which]->numel(); ++i) {
      Inputs<D> din = lift<D>(in);
      Tensor<D>* targets[] = {&din.q, &din.k, &din.v, &din.g, &din.beta, &*din.initial_state};
      targets[which]->data()[i].tangent() = Q(1);
      const D L = loss(din, lift<D>(opt), Cotangents<D>{lift<D>(cot.d_o), lift<D>(cot.d_final_state)});
      ASSERT_EQ(L.tangent(), gradients[which]->data()[i]) << "input tensor #" << which << ", element " << i;
      ++checked;
    }
  EXPECT_EQ(checked, 15 + 15 + 20 + 30 + 10 + 12);
}

// ---- 200 bits, real gates: adjoint vs dual numbers to 1e-54 -----------------------------------

struct RealCase {
  Inputs<HP> in;
  Options<HP> opt;
  Cotangents<HP> cot;
};

RealCase random_real_case() {
  Case c = random_case(*rc::gen::arbitrary<bool>(), 5);
  RealCase r;
  r.in = lift<HP>(c.in);
  const auto layout = *rc::gen::element(StateLayout::k_first, StateLayout::v_first);
  r.opt.state_layout = layout;
  if (r.in.initial_state && layout == StateLayout::v_first)
    r.in.initial_state = lift<HP>(random_tensor({c.N, c.s.HV, c.s.V, c.s.K}, -4, 4));
  r.opt.qk_l2norm = *rc::gen::arbitrary<bool>();
  r.opt.gate = *rc::gen::element(GateForm::log_decay, GateForm::softplus, GateForm::lower_bound);
  r.opt.gate_base = *rc::gen::element(GateBase::e, GateBase::two);
  r.opt.beta = *rc::gen::element(BetaForm::as_given, BetaForm::sigmoid, BetaForm::two_sigmoid);
  if (!r.opt.qk_l2norm && c.s.K != 4) r.opt.scale = HP(1) / HP(3);  // otherwise the default K^-1/2
  r.in.g = lift<HP>(random_tensor(r.in.g.shape(), -6, 2));  // raw gates or log decays
  if (r.opt.gate == GateForm::log_decay)
    for (HP& x : r.in.g.values()) x = -abs(x);
  const bool with_A = r.opt.gate == GateForm::softplus || *rc::gen::arbitrary<bool>();
  if (r.opt.gate != GateForm::log_decay) {
    if (with_A) r.in.A_log = lift<HP>(random_tensor({c.s.HV}, -2, 1));
    if (*rc::gen::arbitrary<bool>()) r.in.dt_bias = lift<HP>(random_tensor({c.s.HV, c.s.K}, -2, 2));
  }
  if (r.opt.gate == GateForm::lower_bound) r.opt.lower_bound = HP(*rc::gen::element(-5, -8, -1));
  if (r.opt.beta != BetaForm::as_given) r.in.beta = lift<HP>(random_tensor(r.in.beta.shape(), -4, 4));
  r.cot = random_cotangents<HP>(c, *rc::gen::arbitrary<bool>(), layout);
  return r;
}

RC_GTEST_PROP(KdaBackwardHighPrecision, AdjointEqualsDualNumbersWithRealGatesTo1e54, ()) {
  const RealCase c = random_real_case();
  const auto grad = recurrent_backward(c.in, c.opt, c.cot);
  const auto check = directional(c.in, c.opt, c.cot, grad, random_direction(c.in, -3, 3));
  using std::abs;
  const HP err = abs(check.by_dual - check.by_adjoint);
  // Measured: at most 6.8e-57 relative over 500 cases (seeds 20261130, 1-4); 200 bits
  // round at 6e-61. The bound is 4x that worst case.
  RC_ASSERT(err <= HP(2.7e-56) * check.magnitude);
}

// Central differences at 256 bits (step 2^-60) along a random direction: the error of the step-h
// difference is c h^2 + O(h^4), so |FD(h) - grad| is about |FD(2h) - FD(h)| / 3; the
// adjoint must sit inside that (with a factor 2 of slack) and the truncation must be small.
RC_GTEST_PROP(KdaBackwardHighPrecision, CentralDifferencesAgreeToTheirTruncationError, ()) {
  const RealCase c0 = random_real_case();
  const Inputs<HP256> in = lift<HP256>(c0.in);
  const Options<HP256> opt = lift<HP256>(c0.opt);
  const Cotangents<HP256> cot{lift<HP256>(c0.cot.d_o), lift<HP256>(c0.cot.d_final_state)};
  const auto grad = recurrent_backward(in, opt, cot);
  const Inputs<HP256> E = random_direction(in, -3, 3);
  auto shifted = [&](const HP256& h) {
    Inputs<HP256> x = in, e = E;
    Gradients<HP256> none = grad;
    const auto xs = pair_up(x, none);
    const auto es = pair_up(e, none);
    for (std::size_t t = 0; t < xs.size(); ++t)
      for (std::int64_t i = 0; i < xs[t].first->numel(); ++i) xs[t].first->data()[i] += h * es[t].first->data()[i];
    return loss(x, opt, cot);
  };
  auto central = [&](const HP256& h) { return (shifted(h) - shifted(-h)) / (HP256(2) * h); };
  const HP256 h = HP256(1) / HP256(1ull << 60);  // h^2 ~ 1e-36: the L2 norm of a near-zero row has
                                                 // third derivatives up to ~1e9 (eps = 1e-6)
  const HP256 fd = central(h), fd2 = central(HP256(2) * h);
  HP256 exact(0);
  {
    Inputs<HP256> e = E;
    Gradients<HP256> g = grad;
    for (auto [x, gt] : pair_up(e, g))
      for (std::int64_t i = 0; i < x->numel(); ++i) exact += x->data()[i] * gt->data()[i];
  }
  using std::abs;
  const HP256 truncation = abs(fd2 - fd) / HP256(3);
  RC_ASSERT(abs(fd - exact) <= HP256(2) * truncation + HP256(1e-60) * (HP256(1) + abs(exact)));
  RC_ASSERT(truncation <= HP256(1e-18) * (HP256(1) + abs(exact)));
}

// ---- structure ----------------------------------------------------------------------------------

TEST(KdaBackward, ThreadCountNeverChangesAGradient) {
  num::Random rng(7);
  auto fill = [&](const Shape& shape, double lo, double hi) {
    Tensor<double> t(shape);
    for (double& x : t.values()) x = rng.dyadic(lo, hi, 20);
    return t;
  };
  Inputs<double> in{fill({1, 70, 2, 16}, -1, 1), fill({1, 70, 2, 16}, -1, 1), fill({1, 70, 4, 8}, -1, 1),
                    fill({1, 70, 4, 16}, -3, 0), fill({1, 70, 4}, 0, 1), fill({3, 4, 16, 8}, -1, 1),
                    std::nullopt, std::nullopt, std::vector<std::int64_t>{0, 30, 30, 70}};
  Options<double> opt;
  opt.qk_l2norm = true;
  const Cotangents<double> cot{fill({1, 70, 4, 8}, -1, 1), fill({3, 4, 16, 8}, -1, 1)};
  const auto one = recurrent_backward(in, opt, cot);
  opt.num_threads = 3;
  const auto three = recurrent_backward(in, opt, cot);
  EXPECT_EQ(one.dq, three.dq);
  EXPECT_EQ(one.dk, three.dk);
  EXPECT_EQ(one.dv, three.dv);
  EXPECT_EQ(one.dg, three.dg);
  EXPECT_EQ(one.dbeta, three.dbeta);
  EXPECT_EQ(one.d_initial_state, three.d_initial_state);
}

TEST(KdaBackward, BadCotangentShapesNameTheArgument) {
  Inputs<double> in{Tensor<double>({1, 4, 1, 2}), Tensor<double>({1, 4, 1, 2}), Tensor<double>({1, 4, 1, 3}),
                    Tensor<double>({1, 4, 1, 2}), Tensor<double>({1, 4, 1}), std::nullopt, std::nullopt, std::nullopt,
                    std::nullopt};
  const Options<double> opt;
  try {
    recurrent_backward(in, opt, Cotangents<double>{Tensor<double>({1, 4, 1, 2}), std::nullopt});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'d_o'"), std::string::npos) << e.what();
  }
  try {
    recurrent_backward(in, opt, Cotangents<double>{Tensor<double>({1, 4, 1, 3}), Tensor<double>({1, 1, 3, 2})});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'d_final_state'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace k3ref::kda
