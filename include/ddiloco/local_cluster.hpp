// ddiloco/local_cluster.hpp: M learners and a syncer in one process.
//
// What it is: the harness behind the chaos demo and the integration tests. It
// runs the real OuterLoop and the real Syncer over the in-process transport,
// with a FaultTape that kills, restarts, slows, partitions and adds learners
// and drops, delays, duplicates and reorders messages. Two drivers, same code
// paths:
//   * run_virtual(): one thread, virtual time. Every inner step takes
//     `step_time` x slowdown of virtual time; the driver always advances the
//     clock to the next event (a step finishing, a message arriving, a syncer
//     deadline, a restart, a joining learner's retry). Two runs with the same
//     inputs produce bit-identical global parameters, whatever the machine's
//     load.
//   * run_threaded(): one thread per learner plus a SyncerRuntime with worker
//     threads, on the real steady clock (tests run it under ThreadSanitizer).
// What it is not: a trainer (the user's ClusterTrainer does the inner steps).
//
// Measures (docs/algorithm.md, "Published figures"): goodput = time learners spent computing inner
// steps / time they were provisioned for (dead, joining and waiting time is
// lost); global downtime = time during which no learner was computing;
// merge-free windows = windows of H step times, after the first merge, in
// which some learner was alive but the syncer merged nothing.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <latch>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <thread>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/fault_tape.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/syncer.hpp>
#include <ddiloco/syncer_runtime.hpp>
#include <ddiloco/transport/in_process.hpp>

namespace ddiloco {

/// What the cluster needs from a learner's trainer:
///  1. `T::tensor_type`, an adapted Tensor;
///  2. `t.parameters()` returns the model's tensors in plan order as a
///     std::span<T::tensor_type> that stays valid for the trainer's life;
///  3. `t.inner_step()` runs one inner optimizer step and returns the number
///     of tokens it processed (> 0: OuterLoop::step refuses 0).
template <class T>
concept ClusterTrainer = requires(T& t) {
  typename T::tensor_type;
  { t.parameters() } -> std::same_as<std::span<typename T::tensor_type>>;
  { t.inner_step() } -> std::convertible_to<std::int64_t>;
};

struct ClusterConfig {
  std::size_t learners = 4;        ///< M base learners, ids 0..M-1 (scavenged ones come from the tape)
  OuterLoopConfig outer{};         ///< H, tau, alpha, lock-step; `id` is set per learner
  SyncerConfig syncer{};           ///< K, grace, deadline, staleness, heartbeat time-out
  std::int64_t token_budget = 0;   ///< stop once all learners together processed this many tokens
  /// Threaded driver: each learner also stops after this many inner steps
  /// (0: only the token budget counts). Makes thread tests independent of
  /// how the OS schedules the threads.
  std::uint64_t steps_per_learner = 0;
  FaultTape tape{};                ///< message and learner faults
  std::size_t queue_capacity = 4096;
  /// Virtual driver: duration of one inner step at speed 1.
  Duration step_time = std::chrono::milliseconds(10);
  /// Virtual driver: give up (result.timed_out) after this much virtual time.
  Duration max_time = std::chrono::hours(24);
  /// Threaded driver: merge workers of the syncer runtime.
  std::size_t syncer_workers = 1;
  /// Called with the global parameters every `sample_every` (virtual or real) time.
  Duration sample_every = std::chrono::seconds(1);
  std::function<void(TimePoint, std::span<const float> global, const SyncerStatus&)> on_sample;
};

struct ClusterResult {
  Duration elapsed{0};             ///< virtual (run_virtual) or real (run_threaded) time
  // goodput, global_downtime and the windows are measured by run_virtual()
  // only (they need every learner's state at every instant); run_threaded()
  // leaves them 0.
  double goodput = 0.0;
  Duration global_downtime{0};
  std::size_t windows = 0;                 ///< windows of H step times after the first merge
  std::size_t windows_alive_without_merge = 0;
  std::int64_t tokens = 0;
  std::uint64_t inner_steps = 0;
  std::uint64_t kills = 0, restarts = 0;
  bool timed_out = false;
  SyncerStatus syncer;
  std::vector<OuterLoopStatus> learners;   ///< latest incarnation of each learner id
  std::vector<float> global;               ///< final global parameters, plan order, concatenated
};

namespace detail {

template <class Tensor>
std::vector<float> flatten(std::span<Tensor> params) {
  std::size_t n = 0;
  for (const auto& t : params) n += tensor_size(t);
  std::vector<float> flat(n);
  std::size_t off = 0;
  for (const auto& t : params) {
    const auto k = tensor_size(t);
    read_tensor(t, std::span<float>(flat.data() + off, k));
    off += k;
  }
  return flat;
}

inline void flush(InProcessSyncerTransport& t, Outbox& out) {
  for (auto& o : out) t.send_to(o.to, std::move(o.message));
  out.clear();
}

}  // namespace detail

template <ClusterTrainer Trainer, MergeRule Rule = RadialDirectional, OuterOptimizer Opt = NesterovSGD,
          WeightRule Weights = TokenWeights>
class LocalCluster {
 public:
  using Tensor = typename Trainer::tensor_type;
  /// Makes the trainer of learner `id`; `incarnation` counts restarts (0 first).
  using Factory = std::function<std::unique_ptr<Trainer>(LearnerId id, std::uint64_t incarnation)>;

