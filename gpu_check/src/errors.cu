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

extern "C" int k3gc_code(const char* kind, const char* name) { return k3gc_code_of(kind, name); }
