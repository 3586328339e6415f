#include "k3ref/check/metrics.h"

#include <cmath>
#include <cstdio>
#include <limits>

#include "k3ref/error.h"

namespace k3ref::check {
namespace {

std::string format_double(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3e", x);
  return buf;
}

}  // namespace

double ulp_distance(num::Format format, double x, double ref) {
  const auto info = num::format_info(format);
  const double mag = std::fabs(ref);
  // Spacing of the format at |ref|: 2^(exponent - mantissa_bits), clamped to the subnormal spacing.
  double spacing = info.min_subnormal;
  if (mag >= info.min_normal) {
    int exponent = 0;
    std::frexp(mag, &exponent);  // mag = f * 2^exponent, f in [0.5, 1)
    spacing = std::ldexp(1.0, exponent - 1 - info.mantissa_bits);
  }
  return std::fabs(x - ref) / spacing;
}

Metrics compare(const std::vector<double>& candidate, const std::vector<double>& reference, num::Format format) {
  if (candidate.size() != reference.size())
    throw InvalidArgument("check::compare: candidate has " + std::to_string(candidate.size()) +
                          " elements, reference " + std::to_string(reference.size()));
  Metrics m;
  m.count = static_cast<std::int64_t>(candidate.size());
  // Sums in long double would change with the platform; plain double with a fixed order
  // keeps the figures reproducible.
  double err_sq = 0, ref_sq = 0, floor_sq = 0;
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
    const double diff = std::fabs(x - r);
    err_sq += diff * diff;
    ref_sq += r * r;
    const double rounded = num::round_to(format, r) - r;
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
  m.rel_rms = ref_sq > 0 ? std::sqrt(err_sq / ref_sq) : (err_sq > 0 ? std::numeric_limits<double>::infinity() : 0);
  m.floor_rel_rms = ref_sq > 0 ? std::sqrt(floor_sq / ref_sq) : 0;
  return m;
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
  const std::int64_t windows = (extent + window - 1) / window;
  std::vector<double> err(windows, 0.0), ref(windows, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t w = (i / inner) % extent / window;
    const double diff = candidate[i] - reference[i];
    err[w] += diff * diff;
    ref[w] += reference[i] * reference[i];
  }
  std::vector<double> out(windows);
  for (std::int64_t w = 0; w < windows; ++w) out[w] = ref[w] > 0 ? std::sqrt(err[w] / ref[w]) : std::sqrt(err[w]);
  return out;
}

std::string policy_help() {
  return "exact            bitwise equal values (NaN where the reference has NaN)\n"
         "floor:<m>        relative RMS error <= m x the floor, the error of rounding the exact\n"
         "                 reference to the candidate's dtype (e.g. floor:2)\n"
         "rel-rms:<r>      relative RMS error <= r (e.g. rel-rms:0.005, FLA's test ratio)\n"
         "recurrent        alias of floor:1.5  (FLA fused_recurrent_kda measures 1.0x on an H200)\n"
         "chunk            alias of floor:4    (FLA chunk_kda measures 2.0x-2.7x)\n"
         "flashkda         alias of floor:5    (FlashKDA measures 3.4x-3.5x)\n"
         "fla-test         alias of rel-rms:0.005\n";
}

Policy parse_policy(const std::string& name) {
  auto parse_number = [&](const std::string& text) {
    std::size_t used = 0;
    double value = 0;
    try {
      value = std::stod(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != text.size() || !(value > 0) || !std::isfinite(value))
      throw InvalidArgument("tolerance policy '" + name + "': '" + text + "' is not a positive number");
    return value;
  };
  if (name == "exact") return {Policy::Kind::exact, 0, name};
  if (name == "recurrent") return {Policy::Kind::floor_multiple, 1.5, name};
  if (name == "chunk") return {Policy::Kind::floor_multiple, 4, name};
  if (name == "flashkda") return {Policy::Kind::floor_multiple, 5, name};
  if (name == "fla-test") return {Policy::Kind::rel_rms, 0.005, name};
  if (name.rfind("floor:", 0) == 0) return {Policy::Kind::floor_multiple, parse_number(name.substr(6)), name};
  if (name.rfind("rel-rms:", 0) == 0) return {Policy::Kind::rel_rms, parse_number(name.substr(8)), name};
  throw InvalidArgument("unknown tolerance policy '" + name + "'; known policies:\n" + policy_help());
}

Verdict judge(const Metrics& m, const Policy& p) {
  if (m.first_nonfinite_mismatch >= 0)
    return {false, "NaN/Inf where the reference has none (or the reverse), first at flat index " +
                       std::to_string(m.first_nonfinite_mismatch)};
  switch (p.kind) {
    case Policy::Kind::exact:
      if (m.max_abs == 0) return {true, "bitwise equal"};
      return {false, "not equal: max abs error " + format_double(m.max_abs) + " at flat index " +
                         std::to_string(m.max_abs_index)};
    case Policy::Kind::floor_multiple: {
      const double bound = p.bound * m.floor_rel_rms;
      const std::string ratio = m.floor_rel_rms > 0 ? format_double(m.rel_rms / m.floor_rel_rms) + "x floor" : "n/a";
      if (m.rel_rms <= bound || m.max_abs == 0)
        return {true, "rel RMS " + format_double(m.rel_rms) + " <= " + format_double(bound) + " (" +
                          format_double(p.bound) + " x floor " + format_double(m.floor_rel_rms) + "; " + ratio + ")"};
      return {false, "rel RMS " + format_double(m.rel_rms) + " > " + format_double(bound) + " (" +
                         format_double(p.bound) + " x floor " + format_double(m.floor_rel_rms) + "; " + ratio + ")"};
    }
    case Policy::Kind::rel_rms:
      if (m.rel_rms <= p.bound)
        return {true, "rel RMS " + format_double(m.rel_rms) + " <= " + format_double(p.bound)};
      return {false, "rel RMS " + format_double(m.rel_rms) + " > " + format_double(p.bound)};
  }
  return {false, "unknown policy"};
}

}  // namespace k3ref::check
