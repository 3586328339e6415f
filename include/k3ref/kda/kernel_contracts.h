// Precision contracts of real KDA kernels: each kernel's own sequence of roundings,
// evaluated on the CPU on the inputs the kernel received, so that a kernel is judged
// against what its arithmetic can deliver (docs/contracts.md).
//
//   fla_recurrent        FLA fused_recurrent_kda: the library's recurrence (kda/recurrent.h)
//                        instantiated in float (fp32 state and accumulation), o rounded to bf16.
//   fla_chunk            FLA chunk_kda (C = 64 from 16-token sub-chunks): bf16 operands of
//                        every product, the fp32 state rounded to bf16 where it is an operand
//                        (q·h, w·h), tf32 operands (truncated) of the cross-sub-chunk products
//                        and of the inverse's block merges, fp32 inverse stored as bf16.
//   fla_chunk_safe_gate  the same with safe_gate: the diagonal sub-chunk products through the
//                        anchor row min(8, rows - 1) of the sub-chunk (a future row for the
//                        first half), tf32 operands.
//   flashkda             FlashKDA (C = 16): bf16 normalised q/k, bf16 decays as operands, bf16
//                        scale, fp16 L and Neumann inverse with fp16 accumulation, bf16 state.
//
// The chunk contracts are written here as plain transcriptions of the kernels' operation
// order (not through kda/chunkwise.h's template), because their structure differs from it
// (FlashKDA rounds the decays themselves and sums P + P L^2; FLA scales after its products
// and rounds the state only as an operand). With every rounding site at Precision::exact
// they are the chunk form itself: tests/kda/contract_test.cpp checks == in rationals against
// chunkwise_forward and the recurrence.
//
// Modelled, not emulated bit for bit (each bound is in docs/contracts.md): exp2 / exp as
// correctly rounded fp32 of the exact decay (ex2.approx: 2 ulp of fp32), sigmoid via
// tanh.approx as the exact sigmoid (for FlashKDA's beta the GPU harness passes the kernel's own
// values as BetaForm::as_given, measured per bf16 logit: the approximation cancels for negative
// logits, up to 1 % of beta at -12), FLA's fp32 cumulative sums of log2 decays as exact,
// tensor-core accumulation as sequential fp32 sums.
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "k3ref/exec/parallel.h"
#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/kda/prepare.h"
#include "k3ref/kda/recurrent.h"
#include "k3ref/num/float_format.h"

