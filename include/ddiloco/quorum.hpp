// ddiloco/quorum.hpp: when the syncer merges a fragment round (minimum quorum
// plus adaptive grace window: docs/algorithm.md, "Quorum and grace window",
// docs/quorum.md, and the paper's Eq. 3).
//
// What it is: a pure decision function. The caller (a syncer, a simulator)
// keeps one RoundState per open fragment round, tells the policy how long
// inner steps and merges take, and asks "merge now, or wait until when?"
// with "now" read from an injected clock (ddiloco/clock.hpp). Decisions are
// returned values; quorum not reached is an outcome, never an exception.
// What it is not: a timer, a thread or a clock. It never sleeps and never
// reads the time itself; the caller wakes up at WaitDecision::until (or on the
// next contribution) and asks again.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <limits>
#include <optional>
#include <string_view>

#include "clock.hpp"
#include "error.hpp"

namespace ddiloco {

/// Configuration of the quorum/grace policy. Every field is validated by
/// QuorumPolicy's constructor.
struct QuorumConfig {
  /// K: minimum number of distinct contributions before a merge (K >= 1).
  /// K = 1 never stalls; K = M is synchronous (bounded by `deadline`).
  std::size_t min_quorum = 1;
  /// tau: inner steps between a learner's send and the step at which it
  /// applies the result (docs/algorithm.md, "Schedule"). The grace window may only use the
  /// part of tau * xi_step that quorum and merge leave over.
  std::size_t overlap = 2;
  /// gamma in [0, 1]: safety factor on the slack (not published; 0.2-0.5 sensible).
  double gamma = 0.3;
  /// Upper bound of the grace window ("about one inner step" in the paper).
  Duration cap = std::chrono::seconds(1);
  /// Hard bound on a round, measured from its start: at start + deadline the
  /// round merges with whatever has arrived, even below K (> 0).
  Duration deadline = std::chrono::seconds(60);
  /// beta in (0, 1]: weight of a new sample in every moving average.
  /// 0.1 follows roughly the last ten samples; 1 keeps only the latest.
  double ema_beta = 0.1;
  /// false: merge as soon as the quorum forms (no grace window).
  bool grace = true;
};

/// The per-round bookkeeping the caller keeps for one open round of one
/// fragment, and passes to decide() each time something changes.
struct RoundState {
  /// When the round started: the arrival time of its first contribution.
  /// Learners expect the merged fragment tau steps after their own send, so
  /// the earliest sender's budget is the tightest: the round's clock runs from
  /// the earliest send, not from the quorum or the latest send.
  TimePoint start{0};
  /// Distinct learners that have contributed to this round (c_steps >= 1).
  std::size_t contributions = 0;
  /// Learners currently alive (could still contribute to this round).
  std::size_t alive = 0;
  /// Of those, the ones known to train (the syncer: alive and trained a step
  /// since they joined); unset: every alive learner. A round with every
  /// training learner in and its quorum met (or every alive learner in) does
  /// not wait for ids that only joined or only send heartbeats.
  std::optional<std::size_t> training;
  /// When the quorum first formed. decide() sets it (to `now`) the first time
  /// it sees the quorum unless the caller has already set it to the exact
  /// arrival time of the K-th contribution.
  std::optional<TimePoint> quorum_at;
  /// The latest merge time fixed when the quorum formed:
  /// min(quorum_at + grace, start + deadline). Set by decide(); the grace is
  /// frozen for the round so later EMA updates do not move the target.
  std::optional<TimePoint> merge_by;
  /// True once xi_quorum has been fed from this round (once per round).
  bool quorum_observed = false;
};

/// What the caller should do with a round.
struct WaitDecision {
  enum class Kind {
    merge_now,   ///< merge the contributions that are in, now
    wait_until,  ///< wait for more contributions, at most until `until`
    idle,        ///< no contribution: nothing to merge, no round open
  };
  Kind kind = Kind::idle;
  /// merge_now: `now`; wait_until: the time to ask again at the latest;
  /// idle: `now` (meaningless).
  TimePoint until{0};
  /// Why (a static string, for logs and counters).
  std::string_view reason;
};

/// WaitPolicy: what a syncer needs from a policy that decides when to merge.
/// A type P models WaitPolicy when, for `p` a P lvalue, `r` a RoundState
/// lvalue, `t` a TimePoint and `d` a Duration:
///  1. P opts in explicitly with a member type `P::wait_policy_tag`.
///  2. `p.decide(r, t)` returns a WaitDecision; it may update `r` (quorum
///     time, frozen merge target) and the policy's own statistics, but reads
///     no clock: `t` is the only notion of time.
///  3. decide() never returns wait_until with `until` later than
///     `r.start + deadline`, and returns merge_now for a round with at least
///     one contribution once `t >= r.start + deadline`.
///  4. decide() returns idle exactly when `r.contributions == 0`.
///  5. `p.observe_step_time(d)` and `p.observe_sync_time(d)` feed the
///     policy's estimates of the inner-step time and of merge + send-back time.
///  6. `p.grace()` returns the grace window (a Duration >= 0) the policy would
///     grant a round whose quorum forms now.
template <class P>
concept WaitPolicy = requires(P& p, RoundState& r, TimePoint t, Duration d) {
  typename P::wait_policy_tag;
  { p.decide(r, t) } -> std::same_as<WaitDecision>;
  p.observe_step_time(d);
  p.observe_sync_time(d);
  { p.grace() } -> std::same_as<Duration>;
};

namespace detail {
/// a + d without overflowing TimePoint's range (saturates at its maximum).
inline TimePoint saturating_add(TimePoint a, Duration d) noexcept {
  using Rep = TimePoint::rep;
  constexpr Rep hi = std::numeric_limits<Rep>::max();
  if (d.count() > 0 && a.count() > hi - d.count()) return TimePoint{hi};
  return a + d;
}

/// An exponential moving average: ema <- (1 - beta) * ema + beta * sample;
/// the first sample initialises it (so it has no bias towards zero).
class Ema {
 public:
  explicit Ema(double beta) : beta_(beta) {}
  void add(double sample) noexcept {
    value_ = has_value_ ? (1.0 - beta_) * value_ + beta_ * sample : sample;
    has_value_ = true;
  }
  [[nodiscard]] double value() const noexcept { return value_; }
  [[nodiscard]] bool has_value() const noexcept { return has_value_; }

