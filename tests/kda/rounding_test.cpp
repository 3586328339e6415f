// The rounding vocabulary of the chunk forms (kda/rounding.h): the fast double roundings
// equal the generic ones, tf32 rounds as declared, the site names round-trip, and a policy
// rounds only where its table says.
#include <gtest/gtest.h>

#include <cmath>

#include "k3ref/kda/rounding.h"
#include "k3ref/num/random.h"

namespace k3ref::kda::contract {
namespace {

TEST(KdaRounding, FastRoundingOfDoublesEqualsTheGenericRounding) {
  num::Random rng(17);
  for (num::Format f : {num::Format::fp32, num::Format::bf16, num::Format::fp16, num::Format::fp8_e4m3,
                        num::Format::fp8_e5m2})
    for (int i = 0; i < 20000; ++i) {
      // Magnitudes from deep subnormal to beyond every format's range, both signs, ties included.
      const double mant = static_cast<double>(rng.next_u64() >> (11 + rng.below(50)));
      const double x = std::ldexp(rng.below(2) ? mant : -mant, static_cast<int>(rng.between(-200, 160)) - 26);
      const double a = round_double(f, x), b = num::round_to(f, x);
      ASSERT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << num::format_info(f).name << " x=" << x;
    }
}

TEST(KdaRounding, Tf32RoundsToNearestEvenOrTowardZero) {
  EXPECT_EQ(round_tf32(1.0 + std::ldexp(1.0, -11)), 1.0);  // a tie: to even
  EXPECT_EQ(round_tf32(1.0 + 3 * std::ldexp(1.0, -11)), 1.0 + std::ldexp(1.0, -9));
  EXPECT_EQ(round_tf32(1.0 + 3 * std::ldexp(1.0, -11), true), 1.0 + std::ldexp(1.0, -10));
  EXPECT_EQ(round_tf32(-1.0 - 3 * std::ldexp(1.0, -11), true), -1.0 - std::ldexp(1.0, -10));
}

TEST(KdaRounding, SitesRoundTrip) {
  for (std::size_t s = 0; s < site_count; ++s)
    EXPECT_EQ(site_from_string(to_string(static_cast<Site>(s))), static_cast<Site>(s));
  EXPECT_FALSE(site_from_string("Input"));
}

// A policy rounds a site to its precision and nowhere else; the decays' flush applies to
// `decay` only.
TEST(KdaRounding, PolicyRoundsOnlyTheDeclaredSites) {
  RoundingPolicy pol;
  pol.set(Site::u, Precision::bf16).set(Site::decay, Precision::fp32);
  const double x = 1.0 + std::ldexp(1.0, -20), tiny = std::ldexp(1.0, -130);
  EXPECT_EQ(pol.round(Site::u, x), 1.0);
  EXPECT_EQ(pol.round(Site::k_decay, x), x);
  EXPECT_EQ(pol.round(Site::decay, tiny), static_cast<double>(static_cast<float>(tiny)));
  pol.flush_decay_subnormals = true;
  EXPECT_EQ(pol.round(Site::decay, tiny), 0.0);
  EXPECT_EQ(Exact{}.round(Site::u, x), x);
}

}  // namespace
}  // namespace k3ref::kda::contract
