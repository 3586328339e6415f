// The golden catalogue: named cases, each fully described by its operator, parameters and
// seed, and the generators that turn a case into a safetensors file. Generation is
// deterministic: the same case gives the same bytes on every platform.
//
// Part of the golden tool (the static library k3ref_golden that the `k3ref` command links),
// not of the installed numerics library libk3ref.
//
// Families register in one place: a family is one file src/golden/<family>_cases.cc that
// defines `Family family_<family>()`, and its name in `golden_families` of
// src/golden/meson.build; the build writes the list (golden_families.inc) that families()
// reads. Nothing else names a family (docs/golden-format.md, "Adding a family").
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "k3ref/io/safetensors.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"
#include "k3ref/num/scalar.h"
#include "k3ref/tensor/convert.h"
#include "k3ref/tensor/tensor.h"

namespace k3ref::golden {

// Bumped whenever a change alters the bytes of any generated file (docs/golden-format.md,
// "Versions", says what each version changed).
inline constexpr const char* generator_version = "3";
// The layout of a golden file's metadata and parameters (docs/golden-format.md, "Schema"),
// written as `k3ref.schema`.
inline constexpr const char* golden_schema_version = "2";

struct Case {
  std::string name;       // file stem, unique in a suite
  std::string op;         // operator, e.g. "kda.recurrent"
  std::uint64_t seed = 0;  // case_seed(op, name)
  nlohmann::json params;  // everything the generator needs besides the seed
};

// The seed of a case: the first 8 bytes of sha256("<op>/<name>") read as a little-endian
// integer. A pure function of the case's operator and name, so adding, removing or
// reordering cases changes no other case's bytes.
std::uint64_t case_seed(const std::string& op, const std::string& name);
// A case with its seed derived from its operator and name.
Case make_case(std::string name, std::string op, nlohmann::json params);

// An operator's generator: a case to its golden file.
struct Generator {
  std::string op;
  std::function<io::SafetensorsFile(const Case&)> generate;
  std::string reference_precision;  // recorded in the manifest
  // Named policies of policy/policies.json, in order of preference: each expected output's
  // recommended policy (`k3ref.policies`) is the first of them with a rule for it.
  std::vector<std::string> policies;
};

// An operator family: its generators and the cases it contributes to the default suite.
struct Family {
  std::string name;  // the file stem src/golden/<name>_cases.cc
  std::vector<Generator> generators;
  std::function<std::vector<Case>()> default_cases;
};

// Every registered family, in the order of golden_families (src/golden/meson.build).
const std::vector<Family>& families();
// All families' generators, and the one for an operator (InvalidArgument when none).
const std::vector<Generator>& generators();
const Generator& generator_for(const std::string& op);

// The committed suite ("default"): every family's default cases, in family order.
std::vector<Case> suite(const std::string& name);
std::vector<std::string> suite_names();

// Golden inputs: uniform in [lo, hi] from the project's own stream, then rounded to
// `format`, so the stored value is exactly what the reference consumes. Integer
// arithmetic and IEEE operations in a fixed order: the same bytes everywhere.
Tensor<double> draw_uniform_rounded(num::Random& rng, const Shape& shape, double lo, double hi, num::Format format);

// The `__metadata__` every golden file carries (docs/golden-format.md, "Schema"): the schema
// version, the case, its operator, seed, parameters, the generator version, the reference
// precision, and every tensor of `file` in exactly one of three lists: `outputs` (the
// expected outputs, comma-separated), `layout` (index tensors describing the layout, e.g.
// chunk_starts) and the inputs (every other tensor, in file order); per output the
// recommended policy. Throws InvalidArgument when a listed name is not in the file, an input
// or layout tensor is not an input of the operator in the policy table, or no preferred
// policy has a rule for an output.
std::map<std::string, std::string> metadata_of(const Case& c, const std::string& reference_precision,
                                               const io::SafetensorsFile& file, const std::string& outputs,
                                               const std::string& layout = "");
// "256-bit binary float": the reference precision of the goldens computed at golden_bits.
std::string golden_float_precision();
// A golden-precision tensor rounded to double (round to nearest even), as goldens store it.
Tensor<double> round_to_double(const Tensor<num::golden_float>& t);

}  // namespace k3ref::golden
