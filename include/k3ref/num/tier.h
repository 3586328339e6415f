// The arithmetic tiers a reference is instantiated in, by their one name each: the name the
// `k3ref kda --precision` option and the Python module's precision= take, and the
// description the goldens record as their reference precision (k3ref.reference_precision).
#pragma once

#include "k3ref/num/scalar.h"
#include "k3ref/vocabulary.h"

namespace k3ref::num {

enum class Tier {
  double_,   // IEEE binary64
  mp256,     // golden_float: num::golden_bits-bit binary floats, the goldens' tier
  rational,  // exact rationals (no transcendentals: decays given as factors, scale explicit)
};

// `about` is the text the goldens' manifests and metadata record for the tier.
inline constexpr Choices<Tier, 3> tiers{"precision",
                                        {{{Tier::double_, "double", "IEEE binary64"},
                                          {Tier::mp256, "mp256", "256-bit binary float"},
                                          {Tier::rational, "rational", "exact rational"}}}};
static_assert(golden_bits == 256, "the name and description of Tier::mp256 state the goldens' 256 bits");

// The tiers the references' precision option offers (the command line and the Python module):
// the rational tier needs inputs built for it, so it is the C++ templates' alone.
inline constexpr Choices<Tier, 2> precision_tiers{"precision", {{tiers.values[0], tiers.values[1]}}};

inline std::string_view to_string(Tier t) { return tiers.name(t); }
// The reference precision a golden computed in tier t records.
inline std::string_view description(Tier t) {
  for (const auto& c : tiers.values)
    if (c.value == t) return c.about;
  return "?";
}

}  // namespace k3ref::num