  LocalCluster(Plan plan, ClusterConfig config, Factory factory, Rule rule = Rule(), Opt opt = Opt(),
               Weights weights = Weights())
      : plan_(std::move(plan)),
        config_(std::move(config)),
        factory_(std::move(factory)),
        rule_(std::move(rule)),
        opt_(std::move(opt)),
        weights_(std::move(weights)) {
    if (config_.learners == 0) throw InvalidArgument("ClusterConfig::learners = 0: a run needs at least one learner");
    if (config_.token_budget <= 0 && config_.steps_per_learner == 0)
      throw InvalidArgument(detail::msg("ClusterConfig::token_budget = ", config_.token_budget,
                                        " must be > 0 (or set steps_per_learner for a threaded run)"));
    if (config_.token_budget <= 0) config_.token_budget = std::numeric_limits<std::int64_t>::max();
    if (config_.step_time <= Duration{0}) throw InvalidArgument("ClusterConfig::step_time must be > 0");
    if (!factory_) throw InvalidArgument("LocalCluster: the trainer factory is empty");
  }

  // ---- virtual time, one thread -------------------------------------------
  ClusterResult run_virtual() {
    VirtualClock clock;
    InProcessNetwork net(clock, config_.tape, config_.queue_capacity);
    auto syncer_link = net.syncer();
    auto first = factory_(0, 0);
    const std::vector<float> initial = detail::flatten(first->parameters());
    Syncer<Rule, Opt, Weights> syncer(plan_, initial, clock, config_.syncer, rule_, opt_, weights_);

    std::vector<Slot> slots;
    for (LearnerId id = 0; id < config_.learners; ++id) slots.push_back(make_slot(id));
    for (const auto& s : config_.tape.scavenges())
      if (s.learner >= config_.learners) slots.push_back(make_slot(s.learner));
    slots[0].trainer = std::move(first);

    ClusterResult result;
    Outbox out;
    std::int64_t tokens = 0;
    TimePoint now = clock.now();
    TimePoint next_sample = now + config_.sample_every;
    std::optional<TimePoint> first_merge;
    std::vector<TimePoint> merge_times;
    std::vector<std::pair<TimePoint, TimePoint>> alive_spans;  // [from, to) with >= 1 learner alive
    bool alive_now = false;
    TimePoint alive_since{0};
    std::uint64_t merges_seen = 0;
    const Duration window = config_.step_time * static_cast<Duration::rep>(config_.outer.sync_every);

    auto presence = [&](const Slot& s) -> std::pair<TimePoint, std::optional<TimePoint>> {
      for (const auto& sc : config_.tape.scavenges())
        if (sc.learner == s.id) {
          std::optional<TimePoint> leave;
          if (sc.leave_step) leave = TimePoint{config_.step_time * static_cast<Duration::rep>(*sc.leave_step)};
          return {TimePoint{config_.step_time * static_cast<Duration::rep>(sc.at_step)}, leave};
        }
      return {TimePoint{0}, std::nullopt};
    };

    while (tokens < config_.token_budget) {
      now = clock.now();
      if (now >= TimePoint{config_.max_time}) {
        result.timed_out = true;
        break;
      }
      // 1. The syncer takes everything that has arrived, then lets time pass.
      while (auto m = syncer_link.try_receive()) {
        syncer.handle(*m, out);
        detail::flush(syncer_link, out);
      }
      syncer.tick(out);
      detail::flush(syncer_link, out);
      if (const auto merges = syncer.merges_total(); merges != merges_seen) {
        merges_seen = merges;
        merge_times.push_back(now);
        if (!first_merge) first_merge = now;
      }
      // 2. Learners, in id order (deterministic).
      for (auto& s : slots) {
        const auto [join_at, leave_at] = presence(s);
        switch (s.state) {
          case State::absent:
            if (now >= join_at && (!leave_at || now < *leave_at)) start_join(s, net, now);
            break;
          case State::joining:
            if (s.outer->poll_join(s.trainer->parameters())) become_running(s, now);
            break;
          case State::waiting:
            s.outer->poll(s.trainer->parameters());
            if (!s.outer->waiting_for_sync()) become_running(s, now);
            break;
          case State::dead:
            if (now >= s.restart_at) {
              ++result.restarts;
              start_join(s, net, now);
            }
            break;
          case State::left: break;
          case State::running:
            if (leave_at && now >= *leave_at) {
              s.outer->leave();
              net.close(s.id);
              s.left_at = now;
              s.state = State::left;
              break;
            }
            if (now < s.next) {
              // Between steps: take what has arrived (a late global is applied on arrival).
              s.outer->poll(s.trainer->parameters());
              break;
            }
            if (auto kill = kill_at(s.id, s.steps); kill && s.killed_at_step != s.steps) {
              s.killed_at_step = s.steps;
              ++result.kills;
              net.close(s.id);
              s.state = State::dead;
              s.restart_at = now + down_time(*kill);
              s.final_status = s.outer->status();
              s.outer.reset();
              s.trainer.reset();
              break;
            }
            {
              const std::int64_t t = s.trainer->inner_step();
              tokens += t;
              ++s.steps;
              ++result.inner_steps;
              s.busy += s.current_step;
              s.outer->step(s.trainer->parameters(), t);
            }
            if (s.outer->waiting_for_sync()) {
              s.state = State::waiting;
            } else {
              s.current_step = step_duration(s);
              s.next = now + s.current_step;
            }
            break;
        }
      }
      // Alive bookkeeping (dead or absent learners are not alive).
      const bool any_alive = std::any_of(slots.begin(), slots.end(), [](const Slot& s) {
        return s.state == State::running || s.state == State::waiting || s.state == State::joining;
      });
      if (any_alive && !alive_now) {
        alive_now = true;
        alive_since = now;
      }
      if (!any_alive && alive_now) {
        alive_spans.emplace_back(alive_since, now);
        alive_now = false;
      }
      if (config_.on_sample && now >= next_sample) {
        config_.on_sample(now, syncer.global_parameters(), syncer.status());
        next_sample = now + config_.sample_every;
      }
      // 3. Advance to the next event.
      std::optional<TimePoint> next;
      auto consider = [&](std::optional<TimePoint> t) {
        if (t && (!next || *t < *next)) next = t;
      };
      consider(net.next_delivery_time());
      consider(syncer.next_wakeup());
      for (const auto& s : slots) {
        const auto [join_at, leave_at] = presence(s);
        if (s.state == State::running) consider(std::min(s.next, leave_at.value_or(s.next)));
        if (s.state == State::waiting) consider(s.outer->next_heartbeat());  // a waiting learner stays alive
        if (s.state == State::joining) consider(s.outer->next_join_retry());  // a lost join is asked again
        if (s.state == State::dead) consider(s.restart_at);
        if (s.state == State::absent && (!leave_at || join_at < *leave_at) && join_at > now) consider(join_at);
      }
      if (!next) {
        result.timed_out = true;  // nothing can happen any more: everyone waits on nothing
        break;
      }
      // Downtime: no learner computing between now and the next event.
      const bool computing = std::any_of(slots.begin(), slots.end(), [](const Slot& s) { return s.state == State::running; });
      if (*next > now) {
        if (!computing) result.global_downtime += *next - now;
        clock.advance_to(*next);
      }
    }
    now = clock.now();
    if (alive_now) alive_spans.emplace_back(alive_since, now);
    result.elapsed = now - TimePoint{0};
    finish(result, slots, syncer, now, tokens);
    count_windows(result, first_merge, merge_times, alive_spans, window, now);
    if (config_.on_sample) config_.on_sample(now, result.global, result.syncer);
    return result;
  }

