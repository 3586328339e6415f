// Tests of the golden suite: regeneration is byte-identical, the committed suite
// verifies, a flipped bit is found and named, and the double tier's agreement with the
// 256-bit goldens is reported in ulps.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>

#include <cstring>
#include <set>
#include <unistd.h>

#include "k3ref/check/metrics.h"
#include "k3ref/golden/suite.h"
#include "k3ref/io/sha256.h"
#include "k3ref/kda/kda_io.h"
#include "k3ref/num/float_format.h"
#include "k3ref/num/random.h"

namespace k3ref::golden {
namespace {

namespace fs = std::filesystem;

fs::path source_root() {
  const char* root = std::getenv("K3REF_SOURCE_ROOT");
  return root ? fs::path(root) : fs::path(".");
}

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

TEST(GoldenSuite, RegenerationIsByteIdenticalWhateverTheThreadCount) {
  const auto cases = cheap_cases();
  const auto once = generate_cases(cases, 1, {});
  const auto again = generate_cases(cases, 3, {});
  ASSERT_EQ(once.size(), again.size());
  for (std::size_t i = 0; i < once.size(); ++i) EXPECT_EQ(once[i].bytes, again[i].bytes) << cases[i].name;
  EXPECT_EQ(manifest_text("default", once), manifest_text("default", again));
}

TEST(GoldenSuite, CommittedSuiteVerifiesAgainstAFreshGeneration) {
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

// Every committed file, each with one bit flipped at a position drawn from the project's
// random stream: verify must name that file.
TEST(GoldenSuite, AFlippedBitInEveryCommittedFileIsNamed) {
  const fs::path committed = source_root() / "goldens";
  const fs::path scratch = fs::temp_directory_path() / ("k3ref_flip_all_" + std::to_string(::getpid()));
  num::Random rng(77);
  std::vector<fs::path> files;
  for (const auto& item : fs::directory_iterator(committed)) files.push_back(item.path().filename());
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 2u);
  for (const fs::path& name : files) {
    fs::remove_all(scratch);
    fs::copy(committed, scratch);
    std::fstream f(scratch / name, std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<std::uint64_t>(fs::file_size(scratch / name));
    const auto at = static_cast<std::streamoff>(rng.below(size));
    f.seekg(at);
    char byte = 0;
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ (1 << rng.below(8)));
    f.seekp(at);
    f.write(&byte, 1);
    f.close();
    VerifyOptions options;
    options.generated_dir = committed;
    const auto problems = verify_suite(scratch, options);
    bool named = false;
    for (const auto& p : problems) named = named || p.file.find(name.string()) != std::string::npos;
    EXPECT_TRUE(named) << name << " with bit flipped at byte " << at << " was not named";
  }
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

// The double tier on the committed inputs against the 256-bit outputs. Reported per
// case; asserted loosely, since the figure depends on conditioning, not on a bug.
TEST(GoldenSuite, DoubleAgreesWithTheGoldensAndTheFigureIsReported) {
  const fs::path dir = source_root() / "goldens";
  std::printf("%-34s %11s %11s %12s\n", "case", "rel RMS", "max ulp", "ulp of max");
  double worst_rel = 0;
  for (const Case& c : suite("default")) {
    if (c.op != "kda.recurrent") continue;  // other operators have their own double checks
    const auto file = io::read_safetensors(dir / (c.name + ".safetensors"));
    const auto d = kda_recurrent_in_double(c, file);
    double err2 = 0, ref2 = 0, max_ulp = 0, max_ref = 0, max_diff = 0;
    for (const auto& [name, out] : {std::pair{"o", &d.o}, std::pair{"final_state", &*d.final_state}}) {
      const Tensor<double> ref = io::to_f64(file.at(name, c.name), c.name);
      for (std::int64_t i = 0; i < ref.numel(); ++i) {
        const double r = ref.data()[i], x = out->data()[i];
        err2 += (x - r) * (x - r);
        ref2 += r * r;
        max_ref = std::max(max_ref, std::fabs(r));
        max_diff = std::max(max_diff, std::fabs(x - r));
        max_ulp = std::max(max_ulp, check::ulp_distance(num::Format::fp64, x, r));
      }
    }
    const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : 0;
    worst_rel = std::max(worst_rel, rel);
    std::printf("%-34s %11.2e %11.1f %12.2f\n", c.name.c_str(), rel, max_ulp, max_ref > 0 ? max_diff / (max_ref * 0x1p-52) : 0);
    EXPECT_LT(rel, 1e-12) << c.name;
  }
  std::printf("worst relative RMS error of double over the suite: %.2e\n", worst_rel);
}

}  // namespace
}  // namespace k3ref::golden
