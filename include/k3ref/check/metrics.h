// Error metrics of a candidate tensor against a reference. The tolerance policies that turn
// them into a verdict are the policy table's (policy_table.h, judgement.h): a verdict always
// says why: the measured figure, the bound, and where the bound came from.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "k3ref/num/float_format.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::check {

struct Metrics {
  std::int64_t count = 0;
  double rel_rms = 0;          // ||x - ref|| / ||ref|| over finite pairs (0 when both are zero)
  double max_abs = 0;          // max |x - ref|
  std::int64_t max_abs_index = -1;
  double max_ulp = 0;          // max distance in units of the output format's ulp at the reference
  std::int64_t max_ulp_index = -1;
  std::int64_t candidate_nan = 0, candidate_inf = 0;
  std::int64_t reference_nan = 0, reference_inf = 0;
  std::int64_t first_nonfinite_mismatch = -1;  // first index where finiteness differs
  std::int64_t first_zero_sign_mismatch = -1;  // first index where one is +0.0 and the other -0.0
  std::int64_t finite_pairs = 0;               // pairs where both are finite: what the figures cover
  double floor_rel_rms = 0;    // rel RMS of rounding the reference to the output format
};

// Multiplication by 2^-e, e the exponent of `largest` (so every value up to it lands in
// [0, 1)), as two exact power-of-two factors applied in turn; the identity for 0 or a
// non-finite `largest`. 
struct PowerOfTwoScale {
  double first = 1, second = 1;
  static PowerOfTwoScale of(double largest);
  double operator()(double x) const { return x * first * second; }
};

// Distance |x - ref| in ulps of `format` at ref: the spacing of the format around |ref|
// (subnormal spacing below the normal range).
double ulp_distance(num::Format format, double x, double ref);

// Expected rel RMS of rounding values of these magnitudes to `format`:
// sqrt(mean(ulp^2 / 12)) / rms over the finite values (a rounding error uniform over one ulp
// has variance ulp^2 / 12). The floor for two runs of a kernel compared with each other
// (the metamorphic checks), where no exact value exists; 0 when there is no finite value.
double nominal_floor(const std::vector<double>& values, num::Format format);

// The relative RMS error of accumulated sums of squares: sqrt(err_sq / ref_sq); infinite
// when only the error is non-zero, 0 when both are. The one rule that makes a comparator's
// sums a figure: compare's, rel_rms_by_window's, and libk3gc's (summed on the device).
double rel_rms_of_sums(double err_sq, double ref_sq);

// Compares elementwise; `format` is the format whose rounding of the reference is the floor
// (and whose ulps max_ulp counts): the contract dtype the policy table gives, not the storage dtype.
Metrics compare(const std::vector<double>& candidate, const std::vector<double>& reference, num::Format format);

// Relative RMS error per window of `window` consecutive positions along axis `axis` of
// `shape` (e.g. error by token position, axis 1 of [B, T, HV, V]).
std::vector<double> rel_rms_by_window(const std::vector<double>& candidate, const std::vector<double>& reference,
                                      const Shape& shape, std::size_t axis, std::int64_t window);

// Tolerance policies and verdicts: policy_table.h (the rules, from policy/policies.json)
// and judgement.h (the verdict on a golden case).

}  // namespace k3ref::check