  // ---- real threads ---------------------------------------------------------
  /// Learners as threads on the steady clock; the syncer on a SyncerRuntime.
  /// Kills take effect at the tape's step; the learner is down for
  /// `down.time` (or down.steps x its mean step time so far) and rejoins.
  ClusterResult run_threaded() {
    SteadyClock clock;
    const TimePoint t0 = clock.now();
    InProcessNetwork net(clock, config_.tape, config_.queue_capacity);
    auto syncer_link = net.syncer();
    auto first = factory_(0, 0);
    const std::vector<float> initial = detail::flatten(first->parameters());
    Syncer<Rule, Opt, Weights> syncer(plan_, initial, clock, config_.syncer, rule_, opt_, weights_);
    SyncerRuntimeConfig rc;
    rc.workers = config_.syncer_workers;
    rc.poll = std::chrono::milliseconds(5);
    SyncerRuntime runtime(syncer, syncer_link, rc);
    runtime.start();

    std::atomic<std::int64_t> tokens{0};
    std::atomic<std::uint64_t> steps{0}, kills{0}, restarts{0};
    std::mutex status_mutex;
    std::vector<OuterLoopStatus> statuses(config_.learners);
    std::stop_source stop;
    std::vector<std::jthread> threads;
    std::vector<std::unique_ptr<Trainer>> firsts(config_.learners);
    // Learners start stepping together, once every one of them has joined.
    std::latch all_joined(static_cast<std::ptrdiff_t>(config_.learners));
    firsts[0] = std::move(first);
    for (LearnerId id = 0; id < config_.learners; ++id) {
      threads.emplace_back([&, id] {
        std::uint64_t incarnation = 0;
        std::uint64_t my_steps = 0;
        std::optional<std::uint64_t> killed_at_step;  // a kill fires once
        std::unique_ptr<Trainer> trainer = std::move(firsts[id]);
        while (!stop.get_token().stop_requested()) {
          if (!trainer) trainer = factory_(id, incarnation);
          auto link = net.learner(id);
          OuterLoopConfig oc = config_.outer;
          oc.id = id;
          OuterLoop<InProcessLearnerTransport, Tensor> outer(plan_, link, oc);
          outer.join(trainer->parameters());
          if (incarnation == 0) all_joined.arrive_and_wait();
          const auto started = std::chrono::steady_clock::now();
          std::uint64_t steps_this_life = 0;
          bool killed = false;
          while (!stop.get_token().stop_requested() && tokens.load() < config_.token_budget &&
                 (config_.steps_per_learner == 0 || my_steps < config_.steps_per_learner)) {
            if (auto k = kill_at(id, my_steps); k && killed_at_step != my_steps) {
              killed_at_step = my_steps;
              kills.fetch_add(1);
              net.close(id);
              const auto mean_step = steps_this_life ? (std::chrono::steady_clock::now() - started) /
                                                           static_cast<std::int64_t>(steps_this_life)
                                                     : std::chrono::steady_clock::duration{std::chrono::milliseconds(1)};
              const Duration down = k->down.steps ? std::chrono::duration_cast<Duration>(
                                                        mean_step * static_cast<std::int64_t>(*k->down.steps))
                                                  : k->down.time;
              // The outage itself: this learner is down for `down`.
              std::mutex m;
              std::condition_variable_any cv;
              std::unique_lock lock(m);
              cv.wait_for(lock, stop.get_token(), down, [] { return false; });
              killed = true;
              break;
            }
            const auto t_step = std::chrono::steady_clock::now();
            const std::int64_t t = trainer->inner_step();
            ++my_steps;
            ++steps_this_life;
            steps.fetch_add(1);
            tokens.fetch_add(t);
            outer.step(trainer->parameters(), t);
            const double f = slowdown(id, my_steps);
            if (f > 1.0) {
              // A slow chip: the step takes f times as long.
              const auto extra = (std::chrono::steady_clock::now() - t_step) * (f - 1.0);
              std::this_thread::sleep_for(extra);
            }
          }
          {
            std::lock_guard lock(status_mutex);
            statuses[id] = outer.status();
          }
          if (!killed) {
            outer.leave();
            break;
          }
          trainer.reset();
          ++incarnation;
          restarts.fetch_add(1);
          net.reopen(id);
        }
      });
    }
    // Wait for the budget: the learner threads end by themselves.
    for (auto& t : threads) t.join();
    runtime.stop();
    ClusterResult result;
    result.elapsed = clock.now() - t0;
    result.tokens = tokens.load();
    result.inner_steps = steps.load();
    result.kills = kills.load();
    result.restarts = restarts.load();
    result.learners = statuses;
    result.syncer = syncer.status();
    result.global = syncer.global_parameters();
    return result;
  }

