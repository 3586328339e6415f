// k3ref._core: the precision contracts of real KDA kernels (kda/kernel_contracts.h),
// evaluated on the inputs a kernel received.
#include "k3ref/kda/kernel_contracts.h"
#include "k3ref/kda/recurrent.h"
#include <map>

#include "core.h"

namespace k3ref::python {
namespace {

py::dict kda_contract(const py::dict& inputs, const py::dict& options, const std::string& contract, bool exact,
                      const std::map<std::string, std::string>& sites, double progress_after) {
  const kda::Inputs<double> in = kda_inputs(inputs);
  const kda::contract::Kernel kernel = kda::contract::kernels.parse(contract);
  kda::contract::KernelContract c =
      exact ? kda::contract::exact_contract(kernel) : kda::contract::kernel_contract(kernel);
  for (const auto& [name, precision] : sites) {
    const auto site = kda::contract::site_from_string(name);
    if (!site) throw InvalidArgument("option 'sites': unknown rounding site '" + name + "'");
    const auto p = kda::contract::precisions.find(precision);
    if (!p)
      throw InvalidArgument("option 'sites': site '" + name + "': precision " +
                            not_one_of(kda::contract::precisions.names(), precision));
    c.set(*site, *p);
  }
  const kda::Options<double> opt = kda_options<double>(options);
  exec::ProgressLines progress = kda::token_head_progress("k3ref.kda_contract", in, opt, false,
                                                          kda::RelativeCost::contract, progress_after, python_stderr_line);
  const kda::Outputs<double> out =
      with_progress(progress, true, [&] { return kda::contract::evaluate_contract(c, in, opt); });
  py::dict r;
  put_outputs(r, out);
  return r;
}

py::dict kda_contract_sites(const std::string& contract) {
  const kda::contract::KernelContract c = kda::contract::kernel_contract(kda::contract::kernels.parse(contract));
  py::dict r;
  for (std::size_t s = 0; s < kda::contract::site_count; ++s) {
    const auto site = static_cast<kda::contract::Site>(s);
    r[py::str(std::string(kda::contract::to_string(site)))] = std::string(kda::contract::to_string(c[site]));
  }
  return r;
}

}  // namespace

void register_kda_contract(py::module_& m) {
  m.def("kda_contract", &kda_contract, py::arg("inputs"), py::arg("options"), py::arg("contract"), py::arg("exact"),
        py::arg("sites"), py::arg("progress_after"));
  m.def("kda_contract_sites", &kda_contract_sites, py::arg("contract"));
}

}  // namespace k3ref::python
