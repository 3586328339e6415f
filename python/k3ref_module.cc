// The Python module of k3ref (pybind11): the references, callable in-process from the
// gpu_check harness and its property tests. Arrays in and out are NumPy float64 (the
// golden files' storage converts to float64 exactly); the precision of the arithmetic is
// chosen per call: "double", or "high" (num::golden_float, the goldens' 256 bits, rounded
// once to double on the way out).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "k3ref/attnres/attnres.h"
#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/kda/recurrent.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/scalar.h"
#include "k3ref/qb/solver.h"

namespace py = pybind11;
using namespace k3ref;

namespace {

using Array = py::array_t<double, py::array::c_style | py::array::forcecast>;
using IndexArray = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;
using High = num::golden_float;

Tensor<double> to_tensor(const Array& a) {
  Shape shape(a.shape(), a.shape() + a.ndim());
  std::vector<double> data(a.data(), a.data() + a.size());
  return Tensor<double>(std::move(shape), std::move(data));
}

std::optional<Tensor<double>> to_tensor(const std::optional<Array>& a) {
  return a ? std::optional<Tensor<double>>(to_tensor(*a)) : std::nullopt;
}

template <class S>
py::array_t<double> to_numpy(const Tensor<S>& t) {
  py::array_t<double> out(std::vector<py::ssize_t>(t.shape().begin(), t.shape().end()));
  double* dst = out.mutable_data();
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    if constexpr (std::is_same_v<S, double>)
      dst[i] = t.data()[i];
    else
      dst[i] = num::to_double_rne(t.data()[i]);  // one rounding, to nearest
  }
  return out;
}

template <class S>
Tensor<S> lift(const Tensor<double>& t) {
  return t.map<S>([](double x) { return S(x); });
}

// Which arithmetic; a single place turns the user's string into a tier.
enum class Tier { double_, high };
Tier tier_of(const std::string& precision) {
  if (precision == "double") return Tier::double_;
  if (precision == "high") return Tier::high;
  throw py::value_error("precision must be 'double' or 'high' (256-bit), not '" + precision + "'");
}

// ---- KDA -------------------------------------------------------------------------------

struct KdaCall {
  kda::Inputs<double> in;
  std::optional<double> scale, lower_bound;
  bool qk_l2norm = false;
  std::string gate = "log_decay", gate_base = "e", beta = "as_given", state_layout = "k_first";
  bool output_final_state = true, output_all_states = false;
  int num_threads = 1;
};

template <class E>
E parse(std::optional<E> (*from)(std::string_view), const std::string& value, const char* what) {
  auto v = from(value);
  if (!v) throw py::value_error(std::string("unknown ") + what + " '" + value + "'");
  return *v;
}

template <class S>
kda::Options<S> options_of(const KdaCall& c) {
  kda::Options<S> opt;
  if (c.scale) opt.scale = S(*c.scale);
  if (c.lower_bound) opt.lower_bound = S(*c.lower_bound);
  opt.qk_l2norm = c.qk_l2norm;
  opt.gate = parse(kda::gate_form_from_string, c.gate, "gate");
  opt.gate_base = parse(kda::gate_base_from_string, c.gate_base, "gate_base");
  opt.beta = parse(kda::beta_form_from_string, c.beta, "beta");
  opt.state_layout = parse(kda::state_layout_from_string, c.state_layout, "state_layout");
  opt.output_final_state = c.output_final_state;
  opt.output_all_states = c.output_all_states;
  opt.num_threads = c.num_threads;
  return opt;
}

template <class S>
py::dict outputs_dict(const kda::Outputs<S>& out) {
  py::dict d;
  d["o"] = to_numpy(out.o);
  if (out.final_state) d["final_state"] = to_numpy(*out.final_state);
  if (out.all_states) d["all_states"] = to_numpy(*out.all_states);
  return d;
}

template <class S>
py::dict recurrent(const KdaCall& c) {
  kda::Outputs<S> out;
  {
    py::gil_scoped_release release;
    out = kda::recurrent_forward(kda::lift<S>(c.in), options_of<S>(c));
  }
  return outputs_dict(out);
}

template <class S>
py::dict chunkwise(const KdaCall& c, const kda::ChunkwiseOptions& copt) {
  kda::ChunkwiseOutputs<S> out;
  {
    py::gil_scoped_release release;
    out = kda::chunkwise_forward(kda::lift<S>(c.in), options_of<S>(c), copt);
  }
  return outputs_dict(out.out);
}

