#include "k3ref/golden/catalogue.h"

#include <cmath>

#include "k3ref/error.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {

Tensor<double> draw_uniform_rounded(num::Random& rng, const Shape& shape, double lo, double hi, num::Format format) {
  Tensor<double> t(shape);
  for (double& x : t.values()) {
    const double u = std::ldexp(static_cast<double>(rng.next_u64() >> 11), -53);
    x = num::round_to(format, lo + (hi - lo) * u);
  }
  return t;
}

const std::vector<Generator>& generators() {
  static const std::vector<Generator> all = {
      {"kda.recurrent", generate_kda_recurrent, std::to_string(num::golden_bits) + "-bit binary float"},
      {"kda.chunkwise_flashkda", generate_kda_chunkwise, std::to_string(num::golden_bits) + "-bit binary float"},
      {"kda.chunkwise_fla", generate_kda_chunkwise, std::to_string(num::golden_bits) + "-bit binary float"},
      {"qb.solver", generate_qb_solver, "exact (rational, or double proven exact)"},
      {"qb.online", generate_qb_online, "exact rational"},
      {"attnres.full", generate_attnres, std::to_string(num::golden_bits) + "-bit binary float"},
      {"attnres.block", generate_attnres, std::to_string(num::golden_bits) + "-bit binary float"},
      {"attnres.phase1", generate_attnres, std::to_string(num::golden_bits) + "-bit binary float"},
      {"kcp.context_parallel", generate_kcp_context_parallel, std::to_string(num::golden_bits) + "-bit binary float"},
      {"kda.backward", generate_kda_backward, std::to_string(num::golden_bits) + "-bit binary float"},
      // Each operator family registers its generator here (one line per op).
  };
  return all;
}

const Generator& generator_for(const std::string& op) {
  for (const Generator& g : generators())
    if (g.op == op) return g;
  throw InvalidArgument("golden: no generator for operator '" + op + "'");
}

std::vector<std::string> suite_names() { return {"default"}; }

std::vector<Case> suite(const std::string& name) {
  if (name == "default") {
    std::vector<Case> cases;
    // Each operator family appends its default cases here (one line per family).
    for (auto family : {kda_default_cases, kda_chunkwise_default_cases, qb_default_cases, attnres_default_cases, kcp_default_cases,
                        kda_backward_default_cases}) {
      auto more = family();
      cases.insert(cases.end(), more.begin(), more.end());
    }
    return cases;
  }
  std::string known;
  for (const auto& n : suite_names()) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument("golden: unknown suite '" + name + "' (known: " + known + ")");
}

}  // namespace k3ref::golden
