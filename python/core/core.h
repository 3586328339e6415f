// Shared pieces of k3ref._core, the compiled half of the Python package (python/k3ref/).
// The Python half validates every argument and hands over NumPy arrays (float64, or int64
// for index tensors, C-contiguous) and option dicts keyed by the `k3ref kda` command's option
// names; this half turns them into the C++ types once and calls the templates. Arrays come
// back as float64 (a 256-bit result is rounded once, to nearest).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "k3ref/error.h"
#include "k3ref/exec/progress.h"
#include "k3ref/kda/backward.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/kda/options.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/scalar.h"
#include "k3ref/num/tier.h"
#include "k3ref/vocabulary.h"

namespace k3ref::python {

namespace py = pybind11;

using Array = py::array_t<double, py::array::c_style | py::array::forcecast>;
using IndexArray = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;
using Mp256 = num::golden_float;

// Runs f.template operator()<S>() in the scalar type of the tier named `precision` (the
// options vocabulary's names, num::precision_tiers).
template <class F>
auto in_tier(const std::string& precision, F&& f) {
  return num::precision_tiers.parse(precision) == num::Tier::mp256 ? f.template operator()<Mp256>()
                                                                   : f.template operator()<double>();
}

// A progress line on Python's sys.stderr (where a notebook shows it and pytest captures it),
// from whichever thread of the computation prints it (module.cc).
void python_stderr_line(const std::string& line);

// Runs `work` without the GIL, with `lines` (a reference's progress lines) ticking beside it
// when `tick` (the work reports no units); the ticker stops before the GIL is taken back, as
// its lines need the GIL. Then the last line.
template <class F>
auto with_progress(exec::ProgressLines& lines, bool tick, F&& work) {
  auto result = [&] {
    py::gil_scoped_release release;
    struct StopTicking {
      exec::ProgressLines& lines;
      ~StopTicking() { lines.stop_ticking(); }
    } stop{lines};
    if (tick) lines.tick();
    return work();
  }();
  lines.finish();
  return result;
}

inline Tensor<double> to_tensor(const Array& a) {
  Shape shape(a.shape(), a.shape() + a.ndim());
  return Tensor<double>(std::move(shape), std::vector<double>(a.data(), a.data() + a.size()));
}

template <class S>
Tensor<S> lift(const Tensor<double>& t) {
  return t.map<S>([](double x) { return S(x); });
}

template <class S>
py::array_t<double> to_numpy(const Tensor<S>& t) {
  py::array_t<double> out(std::vector<py::ssize_t>(t.shape().begin(), t.shape().end()));
  double* dst = out.mutable_data();
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    if constexpr (std::is_same_v<S, double>)
      dst[i] = t.data()[i];
    else
      dst[i] = num::to_double_rne(t.data()[i]);
  }
  return out;
}

inline py::array_t<std::int64_t> to_numpy(const Tensor<std::int64_t>& t) {
  py::array_t<std::int64_t> out(std::vector<py::ssize_t>(t.shape().begin(), t.shape().end()));
  std::copy(t.data(), t.data() + t.numel(), out.mutable_data());
  return out;
}

// Stacks per-rank tensors of one shape into [P, ...].
template <class S>
Tensor<S> stack(const std::vector<Tensor<S>>& parts) {
  Shape shape{static_cast<std::int64_t>(parts.size())};
  if (!parts.empty()) shape.insert(shape.end(), parts[0].shape().begin(), parts[0].shape().end());
  std::vector<S> data;
  for (const auto& t : parts) data.insert(data.end(), t.values().begin(), t.values().end());
  return Tensor<S>(std::move(shape), std::move(data));
}

inline std::optional<Tensor<double>> optional_tensor(const py::dict& d, const char* name) {
  if (!d.contains(name) || d[name].is_none()) return std::nullopt;
  return to_tensor(d[name].cast<Array>());
}

