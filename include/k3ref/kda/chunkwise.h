// The chunkwise (UT transform) forms of KDA, the algorithm kernels implement
// (docs/chunkwise.md; proofs/chunkwise_equals_recurrence.md shows it is the recurrence).
//
// Within a chunk of c <= C tokens entering with state S_in (K x V), a_t the cumulative
// decay from the chunk's first token up to t (inclusive), q already scaled:
//   K_decay = a ⊙ K,  Q_decay = a ⊙ Q,  K_inv = K / a,  K_restore = a_last ⊙ K_inv
//   L    = StrictTril(Diag(beta) K_decay K_inv^T),   INV = (I + L)^-1
//   M_qk = tril(Q_decay K_inv^T)
//   U = INV Diag(beta) (V - K_decay S_in),  O = Q_decay S_in + M_qk U,
//   S_out = Diag(a_last) S_in + K_restore^T U.
// Two variants compute those quantities differently, each in its kernel's order of
// operations (so that a kernel's precision contract is this algorithm with a rounding
// policy, kda/kernel_contracts.h):
//   * ChunkForm::flashkda (C = 16), as MoonshotAI/FlashKDA computes it: its "prepare" stage
//     (a, K_decay, Q_decay = (a ⊙ Q) scale, K_inv, K_restore, L, INV, M_qk; its first kernel)
//     then the "recurrence" stage (U, O, S per chunk; its second kernel). INV by Neumann
//     doubling, accumulated as P <- P + P L^(2^j); O as the sum of its two partial outputs
//     Q_decay S_in and M_qk U; S_out = S_in a_last + K_restore^T U with the product first.
//     K_inv uses the inverse decays 1/a, which overflow for steep gates
//     (proofs/inverse_decay_overflow.md).
//   * ChunkForm::fla (C = 64), as FLA's chunk_kda computes it. Never forms 1/a: every decay
//     factor is a ratio a_t / a_s with s <= t. Inside a 16-token sub-chunk the ratio is formed
//     pairwise (product of the decays s+1..t); across sub-chunks it is split at the later
//     sub-chunk's first row f: (a_t / a_f)(a_f / a_s), both factors <= 1. beta enters the
//     k-k products (G is Diag(beta) K_decay K_inv^T), the scale multiplies the products with
//     q (M_qk and Q_decay S_in), not q. INV by forward substitution of each sub-chunk, merged
//     block by block (FLA's solve_tril); the state-independent parts W = INV Diag(beta)
//     K_decay and U' = INV Diag(beta) V are formed first, then U = U' - W S_in. With
//     `safe_gate` the diagonal sub-chunks go through an anchor row (FLA's safe_gate=True).
// Both are one template over the scalar and a rounding policy (kda/rounding.h): with
// contract::Exact and rationals they equal the recurrence exactly. The stage functions name
// the kernel source each order models: FlashKDA at 1ce47ea (csrc/smxx/), FLA at bc3b101d
// (fla/ops/).
#pragma once

#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "k3ref/kda/rounding.h"
#include "k3ref/kda/recurrent.h"

#if K3REF_HAVE_EIGEN
#include <Eigen/Core>
#endif

