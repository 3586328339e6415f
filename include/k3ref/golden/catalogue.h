// The golden catalogue: named cases, each fully described by its parameters and seed,
// and the generator that turns a case into a safetensors file. Generation is
// deterministic: the same case gives the same bytes on every platform.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "k3ref/io/safetensors.h"
#include "k3ref/kda/options.h"

namespace k3ref::golden {

// Bumped whenever a change alters the bytes of any generated file.
inline constexpr const char* generator_version = "1";

struct Case {
  std::string name;       // file stem, unique in a suite
  std::string op;         // operator, e.g. "kda.recurrent"
  std::uint64_t seed = 0;
  nlohmann::json params;  // everything the generator needs besides the seed
};

// An operator family's generator: a case to its golden file.
struct Generator {
  std::string op;
  std::function<io::SafetensorsFile(const Case&)> generate;
  std::string reference_precision;  // recorded in the manifest
};

// All registered generators (one per operator family).
const std::vector<Generator>& generators();
const Generator& generator_for(const std::string& op);

// The committed suite ("default") or a larger one generated on demand ("extended").
std::vector<Case> suite(const std::string& name);
std::vector<std::string> suite_names();

// KDA recurrence cases (src/golden/kda_cases.cc).
std::vector<Case> kda_default_cases();
io::SafetensorsFile generate_kda_recurrent(const Case&);
// The double-precision recurrence run on a KDA case's stored inputs with the case's
// options: what the double tier gives against the golden's 256-bit outputs.
kda::Outputs<double> kda_recurrent_in_double(const Case&, const io::SafetensorsFile& golden_file);

}  // namespace k3ref::golden
