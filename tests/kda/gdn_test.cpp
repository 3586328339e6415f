// Tests of GDN as KDA's scalar-gate case (include/k3ref/kda/gdn.h): in rationals, the GDN
// forms (recurrence, both chunkwise forms, the pool decode) == the scalar-gate recurrence
// written out here from its definition == KDA on inputs whose gate is broadcast over K by
// hand; GDN's gating (softplus gate, sigmoid beta) equals the formula at 256 bits; the packed
// mixed_qkv layout. RapidCheck prints the seed that replays a failure (RC_PARAMS).
#include "test_support.h"

#include <cmath>

#include "k3ref/kda/gdn.h"
#include "k3ref/serving/decode.h"

namespace k3ref::gdn {
namespace {

using test::HP;
using test::Q;

// The GDN recurrence of one sequence from the definition: the state is scaled by the head's
// one decay a_t (not per row), then the delta rule, then the read. K-first [HV, K, V].
Tensor<Q> gdn_by_definition(const Inputs<Q>& in, const kda::Options<Q>& opt, std::int64_t b, std::int64_t begin,
                            std::int64_t end, Tensor<Q> S, Tensor<Q>& o) {
  const std::int64_t H = in.q.dim(2), HV = in.v.dim(2), K = in.q.dim(3), V = in.v.dim(3);
  for (std::int64_t t = begin; t < end; ++t)
    for (std::int64_t hv = 0; hv < HV; ++hv) {
      const std::int64_t h = hv / (HV / H);
      const Q a = in.g(b, t, hv);
      for (std::int64_t j = 0; j < V; ++j) {
        Q kS(0);
        for (std::int64_t i = 0; i < K; ++i) {
          S(hv, i, j) = a * S(hv, i, j);
          kS += in.k(b, t, h, i) * S(hv, i, j);
        }
        const Q u = in.beta(b, t, hv) * (in.v(b, t, hv, j) - kS);
        Q out(0);
        for (std::int64_t i = 0; i < K; ++i) {
          S(hv, i, j) += in.k(b, t, h, i) * u;
          out += S(hv, i, j) * (*opt.scale * in.q(b, t, h, i));
        }
        o(b, t, hv, j) = out;
      }
    }
  return S;
}

// Sequence n's initial state [HV, K, V] (or V-first) of a stacked [N, ...] one; zero when absent.
Tensor<Q> state_of(const std::optional<Tensor<Q>>& stacked, std::int64_t n, const Shape& shape) {
  if (!stacked) return Tensor<Q>(shape);
  const std::int64_t size = stacked->numel() / stacked->dim(0);
  return Tensor<Q>(shape, std::vector<Q>(stacked->data() + n * size, stacked->data() + (n + 1) * size));
}

struct GdnCase {
  Inputs<Q> in;
  kda::Options<Q> opt;
};

// An exact KDA case with its gate replaced by one decay per value head.
GdnCase random_gdn_case() {
  const test::ExactCase c = test::random_exact_case(10);
  GdnCase r;
  r.in = Inputs<Q>{c.in.q, c.in.k, c.in.v, test::random_decays({c.in.q.dim(0), c.in.q.dim(1), c.in.v.dim(2)}),
                   c.in.beta, c.in.initial_state, std::nullopt, std::nullopt, c.in.cu_seqlens};
  r.opt = c.opt;
  return r;
}

TEST(Gdn, EveryFormEqualsTheScalarGateDefinitionAndKdaWithTheGateBroadcast) {
  test::check_property([] {
    const GdnCase c = random_gdn_case();
    const std::int64_t B = c.in.q.dim(0), T = c.in.q.dim(1), HV = c.in.v.dim(2), K = c.in.q.dim(3), V = c.in.v.dim(3);
    const bool v_first = c.opt.state_layout == kda::StateLayout::v_first;
    // The definition, per sequence.
    Tensor<Q> o({B, T, HV, V});
    std::vector<Q> finals;
    const auto cu = c.in.cu_seqlens;
    const std::int64_t N = cu ? static_cast<std::int64_t>(cu->size()) - 1 : B;
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int64_t b = cu ? 0 : n, begin = cu ? (*cu)[n] : 0, end = cu ? (*cu)[n + 1] : T;
      const Tensor<Q> S0 =
          kda::to_k_first(state_of(c.in.initial_state, n, v_first ? Shape{HV, V, K} : Shape{HV, K, V}), c.opt.state_layout);
      const Tensor<Q> S = kda::from_k_first(gdn_by_definition(c.in, c.opt, b, begin, end, S0, o), c.opt.state_layout);
      finals.insert(finals.end(), S.values().begin(), S.values().end());
    }
    const Tensor<Q> final_state(v_first ? Shape{N, HV, V, K} : Shape{N, HV, K, V}, finals);
    // KDA with the gate broadcast over K, written here element by element.
    kda::Inputs<Q> kin{c.in.q, c.in.k, c.in.v, Tensor<Q>({B, T, HV, K}), c.in.beta, c.in.initial_state,
                       std::nullopt, std::nullopt, c.in.cu_seqlens};
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t hv = 0; hv < HV; ++hv)
          for (std::int64_t i = 0; i < K; ++i) kin.g(b, t, hv, i) = c.in.g(b, t, hv);
    const auto kda_out = kda::recurrent_forward(kin, c.opt);
    const auto gdn_out = gdn::recurrent_forward(c.in, c.opt);
    RC_ASSERT(gdn_out.o == o);
    RC_ASSERT(*gdn_out.final_state == final_state);
    RC_ASSERT(kda_out.o == o);
    RC_ASSERT(*kda_out.final_state == final_state);
    for (const auto form : {kda::ChunkForm::flashkda, kda::ChunkForm::fla}) {
      kda::ChunkwiseOptions copt;
      copt.form = form;
      copt.chunk_size = form == kda::ChunkForm::fla ? 4 : 2;
      copt.sub_chunk = 2;
      const auto chunk = gdn::chunkwise_forward(c.in, c.opt, copt);
      RC_ASSERT(chunk.out.o == o);
      RC_ASSERT(*chunk.out.final_state == final_state);
    }
  });
}

