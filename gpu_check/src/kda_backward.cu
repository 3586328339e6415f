// KDA backward on the GPU in fp64: the gradients of the fp64 reference's forward (kda.cu,
// precision 0) for gradient checks at sizes the CPU cannot reach. One plain definition,
// deterministic: every sum runs in a fixed order, without atomics.
//
// Forward, per (sequence, value head), with the staged rows q^ and k^ (after the L2 norm), the
// decay d = exp(gamma), beta b and v:
//   S' = diag(d) S;  ks = S'^T k^;  u = b (v - ks);  S = S' + k^ u^T;  o = scale S^T q^.
// Backward from dS = d_final_state, token by token in reverse:
//   dS += scale q^ do^T;  dq^ = scale S do;  du = dS^T k^;  dv = b du;  db = du . (v - ks);
//   w = -b du;  dk^ = dS u + S' w;  dS' = dS + k^ w^T;  dd = rowsum(dS' * S_prev);  dS = diag(d) dS'.
// The state before each token of a 64-token chunk is recomputed, into a scratch buffer, from
// the state a forward pass kept at the chunk's start, then read back in reverse.
//
// Layout: one block per (sequence, value head), 4 threads per column j of the state, thread s
// holding rows i = s + 4r (r < 32); dS lives in registers, the recomputed states in scratch
// (each element written and read by its one thread). Sums over a column (ks, du) are shuffles
// over the column's 4 lanes; sums over a row (dq^, dk^, dd) go through shared memory, one
// quantity at a time, each row summed by 4 threads over 32 columns each, in column order.
// A finishing kernel takes the staged rows' gradients back through the stages (the value heads
// of a query head summed in order, the L2 norm, the gate, beta); a last one sums dA_log and
// ddt_bias over the tokens.
#include <algorithm>
#include <string>
#include <vector>

#include "kda_common.cuh"

