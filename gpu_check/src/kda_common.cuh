// The KDA recurrence's element-wise stages, shared by the forward (kda.cu) and the backward
// (kda_backward.cu): the gate's log decay, beta, the L2 norm's factor and the state's index,
// each written once so that both kernels compute the same expressions.
#pragma once

#include <cmath>
#include <vector>

#include "common.cuh"

namespace k3gc {

constexpr int kMaxDim = 128;  // the largest K and V

// Returns 0, or records why the arguments cannot run (fn names the caller) and returns 1:
// sizes, dtypes, modes, and NULL token tensors when T > 0.
int check_kda_args(const k3gc_kda_args& a, const char* fn);
// The n_seq + 1 sequence bounds on the host: cu_seqlens read (synchronising `stream`) and
// checked to increase within [0, T], or n * T without it.
int sequence_bounds(const k3gc_kda_args& a, int64_t n_seq, cudaStream_t stream, const char* fn, std::vector<int64_t>& cu);

namespace {

__host__ __device__ __forceinline__ int64_t imin(int64_t x, int64_t y) { return x < y ? x : y; }

template <typename Acc> struct Math;
template <> struct Math<double> {
  static __device__ double exp_(double x) { return ::exp(x); }
  static __device__ double log1p_(double x) { return ::log1p(x); }
  static __device__ double sqrt_(double x) { return ::sqrt(x); }
};
template <> struct Math<float> {
  static __device__ float exp_(float x) { return ::expf(x); }
  static __device__ float log1p_(float x) { return ::log1pf(x); }
  static __device__ float sqrt_(float x) { return ::sqrtf(x); }
};

template <typename Acc> __device__ Acc softplus(Acc x) {
  using M = Math<Acc>;
  return x > Acc(0) ? x + M::log1p_(M::exp_(-x)) : M::log1p_(M::exp_(x));
}
template <typename Acc> __device__ Acc sigmoid(Acc x) { return Acc(1) / (Acc(1) + Math<Acc>::exp_(-x)); }

// The log decay of one gate element, from the raw input as the options say, with amp =
// exp(A_log[hv]) given (1 without A_log): a kernel may compute it once per head.
template <typename Acc>
__device__ Acc gate_with_amp(const k3gc_kda_args& a, Acc amp, int64_t hv, int64_t i, Acc raw) {
  if (a.gate == K3GC_GATE_LOG_DECAY) return raw;
  const Acc bias = a.dt_bias ? Acc(a.dt_bias[hv * a.K + i]) : Acc(0);
  const Acc x = raw + bias;
  if (a.gate == K3GC_GATE_SOFTPLUS) return -amp * softplus(x);
  const Acc y = a.A_log ? amp * x : x;
  return Acc(a.lower_bound) * sigmoid(y);
}

template <typename Acc>
__device__ Acc gate_value(const k3gc_kda_args& a, int64_t hv, int64_t i, Acc raw) {
  const Acc amp = (a.gate != K3GC_GATE_LOG_DECAY && a.A_log) ? Math<Acc>::exp_(Acc(a.A_log[hv])) : Acc(1);
  return gate_with_amp(a, amp, hv, i, raw);
}

// Beta from its raw input, as the options say.
template <typename Acc>
__device__ Acc beta_value(const k3gc_kda_args& a, Acc raw) {
  if (a.beta_mode == K3GC_BETA_SIGMOID) return sigmoid(raw);
  if (a.beta_mode == K3GC_BETA_TWO_SIGMOID) return Acc(2) * sigmoid(raw);
  return raw;
}

// The L2 norm's factor from a row's sum of squares.
template <typename Acc> __device__ Acc inverse_norm(Acc sum_sq) { return Acc(1) / Math<Acc>::sqrt_(sum_sq + Acc(1e-6)); }

// The L2 norm of one (token, head)'s q and k over a warp, lane l holding rows l + 32c (c < 4;
// rows >= K hold 0 and stay out of the sums): each row times inverse_norm of its sum of
// squares, the lanes' sums added by xor shuffles.
__device__ __forceinline__ void l2_normalize(double (&qv)[4], double (&kv)[4], int lane, int64_t K) {
  double sq = 0, sk = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    if (lane + 32 * c < K) {
      sq += qv[c] * qv[c];
      sk += kv[c] * kv[c];
    }
  }
  for (int off = 16; off > 0; off /= 2) {
    sq += __shfl_xor_sync(0xffffffffu, sq, off);
    sk += __shfl_xor_sync(0xffffffffu, sk, off);
  }
  const double fq = inverse_norm(sq), fk = inverse_norm(sk);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    if (lane + 32 * c < K) {
      qv[c] *= fq;
      kv[c] *= fk;
    }
  }
}

// The index of state element (i, j) of (sequence n, value head hv) in a's state layout.
__device__ __forceinline__ int64_t state_index(const k3gc_kda_args& a, int64_t n, int64_t hv, int64_t i, int64_t j) {
  const int64_t K = a.K, V = a.V;
  return ((n * a.HV + hv) * (a.state_v_first ? V : K) + (a.state_v_first ? j : i)) * (a.state_v_first ? K : V) +
         (a.state_v_first ? i : j);
}

}  // namespace
}  // namespace k3gc
