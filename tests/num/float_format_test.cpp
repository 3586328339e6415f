// Tests of k3ref/num/float_format.h. The reference values here are computed independently
// of the header: field widths are written out as literals, pattern values come from
// std::ldexp on the fields, rounding references come from exact rational comparisons or
// from the hardware (float, _Float16), and the hand cases carry their derivations.
#include "k3ref/num/float_format.h"

#include "test_support.h"

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

using k3ref::InvalidArgument;
using k3ref::num::decode;
using k3ref::num::encode;
using k3ref::num::Format;
using k3ref::num::format_info;
using k3ref::num::is_nan_pattern;
using k3ref::num::rational;
using k3ref::num::round_to;
using k3ref::num::to_double_rne;
using hp256 = k3ref::num::high_precision<256>;

// ---------------------------------------------------------------------------------------
// Independent description of the small formats, written from their specifications.

struct Spec {
  Format format;
  int exponent_bits;
  int mantissa_bits;
  bool ieee;  // false: fn convention (no infinity, only S.1..1.1..1 is NaN)
  int total_bits() const { return 1 + exponent_bits + mantissa_bits; }
  int bias() const { return (1 << (exponent_bits - 1)) - 1; }
  std::uint64_t sign_bit() const { return std::uint64_t{1} << (total_bits() - 1); }
  std::uint64_t pattern_count() const { return std::uint64_t{1} << total_bits(); }
  // Largest finite positive pattern.
  std::uint64_t max_pattern() const {
    const std::uint64_t all_ones = sign_bit() - 1;
    return ieee ? (((std::uint64_t{1} << exponent_bits) - 1) << mantissa_bits) - 1 : all_ones - 1;
  }
};

const Spec kBf16{Format::bf16, 8, 7, true};
const Spec kFp16{Format::fp16, 5, 10, true};
const Spec kE4m3{Format::fp8_e4m3, 4, 3, false};
const Spec kE5m2{Format::fp8_e5m2, 5, 2, true};
const Spec kSmallSpecs[] = {kBf16, kFp16, kE4m3, kE5m2};

// Value of a pattern from its sign/exponent/mantissa fields.
double reference_value(const Spec& s, std::uint64_t pattern) {
  const bool negative = (pattern >> (s.total_bits() - 1)) & 1;
  const std::uint64_t exponent_field = (pattern >> s.mantissa_bits) & ((std::uint64_t{1} << s.exponent_bits) - 1);
  const std::uint64_t mantissa = pattern & ((std::uint64_t{1} << s.mantissa_bits) - 1);
  const std::uint64_t exponent_all_ones = (std::uint64_t{1} << s.exponent_bits) - 1;
  const std::uint64_t mantissa_all_ones = (std::uint64_t{1} << s.mantissa_bits) - 1;
  double magnitude;
  if (s.ieee && exponent_field == exponent_all_ones) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else if (!s.ieee && exponent_field == exponent_all_ones && mantissa == mantissa_all_ones) {
    magnitude = NAN;
  } else if (exponent_field == 0) {
    magnitude = std::ldexp(static_cast<double>(mantissa), 1 - s.bias() - s.mantissa_bits);
  } else {
    magnitude = std::ldexp(static_cast<double>(mantissa + (mantissa_all_ones + 1)),
                           static_cast<int>(exponent_field) - s.bias() - s.mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}

// What the pattern just above max_pattern "would be" with an unbounded exponent: the
// value that rounding ties against at the overflow threshold.
double virtual_value_above_max(const Spec& s) {
  const double max = reference_value(s, s.max_pattern());
  const int emax = static_cast<int>(s.max_pattern() >> s.mantissa_bits) - s.bias();
  return max + std::ldexp(1.0, emax - s.mantissa_bits);
}

bool same_double(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) && std::signbit(a) == std::signbit(b);
  return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b);
}

// Simple xorshift64 (Marsaglia) over raw bit patterns; no std distributions.
struct XorShift64 {
  std::uint64_t state;
  std::uint64_t next() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  }
};

double double_from_fields(bool negative, std::uint64_t biased_exponent, std::uint64_t mantissa) {
  return std::bit_cast<double>((negative ? std::uint64_t{1} << 63 : 0) | (biased_exponent << 52) |
                               (mantissa & ((std::uint64_t{1} << 52) - 1)));
}

// Doubles that stress a conversion to fp32: raw patterns, the float range, the float
// subnormal range, and float midpoints nudged by a few double ulps.
double random_double_for_fp32(XorShift64& rng) {
  const std::uint64_t r = rng.next();
  const std::uint64_t mantissa = rng.next();
  const bool negative = r & 1;
  switch ((r >> 1) % 4) {
    case 0: return std::bit_cast<double>(mantissa);
    case 1: return double_from_fields(negative, 1023 - 160 + (r >> 8) % 300, mantissa);
    case 2: return double_from_fields(negative, 1023 - 155 + (r >> 8) % 40, mantissa);
    default: {
      const std::uint32_t float_bits = static_cast<std::uint32_t>(mantissa) & 0x7F7FFFFFu;  // finite
      const double low = std::bit_cast<float>(float_bits);
      const double high = std::bit_cast<float>(float_bits + 1);  // may be inf: midpoint is then inf too
      double x = (low + high) / 2;                                // exact: 25 bits
      for (int steps = static_cast<int>((r >> 8) % 5) - 2; steps != 0; steps += steps > 0 ? -1 : 1) {
        x = std::nextafter(x, steps > 0 ? INFINITY : 0.0);
      }
      return negative ? -x : x;
    }
  }
}

