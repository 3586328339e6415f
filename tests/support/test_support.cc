// main() of every C++ test program, the seeds (K3REF_SEED, RapidCheck's RC_PARAMS), the
// repeats (K3REF_REPEAT) and the QB instance generators of test_support.h. This file folds
// in what tests/rc_seed.cpp did (print the RapidCheck seed of the run).
#include "test_support.h"

#include <rapidcheck/detail/Configuration.h>

#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <set>

namespace k3ref::test {
namespace {

std::uint64_t base_seed = 0;  // K3REF_SEED, 0 when unset
int repetition = 0;           // GoogleTest's iteration, from 0

// splitmix64's finaliser: every bit of the input moves every bit of the output.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A whole number from the environment, or `fallback` when unset; exit 2 on anything else.
unsigned long long number_from_environment(const char* name, unsigned long long fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (*end != '\0' || text[0] == '-') {
    std::fprintf(stderr, "%s=%s: expected a whole number\n", name, text);
    std::exit(2);
  }
  return value;
}

unsigned long long rapidcheck_seed() { return rapidcheck_params().seed; }

// Prints the seeds at the start of each repetition and the replay line after each failed test.
class SeedPrinter : public ::testing::EmptyTestEventListener {
 public:
  void OnTestIterationStart(const ::testing::UnitTest&, int iteration) override {
    repetition = iteration;
    const char* params = std::getenv("RC_PARAMS");
    std::printf("K3REF_SEED=%llu (%s); RapidCheck seed %llu (RC_PARAMS=%s); replay with RC_PARAMS=\"seed=%llu\"\n",
                static_cast<unsigned long long>(current_seed()),
                current_seed() == 0 ? "the fixed seeds" : "seeds mixed with it", rapidcheck_seed(),
                params ? params : "unset", rapidcheck_seed());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::printf("K3REF_SEED=%llu to replay %s.%s (RapidCheck: RC_PARAMS=\"seed=%llu\", or the reproduce string it printed)\n",
                static_cast<unsigned long long>(current_seed()), info.test_suite_name(), info.name(),
                rapidcheck_seed());
    std::fflush(stdout);
  }
};

}  // namespace

std::uint64_t current_seed() { return base_seed == 0 && repetition == 0 ? 0 : base_seed + repetition; }

std::uint64_t test_seed(std::uint64_t fixed) {
  const std::uint64_t s = current_seed();
  return s == 0 ? fixed : mix(mix(s) ^ fixed);
}

rc::detail::TestParams rapidcheck_params() {
  rc::detail::TestParams params = rc::detail::configuration().testParams;
  params.seed += static_cast<std::uint64_t>(repetition);
  return params;
}

std::filesystem::path source_root() {
  const char* root = std::getenv("K3REF_SOURCE_ROOT");
  return root ? std::filesystem::path(root) : std::filesystem::path(".");
}

// ---- Quantile Balancing instances ----------------------------------------------------------

QbSizes random_qb_sizes(std::int64_t max_m, std::int64_t max_n) {
  const std::int64_t n = *rc::gen::inRange<std::int64_t>(2, max_n + 1);
  const std::int64_t k = *rc::gen::inRange<std::int64_t>(1, n);
  const std::int64_t step = n / std::gcd(n, k);
  const std::int64_t most = std::max<std::int64_t>(1, max_m / step);
  const std::int64_t m = step * *rc::gen::inRange<std::int64_t>(1, most + 1);
  return QbSizes{m, n, k};
}

Tensor<Q> tie_free_scores(std::int64_t m, std::int64_t n) {
  // Drawn from a seed RapidCheck chooses (and reports on failure): rejection sampling of
  // distinct values on RapidCheck's own shrinking generators would not terminate when shrunk.
  num::Random rng(*rc::gen::arbitrary<std::uint64_t>());
  Tensor<Q> s({m, n});
  std::set<std::uint64_t> used;
  for (Q& x : s.values()) {
    std::uint64_t num;
    do num = rng.below(std::uint64_t{1} << 40);
    while (!used.insert(num).second);
    x = Q(static_cast<std::int64_t>(num)) / Q(std::int64_t{1} << 20);
  }
  return s;
}

Tensor<Q> tie_heavy_scores(std::int64_t m, std::int64_t n) {
  Tensor<Q> s({m, n});
  for (Q& x : s.values()) x = Q(*rc::gen::inRange(0, 4)) / Q(4);
  return s;
}

Tensor<Q> any_scores(std::int64_t m, std::int64_t n) {
  return *rc::gen::arbitrary<bool>() ? tie_free_scores(m, n) : tie_heavy_scores(m, n);
}

std::vector<std::int64_t> random_permutation(std::int64_t n) {
  std::vector<std::int64_t> perm(static_cast<std::size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  for (std::int64_t i = n - 1; i > 0; --i) std::swap(perm[i], perm[*rc::gen::inRange<std::int64_t>(0, i + 1)]);
  return perm;
}

}  // namespace k3ref::test

// K3REF_REPEAT=N is --gtest_repeat=N; K3REF_SEED=n sets the seed of the non-RapidCheck draws.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  k3ref::test::base_seed = k3ref::test::number_from_environment("K3REF_SEED", 0);
  const unsigned long long repeat = k3ref::test::number_from_environment("K3REF_REPEAT", 0);
  if (repeat > 0) GTEST_FLAG_SET(repeat, static_cast<int>(repeat));
  ::testing::UnitTest::GetInstance()->listeners().Append(new k3ref::test::SeedPrinter);
  return RUN_ALL_TESTS();
}
