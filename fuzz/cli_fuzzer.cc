// libFuzzer target: the k3ref argument handling. The input is split at NUL bytes into
// arguments and parsed (not executed: a fuzzer must not write files where its input says).
// Parsing must return 0 or 2, never crash.
// CLI11 prints usage and errors: run it with -close_fd_mask=3 (libFuzzer keeps its own output).
#include <cstdlib>
#include <string>
#include <vector>

#include "../src/cli/command_line.h"
#include "k3ref/check/policy_table.h"
#include "k3ref/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args{"k3ref"};
  std::string current;
  for (std::size_t i = 0; i < size && args.size() < 64; ++i) {
    if (data[i] == 0) {
      args.push_back(current);
      current.clear();
    } else {
      current.push_back(static_cast<char>(data[i]));
    }
  }
  args.push_back(current);
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  const int code = k3ref::cli::run(static_cast<int>(argv.size()), argv.data(), /*execute=*/false);
  if (code != 0 && code != 2) std::abort();
  // The policy table's parsing of a policy name (parametric forms such as floor:<m>) and
  // the expansion of a golden's output list (brace groups) get each argument too.
  const auto& table = k3ref::check::PolicyTable::builtin();
  for (const auto& a : args) {
    try {
      (void)table.rules(a, "kda.recurrent");
    } catch (const k3ref::InvalidArgument&) {
    }
    try {
      (void)k3ref::check::expand_outputs(a);
    } catch (const k3ref::InvalidArgument&) {
    }
  }
  return 0;
}
