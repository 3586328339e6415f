#include "golden/suite.h"

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>

#include "k3ref/check/policy_table.h"
#include "k3ref/error.h"
#include "k3ref/exec/parallel.h"
#include "k3ref/io/file.h"
#include "k3ref/io/json_rules.h"
#include "k3ref/io/sha256.h"
#include "k3ref/num/scalar.h"

namespace k3ref::golden {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A golden file: regular files only (a FIFO would block, /dev/zero never ends), bounded.
std::vector<std::uint8_t> read_all(const fs::path& path) { return io::read_regular_file(path, max_golden_file_bytes); }

std::string file_name_of(const Case& c) { return c.name + ".safetensors"; }

bool is_safe_file_stem(const std::string& name) {
  if (name.empty() || name.size() > 200 || name == "." || name == "..") return false;
  for (unsigned char ch : name)
    if (!(std::isalnum(ch) || ch == '_' || ch == '-' || ch == '.')) return false;
  return true;
}

}  // namespace

Manifest parse_manifest(std::span<const std::uint8_t> bytes, const std::string& file_name) {
  const std::string file = io::printable(file_name);
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  // nlohmann's lexer ends the input at a NUL, which would accept garbage after one.
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw FileError(file + ": holds a NUL byte at byte " + std::to_string(nul) + " (JSON allows none)");
  // The shared JSON rules (io/json_rules.h), checked before the document is built.
  using Break = io::JsonRuleBreak::Kind;
  if (const auto broken = io::check_json_rules(text, {max_manifest_depth, max_manifest_values, false})) {
    switch (broken.kind) {
      case Break::byte_order_mark: throw FileError(file + ": starts with a byte-order mark (JSON allows none)");
      case Break::too_deep:
        throw FileError(file + ": values nested more than " + std::to_string(max_manifest_depth) + " deep (the limit)");
      case Break::too_many_values:
        throw FileError(file + ": more than " + std::to_string(max_manifest_values) + " JSON values (the limit)");
      case Break::duplicate_key:
        throw FileError(file + ": duplicate key " + io::excerpt(broken.detail) + " (JSON keys must be unique)");
      default: throw FileError(file + ": not valid JSON (" + io::excerpt(broken.detail, 160) + ")");
    }
  }
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    throw FileError(file + ": not valid JSON (" + io::excerpt(e.what(), 160) + ")");
  }
  auto fail = [&](const std::string& where, const std::string& what) -> FileError {
    return FileError(file + ": " + where + (where.empty() ? "" : ": ") + what);
  };
  if (!j.is_object()) throw fail("", "top level is not a JSON object");
  auto string_field = [&](const json& obj, const char* key, const std::string& where) {
    auto it = obj.find(key);
    if (it == obj.end() || !it->is_string()) throw fail(where, std::string("field '") + key + "' missing or not a string");
    return it->get<std::string>();
  };
  if (string_field(j, "format", "") != "k3ref-golden-manifest") throw fail("", "field 'format' is not k3ref-golden-manifest");
  Manifest m;
  m.suite = string_field(j, "suite", "");
  m.generator_version = string_field(j, "generator_version", "");
  // Both are echoed in messages later: plain and short, or refused here.
  if (!is_safe_file_stem(m.suite))
    throw fail("", "field 'suite' " + io::excerpt(m.suite) + " is not a plain name ([A-Za-z0-9_.-], at most 200)");
  if (!is_safe_file_stem(m.generator_version))
    throw fail("", "field 'generator_version' " + io::excerpt(m.generator_version) +
                       " is not a plain version ([A-Za-z0-9_.-], at most 200)");
  if (auto schema = j.find("schema"); schema != j.end()) {
    if (!schema->is_string() || !is_safe_file_stem(schema->get<std::string>()))
      throw fail("", "field 'schema' is not a plain version string ([A-Za-z0-9_.-], at most 200)");
    m.schema = schema->get<std::string>();
  }
  if (auto subset = j.find("subset"); subset != j.end()) {
    if (!subset->is_boolean()) throw fail("", "field 'subset' is not a boolean");
    m.subset = subset->get<bool>();
  }
  auto cases = j.find("cases");
  if (cases == j.end() || !cases->is_array()) throw fail("", "field 'cases' missing or not an array");
  std::set<std::string> names;
  for (std::size_t i = 0; i < cases->size(); ++i) {
    const json& c = (*cases)[i];
    std::string where = "case #" + std::to_string(i);
    if (!c.is_object()) throw fail(where, "not a JSON object");
    ManifestEntry e;
    e.name = string_field(c, "name", where);
    if (!is_safe_file_stem(e.name))
      throw fail(where, "field 'name' " + io::excerpt(e.name) + " is not a plain file stem ([A-Za-z0-9_.-], at most 200)");
    where = "case '" + e.name + "'";
    if (!names.insert(e.name).second) throw fail(where, "listed twice");
    e.op = string_field(c, "op", where);
    e.file = string_field(c, "file", where);
    if (e.file != e.name + ".safetensors") throw fail(where, "field 'file' is not '" + e.name + ".safetensors'");
    e.sha256 = string_field(c, "sha256", where);
    if (e.sha256.size() != 64 || e.sha256.find_first_not_of("0123456789abcdef") != std::string::npos)
      throw fail(where, "field 'sha256' is not 64 lowercase hex digits");
    auto seed = c.find("seed");
    if (seed == c.end() || !seed->is_number_unsigned()) throw fail(where, "field 'seed' missing or not an unsigned integer");
    e.seed = seed->get<std::uint64_t>();
    if (auto size = c.find("bytes"); size != c.end()) {
      if (!size->is_number_unsigned()) throw fail(where, "field 'bytes' is not an unsigned integer");
      e.bytes = size->get<std::uint64_t>();
    }
    auto params = c.find("params");
    if (params == c.end() || !params->is_object()) throw fail(where, "field 'params' missing or not an object");
    e.params = *params;
    m.cases.push_back(std::move(e));
  }
  return m;
}

