// End-to-end tests of the k3ref command: exit codes (0 pass, 1 fail, 2 unusable input),
// one-line errors on malformed files, and the kda command reproducing a golden.
#include "test_support.h"
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <fstream>
#include <sstream>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "golden/suite.h"
#include "k3ref/io/file.h"
#include "k3ref/io/safetensors.h"
#include "k3ref/num/float_format.h"
#include "k3ref/tensor/convert.h"
#include "k3ref/vocabulary.h"

namespace k3ref {
namespace {

namespace fs = std::filesystem;

struct CommandResult {
  int code;
  std::string out;
};

fs::path scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("k3ref_cli_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

CommandResult k3ref(const std::string& args) {
  const char* exe = std::getenv("K3REF_EXE");
  const fs::path log = scratch() / "out.txt";
  const std::string cmd = std::string(exe ? exe : "k3ref") + " " + args + " > " + log.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, text.str()};
}

fs::path golden(const std::string& name) {
  const char* root = std::getenv("K3REF_SOURCE_ROOT");
  return fs::path(root ? root : ".") / "goldens" / (name + ".safetensors");
}

std::size_t line_count(const std::string& s) { return std::count(s.begin(), s.end(), '\n'); }

// A candidate file: the golden's outputs transformed elementwise and stored as `dtype`.
fs::path candidate(const std::string& name, DType dtype, double factor) {
  const auto g = io::read_safetensors(golden(name));
  io::SafetensorsFile out;
  for (const char* t : {"o", "final_state"}) {
    Tensor<double> x = io::to_f64(g.at(t, "golden"), "golden");
    for (double& v : x.values()) v = num::round_to(num::Format::fp64, v * factor);
    out.tensors.emplace_back(t, io::from_f64(x, dtype));
  }
  const fs::path path = scratch() / ("cand_" + std::to_string(static_cast<int>(dtype)) + "_" +
                                     std::to_string(factor) + ".safetensors");
  io::write_safetensors_atomic(path, out);
  return path;
}

TEST(Cli, HelpOfEveryCommandSucceeds) {
  for (const char* cmd : {"--help", "golden --help", "golden generate --help", "golden verify --help",
                          "golden list --help", "kda --help", "inputs --help", "compare --help"}) {
    const CommandResult r = k3ref(cmd);
    EXPECT_EQ(r.code, 0) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << cmd;
  }
}

TEST(Cli, CompareExitCodes) {
  const fs::path g = golden("kda_b2_t37");
  EXPECT_EQ(k3ref("compare --golden " + g.string() + " --candidate " + g.string() + " --policy exact").code, 0);
  // Rounded to bf16: exactly at the floor, so floor:1 passes.
  const fs::path bf16 = candidate("kda_b2_t37", DType::BF16, 1.0);
  const CommandResult pass = k3ref("compare --golden " + g.string() + " --candidate " + bf16.string() + " --policy floor:1");
  EXPECT_EQ(pass.code, 0) << pass.out;
  EXPECT_NE(pass.out.find("PASS"), std::string::npos);
  // 1% too large: far above the bf16 floor (about 0.2%), and fails exact.
  const fs::path off = candidate("kda_b2_t37", DType::BF16, 1.01);
  const CommandResult fail = k3ref("compare --golden " + g.string() + " --candidate " + off.string() + " --policy floor:2");
  EXPECT_EQ(fail.code, 1) << fail.out;
  // The worst element by the axes the policy table names (check::describe_index), as
  // Python's messages name it.
  EXPECT_NE(fail.out.find("worst element (batch "), std::string::npos) << fail.out;
  EXPECT_NE(fail.out.find(", token "), std::string::npos) << fail.out;
  // A varlen golden's packed token is (sequence, position) from its cu_seqlens.
  const fs::path vg = golden("kda_varlen");
  const fs::path voff = candidate("kda_varlen", DType::BF16, 1.02);  // (a file of its own: names carry the factor)
  const CommandResult vfail = k3ref("compare --golden " + vg.string() + " --candidate " + voff.string() + " --policy floor:2");
  EXPECT_EQ(vfail.code, 1) << vfail.out;
  EXPECT_NE(vfail.out.find("worst element (batch 0, sequence "), std::string::npos) << vfail.out;
  EXPECT_NE(vfail.out.find(", position "), std::string::npos) << vfail.out;
  EXPECT_EQ(k3ref("compare --golden " + g.string() + " --candidate " + off.string() + " --policy exact").code, 1);
  // Unknown policy and missing tensors are unusable input.
  EXPECT_EQ(k3ref("compare --golden " + g.string() + " --candidate " + g.string() + " --policy nearly").code, 2);
  EXPECT_EQ(k3ref("compare --golden " + g.string() + " --candidate " + g.string() + " --tensors nothing").code, 2);
}

// --policy recommended: the policy the golden names for its outputs (k3ref.policies), here
// "recurrent" (1.5 x the bf16 floor): a bf16 rounding of the golden is 1 x the floor and passes,
// 1% off fails; a file without the metadata is unusable.
TEST(Cli, CompareUnderTheGoldensRecommendedPolicy) {
  const fs::path g = golden("kda_b2_t37");
  const CommandResult pass =
      k3ref("compare --golden " + g.string() + " --candidate " + candidate("kda_b2_t37", DType::BF16, 1.0).string() +
            " --policy recommended");
  EXPECT_EQ(pass.code, 0) << pass.out;
  EXPECT_NE(pass.out.find("PASS under policy 'recurrent'"), std::string::npos) << pass.out;
  const CommandResult fail =
      k3ref("compare --golden " + g.string() + " --candidate " + candidate("kda_b2_t37", DType::BF16, 1.01).string() +
            " --policy recommended");
  EXPECT_EQ(fail.code, 1) << fail.out;
  const fs::path plain = candidate("kda_b2_t37", DType::F64, 1.0);  // no k3ref metadata at all
  EXPECT_EQ(k3ref("compare --golden " + plain.string() + " --candidate " + plain.string() + " --policy recommended").code, 2);
}

// Every name of every vocabulary option `k3ref kda` offers is accepted and reaches the
// computation as that value: the output records the parsed options by the vocabulary's names
// (k3ref.options). A name not in the table is one line, exit 2, naming the option and every
// allowed name.
TEST(Cli, KdaTakesEveryVocabularyNameAndListsThemOnAnUnknownOne) {
  const std::string help = k3ref("kda --help").out;
  std::set<std::string> offered;
  for (const OptionVocabulary& v : option_vocabulary()) {
    std::string flag = "--" + std::string(v.option);
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (help.find(flag + " ") == std::string::npos) continue;
    offered.insert(std::string(v.option));
    EXPECT_NE(help.find(v.help()), std::string::npos) << flag << ": help is not the vocabulary's:\n" << help;
    for (std::string_view name : v.names()) {
      // The raw gates need their parameters, which only the raw-gate goldens carry.
      std::string file = "kda_t1", extra;
      if (v.option == "gate" && name == "softplus") file = "kda_gate_softplus";
      if (v.option == "gate" && name == "lower_bound") file = "kda_gate_lower_bound", extra = " --lower-bound -5";
      const fs::path out = scratch() / "vocabulary.safetensors";
      const std::string args = "kda --in " + golden(file).string() + " --out " + out.string() + " --force " + flag +
                               " " + std::string(name) + extra;
      const CommandResult r = k3ref(args);
      ASSERT_EQ(r.code, 0) << args << "\n" << r.out;
      const auto meta = io::read_safetensors(out).metadata;
      const auto named = nlohmann::json::parse(meta.at("k3ref.options"));
      EXPECT_EQ(named.at(std::string(v.option)).get<std::string>(), name) << args;
    }
    const CommandResult bad = k3ref("kda --in " + golden("kda_t1").string() + " --out " +
                                    (scratch() / "never.safetensors").string() + " " + flag + " Nope");
    EXPECT_EQ(bad.code, 2) << bad.out;
    EXPECT_EQ(line_count(bad.out), 1u) << bad.out;
    EXPECT_NE(bad.out.find(flag + ": " + not_one_of(v.names(), "Nope")), std::string::npos) << bad.out;
    EXPECT_FALSE(fs::exists(scratch() / "never.safetensors"));
  }
  EXPECT_EQ(offered, (std::set<std::string>{"gate", "gate_base", "beta", "state_layout", "precision"}));
}

TEST(Cli, TruncatedOrMalformedFilesGiveAOneLineErrorAndExitTwo) {
  const fs::path g = golden("kda_t1");
  std::ifstream in(g, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  const std::vector<std::pair<std::string, std::string>> broken = {
      {"truncated_data.safetensors", bytes.substr(0, bytes.size() - 5)},
      {"truncated_header.safetensors", bytes.substr(0, 20)},
      {"tiny.safetensors", bytes.substr(0, 3)},
      {"empty.safetensors", ""},
      {"garbage.safetensors", std::string("\x10\x00\x00\x00\x00\x00\x00\x00{not json at all", 24)},
  };
  for (const auto& [name, content] : broken) {
    const fs::path path = scratch() / name;
    std::ofstream(path, std::ios::binary) << content;
    for (const std::string& args :
         {"compare --golden " + g.string() + " --candidate " + path.string(),
          "compare --golden " + path.string() + " --candidate " + g.string(),
          "kda --in " + path.string() + " --out " + (scratch() / "o.safetensors").string()}) {
      const CommandResult r = k3ref(args);
      EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
      EXPECT_EQ(line_count(r.out), 1u) << args << "\n" << r.out;
      EXPECT_NE(r.out.find(name), std::string::npos) << "error must name the file: " << r.out;
    }
  }
  EXPECT_EQ(k3ref("kda --in " + (scratch() / "missing.safetensors").string() + " --out x.safetensors").code, 2);
}

TEST(Cli, KdaCommandAtGoldenPrecisionReproducesTheGoldenExactly) {
  // kda_gate_lower_bound_base2: lower-bound gate with A_log and dt_bias in base 2.
  const fs::path g = golden("kda_gate_lower_bound_base2");
  const fs::path out = scratch() / "kda_out.safetensors";
  const CommandResult r = k3ref("kda --in " + g.string() + " --out " + out.string() +
                      " --gate lower_bound --lower-bound -5 --gate-base 2 --precision mp256");
  ASSERT_EQ(r.code, 0) << r.out;
  const CommandResult cmp = k3ref("compare --golden " + g.string() + " --candidate " + out.string() + " --policy exact");
  EXPECT_EQ(cmp.code, 0) << cmp.out;
  // In double: not bitwise, but far inside any policy.
  const CommandResult d = k3ref("kda --in " + g.string() + " --out " + out.string() +
                      " --gate lower_bound --lower-bound -5 --gate-base 2 --precision double");
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_EQ(k3ref("compare --golden " + g.string() + " --candidate " + out.string() + " --policy rel-rms:1e-12").code, 0);
  // A wrong option is an error naming the argument, exit 2.
  const CommandResult bad = k3ref("kda --in " + g.string() + " --out " + out.string() + " --gate lower_bound");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("lower_bound"), std::string::npos) << bad.out;
}

// `k3ref kda` writes a golden of kda.recurrent: `compare` takes it as the golden of a
// candidate (the same file passes, a perturbed one fails), and it records every option.
TEST(Cli, KdaOutputIsAGoldenThatCompareTakes) {
  const fs::path dir = scratch() / "kda_golden";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path ref = dir / "ref.safetensors", cand = dir / "cand.safetensors";
  const CommandResult made = k3ref("kda --in " + golden("kda_gate_lower_bound").string() + " --out " + ref.string() +
                                   " --gate lower_bound --lower-bound -5 --beta sigmoid --l2norm --scale 0.25");
  ASSERT_EQ(made.code, 0) << made.out;
  const io::SafetensorsFile file = io::read_safetensors(ref);
  EXPECT_EQ(file.metadata.at("k3ref.schema"), golden::golden_schema_version);
  EXPECT_EQ(file.metadata.at("k3ref.outputs"), "o,final_state");
  const auto params = nlohmann::json::parse(file.metadata.at("k3ref.params"));
  EXPECT_EQ(params.at("gate"), "lower_bound");
  EXPECT_EQ(params.at("lower_bound"), -5.0);
  EXPECT_EQ(params.at("beta"), "sigmoid");
  EXPECT_EQ(params.at("qk_l2norm"), true);
  EXPECT_EQ(params.at("scale"), 0.25);
  const auto options = nlohmann::json::parse(file.metadata.at("k3ref.options"));
  EXPECT_EQ(options.at("l2norm"), true);
  EXPECT_EQ(options.at("lower_bound"), -5.0);
  const CommandResult same = k3ref("compare --golden " + ref.string() + " --candidate " + ref.string() +
                                   " --policy recommended");
  EXPECT_EQ(same.code, 0) << same.out;
  io::SafetensorsFile perturbed = file;
  for (auto& [name, t] : perturbed.tensors) {
    Tensor<double> v = io::to_f64(t, name);
    for (double& x : v.values()) x = -x;
    t = io::from_f64(v, t.dtype);
  }
  io::write_safetensors_atomic(cand, perturbed);
  const CommandResult wrong = k3ref("compare --golden " + ref.string() + " --candidate " + cand.string());
  EXPECT_EQ(wrong.code, 1) << wrong.out;
}

TEST(Cli, GoldenListNamesEveryCase) {
  const CommandResult r = k3ref("golden list");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("kda_varlen"), std::string::npos);
  const std::size_t all = golden::suite("default").size();
  EXPECT_NE(r.out.find(std::to_string(all) + " of the " + std::to_string(all) + " cases"), std::string::npos) << r.out;
  // --op: one operator or a prefix; --json: every case with all its parameters.
  const CommandResult chunk = k3ref("golden list --op kda.chunkwise");
  EXPECT_EQ(chunk.code, 0);
  EXPECT_NE(chunk.out.find("kda_chunkwise_fla_c64_t100"), std::string::npos);
  EXPECT_NE(chunk.out.find("kda_chunkwise_flashkda_c16_b2_t37"), std::string::npos);
  EXPECT_EQ(chunk.out.find("kda_varlen "), std::string::npos);
  const CommandResult json = k3ref("golden list --json --op qb.");
  ASSERT_EQ(json.code, 0);
  const auto listed = nlohmann::json::parse(json.out);
  ASSERT_FALSE(listed.empty());
  for (const auto& c : listed) EXPECT_EQ(c.at("op").get<std::string>().rfind("qb.", 0), 0u) << c.dump();
  const CommandResult unknown = k3ref("golden list --op nope");
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.out.find("kda.recurrent"), std::string::npos) << unknown.out;  // the operators there are
}

