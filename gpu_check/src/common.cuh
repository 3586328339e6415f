// Shared device helpers of the gpu_check library: dtype loads/stores and error reporting.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "k3gc.h"
#include "k3gc_names.h"

namespace k3gc {

void set_error(const std::string& message);
int fail(const std::string& message);
// Returns 0, or records the CUDA error with `what` and returns 1.
int check_cuda(cudaError_t status, const char* what);

__device__ __forceinline__ double load_as_double(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case K3GC_F64: return static_cast<const double*>(p)[i];
    case K3GC_F32: return static_cast<const float*>(p)[i];
    case K3GC_BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return __half2float(static_cast<const __half*>(p)[i]);
  }
}

// Stores with round-to-nearest-even into the dtype (double -> bf16/f16 rounds once).
__device__ __forceinline__ void store_from_double(void* p, int dtype, int64_t i, double x) {
  switch (dtype) {
    case K3GC_F64: static_cast<double*>(p)[i] = x; break;
    case K3GC_F32: static_cast<float*>(p)[i] = static_cast<float>(x); break;
    case K3GC_BF16: static_cast<__nv_bfloat16*>(p)[i] = __double2bfloat16(x); break;
    default: static_cast<__half*>(p)[i] = __double2half(x); break;
  }
}

// Device memory taken on a stream (cudaMallocAsync), freed on it when this goes out of scope,
// on every return path of a host function.
struct StreamBuffer {
  void* p = nullptr;
  cudaStream_t s;
  explicit StreamBuffer(cudaStream_t stream) : s(stream) {}
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  ~StreamBuffer() { if (p) (void)cudaFreeAsync(p, s); }
};

inline bool valid_dtype(int dtype) { return dtype >= K3GC_F64 && dtype <= K3GC_F16; }

}  // namespace k3gc
