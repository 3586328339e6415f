// Kernel domains (policy/kernel_domains.json, docs/kernel-domains.md): for each built-in
// kernel, the golden operators, head sizes, GVA ratios, gates, beta forms, layouts, varlen,
// initial state and input dtypes it accepts. The same file is read by the harness
// (python/k3ref/kernel_domains.py), which judges a kernel on the goldens inside its domain;
// both readers give a case the same verdict and the same reason.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace k3ref::io {

inline constexpr int kernel_domains_version = 1;

// A set of numbers: the listed values (`in`), or the interval the bounds leave (min <= x,
// above < x, x <= max, x < below); a bound left out is no bound.
struct DomainRange {
  std::vector<double> in;
  std::optional<double> min, max, above, below;
  bool holds(double x) const;
  // "K = 128", "K in {64, 128}", "K <= 256", "lower_bound in [-5, 0)".
  std::string text(const std::string& label) const;
};

// One gate form a kernel takes: the bases it exponentiates in (empty: any), the range of
// lower_bound (lower-bound gate), whether it needs A_log (true), refuses it (false) or either.
struct GateDomain {
  std::string form;
  std::vector<std::string> bases;
  std::optional<DomainRange> lower_bound;
  std::optional<bool> A_log;
};

// What one kernel accepts; nullopt (a key left out of the file) accepts everything.
struct KernelDomain {
  std::string name, about;
  std::optional<std::vector<std::string>> ops;
  std::map<std::string, DomainRange> sizes;  // B, T, H, HV, K, V, gva_ratio (HV / H)
  std::optional<bool> varlen;                // false: no cu_seqlens
  std::optional<std::vector<bool>> initial_state, qk_l2norm;
  std::optional<std::vector<GateDomain>> gates;
  std::optional<std::vector<std::string>> betas, state_layouts, input_dtypes;

  // nullopt when a case of operator `op` with KDA parameters `params` (docs/golden-format.md)
  // and inputs in `input_dtype` is inside the domain, else why not, in one line. A parameter
  // the case does not have constrains nothing.
  std::optional<std::string> outside(const std::string& op, const nlohmann::json& params,
                                     const std::string& input_dtype) const;
};

struct KernelDomains {
  std::vector<KernelDomain> kernels;  // sorted by name
  const KernelDomain* find(const std::string& name) const;
  std::vector<std::string> names() const;

  // Checks the whole file (the project's JSON rules, io/json_rules.h; every key known, every
  // value of its type); a broken file throws InvalidArgument naming `origin` and the entry.
  static KernelDomains parse(const std::string& json_text, const std::string& origin);
  // The copy of policy/kernel_domains.json compiled into the library.
  static const KernelDomains& builtin();
};

}  // namespace k3ref::io
