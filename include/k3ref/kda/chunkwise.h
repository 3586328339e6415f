// The chunkwise (UT transform) forms of KDA, the algorithm kernels implement
// (DESIGN.md section 4; proofs/chunkwise_equals_recurrence.md shows it is the recurrence).
//
// Within a chunk of c <= C tokens entering with state S_in (K x V), a_t the cumulative
// decay from the chunk's first token up to t (inclusive), q already scaled:
//   K_decay = a ⊙ K,  Q_decay = a ⊙ Q,  K_inv = K / a,  K_restore = a_last ⊙ K_inv
//   L    = StrictTril(Diag(beta) K_decay K_inv^T),   INV = (I + L)^-1
//   M_qk = tril(Q_decay K_inv^T)
//   U = INV Diag(beta) (V - K_decay S_in),  O = Q_decay S_in + M_qk U,
//   S_out = Diag(a_last) S_in + K_restore^T U.
// Two variants compute those quantities differently:
//   * ChunkForm::flashkda (C = 16): FlashKDA's "prepare" stage (a, K_decay, Q_decay,
//     K_inv, K_restore, L, INV, M_qk; its first kernel) then the "recurrence" stage
//     (U, O, S per chunk; its second kernel); INV by Neumann doubling
//     (I - L)(I + L^2)(I + L^4)...; K_inv uses the inverse decays 1/a, which overflow for
//     steep gates (proofs/inverse_decay_overflow.md).
//   * ChunkForm::fla (C = 64): FLA's chunk_kda. Never forms 1/a: every decay factor is a
//     ratio a_t / a_s with s <= t. Inside a 16-token sub-chunk the ratio is formed pairwise
//     (product of the decays s+1..t); across sub-chunks it is split at the later
//     sub-chunk's first row f: (a_t / a_f)(a_f / a_s), both factors <= 1. INV by forward
//     substitution; the state-independent parts W = INV Diag(beta) K_decay and
//     U' = INV Diag(beta) V are formed first, then U = U' - W S_in.
// Both are one template over the scalar and a rounding policy (kda/precision_contract.h):
// with contract::Exact and rationals they equal the recurrence exactly.
#pragma once

#include <optional>
#include <string_view>
#include <vector>

#include "k3ref/kda/precision_contract.h"
#include "k3ref/kda/recurrent.h"

#if K3REF_HAVE_EIGEN
#include <Eigen/Core>
#endif

