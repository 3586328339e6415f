// Tests of the golden suite: regeneration is byte-identical, the committed suite
// verifies, a flipped bit is found and named, and the double tier's agreement with the
// 256-bit goldens is reported in ulps.
#include "test_support.h"

#include <cmath>
#include <cstdlib>
#include <fstream>

#include <cstring>
#include <map>
#include <set>
#include <unistd.h>

#include "k3ref/check/metrics.h"
#include "golden/suite.h"
#include "k3ref/io/sha256.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"

namespace k3ref::golden {
namespace {

namespace fs = std::filesystem;

using test::source_root;

std::vector<Case> cheap_cases() {
  std::vector<Case> picked;
  for (const Case& c : suite("default"))
    if (c.name == "kda_t1" || c.name == "kda_varlen" || c.name == "kda_gate_softplus" || c.name == "kda_state_v_first")
      picked.push_back(c);
  return picked;
}

TEST(GoldenSuite, CatalogueNamesAreUniqueAndEveryCaseHasAGenerator) {
  std::set<std::string> names;
  for (const Case& c : suite("default")) {
    EXPECT_TRUE(names.insert(c.name).second) << c.name;
    EXPECT_NO_THROW(generator_for(c.op));
  }
  EXPECT_GE(names.size(), 20u);
  EXPECT_THROW(suite("no-such-suite"), InvalidArgument);
}

// The registry (src/golden/meson.build's golden_families): every family contributes cases, each
// of its cases is of one of its own operators, and no operator belongs to two families.
TEST(GoldenSuite, EveryFamilyOwnsItsOperatorsAndCases) {
  std::set<std::string> family_names, ops;
  std::size_t cases = 0;
  for (const Family& f : families()) {
    EXPECT_TRUE(family_names.insert(f.name).second) << f.name;
    std::set<std::string> own;
    for (const Generator& g : f.generators) {
      EXPECT_TRUE(ops.insert(g.op).second) << g.op << " registered twice";
      EXPECT_FALSE(g.policies.empty()) << g.op << ": no recommended policy";
      own.insert(g.op);
    }
    const auto mine = f.default_cases();
    EXPECT_FALSE(mine.empty()) << f.name;
    for (const Case& c : mine) EXPECT_TRUE(own.count(c.op)) << f.name << ": case " << c.name << " of foreign op " << c.op;
    cases += mine.size();
  }
  EXPECT_EQ(family_names, (std::set<std::string>{"attnres", "gdn", "kcp", "kda", "kda_backward", "kda_chunkwise", "kda_layer", "moe", "qb", "serving"}));
  EXPECT_EQ(cases, suite("default").size());
}

// The schema's lists (docs/golden-format.md): every tensor in exactly one of inputs, outputs,
// layout, in agreement with the policy table; the generator refuses anything else.
TEST(GoldenSuite, MetadataListsEveryTensorOnceAndRefusesWhatThePolicyTableDoesNotKnow) {
  const Case c = make_case("kda_schema_probe", "kda.recurrent", nlohmann::json::object());
  io::SafetensorsFile file;
  for (const char* name : {"q", "k", "v", "g", "beta", "o", "final_state"})
    file.tensors.emplace_back(name, io::from_f64(Tensor<double>({1}, std::vector<double>{1.0}), DType::F64));
  const auto meta = metadata_of(c, "test", file, "o,final_state");
  EXPECT_EQ(meta.at("k3ref.schema"), golden_schema_version);
  EXPECT_EQ(meta.at("k3ref.inputs"), "q,k,v,g,beta");
  EXPECT_EQ(meta.at("k3ref.outputs"), "o,final_state");
  EXPECT_EQ(meta.at("k3ref.layout"), "");
  EXPECT_EQ(nlohmann::json::parse(meta.at("k3ref.policies")),
            nlohmann::json({{"o", "recurrent"}, {"final_state", "recurrent"}}));
  auto refused = [&](const io::SafetensorsFile& f, const std::string& outputs, const std::string& layout,
                     const std::string& needle) {
    try {
      (void)metadata_of(c, "test", f, outputs, layout);
      ADD_FAILURE() << "accepted outputs '" << outputs << "' layout '" << layout << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused(file, "o,final_state,all_states", "", "output tensor 'all_states' is not in the file");
  refused(file, "o", "final_state", "layout tensor 'final_state' is not an input");
  io::SafetensorsFile extra = file;
  extra.tensors.emplace_back("mystery", io::from_f64(Tensor<double>({1}, std::vector<double>{0.0}), DType::F64));
  refused(extra, "o,final_state", "", "tensor 'mystery' is not an input of the operator");
  refused(extra, "o,final_state,mystery", "", "no preferred policy has a rule for output 'mystery'");
}

TEST(GoldenSuite, RegenerationIsByteIdenticalWhateverTheThreadCount) {
  const auto cases = cheap_cases();
  const auto once = generate_cases(cases, 1, {});
  const auto again = generate_cases(cases, 3, {});
  ASSERT_EQ(once.size(), again.size());
  for (std::size_t i = 0; i < once.size(); ++i) EXPECT_EQ(once[i].bytes, again[i].bytes) << cases[i].name;
  EXPECT_EQ(manifest_text("default", once), manifest_text("default", again));
}

// A case's seed is the first 8 bytes, little-endian, of sha256("<op>/<name>"): nothing of its
// position in the catalogue. The pinned values are Python's
//   int.from_bytes(hashlib.sha256(b"kda.recurrent/kda_t1").digest()[:8], "little")
// (and the same for the QB case), computed apart from this code.
TEST(GoldenSuite, EverySeedIsAPureFunctionOfTheCasesOperatorAndName) {
  EXPECT_EQ(case_seed("kda.recurrent", "kda_t1"), 13750363846518736545ull);
  EXPECT_EQ(case_seed("qb.solver", "qb_solver_m16_n8_k2"), 15836992945865554020ull);
  std::set<std::uint64_t> seeds;
  for (const Case& c : suite("default")) {
    EXPECT_EQ(c.seed, case_seed(c.op, c.name)) << c.name;
    EXPECT_TRUE(seeds.insert(c.seed).second) << c.name << ": seed shared with another case";
  }
}

// Adding a case (here one inserted first and one in the middle of a catalogue) leaves every
// other case's bytes as they were: a file depends on its own case only.
TEST(GoldenSuite, InsertingACaseChangesNoOtherCasesBytes) {
  const std::vector<Case> cases = cheap_cases();
  ASSERT_GE(cases.size(), 2u);
  Case extra = make_case("kda_inserted_t5", "kda.recurrent", cases.front().params);
  extra.params["T"] = 5;
  std::vector<Case> with_extra = cases;
  with_extra.insert(with_extra.begin(), extra);
  with_extra.insert(with_extra.begin() + 2, make_case("kda_inserted_again", "kda.recurrent", cases.front().params));
  const auto before = generate_cases(cases, 2, {});
  const auto after = generate_cases(with_extra, 2, {});
  std::map<std::string, std::vector<std::uint8_t>> bytes_after;
  for (const GeneratedCase& g : after) bytes_after[g.c.name] = g.bytes;
  for (const GeneratedCase& g : before) EXPECT_TRUE(bytes_after.at(g.c.name) == g.bytes) << g.c.name << " changed";
  // The inserted copy of the first case's parameters differs from it by its name (seed) alone.
  EXPECT_FALSE(bytes_after.at("kda_inserted_again") == before.front().bytes);
}

// Derived families draw their inputs in memory from the recurrence case they name: the stored
// inputs equal the recurrence golden's, tensor for tensor, byte for byte.
TEST(GoldenSuite, DerivedCasesStoreTheInputsOfTheRecurrenceCaseTheyName) {
  std::map<std::string, Case> by_name;
  for (const Case& c : suite("default")) by_name[c.name] = c;
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"kda_chunkwise_flashkda_c16_b2_t37", "kda_b2_t37"}, {"kda_backward_gva_h2_hv6", "kda_gva_h2_hv6"}};
  for (const auto& [derived, base] : pairs) {
    ASSERT_TRUE(by_name.count(derived) && by_name.count(base)) << derived << " / " << base;
    const auto files = generate_cases({by_name.at(derived), by_name.at(base)}, 2, {});
    const io::SafetensorsFile d = io::parse_safetensors(files[0].bytes, derived), b = io::parse_safetensors(files[1].bytes, base);
    int compared = 0;
    for (const char* name : kda::input_names) {
      const io::RawTensor* x = d.find(name);
      const io::RawTensor* y = b.find(name);
      ASSERT_EQ(x == nullptr, y == nullptr) << derived << ": input " << name;
      if (!x) continue;
      EXPECT_TRUE(x->dtype == y->dtype && x->shape == y->shape && x->bytes == y->bytes) << derived << ": input " << name;
      ++compared;
    }
    EXPECT_GE(compared, 5) << derived;
  }
}

// The whole committed suite against a fresh generation. In the sanitizer build (meson sets
// K3REF_GOLDEN_VERIFY_SAMPLE) only the first case of every operator is regenerated and
// compared byte for byte: every generator still runs under ASan/UBSan, while the full
// regeneration at -O0 would take longer than the rest of CI; the release build and the
// README's `golden verify` check every file.
TEST(GoldenSuite, CommittedSuiteVerifiesAgainstAFreshGeneration) {
  if (std::getenv("K3REF_GOLDEN_VERIFY_SAMPLE")) {
    std::vector<Case> sample;
    std::set<std::string> ops;
    for (const Case& c : suite("default"))
      if (ops.insert(c.op).second) sample.push_back(c);
    EXPECT_EQ(ops.size(), generators().size()) << "every generator has a case in the default suite";
    for (const GeneratedCase& g : generate_cases(sample, 2, {})) {
      std::ifstream in(source_root() / "goldens" / (g.c.name + ".safetensors"), std::ios::binary);
      const std::vector<std::uint8_t> committed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      EXPECT_TRUE(committed == g.bytes) << g.c.name << ": regenerated bytes differ from goldens/";
    }
    return;
  }
  VerifyOptions options;
  options.jobs = 2;
  const auto problems = verify_suite(source_root() / "goldens", options);
  for (const auto& p : problems) ADD_FAILURE() << p.file << " " << p.tensor << ": " << p.what;
}

TEST(GoldenSuite, AFlippedBitInAnyCommittedFileIsFoundAndNamed) {
  const fs::path committed = source_root() / "goldens";
  const fs::path scratch = fs::temp_directory_path() / ("k3ref_flip_" + std::to_string(::getpid()));
  fs::remove_all(scratch);
  fs::copy(committed, scratch);
  // Flip one bit in the data section of the o tensor of one case, then one in a header.
  const fs::path victim = scratch / "kda_varlen.safetensors";
  std::vector<char> bytes;
  {
    std::ifstream in(victim, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto parsed = io::parse_safetensors(std::vector<std::uint8_t>(bytes.begin(), bytes.end()), "x");
  std::uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  // The o tensor is the first F64 output; find its byte offset by summing the sizes before it.
  std::size_t offset = 8 + header;
  for (const auto& [name, t] : parsed.tensors) {
    if (name == "o") break;
    offset += t.bytes.size();
  }
  bytes[offset + 3] ^= 0x10;
  {
    std::ofstream out(victim, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  VerifyOptions options;
  options.generated_dir = committed;  // the untouched suite stands in for the fresh generation
  const auto problems = verify_suite(scratch, options);
  bool named_file = false, named_tensor = false;
  for (const auto& p : problems) {
    named_file = named_file || (p.file.find("kda_varlen.safetensors") != std::string::npos &&
                                p.what.find("sha256") != std::string::npos);
    named_tensor = named_tensor || p.tensor == "o";
  }
  EXPECT_TRUE(named_file);
  EXPECT_TRUE(named_tensor);
  fs::remove_all(scratch);
}

// Every committed file with one bit flipped at a position drawn from the project's random
// stream: verify must name each of them. Verification checks each file on its own, so all
// golden files are flipped in one copy of the suite and verified once (linear in the suite,
// not quadratic); the manifest, whose corruption stops the verification, gets its own run.
TEST(GoldenSuite, AFlippedBitInEveryCommittedFileIsNamed) {
  const fs::path committed = source_root() / "goldens";
  const fs::path scratch = fs::temp_directory_path() / ("k3ref_flip_all_" + std::to_string(::getpid()));
  num::Random rng(77);
  std::vector<fs::path> files;
  for (const auto& item : fs::directory_iterator(committed)) files.push_back(item.path().filename());
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 2u);
  auto flip_one_bit = [&](const fs::path& path) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    const auto at = static_cast<std::streamoff>(rng.below(static_cast<std::uint64_t>(fs::file_size(path))));
    f.seekg(at);
    char byte = 0;
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ (1 << rng.below(8)));
    f.seekp(at);
    f.write(&byte, 1);
    return at;
  };
  auto named_by_verify = [&](const fs::path& dir) {
    VerifyOptions options;
    options.generated_dir = committed;
    options.jobs = 2;
    std::set<std::string> named;
    for (const auto& p : verify_suite(dir, options))
      for (const fs::path& name : files)
        if (p.file.find(name.string()) != std::string::npos) named.insert(name.string());
    return named;
  };
  const fs::path manifest = "MANIFEST.json";
  // All golden files at once.
  fs::remove_all(scratch);
  fs::copy(committed, scratch);
  std::map<std::string, std::streamoff> flipped;
  for (const fs::path& name : files)
    if (name != manifest) flipped[name.string()] = flip_one_bit(scratch / name);
  const auto named = named_by_verify(scratch);
  for (const auto& [name, at] : flipped)
    EXPECT_TRUE(named.count(name)) << name << " with bit flipped at byte " << at << " was not named";
  // The manifest alone.
  fs::remove_all(scratch);
  fs::copy(committed, scratch);
  const auto at = flip_one_bit(scratch / manifest);
  EXPECT_TRUE(named_by_verify(scratch).count(manifest.string())) << "MANIFEST.json with bit flipped at byte " << at;
  fs::remove_all(scratch);
}

TEST(GoldenManifest, HostileManifestsGetOneLineErrorsNamingTheCase) {
  auto parse = [](const std::string& text) {
    return parse_manifest(std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()), "M.json");
  };
  const std::string sha(64, 'a');
  auto entry = [&](const std::string& name, const std::string& file, const std::string& digest, const std::string& seed) {
    return R"({"name": ")" + name + R"(", "op": "kda.recurrent", "file": ")" + file + R"(", "sha256": ")" + digest +
           R"(", "seed": )" + seed + R"(, "params": {}})";
  };
  auto manifest = [](const std::string& cases) {
    return R"({"format": "k3ref-golden-manifest", "suite": "default", "generator_version": "1", "cases": [)" + cases + "]}";
  };
  EXPECT_EQ(parse(manifest(entry("a", "a.safetensors", sha, "1"))).cases.size(), 1u);
  const std::vector<std::pair<std::string, std::string>> hostile = {
      {"{", "not valid JSON"},
      {"[]", "not a JSON object"},
      {R"({"format": "other"})", "format"},
      {manifest("1"), "case #0"},
      {manifest(entry("../etc/passwd", "x.safetensors", sha, "1")), "file stem"},
      {manifest(entry("a", "b.safetensors", sha, "1")), "case 'a'"},
      {manifest(entry("a", "a.safetensors", "xyz", "1")), "sha256"},
      {manifest(entry("a", "a.safetensors", sha, "-1")), "seed"},
      {R"({"format": "k3ref-golden-manifest", "suite": "default", "generator_version": "1", "schema": 2, "cases": []})",
       "field 'schema'"},
      {manifest(entry("a", "a.safetensors", sha, "1") + "," + entry("a", "a.safetensors", sha, "2")), "twice"},
  };
  for (const auto& [text, needle] : hostile) {
    try {
      parse(text);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const FileError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("M.json"), std::string::npos) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  }
}

// The double tier on the committed inputs against the 256-bit outputs is held to the measured
// table in tests/kda/measured_errors_test.cpp.

}  // namespace
}  // namespace k3ref::golden
