// The verdict on one golden case: every golden output judged under its own rule of the
// policy table (policy_table.h), failing closed. The same rules, in the same order, as the
// Python package's judge (k3ref.policy, bound through k3ref._core: one judge for both).
//
//   exit 2 (unusable): the operator or policy is not in the table, the policy has no
//          rules for the operator, a golden output is not in the table, a requested
//          tensor is not a golden output, a candidate tensor is neither an output nor an
//          input of the golden, a shape differs, a candidate tensor is not numeric;
//   exit 1 (fail):     a figure over its bound, NaN/Inf where the golden has none (or the
//          reverse), a required output (role output/gradient, or any --tensors name)
//          missing from the candidate, or nothing judged at all;
//   exit 0 (pass):     otherwise. Optional (stage) tensors absent from the candidate are
//          reported as skipped.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "k3ref/check/policy_table.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::check {

struct NamedValues {
  Shape shape;
  std::vector<double> values;  // row-major, exact conversions of the stored elements
  std::string dtype;           // the stored dtype's name ("BF16"), for the report
  bool numeric = true;         // false for BOOL and other non-numeric dtypes
};

struct JudgeRequest {
  std::string op, policy;
  std::vector<std::pair<std::string, NamedValues>> expected;  // golden outputs, golden order
  std::vector<std::string> known;                             // the golden's other tensor names (its inputs)
  std::vector<std::string> candidate_names;                   // every tensor of the candidate
  std::function<NamedValues(const std::string&)> candidate;   // values of one of candidate_names
  std::optional<std::vector<std::string>> tensors;            // judge only these (each then required)
  // The values of a precision contract's tensor on the golden's inputs, for rules of metric
  // contract (nullopt: not available, and such a rule is unusable). The caller evaluates the
  // contract (k3ref._core.kda_contract); the judge only measures and bounds.
  std::function<std::optional<NamedValues>(const std::string& contract, const std::string& tensor)> contract_values;
  // A floor below which a tensor's floor is not taken (floor and contract rules), by tensor:
  // on the few elements of a shrunk case the measured floor can be near zero by chance.
  std::map<std::string, double> floor_at_least;
  // For naming indices (describe_index): the golden's cu_seqlens (empty: not varlen) and
  // whether its states are stored [.., V, K] (v_first) rather than [.., K, V].
  std::vector<std::int64_t> cu_seqlens;
  bool v_first = false;
};

// The one axis-naming rule of every report: "(batch 0, token 76, head 0, channel 28)" from
// an output's axes in the policy table (unnamed axes "dim<i>"; a state's last two swapped
// when v_first); with cu_seqlens, a packed token axis reads "sequence 1, position 12".
std::string describe_index(const std::vector<std::string>& axes, const std::vector<std::int64_t>& index,
                           const std::vector<std::int64_t>& cu_seqlens = {}, bool v_first = false);

struct TensorJudgement {
  std::string tensor, role;      // role "" for a tensor unknown to the golden
  bool required = true;
  std::string status = "pass";   // pass | fail | missing | skipped | unknown | error
  bool passed = false;
  std::string metric, floor_dtype, rule;
  double figure = 0, bound = 0, floor = 0, ratio = 0, rel_rms = 0, max_abs = 0;
  std::int64_t max_abs_index = -1;
  std::vector<std::int64_t> worst_index;  // max_abs_index per axis of the golden's shape
  double candidate_value = 0, golden_value = 0, max_ulp = 0;
  std::int64_t max_ulp_index = -1, count = 0, candidate_nan = 0, candidate_inf = 0, first_nonfinite_mismatch = -1;
  std::string candidate_dtype;
  Shape shape;
  std::string contract;           // contract rules: the contract's name and its own rel RMS
  double contract_error = 0;
  std::string worst_at, first_nonfinite_at;  // describe_index of max_abs_index / first_nonfinite_mismatch
  std::string reason;
};