namespace k3ref::kda {

enum class ChunkForm { flashkda, fla };
std::string_view to_string(ChunkForm);
std::optional<ChunkForm> chunk_form_from_string(std::string_view);

struct ChunkwiseOptions {
  ChunkForm form = ChunkForm::flashkda;
  std::int64_t chunk_size = 0;   // 0: the form's own, 16 (FlashKDA) or 64 (FLA)
  std::int64_t sub_chunk = 16;   // FLA form: rows per sub-chunk; must divide the chunk size
  bool record_stages = false;    // fill ChunkwiseOutputs::stages
};

// The chunk size actually used.
std::int64_t effective_chunk_size(const ChunkwiseOptions&);

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
  Tensor<S> chunk_states;  // [chunks, HV, K, V] (V-first if the options say so): state entering each chunk
  Tensor<std::int64_t> chunk_starts;  // [chunks, 3]: batch row, first token, length
};

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
// at `acc` by the policy. In double with the exact policy Eigen's blocked product does it,
// or gemm_rows_in_lanes when the inner dimension is at most 16.
template <class S, class Policy>
void gemm(const Policy& pol, contract::Point acc, std::int64_t m, std::int64_t n, std::int64_t k, const S* A,
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
void round_all(const Policy& pol, contract::Point p, std::vector<S>& x) {
  if constexpr (!Policy::is_identity)
    for (S& v : x) v = pol.round(p, v);
}

// (I + L)^-1 by Neumann doubling: P = I - L, then P <- P (I + L^(2^j)) for j = 1..m-1.
// Writes P (c x c); `work` is scratch of 3 c x c matrices (no allocation per chunk).
template <class S, class Policy>
void inverse_by_neumann_doubling_into(const Policy& pol, const S* L, std::int64_t c, int factors, S* P, S* work) {
  using contract::Point;
  const std::int64_t cc = c * c;
  S* power = work;           // L^(2^step)
  S* factor = work + cc;     // I + L^(2^step); also the squaring's output before it is copied to power
  S* next = work + 2 * cc;   // P (I + L^(2^step))
  auto round_block = [&](S* x) {
    if constexpr (!Policy::is_identity)
      for (std::int64_t i = 0; i < cc; ++i) x[i] = pol.round(Point::inv, x[i]);
  };
  for (std::int64_t i = 0; i < c; ++i)
    for (std::int64_t j = 0; j < c; ++j) P[i * c + j] = (i == j ? S(1) : S(0)) - L[i * c + j];
  round_block(P);
  std::copy(L, L + cc, power);
  for (int step = 1; step < factors; ++step) {
    gemm(pol, Point::inv_accumulate, c, c, c, power, false, power, false, factor, false);
    round_block(factor);
    std::copy(factor, factor + cc, power);
    for (std::int64_t i = 0; i < c; ++i) factor[i * c + i] += S(1);
    round_block(factor);
    gemm(pol, Point::inv_accumulate, c, c, c, P, false, factor, false, next, false);
    round_block(next);
    std::copy(next, next + cc, P);
  }
}

template <class S, class Policy>
std::vector<S> inverse_by_neumann_doubling(const Policy& pol, const std::vector<S>& L, std::int64_t c, int factors) {
  std::vector<S> P(c * c), work(3 * c * c);
  inverse_by_neumann_doubling_into(pol, L.data(), c, factors, P.data(), work.data());
  return P;
}

// (I + L)^-1 by forward substitution: X[t, s] = -sum_{s <= r < t} L[t, r] X[r, s], the sum
// taken in order r = s..t-1 and held in X's row t. The loop runs r outside s, so the inner
// loop is a vectorisable row update; each element still sees the same operations in the
// same order. Writes X (c x c).
template <class S, class Policy>
void inverse_by_forward_substitution_into(const Policy& pol, const S* L, std::int64_t c, S* X) {
  using contract::Point;
  for (std::int64_t i = 0; i < c * c; ++i) X[i] = S(0);
  for (std::int64_t t = 0; t < c; ++t) {
    S* __restrict acc = X + t * c;
    for (std::int64_t r = 0; r < t; ++r) {
      const S l = L[t * c + r];
      const S* __restrict xr = X + r * c;
      for (std::int64_t s = 0; s <= r; ++s) acc[s] = pol.round(Point::inv_accumulate, acc[s] - l * xr[s]);
    }
    for (std::int64_t s = 0; s < t; ++s) acc[s] = pol.round(Point::inv, acc[s]);
    acc[t] = S(1);
  }
}

template <class S, class Policy>
std::vector<S> inverse_by_forward_substitution(const Policy& pol, const std::vector<S>& L, std::int64_t c) {
  std::vector<S> X(c * c);
  inverse_by_forward_substitution_into(pol, L.data(), c, X.data());
  return X;
}

}  // namespace detail

