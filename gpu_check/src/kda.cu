// KDA forward on the GPU: the fp64 reference for sequences too long for the CPU, and the
// fp32 kernel with its mutants (each one mistake a real kernel could make).
//
// The state's columns are independent: S[:, j] needs only k, q, decay, beta and v[j] of each
// token. One block per (sequence, value head); 8 threads per column j, thread s holding rows
// i = s + 8r (r < 16) in registers; k.S and q.S are reduced over the 8 threads by shuffles.
// Inputs of TT tokens at a time are staged in shared memory with the optional stages applied
// (gate, L2 norm, beta), in the accumulation type.
#include <cmath>

#include <cooperative_groups.h>

#include "common.cuh"

namespace k3gc {
namespace {

constexpr int kMaxDim = 128;
constexpr int kChunk = 16;  // the chunk size the chunk-related mutants think in
constexpr int64_t kGridLimit = 65535;  // a grid's y and z extent: where the grid mutant caps its pairs
constexpr int64_t kLongT = 4096;       // where the bf16-state mutant's "long-sequence path" starts

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

// The log decay of one gate element, from the raw input as the options say.
template <typename Acc>
__device__ Acc gate_value(const k3gc_kda_args& a, int64_t hv, int64_t i, Acc raw) {
  if (a.gate == K3GC_GATE_LOG_DECAY) return raw;
  const Acc bias = a.dt_bias ? Acc(a.dt_bias[hv * a.K + i]) : Acc(0);
  const Acc x = raw + bias;
  if (a.gate == K3GC_GATE_SOFTPLUS) {
    const Acc amp = a.A_log ? Math<Acc>::exp_(Acc(a.A_log[hv])) : Acc(1);
    return -amp * softplus(x);
  }
  const Acc y = a.A_log ? Math<Acc>::exp_(Acc(a.A_log[hv])) * x : x;
  return Acc(a.lower_bound) * sigmoid(y);
}

template <typename Acc, int TT>
struct Tile {
  Acc q[TT][kMaxDim], k[TT][kMaxDim], d[TT][kMaxDim], v[TT][kMaxDim], b[TT];
};

__device__ __forceinline__ int64_t imin(int64_t x, int64_t y) { return x < y ? x : y; }

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
      const int64_t idx = ((n * a.HV + hv) * (a.state_v_first ? V : K) + (a.state_v_first ? j : i)) *
                              (a.state_v_first ? K : V) + (a.state_v_first ? i : j);
      S[r] = Acc(load_as_double(a.initial_state, a.state_dtype, idx));
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
        bv = Acc(load_as_double(a.beta, a.input_dtype, flat<MUT>((t0 + tid + read_shift) * a.HV + hv)));
        if (a.beta_mode == K3GC_BETA_SIGMOID) bv = sigmoid(bv);
        if (a.beta_mode == K3GC_BETA_TWO_SIGMOID) bv = Acc(2) * sigmoid(bv);
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
        const Acc fq = Acc(1) / Math<Acc>::sqrt_(sq + Acc(1e-6)), fk = Acc(1) / Math<Acc>::sqrt_(sk + Acc(1e-6));
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
        const int64_t idx = ((n * a.HV + hv) * (a.state_v_first ? V : K) + (a.state_v_first ? j : i)) *
                                (a.state_v_first ? K : V) + (a.state_v_first ? i : j);
        store_from_double(a.final_state, a.state_dtype, idx, double(S[r]));
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
// The fp64 reference, cluster-staged (precision 2): bit for bit the plain kernel's
// launch<double, 8, 16, 32, 0> (precision 0, the reference), tested against it
// (tests/gpu_check/test_fp64_reference.py). Written to be faster, measured slower on an H200
// (K3's shape, 125,000 tokens x 96 heads: 0.51 s against the plain kernel's 0.38 s): it runs 4
// threads per column where the plain kernel runs 16, and the recurrence is latency-bound, so
// the 4x fewer warps hide less than the saved shuffles gain. Kept, tested, as the base of the
// next attempt; the reference runs the plain kernel. Every element gets the same IEEE
// operations in the same order:
//
// - Column j's k.S and q.S are, in the plain kernel, 16 partial sums ("slices" s < 16, slice s
//   summing rows s + 16r in r order, starting from 0) reduced by x += shfl_xor(x, off) for off
//   = 8, 4, 2, 1. Addition is commutative, so lanes s and s^off hold the same value after each
//   step: P physical threads per column (thread p holding the NV = 16/P slices s = p + P*jv,
//   i.e. every row i = p mod P) do the steps off >= P in registers, own operand first, and
//   shuffle only the steps off < P. Fewer shuffles and redundant tree adds, NV independent
//   accumulation chains per thread.
// - Staging computes the same expression for each element; only who computes it changes. The
//   column blocks of one (sequence, head) form a thread block cluster (sm_90) and split the
//   tile's tokens: each block stages its tokens (loads, gate, exp, L2 norm, with its lane-strided
//   sums and 16..1 tree) once and writes them into every block's shared memory, so the gate's
//   exps are computed once per head, not once per column block. exp(A_log[hv]) is hoisted (exp
//   is a function: same argument, same bits).
// - Shared memory holds a thread's rows contiguously (row i at (i % P) * kStride + i / P, padded
//   so the P threads of a warp hit distinct banks): 16-byte loads.
// - Two tile buffers: the tokens of tile n+1 are staged while tile n is computed; one cluster
//   barrier per tile.
// - Grid: for the K3 shape 96 heads x 4 column blocks = 384 blocks of 128 threads, 3 resident per
//   SM (56 KiB of shared memory each), so one wave on 132 SMs.
// As in the plain kernel every one of the 128 rows is computed (rows >= K with q = k = 0, decay
// 1), so zeros' signs, infinities and NaNs propagate as there.
namespace fp64 {

constexpr int kCB = 32;  // columns per block
constexpr int kTT = 8;   // tokens per tile

template <int P> struct Layout {
  static constexpr int kNV = 16 / P;                 // slices per thread
  static constexpr int kRows = kMaxDim / P;          // rows per thread
  static constexpr int kStride = kRows + 2;          // per-thread row block, padded (16 B banks)
  static constexpr int kWidth = P * kStride;         // one token's row vector
  static __device__ __forceinline__ int pos(int i) { return (i % P) * kStride + i / P; }
};

template <int P> struct alignas(16) Tile64 {
  double q[kTT][Layout<P>::kWidth], k[kTT][Layout<P>::kWidth], d[kTT][Layout<P>::kWidth];
  double v[kTT][kCB], b[kTT];
};

// gate_value with exp(A_log[hv]) (amp) and dt_bias[hv * K + i] (bias) given: the same operations.
__device__ __forceinline__ double gate_of(const k3gc_kda_args& a, double amp, double bias, double raw) {
  if (a.gate == K3GC_GATE_LOG_DECAY) return raw;
  const double x = raw + bias;
  if (a.gate == K3GC_GATE_SOFTPLUS) return -amp * softplus(x);
  const double y = a.A_log ? amp * x : x;
  return double(a.lower_bound) * sigmoid(y);
}

// One step of the reduction tree in registers: slice jv takes slice jv ^ dj = jv + dj (its own
// value first, as x += shfl_xor(x, off) adds); only the slices jv < dj feed the next step.
template <int NV> __device__ __forceinline__ void tree_step(double (&x)[NV], int dj) {
#pragma unroll
  for (int jv = 0; jv < NV; ++jv)
    if (jv < dj) x[jv] = x[jv] + x[jv + dj];
}

template <int P>
__global__ void __launch_bounds__(kCB * P, 3) kda_fp64_kernel(k3gc_kda_args a) {
  using L = Layout<P>;
  constexpr int NV = L::kNV, R = L::kRows;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Tile64<P>* const buf = reinterpret_cast<Tile64<P>*>(smem_raw);  // [2]
  const int64_t col_blocks = (a.V + kCB - 1) / kCB;
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
  const int64_t K = a.K, V = a.V;
  const int tid = threadIdx.x, p = tid % P, jl = tid / P;
  const int64_t j = cb * kCB + jl;
  const bool column = j < V;
  const int warp = tid / 32, lane = tid % 32, n_warps = blockDim.x / 32;

  // The blocks this one stages for: its cluster (the column blocks of its (sequence, head)) on
  // sm_90 when launched as one, else itself.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int CL = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  Tile64<P>* dst[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) dst[c] = c < CL ? cluster.map_shared_rank(buf, c) : buf;
  auto barrier = [&] { if (CL > 1) cluster.sync(); else __syncthreads(); };
  if (CL > 1) cluster.sync();  // every block of the cluster runs before any writes into it
#else
  constexpr int CL = 1, rank = 0;
  Tile64<P>* dst[1] = {buf};
  auto barrier = [] { __syncthreads(); };
#endif

  // Staging constants of this lane's rows i = lane + 32c (c < 4).
  const double amp = (a.gate != K3GC_GATE_LOG_DECAY && a.A_log) ? Math<double>::exp_(double(a.A_log[hv])) : 1.0;
  double bias[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int64_t i = lane + 32 * c;
    bias[c] = (a.dt_bias && i < K) ? double(a.dt_bias[hv * K + i]) : 0.0;
  }

  double S[R];
  const bool use_init = a.initial_state != nullptr;
#pragma unroll
  for (int m = 0; m < R; ++m) {
    const int64_t i = p + P * m;
    S[m] = 0.0;
    if (use_init && column && i < K) {
      const int64_t idx = ((n * a.HV + hv) * (a.state_v_first ? V : K) + (a.state_v_first ? j : i)) *
                              (a.state_v_first ? K : V) + (a.state_v_first ? i : j);
      S[m] = load_as_double(a.initial_state, a.state_dtype, idx);
    }
  }

  // Stages tile `nt` (tokens t0..t0+count) into buffer nb: this block's share of the q, k, decay
  // rows into every block of the cluster, its own v columns and the betas.
  auto stage = [&](int64_t t0, int count, int nb, int64_t nt) {
    for (int slot = 0; slot * CL + rank < count; ++slot) {
      if ((slot + nt) % n_warps != warp) continue;  // rotated over the warps from tile to tile
      const int tt = slot * CL + rank;
      const int64_t t = t0 + tt;
      double qv[4], kv[4], dv[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t i = lane + 32 * c;
        qv[c] = 0;
        kv[c] = 0;
        dv[c] = 1;
        if (i < K) {
          qv[c] = load_as_double(a.q, a.input_dtype, (t * a.H + h) * K + i);
          kv[c] = load_as_double(a.k, a.input_dtype, (t * a.H + h) * K + i);
          const double raw = load_as_double(a.g, a.input_dtype, (t * a.HV + hv) * K + i);
          dv[c] = Math<double>::exp_(gate_of(a, amp, bias[c], raw));
        }
      }
      if (a.qk_l2norm) {
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
        const double fq = 1.0 / Math<double>::sqrt_(sq + double(1e-6)), fk = 1.0 / Math<double>::sqrt_(sk + double(1e-6));
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (lane + 32 * c < K) {
            qv[c] *= fq;
            kv[c] *= fk;
          }
        }
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int at = L::pos(lane + 32 * c);
#pragma unroll
        for (int r = 0; r < int(sizeof(dst) / sizeof(dst[0])); ++r) {
          if (r >= CL) break;
          dst[r][nb].q[tt][at] = qv[c];
          dst[r][nb].k[tt][at] = kv[c];
          dst[r][nb].d[tt][at] = dv[c];
        }
      }
    }
    for (int idx = tid; idx < count * kCB; idx += blockDim.x) {
      const int tt = idx / kCB, c = idx % kCB;
      const int64_t col = cb * kCB + c;
      buf[nb].v[tt][c] = col < V ? load_as_double(a.v, a.input_dtype, ((t0 + tt) * a.HV + hv) * V + col) : 0.0;
    }
    if (tid < count) {
      double bv = load_as_double(a.beta, a.input_dtype, (t0 + tid) * a.HV + hv);
      if (a.beta_mode == K3GC_BETA_SIGMOID) bv = sigmoid(bv);
      if (a.beta_mode == K3GC_BETA_TWO_SIGMOID) bv = 2.0 * sigmoid(bv);
      buf[nb].b[tid] = bv;
    }
  };