// The pool decode of GDN inputs: each sequence from its slot, by the definition.
TEST(Gdn, PoolDecodeEqualsTheDefinitionPerSequence) {
  test::check_property([] {
    const test::Sizes s = test::random_sizes();
    const std::int64_t N = *rc::gen::inRange(1, 4);
    std::vector<std::int64_t> cu{0};
    for (std::int64_t n = 0; n < N; ++n) cu.push_back(cu.back() + *rc::gen::inRange<std::int64_t>(0, 3));
    const kda::Inputs<Q> base = test::random_packed_inputs(s, cu, false);
    Inputs<Q> in{base.q, base.k, base.v, test::random_decays({1, cu.back(), s.HV}), base.beta, std::nullopt,
                 std::nullopt, std::nullopt, cu};
    const kda::Options<Q> opt = test::exact_options();
    const std::int64_t slots = N + 2;
    serving::StatePool<Q> pool{serving::dense_pool_layout(slots, s.HV, s.K, s.V), {}};
    pool.buffer = test::random_tensor({slots * s.HV * s.K * s.V}, -4, 4).values();
    std::vector<std::int64_t> slot_of(static_cast<std::size_t>(N));
    for (std::int64_t n = 0; n < N; ++n) slot_of[n] = slots - 1 - n;  // named in reverse, slot 0 never
    const serving::StatePool<Q> before = pool;
    const Tensor<Q> o = serving::continuous_batching_decode(to_kda(in), opt, pool, slot_of);
    Tensor<Q> expected({1, cu.back(), s.HV, s.V});
    for (std::int64_t n = 0; n < N; ++n) {
      const Tensor<Q> S = gdn_by_definition(in, opt, 0, cu[n], cu[n + 1], serving::read_slot(before, slot_of[n]), expected);
      RC_ASSERT(serving::read_slot(pool, slot_of[n]) == S);
    }
    RC_ASSERT(o == expected);
    RC_ASSERT(serving::read_slot(pool, 0) == serving::read_slot(before, 0));
  });
}

