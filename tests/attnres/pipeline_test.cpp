// The pipeline-parallel communication simulator against the closed forms
// (proofs/attnres_pipeline.md) on the whole grid P <= 8, V <= 4, N_p <= 4.
#include "test_support.h"

#include "report/pipeline.h"
#include "k3ref/error.h"

namespace k3ref::attnres::pipeline {
namespace {

TEST(AttnResPipeline, SimulatorMatchesTheFormulasOnTheWholeGrid) {
  int configurations = 0;
  for (std::int64_t P = 1; P <= 8; ++P)
    for (std::int64_t V = 1; V <= 4; ++V)
      for (std::int64_t Np = 1; Np <= 4; ++Np)
        for (std::int64_t d : {1, 7}) {
          const Config c{P, V, Np, d};
          const Result naive = simulate(c, Policy::naive);
          const Result cached = simulate(c, Policy::cached_per_link);
          const Result aware = simulate(c, Policy::cached_receiver_aware);
          ASSERT_EQ(naive.elements_sent, naive_formula(c)) << "P=" << P << " V=" << V << " N_p=" << Np;
          ASSERT_EQ(cached.elements_sent, cached_formula(c)) << "P=" << P << " V=" << V << " N_p=" << Np;
          ASSERT_EQ(aware.elements_sent, receiver_aware_formula(c)) << "P=" << P << " V=" << V << " N_p=" << Np;
          // The formula's two terms, hop by hop: chunk c = vP + p receives p N_p blocks in the
          // first virtual stage and P N_p (per link) or (P - 1) N_p (receiver-aware) after it;
          // naively it receives everything before it, c N_p.
          const std::int64_t C = P * V;
          ASSERT_EQ(static_cast<std::int64_t>(naive.hops.size()), C - 1);
          for (std::int64_t i = 0; i < C - 1; ++i) {
            const std::int64_t chunk = i + 1, p = chunk % P;
            EXPECT_EQ(naive.hops[i].blocks, chunk * Np);
            EXPECT_EQ(cached.hops[i].blocks, (chunk < P ? p : P) * Np);
            EXPECT_EQ(aware.hops[i].blocks, (chunk < P ? p : P - 1) * Np);
            EXPECT_EQ(cached.hops[i].from_rank, (chunk - 1) % P);
            EXPECT_EQ(cached.hops[i].to_rank, p);
          }
          // Caching saves V-proportionally; every hop crosses devices once P >= 2.
          EXPECT_LE(aware.elements_sent, cached.elements_sent);
          EXPECT_LE(cached.elements_sent, naive.elements_sent + (P == 1 ? (V - 1) * Np * d : 0));
          EXPECT_EQ(cached.cross_device_elements, P == 1 ? 0 : cached.elements_sent);
          // With caching a rank ends up holding every block once: C N_p at most.
          EXPECT_LE(cached.peak_blocks_held, C * Np);
          ++configurations;
        }
  EXPECT_EQ(configurations, 8 * 4 * 4 * 2);
}

TEST(AttnResPipeline, PaperFormulaCountsTheReceiversOwnChunkOnEveryLaterHop) {
  // The per-link count exceeds the receiver-aware count by exactly (V - 1) P N_p d.
  for (std::int64_t P = 1; P <= 8; ++P)
    for (std::int64_t V = 1; V <= 4; ++V) {
      const Config c{P, V, 3, 5};
      EXPECT_EQ(cached_formula(c) - receiver_aware_formula(c), (V - 1) * P * 3 * 5);
    }
}

TEST(AttnResPipeline, ZeroBlocksPerChunkSendsNothing) {
  const Config c{4, 3, 0, 16};
  for (Policy policy : {Policy::naive, Policy::cached_per_link, Policy::cached_receiver_aware})
    EXPECT_EQ(simulate(c, policy).elements_sent, 0);
}

TEST(AttnResPipeline, RejectsBadConfigurations) {
  EXPECT_THROW(simulate(Config{0, 1, 1, 1}, Policy::naive), InvalidArgument);
  EXPECT_THROW(simulate(Config{1, 0, 1, 1}, Policy::naive), InvalidArgument);
  EXPECT_THROW(naive_formula(Config{1, 1, -1, 1}), InvalidArgument);
}

}  // namespace
}  // namespace k3ref::attnres::pipeline
