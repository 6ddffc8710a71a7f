// Tests for ddiloco/syncer_runtime.hpp: the syncer's event loop, with its
// per-fragment contribution queues drained by pool tasks into
// Syncer::handle_batch. Several producer threads deliver contributions; every
// one must be handled exactly once, in order per fragment (an out-of-order or
// repeated one would be rejected as a duplicate). Waits are on latches or on
// the syncer's counters, never on sleeps.
// DDILOCO_TEST_LABEL(threaded)
#include <catch2/catch.hpp>
#include <ddiloco/syncer_runtime.hpp>
#include <ddiloco/transport/in_process.hpp>

#include "syncer_test_util.hpp"

#include <atomic>
#include <condition_variable>
#include <latch>
#include <mutex>
#include <thread>
#include <vector>

using namespace ddiloco;
using namespace std::chrono_literals;

namespace {

Plan small_plan() { return make_plan({{"w", 64, false}, {"b", 16, false}}, 2); }

SyncerConfig k1() {
  SyncerConfig c = test::quorum_config(1);
  c.participation_scaling = true;  // as a syncer runs
  c.heartbeat_timeout = 600s;
  c.max_staleness = std::uint64_t{1} << 40;  // every base stays acceptable: count, do not judge
  c.norm_outlier_factor = 1e9;
  return c;
}

using test::kSeq0;

Message join(const Plan& plan, LearnerId id) { return test::join_message(plan, id, 1000 + id); }

/// A contribution with an honest step counter: it advances by at least `steps` between contributions.
Message contribution(const Plan& plan, LearnerId id, std::size_t p, std::uint64_t seq) {
  return test::contribution_message(plan, id, p, seq, 0, test::filled(plan, p, 0.001f * static_cast<float>(1 + id)),
                                    {4, 64, 4 * seq});
}

/// A Syncer<> on the steady clock behind an in-process network, driven by a
/// SyncerRuntime with `workers` threads, and `learners` joined learners.
struct SteadyRig {
  SteadyClock clock;
  Plan plan = small_plan();
  InProcessNetwork net{clock, {}, std::size_t{1} << 16};
  InProcessSyncerTransport link = net.syncer();
  Syncer<> syncer{plan, std::vector<float>(plan.total_numel(), 0.0f), clock, k1()};
  SyncerRuntime<Syncer<>, InProcessSyncerTransport> runtime;
  SteadyRig(LearnerId learners, SyncerRuntimeConfig rc) : runtime(syncer, link, rc) {
    for (LearnerId id = 1; id <= learners; ++id) runtime.deliver(join(plan, id));
  }
};

// fast::RadialDirectional whose first add() blocks until the test releases it,
// so that contributions queue up behind a running drain; counts batched adds.
struct GatedRda {
  static constexpr std::string_view name = "gated_rda";
  static inline std::latch* entered = nullptr;
  static inline std::latch* release = nullptr;
  static inline std::atomic<std::size_t> adds{0}, batches{0}, batched{0};
  class Accumulator : public fast::RadialDirectional::Accumulator {
   public:
    using Base = fast::RadialDirectional::Accumulator;
    using Base::Base;
    void add(std::span<const float> v, double w) {
      if (adds.fetch_add(1) == 0 && entered) {
        entered->count_down();
        release->wait();
      }
      Base::add(v, w);
    }
    void add_batch(std::span<const fast::Contribution> b) {
      batches.fetch_add(1);
      batched.fetch_add(b.size());
      Base::add_batch(b);
    }
  };
  [[nodiscard]] Accumulator make_accumulator(std::span<const TensorSegment> layout) const {
    return Accumulator(layout);
  }
};

}  // namespace

TEST_CASE(
    "Contributions delivered by several producer threads are each handled exactly once, in order per "
    "fragment",
    "[syncer_runtime]") {
  constexpr LearnerId kProducers = 4;
  constexpr std::uint64_t kPerProducer = 300;
  SyncerRuntimeConfig rc;
  rc.workers = 2;
  SteadyRig rig(kProducers, rc);
  auto& [clock, plan, net, link, syncer, runtime] = rig;
  {
    std::latch go(kProducers);
    std::vector<std::jthread> producers;
    for (LearnerId id = 1; id <= kProducers; ++id) {
      producers.emplace_back([&, id] {  // rig.*: Clang 14 cannot capture structured bindings
        go.arrive_and_wait();
        // Sequences increase per learner, so a reordering within a fragment
        // or a second handling would be rejected as a duplicate.
        for (std::uint64_t i = 1; i <= kPerProducer; ++i)
          rig.runtime.deliver(contribution(rig.plan, id, i % rig.plan.num_fragments(), kSeq0 + i));
      });
    }
  }                // producers joined
  runtime.stop();  // waits for every queued drain
  const auto s = syncer.status();
  INFO(s.line());
  CHECK(s.contributions_accepted == kProducers * kPerProducer);
  CHECK(s.rejected_total() == 0);
  CHECK(s.merges >= 2);
  std::uint64_t in_merges = 0;
  for (std::size_t k = 0; k < s.quorum_sizes.size(); ++k) in_merges += k * s.quorum_sizes[k];
  CHECK(in_merges <= kProducers * kPerProducer);
  CHECK(runtime.task_failures() == 0);
  for (float x : syncer.global_parameters()) CHECK(std::isfinite(x));
}

