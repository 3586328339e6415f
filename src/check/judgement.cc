#include "k3ref/check/judgement.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "k3ref/check/metrics.h"
#include "k3ref/error.h"
#include "k3ref/io/file.h"

namespace k3ref::check {
namespace {

// printf formats of the figures in reasons ({:.3e}, {:g}, {:.3g} in Python's spelling).
std::string fmt(const char* spec, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, spec, x);
  return buf;
}
std::string e3(double x) { return fmt("%.3e", x); }

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// A list of names for a one-line message: the first 8, then how many there are in all.
std::string name_list(const std::vector<std::string>& v) {
  if (v.size() <= 8) return join(v);
  return join(std::vector<std::string>(v.begin(), v.begin() + 8)) + ", ... (" + std::to_string(v.size()) + " in all)";
}

// Figures and verdict of one tensor under its rule. `contract`: the contract's values of the
// tensor (contract rules only); `floor_at_least`: the caller's lower limit on the floor.
void apply_rule(TensorJudgement& res, const std::vector<double>& x, const std::vector<double>& r, const TensorRule& rule,
                const std::vector<double>* contract, double floor_at_least) {
  const num::Format format = rule.floor_format.value_or(num::Format::fp64);
  Metrics m = compare(x, r, format);
  m.floor_rel_rms = std::max(m.floor_rel_rms, floor_at_least);
  if (m.max_abs_index >= 0) {
    res.candidate_value = x[m.max_abs_index];
    res.golden_value = r[m.max_abs_index];
  }
  double ulp_scale = 1;  // max(1, max |golden|) over the finite pairs: max-abs-ulps rules
  if (rule.metric == RuleMetric::max_abs_ulps)
    for (std::size_t i = 0; i < r.size(); ++i)
      if (std::isfinite(r[i]) && std::isfinite(x[i])) ulp_scale = std::max(ulp_scale, std::fabs(r[i]));
  judge_figures(res, m, rule, contract ? compare(*contract, r, format).rel_rms : 0.0, ulp_scale);
}

std::vector<std::int64_t> unravel(std::int64_t index, const Shape& shape) {
  std::vector<std::int64_t> out(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    const std::int64_t extent = shape[d];
    out[d] = extent ? index % extent : 0;
    index = extent ? index / extent : index;
  }
  return out;
}

nlohmann::json number(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // Control characters other than tab and newline are not allowed in XML 1.0.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n') out += ' ';
        else out += c;
    }
  }
  return out;
}

}  // namespace

std::string describe_index(const std::vector<std::string>& axes, const std::vector<std::int64_t>& index,
                           const std::vector<std::int64_t>& cu_seqlens, bool v_first) {
  std::vector<std::string> names = axes;
  if (names.size() != index.size()) {
    names.clear();
    for (std::size_t d = 0; d < index.size(); ++d) names.push_back("dim" + std::to_string(d));
  }
  const std::size_t n = names.size();
  if (v_first && n >= 2 && names[n - 2] == "k" && names[n - 1] == "v") std::swap(names[n - 2], names[n - 1]);
  std::string s = "(";
  for (std::size_t d = 0; d < n; ++d) {
    if (d) s += ", ";
    // A packed varlen batch: the token axis of batch 0 runs over every sequence in turn.
    if (names[d] == "token" && cu_seqlens.size() >= 2) {
      const auto next = std::upper_bound(cu_seqlens.begin(), cu_seqlens.end(), index[d]);
      if (next != cu_seqlens.begin() && next != cu_seqlens.end()) {
        const std::int64_t seq = next - cu_seqlens.begin() - 1;
        s += "sequence " + std::to_string(seq) + ", position " + std::to_string(index[d] - cu_seqlens[seq]);
        continue;
      }
    }
    s += names[d] + " " + std::to_string(index[d]);
  }
  return s + ")";
}

