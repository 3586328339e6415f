// The registry of the options vocabulary (k3ref/vocabulary.h): each option's table lives
// beside its enum; this lists them, with the defaults of the option structs, for the
// command line and the Python module.
#include "k3ref/vocabulary.h"

#include "k3ref/error.h"
#include "k3ref/kcp/context_parallel.h"
#include "k3ref/kda/chunkwise.h"
#include "k3ref/kda/kernel_contracts.h"
#include "k3ref/kda/options.h"
#include "k3ref/num/tier.h"

namespace k3ref {

std::string not_one_of(const std::vector<std::string_view>& names, std::string_view got) {
  std::string r = "must be one of ";
  for (std::size_t i = 0; i < names.size(); ++i) (r += i ? ", " : "") += names[i];
  return r + ", not '" + std::string(got) + "'";
}

void throw_not_one_of(std::string_view option, const std::vector<std::string_view>& names, std::string_view got) {
  throw InvalidArgument("option '" + std::string(option) + "' " + not_one_of(names, got));
}

std::vector<std::string_view> OptionVocabulary::names() const {
  std::vector<std::string_view> r;
  for (const auto& c : values) r.push_back(c.name);
  return r;
}

bool OptionVocabulary::contains(std::string_view name) const {
  for (const auto& c : values)
    if (c.name == name) return true;
  return false;
}

std::string OptionVocabulary::help() const {
  std::string r;
  for (const auto& c : values) {
    (r += r.empty() ? "" : " | ") += c.name;
    if (!c.about.empty()) ((r += " (") += c.about) += ")";
  }
  return r;
}

const std::vector<OptionVocabulary>& option_vocabulary() {
  using V = OptionVocabulary;
  static const std::vector<V> all = [] {
    const kda::Options<double> kda_defaults;
    return std::vector<V>{
        V::of(kda::gate_forms, std::optional(kda_defaults.gate)),
        V::of(kda::gate_bases, std::optional(kda_defaults.gate_base)),
        V::of(kda::beta_forms, std::optional(kda_defaults.beta)),
        V::of(kda::state_layouts, std::optional(kda_defaults.state_layout)),
        V::of(num::precision_tiers, std::optional(num::Tier::double_)),
        V::of(kda::chunk_forms, std::optional(kda::ChunkwiseOptions{}.form)),
        V::of(kda::backward_methods, std::optional(kda::BackwardMethod::adjoint)),
        V::of(kcp::merges, std::optional(kcp::Merge::origin_rank)),
        V::of(kda::contract::kernels, std::optional<kda::contract::Kernel>()),
    };
  }();
  return all;
}

const OptionVocabulary& option_vocabulary(std::string_view option) {
  std::vector<std::string_view> known;
  for (const auto& v : option_vocabulary()) {
    if (v.option == option) return v;
    known.push_back(v.option);
  }
  throw InvalidArgument("option_vocabulary: argument 'option' " + not_one_of(known, option));
}

}  // namespace k3ref