 private:
  double beta_;
  double value_ = 0.0;
  bool has_value_ = false;
};
}  // namespace detail

/// Minimum quorum K plus the adaptive grace window of Eq. 3.
///
/// The syncer keeps one policy per fragment: each fragment's moving averages
/// (step time, time to quorum, time to merge and send) are learnt from its own
/// rounds, so a large fragment's longer merge does not shorten a small one's
/// window; the per-round state lives in RoundState, one per open round.
///
/// Maths (docs/algorithm.md, "Quorum and grace window"; paper Eq. 3):
///     slack = tau * xi_step - (xi_quorum + xi_sync)
///     grace = clamp(gamma * slack, 0, cap)
/// xi_step: inner-step time; xi_quorum: time from a round's start to its
/// quorum; xi_sync: merge + send-back time; each an EMA
///     ema <- (1 - beta) * ema + beta * sample,   first sample initialises.
/// An EMA with no sample yet counts as 0 (so with no step time observed the
/// slack is <= 0 and the grace window is 0: never wait on an unknown budget).
///
/// Decision rules, in order, for a round r at time `now`:
///  1. r.contributions == 0                      -> idle.
///  2. r.contributions >= r.alive, or r.training is set, r.contributions >=
///     r.training and r.contributions >= min(K, r.alive)
///                                               -> merge now (nobody left to wait for).
///  3. r.contributions >= K: the first time, set r.quorum_at (if unset),
///     feed xi_quorum with quorum_at - start, then freeze
///     r.merge_by = min(quorum_at + grace, start + deadline);
///     merge now if grace is off or now >= merge_by, else wait until merge_by.
///  4. r.contributions < K: wait until start + deadline; at or after it,
///     merge with whatever is there. This also bounds K > alive.
class QuorumPolicy {
 public:
  using wait_policy_tag = void;

  explicit QuorumPolicy(QuorumConfig config = {})
      : config_(validated(config)), step_(config.ema_beta), quorum_(config.ema_beta), sync_(config.ema_beta) {}

  [[nodiscard]] const QuorumConfig& config() const noexcept { return config_; }

  /// One inner step took `d` (feeds xi_step). Negative samples are a bug.
  void observe_step_time(Duration d) { step_.add(seconds(check_sample(d, "observe_step_time"))); }
  /// One merge + send-back took `d` (feeds xi_sync).
  void observe_sync_time(Duration d) { sync_.add(seconds(check_sample(d, "observe_sync_time"))); }
  /// A round reached its quorum `d` after its start (feeds xi_quorum).
  /// decide() calls this itself once per round; call it directly only when
  /// you make decisions without decide().
  void observe_quorum_time(Duration d) { quorum_.add(seconds(check_sample(d, "observe_quorum_time"))); }

  [[nodiscard]] double ema_step_seconds() const noexcept { return step_.value(); }
  [[nodiscard]] double ema_quorum_seconds() const noexcept { return quorum_.value(); }
  [[nodiscard]] double ema_sync_seconds() const noexcept { return sync_.value(); }

