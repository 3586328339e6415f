// Element types of stored tensors, named as safetensors names them.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace k3ref {

enum class DType { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, U8, BOOL };

inline constexpr DType all_dtypes[] = {DType::F64,     DType::F32,     DType::F16, DType::BF16, DType::F8_E4M3,
                                       DType::F8_E5M2, DType::I64,     DType::I32, DType::U8,   DType::BOOL};

constexpr std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::F8_E4M3: case DType::F8_E5M2: case DType::U8: case DType::BOOL: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType d) {
  switch (d) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::F8_E5M2: return "F8_E5M2";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

constexpr std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType d : all_dtypes)
    if (dtype_name(d) == name) return d;
  return std::nullopt;
}

constexpr bool is_floating(DType d) {
  return d == DType::F64 || d == DType::F32 || d == DType::F16 || d == DType::BF16 || d == DType::F8_E4M3 ||
         d == DType::F8_E5M2;
}

}  // namespace k3ref
