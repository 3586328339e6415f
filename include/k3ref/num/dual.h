// Forward-mode automatic differentiation: a dual number value + tangent·ε with ε² = 0,
// templated over its underlying scalar, so a reference written once over S gives exact
// directional derivatives when instantiated with Dual<S>:
//
//   Dual<double>                  derivatives in double
//   Dual<num::high_precision<B>>  derivatives at B bits (checked against finite differences)
//   Dual<num::rational>           exact derivatives of rational functions (no exp/log/sqrt)
//
// f(x + t ε) = f(x) + f'(x) t ε: seed the tangent of one input with 1, read the tangents of
// the outputs, and you have one column of the Jacobian. Comparisons look at the value part
// only (so max/argmax, branches and sorting follow the primal computation exactly).
//
// The operators are hidden friends taking Dual on both sides: a double, an int or a T on
// either side converts implicitly (tangent 0), and lookup only finds them when a Dual is
// involved. exp/log/sqrt/abs/tanh are found by argument-dependent lookup, like Boost's
// overloads, so generic code keeps writing `using std::exp; exp(x)`.
#pragma once

#include <cmath>
#include <ostream>
#include <type_traits>

#include "k3ref/num/scalar.h"

namespace k3ref::num {

template <class T>
class Dual {
 public:
  using value_type = T;

  Dual() : value_(0), tangent_(0) {}
  Dual(const T& value) : value_(value), tangent_(0) {}  // NOLINT: implicit, constants enter expressions freely
  Dual(const T& value, const T& tangent) : value_(value), tangent_(tangent) {}
  // Arithmetic constants (double, int, ...) other than T itself: a constant has tangent 0.
  template <class U>
    requires(std::is_arithmetic_v<U> && !std::is_same_v<U, T>)
  Dual(U constant) : value_(T(constant)), tangent_(0) {}  // NOLINT: implicit

  // A variable: the value with tangent 1 (the direction of differentiation).
  static Dual variable(const T& value) { return Dual(value, T(1)); }

  const T& value() const { return value_; }
  const T& tangent() const { return tangent_; }
  T& tangent() { return tangent_; }

  // Explicit conversion to the underlying scalar drops the tangent.
  explicit operator T() const { return value_; }

  Dual& operator+=(const Dual& b) {
    value_ += b.value_;
    tangent_ += b.tangent_;
    return *this;
  }
  Dual& operator-=(const Dual& b) {
    value_ -= b.value_;
    tangent_ -= b.tangent_;
    return *this;
  }
  Dual& operator*=(const Dual& b) { return *this = *this * b; }
  Dual& operator/=(const Dual& b) { return *this = *this / b; }

  friend Dual operator+(const Dual& a) { return a; }
  friend Dual operator-(const Dual& a) { return Dual(-a.value_, -a.tangent_); }
  friend Dual operator+(const Dual& a, const Dual& b) { return Dual(a.value_ + b.value_, a.tangent_ + b.tangent_); }
  friend Dual operator-(const Dual& a, const Dual& b) { return Dual(a.value_ - b.value_, a.tangent_ - b.tangent_); }
  // (a + a'ε)(b + b'ε) = ab + (a'b + ab')ε
  friend Dual operator*(const Dual& a, const Dual& b) {
    return Dual(a.value_ * b.value_, a.tangent_ * b.value_ + a.value_ * b.tangent_);
  }
  // (a + a'ε)/(b + b'ε) = a/b + (a' - (a/b) b')/b ε
  friend Dual operator/(const Dual& a, const Dual& b) {
    const T q = a.value_ / b.value_;
    return Dual(q, (a.tangent_ - q * b.tangent_) / b.value_);
  }

  friend bool operator==(const Dual& a, const Dual& b) { return a.value_ == b.value_; }
  friend bool operator!=(const Dual& a, const Dual& b) { return a.value_ != b.value_; }
  friend bool operator<(const Dual& a, const Dual& b) { return a.value_ < b.value_; }
  friend bool operator<=(const Dual& a, const Dual& b) { return a.value_ <= b.value_; }
  friend bool operator>(const Dual& a, const Dual& b) { return a.value_ > b.value_; }
  friend bool operator>=(const Dual& a, const Dual& b) { return a.value_ >= b.value_; }

  // Elementary functions: f(a) + f'(a) a' ε. Unqualified calls on T so that Boost's
  // multiprecision overloads are found by ADL; T without them (rational) fails to compile
  // here only if the function is actually used.
  friend Dual exp(const Dual& a) {
    using std::exp;
    const T e = exp(a.value_);
    return Dual(e, e * a.tangent_);
  }
  friend Dual log(const Dual& a) {
    using std::log;
    return Dual(log(a.value_), a.tangent_ / a.value_);
  }
  friend Dual sqrt(const Dual& a) {
    using std::sqrt;
    const T r = sqrt(a.value_);
    return Dual(r, a.tangent_ / (T(2) * r));
  }
  friend Dual tanh(const Dual& a) {
    using std::tanh;
    const T t = tanh(a.value_);
    return Dual(t, (T(1) - t * t) * a.tangent_);
  }
  // |a|: derivative sign(a) a' (0 at a = 0, the subgradient of least norm).
  friend Dual abs(const Dual& a) {
    if (a.value_ < T(0)) return -a;
    if (a.value_ > T(0)) return a;
    return Dual(a.value_, T(0));
  }
  // a^b = exp(b log a): derivative a^b (b' log a + b a' / a), for a > 0.
  friend Dual pow(const Dual& a, const Dual& b) {
    using std::log;
    using std::pow;
    const T p = pow(a.value_, b.value_);
    return Dual(p, p * (b.tangent_ * log(a.value_) + b.value_ * a.tangent_ / a.value_));
  }
  // a^n for an integer n, by repeated multiplication (exact for rationals).
  friend Dual pow(const Dual& a, int n) {
    if (n < 0) return Dual(T(1)) / pow(a, -n);
    Dual result(T(1));
    for (int i = 0; i < n; ++i) result *= a;
    return result;
  }

  friend std::ostream& operator<<(std::ostream& out, const Dual& a) {
    return out << a.value_ << " + " << a.tangent_ << "ε";
  }

 private:
  T value_;
  T tangent_;
};

template <class T>
struct scalar_traits<Dual<T>> {
  static constexpr bool is_exact = scalar_traits<T>::is_exact;
  static constexpr bool has_transcendentals = scalar_traits<T>::has_transcendentals;
};

// The value part of a scalar: the scalar itself, or a Dual's value (recursively).
template <class T>
const T& primal(const T& x) {
  return x;
}
template <class T>
decltype(auto) primal(const Dual<T>& x) {
  return primal(x.value());
}

}  // namespace k3ref::num
