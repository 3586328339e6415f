// Tests of the chunkwise KDA forms (kda/chunkwise.h) and their precision contracts.
// Equalities with the recurrence are exact, with ==, in rationals (decays as rationals);
// proofs/chunkwise_equals_recurrence.md, proofs/neumann_doubling.md and
// proofs/inverse_decay_overflow.md name the tests here that check them.
#include <array>
#include <cmath>

#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/kernel_contracts.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"
#include "test_support.h"

namespace k3ref::kda {
namespace {

using Q = num::rational;
using HP = num::high_precision<256>;

using namespace test;

// Random inputs: batch or varlen (empty sequences too), GVA, nonzero initial state, T
// rarely a multiple of the chunk size; smaller rationals than the other KDA tests'
// (denominators 1, 2, 4, decays over q <= 4), so that chunks of 16 stay fast.
constexpr std::array<int, 3> chunk_denominators{1, 2, 4};
using Case = ExactCase;
Case random_case(std::int64_t max_t) { return random_exact_case(max_t, ExactDraws{chunk_denominators, 4}); }

// ---- chunkwise = recurrence, exactly (proofs/chunkwise_equals_recurrence.md) -------------------

RC_GTEST_PROP(KdaChunkwiseExact, FlashKdaFormEqualsTheRecurrence, ()) {
  const Case c = random_case(40);
  ChunkwiseOptions copt;
  copt.form = ChunkForm::flashkda;
  copt.chunk_size = *rc::gen::element<std::int64_t>(1, 2, 3, 4, 5, 7, 8, 16);
  const auto r = recurrent_forward(c.in, c.opt);
  const auto w = chunkwise_forward(c.in, c.opt, copt);
  RC_ASSERT(w.out.o == r.o);
  RC_ASSERT(*w.out.final_state == *r.final_state);
}

RC_GTEST_PROP(KdaChunkwiseExact, FlaFormEqualsTheRecurrence, ()) {
  const Case c = random_case(40);
  ChunkwiseOptions copt;
  copt.form = ChunkForm::fla;
  copt.sub_chunk = *rc::gen::inRange(1, 5);
  copt.chunk_size = copt.sub_chunk * *rc::gen::inRange(1, 5);
  const auto r = recurrent_forward(c.in, c.opt);
  const auto w = chunkwise_forward(c.in, c.opt, copt);
  RC_ASSERT(w.out.o == r.o);
  RC_ASSERT(*w.out.final_state == *r.final_state);
}

// The forms at their own sizes (C = 16 Neumann; C = 64 from 16-token sub-chunks) on
// sequences that span several chunks and end in a partial one.
TEST(KdaChunkwiseExact, BothFormsAtTheirOwnChunkSizesEqualTheRecurrence) {
  const Inputs<Q> in = seeded_exact_inputs(test_seed(3), 150, 81);
  const auto r = recurrent_forward(in, exact_options());
  for (ChunkForm form : {ChunkForm::flashkda, ChunkForm::fla}) {
    ChunkwiseOptions copt;
    copt.form = form;
    const auto w = chunkwise_forward(in, exact_options(), copt);
    EXPECT_EQ(w.out.o, r.o) << to_string(form);
    EXPECT_EQ(*w.out.final_state, *r.final_state) << to_string(form);
  }
}

// Both forms compute the same mathematical stage tensors (where both have them), L is
// strictly lower triangular, INV (I + L) = I exactly, and the state entering each chunk is
// the recurrence's state after the chunk's previous token.
RC_GTEST_PROP(KdaChunkwiseExact, StagesAgreeBetweenFormsAndWithTheirDefinitions, ()) {
  Case c = random_case(30);
  c.opt.state_layout = StateLayout::k_first;
  const bool v_first = false;
  const std::int64_t N = c.in.initial_state->dim(0), HV = c.in.v.dim(2), K = c.in.q.dim(3), V = c.in.v.dim(3);
  c.in.initial_state = random_tensor({N, HV, K, V}, -4, 4);
  const std::int64_t sub = *rc::gen::inRange(1, 4);
  ChunkwiseOptions fk{ChunkForm::flashkda, sub * *rc::gen::inRange(1, 4), 16, true};
  ChunkwiseOptions fl{ChunkForm::fla, fk.chunk_size, sub, true};
  const auto a = chunkwise_forward(c.in, c.opt, fk), b = chunkwise_forward(c.in, c.opt, fl);
  const auto& sa = *a.stages;
  const auto& sb = *b.stages;
  RC_ASSERT(sa.decay == sb.decay);
  RC_ASSERT(sa.q_decay == sb.q_decay);
  RC_ASSERT(sa.k_decay == sb.k_decay);
  RC_ASSERT(sa.k_restore == sb.k_restore);
  RC_ASSERT(sa.L == sb.L);
  RC_ASSERT(sa.inv == sb.inv);
  RC_ASSERT(sa.m_qk == sb.m_qk);
  RC_ASSERT(sa.u == sb.u);
  RC_ASSERT(sa.chunk_states == sb.chunk_states);
  RC_ASSERT(sa.chunk_starts == sb.chunk_starts);

  auto opt = c.opt;
  opt.output_all_states = true;
  const auto r = recurrent_forward(c.in, opt);
  const std::int64_t C = sa.chunk_size;
  for (std::int64_t ci = 0; ci < sa.chunk_starts.dim(0); ++ci) {
    const std::int64_t bt = sa.chunk_starts(ci, 0), t0 = sa.chunk_starts(ci, 1), len = sa.chunk_starts(ci, 2);
    RC_ASSERT(len >= 1);
    RC_ASSERT(len <= C);
    // The sequence of this chunk: its first chunk starts at the sequence's first token.
    std::int64_t seq = bt, seq_begin = 0;
    if (c.in.cu_seqlens) {
      const auto& cu = *c.in.cu_seqlens;
      for (seq = 0; !(cu[seq] <= t0 && t0 < cu[seq + 1]); ++seq) {
      }
      seq_begin = cu[seq];
    }
    for (std::int64_t hv = 0; hv < HV; ++hv) {
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t j = 0; j < V; ++j) {
          const Q expected = t0 == seq_begin ? (*c.in.initial_state)(seq, hv, i, j) : (*r.all_states)(bt, t0 - 1, hv, i, j);
          RC_ASSERT(sa.chunk_states(ci, hv, v_first ? j : i, v_first ? i : j) == expected);
        }
      // L strictly lower, INV (I + L) = I on the chunk's c x c block.
      for (std::int64_t t = 0; t < len; ++t)
        for (std::int64_t s = 0; s < len; ++s) {
          if (s >= t) RC_ASSERT(sa.L(bt, t0 + t, hv, s) == Q(0));
          if (s > t) RC_ASSERT(sa.m_qk(bt, t0 + t, hv, s) == Q(0));
          Q prod(0);
          for (std::int64_t r2 = 0; r2 < len; ++r2)
            prod += sa.inv(bt, t0 + t, hv, r2) * ((r2 == s ? Q(1) : Q(0)) + sa.L(bt, t0 + r2, hv, s));
          RC_ASSERT(prod == (t == s ? Q(1) : Q(0)));
        }
    }
  }
}

// ---- Neumann doubling (proofs/neumann_doubling.md) -------------------------------------------

std::vector<Q> matmul(const std::vector<Q>& A, const std::vector<Q>& B, std::int64_t n) {
  std::vector<Q> C(n * n, Q(0));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t l = 0; l < n; ++l)
      for (std::int64_t j = 0; j < n; ++j) C[i * n + j] += A[i * n + l] * B[l * n + j];
  return C;
}

