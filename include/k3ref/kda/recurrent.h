// The KDA recurrence, tuned: the reference every other form of KDA is checked against in
// double and at 256 bits. It computes kda/definition.h (the plain stepwise loop of
// docs/conventions.md) with the same operations in the same order, blocked for the cache
// and registers, so it equals the definition bitwise in double and == in rationals
// (tests/kda/definition_test.cpp). S is K x V. Value head hv reads q/k head hv / (HV / H).
#pragma once

#include <algorithm>
#include <vector>

#include "k3ref/exec/parallel.h"
#include "k3ref/exec/progress.h"
#include "k3ref/kda/prepare.h"
#include "k3ref/num/lanes.h"

namespace k3ref::kda {

// How the recurrence is evaluated. Per token it is two sweeps over the K x V state:
//   sweep A (token t):  S <- Diag(a_t) S,  kS <- S^T k_t
//   sweep B (token t):  S <- S + k_t u_t^T with u_t = beta_t (v_t - kS),  o_t <- S^T q_t
// and sweep B of token t is fused with sweep A of token t+1, so each state element is
// loaded and stored once per token. Every column of S evolves on its own: the decay
// scales rows, and the delta rule and the read act on column j with the shared k_t, q_t
// and its own v_t[j], kS[j], u_t[j], o_t[j]. So the state is cut into blocks of
// `recurrence_lanes<S>` columns, and one block at a time is carried through a tile of
// `recurrence_tile` tokens: its K x lanes values stay in the L1 cache, and its
// accumulators (kS, o) and u are a few num::Lanes, i.e. registers. Each element still
// sees the operations of the plain stepwise form (kda/definition.h) in the same order (rows summed in
// order i = 0..K-1), so the result is the same bits for every block width, tile length
// and thread count, in every scalar type.
namespace detail {

// 8 doubles: two AVX or four SSE2 registers per Lanes. With AVX the accumulators (o, kS),
// u and a state row take 8 of the 16 vector registers; with SSE2 they take 16 and the
// compiler reads u from L1 instead (measured: 4 lanes, i.e. fewer registers, is slower,
// because each broadcast of k_t[i] or q_t[i] then serves fewer columns). Any width gives
// the same bits.
template <class S>
inline constexpr int recurrence_lanes = 8;
// Tokens per tile: the tile's gathered inputs (about 5 K-vectors per token, 40 KiB at
// K = V = 128) stay in L1/L2 while every column block passes through them; the block
// itself (K x 8 doubles, 8 KiB) stays in L1 for the whole tile.
inline constexpr std::int64_t recurrence_tile = 8;

// Sweep B of one token on one column block (block[i * N + l]), fused with sweep A of the
// next token when kNext. Returns o_t for the block; `next` receives S^T k_{t+1}. With
// kRecord the state after token t is handed to record(i, lanes) before the next decay.
template <class S, int N, bool kNext, bool kRecord, class Record>
num::Lanes<S, N> update_read_decay(S* __restrict block, std::int64_t K, const num::Lanes<S, N>& u,
                                   const S* __restrict k, const S* __restrict q_scaled,
                                   const S* __restrict next_decay, const S* __restrict next_k,
                                   num::Lanes<S, N>& next, Record&& record) {
  using L = num::Lanes<S, N>;
  L out = L::splat(S(0));
  if constexpr (kNext) next = L::splat(S(0));
  for (std::int64_t i = 0; i < K; ++i) {
    L r = L::take(block + i * N);
    r.add_scaled(k[i], u);
    out.add_scaled(q_scaled[i], r);
    if constexpr (kRecord) record(i, r);
    if constexpr (kNext) {
      r.scale(next_decay[i]);
      next.add_scaled(next_k[i], r);
    }
    r.put(block + i * N);
  }
  return out;
}

// Per-item buffers of one token tile, gathered contiguously from the inputs. Token l of
// the tile: q_scaled[l * K], k[l * K], decay[l * K], v[l * Vp], beta[l]; o[l * Vp] out.
// k and decay hold one token more: the token after the tile, which sweep A needs.
template <class S>
struct TokenTile {
  std::vector<S> q_scaled, k, decay, v, o, beta;
  TokenTile(std::int64_t K, std::int64_t Vp)
      : q_scaled(recurrence_tile * K), k((recurrence_tile + 1) * K), decay((recurrence_tile + 1) * K),
        v(recurrence_tile * Vp, S(0)), o(recurrence_tile * Vp), beta(recurrence_tile) {}
};

// Carries one column block (columns j0 .. j0 + N of the padded state) through the `count`
// tokens of a tile. `first`: the tile starts the sequence, so sweep A of its first token
// runs here; otherwise kS[j0..] holds its S^T k. `more`: a token follows the tile; then
// kS[j0..] receives its S^T k. record(l, i, j0, lanes) sees the state after token l.
template <class S, int N, bool kRecord, class Record>
void carry_block(S* __restrict block, std::int64_t K, std::int64_t Vp, std::int64_t j0, TokenTile<S>& tile,
                 std::int64_t count, bool first, bool more, S* __restrict kS, Record&& record) {
  using L = num::Lanes<S, N>;
  L next = L::splat(S(0));
  if (first) {
    for (std::int64_t i = 0; i < K; ++i) {
      L r = L::take(block + i * N);
      r.scale(tile.decay[i]);
      next.add_scaled(tile.k[i], r);
      r.put(block + i * N);
    }
  } else {
    next = L::load(kS + j0);
  }
  for (std::int64_t l = 0; l < count; ++l) {
    const L u = L::scaled_difference(tile.beta[l], L::load(tile.v.data() + l * Vp + j0), next);
    const S* k = tile.k.data() + l * K;
    const S* q = tile.q_scaled.data() + l * K;
    const S* next_decay = tile.decay.data() + (l + 1) * K;
    auto rec = [&](std::int64_t i, const L& r) { record(l, i, r); };
    const L out = l + 1 < count || more
                      ? update_read_decay<S, N, true, kRecord>(block, K, u, k, q, next_decay, k + K, next, rec)
                      : update_read_decay<S, N, false, kRecord>(block, K, u, k, q, nullptr, nullptr, next, rec);
    out.store(tile.o.data() + l * Vp + j0);
  }
  if (more) next.store(kS + j0);
}

}  // namespace detail

// The recurrence over prepared inputs. States are K-first: initial_state [N, HV, K, V],
// final_state likewise, all_states [B, T, HV, K, V] (opt.state_layout is not read here;
// recurrent_forward converts at the boundary).
template <class S>
Outputs<S> recurrent_core(const PreparedInputs<S>& p, const std::optional<Tensor<S>>& initial_state,
                          const Options<S>& opt, const Dims& d) {
  constexpr int N = detail::recurrence_lanes<S>;
  Outputs<S> out;
  out.o = Tensor<S>({d.B, d.T, d.HV, d.V});
  if (opt.output_final_state) out.final_state = Tensor<S>({d.N, d.HV, d.K, d.V});
  if (opt.output_all_states)
    out.all_states = Tensor<S>({d.B, d.T, d.HV, d.K, d.V});
  const std::int64_t group = d.HV / d.H;
  const std::int64_t K = d.K, V = d.V;
  // The working state: column blocks of N, each K x N row-major, padded with zero columns
  // up to Vp (padding columns never reach an output).
  const std::int64_t Vp = (V + N - 1) / N * N;
  auto at = [&](std::int64_t i, std::int64_t j) { return (j / N) * K * N + i * N + j % N; };
  auto slot = [&](std::int64_t i, std::int64_t j) { return i * V + j; };  // K-first state tensors

  exec::parallel_for(d.N * d.HV, opt.num_threads, [&](std::int64_t item) {
    const std::int64_t n = item / d.HV, hv = item % d.HV, h = hv / group;
    const std::int64_t b = d.seq_batch[n];
    std::vector<S> st(static_cast<std::size_t>(K * Vp), S(0)), kS(Vp, S(0));
    if (initial_state) {
      const S* src = initial_state->data() + initial_state->offset(n, hv, 0, 0);
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t j = 0; j < V; ++j) st[at(i, j)] = src[slot(i, j)];
    }
    const std::int64_t begin = d.seq_begin[n], end = d.seq_end[n];
    detail::TokenTile<S> tile(K, Vp);
    for (std::int64_t t0 = begin; t0 < end; t0 += detail::recurrence_tile) {
      const std::int64_t count = std::min(detail::recurrence_tile, end - t0);
      const bool more = t0 + count < end;
      for (std::int64_t l = 0; l < count + (more ? 1 : 0); ++l) {
        const S* k = p.k.data() + p.k.offset(b, t0 + l, h, 0);
        const S* a = p.decay.data() + p.decay.offset(b, t0 + l, hv, 0);
        std::copy(k, k + K, tile.k.begin() + l * K);
        std::copy(a, a + K, tile.decay.begin() + l * K);
      }
      for (std::int64_t l = 0; l < count; ++l) {
        const S* q = p.q.data() + p.q.offset(b, t0 + l, h, 0);
        for (std::int64_t i = 0; i < K; ++i) tile.q_scaled[l * K + i] = p.scale * q[i];
        const S* v = p.v.data() + p.v.offset(b, t0 + l, hv, 0);
        std::copy(v, v + V, tile.v.begin() + l * Vp);
        tile.beta[l] = p.beta(b, t0 + l, hv);
      }
      for (std::int64_t j0 = 0; j0 < Vp; j0 += N) {
        S* block = st.data() + j0 * K;
        if (out.all_states) {
          auto record = [&](std::int64_t l, std::int64_t i, const num::Lanes<S, N>& r) {
            S* dst = out.all_states->data() + out.all_states->offset(b, t0 + l, hv, 0, 0);
            for (std::int64_t c = 0; c < N && j0 + c < V; ++c) dst[slot(i, j0 + c)] = r.get(static_cast<int>(c));
          };
          detail::carry_block<S, N, true>(block, K, Vp, j0, tile, count, t0 == begin, more, kS.data(), record);
        } else {
          auto none = [](std::int64_t, std::int64_t, const num::Lanes<S, N>&) {};
          detail::carry_block<S, N, false>(block, K, Vp, j0, tile, count, t0 == begin, more, kS.data(), none);
        }
      }
      for (std::int64_t l = 0; l < count; ++l) {
        const auto first = tile.o.begin() + l * Vp;
        std::copy(first, first + V, out.o.data() + out.o.offset(b, t0 + l, hv, 0));
      }
      if (opt.progress) opt.progress(count);
    }
    if (out.final_state) {
      S* dst = out.final_state->data() + out.final_state->offset(n, hv, 0, 0);
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t j = 0; j < V; ++j) dst[slot(i, j)] = st[at(i, j)];
    }
  });
  return out;
}