TEST(Cli, GoldenListKernelListsTheGoldensInsideItsDomain) {
  // FlashKDA takes K = V = 128 only: its FlashKDA-like goldens, none of K = 32.
  const CommandResult r = k3ref("golden list --kernel flashkda.fwd");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("kda_flashkda_varlen_empty_one_token"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("kda_varlen "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("inside the domain of flashkda.fwd"), std::string::npos) << r.out;
  // --kernel with --op and --json: the cases both select.
  const CommandResult json = k3ref("golden list --json --op kda.recurrent --kernel 'fla.chunk_kda[safe_gate]'");
  ASSERT_EQ(json.code, 0) << json.out;
  const auto listed = nlohmann::json::parse(json.out);
  ASSERT_GE(listed.size(), 12u);
  for (const auto& c : listed) EXPECT_EQ(c.at("params").at("gate"), "lower_bound") << c.dump();
  // An unknown kernel: one line naming the known ones, exit 2.
  const CommandResult unknown = k3ref("golden list --kernel nope");
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.out.find("--kernel must be one of fla.chunk_kda, "), std::string::npos) << unknown.out;
  EXPECT_NE(unknown.out.find("vllm.kda_decode, not 'nope'"), std::string::npos) << unknown.out;
}

// ---- hostile arguments, paths and files (the corpus in tests/hostile/ runs many more)

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// A fresh directory per test under the scratch directory.
fs::path fresh_dir(const std::string& name) {
  const fs::path dir = scratch() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void expect_one_line_exit_two(const std::string& args, std::initializer_list<std::string_view> parts) {
  const CommandResult r = k3ref(args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
  EXPECT_EQ(line_count(r.out), 1u) << args << "\n" << r.out;
  for (std::string_view part : parts) EXPECT_NE(r.out.find(part), std::string::npos) << "missing '" << part << "' in: " << r.out;
}

TEST(CliHostile, NonFiniteAndOutOfRangeNumbersAreRefusedNotClampedOrAccepted) {
  const std::string kda = "kda --in " + golden("kda_t1").string() + " --out " + (scratch() / "o.safetensors").string();
  for (const char* value : {"nan", "NaN", "inf", "-inf", "1e999", "0x1p3", "1.5x"})
    expect_one_line_exit_two(kda + " --scale " + value, {"--scale"});
  expect_one_line_exit_two(kda + " --gate lower_bound --lower-bound nan", {"--lower-bound", "not finite"});
  expect_one_line_exit_two(kda + " --threads 4294967297", {"--threads", "outside [1, 1024]"});
  expect_one_line_exit_two(kda + " --threads 0", {"--threads", "outside"});
  const std::string g = golden("kda_b2_t37").string();
  const std::string cmp = "compare --golden " + g + " --candidate " + g;
  // 2^63 was clamped to 2^63 - 1 by CLI11; 2^63 - 1 itself overflowed the window count.
  expect_one_line_exit_two(cmp + " --window 9223372036854775808", {"--window", "outside [0, 9223372036854775807]"});
  expect_one_line_exit_two(cmp + " --window -1", {"--window"});
  const CommandResult huge = k3ref(cmp + " --window 9223372036854775807");
  EXPECT_EQ(huge.code, 0) << huge.out;
  EXPECT_NE(huge.out.find("rel RMS by token window of 9223372036854775807: 0.00e+00\n"), std::string::npos) << huge.out;
  expect_one_line_exit_two("golden verify -j 9223372036854775808", {"-j"});
}

TEST(CliHostile, KdaChecksItsOutputBeforeComputingAndNeverDestroysAnother) {
  const fs::path dir = fresh_dir("kda_out");
  const fs::path in = dir / "in.safetensors";
  fs::copy_file(golden("kda_t1"), in);
  const std::string original = slurp(in);
  const std::string kda = "kda --in " + in.string() + " --out ";
  expect_one_line_exit_two(kda + in.string(), {"--out", "is the input"});
  fs::create_hard_link(in, dir / "hard_link");
  expect_one_line_exit_two(kda + (dir / "hard_link").string(), {"is the input"});
  fs::create_symlink("in.safetensors", dir / "link");
  expect_one_line_exit_two(kda + (dir / "link").string(), {"symbolic link"});
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  expect_one_line_exit_two(kda + (dir / "fifo").string(), {"not a regular file"});
  expect_one_line_exit_two(kda + "/dev/null", {"not a regular file"});
  expect_one_line_exit_two(kda + (dir / "missing" / "o.safetensors").string(), {"missing"});
  expect_one_line_exit_two(kda + "\"" + dir.string() + "/$(printf 'o\\377')\"", {"not valid UTF-8"});
  EXPECT_EQ(slurp(in), original);
  EXPECT_TRUE(fs::is_symlink(dir / "link"));
  EXPECT_TRUE(fs::is_fifo(dir / "fifo"));
  // --force: the input is read whole first, so overwriting it is safe when asked for.
  const CommandResult forced = k3ref(kda + in.string() + " --force");
  EXPECT_EQ(forced.code, 0) << forced.out;
  EXPECT_NE(io::read_safetensors(in).find("o"), nullptr);
  EXPECT_EQ(io::read_safetensors(in).find("q"), nullptr);
}

// Every write is safe: no output is an input (the policy table included) or another output,
// a name too long for its temporary is refused before any work, and a write goes through a
// fresh temporary created exclusively.
TEST(CliHostile, OutputsNeverReplaceInputsOrEachOther) {
  const fs::path dir = fresh_dir("outputs");
  const fs::path table = dir / "t.json";
  fs::copy_file(test::source_root() / "policy" / "policies.json", table);
  const std::string original = slurp(table);
  const std::string compare = "compare --golden " + golden("kda_t1").string() + " --candidate " +
                              golden("kda_t1").string() + " --policy exact ";
  expect_one_line_exit_two(compare + "--policy-table " + table.string() + " --json " + table.string(),
                           {"--json", "is the input"});
  EXPECT_EQ(slurp(table), original);
  expect_one_line_exit_two(compare + "--json " + (dir / "x").string() + " --junit " + (dir / "x").string(),
                           {"--json", "--junit", "name the same file"});
  EXPECT_FALSE(fs::exists(dir / "x"));
  const std::string long_name = std::string(240, 'n');
  expect_one_line_exit_two("kda --in " + golden("kda_t1").string() + " --out " + (dir / long_name).string(),
                           {"--out", "beyond the 255-byte limit"});
  const CommandResult ok = k3ref(compare + "--json " + (dir / "v.json").string());
  EXPECT_EQ(ok.code, 0) << ok.out;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"t.json", "v.json"}));  // no temporary left behind
}

