// Comparison kernels: one pass over candidate and reference, fp64 accumulation.
//
// One wave of resident blocks (grid from the kernel's occupancy); block b owns a contiguous
// range of 2048-element steps, each thread 8 consecutive elements per step, loaded with
// streaming 16-byte loads, and the next step's loads are issued before the current step's
// arithmetic (software prefetch), so memory and fp64 work overlap within every warp. A
// thread finds its token window by one division per window change (not per element), and
// adds to the window sums (atomics) once per window it leaves: a few atomics per thread.
// Per-block partials are reduced by one block in a fixed order: the totals do not depend
// on scheduling (the per-window sums use atomics and may differ in the last bits).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.cuh"

namespace k3gc {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;
constexpr int64_t kChunk = kThreads * kVec;

struct Partial {
  double err_sq, ref_sq, floor_sq, max_abs, max_ulp;
  int64_t max_abs_index, max_ulp_index;
  int64_t cand_nan, cand_inf, ref_nan, ref_inf;
  int64_t first_mismatch, first_offending;
};

struct FormatInfo {
  int mantissa_bits;   // explicit fraction bits
  int min_exponent;    // exponent of the smallest normal, as a power of two
  int min_sub_exp;     // exponent of the smallest subnormal
};

__host__ __device__ inline FormatInfo format_info(int format) {
  switch (format) {
    case K3GC_F64: return {52, -1022, -1074};
    case K3GC_F32: return {23, -126, -149};
    case K3GC_BF16: return {7, -126, -133};
    default: return {10, -14, -24};
  }
}

__device__ __forceinline__ double pow2(int e) {
  // 2^e for e in the normal double range, built from the bits (no libm call).
  return __longlong_as_double(static_cast<long long>(e + 1023) << 52);
}

// Eight consecutive elements in their stored type, as loaded: 16 bytes (bf16, f16) to 64
// bytes (f64). Kept raw so that the next step's loads can be in flight (prefetched) while
// the current step computes, at the register cost of the raw bytes only.
template <typename T>
struct alignas(16) Raw8 {
  T v[kVec];
};

// Streaming 16-byte loads (ld.global.cs: read once, evict first) when the group is full and
// both pointers are 16-byte aligned; element by element otherwise (zeros past the end).
template <typename T>
__device__ __forceinline__ void load_raw(Raw8<T>& r, const T* __restrict__ p, int64_t i, bool vec, int64_t n) {
  if (vec) {
    const uint4* src = reinterpret_cast<const uint4*>(p + i);
    uint4* dst = reinterpret_cast<uint4*>(r.v);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(Raw8<T>) / 16); ++k) dst[k] = __ldcs(src + k);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) r.v[j] = (i + j < n) ? p[i + j] : T{};
  }
}

template <typename T>
__device__ __forceinline__ double to_double(const T& x) {
  return static_cast<double>(x);
}
template <>
__device__ __forceinline__ double to_double<__nv_bfloat16>(const __nv_bfloat16& x) {
  // bf16 is the top half of an fp32: a shift, no conversion instruction.
  return __uint_as_float(static_cast<uint32_t>(__bfloat16_as_ushort(x)) << 16);
}
template <>
__device__ __forceinline__ double to_double<__half>(const __half& x) {
  return __half2float(x);
}

__device__ __forceinline__ bool finite_bits(double x) {
  // On the integer pipe (idle here), not the fp64 one: exponent field not all ones.
  return (__double_as_longlong(x) & 0x7ff0000000000000LL) != 0x7ff0000000000000LL;
}

// Running sums of one thread. Counts are 32-bit: a thread sees at most n / (grid * 256)
// elements, far below 2^31 for any n that fits in device memory.
struct Acc {
  double err_sq = 0, ref_sq = 0, floor_sq = 0, max_abs = -1, max_ulp = -1;
  int64_t max_abs_index = -1, max_ulp_index = -1, first_mismatch = INT64_MAX, first_offending = INT64_MAX;
  int32_t cand_nan = 0, cand_inf = 0, ref_nan = 0, ref_inf = 0;
  double w_err = 0, w_ref = 0;
};

