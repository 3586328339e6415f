// k3ref._core: the module definition, AttnRes and Quantile Balancing. Private: the public
// API is python/k3ref/__init__.py, which validates arguments and converts torch tensors.
#include "k3ref/attnres/attnres.h"
#include "k3ref/qb/solver.h"
#include "core.h"

#include <type_traits>

namespace k3ref::python {

void python_stderr_line(const std::string& line) {
  py::gil_scoped_acquire gil;
  try {
    py::object err = py::module_::import("sys").attr("stderr");
    err.attr("write")(line + "\n");
    err.attr("flush")();
  } catch (const py::error_already_set&) {
    // no usable sys.stderr: the computation goes on without its progress lines
  }
}

namespace {

py::dict attnres(const Array& values, const Array& queries, const Array& norm_weights, double eps,
                 std::optional<std::int64_t> block_size, bool two_phase, const std::string& precision,
                 double progress_after) {
  const Tensor<double> v = to_tensor(values), q = to_tensor(queries), w = to_tensor(norm_weights);
  return in_tier(precision, [&]<class S>() {
    const attnres::Weights<S> weights{lift<S>(q), lift<S>(w), S(eps)};
    const Tensor<S> vals = lift<S>(v);
    // the estimate (exec/progress.h) in token-slots; the values' rank is checked by the reference
    const std::int64_t slots = v.rank() == 3 ? v.dim(0) : 0, tokens = v.rank() == 3 ? v.dim(1) : 0,
                       width = v.rank() == 3 ? v.dim(2) : 0;
    const double per_element = std::is_same_v<S, double> ? attnres::seconds_per_element_double
                                                         : attnres::seconds_per_element_multiprecision;
    exec::ProgressLines progress("k3ref.attnres", "token-slots", slots * tokens,
                                 exec::estimated_seconds(static_cast<double>(slots * slots * tokens * width), per_element, 1, 1),
                                 progress_after, python_stderr_line);
    const attnres::Outputs<S> out = with_progress(progress, true, [&] {
      return block_size ? attnres::block_forward(weights, vals, *block_size,
                                                 two_phase ? attnres::BlockForm::two_phase : attnres::BlockForm::direct)
                        : attnres::full_forward(weights, vals);
    });
    py::dict r;
    r["h"] = to_numpy(out.h);
    r["alpha"] = to_numpy(out.alpha);
    if (out.block_sums) r["block_sums"] = to_numpy(*out.block_sums);
    if (out.phase1_output) r["phase1_output"] = to_numpy(*out.phase1_output);
    if (out.phase1_max) r["phase1_max"] = to_numpy(*out.phase1_max);
    if (out.phase1_sum) r["phase1_sum"] = to_numpy(*out.phase1_sum);
    return r;
  });
}

py::dict qb_solver(const Array& scores, std::int64_t k, int iterations, const std::optional<Array>& beta0,
                   double progress_after) {
  const Tensor<double> s = to_tensor(scores);
  std::vector<double> b0;
  if (beta0) b0.assign(beta0->data(), beta0->data() + beta0->size());
  const std::int64_t items = s.rank() == 2 ? s.dim(0) * s.dim(1) : 0;  // the rank is the solver's to check
  exec::ProgressLines progress("k3ref.qb_solver", "iterations", iterations,
                               exec::estimated_seconds(static_cast<double>(iterations) * static_cast<double>(items),
                                                       qb::solver_seconds_per_element, 1, 1),
                               progress_after, python_stderr_line);
  const std::vector<qb::Iterate<double>> trace =
      with_progress(progress, true, [&] { return qb::alternating_solver(s, k, iterations, b0); });
  const std::int64_t m = s.dim(0), n = s.dim(1), T = static_cast<std::int64_t>(trace.size());
  py::array_t<double> alpha({T, m}), beta({T, n});
  py::array_t<std::int32_t> selection({T, m, k});
  py::array_t<std::int64_t> loads({T, n});
  for (std::int64_t t = 0; t < T; ++t) {
    const auto& it = trace[static_cast<std::size_t>(t)];
    std::copy(it.alpha.begin(), it.alpha.end(), alpha.mutable_data() + t * m);
    std::copy(it.beta.begin(), it.beta.end(), beta.mutable_data() + t * n);
    std::copy(it.selection.values().begin(), it.selection.values().end(), selection.mutable_data() + t * m * k);
    std::copy(it.loads.begin(), it.loads.end(), loads.mutable_data() + t * n);
  }
  py::dict r;
  r["alpha"] = alpha;
  r["beta"] = beta;
  r["selection"] = selection;
  r["loads"] = loads;
  return r;
}

}  // namespace

void register_attnres_qb(py::module_& m) {
  m.def("attnres", &attnres, py::arg("values"), py::arg("queries"), py::arg("norm_weights"), py::arg("eps"),
        py::arg("block_size"), py::arg("two_phase"), py::arg("precision"), py::arg("progress_after"));
  m.def("qb_solver", &qb_solver, py::arg("scores"), py::arg("k"), py::arg("iterations"), py::arg("beta0"),
        py::arg("progress_after"));
}

}  // namespace k3ref::python

PYBIND11_MODULE(_core, m) {
  namespace kp = k3ref::python;
  m.doc() = "k3ref's compiled references (private; use the k3ref package)";
  m.attr("high_precision_backend") = k3ref::num::high_precision_backend;
  m.attr("high_precision_bits") = k3ref::num::golden_bits;
  // InvalidArgument and FileError are ValueErrors with the library's one-line message.
  pybind11::register_exception<k3ref::InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);
  pybind11::register_exception<k3ref::FileError>(m, "FileError", PyExc_ValueError);
  // The options vocabulary (k3ref/vocabulary.h), from which the package takes its option
  // names, defaults and allowed values: {option: {"values": (name, ...), "default": name or
  // None, "about": {name: meaning}}}; and every tier's {name: description}.
  m.def("option_vocabulary", [] {
    pybind11::dict r;
    for (const k3ref::OptionVocabulary& v : k3ref::option_vocabulary()) {
      pybind11::list names;
      pybind11::dict about;
      for (const auto& c : v.values) {
        names.append(std::string(c.name));
        about[pybind11::str(std::string(c.name))] = std::string(c.about);
      }
      pybind11::dict entry;
      entry["values"] = pybind11::tuple(names);
      entry["default"] = v.default_name.empty() ? pybind11::object(pybind11::none())
                                                : pybind11::object(pybind11::str(std::string(v.default_name)));
      entry["about"] = about;
      r[pybind11::str(std::string(v.option))] = entry;
    }
    return r;
  });
  m.def("tiers", [] {
    pybind11::dict r;
    for (const auto& t : k3ref::num::tiers.values) r[pybind11::str(std::string(t.name))] = std::string(t.about);
    return r;
  });
  kp::register_kda_forward(m);
  kp::register_kda_backward(m);
  kp::register_kda_contract(m);
  kp::register_kcp(m);
  kp::register_attnres_qb(m);
  kp::register_readers(m);
  kp::register_cost(m);
  kp::register_check(m);
  kp::register_k3gc(m);
}