// golden generate: one writer per directory at a time; an interrupted run's temporaries do not
// block the next run, which removes them.
TEST(CliHostile, GoldenGenerateLocksItsDirectoryAndRecoversItsTemporaries) {
  const fs::path dir = fresh_dir("generate_lock");
  std::ofstream(dir / ("kda_t1.safetensors.tmp." + std::to_string(::getpid()) + ".0badcafe")) << "half a file";
  std::ofstream(dir / "MANIFEST.json.tmp.1.00000001") << "{";
  const std::string generate = "golden generate -q --only kda_t1 --out " + dir.string();
  {
    const io::DirectoryLock held(dir, "test");
    expect_one_line_exit_two(generate, {"another k3ref is writing there now"});
  }
  const CommandResult r = k3ref(generate);
  ASSERT_EQ(r.code, 0) << r.out;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"MANIFEST.json", "kda_t1.safetensors"}));
  EXPECT_EQ(slurp(dir / "kda_t1.safetensors"), slurp(golden("kda_t1")));
}

TEST(CliHostile, KdaBoundsTheWorkOfInputsWithoutTokens) {
  // T = 0 and 2^36 value heads in 336 bytes: looped for hours (--no-final-state) or
  // allocated 2^36 states; B = 2^40 sequences allocated per-sequence tables.
  const fs::path dir = fresh_dir("kda_work");
  for (const auto& [B, HV] : {std::pair<std::int64_t, std::int64_t>{1, std::int64_t{1} << 36}, {std::int64_t{1} << 40, 1}}) {
    io::SafetensorsFile file;
    for (const char* name : {"q", "k"}) file.tensors.emplace_back(name, io::RawTensor{DType::F64, {B, 0, 1, 1}, {}});
    for (const char* name : {"v", "g"}) file.tensors.emplace_back(name, io::RawTensor{DType::F64, {B, 0, HV, 1}, {}});
    file.tensors.emplace_back("beta", io::RawTensor{DType::F64, {B, 0, HV}, {}});
    const fs::path in = dir / "no_tokens.safetensors";
    io::write_safetensors_atomic(in, file);
    for (const char* flags : {"", " --no-final-state"})
      expect_one_line_exit_two("kda --in " + in.string() + " --out " + (dir / "o.safetensors").string() + flags,
                               {"no_tokens.safetensors", "sequence-heads, over the limit of 1048576"});
  }
  EXPECT_FALSE(fs::exists(dir / "o.safetensors"));
  // T = 0 with K = V = 12000: a few hundred bytes that ask for 1.1 GB of state (a 2.1 GiB
  // estimate in double, 19 GiB at 256 bits), refused before any allocation past the budget.
  io::SafetensorsFile wide;
  for (const char* name : {"q", "k"}) wide.tensors.emplace_back(name, io::RawTensor{DType::F64, {1, 0, 1, 12000}, {}});
  wide.tensors.emplace_back("v", io::RawTensor{DType::F64, {1, 0, 1, 12000}, {}});
  wide.tensors.emplace_back("g", io::RawTensor{DType::F64, {1, 0, 1, 12000}, {}});
  wide.tensors.emplace_back("beta", io::RawTensor{DType::F64, {1, 0, 1}, {}});
  const fs::path in = dir / "wide.safetensors";
  io::write_safetensors_atomic(in, wide);
  for (const char* flags : {" --memory-budget 512M", " --memory-budget 4G --precision mp256"})
    expect_one_line_exit_two("kda --in " + in.string() + " --out " + (dir / "o.safetensors").string() + flags,
                             {"wide.safetensors", "of memory", "over the budget of", "--memory-budget"});
  expect_one_line_exit_two("kda --in " + in.string() + " --out " + (dir / "o.safetensors").string() +
                               " --memory-budget 12Q",
                           {"--memory-budget", "'12Q'"});
  EXPECT_FALSE(fs::exists(dir / "o.safetensors"));
}

