// ddiloco/sim/goodput.hpp: a discrete-event goodput simulator for training
// under chip failures (the Decoupled DiLoCo paper's goodput study,
// docs/algorithm.md, "Published figures").
//
// What it is: a deterministic (by seed) simulation of N chips grouped into
// slices and learners, failing as a Poisson process and recovering after an
// exponentiated-Weibull delay, for three systems:
//   * data_parallel: one job of N chips that restarts on any failure;
//   * elastic: one job that drops the failed slice after a reconfiguration
//     stall and grows back (another stall) when the slice returns;
//   * decoupled: M learners, each an elastic job of N/M chips, streaming
//     fragments (ddiloco::Schedule) to a syncer that merges with the library's
//     QuorumPolicy; a failure stalls only its own learner.
// Outputs goodput, uptime, global downtime and a time series. Cost is linear in
// the number of events (failures, recoveries and, for decoupled, inner steps).
// What it is not: a model of learning quality, and not a network simulator
// (transfers take a fixed latency here; see sim/bandwidth.hpp for bandwidth).
//
// # The model (every constant is a field below, with its default)
// - Chips fail independently at rate 1 / chip_mtbi (default one interruption
//   per chip per year, as in the paper), so the cluster sees a Poisson stream
//   of rate N / chip_mtbi. A failure hits a uniformly random slice position; a
//   failure that hits a position already down is dropped (its chips are not running).
// - A slice of `slice_chips` chips is the unit that fails. A failed slice goes
//   to repair for an exponentiated-Weibull delay (sim/random.hpp) and then
//   joins a pool of spare slices. The pool starts with
//   ceil(spare_fraction x slices) spares outside the N chips (goodput is still
//   counted against N). A position whose slice failed takes a spare from the
//   pool after spare_swap_s; with the pool empty it waits for the next repaired
//   slice (positions are served first come, first served). Every system draws
//   on the same pool. spare_fraction = 0 is a cluster without spares: a
//   position is down for its slice's whole repair.
// - Each slice has a fixed speed factor 1 + speed_cv * Z (Z standard normal,
//   clipped to >= 0.05). A lock-step job runs at its slowest running slice:
//   one inner step takes step_s / min_speed. Goodput is measured against
//   nominal speed, so speed variation alone costs goodput.
// - Work is counted in whole inner steps: a step cut by a failure is lost.
//   A step of a job with `a` running chips yields a * step_s chip-seconds.
// - goodput = useful chip-seconds / (N * horizon).
// - data_parallel: a failure while running stops the job for restart_s
//   (re-schedule onto the spare, reload the checkpoint, warm up). Failures
//   during a restart are absorbed by it. The job needs every position: if one
//   still waits for a slice when the restart ends, it waits too, and restarts
//   again when the slice comes.
// - elastic and each decoupled learner: a slice going down or coming back
//   stalls the job for reconfigure_s; changes during a stall are absorbed by
//   it (with spare_swap_s = 0 the spare comes in during the shrink's stall, so
//   a failure costs one stall). The job then runs on the slices that are up. A
//   job with no slice up waits for one.
// - Limits: with failures rare (chip_mtbi -> infinity, or few chips per job so
//   each job rarely fails) every system's goodput tends to 1 minus the cost of
//   the speed spread, as long as the pool covers the slices in repair (on
//   average slices x slice_chips x E[recovery] / chip_mtbi, 5.6% at the
//   defaults). Without spares an elastic job loses that fraction at any size.
// - decoupled: learner m sends fragment p at the steps Schedule(P, H, tau)
//   says; the contribution reaches the syncer after link_latency_s. The syncer
//   keeps one RoundState per fragment and asks QuorumPolicy::decide on every
//   arrival and at every wake-up it asked for; "alive" learners are those not
//   stalled. A merge costs sync_s (fed to the policy as xi_sync); inner step
//   durations feed xi_step. A learner never waits for a result (it applies it
//   on arrival), but it may hold at most one unmerged contribution per
//   fragment: at its next slot for p, if the previous one is still unmerged,
//   it blocks until that round merges. With K = 1 that never happens (a round
//   merges within the grace cap); with K = M it makes fast learners wait for
//   slow ones.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <queue>
#include <span>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/quorum.hpp>
#include <ddiloco/schedule.hpp>
#include <ddiloco/sim/random.hpp>