  /// slack = tau * xi_step - (xi_quorum + xi_sync), in seconds (may be negative).
  [[nodiscard]] double slack_seconds() const noexcept {
    return static_cast<double>(config_.overlap) * step_.value() - (quorum_.value() + sync_.value());
  }

  /// grace = clamp(gamma * slack, 0, cap); 0 when the grace window is off.
  [[nodiscard]] Duration grace() const noexcept {
    if (!config_.grace) return Duration{0};
    const double g = config_.gamma * slack_seconds();
    const double cap = seconds(config_.cap);
    if (!(g < cap)) return config_.cap;  // also keeps huge caps clear of overflow below
    const double clamped = std::max(g, 0.0);
    // Rounded to the nearest nanosecond, then bounded by the cap again.
    const auto ns = std::llround(clamped * 1e9);
    return std::min(Duration{static_cast<Duration::rep>(ns)}, config_.cap);
  }

  /// The decision for round `r` at time `now` (rules in the class comment).
  [[nodiscard]] WaitDecision decide(RoundState& r, TimePoint now) {
    if (r.contributions == 0) return {WaitDecision::Kind::idle, now, "no contribution"};
    const TimePoint hard = detail::saturating_add(r.start, config_.deadline);
    if (r.contributions >= r.alive) return {WaitDecision::Kind::merge_now, now, "every alive learner contributed"};
    if (r.training && r.contributions >= *r.training && r.contributions >= std::min(config_.min_quorum, r.alive))
      return {WaitDecision::Kind::merge_now, now, "every training learner contributed"};
    if (r.contributions >= config_.min_quorum) {
      if (!r.quorum_at) r.quorum_at = now;
      if (!r.quorum_observed) {
        observe_quorum_time(std::max(Duration{0}, *r.quorum_at - r.start));
        r.quorum_observed = true;
      }
      if (!r.merge_by) r.merge_by = std::min(detail::saturating_add(*r.quorum_at, grace()), hard);
      if (now >= *r.merge_by) {
        return {WaitDecision::Kind::merge_now, now, config_.grace ? "quorum reached, grace window over" : "quorum reached"};
      }
      return {WaitDecision::Kind::wait_until, *r.merge_by, "quorum reached, in grace window"};
    }
    if (now >= hard) return {WaitDecision::Kind::merge_now, now, "deadline reached below quorum"};
    return {WaitDecision::Kind::wait_until, hard, "below quorum"};
  }

 private:
  static double seconds(Duration d) noexcept { return std::chrono::duration<double>(d).count(); }

  static Duration check_sample(Duration d, const char* what) {
    if (d < Duration{0}) {
      throw InvalidArgument(detail::msg("QuorumPolicy::", what, ": duration ", d.count(),
                                        " ns is negative; pass the elapsed time end - start of a monotonic clock"));
    }
    return d;
  }

  static QuorumConfig validated(const QuorumConfig& c) {
    if (c.min_quorum < 1) {
      throw InvalidArgument(detail::msg("QuorumConfig::min_quorum (K) = ", c.min_quorum,
                                        " must be >= 1; use K = 1 to merge as soon as one learner has contributed"));
    }
    if (!(c.gamma >= 0.0 && c.gamma <= 1.0)) {
      throw InvalidArgument(detail::msg("QuorumConfig::gamma = ", c.gamma,
                                        " must be in [0, 1]; it is a safety factor on the slack (0.2-0.5 is sensible)"));
    }
    if (c.cap < Duration{0}) {
      throw InvalidArgument(detail::msg("QuorumConfig::cap = ", c.cap.count(),
                                        " ns must be >= 0; use about one inner step, or 0 to disable the grace window"));
    }
    if (c.deadline <= Duration{0}) {
      throw InvalidArgument(detail::msg("QuorumConfig::deadline = ", c.deadline.count(),
                                        " ns must be > 0; every round needs a hard bound on its wait"));
    }
    if (!(c.ema_beta > 0.0 && c.ema_beta <= 1.0)) {
      throw InvalidArgument(detail::msg("QuorumConfig::ema_beta = ", c.ema_beta,
                                        " must be in (0, 1]; 0.1 averages roughly the last ten samples"));
    }
    return c;
  }

  QuorumConfig config_;
  detail::Ema step_;
  detail::Ema quorum_;
  detail::Ema sync_;
};

/// The quorum policy without a grace window: merge as soon as K contributions
/// are in (or every alive learner has contributed, or the deadline passed).
class NoGrace : public QuorumPolicy {
 public:
  explicit NoGrace(QuorumConfig config = {}) : QuorumPolicy(without_grace(config)) {}

 private:
  static QuorumConfig without_grace(QuorumConfig c) {
    c.grace = false;
    return c;
  }
};

}  // namespace ddiloco
