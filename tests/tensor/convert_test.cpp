#include "k3ref/tensor/convert.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "k3ref/error.h"

namespace k3ref::io {
namespace {

using Bytes = std::vector<std::uint8_t>;

RawTensor raw_tensor(DType dtype, Shape shape, Bytes bytes) { return RawTensor{dtype, std::move(shape), std::move(bytes)}; }

// Element i of `raw` as its little-endian bits.
std::uint64_t element_bits(const RawTensor& raw, std::size_t i) {
  const std::size_t size = dtype_size(raw.dtype);
  std::uint64_t bits = 0;
  for (std::size_t b = size; b-- > 0;) bits = bits << 8 | raw.bytes[i * size + b];
  return bits;
}

TEST(Convert, EveryDtypeRoundTripsValues) {
  const Tensor<double> float_values({2, 2}, std::vector<double>{0.0, 1.0, -2.0, 0.5});
  const Tensor<double> integer_values({2, 2}, std::vector<double>{0.0, 1.0, 7.0, 100.0});
  const Tensor<double> bool_values({2, 2}, std::vector<double>{0.0, 1.0, 1.0, 0.0});
  for (DType dtype : all_dtypes) {
    const Tensor<double>& values =
        is_floating(dtype) ? float_values : dtype == DType::BOOL ? bool_values : integer_values;
    const RawTensor stored = from_f64(values, dtype);
    EXPECT_EQ(stored.bytes.size(), 4 * dtype_size(dtype)) << dtype_name(dtype);
    EXPECT_EQ(to_f64(stored, "x"), values) << dtype_name(dtype);
    if (!is_floating(dtype)) {
      EXPECT_EQ(to_i64(stored, "x"), values.cast<std::int64_t>()) << dtype_name(dtype);
    }
  }
}

TEST(Convert, DecodesKnownBitPatterns) {
  // 1.0 in each format: F32 0x3f800000, F16 0x3c00, BF16 0x3f80, E4M3 (bias 7) 0x38,
  // E5M2 (bias 15) 0x3c; then -2.0: F32 0xc0000000, F16 0xc000, BF16 0xc000, E4M3 0xc0, E5M2 0xc0.
  EXPECT_EQ(to_f64(raw_tensor(DType::F32, {2}, {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0}), "f32").values(),
            (std::vector<double>{1.0, -2.0}));
  EXPECT_EQ(to_f64(raw_tensor(DType::F16, {2}, {0x00, 0x3c, 0x00, 0xc0}), "f16").values(), (std::vector<double>{1.0, -2.0}));
  EXPECT_EQ(to_f64(raw_tensor(DType::BF16, {2}, {0x80, 0x3f, 0x00, 0xc0}), "bf16").values(), (std::vector<double>{1.0, -2.0}));
  EXPECT_EQ(to_f64(raw_tensor(DType::F8_E4M3, {2}, {0x38, 0xc0}), "e4m3").values(), (std::vector<double>{1.0, -2.0}));
  EXPECT_EQ(to_f64(raw_tensor(DType::F8_E5M2, {2}, {0x3c, 0xc0}), "e5m2").values(), (std::vector<double>{1.0, -2.0}));
  EXPECT_EQ(to_f64(raw_tensor(DType::I32, {1}, {0xfe, 0xff, 0xff, 0xff}), "i32").values(), (std::vector<double>{-2.0}));
  EXPECT_EQ(to_i64(raw_tensor(DType::U8, {}, {0x07}), "u8").values(), (std::vector<std::int64_t>{7}));
}

TEST(Convert, NarrowFloatsRoundToNearestEven) {
  // BF16 keeps 8 significant bits: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 and goes to
  // the even 1.0 (0x3f80); 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6
  // (even, 0x3f82).
  const RawTensor bf16 = from_f64(Tensor<double>({2}, std::vector<double>{1 + std::ldexp(1, -8), 1 + 3 * std::ldexp(1, -8)}), DType::BF16);
  EXPECT_EQ(element_bits(bf16, 0), 0x3f80u);
  EXPECT_EQ(element_bits(bf16, 1), 0x3f82u);
  // F32: 1 + 2^-24 ties to 1.0f; 1 + 2^-23 + 2^-24 ties up to 1 + 2^-22.
  const RawTensor f32 = from_f64(Tensor<double>({2}, std::vector<double>{1 + std::ldexp(1, -24), 1 + std::ldexp(3, -24)}), DType::F32);
  EXPECT_EQ(element_bits(f32, 0), 0x3f800000u);
  EXPECT_EQ(element_bits(f32, 1), 0x3f800002u);
}

TEST(Convert, F64KeepsEveryBit) {
  const double nan_with_payload = std::bit_cast<double>(std::uint64_t{0x7ff0000000000123});
  const RawTensor raw = from_f64(Tensor<double>({3}, std::vector<double>{-0.0, nan_with_payload, 0x1p-1074}), DType::F64);
  EXPECT_EQ(element_bits(raw, 0), 0x8000000000000000u);
  EXPECT_EQ(element_bits(raw, 1), 0x7ff0000000000123u);
  EXPECT_EQ(element_bits(raw, 2), 1u);
  const Tensor<double> back = to_f64(raw, "f64");
  EXPECT_EQ(std::bit_cast<std::uint64_t>(back.values()[1]), 0x7ff0000000000123u);
}

TEST(Convert, IntegerDtypesRequireIntegralInRangeValues) {
  const auto store = [](double x, DType dtype) { return from_f64(Tensor<double>({1}, std::vector<double>{x}), dtype); };
  EXPECT_THROW(store(2.5, DType::I32), InvalidArgument);
  EXPECT_THROW(store(std::nan(""), DType::I64), InvalidArgument);
  EXPECT_THROW(store(INFINITY, DType::I64), InvalidArgument);
  EXPECT_THROW(store(256, DType::U8), InvalidArgument);
  EXPECT_THROW(store(-1, DType::U8), InvalidArgument);
  EXPECT_THROW(store(2, DType::BOOL), InvalidArgument);
  EXPECT_THROW(store(2147483648.0, DType::I32), InvalidArgument);
  EXPECT_THROW(store(0x1p63, DType::I64), InvalidArgument);
  EXPECT_EQ(element_bits(store(-0x1p63, DType::I64), 0), 0x8000000000000000u);
  EXPECT_EQ(element_bits(store(-2147483648.0, DType::I32), 0), 0x80000000u);
  EXPECT_EQ(element_bits(store(255, DType::U8), 0), 0xffu);
  EXPECT_EQ(element_bits(store(1, DType::BOOL), 0), 1u);
  try {
    store(2.5, DType::I32);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("element 0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("I32"), std::string::npos) << e.what();
  }
}

TEST(Convert, ToF64RejectsWhatADoubleCannotHold) {
  // 2^53 + 1 as I64.
  const RawTensor big = raw_tensor(DType::I64, {1}, {0x01, 0, 0, 0, 0, 0, 0x20, 0});
  EXPECT_THROW(to_f64(big, "big"), InvalidArgument);
  EXPECT_EQ(to_i64(big, "big").values(), (std::vector<std::int64_t>{(std::int64_t{1} << 53) + 1}));
  try {
    to_f64(raw_tensor(DType::BOOL, {2}, {1, 2}), "flags");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("flags"), std::string::npos) << e.what();
  }
  EXPECT_THROW(to_f64(raw_tensor(DType::F32, {2}, {0, 0, 0}), "short"), InvalidArgument);
}

TEST(Convert, ToI64RequiresIntegralFloats) {
  EXPECT_EQ(to_i64(raw_tensor(DType::F32, {1}, {0x00, 0x00, 0x40, 0x40}), "three").values(), (std::vector<std::int64_t>{3}));
  EXPECT_THROW(to_i64(raw_tensor(DType::F32, {1}, {0x00, 0x00, 0x20, 0x40}), "two_and_a_half"), InvalidArgument);
  EXPECT_THROW(to_i64(raw_tensor(DType::F16, {1}, {0x00, 0x7c}), "infinity"), InvalidArgument);
}

TEST(Convert, FromI64) {
  const Tensor<std::int64_t> values({3}, std::vector<std::int64_t>{-5, 0, 300});
  EXPECT_EQ(to_i64(from_i64(values, DType::I32), "i32"), values);
  EXPECT_EQ(to_i64(from_i64(values, DType::I64), "i64"), values);
  EXPECT_EQ(to_i64(from_i64(values, DType::F16), "f16"), values);
  EXPECT_EQ(element_bits(from_i64(Tensor<std::int64_t>({1}, std::vector<std::int64_t>{3}), DType::F16), 0), 0x4200u);
  EXPECT_THROW(from_i64(values, DType::U8), InvalidArgument);
  EXPECT_THROW(from_i64(Tensor<std::int64_t>({1}, std::vector<std::int64_t>{std::int64_t{1} << 31}), DType::I32), InvalidArgument);
  EXPECT_THROW(from_i64(Tensor<std::int64_t>({1}, std::vector<std::int64_t>{(std::int64_t{1} << 53) + 1}), DType::F32),
               InvalidArgument);
  EXPECT_EQ(element_bits(from_i64(Tensor<std::int64_t>({1}, std::vector<std::int64_t>{std::numeric_limits<std::int64_t>::min()}),
                                  DType::I64),
                         0),
            0x8000000000000000u);
}

TEST(Convert, ByteCountMustMatchShapeAndDtype) {
  EXPECT_EQ(checked_element_count(raw_tensor(DType::BF16, {2, 3}, Bytes(12)), "x"), 6u);
  EXPECT_EQ(checked_element_count(raw_tensor(DType::F64, {0, 5}, {}), "x"), 0u);
  try {
    checked_element_count(raw_tensor(DType::F32, {2}, Bytes(7)), "short");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "short: 7 bytes do not hold shape [2] of F32");
  }
  EXPECT_THROW(checked_element_count(raw_tensor(DType::U8, {-1}, {}), "negative"), InvalidArgument);
}

}  // namespace
}  // namespace k3ref::io