void judge_figures(TensorJudgement& res, const Metrics& m, const TensorRule& rule, double contract_error,
                   double ulp_scale) {
  const num::Format format = rule.floor_format.value_or(num::Format::fp64);
  res.metric = metric_name(rule.metric);
  res.floor_dtype = floor_format_name(rule.floor_format);
  res.rule = rule.source;
  res.count = m.count;
  res.candidate_nan = m.candidate_nan;
  res.candidate_inf = m.candidate_inf;
  res.first_nonfinite_mismatch = m.first_nonfinite_mismatch;
  res.rel_rms = m.rel_rms;
  res.floor = m.floor_rel_rms;
  res.ratio = m.floor_rel_rms > 0 ? m.rel_rms / m.floor_rel_rms : (m.rel_rms == 0 ? 0.0 : INFINITY);
  res.max_abs = m.max_abs;
  res.max_abs_index = m.max_abs_index;
  res.max_ulp = m.max_ulp;
  res.max_ulp_index = m.max_ulp_index;
  bool ok = false;
  std::string why;
  const std::string dtype = floor_format_name(rule.floor_format);
  // The ratio to the floor where there is one (a golden exact in the floor dtype has none).
  const std::string ratio = m.floor_rel_rms > 0 ? "; " + fmt("%.3g", res.ratio) + "x" : "";
  switch (rule.metric) {
    case RuleMetric::exact:
      res.figure = m.max_abs;
      res.bound = 0;
      ok = m.max_abs == 0 && m.first_zero_sign_mismatch < 0;
      why = ok ? "bitwise equal"
               : m.max_abs != 0
                   ? "not equal: max abs error " + e3(m.max_abs) + " at flat index " + std::to_string(m.max_abs_index)
                   : "not equal: 0.0 against -0.0 at flat index " + std::to_string(m.first_zero_sign_mismatch);
      break;
    case RuleMetric::floor_multiple:
      res.figure = m.rel_rms;
      res.bound = rule.multiple * m.floor_rel_rms;
      ok = m.rel_rms <= res.bound || m.max_abs == 0;
      why = "rel RMS " + e3(m.rel_rms) + (ok ? " <= " : " > ") + e3(res.bound) + " (" + fmt("%g", rule.multiple) +
            " x " + dtype + " floor " + e3(m.floor_rel_rms) + ratio + ")";
      if (!std::isfinite(m.floor_rel_rms)) {  // fail closed: an infinite floor would pass anything
        ok = false;
        why = "the golden overflows " + dtype + ": its floor is infinite";
      } else if (m.floor_rel_rms >= 1) {  // every value rounds to zero: a sign flip would pass
        ok = false;
        why = "the golden underflows " + dtype + ": every value rounds to zero there, its floor is 100 %";
      }
      break;
    case RuleMetric::rel_rms:
      res.figure = m.rel_rms;
      res.bound = rule.bound;
      ok = m.rel_rms <= res.bound;
      why = "rel RMS " + e3(m.rel_rms) + (ok ? " <= " : " > ") + e3(res.bound) + " (" + dtype + " floor " +
            e3(m.floor_rel_rms) + ratio + ")";
      break;
    case RuleMetric::max_abs_ulps: {
      const double scale = ulp_scale;
      res.figure = m.max_abs;
      res.bound = rule.ulps * std::ldexp(1.0, -num::format_info(format).mantissa_bits) * scale;
      ok = m.max_abs <= res.bound;
      why = "max abs error " + e3(m.max_abs) + (ok ? " <= " : " > ") + e3(res.bound) + " (" + fmt("%g", rule.ulps) +
            " " + dtype + " ulps of max(1, max |golden|) = " + e3(scale) + ")";
      break;
    }
    case RuleMetric::contract: {
      res.contract = rule.contract;
      res.contract_error = contract_error;
      const double scale = std::max(m.floor_rel_rms, res.contract_error);
      res.figure = m.rel_rms;
      res.bound = rule.multiple * scale;
      res.ratio = scale > 0 ? m.rel_rms / scale : (m.rel_rms == 0 ? 0.0 : INFINITY);
      ok = m.rel_rms <= res.bound;
      why = "rel RMS " + e3(m.rel_rms) + (ok ? " <= " : " > ") + fmt("%g", rule.multiple) + " x max(" + dtype +
            " floor " + e3(m.floor_rel_rms) + ", contract " + rule.contract + " " + e3(res.contract_error) + ") (" +
            fmt("%.3g", res.ratio) + "x)";
      break;
    }
  }
  if (m.first_nonfinite_mismatch >= 0) {
    ok = false;
    why = "NaN/Inf where the golden has none (or the reverse), first at flat index " +
          std::to_string(m.first_nonfinite_mismatch);
  } else if (m.count > 0 && m.finite_pairs == 0) {  // a figure over nothing vouches for nothing
    ok = false;
    why = "no finite value compared (" + std::to_string(m.count) + " non-finite pairs)";
  }
  res.passed = ok;
  res.status = ok ? "pass" : "fail";
  res.reason = why;
}


