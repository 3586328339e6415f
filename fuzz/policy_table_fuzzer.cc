// libFuzzer target: the policy table reader (src/check/policy_table.cc), as `k3ref compare
// --policy-table` uses it. Any input must either parse or raise InvalidArgument / FileError
// whose message is one printable line of bounded length; a table that parses must resolve,
// for every operator it names, the rules of each of its policies and of the parametric ones
// (exact, floor:2, rel-rms:0.5) or refuse them the same way, and every rule it resolves must
// be usable (a finite positive multiple, bound or ulps where its metric needs one).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "k3ref/check/policy_table.h"
#include "k3ref/error.h"

namespace {

void check_message(const std::exception& e) {
  const std::string m = e.what();
  bool bad = m.empty() || m.size() > 4096;
  for (unsigned char c : m)
    if (c < 0x20 || c == 0x7f) bad = true;
  if (bad) {
    std::fprintf(stderr, "error message is not one short printable line (%zu bytes): %.300s\n", m.size(), m.c_str());
    std::abort();
  }
}

void check_rules(const std::map<std::string, k3ref::check::TensorRule>& rules) {
  using k3ref::check::RuleMetric;
  for (const auto& [name, r] : rules) {
    const double v = r.metric == RuleMetric::floor_multiple ? r.multiple
                     : r.metric == RuleMetric::rel_rms      ? r.bound
                     : r.metric == RuleMetric::max_abs_ulps ? r.ulps
                                                            : 1.0;
    if (!(v > 0) || !std::isfinite(v)) {
      std::fprintf(stderr, "rule for '%s' has the unusable value %g\n", name.c_str(), v);
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using k3ref::check::PolicyTable;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const PolicyTable table = PolicyTable::parse(text, "policies.json");
    for (const std::string& op : table.operator_names()) {
      std::vector<std::string> policies = table.policy_names();
      policies.insert(policies.end(), {"exact", "floor:2", "rel-rms:0.5", "floor:nan", "no-such-policy"});
      for (const std::string& policy : policies) {
        try {
          check_rules(table.rules(policy, op));
        } catch (const k3ref::InvalidArgument& e) {
          check_message(e);
        }
      }
    }
  } catch (const k3ref::InvalidArgument& e) {
    check_message(e);
  } catch (const k3ref::FileError& e) {
    check_message(e);
  }
  return 0;
}