namespace ddiloco::sim {

enum class System { data_parallel, elastic, decoupled };

inline const char* system_name(System s) noexcept {
  switch (s) {
    case System::data_parallel: return "data-parallel";
    case System::elastic: return "elastic data-parallel";
    case System::decoupled: return "Decoupled DiLoCo";
  }
  return "?";
}

/// Hardware behaviour: shared by every system (calibrated on the baselines).
struct FailureModel {
  double chip_mtbi_hours = 24.0 * 365.0;  ///< mean time between interruptions of one chip
  double slice_chips = 256.0;             ///< chips per failure/recovery unit
  /// Recovery delay of a failed slice, in seconds. The shape (k < 1: a heavy
  /// tail of long repairs; alpha > 1: few near-instant returns) is an
  /// assumption; the mean is calibrated (goodput depends on it, not on the shape).
  /// Default mean: 1.93 h, the value fitted to the elastic row when the model
  /// had no spares (docs/simulator.md). With the default pool the baselines no
  /// longer depend on it, so it is now an assumption: it sizes the repair
  /// pipeline, and matters when the pool runs dry.
  ExpWeibull recovery = ExpWeibull{1.0, 0.8, 1.5}.with_mean(1.93 * 3600.0);
  double speed_cv = 0.01;  ///< per-slice speed spread (coefficient of variation)
  /// Spare slices, as a fraction of the slices (rounded up; 0: no spares). The
  /// default covers the 5.6% of slices in repair at the other defaults with room
  /// for their fluctuation; an assumption, not calibrated (the baselines do not
  /// move with it while the pool does not run dry).
  double spare_fraction = 0.10;
  double spare_swap_s = 0.0;  ///< from taking a spare to its slice running in the job (0: within the stall)
};

/// The baselines' costs. Defaults: calibrate_baselines() on the goodput table of
/// docs/algorithm.md, "Published figures", with seed 1 and a 72 h horizon (docs/simulator.md).
struct SystemCosts {
  double restart_s = 74.0;     ///< data_parallel: one restart after a failure
  double reconfigure_s = 17.7;  ///< elastic / decoupled learner: one shrink or grow (a spare comes in within it)
};

/// Decoupled DiLoCo's own settings: the paper's defaults, never tuned to goodput.
struct DecoupledConfig {
  std::size_t learners = 8;         ///< M
  std::size_t fragments = 24;       ///< P
  std::size_t sync_every = 24;      ///< H
  std::size_t overlap = 2;          ///< tau
  double link_latency_s = 0.5;      ///< learner -> syncer transfer of one fragment
  double sync_s = 0.5;              ///< merge + send-back of one fragment
  std::size_t min_quorum = 1;       ///< K
  double gamma = 0.3;               ///< grace safety factor
  double grace_cap_steps = 1.0;     ///< cap of the grace window, in inner steps
  double deadline_steps = 24.0;     ///< hard bound on a round, in inner steps (one period H)
};

struct GoodputConfig {
  System system = System::data_parallel;
  double chips = 150'000;
  double horizon_hours = 72.0;
  double step_s = 2.0;  ///< nominal inner-step time (every system)
  std::uint64_t seed = 1;
  FailureModel failures{};
  SystemCosts costs{};
  DecoupledConfig decoupled{};
  double series_bin_s = 0.0;  ///< > 0: record a time series with bins this wide
};

struct SeriesPoint {
  double t_hours = 0;      ///< bin start
  double goodput = 0;      ///< useful chip-seconds in the bin / (N * bin)
  std::uint64_t failures = 0;  ///< failures (accepted) in the bin
};

struct GoodputResult {
  double goodput = 0;                ///< useful / (N * horizon)
  double uptime = 0;                 ///< fraction of time at least one learner trains
  double global_downtime_hours = 0;  ///< time no learner trains
  double horizon_hours = 0;
  std::uint64_t failures = 0;          ///< failures that took a slice (or the job) down
  std::uint64_t reconfigurations = 0;  ///< stalls started (restarts for data_parallel)
  std::uint64_t steps = 0;             ///< inner steps completed (all learners)
  std::uint64_t merges = 0;            ///< decoupled: fragment rounds merged
  double mean_merge_size = 0;          ///< decoupled: contributions per merge
  std::uint64_t blocked_sends = 0;     ///< decoupled: sends that waited for a merge
  std::vector<SeriesPoint> series;
};

namespace detail {

/// The slowest running slice of a job, in amortised O(1) per change: slices
/// sorted by speed once; a cursor on the slowest one that is up.
class SlowestSlice {
 public:
  void init(std::span<const double> speeds, std::size_t first, std::size_t count) {
    order_.resize(count);
    for (std::size_t i = 0; i < count; ++i) order_[i] = first + i;
    std::stable_sort(order_.begin(), order_.end(), [&](std::size_t a, std::size_t b) { return speeds[a] < speeds[b]; });
    rank_.assign(count, 0);
    for (std::size_t r = 0; r < count; ++r) rank_[order_[r] - first] = r;
    first_ = first;
    cursor_ = 0;
  }
  /// Call after slice `s` changed state; `up` tells the states of all slices.
  void changed(std::size_t s, const std::vector<char>& up) {
    const std::size_t r = rank_[s - first_];
    if (up[s] && r < cursor_) cursor_ = r;
    while (cursor_ < order_.size() && !up[order_[cursor_]]) ++cursor_;
  }
  /// Index of the slowest up slice, or npos when none is up.
  [[nodiscard]] std::size_t slowest() const noexcept { return cursor_ < order_.size() ? order_[cursor_] : npos; }
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

