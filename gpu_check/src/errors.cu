#include <cstring>
#include <string>

#include "common.cuh"

namespace k3gc {
namespace {
thread_local std::string last_error;
}
void set_error(const std::string& message) { last_error = message; }
int fail(const std::string& message) {
  set_error(message);
  return 1;
}
int check_cuda(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return 0;
  return fail(std::string(what) + ": " + cudaGetErrorString(status));
}
}  // namespace k3gc

extern "C" const char* k3gc_last_error(void) {
  static thread_local std::string copy;
  copy = k3gc::last_error;
  return copy.c_str();
}

extern "C" int k3gc_code(const char* kind, const char* name) {
  struct Named {
    const char *kind, *name;
    int code;
  };
  static const Named names[] = {
      {"format", "fp64", K3GC_F64}, {"format", "fp32", K3GC_F32}, {"format", "bf16", K3GC_BF16},
      {"format", "fp16", K3GC_F16}, {"gate", "log_decay", K3GC_GATE_LOG_DECAY},
      {"gate", "softplus", K3GC_GATE_SOFTPLUS}, {"gate", "lower_bound", K3GC_GATE_LOWER_BOUND},
      {"beta", "as_given", K3GC_BETA_AS_GIVEN}, {"beta", "sigmoid", K3GC_BETA_SIGMOID},
      {"beta", "two_sigmoid", K3GC_BETA_TWO_SIGMOID}};
  if (kind == nullptr || name == nullptr) return -1;
  for (const Named& n : names)
    if (std::strcmp(n.kind, kind) == 0 && std::strcmp(n.name, name) == 0) return n.code;
  return -1;
}