KdaCall kda_call(const Array& q, const Array& k, const Array& v, const Array& g, const Array& beta,
                 const std::optional<Array>& initial_state, const std::optional<Array>& A_log,
                 const std::optional<Array>& dt_bias, const std::optional<IndexArray>& cu_seqlens,
                 std::optional<double> scale, bool qk_l2norm, const std::string& gate, const std::string& gate_base,
                 std::optional<double> lower_bound, const std::string& beta_mode, const std::string& state_layout,
                 bool output_final_state, bool output_all_states, int num_threads) {
  KdaCall c;
  c.in.q = to_tensor(q);
  c.in.k = to_tensor(k);
  c.in.v = to_tensor(v);
  c.in.g = to_tensor(g);
  c.in.beta = to_tensor(beta);
  c.in.initial_state = to_tensor(initial_state);
  c.in.A_log = to_tensor(A_log);
  c.in.dt_bias = to_tensor(dt_bias);
  if (cu_seqlens) {
    if (cu_seqlens->ndim() != 1) throw py::value_error("cu_seqlens must be one-dimensional");
    c.in.cu_seqlens = std::vector<std::int64_t>(cu_seqlens->data(), cu_seqlens->data() + cu_seqlens->size());
  }
  c.scale = scale;
  c.qk_l2norm = qk_l2norm;
  c.gate = gate;
  c.gate_base = gate_base;
  c.lower_bound = lower_bound;
  c.beta = beta_mode;
  c.state_layout = state_layout;
  c.output_final_state = output_final_state;
  c.output_all_states = output_all_states;
  c.num_threads = num_threads;
  return c;
}

// ---- AttnRes ---------------------------------------------------------------------------

template <class S>
py::dict attnres_dict(const attnres::Outputs<S>& out) {
  py::dict d;
  d["h"] = to_numpy(out.h);
  d["alpha"] = to_numpy(out.alpha);
  if (out.block_sums) d["block_sums"] = to_numpy(*out.block_sums);
  if (out.phase1_output) d["phase1_output"] = to_numpy(*out.phase1_output);
  if (out.phase1_max) d["phase1_max"] = to_numpy(*out.phase1_max);
  if (out.phase1_sum) d["phase1_sum"] = to_numpy(*out.phase1_sum);
  return d;
}

template <class S>
py::dict attnres_run(const Array& values, const Array& queries, const Array& norm_weights, double eps,
                     std::optional<std::int64_t> block_size, bool two_phase) {
  attnres::Weights<S> w{lift<S>(to_tensor(queries)), lift<S>(to_tensor(norm_weights)), S(eps)};
  const Tensor<S> vals = lift<S>(to_tensor(values));
  attnres::Outputs<S> out;
  {
    py::gil_scoped_release release;
    out = block_size ? attnres::block_forward(w, vals, *block_size,
                                              two_phase ? attnres::BlockForm::two_phase : attnres::BlockForm::direct)
                     : attnres::full_forward(w, vals);
  }
  return attnres_dict(out);
}

// ---- QB --------------------------------------------------------------------------------

py::dict qb_solver(const Array& scores, std::int64_t k, int iterations, const std::optional<Array>& beta0) {
  const Tensor<double> s = to_tensor(scores);
  std::vector<double> b0;
  if (beta0) b0.assign(beta0->data(), beta0->data() + beta0->size());
  std::vector<qb::Iterate<double>> trace;
  {
    py::gil_scoped_release release;
    trace = qb::alternating_solver(s, k, iterations, b0);
  }
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
  py::dict d;
  d["alpha"] = alpha;
  d["beta"] = beta;
  d["selection"] = selection;
  d["loads"] = loads;
  return d;
}

}  // namespace