// The chunkwise forward over prepared inputs (the chunk algorithm proper).
template <class S, class Policy = contract::Exact>
ChunkwiseOutputs<S> chunkwise_core(const PreparedInputs<S>& p, const std::optional<Tensor<S>>& initial_state,
                                   const Options<S>& opt, const Dims& d, const ChunkwiseOptions& copt,
                                   const Policy& pol = {}) {
  using contract::Point;
  const std::int64_t C = effective_chunk_size(copt);
  const bool fla = copt.form == ChunkForm::fla;
  const std::int64_t sub = fla ? copt.sub_chunk : C;
  const int factors = neumann_factor_count(C);
  const std::int64_t K = d.K, V = d.V, group = d.HV / d.H;
  const bool v_first = opt.state_layout == StateLayout::v_first;

  ChunkwiseOutputs<S> result;
  Outputs<S>& out = result.out;
  out.o = Tensor<S>({d.B, d.T, d.HV, V});
  const Shape state_shape = v_first ? Shape{d.N, d.HV, V, K} : Shape{d.N, d.HV, K, V};
  if (opt.output_final_state) out.final_state = Tensor<S>(state_shape);

  // Chunks of each sequence, numbered in sequence order.
  std::vector<std::int64_t> first_chunk(d.N + 1, 0);
  for (std::int64_t n = 0; n < d.N; ++n)
    first_chunk[n + 1] = first_chunk[n] + (d.seq_end[n] - d.seq_begin[n] + C - 1) / C;
  ChunkStages<S>* st = nullptr;
  if (copt.record_stages) {
    result.stages.emplace();
    st = &*result.stages;
    st->chunk_size = C;
    const Shape tk{d.B, d.T, d.HV, K}, tv{d.B, d.T, d.HV, V}, tc{d.B, d.T, d.HV, C};
    st->decay = Tensor<S>(tk);
    st->q_decay = Tensor<S>(tk);
    st->k_decay = Tensor<S>(tk);
    if (!fla) st->k_inv = Tensor<S>(tk);
    st->k_restore = Tensor<S>(tk);
    st->L = Tensor<S>(tc);
    st->inv = Tensor<S>(tc);
    st->m_qk = Tensor<S>(tc);
    if (fla) {
      st->w = Tensor<S>(tk);
      st->u_pre = Tensor<S>(tv);
    }
    st->u = Tensor<S>(tv);
    const std::int64_t chunks = first_chunk[d.N];
    st->chunk_states = Tensor<S>(v_first ? Shape{chunks, d.HV, V, K} : Shape{chunks, d.HV, K, V});
    st->chunk_starts = Tensor<std::int64_t>({chunks, 3});
    for (std::int64_t n = 0; n < d.N; ++n)
      for (std::int64_t ci = first_chunk[n]; ci < first_chunk[n + 1]; ++ci) {
        const std::int64_t t0 = d.seq_begin[n] + (ci - first_chunk[n]) * C;
        st->chunk_starts(ci, 0) = d.seq_batch[n];
        st->chunk_starts(ci, 1) = t0;
        st->chunk_starts(ci, 2) = std::min(C, d.seq_end[n] - t0);
      }
  }

  exec::parallel_for(d.N * d.HV, opt.num_threads, [&](std::int64_t item) {
    const std::int64_t n = item / d.HV, hv = item % d.HV, h = hv / group;
    const std::int64_t b = d.seq_batch[n];
    // Working state, K-first row-major.
    std::vector<S> state(K * V, S(0));
    if (initial_state) {
      const S* src = initial_state->data() + initial_state->offset(n, hv, 0, 0);
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t j = 0; j < V; ++j) state[i * V + j] = src[v_first ? j * K + i : i * V + j];
      detail::round_all(pol, Point::state, state);
    }
    // Every buffer is allocated once per item. `lhs` stacks the two operands that multiply
    // the entering state, [K_decay; Q_decay] (FlashKDA) or [W; Q_decay] (FLA), so that one
    // product gives [K_decay S_in; Q_decay S_in] in `lhs_state`: each row of a product is
    // computed on its own, so stacking changes no operation.
    std::vector<S> qs(C * K), kk(C * K), vv(C * V), beta(C), dd(C * K), a(C * K), a_inv(C * K), k_dec_fla(C * K),
        lhs(2 * C * K), k_inv(C * K), k_rest(C * K), GM(2 * C * C), Lm(C * C), Upre(C * V), Bm(C * V), bk(C * K),
        U(C * V), lhs_state(2 * C * V), ratio(K), row_ops(2 * sub * K), col_op(C * K), block_gm(2 * sub * C),
        inv(C * C), inv_work(3 * C * C), diag_ratio(K * sub), diag_k(K * sub), diag_g(sub), diag_m(sub);
    auto store_rows = [&](Tensor<S>& dst, const S* src, std::int64_t t0, std::int64_t c, std::int64_t width) {
      for (std::int64_t t = 0; t < c; ++t)
        for (std::int64_t x = 0; x < width; ++x) dst(b, t0 + t, hv, x) = src[t * width + x];
    };
    auto store_matrix = [&](Tensor<S>& dst, const S* src, std::int64_t t0, std::int64_t c) {
      for (std::int64_t t = 0; t < c; ++t)
        for (std::int64_t s = 0; s < c; ++s) dst(b, t0 + t, hv, s) = src[t * c + s];
    };

    const std::int64_t begin = d.seq_begin[n], end = d.seq_end[n];
    for (std::int64_t t0 = begin, chunk = first_chunk[n]; t0 < end; t0 += C, ++chunk) {
      const std::int64_t c = std::min(C, end - t0);
      S* const q_dec = lhs.data() + c * K;                       // rows c..2c-1 of lhs
      S* const k_dec = fla ? k_dec_fla.data() : lhs.data();      // FlashKDA: rows 0..c-1 of lhs
      S* const W = lhs.data();                                   // FLA: rows 0..c-1 of lhs
      S* const G = GM.data();                                    // c x c
      S* const M = GM.data() + c * c;                            // c x c
      // ---- prepare stage (FlashKDA's first kernel): everything that does not read the state
      // (Separate loops over restrict pointers, so that each is one vector loop.)
      for (std::int64_t t = 0; t < c; ++t) {
        const S* __restrict q = p.q.data() + p.q.offset(b, t0 + t, h, 0);
        const S* __restrict k = p.k.data() + p.k.offset(b, t0 + t, h, 0);
        const S* __restrict v = p.v.data() + p.v.offset(b, t0 + t, hv, 0);
        const S* __restrict g = p.decay.data() + p.decay.offset(b, t0 + t, hv, 0);
        S* __restrict qs_t = qs.data() + t * K;
        S* __restrict kk_t = kk.data() + t * K;
        S* __restrict dd_t = dd.data() + t * K;
        S* __restrict a_t = a.data() + t * K;
        S* __restrict vv_t = vv.data() + t * V;
        const S scale = p.scale;
        for (std::int64_t i = 0; i < K; ++i) qs_t[i] = scale * q[i];
        std::copy(k, k + K, kk_t);
        std::copy(g, g + K, dd_t);
        if (t == 0) {
          for (std::int64_t i = 0; i < K; ++i) a_t[i] = pol.round(Point::decay, g[i]);
        } else {
          const S* __restrict a_prev = a_t - K;
          for (std::int64_t i = 0; i < K; ++i) a_t[i] = pol.round(Point::decay, a_prev[i] * g[i]);
        }
        std::copy(v, v + V, vv_t);
        beta[t] = p.beta(b, t0 + t, hv);
      }
      const S* a_last = a.data() + (c - 1) * K;
      {
        S* __restrict qd = q_dec;
        S* __restrict kd = k_dec;
        const S* __restrict aa = a.data();
        const S* __restrict qq = qs.data();
        const S* __restrict kq = kk.data();
        for (std::int64_t x = 0; x < c * K; ++x) {
          qd[x] = pol.round(Point::q_decay, aa[x] * qq[x]);
          kd[x] = pol.round(Point::k_decay, aa[x] * kq[x]);
        }
      }
      // G[t, s] = sum_i k_t[i] k_s[i] a_t[i] / a_s[i] (s < t), M[t, s] the same with q_t (s <= t).
      if (!fla) {
        {
          S* __restrict ai = a_inv.data();
          S* __restrict ki = k_inv.data();
          const S* __restrict aa = a.data();
          const S* __restrict kq = kk.data();
          for (std::int64_t x = 0; x < c * K; ++x) {
            ai[x] = pol.round(Point::decay, S(1) / aa[x]);
            ki[x] = pol.round(Point::k_inv, kq[x] * ai[x]);
          }
          S* __restrict kr = k_rest.data();
          const S* __restrict al = a_last;
          for (std::int64_t t = 0; t < c; ++t)
            for (std::int64_t i = 0; i < K; ++i) kr[t * K + i] = pol.round(Point::k_restore, al[i] * ki[t * K + i]);
        }
        // [G; M] = [K_decay; Q_decay] K_inv^T in one product (G and M are adjacent c x c blocks of GM).
        detail::gemm(pol, Point::intra_accumulate, 2 * c, c, K, lhs.data(), false, k_inv.data(), true, GM.data(), false);
      } else {
        for (std::int64_t i = 0; i < c * c; ++i) G[i] = M[i] = S(0);
        for (std::int64_t f = 0; f < c; f += sub) {
          const std::int64_t e = std::min(c, f + sub), rows = e - f;
          // Sub-chunks on the diagonal: pairwise ratios, the product of decays s+1..t. For
          // each row t all columns s = f..t advance together (x = s - f is the inner,
          // vectorisable index; diag_ratio and diag_k are [i][x]); for each pair (s, t) the
          // ratio is still multiplied by the decays in order s+1..t and the sums run over
          // i in order, as in the pairwise definition.
          for (std::int64_t i = 0; i < K; ++i)
            for (std::int64_t x = 0; x < rows; ++x) {
              diag_ratio[i * sub + x] = S(1);
              diag_k[i * sub + x] = kk[(f + x) * K + i];
            }
          for (std::int64_t t = f; t < e; ++t) {
            const std::int64_t xt = t - f;
            for (std::int64_t i = 0; i < K; ++i) {
              S* __restrict r = diag_ratio.data() + i * sub;
              const S dt = dd[t * K + i];
              for (std::int64_t x = 0; x < xt; ++x) r[x] = pol.round(Point::decay, r[x] * dt);
            }
            for (std::int64_t x = 0; x <= xt; ++x) diag_g[x] = diag_m[x] = S(0);
            for (std::int64_t i = 0; i < K; ++i) {
              const S* __restrict r = diag_ratio.data() + i * sub;
              const S* __restrict ks = diag_k.data() + i * sub;
              S* __restrict gk = diag_g.data();
              S* __restrict mq = diag_m.data();
              const S kt = kk[t * K + i], qt = qs[t * K + i];
              for (std::int64_t x = 0; x <= xt; ++x) {
                const S kr = ks[x] * r[x];
                gk[x] = pol.round(Point::intra_accumulate, gk[x] + kt * kr);
                mq[x] = pol.round(Point::intra_accumulate, mq[x] + qt * kr);
              }
            }
            for (std::int64_t x = 0; x <= xt; ++x) {
              if (x < xt) G[t * c + f + x] = diag_g[x];
              M[t * c + f + x] = diag_m[x];
            }
          }
          if (f == 0) continue;
          // Sub-chunk [f, e) against all earlier rows [0, f): split the ratio at row f. The
          // k and q operands are stacked (rows 0..rows-1 and rows..2 rows-1 of row_ops) so
          // one product gives both blocks.
          S* row_op = row_ops.data();
          S* qrow_op = row_ops.data() + rows * K;
          for (std::int64_t i = 0; i < K; ++i) ratio[i] = S(1);
          for (std::int64_t t = f; t < e; ++t)
            for (std::int64_t i = 0; i < K; ++i) {
              if (t > f) ratio[i] = pol.round(Point::decay, ratio[i] * dd[t * K + i]);
              row_op[(t - f) * K + i] = pol.round(Point::k_decay, kk[t * K + i] * ratio[i]);
              qrow_op[(t - f) * K + i] = pol.round(Point::q_decay, qs[t * K + i] * ratio[i]);
            }
          for (std::int64_t i = 0; i < K; ++i) ratio[i] = S(1);
          for (std::int64_t s = f - 1; s >= 0; --s)
            for (std::int64_t i = 0; i < K; ++i) {
              ratio[i] = pol.round(Point::decay, ratio[i] * dd[(s + 1) * K + i]);
              col_op[s * K + i] = pol.round(Point::k_inv, kk[s * K + i] * ratio[i]);
            }
          detail::gemm(pol, Point::intra_accumulate, 2 * rows, f, K, row_ops.data(), false, col_op.data(), true,
                       block_gm.data(), false);
          for (std::int64_t t = f; t < e; ++t)
            for (std::int64_t s = 0; s < f; ++s) {
              G[t * c + s] = block_gm[(t - f) * f + s];
              M[t * c + s] = block_gm[(rows + t - f) * f + s];
            }
        }
        // K_restore by the ratio to the last row, formed backwards.
        for (std::int64_t i = 0; i < K; ++i) ratio[i] = S(1);
        for (std::int64_t s = c - 1; s >= 0; --s)
          for (std::int64_t i = 0; i < K; ++i) {
            if (s < c - 1) ratio[i] = pol.round(Point::decay, ratio[i] * dd[(s + 1) * K + i]);
            k_rest[s * K + i] = pol.round(Point::k_restore, kk[s * K + i] * ratio[i]);
          }
      }
      for (std::int64_t i = 0; i < c * c; ++i) Lm[i] = S(0);
      for (std::int64_t t = 0; t < c; ++t)
        for (std::int64_t s = 0; s < c; ++s) {
          if (s < t) Lm[t * c + s] = pol.round(Point::L, beta[t] * G[t * c + s]);
          M[t * c + s] = s <= t ? pol.round(Point::m_qk, M[t * c + s]) : S(0);
        }
      if (!fla) {
        detail::inverse_by_neumann_doubling_into(pol, Lm.data(), c, factors, inv.data(), inv_work.data());
      } else {
        detail::inverse_by_forward_substitution_into(pol, Lm.data(), c, inv.data());
        // W = INV Diag(beta) K_decay and U' = INV Diag(beta) V (bk, Bm hold the scaled operands first).
        for (std::int64_t t = 0; t < c; ++t) {
          for (std::int64_t i = 0; i < K; ++i) bk[t * K + i] = pol.round(Point::k_decay, beta[t] * k_dec[t * K + i]);
          for (std::int64_t j = 0; j < V; ++j) Bm[t * V + j] = pol.round(Point::wu_pre, beta[t] * vv[t * V + j]);
        }
        detail::gemm(pol, Point::chunk_accumulate, c, K, c, inv.data(), false, bk.data(), false, W, false);
        detail::gemm(pol, Point::chunk_accumulate, c, V, c, inv.data(), false, Bm.data(), false, Upre.data(), false);
        for (std::int64_t i = 0; i < c * K; ++i) W[i] = pol.round(Point::wu_pre, W[i]);
        for (std::int64_t i = 0; i < c * V; ++i) Upre[i] = pol.round(Point::wu_pre, Upre[i]);
      }

      // ---- recurrence stage (FlashKDA's second kernel): reads and updates the state
      if (st) {
        S* dst = st->chunk_states.data() + st->chunk_states.offset(chunk, hv, 0, 0);
        for (std::int64_t i = 0; i < K; ++i)
          for (std::int64_t j = 0; j < V; ++j) dst[v_first ? j * K + i : i * V + j] = state[i * V + j];
      }
      // [K_decay S_in; Q_decay S_in] (FlashKDA) or [W S_in; Q_decay S_in] (FLA) in one product.
      detail::gemm(pol, Point::chunk_accumulate, 2 * c, V, K, lhs.data(), false, state.data(), false, lhs_state.data(),
                   false);
      const S* ks_in = lhs_state.data();  // K_decay S_in or W S_in
      S* const O = lhs_state.data() + c * V;  // Q_decay S_in, then O
      if (!fla) {
        // B = Diag(beta) (V - K_decay S_in); U = INV B.
        for (std::int64_t t = 0; t < c; ++t)
          for (std::int64_t j = 0; j < V; ++j)
            Bm[t * V + j] = pol.round(Point::chunk_accumulate, beta[t] * (vv[t * V + j] - ks_in[t * V + j]));
        detail::gemm(pol, Point::chunk_accumulate, c, V, c, inv.data(), false, Bm.data(), false, U.data(), false);
      } else {
        // U = U' - W S_in.
        for (std::int64_t i = 0; i < c * V; ++i) U[i] = Upre[i] - ks_in[i];
      }
      for (std::int64_t i = 0; i < c * V; ++i) U[i] = pol.round(Point::u, U[i]);
      // O = Q_decay S_in + M_qk U.
      detail::gemm(pol, Point::chunk_accumulate, c, V, c, M, false, U.data(), false, O, true);
      for (std::int64_t t = 0; t < c; ++t) {
        S* o = out.o.data() + out.o.offset(b, t0 + t, hv, 0);
        for (std::int64_t j = 0; j < V; ++j) o[j] = pol.round(Point::output, O[t * V + j]);
      }
      // S_out = Diag(a_last) S_in + K_restore^T U.
      for (std::int64_t i = 0; i < K; ++i) {
        S* __restrict row = state.data() + i * V;
        const S ai = a_last[i];
        for (std::int64_t j = 0; j < V; ++j) row[j] = pol.round(Point::chunk_accumulate, ai * row[j]);
      }
      detail::gemm(pol, Point::chunk_accumulate, K, V, c, k_rest.data(), true, U.data(), false, state.data(), true);
      detail::round_all(pol, Point::state, state);

      if (st) {
        store_rows(st->decay, a.data(), t0, c, K);
        store_rows(st->q_decay, q_dec, t0, c, K);
        store_rows(st->k_decay, k_dec, t0, c, K);
        if (!fla) store_rows(st->k_inv, k_inv.data(), t0, c, K);
        store_rows(st->k_restore, k_rest.data(), t0, c, K);
        for (std::int64_t t = 0; t < c; ++t)
          for (std::int64_t s = 0; s < c; ++s) {
            st->L(b, t0 + t, hv, s) = Lm[t * c + s];
            st->m_qk(b, t0 + t, hv, s) = M[t * c + s];
          }
        store_matrix(st->inv, inv.data(), t0, c);
        if (fla) {
          store_rows(st->w, W, t0, c, K);
          store_rows(st->u_pre, Upre.data(), t0, c, V);
        }
        store_rows(st->u, U.data(), t0, c, V);
      }
    }
    if (out.final_state) {
      S* dst = out.final_state->data() + out.final_state->offset(n, hv, 0, 0);
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t j = 0; j < V; ++j) dst[v_first ? j * K + i : i * V + j] = state[i * V + j];
    }
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
  return chunkwise_core(prepare(in, opt, d), in.initial_state, opt, d, copt, pol);
}

}  // namespace k3ref::kda
