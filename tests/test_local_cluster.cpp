// Integration tests for ddiloco/local_cluster.hpp: several learners and a
// syncer in one process, under seeded fault tapes, in virtual time (one
// thread, deterministic) and as real threads.
// DDILOCO_TEST_LABEL(threaded)
#include <ddiloco/local_cluster.hpp>

#include <catch2/catch.hpp>

#include "cluster_test_util.hpp"

#include <cstdio>

using namespace ddiloco;
using namespace ddiloco::test;
using namespace std::chrono_literals;

namespace {

// The threaded runs: 300 steps per learner, 2 merge workers, 5% duplicates,
// learner 1 killed at its step 60 and back 5 ms later.
ClusterConfig threaded(ClusterConfig c) {
  c.token_budget = 0;
  c.steps_per_learner = 300;
  c.syncer.quorum.cap = 1ms;
  c.syncer_workers = 2;
  MessageFaults f;
  f.duplicate = 0.05;
  c.tape.set_message_faults(f);
  c.tape.add(Kill{1, 60, Downtime{std::nullopt, 5ms}});
  return c;
}

auto heavy_trainers(std::size_t a, std::size_t b) {
  return [a, b](LearnerId id, std::uint64_t inc) { return std::make_unique<QuadraticTrainer>(id, inc, 4, a, b); };
}

}  // namespace

TEST_CASE("Four learners in virtual time train to the global optimum with zero global downtime", "[cluster]") {
  Cluster cluster(quad_plan(2), decoupled(4), factory(4));
  const auto r = cluster.run_virtual();
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.tokens >= 64 * 400 * 4);
  CHECK(distance_to_optimum(r.global) < 0.05);
  CHECK(r.global_downtime == Duration{0});
  CHECK(r.windows > 10);
  CHECK(r.windows_alive_without_merge == 0);
  CHECK(r.syncer.merges > 50);
  CHECK(r.syncer.rejected_total() == 0);
  CHECK(r.goodput > 0.95);
}

TEST_CASE("Two virtual-time runs with the same seed give bit-identical global parameters", "[cluster]") {
  FaultTape tape(7);
  MessageFaults f;
  f.drop = 0.05;
  f.duplicate = 0.05;
  f.reorder = 0.1;
  f.reorder_max = 30ms;
  f.latency = 2ms;
  f.jitter = 3ms;
  tape.set_message_faults(f);
  tape.add(Kill{1, 100, Downtime{50, Duration{0}}});
  ClusterConfig c = decoupled(4);
  c.tape = tape;
  const auto a = Cluster(quad_plan(2), c, factory(4)).run_virtual();
  const auto b = Cluster(quad_plan(2), c, factory(4)).run_virtual();
  REQUIRE(a.global.size() == b.global.size());
  CHECK(a.global == b.global);
  CHECK(a.syncer.merges == b.syncer.merges);
  c.tape.set_seed(8);
  const auto other = Cluster(quad_plan(2), c, factory(4)).run_virtual();
  CHECK(other.global != a.global);
}

TEST_CASE("A killed learner restarts, rejoins with the global state and contributes again; the syncer keeps merging",
          "[cluster]") {
  ClusterConfig c = decoupled(4);
  c.tape.add(Kill{2, 100, Downtime{80, Duration{0}}});
  const auto r = Cluster(quad_plan(2), c, factory(4)).run_virtual();
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.kills == 1);
  CHECK(r.restarts == 1);
  CHECK(r.syncer.joins == 5);
  CHECK(r.learners[2].sends > 0);  // the new incarnation contributed
  CHECK(r.windows_alive_without_merge == 0);
  CHECK(r.global_downtime == Duration{0});
  CHECK(distance_to_optimum(r.global) < 0.05);
  CHECK(r.goodput < 1.0);
  CHECK(r.goodput > 0.9);
}

