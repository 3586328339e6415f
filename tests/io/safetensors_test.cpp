#include "k3ref/io/file.h"
#include "k3ref/io/safetensors.h"

#include "test_support.h"
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "k3ref/error.h"

namespace k3ref::io {
namespace {

using Bytes = std::vector<std::uint8_t>;

// A file in the raw format: length prefix, the header text exactly as given, the data.
Bytes build_file(std::string_view header, const Bytes& data = {}) {
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(header.size() >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Bytes zeros(std::size_t n) { return Bytes(n, 0); }

RawTensor raw_tensor(DType dtype, Shape shape, Bytes bytes) { return RawTensor{dtype, std::move(shape), std::move(bytes)}; }

// Parses `bytes` expecting a FileError whose message contains every one of `parts`
// (always the file name; the tensor name where one is involved) and is one line.
void expect_file_error(const Bytes& bytes, std::initializer_list<std::string_view> parts) {
  const std::string file_name = "broken_model.safetensors";
  try {
    parse_safetensors(bytes, file_name);
    ADD_FAILURE() << "expected FileError";
  } catch (const FileError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(file_name), std::string::npos) << message;
    for (std::string_view part : parts) EXPECT_NE(message.find(part), std::string::npos) << "missing '" << part << "' in: " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

// ---------------------------------------------------------------- round trips

// Element bytes that differ per position and per dtype, so a mix-up shows.
Bytes pattern_bytes(std::size_t n, std::uint8_t salt) {
  Bytes bytes(n);
  for (std::size_t i = 0; i < n; ++i) bytes[i] = static_cast<std::uint8_t>(i * 37 + salt);
  return bytes;
}

TEST(SafetensorsRoundTrip, EveryDtype) {
  SafetensorsFile file;
  std::uint8_t salt = 1;
  for (DType dtype : all_dtypes) {
    const Shape shape = {2, 3};
    file.tensors.emplace_back("tensor_" + std::string(dtype_name(dtype)),
                              raw_tensor(dtype, shape, pattern_bytes(6 * dtype_size(dtype), salt++)));
  }
  const Bytes bytes = serialize_safetensors(file);
  EXPECT_EQ(parse_safetensors(bytes, "every_dtype.safetensors"), file);
}

TEST(SafetensorsRoundTrip, Metadata) {
  SafetensorsFile file;
  file.metadata = {{"format", "pt"}, {"seed", "12345"}, {"note", "unicode \xc3\xa9 \"quoted\" \\ and\nnewline"}};
  file.tensors.emplace_back("w", raw_tensor(DType::F32, {1}, {0, 0, 128, 63}));
  const SafetensorsFile parsed = parse_safetensors(serialize_safetensors(file), "metadata.safetensors");
  EXPECT_EQ(parsed.metadata, file.metadata);
  EXPECT_EQ(parsed, file);
}

TEST(SafetensorsRoundTrip, EmptyMetadataIsOmittedAndEmptyFileWorks) {
  const Bytes bytes = serialize_safetensors(SafetensorsFile{});
  // "{}" padded with six spaces to 8 bytes.
  EXPECT_EQ(bytes, build_file("{}      "));
  EXPECT_EQ(parse_safetensors(bytes, "empty.safetensors"), SafetensorsFile{});
}

TEST(SafetensorsRoundTrip, TensorsComeBackInDataOffsetOrder) {
  SafetensorsFile file;
  file.tensors.emplace_back("zeta", raw_tensor(DType::U8, {1}, {1}));
  file.tensors.emplace_back("alpha", raw_tensor(DType::U8, {2}, {2, 3}));
  const SafetensorsFile parsed = parse_safetensors(serialize_safetensors(file), "order.safetensors");
  ASSERT_EQ(parsed.tensors.size(), 2u);
  EXPECT_EQ(parsed.tensors[0].first, "zeta");
  EXPECT_EQ(parsed.tensors[1].first, "alpha");
}

// The exact bytes of a small file, derived by hand:
//
//   tensors, in this order: "b" F32 [2] = {1.0f, -2.0f}; "a" U8 [] = {7}
//   data buffer: 1.0f = 0x3f800000 -> 00 00 80 3f; -2.0f = 0xc0000000 -> 00 00 00 c0;
//                then 07. So "b" spans [0, 8) and "a" spans [8, 9).
//   header JSON, compact, keys sorted ("__metadata__" < "a" < "b"; inside an entry
//   "data_offsets" < "dtype" < "shape"):
//     {"__metadata__":{"k":"v"},"a":{"data_offsets":[8,9],"dtype":"U8","shape":[]},
//      "b":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}}      (one line, 130 bytes)
//   130 = 16 * 8 + 2, so 6 spaces pad it to 136 = 0x88: the prefix is 88 00 00 00 00 00 00 00.
//   Total: 8 + 136 + 9 = 153 bytes.
TEST(SafetensorsFormat, HandBuiltBytes) {
  SafetensorsFile file;
  file.metadata = {{"k", "v"}};
  file.tensors.emplace_back("b", raw_tensor(DType::F32, {2}, {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0}));
  file.tensors.emplace_back("a", raw_tensor(DType::U8, {}, {0x07}));

  const std::string header =
      R"({"__metadata__":{"k":"v"},"a":{"data_offsets":[8,9],"dtype":"U8","shape":[]},)"
      R"("b":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}})";
  ASSERT_EQ(header.size(), 130u);
  Bytes expected = {0x88, 0, 0, 0, 0, 0, 0, 0};
  expected.insert(expected.end(), header.begin(), header.end());
  expected.insert(expected.end(), 6, ' ');
  expected.insert(expected.end(), {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0, 0x07});
  ASSERT_EQ(expected.size(), 153u);

  const Bytes bytes = serialize_safetensors(file);
  EXPECT_EQ(bytes, expected);
  const SafetensorsFile parsed = parse_safetensors(bytes, "hand_built.safetensors");
  EXPECT_EQ(parsed, file);
}

// A header laid out the way other writers do it (entry keys in another order, whitespace,
// no padding) is accepted: only the meaning is checked.
TEST(SafetensorsFormat, AcceptsForeignHeaderLayout) {
  const Bytes bytes = build_file(R"( { "x" : { "shape" : [ 1 ] , "dtype" : "I32" , "data_offsets" : [ 0 , 4 ] } } )",
                                 {0xff, 0xff, 0xff, 0xff});
  const SafetensorsFile parsed = parse_safetensors(bytes, "foreign.safetensors");
  EXPECT_EQ(parsed.at("x", "foreign.safetensors"), raw_tensor(DType::I32, {1}, {0xff, 0xff, 0xff, 0xff}));
}

TEST(SafetensorsFormat, AtNamesFileAndTensor) {
  SafetensorsFile file;
  file.tensors.emplace_back("present", raw_tensor(DType::U8, {1}, {1}));
  EXPECT_NE(file.find("present"), nullptr);
  EXPECT_EQ(file.find("absent"), nullptr);
  try {
    file.at("absent_tensor", "model_file.safetensors");
    FAIL() << "expected FileError";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find("model_file.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("absent_tensor"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- property

// Names from pieces that exercise JSON escaping and multi-byte UTF-8.
rc::Gen<std::string> gen_name() {
  return rc::gen::map(rc::gen::container<std::vector<std::string>>(
                          rc::gen::elementOf(std::vector<std::string>{"a", "b", "Z", "0", "_", ".", " ", "\"", "\\",
                                                                      "\n", "\x01", "\xc3\xa9", "\xe4\xb8\xad",
                                                                      "\xf0\x9f\x98\x80"})),
                      [](const std::vector<std::string>& pieces) {
                        std::string name;
                        for (const std::string& piece : pieces) name += piece;
                        return name;
                      });
}

rc::Gen<RawTensor> gen_raw_tensor() {
  return rc::gen::mapcat(
      rc::gen::pair(rc::gen::elementOf(std::vector<DType>(std::begin(all_dtypes), std::end(all_dtypes))),
                    rc::gen::container<Shape>(rc::gen::inRange<std::int64_t>(0, 5))),
      [](const std::pair<DType, Shape>& dtype_and_shape) {
        // Plain variables, not a structured binding: older clang cannot capture bindings.
        const DType dtype = dtype_and_shape.first;
        Shape bounded = dtype_and_shape.second;
        if (bounded.size() > 4) bounded.resize(4);
        const std::size_t byte_count = static_cast<std::size_t>(checked_numel(bounded, "gen")) * dtype_size(dtype);
        return rc::gen::map(rc::gen::container<Bytes>(byte_count, rc::gen::arbitrary<std::uint8_t>()),
                            [dtype, bounded](Bytes bytes) { return RawTensor{dtype, bounded, std::move(bytes)}; });
      });
}

// The order the reader gives: by (begin, end) offset, ties (zero-byte tensors sharing an
// offset) by name, as the sorted header keys present them.
std::vector<std::pair<std::string, RawTensor>> reader_order(const std::vector<std::pair<std::string, RawTensor>>& tensors) {
  std::vector<std::tuple<std::uint64_t, std::uint64_t, std::string, RawTensor>> keyed;
  std::uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    keyed.emplace_back(offset, offset + tensor.bytes.size(), name, tensor);
    offset += tensor.bytes.size();
  }
  std::sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a), std::get<1>(a), std::get<2>(a)) < std::tie(std::get<0>(b), std::get<1>(b), std::get<2>(b));
  });
  std::vector<std::pair<std::string, RawTensor>> ordered;
  for (auto& [begin, end, name, tensor] : keyed) ordered.emplace_back(name, tensor);
  return ordered;
}

RC_GTEST_PROP(SafetensorsProperty, SerialiseParseRoundTripIsIdenticalAndDeterministic, ()) {
  const auto names = *rc::gen::unique<std::vector<std::string>>(gen_name());
  SafetensorsFile file;
  for (const std::string& name : names) {
    if (file.tensors.size() == 6) break;
    file.tensors.emplace_back(name, *gen_raw_tensor());
  }
  file.metadata = *rc::gen::container<std::map<std::string, std::string>>(gen_name(), gen_name());

  const Bytes bytes = serialize_safetensors(file);
  RC_ASSERT(serialize_safetensors(file) == bytes);
  const std::uint64_t header_length = std::bit_cast<std::uint64_t>(
      std::array<std::uint8_t, 8>{bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5], bytes[6], bytes[7]});
  RC_ASSERT(header_length % 8 == 0);

  const SafetensorsFile parsed = parse_safetensors(bytes, "property.safetensors");
  SafetensorsFile expected = file;
  expected.tensors = reader_order(file.tensors);
  RC_ASSERT(parsed == expected);
  RC_ASSERT(serialize_safetensors(parsed) == bytes);
}

// ---------------------------------------------------------------- validation

TEST(SafetensorsValidation, FileShorterThanEightBytes) { expect_file_error({1, 2, 3, 4, 5}, {"too short"}); }

TEST(SafetensorsValidation, HeaderLengthAboveLimit) {
  Bytes bytes = zeros(64);
  const std::uint64_t length = max_header_bytes + 1;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<std::uint8_t>(length >> (8 * i));
  expect_file_error(bytes, {"header length 100000001", "limit"});
}

TEST(SafetensorsValidation, HeaderLengthBeyondFile) {
  Bytes bytes = build_file("{}");
  bytes[0] = 3;  // claims 3 header bytes, only 2 follow
  expect_file_error(bytes, {"header length 3", "2 bytes after"});
}

TEST(SafetensorsValidation, HeaderLengthHugeDoesNotAllocate) {
  // 2^64 - 1: must be rejected by the checks, not by an allocation failure.
  expect_file_error(Bytes(16, 0xff), {"header length 18446744073709551615"});
}

TEST(SafetensorsValidation, HeaderNotJson) { expect_file_error(build_file(R"({"w": {"dtype": )"), {"not valid JSON"}); }

TEST(SafetensorsValidation, HeaderNotAnObject) { expect_file_error(build_file("[1, 2]"), {"must be a JSON object", "array"}); }

TEST(SafetensorsValidation, HeaderEmpty) { expect_file_error(build_file(""), {"not valid JSON"}); }

TEST(SafetensorsValidation, HeaderNotUtf8) {
  // A stray continuation byte, an overlong '/', a surrogate, a code point above U+10FFFF,
  // a truncated sequence: each inside a tensor name, and one outside any string.
  for (std::string_view bad : {"\x80", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe4\xb8"}) {
    const std::string header = R"({"w)" + std::string(bad) + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})";
    expect_file_error(build_file(header), {"not valid UTF-8"});
  }
  expect_file_error(build_file("{}\xff"), {"not valid UTF-8"});
}

TEST(SafetensorsValidation, HeaderStartsWithByteOrderMark) {
  expect_file_error(build_file("\xef\xbb\xbf{}"), {"byte-order mark"});
}

TEST(SafetensorsValidation, ValidUtf8NamesAreAccepted) {
  const std::string name = "w\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80";
  const SafetensorsFile parsed =
      parse_safetensors(build_file(R"({")" + name + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})"), "utf8.st");
  EXPECT_NE(parsed.find(name), nullptr);
}

TEST(SafetensorsValidation, EscapedLoneSurrogate) {
  expect_file_error(build_file(R"({"w\ud800":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})"), {"not valid JSON"});
}

TEST(SafetensorsValidation, MissingDtype) {
  expect_file_error(build_file(R"({"weight":{"shape":[1],"data_offsets":[0,1]}})", zeros(1)), {"'weight'", "missing \"dtype\""});
}

TEST(SafetensorsValidation, MissingShape) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","data_offsets":[0,1]}})", zeros(1)), {"'weight'", "missing \"shape\""});
}