TEST_CASE(
    "Through the receive thread, every contribution sent by several learner threads is accepted exactly once",
    "[syncer_runtime]") {
  constexpr LearnerId kLearners = 3;
  constexpr std::uint64_t kPerLearner = 200;
  SyncerRuntimeConfig rc;
  rc.workers = 2;
  rc.poll = 1ms;
  SteadyRig rig(kLearners, rc);
  auto& [clock, plan, net, link, syncer, runtime] = rig;
  runtime.start();
  std::atomic<std::size_t> refused{0};
  {
    std::vector<std::jthread> learners;
    for (LearnerId id = 1; id <= kLearners; ++id) {
      learners.emplace_back([&, id] {  // rig.*: Clang 14 cannot capture structured bindings
        auto t = rig.net.learner(id);
        for (std::uint64_t i = 1; i <= kPerLearner; ++i)
          if (!t.send(contribution(rig.plan, id, i % rig.plan.num_fragments(), kSeq0 + i))) refused.fetch_add(1);
      });
    }
  }
  REQUIRE(refused == 0);
  // Wait for the syncer's counter (an event, bounded by a deadline), then stop.
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (syncer.status().contributions_accepted + syncer.status().rejected_total() <
             kLearners * kPerLearner &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::yield();
  runtime.stop();
  const auto s = syncer.status();
  INFO(s.line());
  CHECK(s.contributions_accepted == kLearners * kPerLearner);
  CHECK(s.rejected_total() == 0);
  CHECK(runtime.send_failures() == 0);
}

TEST_CASE(
    "Contributions that queue up behind a running drain are folded with one add_batch and land in one merge",
    "[syncer_runtime]") {
  VirtualClock clock;
  const Plan plan = small_plan();
  InProcessNetwork net(clock, {}, std::size_t{1} << 12);
  auto link = net.syncer();
  std::latch entered(1), release(1);
  GatedRda::entered = &entered;
  GatedRda::release = &release;
  GatedRda::adds = 0;
  GatedRda::batches = 0;
  GatedRda::batched = 0;
  Syncer<GatedRda> syncer(plan, std::vector<float>(plan.total_numel(), 0.0f), clock, k1());
  SyncerRuntimeConfig rc;
  rc.workers = 1;
  SyncerRuntime runtime(syncer, link, rc);
  for (LearnerId id = 1; id <= 4; ++id) runtime.deliver(join(plan, id));
  const std::size_t p = 0;
  runtime.deliver(contribution(plan, 1, p, kSeq0 + 1));
  entered.wait();  // the worker is inside the first contribution's add()
  for (LearnerId id = 2; id <= 4; ++id) runtime.deliver(contribution(plan, id, p, kSeq0 + 1));
  release.count_down();
  runtime.stop();
  GatedRda::entered = nullptr;
  const auto s = syncer.status();
  INFO(s.line());
  CHECK(s.contributions_accepted == 4);
  CHECK(s.fragments[p].merges == 2);  // K = 1: the first alone, then the three queued ones together
  REQUIRE(s.quorum_sizes.size() == 4);
  CHECK(s.quorum_sizes[1] == 1);
  CHECK(s.quorum_sizes[3] == 1);
  CHECK(GatedRda::adds == 1);
  CHECK(GatedRda::batches == 1);
  CHECK(GatedRda::batched == 3);
}

TEST_CASE("Without workers every contribution is handled on the delivering thread, one merge each at K = 1",
          "[syncer_runtime]") {
  VirtualClock clock;
  const Plan plan = small_plan();
  InProcessNetwork net(clock, {}, std::size_t{1} << 12);
  auto link = net.syncer();
  Syncer<> syncer(plan, std::vector<float>(plan.total_numel(), 0.0f), clock, k1());
  SyncerRuntimeConfig rc;
  rc.workers = 0;
  SyncerRuntime runtime(syncer, link, rc);
  runtime.deliver(join(plan, 1));
  runtime.deliver(join(plan, 2));
  for (std::uint64_t i = 1; i <= 10; ++i) {
    runtime.deliver(contribution(plan, 1 + static_cast<LearnerId>(i % 2), 1, kSeq0 + i));
    CHECK(syncer.status().merges == i);  // handled before deliver() returned
  }
  CHECK(syncer.status().contributions_accepted == 10);
}

namespace {

/// A syncer whose batches wait at a gate the test opens: the workers are slow
/// for as long as the test wants, without a timer.
struct GatedSyncer {
  Plan plan_ = small_plan();
  std::mutex mutex;
  std::condition_variable cv;
  bool open = false;
  std::atomic<std::size_t> handled{0};

  const Plan& plan() const { return plan_; }
  void handle(const Message&, Outbox&) {}
  void handle_batch(std::span<const Message> batch, Outbox&) {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return open; });
    handled += batch.size();
  }
  void release_gate() {
    {
      std::lock_guard lock(mutex);
      open = true;
    }
    cv.notify_all();
  }
  std::optional<TimePoint> next_wakeup() const { return std::nullopt; }
  void expire_learners() {}
  std::vector<std::size_t> due_fragments(TimePoint) const { return {}; }
  bool merge_if_due(std::size_t, Outbox&) { return false; }
  SyncerStatus status() const { return {}; }
};

