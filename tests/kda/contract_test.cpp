// Tests of the kernel precision contracts (kda/kernel_contracts.h).
//  * Rounding nowhere, each contract is the chunk form: == in rationals against
//    chunkwise_forward and the recurrence (chunk and sub-chunk sizes shrunk so that small
//    cases span several chunks and sub-chunks), bitwise in double for fla_recurrent.
//  * With the kernel's roundings, the error on fixed random bf16 inputs lies in a committed
//    range around the value measured when the contract was written (Boost.Math style: a
//    change of the model moves it out of the range and must be re-measured and explained in
//    docs/contracts.md).
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "golden/kda_family.h"
#include "k3ref/check/metrics.h"
#include "k3ref/kda/kernel_contracts.h"
#include "k3ref/num/random.h"
#include "test_support.h"

namespace k3ref::kda {
namespace {

using contract::Kernel;
using contract::Precision;
using contract::Site;
using Q = num::rational;
using test::ExactCase;
using test::random_exact_case;

// ---- rounding nowhere: the chunk form, exactly -------------------------------------------

RC_GTEST_PROP(KdaContractExact, FlaChunkAndSafeGateEqualTheChunkFormAndTheRecurrence, ()) {
  const ExactCase c = random_exact_case(24);
  const auto r = recurrent_forward(c.in, c.opt);
  ChunkwiseOptions copt;
  copt.form = ChunkForm::fla;
  copt.sub_chunk = *rc::gen::inRange(1, 5);
  copt.chunk_size = copt.sub_chunk * *rc::gen::inRange(1, 5);
  const auto w = chunkwise_forward(c.in, c.opt, copt);
  for (Kernel k : {Kernel::fla_chunk, Kernel::fla_chunk_safe_gate}) {
    auto con = contract::exact_contract(k);
    con.chunk_size = copt.chunk_size;
    con.sub_chunk = copt.sub_chunk;
    const auto e = contract::evaluate_contract(con, c.in, c.opt);
    RC_ASSERT(e.o == w.out.o);
    RC_ASSERT(*e.final_state == *w.out.final_state);
    RC_ASSERT(e.o == r.o);
    RC_ASSERT(*e.final_state == *r.final_state);
  }
}

RC_GTEST_PROP(KdaContractExact, FlashKdaEqualsTheChunkFormAndTheRecurrence, ()) {
  const ExactCase c = random_exact_case(24);
  ChunkwiseOptions copt;
  copt.form = ChunkForm::flashkda;
  copt.chunk_size = *rc::gen::element<std::int64_t>(1, 2, 3, 4, 5, 8);
  auto con = contract::exact_contract(Kernel::flashkda);
  con.chunk_size = copt.chunk_size;
  con.sub_chunk = 1;
  const auto e = contract::evaluate_contract(con, c.in, c.opt);
  const auto w = chunkwise_forward(c.in, c.opt, copt);
  RC_ASSERT(e.o == w.out.o);
  RC_ASSERT(*e.final_state == *w.out.final_state);
  const auto r = recurrent_forward(c.in, c.opt);
  RC_ASSERT(e.o == r.o);
  RC_ASSERT(*e.final_state == *r.final_state);
}

// At the kernels' own sizes (C = 64 from 16-row sub-chunks; C = 16) over several chunks.
TEST(KdaContractExact, KernelChunkSizesEqualTheRecurrence) {
  const Inputs<Q> in = test::seeded_exact_inputs(test::test_seed(5), 140, 75);
  Options<Q> opt;
  opt.gate = GateForm::decay_factor;
  opt.scale = Q(1) / Q(2);
  const auto r = recurrent_forward(in, opt);
  for (Kernel k : {Kernel::fla_chunk, Kernel::fla_chunk_safe_gate, Kernel::flashkda}) {
    const auto e = contract::evaluate_contract(contract::exact_contract(k), in, opt);
    EXPECT_EQ(e.o, r.o) << contract::to_string(k);
    EXPECT_EQ(*e.final_state, *r.final_state) << contract::to_string(k);
  }
}

// Every chunk golden's inputs, made exact: q and k (normalised as the golden asks), v, the
// activated beta and the scale as the doubles the golden's options give, the decays rounded
// to bf16 (so that rationals stay small; the exact decays of a log gate are irrational).
// Rounding nowhere, each chunk contract is then the recurrence, ==. (20 s in a release
// build; under the sanitizers, where K3REF_GOLDEN_VERIFY_SAMPLE is set, the first golden only.)
TEST(KdaContractExact, EveryChunkContractIsTheRecurrenceOnEveryChunkGoldensInputs) {
  const bool sample = std::getenv("K3REF_GOLDEN_VERIFY_SAMPLE") != nullptr;
  int goldens = 0;
  for (const golden::Case& c : golden::suite("default")) {
    if (c.op.rfind("kda.chunkwise", 0) != 0 || (sample && goldens == 1)) continue;
    const golden::Case base = golden::recurrence_case(c.params.at("base_case").get<std::string>(), c.name);
    const Inputs<double> in = golden::recurrence_inputs(base);
    const Options<double> dopt = golden::kda_double_options(base.params);
    const PreparedInputs<double> p = prepare(in, dopt, validated_dims(in, dopt));
    auto lift = [](const Tensor<double>& t) { return t.map<Q>([](double x) { return Q(x); }); };
    Inputs<Q> q_in;
    q_in.q = lift(p.q);
    q_in.k = lift(p.k);
    q_in.v = lift(p.v);
    q_in.g = p.decay.map<Q>([](double x) { return Q(num::round_to(num::Format::bf16, x)); });
    q_in.beta = lift(p.beta);
    if (in.initial_state) q_in.initial_state = lift(*in.initial_state);
    q_in.cu_seqlens = in.cu_seqlens;
    Options<Q> opt;
    opt.gate = GateForm::decay_factor;
    opt.scale = Q(p.scale);
    opt.state_layout = dopt.state_layout;
    const auto r = recurrent_forward(q_in, opt);
    for (Kernel k : {Kernel::fla_chunk, Kernel::fla_chunk_safe_gate, Kernel::flashkda}) {
      const auto e = contract::evaluate_contract(contract::exact_contract(k), q_in, opt);
      EXPECT_EQ(e.o, r.o) << c.name << " " << contract::to_string(k);
      EXPECT_EQ(*e.final_state, *r.final_state) << c.name << " " << contract::to_string(k);
    }
    ++goldens;
  }
  EXPECT_EQ(goldens, sample ? 1 : 7);
}

// ---- with the kernels' roundings, on bf16 inputs -----------------------------------------

struct Problem {
  Inputs<double> in;
  Options<double> opt;
};

// bf16 inputs, K = V = 32, T = 80 (two FLA chunks, five FlashKDA chunks), q/k L2-normalised,
// beta through sigmoid, the lower-bound gate (FlashKDA's) or log decays in [-0.5, 0].
Problem bf16_problem(std::uint64_t seed, std::int64_t H, std::int64_t HV, bool lower_bound_gate) {
  const std::int64_t T = 80, K = 32, V = 32;
  num::Random rng(seed);
  auto draw = [&](const Shape& shape, double lo, double hi) { return test::bf16_tensor(rng, shape, lo, hi); };
  Problem p;
  p.in.q = draw({1, T, H, K}, -1, 1);
  p.in.k = draw({1, T, H, K}, -1, 1);
  p.in.v = draw({1, T, HV, V}, -1, 1);
  p.in.beta = draw({1, T, HV}, -4, 4);
  p.opt.qk_l2norm = true;
  p.opt.beta = BetaForm::sigmoid;
  if (lower_bound_gate) {
    test::draw_lower_bound_gate(rng, p.in, p.opt, T, HV, K);
  } else {
    p.in.g = draw({1, T, HV, K}, -0.5, 0);
    p.in.initial_state = draw({1, HV, K, V}, -1, 1);
  }
  return p;
}

struct Measured {
  double o_rel_rms, floor;
};

Measured contract_error(Kernel k, const Problem& p) {
  const auto ref = recurrent_forward(p.in, p.opt);
  const auto got = contract::evaluate_contract(contract::kernel_contract(k), p.in, p.opt);
  const auto m = check::compare(got.o.values(), ref.o.values(), num::Format::bf16);
  return {m.rel_rms, m.floor_rel_rms};
}

// Committed ranges: the value measured when the model was written (printed by the test),
// within 25% either way (libm's exp and the thread-independent order keep it reproducible;
// the margin absorbs a different libm).
TEST(KdaContractError, EachContractLiesInItsMeasuredRange) {
  struct Expect {
    Kernel kernel;
    std::int64_t H, HV;
    bool lower_bound_gate;
    double measured;  // o relative RMS error against the recurrence in double
  };
  const Expect expected[] = {
      // Measured 2026-12-01; the H200 figures of the same kernels on K = V = 128 are 1.00x,
      // 2.0x-2.7x and 3.4x-3.5x the floor (docs/contracts.md): the contracts reproduce them.
      {Kernel::fla_recurrent, 1, 2, false, 1.6337e-03},        // 1.00x the bf16 floor
      {Kernel::fla_chunk, 1, 2, false, 3.7852e-03},            // 2.32x
      {Kernel::fla_chunk_safe_gate, 1, 2, false, 3.8149e-03},  // 2.34x
      {Kernel::flashkda, 2, 2, true, 6.1347e-03},              // 3.59x
  };
  for (const Expect& e : expected) {
    const Measured m = contract_error(e.kernel, bf16_problem(16, e.H, e.HV, e.lower_bound_gate));
    std::printf("%-20s o rel RMS %.4e  bf16 floor %.4e  (%.2fx)\n", std::string(contract::to_string(e.kernel)).c_str(),
                m.o_rel_rms, m.floor, m.o_rel_rms / m.floor);
    EXPECT_GE(m.o_rel_rms, e.measured / 1.25) << contract::to_string(e.kernel);
    EXPECT_LE(m.o_rel_rms, e.measured * 1.25) << contract::to_string(e.kernel);
  }
}

// fla_recurrent rounding nowhere is the recurrence in double, bit for bit; with its contract
// o is the float recurrence's o rounded once to bf16 and the final state is fp32.
TEST(KdaContractExact, FlaRecurrentIsTheRecurrence) {
  const Problem p = bf16_problem(7, 1, 2, false);
  const auto r = recurrent_forward(p.in, p.opt);
  const auto e = contract::evaluate_contract(contract::exact_contract(Kernel::fla_recurrent), p.in, p.opt);
  EXPECT_EQ(e.o, r.o);
  EXPECT_EQ(*e.final_state, *r.final_state);
  const auto f = contract::evaluate_contract(contract::kernel_contract(Kernel::fla_recurrent), p.in, p.opt);
  for (double x : f.o.values()) EXPECT_EQ(x, num::round_to(num::Format::bf16, x));
  for (double x : f.final_state->values()) EXPECT_EQ(x, static_cast<double>(static_cast<float>(x)));
}

// Every site of a contract rounds to what its table says: the FLA chunk contract's stored
// tensors are bf16 values, FlashKDA's state is bf16.
TEST(KdaContractTable, OutputsAndStatesHaveTheDeclaredFormats) {
  const Problem p = bf16_problem(9, 1, 1, false);
  for (Kernel k : {Kernel::fla_chunk, Kernel::flashkda}) {
    const auto e = contract::evaluate_contract(contract::kernel_contract(k), p.in, p.opt);
    for (double x : e.o.values()) ASSERT_EQ(x, num::round_to(num::Format::bf16, x)) << contract::to_string(k);
    const num::Format state = k == Kernel::flashkda ? num::Format::bf16 : num::Format::fp32;
    for (double x : e.final_state->values()) ASSERT_EQ(x, num::round_to(state, x)) << contract::to_string(k);
  }
}

}  // namespace
}  // namespace k3ref::kda