std::vector<Q> identity(std::int64_t n) {
  std::vector<Q> I(n * n, Q(0));
  for (std::int64_t i = 0; i < n; ++i) I[i * n + i] = Q(1);
  return I;
}

// A strictly lower triangular matrix with a nonzero subdiagonal, so L^(C-1) != 0: its
// (C-1, 0) entry is the product of the subdiagonal.
std::vector<Q> random_strictly_lower(std::int64_t C) {
  std::vector<Q> L(C * C, Q(0));
  for (std::int64_t i = 0; i < C; ++i)
    for (std::int64_t j = 0; j < i; ++j) {
      L[i * C + j] = small_rational(-3, 3);
      if (j == i - 1 && L[i * C + j] == 0) L[i * C + j] = Q(1) / Q(2);
    }
  return L;
}

TEST(KdaNeumann, FactorCountIsTheLeastMWithTwoToTheMAtLeastC) {
  // 2^m >= C: C = 1, 2 -> 1; 3, 4 -> 2; 5..8 -> 3; 9..16 -> 4 (FlashKDA: 3 doubling steps); 64 -> 6.
  EXPECT_EQ(neumann_factor_count(1), 1);
  EXPECT_EQ(neumann_factor_count(2), 1);
  EXPECT_EQ(neumann_factor_count(3), 2);
  EXPECT_EQ(neumann_factor_count(4), 2);
  EXPECT_EQ(neumann_factor_count(5), 3);
  EXPECT_EQ(neumann_factor_count(16), 4);
  EXPECT_EQ(neumann_factor_count(17), 5);
  EXPECT_EQ(neumann_factor_count(64), 6);
  EXPECT_THROW(neumann_factor_count(0), InvalidArgument);
}

