#include "golden/catalogue.h"

#include <cmath>

#include "k3ref/error.h"
#include "k3ref/io/sha256.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {

// Each family file defines its Family family_<name>(); the build lists them
// (src/golden/meson.build, golden_families -> golden_families.inc).
#define K3REF_GOLDEN_FAMILY(name) Family family_##name();
#include "golden_families.inc"
#undef K3REF_GOLDEN_FAMILY

std::uint64_t case_seed(const std::string& op, const std::string& name) {
  const std::string key = op + "/" + name;
  const std::string hex = io::sha256_hex(std::span(reinterpret_cast<const std::uint8_t*>(key.data()), key.size()));
  // Bytes 0..7 of the digest, byte 0 the least significant.
  std::uint64_t seed = 0;
  for (int i = 7; i >= 0; --i) seed = (seed << 8) | std::stoull(hex.substr(2 * static_cast<std::size_t>(i), 2), nullptr, 16);
  return seed;
}

Case make_case(std::string name, std::string op, nlohmann::json params) {
  const std::uint64_t seed = case_seed(op, name);
  return Case{std::move(name), std::move(op), seed, std::move(params)};
}

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

std::string golden_float_precision() { return std::to_string(num::golden_bits) + "-bit binary float"; }

Tensor<double> round_to_double(const Tensor<num::golden_float>& t) {
  return t.map<double>([](const num::golden_float& x) { return num::to_double_rne(x); });
}

const std::vector<Family>& families() {
  static const std::vector<Family> all = {
#define K3REF_GOLDEN_FAMILY(name) family_##name(),
#include "golden_families.inc"
#undef K3REF_GOLDEN_FAMILY
  };
  return all;
}

const std::vector<Generator>& generators() {
  static const std::vector<Generator> all = [] {
    std::vector<Generator> g;
    for (const Family& f : families()) g.insert(g.end(), f.generators.begin(), f.generators.end());
    return g;
  }();
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
    for (const Family& f : families()) {
      auto more = f.default_cases();
      cases.insert(cases.end(), more.begin(), more.end());
    }
    return cases;
  }
  std::string known;
  for (const auto& n : suite_names()) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument("golden: unknown suite '" + name + "' (known: " + known + ")");
}

}  // namespace k3ref::golden
