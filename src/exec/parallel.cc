// The thread pool is Boost.Asio's thread_pool (threads started and joined by the library);
// what is ours is only the shared item counter and the deterministic choice of exception.
#include "k3ref/exec/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

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
  if (n == 1) {
    drain();
  } else {
    boost::asio::thread_pool pool(static_cast<std::size_t>(n));
    for (std::int64_t t = 0; t < n; ++t)
      boost::asio::post(pool, [&] {
        drain();
        num::release_thread_caches();
      });
    pool.join();
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace k3ref::exec