RC_GTEST_PROP(KdaNeumann, DoublingWithTheCountedFactorsInvertsAndOneFewerDoesNot, ()) {
  const std::int64_t C = *rc::gen::inRange(1, 21);
  const std::vector<Q> L = random_strictly_lower(C);
  // L^C = 0.
  std::vector<Q> power = identity(C);
  for (std::int64_t i = 0; i < C; ++i) power = matmul(power, L, C);
  for (const Q& x : power) RC_ASSERT(x == Q(0));
  std::vector<Q> I_plus_L = L;
  for (std::int64_t i = 0; i < C; ++i) I_plus_L[i * C + i] += Q(1);
  const int m = neumann_factor_count(C);
  const auto inv = detail::inverse_by_neumann_doubling(contract::Exact{}, L, C, m);
  RC_ASSERT(matmul(inv, I_plus_L, C) == identity(C));
  RC_ASSERT(matmul(I_plus_L, inv, C) == identity(C));
  if (m > 1) {
    // One factor fewer sums (-L)^k for k < 2^(m-1) < C only: it misses (-L)^(C-1) != 0.
    const auto short_inv = detail::inverse_by_neumann_doubling(contract::Exact{}, L, C, m - 1);
    RC_ASSERT(matmul(short_inv, I_plus_L, C) != identity(C));
  }
  // Forward substitution gives the same inverse.
  RC_ASSERT(detail::inverse_by_forward_substitution(contract::Exact{}, L, C) == inv);
}

RC_GTEST_PROP(KdaNeumann, FlashKdaProductFormForC16, ()) {
  const std::int64_t C = 16;
  const std::vector<Q> L = random_strictly_lower(C);
  std::vector<Q> I_minus_L = identity(C), L2 = matmul(L, L, C), L4 = matmul(L2, L2, C), L8 = matmul(L4, L4, C);
  for (std::int64_t i = 0; i < C * C; ++i) I_minus_L[i] -= L[i];
  auto plus_identity = [&](std::vector<Q> X) {
    for (std::int64_t i = 0; i < C; ++i) X[i * C + i] += Q(1);
    return X;
  };
  const auto P = matmul(matmul(matmul(I_minus_L, plus_identity(L2), C), plus_identity(L4), C), plus_identity(L8), C);
  RC_ASSERT(matmul(P, plus_identity(L), C) == identity(C));
}

// ---- the inverse-decay overflow bound (proofs/inverse_decay_overflow.md) --------------------------

// Emulated fp32 kernel arithmetic: the per-step gate in base 2, g2 = fl32(-lambda log2 e),
// its chunk-local cumulative sum in fp32, and the inverse factor exp2(-G) rounded to the
// operand format. Finite over a span of s equal steps?
bool inverse_decay_finite(double lambda, std::int64_t span, num::Format format) {
  auto fp32 = [](double x) { return static_cast<double>(static_cast<float>(x)); };
  const double g2 = fp32(-lambda * fp32(1.4426950408889634));
  double G = 0;
  for (std::int64_t t = 0; t < span; ++t) G = fp32(G + g2);
  const double inverse = num::round_to(format, fp32(std::exp2(-G)));
  return std::isfinite(inverse);
}

double bisect_bound(std::int64_t span, num::Format format) {
  double lo = 0, hi = 4096;  // finite at lo, infinite at hi
  for (int i = 0; i < 100; ++i) {
    const double mid = 0.5 * (lo + hi);
    (inverse_decay_finite(mid, span, format) ? lo : hi) = mid;
  }
  return lo;
}