TEST(CliHostile, GoldenGenerateNeverDestroysFilesItDidNotWrite) {
  const fs::path dir = fresh_dir("generate");
  // --only into a directory whose manifest lists more cases: refused, even with --force
  // (it rewrote the committed 69-case MANIFEST.json as a 1-case one).
  fs::create_directories(dir / "suite");
  const fs::path committed_manifest = golden("kda_t1").parent_path() / "MANIFEST.json";
  fs::copy_file(committed_manifest, dir / "suite" / "MANIFEST.json");
  for (const char* force : {"", " --force"})
    expect_one_line_exit_two("golden generate -q --only kda_t1 --out " + (dir / "suite").string() + force,
                             {"--only writes a subset suite of 1 case(s)", "give --out a fresh directory"});
  EXPECT_EQ(slurp(dir / "suite" / "MANIFEST.json"), slurp(committed_manifest));
  // A user's files: a name colliding with a case, or any other file, is not overwritten.
  fs::create_directories(dir / "mine");
  std::ofstream(dir / "mine" / "kda_t1.safetensors") << "my notes";
  expect_one_line_exit_two("golden generate -q --only kda_t1 --out " + (dir / "mine").string(),
                           {"'kda_t1.safetensors'", "k3ref did not write"});
  EXPECT_EQ(slurp(dir / "mine" / "kda_t1.safetensors"), "my notes");
  // --only X --only X: one case, a manifest its own verifier accepts; regenerating into
  // k3ref's own subset suite is allowed.
  const std::string twice = "golden generate -q --only kda_t1 --only kda_t1 --out " + (dir / "subset").string();
  ASSERT_EQ(k3ref(twice).code, 0);
  ASSERT_EQ(k3ref(twice).code, 0);
  const golden::Manifest subset = golden::read_manifest(dir / "subset" / "MANIFEST.json");
  EXPECT_TRUE(subset.subset);
  ASSERT_EQ(subset.cases.size(), 1u);
  const CommandResult verify = k3ref("golden verify -q --subset --dir " + (dir / "subset").string());
  EXPECT_EQ(verify.code, 0) << verify.out;
  EXPECT_NE(verify.out.find("(a subset: 1 of "), std::string::npos) << verify.out;
  // Without --subset a subset suite does not verify: fewer cases than the suite holds.
  const CommandResult unasked = k3ref("golden verify -q --dir " + (dir / "subset").string());
  EXPECT_EQ(unasked.code, 1) << unasked.out;
  EXPECT_NE(unasked.out.find("verifying a subset needs --subset"), std::string::npos) << unasked.out;
  // A subset manifest listing nothing verifies nothing, and says so, --subset or not.
  {
    nlohmann::json m = nlohmann::json::parse(slurp(dir / "subset" / "MANIFEST.json"));
    m["cases"] = nlohmann::json::array();
    fs::create_directories(dir / "empty");
    std::ofstream(dir / "empty" / "MANIFEST.json") << m.dump();
    const CommandResult empty = k3ref("golden verify -q --subset --dir " + (dir / "empty").string());
    EXPECT_EQ(empty.code, 1) << empty.out;
    EXPECT_NE(empty.out.find("lists no case: nothing to verify"), std::string::npos) << empty.out;
  }
  // With --force the user's directory is written.
  EXPECT_EQ(k3ref("golden generate -q --only kda_t1 --force --out " + (dir / "mine").string()).code, 0);
  EXPECT_EQ(slurp(dir / "mine" / "kda_t1.safetensors"), slurp(golden("kda_t1")));
}