// One pair. Windows is a template flag: without windows the two window sums cost nothing.
template <bool Windows>
__device__ __forceinline__ void accumulate(Acc& a, double xv, double rv, int64_t i, const FormatInfo& fmt,
                                           double atol, double rtol, double min_sub, double inv_min_sub) {
  if (!(finite_bits(xv) && finite_bits(rv))) {
    const bool xn = isnan(xv), rn = isnan(rv), xi = isinf(xv), ri = isinf(rv);
    a.cand_nan += xn;
    a.cand_inf += xi;
    a.ref_nan += rn;
    a.ref_inf += ri;
    const bool xf = !(xn || xi), rf = !(rn || ri);
    if (xf != rf || (!xf && !(xn && rn) && xv != rv)) {
      a.first_mismatch = min(a.first_mismatch, i);
      a.first_offending = min(a.first_offending, i);
    }
    return;
  }
  const double diff = fabs(xv - rv);
  const double mag = fabs(rv);
  a.err_sq = fma(diff, diff, a.err_sq);
  a.ref_sq = fma(rv, rv, a.ref_sq);
  if (Windows) {
    a.w_err = fma(diff, diff, a.w_err);
    a.w_ref = fma(rv, rv, a.w_ref);
  }
  // Spacing of the output format at |r| from the exponent bits of r (integer pipe).
  const int e = static_cast<int>(__double_as_longlong(mag) >> 52) - 1023;
  double spacing = min_sub, inv_spacing = inv_min_sub;
  if (e >= fmt.min_exponent) {
    spacing = pow2(e - fmt.mantissa_bits);
    inv_spacing = pow2(fmt.mantissa_bits - e);
  }
  const double fl = fma(rint(rv * inv_spacing), spacing, -rv);  // RNE into the format, minus r (exact)
  a.floor_sq = fma(fl, fl, a.floor_sq);
  if (diff > a.max_abs) {
    a.max_abs = diff;
    a.max_abs_index = i;
  }
  const double ulps = diff * inv_spacing;
  if (ulps > a.max_ulp) {
    a.max_ulp = ulps;
    a.max_ulp_index = i;
  }
  // Indices grow within a thread: once set, a later offender cannot be the first.
  if (a.first_offending == INT64_MAX && diff > atol + rtol * mag) a.first_offending = i;
}

// The window of flat index i, and in `end` the first flat index of the next window: one
// 64-bit division per window change, not per element (divisions cost ~100 instructions).
__device__ __forceinline__ int64_t window_of(int64_t i, int64_t inner, int64_t extent, int64_t window, int64_t& end) {
  const int64_t row = i / inner;  // token row, batches included
  const int64_t t = row % extent;
  const int64_t w = t / window;
  const int64_t t_end = min((w + 1) * window, extent);
  end = (row - t + t_end) * inner;
  return w;
}

constexpr int64_t kStep = kChunk;

// Resident blocks per SM the register budget is cut for: 3 (80 registers, 24 warps) where
// ptxas fits the kernel without spills at sm_90 (no windows, at most 10 bytes per element
// pair: bf16/f16 against f64, or f32 against f32 or narrower); 2 (128 registers) otherwise.
template <typename TC, typename TR, bool Windows>
constexpr int min_blocks() {
  return (!Windows && sizeof(TC) + sizeof(TR) <= 10) ? 3 : 2;
}