namespace k3ref::kda {

enum class ChunkForm { flashkda, fla };
inline constexpr Choices<ChunkForm, 2> chunk_forms{
    "chunk_form", {{{ChunkForm::flashkda, "flashkda", "inverse-decay form, C = 16"},
                    {ChunkForm::fla, "fla", "FLA's sub-chunked form, C = 64"}}}};
inline std::string_view to_string(ChunkForm form) { return chunk_forms.name(form); }

struct ChunkwiseOptions {
  ChunkForm form = ChunkForm::flashkda;
  std::int64_t chunk_size = 0;   // 0: the form's own, 16 (FlashKDA) or 64 (FLA)
  std::int64_t sub_chunk = 16;   // FLA form: rows per sub-chunk; must divide the chunk size
  bool record_stages = false;    // fill ChunkwiseOutputs::stages
  bool safe_gate = false;        // FLA form: diagonal sub-chunks through an anchor row (FLA's safe_gate=True)
};

// The chunk size actually used.
std::int64_t effective_chunk_size(const ChunkwiseOptions&);

// The largest chunk_size the chunk forms take (validate_chunkwise refuses more).
inline constexpr std::int64_t max_chunk_size = 1024;

// Factors of the Neumann doubling product (I - L)(I + L^2)...(I + L^(2^(m-1))) that give
// (I + L)^-1 for a strictly lower triangular C x C matrix L: the least m >= 1 with
// 2^m >= C. The doubling steps (squarings) are m - 1; FlashKDA's C = 16 needs m = 4,
// three steps. proofs/neumann_doubling.md.
int neumann_factor_count(std::int64_t C);

// The inverse-decay overflow bound (proofs/inverse_decay_overflow.md). A gate bounded by
// g >= -lambda per step (natural log, lambda = |lower_bound|) makes the inverse decay over
// a span of s steps at most exp(lambda s); it stays finite in `format` iff
// lambda s < ln(threshold), threshold = max_finite + ulp(max_finite) / 2, the least real
// that rounds to infinity. Returns ln(threshold) / s: for fp32 and bf16 about
// 128 / (s log2 e), for fp16 about 16 / (s log2 e).
double inverse_decay_overflow_bound(num::Format format, std::int64_t span);

// Per-stage tensors, for checking a kernel's stages one by one. Token-indexed tensors are
// [B, T, HV, X]; the C x C chunk matrices are [B, T, HV, C], row t of its chunk's matrix
// (columns local to the chunk, zero beyond a partial chunk's length).
template <class S>
struct ChunkStages {
  std::int64_t chunk_size = 0;
  Tensor<S> decay;       // [B, T, HV, K] a_t, cumulative decay from the chunk's first token, inclusive
  Tensor<S> q_decay;     // [B, T, HV, K] a ⊙ (scale q)
  Tensor<S> k_decay;     // [B, T, HV, K] a ⊙ k
  Tensor<S> k_inv;       // [B, T, HV, K] k / a (FlashKDA form only; empty in the FLA form)
  Tensor<S> k_restore;   // [B, T, HV, K] (a_last / a) ⊙ k
  Tensor<S> L;           // [B, T, HV, C]
  Tensor<S> inv;         // [B, T, HV, C]
  Tensor<S> m_qk;        // [B, T, HV, C]
  Tensor<S> w;           // [B, T, HV, K] FLA form only: INV Diag(beta) K_decay
  Tensor<S> u_pre;       // [B, T, HV, V] FLA form only: INV Diag(beta) V
  Tensor<S> u;           // [B, T, HV, V] U of each chunk
  Tensor<S> chunk_states;  // [chunks, HV, K, V] (V-first from chunkwise_forward if the options say so): state entering each chunk
  Tensor<std::int64_t> chunk_starts;  // [chunks, 3]: batch row, first token, length
};

// Calls f(name, tensor) for each floating-point stage tensor the form has (a tensor of rank 0
// is one it does not have), in the order and under the names of the stage goldens
// (docs/chunkwise.md); `chunk_starts` is the integer index beside them.
template <class S, class F>
void for_each_stage(const ChunkStages<S>& st, F&& f) {
  const std::pair<const char*, const Tensor<S>*> stages[] = {
      {"decay", &st.decay}, {"q_decay", &st.q_decay}, {"k_decay", &st.k_decay}, {"k_inv", &st.k_inv},
      {"k_restore", &st.k_restore}, {"L", &st.L}, {"INV", &st.inv}, {"M_qk", &st.m_qk}, {"w", &st.w},
      {"u_pre", &st.u_pre}, {"u", &st.u}, {"chunk_states", &st.chunk_states}};
  for (const auto& [name, t] : stages)
    if (t->rank() != 0) f(name, *t);
}

template <class S>
struct ChunkwiseOutputs {
  Outputs<S> out;  // o and final_state as the recurrence gives them (all_states is not supported)
  std::optional<ChunkStages<S>> stages;
};

namespace detail {

// C [+]= op(A) B for a short inner dimension: each block of N columns of a row of C is
// accumulated in num::Lanes (registers, for double) over l = 0..k-1 in order, exactly the
// operations of gemm's plain loop. Four rows at a time share the loads of B and give four
// independent chains of additions. Needs n % N == 0.
template <class S, int N>
void gemm_rows_in_lanes(std::int64_t m, std::int64_t n, std::int64_t k, const S* A, bool trans_a, const S* B, S* C,
                        bool accumulate) {
  using L = num::Lanes<S, N>;
  auto a_at = [&](std::int64_t i, std::int64_t l) -> const S& { return trans_a ? A[l * m + i] : A[i * k + l]; };
  auto start = [&](std::int64_t i, std::int64_t j0) { return accumulate ? L::load(C + i * n + j0) : L::splat(S(0)); };
  std::int64_t i = 0;
  for (; i + 4 <= m; i += 4)
    for (std::int64_t j0 = 0; j0 < n; j0 += N) {
      L s0 = start(i, j0), s1 = start(i + 1, j0), s2 = start(i + 2, j0), s3 = start(i + 3, j0);
      for (std::int64_t l = 0; l < k; ++l) {
        const L b = L::load(B + l * n + j0);
        s0.add_scaled(a_at(i, l), b);
        s1.add_scaled(a_at(i + 1, l), b);
        s2.add_scaled(a_at(i + 2, l), b);
        s3.add_scaled(a_at(i + 3, l), b);
      }
      s0.store(C + i * n + j0);
      s1.store(C + (i + 1) * n + j0);
      s2.store(C + (i + 2) * n + j0);
      s3.store(C + (i + 3) * n + j0);
    }
  for (; i < m; ++i)
    for (std::int64_t j0 = 0; j0 < n; j0 += N) {
      L s0 = start(i, j0);
      for (std::int64_t l = 0; l < k; ++l) s0.add_scaled(a_at(i, l), L::load(B + l * n + j0));
      s0.store(C + i * n + j0);
    }
}

// C (m x n) = [C +] op(A) op(B), op(X) = X or X^T as flagged; A is m x k (k x m when
// transposed), B k x n (n x k when transposed), all row-major. Each partial sum is rounded
// at `acc` by the policy, in the order l = 0..k-1 from zero (or from C). In double with the
// exact policy Eigen's blocked product does it, or gemm_rows_in_lanes when the inner
// dimension is at most 16.
template <class S, class Policy>
void gemm(const Policy& pol, contract::Site acc, std::int64_t m, std::int64_t n, std::int64_t k, const S* A,
          bool trans_a, const S* B, bool trans_b, S* C, bool accumulate) {
  if constexpr (std::is_same_v<S, double> && Policy::is_identity) {
    // FlashKDA's chunk (C = 16) multiplies by c x c factors and by K_restore^T (k = c):
    // with so short an inner dimension Eigen's packing costs more than the product, and
    // the accumulators of a row fit in registers.
    if (!trans_b && k <= 16 && n % 8 == 0) return gemm_rows_in_lanes<S, 8>(m, n, k, A, trans_a, B, C, accumulate);
  }
#if K3REF_HAVE_EIGEN
  if constexpr (std::is_same_v<S, double> && Policy::is_identity) {
    using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using CMap = Eigen::Map<const Mat>;
    Eigen::Map<Mat> c(C, m, n);
    if (m == 0 || n == 0) return;
    if (k == 0) {
      if (!accumulate) c.setZero();
      return;
    }
    auto run = [&](const auto& a, const auto& b) {
      if (accumulate)
        c.noalias() += a * b;
      else
        c.noalias() = a * b;
    };
    if (!trans_a && !trans_b) run(CMap(A, m, k), CMap(B, k, n));
    else if (!trans_a && trans_b) run(CMap(A, m, k), CMap(B, n, k).transpose());
    else if (trans_a && !trans_b) run(CMap(A, k, m).transpose(), CMap(B, k, n));
    else run(CMap(A, k, m).transpose(), CMap(B, n, k).transpose());
    return;
  }
#endif
  if (!accumulate)
    for (std::int64_t i = 0; i < m * n; ++i) C[i] = S(0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t l = 0; l < k; ++l) {
      const S a = trans_a ? A[l * m + i] : A[i * k + l];
      S* __restrict row = C + i * n;
      if (trans_b) {
        for (std::int64_t j = 0; j < n; ++j) row[j] = pol.round(acc, row[j] + a * B[j * k + l]);
      } else {
        const S* __restrict brow = B + l * n;
        for (std::int64_t j = 0; j < n; ++j) row[j] = pol.round(acc, row[j] + a * brow[j]);
      }
    }
}

template <class S, class Policy>
void round_all(const Policy& pol, contract::Site site, S* x, std::int64_t n) {
  if constexpr (!Policy::is_identity)
    for (std::int64_t i = 0; i < n; ++i) x[i] = pol.round(site, x[i]);
}

template <class S, class Policy>
void round_all(const Policy& pol, contract::Site site, std::vector<S>& x) {
  round_all(pol, site, x.data(), static_cast<std::int64_t>(x.size()));
}

// (I + L)^-1 by Neumann doubling, as FlashKDA accumulates it (utils.cuh, neumann_inv_fused_1warp,
// called at fwd_kernel1.cuh:513): P = I - L, then P <- P + P L^(2^j) for j = 1..m-1
// (= P (I + L^(2^j))), L^(2^j) by squaring. Writes P
// (c x c); `work` is scratch of 2 c x c matrices (no allocation per chunk).
template <class S, class Policy>
void inverse_by_neumann_doubling_into(const Policy& pol, const S* L, std::int64_t c, int factors, S* P, S* work) {
  using contract::Site;
  const std::int64_t cc = c * c;
  S* power = work;             // L^(2^step)
  S* product = work + cc;      // the squaring, then P L^(2^step)
  for (std::int64_t i = 0; i < c; ++i)
    for (std::int64_t j = 0; j < c; ++j) P[i * c + j] = (i == j ? S(1) : S(0)) - L[i * c + j];
  round_all(pol, Site::inv, P, cc);
  std::copy(L, L + cc, power);
  for (int step = 1; step < factors; ++step) {
    gemm(pol, Site::inv_accumulate, c, c, c, power, false, power, false, product, false);
    round_all(pol, Site::inv, product, cc);
    std::copy(product, product + cc, power);
    gemm(pol, Site::inv_accumulate, c, c, c, P, false, power, false, product, false);
    round_all(pol, Site::inv, product, cc);
    for (std::int64_t i = 0; i < cc; ++i) P[i] = pol.round(Site::inv, P[i] + product[i]);
  }
}

template <class S, class Policy>
std::vector<S> inverse_by_neumann_doubling(const Policy& pol, const std::vector<S>& L, std::int64_t c, int factors) {
  std::vector<S> P(c * c), work(2 * c * c);
  inverse_by_neumann_doubling_into(pol, L.data(), c, factors, P.data(), work.data());
  return P;
}

// (I + L)^-1 by forward substitution: X[t, s] = -sum_{s <= r < t} L[t, r] X[r, s], the sum
// taken in order r = s..t-1 and held in X's row t. The loop runs r outside s, so the inner
// loop is a vectorisable row update; each element still sees the same operations in the
// same order. Reads and writes rows of stride `ld` (a c x c block of a larger matrix).
template <class S, class Policy>
void inverse_by_forward_substitution_into(const Policy& pol, const S* L, std::int64_t c, S* X,
                                          std::int64_t ld = 0) {
  using contract::Site;
  if (ld == 0) ld = c;
  for (std::int64_t t = 0; t < c; ++t)
    for (std::int64_t s = 0; s < c; ++s) X[t * ld + s] = S(0);
  for (std::int64_t t = 0; t < c; ++t) {
    S* __restrict acc = X + t * ld;
    for (std::int64_t r = 0; r < t; ++r) {
      const S l = L[t * ld + r];
      const S* __restrict xr = X + r * ld;
      for (std::int64_t s = 0; s <= r; ++s) acc[s] = pol.round(Site::inv_accumulate, acc[s] - l * xr[s]);
    }
    for (std::int64_t s = 0; s < t; ++s) acc[s] = pol.round(Site::inv, acc[s]);
    acc[t] = S(1);
  }
}

template <class S, class Policy>
std::vector<S> inverse_by_forward_substitution(const Policy& pol, const std::vector<S>& L, std::int64_t c) {
  std::vector<S> X(c * c);
  inverse_by_forward_substitution_into(pol, L.data(), c, X.data());
  return X;
}

// (I + L)^-1 as FLA's chunk_kda forms it (its solve_tril, fused in
// kda/chunk_intra.py:315-343): each sub x sub diagonal block by forward substitution, then block (a, b) below the diagonal as -X_aa (L_ab X_bb) ... for
// b = a - 1 as (X_aa L_ab) X_bb, otherwise -X_aa (sum_{b <= l < a} L_al X_lb), every product
// with its operands rounded at inv_operand (tf32 in FLA's merges) and its sums at
// inv_accumulate. With one block it is the forward substitution.
template <class S, class Policy>
void inverse_by_block_merges_into(const Policy& pol, const S* L, std::int64_t c, std::int64_t sub, S* X) {
  using contract::Site;
  const std::int64_t nb = (c + sub - 1) / sub;
  auto lo = [&](std::int64_t b) { return b * sub; };
  auto size = [&](std::int64_t b) { return std::min(c, (b + 1) * sub) - b * sub; };
  for (std::int64_t i = 0; i < c * c; ++i) X[i] = S(0);
  for (std::int64_t b = 0; b < nb; ++b)
    inverse_by_forward_substitution_into(pol, L + lo(b) * c + lo(b), size(b), X + lo(b) * c + lo(b), c);
  using Block = std::vector<S>;
  auto block_of = [&](const S* M, std::int64_t a, std::int64_t b) {
    Block out(size(a) * size(b));
    for (std::int64_t t = 0; t < size(a); ++t)
      for (std::int64_t s = 0; s < size(b); ++s)
        out[t * size(b) + s] = pol.round(Site::inv_operand, M[(lo(a) + t) * c + lo(b) + s]);
    return out;
  };
  auto mul = [&](Block A, Block B, std::int64_t rows, std::int64_t inner, std::int64_t cols) {
    round_all(pol, Site::inv_operand, A);
    round_all(pol, Site::inv_operand, B);
    Block R(rows * cols);
    gemm(pol, Site::inv_accumulate, rows, cols, inner, A.data(), false, B.data(), false, R.data(), false);
    return R;
  };
  for (std::int64_t a = 1; a < nb; ++a)
    for (std::int64_t b = a - 1; b >= 0; --b) {
      Block R;
      if (b == a - 1) {
        R = mul(mul(block_of(X, a, a), block_of(L, a, b), size(a), size(a), size(b)), block_of(X, b, b), size(a),
                size(b), size(b));
      } else {
        Block sum(size(a) * size(b), S(0));
        for (std::int64_t l = b; l < a; ++l) {
          const Block t = mul(block_of(L, a, l), block_of(X, l, b), size(a), size(l), size(b));
          for (std::size_t z = 0; z < sum.size(); ++z) sum[z] = pol.round(Site::inv_accumulate, sum[z] + t[z]);
        }
        R = mul(block_of(X, a, a), sum, size(a), size(a), size(b));
      }
      for (std::int64_t t = 0; t < size(a); ++t)
        for (std::int64_t s = 0; s < size(b); ++s)
          X[(lo(a) + t) * c + lo(b) + s] = pol.round(Site::inv, -R[t * size(b) + s]);
    }
}

// The product of the per-step decays d[u * K + i] over u in (from, to], in increasing u from
// one (the exact decay ratio a_to / a_from; the kernels take exp2 of a difference of
// cumulative log decays, one correctly rounded value, which a policy's round at `decay` of
// this product models).
template <class S>
S decay_ratio(const S* step_decay, std::int64_t K, std::int64_t from, std::int64_t to, std::int64_t i) {
  S p(1);
  for (std::int64_t u = from + 1; u <= to; ++u) p *= step_decay[u * K + i];
  return p;
}

}  // namespace detail

namespace detail {

// Scratch of one (sequence, value head) item: allocated once, reused by every chunk.
// Blocks are row-major, c x K, c x V or c x c for the c <= C tokens of a chunk.
template <class S>
struct ChunkScratch {
  // The chunk's inputs, gathered and rounded at `input`: q_t (unscaled), k_t, v_t, beta_t,
  // and the per-token decay a_t / a_{t-1}.
  std::vector<S> q, k, v, beta, step_decay;
  std::vector<S> decay_product;  // a_t as the exact running product of the step decays
  std::vector<S> decay;          // a_t rounded at `decay`: the cumulative decay from the chunk's first token
  // The two operands that multiply the entering state, stacked so that one product gives
  // both (each row of a product is computed on its own, so stacking changes no operation):
  // rows 0..c-1 hold K_decay (FlashKDA) or W (FLA), rows c..2c-1 Q_decay.
  std::vector<S> state_operands;
  std::vector<S> k_decay_record;  // FLA: K_decay, formed only for the stage record
  std::vector<S> k_inv;           // FlashKDA: K / a
  std::vector<S> k_restore;       // (a_last / a) K
  std::vector<S> gram;  // [G; M]: G[t, s] = sum_i k_t k_s a_t / a_s (s < t; FLA: times beta_t), M with q_t (s <= t)
  std::vector<S> L;     // StrictTril(Diag(beta) G)
  std::vector<S> inv, inv_work;   // INV = (I + L)^-1; the Neumann doubling's two c x c work matrices
  std::vector<S> w_operand, u_pre;  // FLA: (beta K) a, the operand of W; U' = INV Diag(beta) V
  std::vector<S> rhs;   // FlashKDA: Diag(beta) (V - K_decay S_in); FLA: Diag(beta) V
  std::vector<S> u;     // U
  std::vector<S> state_products;  // [K_decay S_in (or W S_in); Q_decay S_in], rows c..2c-1 then O
  std::vector<S> state_operand;   // FLA: the entering state as an operand (a policy may round it)
  std::vector<S> partial;         // FlashKDA: M_qk U; K_restore^T U
  // FLA's decay ratios: a running per-channel ratio, the operands and result of the product of
  // a sub-chunk against the earlier rows, and the pairwise ratios inside a diagonal sub-chunk
  // ([channel][column] so that a row's columns advance together).
  std::vector<S> ratio, offdiag_rows, offdiag_cols, offdiag_gram, diag_ratio, diag_k, diag_g, diag_m;

