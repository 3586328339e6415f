// The communication figures of the K3 report (section on KDA context parallelism).
#include "test_support.h"

#include <cmath>

#include "k3ref/error.h"
#include "report/comm.h"

namespace k3ref::kcp {
namespace {

constexpr std::int64_t MiB = 1 << 20;

// Per head M (128 x 128) and S~ (128 x 128) in bf16: 2 * 16384 * 2 = 65,536 B = 64 KiB;
// 96 heads: 6,291,456 B = 6 MiB, the report's "6 MB of fragments per layer".
TEST(KcpComm, FragmentsPerLayerAreSixMegabytes) {
  EXPECT_EQ(fragment_bytes_per_rank(KdaLayerSizes{1, 1, 128, 128, 4}, 2), 64 * 1024);
  EXPECT_EQ(fragment_bytes_per_rank(k3_kda_layer, 2), 6 * MiB);
  EXPECT_EQ(fragment_bytes_per_rank(k3_kda_layer, 4), 12 * MiB);  // FLA exchanges them in fp32
}

// After the all-gather each rank holds the other P - 1 ranks' fragments: at P = 8,
// 7 * 6 MiB = 42 MiB per layer, whatever the sequence length. FLA's total P H dk (dk + dv).
TEST(KcpComm, EachRankReceivesFortyTwoMegabytesAtEightRanks) {
  EXPECT_EQ(cp_bytes_received_per_rank(k3_kda_layer, 8, 2), 42 * MiB);
  EXPECT_EQ(cp_all_gather_bytes(k3_kda_layer, 8, 2), 8LL * 96 * 128 * (128 + 128) * 2);
  EXPECT_EQ(cp_bytes_received_per_rank(k3_kda_layer, 1, 2), 0);
}

// Ring attention, 4 b S d bytes per layer and rank: b = 1, S = 10^6, d = 7168 gives
// 2.8672e10 B, "about 30 GB" (to one significant figure), some 650 times the 42 MiB.
TEST(KcpComm, RingAttentionIsAboutThirtyGigabytesPerLayer) {
  const double ring = ring_attention_bytes_per_layer(1, 1000000, 7168);
  EXPECT_EQ(ring, 28672000000.0);
  EXPECT_EQ(std::round(ring / 1e10) * 1e10, 30e9);
  EXPECT_GT(ring / static_cast<double>(cp_bytes_received_per_rank(k3_kda_layer, 8, 2)), 600);
}

TEST(KcpComm, RejectsNonsense) {
  EXPECT_THROW(fragment_bytes_per_rank(KdaLayerSizes{0, 1, 1, 1, 4}, 2), InvalidArgument);
  EXPECT_THROW(fragment_bytes_per_rank(KdaLayerSizes{2, 3, 1, 1, 4}, 2), InvalidArgument);
  EXPECT_THROW(cp_bytes_received_per_rank(k3_kda_layer, 0, 2), InvalidArgument);
  EXPECT_THROW(rollback_bytes(k3_kda_layer, 2, 3), InvalidArgument);
}

}  // namespace
}  // namespace k3ref::kcp
