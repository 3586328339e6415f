// Tests of the chunkwise (UT transform) backward (kda/chunkwise_backward.h): in exact
// rationals every gradient equals the adjoint recurrence's (kda/backward.h, itself checked
// against dual numbers in backward_test.cpp) with ==, for chunk sizes that do and do not
// divide T, varlen with empty sequences, grouped heads and both state layouts; and each
// stage tensor equals what the recurrence says it is.
#include "k3ref/kda/chunkwise_backward.h"
#include "test_support.h"

namespace k3ref::kda {
namespace {

using namespace test;

using Q = num::rational;

struct Case {
  Inputs<Q> in;
  Options<Q> opt;
  Cotangents<Q> cot;
  std::int64_t chunk_size;
};

Case random_case() {
  const std::int64_t H = *rc::gen::inRange(1, 3), HV = H * *rc::gen::inRange(1, 3);
  const std::int64_t K = *rc::gen::inRange(1, 4), V = *rc::gen::inRange(1, 4);
  std::int64_t B = 1, T = 0;
  std::optional<std::vector<std::int64_t>> cu;
  if (*rc::gen::arbitrary<bool>()) {
    cu = std::vector<std::int64_t>{0};
    const int n = *rc::gen::inRange(1, 4);
    for (int i = 0; i < n; ++i) cu->push_back(cu->back() + *rc::gen::inRange<std::int64_t>(0, 8));
    T = cu->back();
  } else {
    B = *rc::gen::inRange<std::int64_t>(1, 3);
    T = *rc::gen::inRange<std::int64_t>(0, 12);
  }
  const std::int64_t N = cu ? static_cast<std::int64_t>(cu->size()) - 1 : B;
  Case c;
  c.opt = exact_options(*rc::gen::element(StateLayout::k_first, StateLayout::v_first));
  const bool v_first = c.opt.state_layout == StateLayout::v_first;
  const Shape state{N, HV, v_first ? V : K, v_first ? K : V};
  c.in = random_exact_tokens(B, T, Sizes{H, HV, K, V});
  if (*rc::gen::arbitrary<bool>()) c.in.initial_state = random_tensor(state, -4, 4);
  c.in.cu_seqlens = cu;
  c.cot.d_o = random_tensor({B, T, HV, V}, -3, 3);
  if (*rc::gen::arbitrary<bool>()) c.cot.d_final_state = random_tensor(state, -3, 3);
  c.chunk_size = *rc::gen::inRange<std::int64_t>(1, 6);
  return c;
}

RC_GTEST_PROP(KdaChunkwiseBackwardExact, EveryGradientEqualsTheAdjointRecurrence, ()) {
  const Case c = random_case();
  const auto want = recurrent_backward(c.in, c.opt, c.cot);
  const auto got = chunkwise_backward(c.in, c.opt, c.cot, c.chunk_size).gradients;
  RC_ASSERT(first_differing_gradient(got, want) == std::string());
}

// Stage 1 and 2 tensors against the recurrence: h_c is the state after token t0 - 1 (or
// the initial state), and dh_c is what the adjoint recurrence carries back to it from the
// end of the sequence.
RC_GTEST_PROP(KdaChunkwiseBackwardExact, ChunkStatesAndStateGradientsAreTheRecurrences, ()) {
  Case c = random_case();
  c.opt.state_layout = StateLayout::k_first;
  const std::int64_t N = c.in.cu_seqlens ? static_cast<std::int64_t>(c.in.cu_seqlens->size()) - 1 : c.in.q.dim(0);
  const Shape state{N, c.in.v.dim(2), c.in.q.dim(3), c.in.v.dim(3)};
  if (c.in.initial_state) c.in.initial_state = random_tensor(state, -4, 4);
  if (c.cot.d_final_state) c.cot.d_final_state = random_tensor(state, -3, 3);
  const auto d = validate(shapes_of(c.in, c.opt));
  const auto bs = chunkwise_backward(c.in, c.opt, c.cot, c.chunk_size).stages;
  const auto p = prepare(c.in, c.opt, d);
  PreparedGradients<Q> scratch = zero_prepared_gradients<Q>(d);
  for (std::int64_t ci = 0; ci < bs.chunk_starts.dim(0); ++ci) {
    const std::int64_t b = bs.chunk_starts(ci, 0), t0 = bs.chunk_starts(ci, 1);
    std::int64_t n = 0;
    while (!(d.seq_batch[n] == b && d.seq_begin[n] <= t0 && t0 < d.seq_end[n])) ++n;
    for (std::int64_t hv = 0; hv < d.HV; ++hv) {
      // The state entering the chunk by the recurrence, token by token.
      std::vector<Q> state(static_cast<std::size_t>(d.K * d.V), Q(0));
      if (c.in.initial_state)
        for (std::int64_t i = 0; i < d.K * d.V; ++i) state[i] = c.in.initial_state->data()[c.in.initial_state->offset(n, hv, 0, 0) + i];
      const std::vector<Q> start = state;
      for (std::int64_t t = d.seq_begin[n]; t < t0; ++t)
        definition::update(state.data(), d.K, d.V, &p.decay(b, t, hv, 0), &p.k(b, t, hv / (d.HV / d.H), 0),
                           &p.v(b, t, hv, 0), p.beta(b, t, hv));
      std::vector<Q> G(static_cast<std::size_t>(d.K * d.V), Q(0));
      if (c.cot.d_final_state)
        for (std::int64_t i = 0; i < d.K * d.V; ++i) G[i] = c.cot.d_final_state->data()[c.cot.d_final_state->offset(n, hv, 0, 0) + i];
      adjoint_span(p, d, b, hv, t0, d.seq_end[n], state, c.cot.d_o, G, scratch);
      for (std::int64_t i = 0; i < d.K; ++i)
        for (std::int64_t j = 0; j < d.V; ++j) {
          RC_ASSERT(bs.chunk_states(ci, hv, i, j) == state[i * d.V + j]);
          RC_ASSERT(bs.chunk_state_gradients(ci, hv, i, j) == G[i * d.V + j]);
        }
    }
  }
}

TEST(KdaChunkwiseBackward, ZeroDecayIsRefusedWithTheArgumentNamed) {
  Inputs<double> in{Tensor<double>({1, 2, 1, 1}, 1.0), Tensor<double>({1, 2, 1, 1}, 1.0), Tensor<double>({1, 2, 1, 1}, 1.0),
                    Tensor<double>({1, 2, 1, 1}, 0.0), Tensor<double>({1, 2, 1}, 0.5), std::nullopt, std::nullopt,
                    std::nullopt, std::nullopt};
  Options<double> opt;
  opt.gate = GateForm::decay_factor;
  try {
    chunkwise_backward(in, opt, Cotangents<double>{Tensor<double>({1, 2, 1, 1}, 1.0), std::nullopt});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'g'"), std::string::npos) << e.what();
  }
}

// Gates steep enough that a cumulative decay over one chunk underflows double (e^-50 per
// token, 16 tokens: e^-800 < 2^-1074): the inverse-decay form cannot run, and says so
// instead of returning NaN gradients. One chunk of 8 tokens (e^-400, inverse finite) runs.
TEST(KdaChunkwiseBackward, InverseDecayOverflowInDoubleIsRefused) {
  const std::int64_t T = 16;
  Inputs<double> in{Tensor<double>({1, T, 1, 2}, 0.5), Tensor<double>({1, T, 1, 2}, 0.5), Tensor<double>({1, T, 1, 2}, 1.0),
                    Tensor<double>({1, T, 1, 2}, -50.0), Tensor<double>({1, T, 1}, 0.5), std::nullopt, std::nullopt,
                    std::nullopt, std::nullopt};
  const Cotangents<double> cot{Tensor<double>({1, T, 1, 2}, 1.0), std::nullopt};
  try {
    chunkwise_backward(in, Options<double>{}, cot, 16);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no finite inverse"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'g'"), std::string::npos) << e.what();
  }
  const auto g = chunkwise_backward(in, Options<double>{}, cot, 8).gradients;
  for (double x : g.dq.values()) EXPECT_TRUE(std::isfinite(x));
}

}  // namespace
}  // namespace k3ref::kda
