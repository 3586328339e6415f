// Tests of the KDA layer reference (include/k3ref/layer/kda_layer.h): the layer equals the
// composition of the operator references (kcp::short_conv_forward per q, k and v,
// kda::recurrent_forward, the projections and the norm written out here), == in rationals
// and bitwise in double and at 256 bits with every piece on; decode after prefill, verify
// then rollback, and the tapes equal the single shot, == in rationals; padded lanes and
// slots not named are untouched; explicit cu_seqlens win over an all-ones mask, and a
// padding mask equals running each row's tokens alone. RapidCheck prints the seed that
// replays a failure (RC_PARAMS is set by meson).
#include "test_support.h"

#include <set>

#include "k3ref/layer/kda_layer.h"

namespace k3ref::layer {
namespace {

using test::HP;
using test::Q;
using test::random_tensor;

struct LayerSizes {
  std::int64_t D, H, HV, K, V, W;
};

LayerSizes random_layer_sizes() {
  const auto s = test::random_sizes();
  return LayerSizes{*rc::gen::inRange<std::int64_t>(1, 4), s.H, s.HV, s.K, s.V, *rc::gen::inRange<std::int64_t>(1, 4)};
}

// Exact weights: projections and conv weights in [-2, 2] (denominators 1, 2, 3, 4, 8); the
// low-rank factors present or not, conv biases present or not.
Weights<Q> random_exact_weights(const LayerSizes& s) {
  Weights<Q> w;
  w.q_proj = random_tensor({s.H * s.K, s.D}, -2, 2);
  w.k_proj = random_tensor({s.H * s.K, s.D}, -2, 2);
  w.v_proj = random_tensor({s.HV * s.V, s.D}, -2, 2);
  w.q_conv = random_tensor({s.H * s.K, s.W}, -2, 2);
  w.k_conv = random_tensor({s.H * s.K, s.W}, -2, 2);
  w.v_conv = random_tensor({s.HV * s.V, s.W}, -2, 2);
  if (*rc::gen::arbitrary<bool>()) {
    w.q_conv_bias = random_tensor({s.H * s.K}, -2, 2);
    w.v_conv_bias = random_tensor({s.HV * s.V}, -2, 2);
  }
  const std::int64_t R = *rc::gen::inRange<std::int64_t>(1, 3);
  const bool low_rank = *rc::gen::arbitrary<bool>();
  if (low_rank) w.f_a = random_tensor({R, s.D}, -2, 2);
  w.f_b = random_tensor({s.HV * s.K, low_rank ? R : s.D}, -2, 2);
  w.b_proj = random_tensor({s.HV, s.D}, -2, 2);
  w.o_proj = random_tensor({s.D, s.HV * s.V}, -2, 2);
  return w;
}

// The exact layer: every transcendental stage off (docs/kda-layer.md).
Options<Q> exact_layer_options(const LayerSizes& s) {
  Options<Q> o;
  o.H = s.H;
  o.HV = s.HV;
  o.gate = kda::GateForm::decay_factor;
  o.beta = kda::BetaForm::as_given;
  o.qk_l2norm = false;
  o.activation = ConvActivation::none;
  o.output_norm = false;
  o.scale = Q(1) / Q(2);
  return o;
}

struct ExactLayer {
  LayerSizes s;
  Weights<Q> w;
  Options<Q> opt;
};

ExactLayer random_exact_layer() {
  const LayerSizes s = random_layer_sizes();
  return ExactLayer{s, random_exact_weights(s), exact_layer_options(s)};
}

// x W^T (+ b), written here from nn.Linear's definition.
template <class S>
Tensor<S> matmul_t(const Tensor<S>& x, const Tensor<S>& w, const std::optional<Tensor<S>>& b = std::nullopt) {
  Tensor<S> y({x.dim(0), w.dim(0)});
  for (std::int64_t r = 0; r < x.dim(0); ++r)
    for (std::int64_t o = 0; o < w.dim(0); ++o) {
      S acc = b ? (*b)(o) : S(0);
      for (std::int64_t i = 0; i < x.dim(1); ++i) acc += x(r, i) * w(o, i);
      y(r, o) = acc;
    }
  return y;
}

template <class S>
Tensor<S> as_batch(const Tensor<S>& t) {
  Shape shape{1};
  shape.insert(shape.end(), t.shape().begin(), t.shape().end());
  return Tensor<S>(shape, t.values());
}

// Channels [from, from + width) of conv states [N, C, M].
template <class S>
Tensor<S> channel_slice(const Tensor<S>& states, std::int64_t from, std::int64_t width) {
  Tensor<S> out({states.dim(0), width, states.dim(2)});
  for (std::int64_t n = 0; n < states.dim(0); ++n)
    for (std::int64_t c = 0; c < width; ++c)
      for (std::int64_t m = 0; m < states.dim(2); ++m) out(n, c, m) = states(n, from + c, m);
  return out;
}

template <class S>
struct Composed {
  Tensor<S> y, recurrent, conv_q, conv_k, conv_v;
};

// The layer as the composition of the operator references on packed tokens x [T, D]: three
// separate short convolutions, the recurrence with the layer's options, the norm written out.
template <class S>
Composed<S> compose(const Tensor<S>& x, const Weights<S>& w, const Options<S>& opt, const std::vector<std::int64_t>& cu,
                    const std::optional<LayerState<S>>& initial) {
  const std::int64_t T = x.dim(0), HK = w.q_proj.dim(0), HVV = w.v_proj.dim(0);
  const std::int64_t K = HK / opt.H, V = HVV / opt.HV;
  Composed<S> c;
  auto conv = [&](const Tensor<S>& proj, const Tensor<S>& weight, const std::optional<Tensor<S>>& bias, std::int64_t from,
                  Tensor<S>& state_out) {
    kcp::ShortConvInputs<S> in;
    in.x = as_batch(proj);
    in.weight = weight;
    in.bias = bias;
    in.cu_seqlens = cu;
    if (initial) in.initial_state = channel_slice(initial->conv, from, proj.dim(1));
    auto out = kcp::short_conv_forward(in, opt.activation);
    state_out = out.final_state;
    return Tensor<S>({T, proj.dim(1)}, out.y.values());
  };
  const Tensor<S> q = conv(matmul_t(x, w.q_proj), *w.q_conv, w.q_conv_bias, 0, c.conv_q);
  std::optional<Tensor<S>> k_bias = w.k_conv_bias;
  const Tensor<S> k = conv(matmul_t(x, w.k_proj), *w.k_conv, k_bias, HK, c.conv_k);
  const Tensor<S> v = conv(matmul_t(x, w.v_proj), *w.v_conv, w.v_conv_bias, 2 * HK, c.conv_v);
  kda::Inputs<S> in;
  in.q = Tensor<S>({1, T, opt.H, K}, q.values());
  in.k = Tensor<S>({1, T, opt.H, K}, k.values());
  in.v = Tensor<S>({1, T, opt.HV, V}, v.values());
  in.g = Tensor<S>({1, T, opt.HV, K}, (w.f_a ? matmul_t(matmul_t(x, *w.f_a), w.f_b) : matmul_t(x, w.f_b)).values());
  in.beta = Tensor<S>({1, T, opt.HV}, matmul_t(x, w.b_proj).values());
  in.A_log = w.A_log;
  if (w.dt_bias) in.dt_bias = Tensor<S>({opt.HV, K}, w.dt_bias->values());
  in.cu_seqlens = cu;
  if (initial) in.initial_state = initial->recurrent;
  kda::Options<S> ko;
  ko.scale = opt.scale;
  ko.qk_l2norm = opt.qk_l2norm;
  ko.gate = opt.gate;
  ko.lower_bound = opt.lower_bound;
  ko.beta = opt.beta;
  const auto out = kda::recurrent_forward(in, ko);
  c.recurrent = *out.final_state;
  Tensor<S> o({T, HVV}, out.o.values());
  if (opt.output_norm) {
    if constexpr (num::scalar_traits<S>::has_transcendentals) {
      using std::sqrt;
      std::optional<Tensor<S>> gate;
      if (w.g_b) gate = w.g_a ? matmul_t(matmul_t(x, *w.g_a), *w.g_b, w.g_bias) : matmul_t(x, *w.g_b, w.g_bias);
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t hv = 0; hv < opt.HV; ++hv) {
          S ss(0);
          for (std::int64_t j = 0; j < V; ++j) ss += o(t, hv * V + j) * o(t, hv * V + j);
          const S inv = S(1) / sqrt(ss / S(V) + opt.norm_eps);
          for (std::int64_t j = 0; j < V; ++j) {
            S z = o(t, hv * V + j) * inv;
            if (w.norm_weight) z = z * (*w.norm_weight)(j);
            if (gate) z = z * (S(1) / (S(1) + exp(-(*gate)(t, hv * V + j))));
            o(t, hv * V + j) = z;
          }
        }
    }
  }
  c.y = matmul_t(o, w.o_proj);
  return c;
}

template <class S>
void expect_layer_is_composition(const ForwardOutputs<S>& got, const Composed<S>& want, std::int64_t HK) {
  RC_ASSERT(Tensor<S>({got.y.dim(1), got.y.dim(2)}, got.y.values()) == want.y);
  RC_ASSERT(got.final.recurrent == want.recurrent);
  RC_ASSERT(channel_slice(got.final.conv, 0, HK) == want.conv_q);
  RC_ASSERT(channel_slice(got.final.conv, HK, HK) == want.conv_k);
  RC_ASSERT(channel_slice(got.final.conv, 2 * HK, want.conv_v.dim(1)) == want.conv_v);
}

LayerState<Q> random_exact_layer_state(const LayerSizes& s, std::int64_t N) {
  return LayerState<Q>{random_tensor({N, s.HV, s.K, s.V}, -2, 2),
                       random_tensor({N, 2 * s.H * s.K + s.HV * s.V, s.W - 1}, -2, 2)};
}

TEST(KdaLayer, ExactLayerEqualsTheCompositionOfTheOperatorReferences) {
  test::check_property([] {
    const auto [s, w, opt] = random_exact_layer();
    const auto cu = test::random_documents(3, 4);
    const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1;
    const Tensor<Q> x = random_tensor({cu.back(), s.D}, -2, 2);
    std::optional<LayerState<Q>> initial;
    if (*rc::gen::arbitrary<bool>()) initial = random_exact_layer_state(s, N);
    const auto got = kda_layer_forward(as_batch(x), w, opt, initial, cu);
    expect_layer_is_composition(got, compose(x, w, opt, cu, initial), s.H * s.K);
  });
}

// Every piece on, in double and at 256 bits: the same operations in the same order as the
// composition, so the same bits.
template <class S>
void check_full_layer_is_composition(std::uint64_t seed, kda::GateForm gate) {
  num::Random rng(test::test_seed(seed));
  auto draw = [&](const Shape& shape, double lo, double hi) {
    return test::lift<S>(test::bf16_tensor(rng, shape, lo, hi, 20));
  };
  Weights<S> w;
  w.q_proj = draw({8, 12}, -0.5, 0.5);
  w.k_proj = draw({8, 12}, -0.5, 0.5);
  w.v_proj = draw({12, 12}, -0.5, 0.5);
  w.q_conv = draw({8, 4}, -1, 1);
  w.k_conv = draw({8, 4}, -1, 1);
  w.v_conv = draw({12, 4}, -1, 1);
  w.k_conv_bias = draw({8}, -0.2, 0.2);
  w.f_a = draw({4, 12}, -0.5, 0.5);
  w.f_b = draw({24, 4}, -0.5, 0.5);
  w.b_proj = draw({3, 12}, -0.5, 0.5);
  w.A_log = draw({3}, 0, 1);
  w.dt_bias = draw({24}, -1, 1);
  w.g_a = draw({4, 12}, -0.5, 0.5);
  w.g_b = draw({12, 4}, -0.5, 0.5);
  w.g_bias = draw({12}, -0.5, 0.5);
  w.norm_weight = draw({4}, 0.5, 1.5);
  w.o_proj = draw({12, 12}, -0.5, 0.5);
  Options<S> opt;
  opt.H = 1;
  opt.HV = 3;
  opt.gate = gate;
  if (gate == kda::GateForm::lower_bound) opt.lower_bound = S(-5);
  const std::vector<std::int64_t> cu{0, 0, 1, 6, 6, 11};
  const Tensor<S> x = draw({11, 12}, -1, 1);
  const LayerState<S> initial{draw({5, 3, 8, 4}, -1, 1), draw({5, 28, 3}, -1, 1)};
  const auto got = kda_layer_forward(as_batch(x), w, opt, std::optional<LayerState<S>>(initial), cu);
  const auto want = compose(x, w, opt, cu, std::optional<LayerState<S>>(initial));
  EXPECT_EQ(Tensor<S>({11, 12}, got.y.values()), want.y);
  EXPECT_EQ(got.final.recurrent, want.recurrent);
  EXPECT_EQ(channel_slice(got.final.conv, 16, 12), want.conv_v);
}

TEST(KdaLayer, FullLayerIsTheCompositionBitwiseInDoubleAndAt256Bits) {
  check_full_layer_is_composition<double>(11, kda::GateForm::softplus);
  check_full_layer_is_composition<double>(12, kda::GateForm::lower_bound);
  check_full_layer_is_composition<HP>(13, kda::GateForm::lower_bound);
}

// Documents split at `split` tokens each: the first part by prefill, the rest one token at
// a time by decode over the pools (slots named out of order), == the prefill of the whole.
TEST(KdaLayer, DecodeAfterPrefillEqualsThePrefillOfTheWhole) {
  test::check_property([] {
    const auto [s, w, opt] = random_exact_layer();
    const std::int64_t N = *rc::gen::inRange<std::int64_t>(1, 4), L = *rc::gen::inRange<std::int64_t>(1, 4);
    const std::int64_t steps = *rc::gen::inRange<std::int64_t>(1, 3);
    std::vector<std::int64_t> cu{0}, cu_first{0};
    for (std::int64_t n = 0; n < N; ++n) {
      cu.push_back(cu.back() + L + steps);
      cu_first.push_back(cu_first.back() + L);
    }
    const Tensor<Q> x = random_tensor({cu.back(), s.D}, -2, 2);
    const LayerState<Q> initial = random_exact_layer_state(s, N);
    const auto whole = kda_layer_forward(as_batch(x), w, opt, std::optional<LayerState<Q>>(initial), cu);
    // Prefill of the first L tokens of each document.
    Tensor<Q> first({cu_first.back(), s.D});
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t t = 0; t < L; ++t)
        for (std::int64_t c = 0; c < s.D; ++c) first(cu_first[n] + t, c) = x(cu[n] + t, c);
    const auto pre = kda_layer_forward(as_batch(first), w, opt, std::optional<LayerState<Q>>(initial), cu_first);
    const std::int64_t slots = N + 2, C = 2 * s.H * s.K + s.HV * s.V;
    serving::StatePool<Q> pool = serving::StatePool<Q>::zeros(serving::dense_pool_layout(slots, s.HV, s.K, s.V), Q(7));
    ConvPool<Q> conv_pool({slots, C, s.W - 1}, Q(7));
    std::vector<std::int64_t> slot_of(N);
    for (std::int64_t n = 0; n < N; ++n) {
      slot_of[n] = slots - 1 - n;
      serving::write_slot(pool, slot_of[n], serving::detail::state_at(pre.final.recurrent, n));
      std::copy(pre.final.conv.data() + n * C * (s.W - 1), pre.final.conv.data() + (n + 1) * C * (s.W - 1),
                conv_pool.data() + slot_of[n] * C * (s.W - 1));
    }
    std::vector<std::int64_t> one_each{0};
    for (std::int64_t n = 0; n < N; ++n) one_each.push_back(n + 1);
    for (std::int64_t step = 0; step < steps; ++step) {
      Tensor<Q> tok({N, s.D});
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t c = 0; c < s.D; ++c) tok(n, c) = x(cu[n] + L + step, c);
      const Tensor<Q> y = kda_layer_decode(tok, w, opt, pool, conv_pool, one_each, slot_of);
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t c = 0; c < s.D; ++c) RC_ASSERT(y(n, c) == whole.y(0, cu[n] + L + step, c));
    }
    for (std::int64_t n = 0; n < N; ++n) {
      RC_ASSERT(serving::read_slot(pool, slot_of[n]) == serving::detail::state_at(whole.final.recurrent, n));
      RC_ASSERT(serving::detail::state_at(conv_pool, slot_of[n]) == serving::detail::state_at(whole.final.conv, n));
    }
    for (std::int64_t slot = 0; slot < slots - N; ++slot) {  // slots not named: untouched
      RC_ASSERT(serving::read_slot(pool, slot) == Tensor<Q>({s.HV, s.K, s.V}));
      RC_ASSERT(serving::detail::state_at(conv_pool, slot) == Tensor<Q>({C, s.W - 1}, Q(7)));
    }
  });
}