TEST(SafetensorsValidation, MissingDataOffsets) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[1]}})", zeros(1)), {"'weight'", "missing \"data_offsets\""});
}

TEST(SafetensorsValidation, EntryNotAnObject) {
  expect_file_error(build_file(R"({"weight":[1,2]})"), {"'weight'", "must be a JSON object"});
}

TEST(SafetensorsValidation, DtypeNotAString) {
  expect_file_error(build_file(R"({"weight":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", zeros(1)),
                    {"'weight'", "dtype must be a string"});
}

TEST(SafetensorsValidation, ShapeNotAnArray) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":"1","data_offsets":[0,1]}})", zeros(1)),
                    {"'weight'", "shape must be an array"});
}

TEST(SafetensorsValidation, ShapeHoldsNonIntegers) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}})", zeros(1)),
                    {"'weight'", "shape must hold integers"});
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":["1"],"data_offsets":[0,1]}})", zeros(1)),
                    {"'weight'", "shape must hold integers"});
}

TEST(SafetensorsValidation, DataOffsetsNotAPair) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", zeros(1)),
                    {"'weight'", "data_offsets must be an array [begin, end]"});
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[1],"data_offsets":{"a":1}}})", zeros(1)),
                    {"'weight'", "data_offsets must be an array [begin, end]"});
}