  const double scale = a.scale;
  const int64_t n_tiles = (eos - bos + kTT - 1) / kTT;
  if (n_tiles > 0) stage(bos, static_cast<int>(imin(int64_t(kTT), eos - bos)), 0, 0);
  barrier();
  for (int64_t nt = 0; nt < n_tiles; ++nt) {
    const int nb = static_cast<int>(nt & 1);
    const int64_t t0 = bos + nt * kTT;
    // Buffer nb ^ 1 was last read by tile nt - 1, which every block of the cluster has finished.
    if (nt + 1 < n_tiles) stage(t0 + kTT, static_cast<int>(imin(int64_t(kTT), eos - t0 - kTT)), nb ^ 1, nt + 1);
    const int count = static_cast<int>(imin(int64_t(kTT), eos - t0));
    const Tile64<P>& tile = buf[nb];
    for (int tt = 0; tt < count; ++tt) {
      const double* dq = tile.d[tt] + p * L::kStride;
      const double* kq = tile.k[tt] + p * L::kStride;
      const double* qq = tile.q[tt] + p * L::kStride;
      double x[NV];
#pragma unroll
      for (int jv = 0; jv < NV; ++jv) x[jv] = 0;
#pragma unroll
      for (int m = 0; m < R; m += 2) {  // m = jv + NV * r: slice jv's rows in r order
        // Halfway, a warp barrier: ptxas would otherwise hoist every row's loads (232 registers,
        // spills at the 168 that 3 blocks per SM leave).
        if (m % 16 == 0 && m > 0) __syncwarp();
        const double2 d2 = *reinterpret_cast<const double2*>(dq + m);
        const double2 k2 = *reinterpret_cast<const double2*>(kq + m);
        S[m] *= d2.x;
        S[m + 1] *= d2.y;
        x[m % NV] += k2.x * S[m];
        x[(m + 1) % NV] += k2.y * S[m + 1];
      }
      // The tree's steps 8 .. P in registers (slice jv with slice jv ^ (off / P), own first),
      // then the steps below P across the P lanes.
#pragma unroll
      for (int off = 8; off >= P; off /= 2) tree_step<NV>(x, off / P);
      double ks = x[0];
#pragma unroll
      for (int off = P / 2; off > 0; off /= 2) ks += __shfl_xor_sync(0xffffffffu, ks, off);
      const double u = tile.b[tt] * ((column ? tile.v[tt][jl] : 0.0) - ks);
#pragma unroll
      for (int jv = 0; jv < NV; ++jv) x[jv] = 0;
#pragma unroll
      for (int m = 0; m < R; m += 2) {
        if (m % 16 == 0 && m > 0) __syncwarp();
        const double2 q2 = *reinterpret_cast<const double2*>(qq + m);
        const double2 k2 = *reinterpret_cast<const double2*>(kq + m);
        S[m] += k2.x * u;
        S[m + 1] += k2.y * u;
        x[m % NV] += q2.x * S[m];
        x[(m + 1) % NV] += q2.y * S[m + 1];
      }
#pragma unroll
      for (int off = 8; off >= P; off /= 2) tree_step<NV>(x, off / P);
      double qs = x[0];
#pragma unroll
      for (int off = P / 2; off > 0; off /= 2) qs += __shfl_xor_sync(0xffffffffu, qs, off);
      if (p == 0 && column) store_from_double(a.o, a.output_dtype, ((t0 + tt) * a.HV + hv) * V + j, qs * scale);
    }
    barrier();
  }

