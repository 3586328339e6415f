// Writing a suite of goldens with its MANIFEST.json, and verifying a committed suite.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "k3ref/golden/catalogue.h"

namespace k3ref::golden {

// A parsed MANIFEST.json. The parser trusts nothing: every malformed field is a one-line
// FileError naming the manifest and the case.
struct ManifestEntry {
  std::string name, op, file, sha256;
  std::uint64_t seed = 0;
  nlohmann::json params;
};
struct Manifest {
  std::string suite, generator_version;
  std::vector<ManifestEntry> cases;
};
Manifest parse_manifest(std::span<const std::uint8_t> bytes, const std::string& name_for_errors);

// Called after each case: (done, total, case name, seconds spent on it).
using Progress = std::function<void(std::size_t, std::size_t, const std::string&, double)>;

struct GeneratedCase {
  Case c;
  std::vector<std::uint8_t> bytes;
};

// Generates cases on `jobs` threads; the result is in catalogue order whatever `jobs` is.
std::vector<GeneratedCase> generate_cases(const std::vector<Case>& cases, int jobs, const Progress& progress);

// The manifest of a generated suite (deterministic JSON text).
std::string manifest_text(const std::string& suite_name, const std::vector<GeneratedCase>& generated);

// Writes each file atomically, then MANIFEST.json.
void write_suite(const std::filesystem::path& dir, const std::string& suite_name,
                 const std::vector<GeneratedCase>& generated);

struct VerifyProblem {
  std::string file;    // path of the file concerned
  std::string tensor;  // tensor concerned, empty if the problem is the file as a whole
  std::string what;    // one line
};

struct VerifyOptions {
  int jobs = 1;
  // Compare against an already generated suite instead of regenerating in memory.
  std::optional<std::filesystem::path> generated_dir;
  Progress progress;
};

// Checks a committed suite: the manifest lists exactly the catalogue's cases with the
// current generator version; every file's sha256 matches the manifest; every file equals,
// byte for byte, the freshly generated case. A difference is explained tensor by tensor.
std::vector<VerifyProblem> verify_suite(const std::filesystem::path& dir, const VerifyOptions& options);

// Names the tensors (and first differing element) where two golden files differ.
std::vector<VerifyProblem> explain_difference(const std::string& file, const std::vector<std::uint8_t>& committed,
                                              const std::vector<std::uint8_t>& fresh);

}  // namespace k3ref::golden
