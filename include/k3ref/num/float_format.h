// The low-precision storage formats of tensors (fp64 down to fp8) and exact rounding into
// them from any scalar tier. One algorithm serves every format: it is parameterised by
// FormatInfo (field widths, bias, whether the top binade holds infinities), never written
// out per format.
//
// Conventions (those of PyTorch and ml_dtypes):
//   * Rounding is to nearest, ties to even, everywhere: inside a binade, across the
//     subnormal/normal boundary, down to zero, and at the overflow threshold.
//   * fp64, fp32, fp16, bf16, fp8_e5m2 are IEEE-style: infinities, NaNs, subnormals (never
//     flushed), signed zero. A magnitude at or beyond max_finite + ulp(max_finite)/2 rounds
//     to infinity: that midpoint is a tie whose even neighbour is 2^(emax+1), because
//     max_finite's mantissa is all ones (odd), which is exactly IEEE 754's rule.
//   * A NaN input becomes the canonical quiet NaN of the format with the input's sign:
//     exponent all ones, only the top mantissa bit set (bf16 0x7FC0, fp16 0x7E00, e5m2
//     0x7E). (torch's own float -> bf16 drops the sign of a NaN; here it is kept.) The sign
//     survives only where S carries one: an MPFR NaN made through Boost is unsigned.
//   * fp8_e4m3 is the "fn" variant (OCP E4M3FN, torch.float8_e4m3fn, ml_dtypes
//     float8_e4m3fn): bias 7, no infinities, the top binade is ordinary except that
//     S.1111.111 is the only NaN; S.1111.110 = 448 is the largest finite value.
//     Overflow and +-inf map to NaN with the input's sign (0x7F / 0xFF), as torch's
//     float -> float8_e4m3fn does. Overflow means: RNE would give a value beyond 448. The
//     next step up would be 480, so the midpoint 464 is a tie whose even neighbour is 448
//     (mantissa 110): 464 -> 448, anything above 464 -> NaN. torch (the `mant_odd` round
//     bias in c10/util/Float8_e4m3fn.h) and ml_dtypes both give 464 -> 448.
//   * Rounding is done once, from the exact value. torch converts a double to fp16/bf16/
//     fp8 through float32 (two roundings); this header does not, so it can differ from
//     torch on doubles that are not floats. For float inputs the results coincide.
//
// Bit patterns travel in the low total_bits of a std::uint64_t. Every value of every
// format here is exact in double, so decode returns a double and round_to<S> converts that
// double into S exactly. The generic round_to / to_double_rne work from the value in S
// itself (comparisons with powers of two, exact scaling by powers of two, floor), so a
// rational or a 256-bit value is never first rounded to double.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "k3ref/error.h"
#include "k3ref/num/scalar.h"

