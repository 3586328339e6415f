// The chunkwise (UT transform) backward of KDA, organised as training kernels organise it
// (proofs/kda_backward.md, part 2, derives every line):
//   stage 1, forward recompute: the chunkwise forward's stages (chunk_states h_c, the
//            cumulative decays a, Q_decay, K_decay, K_inv, K_restore, INV, M_qk, U);
//   stage 2, the state-gradient recurrence over chunks, last to first (a kernel's
//            "bwd_dh"): with dS_out the gradient arriving at the chunk's end,
//              dU   = M_qk^T dO + K_restore dS_out        (FLA calls it dv_new)
//              dX   = INV^T dU
//              dh_c = Q_decay^T dO + Diag(a_last) dS_out - K_decay^T Diag(beta) dX;
//   stage 3, the intra-chunk gradients, every chunk independently given (h_c, dS_out, dU):
//              dL = StrictTril(-dX U^T),  dM = tril(dO U^T)
//              dQ_decay  = dO h_c^T + dM K_inv
//              dK_inv    = dM^T Q_decay + dL^T Diag(beta) K_decay
//              dK_decay  = Diag(beta) (dL K_inv - dX h_c^T)
//              dK_restore = U dS_out^T
//              dbeta_t = dX_t . (v_t - K_decay_t h_c) + sum_s dL_ts K_decay_t . K_inv_s
//              dV = Diag(beta) dX
//            and the decays through the cumulative log decay G_t (a_t = exp G_t):
//              dG_t = K_decay o dK_decay + Q_decay o dQ_decay - K_inv o dK_inv - K_restore o dK_restore
//              dG_last += sum_t K_restore o dK_restore + a_last o rowsum(h_c o dS_out)
//              dg_s = sum_{t >= s} dG_t   (a reverse cumulative sum inside the chunk).
// It uses the inverse-decay (FlashKDA) form of the forward, so decays must be positive.
// In rationals it equals the adjoint recurrence exactly (tests/kda/chunkwise_backward_test.cpp).
#pragma once

#include "k3ref/kda/backward.h"
#include "k3ref/kda/chunkwise.h"

namespace k3ref::kda {

// Stage tensors of the chunkwise backward, K-first, chunks numbered as in ChunkStages.
template <class S>
struct ChunkBackwardStages {
  std::int64_t chunk_size = 0;
  Tensor<S> chunk_states;           // [chunks, HV, K, V] h_c, the state entering chunk c (stage 1)
  Tensor<S> chunk_state_gradients;  // [chunks, HV, K, V] dh_c = dL/dh_c (stage 2)
  Tensor<S> du;                     // [B, T, HV, V] dU of each chunk (stage 2)
  Tensor<S> dg_cumulative;          // [B, T, HV, K] dG_t, gradient w.r.t. the cumulative log decay (stage 3)
  Tensor<std::int64_t> chunk_starts;  // [chunks, 3]: batch row, first token, length
};

template <class S>
struct ChunkwiseBackwardResult {
  Gradients<S> gradients;
  ChunkBackwardStages<S> stages;
};

namespace detail {

// One chunk of one (sequence, value head) as the backward's stages read it: the forward's
// recorded stage tensors, the cotangent of o, and dS_out, the gradient arriving at the
// chunk's end; row indices local to the chunk.
template <class S>
struct AdjointChunk {
  const ChunkStages<S>& st;
  const PreparedInputs<S>& p;
  const Tensor<S>& d_o;
  const std::vector<S>& dS_out;
  std::int64_t c, b, t0, len, hv, K, V;

