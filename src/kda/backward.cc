// Scalar-free validation of the KDA backward's upstream gradients.
#include "k3ref/kda/backward.h"

namespace k3ref::kda {

void validate_cotangents(const Dims& d, const Shape& d_o, const std::optional<Shape>& d_final_state,
                         StateLayout layout) {
  const Shape want_o{d.B, d.T, d.HV, d.V};
  if (d_o != want_o)
    throw InvalidArgument("kda backward: argument 'd_o': expected " + shape_to_string(want_o) + " (the shape of o), got " +
                          shape_to_string(d_o));
  if (d_final_state) {
    const Shape want = layout == StateLayout::k_first ? Shape{d.N, d.HV, d.K, d.V} : Shape{d.N, d.HV, d.V, d.K};
    if (*d_final_state != want)
      throw InvalidArgument("kda backward: argument 'd_final_state': expected " + shape_to_string(want) + " (" +
                            std::string(to_string(layout)) + " layout, N = " + std::to_string(d.N) + " sequences), got " +
                            shape_to_string(*d_final_state));
  }
}

}  // namespace k3ref::kda
