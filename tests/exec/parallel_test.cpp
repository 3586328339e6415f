// The thread pool (exec/parallel.h): every item runs once whatever the thread count, the
// lowest failing item's exception is the one rethrown, and when the system refuses threads
// the run completes on the ones it gave instead of deadlocking. Progress lines
// (exec/progress.h): none below the threshold, and above it the units of every thread counted.
#include "test_support.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <stdexcept>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "k3ref/exec/parallel.h"
#include "k3ref/exec/progress.h"

namespace k3ref::exec {
namespace {

TEST(ParallelFor, EveryItemRunsOnceForAnyThreadCount) {
  for (int threads : {1, 2, 3, 16, 400}) {
    std::vector<std::atomic<int>> seen(1000);
    parallel_for(1000, threads, [&](std::int64_t i) { ++seen[i]; });
    for (const auto& s : seen) ASSERT_EQ(s.load(), 1) << threads << " threads";
  }
  parallel_for(0, 8, [](std::int64_t) { FAIL() << "no item to run"; });
}

TEST(ParallelFor, TheLowestFailingItemsExceptionIsRethrown) {
  for (int threads : {1, 4}) {
    std::atomic<int> ran{0};
    try {
      parallel_for(100, threads, [&](std::int64_t i) {
        ++ran;
        if (i == 37 || i == 90) throw std::runtime_error("item " + std::to_string(i));
      });
      FAIL() << "expected an exception";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "item 37");
    }
    EXPECT_EQ(ran.load(), 100);  // the other items still ran
  }
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;  // reserves terabytes of address space: no RLIMIT_AS
#else
constexpr bool kAddressSanitizer = false;
#endif

// In a child whose address space leaves room for a few thread stacks only, 400 threads are
// asked for: the run must finish (the parent waits at most 30 s) with every item done.
TEST(ParallelFor, RefusedThreadsDegradeInsteadOfDeadlocking) {
  if (kAddressSanitizer) GTEST_SKIP() << "an address-space limit cannot be set under AddressSanitizer";
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::vector<char> warm(1 << 20, 1);  // touch the heap before the limit
    rlimit as{};
    ::getrlimit(RLIMIT_AS, &as);
    // Room for the process as it is plus about 8 default (8 MiB) thread stacks.
    long pages = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    const rlim_t limit = static_cast<rlim_t>(pages) * ::sysconf(_SC_PAGESIZE) + (64ull << 20);
    as.rlim_cur = limit;
    if (::setrlimit(RLIMIT_AS, &as) != 0) ::_exit(3);
    std::atomic<int> done{0};
    try {
      parallel_for(4000, 400, [&](std::int64_t) { ++done; });
    } catch (...) {
      ::_exit(4);
    }
    ::_exit(done.load() == 4000 ? 0 : 5);
  }
  int status = 0;
  for (int i = 0; i < 3000 && ::waitpid(child, &status, WNOHANG) == 0; ++i) ::usleep(10000);
  if (::waitpid(child, &status, WNOHANG) == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "parallel_for did not finish within 30 s under an address-space limit (a deadlock)";
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: setrlimit failed, 4: threw, 5: items missing";
}

TEST(ProgressLines, NothingBelowTheThresholdOrWhenNever) {
  std::vector<std::string> lines;
  auto sink = [&](const std::string& line) { lines.push_back(line); };
  for (const auto& [estimate, after] : std::initializer_list<std::pair<double, double>>{{4.9, 5.0}, {1e9, -1.0}, {0.0, 1e-9}}) {
    ProgressLines p("work", "items", 10, estimate, after, sink);
    EXPECT_FALSE(p.active()) << estimate << " s estimated, threshold " << after;
    EXPECT_FALSE(p.hook());
    p.add(10);
    p.finish();
  }
  EXPECT_TRUE(lines.empty()) << lines.front();
  ProgressLines no_sink("work", "items", 10, 100, 0, {});
  EXPECT_FALSE(no_sink.active());
}

TEST(ProgressLines, AboveTheThresholdTheFirstAndLastLineCountEveryThreadsUnits) {
  std::vector<std::string> lines;
  ProgressLines p("work", "items", 4000, 5.0, 5.0, [&](const std::string& line) { lines.push_back(line); });
  ASSERT_TRUE(p.active());
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "work: about 5.0 s estimated for 4000 items; progress every 2.0 s");
  const auto hook = p.hook();
  parallel_for(1000, 4, [&](std::int64_t) { hook(4); });
  p.finish();
  // Done well under 2 s: no line in between.
  ASSERT_EQ(lines.size(), 2u) << lines.back();
  EXPECT_EQ(lines[1].rfind("work: 4000 of 4000 items done in ", 0), 0u) << lines[1];
}

TEST(ProgressLines, WorkThatReportsNoUnitsTicksAndEndsWithTheWholeTotalDone) {
  std::vector<std::string> lines;
  {
    ProgressLines p("work", "items", 7, 9.0, 5.0, [&](const std::string& line) { lines.push_back(line); });
    p.tick();
    p.tick();  // a second call starts no second ticker
    p.finish();  // done before the first tick (2 s): the start and the end line only
  }
  ASSERT_EQ(lines.size(), 2u) << lines.back();
  EXPECT_EQ(lines[0], "work: about 9.0 s estimated for 7 items; progress every 2.0 s");
  EXPECT_EQ(lines[1].rfind("work: 7 of 7 items done in ", 0), 0u) << lines[1];
  ProgressLines inactive("work", "items", 7, 1.0, 5.0, [&](const std::string& line) { lines.push_back(line); });
  inactive.tick();  // below the threshold: no thread, no line
  inactive.finish();
  EXPECT_EQ(lines.size(), 2u);
}

}  // namespace
}  // namespace k3ref::exec
