// Tests of speculative-decoding rollback: replaying the cached projected inputs of the
// accepted draft tokens from the pre-draft state rebuilds the KDA state and the short-conv
// state exactly (== in rationals; bitwise with SiLU and real gates at 256 bits), as does the
// snapshot baseline; keeping the verification pass's state would be wrong.
#include "test_support.h"

#include "report/comm.h"
#include "k3ref/kcp/replay.h"

namespace k3ref::kcp {
namespace {

using namespace test;

template <class S>
ProjectedTokens<S> random_tokens(const DecodeLayer<S>& layer, std::int64_t L, bool raw_gate) {
  ProjectedTokens<S> t;
  t.q = lift<S>(random_tensor({L, layer.H * layer.K}, -4, 4));
  t.k = lift<S>(random_tensor({L, layer.H * layer.K}, -2, 2));
  t.v = lift<S>(random_tensor({L, layer.HV * layer.V}, -4, 4));
  t.g = raw_gate ? lift<S>(random_tensor({L, layer.HV, layer.K}, -4, 4)) : lift<S>(random_decays({L, layer.HV, layer.K}));
  t.beta = raw_gate ? lift<S>(random_tensor({L, layer.HV}, -4, 4)) : lift<S>(random_tensor({L, layer.HV}, 0, 2));
  return t;
}

template <class S>
DecodeLayer<S> random_layer(bool real) {
  DecodeLayer<S> layer;
  const Sizes s = random_sizes();
  layer.H = s.H;
  layer.HV = s.HV;
  layer.K = s.K;
  layer.V = s.V;
  const std::int64_t W = *rc::gen::element(2, 4);
  layer.conv_q = lift<S>(random_tensor({s.H * s.K, W}, -2, 2));
  layer.conv_k = lift<S>(random_tensor({s.H * s.K, W}, -2, 2));
  layer.conv_v = lift<S>(random_tensor({s.HV * s.V, W}, -2, 2));
  if (!real) {
    layer.activation = ConvActivation::none;
    layer.options.gate = kda::GateForm::decay_factor;
    layer.options.scale = S(1) / S(2);
  } else {
    layer.activation = ConvActivation::silu;
    layer.options.qk_l2norm = true;
    layer.options.gate = kda::GateForm::lower_bound;
    layer.options.lower_bound = S(-5);
    layer.options.gate_base = *rc::gen::element(kda::GateBase::e, kda::GateBase::two);
    layer.options.beta = kda::BetaForm::sigmoid;
    layer.A_log = lift<S>(random_tensor({s.HV}, -2, 2));
    layer.dt_bias = lift<S>(random_tensor({s.HV, s.K}, -2, 2));
  }
  return layer;
}

template <class S>
void check_replay(bool real) {
  const auto layer = random_layer<S>(real);
  const std::int64_t history = *rc::gen::inRange(0, 6), L = *rc::gen::inRange(0, 7);
  const std::int64_t accepted = *rc::gen::inRange<std::int64_t>(0, L + 1);
  const auto past = random_tokens(layer, history, real);
  const auto draft = random_tokens(layer, L, real);
  const auto bonus = random_tokens(layer, 1, real);
  const auto pre = decode_run(layer, zero_decode_state(layer), past).state;

  // The verification pass: all L drafts from the pre-draft state, outputs for the verifier.
  const auto verify = decode_run(layer, pre, draft);
  // Reference: the recurrence over the whole sequence so far, from the start.
  const auto reference = decode_run(layer, zero_decode_state(layer), past.append(draft.slice(0, accepted)));
  const auto reference_bonus = decode_run(layer, zero_decode_state(layer), past.append(draft.slice(0, accepted)).append(bonus));

  const auto replayed = replay_accepted(layer, pre, draft, accepted);
  RC_ASSERT(replayed.state == reference.state);  // KDA state and all three conv states
  const auto snaps = snapshot_states(layer, pre, draft);
  RC_ASSERT(snaps[static_cast<std::size_t>(accepted)] == reference.state);
  // Replay then bonus token in one run; outputs of the accepted tokens are the verifier's.
  const auto with_bonus = replay_accepted(layer, pre, draft, accepted, std::optional<ProjectedTokens<S>>(bonus));
  RC_ASSERT(with_bonus.state == reference_bonus.state);
  for (std::int64_t i = 0; i < accepted * layer.HV * layer.V; ++i) RC_ASSERT(with_bonus.o.data()[i] == verify.o.data()[i]);
  for (std::int64_t i = 0; i < layer.HV * layer.V; ++i)
    RC_ASSERT(with_bonus.o.data()[accepted * layer.HV * layer.V + i] ==
              reference_bonus.o.data()[(history + accepted) * layer.HV * layer.V + i]);
  if (accepted == L) RC_ASSERT(verify.state == reference.state);
}

RC_GTEST_PROP(KcpReplay, ReplayAndSnapshotEqualTheRecurrenceExactly, ()) { check_replay<Q>(false); }
RC_GTEST_PROP(KcpReplay, ReplayAndSnapshotEqualTheRecurrenceBitwiseWithSiluAndRealGates, ()) { check_replay<HP>(true); }

// Without the rollback the state is wrong: after a rejection the verification pass's
// state differs from the accepted prefix's (in KDA state or conv state).
TEST(KcpReplay, KeepingTheVerificationStateIsWrongAfterARejection) {
  int wrong = 0, rejected = 0;
  rc::check("collect", [&] {
    const auto layer = random_layer<Q>(false);
    const std::int64_t L = *rc::gen::inRange(1, 6), accepted = *rc::gen::inRange<std::int64_t>(0, L);
    auto draft = random_tokens(layer, L, false);
    const auto pre = decode_run(layer, zero_decode_state(layer), random_tokens(layer, 3, false)).state;
    ++rejected;
    wrong += decode_run(layer, pre, draft).state != replay_accepted(layer, pre, draft, accepted).state;
  });
  std::printf("verification state wrong after %d of %d rejections\n", wrong, rejected);
  EXPECT_GE(rejected, 100);
  EXPECT_GT(wrong, rejected * 9 / 10);
}

// Bytes per draft window at K3's sizes (96 heads, 128 x 128, conv width 4; fp32 state,
// bf16 inputs and conv state). State: 96 * 128 * 128 * 4 = 6,291,456 B. Conv state:
// (2 * 96 * 128 + 96 * 128) * 3 * 2 = 221,184 B. One token's projected inputs: q, k, v, g
// (4 * 96 * 128 = 49,152 values) + beta (96) = 49,248 values * 2 = 98,496 B.
TEST(KcpReplay, BytesPerDraftWindowAtK3Sizes) {
  const auto b = rollback_bytes(k3_kda_layer, 4, 2);
  EXPECT_EQ(b.state_bytes, 6291456);
  EXPECT_EQ(b.conv_state_bytes, 221184);
  EXPECT_EQ(b.token_input_bytes, 98496);
  EXPECT_EQ(b.snapshot_window, 4 * (6291456 + 221184));  // 26,050,560 B
  EXPECT_EQ(b.replay_window, (4 + 2) * 98496);           // 590,976 B
  for (std::int64_t L = 1; L <= 8; ++L) {
    const auto worst = rollback_bytes(k3_kda_layer, L, L);
    std::printf("draft %lld: snapshot %lld B, replay <= %lld B per layer and sequence (%.0fx)\n",
                static_cast<long long>(L), static_cast<long long>(worst.snapshot_window),
                static_cast<long long>(worst.replay_window),
                static_cast<double>(worst.snapshot_window) / static_cast<double>(worst.replay_window));
    EXPECT_GT(worst.snapshot_window, 30 * worst.replay_window);  // 6,512,640 / (2 * 98,496) = 33.06
  }
}

}  // namespace
}  // namespace k3ref::kcp