template <typename TC, typename TR, bool Windows>
__global__ void __launch_bounds__(kThreads, (min_blocks<TC, TR, Windows>())) compare_kernel(const TC* __restrict__ cand, const TR* __restrict__ ref,
                                                              int64_t n, FormatInfo fmt, double atol, double rtol,
                                                              int64_t inner, int64_t extent, int64_t window,
                                                              double* __restrict__ win_err, double* __restrict__ win_ref,
                                                              bool aligned, Partial* __restrict__ partials) {
  // Block b owns the contiguous steps [first, last): the first maximal index of the whole
  // array is found by comparing blocks in order, and a thread's window changes rarely.
  const int64_t n_steps = (n + kStep - 1) / kStep;
  const int64_t first = n_steps * blockIdx.x / gridDim.x;
  const int64_t last = n_steps * (blockIdx.x + 1) / gridDim.x;
  Acc a;
  int64_t cur_window = -1, window_end = -1;
  const double min_sub = pow2(fmt.min_sub_exp), inv_min_sub = pow2(-fmt.min_sub_exp);

  auto flush = [&]() {
    if (cur_window >= 0) {
      atomicAdd(win_err + cur_window, a.w_err);
      atomicAdd(win_ref + cur_window, a.w_ref);
    }
    a.w_err = a.w_ref = 0;
  };

  Raw8<TC> next_x;
  Raw8<TR> next_r;
  auto fetch = [&](int64_t c) {
    const int64_t base = c * kStep + threadIdx.x * kVec;
    const bool vec = aligned && base + kVec <= n;
    if (base < n) {
      load_raw(next_x, cand, base, vec, n);
      load_raw(next_r, ref, base, vec, n);
    }
  };
  if (first < last) fetch(first);
  for (int64_t c = first; c < last; ++c) {
    const Raw8<TC> xr = next_x;
    const Raw8<TR> rr = next_r;
    if (c + 1 < last) fetch(c + 1);  // next step's loads in flight during this step's arithmetic
    const int64_t base = c * kStep + threadIdx.x * kVec;
    if (base >= n) continue;
    if (base + kVec <= n && (!Windows || base + kVec <= window_end)) {
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        accumulate<Windows>(a, to_double(xr.v[j]), to_double(rr.v[j]), base + j, fmt, atol, rtol, min_sub, inv_min_sub);
    } else {
      // The end of the array or a window boundary inside the group: element by element.
      for (int j = 0; j < kVec && base + j < n; ++j) {
        const int64_t i = base + j;
        if (Windows && i >= window_end) {
          flush();
          cur_window = window_of(i, inner, extent, window, window_end);
        }
        accumulate<Windows>(a, to_double(xr.v[j]), to_double(rr.v[j]), i, fmt, atol, rtol, min_sub, inv_min_sub);
      }
    }
  }
  if (Windows) flush();

  // Block reduction in shared memory, fixed order.
  __shared__ Partial sh[kThreads];
  sh[threadIdx.x] = {a.err_sq, a.ref_sq, a.floor_sq, a.max_abs, a.max_ulp, a.max_abs_index, a.max_ulp_index,
                     a.cand_nan, a.cand_inf, a.ref_nan, a.ref_inf, a.first_mismatch, a.first_offending};
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      Partial& p = sh[threadIdx.x];
      const Partial& b = sh[threadIdx.x + stride];
      p.err_sq += b.err_sq;
      p.ref_sq += b.ref_sq;
      p.floor_sq += b.floor_sq;
      if (b.max_abs > p.max_abs || (b.max_abs == p.max_abs && b.max_abs_index >= 0 && b.max_abs_index < p.max_abs_index)) {
        p.max_abs = b.max_abs;
        p.max_abs_index = b.max_abs_index;
      }
      if (b.max_ulp > p.max_ulp || (b.max_ulp == p.max_ulp && b.max_ulp_index >= 0 && b.max_ulp_index < p.max_ulp_index)) {
        p.max_ulp = b.max_ulp;
        p.max_ulp_index = b.max_ulp_index;
      }
      p.cand_nan += b.cand_nan;
      p.cand_inf += b.cand_inf;
      p.ref_nan += b.ref_nan;
      p.ref_inf += b.ref_inf;
      p.first_mismatch = min(p.first_mismatch, b.first_mismatch);
      p.first_offending = min(p.first_offending, b.first_offending);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = sh[0];
}