TEST(CliHostile, GoldenVerifyNamesFilesByTheirOwnPathAndRefusesAnUnreadableManifest) {
  const fs::path dir = fresh_dir("verify");
  fs::create_directories(dir / "suite");
  fs::create_directories(dir / "generated");
  const std::string args =
      "golden verify -q --subset --dir " + (dir / "suite").string() + " --generated " + (dir / "generated").string();
  ASSERT_EQ(k3ref("golden generate -q --only kda_t1 --out " + (dir / "suite").string()).code, 0);
  std::ofstream(dir / "generated" / "kda_t1.safetensors") << std::string("\x10\0\0\0\0\0\0\0{\"o\":[1]}       ", 24);
  const CommandResult bad = k3ref(args);
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_NE(bad.out.find("DIFFERENT " + (dir / "generated" / "kda_t1.safetensors").string() +
                         ": regenerated file is unreadable"),
            std::string::npos)
      << bad.out;
  // The manifest: a FIFO, /dev/zero, deep params: one line, exit 2, at once.
  fs::remove(dir / "suite" / "MANIFEST.json");
  ASSERT_EQ(::mkfifo((dir / "suite" / "MANIFEST.json").c_str(), 0600), 0);
  expect_one_line_exit_two(args, {"MANIFEST.json", "is a FIFO"});
  fs::remove(dir / "suite" / "MANIFEST.json");
  fs::create_symlink("/dev/zero", dir / "suite" / "MANIFEST.json");
  expect_one_line_exit_two(args, {"MANIFEST.json", "is a character device"});
  fs::remove(dir / "suite" / "MANIFEST.json");
  std::ofstream(dir / "suite" / "MANIFEST.json")
      << R"({"format":"k3ref-golden-manifest","suite":"default","generator_version":"1","cases":[{"params":)"
      << std::string(100000, '[') << std::string(100000, ']') << "}]}";
  expect_one_line_exit_two(args, {"MANIFEST.json", "nested more than 64 deep"});
}