// A draft window verified with per-token tapes, then rolled back to an accepted prefix ==
// decoding the accepted tokens one after another; the in-place verify's columns hold the
// same states; a padded lane (-1) reads and writes nothing and outputs zero.
TEST(KdaLayer, VerifyThenRollbackEqualsSequentialDecodeOfTheAcceptedTokens) {
  test::check_property([] {
    const auto [s, w, opt] = random_exact_layer();
    const std::int64_t N = *rc::gen::inRange<std::int64_t>(1, 4), L = *rc::gen::inRange<std::int64_t>(1, 4);
    const std::int64_t C = 2 * s.H * s.K + s.HV * s.V, slots = N * (L + 1), M = s.W - 1;
    const std::int64_t padded = *rc::gen::inRange<std::int64_t>(0, N);  // this lane is padding
    std::vector<std::int64_t> cu{0};
    for (std::int64_t n = 0; n < N; ++n) cu.push_back(cu.back() + L);
    const Tensor<Q> x = random_tensor({cu.back(), s.D}, -2, 2);
    serving::StatePool<Q> pool{serving::dense_pool_layout(slots, s.HV, s.K, s.V), {}};
    pool.buffer = random_tensor({slots * s.HV * s.K * s.V}, -2, 2).values();
    ConvPool<Q> conv_pool = random_tensor({slots, C, M}, -2, 2);
    // Sequence n: slot n * (L + 1) is its live slot, the next L its window columns.
    std::vector<std::int64_t> live(N), accepted(N);
    Tensor<std::int64_t> idx({N, L});
    for (std::int64_t n = 0; n < N; ++n) {
      live[n] = n == padded ? serving::pad_slot : n * (L + 1);
      accepted[n] = *rc::gen::inRange<std::int64_t>(0, L + 1);
      for (std::int64_t t = 0; t < L; ++t) idx(n, t) = n * (L + 1) + 1 + t;
    }
    // Entering column 0 holds the live state (num_accepted 1); the padded lane -1 there.
    Tensor<std::int64_t> entering_idx = idx;
    for (std::int64_t n = 0; n < N; ++n) {
      entering_idx(n, 0) = live[n];
      if (live[n] != serving::pad_slot) {
        serving::write_slot(pool, idx(n, 0), serving::read_slot(pool, live[n]));
        std::copy(conv_pool.data() + live[n] * C * M, conv_pool.data() + (live[n] + 1) * C * M,
                  conv_pool.data() + idx(n, 0) * C * M);
      }
    }
    const std::vector<std::int64_t> ones(N, 1);
    auto seq_pool = pool;
    auto seq_conv = conv_pool;
    auto tape_pool = pool;
    auto tape_conv = conv_pool;
    const auto verified =
        kda_layer_verify(x, w, opt, tape_pool, tape_conv, cu, entering_idx, ones, serving::StateWrites::per_token_output);
    RC_ASSERT(tape_pool.buffer == pool.buffer);  // per-token output: the pools only read
    RC_ASSERT(tape_conv == conv_pool);
    auto inplace_pool = pool;
    auto inplace_conv = conv_pool;
    Tensor<std::int64_t> inplace_idx = idx;  // enters from column 0, writes columns 0..L-1 in place
    for (std::int64_t n = 0; n < N; ++n)
      if (live[n] == serving::pad_slot) inplace_idx(n, 0) = serving::pad_slot;
    const auto in_place = kda_layer_verify(x, w, opt, inplace_pool, inplace_conv, cu, inplace_idx, ones);
    RC_ASSERT(in_place.y == verified.y);
    accept_prefix(tape_pool, tape_conv, verified, cu, live, accepted);
    for (std::int64_t n = 0; n < N; ++n) {
      if (live[n] == serving::pad_slot) {
        for (std::int64_t t = 0; t < L; ++t)
          for (std::int64_t c = 0; c < s.D; ++c) RC_ASSERT(verified.y(cu[n] + t, c) == Q(0));
        continue;
      }
      for (std::int64_t t = 0; t < L; ++t) {
        Tensor<Q> tok({1, s.D});
        for (std::int64_t c = 0; c < s.D; ++c) tok(0, c) = x(cu[n] + t, c);
        const Tensor<Q> y = kda_layer_decode(tok, w, opt, seq_pool, seq_conv, {0, 1}, {live[n]});
        for (std::int64_t c = 0; c < s.D; ++c) RC_ASSERT(y(0, c) == verified.y(cu[n] + t, c));
        RC_ASSERT(serving::read_slot(seq_pool, live[n]) == serving::read_slot(inplace_pool, idx(n, t)));
        RC_ASSERT(serving::detail::state_at(seq_conv, live[n]) == serving::detail::state_at(inplace_conv, idx(n, t)));
        if (t + 1 == accepted[n]) {
          RC_ASSERT(serving::read_slot(tape_pool, live[n]) == serving::read_slot(seq_pool, live[n]));
          RC_ASSERT(serving::detail::state_at(tape_conv, live[n]) == serving::detail::state_at(seq_conv, live[n]));
        }
      }
      if (accepted[n] == 0) {
        RC_ASSERT(serving::read_slot(tape_pool, live[n]) == serving::read_slot(pool, live[n]));
        RC_ASSERT(serving::detail::state_at(tape_conv, live[n]) == serving::detail::state_at(conv_pool, live[n]));
      }
    }
  });
}