template <class S>
S pow2(int e) {
  S result(1);
  for (; e > 1000; e -= 1000) result *= S(std::ldexp(1.0, 1000));
  for (; e < -1000; e += 1000) result *= S(std::ldexp(1.0, -1000));
  return result * S(std::ldexp(1.0, e));
}

rational abs_rational(const rational& r) { return r < 0 ? rational(-r) : r; }

// RNE reference by exact rational comparisons: binary search for the largest pattern not
// above |r|, then the nearer of it and its successor, ties to the even pattern. The
// successor of max_pattern stands for virtual_value_above_max; choosing it means overflow
// (nullopt).
std::optional<std::uint64_t> reference_round_magnitude(const Spec& s, const rational& magnitude) {
  const std::uint64_t top = s.max_pattern() + 1;
  auto value_of = [&](std::uint64_t p) {
    return p == top ? rational(virtual_value_above_max(s)) : rational(reference_value(s, p));
  };
  if (magnitude >= value_of(top)) return std::nullopt;
  std::uint64_t low = 0, high = top;  // value(low) <= magnitude < value(high)
  while (high - low > 1) {
    const std::uint64_t mid = low + (high - low) / 2;
    (value_of(mid) <= magnitude ? low : high) = mid;
  }
  const rational below = magnitude - value_of(low), above = value_of(high) - magnitude;
  const std::uint64_t chosen = below < above ? low : above < below ? high : (low % 2 == 0 ? low : high);
  if (chosen == top) return std::nullopt;
  return chosen;
}

// ---------------------------------------------------------------------------------------
// FormatInfo

static_assert(format_info(Format::bf16).max_finite == 3.3895313892515355e38);
static_assert(format_info(Format::fp16).max_finite == 65504.0);
static_assert(format_info(Format::fp8_e4m3).max_finite == 448.0);
static_assert(format_info(Format::fp8_e5m2).max_finite == 57344.0);
static_assert(format_info(Format::fp32).max_finite == static_cast<double>(FLT_MAX));
static_assert(format_info(Format::fp64).max_finite == DBL_MAX);
static_assert(format_info(Format::fp64).min_subnormal == std::numeric_limits<double>::denorm_min());
static_assert(format_info(Format::fp32).min_subnormal == static_cast<double>(std::numeric_limits<float>::denorm_min()));
static_assert(format_info(Format::fp32).min_normal == static_cast<double>(FLT_MIN));

TEST(FloatFormatInfo, FieldsMatchSpecifications) {
  for (const Spec& s : kSmallSpecs) {
    const auto info = format_info(s.format);
    SCOPED_TRACE(info.name);
    EXPECT_EQ(info.total_bits, s.total_bits());
    EXPECT_EQ(info.exponent_bits, s.exponent_bits);
    EXPECT_EQ(info.mantissa_bits, s.mantissa_bits);
    EXPECT_EQ(info.bias, s.bias());
    EXPECT_EQ(info.has_infinity, s.ieee);
    EXPECT_EQ(info.max_finite, reference_value(s, s.max_pattern()));
    EXPECT_EQ(info.min_normal, reference_value(s, std::uint64_t{1} << s.mantissa_bits));
    EXPECT_EQ(info.min_subnormal, reference_value(s, 1));
  }
  EXPECT_EQ(format_info(Format::fp16).min_subnormal, std::ldexp(1.0, -24));
  EXPECT_EQ(format_info(Format::fp8_e4m3).min_subnormal, std::ldexp(1.0, -9));
  EXPECT_EQ(format_info(Format::fp8_e5m2).min_subnormal, std::ldexp(1.0, -16));
  EXPECT_EQ(format_info(Format::bf16).min_subnormal, std::ldexp(1.0, -133));
}

// ---------------------------------------------------------------------------------------
// Exhaustive over every pattern of the 8- and 16-bit formats.

TEST(FloatFormatExhaustive, DecodeMatchesFieldsAndRoundTrips) {
  for (const Spec& s : kSmallSpecs) {
    SCOPED_TRACE(format_info(s.format).name);
    for (std::uint64_t p = 0; p < s.pattern_count(); ++p) {
      const double value = decode(s.format, p);
      ASSERT_TRUE(same_double(value, reference_value(s, p))) << "pattern " << p;
      const bool nan = std::isnan(value);
      ASSERT_EQ(is_nan_pattern(s.format, p), nan) << "pattern " << p;
      const std::uint64_t again = encode(s.format, value);
      if (nan) {
        ASSERT_TRUE(is_nan_pattern(s.format, again)) << "pattern " << p;
        ASSERT_EQ(again & s.sign_bit(), p & s.sign_bit()) << "pattern " << p;
      } else {
        ASSERT_EQ(again, p);
        ASSERT_TRUE(same_double(round_to(s.format, value), value)) << "pattern " << p;
      }
    }
  }
}

