// The tuned KDA forms against the plain stepwise definition (kda/definition.h): the
// register-blocked recurrence bitwise in double and == in rationals, the chunkwise forms
// == in rationals, the adjoint's recompute by construction (it calls definition::update).
// Property seeds come from RC_PARAMS (tests/meson.build fixes one for CI); RapidCheck
// prints the seed and the shrunk case of any failure.
#include <cstring>

#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/definition.h"
#include "k3ref/kda/recurrent.h"
#include "k3ref/num/random.h"
#include "test_support.h"

namespace k3ref::kda {
namespace {

using namespace test;

struct Sizes {
  std::int64_t T, H, HV, K, V;
  std::vector<std::int64_t> cu_seqlens;  // B = 1, packed documents
};

// T up to 2 token tiles and V up to 3 column blocks of the tuned recurrence, so tile and
// block edges are crossed; a few documents, some empty.
Sizes random_sizes(std::int64_t max_t, std::int64_t max_k, std::int64_t max_v) {
  Sizes s;
  s.H = *rc::gen::inRange(1, 3);
  s.HV = s.H * *rc::gen::inRange(1, 3);
  s.K = *rc::gen::inRange<std::int64_t>(1, max_k + 1);
  s.V = *rc::gen::inRange<std::int64_t>(1, max_v + 1);
  s.T = *rc::gen::inRange<std::int64_t>(0, max_t + 1);
  s.cu_seqlens = {0};
  const int docs = *rc::gen::inRange(1, 4);
  for (int n = 1; n < docs; ++n) s.cu_seqlens.push_back(*rc::gen::inRange<std::int64_t>(0, s.T + 1));
  std::sort(s.cu_seqlens.begin(), s.cu_seqlens.end());
  s.cu_seqlens.push_back(s.T);
  return s;
}

template <class S, class Draw, class DrawDecay>
Inputs<S> inputs_of(const Sizes& s, Draw&& draw, DrawDecay&& draw_decay) {
  const std::int64_t N = static_cast<std::int64_t>(s.cu_seqlens.size()) - 1;
  Inputs<S> in;
  in.q = draw(Shape{1, s.T, s.H, s.K}, -4, 4);
  in.k = draw(Shape{1, s.T, s.H, s.K}, -2, 2);
  in.v = draw(Shape{1, s.T, s.HV, s.V}, -4, 4);
  in.g = draw_decay(Shape{1, s.T, s.HV, s.K});
  in.beta = draw(Shape{1, s.T, s.HV}, 0, 2);
  if (*rc::gen::arbitrary<bool>()) in.initial_state = draw(Shape{N, s.HV, s.K, s.V}, -4, 4);
  in.cu_seqlens = s.cu_seqlens;
  return in;
}

// test_support.h's exact draws as the callables inputs_of takes.
const auto exact_values = [](const Shape& shape, int lo, int hi) { return random_tensor(shape, lo, hi); };
const auto exact_decays = [](const Shape& shape) { return random_decays(shape); };

template <class S>
Options<S> decay_factor_options(const S& scale) {
  Options<S> opt;
  opt.gate = GateForm::decay_factor;
  opt.scale = scale;
  opt.output_all_states = true;
  return opt;
}

template <class S>
Outputs<S> by_definition(const Inputs<S>& in, const Options<S>& opt) {
  const Dims d = validated_dims(in, opt);
  return definition::recurrence(prepare(in, opt, d), in.initial_state, d, true);
}

bool bitwise_equal(const Tensor<double>& a, const Tensor<double>& b) {
  if (a.shape() != b.shape()) return false;
  return a.numel() == 0 ||  // memcmp must not see the null data of an empty tensor
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(double)) == 0;
}

RC_GTEST_PROP(KdaDefinition, TunedRecurrenceEqualsTheDefinitionInRationals, ()) {
  const Sizes s = random_sizes(18, 3, 10);
  const Inputs<Q> in = inputs_of<Q>(s, exact_values, exact_decays);
  Options<Q> opt = decay_factor_options(small_rational(1, 4));
  opt.num_threads = *rc::gen::inRange(1, 4);
  const Outputs<Q> tuned = recurrent_forward(in, opt), def = by_definition(in, opt);
  RC_ASSERT(tuned.o == def.o);
  RC_ASSERT(*tuned.final_state == *def.final_state);
  RC_ASSERT(*tuned.all_states == *def.all_states);
}

RC_GTEST_PROP(KdaDefinition, TunedRecurrenceEqualsTheDefinitionBitwiseInDouble, ()) {
  const Sizes s = random_sizes(20, 12, 20);
  num::Random rng(*rc::gen::arbitrary<std::uint64_t>());
  auto draw = [&](const Shape& shape, double lo, double hi) {
    Tensor<double> t(shape);
    for (double& x : t.values()) x = rng.dyadic(lo, hi, 52);
    return t;
  };
  auto draw_decay = [&](const Shape& shape) { return draw(shape, 0.05, 1); };
  const Inputs<double> in = inputs_of<double>(s, draw, draw_decay);
  Options<double> opt = decay_factor_options(rng.dyadic(0.1, 1, 52));
  opt.num_threads = *rc::gen::inRange(1, 4);
  const Outputs<double> tuned = recurrent_forward(in, opt), def = by_definition(in, opt);
  RC_ASSERT(bitwise_equal(tuned.o, def.o));
  RC_ASSERT(bitwise_equal(*tuned.final_state, *def.final_state));
  RC_ASSERT(bitwise_equal(*tuned.all_states, *def.all_states));
}

// Both chunkwise forms, every chunk size (and FLA sub-chunk) that divides into the
// sequence differently, equal the definition exactly.
RC_GTEST_PROP(KdaDefinition, ChunkwiseFormsEqualTheDefinitionInRationals, ()) {
  const Sizes s = random_sizes(12, 3, 3);
  const Inputs<Q> in = inputs_of<Q>(s, exact_values, exact_decays);
  Options<Q> opt = decay_factor_options(small_rational(1, 4));
  const Outputs<Q> def = by_definition(in, opt);
  opt.output_all_states = false;
  ChunkwiseOptions copt;
  copt.form = *rc::gen::element(ChunkForm::flashkda, ChunkForm::fla);
  copt.sub_chunk = *rc::gen::element<std::int64_t>(1, 2, 3);
  copt.chunk_size = copt.sub_chunk * *rc::gen::inRange<std::int64_t>(1, 4);
  RC_TAG(to_string(copt.form), copt.chunk_size);
  const auto chunked = chunkwise_forward(in, opt, copt);
  RC_ASSERT(chunked.out.o == def.o);
  RC_ASSERT(*chunked.out.final_state == *def.final_state);
}

// One token by hand (K = V = 1): S = 2, a = 1/2, k = 1, beta = 1/2, v = 3, q = 1, scale = 1.
// Decay: 1. Residual: 3 - 1 = 2. Update: 1 + 1 * (1/2 * 2) = 2. Read: 2.
TEST(KdaDefinition, OneTokenByHand) {
  Q state[1] = {Q(2)}, residual[1], o[1];
  const Q a[1] = {Q(1, 2)}, k[1] = {Q(1)}, v[1] = {Q(3)}, q[1] = {Q(1)};
  definition::update(state, 1, 1, a, k, v, Q(1, 2), residual);
  definition::read(state, 1, 1, q, Q(1), o);
  EXPECT_EQ(residual[0], Q(2));
  EXPECT_EQ(state[0], Q(2));
  EXPECT_EQ(o[0], Q(2));
}

}  // namespace
}  // namespace k3ref::kda
