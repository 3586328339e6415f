// The one header of the C++ tests (Eigen's test/main.h habit): every test program includes
// it first and links tests/support/test_support.cc, which holds main().
//
//  * Seeds. RapidCheck properties draw from RC_PARAMS (tests/meson.build fixes
//    seed=20261130 for CI); RapidCheck prints the reproduce string of a shrunk failure. The
//    other random draws (num::Random) take their seed from test_seed(n): n itself, the fixed
//    seed the test names, while K3REF_SEED is unset or 0; otherwise a mix of K3REF_SEED and
//    n, so that every draw moves. A failing test prints "K3REF_SEED=<n> to replay" and the
//    RapidCheck seed it ran with.
//  * Repeats. K3REF_REPEAT=N runs every test of the program N times (--gtest_repeat=N);
//    repetition i (from 0) runs with K3REF_SEED + i and RapidCheck seed + i, so each one
//    draws new inputs, and a failure prints the seeds that replay that repetition alone.
//    Repetition 0 is the plain run: K3REF_REPEAT changes nothing of it.
// Tests whose bounds were measured on fixed inputs pass the seed directly (not through
// test_seed): their draws never move.
#pragma once

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "k3ref/check/metrics.h"
#include "k3ref/kda/options.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::test {

using Q = num::rational;
using HP = num::high_precision<256>;

// ---- seeds and repeats (test_support.cc) --------------------------------------------------

// K3REF_SEED of the current repetition (K3REF_SEED + repetition); 0: the tests' fixed seeds.
std::uint64_t current_seed();

// The seed of a non-RapidCheck draw whose fixed seed is `fixed`: `fixed` itself when
// current_seed() is 0, else a mix of the two.
std::uint64_t test_seed(std::uint64_t fixed);

// RapidCheck's parameters for the current repetition: RC_PARAMS's, the seed + repetition.
rc::detail::TestParams rapidcheck_params();

// The source tree (K3REF_SOURCE_ROOT, set by meson; "." without it).
std::filesystem::path source_root();

// RC_GTEST_PROP as RapidCheck's own, with rapidcheck_params() (the seed moves per repetition).
template <class Testable>
void check_property(Testable&& testable) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  rc::detail::TestMetadata metadata;
  metadata.id = std::string(info->test_suite_name()) + "/" + info->name();
  metadata.description = info->name();
  const auto result = rc::detail::checkTestable(std::forward<Testable>(testable), metadata, rapidcheck_params());
  if (result.template is<rc::detail::SuccessResult>()) {
    if (!result.template get<rc::detail::SuccessResult>().distribution.empty()) {
      rc::detail::printResultMessage(result, std::cout);
      std::cout << std::endl;
    }
  } else {
    std::ostringstream ss;
    rc::detail::printResultMessage(result, ss);
    FAIL() << ss.str() << std::endl;
  }
}

// ---- small exact rationals (RapidCheck draws) ------------------------------------------------

// The denominators of the KDA tests' rationals; a test with other needs names its own list.
inline constexpr std::array<int, 5> kda_denominators{1, 2, 3, 4, 8};

// num / den with num in [lo, hi] and den drawn from `denominators`.
inline Q small_rational(int lo, int hi, std::span<const int> denominators = kda_denominators) {
  const int num = *rc::gen::inRange(lo, hi + 1);
  const int den = *rc::gen::elementOf(std::vector<int>(denominators.begin(), denominators.end()));
  return Q(num) / Q(den);
}

inline Tensor<Q> random_tensor(const Shape& shape, int lo, int hi, std::span<const int> denominators = kda_denominators) {
  Tensor<Q> t(shape);
  for (Q& x : t.values()) x = small_rational(lo, hi, denominators);
  return t;
}

// Decays as rationals in (0, 1]: p / q with 1 <= p <= q <= max_denominator (never 0: the
// inverse-decay chunk form divides by them).
inline Tensor<Q> random_decays(const Shape& shape, int max_denominator = 6) {
  Tensor<Q> t(shape);
  for (Q& x : t.values()) {
    const int q = *rc::gen::inRange(1, max_denominator + 1);
    const int p = *rc::gen::inRange(1, q + 1);
    x = Q(p) / Q(q);
  }
  return t;
}