TEST(SafetensorsValidation, DataOffsetsNotNonNegativeIntegers) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", zeros(1)),
                    {"'weight'", "non-negative integers"});
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}})", zeros(1)),
                    {"'weight'", "non-negative integers"});
}

TEST(SafetensorsValidation, UnexpectedKeyInEntry) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}})", zeros(1)),
                    {"'weight'", "unexpected key 'extra'"});
}

TEST(SafetensorsValidation, UnknownDtype) {
  expect_file_error(build_file(R"({"weight":{"dtype":"Q4_K","shape":[1],"data_offsets":[0,1]}})", zeros(1)),
                    {"'weight'", "unknown dtype 'Q4_K'"});
}

TEST(SafetensorsValidation, NegativeExtent) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[2,-1],"data_offsets":[0,0]}})"),
                    {"'weight'", "negative extent"});
}

TEST(SafetensorsValidation, ElementCountOverflows63Bits) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"),
                    {"'weight'", "overflows 63 bits"});
}

TEST(SafetensorsValidation, ExtentBeyond63Bits) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,0]}})"),
                    {"'weight'", "does not fit in 63 bits"});
}

TEST(SafetensorsValidation, ByteCountTimesDtypeSizeOverflows) {
  // 2^62 elements of 8 bytes: the element count fits in 63 bits, the byte count does not.
  expect_file_error(build_file(R"({"weight":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}})"),
                    {"'weight'", "needs 4611686018427387904 x 8 bytes"});
}