  ChunkScratch(std::int64_t C, std::int64_t K, std::int64_t V, std::int64_t sub)
      : q(C * K), k(C * K), v(C * V), beta(C), step_decay(C * K), decay_product(C * K), decay(C * K),
        state_operands(2 * C * K), k_decay_record(C * K), k_inv(C * K), k_restore(C * K), gram(2 * C * C),
        L(C * C), inv(C * C), inv_work(2 * C * C), w_operand(C * K), u_pre(C * V), rhs(C * V), u(C * V),
        state_products(2 * C * V), state_operand(K * V), partial(std::max(C, K) * V), ratio(K),
        offdiag_rows(2 * sub * K), offdiag_cols(C * K), offdiag_gram(2 * sub * C), diag_ratio(K * sub),
        diag_k(K * sub), diag_g(sub), diag_m(sub) {}
};

// Where a chunk lies: batch row, q/k head, value head, first token, length, chunk number.
struct ChunkAt {
  std::int64_t b, h, hv, t0, c, chunk;
};

// What the chunk stages read and write besides the scratch; `scale` as the policy holds it.
template <class S>
struct ChunkIo {
  const PreparedInputs<S>& p;
  std::int64_t K, V;
  Tensor<S>& o;
  ChunkStages<S>* stages;  // null unless recorded
  S scale;
};

// Stage 1 (both forms): gather the chunk's inputs; a_t rounded from the running product.
// (Separate loops over restrict pointers, so that each is one vector loop.)
template <class S, class Policy>
void gather_chunk(const Policy& pol, const ChunkIo<S>& io, const ChunkAt& at, ChunkScratch<S>& x) {
  using contract::Site;
  const PreparedInputs<S>& p = io.p;
  const std::int64_t K = io.K, V = io.V, c = at.c;
  for (std::int64_t t = 0; t < c; ++t) {
    const S* __restrict q = p.q.data() + p.q.offset(at.b, at.t0 + t, at.h, 0);
    const S* __restrict k = p.k.data() + p.k.offset(at.b, at.t0 + t, at.h, 0);
    const S* __restrict v = p.v.data() + p.v.offset(at.b, at.t0 + t, at.hv, 0);
    const S* __restrict g = p.decay.data() + p.decay.offset(at.b, at.t0 + t, at.hv, 0);
    S* __restrict run = x.decay_product.data() + t * K;
    S* __restrict a_t = x.decay.data() + t * K;
    for (std::int64_t i = 0; i < K; ++i) x.q[t * K + i] = pol.round(Site::input, q[i]);
    for (std::int64_t i = 0; i < K; ++i) x.k[t * K + i] = pol.round(Site::input, k[i]);
    for (std::int64_t j = 0; j < V; ++j) x.v[t * V + j] = pol.round(Site::input, v[j]);
    std::copy(g, g + K, x.step_decay.begin() + t * K);
    if (t == 0) {
      std::copy(g, g + K, run);
    } else {
      const S* __restrict run_prev = run - K;
      for (std::int64_t i = 0; i < K; ++i) run[i] = run_prev[i] * g[i];
    }
    for (std::int64_t i = 0; i < K; ++i) a_t[i] = pol.round(Site::decay, run[i]);
    x.beta[t] = p.beta(at.b, at.t0 + t, at.hv);
  }
}

// Stage 2, FlashKDA: the decays as operands (rounded again), K_decay = a ⊙ K,
// Q_decay = (a ⊙ Q) scale, K_inv = K / a from the inverse decays 1 / a, K_restore =
// a_last ⊙ K_inv (fwd_kernel1.cuh:452-467), and [G; M] = [K_decay; Q_decay] K_inv^T in one
// product (its two MMAs, fwd_kernel1.cuh:483-485).
template <class S, class Policy>
void gram_by_inverse_decays(const Policy& pol, const ChunkIo<S>& io, std::int64_t c, ChunkScratch<S>& x) {
  using contract::Site;
  const std::int64_t K = io.K;
  S* __restrict kd = x.state_operands.data();
  S* __restrict qd = x.state_operands.data() + c * K;
  S* __restrict ki = x.k_inv.data();
  const S* __restrict run = x.decay_product.data();
  const S* __restrict aa = x.decay.data();
  for (std::int64_t i = 0; i < c * K; ++i) {
    const S a = pol.round(Site::decay_operand, aa[i]);
    const S ai = pol.round(Site::decay_operand, pol.round(Site::decay, S(1) / run[i]));
    kd[i] = pol.round(Site::k_decay, x.k[i] * a);
    qd[i] = pol.round(Site::q_decay, pol.round(Site::q_decay, x.q[i] * a) * io.scale);
    ki[i] = pol.round(Site::k_inv, x.k[i] * ai);
  }
  S* __restrict kr = x.k_restore.data();
  const S* __restrict a_last = x.decay.data() + (c - 1) * K;
  for (std::int64_t t = 0; t < c; ++t)
    for (std::int64_t i = 0; i < K; ++i)
      kr[t * K + i] = pol.round(Site::k_restore, ki[t * K + i] * pol.round(Site::decay_operand, a_last[i]));
  gemm(pol, Site::intra_accumulate, 2 * c, c, K, x.state_operands.data(), false, x.k_inv.data(), true,
       x.gram.data(), false);
}

// Stage 2, FLA, the diagonal sub-chunk [f, e) (kda/chunk_intra_token_parallel.py: beta on
// k_t at :111, the scale after the sum at :119): pairwise ratios, the product of the decays
// s+1..t, rounded at `decay`, times k_s (rounded at intra_accumulate, as FLA's fp32
// registers hold it); G from beta_t k_t, M from q_t, then M times the scale. For each row t
// all columns s = f..t advance together (x = s - f is the inner, vectorisable index); for
// each pair the ratio is still the product of the decays in order s+1..t and the sums run
// over i in order.
template <class S, class Policy>
void gram_diagonal_block(const Policy& pol, const ChunkIo<S>& io, std::int64_t c, std::int64_t sub, std::int64_t f,
                         std::int64_t e, ChunkScratch<S>& x) {
  using contract::Site;
  const std::int64_t K = io.K;
  S* const G = x.gram.data();
  S* const M = x.gram.data() + c * c;
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t col = 0; col < e - f; ++col) {
      x.diag_ratio[i * sub + col] = S(1);
      x.diag_k[i * sub + col] = x.k[(f + col) * K + i];
    }
  for (std::int64_t t = f; t < e; ++t) {
    const std::int64_t xt = t - f;
    for (std::int64_t i = 0; i < K; ++i) {
      S* __restrict r = x.diag_ratio.data() + i * sub;
      const S dt = x.step_decay[t * K + i];
      for (std::int64_t col = 0; col < xt; ++col) r[col] = r[col] * dt;
    }
    for (std::int64_t col = 0; col <= xt; ++col) x.diag_g[col] = x.diag_m[col] = S(0);
    for (std::int64_t i = 0; i < K; ++i) {
      const S* __restrict r = x.diag_ratio.data() + i * sub;
      const S* __restrict ks = x.diag_k.data() + i * sub;
      S* __restrict gk = x.diag_g.data();
      S* __restrict mq = x.diag_m.data();
      const S kt = pol.round(Site::intra_accumulate, x.k[t * K + i] * x.beta[t]), qt = x.q[t * K + i];
      for (std::int64_t col = 0; col <= xt; ++col) {
        const S kr = pol.round(Site::intra_accumulate, ks[col] * pol.round(Site::decay, r[col]));
        gk[col] = pol.round(Site::intra_accumulate, gk[col] + kt * kr);
        mq[col] = pol.round(Site::intra_accumulate, mq[col] + qt * kr);
      }
    }
    for (std::int64_t col = 0; col <= xt; ++col) {
      if (col < xt) G[t * c + f + col] = x.diag_g[col];
      M[t * c + f + col] = pol.round(Site::intra_accumulate, x.diag_m[col] * io.scale);
    }
  }
}

// Stage 2, FLA with safe_gate, the diagonal sub-chunk [f, e): every factor through the anchor
// row a = f + min(sub / 2, rows - 1) (kda/chunk_intra.py:746) (a later row for the first half of the sub-chunk, so
// its ratios a_t / a_anchor exceed one there): q_t a_t / a_a, k_t a_t / a_a and
// k_s a_a / a_s, each rounded at intra_operand, one product for G (then times beta_t) and M.
template <class S, class Policy>
void gram_diagonal_block_through_anchor(const Policy& pol, const ChunkIo<S>& io, std::int64_t c, std::int64_t sub,
                                        std::int64_t f, std::int64_t e, ChunkScratch<S>& x) {
  using contract::Site;
  const std::int64_t K = io.K, rows = e - f, a = f + std::min<std::int64_t>(sub / 2, rows - 1);
  const S* d = x.step_decay.data();
  auto ratio = [&](std::int64_t from, std::int64_t to, std::int64_t i) {  // a_to / a_from, either order
    return from <= to ? pol.round(Site::decay, decay_ratio(d, K, from, to, i))
                      : pol.round(Site::decay, S(1) / decay_ratio(d, K, to, from, i));
  };
  S* qa = x.offdiag_rows.data();
  S* ka = x.offdiag_rows.data() + rows * K;
  S* kb = x.offdiag_cols.data();
  for (std::int64_t t = f; t < e; ++t)
    for (std::int64_t i = 0; i < K; ++i) {
      const S to_anchor = ratio(a, t, i);
      qa[(t - f) * K + i] = pol.round(Site::intra_operand, x.q[t * K + i] * to_anchor);
      ka[(t - f) * K + i] = pol.round(Site::intra_operand, x.k[t * K + i] * to_anchor);
      kb[(t - f) * K + i] = pol.round(Site::intra_operand, x.k[t * K + i] * ratio(t, a, i));
    }
  S* const G = x.gram.data();
  S* const M = x.gram.data() + c * c;
  gemm(pol, Site::intra_accumulate, 2 * rows, rows, K, x.offdiag_rows.data(), false, kb, true, x.offdiag_gram.data(),
       false);
  for (std::int64_t t = f; t < e; ++t)
    for (std::int64_t s = f; s <= t; ++s) {
      M[t * c + s] = pol.round(Site::intra_accumulate, x.offdiag_gram[(t - f) * rows + s - f] * io.scale);
      if (s < t)
        G[t * c + s] = pol.round(Site::intra_accumulate, x.offdiag_gram[(rows + t - f) * rows + s - f] * x.beta[t]);
    }
}

// Stage 2, FLA, sub-chunk [f, e) against all earlier rows [0, f) (kda/chunk_intra.py:161-218,
// stored with the scale at :225 and beta after): the ratio split at row f,
// (a_t / a_f)(a_f / a_s), both factors <= 1, each rounded at `decay` and its product with
// q or k at intra_operand; G then times beta_t and M times the scale. The k and q operands
// are stacked (rows 0..rows-1 and rows..2 rows-1 of offdiag_rows) so that one product gives
// both blocks.
template <class S, class Policy>
void gram_block_against_earlier_rows(const Policy& pol, const ChunkIo<S>& io, std::int64_t c, std::int64_t f,
                                     std::int64_t e, ChunkScratch<S>& x) {
  using contract::Site;
  const std::int64_t K = io.K;
  S* const G = x.gram.data();
  S* const M = x.gram.data() + c * c;
  const std::int64_t rows = e - f;
  S* k_rows = x.offdiag_rows.data();
  S* q_rows = x.offdiag_rows.data() + rows * K;
  for (std::int64_t i = 0; i < K; ++i) x.ratio[i] = S(1);
  for (std::int64_t t = f; t < e; ++t)
    for (std::int64_t i = 0; i < K; ++i) {
      if (t > f) x.ratio[i] = x.ratio[i] * x.step_decay[t * K + i];
      const S r = pol.round(Site::decay, x.ratio[i]);
      k_rows[(t - f) * K + i] = pol.round(Site::intra_operand, x.k[t * K + i] * r);
      q_rows[(t - f) * K + i] = pol.round(Site::intra_operand, x.q[t * K + i] * r);
    }
  for (std::int64_t s = 0; s < f; ++s)
    for (std::int64_t i = 0; i < K; ++i)
      x.offdiag_cols[s * K + i] = pol.round(
          Site::intra_operand, x.k[s * K + i] * pol.round(Site::decay, decay_ratio(x.step_decay.data(), K, s, f, i)));
  gemm(pol, Site::intra_accumulate, 2 * rows, f, K, x.offdiag_rows.data(), false, x.offdiag_cols.data(), true,
       x.offdiag_gram.data(), false);
  for (std::int64_t t = f; t < e; ++t)
    for (std::int64_t s = 0; s < f; ++s) {
      G[t * c + s] = pol.round(Site::intra_accumulate, x.offdiag_gram[(t - f) * f + s] * x.beta[t]);
      M[t * c + s] = pol.round(Site::intra_accumulate, x.offdiag_gram[(rows + t - f) * f + s] * io.scale);
    }
}

// Stage 2, FLA: [G; M] by decay ratios, sub-chunk by sub-chunk, never forming 1 / a (except
// safe_gate's anchor ratios); Q_decay = a ⊙ Q (unscaled: FLA scales the products) and
// K_restore by the ratio to the last row.
template <class S, class Policy>
void gram_by_decay_ratios(const Policy& pol, const ChunkIo<S>& io, std::int64_t c, std::int64_t sub, bool safe_gate,
                          ChunkScratch<S>& x) {
  using contract::Site;
  const std::int64_t K = io.K;
  for (std::int64_t i = 0; i < 2 * c * c; ++i) x.gram[i] = S(0);
  for (std::int64_t f = 0; f < c; f += sub) {
    const std::int64_t e = std::min(c, f + sub);
    if (safe_gate)
      gram_diagonal_block_through_anchor(pol, io, c, sub, f, e, x);
    else
      gram_diagonal_block(pol, io, c, sub, f, e, x);
    if (f > 0) gram_block_against_earlier_rows(pol, io, c, f, e, x);
  }
  S* __restrict qd = x.state_operands.data() + c * K;
  for (std::int64_t i = 0; i < c * K; ++i) qd[i] = pol.round(Site::q_decay, x.q[i] * x.decay[i]);
  for (std::int64_t s = 0; s < c; ++s)
    for (std::int64_t i = 0; i < K; ++i)
      x.k_restore[s * K + i] = pol.round(
          Site::k_restore, x.k[s * K + i] * pol.round(Site::decay, decay_ratio(x.step_decay.data(), K, s, c - 1, i)));
}

// Stage 3 (both forms): L = StrictTril(Diag(beta) G) (FLA's G holds beta already); M_qk = tril(M).
template <class S, class Policy>
void lower_and_mask(const Policy& pol, std::int64_t c, bool beta_in_gram, ChunkScratch<S>& x) {
  using contract::Site;
  const S* const G = x.gram.data();
  S* const M = x.gram.data() + c * c;
  for (std::int64_t i = 0; i < c * c; ++i) x.L[i] = S(0);
  for (std::int64_t t = 0; t < c; ++t) {
    const S beta = beta_in_gram ? S(1) : pol.round(Site::beta_l, x.beta[t]);
    for (std::int64_t s = 0; s < c; ++s) {
      if (s < t) {
        const S g = pol.round(Site::akk, G[t * c + s]);
        x.L[t * c + s] = pol.round(Site::L, beta_in_gram ? g : g * beta);
      }
      M[t * c + s] = s <= t ? pol.round(Site::aqk, M[t * c + s]) : S(0);
    }
  }
}

// Stage 4, FLA: the state-independent parts W = INV ((beta K) ⊙ a) (into rows 0..c-1 of
// state_operands) and U' = INV (beta V) (kda/wy_fast.py:99 and :127).
template <class S, class Policy>
void w_and_u_pre(const Policy& pol, std::int64_t K, std::int64_t V, std::int64_t c, ChunkScratch<S>& x) {
  using contract::Site;
  S* const W = x.state_operands.data();
  for (std::int64_t t = 0; t < c; ++t) {
    for (std::int64_t i = 0; i < K; ++i)
      x.w_operand[t * K + i] =
          pol.round(Site::w_operand, pol.round(Site::k_beta, x.k[t * K + i] * x.beta[t]) * x.decay[t * K + i]);
    for (std::int64_t j = 0; j < V; ++j) x.rhs[t * V + j] = pol.round(Site::k_beta, x.v[t * V + j] * x.beta[t]);
  }
  gemm(pol, Site::chunk_accumulate, c, K, c, x.inv.data(), false, x.w_operand.data(), false, W, false);
  gemm(pol, Site::chunk_accumulate, c, V, c, x.inv.data(), false, x.rhs.data(), false, x.u_pre.data(), false);
  round_all(pol, Site::w, W, c * K);
  round_all(pol, Site::u_pre, x.u_pre);
}

// Stage 5 (both forms, FlashKDA's second kernel begins): record the entering state, then
// [K_decay S_in (or W S_in); Q_decay S_in] in one product (FLA: with the state as an
// operand, which a policy may round: h.to(w.dtype), common/chunk_delta_h.py:213-236).
template <class S, class Policy>
void multiply_entering_state(const Policy& pol, const ChunkIo<S>& io, const ChunkAt& at, const std::vector<S>& state,
                             ChunkScratch<S>& x) {
  using contract::Site;
  if (io.stages)
    std::copy(state.begin(), state.end(),
              io.stages->chunk_states.data() + io.stages->chunk_states.offset(at.chunk, at.hv, 0, 0));
  const S* operand = state.data();
  if constexpr (!Policy::is_identity) {
    for (std::size_t i = 0; i < state.size(); ++i) x.state_operand[i] = pol.round(Site::state_operand, state[i]);
    operand = x.state_operand.data();
  }
  gemm(pol, Site::chunk_accumulate, 2 * at.c, io.V, io.K, x.state_operands.data(), false, operand, false,
       x.state_products.data(), false);
}

// Stage 6, FlashKDA: U = INV (Diag(beta) (V - K_decay S_in)), K_decay S_in as stored.
template <class S, class Policy>
void u_from_entering_state(const Policy& pol, std::int64_t V, std::int64_t c, ChunkScratch<S>& x) {
  using contract::Site;
  const S* k_decay_state = x.state_products.data();
  for (std::int64_t t = 0; t < c; ++t) {
    const S beta = pol.round(Site::beta_u, x.beta[t]);
    for (std::int64_t j = 0; j < V; ++j) {
      const S diff = pol.round(Site::u_input, x.v[t * V + j] - pol.round(Site::state_product, k_decay_state[t * V + j]));
      x.rhs[t * V + j] = pol.round(Site::u_input, diff * beta);
    }
  }
  gemm(pol, Site::chunk_accumulate, c, V, c, x.inv.data(), false, x.rhs.data(), false, x.u.data(), false);
  round_all(pol, Site::u, x.u);
}

// Stage 6, FLA: U = U' - W S_in.
template <class S, class Policy>
void u_from_u_pre(const Policy& pol, std::int64_t V, std::int64_t c, ChunkScratch<S>& x) {
  using contract::Site;
  const S* w_state = x.state_products.data();
  for (std::int64_t i = 0; i < c * V; ++i)
    x.u[i] = pol.round(Site::u, pol.round(Site::chunk_accumulate, x.u_pre[i] - w_state[i]));
}

// Stage 7, FlashKDA: O = Q_decay S_in + M_qk U from its two partial outputs, each stored;
// S_out = Diag(a_last) S_in + K_restore^T U, the product first, then one multiply-add
// (fwd_kernel2.cuh, phases 1-6 of its fused MMA loop, from :533).
template <class S, class Policy>
void flashkda_output_and_next_state(const Policy& pol, const ChunkIo<S>& io, const ChunkAt& at,
                                    std::vector<S>& state, ChunkScratch<S>& x) {
  using contract::Site;
  const std::int64_t K = io.K, V = io.V, c = at.c;
  const S* const QS = x.state_products.data() + c * V;
  S* const MU = x.partial.data();
  gemm(pol, Site::chunk_accumulate, c, V, c, x.gram.data() + c * c, false, x.u.data(), false, MU, false);
  for (std::int64_t t = 0; t < c; ++t) {
    S* o = io.o.data() + io.o.offset(at.b, at.t0 + t, at.hv, 0);
    for (std::int64_t j = 0; j < V; ++j)
      o[j] = pol.round(Site::output,
                       pol.round(Site::state_product, QS[t * V + j]) + pol.round(Site::output, MU[t * V + j]));
  }
  S* const delta = x.partial.data();
  gemm(pol, Site::chunk_accumulate, K, V, c, x.k_restore.data(), true, x.u.data(), false, delta, false);
  const S* a_last = x.decay.data() + (c - 1) * K;
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < V; ++j)
      state[i * V + j] = pol.round(Site::state, pol.round(Site::chunk_accumulate, state[i * V + j] * a_last[i] +
                                                                                      delta[i * V + j]));
}

