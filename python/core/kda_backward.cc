// k3ref._core: KDA gradients, by the adjoint recurrence (kda/backward.h) and by the chunkwise
// backward with its stage tensors (kda/chunkwise_backward.h; the names of the kda.backward goldens).
#include "k3ref/kda/recurrent.h"
#include "k3ref/kda/backward.h"
#include "k3ref/kda/chunkwise_backward.h"
#include "core.h"

#include <type_traits>

namespace k3ref::python {
namespace {

py::dict kda_backward(const py::dict& inputs, const py::dict& cotangents, const py::dict& options,
                      const std::string& method, std::int64_t chunk_size, const std::string& precision,
                      double progress_after) {
  const kda::Inputs<double> in = kda_inputs(inputs);
  const kda::BackwardMethod how = kda::backward_methods.parse(method);
  return in_tier(precision, [&]<class S>() {
    const kda::Options<S> opt = kda_options<S>(options);
    const kda::Cotangents<S> cot = kda_cotangents<S>(cotangents);
    const bool adjoint = how == kda::BackwardMethod::adjoint;
    exec::ProgressLines progress = kda::token_head_progress(
        "k3ref.kda_backward", in, kda_options<double>(options), !std::is_same_v<S, double>,
        adjoint ? kda::RelativeCost::backward_adjoint : kda::RelativeCost::backward_chunkwise, progress_after,
        python_stderr_line);
    py::dict r;
    if (adjoint) {
      put_gradients(r, with_progress(progress, true, [&] { return kda::recurrent_backward(kda::lift<S>(in), opt, cot); }));
    } else {
      const kda::ChunkwiseBackwardResult<S> res =
          with_progress(progress, true, [&] { return kda::chunkwise_backward(kda::lift<S>(in), opt, cot, chunk_size); });
      put_gradients(r, res.gradients);
      r["chunk_states"] = to_numpy(res.stages.chunk_states);
      r["chunk_state_gradients"] = to_numpy(res.stages.chunk_state_gradients);
      r["du"] = to_numpy(res.stages.du);
      r["dg_cumulative"] = to_numpy(res.stages.dg_cumulative);
      r["chunk_starts"] = to_numpy(res.stages.chunk_starts);
    }
    return r;
  });
}

}  // namespace

void register_kda_backward(py::module_& m) {
  m.def("kda_backward", &kda_backward, py::arg("inputs"), py::arg("cotangents"), py::arg("options"),
        py::arg("method"), py::arg("chunk_size"), py::arg("precision"), py::arg("progress_after"));
}

}  // namespace k3ref::python
