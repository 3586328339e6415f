#include "k3ref/tensor/convert.h"

#include <bit>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <utility>

#include "k3ref/error.h"
#include "k3ref/num/float_format.h"

namespace k3ref::io {
namespace {

std::optional<num::Format> float_format_of(DType dtype) {
  switch (dtype) {
    case DType::F64: return num::Format::fp64;
    case DType::F32: return num::Format::fp32;
    case DType::F16: return num::Format::fp16;
    case DType::BF16: return num::Format::bf16;
    case DType::F8_E4M3: return num::Format::fp8_e4m3;
    case DType::F8_E5M2: return num::Format::fp8_e5m2;
    default: return std::nullopt;
  }
}

std::uint64_t load_element_le(const std::uint8_t* p, std::size_t element_bytes) {
  std::uint64_t v = 0;
  for (std::size_t i = element_bytes; i-- > 0;) v = v << 8 | p[i];
  return v;
}

void store_element_le(std::uint8_t* p, std::size_t element_bytes, std::uint64_t v) {
  for (std::size_t i = 0; i < element_bytes; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

// Integer element `i` of an integer or BOOL tensor, sign-extended.
std::int64_t load_integer(const RawTensor& raw, std::size_t i, const std::string& what) {
  const std::uint8_t* p = raw.bytes.data() + i * dtype_size(raw.dtype);
  switch (raw.dtype) {
    case DType::I64: return static_cast<std::int64_t>(load_element_le(p, 8));
    case DType::I32: return static_cast<std::int32_t>(static_cast<std::uint32_t>(load_element_le(p, 4)));
    case DType::U8: return *p;
    case DType::BOOL:
      if (*p > 1) throw InvalidArgument(what + ": BOOL element " + std::to_string(i) + " has byte " + std::to_string(*p) + ", not 0 or 1");
      return *p;
    default: throw InvalidArgument(what + ": " + std::string(dtype_name(raw.dtype)) + " is not an integer dtype");
  }
}

// Range of values an integer or BOOL dtype holds.
std::pair<std::int64_t, std::int64_t> integer_range(DType dtype) {
  switch (dtype) {
    case DType::I64: return {std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max()};
    case DType::I32: return {std::numeric_limits<std::int32_t>::min(), std::numeric_limits<std::int32_t>::max()};
    case DType::U8: return {0, 255};
    default: return {0, 1};  // BOOL
  }
}

// 2^63 as a double: the first double above the int64 range.
constexpr double two_to_63 = 9223372036854775808.0;

// The int64 a double holds exactly, or nullopt (fractional, NaN, infinite, out of range).
std::optional<std::int64_t> exact_int64(double x) {
  if (!(x >= -two_to_63 && x < two_to_63) || std::trunc(x) != x) return std::nullopt;
  return static_cast<std::int64_t>(x);
}

std::string format_double(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", x);
  return text;
}

}  // namespace

std::size_t checked_element_count(const RawTensor& raw, const std::string& what) {
  const std::int64_t numel = checked_numel(raw.shape, what);
  const std::size_t element_bytes = dtype_size(raw.dtype);
  if (raw.bytes.size() % element_bytes != 0 || raw.bytes.size() / element_bytes != static_cast<std::uint64_t>(numel))
    throw InvalidArgument(what + ": " + std::to_string(raw.bytes.size()) + " bytes do not hold shape " +
                          shape_to_string(raw.shape) + " of " + std::string(dtype_name(raw.dtype)));
  return static_cast<std::size_t>(numel);
}

Tensor<double> to_f64(const RawTensor& raw, const std::string& what) {
  const std::size_t count = checked_element_count(raw, what);
  std::vector<double> values(count);
  if (const auto format = float_format_of(raw.dtype)) {
    const std::size_t element_bytes = dtype_size(raw.dtype);
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t bits = load_element_le(raw.bytes.data() + i * element_bytes, element_bytes);
      values[i] = raw.dtype == DType::F64 ? std::bit_cast<double>(bits) : num::decode(*format, bits);
    }
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      const std::int64_t v = load_integer(raw, i, what);
      const double x = static_cast<double>(v);
      if (exact_int64(x) != v)
        throw InvalidArgument(what + ": " + std::string(dtype_name(raw.dtype)) + " element " + std::to_string(i) +
                              " = " + std::to_string(v) + " is not exactly representable as a double");
      values[i] = x;
    }
  }
  return Tensor<double>(raw.shape, std::move(values));
}

RawTensor from_f64(const Tensor<double>& values, DType dtype) {
  const std::size_t element_bytes = dtype_size(dtype);
  RawTensor raw{dtype, values.shape(), std::vector<std::uint8_t>(values.values().size() * element_bytes)};
  const auto format = float_format_of(dtype);
  for (std::size_t i = 0; i < values.values().size(); ++i) {
    const double x = values.values()[i];
    std::uint64_t bits;
    if (format) {
      bits = dtype == DType::F64 ? std::bit_cast<std::uint64_t>(x) : num::encode(*format, x);
    } else {
      const auto [lowest, highest] = integer_range(dtype);
      const std::optional<std::int64_t> integer = exact_int64(x);
      if (!integer || *integer < lowest || *integer > highest)
        throw InvalidArgument("from_f64: element " + std::to_string(i) + " = " + format_double(x) +
                              " is not an integer in [" + std::to_string(lowest) + ", " + std::to_string(highest) +
                              "], cannot store it as " + std::string(dtype_name(dtype)));
      bits = static_cast<std::uint64_t>(*integer);
    }
    store_element_le(raw.bytes.data() + i * element_bytes, element_bytes, bits);
  }
  return raw;
}

Tensor<std::int64_t> to_i64(const RawTensor& raw, const std::string& what) {
  const std::size_t count = checked_element_count(raw, what);
  std::vector<std::int64_t> values(count);
  if (is_floating(raw.dtype)) {
    const Tensor<double> doubles = to_f64(raw, what);
    for (std::size_t i = 0; i < count; ++i) {
      const double x = doubles.values()[i];
      const std::optional<std::int64_t> integer = exact_int64(x);
      if (!integer)
        throw InvalidArgument(what + ": " + std::string(dtype_name(raw.dtype)) + " element " + std::to_string(i) +
                              " = " + format_double(x) + " is not an integer in the int64 range");
      values[i] = *integer;
    }
  } else {
    for (std::size_t i = 0; i < count; ++i) values[i] = load_integer(raw, i, what);
  }
  return Tensor<std::int64_t>(raw.shape, std::move(values));
}

RawTensor from_i64(const Tensor<std::int64_t>& values, DType dtype) {
  if (is_floating(dtype)) {
    // Through double: exact only when the value is a double, otherwise two roundings.
    std::vector<double> doubles(values.values().size());
    for (std::size_t i = 0; i < doubles.size(); ++i) {
      const std::int64_t v = values.values()[i];
      doubles[i] = static_cast<double>(v);
      if (exact_int64(doubles[i]) != v)
        throw InvalidArgument("from_i64: element " + std::to_string(i) + " = " + std::to_string(v) +
                              " is not exactly a double, cannot round it once to " + std::string(dtype_name(dtype)));
    }
    return from_f64(Tensor<double>(values.shape(), std::move(doubles)), dtype);
  }
  const std::size_t element_bytes = dtype_size(dtype);
  RawTensor raw{dtype, values.shape(), std::vector<std::uint8_t>(values.values().size() * element_bytes)};
  const auto [lowest, highest] = integer_range(dtype);
  for (std::size_t i = 0; i < values.values().size(); ++i) {
    const std::int64_t v = values.values()[i];
    if (v < lowest || v > highest)
      throw InvalidArgument("from_i64: element " + std::to_string(i) + " = " + std::to_string(v) + " is outside [" +
                            std::to_string(lowest) + ", " + std::to_string(highest) + "], cannot store it as " +
                            std::string(dtype_name(dtype)));
    store_element_le(raw.bytes.data() + i * element_bytes, element_bytes, static_cast<std::uint64_t>(v));
  }
  return raw;
}

}  // namespace k3ref::io