 private:
  std::vector<std::size_t> order_;
  std::vector<std::size_t> rank_;
  std::size_t first_ = 0;
  std::size_t cursor_ = 0;
};

inline TimePoint to_time_point(double seconds) { return TimePoint{static_cast<TimePoint::rep>(std::llround(seconds * 1e9))}; }
inline double to_seconds(TimePoint t) { return static_cast<double>(t.count()) * 1e-9; }

class GoodputSim {
 public:
  explicit GoodputSim(const GoodputConfig& c)
      : c_(c), rng_fail_(c.seed), rng_recover_(c.seed ^ 0x9e3779b97f4a7c15ULL), rng_speed_(c.seed ^ 0xbf58476d1ce4e5b9ULL) {
    validate();
    horizon_ = c.horizon_hours * 3600.0;
    m_ = c.system == System::decoupled ? c.decoupled.learners : 1;
    num_slices_ = std::max<std::size_t>(m_, static_cast<std::size_t>(std::llround(c.chips / c.failures.slice_chips)));
    chips_per_slice_ = c.chips / static_cast<double>(num_slices_);
    speed_.resize(num_slices_);
    for (auto& s : speed_) s = std::max(0.05, 1.0 + c.failures.speed_cv * rng_speed_.normal());
    up_.assign(num_slices_, 1);
    spares_ = static_cast<std::size_t>(std::ceil(c.failures.spare_fraction * static_cast<double>(num_slices_) - 1e-9));
    learner_of_.resize(num_slices_);
    learners_.resize(m_);
    for (std::size_t l = 0; l < m_; ++l) {
      auto& L = learners_[l];
      L.first = l * num_slices_ / m_;
      L.count = (l + 1) * num_slices_ / m_ - L.first;
      L.up = L.count;
      for (std::size_t s = L.first; s < L.first + L.count; ++s) learner_of_[s] = l;
      L.slowest.init(speed_, L.first, L.count);
      L.slowest.changed(L.first, up_);
    }
    if (c.series_bin_s > 0) {
      const auto bins = static_cast<std::size_t>(std::ceil(horizon_ / c.series_bin_s));
      series_useful_.assign(bins, 0.0);
      series_failures_.assign(bins, 0);
    }
    if (c.system == System::decoupled) {
      const auto& d = c.decoupled;
      schedule_.emplace(d.fragments, d.sync_every, d.overlap);
      QuorumConfig q;
      q.min_quorum = d.min_quorum;
      q.overlap = d.overlap;
      q.gamma = d.gamma;
      q.cap = to_time_point(d.grace_cap_steps * c.step_s);
      q.deadline = to_time_point(d.deadline_steps * c.step_s);
      policy_.emplace(q);
      rounds_.resize(d.fragments);
      for (auto& L : learners_) {
        L.pending.assign(d.fragments, 0);
      }
    }
  }