// ---- exact KDA inputs -------------------------------------------------------------------------

// What the exact KDA draws take their rationals from: by default denominators 1, 2, 3, 4, 8
// and decays p / q with q <= 6 (chunkwise_test: smaller ones, to keep long chunks fast).
struct ExactDraws {
  std::span<const int> denominators = kda_denominators;
  int max_decay_denominator = 6;
};

// Head sizes: H query/key heads, HV value heads (a multiple of H), K, V.
struct Sizes {
  std::int64_t H, HV, K, V;
};

// H in 1..2, HV = H or 2H (grouped value heads), K and V in 1..3 independently.
inline Sizes random_sizes() {
  const std::int64_t H = *rc::gen::inRange(1, 3);
  return Sizes{H, H * *rc::gen::inRange(1, 3), *rc::gen::inRange<std::int64_t>(1, 4), *rc::gen::inRange<std::int64_t>(1, 4)};
}

// q, k, v, g (decays), beta of [B, T] tokens, drawn in that order: q, v in [-4, 4], k in
// [-2, 2], beta in [0, 2]. No initial state, no cu_seqlens.
inline kda::Inputs<Q> random_exact_tokens(std::int64_t B, std::int64_t T, const Sizes& s, const ExactDraws& d = {}) {
  kda::Inputs<Q> in;
  in.q = random_tensor({B, T, s.H, s.K}, -4, 4, d.denominators);
  in.k = random_tensor({B, T, s.H, s.K}, -2, 2, d.denominators);
  in.v = random_tensor({B, T, s.HV, s.V}, -4, 4, d.denominators);
  in.g = random_decays({B, T, s.HV, s.K}, d.max_decay_denominator);
  in.beta = random_tensor({B, T, s.HV}, 0, 2, d.denominators);
  return in;
}

// The state of N sequences in the layout's order, entries in [-4, 4].
inline Tensor<Q> random_exact_state(std::int64_t N, const Sizes& s, bool v_first, const ExactDraws& d = {}) {
  return random_tensor(v_first ? Shape{N, s.HV, s.V, s.K} : Shape{N, s.HV, s.K, s.V}, -4, 4, d.denominators);
}

// Options under which every form is exact in rationals: decays given as factors, scale 1/2.
inline kda::Options<Q> exact_options(kda::StateLayout layout = kda::StateLayout::k_first) {
  kda::Options<Q> opt;
  opt.gate = kda::GateForm::decay_factor;
  opt.scale = Q(1) / Q(2);
  opt.state_layout = layout;
  return opt;
}

// Exact inputs for packed sequences (B = 1, cu_seqlens): the tokens, then the initial state
// if asked.
inline kda::Inputs<Q> random_packed_inputs(const Sizes& s, const std::vector<std::int64_t>& cu, bool initial_state,
                                           bool v_first = false) {
  kda::Inputs<Q> in = random_exact_tokens(1, cu.back(), s);
  if (initial_state) in.initial_state = random_exact_state(static_cast<std::int64_t>(cu.size()) - 1, s, v_first);
  in.cu_seqlens = cu;
  return in;
}

struct ExactCase {
  kda::Inputs<Q> in;
  kda::Options<Q> opt;
};

// Random rational inputs under exact_options(): batch or varlen (empty sequences too), GVA,
// K-first or V-first, a nonzero initial state; T up to max_t (varlen: up to max_t / 2 per
// sequence).
inline ExactCase random_exact_case(std::int64_t max_t, const ExactDraws& d = {}) {
  ExactCase c;
  const std::int64_t H = *rc::gen::inRange(1, 3), HV = H * *rc::gen::inRange(1, 3);
  const std::int64_t K = *rc::gen::inRange(1, 4), V = *rc::gen::inRange(1, 4);
  std::int64_t B = *rc::gen::inRange(1, 3), T = *rc::gen::inRange<std::int64_t>(0, max_t + 1), N = B;
  std::optional<std::vector<std::int64_t>> cu;
  if (*rc::gen::arbitrary<bool>()) {
    B = 1;
    N = *rc::gen::inRange(1, 4);
    cu = std::vector<std::int64_t>{0};
    for (std::int64_t n = 0; n < N; ++n) cu->push_back(cu->back() + *rc::gen::inRange<std::int64_t>(0, max_t / 2 + 1));
    T = cu->back();
  }
  const Sizes s{H, HV, K, V};
  c.in = random_exact_tokens(B, T, s, d);
  c.in.cu_seqlens = cu;
  c.opt = exact_options();
  if (*rc::gen::arbitrary<bool>()) c.opt.state_layout = kda::StateLayout::v_first;
  c.in.initial_state = random_exact_state(N, s, c.opt.state_layout == kda::StateLayout::v_first, d);
  return c;
}

