// Gated DeltaNet (GDN) as KDA's scalar-gate case (docs/gdn.md). GDN's recurrence is KDA's
// with one gate per value head instead of one per key channel:
//   S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   o_t = S_t^T (scale q_t),
// a_t a scalar, i.e. KDA with Diag(a_t) = a_t I. So GDN is not a second recurrence: its
// inputs are broadcast over K (the gate [B, T, HV] and dt_bias [HV] to KDA's [B, T, HV, K]
// and [HV, K]) and every KDA form runs on them (the recurrence, the chunkwise forms, the
// serving paths over a pool). GDN's gating, g = -exp(A_log) * softplus(a + dt_bias) and
// beta = sigmoid(b), is then KDA's softplus gate and sigmoid beta on the broadcast inputs
// (kda::GateForm::softplus, kda::BetaForm::sigmoid), the same per channel as per head.
//
// The engines' decode kernels take q, k and v packed along the channel axis, one row per
// token: mixed_qkv [..., 2 H K + HV V] = [q heads 0..H-1 | k heads 0..H-1 | v heads
// 0..HV-1], each head's channels contiguous. unpack_mixed_qkv / pack_mixed_qkv convert.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/recurrent.h"

namespace k3ref::gdn {

// GDN's inputs are KDA's fields with the gate and dt_bias one per value head: q, k [B, T,
// H, K], v [B, T, HV, V], g [B, T, HV] (meaning set by kda::Options::gate: the log decay, the
// decay itself, or GDN's raw a for the softplus gate), beta [B, T, HV], initial_state
// [N, HV, K, V] (or V-first), A_log [HV], dt_bias [HV], cu_seqlens. The same struct, so
// that what works on KDA's fields (lifting, token ranges, files) works on GDN's; to_kda
// refuses KDA-shaped gates.
template <class S>
using Inputs = kda::Inputs<S>;

// [..., n] to [..., n, K]: each element repeated K times along a new last axis.
template <class S>
Tensor<S> broadcast_over_k(const Tensor<S>& per_head, std::int64_t K) {
  Shape shape = per_head.shape();
  shape.push_back(K);
  Tensor<S> out(shape);
  for (std::int64_t e = 0; e < per_head.numel(); ++e)
    std::fill(out.data() + e * K, out.data() + (e + 1) * K, per_head.data()[e]);
  return out;
}

// The KDA inputs GDN's are: the gate and dt_bias broadcast over K, the rest as given.
template <class S>
kda::Inputs<S> to_kda(const Inputs<S>& in) {
  if (in.q.rank() != 4) throw InvalidArgument("gdn: argument 'q': expected [B, T, H, K], got " + shape_to_string(in.q.shape()));
  if (in.g.rank() != 3)
    throw InvalidArgument("gdn: argument 'g': expected one gate per value head [B, T, HV], got " + shape_to_string(in.g.shape()));
  if (in.dt_bias && in.dt_bias->rank() != 1)
    throw InvalidArgument("gdn: argument 'dt_bias': expected one bias per value head [HV], got " +
                          shape_to_string(in.dt_bias->shape()));
  const std::int64_t K = in.q.dim(3);
  kda::Inputs<S> r = in;
  r.g = broadcast_over_k(in.g, K);
  if (in.dt_bias) r.dt_bias = broadcast_over_k(*in.dt_bias, K);
  return r;
}

// GDN's gating of one value head: the log decay g = -exp(A_log) * softplus(a + dt_bias) and
// beta = sigmoid(b), written out as the engines state them (the tests check that KDA's
// softplus gate and sigmoid beta on the broadcast inputs give these).
template <class S>
S gate(const S& a, const S& A_log, const S& dt_bias) {
  using std::exp;
  return -exp(A_log) * kda::softplus(a + dt_bias);
}
template <class S>
S beta(const S& b) {
  return kda::sigmoid(b);
}

// The options of GDN's own gating on raw a and b: KDA's softplus gate and sigmoid beta.
template <class S>
kda::Options<S> gated_options(kda::Options<S> opt = {}) {
  opt.gate = kda::GateForm::softplus;
  opt.beta = kda::BetaForm::sigmoid;
  return opt;
}

template <class S>
kda::Outputs<S> recurrent_forward(const Inputs<S>& in, const kda::Options<S>& opt = {}) {
  return kda::recurrent_forward(to_kda(in), opt);
}

template <class S, class Policy = kda::contract::Exact>
kda::ChunkwiseOutputs<S> chunkwise_forward(const Inputs<S>& in, const kda::Options<S>& opt = {},
                                           const kda::ChunkwiseOptions& copt = {}, const Policy& pol = {}) {
  return kda::chunkwise_forward(to_kda(in), opt, copt, pol);
}

// The head sizes of a packed mixed_qkv row.
struct PackedHeads {
  std::int64_t H = 1, HV = 1, K = 1, V = 1;
  std::int64_t width() const { return 2 * H * K + HV * V; }
};

// mixed_qkv [B, T, 2 H K + HV V] to q, k [B, T, H, K] and v [B, T, HV, V] (the other
// fields of the result are left empty).
template <class S>
Inputs<S> unpack_mixed_qkv(const Tensor<S>& mixed, const PackedHeads& h) {
  if (mixed.rank() != 3 || mixed.dim(2) != h.width())
    throw InvalidArgument("gdn::unpack_mixed_qkv: argument 'mixed_qkv': expected [B, T, 2 H K + HV V] = [B, T, " +
                          std::to_string(h.width()) + "], got " + shape_to_string(mixed.shape()));
  const std::int64_t B = mixed.dim(0), T = mixed.dim(1), row = h.width();
  Inputs<S> r;
  r.q = Tensor<S>({B, T, h.H, h.K});
  r.k = Tensor<S>({B, T, h.H, h.K});
  r.v = Tensor<S>({B, T, h.HV, h.V});
  for (std::int64_t t = 0; t < B * T; ++t) {
    const S* src = mixed.data() + t * row;
    std::copy(src, src + h.H * h.K, r.q.data() + t * h.H * h.K);
    std::copy(src + h.H * h.K, src + 2 * h.H * h.K, r.k.data() + t * h.H * h.K);
    std::copy(src + 2 * h.H * h.K, src + row, r.v.data() + t * h.HV * h.V);
  }
  return r;
}

// q, k [B, T, H, K] and v [B, T, HV, V] packed into mixed_qkv [B, T, 2 H K + HV V].
template <class S>
Tensor<S> pack_mixed_qkv(const Tensor<S>& q, const Tensor<S>& k, const Tensor<S>& v) {
  if (q.rank() != 4 || k.shape() != q.shape() || v.rank() != 4 || v.dim(0) != q.dim(0) || v.dim(1) != q.dim(1))
    throw InvalidArgument("gdn::pack_mixed_qkv: expected q, k [B, T, H, K] and v [B, T, HV, V]");
  const PackedHeads h{q.dim(2), v.dim(2), q.dim(3), v.dim(3)};
  const std::int64_t B = q.dim(0), T = q.dim(1), row = h.width();
  Tensor<S> mixed({B, T, row});
  for (std::int64_t t = 0; t < B * T; ++t) {
    S* dst = mixed.data() + t * row;
    std::copy(q.data() + t * h.H * h.K, q.data() + (t + 1) * h.H * h.K, dst);
    std::copy(k.data() + t * h.H * h.K, k.data() + (t + 1) * h.H * h.K, dst + h.H * h.K);
    std::copy(v.data() + t * h.HV * h.V, v.data() + (t + 1) * h.HV * h.V, dst + 2 * h.H * h.K);
  }
  return mixed;
}

}  // namespace k3ref::gdn