namespace k3gc {
namespace {
namespace bwd {

constexpr int kP = 4;                              // threads per column
constexpr int kRows = kMaxDim / kP;                // rows per thread
constexpr int kThreads = kMaxDim * kP;             // 512: every column of a value head
constexpr int64_t kChunk = 64;                     // tokens between kept states
constexpr int64_t kState = int64_t(kMaxDim) * kMaxDim;  // doubles of one state
constexpr int64_t kBatchBytes = int64_t(8) << 30;  // kept and scratch states of one launch's pairs
constexpr int kPad = kMaxDim + 1;                  // the row sums' buffer [column][row], padded

// Rows of the tokens [t_begin, t_end), indexed from t_begin: q^, k^ [.][H][128]; d [.][HV][128]; b [.][HV].
struct Staged {
  double *q, *k, *d, *b;
  int64_t t_begin;
};
// The staged rows' gradients per value head: dq^ (before the scale), dk^, dd [.][HV][128]; db [.][HV].
struct RowGrads {
  double *dq, *dk, *dd, *db;
};

// q^, k^ one warp per (token, head); d and b one warp per (token, value head); lane l takes
// rows l + 32c, as the forward's staging does.
__global__ void __launch_bounds__(256) stage_rows(k3gc_kda_args a, Staged st, int64_t tokens) {
  const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t K = a.K;
  if (item < tokens * a.H) {
    const int64_t t = st.t_begin + item / a.H, h = item % a.H;
    double qv[4], kv[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t i = lane + 32 * c;
      qv[c] = i < K ? load_as_double(a.q, a.input_dtype, (t * a.H + h) * K + i) : 0.0;
      kv[c] = i < K ? load_as_double(a.k, a.input_dtype, (t * a.H + h) * K + i) : 0.0;
    }
    if (a.qk_l2norm) l2_normalize(qv, kv, lane, K);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      st.q[item * kMaxDim + lane + 32 * c] = qv[c];
      st.k[item * kMaxDim + lane + 32 * c] = kv[c];
    }
    return;
  }
  const int64_t vitem = item - tokens * a.H;
  if (vitem >= tokens * a.HV) return;
  const int64_t t = st.t_begin + vitem / a.HV, hv = vitem % a.HV;
  const double amp = (a.gate != K3GC_GATE_LOG_DECAY && a.A_log) ? Math<double>::exp_(double(a.A_log[hv])) : 1.0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int64_t i = lane + 32 * c;
    st.d[vitem * kMaxDim + i] =
        i < K ? Math<double>::exp_(gate_with_amp(a, amp, hv, i, load_as_double(a.g, a.input_dtype, (t * a.HV + hv) * K + i)))
              : 1.0;
  }
  if (lane == 0) st.b[vitem] = beta_value(a, load_as_double(a.beta, a.input_dtype, t * a.HV + hv));
}

// Row i's sum over the block's columns of red[column][row], to out[i]: 4 threads per row, each
// over 32 columns in order, then their 4 partial sums by shuffles. Barriers before and after,
// so that red is whole when read and free when this returns.
__device__ __forceinline__ void row_sums(const double* red, double* out) {
  __syncthreads();
  const int i = threadIdx.x / kP, part = threadIdx.x % kP;
  double x = 0;
  for (int c = 0; c < kMaxDim / kP; ++c) x += red[(part * (kMaxDim / kP) + c) * kPad + i];
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  if (part == 0) out[i] = x;
  __syncthreads();
}

// The pairs (sequence, value head) [pair0, pair0 + gridDim.x). kept: per block, the state
// before each chunk (kept_states of them); scratch: per block, the state before each token of
// one chunk (scratch_states). Both hold thread (j, s)'s element r at (r * 128 + j) * kP + s.
__global__ void __launch_bounds__(kThreads, 1)
    recurrence(k3gc_kda_args a, k3gc_kda_grads g, Staged st, RowGrads rg, int64_t pair0, double* kept,
               int64_t kept_states, double* scratch, int64_t scratch_states) {
  extern __shared__ double smem[];
  double* const red = smem;                   // [128][kPad]
  double* const col = smem + kMaxDim * kPad;  // [128]: each column's part of db
  const int64_t pair = pair0 + blockIdx.x;
  const int64_t n = pair / a.HV, hv = pair % a.HV, h = hv / (a.HV / a.H);
  const int64_t bos = a.cu_seqlens ? a.cu_seqlens[n] : n * a.T, eos = a.cu_seqlens ? a.cu_seqlens[n + 1] : bos + a.T;
  const int64_t K = a.K, V = a.V;
  const int j = threadIdx.x / kP, s = threadIdx.x % kP;
  double* const kept_b = kept + blockIdx.x * kept_states * kState;
  double* const scratch_b = scratch + blockIdx.x * scratch_states * kState;
  auto at = [&](int r) { return (int64_t(r) * kMaxDim + j) * kP + s; };
  auto row = [&](int r) { return s + kP * r; };
  // Token t's staged rows and the column's v and do.
  auto qrow = [&](int64_t t) { return st.q + ((t - st.t_begin) * a.H + h) * kMaxDim; };
  auto krow = [&](int64_t t) { return st.k + ((t - st.t_begin) * a.H + h) * kMaxDim; };
  auto drow = [&](int64_t t) { return st.d + ((t - st.t_begin) * a.HV + hv) * kMaxDim; };
  auto beta = [&](int64_t t) { return st.b[(t - st.t_begin) * a.HV + hv]; };
  auto v_of = [&](int64_t t) { return j < V ? load_as_double(a.v, a.input_dtype, (t * a.HV + hv) * V + j) : 0.0; };
  // Thread (j, s)'s rows of a state of (n, hv) in the args' layout, 0 where there is none.
  auto load_state = [&](double (&x)[kRows], const void* state, int dtype) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      x[r] = (state && row(r) < K && j < V) ? load_as_double(state, dtype, state_index(a, n, hv, row(r), j)) : 0.0;
  };
  auto column_sum = [](double x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
  };
  // ks and u of token t from the state before it (read from `prev`).
  auto ks_u = [&](const double* prev, int64_t t, double& ks, double& u) {
    const double *kr = krow(t), *dr = drow(t);
    double x = 0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) x += kr[row(r)] * (prev[at(r)] * dr[row(r)]);
    ks = column_sum(x);
    u = beta(t) * (v_of(t) - ks);
  };

  const int64_t len = eos - bos, n_chunks = (len + kChunk - 1) / kChunk;
  // Forward: the state before each chunk, kept.
  {
    double S[kRows];
    load_state(S, a.initial_state, a.state_dtype);
    for (int64_t c = 0; c < n_chunks; ++c) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) kept_b[c * kState + at(r)] = S[r];
      const int64_t t1 = imin(bos + (c + 1) * kChunk, eos);
      for (int64_t t = bos + c * kChunk; t < t1; ++t) {
        const double *kr = krow(t), *dr = drow(t);
        double x = 0;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          S[r] *= dr[row(r)];
          x += kr[row(r)] * S[r];
        }
        const double u = beta(t) * (v_of(t) - column_sum(x));