std::vector<GeneratedCase> generate_cases(const std::vector<Case>& cases, int jobs, const Progress& progress) {
  std::vector<GeneratedCase> out(cases.size());
  std::size_t done = 0;
  std::mutex report;
  // The library's one thread pool; it rethrows the failure of the first case in suite order.
  exec::parallel_for(static_cast<std::int64_t>(cases.size()), jobs, [&](std::int64_t item) {
    const std::size_t i = static_cast<std::size_t>(item);
    const auto start = std::chrono::steady_clock::now();
    const io::SafetensorsFile file = generator_for(cases[i].op).generate(cases[i]);
    out[i] = GeneratedCase{cases[i], io::serialize_safetensors(file)};
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::lock_guard lock(report);
    const std::size_t n = ++done;
    if (progress) progress(n, cases.size(), cases[i].name, seconds);
  });
  return out;
}

Manifest read_manifest(const fs::path& path) { return parse_manifest(io::read_regular_file(path, max_manifest_bytes), path.string()); }

std::string manifest_text(const std::string& suite_name, const std::vector<GeneratedCase>& generated, bool subset) {
  json cases = json::array();
  for (const GeneratedCase& g : generated) {
    const io::SafetensorsFile parsed = io::parse_safetensors(g.bytes, file_name_of(g.c));
    // Each tensor's role, from the file's own lists (docs/golden-format.md, "Schema").
    std::map<std::string, std::string> role;
    for (const char* list : {"inputs", "outputs", "layout"}) {
      const auto it = parsed.metadata.find(std::string("k3ref.") + list);
      if (it == parsed.metadata.end() || it->second.empty()) continue;
      for (const std::string& name : check::expand_outputs(it->second))
        role[name] = std::string(list) == "inputs" ? "input" : std::string(list) == "outputs" ? "output" : "layout";
    }
    json tensors = json::object();
    for (const auto& [name, t] : parsed.tensors)
      tensors[name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}, {"role", role.at(name)}};
    cases.push_back({{"name", g.c.name},
                     {"op", g.c.op},
                     {"file", file_name_of(g.c)},
                     {"seed", g.c.seed},
                     {"params", g.c.params},
                     {"reference_precision", generator_for(g.c.op).reference_precision},
                     {"generator_version", generator_version},
                     {"sha256", io::sha256_hex(g.bytes)},
                     {"bytes", g.bytes.size()},
                     {"tensors", tensors}});
  }
  json manifest = {{"format", "k3ref-golden-manifest"},
                   {"suite", suite_name},
                   {"generator_version", generator_version},
                   {"schema", golden_schema_version},
                   {"cases", cases}};
  if (subset) manifest["subset"] = true;  // only then: a full suite's manifest is unchanged
  return manifest.dump(2) + "\n";
}

