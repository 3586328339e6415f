#include "k3ref/tensor/tensor.h"

namespace k3ref {

std::string shape_to_string(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::int64_t checked_numel(const Shape& shape, const std::string& what) {
  std::int64_t n = 1;
  for (std::int64_t e : shape) {
    if (e < 0) throw InvalidArgument(what + ": negative extent in shape " + shape_to_string(shape));
    if (e != 0 && n > std::numeric_limits<std::int64_t>::max() / e)
      throw InvalidArgument(what + ": element count of shape " + shape_to_string(shape) + " overflows 63 bits");
    n *= e;
  }
  return n;
}

}  // namespace k3ref
