// k3ref._core: the cost models (k3ref/cost/models.h) for k3ref.cost: decode and FlashKDA
// prefill FLOPs and bytes per head, the MoE communication-to-computation ratio, uniform and
// from a counted dispatch.
#include "k3ref/cost/models.h"
#include "core.h"

namespace k3ref::python {
namespace {

py::dict work(const cost::Work<double>& w) {
  py::dict r;
  r["flops"] = w.flops;
  r["bytes"] = w.bytes;
  return r;
}

py::dict moe_dispatch(const IndexArray& selection, std::int64_t experts, std::int64_t gpus, double bytes_per_element,
                      double flops_per_second, double bytes_per_second, std::int64_t intermediate) {
  if (selection.ndim() != 2) throw InvalidArgument("selection must be [tokens, k]");
  const std::int64_t t = selection.shape(0), k = selection.shape(1);
  Tensor<std::int32_t> sel({t, k});
  for (std::int64_t e = 0; e < t * k; ++e) sel.data()[e] = static_cast<std::int32_t>(selection.data()[e]);
  const auto c = cost::moe_dispatch(sel, experts, gpus, cost::block_sources(t, gpus));
  py::dict r;
  r["routes_in"] = c.routes_in;
  r["remote_in"] = c.remote_in;
  r["remote_out"] = c.remote_out;
  r["ratio"] = cost::moe_comm_comp_ratio(c, bytes_per_element, flops_per_second, static_cast<double>(intermediate),
                                         bytes_per_second);
  return r;
}

}  // namespace

void register_cost(py::module_& m) {
  m.def("cost_decode", [](std::int64_t D) { return work(cost::decode_per_head<double>(D)); }, py::arg("head_dim"));
  m.def("cost_prefill", [](std::int64_t T, std::int64_t C, std::int64_t D, std::int64_t kernels) {
        py::dict r;
        r["per_chunk"] = work(cost::flashkda_chunk_per_head<double>(C, D));
        r["per_head"] = work(cost::flashkda_prefill_per_head<double>(T, C, D, kernels));
        return r;
      }, py::arg("tokens"), py::arg("chunk"), py::arg("head_dim"), py::arg("kernels"));
  m.def("cost_moe_uniform", &cost::moe_comm_comp_ratio_uniform<double>, py::arg("bytes_per_element"),
        py::arg("flops_per_second"), py::arg("intermediate"), py::arg("bytes_per_second"), py::arg("gpus"));
  m.def("cost_moe_dispatch", &moe_dispatch, py::arg("selection"), py::arg("experts"), py::arg("gpus"),
        py::arg("bytes_per_element"), py::arg("flops_per_second"), py::arg("bytes_per_second"), py::arg("intermediate"));
}

}  // namespace k3ref::python