Agreement judge_agreement(double rel_rms, std::int64_t first_nonfinite_mismatch, double nominal_floor, double least,
                          double multiple, const std::string& least_name) {
  if (first_nonfinite_mismatch >= 0)
    return {false, INFINITY, "NaN/Inf in one run only, first at flat index " + std::to_string(first_nonfinite_mismatch)};
  const double scale = std::max(nominal_floor, least);
  Agreement a;
  a.ratio = scale > 0 ? rel_rms / scale : (rel_rms == 0 ? 0.0 : INFINITY);
  a.passed = rel_rms <= multiple * scale;
  const std::string what = scale == nominal_floor ? "nominal floor " + e3(nominal_floor)
                                                  : least_name + " " + e3(least) +
                                                        " (above the nominal floor " + e3(nominal_floor) + ")";
  a.reason = "not bitwise equal; rel RMS of the difference " + e3(rel_rms) + (a.passed ? " <= " : " > ") +
             fmt("%g", multiple) + " x " + what + " (" + fmt("%.3g", a.ratio) + "x)";
  return a;
}

const char* CaseJudgement::verdict() const {
  return exit_code == 0 ? "pass" : exit_code == 1 ? "fail" : "unusable";
}

CaseJudgement unusable(std::string op, std::string policy, std::string reason) {
  CaseJudgement j;
  j.op = std::move(op);
  j.policy = std::move(policy);
  j.exit_code = 2;
  j.reason = std::move(reason);
  return j;
}

