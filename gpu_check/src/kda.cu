// KDA forward on the GPU: the fp64 reference for sequences too long for the CPU, and the
// fp32 kernel with its mutants (each one mistake a real kernel could make).
//
// The state's columns are independent: S[:, j] needs only k, q, decay, beta and v[j] of each
// token. One block per (sequence, value head); 8 threads per column j, thread s holding rows
// i = s + 8r (r < 16) in registers; k.S and q.S are reduced over the 8 threads by shuffles.
// Inputs of TT tokens at a time are staged in shared memory with the optional stages applied
// (gate, L2 norm, beta), in the accumulation type.
#include <algorithm>
#include <cmath>
#include <vector>

#include <cuda_pipeline.h>

#include "kda_common.cuh"

namespace k3gc {
namespace {

constexpr int kChunk = 16;  // the chunk size the chunk-related mutants think in
constexpr int64_t kGridLimit = 65535;  // a grid's y and z extent: where the grid mutant caps its pairs
constexpr int64_t kLongT = 4096;       // where the bf16-state mutant's "long-sequence path" starts

template <typename Acc, int TT>
struct Tile {
  Acc q[TT][kMaxDim], k[TT][kMaxDim], d[TT][kMaxDim], v[TT][kMaxDim], b[TT];
};

// A flat offset into a token tensor as the kernel computes it: the int32-wrap mutant keeps 31
// bits (a wrap to the tensor's start rather than a negative offset, so that it reads and writes
// wrong elements of the allocation instead of ending the process).
template <int MUT> __device__ __forceinline__ int64_t flat(int64_t idx) {
  return MUT == K3GC_MUT_INT32_OFFSET_WRAP ? (idx & 0x7fffffffLL) : idx;
}

__device__ __forceinline__ int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

// SL threads per column (each holding kMaxDim / SL rows), CB columns per block.
template <typename Acc, int TT, int SL, int CB, int MUT>
__global__ void __launch_bounds__(SL * CB, (SL * CB >= 1024 ? 1 : 2)) kda_kernel(k3gc_kda_args a) {
  constexpr int kSlices = SL;
  constexpr int kRows = kMaxDim / SL;
  __shared__ Tile<Acc, TT> tile;
  const int64_t col_blocks = (a.V + CB - 1) / CB;
  const int64_t cb = blockIdx.x % col_blocks;
  const int64_t n = blockIdx.x / col_blocks / a.HV, hv = blockIdx.x / col_blocks % a.HV;
  const int64_t h = hv / (a.HV / a.H);
  int64_t bos, eos;
  if (a.cu_seqlens) {
    bos = a.cu_seqlens[n];
    eos = a.cu_seqlens[n + 1];
  } else {
    bos = n * a.T;
    eos = bos + a.T;
  }
  const int64_t len = eos - bos;
  // Where the inputs of the sequence are read from (the varlen mutant reads one early).
  const int64_t read_shift = (MUT == K3GC_MUT_VARLEN_OFF_BY_ONE && n > 0 && bos > 0) ? -1 : 0;
  const int64_t K = a.K, V = a.V;
  const int64_t k_read = (MUT == K3GC_MUT_OOB_HEAD_READ) ? imin(next_pow2(K), int64_t(kMaxDim)) : K;
  const int tid = threadIdx.x;
  const int s = tid % kSlices;
  const int64_t j = cb * CB + tid / kSlices;
  const bool column = j < V;
  const int warp = tid / 32, lane = tid % 32, n_warps = blockDim.x / 32;

  Acc S[kRows];
  const bool use_init = a.initial_state && MUT != K3GC_MUT_IGNORE_INITIAL_STATE;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = s + kSlices * r;
    S[r] = Acc(0);
    if (use_init && column && i < K) {
      S[r] = Acc(load_as_double(a.initial_state, a.state_dtype, state_index(a, n, hv, i, j)));
    }
  }

  // The skip-partial-chunk mutant stops at the last full chunk.
  const int64_t end = (MUT == K3GC_MUT_SKIP_PARTIAL_CHUNK) ? bos + (len / kChunk) * kChunk : eos;
  const int64_t last_chunk_begin = bos + ((len - 1) / kChunk) * kChunk;

