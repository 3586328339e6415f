// Scalar-free parts of the QB reference: shape checks and loads.
#include <string>

#include "k3ref/qb/solver.h"

namespace k3ref::qb {

RoutingShape routing_shape(std::int64_t m, std::int64_t n, std::int64_t k, const std::string& what) {
  if (m < 1) throw InvalidArgument(what + ": m = " + std::to_string(m) + " tokens, need at least 1");
  if (n < 2) throw InvalidArgument(what + ": n = " + std::to_string(n) + " experts, need at least 2");
  if (k < 1 || k >= n)
    throw InvalidArgument(what + ": k = " + std::to_string(k) + " outside [1, n - 1] (n = " + std::to_string(n) + ")");
  // The cutoff alpha_i needs a (k+1)-th score, the bias beta_j a (q+1)-th: k < n gives both.
  if ((m * k) % n != 0)
    throw InvalidArgument(what + ": q = m k / n = " + std::to_string(m) + " * " + std::to_string(k) + " / " +
                          std::to_string(n) + " is not an integer");
  return RoutingShape{m, n, k, m * k / n};
}

std::vector<std::int64_t> expert_loads(const Tensor<std::int32_t>& selection, std::int64_t n) {
  if (selection.rank() != 2) throw InvalidArgument("qb::expert_loads: argument 'selection' must be [m, k]");
  std::vector<std::int64_t> loads(static_cast<std::size_t>(n), 0);
  for (std::int32_t j : selection.values()) {
    if (j < 0 || j >= n)
      throw InvalidArgument("qb::expert_loads: expert index " + std::to_string(j) + " outside [0, " +
                            std::to_string(n) + ")");
    ++loads[static_cast<std::size_t>(j)];
  }
  return loads;
}

}  // namespace k3ref::qb