// GDN's gating through KDA's softplus gate and sigmoid beta on the broadcast inputs equals
// g = -exp(A_log) softplus(a + dt_bias) and sigmoid(b), at 256 bits, operation for operation.
TEST(Gdn, GatingIsKdaSoftplusGateAndSigmoidBetaOnTheBroadcastInputs) {
  num::Random rng(test::test_seed(2811));
  const std::int64_t T = 5, H = 1, HV = 2, K = 3, V = 2;
  auto draw = [&](const Shape& shape, double lo, double hi) {
    Tensor<HP> t(shape);
    for (HP& x : t.values()) x = HP(rng.dyadic(lo, hi, 20));
    return t;
  };
  Inputs<HP> in{draw({1, T, H, K}, -1, 1), draw({1, T, H, K}, -1, 1), draw({1, T, HV, V}, -1, 1),
                draw({1, T, HV}, -6, 6), draw({1, T, HV}, -6, 6), std::nullopt, draw({HV}, 0, 3),
                draw({HV}, -1, 1), std::nullopt};
  const kda::Options<HP> opt = gated_options<HP>();
  const kda::Inputs<HP> kin = to_kda(in);
  const Tensor<HP> g = kda::gate_log_decay(kin.g, opt.gate, kin.A_log, kin.dt_bias, opt.lower_bound);
  const Tensor<HP> b = kda::activate_beta(kin.beta, opt.beta);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t hv = 0; hv < HV; ++hv) {
      EXPECT_TRUE(b(0, t, hv) == beta(in.beta(0, t, hv)));
      for (std::int64_t i = 0; i < K; ++i)
        EXPECT_TRUE(g(0, t, hv, i) == gate(in.g(0, t, hv), (*in.A_log)(hv), (*in.dt_bias)(hv))) << t << " " << hv << " " << i;
    }
  // a + dt_bias = 0, A_log = 0: g = -softplus(0) = -ln 2, a decay of exactly 1/2.
  using std::exp;
  EXPECT_LT(abs(exp(gate(HP(0), HP(0), HP(0))) - HP(1) / HP(2)), HP(1e-70));
}

// Element (h, i) of q sits at channel h K + i, of k at H K + h K + i, (hv, j) of v at
// 2 H K + hv V + j (the layout, written out here); pack and unpack are inverse.
TEST(Gdn, MixedQkvLayout) {
  const PackedHeads h{2, 4, 3, 5};
  Tensor<double> mixed({2, 3, h.width()});
  for (std::int64_t e = 0; e < mixed.numel(); ++e) mixed.data()[e] = static_cast<double>(e);
  const Inputs<double> u = unpack_mixed_qkv(mixed, h);
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < 3; ++t) {
      for (std::int64_t hh = 0; hh < h.H; ++hh)
        for (std::int64_t i = 0; i < h.K; ++i) {
          EXPECT_EQ(u.q(b, t, hh, i), mixed(b, t, hh * h.K + i));
          EXPECT_EQ(u.k(b, t, hh, i), mixed(b, t, h.H * h.K + hh * h.K + i));
        }
      for (std::int64_t hv = 0; hv < h.HV; ++hv)
        for (std::int64_t j = 0; j < h.V; ++j) EXPECT_EQ(u.v(b, t, hv, j), mixed(b, t, 2 * h.H * h.K + hv * h.V + j));
    }
  EXPECT_TRUE(pack_mixed_qkv(u.q, u.k, u.v) == mixed);
  EXPECT_THROW(unpack_mixed_qkv(Tensor<double>({1, 1, h.width() + 1}), h), InvalidArgument);
}

TEST(Gdn, AGateOfTheWrongShapeIsRefused) {
  Inputs<double> in{Tensor<double>({1, 2, 1, 3}), Tensor<double>({1, 2, 1, 3}), Tensor<double>({1, 2, 1, 2}),
                    Tensor<double>({1, 2, 1, 3}), Tensor<double>({1, 2, 1}), std::nullopt, std::nullopt, std::nullopt,
                    std::nullopt};
  EXPECT_THROW(to_kda(in), InvalidArgument);  // a per-channel gate is KDA's, not GDN's
  in.g = Tensor<double>({1, 2, 1});
  in.dt_bias = Tensor<double>({1, 3});
  EXPECT_THROW(to_kda(in), InvalidArgument);
  in.dt_bias = Tensor<double>({1});
  EXPECT_EQ(to_kda(in).g.shape(), (Shape{1, 2, 1, 3}));
  EXPECT_EQ(to_kda(in).dt_bias->shape(), (Shape{1, 3}));
}

}  // namespace
}  // namespace k3ref::gdn