  for (int64_t t0 = bos; t0 < end; t0 += TT) {
    const int count = static_cast<int>(imin(int64_t(TT), end - t0));
    // The read-past-the-end mutant loads a short last tile whole and runs the recurrence over
    // all of its rows, those past the end multiplied by 0: exact on finite memory.
    const int rows = (MUT == K3GC_MUT_LAST_CHUNK_READ_PAST_END && count >= 1 && count <= TT / 2) ? TT : count;
    // Stage q, k, decay.
    for (int idx = tid; idx < TT * kMaxDim; idx += blockDim.x) {
      const int tt = idx / kMaxDim;
      const int64_t i = idx % kMaxDim;
      Acc qv = 0, kv = 0, dv = 1;
      if (tt < rows && i < k_read) {
        const int64_t t = t0 + tt + read_shift;
        const int64_t tq = (MUT == K3GC_MUT_READ_AHEAD && t + 1 < eos) ? t + 1 : t;
        qv = Acc(load_as_double(a.q, a.input_dtype, flat<MUT>((tq * a.H + h) * K + i)));
        kv = Acc(load_as_double(a.k, a.input_dtype, flat<MUT>((t * a.H + h) * K + i)));
        const Acc raw = Acc(load_as_double(a.g, a.input_dtype, flat<MUT>((t * a.HV + hv) * K + i)));
        Acc g = (i < K) ? gate_value<Acc>(a, hv, i, raw) : raw;
        if (tt >= count) {  // only the read-past-the-end mutant loads such rows
          qv *= Acc(0);
          kv *= Acc(0);
          g *= Acc(0);
        }
        dv = Math<Acc>::exp_(g);
        if (MUT == K3GC_MUT_NAN_RARE_BRANCH && g < Acc(-6)) dv = Acc(NAN);
        if (MUT == K3GC_MUT_DROP_LAST_CHUNK_DECAY && t0 + tt >= last_chunk_begin) dv = Acc(1);
      }
      tile.q[tt][i] = qv;
      tile.k[tt][i] = kv;
      tile.d[tt][i] = dv;
    }
    for (int idx = tid; idx < TT * kMaxDim; idx += blockDim.x) {
      const int tt = idx / kMaxDim;
      const int64_t c = idx % kMaxDim;
      Acc vv = 0;
      if (tt < rows && c < V) {
        vv = Acc(load_as_double(a.v, a.input_dtype, flat<MUT>(((t0 + tt + read_shift) * a.HV + hv) * V + c)));
        if (tt >= count) vv *= Acc(0);
      }
      tile.v[tt][c] = vv;
    }
    if (tid < TT) {
      Acc bv = 0;
      if (tid < rows) {
        bv = beta_value(a, Acc(load_as_double(a.beta, a.input_dtype, flat<MUT>((t0 + tid + read_shift) * a.HV + hv))));
        if (tid >= count) bv *= Acc(0);
      }
      tile.b[tid] = bv;
    }
    __syncthreads();
    if (MUT == K3GC_MUT_FUTURE_ANCHOR) {
      // Decay of row t as exp(G_t - G_a) * exp(G_a - G_{t-1}), G the chunk-local cumulative
      // gate and a the chunk's middle row: exact in real arithmetic, but the rounding of row
      // t now depends on a future row's gate.
      static_assert(MUT != K3GC_MUT_FUTURE_ANCHOR || TT == kChunk, "anchor mutant needs chunk-sized tiles");
      for (int64_t i = tid; i < K; i += blockDim.x) {
        Acc G[TT];
        Acc cum = 0;
        for (int tt = 0; tt < TT; ++tt) {
          cum += (tt < count) ? Math<Acc>::log1p_(tile.d[tt][i] - Acc(1)) : Acc(0);
          G[tt] = cum;
        }
        const int anchor = min(TT / 2, count - 1);
        for (int tt = 0; tt < count; ++tt) {
          const Acc prev = tt > 0 ? G[tt - 1] : Acc(0);
          tile.d[tt][i] = Math<Acc>::exp_(G[tt] - G[anchor]) * Math<Acc>::exp_(G[anchor] - prev);
        }
      }
      __syncthreads();
    }
    if (a.qk_l2norm) {
      for (int tt = warp; tt < count; tt += n_warps) {
        Acc sq = 0, sk = 0;
        for (int64_t i = lane; i < k_read; i += 32) {
          sq += tile.q[tt][i] * tile.q[tt][i];
          sk += tile.k[tt][i] * tile.k[tt][i];
        }
        for (int off = 16; off > 0; off /= 2) {
          sq += __shfl_xor_sync(0xffffffffu, sq, off);
          sk += __shfl_xor_sync(0xffffffffu, sk, off);
        }
        const Acc fq = inverse_norm(sq), fk = inverse_norm(sk);
        for (int64_t i = lane; i < k_read; i += 32) {
          tile.q[tt][i] *= fq;
          tile.k[tt][i] *= fk;
        }
      }
      __syncthreads();
    }
    if (MUT == K3GC_MUT_OVERWRITE_INPUT) {
      // Each block owns its value head: write beta * v back over the input.
      const int64_t c_begin = cb * CB, c_count = imin(int64_t(CB), V - c_begin);
      for (int idx = tid; idx < count * c_count; idx += blockDim.x) {
        const int tt = idx / c_count;
        const int64_t c = c_begin + idx % c_count;
        store_from_double(const_cast<void*>(a.v), a.input_dtype, ((t0 + tt) * a.HV + hv) * V + c,
                          double(tile.b[tt] * tile.v[tt][c]));
      }
    }

    const Acc scale = Acc(a.scale);
    for (int tt = 0; tt < rows; ++tt) {
      Acc ks = 0;
      // The bf16-state mutant stores its state in bf16: each write (the decay, the update) rounds.
      const bool bf16_state = MUT == K3GC_MUT_BF16_STATE_LONG_T && t0 + tt - bos >= kLongT;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        S[r] *= tile.d[tt][s + kSlices * r];
        if (bf16_state) S[r] = Acc(__bfloat162float(__float2bfloat16(static_cast<float>(S[r]))));
        ks += tile.k[tt][s + kSlices * r] * S[r];
      }
#pragma unroll
      for (int off = SL / 2; off > 0; off /= 2) ks += __shfl_xor_sync(0xffffffffu, ks, off);
      const Acc u = tile.b[tt] * ((column ? tile.v[tt][j] : Acc(0)) - ks);
      Acc qs = 0;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        S[r] += tile.k[tt][s + kSlices * r] * u;
        if (bf16_state) S[r] = Acc(__bfloat162float(__float2bfloat16(static_cast<float>(S[r]))));
        qs += tile.q[tt][s + kSlices * r] * S[r];
      }
#pragma unroll
      for (int off = SL / 2; off > 0; off /= 2) qs += __shfl_xor_sync(0xffffffffu, qs, off);
      if (s == 0 && column && tt < count)
        store_from_double(a.o, a.output_dtype, flat<MUT>(((t0 + tt) * a.HV + hv) * V + j), double(qs * scale));
    }
    __syncthreads();
  }

  if (a.final_state && column) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = s + kSlices * r;
      if (i < K) {
        store_from_double(a.final_state, a.state_dtype, state_index(a, n, hv, i, j), double(S[r]));
      }
    }
  }
}