  GoodputResult run() {
    const double rate = c_.chips / (c_.failures.chip_mtbi_hours * 3600.0);
    push(rng_fail_.exponential(rate), Kind::failure, 0, 0);
    for (std::size_t l = 0; l < m_; ++l) start_running(l, 0.0);
    while (!queue_.empty()) {
      const Event e = queue_.top();
      queue_.pop();
      if (e.t >= horizon_) break;
      now_ = e.t;
      switch (e.kind) {
        case Kind::failure: on_failure(rate); break;
        case Kind::repaired: on_repaired(); break;
        case Kind::slice_in: on_slice_up(e.a); break;
        case Kind::stall_end: if (learners_[e.a].gen == e.gen) on_stall_end(e.a); break;
        case Kind::step_end: if (learners_[e.a].gen == e.gen) on_step_end(e.a); break;
        case Kind::arrive: on_arrive(e.a, e.b); break;
        case Kind::wake: if (rounds_[e.b].gen == e.gen) decide(e.b); break;
      }
    }
    now_ = horizon_;
    for (std::size_t l = 0; l < m_; ++l) {
      if (running(l) && c_.system != System::decoupled) close_segment(l);
    }
    set_running_count(running_count_);  // integrate uptime to the horizon
    GoodputResult r;
    r.horizon_hours = c_.horizon_hours;
    r.goodput = useful_ / (c_.chips * horizon_);
    r.uptime = up_time_ / horizon_;
    r.global_downtime_hours = (horizon_ - up_time_) / 3600.0;
    r.failures = failures_;
    r.reconfigurations = stalls_;
    r.steps = steps_;
    r.merges = merges_;
    r.mean_merge_size = merges_ ? static_cast<double>(merged_contributions_) / static_cast<double>(merges_) : 0.0;
    r.blocked_sends = blocked_sends_;
    for (std::size_t b = 0; b < series_useful_.size(); ++b) {
      const double t0 = static_cast<double>(b) * c_.series_bin_s;
      const double w = std::min(c_.series_bin_s, horizon_ - t0);
      r.series.push_back({t0 / 3600.0, series_useful_[b] / (c_.chips * w), series_failures_[b]});
    }
    return r;
  }

 private:
  enum class Kind : std::uint8_t { failure, repaired, slice_in, stall_end, step_end, arrive, wake };
  struct Event {
    double t;
    std::uint64_t seq;
    Kind kind;
    std::uint32_t a;  // slice or learner
    std::uint32_t b;  // fragment
    std::uint64_t gen;
    bool operator>(const Event& o) const noexcept { return t != o.t ? t > o.t : seq > o.seq; }
  };
  struct Learner {
    std::size_t first = 0, count = 0, up = 0;
    SlowestSlice slowest;
    bool stalled = false;
    bool blocked = false;
    bool waiting_for_slice = false;  // stalled with every slice down
    bool deferred_send = false;      // unblocked during a stall: send at its end
    std::size_t blocked_on = 0;
    double segment_start = 0;
    double step_len = 0;
    double chips = 0;  // running chips in this segment
    std::uint64_t gen = 0;
    std::uint64_t step = 0;
    std::vector<char> pending;  // decoupled: unmerged contribution per fragment
  };
  struct Round {
    RoundState st;
    bool open = false;
    std::uint64_t gen = 0;
    std::vector<std::uint32_t> contributors;
  };