 private:
  enum class State { absent, joining, running, waiting, dead, left };
  struct Slot {
    LearnerId id = 0;
    State state = State::absent;
    std::uint64_t incarnation = 0;
    std::uint64_t steps = 0;  ///< inner steps over all incarnations (the tape's step index)
    std::unique_ptr<Trainer> trainer;
    std::optional<InProcessLearnerTransport> link;
    std::unique_ptr<OuterLoop<InProcessLearnerTransport, Tensor>> outer;
    TimePoint next{0};
    Duration current_step{0};
    TimePoint restart_at{0};
    TimePoint provisioned_since{0};    ///< first join
    std::optional<TimePoint> left_at;  ///< left the run for good (scavenged learners)
    Duration busy{0};                  ///< time spent computing inner steps
    bool ever_started = false;
    std::optional<std::uint64_t> killed_at_step;  ///< a kill fires once
    OuterLoopStatus final_status{};
  };

  Slot make_slot(LearnerId id) const {
    Slot s;
    s.id = id;
    return s;
  }

  void start_join(Slot& s, InProcessNetwork& net, TimePoint now) {
    if (!s.trainer) s.trainer = factory_(s.id, s.incarnation);
    if (s.state == State::dead) {
      net.reopen(s.id);
      ++s.incarnation;
    } else if (!s.ever_started) {
      s.provisioned_since = now;
      s.ever_started = true;
    }
    s.link.emplace(net.learner(s.id));
    OuterLoopConfig oc = config_.outer;
    oc.id = s.id;
    s.outer = std::make_unique<OuterLoop<InProcessLearnerTransport, Tensor>>(plan_, *s.link, oc);
    s.outer->begin_join(s.trainer->parameters());
    s.state = State::joining;
  }