// Seconds per token-head per element of the K x V state on one thread, for the estimate
// that decides on progress lines: measured with `k3ref kda --threads 1` on the idle 2-core
// development machine, 2048 token-heads at K = V = 64 in 6.2 s at 256 bits (MPFR, 0.74 us
// each), and 32768 in 0.33 s in double (2.5 ns, reading and writing the files included).
inline constexpr double recurrent_seconds_per_element_double = 3e-9;
inline constexpr double recurrent_seconds_per_element_multiprecision = 0.7e-6;

// Seconds of the other KDA references per second of the recurrence on the same inputs and
// tier, for their progress estimates: measured on the same machine as the figures above, at
// 256 bits, 256 tokens, HV = 2, K = V = 32 (one thread, the middle of three runs; KCP over 4
// ranks); the contract in double, 1024 tokens, HV = 4, K = V = 64.
struct RelativeCost {
  static constexpr double recurrent = 1;
  static constexpr double chunkwise_flashkda = 1.65;  // chunk 16
  static constexpr double chunkwise_fla = 2.63;       // chunk 64, sub-chunks of 16
  static constexpr double backward_adjoint = 3.24;
  static constexpr double backward_chunkwise = 3.83;  // chunk 16
  static constexpr double kcp_forward = 2.53;
  static constexpr double kcp_backward = 9.0;
  static constexpr double contract = 5.2;  // double only: fla_chunk's roundings
};

