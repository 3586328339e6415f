// The pool is std::thread, started one thread at a time: Boost.Asio's thread_pool starts all
// of its threads in its constructor, and when the system refuses one (an address-space or
// process limit) it threw with the started ones still waiting and deadlocked joining them.
// Started one by one, a refused thread only means fewer helpers: the caller's thread drains
// the items too, so the run completes with the threads it got. What is ours beyond that is
// the shared item counter and the deterministic choice of exception.
#include "k3ref/exec/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "k3ref/num/scalar.h"

namespace k3ref::exec {

void parallel_for(std::int64_t count, int threads, const std::function<void(std::int64_t)>& work) {
  const std::int64_t n = std::max<std::int64_t>(1, std::min<std::int64_t>(threads, count));
  std::exception_ptr failure;
  std::int64_t failed_item = count;
  std::mutex failure_lock;
  std::atomic<std::int64_t> next{0};
  auto drain = [&] {
    for (std::int64_t i; (i = next.fetch_add(1)) < count;) {
      try {
        work(i);
      } catch (...) {
        std::lock_guard lock(failure_lock);
        if (i < failed_item) {
          failed_item = i;
          failure = std::current_exception();
        }
      }
    }
  };
  std::vector<std::thread> helpers;
  helpers.reserve(static_cast<std::size_t>(n - 1));
  for (std::int64_t t = 1; t < n; ++t) {
    try {
      helpers.emplace_back([&] {
        drain();
        num::release_thread_caches();
      });
    } catch (const std::system_error&) {
      break;  // the system gives no more threads: the ones running, and this one, do all items
    }
  }
  drain();
  for (std::thread& h : helpers) h.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace k3ref::exec