#pragma unroll
        for (int r = 0; r < kRows; ++r) S[r] += kr[row(r)] * u;
      }
    }
  }

  double dS[kRows];
  load_state(dS, g.d_final_state, g.d_final_state_dtype);
  const double scale = a.scale;
  for (int64_t c = n_chunks - 1; c >= 0; --c) {
    const int64_t t0 = bos + c * kChunk, t1 = imin(t0 + kChunk, eos);
    // The state before each token of the chunk, from the kept one.
#pragma unroll
    for (int r = 0; r < kRows; ++r) scratch_b[at(r)] = kept_b[c * kState + at(r)];
    for (int64_t t = t0; t + 1 < t1; ++t) {
      const double* prev = scratch_b + (t - t0) * kState;
      double* next = scratch_b + (t + 1 - t0) * kState;
      double ks, u;
      ks_u(prev, t, ks, u);
      const double *kr = krow(t), *dr = drow(t);
#pragma unroll
      for (int r = 0; r < kRows; ++r) next[at(r)] = prev[at(r)] * dr[row(r)] + kr[row(r)] * u;
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const double* prev = scratch_b + (t - t0) * kState;
      const double *qr = qrow(t), *kr = krow(t), *dr = drow(t);
      const int64_t out_row = ((t - st.t_begin) * a.HV + hv) * kMaxDim;
      double ks, u;
      ks_u(prev, t, ks, u);
      const double b = beta(t), vj = v_of(t);
      const double doj = j < V ? load_as_double(g.d_o, g.d_o_dtype, (t * a.HV + hv) * V + j) : 0.0;
      // o = scale S^T q^: dS gains scale q^ do^T, and dq^ is scale S do (the scale applied in finish).
      double x = 0;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const double S_t = prev[at(r)] * dr[row(r)] + kr[row(r)] * u;
        dS[r] += scale * qr[row(r)] * doj;
        red[j * kPad + row(r)] = S_t * doj;
        x += dS[r] * kr[row(r)];
      }
      const double du = column_sum(x);
      row_sums(red, rg.dq + out_row);
      if (s == 0) {
        if (j < V) g.dv[(t * a.HV + hv) * V + j] = b * du;
        col[j] = du * (vj - ks);
      }
      const double w = -b * du;
#pragma unroll
      for (int r = 0; r < kRows; ++r) red[j * kPad + row(r)] = dS[r] * u + (prev[at(r)] * dr[row(r)]) * w;
      row_sums(red, rg.dk + out_row);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const double dSp = dS[r] + kr[row(r)] * w;
        red[j * kPad + row(r)] = dSp * prev[at(r)];
        dS[r] = dr[row(r)] * dSp;
      }
      row_sums(red, rg.dd + out_row);
      if (threadIdx.x < 32) {  // db: the columns' parts, 4 per lane in order, then the warp's tree
        double y = 0;
        for (int m = 0; m < kMaxDim / 32; ++m) y += col[threadIdx.x * (kMaxDim / 32) + m];
        for (int off = 16; off > 0; off /= 2) y += __shfl_xor_sync(0xffffffffu, y, off);
        if (threadIdx.x == 0) rg.db[(t - st.t_begin) * a.HV + hv] = y;
      }
    }
  }
  if (g.d_initial_state && j < V) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      if (row(r) < K) g.d_initial_state[state_index(a, n, hv, row(r), j)] = dS[r];
  }
}