// With K = 1 every merge applies a full outer (Nesterov) step, so when faults
// scatter the arrivals, merges hold fewer contributions (mean quorum 2.2
// instead of 3.9 here) and the global takes more, smaller-quorum steps: the
// effective outer learning rate rises. Measured on this tape: RMS distance 0.17
// after the budget, against 0.003 without faults and 0.7 at the start. This is
// the effect the grace window exists to counter (docs/algorithm.md, "Quorum and grace
// window"); the test
// asserts the protocol (at-most-once merging, progress), not the optimum.
TEST_CASE("Dropped, duplicated and reordered messages are survived: duplicates are merged at most once", "[cluster]") {
  ClusterConfig c = decoupled(4);
  MessageFaults f;
  f.drop = 0.1;
  f.duplicate = 0.2;
  f.reorder = 0.2;
  f.reorder_max = 50ms;
  f.latency = 1ms;
  c.tape.set_message_faults(f);
  const auto r = Cluster(quad_plan(2), c, factory(4)).run_virtual();
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.syncer.rejected[static_cast<std::size_t>(RejectReason::duplicate)] > 0);
  CHECK(r.syncer.contributions_accepted <= r.learners[0].sends + r.learners[1].sends + r.learners[2].sends +
                                                 r.learners[3].sends);
  CHECK(distance_to_optimum(r.global) < 0.35);  // half the starting distance
}

TEST_CASE("A partitioned learner keeps training and is resynchronised when the partition heals", "[cluster]") {
  ClusterConfig c = decoupled(4);
  c.syncer.max_staleness = 4;
  c.tape.add(Partition{3, 1s, 2500ms});
  const auto r = Cluster(quad_plan(2), c, factory(4)).run_virtual();
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.syncer.deaths >= 1);  // declared dead during the partition
  CHECK(r.learners[3].sends > 0);
  CHECK(r.syncer.rejected[static_cast<std::size_t>(RejectReason::stale)] >= 1);
  CHECK(r.global_downtime == Duration{0});
  CHECK(distance_to_optimum(r.global) < 0.05);
}

TEST_CASE("Learners whose joins are all lost ask again at their join retry, in virtual time too", "[cluster]") {
  // Every learner is cut off while it joins: no message is in flight and no learner computes, so
  // the only event left is each learner's join retry (found by a seed sweep of 5% loss: seed 3537
  // lost a message of each of the four joins and the run stopped at 1 s with nobody joined).
  ClusterConfig c = decoupled(4);
  for (LearnerId id = 0; id < 4; ++id) c.tape.add(Partition{id, 0ms, 50ms});
  const auto r = Cluster(quad_plan(2), c, factory(4)).run_virtual();
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.syncer.joins == 4);  // each join heard once: the copies sent into the partition were lost
  CHECK(r.elapsed >= c.outer.join_retry);  // nothing joined before the first retry
  for (const auto& l : r.learners) CHECK(l.sends > 0);
  CHECK(distance_to_optimum(r.global) < 0.05);
}

TEST_CASE("A scavenged learner joins for a while, contributes and leaves without disturbing the run", "[cluster]") {
  ClusterConfig c = decoupled(2);
  const auto alone = Cluster(quad_plan(2), c, factory(2)).run_virtual();
  c.tape.add(Scavenge{5, 100, 300});
  const auto r = Cluster(quad_plan(2), c, factory(2)).run_virtual();
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.syncer.joins == 3);
  CHECK(r.syncer.leaves == 1);
  REQUIRE(r.learners.size() > 5);
  CHECK(r.learners[5].sends > 0);
  // The scavenger runs out of phase with the others, so while it is present
  // most of its merges hold its progress alone: more outer steps per round
  // (see the faults test). Measured: RMS 0.063 with it, 0.003 without, 0.7 at
  // the start; it must not derail the run.
  CHECK(distance_to_optimum(alone.global) < 0.05);
  CHECK(distance_to_optimum(r.global) < 0.1);
}

