// Tests of the error metrics, on hand-derived inputs (the policies: policy_table_test.cpp).
#include "test_support.h"

#include <cmath>
#include <limits>

#include "k3ref/check/metrics.h"

namespace k3ref::check {
namespace {

using num::Format;

TEST(Metrics, HandDerivedFigures) {
  // ref = (3, 4): ||ref|| = 5. candidate = (3, 4.5): error (0, 0.5), rel RMS = 0.5 / 5 = 0.1.
  const Metrics m = compare({3, 4.5}, {3, 4}, Format::fp64);
  EXPECT_EQ(m.rel_rms, 0.1);
  EXPECT_EQ(m.max_abs, 0.5);
  EXPECT_EQ(m.max_abs_index, 1);
  // In fp64 the ulp at 4 is 2^-50, so 0.5 is 2^49 ulps.
  EXPECT_EQ(m.max_ulp, std::ldexp(1.0, 49));
  // 3 and 4 are exact in fp64: the floor is zero.
  EXPECT_EQ(m.floor_rel_rms, 0);
}

TEST(Metrics, RelRmsOfSumsIsTheOneRuleFromSumsToAFigure) {
  // err_sq 0.25, ref_sq 25 (the sums of HandDerivedFigures): sqrt(0.25 / 25) = 0.1, compare's figure.
  EXPECT_EQ(rel_rms_of_sums(0.25, 25), 0.1);
  EXPECT_EQ(rel_rms_of_sums(0.25, 25), compare({3, 4.5}, {3, 4}, Format::fp64).rel_rms);
  EXPECT_EQ(rel_rms_of_sums(0, 0), 0);  // nothing to compare, no error
  EXPECT_EQ(rel_rms_of_sums(1, 0), std::numeric_limits<double>::infinity());  // an error against zeros
  EXPECT_EQ(rel_rms_of_sums(0, 4), 0);
}

TEST(Metrics, UlpsInBf16) {
  // bf16 has 7 stored mantissa bits: the ulp at 1 is 2^-7, at 0.75 (in [0.5, 1)) 2^-8.
  EXPECT_EQ(ulp_distance(Format::bf16, 1 + 0x1p-7, 1), 1);
  EXPECT_EQ(ulp_distance(Format::bf16, 0.75 + 0x1p-8, 0.75), 1);
  // Below the normal range the spacing is the subnormal one, 2^-133.
  EXPECT_EQ(ulp_distance(Format::bf16, 0x1p-133, 0), 1);
}

TEST(Metrics, FloorIsTheErrorOfRoundingTheReferenceToTheOutputFormat) {
  // 1 + 2^-9 rounds to 1 in bf16 (below half an ulp of 2^-7): error 2^-9 on a norm of ~1.
  const std::vector<double> ref = {1 + 0x1p-9};
  const Metrics m = compare(ref, ref, Format::bf16);
  EXPECT_DOUBLE_EQ(m.floor_rel_rms, 0x1p-9 / (1 + 0x1p-9));
}

TEST(Metrics, NonFiniteValuesAreCountedAndTheFirstMismatchFound) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Metrics m = compare({1, nan, 2}, {1, 1, 2}, Format::bf16);
  EXPECT_EQ(m.candidate_nan, 1);
  EXPECT_EQ(m.first_nonfinite_mismatch, 1);
  // NaN where the reference has NaN is agreement (every policy fails a mismatch: judgement.h).
  const Metrics same = compare({nan, 1}, {nan, 1}, Format::fp32);
  EXPECT_EQ(same.first_nonfinite_mismatch, -1);
  EXPECT_EQ(same.max_abs, 0);
}

// Magnitudes whose plain squares overflow or vanish: a negated or doubled candidate must still
// be off by 200 % or 100 %, a wrong candidate against zeros infinitely so.
TEST(Metrics, FiguresNeitherOverflowNorUnderflow) {
  for (double magnitude : {1e-170, 1e-300, 4e-320, 1e160, 1e300}) {
    const std::vector<double> ref = {magnitude, -magnitude / 2, magnitude / 4};
    std::vector<double> negated, doubled;
    for (double r : ref) {
      negated.push_back(-r);
      doubled.push_back(2 * r);
    }
    EXPECT_DOUBLE_EQ(compare(negated, ref, Format::bf16).rel_rms, 2.0) << magnitude;
    EXPECT_DOUBLE_EQ(compare(doubled, ref, Format::bf16).rel_rms, 1.0) << magnitude;
    EXPECT_EQ(compare(ref, ref, Format::bf16).rel_rms, 0.0) << magnitude;
  }
  const std::vector<double> zeros = {0, 0, 0};
  EXPECT_EQ(compare({1e-300, 0, 0}, zeros, Format::bf16).rel_rms, std::numeric_limits<double>::infinity());
  EXPECT_EQ(compare(zeros, zeros, Format::bf16).rel_rms, 0.0);
  // The bf16 floor of a tiny golden: its rounding, not zero (bf16 has fp32's exponent range,
  // so 1e-30 is normal there; 1e-170 rounds to 0 in bf16 and its floor is 100 %).
  EXPECT_GT(compare({1e-30, 3e-30}, {1e-30, 3e-30}, Format::bf16).floor_rel_rms, 1e-4);
  EXPECT_DOUBLE_EQ(compare({1e-170}, {1e-170}, Format::bf16).floor_rel_rms, 1.0);
}

TEST(Metrics, SignedZerosAndFinitePairsAreReported) {
  const Metrics m = compare({0.0, -0.0, 1.0}, {0.0, 0.0, 1.0}, Format::fp32);
  EXPECT_EQ(m.first_zero_sign_mismatch, 1);
  EXPECT_EQ(m.max_abs, 0);
  EXPECT_EQ(m.finite_pairs, 3);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(compare({nan, nan}, {nan, nan}, Format::fp32).finite_pairs, 0);
}

TEST(Metrics, ErrorByWindowLocalisesTheBadTokens) {
  // Shape [1, 4, 2]: tokens 0..3, window 2. Only token 3 is wrong.
  const std::vector<double> ref = {1, 1, 1, 1, 1, 1, 1, 1};
  const std::vector<double> cand = {1, 1, 1, 1, 1, 1, 1, 2};
  const auto w = rel_rms_by_window(cand, ref, {1, 4, 2}, 1, 2);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0], 0);
  EXPECT_EQ(w[1], 0.5);  // sqrt(1 / 4)
}

RC_GTEST_PROP(Metrics, ScalingBothByAPowerOfTwoKeepsRelativeRms, (std::vector<int> a, int shift_raw)) {
  RC_PRE(!a.empty());
  const int shift = shift_raw % 20;
  std::vector<double> ref, cand, ref2, cand2;
  for (int x : a) {
    ref.push_back(x % 1000);
    cand.push_back(x % 1000 + (x % 7) * 0.25);
    ref2.push_back(std::ldexp(ref.back(), shift));
    cand2.push_back(std::ldexp(cand.back(), shift));
  }
  RC_ASSERT(compare(cand, ref, Format::fp64).rel_rms == compare(cand2, ref2, Format::fp64).rel_rms);
}

}  // namespace
}  // namespace k3ref::check