// ---- k3ref inputs: a seeded input file for k3ref kda, with no other writer

std::string slurp(const fs::path& path);
fs::path fresh_dir(const std::string& name);
void expect_one_line_exit_two(const std::string& args, std::initializer_list<std::string_view> parts);

// The same arguments give the same bytes (the file's name is not in it); another seed gives
// other values; the metadata records the seed, every option and the command that draws the
// file again, which does.
TEST(Cli, InputsAreReproducibleFromTheirSeed) {
  const fs::path dir = fresh_dir("inputs_seed");
  const std::string args = " --cu-seqlens 0,3,3,20 --H 2 --HV 4 --K 8 --V 12 --gate softplus --beta sigmoid";
  for (const char* name : {"a", "b"})
    ASSERT_EQ(k3ref("inputs --out " + (dir / name).string() + args + " --seed 7").code, 0);
  ASSERT_EQ(k3ref("inputs --out " + (dir / "c").string() + args + " --seed 8").code, 0);
  EXPECT_TRUE(slurp(dir / "a") == slurp(dir / "b"));  // (not EXPECT_EQ: no bytes dumped on a failure)
  EXPECT_TRUE(slurp(dir / "a") != slurp(dir / "c"));
  const io::SafetensorsFile a = io::read_safetensors(dir / "a"), c = io::read_safetensors(dir / "c");
  for (const char* t : {"q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"})
    EXPECT_NE(a.at(t, "a").bytes, c.at(t, "c").bytes) << t;
  EXPECT_EQ(a.at("cu_seqlens", "a"), c.at("cu_seqlens", "c"));
  EXPECT_EQ(a.metadata.at("k3ref.seed"), "7");
  EXPECT_EQ(c.metadata.at("k3ref.seed"), "8");
  const auto options = nlohmann::json::parse(a.metadata.at("k3ref.options"));
  EXPECT_EQ(options.at("HV"), 4);
  EXPECT_EQ(options.at("T"), 20);
  EXPECT_EQ(options.at("cu_seqlens"), (std::vector<int>{0, 3, 3, 20}));
  EXPECT_EQ(options.at("gate"), "softplus");
  EXPECT_EQ(options.at("dtype"), "bf16");
  EXPECT_EQ(a.metadata.at("k3ref.kda_args"), "--gate softplus --beta sigmoid");
  EXPECT_EQ(a.at("q", "a").shape, (Shape{1, 20, 2, 8}));
  EXPECT_EQ(a.at("initial_state", "a").shape, (Shape{3, 4, 8, 12}));
  // k3ref.command, with its file named, draws the same bytes again.
  std::string again = a.metadata.at("k3ref.command");
  ASSERT_EQ(again.rfind("k3ref inputs --out FILE ", 0), 0u) << again;
  again.replace(0, std::string("k3ref inputs --out FILE").size(), "inputs --out " + (dir / "again").string());
  ASSERT_EQ(k3ref(again).code, 0) << again;
  EXPECT_TRUE(slurp(dir / "again") == slurp(dir / "a"));
  // The file is not a golden: compare refuses it as one.
  EXPECT_EQ(k3ref("compare --golden " + (dir / "a").string() + " --candidate " + (dir / "a").string()).code, 2);
}

