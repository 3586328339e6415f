// Execution helpers: the one thread pool of the library (src/exec/parallel.cc).
#pragma once

#include <cstdint>
#include <functional>

namespace k3ref::exec {

// Runs work(i) for every i in [0, count) on up to `threads` threads, the caller's among them
// (1: on the caller's thread, in order); when the system refuses a thread, on the threads it
// gave (never a deadlock, never an error). Items are taken in increasing order as threads
// become free; callers give items that write disjoint outputs, so no result depends on the
// thread count. If
// items throw, the remaining items still run and the exception of the lowest-numbered
// failing item is rethrown, so the error message does not depend on the thread count
// either. Helper threads release the scalar tiers' per-thread caches (MPFR) before they end.
void parallel_for(std::int64_t count, int threads, const std::function<void(std::int64_t)>& work);

}  // namespace k3ref::exec