template <typename Acc, int TT, int SL, int CB, int MUT>
int launch(const k3gc_kda_args& a, int64_t n_seq, cudaStream_t stream) {
  const int64_t col_blocks = (a.V + CB - 1) / CB;
  // Fewer threads when V is small; whole warps, whole columns.
  const int64_t cols = a.V < CB ? a.V : CB;
  const int threads = static_cast<int>((cols * SL + 31) / 32 * 32);
  int64_t pairs = n_seq * a.HV;
  if (MUT == K3GC_MUT_GRID_DROPS_SEQUENCES && pairs > kGridLimit) pairs = kGridLimit;
  kda_kernel<Acc, TT, SL, CB, MUT><<<static_cast<unsigned>(pairs * col_blocks), threads, 0, stream>>>(a);
  return check_cuda(cudaGetLastError(), "kda_kernel launch");
}

template <int MUT>
int launch_f32(const k3gc_kda_args& a, int64_t n_seq, cudaStream_t s) {
  return launch<float, kChunk, 8, 128, MUT>(a, n_seq, s);
}

// ---------------------------------------------------------------------------------------------
// The fp64 reference, fast form (precision 2): bit for bit the plain kernel's
// launch<double, 8, 16, 32, 0> (precision 0, the definition), tested against it
// (tests/gpu_check/test_fp64_reference.py), and what the long references run. Every element
// gets the same IEEE operations in the same order; only who computes them, and when, changes:
//
// - Staging runs once per token and head, not once per column block: a prepare kernel writes
//   the staged rows (q and k after the L2 norm, the decay exp(gate), v and beta, each the plain
//   kernel's expression) as fp64 into a workspace, for a window of tokens at a time (at most
//   kWorkspaceBytes), where the plain kernel recomputes the gate's exps in each of a head's 4
//   column blocks.
// - Column j's k.S and q.S are, in the plain kernel, 16 partial sums ("slices" s < 16, slice s
//   summing rows s + 16r in r order, starting from 0) reduced by x += shfl_xor(x, off) for off
//   = 8, 4, 2, 1. Addition is commutative, so lanes s and s^off hold the same value after each
//   step: P threads per column (thread p holding the 16/P slices s = p + P*jv, i.e. the rows
//   i = p mod P) do the steps off >= P in registers, own operand first, and shuffle only the
//   steps off < P. Each thread holds C = 2 columns: one load of a row's q, k and decay serves
//   both, and their shuffle steps are paired (pair_sum). Of the loop's 433 instructions per
//   warp and token, 239 are fp64 arithmetic (ncu on the H200).
// - The recurrence streams its window's rows from the workspace into shared memory with
//   cp.async, the next tile of kTT tokens in flight while one is computed, one barrier per
//   tile. A thread's rows lie contiguously (row i at (i % P) * kStride + i / P, padded so the P
//   threads of a warp hit distinct banks): 16-byte loads.
// - A sequence that runs past a window carries its fp64 state to the next window through a
//   workspace buffer (two, alternating: the sequence leaving a window and the one entering it
//   may differ). Sequences are contiguous in the token dimension, so at most one crosses each
//   window boundary.
// As in the plain kernel every one of the 128 rows is computed (rows >= K with q = k = 0, decay
// 1), so zeros' signs, infinities and NaNs propagate as there.
namespace fp64 {

#ifndef K3GC_FP64_THREADS_PER_COLUMN
#define K3GC_FP64_THREADS_PER_COLUMN 8
#endif
constexpr int kP = K3GC_FP64_THREADS_PER_COLUMN;  // threads per column
constexpr int kC = 2;                             // columns per thread (pair_sum takes two)
constexpr int kThreads = 128;
constexpr int kCB = kThreads / kP * kC;  // columns per block
#ifndef K3GC_FP64_TOKENS_PER_TILE
#define K3GC_FP64_TOKENS_PER_TILE 8
#endif
#ifndef K3GC_FP64_MIN_BLOCKS
#define K3GC_FP64_MIN_BLOCKS 3
#endif
constexpr int kTT = K3GC_FP64_TOKENS_PER_TILE;  // tokens per tile (a build option, as P)
constexpr int kNV = 16 / kP;             // slices per thread
constexpr int kR = kMaxDim / kP;         // rows per thread
constexpr int kStride = kR + 2;          // a thread's row block in shared memory, padded (16 B banks)
constexpr int kWidth = kP * kStride;     // one token's row vector in shared memory
constexpr int64_t kWorkspaceBytes = int64_t(1) << 30;
// The lanes of one column hold p in the high lane bits, so that the 8 lanes of each quarter warp
// read as few distinct rows as they can (measured: 3 % faster than p in the low bits).
constexpr int kLaneStep = 32 / kP;
static_assert(16 % kP == 0 && kP >= 2 && kC == 2 && kMaxDim % kCB == 0 && kR % 2 == 0, "a layout the kernel cannot take");

// Row i of a staged vector, in the workspace (unpadded) and in shared memory.
__host__ __device__ constexpr int ws_pos(int i) { return (i % kP) * kR + i / kP; }

// The staged rows of a window of tokens [c0, c0 + tokens): q and k per (token, head), decay
// and v per (token, value head), each 128 doubles; beta per (value head, token).
struct Workspace {
  double *q, *k, *d, *v, *b;
  int64_t c0, tokens;
};

__host__ inline int64_t workspace_doubles_per_token(const k3gc_kda_args& a) { return (2 * a.H + 2 * a.HV) * kMaxDim + a.HV; }

// One warp per (token, head) of q and k, then one per (token, value head) of the decay, v and
// beta: lane l computes rows l + 32c, as the plain kernel's staging and L2 norm do.
// DT: the input dtype, a template argument so that each load is one conversion, not a switch.
template <int DT>
__global__ void __launch_bounds__(256) kda_fp64_prepare(k3gc_kda_args a, Workspace w) {
  const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t K = a.K, V = a.V;
  // The warp's two rows go through shared memory, so that each lane stores 32 contiguous bytes.
  __shared__ __align__(16) double rows[8][2][kMaxDim];
  double (&row)[2][kMaxDim] = rows[threadIdx.x / 32];
  auto write_rows = [&](double* dst0, double* dst1) {
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      double* dst = r ? dst1 : dst0;
      reinterpret_cast<double2*>(dst)[2 * lane] = reinterpret_cast<const double2*>(row[r])[2 * lane];
      reinterpret_cast<double2*>(dst)[2 * lane + 1] = reinterpret_cast<const double2*>(row[r])[2 * lane + 1];
    }
  };
  if (item < w.tokens * a.H) {
    const int64_t tok = item / a.H, h = item % a.H, t = w.c0 + tok;
    double qv[4], kv[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t i = lane + 32 * c;
      qv[c] = i < K ? load_as_double(a.q, DT, (t * a.H + h) * K + i) : 0.0;
      kv[c] = i < K ? load_as_double(a.k, DT, (t * a.H + h) * K + i) : 0.0;
    }
    if (a.qk_l2norm) l2_normalize(qv, kv, lane, K);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      row[0][ws_pos(lane + 32 * c)] = qv[c];
      row[1][ws_pos(lane + 32 * c)] = kv[c];
    }
    write_rows(w.q + item * kMaxDim, w.k + item * kMaxDim);
    return;
  }
  const int64_t vitem = item - w.tokens * a.H;
  if (vitem >= w.tokens * a.HV) return;  // a whole warp: write_rows' __syncwarp sees all 32 lanes
  const int64_t tok = vitem / a.HV, hv = vitem % a.HV, t = w.c0 + tok;
  // exp(A_log[hv]) once per warp, not per element: a function, so the same bits.
  const double amp = (a.gate != K3GC_GATE_LOG_DECAY && a.A_log) ? Math<double>::exp_(double(a.A_log[hv])) : 1.0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int64_t i = lane + 32 * c;
    double dv = 1;
    if (i < K) dv = Math<double>::exp_(gate_with_amp(a, amp, hv, i, load_as_double(a.g, DT, (t * a.HV + hv) * K + i)));
    row[0][ws_pos(lane + 32 * c)] = dv;
    row[1][i] = i < V ? load_as_double(a.v, DT, (t * a.HV + hv) * V + i) : 0.0;
  }
  write_rows(w.d + vitem * kMaxDim, w.v + vitem * kMaxDim);
  if (lane == 0) {
    w.b[hv * w.tokens + tok] = beta_value(a, load_as_double(a.beta, DT, t * a.HV + hv));
  }
}

