// Comparison kernels: one pass over candidate and reference, fp64 accumulation.
//
// A persistent grid; block b owns a contiguous range of 2048-element chunks, so a thread's
// token window changes only at window boundaries (few atomics for the per-window sums).
// Per-block partials are reduced by one block in a fixed order: the totals do not depend
// on scheduling (the per-window sums use atomics and may differ in the last bits).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

template <typename T>
__device__ __forceinline__ void load8(const T* p, int64_t i, bool vec, double out[kVec], int64_t n) {
  if (vec) {
    constexpr int per16 = 16 / sizeof(T);
#pragma unroll
    for (int part = 0; part < kVec / per16; ++part) {
      uint4 raw = *reinterpret_cast<const uint4*>(p + i + part * per16);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < per16; ++j) out[part * per16 + j] = static_cast<double>(e[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = (i + j < n) ? static_cast<double>(p[i + j]) : 0.0;
  }
}

template <>
__device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i, bool vec, double out[kVec],
                                                     int64_t n) {
  if (vec) {
    uint4 raw = *reinterpret_cast<const uint4*>(p + i);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out[2 * j] = __uint_as_float(w[j] << 16);
      out[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = (i + j < n) ? static_cast<double>(__bfloat162float(p[i + j])) : 0.0;
  }
}

template <>
__device__ __forceinline__ void load8<__half>(const __half* p, int64_t i, bool vec, double out[kVec], int64_t n) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = (vec || i + j < n) ? static_cast<double>(__half2float(p[i + j])) : 0.0;
}

// Running sums of one thread.
struct Acc {
  double err_sq = 0, ref_sq = 0, floor_sq = 0, max_abs = -1, max_ulp = -1;
  int64_t max_abs_index = -1, max_ulp_index = -1, first_mismatch = INT64_MAX, first_offending = INT64_MAX;
  int64_t cand_nan = 0, cand_inf = 0, ref_nan = 0, ref_inf = 0;
  double w_err = 0, w_ref = 0;
};

// One pair. Returns the squared error added (0 for non-finite pairs) through w_err/w_ref.
__device__ __forceinline__ void accumulate(Acc& a, double xv, double rv, int64_t i, const FormatInfo& fmt,
                                           double atol, double rtol, double min_sub, double inv_min_sub) {
  // Fast path for finite pairs (NaN fails both comparisons).
  if (!(fabs(xv) <= 1.7976931348623157e308 && fabs(rv) <= 1.7976931348623157e308)) {
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
  a.err_sq += diff * diff;
  a.ref_sq += rv * rv;
  a.w_err += diff * diff;
  a.w_ref += rv * rv;
  // Spacing of the output format at |r| from the exponent bits of r.
  const int e = static_cast<int>(__double_as_longlong(mag) >> 52) - 1023;
  double spacing = min_sub, inv_spacing = inv_min_sub;
  if (e >= fmt.min_exponent) {
    spacing = pow2(e - fmt.mantissa_bits);
    inv_spacing = pow2(fmt.mantissa_bits - e);
  }
  const double fl = rint(rv * inv_spacing) * spacing - rv;  // RNE into the format, minus r
  a.floor_sq += fl * fl;
  if (diff > a.max_abs) {
    a.max_abs = diff;
    a.max_abs_index = i;
  }
  const double ulps = diff * inv_spacing;
  if (ulps > a.max_ulp) {
    a.max_ulp = ulps;
    a.max_ulp_index = i;
  }
  if (diff > atol + rtol * mag) a.first_offending = min(a.first_offending, i);
}

constexpr int kUnroll = 1;  // vectors per thread per iteration (2 spills at 64 registers)
constexpr int64_t kStep = kChunk * kUnroll;

template <typename TC, typename TR>
__global__ void __launch_bounds__(kThreads, 2) compare_kernel(const TC* __restrict__ cand, const TR* __restrict__ ref,
                                                              int64_t n, FormatInfo fmt, double atol, double rtol,
                                                              int64_t inner, int64_t extent, int64_t window,
                                                              double* __restrict__ win_err, double* __restrict__ win_ref,
                                                              bool aligned, Partial* __restrict__ partials) {
  const int64_t n_steps = (n + kStep - 1) / kStep;
  const int64_t first = n_steps * blockIdx.x / gridDim.x;
  const int64_t last = n_steps * (blockIdx.x + 1) / gridDim.x;
  Acc a;
  const bool windows = win_err != nullptr;
  int64_t cur_window = -1;
  const double min_sub = pow2(fmt.min_sub_exp), inv_min_sub = pow2(-fmt.min_sub_exp);

  for (int64_t c = first; c < last; ++c) {
    double x[kUnroll][kVec], r[kUnroll][kVec];
    int64_t base[kUnroll];
    bool full[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      base[u] = c * kStep + u * kChunk + threadIdx.x * kVec;
      full[u] = base[u] + kVec <= n;
      if (base[u] < n) {
        load8(cand, base[u], aligned && full[u], x[u], n);
        load8(ref, base[u], aligned && full[u], r[u], n);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base[u] >= n) break;
      if (windows) {
        // One window per 8 elements unless the group straddles a window boundary.
        const int64_t w0 = (base[u] / inner) % extent / window;
        const int64_t w1 = ((base[u] + kVec - 1) / inner) % extent / window;
        if (w0 != cur_window) {
          if (cur_window >= 0) {
            atomicAdd(win_err + cur_window, a.w_err);
            atomicAdd(win_ref + cur_window, a.w_ref);
          }
          cur_window = w0;
          a.w_err = a.w_ref = 0;
        }
        if (w1 != w0) {
          // Rare: element by element.
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const int64_t i = base[u] + j;
            if (i >= n) break;
            const int64_t w = (i / inner) % extent / window;
            if (w != cur_window) {
              atomicAdd(win_err + cur_window, a.w_err);
              atomicAdd(win_ref + cur_window, a.w_ref);
              cur_window = w;
              a.w_err = a.w_ref = 0;
            }
            accumulate(a, x[u][j], r[u][j], i, fmt, atol, rtol, min_sub, inv_min_sub);
          }
          continue;
        }
      }
      if (full[u]) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) accumulate(a, x[u][j], r[u][j], base[u] + j, fmt, atol, rtol, min_sub, inv_min_sub);
      } else {
        for (int j = 0; j < kVec && base[u] + j < n; ++j)
          accumulate(a, x[u][j], r[u][j], base[u] + j, fmt, atol, rtol, min_sub, inv_min_sub);
      }
    }
  }
  if (windows && cur_window >= 0) {
    atomicAdd(win_err + cur_window, a.w_err);
    atomicAdd(win_ref + cur_window, a.w_ref);
  }
  double err_sq = a.err_sq, ref_sq = a.ref_sq, floor_sq = a.floor_sq, max_abs = a.max_abs, max_ulp = a.max_ulp;
  int64_t max_abs_index = a.max_abs_index, max_ulp_index = a.max_ulp_index;
  int64_t cand_nan = a.cand_nan, cand_inf = a.cand_inf, ref_nan = a.ref_nan, ref_inf = a.ref_inf;
  int64_t first_mismatch = a.first_mismatch, first_offending = a.first_offending;

  // Block reduction in shared memory, fixed order.
  __shared__ Partial sh[kThreads];
  sh[threadIdx.x] = {err_sq, ref_sq, floor_sq, max_abs, max_ulp, max_abs_index, max_ulp_index,
                     cand_nan, cand_inf, ref_nan, ref_inf, first_mismatch, first_offending};
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      Partial& a = sh[threadIdx.x];
      const Partial& b = sh[threadIdx.x + stride];
      a.err_sq += b.err_sq;
      a.ref_sq += b.ref_sq;
      a.floor_sq += b.floor_sq;
      if (b.max_abs > a.max_abs || (b.max_abs == a.max_abs && b.max_abs_index >= 0 && b.max_abs_index < a.max_abs_index)) {
        a.max_abs = b.max_abs;
        a.max_abs_index = b.max_abs_index;
      }
      if (b.max_ulp > a.max_ulp || (b.max_ulp == a.max_ulp && b.max_ulp_index >= 0 && b.max_ulp_index < a.max_ulp_index)) {
        a.max_ulp = b.max_ulp;
        a.max_ulp_index = b.max_ulp_index;
      }
      a.cand_nan += b.cand_nan;
      a.cand_inf += b.cand_inf;
      a.ref_nan += b.ref_nan;
      a.ref_inf += b.ref_inf;
      a.first_mismatch = min(a.first_mismatch, b.first_mismatch);
      a.first_offending = min(a.first_offending, b.first_offending);
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
           int64_t extent, int64_t window, double* win_err, double* win_ref, Partial* partials, int grid,
           cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(cand) % 16 == 0 && reinterpret_cast<uintptr_t>(ref) % 16 == 0;
  compare_kernel<TC, TR><<<grid, kThreads, 0, stream>>>(static_cast<const TC*>(cand), static_cast<const TR*>(ref), n,
                                                          format_info(format), atol, rtol, inner, extent, window,
                                                          win_err, win_ref, aligned, partials);
  return check_cuda(cudaGetLastError(), "compare_kernel launch");
}

template <typename TC>
int dispatch_ref(int ref_dtype, const void* cand, const void* ref, int64_t n, int format, double atol, double rtol,
                 int64_t inner, int64_t extent, int64_t window, double* we, double* wr, Partial* partials, int grid,
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
  const int64_t n_steps = (n + kStep - 1) / kStep;
  const int grid = static_cast<int>(std::min<int64_t>(n_steps, static_cast<int64_t>(sms) * 2));  // 2 blocks of 256 resident per SM at 108 registers
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
  out->rel_rms = total.ref_sq > 0 ? std::sqrt(total.err_sq / total.ref_sq) : (total.err_sq > 0 ? INFINITY : 0.0);
  out->floor_rel_rms = total.ref_sq > 0 ? std::sqrt(total.floor_sq / total.ref_sq) : 0.0;
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