  std::int64_t last() const { return t0 + len - 1; }
  const S& H(std::int64_t i, std::int64_t j) const { return st.chunk_states(c, hv, i, j); }
  const S& dO(std::int64_t t, std::int64_t j) const { return d_o(b, t0 + t, hv, j); }
  const S& U(std::int64_t t, std::int64_t j) const { return st.u(b, t0 + t, hv, j); }
  const S& INV(std::int64_t t, std::int64_t s) const { return st.inv(b, t0 + t, hv, s); }
  const S& M(std::int64_t t, std::int64_t s) const { return st.m_qk(b, t0 + t, hv, s); }
  const S& Qd(std::int64_t t, std::int64_t i) const { return st.q_decay(b, t0 + t, hv, i); }
  const S& Kd(std::int64_t t, std::int64_t i) const { return st.k_decay(b, t0 + t, hv, i); }
  const S& Ki(std::int64_t t, std::int64_t i) const { return st.k_inv(b, t0 + t, hv, i); }
  const S& Kr(std::int64_t t, std::int64_t i) const { return st.k_restore(b, t0 + t, hv, i); }
  const S& a(std::int64_t t, std::int64_t i) const { return st.decay(b, t0 + t, hv, i); }
  const S& beta(std::int64_t t) const { return p.beta(b, t0 + t, hv); }
  const S& dSo(std::int64_t i, std::int64_t j) const { return dS_out[i * V + j]; }
};

// Stage 2: dU = M_qk^T dO + K_restore dS_out and dX = INV^T dU (len x V each).
template <class S>
void chunk_du_and_dx(const AdjointChunk<S>& x, std::vector<S>& dU, std::vector<S>& dX) {
  const std::int64_t len = x.len, K = x.K, V = x.V;
  dU.assign(static_cast<std::size_t>(len * V), S(0));
  dX.assign(static_cast<std::size_t>(len * V), S(0));
  for (std::int64_t s = 0; s < len; ++s)
    for (std::int64_t j = 0; j < V; ++j) {
      S acc(0);
      for (std::int64_t t = s; t < len; ++t) acc += x.M(t, s) * x.dO(t, j);
      for (std::int64_t i = 0; i < K; ++i) acc += x.Kr(s, i) * x.dSo(i, j);
      dU[s * V + j] = acc;
    }
  for (std::int64_t s = 0; s < len; ++s)
    for (std::int64_t j = 0; j < V; ++j) {
      S acc(0);
      for (std::int64_t t = s; t < len; ++t) acc += x.INV(t, s) * dU[t * V + j];
      dX[s * V + j] = acc;
    }
}

// Stage 2: dh_c = Q_decay^T dO + Diag(a_last) dS_out - K_decay^T Diag(beta) dX (K x V).
template <class S>
std::vector<S> chunk_entering_state_gradient(const AdjointChunk<S>& x, const std::vector<S>& dX) {
  const std::int64_t K = x.K, V = x.V;
  std::vector<S> dh(static_cast<std::size_t>(K * V));
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < V; ++j) {
      S acc = x.a(x.len - 1, i) * x.dSo(i, j);
      for (std::int64_t t = 0; t < x.len; ++t)
        acc += x.Qd(t, i) * x.dO(t, j) - x.Kd(t, i) * x.beta(t) * dX[t * V + j];
      dh[i * V + j] = acc;
    }
  return dh;
}

// Stage 3: dL = StrictTril(-dX U^T) and dM = tril(dO U^T) (len x len each).
template <class S>
void chunk_dl_and_dm(const AdjointChunk<S>& x, const std::vector<S>& dX, std::vector<S>& dL, std::vector<S>& dM) {
  const std::int64_t len = x.len, V = x.V;
  dL.assign(static_cast<std::size_t>(len * len), S(0));
  dM.assign(static_cast<std::size_t>(len * len), S(0));
  for (std::int64_t t = 0; t < len; ++t)
    for (std::int64_t s = 0; s <= t; ++s) {
      S xu(0), ou(0);
      for (std::int64_t j = 0; j < V; ++j) {
        xu += dX[t * V + j] * x.U(s, j);
        ou += x.dO(t, j) * x.U(s, j);
      }
      if (s < t) dL[t * len + s] = -xu;
      dM[t * len + s] = ou;
    }
}

// Stage 3, token by token: dbeta_t, dV, and dq, dk through dQ_decay, dK_decay, dK_inv and
// dK_restore; dG (len x K) receives each token's gradient w.r.t. the cumulative log decay,
// its last row also the K_restore terms of every token.
template <class S>
void chunk_token_gradients(const AdjointChunk<S>& x, const std::vector<S>& dX, const std::vector<S>& dL,
                           const std::vector<S>& dM, PreparedGradients<S>& g, std::vector<S>& dG) {
  const std::int64_t len = x.len, K = x.K, V = x.V, b = x.b, t0 = x.t0, hv = x.hv;
  dG.assign(static_cast<std::size_t>(len * K), S(0));
  S* dG_last = &dG[(len - 1) * K];
  for (std::int64_t t = 0; t < len; ++t) {
    // Residual r_t = v_t - K_decay_t h_c (the X before beta).
    S dbeta(0);
    for (std::int64_t j = 0; j < V; ++j) {
      S kh(0);
      for (std::int64_t i = 0; i < K; ++i) kh += x.Kd(t, i) * x.H(i, j);
      dbeta += dX[t * V + j] * (x.p.v(b, t0 + t, hv, j) - kh);
      g.dv(b, t0 + t, hv, j) = x.beta(t) * dX[t * V + j];
    }
    for (std::int64_t s = 0; s < t; ++s) {
      S kk(0);
      for (std::int64_t i = 0; i < K; ++i) kk += x.Kd(t, i) * x.Ki(s, i);
      dbeta += dL[t * len + s] * kk;
    }
    g.dbeta(b, t0 + t, hv) = dbeta;
    for (std::int64_t i = 0; i < K; ++i) {
      S dQd(0), dKi(0), dKd(0), dKr(0);
      for (std::int64_t j = 0; j < V; ++j) {
        dQd += x.dO(t, j) * x.H(i, j);
        dKd -= dX[t * V + j] * x.H(i, j);
        dKr += x.U(t, j) * x.dSo(i, j);
      }
      for (std::int64_t s = 0; s <= t; ++s) dQd += dM[t * len + s] * x.Ki(s, i);
      for (std::int64_t r = t; r < len; ++r) dKi += dM[r * len + t] * x.Qd(r, i);
      for (std::int64_t r = t + 1; r < len; ++r) dKi += dL[r * len + t] * x.beta(r) * x.Kd(r, i);
      for (std::int64_t s = 0; s < t; ++s) dKd += dL[t * len + s] * x.Ki(s, i);
      dKd *= x.beta(t);
      const S a = x.a(t, i), a_last = x.a(len - 1, i);
      g.dq(b, t0 + t, hv, i) = x.p.scale * (a * dQd);
      g.dk(b, t0 + t, hv, i) = a * dKd + dKi / a + (a_last / a) * dKr;
      dG[t * K + i] += x.Kd(t, i) * dKd + x.Qd(t, i) * dQd - x.Ki(t, i) * dKi - x.Kr(t, i) * dKr;
      dG_last[i] += x.Kr(t, i) * dKr;
    }
  }
}

// Stage 3, the decays: dG_last += a_last o rowsum(h_c o dS_out); then dg_s = sum_{t >= s}
// dG_t, the multiplicative decay's gradient dg / decay. Records dG in `dg_cumulative`.
template <class S>
void chunk_decay_gradients(const AdjointChunk<S>& x, std::vector<S>& dG, PreparedGradients<S>& g,
                           Tensor<S>& dg_cumulative) {
  const std::int64_t len = x.len, K = x.K, V = x.V, b = x.b, t0 = x.t0, hv = x.hv;
  for (std::int64_t i = 0; i < K; ++i) {
    S hs(0);
    for (std::int64_t j = 0; j < V; ++j) hs += x.H(i, j) * x.dSo(i, j);
    dG[(len - 1) * K + i] += x.a(len - 1, i) * hs;
  }
  for (std::int64_t i = 0; i < K; ++i) {
    S suffix(0);
    for (std::int64_t t = len; t-- > 0;) {
      dg_cumulative(b, t0 + t, hv, i) = dG[t * K + i];
      suffix += dG[t * K + i];
      g.ddecay(b, t0 + t, hv, i) = suffix / x.p.decay(b, t0 + t, hv, i);
    }
  }
}

}  // namespace detail