CaseJudgement judge_case(const PolicyTable& table, const JudgeRequest& q) {
  CaseJudgement j = unusable(q.op, q.policy, "");
  j.table = table.origin();
  std::map<std::string, TensorRule> rules;
  try {
    rules = table.rules(q.policy, q.op);
  } catch (const InvalidArgument& e) {
    j.reason = e.what();
    return j;
  }
  // The first reason of each kind, in the order the Python judge finds them.
  std::string first_unusable, first_fail;
  auto note_unusable = [&](const std::string& s) { if (first_unusable.empty()) first_unusable = s; };
  auto note_fail = [&](const std::string& s) { if (first_fail.empty()) first_fail = s; };

  std::vector<std::string> outputs;
  for (const auto& [name, values] : q.expected) outputs.push_back(name);
  for (const auto& name : outputs)
    if (!rules.count(name)) note_unusable("golden output " + io::excerpt(name) + " of operator " + io::excerpt(q.op) + " is not in the policy table");
  const std::set<std::string> output_set(outputs.begin(), outputs.end());
  const std::vector<std::string> selected = q.tensors ? *q.tensors : outputs;
  for (const auto& name : selected)
    if (!output_set.count(name)) note_unusable("no output " + io::excerpt(name) + " in the golden (outputs: " + name_list(outputs) + ")");
  const OperatorSpec& spec = *table.find_operator(q.op);
  // Hash sets: a lookup per candidate tensor in vectors was quadratic (40k tensors: seconds).
  const std::set<std::string> accepted = [&] {
    std::set<std::string> names = output_set;
    names.insert(q.known.begin(), q.known.end());
    names.insert(spec.inputs.begin(), spec.inputs.end());
    return names;
  }();
  for (const auto& name : q.candidate_names) {
    if (accepted.count(name)) continue;
    TensorJudgement u;
    u.tensor = name;
    u.required = false;
    u.status = "unknown";
    u.reason = "candidate tensor " + io::excerpt(name) + " is neither an output nor an input of the golden (outputs: " +
               name_list(outputs) + ")";
    note_unusable(u.reason);
    j.tensors.push_back(std::move(u));
  }
  if (!first_unusable.empty()) {
    j.reason = first_unusable;
    return j;
  }

  std::map<std::string, const NamedValues*> expected_by_name;
  for (const auto& [name, values] : q.expected) expected_by_name.emplace(name, &values);
  const std::set<std::string> in_candidate(q.candidate_names.begin(), q.candidate_names.end());
  int judged = 0;
  for (const auto& name : selected) {
    const TensorRule& rule = rules.at(name);
    const OutputSpec& out = *spec.find(name);
    const NamedValues& ref = *expected_by_name.at(name);
    TensorJudgement res;
    res.tensor = name;
    res.role = role_name(out.role);
    res.required = q.tensors.has_value() || out.role != TensorRole::stage;
    res.metric = metric_name(rule.metric);
    res.floor_dtype = floor_format_name(rule.floor_format);
    res.rule = rule.source;
    res.shape = ref.shape;
    if (!in_candidate.count(name)) {
      if (res.required) {
        res.status = "missing";
        res.reason = "missing from the candidate (a required " + res.role + ")";
        note_fail(name + ": " + res.reason);
      } else {
        res.status = "skipped";
        res.passed = true;
        res.reason = "not in the candidate (an optional " + res.role + " tensor)";
      }
      j.tensors.push_back(std::move(res));
      continue;
    }
    const NamedValues cand = q.candidate(name);
    res.candidate_dtype = cand.dtype;
    if (cand.shape != ref.shape) {
      res.status = "error";
      res.reason = "shape " + shape_to_string(cand.shape) + " differs from the golden's " + shape_to_string(ref.shape);
      note_unusable(name + ": " + res.reason);
    } else if (!cand.numeric) {
      res.status = "error";
      res.reason = "dtype " + cand.dtype + " is not a numeric output";
      note_unusable(name + ": " + res.reason);
    } else if (const auto bad = std::find_if(ref.values.begin(), ref.values.end(),
                                             [](double v) { return !std::isfinite(v); });
               bad != ref.values.end()) {
      res.status = "error";
      res.reason = "the golden holds a non-finite value (first at flat index " +
                   std::to_string(bad - ref.values.begin()) + "): no verdict can be vouched for against it";
      note_unusable(name + ": " + res.reason);
    } else {
      std::optional<NamedValues> contract;
      if (rule.metric == RuleMetric::contract) {
        if (q.contract_values) contract = q.contract_values(rule.contract, name);
        const char* why = !contract ? "is not available here (it is evaluated on the golden's inputs by the caller)"
                          : contract->shape != ref.shape ? "has another shape than the golden's"
                          : std::all_of(contract->values.begin(), contract->values.end(),
                                        [](double v) { return std::isfinite(v); })
                              ? nullptr
                              : "is not finite on these inputs: no bound to judge by";
        if (why) {
          res.status = "error";
          res.reason = "the tensor of contract " + rule.contract + " " + why;
          note_unusable(name + ": " + res.reason);
          j.tensors.push_back(std::move(res));
          continue;
        }
      }
      const auto at_least = q.floor_at_least.find(name);
      apply_rule(res, cand.values, ref.values, rule, contract ? &contract->values : nullptr,
                 at_least == q.floor_at_least.end() ? 0.0 : at_least->second);
      if (res.max_abs_index >= 0) {
        res.worst_index = unravel(res.max_abs_index, res.shape);
        res.worst_at = describe_index(out.axes, res.worst_index, q.cu_seqlens, q.v_first);
      }
      if (res.first_nonfinite_mismatch >= 0)
        res.first_nonfinite_at = describe_index(out.axes, unravel(res.first_nonfinite_mismatch, res.shape),
                                                q.cu_seqlens, q.v_first);
      ++judged;
      if (!res.passed) note_fail(name + ": " + res.reason);
    }
    j.tensors.push_back(std::move(res));
  }
  if (!first_unusable.empty()) {
    j.reason = first_unusable;
  } else if (!first_fail.empty()) {
    j.exit_code = 1;
    j.reason = first_fail;
  } else if (judged == 0) {
    j.exit_code = 1;
    j.reason = "no tensor was judged: the candidate holds none of the golden's outputs";
  } else {
    j.exit_code = 0;
    j.reason = std::to_string(judged) + " tensor(s) pass under policy '" + q.policy + "'";
  }
  return j;
}