namespace {

// The files a suite of `cases` writes into a directory that lists `listed`, and MANIFEST.json.
std::set<std::string> listed_files_and(const std::map<std::string, const ManifestEntry*>& listed,
                                       const std::vector<Case>& cases) {
  std::set<std::string> files{"MANIFEST.json"};
  for (const auto& [file, entry] : listed) files.insert(file);
  for (const Case& c : cases) files.insert(file_name_of(c));
  return files;
}

// "<file>.tmp.<pid>.<hex>" (or an earlier version's "<file>.tmp.<pid>") of one of `files`.
bool is_own_temporary(const std::string& name, const std::set<std::string>& files) {
  std::string target;
  if (io::is_temporary_name(name, &target)) return files.count(target) > 0;
  const std::size_t tmp = name.rfind(".tmp.");
  return tmp != std::string::npos && tmp + 5 < name.size() &&
         name.find_first_not_of("0123456789", tmp + 5) == std::string::npos && files.count(name.substr(0, tmp)) > 0;
}

}  // namespace

void check_suite_output(const fs::path& dir, const std::vector<Case>& cases, bool subset, bool force) {
  const std::string where = "golden generate: --out " + io::printable(dir.string());
  auto refuse = [&](const std::string& rule) { throw FileError(where + ": " + rule); };
  if (!force && !io::is_valid_utf8(dir.string()))
    refuse("the name is not valid UTF-8 (--force writes it anyway)");
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(dir, ec);
  if (status.type() == fs::file_type::not_found) return;  // a fresh directory
  if (ec) refuse("cannot stat: " + ec.message());
  if (status.type() == fs::file_type::symlink && !force) refuse("is a symbolic link (--force writes through it)");
  if (!fs::is_directory(dir, ec)) refuse("exists and is not a directory");

  // What k3ref wrote there: the existing manifest and the files it lists.
  const fs::path manifest_path = dir / "MANIFEST.json";
  std::optional<Manifest> existing;
  const fs::file_status manifest_status = fs::symlink_status(manifest_path, ec);
  if (manifest_status.type() == fs::file_type::regular) {
    try {
      existing = read_manifest(manifest_path);
    } catch (const FileError& e) {
      if (!force) refuse("MANIFEST.json is not a k3ref manifest (" + std::string(e.what()) + "); --force overwrites it");
    }
  } else if (manifest_status.type() != fs::file_type::not_found && !force) {
    refuse("MANIFEST.json is not a regular file (a symlink, FIFO or device); --force replaces it");
  }
  std::set<std::string> generating;
  for (const Case& c : cases) generating.insert(c.name);
  if (subset && existing) {
    // Never, not even with --force: writing would drop cases from a fuller manifest.
    for (const ManifestEntry& e : existing->cases)
      if (!generating.count(e.name))
        refuse("--only writes a subset suite of " + std::to_string(cases.size()) + " case(s), but MANIFEST.json there lists " +
               std::to_string(existing->cases.size()) + " (" + io::excerpt(e.name) +
               " among them); give --out a fresh directory");
  }
  if (force) return;
  std::map<std::string, const ManifestEntry*> listed;
  if (existing)
    for (const ManifestEntry& e : existing->cases) listed[e.file] = &e;
  for (const auto& item : fs::directory_iterator(dir)) {
    const std::string name = item.path().filename().string();
    if (name == "MANIFEST.json") continue;
    // A temporary of an interrupted k3ref write of this suite: removed before writing.
    if (is_own_temporary(name, listed_files_and(listed, cases))) continue;
    const auto it = listed.find(name);
    const std::string file = io::excerpt(name);
    if (it == listed.end())
      refuse("holds " + file + ", which k3ref did not write (not in its MANIFEST.json); --force writes anyway");
    if (!item.is_regular_file(ec) || item.is_symlink(ec))
      refuse(file + " is not a regular file; --force replaces it");
    if (it->second->bytes && item.file_size(ec) != *it->second->bytes)
      refuse(file + " has " + std::to_string(item.file_size(ec)) + " bytes, MANIFEST.json lists " +
             std::to_string(*it->second->bytes) + " (changed since k3ref wrote it); --force overwrites it");
    std::vector<std::uint8_t> bytes;
    try {
      bytes = read_all(item.path());
    } catch (const FileError& e) {
      refuse(std::string(e.what()) + "; --force overwrites it");
    }
    if (io::sha256_hex(bytes) != it->second->sha256)
      refuse(file + " differs from the sha256 in MANIFEST.json (edited since k3ref wrote it); --force overwrites it");
  }
}