TEST(KdaInverseDecayOverflow, ClosedFormAgreesWithBisectionInEmulatedFp32) {
  std::printf("%-6s %5s %14s %14s\n", "format", "span", "closed form", "bisection");
  for (num::Format format : {num::Format::fp32, num::Format::bf16, num::Format::fp16})
    for (std::int64_t span : {1, 4, 8, 15, 16, 32, 64}) {
      const double closed = inverse_decay_overflow_bound(format, span);
      const double found = bisect_bound(span, format);
      std::printf("%-6s %5lld %14.6f %14.6f\n", num::format_info(format).name, static_cast<long long>(span), closed,
                  found);
      // Measured worst 5.6e-7 over these 21 formats and spans (2026-12-01); bound 4x.
      EXPECT_NEAR(found / closed, 1.0, 2.2e-6) << num::format_info(format).name << " span " << span;
    }
  // fp32's shape: 128 / (s log2 e) = 128 ln 2 / s, to 3 significant digits (C = 16: 5.545).
  for (std::int64_t span : {8, 15, 16})
    EXPECT_NEAR(inverse_decay_overflow_bound(num::Format::fp32, span) / (128 * std::log(2.0) / span), 1.0, 5e-4);
  EXPECT_NEAR(inverse_decay_overflow_bound(num::Format::fp32, 16), 5.545, 5e-4);
}

// The FlashKDA form itself, with fp32 decays (no flush), lower bound -5.5 vs -5.6 at a
// full chunk of 16 steps: 16 * 5.5 * log2 e = 127.0 < 128 keeps K_inv finite; 5.6 gives
// 129.3 > 128 and K_inv overflows. The FLA form never forms 1/a and stays finite.
TEST(KdaInverseDecayOverflow, FlashKdaFormOverflowsPastTheBoundAndFlaFormDoesNot) {
  contract::RoundingPolicy fp32_decays;
  fp32_decays.set(contract::Site::decay, contract::Precision::fp32).set(contract::Site::k_inv, contract::Precision::fp32);
  for (double lambda : {5.5, 5.6}) {
    Inputs<double> in;
    const std::int64_t T = 16, K = 2, V = 2;
    in.q = Tensor<double>({1, T, 1, K}, 0.5);
    in.k = Tensor<double>({1, T, 1, K}, 0.5);
    in.v = Tensor<double>({1, T, 1, V}, 1.0);
    in.g = Tensor<double>({1, T, 1, K}, -lambda);
    in.beta = Tensor<double>({1, T, 1}, 0.5);
    Options<double> opt;
    for (ChunkForm form : {ChunkForm::flashkda, ChunkForm::fla}) {
      ChunkwiseOptions copt{form, 16, 16, true};
      const auto w = chunkwise_forward(in, opt, copt, fp32_decays);
      bool k_inv_finite = true;
      for (double x : w.stages->k_inv.values()) k_inv_finite = k_inv_finite && std::isfinite(x);
      if (form == ChunkForm::flashkda) {
        EXPECT_EQ(k_inv_finite, lambda < inverse_decay_overflow_bound(num::Format::fp32, 16)) << lambda;
      } else {
        for (double x : w.out.o.values()) EXPECT_TRUE(std::isfinite(x)) << "fla form, lambda " << lambda;
      }
    }
  }
}

// ---- double against 256 bits; contracts --------------------------------------------------------

TEST(KdaChunkwiseDouble, BothFormsAgreeWithTheRecurrenceAt256Bits) {
  const Inputs<double> in = random_double_inputs(5, 80, 1, 2, 16, 16, -5, 0);
  Options<double> dopt;
  dopt.beta = BetaForm::sigmoid;
  dopt.qk_l2norm = true;
  Options<HP> hopt;
  hopt.beta = BetaForm::sigmoid;
  hopt.qk_l2norm = true;
  const auto ref = recurrent_forward(lift<HP>(in), hopt);
  for (ChunkForm form : {ChunkForm::flashkda, ChunkForm::fla}) {
    ChunkwiseOptions copt;
    copt.form = form;
    const auto w = chunkwise_forward(in, dopt, copt);
    const double e = rel_rms(w.out.o, ref.o), s = rel_rms(*w.out.final_state, *ref.final_state);
    std::printf("%-9s rel RMS of o %.3e, of the final state %.3e\n", std::string(to_string(form)).c_str(), e, s);
    // The inverse decays reach exp(5 * 16) ~ 5.5e34 times the forward ones; their product
    // cancels in double to a relative ~1e-16 per entry. Measured 2026-12-01 (these fixed
    // inputs, the forms in their kernels' order): FlashKDA 2.716e-16 (o), 2.326e-16 (state);
    // FLA 2.399e-16, 2.038e-16. Bound: 4x the worst, 1.08e-15.
    EXPECT_LT(e, 1.08e-15) << to_string(form);
    EXPECT_LT(s, 1.08e-15) << to_string(form);
  }
}