// The conv tape's row t is the final convolution state of the document's prefix ending at t.
TEST(KdaLayer, ConvTapeRowsAreThePrefixesFinalStates) {
  test::check_property([] {
    const std::int64_t C = *rc::gen::inRange<std::int64_t>(1, 4), W = *rc::gen::inRange<std::int64_t>(1, 5);
    const auto cu = test::random_documents(3, 5);
    const std::int64_t N = static_cast<std::int64_t>(cu.size()) - 1;
    const Tensor<Q> x = random_tensor({1, cu.back(), C}, -2, 2);
    const Tensor<Q> entering = random_tensor({N, C, W - 1}, -2, 2);
    const Tensor<Q> tape = conv_tape(x, entering, cu);
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        kcp::ShortConvInputs<Q> in;
        in.x = Tensor<Q>({1, t + 1 - cu[n], C}, std::vector<Q>(x.data() + cu[n] * C, x.data() + (t + 1) * C));
        in.weight = Tensor<Q>({C, W}, Q(1));
        in.initial_state = Tensor<Q>({1, C, W - 1}, std::vector<Q>(entering.data() + n * C * (W - 1),
                                                                     entering.data() + (n + 1) * C * (W - 1)));
        RC_ASSERT(serving::detail::state_at(tape, t) ==
                  serving::detail::state_at(kcp::short_conv_forward(in, ConvActivation::none).final_state, 0));
      }
  });
}

