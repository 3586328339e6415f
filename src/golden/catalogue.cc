#include "golden/catalogue.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "k3ref/check/policy_table.h"
#include "k3ref/error.h"
#include "k3ref/io/sha256.h"
#include "k3ref/num/scalar.h"
#include "k3ref/num/tier.h"

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
                                               const io::SafetensorsFile& file, const std::string& outputs,
                                               const std::string& layout) {
  const std::string where = "golden: case '" + c.name + "' (" + c.op + ")";
  const check::PolicyTable& table = check::PolicyTable::builtin();
  const check::OperatorSpec* spec = table.find_operator(c.op);
  if (!spec) throw InvalidArgument(where + ": the operator is not in policy/policies.json");
  std::set<std::string> in_file;
  for (const auto& [name, t] : file.tensors) in_file.insert(name);
  auto listed = [&](const std::string& csv, const char* what) {
    std::vector<std::string> names = csv.empty() ? std::vector<std::string>{} : check::expand_outputs(csv);
    for (const std::string& n : names)
      if (!in_file.count(n)) throw InvalidArgument(where + ": " + what + " tensor '" + n + "' is not in the file");
    return names;
  };
  const std::vector<std::string> output_names = listed(outputs, "output"), layout_names = listed(layout, "layout");
  std::set<std::string> not_inputs(output_names.begin(), output_names.end());
  not_inputs.insert(layout_names.begin(), layout_names.end());
  auto is_table_input = [&](const std::string& n) {
    return std::find(spec->inputs.begin(), spec->inputs.end(), n) != spec->inputs.end();
  };
  std::string inputs;
  for (const auto& [name, t] : file.tensors) {
    if (not_inputs.count(name)) continue;
    if (!is_table_input(name)) throw InvalidArgument(where + ": tensor '" + name + "' is not an input of the operator in policy/policies.json");
    inputs += (inputs.empty() ? "" : ",") + name;
  }
  for (const std::string& n : layout_names)
    if (!is_table_input(n)) throw InvalidArgument(where + ": layout tensor '" + n + "' is not an input of the operator in policy/policies.json");
  // Per output the first preferred policy with a rule for it.
  nlohmann::json policies = nlohmann::json::object();
  const std::vector<std::string>& preferred = generator_for(c.op).policies;
  for (const std::string& n : output_names) {
    for (const std::string& p : preferred)
      if (table.rules(p, c.op).count(n)) {
        policies[n] = p;
        break;
      }
    if (!policies.contains(n)) throw InvalidArgument(where + ": no preferred policy has a rule for output '" + n + "'");
  }
  std::string outputs_list, layout_list;
  for (const std::string& n : output_names) outputs_list += (outputs_list.empty() ? "" : ",") + n;
  for (const std::string& n : layout_names) layout_list += (layout_list.empty() ? "" : ",") + n;
  return {{"k3ref.schema", golden_schema_version},
          {"k3ref.case", c.name},
          {"k3ref.op", c.op},
          {"k3ref.seed", std::to_string(c.seed)},
          {"k3ref.params", c.params.dump()},
          {"k3ref.generator_version", generator_version},
          {"k3ref.reference_precision", reference_precision},
          {"k3ref.inputs", inputs},
          {"k3ref.outputs", outputs_list},
          {"k3ref.layout", layout_list},
          {"k3ref.policies", policies.dump()}};
}

std::string golden_float_precision() { return std::string(num::description(num::Tier::mp256)); }

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
