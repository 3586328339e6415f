// The rounding functions of the chunk forms' precision policies (kda/rounding.h).
#include "k3ref/kda/rounding.h"

namespace k3ref::kda::contract {

double round_double(num::Format format, double x) {
  switch (format) {
    case num::Format::fp64: return x;
    case num::Format::fp32: return static_cast<double>(static_cast<float>(x));  // IEEE conversion is RNE
    default: break;
  }
  const num::FormatInfo info = num::format_info(format);
  if (x == 0 || !std::isfinite(x)) return num::round_to(format, x);
  int e = 0;
  (void)std::frexp(x, &e);                        // |x| in [2^(e-1), 2^e)
  const int min_normal_exponent = 1 - info.bias;  // exponent of the smallest normal binade
  if (e - 1 < min_normal_exponent) return num::round_to(format, x);
  const int drop = 52 - info.mantissa_bits;
  std::uint64_t bits = std::bit_cast<std::uint64_t>(x);
  const std::uint64_t half_minus_one = (std::uint64_t{1} << (drop - 1)) - 1;
  bits += half_minus_one + ((bits >> drop) & 1);  // ties to even; a carry moves into the exponent
  bits &= ~((std::uint64_t{1} << drop) - 1);
  const double r = std::bit_cast<double>(bits);
  if (std::fabs(r) > info.max_finite) return num::round_to(format, x);  // overflow rule of the format
  return r;
}

double round_tf32(double x, bool toward_zero) {
  const float f = static_cast<float>(x);
  if (!std::isfinite(f)) return f;
  std::uint32_t b = std::bit_cast<std::uint32_t>(f);
  if (!toward_zero) b += 0xFFFu + ((b >> 13) & 1u);  // ties to even on the 13 dropped bits
  b &= ~0x1FFFu;
  return std::bit_cast<float>(b);
}

}  // namespace k3ref::kda::contract