// Progress lines (exec/progress.h) for a KDA reference on `in`, by token-heads (a token of
// one value head): active when the estimate for its size, tier, threads and cost relative to
// the recurrence is at least `after` seconds. A computation reports to it through
// opt.progress = lines.hook(); one that reports nothing runs with lines.tick() beside it.
template <class S>
exec::ProgressLines token_head_progress(std::string what, const Inputs<S>& in, const Options<S>& opt,
                                        bool multiprecision, double relative_cost, double after,
                                        exec::ProgressLines::Sink sink) {
  const Dims d = validated_dims(in, opt);
  std::int64_t token_heads = 0;
  for (std::int64_t n = 0; n < d.N; ++n) token_heads += (d.seq_end[n] - d.seq_begin[n]) * d.HV;
  const double per_element =
      multiprecision ? recurrent_seconds_per_element_multiprecision : recurrent_seconds_per_element_double;
  const double estimate = exec::estimated_seconds(static_cast<double>(token_heads) * static_cast<double>(d.K * d.V),
                                                  per_element * relative_cost, d.N * d.HV, opt.num_threads);
  return exec::ProgressLines(std::move(what), "token-heads", token_heads, estimate, after, std::move(sink));
}

// The recurrence's own (it reports its token-heads as it goes).
template <class S>
exec::ProgressLines recurrent_progress(std::string what, const Inputs<S>& in, const Options<S>& opt,
                                       bool multiprecision, double after, exec::ProgressLines::Sink sink) {
  return token_head_progress(std::move(what), in, opt, multiprecision, RelativeCost::recurrent, after, std::move(sink));
}

// The full KDA forward by the recurrence: validation, optional stages, recurrence.
template <class S>
Outputs<S> recurrent_forward(const Inputs<S>& in, const Options<S>& opt = {}) {
  const Dims d = validated_dims(in, opt);
  Outputs<S> out = recurrent_core(prepare(in, opt, d), to_k_first(in.initial_state, opt.state_layout), opt, d);
  out.final_state = from_k_first(std::move(out.final_state), opt.state_layout);
  out.all_states = from_k_first(std::move(out.all_states), opt.state_layout);
  return out;
}

}  // namespace k3ref::kda
