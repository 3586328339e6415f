#include "k3ref/golden/catalogue.h"

#include <cmath>

#include "k3ref/error.h"
#include "k3ref/num/scalar.h"
#include "k3ref/num/tier.h"

namespace k3ref::golden {

Tensor<double> draw_uniform_rounded(num::Random& rng, const Shape& shape, double lo, double hi, num::Format format) {
  Tensor<double> t(shape);
  for (double& x : t.values()) {
    const double u = std::ldexp(static_cast<double>(rng.next_u64() >> 11), -53);
    x = num::round_to(format, lo + (hi - lo) * u);
  }
  return t;
}

std::map<std::string, std::string> metadata_of(const Case& c, const std::string& reference_precision,
                                               const std::string& outputs) {
  return {{"k3ref.case", c.name},
          {"k3ref.op", c.op},
          {"k3ref.seed", std::to_string(c.seed)},
          {"k3ref.params", c.params.dump()},
          {"k3ref.generator_version", generator_version},
          {"k3ref.reference_precision", reference_precision},
          {"k3ref.outputs", outputs}};
}

std::string golden_float_precision() { return std::string(num::description(num::Tier::mp256)); }

const std::vector<Generator>& generators() {
  static const std::vector<Generator> all = {
      {"kda.recurrent", generate_kda_recurrent, golden_float_precision()},
      {"kda.chunkwise_flashkda", generate_kda_chunkwise, golden_float_precision()},
      {"kda.chunkwise_fla", generate_kda_chunkwise, golden_float_precision()},
      {"qb.solver", generate_qb_solver, "exact (rational, or double proven exact)"},
      {"qb.online", generate_qb_online, std::string(num::description(num::Tier::rational))},
      {"attnres.full", generate_attnres, golden_float_precision()},
      {"attnres.block", generate_attnres, golden_float_precision()},
      {"attnres.phase1", generate_attnres, golden_float_precision()},
      {"kcp.context_parallel", generate_kcp_context_parallel, golden_float_precision()},
      {"kda.backward", generate_kda_backward, golden_float_precision()},
      {"serving.decode", generate_serving, golden_float_precision()},
      {"serving.verify", generate_serving, golden_float_precision()},
      {"serving.checkpoints", generate_serving, golden_float_precision()},
      {"serving.rollback", generate_serving, golden_float_precision()},
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
                        kda_backward_default_cases, serving_default_cases}) {
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