// Explicit cu_seqlens with an all-ones mask: the mask is not read (FLA's rule; a layer that
// derives cu_seqlens from that mask attends across the documents). A padding mask without
// cu_seqlens: each row's kept tokens are one document, zero output at the padding.
TEST(KdaLayer, CuSeqlensWinOverAnAllOnesMaskAndAPaddingMaskDropsTokens) {
  test::check_property([] {
    const auto [s, w, opt] = random_exact_layer();
    const auto cu = test::random_documents(3, 4);
    const std::int64_t T = cu.back();
    const Tensor<Q> x = random_tensor({1, T, s.D}, -2, 2);
    const auto plain = kda_layer_forward(x, w, opt, std::nullopt, cu);
    const auto masked = kda_layer_forward(x, w, opt, std::nullopt, cu, Tensor<std::int64_t>({1, T}, 1));
    RC_ASSERT(masked.y == plain.y);
    RC_ASSERT(masked.final.recurrent == plain.final.recurrent);
    // Two rows with padding; each row's kept tokens alone.
    const std::int64_t Tp = *rc::gen::inRange<std::int64_t>(1, 5);
    const Tensor<Q> xp = random_tensor({2, Tp, s.D}, -2, 2);
    Tensor<std::int64_t> mask({2, Tp});
    for (auto& m : mask.values()) m = *rc::gen::inRange(0, 2);
    const auto padded = kda_layer_forward(xp, w, opt, std::nullopt, std::nullopt, mask);
    for (std::int64_t b = 0; b < 2; ++b) {
      std::vector<Q> kept;
      std::vector<std::int64_t> at;
      for (std::int64_t t = 0; t < Tp; ++t)
        if (mask(b, t) != 0) {
          at.push_back(t);
          kept.insert(kept.end(), xp.data() + (b * Tp + t) * s.D, xp.data() + (b * Tp + t + 1) * s.D);
        }
      const std::int64_t n = static_cast<std::int64_t>(at.size());
      const auto alone = kda_layer_forward(Tensor<Q>({1, n, s.D}, kept), w, opt);
      for (std::int64_t t = 0; t < Tp; ++t)
        for (std::int64_t c = 0; c < s.D; ++c) {
          const auto pos = std::find(at.begin(), at.end(), t);
          const Q want = pos == at.end() ? Q(0) : alone.y(0, pos - at.begin(), c);
          RC_ASSERT(padded.y(b, t, c) == want);
        }
      RC_ASSERT(serving::detail::state_at(padded.final.recurrent, b) == serving::detail::state_at(alone.final.recurrent, 0));
    }
  });
}