  if (a.final_state && column) {
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int64_t i = p + P * m;
      if (i < K) {
        const int64_t idx = ((n * a.HV + hv) * (a.state_v_first ? V : K) + (a.state_v_first ? j : i)) *
                                (a.state_v_first ? K : V) + (a.state_v_first ? i : j);
        store_from_double(a.final_state, a.state_dtype, idx, S[m]);
      }
    }
  }
}

template <int P>
int launch_tuned(const k3gc_kda_args& a, int64_t n_seq, cudaStream_t stream) {
  const int64_t col_blocks = (a.V + kCB - 1) / kCB;
  const int64_t cols = a.V < kCB ? a.V : kCB;
  const unsigned threads = static_cast<unsigned>((cols * P + 31) / 32 * 32);
  const size_t smem = 2 * sizeof(Tile64<P>);
  auto kernel = kda_fp64_kernel<P>;
  if (int rc = check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                          "kda_fp64_kernel shared memory"))
    return rc;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(n_seq * a.HV * col_blocks));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  int device = 0, major = 0;
  cudaLaunchAttribute attr = {};
  if (col_blocks > 1 && cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(col_blocks);
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    if (cudaLaunchKernelEx(&cfg, kernel, a) == cudaSuccess) return 0;
    (void)cudaGetLastError();  // no cluster of this size fits: each block stages for itself
    cfg.numAttrs = 0;
  }
  if (int rc = check_cuda(cudaLaunchKernelEx(&cfg, kernel, a), "kda_fp64_kernel launch")) return rc;
  return 0;
}

}  // namespace fp64

}  // namespace
}  // namespace k3gc