struct alignas(16) Tile64 {
  double q[kTT][kWidth], k[kTT][kWidth], d[kTT][kWidth];
  double v[kTT][kCB], b[kTT];
};

// One step of the reduction tree in registers: slice jv takes slice jv ^ dj = jv + dj (its own
// value first, as x += shfl_xor(x, off) adds); only the slices jv < dj feed the next step.
__device__ __forceinline__ void tree_step(double (&x)[kNV], int dj) {
#pragma unroll
  for (int jv = 0; jv < kNV; ++jv)
    if (jv < dj) x[jv] = x[jv] + x[jv + dj];
}

// Two columns' reductions at once: the first shuffle step exchanges the halves, lanes with
// bit kP / 2 of p set keeping column 1 and the others column 0, so each step after it moves one
// value, not two. Returns the kept column's sum (column hi of the caller's pair).
__device__ __forceinline__ double pair_sum(double (&x0)[kNV], double (&x1)[kNV], bool hi) {
#pragma unroll
  for (int off = 8; off >= kP; off /= 2) {
    tree_step(x0, off / kP);
    tree_step(x1, off / kP);
  }
  const double keep = hi ? x1[0] : x0[0], send = hi ? x0[0] : x1[0];
  double sum = keep + __shfl_xor_sync(0xffffffffu, send, (kP / 2) * kLaneStep);
#pragma unroll
  for (int off = kP / 4; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off * kLaneStep);
  return sum;
}

