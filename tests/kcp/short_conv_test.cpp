// Tests of the short convolution and its halo exchange across ranks: the reference against
// its definition, streaming (decode) equals prefill, and any split of any document layout
// equals the unsplit convolution (== in rationals without the activation, bitwise in
// double with SiLU: each output sees the same four inputs in the same order).
#include "test_support.h"

#include <cmath>

#include "k3ref/kcp/fragment.h"
#include "k3ref/kcp/short_conv.h"
#include "k3ref/num/random.h"

namespace k3ref::kcp {
namespace {

using namespace test;

ShortConvInputs<Q> random_conv_inputs(const std::vector<std::int64_t>& cu, std::int64_t D, std::int64_t W,
                                      bool with_state, bool with_bias) {
  const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1;
  ShortConvInputs<Q> in;
  in.x = random_tensor({1, cu.back(), D}, -4, 4);
  in.weight = random_tensor({D, W}, -2, 2);
  if (with_bias) in.bias = random_tensor({D}, -2, 2);
  if (with_state) in.initial_state = random_tensor({N, D, W - 1}, -4, 4);
  in.cu_seqlens = cu;
  return in;
}

// Definition, per document on its own: prepend the state (or W - 1 zeros) to the
// document's inputs, then y_t = bias + sum_i w_i xpad_{t + i}: F.conv1d with padding W - 1.
RC_GTEST_PROP(KcpShortConv, ReferenceEqualsPaddedConvolutionPerDocument, ()) {
  const auto cu = random_documents(4, 7);
  const std::int64_t D = *rc::gen::inRange(1, 4), W = *rc::gen::inRange(1, 6);
  const auto in = random_conv_inputs(cu, D, W, *rc::gen::arbitrary<bool>(), *rc::gen::arbitrary<bool>());
  const auto out = short_conv_forward(in, ConvActivation::none);
  for (std::size_t n = 0; n + 1 < cu.size(); ++n)
    for (std::int64_t c = 0; c < D; ++c) {
      std::vector<Q> pad;
      for (std::int64_t m = 0; m < W - 1; ++m)
        pad.push_back(in.initial_state ? (*in.initial_state)(static_cast<std::int64_t>(n), c, m) : Q(0));
      for (std::int64_t t = cu[n]; t < cu[n + 1]; ++t) pad.push_back(in.x(0, t, c));
      for (std::int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        Q y = in.bias ? (*in.bias)(c) : Q(0);
        for (std::int64_t i = 0; i < W; ++i) y += in.weight(c, i) * pad[static_cast<std::size_t>(t - cu[n] + i)];
        RC_ASSERT(out.y(0, t, c) == y);
      }
      for (std::int64_t m = 0; m < W - 1; ++m)  // the state after: the last W - 1 padded inputs
        RC_ASSERT(out.final_state(static_cast<std::int64_t>(n), c, m) == pad[pad.size() - static_cast<std::size_t>(W - 1 - m)]);
    }
}

// Decoding one token at a time, carrying the state, equals one prefill over the tokens.
RC_GTEST_PROP(KcpShortConv, StreamingEqualsPrefill, ()) {
  const std::int64_t T = *rc::gen::inRange(0, 10), D = *rc::gen::inRange(1, 4), W = *rc::gen::inRange(1, 6);
  auto in = random_conv_inputs({0, T}, D, W, true, true);
  const auto whole = short_conv_forward(in, ConvActivation::none);
  Tensor<Q> state = *in.initial_state;
  for (std::int64_t t = 0; t < T; ++t) {
    ShortConvInputs<Q> one = in;
    one.x = detail::slice_tokens(in.x, t, t + 1);
    one.cu_seqlens = std::vector<std::int64_t>{0, 1};
    one.initial_state = state;
    const auto step = short_conv_forward(one, ConvActivation::none);
    for (std::int64_t c = 0; c < D; ++c) RC_ASSERT(step.y(0, 0, c) == whole.y(0, t, c));
    state = step.final_state;
  }
  RC_ASSERT(state == whole.final_state);
}

// Halo exchange: split equals unsplit for any split and document layout.
RC_GTEST_PROP(KcpShortConv, ChainedHaloSplitEqualsUnsplitExactly, ()) {
  const auto cu = random_documents(5, 8);
  const std::int64_t D = *rc::gen::inRange(1, 4), W = *rc::gen::element(1, 2, 4, 5);
  const auto in = random_conv_inputs(cu, D, W, *rc::gen::arbitrary<bool>(), *rc::gen::arbitrary<bool>());
  const auto splits = random_splits(cu.back(), 8);
  const auto whole = short_conv_forward(in, ConvActivation::none);
  const auto split = short_conv_context_parallel(in, ConvActivation::none, splits);
  RC_ASSERT(split.out.y == whole.y);
  RC_ASSERT(split.out.final_state == whole.final_state);
}

// With FLA's SiLU, in double: bitwise equal.
RC_GTEST_PROP(KcpShortConv, ChainedHaloSplitEqualsUnsplitBitwiseWithSiluInDouble, ()) {
  const auto cu = random_documents(5, 8);
  const std::int64_t D = *rc::gen::inRange(1, 4);
  const auto q = random_conv_inputs(cu, D, 4, *rc::gen::arbitrary<bool>(), *rc::gen::arbitrary<bool>());
  auto down = [](const Tensor<Q>& t) { return t.map<double>([](const Q& x) { return x.convert_to<double>(); }); };
  ShortConvInputs<double> in{down(q.x), down(q.weight), std::nullopt, std::nullopt, q.cu_seqlens};
  if (q.bias) in.bias = down(*q.bias);
  if (q.initial_state) in.initial_state = down(*q.initial_state);
  const auto splits = random_splits(cu.back(), 8);
  const auto whole = short_conv_forward(in, ConvActivation::silu);
  const auto split = short_conv_context_parallel(in, ConvActivation::silu, splits);
  RC_ASSERT(split.out.y == whole.y);
  RC_ASSERT(split.out.final_state == whole.final_state);
  for (double y : whole.y.values()) RC_ASSERT(std::isfinite(y));
}

// The "previous rank's last W - 1 tokens" exchange is right exactly when every continuing
// rank's halo lies within its previous rank (or before its document began); otherwise
// tokens are missing. The tests find such layouts and see the outputs differ.
TEST(KcpShortConv, PreviousRankOnlyHaloFailsWhenARankIsShorterThanTheHalo) {
  int needed_two_hops = 0, wrong_when_short = 0, checked = 0;
  num::Random rng(4);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<std::int64_t> cu{0};
    const int N = static_cast<int>(rng.between(1, 3));
    for (int n = 0; n < N; ++n) cu.push_back(cu.back() + rng.between(0, 10));
    const std::int64_t T = cu.back();
    std::vector<std::int64_t> splits{0};
    const int P = static_cast<int>(rng.between(1, 6));
    for (int r = 1; r < P; ++r) splits.push_back(rng.between(0, T));
    splits.push_back(T);
    std::sort(splits.begin(), splits.end());
    ShortConvInputs<Q> in;
    in.x = Tensor<Q>({1, T, 1});
    for (Q& x : in.x.values()) x = Q(rng.between(1, 9));  // nonzero: a missing token shows
    in.weight = Tensor<Q>({1, 4}, std::vector<Q>{Q(1), Q(2), Q(3), Q(5)});
    in.cu_seqlens = cu;
    const auto whole = short_conv_forward(in, ConvActivation::none);
    const auto chained = short_conv_context_parallel(in, ConvActivation::none, splits, HaloRule::chained);
    const auto naive = short_conv_context_parallel(in, ConvActivation::none, splits, HaloRule::previous_rank_only);
    ASSERT_EQ(chained.out.y, whole.y);
    bool multi_hop = false;
    for (std::int64_t h : chained.halo_hops) multi_hop = multi_hop || h > 1;
    // The naive halo is right iff no rank needs tokens from more than one earlier rank.
    EXPECT_EQ(naive.out.y == whole.y, !multi_hop) << "trial " << trial;
    needed_two_hops += multi_hop;
    wrong_when_short += multi_hop && naive.out.y != whole.y;
    ++checked;
  }
  std::printf("%d of %d layouts need a halo from more than one rank; the naive exchange is wrong on %d\n",
              needed_two_hops, checked, wrong_when_short);
  EXPECT_GT(needed_two_hops, 0);
  EXPECT_EQ(wrong_when_short, needed_two_hops);
}

TEST(KcpShortConv, RejectsBadShapesAndSiluInExactArithmetic) {
  ShortConvInputs<Q> in;
  in.x = Tensor<Q>({1, 3, 2});
  in.weight = Tensor<Q>({3, 4});
  EXPECT_THROW(short_conv_forward(in, ConvActivation::none), InvalidArgument);
  in.weight = Tensor<Q>({2, 4});
  EXPECT_THROW(short_conv_forward(in, ConvActivation::silu), InvalidArgument);
  EXPECT_NO_THROW(short_conv_forward(in, ConvActivation::none));
}

}  // namespace
}  // namespace k3ref::kcp
