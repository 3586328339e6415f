// Linked into every test program: prints the RapidCheck seed its properties run with, taken
// from RC_PARAMS (tests/meson.build fixes one for CI; unset, RapidCheck draws one at random),
// so a run that fails can be replayed with the printed RC_PARAMS even before RapidCheck's own
// "reproduce" line for the shrunk case.
#include <gtest/gtest.h>
#include <rapidcheck/detail/Configuration.h>

#include <cstdio>
#include <cstdlib>

namespace {

class PrintRapidCheckSeed : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* params = std::getenv("RC_PARAMS");
    const unsigned long long seed = rc::detail::configuration().testParams.seed;
    std::printf("RapidCheck seed %llu (RC_PARAMS=%s); replay with RC_PARAMS=\"seed=%llu\"\n", seed,
                params ? params : "unset", seed);
  }
};

::testing::Environment* const print_seed = ::testing::AddGlobalTestEnvironment(new PrintRapidCheckSeed);

}  // namespace
