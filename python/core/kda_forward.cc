// k3ref._core: the KDA forward, by the recurrence and by the chunkwise forms with their
// per-stage tensors (the names of the kda.chunkwise_* goldens).
#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/recurrent.h"
#include "core.h"

#include <type_traits>

namespace k3ref::python {
namespace {

py::dict kda_recurrent(const py::dict& inputs, const py::dict& options, const std::string& precision,
                       double progress_after) {
  const kda::Inputs<double> in = kda_inputs(inputs);
  return in_tier(precision, [&]<class S>() {
    kda::Options<S> opt = kda_options<S>(options);
    exec::ProgressLines progress = kda::recurrent_progress("k3ref.kda", in, kda_options<double>(options),
                                                           !std::is_same_v<S, double>, progress_after,
                                                           python_stderr_line);
    opt.progress = progress.hook();
    const kda::Outputs<S> out = with_progress(progress, false, [&] { return kda::recurrent_forward(kda::lift<S>(in), opt); });
    py::dict r;
    put_outputs(r, out);
    return r;
  });
}

py::dict kda_chunkwise(const py::dict& inputs, const py::dict& options, const std::string& chunk_form,
                       std::int64_t chunk_size, std::int64_t sub_chunk, bool stages, const std::string& precision,
                       double progress_after) {
  const kda::Inputs<double> in = kda_inputs(inputs);
  kda::ChunkwiseOptions copt;
  copt.form = kda::chunk_forms.parse(chunk_form);
  copt.chunk_size = chunk_size;
  copt.sub_chunk = sub_chunk;
  copt.record_stages = stages;
  return in_tier(precision, [&]<class S>() {
    const kda::Options<S> opt = kda_options<S>(options);
    exec::ProgressLines progress = kda::token_head_progress(
        "k3ref.kda_chunkwise", in, kda_options<double>(options), !std::is_same_v<S, double>,
        copt.form == kda::ChunkForm::fla ? kda::RelativeCost::chunkwise_fla : kda::RelativeCost::chunkwise_flashkda,
        progress_after, python_stderr_line);
    const kda::ChunkwiseOutputs<S> out =
        with_progress(progress, true, [&] { return kda::chunkwise_forward(kda::lift<S>(in), opt, copt); });
    py::dict r;
    put_outputs(r, out.out);
    if (out.stages) {
      const auto& st = *out.stages;
      kda::for_each_stage(st, [&](const char* name, const Tensor<S>& t) { r[name] = to_numpy(t); });
      r["chunk_starts"] = to_numpy(st.chunk_starts);
    }
    return r;
  });
}

}  // namespace

void register_kda_forward(py::module_& m) {
  m.def("kda_recurrent", &kda_recurrent, py::arg("inputs"), py::arg("options"), py::arg("precision"),
        py::arg("progress_after") = -1.0);  // default: no lines (k3ref.kda passes its own)
  // The threshold of k3ref.kda's progress lines when it names none: the command's.
  m.attr("default_progress_after") = exec::ProgressLines::default_after_seconds;
  m.def("kda_chunkwise", &kda_chunkwise, py::arg("inputs"), py::arg("options"), py::arg("chunk_form"),
        py::arg("chunk_size"), py::arg("sub_chunk"), py::arg("stages"), py::arg("precision"), py::arg("progress_after"));
}

}  // namespace k3ref::python