__global__ void finish_kernel(Partial* partials, int count) {
  // One thread, fixed order: deterministic totals.
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  Partial a = partials[0];
  for (int b = 1; b < count; ++b) {
    const Partial& p = partials[b];
    a.err_sq += p.err_sq;
    a.ref_sq += p.ref_sq;
    a.floor_sq += p.floor_sq;
    if (p.max_abs > a.max_abs) {
      a.max_abs = p.max_abs;
      a.max_abs_index = p.max_abs_index;
    }
    if (p.max_ulp > a.max_ulp) {
      a.max_ulp = p.max_ulp;
      a.max_ulp_index = p.max_ulp_index;
    }
    a.cand_nan += p.cand_nan;
    a.cand_inf += p.cand_inf;
    a.ref_nan += p.ref_nan;
    a.ref_inf += p.ref_inf;
    a.first_mismatch = min(a.first_mismatch, p.first_mismatch);
    a.first_offending = min(a.first_offending, p.first_offending);
  }
  partials[0] = a;
}

template <typename TC, typename TR>
int launch(const void* cand, const void* ref, int64_t n, int format, double atol, double rtol, int64_t inner,
           int64_t extent, int64_t window, double* win_err, double* win_ref, Partial* partials, int& grid,
           cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(cand) % 16 == 0 && reinterpret_cast<uintptr_t>(ref) % 16 == 0;
  // As many blocks as can be resident at once (all of them in flight, one wave), at most
  // `grid` (the size of `partials`) and at most one per step.
  int per_sm = 0;
  const cudaError_t occ = win_err ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, compare_kernel<TC, TR, true>, kThreads, 0)
                                  : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, compare_kernel<TC, TR, false>, kThreads, 0);
  if (check_cuda(occ, "cudaOccupancyMaxActiveBlocksPerMultiprocessor")) return 1;
  int device = 0, sms = 0;
  if (check_cuda(cudaGetDevice(&device), "cudaGetDevice")) return 1;
  if (check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute")) return 1;
  const int64_t n_steps = (n + kStep - 1) / kStep;
  grid = static_cast<int>(std::min<int64_t>({n_steps, static_cast<int64_t>(sms) * std::max(per_sm, 1), grid}));
  if (win_err)
    compare_kernel<TC, TR, true><<<grid, kThreads, 0, stream>>>(static_cast<const TC*>(cand), static_cast<const TR*>(ref),
                                                                 n, format_info(format), atol, rtol, inner, extent,
                                                                 window, win_err, win_ref, aligned, partials);
  else
    compare_kernel<TC, TR, false><<<grid, kThreads, 0, stream>>>(static_cast<const TC*>(cand), static_cast<const TR*>(ref),
                                                                  n, format_info(format), atol, rtol, inner, extent,
                                                                  window, win_err, win_ref, aligned, partials);
  return check_cuda(cudaGetLastError(), "compare_kernel launch");
}

template <typename TC>
int dispatch_ref(int ref_dtype, const void* cand, const void* ref, int64_t n, int format, double atol, double rtol,
                 int64_t inner, int64_t extent, int64_t window, double* we, double* wr, Partial* partials, int& grid,
                 cudaStream_t s) {
  switch (ref_dtype) {
    case K3GC_F64: return launch<TC, double>(cand, ref, n, format, atol, rtol, inner, extent, window, we, wr, partials, grid, s);
    case K3GC_F32: return launch<TC, float>(cand, ref, n, format, atol, rtol, inner, extent, window, we, wr, partials, grid, s);
    case K3GC_BF16: return launch<TC, __nv_bfloat16>(cand, ref, n, format, atol, rtol, inner, extent, window, we, wr, partials, grid, s);
    default: return launch<TC, __half>(cand, ref, n, format, atol, rtol, inner, extent, window, we, wr, partials, grid, s);
  }
}

}  // namespace
}  // namespace k3gc

