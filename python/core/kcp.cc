// k3ref._core: context-parallel KDA (kcp/), the simulated run of P ranks: per-rank fragments
// (transition M, state S~), the merged entering states, the gathered outputs; and its backward.
// Per-rank tensors are stacked into [P, ...] as in the kcp.context_parallel goldens.
#include "k3ref/kda/recurrent.h"
#include "k3ref/kcp/backward.h"
#include "k3ref/kcp/context_parallel.h"
#include "core.h"

#include <type_traits>

namespace k3ref::python {
namespace {

py::dict kcp_forward(const py::dict& inputs, const py::dict& options, const std::vector<std::int64_t>& splits,
                     const std::string& merge, const std::string& precision, double progress_after) {
  const kda::Inputs<double> in = kda_inputs(inputs);
  const kcp::Merge how = kcp::merges.parse(merge);
  return in_tier(precision, [&]<class S>() {
    const kda::Options<S> opt = kda_options<S>(options);
    exec::ProgressLines progress =
        kda::token_head_progress("k3ref.kcp_forward", in, kda_options<double>(options), !std::is_same_v<S, double>,
                                 kda::RelativeCost::kcp_forward, progress_after, python_stderr_line);
    const kcp::ContextParallelResult<S> cp =
        with_progress(progress, true, [&] { return kcp::context_parallel_forward(kda::lift<S>(in), opt, splits, how); });
    py::dict r;
    put_outputs(r, cp.out);
    std::vector<Tensor<S>> transitions, states;
    std::vector<std::int64_t> origin;
    for (const auto& f : cp.fragments) {
      transitions.push_back(f.transition);
      states.push_back(f.state);
    }
    for (const auto& s : cp.plan.ranks) origin.push_back(s.origin_rank);
    r["fragment_transition"] = to_numpy(stack(transitions));
    r["fragment_state"] = to_numpy(stack(states));
    r["entering_state"] = to_numpy(stack(cp.entering_states));
    r["origin_rank"] = to_numpy(Tensor<std::int64_t>({static_cast<std::int64_t>(origin.size())}, origin));
    return r;
  });
}

py::dict kcp_backward(const py::dict& inputs, const py::dict& cotangents, const py::dict& options,
                      const std::vector<std::int64_t>& splits, const std::string& merge,
                      const std::string& precision, double progress_after) {
  const kda::Inputs<double> in = kda_inputs(inputs);
  const kcp::Merge how = kcp::merges.parse(merge);
  return in_tier(precision, [&]<class S>() {
    const kda::Options<S> opt = kda_options<S>(options);
    const kda::Cotangents<S> cot = kda_cotangents<S>(cotangents);
    exec::ProgressLines progress =
        kda::token_head_progress("k3ref.kcp_backward", in, kda_options<double>(options), !std::is_same_v<S, double>,
                                 kda::RelativeCost::kcp_backward, progress_after, python_stderr_line);
    const kcp::ContextParallelBackwardResult<S> res = with_progress(
        progress, true, [&] { return kcp::context_parallel_backward(kda::lift<S>(in), opt, splits, cot, how); });
    py::dict r;
    put_gradients(r, res.gradients);
    r["cp_entering_states"] = to_numpy(stack(res.entering_states));
    r["cp_entering_state_gradients"] = to_numpy(stack(res.state.entering_gradients));
    return r;
  });
}

}  // namespace

void register_kcp(py::module_& m) {
  m.def("kcp_forward", &kcp_forward, py::arg("inputs"), py::arg("options"), py::arg("splits"), py::arg("merge"),
        py::arg("precision"), py::arg("progress_after"));
  m.def("kcp_backward", &kcp_backward, py::arg("inputs"), py::arg("cotangents"), py::arg("options"),
        py::arg("splits"), py::arg("merge"), py::arg("precision"), py::arg("progress_after"));
}

}  // namespace k3ref::python
