// Progress lines of a long computation: whether to print them is decided before it starts,
// from an estimate of its duration, so that a call estimated under the threshold prints
// nothing, and one above it says so at once and then every few seconds how far it is.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <condition_variable>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>

namespace k3ref::exec {

// Seconds `units` of work take at `seconds_per_unit` on one thread, spread over at most
// `threads` threads, one per independent item, and no more than the machine runs at once.
inline double estimated_seconds(double units, double seconds_per_unit, std::int64_t items, int threads) {
  const std::int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const std::int64_t parallel = std::max<std::int64_t>(1, std::min<std::int64_t>({items, threads, cores}));
  return units * seconds_per_unit / static_cast<double>(parallel);
}

class ProgressLines {
 public:
  using Sink = std::function<void(const std::string& line)>;
  // Calls estimated to take longer than this print progress (the default of every front end).
  static constexpr double default_after_seconds = 5;
  // A line at most this often while the work runs.
  static constexpr double every_seconds = 2;

  // `total` units named `unit` ("token-heads"); lines start with `what` ("k3ref kda"). Active
  // when `estimate` (seconds) is at least `after` (negative: never; 0: always) and a sink is given.
  ProgressLines(std::string what, std::string unit, std::int64_t total, double estimate, double after, Sink sink)
      : what_(std::move(what)), unit_(std::move(unit)), total_(total), estimate_(estimate), sink_(std::move(sink)),
        active_(sink_ && after >= 0 && estimate >= after), start_(Clock::now()), last_(start_) {
    if (active_)
      emit(what_ + ": about " + seconds(estimate) + " s estimated for " + std::to_string(total_) + " " + unit_ +
           "; progress every " + seconds(every_seconds) + " s");
  }

  ~ProgressLines() { stop_ticking(); }
  ProgressLines(const ProgressLines&) = delete;
  ProgressLines& operator=(const ProgressLines&) = delete;

  bool active() const { return active_; }

  // For work that reports no units as it goes: a line every every_seconds from a thread of
  // its own (elapsed against the estimate) until finish(), which counts the whole total done.
  void tick() {
    if (!active_ || ticked_) return;
    ticked_ = true;
    ticker_ = std::jthread([this](std::stop_token stop) {
      std::mutex m;
      std::unique_lock lock(m);
      std::condition_variable_any wake;
      for (;;) {
        wake.wait_for(lock, stop, std::chrono::duration<double>(every_seconds), [] { return false; });
        if (stop.stop_requested()) return;
        const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
        std::lock_guard line(line_);
        emit(what_ + ": " + seconds(elapsed) + " s elapsed of about " + seconds(estimate_) + " s estimated");
      }
    });
  }

  // `units` more done; from any thread. Prints a line when the last one is old enough and no
  // other thread is printing (never waits for one).
  void add(std::int64_t units) {
    const std::int64_t done = done_.fetch_add(units, std::memory_order_relaxed) + units;
    const Clock::time_point now = Clock::now();
    std::unique_lock lock(line_, std::try_to_lock);
    if (!lock.owns_lock() || std::chrono::duration<double>(now - last_).count() < every_seconds) return;
    last_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double fraction = total_ > 0 ? static_cast<double>(done) / static_cast<double>(total_) : 1;
    std::string line = what_ + ": " + std::to_string(done) + " of " + std::to_string(total_) + " " + unit_ + " (" +
                       std::to_string(static_cast<int>(std::floor(100 * fraction))) + "%), " + seconds(elapsed) +
                       " s elapsed";
    if (fraction > 0) line += ", about " + seconds(elapsed * (1 - fraction) / fraction) + " s left";
    emit(line);
  }

  // The last line, once the work is done.
  void finish() {
    if (!active_) return;
    stop_ticking();
    if (ticked_) done_ = total_;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    std::lock_guard lock(line_);
    emit(what_ + ": " + std::to_string(done_.load()) + " of " + std::to_string(total_) + " " + unit_ + " done in " +
         seconds(elapsed) + " s");
  }

  // Ends the lines of tick() (finish() and the destructor call it too). A sink that needs a
  // lock the caller holds (Python's GIL) must see this called without that lock.
  void stop_ticking() {
    if (!ticker_.joinable()) return;
    ticker_.request_stop();
    ticker_.join();
  }

  // The hook a computation calls with the units it finished (empty when inactive).
  std::function<void(std::int64_t)> hook() {
    if (!active_) return {};
    return [this](std::int64_t units) { add(units); };
  }

 private:
  using Clock = std::chrono::steady_clock;

  static std::string seconds(double s) {
    char text[32];
    std::snprintf(text, sizeof text, s < 10 ? "%.1f" : "%.0f", s);
    return text;
  }

  void emit(const std::string& line) {
    if (active_) sink_(line);
  }

  std::string what_, unit_;
  std::int64_t total_;
  double estimate_;
  Sink sink_;
  bool active_;
  bool ticked_ = false;
  Clock::time_point start_, last_;
  std::atomic<std::int64_t> done_{0};
  std::mutex line_;
  std::jthread ticker_;  // last: joined (by the destructor) before the members it reads go
};

}  // namespace k3ref::exec