// The sequences [n_lo, n_lo + gridDim / (HV * column blocks)) over the window's tokens
// [w.c0, w.c0 + w.tokens): their state from the initial state (or 0) where they begin in the
// window, else from carry_in; to the final state where they end in it, else to carry_out
// (each [HV, 128, 128] fp64).
__global__ void __launch_bounds__(kThreads, K3GC_FP64_MIN_BLOCKS)
    kda_fp64_window(k3gc_kda_args a, Workspace w, int64_t n_lo, const double* carry_in, double* carry_out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Tile64* const buf = reinterpret_cast<Tile64*>(smem_raw);  // [2]
  const int64_t col_blocks = (a.V + kCB - 1) / kCB;
  const int64_t cb = blockIdx.x % col_blocks;
  const int64_t n = n_lo + blockIdx.x / col_blocks / a.HV, hv = blockIdx.x / col_blocks % a.HV;
  const int64_t h = hv / (a.HV / a.H);
  const int64_t bos = a.cu_seqlens ? a.cu_seqlens[n] : n * a.T, eos = a.cu_seqlens ? a.cu_seqlens[n + 1] : bos + a.T;
  const int64_t c0 = w.c0, c1 = w.c0 + w.tokens;
  const int64_t lo = bos > c0 ? bos : c0, hi = eos < c1 ? eos : c1;
  const int64_t K = a.K, V = a.V;
  const int tid = threadIdx.x;
  const int p = tid % 32 / kLaneStep;
  const int jl = (tid / 32 * kLaneStep + tid % kLaneStep) * kC;  // this thread's first column in the block
  const int64_t j0 = cb * kCB + jl;

  double S[kC][kR];
  const bool begins = bos >= c0;
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const int64_t j = j0 + c;
#pragma unroll
    for (int m = 0; m < kR; ++m) {
      const int64_t i = p + kP * m;
      S[c][m] = 0.0;
      if (j < V && i < K) {
        if (!begins) S[c][m] = carry_in[(hv * kMaxDim + i) * kMaxDim + j];
        else if (a.initial_state) S[c][m] = load_as_double(a.initial_state, a.state_dtype, state_index(a, n, hv, i, j));
      }
    }
  }

  // Tile nt's rows into buffer nb, 16 bytes (beta: 8) per cp.async.
  // Constant trip counts and power-of-two strides: the index arithmetic is shifts, not the
  // runtime divisions a loop over `count` tokens would take (measured: a tenth of the kernel).
  const int64_t stride_qk = a.H * kMaxDim, stride_dv = a.HV * kMaxDim;
  auto stage = [&](int64_t t0, int count, int nb) {
    Tile64& tile = buf[nb];
    constexpr int kChunks = kMaxDim / 2;  // 16-byte chunks of one row vector
    const int64_t tok0 = t0 - c0;
    const double* const src_q = w.q + tok0 * stride_qk + h * kMaxDim;
    const double* const src_k = w.k + tok0 * stride_qk + h * kMaxDim;
    const double* const src_d = w.d + tok0 * stride_dv + hv * kMaxDim;
#pragma unroll 1
    for (int idx = tid; idx < 3 * kTT * kChunks; idx += kThreads) {
      const int which = idx / (kTT * kChunks), tt = idx / kChunks % kTT, at = 2 * (idx % kChunks);
      if (tt >= count) continue;
      const double* src = (which == 0 ? src_q : which == 1 ? src_k : src_d) + tt * (which == 2 ? stride_dv : stride_qk);
      double* dst = which == 0 ? tile.q[tt] : which == 1 ? tile.k[tt] : tile.d[tt];
      __pipeline_memcpy_async(dst + (at / kR) * kStride + at % kR, src + at, 16);  // (p, m) = (at / kR, at % kR)
    }
    auto copy_v = [&](int idx) {
      const int tt = idx / (kCB / 2), ch = idx % (kCB / 2);
      if (tt < count) __pipeline_memcpy_async(&tile.v[tt][2 * ch], w.v + (tok0 + tt) * stride_dv + hv * kMaxDim + cb * kCB + 2 * ch, 16);
    };
    if constexpr (kTT * (kCB / 2) <= kThreads) {  // one chunk per thread at most (P = 8): no loop, no spill
      if (tid < kTT * (kCB / 2)) copy_v(tid);
    } else {
      for (int idx = tid; idx < kTT * (kCB / 2); idx += kThreads) copy_v(idx);
    }
    if (tid < count) __pipeline_memcpy_async(&tile.b[tid], w.b + hv * w.tokens + tok0 + tid, 8);
    __pipeline_commit();
  };

  const double scale = a.scale;
  // Token t's o from its q.S partial sums: lanes p = 0 and kP / 2 hold columns j0 and j0 + 1.
  const bool upper = p & (kP / 2);
  double xq[kC][kNV];
  auto output = [&](double (&x)[kC][kNV], int64_t t) {
    const double qs = pair_sum(x[0], x[1], upper);
    const int64_t j = j0 + (upper ? 1 : 0);
    if (p % (kP / 2) == 0 && j < V) store_from_double(a.o, a.output_dtype, (t * a.HV + hv) * V + j, qs * scale);
  };
  const int64_t n_tiles = (hi - lo + kTT - 1) / kTT;
  if (n_tiles > 0) stage(lo, static_cast<int>(imin(int64_t(kTT), hi - lo)), 0);
  for (int64_t nt = 0; nt < n_tiles; ++nt) {
    const int nb = static_cast<int>(nt & 1);
    const int64_t t0 = lo + nt * kTT;
    // One barrier per tile: past it, tile nt is in buffer nb for every thread, and every thread
    // has finished tile nt - 1, so buffer nb ^ 1 takes tile nt + 1 while tile nt is computed.
    __pipeline_wait_prior(0);
    __syncthreads();
    if (nt + 1 < n_tiles) stage(t0 + kTT, static_cast<int>(imin(int64_t(kTT), hi - t0 - kTT)), nb ^ 1);
    const int count = static_cast<int>(imin(int64_t(kTT), hi - t0));
    const Tile64& tile = buf[nb];
    for (int tt = 0; tt < count; ++tt) {
      const double* dq = tile.d[tt] + p * kStride;
      const double* kq = tile.k[tt] + p * kStride;
      const double* qq = tile.q[tt] + p * kStride;
      double xk[kC][kNV];
#pragma unroll
      for (int c = 0; c < kC; ++c)
#pragma unroll
        for (int jv = 0; jv < kNV; ++jv) xk[c][jv] = 0;
#pragma unroll
      for (int m = 0; m < kR; m += 2) {  // m = jv + kNV * r: slice jv's rows in r order
        const double2 d2 = *reinterpret_cast<const double2*>(dq + m);
        const double2 k2 = *reinterpret_cast<const double2*>(kq + m);
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          S[c][m] *= d2.x;
          S[c][m + 1] *= d2.y;
          xk[c][m % kNV] += k2.x * S[c][m];
          xk[c][(m + 1) % kNV] += k2.y * S[c][m + 1];
        }
      }
      const double ks_mine = pair_sum(xk[0], xk[1], upper);
      const double ks_other = __shfl_xor_sync(0xffffffffu, ks_mine, (kP / 2) * kLaneStep);
      const double b = tile.b[tt];
      const double u0 = b * ((j0 < V ? tile.v[tt][jl] : 0.0) - (upper ? ks_other : ks_mine));
      const double u1 = b * ((j0 + 1 < V ? tile.v[tt][jl + 1] : 0.0) - (upper ? ks_mine : ks_other));
#pragma unroll
      for (int c = 0; c < kC; ++c)
#pragma unroll
        for (int jv = 0; jv < kNV; ++jv) xq[c][jv] = 0;
#pragma unroll
      for (int m = 0; m < kR; m += 2) {
        const double2 q2 = *reinterpret_cast<const double2*>(qq + m);
        const double2 k2 = *reinterpret_cast<const double2*>(kq + m);
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          const double u = c ? u1 : u0;
          S[c][m] += k2.x * u;
          S[c][m + 1] += k2.y * u;
          xq[c][m % kNV] += q2.x * S[c][m];
          xq[c][(m + 1) % kNV] += q2.y * S[c][m + 1];
        }
      }
      output(xq, t0 + tt);
    }
  }

  const bool ends = eos <= c1;
  if (ends && !a.final_state) return;
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const int64_t j = j0 + c;
#pragma unroll
    for (int m = 0; m < kR; ++m) {
      const int64_t i = p + kP * m;
      if (j >= V || i >= K) continue;
      if (ends) store_from_double(a.final_state, a.state_dtype, state_index(a, n, hv, i, j), S[c][m]);
      else carry_out[(hv * kMaxDim + i) * kMaxDim + j] = S[c][m];
    }
  }
}