// Calls f(name, value) for every field of a TensorJudgement, in report order: the one list
// of fields of the JSON report and of the Python package's TensorResult.
template <class F>
void for_each_field(const TensorJudgement& t, F&& f) {
  f("tensor", t.tensor), f("role", t.role), f("required", t.required), f("status", t.status), f("passed", t.passed);
  f("metric", t.metric), f("floor_dtype", t.floor_dtype), f("rule", t.rule), f("figure", t.figure);
  f("bound", t.bound), f("floor", t.floor), f("ratio", t.ratio), f("rel_rms", t.rel_rms), f("max_abs", t.max_abs);
  f("max_abs_index", t.max_abs_index), f("worst_index", t.worst_index), f("worst_at", t.worst_at);
  f("candidate_value", t.candidate_value), f("golden_value", t.golden_value), f("max_ulp", t.max_ulp);
  f("max_ulp_index", t.max_ulp_index), f("count", t.count), f("candidate_nan", t.candidate_nan);
  f("candidate_inf", t.candidate_inf), f("first_nonfinite_mismatch", t.first_nonfinite_mismatch);
  f("first_nonfinite_at", t.first_nonfinite_at), f("candidate_dtype", t.candidate_dtype), f("shape", t.shape);
  f("contract", t.contract), f("contract_error", t.contract_error), f("reason", t.reason);
}

struct CaseJudgement {
  std::string op, policy, table;
  int exit_code = 2;
  std::string reason;  // one line
  std::vector<TensorJudgement> tensors;
  const char* verdict() const;  // "pass", "fail", "unusable"
};

CaseJudgement judge_case(const PolicyTable& table, const JudgeRequest& request);

// The verdict of `rule` on figures already measured: `m` from compare (its floor in the rule's
// floor dtype, raised to any lower limit of the caller's), the contract's rel RMS against the
// same golden (contract rules), max(1, max |golden|) over the finite pairs (max-abs-ulps
// rules). judge_case gives every tensor this verdict once it has compared it on the host; a
// tensor too large for the host is compared where it lies (libk3gc's comparator on the device,
// its sums made figures by rel_rms_of_sums) and judged here, by the same rule.
struct Metrics;
void judge_figures(TensorJudgement& res, const Metrics& m, const TensorRule& rule, double contract_error = 0,
                   double ulp_scale = 1);

// The verdict of a metamorphic check on two runs of one kernel that must agree where no exact
// value exists: the rel RMS of their difference (from compare, or from a comparator's sums by
// rel_rms_of_sums) within `multiple` x max(`nominal_floor` of the values, `least`: the
// difference a correct kernel makes by construction, such as carrying its state in bf16, or
// the difference of its precision contract's two runs; `least_name` says which, in the
// reason). A finiteness mismatch (`first_nonfinite_mismatch` >= 0) fails. Bitwise equality is
// the caller's test before this (it needs no figure).
struct Agreement {
  bool passed = false;
  double ratio = 0;    // rel RMS / max(nominal floor, least); infinite when that is zero
  std::string reason;  // one line
};
Agreement judge_agreement(double rel_rms, std::int64_t first_nonfinite_mismatch, double nominal_floor, double least,
                          double multiple, const std::string& least_name = "the carried-state error");

// A judgement that never got as far as the rules (an unreadable file): exit 2 with `reason`.
CaseJudgement unusable(std::string op, std::string policy, std::string reason);

// Machine-readable reports. JSON: {"golden", "candidate", "op", "policy", "policy_table",
// "policy_table_version", "verdict", "exit_code", "reason", "tensors": [...]} with the
// TensorJudgement fields by name (non-finite numbers as null). JUnit XML: one testsuite for
// the case, one testcase per tensor (failure, error or skipped with the reason).
std::string judgement_json(const CaseJudgement& j, const std::string& golden, const std::string& candidate);
std::string judgement_junit(const CaseJudgement& j, const std::string& case_name);

}  // namespace k3ref::check