namespace k3ref::kda::contract {

enum class Kernel { fla_recurrent, fla_chunk, fla_chunk_safe_gate, flashkda };
inline constexpr Choices<Kernel, 4> kernels{"contract",
                                            {{{Kernel::fla_recurrent, "fla_recurrent", "FLA fused_recurrent_kda"},
                                              {Kernel::fla_chunk, "fla_chunk", "FLA chunk_kda"},
                                              {Kernel::fla_chunk_safe_gate, "fla_chunk_safe_gate",
                                               "FLA chunk_kda, safe_gate=True"},
                                              {Kernel::flashkda, "flashkda", "FlashKDA"}}}};
inline std::string_view to_string(Kernel k) { return kernels.name(k); }

// What a value is rounded to at a site. tf32: fp32's range, 10 stored mantissa bits, to
// nearest (tf32_rz: toward zero, the 13 low bits of an fp32 operand dropped).
enum class Precision { exact, fp32, tf32, tf32_rz, fp16, bf16 };
inline constexpr Choices<Precision, 6> precisions{"sites",
                                                  {{{Precision::exact, "exact", "not rounded"},
                                                    {Precision::fp32, "fp32", ""},
                                                    {Precision::tf32, "tf32", ""},
                                                    {Precision::tf32_rz, "tf32_rz", "tf32 toward zero"},
                                                    {Precision::fp16, "fp16", ""},
                                                    {Precision::bf16, "bf16", ""}}}};
inline std::string_view to_string(Precision p) { return precisions.name(p); }

// The rounding sites of the chunk kernels, in the order a chunk meets them.
enum class Site {
  input,             // q, k (after the L2 norm), v as the kernel holds them
  scale,             // the scale factor itself (FlashKDA: bf16)
  decay,             // decays and decay ratios from exp2 (fp32; FlashKDA flushes subnormals)
  decay_operand,     // FlashKDA: the decays rounded again to be multiplied into k and q
  intra_operand,     // FLA: operands of the intra-chunk products (k, q times a decay ratio)
  intra_accumulate,  // partial sums of the intra-chunk products (Aqk, Akk / K_decay K_inv^T)
  aqk,               // the stored q-k matrix M_qk (FLA Aqk, FlashKDA Mqk)
  akk,               // the stored k-k products before beta (FlashKDA: fp16 L before beta)
  beta_l,            // beta as it multiplies L (FlashKDA fp16)
  L,                 // L = beta * k-k products
  inv_accumulate,    // partial sums inside the inversion's products
  inv,               // every intermediate of the inversion
  inv_operand,       // FLA: operands of the products that merge the 16 x 16 diagonal inverses (tf32)
  inv_store,         // INV as stored for the later products (both kernels: bf16)
  k_beta,            // FLA: k * beta and v * beta as bf16 operands
  w_operand,         // FLA: (k beta) * decay as a bf16 operand of W
  w,                 // FLA: W = INV (beta k decay), stored
  u_pre,             // FLA: U' = INV (beta v), stored
  q_decay,           // q * decay (FlashKDA: also its product with the scale)
  k_decay,           // FlashKDA: k * decay
  k_inv,             // FlashKDA: k / decay
  k_restore,         // k * (a_last / a_t)
  state_operand,     // the state where it is an operand of a product (FLA: bf16 copy of fp32)
  state_product,     // FlashKDA: K_decay S and Q_decay S as stored
  u_input,           // FlashKDA: v - K_decay S, and its product with beta
  beta_u,            // FlashKDA: beta as it multiplies v - K_decay S (bf16)
  u,                 // the pseudo-values U (FLA v_new)
  chunk_accumulate,  // partial sums of the per-chunk products (U, O, state update)
  output,            // o (and FlashKDA's two partial outputs)
  state,             // the state held between chunks
};
inline constexpr std::size_t site_count = static_cast<std::size_t>(Site::state) + 1;
std::string_view to_string(Site);
std::optional<Site> site_from_string(std::string_view);

// RNE of a double to tf32 (fp32's exponent range, 10 mantissa bits) through fp32.
inline double round_tf32(double x, bool toward_zero = false) {
  const float f = static_cast<float>(x);
  if (!std::isfinite(f)) return f;
  std::uint32_t b = std::bit_cast<std::uint32_t>(f);
  if (!toward_zero) b += 0xFFFu + ((b >> 13) & 1u);  // ties to even on the 13 dropped bits
  b &= ~0x1FFFu;
  return std::bit_cast<float>(b);
}

// A kernel's contract: the precision of each site, whether the decays flush subnormals.
struct KernelContract {
  Kernel kernel = Kernel::fla_chunk;
  std::array<Precision, site_count> at{};  // default: exact everywhere
  bool flush_decay_subnormals = false;
  Precision recurrence_precision = Precision::fp32;  // fla_recurrent: the recurrence's scalar (fp32 or exact)
  // The kernel's chunk (FLA 64, FlashKDA 16) and FLA's sub-chunk (16); tests shrink them
  // to reach several chunks and sub-chunks in rationals.
  std::int64_t chunk_size = 64, sub_chunk = 16;

  KernelContract& set(Site s, Precision p) {
    at[static_cast<std::size_t>(s)] = p;
    return *this;
  }
  Precision operator[](Site s) const { return at[static_cast<std::size_t>(s)]; }