// The inputs -> kda -> compare path of docs/verify-your-kernel.md, for the options that shape
// the inputs: kda takes the file with the options the file names (k3ref.kda_args), its
// output passes compare against itself and a candidate with one element changed fails.
TEST(Cli, InputsFeedKdaWhoseReferenceCompareJudges) {
  const fs::path dir = fresh_dir("inputs_kda");
  const std::vector<std::string> configurations = {
      "",
      "--cu-seqlens 0,5,5,12 --H 2 --HV 4 --K 8 --V 12 --state-layout v_first --gate softplus --seed 3",
      "--B 2 --T 9 --gate lower_bound --lower-bound -5 --gate-base 2 --beta sigmoid --l2norm --scale 0.3 --dtype f32",
      "--B 3 --T 7 --gate decay_factor --dtype f64 --no-initial-state --beta two_sigmoid --l2norm",
  };
  for (std::size_t i = 0; i < configurations.size(); ++i) {
    SCOPED_TRACE(configurations[i]);
    const fs::path in = dir / ("in" + std::to_string(i) + ".safetensors");
    const fs::path ref = dir / ("ref" + std::to_string(i) + ".safetensors");
    const fs::path cand = dir / ("cand" + std::to_string(i) + ".safetensors");
    const CommandResult made = k3ref("inputs --out " + in.string() + " " + configurations[i]);
    ASSERT_EQ(made.code, 0) << made.out;
    const io::SafetensorsFile inputs = io::read_safetensors(in);
    const std::string kda_args = inputs.metadata.at("k3ref.kda_args");
    EXPECT_NE(made.out.find("its reference: k3ref kda --in " + in.string() + " --out ref.safetensors"), std::string::npos)
        << made.out;
    // In the operator's domain: beta in [0, 1] as given, log-decays in [-1, 0].
    if (configurations[i].empty()) {
      const Tensor<double> beta = io::to_f64(inputs.at("beta", "in"), "beta"), g = io::to_f64(inputs.at("g", "in"), "g");
      for (double b : beta.values()) EXPECT_TRUE(b >= 0 && b <= 1) << b;
      for (double x : g.values()) EXPECT_TRUE(x >= -1 && x <= 0) << x;
    }
    const CommandResult kda = k3ref("kda --in " + in.string() + " --out " + ref.string() + " " + kda_args);
    ASSERT_EQ(kda.code, 0) << kda.out;
    const CommandResult same = k3ref("compare --golden " + ref.string() + " --candidate " + ref.string());
    EXPECT_EQ(same.code, 0) << same.out;
    io::SafetensorsFile perturbed = io::read_safetensors(ref);
    for (auto& [name, t] : perturbed.tensors)
      if (name == "o") {
        Tensor<double> o = io::to_f64(t, name);
        o.values()[o.values().size() / 2] = 2 * o.values()[o.values().size() / 2] + 1;
        t = io::from_f64(o, t.dtype);
      }
    io::write_safetensors_atomic(cand, perturbed);
    const CommandResult wrong = k3ref("compare --golden " + ref.string() + " --candidate " + cand.string());
    EXPECT_EQ(wrong.code, 1) << wrong.out;
  }
}