TEST_CASE("Lock-step mode with K = M merges every round with all learners (Streaming DiLoCo)", "[cluster]") {
  ClusterConfig c = decoupled(4);
  c.outer.lock_step = true;
  c.syncer.quorum.min_quorum = 4;
  c.syncer.quorum.grace = false;
  const auto r = Cluster(quad_plan(2), c, factory(4)).run_virtual();
  REQUIRE_FALSE(r.timed_out);
  REQUIRE(r.syncer.quorum_sizes.size() == 5);
  CHECK(r.syncer.quorum_sizes[4] == r.syncer.merges);
  CHECK(distance_to_optimum(r.global) < 0.05);
}

TEST_CASE("With a straggler, wait-for-all loses goodput while K = 1 keeps every fast learner busy", "[cluster]") {
  ClusterConfig fast = decoupled(4);
  fast.tape.add(Slowdown{3, 3.0, 0, std::nullopt});
  ClusterConfig sync = fast;
  sync.outer.lock_step = true;
  sync.syncer.quorum.min_quorum = 4;
  sync.syncer.quorum.grace = false;
  const auto a = Cluster(quad_plan(2), fast, factory(4)).run_virtual();
  const auto b = Cluster(quad_plan(2), sync, factory(4)).run_virtual();
  CHECK(a.goodput > 0.95);
  CHECK(b.goodput < 0.8);
  CHECK(a.elapsed < b.elapsed);
}

// Real threads: an inner step must cost more than the syncer's turnaround, as
// in real training (seconds versus milliseconds); tensors of 8192 + 1024
// elements with a Gaussian draw per element make a step ~100x the cost of
// merging it. Threads run out of phase, so with K = 1 most merges hold one
// learner's progress; participation scaling (SyncerConfig) keeps the outer
// step per round at the average progress. Without it this run diverged with
// Nesterov (0.7, 0.9): measured RMS distance 2.5 to 3.9. With it and Nesterov,
// runs still spread from below 0.1 to 0.46 (thread scheduling decides how many
// contributions each merge holds, and momentum amplifies the spread), so this
// test, which is about threads and the protocol, uses plain SGD (lr 0.5): at
// most 0.18 measured over 8 runs. The bound is half the start (0.7).
TEST_CASE("Learners as real threads train to the optimum through the threaded syncer runtime", "[cluster][threads]") {
  static constexpr std::size_t a = 8192, b = 1024;
  const ClusterConfig c = threaded(decoupled(4));
  auto heavy = heavy_trainers(a, b);
  using ThreadedCluster = LocalCluster<QuadraticTrainer, RadialDirectional, PlainSGD, TokenWeights>;
  const auto r = ThreadedCluster(quad_plan(2, a, b), c, heavy, RadialDirectional(), PlainSGD(0.5f)).run_threaded();
  CHECK(r.inner_steps >= 4 * 300);
  CHECK(r.kills == 1);
  CHECK(r.restarts == 1);
  CHECK(r.syncer.merges > 20);
  INFO(r.syncer.line());
  CHECK(distance_to_optimum(r.global) < 0.35);
  std::printf("threaded run: RMS distance %.3f\n", distance_to_optimum(r.global));
}

TEST_CASE("Synchronous data-parallel (H = 1, tau = 0, lock-step) syncs at every step", "[cluster]") {
  ClusterConfig c = decoupled(4);
  c.outer.sync_every = 1;
  c.outer.overlap = 0;
  c.outer.lock_step = true;
  c.syncer.quorum.min_quorum = 4;
  c.syncer.quorum.overlap = 0;
  c.syncer.quorum.grace = false;
  c.token_budget = 64 * 100 * 4;
  const auto r = Cluster(quad_plan(1), c, factory(4)).run_virtual();
  REQUIRE_FALSE(r.timed_out);
  for (std::size_t id = 0; id < 4; ++id) {
    // One send per inner step; before the fix, applying first left nothing to
    // send at every other step.
    CHECK(r.learners[id].sends == r.learners[id].step);
    CHECK(r.learners[id].late_applies == 0);
  }
  CHECK(r.syncer.quorum_sizes.at(4) == r.syncer.merges);
}