int launch_fast(const k3gc_kda_args& a, int64_t n_seq, cudaStream_t stream) {
  // The sequences' bounds on the host, to cut the tokens into windows at known sequences.
  std::vector<int64_t> cu;
  if (int rc = sequence_bounds(a, n_seq, stream, "k3gc_kda_forward", cu)) return rc;
  const int64_t begin = cu[0], total = cu[n_seq];  // the tokens the sequences cover: [begin, total)
  const int64_t per_token = workspace_doubles_per_token(a);
  const int64_t window = total == begin ? 0 : std::max<int64_t>(kTT, std::min(total - begin, kWorkspaceBytes / 8 / per_token));

  StreamBuffer ws(stream), carry(stream);
  if (window > 0 && check_cuda(cudaMallocAsync(&ws.p, size_t(window * per_token) * 8, stream),
                               "k3gc_kda_forward: the fp64 reference's workspace"))
    return 1;
  const int64_t carry_doubles = a.HV * kMaxDim * kMaxDim;
  if (window < total - begin && check_cuda(cudaMallocAsync(&carry.p, size_t(2 * carry_doubles) * 8, stream),
                                   "k3gc_kda_forward: the fp64 reference's state carry"))
    return 1;
  double* const carry_buf[2] = {static_cast<double*>(carry.p), carry.p ? static_cast<double*>(carry.p) + carry_doubles : nullptr};

  const size_t smem = 2 * sizeof(Tile64);
  if (int rc = check_cuda(cudaFuncSetAttribute(kda_fp64_window, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                          "kda_fp64_window shared memory"))
    return rc;
  const int64_t col_blocks = (a.V + kCB - 1) / kCB;
  int64_t n = 0, c0 = begin;
  for (int parity = 0; n < n_seq; parity ^= 1) {
    const int64_t c1 = std::min(c0 + window, total);
    // The sequences with tokens in [c0, c1), and the empty ones at its positions (those at
    // c1 belong to the next window, unless this is the last).
    int64_t n_hi = n;
    while (n_hi < n_seq && (cu[n_hi] < c1 || c1 == total)) ++n_hi;
    Workspace w{};
    w.c0 = c0;
    w.tokens = c1 - c0;
    if (w.tokens > 0) {
      double* base = static_cast<double*>(ws.p);
      w.q = base;
      w.k = w.q + w.tokens * a.H * kMaxDim;
      w.d = w.k + w.tokens * a.H * kMaxDim;
      w.v = w.d + w.tokens * a.HV * kMaxDim;
      w.b = w.v + w.tokens * a.HV * kMaxDim;
      const int64_t warps = w.tokens * (a.H + a.HV);
      const unsigned blocks_p = static_cast<unsigned>((warps + 7) / 8);
      switch (a.input_dtype) {
        case K3GC_F64: kda_fp64_prepare<K3GC_F64><<<blocks_p, 256, 0, stream>>>(a, w); break;
        case K3GC_F32: kda_fp64_prepare<K3GC_F32><<<blocks_p, 256, 0, stream>>>(a, w); break;
        case K3GC_BF16: kda_fp64_prepare<K3GC_BF16><<<blocks_p, 256, 0, stream>>>(a, w); break;
        default: kda_fp64_prepare<K3GC_F16><<<blocks_p, 256, 0, stream>>>(a, w); break;
      }
      if (int rc = check_cuda(cudaGetLastError(), "kda_fp64_prepare launch")) return rc;
    }
    const int64_t blocks = (n_hi - n) * a.HV * col_blocks;
    if (blocks > 0x7fffffffLL) return fail("k3gc_kda_forward: more than 2^31 - 1 blocks in one window");
    if (blocks > 0) kda_fp64_window<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(a, w, n, carry_buf[parity], carry_buf[parity ^ 1]);
    if (int rc = check_cuda(cudaGetLastError(), "kda_fp64_window launch")) return rc;
    // The next window starts with the sequence that runs past c1, if one does.
    n = (n_hi > n && cu[n_hi] > c1) ? n_hi - 1 : n_hi;
    c0 = c1;
  }
  return 0;
}

}  // namespace fp64

}  // namespace
int check_kda_args(const k3gc_kda_args& a, const char* fn) {
  const std::string f = fn;
  if (a.K < 1 || a.K > kMaxDim || a.V < 1 || a.V > kMaxDim)
    return fail(f + ": K and V must be in [1, 128], got K=" + std::to_string(a.K) + " V=" + std::to_string(a.V));
  if (a.H < 1 || a.HV < a.H || a.HV % a.H != 0) return fail(f + ": HV must be a positive multiple of H");
  if (a.cu_seqlens ? (a.B != 1 || a.N < 1) : (a.B < 1)) return fail(f + ": with cu_seqlens B must be 1 and N >= 1");
  if (!valid_dtype(a.input_dtype) || !valid_dtype(a.output_dtype) ||
      ((a.initial_state || a.final_state) && !valid_dtype(a.state_dtype)))
    return fail(f + ": unknown dtype code");
  if (a.gate < 0 || a.gate > 2 || a.beta_mode < 0 || a.beta_mode > 2) return fail(f + ": unknown gate or beta mode");
  // T = 0: the token tensors are empty (a framework may hand NULL for them); only the states are touched
  if (a.T > 0 && (!a.q || !a.k || !a.v || !a.g || !a.beta)) return fail(f + ": NULL input or output");
  if (a.T < 0) return fail(f + ": T < 0");
  return 0;
}