TEST(FloatFormatExhaustive, DecodeIsMonotoneOverFinitePatterns) {
  for (const Spec& s : kSmallSpecs) {
    SCOPED_TRACE(format_info(s.format).name);
    // Value order: -max ... -0, +0 ... +max.
    std::vector<std::uint64_t> ordered;
    for (std::uint64_t m = s.max_pattern() + 1; m-- > 0;) ordered.push_back(s.sign_bit() | m);
    for (std::uint64_t m = 0; m <= s.max_pattern(); ++m) ordered.push_back(m);
    for (std::size_t i = 1; i < ordered.size(); ++i) {
      const double before = decode(s.format, ordered[i - 1]), after = decode(s.format, ordered[i]);
      ASSERT_TRUE(std::isfinite(before) && std::isfinite(after));
      if (ordered[i - 1] == s.sign_bit() && ordered[i] == 0) {
        ASSERT_EQ(before, after);  // -0 == +0
      } else {
        ASSERT_LT(before, after) << "patterns " << ordered[i - 1] << ", " << ordered[i];
      }
    }
    // Everything beyond max_pattern is inf or NaN.
    for (std::uint64_t m = s.max_pattern() + 1; m < s.sign_bit(); ++m) {
      ASSERT_FALSE(std::isfinite(decode(s.format, m)));
      ASSERT_FALSE(std::isfinite(decode(s.format, s.sign_bit() | m)));
    }
  }
}