std::size_t remove_own_temporaries(const fs::path& dir, const std::vector<Case>& cases) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return 0;
  std::map<std::string, const ManifestEntry*> listed;
  std::optional<Manifest> existing;
  try {
    existing = read_manifest(dir / "MANIFEST.json");
  } catch (const std::exception&) {
  }
  if (existing)
    for (const ManifestEntry& e : existing->cases) listed[e.file] = &e;
  const std::set<std::string> files = listed_files_and(listed, cases);
  std::size_t removed = 0;
  for (const auto& item : fs::directory_iterator(dir)) {
    const std::string name = item.path().filename().string();
    if (is_own_temporary(name, files) && !item.is_symlink(ec) && item.is_regular_file(ec) && fs::remove(item.path(), ec))
      ++removed;
  }
  return removed;
}

void write_suite(const fs::path& dir, const std::string& suite_name, const std::vector<GeneratedCase>& generated,
                 bool subset) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw FileError(dir.string() + ": cannot create directory: " + ec.message());
  for (const GeneratedCase& g : generated) io::write_file_atomic(dir / file_name_of(g.c), g.bytes);
  const std::string text = manifest_text(suite_name, generated, subset);
  io::write_file_atomic(dir / "MANIFEST.json",
                        std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
}

std::vector<VerifyProblem> explain_difference(const std::string& file, const std::vector<std::uint8_t>& committed,
                                              const std::vector<std::uint8_t>& fresh, const std::string& fresh_file) {
  std::vector<VerifyProblem> problems;
  io::SafetensorsFile a, b;
  try {
    a = io::parse_safetensors(committed, file);
  } catch (const std::exception& e) {
    return {{file, "", std::string("committed file is unreadable: ") + e.what()}};
  }
  const std::string fresh_name = fresh_file.empty() ? file + " (regenerated)" : fresh_file;
  try {
    b = io::parse_safetensors(fresh, fresh_name);
  } catch (const std::exception& e) {
    return {{fresh_file.empty() ? file : fresh_file, "", std::string("regenerated file is unreadable: ") + e.what()}};
  }
  if (a.metadata != b.metadata) problems.push_back({file, "__metadata__", "metadata differs from the regenerated file"});
  std::set<std::string> seen;
  for (const auto& [name, fresh_tensor] : b.tensors) {
    seen.insert(name);
    const io::RawTensor* old = a.find(name);
    if (!old) {
      problems.push_back({file, name, "tensor missing from the committed file"});
      continue;
    }
    if (old->dtype != fresh_tensor.dtype || old->shape != fresh_tensor.shape) {
      problems.push_back({file, name,
                          "committed " + std::string(dtype_name(old->dtype)) + shape_to_string(old->shape) +
                              ", regenerated " + std::string(dtype_name(fresh_tensor.dtype)) +
                              shape_to_string(fresh_tensor.shape)});
      continue;
    }
    if (old->bytes != fresh_tensor.bytes) {
      const std::size_t width = dtype_size(old->dtype);
      std::size_t byte = 0;
      while (old->bytes[byte] == fresh_tensor.bytes[byte]) ++byte;
      std::string detail = "values differ, first at element " + std::to_string(byte / width);
      if (is_floating(old->dtype)) {
        const Tensor<double> x = io::to_f64(*old, file), y = io::to_f64(fresh_tensor, file);
        char buf[128];
        std::snprintf(buf, sizeof buf, ": committed %.17g, regenerated %.17g", x.data()[byte / width],
                      y.data()[byte / width]);
        detail += buf;
      }
      problems.push_back({file, name, detail});
    }
  }
  for (const auto& [name, t] : a.tensors)
    if (!seen.count(name)) problems.push_back({file, name, "tensor not produced by the generator"});
  if (problems.empty()) problems.push_back({file, "", "bytes differ (header layout) although every tensor is equal"});
  return problems;
}

