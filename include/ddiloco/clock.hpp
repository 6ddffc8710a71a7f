// ddiloco/clock.hpp: time as ddiloco sees it.
//
// What it is: one time representation (nanoseconds since a clock's epoch) and
// two clocks: the real steady clock and a virtual clock that only moves when a
// test or a simulation moves it. Timing logic (the quorum/grace policy, the
// syncer runtime, heartbeats) receives "now" from one of these, so it can be
// tested without sleeping.
// What it is not: a timer or a scheduler.
#pragma once

#include <atomic>
#include <chrono>

namespace ddiloco {

using Duration = std::chrono::nanoseconds;
/// A point in time: nanoseconds since the epoch of the clock that produced it.
using TimePoint = std::chrono::nanoseconds;

/// A source of "now". Implementations must be monotonic and thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  [[nodiscard]] virtual TimePoint now() const = 0;
};

/// Real time from std::chrono::steady_clock.
class SteadyClock final : public Clock {
 public:
  [[nodiscard]] TimePoint now() const override {
    return std::chrono::duration_cast<TimePoint>(std::chrono::steady_clock::now().time_since_epoch());
  }
};

/// Time that moves only when told to (tests, simulations, deterministic runs).
class VirtualClock final : public Clock {
 public:
  explicit VirtualClock(TimePoint start = TimePoint{0}) : now_(start.count()) {}
  [[nodiscard]] TimePoint now() const override { return TimePoint{now_.load(std::memory_order_acquire)}; }
  void advance(Duration d) { now_.fetch_add(d.count(), std::memory_order_acq_rel); }
  /// Moves time forward to `t`; never backwards (a monotonic clock).
  void advance_to(TimePoint t) {
    auto cur = now_.load(std::memory_order_acquire);
    while (t.count() > cur && !now_.compare_exchange_weak(cur, t.count(), std::memory_order_acq_rel)) {
    }
  }

 private:
  std::atomic<TimePoint::rep> now_;
};

}  // namespace ddiloco