TEST(KdaChunkwiseDouble, ThreadCountNeverChangesTheResult) {
  const Inputs<double> in = random_double_inputs(9, 70, 2, 4, 8, 8, -2, 0);
  for (ChunkForm form : {ChunkForm::flashkda, ChunkForm::fla}) {
    Options<double> opt;
    ChunkwiseOptions copt;
    copt.form = form;
    const auto policy = contract::kernel_contract(contract::Kernel::flashkda);
    const auto one = chunkwise_forward(in, opt, copt, policy);
    opt.num_threads = 3;
    const auto many = chunkwise_forward(in, opt, copt, policy);
    EXPECT_EQ(one.out.o, many.out.o);
    EXPECT_EQ(*one.out.final_state, *many.out.final_state);
  }
}

bool representable(num::Format f, double x) { return num::round_to(f, x) == x; }

// The declared sites are where the values are rounded: stage tensors of the FlashKDA
// contract are exact in their declared formats.
TEST(KdaPrecisionContract, FlashKdaStagesAreRoundedToTheirDeclaredFormats) {
  const Inputs<double> in = random_double_inputs(13, 40, 1, 1, 16, 16, -5, 0);
  ChunkwiseOptions copt{ChunkForm::flashkda, 16, 16, true};
  const auto w = chunkwise_forward(in, Options<double>{}, copt, contract::kernel_contract(contract::Kernel::flashkda));
  const auto& s = *w.stages;
  for (double x : s.k_decay.values()) ASSERT_TRUE(representable(num::Format::bf16, x));
  for (double x : s.q_decay.values()) ASSERT_TRUE(representable(num::Format::bf16, x));
  for (double x : s.k_inv.values()) ASSERT_TRUE(representable(num::Format::bf16, x));
  for (double x : s.k_restore.values()) ASSERT_TRUE(representable(num::Format::bf16, x));
  for (double x : s.L.values()) ASSERT_TRUE(representable(num::Format::fp16, x));
  for (double x : s.inv.values()) ASSERT_TRUE(representable(num::Format::bf16, x));  // fp16 inside, stored bf16
  for (double x : s.decay.values()) ASSERT_TRUE(representable(num::Format::fp32, x) && (x == 0 || x >= 0x1p-126));
  for (double x : s.chunk_states.values()) ASSERT_TRUE(representable(num::Format::bf16, x));
  for (double x : w.out.o.values()) ASSERT_TRUE(representable(num::Format::bf16, x));
  // Rounding costs accuracy, but not more than a bf16 pipeline should: against the exact form.
  const auto exact = chunkwise_forward(in, Options<double>{}, copt);
  double e2 = 0, r2 = 0;
  for (std::int64_t i = 0; i < w.out.o.numel(); ++i) {
    e2 += std::pow(w.out.o.data()[i] - exact.out.o.data()[i], 2);
    r2 += std::pow(exact.out.o.data()[i], 2);
  }
  // Measured 4.72e-3 (2026-12-01): within 4x either way.
  EXPECT_GT(std::sqrt(e2 / r2), 1.18e-3);  // bf16 output alone gives ~1e-3
  EXPECT_LT(std::sqrt(e2 / r2), 1.88e-2);
}

// ---- arguments -----------------------------------------------------------------------------------

TEST(KdaChunkwiseArguments, ErrorsNameTheArgument) {
  const Inputs<double> in = random_double_inputs(1, 8, 1, 1, 4, 4, -1, 0);
  auto expect_error = [&](const ChunkwiseOptions& copt, const Options<double>& opt, const std::string& needle) {
    try {
      chunkwise_forward(in, opt, copt);
      ADD_FAILURE() << "expected an error naming " << needle;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(ChunkwiseOptions{ChunkForm::fla, 64, 10, false}, {}, "'sub_chunk'");
  expect_error(ChunkwiseOptions{ChunkForm::flashkda, -1, 16, false}, {}, "'chunk_size'");
  Options<double> all;
  all.output_all_states = true;
  expect_error(ChunkwiseOptions{}, all, "'output_all_states'");
}

}  // namespace
}  // namespace k3ref::kda
