// A counting scalar: a double that counts the arithmetic done on it, so that a reference
// instantiated with it reports its own FLOPs while it runs (docs/cost-models.md, "Counting").
//
// One FLOP is one add, subtract, multiply or divide of two values (a negation is free, as
// it is a sign flip in hardware). Transcendental calls (exp, log, sqrt, pow, tanh) are
// counted apart: the cost models count multiply-adds only. Counts are per thread
// (thread_local), so run the counted code on one thread.
#pragma once

#include <cmath>
#include <cstdint>

#include "k3ref/num/scalar.h"

namespace k3ref::cost {

struct OpCounts {
  std::int64_t add = 0, mul = 0, div = 0, transcendental = 0;
  std::int64_t flops() const { return add + mul + div; }
  friend OpCounts operator-(OpCounts a, const OpCounts& b) {
    a.add -= b.add;
    a.mul -= b.mul;
    a.div -= b.div;
    a.transcendental -= b.transcendental;
    return a;
  }
};

inline OpCounts& op_counts() {
  thread_local OpCounts counts;
  return counts;
}

class Counted {
 public:
  Counted() = default;
  Counted(double v) : v_(v) {}  // NOLINT: implicit, as a scalar literal is
  Counted(int v) : v_(v) {}     // NOLINT
  Counted(std::int64_t v) : v_(static_cast<double>(v)) {}  // NOLINT
  explicit operator double() const { return v_; }
  double value() const { return v_; }

  friend Counted operator+(Counted a, Counted b) { return ++op_counts().add, Counted(a.v_ + b.v_); }
  friend Counted operator-(Counted a, Counted b) { return ++op_counts().add, Counted(a.v_ - b.v_); }
  friend Counted operator*(Counted a, Counted b) { return ++op_counts().mul, Counted(a.v_ * b.v_); }
  friend Counted operator/(Counted a, Counted b) { return ++op_counts().div, Counted(a.v_ / b.v_); }
  friend Counted operator-(Counted a) { return Counted(-a.v_); }
  Counted& operator+=(Counted b) { return *this = *this + b; }
  Counted& operator-=(Counted b) { return *this = *this - b; }
  Counted& operator*=(Counted b) { return *this = *this * b; }
  Counted& operator/=(Counted b) { return *this = *this / b; }
  friend auto operator<=>(Counted a, Counted b) { return a.v_ <=> b.v_; }
  friend bool operator==(Counted a, Counted b) { return a.v_ == b.v_; }

  friend Counted exp(Counted a) { return ++op_counts().transcendental, Counted(std::exp(a.v_)); }
  friend Counted log(Counted a) { return ++op_counts().transcendental, Counted(std::log(a.v_)); }
  friend Counted sqrt(Counted a) { return ++op_counts().transcendental, Counted(std::sqrt(a.v_)); }
  friend Counted tanh(Counted a) { return ++op_counts().transcendental, Counted(std::tanh(a.v_)); }
  friend Counted pow(Counted a, Counted b) { return ++op_counts().transcendental, Counted(std::pow(a.v_, b.v_)); }
  friend Counted abs(Counted a) { return Counted(std::fabs(a.v_)); }
  friend bool isfinite(Counted a) { return std::isfinite(a.v_); }

 private:
  double v_ = 0;
};

// Counts of the arithmetic `f` does, on this thread.
template <class F>
OpCounts count_ops(F&& f) {
  const OpCounts before = op_counts();
  f();
  return op_counts() - before;
}

}  // namespace k3ref::cost

namespace k3ref::num {
template <>
struct scalar_traits<cost::Counted> {
  static constexpr bool is_exact = false;
  static constexpr bool has_transcendentals = true;
};
inline double to_double_rne(const cost::Counted& x) { return x.value(); }
}  // namespace k3ref::num