// Fixed exact inputs from num::Random(seed), for sizes RapidCheck would make slow: H = 1,
// HV = 2, K = V = 2, two sequences [0, split) and [split, T); quarters q, v in [-1, 1],
// k in [-1/2, 1/2], beta in [0, 1], decays 3/4 or 1, an initial state in [-1, 1].
inline kda::Inputs<Q> seeded_exact_inputs(std::uint64_t seed, std::int64_t T, std::int64_t split) {
  num::Random rng(seed);
  auto draw = [&](const Shape& shape, int lo, int hi) {
    Tensor<Q> t(shape);
    for (Q& x : t.values()) x = Q(rng.between(lo, hi)) / Q(4);
    return t;
  };
  kda::Inputs<Q> in;
  in.q = draw({1, T, 1, 2}, -4, 4);
  in.k = draw({1, T, 1, 2}, -2, 2);
  in.v = draw({1, T, 2, 2}, -4, 4);
  in.g = Tensor<Q>({1, T, 2, 2});
  for (Q& x : in.g.values()) x = Q(rng.between(3, 4)) / Q(4);
  in.beta = draw({1, T, 2}, 0, 4);
  in.initial_state = draw({2, 2, 2, 2}, -4, 4);
  in.cu_seqlens = std::vector<std::int64_t>{0, split, T};
  return in;
}

// ---- double KDA inputs ---------------------------------------------------------------------

// A tensor of bf16 values, each a dyadic of `bits` bits drawn uniformly in [lo, hi) and
// rounded to bf16.
inline Tensor<double> bf16_tensor(num::Random& rng, const Shape& shape, double lo, double hi, int bits = 24) {
  Tensor<double> t(shape);
  for (double& x : t.values()) x = num::round_to(num::Format::bf16, rng.dyadic(lo, hi, bits));
  return t;
}

// FlashKDA's gate domain, drawn in this order: the raw gate g in [-4, 4], A_log and dt_bias in
// [-0.5, 0.5], the lower-bound gate at -5.
inline void draw_lower_bound_gate(num::Random& rng, kda::Inputs<double>& in, kda::Options<double>& opt,
                                  std::int64_t T, std::int64_t HV, std::int64_t K) {
  in.g = bf16_tensor(rng, {1, T, HV, K}, -4, 4);
  in.A_log = bf16_tensor(rng, {HV}, -0.5, 0.5);
  in.dt_bias = bf16_tensor(rng, {HV, K}, -0.5, 0.5);
  opt.gate = kda::GateForm::lower_bound;
  opt.lower_bound = -5.0;
}

// bf16-exact double inputs from num::Random(seed) (dyadic, 20 bits, rounded to bf16): B = 1,
// q, k, v in [-1, 1], log decays g in [g_lo, g_hi], beta in [-3, 3], an initial state in
// [-1, 1]; with gate_parameters also A_log in [0, 2] and dt_bias in [-1, 1], drawn last.
inline kda::Inputs<double> random_double_inputs(std::uint64_t seed, std::int64_t T, std::int64_t H, std::int64_t HV,
                                                std::int64_t K, std::int64_t V, double g_lo, double g_hi,
                                                bool gate_parameters = false) {
  num::Random rng(seed);
  auto draw = [&](const Shape& shape, double lo, double hi) { return bf16_tensor(rng, shape, lo, hi, 20); };
  kda::Inputs<double> in;
  in.q = draw({1, T, H, K}, -1, 1);
  in.k = draw({1, T, H, K}, -1, 1);
  in.v = draw({1, T, HV, V}, -1, 1);
  in.g = draw({1, T, HV, K}, g_lo, g_hi);
  in.beta = draw({1, T, HV}, -3, 3);
  in.initial_state = draw({1, HV, K, V}, -1, 1);
  if (gate_parameters) {
    in.A_log = draw({HV}, 0, 2);
    in.dt_bias = draw({HV, K}, -1, 1);
  }
  return in;
}

