// Random exact inputs shared by the KDA test programs (RapidCheck generators): small
// rationals with denominators 1, 2, 3, 4, 8, and decays p / q in (0, 1] with q <= 6.
#pragma once

#include <rapidcheck.h>

#include <cstdint>
#include <vector>

#include "k3ref/kda/options.h"
#include "k3ref/num/scalar.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::kda::test_util {

using Q = num::rational;

inline Q small_rational(int lo, int hi) {
  const int num = *rc::gen::inRange(lo, hi + 1);
  const int den = *rc::gen::element(1, 2, 3, 4, 8);
  return Q(num) / Q(den);
}

inline Tensor<Q> random_tensor(const Shape& shape, int lo, int hi) {
  Tensor<Q> t(shape);
  for (Q& x : t.values()) x = small_rational(lo, hi);
  return t;
}

// Decays as rationals in (0, 1]: p / q with 1 <= p <= q <= 6 (never 0: the inverse-decay
// chunk form divides by them).
inline Tensor<Q> random_decays(const Shape& shape) {
  Tensor<Q> t(shape);
  for (Q& x : t.values()) {
    const int q = *rc::gen::inRange(1, 7);
    const int p = *rc::gen::inRange(1, q + 1);
    x = Q(p) / Q(q);
  }
  return t;
}

// Exact inputs for packed sequences (B = 1, cu_seqlens), decays as rationals; Sizes is any
// struct with H, HV, K, V. The draws are q, k, v, g, beta, then the initial state if asked.
template <class Sizes>
inline Inputs<Q> random_packed_inputs(const Sizes& s, const std::vector<std::int64_t>& cu, bool initial_state,
                                      bool v_first = false) {
  const std::int64_t T = cu.back(), N = static_cast<std::int64_t>(cu.size()) - 1;
  Inputs<Q> in;
  in.q = random_tensor({1, T, s.H, s.K}, -4, 4);
  in.k = random_tensor({1, T, s.H, s.K}, -2, 2);
  in.v = random_tensor({1, T, s.HV, s.V}, -4, 4);
  in.g = random_decays({1, T, s.HV, s.K});
  in.beta = random_tensor({1, T, s.HV}, 0, 2);
  if (initial_state) in.initial_state = random_tensor(v_first ? Shape{N, s.HV, s.V, s.K} : Shape{N, s.HV, s.K, s.V}, -4, 4);
  in.cu_seqlens = cu;
  return in;
}

// Options under which every form is exact in rationals: decays given as factors, scale 1/2.
inline Options<Q> exact_options() {
  Options<Q> opt;
  opt.gate = GateForm::decay_factor;
  opt.scale = Q(1) / Q(2);
  return opt;
}

struct ExactCase {
  Inputs<Q> in;
  Options<Q> opt;
};

// Random rational inputs under exact_options(): batch or varlen (empty sequences too), GVA,
// K-first or V-first, a nonzero initial state; T up to max_t (varlen: up to max_t / 2 per
// sequence). (chunkwise_test draws its own, with smaller denominators.)
inline ExactCase random_exact_case(std::int64_t max_t) {
  ExactCase c;
  const std::int64_t H = *rc::gen::inRange(1, 3), HV = H * *rc::gen::inRange(1, 3);
  const std::int64_t K = *rc::gen::inRange(1, 4), V = *rc::gen::inRange(1, 4);
  std::int64_t B = *rc::gen::inRange(1, 3), T = *rc::gen::inRange<std::int64_t>(0, max_t + 1), N = B;
  if (*rc::gen::arbitrary<bool>()) {
    B = 1;
    N = *rc::gen::inRange(1, 4);
    std::vector<std::int64_t> cu{0};
    for (std::int64_t n = 0; n < N; ++n) cu.push_back(cu.back() + *rc::gen::inRange<std::int64_t>(0, max_t / 2 + 1));
    T = cu.back();
    c.in.cu_seqlens = cu;
  }
  c.in.q = random_tensor({B, T, H, K}, -4, 4);
  c.in.k = random_tensor({B, T, H, K}, -2, 2);
  c.in.v = random_tensor({B, T, HV, V}, -4, 4);
  c.in.g = random_decays({B, T, HV, K});
  c.in.beta = random_tensor({B, T, HV}, 0, 2);
  c.opt = exact_options();
  if (*rc::gen::arbitrary<bool>()) c.opt.state_layout = StateLayout::v_first;
  const bool v_first = c.opt.state_layout == StateLayout::v_first;
  c.in.initial_state = random_tensor(v_first ? Shape{N, HV, V, K} : Shape{N, HV, K, V}, -4, 4);
  return c;
}

}  // namespace k3ref::kda::test_util