  template <class S>
  S round(Site s, const S& x) const {
    const Precision p = at[static_cast<std::size_t>(s)];
    if (p == Precision::exact) return x;
    S r;
    if constexpr (std::is_same_v<S, double>) {
      switch (p) {
        case Precision::fp32: r = static_cast<double>(static_cast<float>(x)); break;
        case Precision::tf32: r = round_tf32(x); break;
        case Precision::tf32_rz: r = round_tf32(x, true); break;
        case Precision::fp16: r = round_double(num::Format::fp16, x); break;
        default: r = round_double(num::Format::bf16, x); break;
      }
    } else {
      switch (p) {
        case Precision::fp32: r = num::round_to(num::Format::fp32, x); break;
        case Precision::tf32: r = S(round_tf32(num::to_double_rne(x))); break;  // exact: a tf32 value is a double
        case Precision::tf32_rz: r = S(round_tf32(num::to_double_rne(x), true)); break;
        case Precision::fp16: r = num::round_to(num::Format::fp16, x); break;
        default: r = num::round_to(num::Format::bf16, x); break;
      }
    }
    if (s == Site::decay && flush_decay_subnormals) {
      using std::abs;
      if (abs(r) < S(min_normal(num::Format::fp32))) r = S(0);
    }
    return r;
  }
};

// The kernel's declared contract (src/kda/precision_contract.cc; docs/contracts.md lists
// each site with the kernel source that justifies it).
KernelContract kernel_contract(Kernel);
// The same algorithm rounding nowhere: the mathematical chunk form (or the recurrence).
KernelContract exact_contract(Kernel);

namespace detail {

// sum_{l < n} x(l) * y(l) from `init`, each partial sum rounded at `site`.
template <class S, class X, class Y>
S contract_dot(const KernelContract& c, Site site, S init, std::int64_t n, X&& x, Y&& y) {
  S acc = init;
  for (std::int64_t l = 0; l < n; ++l) acc = c.round(site, acc + x(l) * y(l));
  return acc;
}

// Product of the per-step decays d[u * K + i] over u in (from, to], rounded once at `decay`
// (the kernels take exp2 of a difference of cumulative log decays: one correctly rounded
// value); `inverse`: its reciprocal.
template <class S>
S decay_span(const KernelContract& c, const std::vector<S>& d, std::int64_t K, std::int64_t from, std::int64_t to,
             std::int64_t i, bool inverse = false) {
  S p(1);
  for (std::int64_t u = from + 1; u <= to; ++u) p *= d[u * K + i];
  return c.round(Site::decay, inverse ? S(1) / p : p);
}

// Gathers one chunk of one (sequence, value head): q, k [c x K] (input-rounded), v [c x V],
// decays [c x K], beta [c].
template <class S>
struct ChunkData {
  std::vector<S> q, k, v, d, beta;
};

template <class S>
ChunkData<S> gather_chunk(const KernelContract& c, const PreparedInputs<S>& p, std::int64_t b, std::int64_t t0,
                          std::int64_t rows, std::int64_t h, std::int64_t hv, std::int64_t K, std::int64_t V) {
  ChunkData<S> x;
  x.q.resize(rows * K);
  x.k.resize(rows * K);
  x.d.resize(rows * K);
  x.v.resize(rows * V);
  x.beta.resize(rows);
  for (std::int64_t t = 0; t < rows; ++t) {
    for (std::int64_t i = 0; i < K; ++i) {
      x.q[t * K + i] = c.round(Site::input, p.q(b, t0 + t, h, i));
      x.k[t * K + i] = c.round(Site::input, p.k(b, t0 + t, h, i));
      x.d[t * K + i] = p.decay(b, t0 + t, hv, i);
    }
    for (std::int64_t j = 0; j < V; ++j) x.v[t * V + j] = c.round(Site::input, p.v(b, t0 + t, hv, j));
    x.beta[t] = p.beta(b, t0 + t, hv);
  }
  return x;
}

// (I + L)^-1 by forward substitution (FLA), sites inv_accumulate / inv.
template <class S>
std::vector<S> forward_substitution(const KernelContract& c, const std::vector<S>& L, std::int64_t n) {
  std::vector<S> X(n * n, S(0));
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t s = 0; s < t; ++s) {
      S acc(0);
      for (std::int64_t r = s; r < t; ++r) acc = c.round(Site::inv_accumulate, acc - L[t * n + r] * X[r * n + s]);
      X[t * n + s] = c.round(Site::inv, acc);
    }
    X[t * n + t] = S(1);
  }
  return X;
}