  void validate() const {
    const auto bad = [](const char* what, double v, const char* fix) {
      throw InvalidArgument(ddiloco::detail::msg("GoodputConfig::", what, " = ", v, ": ", fix));
    };
    if (!(c_.chips >= 1)) bad("chips", c_.chips, "simulate at least one chip");
    if (!(c_.horizon_hours > 0)) bad("horizon_hours", c_.horizon_hours, "must be > 0");
    if (!(c_.step_s > 0)) bad("step_s", c_.step_s, "the inner-step time must be > 0");
    if (!(c_.failures.chip_mtbi_hours > 0)) bad("failures.chip_mtbi_hours", c_.failures.chip_mtbi_hours, "must be > 0");
    if (!(c_.failures.slice_chips >= 1)) bad("failures.slice_chips", c_.failures.slice_chips, "a slice has >= 1 chip");
    if (!(c_.failures.speed_cv >= 0)) bad("failures.speed_cv", c_.failures.speed_cv, "must be >= 0");
    if (!(c_.failures.spare_fraction >= 0 && c_.failures.spare_fraction <= 1e3)) {
      bad("failures.spare_fraction", c_.failures.spare_fraction, "spares per slice, from 0 (none) to 1000");
    }
    if (!(c_.failures.spare_swap_s >= 0)) bad("failures.spare_swap_s", c_.failures.spare_swap_s, "must be >= 0");
    c_.failures.recovery.validate();
    if (!(c_.costs.restart_s >= 0)) bad("costs.restart_s", c_.costs.restart_s, "must be >= 0");
    if (!(c_.costs.reconfigure_s >= 0)) bad("costs.reconfigure_s", c_.costs.reconfigure_s, "must be >= 0");
    if (c_.series_bin_s < 0) bad("series_bin_s", c_.series_bin_s, "use 0 for no time series or a bin width > 0");
    if (c_.system == System::decoupled) {
      const auto& d = c_.decoupled;
      if (d.learners < 1) bad("decoupled.learners", 0, "M must be >= 1");
      if (static_cast<double>(d.learners) > c_.chips / c_.failures.slice_chips) {
        bad("decoupled.learners", static_cast<double>(d.learners), "more learners than slices; use fewer learners or smaller slices");
      }
      if (!(d.link_latency_s >= 0) || !(d.sync_s >= 0)) bad("decoupled.link_latency_s/sync_s", d.link_latency_s, "must be >= 0");
    }
  }

  void push(double t, Kind k, std::size_t a, std::size_t b, std::uint64_t gen = 0) {
    queue_.push(Event{t, seq_++, k, static_cast<std::uint32_t>(a), static_cast<std::uint32_t>(b), gen});
  }

  [[nodiscard]] bool running(std::size_t l) const { return !learners_[l].stalled && !learners_[l].blocked; }

  void set_running_count(std::size_t n) {
    if (running_count_ > 0) up_time_ += now_ - last_count_change_;
    last_count_change_ = now_;
    running_count_ = n;
  }

  void add_useful(double t0, double t1, double amount) {
    useful_ += amount;
    if (series_useful_.empty() || amount <= 0) return;
    const double w = c_.series_bin_s;
    if (t1 <= t0) {
      series_useful_[std::min(series_useful_.size() - 1, static_cast<std::size_t>(t0 / w))] += amount;
      return;
    }
    const double rate = amount / (t1 - t0);
    for (double t = t0; t < t1;) {
      const auto b = std::min(series_useful_.size() - 1, static_cast<std::size_t>(t / w));
      const double end = std::min(t1, static_cast<double>(b + 1) * w);
      series_useful_[b] += rate * (end - t);
      if (end <= t) break;
      t = end;
    }
  }

  // A learner starts (or resumes) running now on the slices that are up.
  void start_running(std::size_t l, double t) {
    auto& L = learners_[l];
    const std::size_t s = L.slowest.slowest();
    L.segment_start = t;
    L.chips = static_cast<double>(L.up) * chips_per_slice_;
    L.step_len = c_.step_s / (c_.system == System::data_parallel ? min_speed_all() : speed_[s]);
    ++L.gen;
    set_running_count(running_count_ + 1);
    if (c_.system == System::decoupled) push(t + L.step_len, Kind::step_end, l, 0, L.gen);
  }

  double min_speed_all() {
    if (min_speed_all_ < 0) min_speed_all_ = *std::min_element(speed_.begin(), speed_.end());
    return min_speed_all_;
  }

  // Whole steps completed in a continuous (non-decoupled) segment.
  void close_segment(std::size_t l) {
    auto& L = learners_[l];
    const double dur = now_ - L.segment_start;
    const auto k = static_cast<std::uint64_t>(std::floor(dur / L.step_len + 1e-12));
    steps_ += k;
    add_useful(L.segment_start, L.segment_start + static_cast<double>(k) * L.step_len,
               static_cast<double>(k) * L.chips * c_.step_s);
  }