// The inputs' gradients from the staged rows' ones: dq, dk one warp per (token, head) (its
// value heads' dq^ and dk^ summed in order, then back through the L2 norm: x^ = f x gives
// dx = f (dx^ - x^ (x^ . dx^))); dg, dbeta one warp per (token, value head) (back through the
// gate and beta), with each one's part of dA_log in dA_part [.][HV].
__global__ void __launch_bounds__(256) finish(k3gc_kda_args a, k3gc_kda_grads g, Staged st, RowGrads rg, double* dA_part,
                                              int64_t tokens) {
  const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t K = a.K, group = a.HV / a.H;
  auto warp_sum = [](double x) {
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
  };
  if (item < tokens * a.H) {
    const int64_t t = st.t_begin + item / a.H, h = item % a.H, tok = item / a.H;
    double dq[4], dk[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t i = lane + 32 * c;
      dq[c] = dk[c] = 0;
      for (int64_t m = 0; m < group; ++m) {
        const int64_t at = (tok * a.HV + h * group + m) * kMaxDim + i;
        dq[c] += rg.dq[at];
        dk[c] += rg.dk[at];
      }
      dq[c] *= a.scale;
    }
    if (a.qk_l2norm) {
      double sq = 0, sk = 0, pq = 0, pk = 0;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t i = lane + 32 * c;
        const double q = i < K ? load_as_double(a.q, a.input_dtype, (t * a.H + h) * K + i) : 0.0;
        const double k = i < K ? load_as_double(a.k, a.input_dtype, (t * a.H + h) * K + i) : 0.0;
        sq += q * q;
        sk += k * k;
        pq += st.q[item * kMaxDim + i] * dq[c];
        pk += st.k[item * kMaxDim + i] * dk[c];
      }
      const double fq = inverse_norm(warp_sum(sq)), fk = inverse_norm(warp_sum(sk));
      pq = warp_sum(pq);
      pk = warp_sum(pk);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t i = lane + 32 * c;
        dq[c] = fq * (dq[c] - st.q[item * kMaxDim + i] * pq);
        dk[c] = fk * (dk[c] - st.k[item * kMaxDim + i] * pk);
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t i = lane + 32 * c;
      if (i < K) {
        g.dq[(t * a.H + h) * K + i] = dq[c];
        g.dk[(t * a.H + h) * K + i] = dk[c];
      }
    }
    return;
  }
  const int64_t vitem = item - tokens * a.H;
  if (vitem >= tokens * a.HV) return;
  const int64_t t = st.t_begin + vitem / a.HV, hv = vitem % a.HV;
  const double amp = (a.gate != K3GC_GATE_LOG_DECAY && a.A_log) ? Math<double>::exp_(double(a.A_log[hv])) : 1.0;
  double dA = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int64_t i = lane + 32 * c;
    if (i >= K) continue;
    const double dgamma = rg.dd[vitem * kMaxDim + i] * st.d[vitem * kMaxDim + i];  // d = exp(gamma)
    const double raw = load_as_double(a.g, a.input_dtype, (t * a.HV + hv) * K + i);
    const double x = raw + (a.dt_bias ? double(a.dt_bias[hv * K + i]) : 0.0);
    double dx = dgamma;
    if (a.gate == K3GC_GATE_SOFTPLUS) {  // gamma = -amp softplus(x): d/dx = -amp sigmoid(x), d/dA_log = gamma
      dx = dgamma * (-amp * sigmoid(x));
      dA += dgamma * (-amp * softplus(x));
    } else if (a.gate == K3GC_GATE_LOWER_BOUND) {  // gamma = lb sigmoid(y), y = amp x (x without A_log)
      const double y = a.A_log ? amp * x : x, sy = sigmoid(y);
      const double dy = dgamma * (a.lower_bound * sy * (1.0 - sy));
      dx = a.A_log ? dy * amp : dy;
      dA += dy * y;  // dy/dA_log = amp x = y
    }
    g.dg[(t * a.HV + hv) * K + i] = dx;
  }
  dA = warp_sum(dA);
  if (lane == 0) {
    if (dA_part) dA_part[vitem] = dA;
    const double db = rg.db[vitem];
    const double sb = sigmoid(load_as_double(a.beta, a.input_dtype, t * a.HV + hv));
    g.dbeta[t * a.HV + hv] = a.beta_mode == K3GC_BETA_SIGMOID       ? db * (sb * (1.0 - sb))
                             : a.beta_mode == K3GC_BETA_TWO_SIGMOID ? db * (2.0 * sb * (1.0 - sb))
                                                                    : db;
  }
}