extern "C" const char* k3gc_mutation_name(int mutation) { return k3gc_mutation_name_of(mutation); }

extern "C" int k3gc_kda_forward(const k3gc_kda_args* args, int precision, int mutation, void* stream_ptr) {
  using namespace k3gc;
  if (!args) return fail("k3gc_kda_forward: args is NULL");
  const k3gc_kda_args& a = *args;
  if (a.K < 1 || a.K > kMaxDim || a.V < 1 || a.V > kMaxDim)
    return fail("k3gc_kda_forward: K and V must be in [1, 128], got K=" + std::to_string(a.K) + " V=" + std::to_string(a.V));
  if (a.H < 1 || a.HV < a.H || a.HV % a.H != 0) return fail("k3gc_kda_forward: HV must be a positive multiple of H");
  if (a.cu_seqlens ? (a.B != 1 || a.N < 1) : (a.B < 1)) return fail("k3gc_kda_forward: with cu_seqlens B must be 1 and N >= 1");
  if (!valid_dtype(a.input_dtype) || !valid_dtype(a.output_dtype) ||
      ((a.initial_state || a.final_state) && !valid_dtype(a.state_dtype)))
    return fail("k3gc_kda_forward: unknown dtype code");
  if (a.gate < 0 || a.gate > 2 || a.beta_mode < 0 || a.beta_mode > 2) return fail("k3gc_kda_forward: unknown gate or beta mode");
  // T = 0: the token tensors are empty (a framework may hand NULL for them); only the states are touched
  if (a.T > 0 && (!a.q || !a.k || !a.v || !a.g || !a.beta || !a.o)) return fail("k3gc_kda_forward: NULL input or output");
  if (a.T < 0) return fail("k3gc_kda_forward: T < 0");
  const int64_t n_seq = a.cu_seqlens ? a.N : a.B;
  if (n_seq * a.HV == 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream_ptr);
  if (precision == 0 || precision == 2) {
    if (mutation != K3GC_MUT_NONE) return fail("k3gc_kda_forward: the fp64 reference has no mutants");
    // 0: the plain kernel (the definition, and the faster one measured); 2: the cluster-staged one (bit for bit the same).
    return precision == 2 ? fp64::launch_tuned<4>(a, n_seq, s) : launch<double, 8, 16, 32, 0>(a, n_seq, s);
  }
  if (precision != 1)
    return fail("k3gc_kda_forward: precision must be 0 (fp64), 1 (fp32) or 2 (fp64, cluster-staged), got " +
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