  void stall(std::size_t l, double duration) {
    auto& L = learners_[l];
    if (L.stalled) return;  // absorbed by the stall in progress
    if (running(l)) {
      if (c_.system != System::decoupled) close_segment(l);
      set_running_count(running_count_ - 1);
    }
    L.stalled = true;
    ++L.gen;  // cancels the step in progress (its work is lost)
    ++stalls_;
    push(now_ + duration, Kind::stall_end, l, 0, L.gen);
  }

  void on_failure(double rate) {
    push(now_ + rng_fail_.exponential(rate), Kind::failure, 0, 0);
    const std::size_t s = static_cast<std::size_t>(rng_fail_.below(num_slices_));
    const double delay = c_.failures.recovery.sample(rng_recover_);  // drawn always: common random numbers
    if (!up_[s]) return;  // its chips are not running
    const std::size_t l = learner_of_[s];
    if (c_.system == System::data_parallel && learners_[0].stalled) return;  // absorbed by the restart
    count_failure();
    up_[s] = 0;
    --learners_[l].up;
    learners_[l].slowest.changed(s, up_);
    push(now_ + delay, Kind::repaired, 0, 0);  // the failed slice, back in the pool after repair
    stall(l, change_cost());
    if (spares_ > 0) {
      --spares_;
      bring_in(s);
    } else {
      waiting_.push_back(s);
    }
  }

  // A slice from the pool goes to position s: within the stall in progress
  // (spare_swap_s = 0) or after the swap time.
  void bring_in(std::size_t s) {
    if (c_.failures.spare_swap_s > 0) {
      push(now_ + c_.failures.spare_swap_s, Kind::slice_in, s, 0);
    } else {
      on_slice_up(s);
    }
  }

  void on_repaired() {
    if (waiting_.empty()) {
      ++spares_;
      return;
    }
    const std::size_t s = waiting_.front();
    waiting_.pop_front();
    bring_in(s);
  }

  void count_failure() {
    ++failures_;
    if (!series_failures_.empty()) {
      series_failures_[std::min(series_failures_.size() - 1, static_cast<std::size_t>(now_ / c_.series_bin_s))]++;
    }
  }

  void on_slice_up(std::size_t s) {
    up_[s] = 1;
    const std::size_t l = learner_of_[s];
    auto& L = learners_[l];
    ++L.up;
    L.slowest.changed(s, up_);
    const bool data_parallel = c_.system == System::data_parallel;  // runs only on every position
    if (L.waiting_for_slice && (!data_parallel || L.up == L.count)) {
      // Stalled with nothing to run on: restart or reconfigure onto the slices now up.
      L.waiting_for_slice = false;
      ++L.gen;
      ++stalls_;
      push(now_ + change_cost(), Kind::stall_end, l, 0, L.gen);
      return;
    }
    if (!data_parallel) stall(l, c_.costs.reconfigure_s);  // grow back (absorbed by a stall in progress)
  }

  /// The stall a change of the slices costs: a restart (data-parallel) or a reconfiguration.
  [[nodiscard]] double change_cost() const {
    return c_.system == System::data_parallel ? c_.costs.restart_s : c_.costs.reconfigure_s;
  }

  void on_stall_end(std::size_t l) {
    auto& L = learners_[l];
    if (c_.system == System::data_parallel ? L.up < L.count : L.up == 0) {
      L.waiting_for_slice = true;  // nothing to run on (data-parallel: a position is empty): wait for a slice
      return;
    }
    L.stalled = false;
    if (L.blocked) return;  // still waiting for a merge
    start_running(l, now_);
    if (L.deferred_send) {
      L.deferred_send = false;
      send(l, L.blocked_on);
    }
  }

  // ---- decoupled: learners and the syncer ----
  void on_step_end(std::size_t l) {
    auto& L = learners_[l];
    ++L.step;
    ++steps_;
    add_useful(now_ - L.step_len, now_, L.chips * c_.step_s);
    policy_->observe_step_time(to_time_point(L.step_len));
    if (const auto p = schedule_->due_at(L.step)) {
      if (L.pending[*p]) {  // previous contribution to p not merged yet: wait for it
        ++blocked_sends_;
        L.blocked = true;
        L.blocked_on = *p;
        ++L.gen;
        set_running_count(running_count_ - 1);
        return;
      }
      send(l, *p);
    }
    push(now_ + L.step_len, Kind::step_end, l, 0, L.gen);
  }