// (I + L)^-1 as FLA forms it: each 16 x 16 diagonal block by forward substitution, then
// block (i, j) below the diagonal as -X_ii (L_ij X_jj) for i = j + 1 and
// -X_ii (sum_{j <= l < i} L_il X_lj) otherwise, every product with operands rounded at
// inv_operand and sums at inv_accumulate.
template <class S>
std::vector<S> fla_block_inverse(const KernelContract& c, const std::vector<S>& L, std::int64_t n, std::int64_t bs) {
  std::vector<S> X(n * n, S(0));
  const std::int64_t nb = (n + bs - 1) / bs;
  auto lo = [&](std::int64_t b) { return b * bs; };
  auto hi = [&](std::int64_t b) { return std::min(n, (b + 1) * bs); };
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::int64_t r0 = lo(b), r = hi(b) - r0;
    std::vector<S> Lb(r * r);
    for (std::int64_t t = 0; t < r; ++t)
      for (std::int64_t s = 0; s < r; ++s) Lb[t * r + s] = L[(r0 + t) * n + r0 + s];
    const std::vector<S> Xb = forward_substitution(c, Lb, r);
    for (std::int64_t t = 0; t < r; ++t)
      for (std::int64_t s = 0; s < r; ++s) X[(r0 + t) * n + r0 + s] = Xb[t * r + s];
  }
  // Block products on (rows of block a) x (columns of block b), a general m x k times k x p.
  using Block = std::vector<S>;
  auto block_of = [&](const std::vector<S>& M, std::int64_t a, std::int64_t b) {
    Block out((hi(a) - lo(a)) * (hi(b) - lo(b)));
    for (std::int64_t t = lo(a); t < hi(a); ++t)
      for (std::int64_t s = lo(b); s < hi(b); ++s) out[(t - lo(a)) * (hi(b) - lo(b)) + s - lo(b)] = M[t * n + s];
    return out;
  };
  auto mul = [&](const Block& A, const Block& B, std::int64_t rows, std::int64_t inner, std::int64_t cols) {
    Block R(rows * cols);
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j)
        R[i * cols + j] = contract_dot(c, Site::inv_accumulate, S(0), inner,
                                       [&](auto l) { return c.round(Site::inv_operand, A[i * inner + l]); },
                                       [&](auto l) { return c.round(Site::inv_operand, B[l * cols + j]); });
    return R;
  };
  for (std::int64_t a = 1; a < nb; ++a)
    for (std::int64_t b = a - 1; b >= 0; --b) {
      const std::int64_t ra = hi(a) - lo(a), rb = hi(b) - lo(b);
      Block R;
      if (b == a - 1) {
        R = mul(mul(block_of(X, a, a), block_of(L, a, b), ra, ra, rb), block_of(X, b, b), ra, rb, rb);
      } else {
        Block sum(ra * rb, S(0));
        for (std::int64_t l = b; l < a; ++l) {
          const Block t = mul(block_of(L, a, l), block_of(X, l, b), ra, hi(l) - lo(l), rb);
          for (std::int64_t z = 0; z < ra * rb; ++z) sum[z] = c.round(Site::inv_accumulate, sum[z] + t[z]);
        }
        R = mul(block_of(X, a, a), sum, ra, ra, rb);
      }
      for (std::int64_t t = 0; t < ra; ++t)
        for (std::int64_t s = 0; s < rb; ++s) X[(lo(a) + t) * n + lo(b) + s] = c.round(Site::inv, -R[t * rb + s]);
    }
  return X;
}

