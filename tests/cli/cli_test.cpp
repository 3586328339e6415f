// End-to-end tests of the k3ref command: exit codes (0 pass, 1 fail, 2 unusable input),
// one-line errors on malformed files, and the kda command reproducing a golden.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <sys/wait.h>
#include <unistd.h>

#include "k3ref/io/safetensors.h"
#include "k3ref/num/float_format.h"

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
                          "golden list --help", "kda --help", "compare --help"}) {
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
  EXPECT_NE(fail.out.find("worst element"), std::string::npos) << fail.out;
  EXPECT_EQ(k3ref("compare --golden " + g.string() + " --candidate " + off.string() + " --policy exact").code, 1);
  // Unknown policy and missing tensors are unusable input.
  EXPECT_EQ(k3ref("compare --golden " + g.string() + " --candidate " + g.string() + " --policy nearly").code, 2);
  EXPECT_EQ(k3ref("compare --golden " + g.string() + " --candidate " + g.string() + " --tensors nothing").code, 2);
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

TEST(Cli, GoldenListNamesEveryCase) {
  const CommandResult r = k3ref("golden list");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("kda_varlen"), std::string::npos);
}

}  // namespace
}  // namespace k3ref