PYBIND11_MODULE(k3ref, m) {
  m.doc() = "k3ref references (KDA recurrent and chunkwise, AttnRes, Quantile Balancing) on NumPy float64 arrays";
  m.attr("high_precision_backend") = num::high_precision_backend;
  m.attr("high_precision_bits") = num::golden_bits;

  py::register_exception<InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);

  m.def(
      "kda_recurrent",
      [](const Array& q, const Array& k, const Array& v, const Array& g, const Array& beta,
         const std::optional<Array>& initial_state, const std::optional<Array>& A_log,
         const std::optional<Array>& dt_bias, const std::optional<IndexArray>& cu_seqlens,
         std::optional<double> scale, bool qk_l2norm, const std::string& gate, const std::string& gate_base,
         std::optional<double> lower_bound, const std::string& beta_mode, const std::string& state_layout,
         bool output_final_state, bool output_all_states, int num_threads, const std::string& precision) {
        const KdaCall c = kda_call(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, scale, qk_l2norm,
                                   gate, gate_base, lower_bound, beta_mode, state_layout, output_final_state,
                                   output_all_states, num_threads);
        return tier_of(precision) == Tier::high ? recurrent<High>(c) : recurrent<double>(c);
      },
      "The KDA recurrence (kda::recurrent_forward): returns a dict with o, final_state, all_states.",
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::kw_only(),
      py::arg("initial_state") = py::none(), py::arg("A_log") = py::none(), py::arg("dt_bias") = py::none(),
      py::arg("cu_seqlens") = py::none(), py::arg("scale") = py::none(), py::arg("qk_l2norm") = false,
      py::arg("gate") = "log_decay", py::arg("gate_base") = "e", py::arg("lower_bound") = py::none(),
      py::arg("beta_mode") = "as_given", py::arg("state_layout") = "k_first", py::arg("output_final_state") = true,
      py::arg("output_all_states") = false, py::arg("num_threads") = 1, py::arg("precision") = "double");

  m.def(
      "kda_chunkwise",
      [](const Array& q, const Array& k, const Array& v, const Array& g, const Array& beta,
         const std::optional<Array>& initial_state, const std::optional<Array>& A_log,
         const std::optional<Array>& dt_bias, const std::optional<IndexArray>& cu_seqlens,
         std::optional<double> scale, bool qk_l2norm, const std::string& gate, const std::string& gate_base,
         std::optional<double> lower_bound, const std::string& beta_mode, const std::string& state_layout,
         const std::string& form, std::int64_t chunk_size, const std::string& precision) {
        const KdaCall c = kda_call(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, scale, qk_l2norm,
                                   gate, gate_base, lower_bound, beta_mode, state_layout, true, false, 1);
        kda::ChunkwiseOptions copt;
        copt.form = parse(kda::chunk_form_from_string, form, "chunk form");
        copt.chunk_size = chunk_size;
        return tier_of(precision) == Tier::high ? chunkwise<High>(c, copt) : chunkwise<double>(c, copt);
      },
      "The chunkwise (UT transform) KDA forward in exact arithmetic policy: returns o, final_state.",
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::kw_only(),
      py::arg("initial_state") = py::none(), py::arg("A_log") = py::none(), py::arg("dt_bias") = py::none(),
      py::arg("cu_seqlens") = py::none(), py::arg("scale") = py::none(), py::arg("qk_l2norm") = false,
      py::arg("gate") = "log_decay", py::arg("gate_base") = "e", py::arg("lower_bound") = py::none(),
      py::arg("beta_mode") = "as_given", py::arg("state_layout") = "k_first", py::arg("form") = "flashkda",
      py::arg("chunk_size") = 0, py::arg("precision") = "double");

  m.def(
      "attnres",
      [](const Array& values, const Array& queries, const Array& norm_weights, double eps,
         std::optional<std::int64_t> block_size, bool two_phase, const std::string& precision) {
        return tier_of(precision) == Tier::high
                   ? attnres_run<High>(values, queries, norm_weights, eps, block_size, two_phase)
                   : attnres_run<double>(values, queries, norm_weights, eps, block_size, two_phase);
      },
      "AttnRes with teacher forcing: values [L+1, T, d], queries and norm_weights [L+1, d]. block_size None: full "
      "AttnRes; otherwise block AttnRes (two_phase: the two-phase inference form). Returns h, alpha, and for "
      "blocks block_sums (and phase1_output, phase1_max, phase1_sum for two_phase).",
      py::arg("values"), py::arg("queries"), py::arg("norm_weights"), py::kw_only(), py::arg("eps") = 1e-6,
      py::arg("block_size") = py::none(), py::arg("two_phase") = false, py::arg("precision") = "double");

  m.def("qb_solver", &qb_solver,
        "The Quantile Balancing alternating solver in double (exact on dyadic scores, docs/qb.md): returns alpha "
        "[T, m], beta [T, n], selection [T, m, k] (int32, best first, k3ref's tie rule), loads [T, n].",
        py::arg("scores"), py::arg("k"), py::arg("iterations"), py::kw_only(), py::arg("beta0") = py::none());
}
