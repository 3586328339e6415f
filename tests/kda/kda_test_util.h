// Random exact inputs shared by the KDA test programs (RapidCheck generators): small
// rationals with denominators 1, 2, 3, 4, 8, and decays p / q in (0, 1] with q <= 6.
#pragma once

#include <rapidcheck.h>

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

}  // namespace k3ref::kda::test_util