// Stage 7, FLA: O = (Q_decay S_in) scale + M_qk U into the output, one sum
// (gla/chunk.py:416-432); S_out = Diag(a_last) S_in + K_restore^T U, accumulated into the
// decayed state (common/chunk_delta_h.py:292-315).
template <class S, class Policy>
void fla_output_and_next_state(const Policy& pol, const ChunkIo<S>& io, const ChunkAt& at, std::vector<S>& state,
                               ChunkScratch<S>& x) {
  using contract::Site;
  const std::int64_t K = io.K, V = io.V, c = at.c;
  S* const O = x.state_products.data() + c * V;  // holds Q_decay S_in
  for (std::int64_t i = 0; i < c * V; ++i) O[i] = pol.round(Site::chunk_accumulate, O[i] * io.scale);
  gemm(pol, Site::chunk_accumulate, c, V, c, x.gram.data() + c * c, false, x.u.data(), false, O, true);
  for (std::int64_t t = 0; t < c; ++t) {
    S* o = io.o.data() + io.o.offset(at.b, at.t0 + t, at.hv, 0);
    for (std::int64_t j = 0; j < V; ++j) o[j] = pol.round(Site::output, O[t * V + j]);
  }
  const S* a_last = x.decay.data() + (c - 1) * K;
  for (std::int64_t i = 0; i < K; ++i) {
    S* __restrict row = state.data() + i * V;
    const S ai = a_last[i];
    for (std::int64_t j = 0; j < V; ++j) row[j] = pol.round(Site::chunk_accumulate, row[j] * ai);
  }
  gemm(pol, Site::chunk_accumulate, K, V, c, x.k_restore.data(), true, x.u.data(), false, state.data(), true);
  round_all(pol, Site::state, state);
}