  void become_running(Slot& s, TimePoint now) {
    s.state = State::running;
    s.current_step = step_duration(s);
    s.next = now + s.current_step;
  }

  Duration step_duration(const Slot& s) const {
    const double f = slowdown(s.id, s.steps);
    return Duration{static_cast<Duration::rep>(static_cast<double>(config_.step_time.count()) * f)};
  }

  double slowdown(LearnerId id, std::uint64_t step) const {
    double f = 1.0;
    for (const auto& sl : config_.tape.slowdowns())
      if (sl.learner == id && step >= sl.from_step && (!sl.to_step || step < *sl.to_step)) f *= sl.factor;
    return f;
  }

  std::optional<Kill> kill_at(LearnerId id, std::uint64_t step) const {
    for (const auto& k : config_.tape.kills())
      if (k.learner == id && k.at_step == step) return k;
    return std::nullopt;
  }

  Duration down_time(const Kill& k) const {
    return k.down.steps ? config_.step_time * static_cast<Duration::rep>(*k.down.steps) : k.down.time;
  }

  void finish(ClusterResult& r, std::vector<Slot>& slots, Syncer<Rule, Opt, Weights>& syncer, TimePoint now,
              std::int64_t tokens) {
    r.tokens = tokens;
    r.syncer = syncer.status();
    r.global = syncer.global_parameters();
    Duration busy{0}, provisioned{0};
    LearnerId max_id = 0;
    for (const auto& s : slots) max_id = std::max(max_id, s.id);
    r.learners.resize(max_id + 1);
    for (auto& s : slots) {
      busy += s.busy;
      if (s.ever_started) provisioned += s.left_at.value_or(now) - s.provisioned_since;
      r.learners[s.id] = s.outer ? s.outer->status() : s.final_status;
    }
    r.goodput = provisioned.count() > 0 ? static_cast<double>(busy.count()) / static_cast<double>(provisioned.count())
                                        : 0.0;
  }

  static void count_windows(ClusterResult& r, std::optional<TimePoint> first_merge,
                            const std::vector<TimePoint>& merges,
                            const std::vector<std::pair<TimePoint, TimePoint>>& alive, Duration window,
                            TimePoint end) {
    if (!first_merge || window <= Duration{0}) return;
    std::size_t mi = 0;
    for (TimePoint w = *first_merge; w + window <= end; w += window) {
      const TimePoint we = w + window;
      ++r.windows;
      while (mi < merges.size() && merges[mi] < w) ++mi;
      const bool merged = mi < merges.size() && merges[mi] < we;
      // Alive for the whole window (a window cut by a total outage is not counted against the syncer).
      const bool alive_all = std::any_of(alive.begin(), alive.end(),
                                         [&](const auto& span) { return span.first <= w && we <= span.second; });
      if (alive_all && !merged) ++r.windows_alive_without_merge;
    }
  }

  Plan plan_;
  ClusterConfig config_;
  Factory factory_;
  Rule rule_;
  Opt opt_;
  Weights weights_;
};

}  // namespace ddiloco