extern "C" int k3gc_compare(const void* candidate, int candidate_dtype, const void* reference, int reference_dtype,
                            int64_t n, int format, double atol, double rtol, int64_t inner, int64_t extent,
                            int64_t window, double* window_err_sq, double* window_ref_sq, k3gc_stats* out,
                            void* stream_ptr) {
  using namespace k3gc;
  if (!out) return fail("k3gc_compare: out is NULL");
  if (!valid_dtype(candidate_dtype) || !valid_dtype(reference_dtype) || !valid_dtype(format))
    return fail("k3gc_compare: unknown dtype code");
  if (n < 0) return fail("k3gc_compare: n < 0");
  if (n > 0 && (!candidate || !reference)) return fail("k3gc_compare: NULL data pointer");
  const bool windows = window_err_sq != nullptr;
  if (windows && (!window_ref_sq || inner <= 0 || extent <= 0 || window <= 0))
    return fail("k3gc_compare: window arrays need inner, extent and window > 0");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  *out = k3gc_stats{};
  out->first_nonfinite_mismatch = out->first_offending = -1;
  out->max_abs_index = out->max_ulp_index = -1;
  if (n == 0) return 0;
  int device = 0, sms = 0;
  if (check_cuda(cudaGetDevice(&device), "cudaGetDevice")) return 1;
  if (check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute")) return 1;
  // Upper bound of the grid (launch() sizes it from the kernel's occupancy): 8 blocks of 256
  // threads per SM is the most an SM can hold (2048 threads).
  int grid = sms * 8;
  if (windows) {
    const int64_t n_windows = (extent + window - 1) / window;
    if (check_cuda(cudaMemsetAsync(window_err_sq, 0, n_windows * sizeof(double), stream), "memset windows")) return 1;
    if (check_cuda(cudaMemsetAsync(window_ref_sq, 0, n_windows * sizeof(double), stream), "memset windows")) return 1;
  }
  Partial* partials = nullptr;
  if (check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&partials), grid * sizeof(Partial), stream), "cudaMallocAsync"))
    return 1;
  int rc = 0;
  switch (candidate_dtype) {
    case K3GC_F64: rc = dispatch_ref<double>(reference_dtype, candidate, reference, n, format, atol, rtol, inner, extent, window, window_err_sq, window_ref_sq, partials, grid, stream); break;
    case K3GC_F32: rc = dispatch_ref<float>(reference_dtype, candidate, reference, n, format, atol, rtol, inner, extent, window, window_err_sq, window_ref_sq, partials, grid, stream); break;
    case K3GC_BF16: rc = dispatch_ref<__nv_bfloat16>(reference_dtype, candidate, reference, n, format, atol, rtol, inner, extent, window, window_err_sq, window_ref_sq, partials, grid, stream); break;
    default: rc = dispatch_ref<__half>(reference_dtype, candidate, reference, n, format, atol, rtol, inner, extent, window, window_err_sq, window_ref_sq, partials, grid, stream); break;
  }
  Partial total{};
  if (rc == 0) {
    finish_kernel<<<1, 32, 0, stream>>>(partials, grid);
    rc = check_cuda(cudaGetLastError(), "finish_kernel launch");
  }
  if (rc == 0) rc = check_cuda(cudaMemcpyAsync(&total, partials, sizeof(Partial), cudaMemcpyDeviceToHost, stream), "copy stats");
  if (rc == 0) rc = check_cuda(cudaStreamSynchronize(stream), "compare");
  cudaFreeAsync(partials, stream);
  if (rc) return rc;
  out->count = n;
  out->err_sq = total.err_sq;
  out->ref_sq = total.ref_sq;
  out->floor_sq = total.floor_sq;
  out->max_abs = total.max_abs < 0 ? 0 : total.max_abs;
  out->max_abs_index = total.max_abs_index;
  out->max_ulp = total.max_ulp < 0 ? 0 : total.max_ulp;
  out->max_ulp_index = total.max_ulp_index;
  out->candidate_nan = total.cand_nan;
  out->candidate_inf = total.cand_inf;
  out->reference_nan = total.ref_nan;
  out->reference_inf = total.ref_inf;
  out->first_nonfinite_mismatch = total.first_mismatch == INT64_MAX ? -1 : total.first_mismatch;
  out->first_offending = total.first_offending == INT64_MAX ? -1 : total.first_offending;
  return 0;
}