// FLA chunk_kda over one (sequence, value head). `state` (K x V, K-first) enters and leaves.
template <class S>
void fla_chunk_item(const KernelContract& c, const PreparedInputs<S>& p, const Dims& d, std::int64_t n,
                    std::int64_t hv, std::vector<S>& state, Tensor<S>& o) {
  const std::int64_t C = c.chunk_size, BC = c.sub_chunk, K = d.K, V = d.V, h = hv / (d.HV / d.H), b = d.seq_batch[n];
  const bool safe = c.kernel == Kernel::fla_chunk_safe_gate;
  const S scale = c.round(Site::scale, p.scale);
  for (std::int64_t t0 = d.seq_begin[n]; t0 < d.seq_end[n]; t0 += C) {
    const std::int64_t m = std::min(C, d.seq_end[n] - t0);
    const ChunkData<S> x = gather_chunk(c, p, b, t0, m, h, hv, K, V);
    // Aqk (m x m, lower incl. diagonal, bf16 as stored) and Akk (strict lower, fp32) of the chunk.
    std::vector<S> Aqk(m * m, S(0)), Akk(m * m, S(0));
    std::vector<S> qop(BC * K), kop(BC * K), cop(m * K);
    for (std::int64_t f = 0; f < m; f += BC) {
      const std::int64_t e = std::min(m, f + BC), rows = e - f;
      // Cross-sub-chunk blocks: ratio split at the sub-chunk's first row f.
      for (std::int64_t t = f; t < e; ++t)
        for (std::int64_t i = 0; i < K; ++i) {
          const S r = decay_span(c, x.d, K, f, t, i);
          qop[(t - f) * K + i] = c.round(Site::intra_operand, x.q[t * K + i] * r);
          kop[(t - f) * K + i] = c.round(Site::intra_operand, x.k[t * K + i] * r);
        }
      for (std::int64_t s = 0; s < f; ++s)
        for (std::int64_t i = 0; i < K; ++i)
          cop[s * K + i] = c.round(Site::intra_operand, x.k[s * K + i] * decay_span(c, x.d, K, s, f, i));
      for (std::int64_t t = f; t < e; ++t)
        for (std::int64_t s = 0; s < f; ++s) {
          const S* qt = &qop[(t - f) * K];
          const S* kt = &kop[(t - f) * K];
          const S* ks = &cop[s * K];
          const S sq = contract_dot(c, Site::intra_accumulate, S(0), K, [&](auto i) { return qt[i]; },
                                    [&](auto i) { return ks[i]; });
          const S sk = contract_dot(c, Site::intra_accumulate, S(0), K, [&](auto i) { return kt[i]; },
                                    [&](auto i) { return ks[i]; });
          Aqk[t * m + s] = c.round(Site::aqk, c.round(Site::intra_accumulate, sq * scale));
          Akk[t * m + s] = c.round(Site::akk, c.round(Site::intra_accumulate, sk * x.beta[t]));
        }
      // Diagonal block.
      if (!safe) {
        // Token-parallel form: k_s exp2(g_t - g_s) in fp32, sums in fp32, beta on k_t first.
        for (std::int64_t t = f; t < e; ++t)
          for (std::int64_t s = f; s <= t; ++s) {
            std::vector<S> ks(K);
            for (std::int64_t i = 0; i < K; ++i)
              ks[i] = c.round(Site::intra_accumulate, x.k[s * K + i] * decay_span(c, x.d, K, s, t, i));
            const S sq = contract_dot(c, Site::intra_accumulate, S(0), K, [&](auto i) { return x.q[t * K + i]; },
                                      [&](auto i) { return ks[i]; });
            Aqk[t * m + s] = c.round(Site::aqk, c.round(Site::intra_accumulate, sq * scale));
            if (s < t) {
              const S sk = contract_dot(
                  c, Site::intra_accumulate, S(0), K,
                  [&](auto i) { return c.round(Site::intra_accumulate, x.k[t * K + i] * x.beta[t]); },
                  [&](auto i) { return ks[i]; });
              Akk[t * m + s] = c.round(Site::akk, sk);
            }
          }
      } else {
        // safe_gate: every factor through the anchor row a = f + min(BC / 2, rows - 1):
        // q_t exp2(g_t - g_a), k_t exp2(g_t - g_a), k_s exp2(g_a - g_s), one product.
        const std::int64_t a = f + std::min<std::int64_t>(BC / 2, rows - 1);
        auto to_anchor = [&](std::int64_t t, std::int64_t i) {  // a_t / a_anchor
          return t >= a ? decay_span(c, x.d, K, a, t, i) : decay_span(c, x.d, K, t, a, i, true);
        };
        auto from_anchor = [&](std::int64_t s, std::int64_t i) {  // a_anchor / a_s
          return s <= a ? decay_span(c, x.d, K, s, a, i) : decay_span(c, x.d, K, a, s, i, true);
        };
        std::vector<S> qa(rows * K), ka(rows * K), kb(rows * K);
        for (std::int64_t t = f; t < e; ++t)
          for (std::int64_t i = 0; i < K; ++i) {
            const S ra = to_anchor(t, i);
            qa[(t - f) * K + i] = c.round(Site::intra_operand, x.q[t * K + i] * ra);
            ka[(t - f) * K + i] = c.round(Site::intra_operand, x.k[t * K + i] * ra);
            kb[(t - f) * K + i] = c.round(Site::intra_operand, x.k[t * K + i] * from_anchor(t, i));
          }
        for (std::int64_t t = f; t < e; ++t)
          for (std::int64_t s = f; s <= t; ++s) {
            const S* ks = &kb[(s - f) * K];
            const S sq = contract_dot(c, Site::intra_accumulate, S(0), K, [&](auto i) { return qa[(t - f) * K + i]; },
                                      [&](auto i) { return ks[i]; });
            Aqk[t * m + s] = c.round(Site::aqk, c.round(Site::intra_accumulate, sq * scale));
            if (s < t) {
              const S sk = contract_dot(c, Site::intra_accumulate, S(0), K,
                                        [&](auto i) { return ka[(t - f) * K + i]; }, [&](auto i) { return ks[i]; });
              Akk[t * m + s] = c.round(Site::akk, c.round(Site::intra_accumulate, sk * x.beta[t]));
            }
          }
      }
    }
    std::vector<S> Lm(m * m, S(0));
    for (std::int64_t t = 0; t < m; ++t)
      for (std::int64_t s = 0; s < t; ++s) Lm[t * m + s] = c.round(Site::L, Akk[t * m + s]);
    std::vector<S> inv = fla_block_inverse(c, Lm, m, BC);
    for (S& y : inv) y = c.round(Site::inv_store, y);
    // W = INV (beta k a), U' = INV (beta v); Q_decay = q a; K_restore = k a_last / a.
    std::vector<S> wop(m * K), vb(m * V), W(m * K), Up(m * V), qg(m * K), kg(m * K);
    for (std::int64_t t = 0; t < m; ++t) {
      for (std::int64_t i = 0; i < K; ++i) {
        const S at = decay_span(c, x.d, K, -1, t, i);
        wop[t * K + i] = c.round(Site::w_operand, c.round(Site::k_beta, x.k[t * K + i] * x.beta[t]) * at);
        qg[t * K + i] = c.round(Site::q_decay, x.q[t * K + i] * at);
        kg[t * K + i] = c.round(Site::k_restore, x.k[t * K + i] * decay_span(c, x.d, K, t, m - 1, i));
      }
      for (std::int64_t j = 0; j < V; ++j) vb[t * V + j] = c.round(Site::k_beta, x.v[t * V + j] * x.beta[t]);
    }
    for (std::int64_t t = 0; t < m; ++t) {
      for (std::int64_t i = 0; i < K; ++i)
        W[t * K + i] = c.round(Site::w, contract_dot(c, Site::chunk_accumulate, S(0), t + 1,
                                                     [&](auto s) { return inv[t * m + s]; },
                                                     [&](auto s) { return wop[s * K + i]; }));
      for (std::int64_t j = 0; j < V; ++j)
        Up[t * V + j] = c.round(Site::u_pre, contract_dot(c, Site::chunk_accumulate, S(0), t + 1,
                                                          [&](auto s) { return inv[t * m + s]; },
                                                          [&](auto s) { return vb[s * V + j]; }));
    }
    // The state as an operand, v_new = U' - W h, o = scale (q a) h + Aqk v_new.
    std::vector<S> hop(K * V), vnew(m * V);
    for (std::int64_t x2 = 0; x2 < K * V; ++x2) hop[x2] = c.round(Site::state_operand, state[x2]);
    for (std::int64_t t = 0; t < m; ++t)
      for (std::int64_t j = 0; j < V; ++j) {
        const S wh = contract_dot(c, Site::chunk_accumulate, S(0), K, [&](auto i) { return W[t * K + i]; },
                                  [&](auto i) { return hop[i * V + j]; });
        vnew[t * V + j] = c.round(Site::u, c.round(Site::chunk_accumulate, Up[t * V + j] - wh));
      }
    for (std::int64_t t = 0; t < m; ++t)
      for (std::int64_t j = 0; j < V; ++j) {
        S acc = contract_dot(c, Site::chunk_accumulate, S(0), K, [&](auto i) { return qg[t * K + i]; },
                             [&](auto i) { return hop[i * V + j]; });
        acc = c.round(Site::chunk_accumulate, acc * scale);
        acc = contract_dot(c, Site::chunk_accumulate, acc, t + 1, [&](auto s) { return Aqk[t * m + s]; },
                           [&](auto s) { return vnew[s * V + j]; });
        o(b, t0 + t, hv, j) = c.round(Site::output, acc);
      }
    // h <- h a_last + K_restore^T v_new.
    for (std::int64_t i = 0; i < K; ++i) {
      const S al = decay_span(c, x.d, K, -1, m - 1, i);
      for (std::int64_t j = 0; j < V; ++j) {
        const S decayed = c.round(Site::chunk_accumulate, state[i * V + j] * al);
        state[i * V + j] = c.round(Site::state, contract_dot(c, Site::chunk_accumulate, decayed, m,
                                                             [&](auto t) { return kg[t * K + i]; },
                                                             [&](auto t) { return vnew[t * V + j]; }));
      }
    }
  }
}

