// The tolerance policy table (policy/policies.json, docs/tolerances.md): per operator and
// output tensor, the metric, the floor dtype (the dtype the kernel's contract rounds the
// tensor to, not the candidate's storage dtype) and the multiple or bound. The same file is
// read by the Python judge (python/k3ref/policy.py); both resolve rules the same way:
//
//   policies.<policy>.rules.<op>.<tensor>, else policies.<policy>.rules.<op>.<role>;
//   the parametric policies "exact", "floor:<m>", "rel-rms:<r>" apply to every output of
//   every operator at its table dtype (integer tensors: exact).
//
// The table also names each output's axes ("axes": ["batch", "token", "head", "channel"]),
// from which every report (the command's, the Python package's) names an element's index.
//
// A table is checked completely when it is parsed (every policy resolves a rule for every
// output of every operator it names), so a malformed table fails at load time, naming the
// entry, never in the middle of a verdict.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "k3ref/num/float_format.h"

namespace k3ref::check {

inline constexpr int policy_table_version = 1;
// Largest table file load() reads (the shipped one is about 20 kB), as k3ref.policy reads it.
inline constexpr std::uint64_t max_table_bytes = std::uint64_t{4} << 20;

enum class TensorRole { output, gradient, stage };  // stage tensors are optional in a candidate
// contract: a kernel's precision contract (kda/kernel_contracts.h) evaluated on the golden's
// inputs bounds its error: rel RMS <= multiple x max(floor, the contract's own rel RMS).
enum class RuleMetric { exact, floor_multiple, rel_rms, max_abs_ulps, contract };

const char* role_name(TensorRole r);
const char* metric_name(RuleMetric m);  // "exact", "floor", "rel-rms", "max-abs-ulps", "contract"
// "fp64", "fp32", "bf16", "fp16"; nullopt for anything else.
std::optional<num::Format> floor_format_from_string(const std::string& name);
const char* floor_format_name(std::optional<num::Format> f);  // nullopt: "int"

struct TensorRule {
  RuleMetric metric = RuleMetric::exact;
  std::optional<num::Format> floor_format;  // nullopt: an integer tensor (exact only)
  double multiple = 0;                      // floor: bound = multiple x floor; contract: see RuleMetric
  double bound = 0;                         // rel-rms: bound on the relative RMS error
  double ulps = 0;                          // max-abs-ulps: ulps x ulp(floor dtype at 1) x max(1, max|golden|)
  std::string contract;                     // contract: the contract's name ("fla_chunk")
  std::string source;                       // "policies.chunk.kda.backward.dq", or "floor:2"
};

struct OutputSpec {
  std::string name;
  TensorRole role = TensorRole::output;
  std::optional<num::Format> dtype;  // the contract dtype; nullopt: integer
  std::vector<std::string> axes;     // one name per axis, in the k_first state layout; empty: unnamed
};

struct OperatorSpec {
  std::vector<std::string> inputs;
  std::vector<OutputSpec> outputs;  // table order
  const OutputSpec* find(const std::string& name) const;
};

class PolicyTable {
 public:
  // Parses a table's JSON text; `origin` names it in errors. Throws InvalidArgument
  // ("<origin>: policies.chunk.rules.kda.backward: no rule for 'dq' ...") on anything
  // malformed, unknown keys included, and on a version other than policy_table_version.
  // The JSON rules are k3ref._bounded's: UTF-8 without NUL or byte-order mark, nested at
  // most 64 deep, no key twice in one object. Every message is one printable line.
  static PolicyTable parse(const std::string& json_text, const std::string& origin);
  // Reads and parses a regular file of at most max_table_bytes (FileError when it cannot be
  // read, is a FIFO, a device or a directory, or is larger).
  static PolicyTable load(const std::filesystem::path& path);
  // The copy of policy/policies.json compiled into the library.
  static const PolicyTable& builtin();
  static const std::string& builtin_text();

  const std::string& origin() const { return origin_; }
  const OperatorSpec* find_operator(const std::string& op) const;
  std::vector<std::string> operator_names() const;
  std::vector<std::string> policy_names() const;  // named policies, sorted
  std::vector<std::string> operators_of(const std::string& policy) const;
  const std::string& about(const std::string& policy) const;

  // Rule of every output of `op` under `policy`, by tensor name. Throws InvalidArgument
  // with one line when the operator is not in the table, the policy is unknown (or a
  // parametric one has a bad number), or the policy has no rules for the operator.
  std::map<std::string, TensorRule> rules(const std::string& policy, const std::string& op) const;

 private:
  std::string origin_;
  std::map<std::string, OperatorSpec> operators_;
  std::map<std::string, std::string> about_;
  std::map<std::pair<std::string, std::string>, std::map<std::string, TensorRule>> rules_;
};

// Help text for --policy: the parametric forms and the table's named policies.
std::string policy_table_help(const PolicyTable& table);

// Names of a golden's `k3ref.outputs`: comma-separated items, each possibly holding brace
// groups expanded in order ("{qb,sign}_{bias,loads}" -> qb_bias, qb_loads, sign_bias,
// sign_loads). Throws InvalidArgument on nested or unbalanced braces.
std::vector<std::string> expand_outputs(const std::string& spec);

}  // namespace k3ref::check