// ---- Pull rounds (SyncerConfig::round = pull; docs/algorithm.md, "Round timeline") ----

TEST_CASE("Pull rounds at M = 16 with four 2x stragglers merge each fragment once per H global steps with most "
          "learners, and reject nothing",
          "[cluster][pull]") {
  ClusterConfig c = pulled(decoupled(16));
  for (LearnerId id = 12; id < 16; ++id) c.tape.add(Slowdown{id, 2.0, 0, std::nullopt});
  const std::size_t P = 2;
  const auto r = Cluster(quad_plan(P), c, factory(16)).run_virtual();
  REQUIRE_FALSE(r.timed_out);
  const std::uint64_t t = r.syncer.global_step, H = c.outer.sync_every;
  INFO("global step " << t << ", merges " << r.syncer.merges << ", mean quorum " << r.syncer.mean_quorum_size()
                      << ", " << r.syncer.line());
  REQUIRE(t > 20 * H);
  for (std::size_t p = 0; p < P; ++p) {
    INFO("fragment " << p << ": " << r.syncer.fragments[p].merges << " merges");
    CHECK(r.syncer.fragments[p].merges + 1 >= t / H);
    CHECK(r.syncer.fragments[p].merges <= t / H + 1);
  }
  CHECK(r.syncer.mean_quorum_size() >= 0.75 * 16);
  CHECK(r.syncer.rejected_total() == 0);
  CHECK(r.syncer.pull_timeouts == 0);
  CHECK(distance_to_optimum(r.global) < 0.05);
}

TEST_CASE("Pull rounds with lost, duplicated and reordered messages: a learner whose pull or answer is lost is asked "
          "again, fewer rounds wait for the time-out, and no answer is merged twice",
          "[cluster][pull]") {
  const bool shuffled = GENERATE(false, true);  // loss alone / loss with duplicates and reordering
  INFO((shuffled ? "5% lost, 10% duplicated, 10% reordered by up to 15 ms" : "5% of messages lost"));
  const auto run = [&](std::uint64_t reask_after_steps) {
    ClusterConfig c = pulled(decoupled(4));
    c.syncer.reask_after_steps = reask_after_steps;
    MessageFaults f;
    f.drop = 0.05;
    f.latency = 1ms;
    if (shuffled) {
      f.duplicate = 0.1;
      f.reorder = 0.1;
      f.reorder_max = 15ms;
    }
    c.tape.set_message_faults(f);
    return Cluster(quad_plan(2), c, factory(4)).run_virtual();
  };
  const auto off = run(0), on = run(3);
  REQUIRE_FALSE(off.timed_out);
  REQUIRE_FALSE(on.timed_out);
  INFO("without second asks: " << off.syncer.line() << ", pull time-outs " << off.syncer.pull_timeouts);
  INFO("with: " << on.syncer.line() << ", pull time-outs " << on.syncer.pull_timeouts << ", second asks "
                << on.syncer.pulls_repeated << ", redundant answers " << on.syncer.answers_redundant);
  CHECK(off.syncer.pulls_repeated == 0);
  CHECK(on.syncer.pulls_repeated > 0);
  // The second asks recover lost pulls and answers before the time-out.
  CHECK(on.syncer.pull_timeouts * 2 <= off.syncer.pull_timeouts);
  CHECK(on.syncer.mean_quorum_size() > off.syncer.mean_quorum_size());
  // Each pull merges at most one answer, and no honest answer, first or second, is refused
  // as unasked (the repeat flag holds under duplicates and reordering).
  CHECK(on.syncer.contributions_accepted <= on.syncer.pulls_sent);
  CHECK(on.syncer.rejected[static_cast<std::size_t>(RejectReason::unsolicited)] == 0);
  std::uint64_t answered_again = 0;
  for (const auto& l : on.learners) answered_again += l.pulls_repeated;
  CHECK(answered_again <= on.syncer.pulls_repeated);
  CHECK(on.syncer.answers_redundant <= answered_again);
  CHECK(distance_to_optimum(on.global) < 0.05);
}