// ---- changing the scalar type ----------------------------------------------------------------

template <class To, class From>
Tensor<To> lift(const Tensor<From>& t) {
  if constexpr (std::is_same_v<To, From>) return t;
  else return t.template map<To>([](const From& x) { return To(x); });
}
template <class To, class From>
std::optional<Tensor<To>> lift(const std::optional<Tensor<From>>& t) {
  if (!t) return std::nullopt;
  return lift<To>(*t);
}
template <class To, class From>
kda::Inputs<To> lift(const kda::Inputs<From>& in) {
  return kda::Inputs<To>{lift<To>(in.q),    lift<To>(in.k),     lift<To>(in.v),
                         lift<To>(in.g),    lift<To>(in.beta),  lift<To>(in.initial_state),
                         lift<To>(in.A_log), lift<To>(in.dt_bias), in.cu_seqlens};
}

// ---- errors -------------------------------------------------------------------------------------

// The entries rounded to the nearest double (ties to even), in order: what check::compare takes.
template <class S>
std::vector<double> to_doubles(const Tensor<S>& t) {
  std::vector<double> d(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) d[static_cast<std::size_t>(i)] = num::to_double_rne(t.data()[i]);
  return d;
}

// Relative RMS error ||x - ref|| / ||ref||: check::compare's (metrics.h), both sides rounded
// to double first. Its max_ulp is check::ulp_distance's, the tests' one ulp distance.
template <class A, class B>
double rel_rms(const Tensor<A>& x, const Tensor<B>& ref) {
  return check::compare(to_doubles(x), to_doubles(ref), num::Format::fp64).rel_rms;
}

// max |x - ref| / max |ref| (max |x - ref| where ref is all zero), in ref's scalar type:
// elementwise relative errors mean nothing on entries that cancel to about 0.
template <class A, class B>
double max_relative_difference(const Tensor<A>& x, const Tensor<B>& ref) {
  using std::abs;
  B diff(0), scale(0);
  for (std::int64_t i = 0; i < ref.numel(); ++i) {
    diff = std::max(diff, B(abs(B(x.data()[i]) - ref.data()[i])));
    scale = std::max(scale, B(abs(ref.data()[i])));
  }
  return static_cast<double>(scale == B(0) ? diff : B(diff / scale));
}

// The name of the first gradient of kda::Gradients `got` that is not `want`'s ("" when all are
// equal): RC_ASSERT(first_differing_gradient(got, want) == "") shows which one.
template <class Gradients>
std::string first_differing_gradient(const Gradients& got, const Gradients& want) {
  if (got.dq != want.dq) return "dq";
  if (got.dk != want.dk) return "dk";
  if (got.dv != want.dv) return "dv";
  if (got.dg != want.dg) return "dg";
  if (got.dbeta != want.dbeta) return "dbeta";
  if (got.d_initial_state != want.d_initial_state) return "d_initial_state";
  if (got.dA_log != want.dA_log) return "dA_log";
  if (got.ddt_bias != want.ddt_bias) return "ddt_bias";
  return "";
}

// ---- context parallelism: documents and splits (RapidCheck draws) ---------------------------

// cu_seqlens of 1..max_docs documents of 0..max_len tokens (empty documents included).
inline std::vector<std::int64_t> random_documents(int max_docs = 5, int max_len = 8) {
  const int N = *rc::gen::inRange(1, max_docs + 1);
  std::vector<std::int64_t> cu{0};
  for (int n = 0; n < N; ++n) cu.push_back(cu.back() + *rc::gen::inRange(0, max_len + 1));
  return cu;
}

// P + 1 split positions 0 = s_0 <= ... <= s_P = T at arbitrary tokens (empty ranks allowed).
inline std::vector<std::int64_t> random_splits(std::int64_t T, int max_ranks = 8) {
  const int P = *rc::gen::inRange(1, max_ranks + 1);
  std::vector<std::int64_t> s{0};
  for (int r = 1; r < P; ++r) s.push_back(*rc::gen::inRange<std::int64_t>(0, T + 1));
  s.push_back(T);
  std::sort(s.begin(), s.end());
  return s;
}