TEST(CliHostile, InputsRefusesBadArgumentsInOneLineBeforeWriting) {
  const fs::path dir = fresh_dir("inputs_bad");
  const std::string inputs = "inputs --out " + (dir / "x.safetensors").string();
  const std::vector<std::pair<std::string, std::vector<std::string_view>>> bad = {
      {" --T 5 --cu-seqlens 0,5", {"--T excludes --cu-seqlens"}},
      {" --cu-seqlens 0,5,x", {"--cu-seqlens", "'x' is not a decimal integer"}},
      {" --cu-seqlens 1,5", {"--cu-seqlens", "must start at 0"}},
      {" --cu-seqlens 0,5,3", {"--cu-seqlens", "non-decreasing"}},
      {" --cu-seqlens 0,5 --B 2", {"--cu-seqlens", "--B 1"}},
      {" --K 0", {"--K", "outside [1, "}},
      {" --V 0", {"--V", "outside [1, "}},
      {" --H 2 --HV 3", {"--HV 3 must be a multiple of --H 2"}},
      {" --H 4 --HV 2", {"--HV 2 must be a multiple of --H 4"}},
      {" --T 1e3", {"--T", "not a decimal integer"}},
      {" --T 268435457", {"--T", "outside [0, 268435456]"}},
      {" --B 99999999999999999999", {"--B", "outside"}},
      {" --B 1000 --HV 2000", {"sequence-heads, over k3ref kda's limit of 1048576"}},
      {" --T 100000 --K 4096", {"q and k", "over k3ref kda's limit of 268435456"}},
      {" --T 1000000 --K 128 --memory-budget 1G", {"of memory", "over the budget of 1.00 GiB", "--memory-budget"}},
      {" --memory-budget 12Q", {"--memory-budget", "'12Q'"}},
      {" --seed -1", {"--seed", "not a decimal integer"}},
      {" --seed 18446744073709551616", {"--seed", "outside [0, 18446744073709551615]"}},
      {" --dtype f16", {"--dtype", "must be one of bf16, f32, f64, not 'f16'"}},
      {" --gate nope", {"--gate", "not 'nope'"}},
      {" --gate lower_bound", {"--gate lower_bound needs --lower-bound"}},
      {" --gate lower_bound --lower-bound 1", {"--lower-bound 1 must be negative"}},
      {" --lower-bound -5", {"--lower-bound is only used by --gate lower_bound"}},
      {" --scale nan", {"--scale", "not finite"}},
      {" --B", {"--B"}},
  };
  for (const auto& [args, parts] : bad) {
    const CommandResult r = k3ref(inputs + args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_EQ(line_count(r.out), 1u) << args << "\n" << r.out;
    for (std::string_view part : parts) EXPECT_NE(r.out.find(part), std::string::npos) << "missing '" << part << "' in: " << r.out;
  }
  expect_one_line_exit_two("inputs", {"--out"});
  EXPECT_FALSE(fs::exists(dir / "x.safetensors"));
  // The output path, checked before drawing: never a symlink's target, a FIFO or a device
  // without --force, never a name whose temporary is too long; no temporary is left.
  std::ofstream(dir / "target") << "mine";
  fs::create_symlink("target", dir / "link");
  expect_one_line_exit_two("inputs --out " + (dir / "link").string(), {"--out", "symbolic link"});
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  expect_one_line_exit_two("inputs --out " + (dir / "fifo").string(), {"not a regular file"});
  expect_one_line_exit_two("inputs --out " + (dir / "missing" / "x").string(), {"missing"});
  expect_one_line_exit_two("inputs --out " + (dir / std::string(240, 'n')).string(), {"beyond the 255-byte limit"});
  EXPECT_EQ(slurp(dir / "target"), "mine");
  // A regular file is replaced, as kda's --out is; --force replaces the link, not its target.
  ASSERT_EQ(k3ref("inputs --out " + (dir / "target").string()).code, 0);
  EXPECT_NE(io::read_safetensors(dir / "target").find("q"), nullptr);
  std::ofstream(dir / "target") << "mine";
  ASSERT_EQ(k3ref("inputs --force --out " + (dir / "link").string()).code, 0);
  EXPECT_FALSE(fs::is_symlink(dir / "link"));
  EXPECT_EQ(slurp(dir / "target"), "mine");
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"fifo", "link", "target"}));
}

}  // namespace
}  // namespace k3ref