int sequence_bounds(const k3gc_kda_args& a, int64_t n_seq, cudaStream_t stream, const char* fn, std::vector<int64_t>& cu) {
  const std::string f = fn;
  cu.assign(static_cast<size_t>(n_seq) + 1, 0);
  if (a.cu_seqlens) {
    if (int rc = check_cuda(cudaMemcpyAsync(cu.data(), a.cu_seqlens, cu.size() * sizeof(int64_t), cudaMemcpyDeviceToHost, stream),
                            (f + ": reading cu_seqlens").c_str()))
      return rc;
    if (int rc = check_cuda(cudaStreamSynchronize(stream), (f + ": reading cu_seqlens").c_str())) return rc;
    for (int64_t n = 0; n < n_seq; ++n)
      if (cu[n + 1] < cu[n]) return fail(f + ": cu_seqlens decreases at index " + std::to_string(n + 1));
    if (cu[0] < 0 || cu[n_seq] > a.T)
      return fail(f + ": cu_seqlens must lie in [0, T = " + std::to_string(a.T) + "], got " + std::to_string(cu[0]) +
                  " to " + std::to_string(cu[n_seq]));
  } else {
    for (int64_t n = 0; n <= n_seq; ++n) cu[n] = n * a.T;
  }
  return 0;
}

}  // namespace k3gc