TEST(SafetensorsValidation, ShapeTimesDtypeSizeDoesNotMatchOffsets) {
  expect_file_error(build_file(R"({"weight":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", zeros(4)),
                    {"'weight'", "needs 2 x 4 bytes", "span 4"});
}

TEST(SafetensorsValidation, BeginAfterEnd) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", zeros(4)),
                    {"'weight'", "run backwards"});
}

TEST(SafetensorsValidation, EndBeyondDataBuffer) {
  expect_file_error(build_file(R"({"weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", zeros(4)),
                    {"'weight'", "beyond the data buffer of 4 bytes"});
}

TEST(SafetensorsValidation, OffsetsNearU64MaxDoNotWrap) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[1],)"
                               R"("data_offsets":[18446744073709551615,18446744073709551616]}})"),
                    {"'weight'", "non-negative integers"});
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[1],)"
                               R"("data_offsets":[18446744073709551614,18446744073709551615]}})"),
                    {"'weight'", "beyond the data buffer"});
}

TEST(SafetensorsValidation, GapBetweenTensors) {
  expect_file_error(build_file(R"({"first":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                               R"("second":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})",
                               zeros(12)),
                    {"'second'", "gap after byte 4", "'first'"});
}

TEST(SafetensorsValidation, GapBeforeFirstTensor) {
  expect_file_error(build_file(R"({"only":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", zeros(8)),
                    {"'only'", "gap after byte 0"});
}