namespace k3ref::num {

enum class Format { fp64, fp32, fp16, bf16, fp8_e4m3, fp8_e5m2 };

inline constexpr Format all_formats[] = {Format::fp64, Format::fp32,     Format::fp16,
                                         Format::bf16, Format::fp8_e4m3, Format::fp8_e5m2};

// Layout and range of a format. has_infinity == false means the "fn" convention: the
// all-ones exponent is an ordinary binade whose all-ones mantissa is the only NaN.
struct FormatInfo {
  const char* name;
  int total_bits;     // sign + exponent_bits + mantissa_bits
  int exponent_bits;
  int mantissa_bits;  // stored bits, without the implicit leading one
  int bias;
  bool has_infinity;
  double max_finite;
  double min_normal;
  double min_subnormal;
};

namespace detail {

// 2^e by repeated exact doubling/halving (std::ldexp is not constexpr in C++20). Every
// intermediate is a power of two inside the double range, hence exact, for e in
// [-1074, 1023].
constexpr double exact_pow2(int e) {
  double result = 1.0;
  for (; e > 0; --e) result *= 2.0;
  for (; e < 0; ++e) result *= 0.5;
  return result;
}

// Exponent of the largest binade holding finite values. With infinities the all-ones
// exponent is reserved; in the fn convention it is an ordinary binade.
constexpr int max_exponent(int exponent_bits, int bias, bool has_infinity) {
  const int top_field = (1 << exponent_bits) - 1;
  return (has_infinity ? top_field - 1 : top_field) - bias;
}

constexpr FormatInfo make_format_info(const char* name, int exponent_bits, int mantissa_bits, bool has_infinity) {
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int min_exponent = 1 - bias;
  const int emax = max_exponent(exponent_bits, bias, has_infinity);
  // Largest significand as an integer: all ones, or all ones minus one where the all-ones
  // pattern of the top binade is NaN (fn).
  const std::uint64_t largest_significand =
      (std::uint64_t{1} << (mantissa_bits + 1)) - 1 - (has_infinity ? 0 : 1);
  return FormatInfo{name,
                    1 + exponent_bits + mantissa_bits,
                    exponent_bits,
                    mantissa_bits,
                    bias,
                    has_infinity,
                    static_cast<double>(largest_significand) * exact_pow2(emax - mantissa_bits),
                    exact_pow2(min_exponent),
                    exact_pow2(min_exponent - mantissa_bits)};
}

// Built at compile time (constexpr variable), so the exact_pow2 loops never run at run
// time, whatever the optimiser does with format_info.
inline constexpr FormatInfo format_table[] = {
    make_format_info("fp64", 11, 52, true),     make_format_info("fp32", 8, 23, true),
    make_format_info("fp16", 5, 10, true),      make_format_info("bf16", 8, 7, true),
    make_format_info("fp8_e4m3", 4, 3, false),  make_format_info("fp8_e5m2", 5, 2, true),
};

}  // namespace detail

constexpr FormatInfo format_info(Format format) {
  switch (format) {
    case Format::fp64: return detail::format_table[0];
    case Format::fp32: return detail::format_table[1];
    case Format::fp16: return detail::format_table[2];
    case Format::bf16: return detail::format_table[3];
    case Format::fp8_e4m3: return detail::format_table[4];
    case Format::fp8_e5m2: return detail::format_table[5];
  }
  throw InvalidArgument("format_info: argument 'format' is not a Format enumerator");
}

namespace detail {

// The fields and special patterns of a format, derived once from FormatInfo.
struct Layout {
  int mantissa_bits;
  int bias;
  int min_exponent;  // exponent of min_normal
  int max_exponent;  // exponent of the top finite binade
  std::uint64_t sign_bit;
  std::uint64_t magnitude_mask;
  std::uint64_t exponent_field_max;  // all ones
  std::uint64_t mantissa_mask;
  std::uint64_t nan_magnitude;       // canonical quiet NaN (fn: the only NaN)
  std::uint64_t overflow_magnitude;  // infinity, or NaN where there is no infinity
};

inline Layout layout_of(const FormatInfo& info) {
  Layout l{};
  l.mantissa_bits = info.mantissa_bits;
  l.bias = info.bias;
  l.min_exponent = 1 - info.bias;
  l.max_exponent = max_exponent(info.exponent_bits, info.bias, info.has_infinity);
  l.sign_bit = std::uint64_t{1} << (info.total_bits - 1);
  l.magnitude_mask = l.sign_bit - 1;
  l.exponent_field_max = (std::uint64_t{1} << info.exponent_bits) - 1;
  l.mantissa_mask = (std::uint64_t{1} << info.mantissa_bits) - 1;
  const std::uint64_t infinity_magnitude = l.exponent_field_max << info.mantissa_bits;
  l.nan_magnitude = info.has_infinity ? infinity_magnitude | (std::uint64_t{1} << (info.mantissa_bits - 1))
                                      : l.magnitude_mask;
  l.overflow_magnitude = info.has_infinity ? infinity_magnitude : l.nan_magnitude;
  return l;
}

inline void check_pattern(const char* function, const FormatInfo& info, std::uint64_t bits) {
  if (info.total_bits < 64 && (bits >> info.total_bits) != 0) {
    throw InvalidArgument(std::string(function) + ": argument 'bits' = " + std::to_string(bits) +
                          " has bits set above the " + std::to_string(info.total_bits) + " of " + info.name);
  }
}

// Where the fractional part of a scaled magnitude lies against one half: all RNE needs.
enum class Fraction { below_half, half, above_half };

struct Truncated {
  std::uint64_t whole;  // floor(|x| / 2^quantum_exponent)
  Fraction fraction;
};

// The few scalar operations the rounding needs, all exact: frexp / ldexp / floor for
// binary floating types (double, MPFR, cpp_bin_float), integer arithmetic on numerator
// and denominator for rationals.
template <class S>
bool is_nan_value(const S& x) {
  if constexpr (is_exact_v<S>) {
    return false;
  } else {
    using std::isnan;
    return isnan(x);
  }
}

template <class S>
bool is_infinite_value(const S& x) {
  if constexpr (is_exact_v<S>) {
    return false;
  } else {
    using std::isinf;
    return isinf(x);
  }
}

// Sign including that of -0 and of a NaN, where the type has them.
template <class S>
bool sign_bit_set(const S& x) {
  if constexpr (is_exact_v<S>) {
    return x < 0;
  } else {
    using std::signbit;
    return static_cast<bool>(signbit(x));
  }
}

// Integer shift of a non-negative big integer by `amount` >= 0.
template <class Integer>
Integer shifted_left(const Integer& value, int amount) {
  return Integer(value << static_cast<unsigned>(amount));
}

// floor(log2(magnitude)) for a finite magnitude > 0.
template <class S>
int floor_log2(const S& magnitude) {
  if constexpr (is_exact_v<S>) {
    using Integer = std::decay_t<decltype(numerator(magnitude))>;
    const Integer num = numerator(magnitude);
    const Integer den = denominator(magnitude);
    // num in [2^a, 2^(a+1)), den in [2^b, 2^(b+1)), so num/den in (2^(a-b-1), 2^(a-b+1)):
    // the answer is a-b or a-b-1, decided by one exact comparison with 2^(a-b).
    const int guess = static_cast<int>(msb(num)) - static_cast<int>(msb(den));
    const bool at_least_guess = guess >= 0 ? num >= detail::shifted_left(den, guess) : detail::shifted_left(num, -guess) >= den;
    return at_least_guess ? guess : guess - 1;
  } else {
    using std::frexp;
    int exponent = 0;
    (void)frexp(magnitude, &exponent);  // magnitude = f * 2^exponent, f in [1/2, 1)
    return exponent - 1;
  }
}

// floor(magnitude / 2^quantum_exponent) and its fractional part against 1/2. The caller
// guarantees the quotient is below 2^63.
template <class S>
Truncated truncate_scaled(const S& magnitude, int quantum_exponent) {
  if constexpr (is_exact_v<S>) {
    using Integer = std::decay_t<decltype(numerator(magnitude))>;
    Integer num = numerator(magnitude);
    Integer den = denominator(magnitude);
    if (quantum_exponent <= 0) {
      num = detail::shifted_left(num, -quantum_exponent);
    } else {
      den = detail::shifted_left(den, quantum_exponent);
    }
    const Integer whole = Integer(num / den);
    const Integer twice_remainder = detail::shifted_left(Integer(num - Integer(whole * den)), 1);
    const Fraction fraction = twice_remainder < den    ? Fraction::below_half
                              : twice_remainder == den ? Fraction::half
                                                       : Fraction::above_half;
    return {static_cast<std::uint64_t>(whole), fraction};
  } else {
    using std::floor;
    using std::ldexp;
    // Scaling by a power of two and taking the fractional part are exact in binary
    // floating point; the scaled value lies in [1/2, 2^(mantissa_bits+1)), far from
    // underflow and overflow.
    const S scaled = S(ldexp(magnitude, -quantum_exponent));
    const S whole = S(floor(scaled));
    const S fraction_part = S(scaled - whole);
    const S half = S(0.5);
    const Fraction fraction = fraction_part < half    ? Fraction::below_half
                              : fraction_part == half ? Fraction::half
                                                      : Fraction::above_half;
    return {static_cast<std::uint64_t>(whole), fraction};
  }
}

// The generic algorithm: the pattern of RNE(x) in the format described by `info`.
template <class S>
std::uint64_t encode_scalar(const FormatInfo& info, const S& x) {
  const Layout l = detail::layout_of(info);
  const std::uint64_t sign = detail::sign_bit_set(x) ? l.sign_bit : 0;
  if (detail::is_nan_value(x)) return sign | l.nan_magnitude;
  if (detail::is_infinite_value(x)) return sign | l.overflow_magnitude;
  if (x == 0) return sign;

  const S magnitude = sign != 0 ? S(-x) : x;
  const int exponent = detail::floor_log2(magnitude);
  // |x| >= 2^(max_exponent+1) lies beyond max_finite + half an ulp in every format.
  if (exponent > l.max_exponent) return sign | l.overflow_magnitude;
  // |x| < 2^(min_exponent - mantissa_bits - 1), half the smallest subnormal: rounds to 0.
  if (exponent < l.min_exponent - l.mantissa_bits - 1) return sign;

  // Quantum (ulp) of the result's binade; subnormals share the quantum of min_normal.
  int quantum_exponent = std::max(exponent, l.min_exponent) - l.mantissa_bits;
  const Truncated truncated = detail::truncate_scaled(magnitude, quantum_exponent);
  std::uint64_t significand = truncated.whole;  // below 2^(mantissa_bits+1)
  const bool round_up = truncated.fraction == Fraction::above_half ||
                        (truncated.fraction == Fraction::half && (significand & 1) != 0);
  if (round_up) ++significand;

  const std::uint64_t hidden_bit = std::uint64_t{1} << l.mantissa_bits;
  if (significand == 2 * hidden_bit) {  // rounding carried into the next binade
    significand = hidden_bit;
    ++quantum_exponent;
  }
  // Below the hidden bit only in the subnormal binade: the pattern is the significand.
  if (significand < hidden_bit) return sign | significand;

  const int result_exponent = quantum_exponent + l.mantissa_bits;
  if (result_exponent > l.max_exponent) return sign | l.overflow_magnitude;
  const std::uint64_t magnitude_bits =
      (static_cast<std::uint64_t>(result_exponent + l.bias) << l.mantissa_bits) | (significand - hidden_bit);
  // In the fn convention the all-ones pattern (where 480 would be in e4m3) is NaN, which
  // is exactly what overflow maps to, so it needs no case of its own.
  return sign | magnitude_bits;
}

}  // namespace detail

inline bool is_nan_pattern(Format format, std::uint64_t bits) {
  const FormatInfo info = format_info(format);
  detail::check_pattern("is_nan_pattern", info, bits);
  const detail::Layout l = detail::layout_of(info);
  const std::uint64_t magnitude = bits & l.magnitude_mask;
  if (!info.has_infinity) return magnitude == l.magnitude_mask;
  return (magnitude >> l.mantissa_bits) == l.exponent_field_max && (magnitude & l.mantissa_mask) != 0;
}

// The pattern of x rounded to nearest, ties to even. For fp64 it is the double's own bits,
// NaN payload included; for the other formats a NaN becomes the canonical quiet NaN.
inline std::uint64_t encode(Format format, double x) {
  if (format == Format::fp64) return std::bit_cast<std::uint64_t>(x);
  return detail::encode_scalar(format_info(format), x);
}

// The exact value of a pattern. Throws InvalidArgument when bits are set above total_bits.
inline double decode(Format format, std::uint64_t bits) {
  const FormatInfo info = format_info(format);
  detail::check_pattern("decode", info, bits);
  if (format == Format::fp64) return std::bit_cast<double>(bits);
  const detail::Layout l = detail::layout_of(info);
  const bool negative = (bits & l.sign_bit) != 0;
  const std::uint64_t exponent_field = (bits & l.magnitude_mask) >> l.mantissa_bits;
  const std::uint64_t mantissa = bits & l.mantissa_mask;
  double magnitude = 0.0;
  if (is_nan_pattern(format, bits)) {
    magnitude = std::numeric_limits<double>::quiet_NaN();
  } else if (info.has_infinity && exponent_field == l.exponent_field_max) {
    magnitude = std::numeric_limits<double>::infinity();
  } else if (exponent_field == 0) {
    magnitude = std::ldexp(static_cast<double>(mantissa), l.min_exponent - l.mantissa_bits);
  } else {
    const std::uint64_t significand = (std::uint64_t{1} << l.mantissa_bits) | mantissa;
    magnitude = std::ldexp(static_cast<double>(significand),
                           static_cast<int>(exponent_field) - l.bias - l.mantissa_bits);
  }
  return std::copysign(magnitude, negative ? -1.0 : 1.0);
}

inline double round_to(Format format, double x) {
  if (format == Format::fp64) return x;
  return decode(format, encode(format, x));
}

// RNE of x into `format`, returned in S, for any tier. The rounding works on x itself, so
// it is exact for rationals and multiprecision values (no detour through double).
// Throws InvalidArgument when S is exact (rational) and the result is +-inf or NaN, which
// a rational cannot hold: overflow of an IEEE format, or of fp8_e4m3 (-> NaN).
template <class S>
  requires(!std::is_integral_v<S>)
S round_to(Format format, const S& x) {
  if constexpr (std::is_same_v<S, double>) {
    return round_to(format, static_cast<double>(x));
  } else {
    const FormatInfo info = format_info(format);
    const double rounded = decode(format, detail::encode_scalar(info, x));
    if constexpr (is_exact_v<S>) {
      if (!std::isfinite(rounded)) {
        throw InvalidArgument(std::string("round_to: argument 'x' overflows ") + info.name + " to " +
                              (std::isnan(rounded) ? "NaN" : "infinity") + ", which a rational cannot hold");
      }
    }
    return S(rounded);
  }
}

// The double nearest to x, ties to even: a correctly rounded conversion (Boost's own
// mpq -> double conversion truncates, and cpp_bin_float's is not guaranteed to be RNE).
// Overflow gives +-inf, as IEEE conversion does.
template <class S>
  requires(!std::is_integral_v<S>)
double to_double_rne(const S& x) {
  if constexpr (std::is_same_v<S, double>) {
    return x;
  } else {
    return decode(Format::fp64, detail::encode_scalar(format_info(Format::fp64), x));
  }
}

}  // namespace k3ref::num
