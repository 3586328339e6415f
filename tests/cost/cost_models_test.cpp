// Counting tests of the cost models (include/k3ref/cost/models.h, docs/cost-models.md): the
// references' own decode and FlashKDA chunk stages, run with the counting scalar, do the
// models' FLOPs plus the lower-order terms listed in docs/cost-models.md, exactly; the
// bytes the stages exchange, counted from the tensors they record, are the models'; the MoE
// ratio of a directly simulated uniform dispatch is the formula's, with == in rationals.
#include "test_support.h"

#include "k3ref/cost/counting.h"
#include "k3ref/cost/models.h"
#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/recurrent.h"

namespace k3ref::cost {
namespace {

using test::Q;

// One head of T tokens, decays given directly (GateForm::decay_factor: no exp), a state.
kda::Inputs<Counted> counted_inputs(std::int64_t T, std::int64_t D) {
  num::Random rng(test::test_seed(11));
  auto draw = [&](const Shape& shape, double lo, double hi) {
    return test::bf16_tensor(rng, shape, lo, hi).map<Counted>([](double x) { return Counted(x); });
  };
  kda::Inputs<Counted> in;
  in.q = draw({1, T, 1, D}, -1, 1);
  in.k = draw({1, T, 1, D}, -1, 1);
  in.v = draw({1, T, 1, D}, -1, 1);
  in.g = draw({1, T, 1, D}, 0.9, 1.0);
  in.beta = draw({1, T, 1}, 0, 1);
  in.initial_state = draw({1, 1, D, D}, -1, 1);
  return in;
}

kda::Options<Counted> counted_options() {
  kda::Options<Counted> opt;
  opt.gate = kda::GateForm::decay_factor;
  opt.scale = Counted(0.125);
  return opt;
}

TEST(CostDecode, TheRecurrenceDoesSevenDSquaredFlopsPerHeadAndToken) {
  for (std::int64_t D : {8, 16, 32, 64})
    for (std::int64_t T : {1, 3}) {
      const auto in = counted_inputs(T, D);
      const OpCounts c = count_ops([&] { kda::recurrent_forward(in, counted_options()); });
      // Model 7 D^2; the reference adds 3 D per token: v - S^T k, beta times it, the query scale.
      EXPECT_EQ(c.flops(), T * (7 * D * D + 3 * D)) << "D = " << D << ", T = " << T;
      EXPECT_EQ(Q(c.flops() - T * 3 * D), Q(T) * decode_per_head<Q>(D).flops);
      EXPECT_EQ(c.mul, T * (4 * D * D + 2 * D));  // decay, S^T k, k u^T, S^T q; beta and scale
      EXPECT_EQ(c.div + c.transcendental, 0);
    }
}

TEST(CostDecode, TheStateReadAndWrittenIsEightDSquaredBytes) {
  for (std::int64_t D : {16, 128}) {
    const auto in = counted_inputs(1, D);
    const auto out = kda::recurrent_forward(in, counted_options());
    // fp32 state read (the initial state) and written (the final state).
    const std::int64_t state_bytes = 4 * (in.initial_state->numel() + out.final_state->numel());
    EXPECT_EQ(Q(state_bytes), decode_per_head<Q>(D).bytes);
    // Beside the model: the token's bf16 q, k, v, g, beta read and o written, 10 D + 2 bytes.
    const std::int64_t token_bytes = 2 * (in.q.numel() + in.k.numel() + in.v.numel() + in.g.numel() + in.beta.numel() + out.o.numel());
    EXPECT_EQ(token_bytes, 10 * D + 2);
  }
}

// FLOPs of the FlashKDA form on `chunks` full chunks of C tokens, one head.
std::int64_t counted_chunk_flops(std::int64_t C, std::int64_t D, std::int64_t chunks) {
  const auto in = counted_inputs(chunks * C, D);
  kda::ChunkwiseOptions copt;
  copt.form = kda::ChunkForm::flashkda;
  copt.chunk_size = C;
  return count_ops([&] { kda::chunkwise_forward(in, counted_options(), copt); }).flops();
}

TEST(CostPrefill, TheFlashKdaChunkDoesTheModelsFlopsPlusLowerOrderTerms) {
  for (std::int64_t C : {8, 16, 32})
    for (std::int64_t D : {16, 32}) {
      const std::int64_t one = counted_chunk_flops(C, D, 1);
      EXPECT_EQ(counted_chunk_flops(C, D, 2), 2 * one) << "not linear in T at C = " << C << ", D = " << D;
      // Neumann doubling: m factors, m - 1 steps of two C x C products (4 C^3 each); the model's
      // 12 C^3 is m = 4, FlashKDA's C = 16.
      const std::int64_t m = kda::neumann_factor_count(C);
      const std::int64_t cubic = 4 * (m - 1) * C * C * C;
      // Lower order (docs/cost-models.md): the state's decay and the add of K_restore^T U
      // (2 D^2); per token and feature the decay prefix, q_decay and its scale, k_decay,
      // k_inv, k_restore, V - K_decay S, beta, the two partial outputs' sum ((10 C - 1) D);
      // I - L and the doubling steps' P + P L^(2^j) (m C^2); beta on the strict lower L (C (C - 1) / 2).
      const std::int64_t lower = 2 * D * D + (10 * C - 1) * D + m * C * C + C * (C - 1) / 2;
      const Work<Q> model = flashkda_chunk_per_head<Q>(C, D);
      EXPECT_EQ(Q(one - lower) - Q(cubic), model.flops - Q(12 * C * C * C)) << "C = " << C << ", D = " << D;
      if (C == 16) EXPECT_EQ(Q(one - lower), model.flops);
    }
}

TEST(CostPrefill, TheTensorsTheTwoKernelsExchangeAreTheModelsBytes) {
  const std::int64_t C = 16, D = 32, chunks = 3;
  kda::Inputs<double> in;
  num::Random rng(test::test_seed(12));
  in.q = test::bf16_tensor(rng, {1, chunks * C, 1, D}, -1, 1);
  in.k = test::bf16_tensor(rng, {1, chunks * C, 1, D}, -1, 1);
  in.v = test::bf16_tensor(rng, {1, chunks * C, 1, D}, -1, 1);
  in.g = test::bf16_tensor(rng, {1, chunks * C, 1, D}, -0.1, 0);
  in.beta = test::bf16_tensor(rng, {1, chunks * C, 1}, 0, 1);
  in.initial_state = test::bf16_tensor(rng, {1, 1, D, D}, -1, 1);
  kda::ChunkwiseOptions copt;
  copt.form = kda::ChunkForm::flashkda;
  copt.record_stages = true;
  const auto r = kda::chunkwise_forward(in, kda::Options<double>{}, copt);
  const auto& st = *r.stages;
  // Kernel 1 reads q, k, g and writes q_decay, k_decay, k_restore, INV, M_qk; kernel 2 reads
  // those five and v, writes o. 2 bytes an element; beta (C) is read by both.
  const std::int64_t token_tensors = in.q.numel() + in.k.numel() + in.g.numel() +
                                     2 * (st.q_decay.numel() + st.k_decay.numel() + st.k_restore.numel()) + in.v.numel() +
                                     r.out.o.numel();
  const std::int64_t chunk_matrices = 2 * (st.inv.numel() + st.m_qk.numel());
  const std::int64_t bytes = 2 * (token_tensors + chunk_matrices);
  EXPECT_EQ(Q(bytes), Q(chunks) * flashkda_chunk_per_head<Q>(C, D).bytes);
  EXPECT_EQ(2 * 2 * in.beta.numel(), chunks * 4 * C);  // beside the model: beta, 4 C per chunk
  // The state: read and written in fp32 by the kernel that carries it, 8 D^2.
  EXPECT_EQ(4 * (in.initial_state->numel() + r.out.final_state->numel()), 8 * D * D);
  const Work<Q> whole = flashkda_prefill_per_head<Q>(chunks * C, C, D, 1);
  EXPECT_EQ(whole.bytes, Q(bytes + 8 * D * D));
  // Linear in T: a partial last chunk is counted as a full one.
  EXPECT_EQ(flashkda_prefill_per_head<Q>(chunks * C - 5, C, D).flops, Q(chunks) * flashkda_chunk_per_head<Q>(C, D).flops);
}

RC_GTEST_PROP(CostMoe, AUniformDispatchSimulatedGivesTheFormulasRatio, ()) {
  const std::int64_t gpus = *rc::gen::inRange(1, 9);
  const std::int64_t experts = gpus * *rc::gen::inRange(1, 5);
  const std::int64_t k = *rc::gen::inRange<std::int64_t>(1, experts + 1);
  const std::int64_t repeats = *rc::gen::inRange(1, 3);
  std::vector<std::int64_t> source;
  const auto sel = uniform_selection(experts, gpus, k, repeats, source);
  const DispatchCounts c = moe_dispatch(sel, experts, gpus, source);
  const std::int64_t t = sel.dim(0);
  for (std::int64_t g = 0; g < gpus; ++g) {
    RC_ASSERT(Q(c.routes_in[g]) == Q(t * k) / Q(gpus));                              // t K / E
    RC_ASSERT(Q(c.remote_in[g]) == Q(t * k) / Q(gpus) * (Q(1) - Q(1) / Q(gpus)));  // a share 1 / E local
  }
  const Q P(2), F(989), m(*rc::gen::inRange(1, 4096)), B(48);
  RC_ASSERT(moe_comm_comp_ratio(c, P, F, m, B) == moe_comm_comp_ratio_uniform(P, F, m, B, Q(gpus)));
}

TEST(CostMoe, AMeasuredRoutingCountsEveryRouteOnce) {
  // Skewed on purpose: every token takes experts 0..k-1, all on GPU 0.
  const std::int64_t experts = 8, gpus = 4, k = 2, t = 16;
  Tensor<std::int32_t> sel({t, k});
  for (std::int64_t i = 0; i < t; ++i)
    for (std::int64_t r = 0; r < k; ++r) sel(i, r) = static_cast<std::int32_t>(r);
  const auto c = moe_dispatch(sel, experts, gpus, block_sources(t, gpus));
  EXPECT_EQ(c.routes_in, (std::vector<std::int64_t>{t * k, 0, 0, 0}));
  EXPECT_EQ(c.remote_in[0], t * k * 3 / 4);  // all but GPU 0's own tokens
  // Busiest GPU: 24 remote routes over 32 computed, against 3/4 of 8 over 8 uniformly.
  EXPECT_EQ(moe_comm_comp_ratio(c, Q(2), Q(6), Q(1), Q(2)), Q(24) / Q(32));
  EXPECT_EQ(moe_comm_comp_ratio_uniform(Q(2), Q(6), Q(1), Q(2), Q(gpus)), Q(3) / Q(4));
}

}  // namespace
}  // namespace k3ref::cost