// out[c] = sum over the rows t < rows of x[t * stride + c], c < width: a block per c, its
// threads each over every 256th row in order, then a tree in shared memory.
__global__ void __launch_bounds__(256) sum_rows(const double* x, int64_t rows, int64_t stride, double* out) {
  __shared__ double part[256];
  const int64_t c = blockIdx.x;
  double y = 0;
  for (int64_t t = threadIdx.x; t < rows; t += 256) y += x[t * stride + c];
  part[threadIdx.x] = y;
  __syncthreads();
  for (int half = 128; half > 0; half /= 2) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[c] = part[0];
}

int launch(const k3gc_kda_args& a, const k3gc_kda_grads& g, int64_t n_seq, cudaStream_t stream) {
  std::vector<int64_t> cu;
  if (int rc = sequence_bounds(a, n_seq, stream, "k3gc_kda_backward", cu)) return rc;
  const int64_t t_begin = cu[0], tokens = cu[n_seq] - cu[0];
  auto zero = [&](void* p, int64_t doubles) {
    return p && doubles > 0 ? check_cuda(cudaMemsetAsync(p, 0, size_t(doubles) * 8, stream), "k3gc_kda_backward: zeroing")
                            : 0;
  };
  // Tokens outside every sequence have zero gradients.
  const int64_t rows = a.B * a.T;
  if (int rc = zero(g.dq, rows * a.H * a.K) | zero(g.dk, rows * a.H * a.K) | zero(g.dv, rows * a.HV * a.V) |
               zero(g.dg, rows * a.HV * a.K) | zero(g.dbeta, rows * a.HV) | zero(g.dA_log, a.HV) |
               zero(g.ddt_bias, a.HV * a.K))
    return rc;

  const int64_t per_token = (2 * a.H + 4 * a.HV) * kMaxDim + 3 * a.HV;
  StreamBuffer work(stream);
  if (tokens > 0 && check_cuda(cudaMallocAsync(&work.p, size_t(tokens * per_token) * 8, stream),
                               "k3gc_kda_backward: the staged rows and their gradients"))
    return 1;
  double* base = static_cast<double*>(work.p);
  Staged st{};
  RowGrads rg{};
  st.t_begin = t_begin;
  st.q = base;
  st.k = st.q + tokens * a.H * kMaxDim;
  st.d = st.k + tokens * a.H * kMaxDim;
  rg.dq = st.d + tokens * a.HV * kMaxDim;
  rg.dk = rg.dq + tokens * a.HV * kMaxDim;
  rg.dd = rg.dk + tokens * a.HV * kMaxDim;
  st.b = rg.dd + tokens * a.HV * kMaxDim;
  rg.db = st.b + tokens * a.HV;
  double* const dA_part = rg.db + tokens * a.HV;
  const unsigned row_blocks = static_cast<unsigned>((tokens * (a.H + a.HV) + 7) / 8);
  if (tokens > 0) {
    stage_rows<<<row_blocks, 256, 0, stream>>>(a, st, tokens);
    if (int rc = check_cuda(cudaGetLastError(), "k3gc_kda_backward: stage_rows launch")) return rc;
  }

  // Pairs in batches whose kept and scratch states fit kBatchBytes (at least one pair).
  int64_t longest = 0;
  for (int64_t n = 0; n < n_seq; ++n) longest = std::max(longest, cu[n + 1] - cu[n]);
  const int64_t kept_states = std::max<int64_t>(1, (longest + kChunk - 1) / kChunk);
  const int64_t scratch_states = std::max<int64_t>(1, std::min(kChunk, longest));
  const int64_t pair_bytes = (kept_states + scratch_states) * kState * 8;
  const int64_t pairs = n_seq * a.HV;
  const int64_t batch = std::min(pairs, std::max<int64_t>(1, std::min<int64_t>(kBatchBytes / pair_bytes, 0x7fffffff)));
  StreamBuffer states(stream);
  if (check_cuda(cudaMallocAsync(&states.p, size_t(batch * pair_bytes), stream), "k3gc_kda_backward: the kept states"))
    return 1;
  double* const kept = static_cast<double*>(states.p);
  double* const scratch = kept + batch * kept_states * kState;
  const size_t smem = (kMaxDim * kPad + kMaxDim) * sizeof(double);
  if (int rc = check_cuda(cudaFuncSetAttribute(recurrence, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                          "k3gc_kda_backward: shared memory"))
    return rc;
  for (int64_t pair0 = 0; pair0 < pairs; pair0 += batch) {
    const int64_t count = std::min(batch, pairs - pair0);
    recurrence<<<static_cast<unsigned>(count), kThreads, smem, stream>>>(a, g, st, rg, pair0, kept, kept_states, scratch,
                                                                        scratch_states);
    if (int rc = check_cuda(cudaGetLastError(), "k3gc_kda_backward: recurrence launch")) return rc;
  }

  if (tokens > 0) {
    finish<<<row_blocks, 256, 0, stream>>>(a, g, st, rg, g.dA_log ? dA_part : nullptr, tokens);
    if (int rc = check_cuda(cudaGetLastError(), "k3gc_kda_backward: finish launch")) return rc;
    if (g.dA_log) sum_rows<<<static_cast<unsigned>(a.HV), 256, 0, stream>>>(dA_part, tokens, a.HV, g.dA_log);
    if (g.ddt_bias && a.gate != K3GC_GATE_LOG_DECAY)  // the log-decay gate takes no bias: its gradient stays 0
      sum_rows<<<static_cast<unsigned>(a.HV * a.K), 256, 0, stream>>>(g.dg + t_begin * a.HV * a.K, tokens, a.HV * a.K,
                                                                       g.ddt_bias);
    if (int rc = check_cuda(cudaGetLastError(), "k3gc_kda_backward: sum_rows launch")) return rc;
  }
  return 0;
}

}  // namespace bwd
}  // namespace
}  // namespace k3gc