TEST(SafetensorsValidation, OverlappingTensors) {
  expect_file_error(build_file(R"({"first":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                               R"("second":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                               zeros(8)),
                    {"'second'", "overlap tensor 'first'"});
}

TEST(SafetensorsValidation, SameOffsetsTwice) {
  expect_file_error(build_file(R"({"first":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                               R"("second":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                               zeros(4)),
                    {"'second'", "overlap tensor 'first'"});
}

TEST(SafetensorsValidation, BytesLeftAfterLastTensor) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", zeros(6)),
                    {"'weight'", "data buffer has 6 bytes", "cover only 4"});
}

TEST(SafetensorsValidation, BytesButNoTensors) {
  expect_file_error(build_file("{}", zeros(3)), {"data buffer has 3 bytes", "no tensors"});
}

TEST(SafetensorsValidation, DuplicateTensorName) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                               R"("weight":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                               zeros(2)),
                    {"'weight'", "more than once"});
}

TEST(SafetensorsValidation, DuplicateKeyInsideEntry) {
  expect_file_error(build_file(R"({"weight":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}})", zeros(1)),
                    {"'weight'", "key 'dtype' appears more than once"});
}

TEST(SafetensorsValidation, DuplicateMetadataKey) {
  expect_file_error(build_file(R"({"__metadata__":{"seed":"1","seed":"2"}})"), {"'__metadata__'", "'seed'", "more than once"});
}

