// The k3ref command line, apart from main() so that the argument handling can be fuzzed.
#pragma once

namespace k3ref::cli {

// Parses and, when `execute` is true, runs a k3ref command. Returns the exit code:
// 0 success / pass, 1 a difference or failed check, 2 unusable input.
int run(int argc, const char* const* argv, bool execute = true);

}  // namespace k3ref::cli