// A real-gate configuration at 256 bits: every gate form, base and beta form in turn.
struct RealGateCase {
  kda::Inputs<HP> in;
  kda::Options<HP> opt;
};

inline RealGateCase random_real_gate_case(const Sizes& s, const std::vector<std::int64_t>& cu) {
  const std::int64_t T = cu.back(), N = static_cast<std::int64_t>(cu.size()) - 1;
  RealGateCase c;
  c.in.q = lift<HP>(random_tensor({1, T, s.H, s.K}, -4, 4));
  c.in.k = lift<HP>(random_tensor({1, T, s.H, s.K}, -4, 4));
  c.in.v = lift<HP>(random_tensor({1, T, s.HV, s.V}, -4, 4));
  c.in.g = lift<HP>(random_tensor({1, T, s.HV, s.K}, -8, 8));
  c.in.beta = lift<HP>(random_tensor({1, T, s.HV}, -8, 8));
  c.in.initial_state = lift<HP>(random_tensor({N, s.HV, s.K, s.V}, -4, 4));
  c.in.cu_seqlens = cu;
  const int form = *rc::gen::inRange(0, 4);
  c.opt.qk_l2norm = true;
  c.opt.beta = *rc::gen::element(kda::BetaForm::sigmoid, kda::BetaForm::two_sigmoid);
  c.opt.gate_base = *rc::gen::element(kda::GateBase::e, kda::GateBase::two);
  if (form == 0) {
    c.opt.gate = kda::GateForm::log_decay;
    c.in.g = c.in.g.map<HP>([](const HP& x) { return -abs(x) / HP(4); });
  } else if (form == 1) {
    c.opt.gate = kda::GateForm::softplus;
    c.in.A_log = lift<HP>(random_tensor({s.HV}, -2, 2));
    c.in.dt_bias = lift<HP>(random_tensor({s.HV, s.K}, -2, 2));
  } else {
    c.opt.gate = kda::GateForm::lower_bound;
    c.opt.lower_bound = HP(-5);
    if (form == 2) c.in.A_log = lift<HP>(random_tensor({s.HV}, -2, 2));
    c.in.dt_bias = lift<HP>(random_tensor({s.HV, s.K}, -2, 2));
  }
  return c;
}

// ---- Quantile Balancing instances (RapidCheck draws) ------------------------------------------

struct QbSizes {
  std::int64_t m, n, k;
};

// 2 <= n <= max_n, 1 <= k < n, m a multiple of n / gcd(n, k) (so q is an integer), m <= max_m.
QbSizes random_qb_sizes(std::int64_t max_m = 12, std::int64_t max_n = 6);

// Tie-free scores: numerators drawn from 2^40 values over 2^20, all distinct in the whole
// matrix (so rule 2 of the tie rule always decides and no raw scores coincide). Ties between
// alternating sums of scores then need an exact integer relation among 40-bit numbers;
// only the structural ties of the iteration remain.
Tensor<Q> tie_free_scores(std::int64_t m, std::int64_t n);

// Tie-heavy scores: four levels {0, 1/4, 1/2, 3/4}.
Tensor<Q> tie_heavy_scores(std::int64_t m, std::int64_t n);

// Either of the two, drawn.
Tensor<Q> any_scores(std::int64_t m, std::int64_t n);

// A uniformly random permutation of 0..n-1 (Fisher-Yates on RapidCheck's integers).
std::vector<std::int64_t> random_permutation(std::int64_t n);

// The QB tests' rationals: -64..64 over 1, 2, 3, 7, 16.
inline constexpr std::array<int, 5> qb_denominators{1, 2, 3, 7, 16};

}  // namespace k3ref::test

// RapidCheck's RC_GTEST_PROP with the repetition's seed (check_property above).
#undef RC_GTEST_PROP
#define RC_GTEST_PROP(TestCase, Name, ArgList)                                             \
  void rapidCheck_propImpl_##TestCase##_##Name ArgList;                                    \
  TEST(TestCase, Name) { ::k3ref::test::check_property(&rapidCheck_propImpl_##TestCase##_##Name); } \
  void rapidCheck_propImpl_##TestCase##_##Name ArgList