TEST_CASE("Pull rounds under loss, duplicates and reordering with a learner killed and back 20 ms later: nothing "
          "an honest learner sends is refused but network duplicates",
          "[cluster][pull]") {
  // Seed 117 of a sweep of this setting (3000 seeds): the syncer pulled learner 1 just before its
  // restart's join, the new incarnation answered that pull, and the answer was refused as
  // unsolicited (11 seeds of 3000 before answers to orphaned pulls were dropped as redundant, 0 after).
  ClusterConfig c = pulled(decoupled(4));
  c.tape = FaultTape(117);
  c.tape.set_message_faults(chaos_network());
  c.tape.add(Kill{1, 57, Downtime{std::nullopt, 20ms}});
  c.tape.add(Kill{2, 137, Downtime{std::nullopt, 300ms}});
  const auto r = Cluster(quad_plan(2), c, factory(4)).run_virtual();
  REQUIRE_FALSE(r.timed_out);
  INFO(r.syncer.line() << ", redundant answers " << r.syncer.answers_redundant);
  CHECK(r.restarts == 2);
  CHECK(r.syncer.rejected_total() == r.syncer.rejected[static_cast<std::size_t>(RejectReason::duplicate)]);
  CHECK(distance_to_optimum(r.global) < 0.05);
}

TEST_CASE("Push rounds at M = 16 with four 2x stragglers reject no honest contribution as stale", "[cluster][push]") {
  ClusterConfig c = decoupled(16);
  c.syncer.sync_every = c.outer.sync_every;
  for (LearnerId id = 12; id < 16; ++id) c.tape.add(Slowdown{id, 2.0, 0, std::nullopt});
  const auto r = Cluster(quad_plan(2), c, factory(16)).run_virtual();
  REQUIRE_FALSE(r.timed_out);
  INFO(r.syncer.line());
  CHECK(r.syncer.rejected[static_cast<std::size_t>(RejectReason::stale)] == 0);
  CHECK(r.syncer.rejected_total() == 0);
}

// The threaded run in pull rounds, with the paper's Nesterov (0.7, 0.9): one
// merge per fragment per H global steps holds every learner that trained, so
// no participation scaling or plain SGD is needed. Learners stop after 300
// steps each; one that has stopped never answers its last pulls, which merge
// at the pull time-out.
TEST_CASE("Learners as real threads train to the optimum in pull rounds with Nesterov", "[cluster][threads][pull]") {
  static constexpr std::size_t a = 8192, b = 1024;
  const ClusterConfig c = threaded(pulled(decoupled(4)));
  auto heavy = heavy_trainers(a, b);
  const auto r = Cluster(quad_plan(2, a, b), c, heavy).run_threaded();
  INFO(r.syncer.line() << ", global step " << r.syncer.global_step << ", pull time-outs " << r.syncer.pull_timeouts);
  CHECK(r.inner_steps >= 4 * 300);
  CHECK(r.kills == 1);
  CHECK(r.restarts == 1);
  // How many rounds merge depends on how the OS schedules the threads (a
  // descheduled learner answers after the pull time-out, and a fragment's
  // next slot passes while its round waits): measured 20 to 69 merges on 2
  // loaded cores. Every fragment must keep merging.
  for (const auto& frag : r.syncer.fragments) CHECK(frag.merges >= 4);
  CHECK(distance_to_optimum(r.global) < 0.35);
  std::printf("threaded pull run: RMS distance %.3f, global step %llu, pull rounds %llu, pull time-outs %llu, %s\n",
              distance_to_optimum(r.global), static_cast<unsigned long long>(r.syncer.global_step),
              static_cast<unsigned long long>(r.syncer.pull_rounds),
              static_cast<unsigned long long>(r.syncer.pull_timeouts), r.syncer.line().c_str());
}