// Stage tensors of one chunk into ChunkStages (when recorded).
template <class S>
void record_chunk_stages(const ChunkIo<S>& io, const ChunkAt& at, ChunkScratch<S>& x, bool fla) {
  ChunkStages<S>& st = *io.stages;
  const std::int64_t K = io.K, V = io.V, c = at.c;
  auto rows = [&](Tensor<S>& dst, const S* src, std::int64_t width) {
    for (std::int64_t t = 0; t < c; ++t)
      for (std::int64_t w = 0; w < width; ++w) dst(at.b, at.t0 + t, at.hv, w) = src[t * width + w];
  };
  rows(st.decay, x.decay.data(), K);
  if (fla) {
    // The stage tensors' definitions (a ⊙ (scale q), a ⊙ k), which FLA's order never forms.
    for (std::int64_t i = 0; i < c * K; ++i) {
      x.k_decay_record[i] = x.decay[i] * x.k[i];
      x.w_operand[i] = x.decay[i] * (io.scale * x.q[i]);
    }
    rows(st.q_decay, x.w_operand.data(), K);
    rows(st.k_decay, x.k_decay_record.data(), K);
    rows(st.w, x.state_operands.data(), K);
    rows(st.u_pre, x.u_pre.data(), V);
  } else {
    rows(st.q_decay, x.state_operands.data() + c * K, K);
    rows(st.k_decay, x.state_operands.data(), K);
    rows(st.k_inv, x.k_inv.data(), K);
  }
  rows(st.k_restore, x.k_restore.data(), K);
  rows(st.L, x.L.data(), c);
  rows(st.m_qk, x.gram.data() + c * c, c);
  rows(st.inv, x.inv.data(), c);
  rows(st.u, x.u.data(), V);
}

