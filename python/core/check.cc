// k3ref._core: the policy table and the judge (k3ref::check), the one place a figure is
// computed and judged for the Python package as for `k3ref compare`. k3ref.policy wraps
// these in its Verdict and TensorResult; every tensor arrives as a float64 array.
#include <cmath>
#include <map>

#include "core.h"
#include "k3ref/check/judgement.h"
#include "k3ref/check/metrics.h"
#include "k3ref/check/policy_table.h"

namespace k3ref::python {
namespace {

using check::NamedValues;
using check::PolicyTable;

// A tensor handed over as (values: float64 array, dtype name, numeric).
NamedValues named(const py::tuple& t) {
  const Array a = t[0].cast<Array>();
  NamedValues v;
  v.shape.assign(a.shape(), a.shape() + a.ndim());
  v.values.assign(a.data(), a.data() + a.size());
  v.dtype = t[1].cast<std::string>();
  v.numeric = t[2].cast<bool>();
  return v;
}

py::dict rule_dict(const check::TensorRule& r) {
  py::dict d;
  d["metric"] = check::metric_name(r.metric);
  d["floor_dtype"] = check::floor_format_name(r.floor_format);
  d["multiple"] = r.multiple;
  d["bound"] = r.bound;
  d["ulps"] = r.ulps;
  d["contract"] = r.contract;
  d["source"] = r.source;
  return d;
}

py::dict operator_dict(const check::OperatorSpec& spec) {
  py::dict outputs;
  for (const auto& o : spec.outputs) {
    py::dict d;
    d["role"] = check::role_name(o.role);
    d["dtype"] = check::floor_format_name(o.dtype);
    d["axes"] = o.axes;
    outputs[py::str(o.name)] = d;
  }
  py::dict d;
  d["inputs"] = spec.inputs;
  d["outputs"] = outputs;
  return d;
}

py::dict tensor_dict(const check::TensorJudgement& t) {
  py::dict d;
  check::for_each_field(t, [&](const char* name, const auto& value) { d[name] = value; });
  return d;
}

// expected: [(name, (values, dtype, numeric))] in golden order; candidate: {name: (...)};
// contracts: {(contract, tensor): values}.
py::dict judge(const PolicyTable& table, const std::string& op, const std::string& policy, const py::list& expected,
               const std::vector<std::string>& known, const py::dict& candidate,
               const std::optional<std::vector<std::string>>& tensors, const py::dict& contracts,
               const std::map<std::string, double>& floor_at_least, const std::vector<std::int64_t>& cu_seqlens,
               bool v_first) {
  check::JudgeRequest q;
  q.op = op;
  q.policy = policy;
  for (const auto& item : expected) {
    const auto pair = item.cast<py::tuple>();
    q.expected.emplace_back(pair[0].cast<std::string>(), named(pair[1].cast<py::tuple>()));
  }
  q.known = known;
  std::map<std::string, NamedValues> cand;
  for (const auto& [name, t] : candidate) {
    q.candidate_names.push_back(name.cast<std::string>());
    cand.emplace(name.cast<std::string>(), named(t.cast<py::tuple>()));
  }
  q.candidate = [&](const std::string& name) { return cand.at(name); };
  q.tensors = tensors;
  std::map<std::pair<std::string, std::string>, NamedValues> con;
  for (const auto& [key, t] : contracts) {
    const auto k = key.cast<py::tuple>();
    con.emplace(std::pair{k[0].cast<std::string>(), k[1].cast<std::string>()}, named(t.cast<py::tuple>()));
  }
  q.contract_values = [&](const std::string& contract, const std::string& tensor) -> std::optional<NamedValues> {
    const auto it = con.find({contract, tensor});
    return it == con.end() ? std::nullopt : std::optional<NamedValues>(it->second);
  };
  q.floor_at_least = floor_at_least;
  q.cu_seqlens = cu_seqlens;
  q.v_first = v_first;
  check::CaseJudgement j;
  {
    py::gil_scoped_release release;
    j = check::judge_case(table, q);
  }
  py::list results;
  for (const auto& t : j.tensors) results.append(tensor_dict(t));
  py::dict d;
  d["op"] = j.op;
  d["policy"] = j.policy;
  d["table"] = j.table;
  d["exit_code"] = j.exit_code;
  d["reason"] = j.reason;
  d["tensors"] = results;
  return d;
}

num::Format format_named(const std::string& name) {
  const auto f = check::floor_format_from_string(name);
  if (!f) throw InvalidArgument("unknown format '" + name + "' (fp64, fp32, bf16, fp16)");
  return *f;
}

std::vector<double> flat(const Array& a) { return {a.data(), a.data() + a.size()}; }

// The figures of check::compare for one pair of tensors (flattened).
py::dict compare(const Array& candidate, const Array& reference, const std::string& format) {
  const std::vector<double> x = flat(candidate), r = flat(reference);
  const num::Format f = format_named(format);
  check::Metrics m;
  {
    py::gil_scoped_release release;
    m = check::compare(x, r, f);
  }
  using namespace pybind11::literals;
  return py::dict("count"_a = m.count, "rel_rms"_a = m.rel_rms, "floor_rel_rms"_a = m.floor_rel_rms,
                  "max_abs"_a = m.max_abs, "max_abs_index"_a = m.max_abs_index, "max_ulp"_a = m.max_ulp,
                  "max_ulp_index"_a = m.max_ulp_index, "candidate_nan"_a = m.candidate_nan,
                  "candidate_inf"_a = m.candidate_inf, "reference_nan"_a = m.reference_nan,
                  "reference_inf"_a = m.reference_inf, "first_nonfinite_mismatch"_a = m.first_nonfinite_mismatch,
                  "finite_pairs"_a = m.finite_pairs);
}

}  // namespace

void register_check(py::module_& m) {
  py::class_<PolicyTable>(m, "PolicyTable")
      .def_static("parse", &PolicyTable::parse, py::arg("text"), py::arg("origin"))
      .def_static("load", [](const std::string& path) { return PolicyTable::load(path); }, py::arg("path"))
      .def_static("builtin", &PolicyTable::builtin, py::return_value_policy::reference)
      .def_static("builtin_text", &PolicyTable::builtin_text)
      .def_property_readonly("origin", &PolicyTable::origin)
      .def("operator_names", &PolicyTable::operator_names)
      .def("policy_names", &PolicyTable::policy_names)
      .def("operators_of", &PolicyTable::operators_of, py::arg("policy"))
      .def("about", &PolicyTable::about, py::arg("policy"))
      .def("operator", [](const PolicyTable& t, const std::string& op) -> py::object {
        const auto* spec = t.find_operator(op);
        return spec ? py::object(operator_dict(*spec)) : py::object(py::none());
      }, py::arg("op"))
      .def("rules", [](const PolicyTable& t, const std::string& policy, const std::string& op) {
        py::dict d;
        for (const auto& [name, rule] : t.rules(policy, op)) d[py::str(name)] = rule_dict(rule);
        return d;
      }, py::arg("policy"), py::arg("op"))
      .def("help", [](const PolicyTable& t) { return check::policy_table_help(t); });
  m.attr("policy_table_version") = check::policy_table_version;
  m.attr("max_table_bytes") = check::max_table_bytes;
  m.def("judge", &judge, py::arg("table"), py::arg("op"), py::arg("policy"), py::arg("expected"), py::arg("known"),
        py::arg("candidate"), py::arg("tensors"), py::arg("contracts"), py::arg("floor_at_least"),
        py::arg("cu_seqlens"), py::arg("v_first"));
  m.def("compare", &compare, py::arg("candidate"), py::arg("reference"), py::arg("format"));
  m.def("nominal_floor", [](const Array& values, const std::string& format) {
    return check::nominal_floor(flat(values), format_named(format));
  }, py::arg("values"), py::arg("format"));
  m.def("rel_rms_by_window", [](const Array& candidate, const Array& reference, std::size_t axis, std::int64_t window) {
    return check::rel_rms_by_window(flat(candidate), flat(reference), Shape(reference.shape(), reference.shape() + reference.ndim()),
                                    axis, window);
  }, py::arg("candidate"), py::arg("reference"), py::arg("axis"), py::arg("window"));
  // Elementwise over two equally long lists: libk3gc's totals or its per-window sums.
  m.def("rel_rms_of_sums", [](const std::vector<double>& err_sq, const std::vector<double>& ref_sq) {
    if (err_sq.size() != ref_sq.size()) throw InvalidArgument("rel_rms_of_sums: the two lists differ in length");
    std::vector<double> out(err_sq.size());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = check::rel_rms_of_sums(err_sq[i], ref_sq[i]);
    return out;
  }, py::arg("err_sq"), py::arg("ref_sq"));
  // The verdict of the rule of `tensor` of `op` under `policy` on figures measured elsewhere
  // (libk3gc's comparator on the device): check::judge_figures. `figures` holds compare's keys;
  // one the comparator does not give is taken as "nothing to report" (-1 for an index, 0 for a
  // count; finite_pairs: count, the comparator reporting a non-finite mismatch by its index),
  // but max_abs as unknown (infinite: never read as equality, which passes a floor rule).
  m.def("judge_figures", [](const PolicyTable& table, const std::string& policy, const std::string& op,
                            const std::string& tensor, const py::dict& figures, double contract_error, double ulp_scale) {
    const auto rules = table.rules(policy, op);
    const auto rule = rules.find(tensor);
    if (rule == rules.end()) throw InvalidArgument("judge_figures: " + op + " has no output '" + tensor + "'");
    auto get = [&](const char* key, auto fallback) {
      return figures.contains(key) ? figures[key].cast<decltype(fallback)>() : fallback;
    };
    check::Metrics m;
    m.count = get("count", std::int64_t{0});
    m.rel_rms = get("rel_rms", 0.0);
    m.floor_rel_rms = get("floor_rel_rms", 0.0);
    m.max_abs = get("max_abs", double(INFINITY));
    m.max_abs_index = get("max_abs_index", std::int64_t{-1});
    m.max_ulp = get("max_ulp", 0.0);
    m.max_ulp_index = get("max_ulp_index", std::int64_t{-1});
    m.candidate_nan = get("candidate_nan", std::int64_t{0});
    m.candidate_inf = get("candidate_inf", std::int64_t{0});
    m.reference_nan = get("reference_nan", std::int64_t{0});
    m.reference_inf = get("reference_inf", std::int64_t{0});
    m.first_nonfinite_mismatch = get("first_nonfinite_mismatch", std::int64_t{-1});
    m.first_zero_sign_mismatch = get("first_zero_sign_mismatch", std::int64_t{-1});
    m.finite_pairs = get("finite_pairs", m.count);
    check::TensorJudgement res;
    res.tensor = tensor;
    check::judge_figures(res, m, rule->second, contract_error, ulp_scale);
    return tensor_dict(res);
  }, py::arg("table"), py::arg("policy"), py::arg("op"), py::arg("tensor"), py::arg("figures"),
        py::arg("contract_error") = 0.0, py::arg("ulp_scale") = 1.0);
  m.def("judge_agreement", [](double rel_rms, std::int64_t first_nonfinite_mismatch, double nominal_floor, double least,
                              double multiple, const std::string& least_name) {
    using namespace pybind11::literals;
    const check::Agreement a = check::judge_agreement(rel_rms, first_nonfinite_mismatch, nominal_floor, least, multiple,
                                                      least_name);
    return py::dict("passed"_a = a.passed, "ratio"_a = a.ratio, "reason"_a = a.reason);
  }, py::arg("rel_rms"), py::arg("first_nonfinite_mismatch"), py::arg("nominal_floor"), py::arg("least"),
        py::arg("multiple"), py::arg("least_name") = "the carried-state error");
  m.def("describe_index", &check::describe_index, py::arg("axes"), py::arg("index"), py::arg("cu_seqlens"),
        py::arg("v_first"));
  m.def("expand_outputs", &check::expand_outputs, py::arg("spec"));
}

}  // namespace k3ref::python
