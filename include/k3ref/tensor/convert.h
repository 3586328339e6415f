// Tensors in their stored form (RawTensor: dtype, shape, little-endian element bytes) and
// the exact conversion of their elements to and from doubles and int64. The containers
// (io/safetensors.h) move RawTensors as bytes; every decode and encode of an element is here.
//
// Namespace k3ref::io: RawTensor and these functions keep the names their callers across
// the tree (the golden generators, the command, the KDA file layer) already use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "k3ref/tensor/dtype.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::io {

// One stored tensor, bytes exactly as in the file (little-endian elements, row-major).
struct RawTensor {
  DType dtype = DType::F64;
  Shape shape;
  std::vector<std::uint8_t> bytes;

  friend bool operator==(const RawTensor&, const RawTensor&) = default;
};

// The element count of `raw` after checking that its byte count is exactly shape x dtype
// size; InvalidArgument naming `what` otherwise (or on a shape checked_numel refuses).
std::size_t checked_element_count(const RawTensor& raw, const std::string& what);

// Element values as doubles, exactly: float dtypes are decoded, integer dtypes must be
// exactly representable (an I64 beyond 2^53 that a double cannot hold throws), BOOL
// bytes must be 0 or 1. Throws InvalidArgument naming `what` otherwise, or when the byte
// count does not match shape x dtype.
Tensor<double> to_f64(const RawTensor& raw, const std::string& what);

// Stores doubles as `dtype`. Narrower float dtypes round to nearest, ties to even.
// Integer and BOOL dtypes require every value to be integral and in range (BOOL: 0 or 1),
// else InvalidArgument naming the element.
RawTensor from_f64(const Tensor<double>& values, DType dtype);

// Element values as int64, exactly: float dtypes must hold integral values in range.
Tensor<std::int64_t> to_i64(const RawTensor& raw, const std::string& what);

// Stores int64 values as `dtype`. Integer and BOOL dtypes require the value in range;
// float dtypes require it to be exactly a double (|v| <= 2^53 or suitably even) so that
// only one rounding, to the target format, takes place.
RawTensor from_i64(const Tensor<std::int64_t>& values, DType dtype);

}  // namespace k3ref::io