// FlashKDA over one (sequence, head), as its kernels order the operations (chunk 16).
template <class S>
void flashkda_item(const KernelContract& c, const PreparedInputs<S>& p, const Dims& d, std::int64_t n,
                   std::int64_t hv, std::vector<S>& state, Tensor<S>& o) {
  const std::int64_t C = c.chunk_size, K = d.K, V = d.V, h = hv / (d.HV / d.H), b = d.seq_batch[n];
  const int factors = neumann_factor_count(C);
  const S scale = c.round(Site::scale, p.scale);
  for (std::int64_t t0 = d.seq_begin[n]; t0 < d.seq_end[n]; t0 += C) {
    const std::int64_t m = std::min(C, d.seq_end[n] - t0);
    const ChunkData<S> x = gather_chunk(c, p, b, t0, m, h, hv, K, V);
    std::vector<S> Kd(m * K), Qd(m * K), Ki(m * K), Kr(m * K), al(K);
    for (std::int64_t i = 0; i < K; ++i)
      al[i] = decay_span(c, x.d, K, -1, m - 1, i);
    for (std::int64_t t = 0; t < m; ++t)
      for (std::int64_t i = 0; i < K; ++i) {
        const S a = c.round(Site::decay_operand, decay_span(c, x.d, K, -1, t, i));
        const S ai = c.round(Site::decay_operand, decay_span(c, x.d, K, -1, t, i, true));
        Kd[t * K + i] = c.round(Site::k_decay, x.k[t * K + i] * a);
        Qd[t * K + i] = c.round(Site::q_decay, c.round(Site::q_decay, x.q[t * K + i] * a) * scale);
        Ki[t * K + i] = c.round(Site::k_inv, x.k[t * K + i] * ai);
        Kr[t * K + i] = c.round(Site::k_restore, Ki[t * K + i] * c.round(Site::decay_operand, al[i]));
      }
    std::vector<S> Lm(m * m, S(0)), M(m * m, S(0));
    for (std::int64_t t = 0; t < m; ++t)
      for (std::int64_t s = 0; s <= t; ++s) {
        auto ki = [&](auto i) { return Ki[s * K + i]; };
        M[t * m + s] = c.round(Site::aqk, contract_dot(c, Site::intra_accumulate, S(0), K,
                                                       [&](auto i) { return Qd[t * K + i]; }, ki));
        if (s < t) {
          const S g = c.round(Site::akk, contract_dot(c, Site::intra_accumulate, S(0), K,
                                                      [&](auto i) { return Kd[t * K + i]; }, ki));
          Lm[t * m + s] = c.round(Site::L, g * c.round(Site::beta_l, x.beta[t]));
        }
      }
    // INV = (I - L)(I + L^2)(I + L^4)... as P <- P + P L^(2^j), L^(2^j) by squaring.
    auto product = [&](const std::vector<S>& A, const std::vector<S>& B) {
      std::vector<S> R(m * m);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < m; ++j)
          R[i * m + j] = c.round(Site::inv, contract_dot(c, Site::inv_accumulate, S(0), m,
                                                         [&](auto l) { return A[i * m + l]; },
                                                         [&](auto l) { return B[l * m + j]; }));
      return R;
    };
    std::vector<S> P(m * m), power = Lm;
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < m; ++j) P[i * m + j] = c.round(Site::inv, (i == j ? S(1) : S(0)) - Lm[i * m + j]);
    for (int step = 1; step < factors; ++step) {
      power = product(power, power);
      const std::vector<S> PL = product(P, power);
      for (std::int64_t z = 0; z < m * m; ++z) P[z] = c.round(Site::inv, P[z] + PL[z]);
    }
    for (S& y : P) y = c.round(Site::inv_store, y);
    // U = INV (beta_u (v - K_decay S)), o = Q_decay S + M U, S <- S a_last + K_restore^T U.
    std::vector<S> vb(m * V), U(m * V);
    for (std::int64_t t = 0; t < m; ++t)
      for (std::int64_t j = 0; j < V; ++j) {
        const S ks = c.round(Site::state_product, contract_dot(c, Site::chunk_accumulate, S(0), K,
                                                               [&](auto i) { return Kd[t * K + i]; },
                                                               [&](auto i) { return state[i * V + j]; }));
        const S diff = c.round(Site::u_input, x.v[t * V + j] - ks);
        vb[t * V + j] = c.round(Site::u_input, diff * c.round(Site::beta_u, x.beta[t]));
      }
    for (std::int64_t t = 0; t < m; ++t)
      for (std::int64_t j = 0; j < V; ++j)
        U[t * V + j] = c.round(Site::u, contract_dot(c, Site::chunk_accumulate, S(0), t + 1,
                                                     [&](auto s) { return P[t * m + s]; },
                                                     [&](auto s) { return vb[s * V + j]; }));
    for (std::int64_t t = 0; t < m; ++t)
      for (std::int64_t j = 0; j < V; ++j) {
        const S qs = c.round(Site::state_product, contract_dot(c, Site::chunk_accumulate, S(0), K,
                                                               [&](auto i) { return Qd[t * K + i]; },
                                                               [&](auto i) { return state[i * V + j]; }));
        const S mu = c.round(Site::output, contract_dot(c, Site::chunk_accumulate, S(0), t + 1,
                                                        [&](auto s) { return M[t * m + s]; },
                                                        [&](auto s) { return U[s * V + j]; }));
        o(b, t0 + t, hv, j) = c.round(Site::output, qs + mu);
      }
    for (std::int64_t i = 0; i < K; ++i)
      for (std::int64_t j = 0; j < V; ++j) {
        const S delta = contract_dot(c, Site::chunk_accumulate, S(0), m, [&](auto t) { return Kr[t * K + i]; },
                                     [&](auto t) { return U[t * V + j]; });
        // One fused multiply-add in fp32, then the bf16 state.
        state[i * V + j] = c.round(Site::state, c.round(Site::chunk_accumulate, state[i * V + j] * al[i] + delta));
      }
  }
}

}  // namespace detail

