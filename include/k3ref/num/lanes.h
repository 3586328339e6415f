// A fixed number of scalars processed together, elementwise: the register tile of the
// hot loops (the KDA recurrence's column blocks).
//
// `Lanes<S, N>` is written once for every scalar as a plain array with loops. For double,
// when N is a multiple of the target's vector width, the lanes are held as the target's
// native vectors (GCC/Clang vector extensions: two doubles with SSE2, four with AVX), so a
// handful of Lanes are a handful of registers and every operation is one vector
// instruction per register, without the compiler having to discover the vectorisation.
// Every operation is elementwise with one rounding per lane per operation (-ffp-contract=off
// keeps a product and a sum two roundings), so the results are the same bits in every form
// and for every N: only the speed differs.
#pragma once

#include <cstring>
#include <utility>

namespace k3ref::num {

// Doubles in one native vector register of the target this is compiled for.
#if defined(__AVX__)
inline constexpr int native_double_lanes = 4;
#elif defined(__SSE2__) || defined(__aarch64__)
inline constexpr int native_double_lanes = 2;
#else
inline constexpr int native_double_lanes = 1;
#endif

template <class S, int N>
struct Lanes {
  static_assert(N >= 1);
  S lane[N];

  static Lanes load(const S* p) {
    Lanes r;
    for (int l = 0; l < N; ++l) r.lane[l] = p[l];
    return r;
  }
  static Lanes splat(const S& s) {
    Lanes r;
    for (int l = 0; l < N; ++l) r.lane[l] = s;
    return r;
  }
  void store(S* p) const {
    for (int l = 0; l < N; ++l) p[l] = lane[l];
  }
  // Moves the values out of p and back: for a multiprecision S no copy of limbs.
  static Lanes take(S* p) {
    Lanes r;
    for (int l = 0; l < N; ++l) r.lane[l] = std::move(p[l]);
    return r;
  }
  void put(S* p) {
    for (int l = 0; l < N; ++l) p[l] = std::move(lane[l]);
  }
  const S& get(int l) const { return lane[l]; }
  // this += s * x (the product rounded, then the sum)
  void add_scaled(const S& s, const Lanes& x) {
    for (int l = 0; l < N; ++l) lane[l] += s * x.lane[l];
  }
  // this *= s
  void scale(const S& s) {
    for (int l = 0; l < N; ++l) lane[l] *= s;
  }
  // s * (x - y)
  static Lanes scaled_difference(const S& s, const Lanes& x, const Lanes& y) {
    Lanes r;
    for (int l = 0; l < N; ++l) r.lane[l] = s * (x.lane[l] - y.lane[l]);
    return r;
  }
};

#if (defined(__GNUC__) || defined(__clang__)) && !defined(K3REF_GENERIC_LANES)
// double on native vectors: the same operations as the generic form, lane for lane.
template <int N>
  requires(native_double_lanes > 1 && N % native_double_lanes == 0)
struct Lanes<double, N> {
  static constexpr int width = native_double_lanes;
  static constexpr int regs = N / width;
  typedef double vec __attribute__((vector_size(width * sizeof(double))));
  vec reg[regs];

  static Lanes load(const double* p) {
    Lanes r;
    for (int m = 0; m < regs; ++m) std::memcpy(&r.reg[m], p + m * width, sizeof(vec));  // unaligned load
    return r;
  }
  static Lanes splat(double s) {
    Lanes r;
    for (int m = 0; m < regs; ++m)
      for (int l = 0; l < width; ++l) r.reg[m][l] = s;  // not 0 + s, which turns -0 into +0
    return r;
  }
  void store(double* p) const {
    for (int m = 0; m < regs; ++m) std::memcpy(p + m * width, &reg[m], sizeof(vec));
  }
  static Lanes take(double* p) { return load(p); }
  void put(double* p) const { store(p); }
  double get(int l) const { return reg[l / width][l % width]; }
  void add_scaled(double s, const Lanes& x) {
    for (int m = 0; m < regs; ++m) reg[m] += s * x.reg[m];
  }
  void scale(double s) {
    for (int m = 0; m < regs; ++m) reg[m] *= s;
  }
  static Lanes scaled_difference(double s, const Lanes& x, const Lanes& y) {
    Lanes r;
    for (int m = 0; m < regs; ++m) r.reg[m] = s * (x.reg[m] - y.reg[m]);
    return r;
  }
};
#endif

}  // namespace k3ref::num
