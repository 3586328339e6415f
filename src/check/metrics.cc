#include "k3ref/check/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "k3ref/error.h"

namespace k3ref::check {

namespace {

// Spacing of the format at |x|: 2^(exponent - mantissa_bits), clamped to the subnormal spacing.
double spacing_at(const num::FormatInfo& info, double x) {
  const double mag = std::fabs(x);
  if (mag < info.min_normal) return info.min_subnormal;
  int exponent = 0;
  std::frexp(mag, &exponent);  // mag = f * 2^exponent, f in [0.5, 1)
  return std::ldexp(1.0, exponent - 1 - info.mantissa_bits);
}

}  // namespace

double ulp_distance(num::Format format, double x, double ref) {
  return std::fabs(x - ref) / spacing_at(num::format_info(format), ref);
}

double nominal_floor(const std::vector<double>& values, num::Format format) {
  const auto info = num::format_info(format);
  double largest = 0;
  std::int64_t n = 0;
  for (double x : values)
    if (std::isfinite(x)) largest = std::max(largest, std::fabs(x)), ++n;
  if (n == 0) return 0;
  // Scaled sums (as in compare): squares of the values and of their spacings neither
  // overflow nor vanish; the ratio is unchanged by the common power of two.
  const PowerOfTwoScale scale = PowerOfTwoScale::of(largest);
  double sq = 0, spacing_sq = 0;
  for (double x : values) {
    if (!std::isfinite(x)) continue;
    const double v = scale(x), s = scale(spacing_at(info, x));
    sq += v * v;
    spacing_sq += s * s;
  }
  return sq > 0 ? std::sqrt(spacing_sq / 12.0 / sq) : 0;
}

PowerOfTwoScale PowerOfTwoScale::of(double largest) {
  PowerOfTwoScale p;
  if (!(largest > 0) || !std::isfinite(largest)) return p;
  int e = 0;
  (void)std::frexp(largest, &e);  // largest in [2^(e-1), 2^e)
  const int half = -e / 2;
  p.first = std::ldexp(1.0, half);
  p.second = std::ldexp(1.0, -e - half);
  return p;
}

Metrics compare(const std::vector<double>& candidate, const std::vector<double>& reference, num::Format format) {
  if (candidate.size() != reference.size())
    throw InvalidArgument("check::compare: candidate has " + std::to_string(candidate.size()) +
                          " elements, reference " + std::to_string(reference.size()));
  Metrics m;
  m.count = static_cast<std::int64_t>(candidate.size());
  double largest = 0;  // the largest finite magnitude compared, for the scale of the sums
  for (std::size_t i = 0; i < candidate.size(); ++i) {
    const double x = candidate[i], r = reference[i];
    m.candidate_nan += std::isnan(x);
    m.candidate_inf += std::isinf(x);
    m.reference_nan += std::isnan(r);
    m.reference_inf += std::isinf(r);
    const bool x_finite = std::isfinite(x), r_finite = std::isfinite(r);
    if (x_finite != r_finite || (!x_finite && !(std::isnan(x) && std::isnan(r)) && x != r)) {
      if (m.first_nonfinite_mismatch < 0) m.first_nonfinite_mismatch = static_cast<std::int64_t>(i);
      continue;
    }
    if (!x_finite) continue;
    ++m.finite_pairs;
    largest = std::max({largest, std::fabs(x), std::fabs(r)});
    if (x == 0 && r == 0 && std::signbit(x) != std::signbit(r) && m.first_zero_sign_mismatch < 0)
      m.first_zero_sign_mismatch = static_cast<std::int64_t>(i);
  }
  // Sums of squares of the values scaled by a power of two near the largest magnitude: squares
  // of plain doubles overflow past 1e154 and vanish below 1e-154 (a decayed state), which would
  // let any candidate pass. The scaling is exact wherever the plain sums were, so ordinary
  // figures are unchanged. Sums in long double would change with the platform; plain double in
  // a fixed order keeps the figures reproducible.
  const PowerOfTwoScale scale = PowerOfTwoScale::of(largest);
  double err_sq = 0, ref_sq = 0, floor_sq = 0;
  for (std::size_t i = 0; i < candidate.size(); ++i) {
    const double x = candidate[i], r = reference[i];
    if (!std::isfinite(x) || !std::isfinite(r)) continue;
    const double diff = std::fabs(x - r);
    const double scaled_diff = scale(x) - scale(r), scaled_ref = scale(r);
    err_sq += scaled_diff * scaled_diff;
    ref_sq += scaled_ref * scaled_ref;
    const double rounded = scale(num::round_to(format, r) - r);
    floor_sq += rounded * rounded;
    if (diff > m.max_abs || m.max_abs_index < 0) {
      m.max_abs = diff;
      m.max_abs_index = static_cast<std::int64_t>(i);
    }
    const double ulps = ulp_distance(format, x, r);
    if (ulps > m.max_ulp || m.max_ulp_index < 0) {
      m.max_ulp = ulps;
      m.max_ulp_index = static_cast<std::int64_t>(i);
    }
  }
  m.rel_rms = rel_rms_of_sums(err_sq, ref_sq);
  m.floor_rel_rms = rel_rms_of_sums(floor_sq, ref_sq);  // 0 with ref_sq: zeros round to zeros
  return m;
}

double rel_rms_of_sums(double err_sq, double ref_sq) {
  return ref_sq > 0 ? std::sqrt(err_sq / ref_sq) : (err_sq > 0 ? std::numeric_limits<double>::infinity() : 0);
}

std::vector<double> rel_rms_by_window(const std::vector<double>& candidate, const std::vector<double>& reference,
                                      const Shape& shape, std::size_t axis, std::int64_t window) {
  if (axis >= shape.size()) throw InvalidArgument("check::rel_rms_by_window: argument 'axis' out of range");
  if (window <= 0) throw InvalidArgument("check::rel_rms_by_window: argument 'window' must be positive");
  const std::int64_t n = checked_numel(shape, "check::rel_rms_by_window");
  if (static_cast<std::int64_t>(candidate.size()) != n || static_cast<std::int64_t>(reference.size()) != n)
    throw InvalidArgument("check::rel_rms_by_window: sizes do not match shape " + shape_to_string(shape));
  std::int64_t inner = 1;
  for (std::size_t d = axis + 1; d < shape.size(); ++d) inner *= shape[d];
  const std::int64_t extent = shape[axis];
  // No elements, no windows (a zero-element shape may still declare a huge extent); the
  // ceiling is formed without overflow for any window up to 2^63 - 1.
  const std::int64_t windows = n == 0 ? 0 : extent / window + (extent % window != 0);
  std::vector<double> err(windows, 0.0), ref(windows, 0.0), largest(windows, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t w = (i / inner) % extent / window;
    largest[w] = std::max({largest[w], std::fabs(candidate[i]), std::fabs(reference[i])});
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t w = (i / inner) % extent / window;
    const PowerOfTwoScale scale = PowerOfTwoScale::of(largest[w]);  // as in compare: no over- or underflow
    const double diff = scale(candidate[i]) - scale(reference[i]), r = scale(reference[i]);
    err[w] += diff * diff;
    ref[w] += r * r;
  }
  std::vector<double> out(windows);
  for (std::int64_t w = 0; w < windows; ++w) {
    out[w] = rel_rms_of_sums(err[w], ref[w]);
  }
  return out;
}

}  // namespace k3ref::check