// The kernel's contract evaluated on `in` with the options of `k3ref kda`: o and the final
// state (layout as the options say), each element the value the contract's arithmetic gives.
template <class S>
Outputs<S> evaluate_contract(const KernelContract& c, const Inputs<S>& in, const Options<S>& opt) {
  if (opt.output_all_states)
    throw InvalidArgument("kda contract: option 'all_states' is not supported (the contracts give o and the final state)");
  if (c.kernel == Kernel::fla_recurrent) {
    if (c.recurrence_precision == Precision::exact) {
      Outputs<S> r = recurrent_forward(in, opt);
      for (S& y : r.o.values()) y = c.round(Site::output, y);
      return r;
    }
    if constexpr (std::is_same_v<S, double>) {
      Inputs<float> f;
      auto narrow = [](const Tensor<double>& t) { return t.map<float>([](double v) { return static_cast<float>(v); }); };
      auto narrow_opt = [&](const std::optional<Tensor<double>>& t) -> std::optional<Tensor<float>> {
        if (!t) return std::nullopt;
        return narrow(*t);
      };
      f.q = narrow(in.q);
      f.k = narrow(in.k);
      f.v = narrow(in.v);
      f.g = narrow(in.g);
      f.beta = narrow(in.beta);
      f.initial_state = narrow_opt(in.initial_state);
      f.A_log = narrow_opt(in.A_log);
      f.dt_bias = narrow_opt(in.dt_bias);
      f.cu_seqlens = in.cu_seqlens;
      const Outputs<float> rf = recurrent_forward(f, convert_options<float>(opt));
      Outputs<double> r;
      r.o = rf.o.map<double>([&](float v) { return c.round(Site::output, static_cast<double>(v)); });
      if (rf.final_state) r.final_state = rf.final_state->map<double>([](float v) { return static_cast<double>(v); });
      return r;
    } else {
      throw InvalidArgument("kda contract 'fla_recurrent': the fp32 recurrence is evaluated from double inputs only");
    }
  }
  const Dims d = validated_dims(in, opt, "kda contract");
  if (c.chunk_size < 1 || c.sub_chunk < 1 || c.chunk_size % c.sub_chunk != 0)
    throw InvalidArgument("kda contract: chunk_size and sub_chunk must be positive, sub_chunk dividing chunk_size");
  const PreparedInputs<S> p = prepare(in, opt, d);
  const std::optional<Tensor<S>> h0 = to_k_first(in.initial_state, opt.state_layout);
  Outputs<S> out;
  out.o = Tensor<S>({d.B, d.T, d.HV, d.V});
  if (opt.output_final_state) out.final_state = Tensor<S>({d.N, d.HV, d.K, d.V});
  exec::parallel_for(d.N * d.HV, opt.num_threads, [&](std::int64_t item) {
    const std::int64_t n = item / d.HV, hv = item % d.HV;
    std::vector<S> state(d.K * d.V, S(0));
    if (h0) {
      const S* src = h0->data() + h0->offset(n, hv, 0, 0);
      for (std::int64_t z = 0; z < d.K * d.V; ++z) state[z] = c.round(Site::state, src[z]);
    }
    if (c.kernel == Kernel::flashkda)
      detail::flashkda_item(c, p, d, n, hv, state, out.o);
    else
      detail::fla_chunk_item(c, p, d, n, hv, state, out.o);
    if (out.final_state)
      std::copy(state.begin(), state.end(), out.final_state->data() + out.final_state->offset(n, hv, 0, 0));
  });
  out.final_state = from_k_first(std::move(out.final_state), opt.state_layout);
  return out;
}

}  // namespace k3ref::kda::contract
