// The numeric tiers of k3ref. Every reference is one template over its scalar type;
// this header names the scalar types it is instantiated for and the few traits the
// templates need.
//
//   double                       fast reference
//   high_precision<Bits>         MPFR through Boost.Multiprecision (cpp_bin_float fallback)
//   rational                     exact rational (GMP mpq, cpp_rational fallback)
//
// Generic code calls exp/log/sqrt/pow unqualified after `using std::exp;` etc., so
// argument-dependent lookup finds Boost's overloads for the multiprecision types. An
// exact type has no exp: instantiating a transcendental stage with it fails to compile,
// which is the point (exact tests give decays directly as rationals).
#pragma once

#include <boost/multiprecision/cpp_bin_float.hpp>
#include <boost/multiprecision/cpp_int.hpp>
#include <type_traits>

#if K3REF_HAVE_MPFR
#include <boost/multiprecision/gmp.hpp>
#include <boost/multiprecision/mpfr.hpp>
#endif

namespace k3ref::num {

// Decimal digits that hold at least `Bits` binary digits.
constexpr unsigned digits10_for_bits(unsigned bits) { return (bits * 30103u + 99999u) / 100000u + 1u; }

#if K3REF_HAVE_MPFR
// Stack-allocated limbs: no heap traffic per temporary, which matters at 10^8 operations.
template <unsigned Bits>
using high_precision = boost::multiprecision::number<
    boost::multiprecision::mpfr_float_backend<digits10_for_bits(Bits), boost::multiprecision::allocate_stack>,
    boost::multiprecision::et_off>;
using rational = boost::multiprecision::number<boost::multiprecision::gmp_rational, boost::multiprecision::et_off>;
inline constexpr const char* high_precision_backend = "mpfr";
inline constexpr const char* rational_backend = "gmp";
#else
template <unsigned Bits>
using high_precision = boost::multiprecision::number<
    boost::multiprecision::cpp_bin_float<Bits, boost::multiprecision::digit_base_2>, boost::multiprecision::et_off>;
using rational = boost::multiprecision::number<boost::multiprecision::cpp_rational_backend, boost::multiprecision::et_off>;
inline constexpr const char* high_precision_backend = "cpp_bin_float";
inline constexpr const char* rational_backend = "cpp_rational";
#endif

// The precision of goldens: 256 bits, so that the reference's own error is negligible next
// to the one rounding of each output to double (docs/golden-format.md).
inline constexpr unsigned golden_bits = 256;
using golden_float = high_precision<golden_bits>;

template <class T>
struct scalar_traits {
  static constexpr bool is_exact = false;
  static constexpr bool has_transcendentals = true;
};
template <>
struct scalar_traits<double> {
  static constexpr bool is_exact = false;
  static constexpr bool has_transcendentals = true;
};
// Every Boost.Multiprecision number: exact when it is a rational kind.
template <class Backend, boost::multiprecision::expression_template_option ET>
struct scalar_traits<boost::multiprecision::number<Backend, ET>> {
  static constexpr bool is_exact = boost::multiprecision::number_category<Backend>::value ==
                                   boost::multiprecision::number_kind_rational;
  static constexpr bool has_transcendentals = !is_exact;
};

template <class T>
inline constexpr bool is_exact_v = scalar_traits<T>::is_exact;

// MPFR keeps per-thread caches (constants such as log 2, exp tables). A worker thread
// that computed in MPFR calls this before it ends so they are freed, not leaked.
inline void release_thread_caches() {
#if K3REF_HAVE_MPFR
  mpfr_free_cache2(MPFR_FREE_LOCAL_CACHE);
#endif
}

// Value of a double in any tier (exact: every double is a dyadic rational).
template <class T>
T from_double(double x) {
  return T(x);
}

}  // namespace k3ref::num