TEST(SafetensorsValidation, SameKeyInDifferentObjectsIsFine) {
  const SafetensorsFile parsed = parse_safetensors(
      build_file(R"({"__metadata__":{"dtype":"x"},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                 R"("b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                 zeros(2)),
      "fine.safetensors");
  EXPECT_EQ(parsed.tensors.size(), 2u);
}

TEST(SafetensorsValidation, MetadataNotAnObject) {
  expect_file_error(build_file(R"({"__metadata__":["a"]})"), {"__metadata__ must be an object of strings"});
}

TEST(SafetensorsValidation, MetadataValueNotAString) {
  expect_file_error(build_file(R"({"__metadata__":{"seed":12}})"), {"__metadata__ entry 'seed' must be a string"});
}

TEST(SafetensorsValidation, ControlCharactersInNamesKeepTheMessageOneLine) {
  expect_file_error(build_file(R"({"bad\nname":{"dtype":"Q","shape":[0],"data_offsets":[0,0]}})"), {"bad\\x0aname"});
}

// ---------------------------------------------------------------- writer errors

template <class Exception>
void expect_serialize_error(const SafetensorsFile& file, std::string_view part) {
  try {
    serialize_safetensors(file);
    ADD_FAILURE() << "expected an exception";
  } catch (const Exception& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(SafetensorsWriter, RejectsDuplicateNames) {
  SafetensorsFile file;
  file.tensors.emplace_back("twice", raw_tensor(DType::U8, {1}, {1}));
  file.tensors.emplace_back("twice", raw_tensor(DType::U8, {1}, {2}));
  expect_serialize_error<InvalidArgument>(file, "'twice': name appears more than once");
}

TEST(SafetensorsWriter, RejectsReservedName) {
  SafetensorsFile file;
  file.tensors.emplace_back("__metadata__", raw_tensor(DType::U8, {1}, {1}));
  expect_serialize_error<InvalidArgument>(file, "reserved");
}

TEST(SafetensorsWriter, RejectsByteCountMismatch) {
  SafetensorsFile file;
  file.tensors.emplace_back("short", raw_tensor(DType::F32, {2}, {1, 2, 3}));
  expect_serialize_error<InvalidArgument>(file, "'short'");
}

TEST(SafetensorsWriter, RejectsInvalidUtf8) {
  SafetensorsFile file;
  file.tensors.emplace_back("bad\xff", raw_tensor(DType::U8, {1}, {1}));
  expect_serialize_error<InvalidArgument>(file, "UTF-8");
  SafetensorsFile with_metadata;
  with_metadata.metadata = {{"k", "\xc0\xaf"}};
  expect_serialize_error<InvalidArgument>(with_metadata, "UTF-8");
}

// ---------------------------------------------------------------- files

class SafetensorsFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = std::filesystem::temp_directory_path() /
                 ("k3ref_safetensors_test_" + std::to_string(::getpid()) + "_" +
                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(directory_);
    std::filesystem::create_directories(directory_);
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }

  std::vector<std::string> directory_entries() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(directory_)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  static Bytes read_bytes(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  static SafetensorsFile small_file(std::uint8_t value) {
    SafetensorsFile file;
    file.metadata = {{"version", std::to_string(value)}};
    file.tensors.emplace_back("w", raw_tensor(DType::U8, {3}, {value, value, value}));
    return file;
  }

  std::filesystem::path directory_;
};

TEST_F(SafetensorsFiles, AtomicWriteReplacesContentAndLeavesNoTemporaries) {
  const std::filesystem::path path = directory_ / "model.safetensors";
  write_safetensors_atomic(path, small_file(1));
  EXPECT_EQ(read_safetensors(path), small_file(1));
  EXPECT_EQ(directory_entries(), std::vector<std::string>{"model.safetensors"});

  write_safetensors_atomic(path, small_file(2));
  EXPECT_EQ(read_safetensors(path), small_file(2));
  EXPECT_EQ(read_bytes(path), serialize_safetensors(small_file(2)));
  EXPECT_EQ(directory_entries(), std::vector<std::string>{"model.safetensors"});
}

// A writer killed in the middle of a write must leave the previous file intact: the
// child writes 256 MiB through write_file_atomic and is SIGKILLed as soon as its
// temporary file has grown; the target must still hold the old bytes, whole.
TEST_F(SafetensorsFiles, WriterKilledMidWriteLeavesThePreviousFileIntact) {
  const std::filesystem::path target = directory_ / "golden.safetensors";
  write_safetensors_atomic(target, small_file(1));
  const Bytes before = read_bytes(target);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::vector<std::uint8_t> huge(256u << 20, 0x5a);
    try {
      write_file_atomic(target, huge);
    } catch (...) {
    }
    ::_exit(0);
  }
  // The child's temporary: "<target>.tmp.<pid>.<8 random hex>", created exclusively.
  const std::string prefix = target.filename().string() + ".tmp." + std::to_string(child) + ".";
  bool killed_mid_write = false;
  for (int i = 0; i < 20000; ++i) {  // up to ~20 s
    std::error_code ec;
    std::filesystem::path temporary;
    for (const auto& e : std::filesystem::directory_iterator(directory_, ec))
      if (e.path().filename().string().rfind(prefix, 0) == 0) temporary = e.path();
    if (temporary.empty()) {
      ::usleep(1000);
      continue;
    }
    EXPECT_TRUE(is_temporary_name(temporary.filename().string()));
    const auto size = std::filesystem::file_size(temporary, ec);
    if (!ec && size > 0 && size < (256u << 20)) {
      ::kill(child, SIGKILL);
      killed_mid_write = true;
      break;
    }
    ::usleep(1000);
  }
  if (!killed_mid_write) ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(killed_mid_write) << "the writer finished before it could be killed";
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(read_bytes(target), before);
  EXPECT_EQ(read_safetensors(target), small_file(1));
}

TEST_F(SafetensorsFiles, WriteFileAtomicWritesExactBytes) {
  const std::filesystem::path path = directory_ / "MANIFEST.json";
  const std::string text = "{\"files\": []}\n";
  write_file_atomic(path, Bytes(text.begin(), text.end()));
  EXPECT_EQ(read_bytes(path), Bytes(text.begin(), text.end()));
  write_file_atomic(path, {});
  EXPECT_EQ(read_bytes(path), Bytes{});
  EXPECT_EQ(directory_entries(), std::vector<std::string>{"MANIFEST.json"});
}

TEST_F(SafetensorsFiles, WriteIntoMissingDirectoryNamesThePath) {
  const std::filesystem::path path = directory_ / "no_such_directory" / "model.safetensors";
  try {
    write_safetensors_atomic(path, small_file(1));
    FAIL() << "expected FileError";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
  EXPECT_EQ(directory_entries(), std::vector<std::string>{});
}

// Renaming onto a non-empty directory fails after the temporary file was written: the
// temporary must be removed and the error must name the path.
TEST_F(SafetensorsFiles, FailedRenameRemovesTheTemporary) {
  const std::filesystem::path path = directory_ / "occupied";
  std::filesystem::create_directories(path / "inside");
  try {
    write_file_atomic(path, Bytes{1, 2, 3});
    FAIL() << "expected FileError";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
  EXPECT_EQ(directory_entries(), std::vector<std::string>{"occupied"});
  EXPECT_TRUE(std::filesystem::is_directory(path / "inside"));
}

TEST_F(SafetensorsFiles, InvalidContentsThrowBeforeWriting) {
  const std::filesystem::path path = directory_ / "model.safetensors";
  write_safetensors_atomic(path, small_file(1));
  SafetensorsFile invalid;
  invalid.tensors.emplace_back("short", raw_tensor(DType::F32, {2}, {1}));
  try {
    write_safetensors_atomic(path, invalid);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_safetensors(path), small_file(1));
  EXPECT_EQ(directory_entries(), std::vector<std::string>{"model.safetensors"});
}

TEST_F(SafetensorsFiles, ReadMissingFileNamesIt) {
  const std::filesystem::path path = directory_ / "absent.safetensors";
  try {
    read_safetensors(path);
    FAIL() << "expected FileError";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
}

// read_safetensors applies the same checks as parse_safetensors, naming the path.
TEST_F(SafetensorsFiles, ReadValidatesLikeParse) {
  const std::filesystem::path path = directory_ / "trailing.safetensors";
  write_file_atomic(path, build_file(R"({"weight":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", zeros(6)));
  try {
    read_safetensors(path);
    FAIL() << "expected FileError";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'weight'"), std::string::npos) << e.what();
  }

  const std::filesystem::path tiny = directory_ / "tiny.safetensors";
  write_file_atomic(tiny, Bytes{1, 2, 3});
  EXPECT_THROW(read_safetensors(tiny), FileError);

  const std::filesystem::path huge_header = directory_ / "huge_header.safetensors";
  write_file_atomic(huge_header, Bytes(16, 0xff));
  EXPECT_THROW(read_safetensors(huge_header), FileError);

  EXPECT_THROW(read_safetensors(directory_), FileError);
}

// ---------------------------------------------------------------- hostile inputs, round two

std::string nested_arrays(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// A valid one-tensor header with the value of `field` replaced by `value`.
std::string header_with(std::string_view field, const std::string& value) {
  std::map<std::string, std::string> fields = {{"dtype", "\"U8\""}, {"shape", "[1]"}, {"data_offsets", "[0,1]"}};
  fields.at(std::string(field)) = value;
  return R"({"weight":{"dtype":)" + fields["dtype"] + R"(,"shape":)" + fields["shape"] + R"(,"data_offsets":)" +
         fields["data_offsets"] + "}}";
}

TEST(SafetensorsHostile, ValuesNestedTensOfThousandsDeepAreRejectedWhileParsingInAShortLine) {
  // Was a segfault: the DOM was built, then the error path serialised it recursively.
  for (std::string_view field : {"dtype", "shape", "data_offsets"}) {
    const Bytes bytes = build_file(header_with(field, nested_arrays(100000)), zeros(1));
    expect_file_error(bytes, {"'weight'", field, "found an array"});
    try {
      parse_safetensors(bytes, "deep.safetensors");
    } catch (const FileError& e) {
      EXPECT_LT(std::string(e.what()).size(), 200u) << e.what();
    }
  }
  expect_file_error(build_file(R"({"__metadata__":{"k":)" + nested_arrays(100000) + "}}"),
                    {"__metadata__ entry 'k' must be a string, found an array"});
  expect_file_error(build_file(R"({"w":)" + std::string(100000, '[') + "}"), {"'w'", "must be a JSON object"});
}

TEST(SafetensorsHostile, NulInsideTheDeclaredHeaderIsRejected) {
  // nlohmann's lexer ends the input at a NUL: the bytes after it used to be ignored.
  const std::string valid = R"({"weight":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  expect_file_error(build_file(valid + std::string(1, '\0') + "garbage", zeros(1)), {"NUL byte at byte 58"});
  expect_file_error(build_file(valid + std::string(5, '\0'), zeros(1)), {"NUL byte"});
  EXPECT_NO_THROW(parse_safetensors(build_file(valid + "     ", zeros(1)), "space_padded.safetensors"));
}

TEST(SafetensorsHostile, EveryProductOfExtentsFitsIn63BitsEvenWithAZero) {
  // [0, 2^62, 2^62] has no elements, but code forming the product of its last two
  // extents (a stride, B x H) would overflow: rejected whatever the order of the zero.
  for (const char* shape : {"[0,4611686018427387904,4611686018427387904]", "[4611686018427387904,4611686018427387904,0]",
                            "[9223372036854775807,2,0]"})
    expect_file_error(build_file(header_with("shape", shape).replace(header_with("shape", shape).find("[0,1]"), 5, "[0,0]")),
                      {"'weight'", "overflows 63 bits"});
  // Large but representable: accepted, and nothing is allocated for it.
  const SafetensorsFile parsed = parse_safetensors(
      build_file(R"({"w":{"dtype":"F64","shape":[1099511627776,0,1,15000],"data_offsets":[0,0]}})"), "big.safetensors");
  ASSERT_EQ(parsed.tensors.size(), 1u);
  EXPECT_EQ(parsed.tensors[0].second.shape, (Shape{1099511627776, 0, 1, 15000}));
  EXPECT_TRUE(parsed.tensors[0].second.bytes.empty());
}

TEST(SafetensorsHostile, TensorCountAndRankLimits) {
  std::string header = "{";
  for (std::size_t i = 0; i <= max_tensors; ++i)
    header += (i ? ",\"t" : "\"t") + std::to_string(i) + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]})";
  header += "}";
  expect_file_error(build_file(header), {"more than 131072 tensors"});

  std::string shape = "[";
  for (std::size_t i = 0; i <= max_rank; ++i) shape += i ? ",1" : "1";
  expect_file_error(build_file(header_with("shape", shape + "]"), zeros(1)), {"'weight'", "more than 64 dimensions"});
  shape.pop_back();
  shape.pop_back();
  EXPECT_NO_THROW(parse_safetensors(build_file(header_with("shape", shape + "]"), zeros(1)), "rank64.safetensors"));
}

TEST(SafetensorsHostile, MessagesQuoteShortPrintableExcerpts) {
  // A 24 MB value was once echoed whole; names with terminal escapes were printed raw.
  const std::string long_name(100000, 'n');
  expect_file_error(build_file(R"({")" + long_name + R"(":{"dtype":"Q","shape":[0],"data_offsets":[0,0]}})"),
                    {"... (100000 bytes)"});
  const std::string escapes = "\\u001b]0;owned\\u0007\\u001b[2J\xc2\x9b" "31m";
  try {
    parse_safetensors(build_file(R"({")" + escapes + R"(":{"dtype":"Q","shape":[0],"data_offsets":[0,0]}})"), "e.st");
    ADD_FAILURE() << "expected FileError";
  } catch (const FileError& e) {
    const std::string message = e.what();
    EXPECT_LT(message.size(), 200u);
    EXPECT_EQ(message.find('\x1b'), std::string::npos) << message;
    EXPECT_EQ(message.find('\x07'), std::string::npos) << message;
    EXPECT_EQ(message.find("\xc2\x9b"), std::string::npos) << message;
    EXPECT_NE(message.find("\\x1b]0;owned\\x07\\x1b[2J\\xc2\\x9b31m"), std::string::npos) << message;
  }
  expect_file_error(build_file(header_with("dtype", '"' + std::string(5000, 'D') + '"'), zeros(1)),
                    {"unknown dtype 'DDDD", "(5000 bytes)"});
}

TEST_F(SafetensorsFiles, OnlyRegularFilesAreReadAndAFifoDoesNotBlock) {
  // alarm: before the fix, opening the FIFO blocked for a writer that never comes.
  const std::filesystem::path fifo = directory_ / "fifo.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ::alarm(20);
  for (const auto& [path, kind] : {std::pair{fifo, "a FIFO"}, {std::filesystem::path("/dev/zero"), "a character device"},
                                   {directory_, "a directory"}}) {
    try {
      read_safetensors(path);
      ADD_FAILURE() << "expected FileError for " << path;
    } catch (const FileError& e) {
      EXPECT_NE(std::string(e.what()).find(kind), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
    }
  }
  ::alarm(0);
}

}  // namespace
}  // namespace k3ref::io