// One chunk in FlashKDA's form (C = 16): its first kernel (stages 1-4: decays and inverse
// decays, [G; M], L, INV by Neumann doubling), then its second (stages 5-7: U, O, S).
template <class S, class Policy>
void flashkda_chunk(const Policy& pol, const ChunkIo<S>& io, const ChunkAt& at, int neumann_factors,
                    std::vector<S>& state, ChunkScratch<S>& x) {
  gather_chunk(pol, io, at, x);
  gram_by_inverse_decays(pol, io, at.c, x);
  lower_and_mask(pol, at.c, false, x);
  inverse_by_neumann_doubling_into(pol, x.L.data(), at.c, neumann_factors, x.inv.data(), x.inv_work.data());
  round_all(pol, contract::Site::inv_store, x.inv.data(), at.c * at.c);
  multiply_entering_state(pol, io, at, state, x);
  u_from_entering_state(pol, io.V, at.c, x);
  flashkda_output_and_next_state(pol, io, at, state, x);
  if (io.stages) record_chunk_stages(io, at, x, false);
}

// One chunk in FLA's form (C = 64): [G; M] by decay ratios, INV by forward substitution of
// each sub-chunk and block merges, W and U' before the state is read, then U = U' - W S_in,
// O, S.
template <class S, class Policy>
void fla_chunk(const Policy& pol, const ChunkIo<S>& io, const ChunkAt& at, std::int64_t sub, bool safe_gate,
               std::vector<S>& state, ChunkScratch<S>& x) {
  gather_chunk(pol, io, at, x);
  gram_by_decay_ratios(pol, io, at.c, sub, safe_gate, x);
  lower_and_mask(pol, at.c, true, x);
  inverse_by_block_merges_into(pol, x.L.data(), at.c, sub, x.inv.data());
  round_all(pol, contract::Site::inv_store, x.inv.data(), at.c * at.c);
  w_and_u_pre(pol, io.K, io.V, at.c, x);
  multiply_entering_state(pol, io, at, state, x);
  u_from_u_pre(pol, io.V, at.c, x);
  fla_output_and_next_state(pol, io, at, state, x);
  if (io.stages) record_chunk_stages(io, at, x, true);
}

}  // namespace detail