std::vector<VerifyProblem> verify_suite(const fs::path& dir, const VerifyOptions& options) {
  std::vector<VerifyProblem> problems;
  const fs::path manifest_path = dir / "MANIFEST.json";
  Manifest manifest;
  try {
    manifest = read_manifest(manifest_path);
  } catch (const std::exception& e) {
    return {{manifest_path.string(), "", e.what()}};
  }
  std::vector<Case> cases;
  try {
    cases = suite(manifest.suite);
  } catch (const std::exception& e) {
    return {{manifest_path.string(), "", e.what()}};
  }
  const std::string& suite_name = manifest.suite;
  // A subset suite (generate --only) is verified case by case for the cases it lists.
  if (manifest.subset)
    std::erase_if(cases, [&](const Case& c) {
      return std::none_of(manifest.cases.begin(), manifest.cases.end(), [&](const ManifestEntry& e) { return e.name == c.name; });
    });
  if (manifest.schema != golden_schema_version)
    problems.push_back({manifest_path.string(), "",
                        "golden schema " + (manifest.schema.empty() ? std::string("(none)") : manifest.schema) +
                            ", this build writes " + golden_schema_version + " (docs/golden-format.md): regenerate the suite"});
  if (manifest.generator_version != generator_version)
    problems.push_back({manifest_path.string(), "",
                        "generator version " + manifest.generator_version + ", this build writes " +
                            generator_version + ": regenerate the suite"});

  // The manifest must list exactly the catalogue's cases, with their parameters.
  std::map<std::string, ManifestEntry> listed;
  for (const ManifestEntry& entry : manifest.cases) listed[entry.name] = entry;
  for (const Case& c : cases) {
    auto it = listed.find(c.name);
    if (it == listed.end()) {
      problems.push_back({(dir / file_name_of(c)).string(), "", "case '" + c.name + "' is missing from the manifest"});
      continue;
    }
    if (it->second.params != c.params || it->second.seed != c.seed || it->second.op != c.op)
      problems.push_back({manifest_path.string(), "", "case '" + c.name + "': operator, parameters or seed differ from the catalogue"});
  }
  std::set<std::string> known;
  for (const Case& c : cases) known.insert(c.name);
  for (const auto& [name, entry] : listed)
    if (!known.count(name)) problems.push_back({manifest_path.string(), "", "case '" + name + "' is not in the catalogue"});
  for (const auto& item : fs::directory_iterator(dir))
    if (item.path().extension() == ".safetensors" && !known.count(item.path().stem().string()))
      problems.push_back({item.path().string(), "", "file is not listed in the manifest"});

  // Checksums first: a flipped bit is named even before regeneration.
  std::map<std::string, std::vector<std::uint8_t>> committed;
  for (const Case& c : cases) {
    const fs::path path = dir / file_name_of(c);
    auto it = listed.find(c.name);
    std::error_code ec;
    if (it != listed.end() && it->second.bytes && fs::is_regular_file(path, ec) && fs::file_size(path, ec) != *it->second.bytes) {
      problems.push_back({path.string(), "", "file has " + std::to_string(fs::file_size(path, ec)) +
                                                 " bytes, the manifest lists " + std::to_string(*it->second.bytes) +
                                                 " (file altered, truncated or replaced)"});
      continue;
    }
    try {
      committed[c.name] = read_all(path);
    } catch (const std::exception& e) {
      problems.push_back({path.string(), "", e.what()});
      continue;
    }
    if (it != listed.end() && io::sha256_hex(committed[c.name]) != it->second.sha256)
      problems.push_back({path.string(), "", "sha256 differs from the manifest (file altered or corrupted)"});
  }

  std::vector<GeneratedCase> fresh;
  if (options.generated_dir) {
    for (const Case& c : cases) {
      const fs::path path = *options.generated_dir / file_name_of(c);
      try {
        fresh.push_back({c, read_all(path)});
      } catch (const std::exception& e) {
        problems.push_back({path.string(), "", e.what()});
        fresh.push_back({c, {}});
      }
    }
  } else {
    fresh = generate_cases(cases, options.jobs, options.progress);
  }
  for (const GeneratedCase& g : fresh) {
    auto it = committed.find(g.c.name);
    if (it == committed.end() || g.bytes.empty()) continue;
    if (it->second != g.bytes) {
      const std::string fresh_file =
          options.generated_dir ? (*options.generated_dir / file_name_of(g.c)).string() : std::string();
      auto explained = explain_difference((dir / file_name_of(g.c)).string(), it->second, g.bytes, fresh_file);
      problems.insert(problems.end(), explained.begin(), explained.end());
    }
  }
  // The manifest text itself must be what this build writes (catches edited metadata).
  if (problems.empty()) {
    const auto bytes = io::read_regular_file(manifest_path, max_manifest_bytes);
    const std::string expected = manifest_text(suite_name, fresh, manifest.subset);
    if (std::string(bytes.begin(), bytes.end()) != expected)
      problems.push_back({manifest_path.string(), "", "manifest text differs from the regenerated manifest"});
  }
  return problems;
}

}  // namespace k3ref::golden