  void send(std::size_t l, std::size_t p) {
    learners_[l].pending[p] = 1;
    push(now_ + c_.decoupled.link_latency_s, Kind::arrive, l, p);
  }

  [[nodiscard]] std::size_t alive() const {
    std::size_t n = 0;
    for (const auto& L : learners_) n += L.stalled ? 0 : 1;
    return n;
  }

  void on_arrive(std::size_t l, std::size_t p) {
    auto& r = rounds_[p];
    if (!r.open) {
      r.open = true;
      r.st = RoundState{};
      r.st.start = to_time_point(now_);
      r.contributors.clear();
    }
    r.contributors.push_back(static_cast<std::uint32_t>(l));
    r.st.contributions = r.contributors.size();
    decide(p);
  }

  void decide(std::size_t p) {
    auto& r = rounds_[p];
    if (!r.open) return;
    r.st.alive = alive();
    const WaitDecision d = policy_->decide(r.st, to_time_point(now_));
    if (d.kind == WaitDecision::Kind::merge_now) {
      merge(p);
    } else if (d.kind == WaitDecision::Kind::wait_until) {
      ++r.gen;
      push(std::max(now_, to_seconds(d.until)), Kind::wake, 0, p, r.gen);
    }
  }

  void merge(std::size_t p) {
    auto& r = rounds_[p];
    ++merges_;
    merged_contributions_ += r.contributors.size();
    policy_->observe_sync_time(to_time_point(c_.decoupled.sync_s));
    r.open = false;
    ++r.gen;
    for (const std::uint32_t l : r.contributors) {
      auto& L = learners_[l];
      L.pending[p] = 0;
      if (L.blocked && L.blocked_on == p) {
        L.blocked = false;
        if (L.stalled) {
          L.deferred_send = true;  // send when the stall ends
        } else {
          start_running(l, now_);
          send(l, p);
        }
      }
    }
  }

  GoodputConfig c_;
  Rng rng_fail_, rng_recover_, rng_speed_;
  double horizon_ = 0, now_ = 0;
  std::size_t m_ = 1, num_slices_ = 1;
  double chips_per_slice_ = 1;
  std::vector<double> speed_;
  std::vector<char> up_;
  std::vector<std::size_t> learner_of_;
  std::vector<Learner> learners_;
  std::size_t spares_ = 0;             // repaired or spare slices free in the pool
  std::deque<std::size_t> waiting_;    // positions waiting for a slice, oldest first
  double min_speed_all_ = -1;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue_;
  std::uint64_t seq_ = 0;
  double useful_ = 0, up_time_ = 0, last_count_change_ = 0;
  std::size_t running_count_ = 0;
  std::uint64_t failures_ = 0, stalls_ = 0, steps_ = 0, merges_ = 0, merged_contributions_ = 0, blocked_sends_ = 0;
  std::vector<double> series_useful_;
  std::vector<std::uint64_t> series_failures_;
  std::optional<Schedule> schedule_;
  std::optional<QuorumPolicy> policy_;
  std::vector<Round> rounds_;
};

}  // namespace detail

/// Runs one simulation. Throws InvalidArgument for an invalid configuration.
inline GoodputResult simulate_goodput(const GoodputConfig& config) { return detail::GoodputSim(config).run(); }

/// Closed form for data_parallel with exponential failures of total rate
/// lambda = chips / chip_mtbi, a fixed restart R (failures during it absorbed),
/// no speed spread and work counted in whole steps of length s:
///     up periods U ~ Exp(lambda), each followed by R;
///     useful per period = s * E[floor(U / s)] = s * e^(-lambda s) / (1 - e^(-lambda s))
///     goodput = useful per period / (1 / lambda + R)
/// (-> 1 / (1 + lambda R) as s -> 0: a renewal-reward argument.)
inline double data_parallel_goodput_closed_form(double chips, double chip_mtbi_hours, double restart_s, double step_s) {
  const double lambda = chips / (chip_mtbi_hours * 3600.0);
  const double x = lambda * step_s;
  const double useful = step_s * std::exp(-x) / -std::expm1(-x);
  return useful / (1.0 / lambda + restart_s);
}

}  // namespace ddiloco::sim