// KDA inputs from the dict of tensors (the names of kda_io.h's input_names).
inline kda::Inputs<double> kda_inputs(const py::dict& d) {
  kda::Inputs<double> in;
  auto required = [&](const char* name) {
    if (!d.contains(name)) throw InvalidArgument(std::string("missing input tensor '") + name + "'");
    return to_tensor(d[name].cast<Array>());
  };
  in.q = required("q");
  in.k = required("k");
  in.v = required("v");
  in.g = required("g");
  in.beta = required("beta");
  in.initial_state = optional_tensor(d, "initial_state");
  in.A_log = optional_tensor(d, "A_log");
  in.dt_bias = optional_tensor(d, "dt_bias");
  if (d.contains("cu_seqlens") && !d["cu_seqlens"].is_none()) {
    const auto c = d["cu_seqlens"].cast<IndexArray>();
    in.cu_seqlens = std::vector<std::int64_t>(c.data(), c.data() + c.size());
  }
  return in;
}

// The value of a named-value option (absent: the option struct's default).
template <class E, std::size_t N>
E parse_choice(const Choices<E, N>& choices, const py::dict& o, E fallback) {
  const std::string key(choices.option);
  return o.contains(key.c_str()) ? choices.parse(o[key.c_str()].cast<std::string>()) : fallback;
}

// The options of `k3ref kda` (gate, gate_base, lower_bound, beta, l2norm, scale,
// state_layout, all_states, no_final_state, threads), already type-checked by the Python side.
template <class S>
kda::Options<S> kda_options(const py::dict& o) {
  kda::Options<S> opt;
  auto number = [&](const char* name) -> std::optional<S> {
    if (!o.contains(name) || o[name].is_none()) return std::nullopt;
    return S(o[name].cast<double>());
  };
  auto flag = [&](const char* name) { return o.contains(name) && o[name].cast<bool>(); };
  opt.scale = number("scale");
  opt.lower_bound = number("lower_bound");
  opt.qk_l2norm = flag("l2norm");
  opt.gate = parse_choice(kda::gate_forms, o, opt.gate);
  opt.gate_base = parse_choice(kda::gate_bases, o, opt.gate_base);
  opt.beta = parse_choice(kda::beta_forms, o, opt.beta);
  opt.state_layout = parse_choice(kda::state_layouts, o, opt.state_layout);
  opt.output_all_states = flag("all_states");
  opt.output_final_state = !flag("no_final_state");
  opt.num_threads = o.contains("threads") ? o["threads"].cast<int>() : 1;
  return opt;
}

template <class S>
kda::Cotangents<S> kda_cotangents(const py::dict& d) {
  if (!d.contains("d_o")) throw InvalidArgument("missing cotangent tensor 'd_o'");
  kda::Cotangents<S> cot;
  cot.d_o = lift<S>(to_tensor(d["d_o"].cast<Array>()));
  if (auto f = optional_tensor(d, "d_final_state")) cot.d_final_state = lift<S>(*f);
  return cot;
}

template <class S>
void put_gradients(py::dict& r, const kda::Gradients<S>& g) {
  r["dq"] = to_numpy(g.dq);
  r["dk"] = to_numpy(g.dk);
  r["dv"] = to_numpy(g.dv);
  r["dg"] = to_numpy(g.dg);
  r["dbeta"] = to_numpy(g.dbeta);
  r["d_initial_state"] = to_numpy(g.d_initial_state);
  if (g.dA_log) r["dA_log"] = to_numpy(*g.dA_log);
  if (g.ddt_bias) r["ddt_bias"] = to_numpy(*g.ddt_bias);
}

template <class S>
void put_outputs(py::dict& r, const kda::Outputs<S>& out) {
  r["o"] = to_numpy(out.o);
  if (out.final_state) r["final_state"] = to_numpy(*out.final_state);
  if (out.all_states) r["all_states"] = to_numpy(*out.all_states);
}

void register_kda_forward(py::module_& m);
void register_kda_backward(py::module_& m);
void register_kda_contract(py::module_& m);
void register_kcp(py::module_& m);
void register_attnres_qb(py::module_& m);
void register_readers(py::module_& m);
void register_cost(py::module_& m);
void register_check(py::module_& m);
void register_k3gc(py::module_& m);

}  // namespace k3ref::python