// The chunkwise backward over prepared inputs: prepared gradients and the stage tensors.
// `initial_state` and `cot.d_final_state` K-first; chunkwise_backward converts.
template <class S>
std::pair<PreparedGradients<S>, ChunkBackwardStages<S>> chunkwise_adjoint(
    const PreparedInputs<S>& p, const std::optional<Tensor<S>>& initial_state, const Cotangents<S>& cot,
    const Options<S>& opt, const Dims& d, std::int64_t chunk_size) {
  for (const S& a : p.decay.values())
    if (!(a > S(0)))
      throw InvalidArgument("kda::chunkwise_backward: argument 'g': the inverse-decay form needs every decay > 0");
  ChunkwiseOptions copt;
  copt.form = ChunkForm::flashkda;
  copt.chunk_size = chunk_size;
  copt.record_stages = true;
  Options<S> fopt = opt;
  fopt.output_final_state = false;
  fopt.output_all_states = false;
  const ChunkStages<S> st = *chunkwise_core(p, initial_state, fopt, d, copt).stages;
  const std::int64_t C = st.chunk_size, K = d.K, V = d.V;
  // The inverse-decay form divides by cumulative decays; in a format with a finite range
  // 1 / a overflows for steep gates over a chunk (proofs/inverse_decay_overflow.md). Refuse
  // rather than return gradients that are NaN without saying so.
  if constexpr (std::is_floating_point_v<S>) {
    for (std::int64_t i = 0; i < st.decay.numel(); ++i)
      if (!std::isfinite(S(1) / st.decay.data()[i]))
        throw InvalidArgument("kda::chunkwise_backward: argument 'g': a cumulative decay of " +
                              std::to_string(static_cast<double>(st.decay.data()[i])) + " within a chunk of " +
                              std::to_string(C) + " tokens has no finite inverse in this scalar type (the "
                              "inverse-decay form overflows); use a smaller chunk_size or a wider tier");
  }
  const std::int64_t chunks = st.chunk_starts.dim(0);

  ChunkBackwardStages<S> bs;
  bs.chunk_size = C;
  bs.chunk_starts = st.chunk_starts;
  bs.chunk_states = st.chunk_states;
  bs.chunk_state_gradients = Tensor<S>({chunks, d.HV, K, V});
  bs.du = Tensor<S>({d.B, d.T, d.HV, V});
  bs.dg_cumulative = Tensor<S>({d.B, d.T, d.HV, K});

  PreparedGradients<S> g = zero_prepared_gradients<S>(d);

  // Chunks of each sequence (as chunkwise_core numbers them).
  std::vector<std::int64_t> first_chunk(d.N + 1, 0);
  for (std::int64_t n = 0; n < d.N; ++n)
    first_chunk[n + 1] = first_chunk[n] + (d.seq_end[n] - d.seq_begin[n] + C - 1) / C;

  // dS_out of a chunk: dF for a sequence's last chunk, else dh of the next chunk.
  auto final_gradient = [&](std::int64_t n, std::int64_t hv) {
    if (!cot.d_final_state) return std::vector<S>(static_cast<std::size_t>(K * V), S(0));
    const S* src = cot.d_final_state->data() + cot.d_final_state->offset(n, hv, 0, 0);
    return std::vector<S>(src, src + K * V);
  };

  exec::parallel_for(d.N * d.HV, opt.num_threads, [&](std::int64_t item) {
    const std::int64_t n = item / d.HV, hv = item % d.HV;
    std::vector<S> dS_out = final_gradient(n, hv), dU, dX, dL, dM, dG;
    for (std::int64_t c = first_chunk[n + 1]; c-- > first_chunk[n];) {
      const detail::AdjointChunk<S> x{st, p, cot.d_o, dS_out, c, st.chunk_starts(c, 0), st.chunk_starts(c, 1),
                                      st.chunk_starts(c, 2), hv, K, V};
      detail::chunk_du_and_dx(x, dU, dX);
      std::vector<S> dh = detail::chunk_entering_state_gradient(x, dX);
      for (std::int64_t s = 0; s < x.len; ++s)
        for (std::int64_t j = 0; j < V; ++j) bs.du(x.b, x.t0 + s, hv, j) = dU[s * V + j];
      for (std::int64_t i = 0; i < K; ++i)
        for (std::int64_t j = 0; j < V; ++j) bs.chunk_state_gradients(c, hv, i, j) = dh[i * V + j];
      detail::chunk_dl_and_dm(x, dX, dL, dM);
      detail::chunk_token_gradients(x, dX, dL, dM, g, dG);
      detail::chunk_decay_gradients(x, dG, g, bs.dg_cumulative);
      dS_out = std::move(dh);
    }
    std::copy(dS_out.begin(), dS_out.end(), g.d_initial_state.data() + g.d_initial_state.offset(n, hv, 0, 0));
  });
  return {std::move(g), std::move(bs)};
}

// The full KDA backward by the chunkwise form (chunk size C; 0 means 16).
template <class S>
ChunkwiseBackwardResult<S> chunkwise_backward(const Inputs<S>& in, const Options<S>& opt, const Cotangents<S>& cot,
                                              std::int64_t chunk_size = 0) {
  const Dims d = validated_dims(in, opt);
  if (chunk_size < 0) throw InvalidArgument("kda::chunkwise_backward: argument 'chunk_size': must be >= 0");
  validate_cotangents(d, cot.d_o.shape(),
                      cot.d_final_state ? std::optional<Shape>(cot.d_final_state->shape()) : std::nullopt,
                      opt.state_layout);
  const PreparedInputs<S> p = prepare(in, opt, d);
  const Cotangents<S> cot_k_first{cot.d_o, to_k_first(cot.d_final_state, opt.state_layout)};
  auto [pg, stages] = chunkwise_adjoint(p, to_k_first(in.initial_state, opt.state_layout), cot_k_first, opt, d, chunk_size);
  Gradients<S> g = stage_backward(in, opt, p, std::move(pg), d);
  g.d_initial_state = from_k_first(std::move(g.d_initial_state), opt.state_layout);
  return {std::move(g), std::move(stages)};
}

}  // namespace k3ref::kda