// The chunkwise forward over prepared inputs: every (sequence, value head) chunk by chunk
// in the form of `copt`. States are K-first (initial_state, final_state, the stages'
// chunk_states); chunkwise_forward converts.
template <class S, class Policy = contract::Exact>
ChunkwiseOutputs<S> chunkwise_core(const PreparedInputs<S>& p, const std::optional<Tensor<S>>& initial_state,
                                   const Options<S>& opt, const Dims& d, const ChunkwiseOptions& copt,
                                   const Policy& pol = {}) {
  const std::int64_t C = effective_chunk_size(copt);
  const bool fla = copt.form == ChunkForm::fla;
  const std::int64_t sub = fla ? copt.sub_chunk : C;
  const int factors = neumann_factor_count(C);
  const std::int64_t K = d.K, V = d.V, group = d.HV / d.H;

  ChunkwiseOutputs<S> result;
  Outputs<S>& out = result.out;
  out.o = Tensor<S>({d.B, d.T, d.HV, V});
  if (opt.output_final_state) out.final_state = Tensor<S>({d.N, d.HV, K, V});

  // Chunks of each sequence, numbered in sequence order.
  std::vector<std::int64_t> first_chunk(d.N + 1, 0);
  for (std::int64_t n = 0; n < d.N; ++n)
    first_chunk[n + 1] = first_chunk[n] + (d.seq_end[n] - d.seq_begin[n] + C - 1) / C;
  if (copt.record_stages) {
    ChunkStages<S>& st = result.stages.emplace();
    st.chunk_size = C;
    const Shape tk{d.B, d.T, d.HV, K}, tv{d.B, d.T, d.HV, V}, tc{d.B, d.T, d.HV, C};
    st.decay = st.q_decay = st.k_decay = st.k_restore = Tensor<S>(tk);
    if (!fla) st.k_inv = Tensor<S>(tk);
    st.L = st.inv = st.m_qk = Tensor<S>(tc);
    if (fla) {
      st.w = Tensor<S>(tk);
      st.u_pre = Tensor<S>(tv);
    }
    st.u = Tensor<S>(tv);
    const std::int64_t chunks = first_chunk[d.N];
    st.chunk_states = Tensor<S>({chunks, d.HV, K, V});
    st.chunk_starts = Tensor<std::int64_t>({chunks, 3});
    for (std::int64_t n = 0; n < d.N; ++n)
      for (std::int64_t ci = first_chunk[n]; ci < first_chunk[n + 1]; ++ci) {
        const std::int64_t t0 = d.seq_begin[n] + (ci - first_chunk[n]) * C;
        st.chunk_starts(ci, 0) = d.seq_batch[n];
        st.chunk_starts(ci, 1) = t0;
        st.chunk_starts(ci, 2) = std::min(C, d.seq_end[n] - t0);
      }
  }
  const detail::ChunkIo<S> io{p, K, V, out.o, result.stages ? &*result.stages : nullptr,
                              pol.round(contract::Site::scale, p.scale)};

  exec::parallel_for(d.N * d.HV, opt.num_threads, [&](std::int64_t item) {
    const std::int64_t n = item / d.HV, hv = item % d.HV;
    std::vector<S> state(K * V, S(0));  // K-first row-major
    if (initial_state) {
      const S* src = initial_state->data() + initial_state->offset(n, hv, 0, 0);
      std::copy(src, src + K * V, state.begin());
      detail::round_all(pol, contract::Site::state, state);
    }
    detail::ChunkScratch<S> scratch(C, K, V, sub);
    for (std::int64_t t0 = d.seq_begin[n], chunk = first_chunk[n]; t0 < d.seq_end[n]; t0 += C, ++chunk) {
      const detail::ChunkAt at{d.seq_batch[n], hv / group, hv, t0, std::min(C, d.seq_end[n] - t0), chunk};
      if (fla)
        detail::fla_chunk(pol, io, at, sub, copt.safe_gate, state, scratch);
      else
        detail::flashkda_chunk(pol, io, at, factors, state, scratch);
    }
    if (out.final_state)
      std::copy(state.begin(), state.end(), out.final_state->data() + out.final_state->offset(n, hv, 0, 0));
  });
  return result;
}

// Checks the chunk options (scalar-free, src/kda/chunkwise.cc).
void validate_chunkwise(const ChunkwiseOptions& copt, bool output_all_states);

// The full KDA forward by a chunkwise form: validation and optional stages as in
// recurrent_forward (kda::validate, kda::prepare), then the chunk algorithm.
template <class S, class Policy = contract::Exact>
ChunkwiseOutputs<S> chunkwise_forward(const Inputs<S>& in, const Options<S>& opt = {},
                                      const ChunkwiseOptions& copt = {}, const Policy& pol = {}) {
  const Dims d = validated_dims(in, opt);
  validate_chunkwise(copt, opt.output_all_states);
  ChunkwiseOutputs<S> r = chunkwise_core(prepare(in, opt, d), to_k_first(in.initial_state, opt.state_layout), opt, d, copt, pol);
  r.out.final_state = from_k_first(std::move(r.out.final_state), opt.state_layout);
  if (r.stages) r.stages->chunk_states = from_k_first(std::move(r.stages->chunk_states), opt.state_layout);
  return r;
}

}  // namespace k3ref::kda