TEST(KdaLayer, RefusesWhatItCannotCompute) {
  Weights<Q> w;
  w.q_proj = Tensor<Q>({2, 3});
  w.k_proj = Tensor<Q>({2, 3});
  w.v_proj = Tensor<Q>({2, 3});
  w.f_b = Tensor<Q>({2, 3});
  w.b_proj = Tensor<Q>({1, 3});
  w.o_proj = Tensor<Q>({3, 2});
  Options<Q> opt;
  opt.gate = kda::GateForm::decay_factor;
  opt.beta = kda::BetaForm::as_given;
  opt.qk_l2norm = false;
  opt.activation = ConvActivation::none;
  opt.scale = Q(1);
  EXPECT_THROW(kda_layer_forward(Tensor<Q>({1, 2, 3}), w, opt), InvalidArgument);  // the norm needs sqrt
  opt.output_norm = false;
  EXPECT_NO_THROW(kda_layer_forward(Tensor<Q>({1, 2, 3}), w, opt));
  EXPECT_THROW(kda_layer_forward(Tensor<Q>({2, 2, 3}), w, opt, std::nullopt, std::vector<std::int64_t>{0, 2}),
               InvalidArgument);  // cu_seqlens need B == 1
  w.g_b = Tensor<Q>({2, 3});
  EXPECT_THROW(kda_layer_forward(Tensor<Q>({1, 2, 3}), w, opt), InvalidArgument);  // a gate without the norm
}

}  // namespace
}  // namespace k3ref::layer