extern "C" const char* k3gc_mutation_name(int mutation) { return k3gc_mutation_name_of(mutation); }

extern "C" int k3gc_kda_forward(const k3gc_kda_args* args, int precision, int mutation, void* stream_ptr) {
  using namespace k3gc;
  if (!args) return fail("k3gc_kda_forward: args is NULL");
  const k3gc_kda_args& a = *args;
  if (int rc = check_kda_args(a, "k3gc_kda_forward")) return rc;
  if (a.T > 0 && !a.o) return fail("k3gc_kda_forward: NULL input or output");
  const int64_t n_seq = a.cu_seqlens ? a.N : a.B;
  if (n_seq * a.HV == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream_ptr);
  if (precision == 0 || precision == 2) {
    if (mutation != K3GC_MUT_NONE) return fail("k3gc_kda_forward: the fp64 reference has no mutants");
    // 0: the plain kernel (the definition); 2: the fast form (bit for bit the same).
    return precision == 2 ? fp64::launch_fast(a, n_seq, s) : launch<double, 8, 16, 32, 0>(a, n_seq, s);
  }
  if (precision != 1)
    return fail("k3gc_kda_forward: precision must be 0 (fp64), 1 (fp32) or 2 (fp64, fast form), got " +
                std::to_string(precision));
  switch (mutation) {
    case 0: return launch_f32<0>(a, n_seq, s);
    case 1: return launch_f32<1>(a, n_seq, s);
    case 2: return launch_f32<2>(a, n_seq, s);
    case 3: return launch_f32<3>(a, n_seq, s);
    case 4: return launch_f32<4>(a, n_seq, s);
    case 5: return launch_f32<5>(a, n_seq, s);
    case 6: return launch_f32<6>(a, n_seq, s);
    case 7: return launch_f32<7>(a, n_seq, s);
    case 8: return launch_f32<8>(a, n_seq, s);
    case 9: return launch_f32<9>(a, n_seq, s);
    case 10: return launch_f32<10>(a, n_seq, s);
    case 11: return launch_f32<11>(a, n_seq, s);
    case 12: return launch_f32<12>(a, n_seq, s);
    case 13: return launch_f32<13>(a, n_seq, s);
    default: return fail("k3gc_kda_forward: unknown mutation " + std::to_string(mutation));
  }
}