std::string judgement_json(const CaseJudgement& j, const std::string& golden, const std::string& candidate) {
  nlohmann::ordered_json out;
  out["golden"] = golden;
  out["candidate"] = candidate;
  out["op"] = j.op;
  out["policy"] = j.policy;
  out["policy_table"] = j.table;
  out["policy_table_version"] = policy_table_version;
  out["verdict"] = j.verdict();
  out["exit_code"] = j.exit_code;
  out["reason"] = j.reason;
  out["tensors"] = nlohmann::ordered_json::array();
  for (const auto& t : j.tensors) {
    nlohmann::ordered_json e;
    for_each_field(t, [&](const char* name, const auto& value) {
      if constexpr (std::is_same_v<std::decay_t<decltype(value)>, double>)
        e[name] = number(value);
      else
        e[name] = value;
    });
    out["tensors"].push_back(std::move(e));
  }
  // Invalid UTF-8 in a name (the safetensors reader refuses it, a caller may not) is replaced.
  return out.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

std::string judgement_junit(const CaseJudgement& j, const std::string& case_name) {
  int failures = 0, errors = 0, skipped = 0;
  std::string cases;
  const std::string classname = xml_escape("k3ref.compare." + case_name);
  for (const auto& t : j.tensors) {
    cases += "    <testcase classname=\"" + classname + "\" name=\"" + xml_escape(t.tensor) + "\">";
    const std::string msg = xml_escape(t.reason);
    if (t.status == "fail" || t.status == "missing") {
      ++failures;
      cases += "<failure message=\"" + msg + "\">" + msg + "</failure>";
    } else if (t.status == "error" || t.status == "unknown") {
      ++errors;
      cases += "<error message=\"" + msg + "\">" + msg + "</error>";
    } else if (t.status == "skipped") {
      ++skipped;
      cases += "<skipped message=\"" + msg + "\"/>";
    } else {
      cases += "<system-out>" + msg + "</system-out>";
    }
    cases += "</testcase>\n";
  }
  // A verdict no tensor carries (an unusable input, nothing judged) is a testcase of its own,
  // so that a report never shows green for a run that judged nothing.
  const bool carried = std::any_of(j.tensors.begin(), j.tensors.end(), [](const TensorJudgement& t) {
    return t.status != "pass" && t.status != "skipped";
  });
  int tests = static_cast<int>(j.tensors.size());
  if (j.exit_code != 0 && !carried) {
    ++tests;
    const std::string msg = xml_escape(j.reason);
    if (j.exit_code == 2) {
      ++errors;
      cases += "    <testcase classname=\"" + classname + "\" name=\"compare\"><error message=\"" + msg + "\">" + msg +
               "</error></testcase>\n";
    } else {
      ++failures;
      cases += "    <testcase classname=\"" + classname + "\" name=\"compare\"><failure message=\"" + msg + "\">" +
               msg + "</failure></testcase>\n";
    }
  }
  std::string head = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites>\n  <testsuite name=\"" +
                     xml_escape("k3ref compare " + case_name + " (policy " + j.policy + ")") + "\" tests=\"" +
                     std::to_string(tests) + "\" failures=\"" + std::to_string(failures) + "\" errors=\"" +
                     std::to_string(errors) + "\" skipped=\"" + std::to_string(skipped) + "\">\n";
  return head + cases + "  </testsuite>\n</testsuites>\n";
}

}  // namespace k3ref::check
