// The options vocabulary: every option whose value is one name of a fixed list (a gate
// form, a state layout, an arithmetic tier, ...), as one table per option beside its enum.
// The table is the only place that spells the names: to_string / find / parse, the
// `k3ref` command's choices and help, the Python module's parsing and name tuples
// (k3ref._core.option_vocabulary()), and the names the golden catalogue writes into its
// parameters and manifest all read it. The registry of all of them is option_vocabulary().
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace k3ref {

// One allowed value: the enumerator, its one name, and what it means (for help texts).
template <class E>
struct Choice {
  E value;
  std::string_view name;
  std::string_view about;
};

// "must be one of a, b, c, not 'x'": the one-line complaint about a value not in `names`.
std::string not_one_of(const std::vector<std::string_view>& names, std::string_view got);
// Throws InvalidArgument("option '<option>' must be one of ..., not '<got>'").
[[noreturn]] void throw_not_one_of(std::string_view option, const std::vector<std::string_view>& names,
                                   std::string_view got);

// The values of one option, in the order help texts list them.
template <class E, std::size_t N>
struct Choices {
  std::string_view option;  // as the command line (--option, '_' written '-') and Python (option=) spell it
  std::array<Choice<E>, N> values;

  constexpr std::string_view name(E value) const {
    for (const auto& c : values)
      if (c.value == value) return c.name;
    return "?";  // only for a value cast from an integer outside the enum
  }
  constexpr std::optional<E> find(std::string_view name) const {
    for (const auto& c : values)
      if (c.name == name) return c.value;
    return std::nullopt;
  }
  std::vector<std::string_view> names() const {
    std::vector<std::string_view> r;
    for (const auto& c : values) r.push_back(c.name);
    return r;
  }
  // The value named `name`, or InvalidArgument naming the option and listing the names.
  E parse(std::string_view name) const {
    if (auto v = find(name)) return *v;
    throw_not_one_of(option, names(), name);
  }
};

// One option of the registry, its enum erased: what the command line and the Python module
// need to offer, document and check it.
struct OptionVocabulary {
  std::string_view option;
  std::vector<Choice<std::string_view>> values;  // value == name
  std::string_view default_name;                 // empty: the option has no default (required)

  template <class E, std::size_t N>
  static OptionVocabulary of(const Choices<E, N>& c, std::optional<E> default_value) {
    OptionVocabulary v{c.option, {}, default_value ? c.name(*default_value) : std::string_view()};
    for (const auto& x : c.values) v.values.push_back({x.name, x.name, x.about});
    return v;
  }
  std::vector<std::string_view> names() const;
  bool contains(std::string_view name) const;
  // "a | b (what b means) | c": the help text of the option.
  std::string help() const;
};

// Every named-value option of the references, in the order of the `k3ref kda` command and
// the Python module: gate, gate_base, beta, state_layout, precision, chunk_form, method,
// merge, contract.
const std::vector<OptionVocabulary>& option_vocabulary();
// One of them; InvalidArgument for an option that is not in the registry.
const OptionVocabulary& option_vocabulary(std::string_view option);

}  // namespace k3ref