extern "C" int k3gc_kda_backward(const k3gc_kda_args* args, const k3gc_kda_grads* grads, void* stream_ptr) {
  using namespace k3gc;
  if (!args || !grads) return fail("k3gc_kda_backward: args or grads is NULL");
  const k3gc_kda_args& a = *args;
  const k3gc_kda_grads& g = *grads;
  if (int rc = check_kda_args(a, "k3gc_kda_backward")) return rc;
  if (a.T > 0 && (!g.d_o || !g.dq || !g.dk || !g.dv || !g.dg || !g.dbeta))
    return fail("k3gc_kda_backward: NULL d_o or gradient output (dq, dk, dv, dg, dbeta are needed)");
  if ((g.d_o && !valid_dtype(g.d_o_dtype)) || (g.d_final_state && !valid_dtype(g.d_final_state_dtype)))
    return fail("k3gc_kda_backward: unknown dtype code");
  if ((g.dA_log && !a.A_log) || (g.ddt_bias && !a.dt_bias))
    return fail("k3gc_kda_backward: dA_log needs A_log and ddt_bias needs dt_bias");
  const int64_t n_seq = a.cu_seqlens ? a.N : a.B;
  if (n_seq * a.HV == 0) return 0;
  return bwd::launch(a, g, n_seq, static_cast<cudaStream_t>(stream_ptr));
}