// Every gap between adjacent finite values, both signs: the midpoint goes to the even
// pattern, one double ulp either side goes to the nearer one. The gap above max_finite is
// against the virtual next value: IEEE formats tie to inf (max's mantissa is odd), e4m3fn
// ties to 448 (mantissa 110 is even) and goes to NaN above 464.
TEST(FloatFormatExhaustive, MidpointsTieToEven) {
  for (const Spec& s : kSmallSpecs) {
    SCOPED_TRACE(format_info(s.format).name);
    const std::uint64_t overflow_magnitude = s.max_pattern() + 1;  // inf, or NaN for fn
    for (std::uint64_t low = 0; low <= s.max_pattern(); ++low) {
      const std::uint64_t high = low + 1;
      const double low_value = reference_value(s, low);
      const double high_value = high == overflow_magnitude ? virtual_value_above_max(s) : reference_value(s, high);
      const double mid = (low_value + high_value) / 2;  // exact: a few more bits than the format
      const std::uint64_t even = low % 2 == 0 ? low : high;
      for (const std::uint64_t sign : {std::uint64_t{0}, s.sign_bit()}) {
        const double direction = sign != 0 ? -1.0 : 1.0;
        ASSERT_EQ(encode(s.format, direction * mid), sign | even) << "low pattern " << low;
        ASSERT_EQ(encode(s.format, direction * std::nextafter(mid, low_value)), sign | low) << "low pattern " << low;
        ASSERT_EQ(encode(s.format, direction * std::nextafter(mid, high_value)), sign | high) << "low pattern " << low;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Hand-derived cases.

TEST(FloatFormatHand, Bf16) {
  // bf16 keeps 7 mantissa bits: the ulp of [1, 2) is 2^-7.
  // 1 + 2^-8 is the midpoint of 1 (mantissa 0, even) and 1 + 2^-7 (mantissa 1): -> 1.
  EXPECT_EQ(round_to(Format::bf16, 1 + std::ldexp(1.0, -8)), 1.0);
  EXPECT_EQ(encode(Format::bf16, 1 + std::ldexp(1.0, -8)), 0x3F80u);
  // 1 + 3*2^-8 = 1 + 1.5 ulp: midpoint of 1 + 2^-7 (mantissa 1, odd) and 1 + 2^-6
  // (mantissa 2, even): -> 1 + 2^-6.
  EXPECT_EQ(round_to(Format::bf16, 1 + 3 * std::ldexp(1.0, -8)), 1 + std::ldexp(1.0, -6));
  EXPECT_EQ(encode(Format::bf16, 1 + 3 * std::ldexp(1.0, -8)), 0x3F82u);
  // Just above the first midpoint: -> 1 + 2^-7.
  EXPECT_EQ(encode(Format::bf16, 1 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30)), 0x3F81u);
  // Largest finite 0x7F7F = (2 - 2^-7) * 2^127; the next step would be 2^128. The
  // midpoint (2 - 2^-8) * 2^127 ties; 0x7F7F is odd, so IEEE sends the tie to inf.
  const double max = 3.3895313892515355e38;
  const double threshold = std::ldexp(2 - std::ldexp(1.0, -8), 127);
  EXPECT_EQ(decode(Format::bf16, 0x7F7F), max);
  EXPECT_EQ(encode(Format::bf16, threshold), 0x7F80u);
  EXPECT_EQ(encode(Format::bf16, std::nextafter(threshold, 0.0)), 0x7F7Fu);
  EXPECT_EQ(encode(Format::bf16, static_cast<double>(FLT_MAX)), 0x7F80u);  // above the threshold
  EXPECT_EQ(encode(Format::bf16, -threshold), 0xFF80u);
  // Smallest subnormal 2^-133; half of it ties to 0; the largest subnormal 0x007F plus
  // half an ulp ties to the even min normal 0x0080 = 2^-126.
  EXPECT_EQ(decode(Format::bf16, 0x0001), std::ldexp(1.0, -133));
  EXPECT_EQ(encode(Format::bf16, std::ldexp(1.0, -134)), 0x0000u);
  EXPECT_EQ(encode(Format::bf16, std::ldexp(255.0, -134)), 0x0080u);  // 127.5 * 2^-133
}

TEST(FloatFormatHand, Fp16) {
  // Top binade [2^15, 2^16) has ulp 2^(15-10) = 32: max = 2047 * 32 = 65504 (0x7BFF).
  EXPECT_EQ(decode(Format::fp16, 0x7BFF), 65504.0);
  EXPECT_EQ(round_to(Format::fp16, 65504.0), 65504.0);
  // The midpoint to 2^16 is 65520; below it -> 65504; at it the tie goes to the even
  // significand 2048 = 2^16 (2047 is odd), which overflows -> inf.
  EXPECT_EQ(round_to(Format::fp16, 65519.99), 65504.0);
  EXPECT_EQ(encode(Format::fp16, 65520.0), 0x7C00u);
  EXPECT_EQ(round_to(Format::fp16, 65520.0), INFINITY);
  EXPECT_EQ(round_to(Format::fp16, -65520.0), -INFINITY);
  // Subnormal quantum is 2^(1-15-10) = 2^-24.
  EXPECT_EQ(decode(Format::fp16, 0x0001), std::ldexp(1.0, -24));
  // 2^-25 ties between 0 (even) and 2^-24 (odd) -> 0.
  EXPECT_EQ(encode(Format::fp16, std::ldexp(1.0, -25)), 0x0000u);
  EXPECT_EQ(encode(Format::fp16, -std::ldexp(1.0, -25)), 0x8000u);  // sign kept
  // Just above the tie -> 2^-24.
  EXPECT_EQ(round_to(Format::fp16, std::ldexp(1 + std::ldexp(1.0, -20), -25)), std::ldexp(1.0, -24));
  // 1.5 * 2^-24 ties between 1 and 2 quanta -> 2 (even).
  EXPECT_EQ(encode(Format::fp16, std::ldexp(3.0, -25)), 0x0002u);
  // 1023.5 * 2^-24 ties between the largest subnormal 0x03FF and min normal 0x0400 = 2^-14.
  EXPECT_EQ(encode(Format::fp16, std::ldexp(2047.0, -25)), 0x0400u);
  // 1 + 2^-11 ties between 1 and 1 + 2^-10 -> 1.
  EXPECT_EQ(round_to(Format::fp16, 1 + std::ldexp(1.0, -11)), 1.0);
}

TEST(FloatFormatHand, Fp8E4m3fn) {
  // bias 7, top binade [2^8, 2^9) with ulp 2^(8-3) = 32; S.1111.111 is NaN, so the
  // largest finite is 1.110b * 2^8 = 448 (0x7E).
  EXPECT_EQ(decode(Format::fp8_e4m3, 0x7E), 448.0);
  EXPECT_EQ(encode(Format::fp8_e4m3, 448.0), 0x7Eu);
  // 460 is below the midpoint 464 of 448 and the would-be 480 -> 448.
  EXPECT_EQ(round_to(Format::fp8_e4m3, 460.0), 448.0);
  // 464 = 1.1101b * 2^8 is an exact tie between 448 (mantissa 110, even) and 480
  // (mantissa 111, odd): RNE -> 448. torch (mant_odd rounding bias) and ml_dtypes agree.
  EXPECT_EQ(round_to(Format::fp8_e4m3, 464.0), 448.0);
  EXPECT_EQ(encode(Format::fp8_e4m3, -464.0), 0xFEu);
  // Anything above 464 rounds to 480, beyond max -> NaN with the sign kept.
  EXPECT_EQ(encode(Format::fp8_e4m3, std::nextafter(464.0, 1e9)), 0x7Fu);
  EXPECT_EQ(encode(Format::fp8_e4m3, 480.0), 0x7Fu);
  EXPECT_EQ(encode(Format::fp8_e4m3, -1e30), 0xFFu);
  EXPECT_TRUE(std::isnan(round_to(Format::fp8_e4m3, 465.0)));
  // No infinity: +-inf -> NaN with sign.
  EXPECT_EQ(encode(Format::fp8_e4m3, INFINITY), 0x7Fu);
  EXPECT_EQ(encode(Format::fp8_e4m3, -INFINITY), 0xFFu);
  // S.1111.110 is finite, S.1111.111 the only NaN.
  EXPECT_FALSE(is_nan_pattern(Format::fp8_e4m3, 0x7E));
  EXPECT_TRUE(is_nan_pattern(Format::fp8_e4m3, 0x7F));
  EXPECT_TRUE(is_nan_pattern(Format::fp8_e4m3, 0xFF));
  // Subnormal quantum 2^(1-7-3) = 2^-9; min normal 2^-6 (0x08); 2^-10 ties to 0.
  EXPECT_EQ(decode(Format::fp8_e4m3, 0x01), std::ldexp(1.0, -9));
  EXPECT_EQ(decode(Format::fp8_e4m3, 0x08), std::ldexp(1.0, -6));
  EXPECT_EQ(encode(Format::fp8_e4m3, std::ldexp(1.0, -10)), 0x00u);
}

TEST(FloatFormatHand, Fp8E5m2) {
  // bias 15, top finite binade [2^15, 2^16) with ulp 2^(15-2) = 2^13: max = 7 * 2^13 =
  // 57344 (0x7B). The midpoint to 2^16 is 61440; 0x7B is odd, so the tie goes to inf.
  EXPECT_EQ(decode(Format::fp8_e5m2, 0x7B), 57344.0);
  EXPECT_EQ(encode(Format::fp8_e5m2, 61440.0), 0x7Cu);
  EXPECT_EQ(encode(Format::fp8_e5m2, 61439.0), 0x7Bu);
  EXPECT_EQ(round_to(Format::fp8_e5m2, 61440.0), INFINITY);
  EXPECT_EQ(decode(Format::fp8_e5m2, 0x01), std::ldexp(1.0, -16));
  EXPECT_EQ(encode(Format::fp8_e5m2, INFINITY), 0x7Cu);
  EXPECT_EQ(encode(Format::fp8_e5m2, -INFINITY), 0xFCu);
}

TEST(FloatFormatHand, Fp32AndFp64) {
  // 1 + 2^-24 ties between 1 and 1 + 2^-23 -> 1 (even).
  EXPECT_EQ(encode(Format::fp32, 1 + std::ldexp(1.0, -24)), 0x3F800000u);
  // 2^-50 above the tie -> 1 + 2^-23.
  EXPECT_EQ(encode(Format::fp32, 1 + std::ldexp(1.0, -24) + std::ldexp(1.0, -50)), 0x3F800001u);
  // FLT_MAX + half an ulp ties to inf (FLT_MAX's mantissa is odd).
  EXPECT_EQ(encode(Format::fp32, std::ldexp(2 - std::ldexp(1.0, -24), 127)), 0x7F800000u);
  // Half the smallest subnormal 2^-150 ties to 0; a hair more -> 2^-149.
  EXPECT_EQ(encode(Format::fp32, std::ldexp(1.0, -150)), 0x00000000u);
  EXPECT_EQ(encode(Format::fp32, std::nextafter(std::ldexp(1.0, -150), 1.0)), 0x00000001u);
  // fp64 is the double itself, NaN payload included.
  const double signalling = std::bit_cast<double>(std::uint64_t{0x7FF0000000000001});
  EXPECT_EQ(encode(Format::fp64, signalling), 0x7FF0000000000001u);
  EXPECT_EQ(encode(Format::fp64, -0.0), 0x8000000000000000u);
  EXPECT_EQ(encode(Format::fp64, 0.1), std::bit_cast<std::uint64_t>(0.1));
}

TEST(FloatFormatHand, SignedZeroNanInfinity) {
  for (const Format f : k3ref::num::all_formats) {
    const auto info = format_info(f);
    SCOPED_TRACE(info.name);
    const std::uint64_t sign_bit = std::uint64_t{1} << (info.total_bits - 1);
    EXPECT_EQ(encode(f, 0.0), 0u);
    EXPECT_EQ(encode(f, -0.0), sign_bit);
    EXPECT_TRUE(std::signbit(round_to(f, -0.0)));
    EXPECT_TRUE(std::signbit(decode(f, sign_bit)));
    EXPECT_EQ(encode(f, -1e-300), f == Format::fp64 ? std::bit_cast<std::uint64_t>(-1e-300) : sign_bit);
    EXPECT_TRUE(is_nan_pattern(f, encode(f, NAN)));
    EXPECT_TRUE(is_nan_pattern(f, encode(f, -NAN)));
    EXPECT_EQ(encode(f, -NAN) & sign_bit, sign_bit);
    EXPECT_EQ(encode(f, NAN) & sign_bit, 0u);
    EXPECT_TRUE(std::isnan(round_to(f, NAN)));
    if (info.has_infinity) {
      EXPECT_EQ(round_to(f, INFINITY), INFINITY);
      EXPECT_EQ(round_to(f, -INFINITY), -INFINITY);
    } else {
      EXPECT_TRUE(std::isnan(round_to(f, INFINITY)));
      EXPECT_TRUE(std::isnan(round_to(f, -INFINITY)));
    }
  }
  // Canonical quiet NaNs: exponent all ones, top mantissa bit only.
  EXPECT_EQ(encode(Format::bf16, NAN), 0x7FC0u);
  EXPECT_EQ(encode(Format::bf16, -NAN), 0xFFC0u);
  EXPECT_EQ(encode(Format::fp16, NAN), 0x7E00u);
  EXPECT_EQ(encode(Format::fp32, NAN), 0x7FC00000u);
  EXPECT_EQ(encode(Format::fp8_e5m2, NAN), 0x7Eu);
  EXPECT_EQ(encode(Format::fp8_e4m3, NAN), 0x7Fu);
  EXPECT_EQ(encode(Format::bf16, INFINITY), 0x7F80u);
  EXPECT_EQ(encode(Format::fp16, -INFINITY), 0xFC00u);
}

TEST(FloatFormatErrors, RejectsStrayBitsAndUnrepresentableRationals) {
  EXPECT_THROW(decode(Format::bf16, 0x10000), InvalidArgument);
  EXPECT_THROW(decode(Format::fp8_e4m3, 0x100), InvalidArgument);
  EXPECT_THROW(is_nan_pattern(Format::fp16, 0x1FFFF), InvalidArgument);
  EXPECT_NO_THROW(decode(Format::fp64, ~std::uint64_t{0}));
  EXPECT_THROW(round_to(Format::bf16, rational(1e39)), InvalidArgument);
  EXPECT_THROW(round_to(Format::fp8_e4m3, rational(465)), InvalidArgument);
  EXPECT_EQ(round_to(Format::fp8_e4m3, rational(464)), rational(448));
}

// ---------------------------------------------------------------------------------------
// fp32 against the hardware's RNE conversion (and fp16 against _Float16 where the
// compiler has it).

TEST(FloatFormatHardware, Fp32MatchesFloatConversionOnAMillionDoubles) {
  XorShift64 rng{0x9E3779B97F4A7C15ull};
  for (int i = 0; i < 1'000'000; ++i) {
    const double x = random_double_for_fp32(rng);
    const float hardware = static_cast<float>(x);
    const std::uint64_t pattern = encode(Format::fp32, x);
    if (std::isnan(x)) {
      ASSERT_TRUE(is_nan_pattern(Format::fp32, pattern));
      ASSERT_EQ(pattern >> 31, std::uint64_t{std::signbit(x)});
      continue;
    }
    ASSERT_EQ(pattern, std::bit_cast<std::uint32_t>(hardware)) << std::hexfloat << x;
    ASSERT_TRUE(same_double(round_to(Format::fp32, x), static_cast<double>(hardware))) << std::hexfloat << x;
  }
}

#if defined(__FLT16_MANT_DIG__)
TEST(FloatFormatHardware, Fp16MatchesFloat16Conversion) {
  XorShift64 rng{0xD1B54A32D192ED03ull};
  for (int i = 0; i < 200'000; ++i) {
    const std::uint64_t r = rng.next();
    // Exponents around the fp16 range, from below its subnormals to beyond its max.
    const double x = double_from_fields(r & 1, 1023 - 30 + (r >> 1) % 50, rng.next());
    const auto hardware = std::bit_cast<std::uint16_t>(static_cast<_Float16>(x));
    ASSERT_EQ(encode(Format::fp16, x), hardware) << std::hexfloat << x;
  }
}
#endif

RC_GTEST_PROP(FloatFormatProperty, Fp32MatchesFloatConversion, ()) {
  const bool negative = *rc::gen::arbitrary<bool>();
  const auto biased_exponent = *rc::gen::inRange<std::uint64_t>(0, 2047);  // finite doubles
  const auto mantissa = *rc::gen::arbitrary<std::uint64_t>();
  const double from_fields = double_from_fields(negative, biased_exponent, mantissa);
  const double arbitrary = *rc::gen::arbitrary<double>();
  for (const double x : {from_fields, arbitrary}) {
    if (std::isnan(x)) continue;
    RC_ASSERT(encode(Format::fp32, x) == std::uint64_t{std::bit_cast<std::uint32_t>(static_cast<float>(x))});
  }
}

// ---------------------------------------------------------------------------------------
// The generic tiers.

TEST(FloatFormatGeneric, ExactDoublesAgreeWithTheDoublePath) {
  XorShift64 rng{0x2545F4914F6CDD1Dull};
  for (int i = 0; i < 4000; ++i) {
    const double x = random_double_for_fp32(rng);
    if (std::isnan(x)) continue;
    for (const Format f : k3ref::num::all_formats) {
      const double expected = round_to(f, x);
      const double through_hp = to_double_rne(round_to(f, hp256(x)));
      if (std::isnan(expected)) {
        ASSERT_TRUE(std::isnan(through_hp)) << std::hexfloat << x;  // MPFR's NaN has no sign
      } else {
        ASSERT_TRUE(same_double(through_hp, expected)) << std::hexfloat << x;
      }
      if (std::isinf(x)) continue;  // a rational cannot hold the input
      if (std::isfinite(expected)) {
        ASSERT_EQ(round_to(f, rational(x)), rational(expected)) << std::hexfloat << x;
      } else {
        ASSERT_THROW(round_to(f, rational(x)), InvalidArgument) << std::hexfloat << x;
      }
    }
    ASSERT_TRUE(same_double(to_double_rne(hp256(x)), x));
    if (std::isfinite(x)) {
      ASSERT_TRUE(same_double(to_double_rne(rational(x)), std::fabs(x) == 0 ? 0.0 : x));
    }
  }
}

// Values that are not doubles: rounding to double first and then to the format lands on
// a tie the exact value is not on (or leaves one it is on).
TEST(FloatFormatGeneric, NoDoubleRounding) {
  // 1 + 2^-8 + 2^-70 is above the bf16 midpoint 1 + 2^-8, so it rounds up to 1 + 2^-7.
  // As a double it is 1 + 2^-8 (2^-70 is far below half a double ulp), which ties to 1.
  const rational trap = rational(1) + pow2<rational>(-8) + pow2<rational>(-70);
  EXPECT_EQ(to_double_rne(trap), 1 + std::ldexp(1.0, -8));
  EXPECT_EQ(round_to(Format::bf16, to_double_rne(trap)), 1.0);
  EXPECT_EQ(round_to(Format::bf16, trap), rational(1) + pow2<rational>(-7));
  EXPECT_EQ(round_to(Format::bf16, rational(-trap)), -(rational(1) + pow2<rational>(-7)));
  const hp256 trap_hp = hp256(1) + ldexp(hp256(1), -8) + ldexp(hp256(1), -70);
  EXPECT_EQ(round_to(Format::bf16, trap_hp), hp256(1 + std::ldexp(1.0, -7)));
  // fp16 subnormal: 2^-25 + 2^-90 -> 2^-24, while the double 2^-25 ties to 0.
  const rational tiny = pow2<rational>(-25) + pow2<rational>(-90);
  EXPECT_EQ(round_to(Format::fp16, tiny), pow2<rational>(-24));
  EXPECT_EQ(round_to(Format::fp16, to_double_rne(tiny)), 0.0);
  // e5m2 overflow: 61440 - 2^-70 is below the threshold -> 57344; as a double it is
  // 61440, which ties to inf.
  const hp256 below_threshold = hp256(61440) - ldexp(hp256(1), -70);
  EXPECT_EQ(round_to(Format::fp8_e5m2, below_threshold), hp256(57344));
  EXPECT_EQ(round_to(Format::fp8_e5m2, to_double_rne(below_threshold)), INFINITY);
  // e4m3fn overflow: 464 + 2^-80 -> NaN, while the double 464 ties to 448.
  const hp256 above_tie = hp256(464) + ldexp(hp256(1), -80);
  using std::isnan;
  EXPECT_TRUE(isnan(round_to(Format::fp8_e4m3, above_tie)));
  EXPECT_EQ(round_to(Format::fp8_e4m3, to_double_rne(above_tie)), 448.0);
  EXPECT_THROW(round_to(Format::fp8_e4m3, rational(464) + pow2<rational>(-80)), InvalidArgument);
  // fp32: 1 + 2^-24 + 2^-60 -> 1 + 2^-23; the double is 1 + 2^-24, a tie to 1.
  const rational fp32_trap = rational(1) + pow2<rational>(-24) + pow2<rational>(-60);
  EXPECT_EQ(round_to(Format::fp32, fp32_trap), rational(1) + pow2<rational>(-23));
  EXPECT_EQ(round_to(Format::fp32, to_double_rne(fp32_trap)), 1.0);
}

// Every gap of the small formats again, now with values just off the midpoint by 2^-80 of
// the gap: not doubles (they would round to the midpoint itself), so a detour through
// double would tie where the exact value does not.
TEST(FloatFormatGeneric, NearMidpointsOfEveryGapInRationalAndHighPrecision) {
  for (const Spec& s : kSmallSpecs) {
    SCOPED_TRACE(format_info(s.format).name);
    for (std::uint64_t low = 0; low <= s.max_pattern(); ++low) {
      const double low_value = reference_value(s, low);
      const double high_value = low == s.max_pattern() ? virtual_value_above_max(s) : reference_value(s, low + 1);
      const std::uint64_t even = low % 2 == 0 ? low : low + 1;
      auto expected_value = [&](std::uint64_t p) {
        return p == s.max_pattern() + 1 ? std::optional<double>() : std::optional<double>(reference_value(s, p));
      };
      const rational mid = (rational(low_value) + rational(high_value)) / 2;
      const rational nudge = (rational(high_value) - rational(low_value)) * pow2<rational>(-80);
      const hp256 mid_hp = (hp256(low_value) + hp256(high_value)) / 2;
      const hp256 nudge_hp = ldexp(hp256(high_value) - hp256(low_value), -80);
      const struct {
        rational exact;
        hp256 wide;
        std::uint64_t pattern;
      } cases[] = {{mid, mid_hp, even}, {mid - nudge, mid_hp - nudge_hp, low}, {mid + nudge, mid_hp + nudge_hp, low + 1}};
      for (const auto& c : cases) {
        const std::optional<double> expected = expected_value(c.pattern);
        if (expected) {
          ASSERT_EQ(round_to(s.format, c.exact), rational(*expected)) << "low pattern " << low;
          ASSERT_EQ(to_double_rne(round_to(s.format, c.wide)), *expected) << "low pattern " << low;
        } else {
          ASSERT_THROW(round_to(s.format, c.exact), InvalidArgument) << "low pattern " << low;
          const double overflowed = to_double_rne(round_to(s.format, c.wide));
          ASSERT_TRUE(s.ieee ? overflowed == INFINITY : std::isnan(overflowed)) << "low pattern " << low;
        }
      }
    }
  }
}

TEST(FloatFormatGeneric, SpecialValuesInHighPrecision) {
  using std::isinf;
  using std::isnan;
  using std::signbit;
  EXPECT_TRUE(signbit(round_to(Format::bf16, hp256(-0.0))));
  EXPECT_TRUE(signbit(round_to(Format::fp16, hp256(-1e-30))));
  EXPECT_TRUE(isnan(round_to(Format::bf16, hp256(NAN))));
  EXPECT_TRUE(isnan(round_to(Format::fp8_e4m3, hp256(INFINITY))));
  EXPECT_TRUE(isinf(round_to(Format::fp8_e5m2, hp256(-INFINITY))));
  EXPECT_TRUE(std::isnan(to_double_rne(hp256(NAN))));
  EXPECT_EQ(to_double_rne(hp256(-INFINITY)), -INFINITY);
  // Far outside the double range (a 256-bit value has a wide exponent).
  EXPECT_EQ(to_double_rne(ldexp(hp256(1), 5000)), INFINITY);
  EXPECT_TRUE(std::signbit(to_double_rne(-ldexp(hp256(1), -5000))));
  EXPECT_EQ(to_double_rne(pow2<rational>(-5000)), 0.0);
  EXPECT_EQ(to_double_rne(pow2<rational>(5000)), INFINITY);
}

TEST(FloatFormatGeneric, ToDoubleRneOfRationals) {
  // IEEE division of exact operands is correctly rounded, so p/q in double is the
  // reference for small integers.
  EXPECT_EQ(to_double_rne(rational(1) / 3), 1.0 / 3.0);
  EXPECT_EQ(to_double_rne(rational(2) / 3), 2.0 / 3.0);
  EXPECT_EQ(to_double_rne(rational(-1) / 3), -1.0 / 3.0);
  EXPECT_EQ(to_double_rne(rational(1) / 10), 0.1);
  EXPECT_EQ(to_double_rne(rational(1) / 7), 1.0 / 7.0);
  EXPECT_EQ(to_double_rne(hp256(1) / 3), 1.0 / 3.0);
  // Long-division check of 1/3: the result is within half an ulp, exactly.
  const rational third = rational(1) / 3;
  const double d = to_double_rne(third);
  const rational error = abs_rational(rational(d) - third);
  EXPECT_LT(error, abs_rational(rational(std::nextafter(d, 1.0)) - third));
  EXPECT_LT(error, abs_rational(rational(std::nextafter(d, 0.0)) - third));
  // Double's own boundaries. 2^-1075 ties between 0 and 2^-1074 -> 0.
  EXPECT_EQ(to_double_rne(pow2<rational>(-1075)), 0.0);
  EXPECT_EQ(to_double_rne(pow2<rational>(-1075) * (1 + pow2<rational>(-100))), std::ldexp(1.0, -1074));
  EXPECT_EQ(to_double_rne(3 * pow2<rational>(-1076)), std::ldexp(1.0, -1074));  // 0.75 quantum
  // DBL_MAX + 2^970 ties to 2^1024 (DBL_MAX's mantissa is odd) -> inf.
  EXPECT_EQ(to_double_rne(rational(DBL_MAX) + pow2<rational>(970)), INFINITY);
  EXPECT_EQ(to_double_rne(rational(DBL_MAX) + pow2<rational>(970) - pow2<rational>(900)), DBL_MAX);
  EXPECT_EQ(to_double_rne(-pow2<rational>(1024)), -INFINITY);
}

RC_GTEST_PROP(FloatFormatProperty, ToDoubleRneMatchesIeeeDivision, ()) {
  const auto p = *rc::gen::arbitrary<std::int32_t>();
  const auto q = *rc::gen::suchThat(rc::gen::arbitrary<std::int32_t>(), [](std::int32_t v) { return v != 0; });
  const double expected = static_cast<double>(p) / static_cast<double>(q);
  RC_ASSERT(same_double(to_double_rne(rational(p) / q), expected == 0 ? 0.0 : expected));
  RC_ASSERT(to_double_rne(hp256(p) / q) == expected);
}

// Random magnitudes, either p/q * 2^k or a midpoint of two adjacent patterns nudged by
// +-2^-j of their gap (ties and near-ties, which p/q alone almost never hits).
rational random_magnitude(const Spec& s) {
  const int min_exponent = 1 - s.bias() - s.mantissa_bits;
  const int max_exponent = (1 << s.exponent_bits) - s.bias();
  if (*rc::gen::arbitrary<bool>()) {
    const auto p = *rc::gen::arbitrary<std::uint32_t>();
    const auto q = *rc::gen::inRange<std::uint32_t>(1, 0xFFFFFFFFu);
    const auto k = *rc::gen::inRange<int>(min_exponent - 34, max_exponent + 3);
    return rational(p) / q * pow2<rational>(k);
  }
  const auto low = *rc::gen::inRange<std::uint64_t>(0, s.max_pattern() + 1);
  const double low_value = reference_value(s, low);
  const double high_value = low == s.max_pattern() ? virtual_value_above_max(s) : reference_value(s, low + 1);
  const rational mid = (rational(low_value) + rational(high_value)) / 2;
  const auto j = *rc::gen::inRange<int>(1, 200);
  const auto direction = *rc::gen::element(-1, 0, 1);
  return mid + direction * (rational(high_value) - rational(low_value)) * pow2<rational>(-j);
}

void check_nearest_neighbour(const Spec& s) {
  const rational magnitude = random_magnitude(s);
  const bool negative = *rc::gen::arbitrary<bool>();
  const rational x = negative ? rational(-magnitude) : magnitude;
  const std::optional<std::uint64_t> expected = reference_round_magnitude(s, magnitude);
  if (!expected) {
    RC_ASSERT_THROWS_AS(round_to(s.format, x), InvalidArgument);
    return;
  }
  const rational rounded = round_to(s.format, x);
  const rational expected_value(reference_value(s, *expected));
  RC_ASSERT(rounded == (negative ? rational(-expected_value) : expected_value));
}

RC_GTEST_PROP(FloatFormatProperty, RationalRoundsToNearestBf16, ()) { check_nearest_neighbour(kBf16); }
RC_GTEST_PROP(FloatFormatProperty, RationalRoundsToNearestFp16, ()) { check_nearest_neighbour(kFp16); }
RC_GTEST_PROP(FloatFormatProperty, RationalRoundsToNearestE4m3, ()) { check_nearest_neighbour(kE4m3); }
RC_GTEST_PROP(FloatFormatProperty, RationalRoundsToNearestE5m2, ()) { check_nearest_neighbour(kE5m2); }

// a + b * 2^-k built exactly in both tiers (at most 53 + 40 + 150 < 256 significant bits):
// every format and to_double_rne agree between rational and high_precision<256>.
RC_GTEST_PROP(FloatFormatProperty, RationalAndHighPrecisionAgree, ()) {
  const int exponent = *rc::gen::inRange<int>(-160, 140);
  const double a = double_from_fields(*rc::gen::arbitrary<bool>(), 1023 + exponent, *rc::gen::arbitrary<std::uint64_t>());
  const double b = double_from_fields(*rc::gen::arbitrary<bool>(), 1023 + exponent + *rc::gen::inRange<int>(-40, 0),
                                      *rc::gen::arbitrary<std::uint64_t>());
  const int k = *rc::gen::inRange<int>(0, 150);
  const rational exact = rational(a) + rational(b) * pow2<rational>(-k);
  const hp256 wide = hp256(a) + ldexp(hp256(b), -k);
  RC_ASSERT(to_double_rne(exact) == to_double_rne(wide));
  for (const Format f : k3ref::num::all_formats) {
    const hp256 wide_rounded = round_to(f, wide);
    const double wide_double = to_double_rne(wide_rounded);
    if (std::isfinite(wide_double)) {
      RC_ASSERT(round_to(f, exact) == rational(wide_double));
    } else {
      RC_ASSERT_THROWS_AS(round_to(f, exact), InvalidArgument);
    }
  }
}

}  // namespace