/// A transport holding `n` contributions, counting what was taken from it.
struct CountingTransport {
  SteadyClock steady;
  Plan plan = small_plan();
  std::mutex mutex;
  std::size_t left;
  std::atomic<std::size_t> taken{0};
  explicit CountingTransport(std::size_t n) : left(n) {}
  bool send_to(LearnerId, Message&&) { return true; }
  std::optional<Message> try_receive() {
    std::lock_guard lock(mutex);
    if (left == 0) return std::nullopt;
    --left;
    ++taken;
    return contribution(plan, 1, taken % 2, kSeq0 + taken);
  }
  std::optional<Message> receive_until(TimePoint) { return try_receive(); }
  const Clock& clock() const { return steady; }
};

}  // namespace

TEST_CASE("While the workers are busy the runtime takes at most max_queued contributions from the transport",
          "[syncer_runtime][bounds]") {
  GatedSyncer syncer;
  CountingTransport transport(1000);
  SyncerRuntimeConfig rc;
  rc.workers = 1;
  rc.max_queued = 8;
  SyncerRuntime runtime(syncer, transport, rc);
  runtime.start();
  // The receive thread pauses at the bound instead of draining the transport.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (runtime.receive_pauses() == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  REQUIRE(runtime.receive_pauses() > 0);
  CHECK(transport.taken == 8);
  CHECK(runtime.queued().first == 8);
  CHECK(runtime.queued().second > 0);
  // Open the gate: everything is taken and handled, each exactly once.
  syncer.release_gate();
  while (syncer.handled < 1000 && std::chrono::steady_clock::now() < deadline + 20s) std::this_thread::yield();
  CHECK(syncer.handled == 1000);
  CHECK(transport.taken == 1000);
  runtime.stop();
  CHECK(runtime.queued().first == 0);
  CHECK(runtime.queued().second == 0);
  rc.max_queued = 0;
  CHECK_THROWS_WITH(SyncerRuntime(syncer, transport, rc), Catch::Contains("max_queued = 0"));
}

TEST_CASE("A status callback that blocks does not stall receiving: it runs on a thread of its own",
          "[syncer_runtime]") {
  // The callback of the syncer program writes stdout and a status file; on a
  // disk busy with writeback a write can block for seconds. Here it blocks
  // until every contribution has been taken and handled.
  GatedSyncer syncer;
  syncer.release_gate();
  // Contributions only once the callback is blocked (the old receive thread
  // would be blocked with it).
  struct AfterStatus : CountingTransport {
    using CountingTransport::CountingTransport;
    std::atomic<bool> open{false};
    std::optional<Message> receive_until(TimePoint) { return open ? try_receive() : std::nullopt; }
  } transport(1000);
  std::latch entered(1), release(1);
  std::atomic<int> calls{0};
  SyncerRuntimeConfig rc;
  rc.workers = 1;
  rc.status_every = 1ms;
  rc.on_status = [&](const SyncerStatus&) {
    if (calls.fetch_add(1) == 0) {
      entered.count_down();
      release.wait();
    }
  };
  SyncerRuntime runtime(syncer, transport, rc);
  runtime.start();
  entered.wait();
  transport.open = true;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (syncer.handled < 1000 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  CHECK(syncer.handled == 1000);
  CHECK(calls == 1);  // still inside the first call
  release.count_down();
  while (calls < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  CHECK(calls >= 2);  // and it goes on after it
  runtime.stop();
}
