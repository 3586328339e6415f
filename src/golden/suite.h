// Writing a suite of goldens with its MANIFEST.json, and verifying a committed suite.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "golden/catalogue.h"

namespace k3ref::golden {

// A parsed MANIFEST.json. The parser trusts nothing: every malformed field is a one-line
// FileError naming the manifest, the case and the field, quoting at most a short
// printable excerpt of a value. Nesting deeper than max_manifest_depth and more than
// max_manifest_values JSON values are rejected while parsing, before a document is built.
struct ManifestEntry {
  std::string name, op, file, sha256;
  std::uint64_t seed = 0;
  std::optional<std::uint64_t> bytes;  // the file's size, when listed
  nlohmann::json params;
};
struct Manifest {
  std::string suite, generator_version;
  std::string schema;   // the golden schema of its files ("schema"; empty in manifests before schema 2)
  bool subset = false;  // written by `generate --only`: lists some of the suite's cases
  std::vector<ManifestEntry> cases;
};
inline constexpr std::uint64_t max_manifest_bytes = 16u << 20;  // 16 MiB (the suite's is 0.2 MB)
inline constexpr int max_manifest_depth = 64;
inline constexpr std::size_t max_manifest_values = 1u << 20;
// Largest golden file read by `golden verify` (the largest committed one is about 2 MB).
inline constexpr std::uint64_t max_golden_file_bytes = 1u << 30;
Manifest parse_manifest(std::span<const std::uint8_t> bytes, const std::string& name_for_errors);
// Reads (a regular file of at most max_manifest_bytes, opened without blocking) and parses.
Manifest read_manifest(const std::filesystem::path& path);

// Called after each case: (done, total, case name, seconds spent on it).
using Progress = std::function<void(std::size_t, std::size_t, const std::string&, double)>;

struct GeneratedCase {
  Case c;
  std::vector<std::uint8_t> bytes;
};

// Generates cases on `jobs` threads; the result is in catalogue order whatever `jobs` is.
std::vector<GeneratedCase> generate_cases(const std::vector<Case>& cases, int jobs, const Progress& progress);

// The manifest of a generated suite (deterministic JSON text); a subset manifest says so.
std::string manifest_text(const std::string& suite_name, const std::vector<GeneratedCase>& generated,
                          bool subset = false);

// Throws FileError (one line naming the directory, the file and the rule) unless writing
// `cases` into `dir` destroys nothing k3ref did not write. Checked before generating:
// - the name is UTF-8 and `dir` is a directory (or absent), not a symlink, unless `force`;
// - `dir` holds only MANIFEST.json, the files it lists with their listed sha256, and
//   k3ref's temporary files: anything else (a user's file, a file whose name collides with
//   a case, a symlink, an edited golden) is refused unless `force`;
// - `subset` (generate --only): an existing manifest listing a case not in `cases` is
//   refused even with `force`: a subset suite goes into a directory of its own.
void check_suite_output(const std::filesystem::path& dir, const std::vector<Case>& cases, bool subset, bool force);

// Removes the temporaries an interrupted generate of `cases` into `dir` left behind
// ("<file>.tmp.<pid>.<hex>" of a case file or MANIFEST.json); returns how many. Call it while
// holding the directory's lock (io::DirectoryLock), so that no live writer owns them.
std::size_t remove_own_temporaries(const std::filesystem::path& dir, const std::vector<Case>& cases);

// Writes each file atomically, then MANIFEST.json.
void write_suite(const std::filesystem::path& dir, const std::string& suite_name,
                 const std::vector<GeneratedCase>& generated, bool subset = false);

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

// Checks a committed suite: the manifest lists exactly the catalogue's cases (a subset
// manifest: some of them) with the current generator version; every file's sha256 matches
// the manifest; every file equals, byte for byte, the freshly generated case. A difference
// is explained tensor by tensor. Files are read as regular files only, of bounded size.
std::vector<VerifyProblem> verify_suite(const std::filesystem::path& dir, const VerifyOptions& options);

// Names the tensors (and first differing element) where two golden files differ;
// `fresh_file` names the regenerated file in messages about it (default: `file`
// followed by " (regenerated)").
std::vector<VerifyProblem> explain_difference(const std::string& file, const std::vector<std::uint8_t>& committed,
                                              const std::vector<std::uint8_t>& fresh, const std::string& fresh_file = "");

}  // namespace k3ref::golden
