// A seeded chaos sweep of the pull-round protocol: the virtual-time cluster
// (LocalCluster::run_virtual, deterministic per seed, milliseconds a run) run
// for many seeds of each fault setting, every run held to the protocol's
// promises. One seed is one fault schedule: which messages are lost,
// duplicated or reordered, and where kills, partitions and joins fall.
//
//   build/tests/test_chaos_sweep                           # 300 seeds of each setting
//   DDILOCO_CHAOS_SEEDS=3000 build/tests/test_chaos_sweep  # the long sweep (docs/security.md)
//   DDILOCO_CHAOS_SETTING=killed DDILOCO_CHAOS_FIRST_SEED=117 DDILOCO_CHAOS_SEEDS=1 build/tests/test_chaos_sweep
//                                                          # seed 117 of the setting whose name holds "killed"
//
// Labelled slow: not run again under the sanitizers (the unit tests of every
// block it drives are).
// DDILOCO_TEST_LABEL(slow)
#include <ddiloco/local_cluster.hpp>

#include <catch2/catch.hpp>

#include "cluster_test_util.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

using namespace ddiloco;
using namespace ddiloco::test;
using namespace std::chrono_literals;

namespace {

/// A non-negative integer from the environment, or `fallback` if unset.
std::uint64_t env_count(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const auto n = std::strtoull(v, &end, 10);
  if (*end != '\0' || *v == '-') FAIL(name << " = '" << v << "' must be a non-negative integer");
  return n;
}

struct Setting {
  const char* name;
  std::size_t learners = 4;
  /// Adds the setting's faults for one seed (the network is set already); empty: none.
  std::function<void(FaultTape&, std::uint64_t seed)> faults{};
  bool loss = true, duplicates = true;
};

/// The settings, each on chaos_network() (cluster_test_util.hpp) unless it says otherwise. The
/// seed also moves where a kill, partition or join falls.
std::vector<Setting> settings() {
  using std::chrono::milliseconds;
  return {
      {"loss, duplicates and reordering"},
      {"loss and reordering, no duplicates", 4, {}, true, false},
      {"duplicates and reordering, no loss", 4, {}, false, true},
      {"learner 1 killed and back 20 ms later, learner 2 killed and back 300 ms later", 4,
       [](FaultTape& t, std::uint64_t s) {
         t.add(Kill{1, 40 + s % 50, Downtime{std::nullopt, 20ms}});
         t.add(Kill{2, 120 + s % 70, Downtime{std::nullopt, 300ms}});
       }},
      {"learner 1 dead past its heartbeat time-out (1.2 to 2 s), then back", 4,
       [](FaultTape& t, std::uint64_t s) {
         t.add(Kill{1, 40 + s % 50, Downtime{std::nullopt, milliseconds(1200 + s % 800)}});
       }},
      {"learner 3 partitioned for 1.5 to 2.6 s", 4,
       [](FaultTape& t, std::uint64_t s) {
         t.add(Partition{3, milliseconds(300 + s % 400), milliseconds(1800 + s % 500)});
       }},
      {"a scavenged learner joins and leaves", 4,
       [](FaultTape& t, std::uint64_t s) {
         t.add(Scavenge{4, 30 + s % 40, 150 + s % 100});
       }},
      {"learner 3 three times slower", 4,
       [](FaultTape& t, std::uint64_t) {
         t.add(Slowdown{3, 3.0, 0, std::nullopt});
       }},
      {"M = 16, four of them 2x slower, no duplicates", 16,
       [](FaultTape& t, std::uint64_t) {
         for (LearnerId id = 12; id < 16; ++id) t.add(Slowdown{id, 2.0, 0, std::nullopt});
       },
       true, false},
  };
}

/// What one run broke of the protocol's promises ("" if nothing); `d`: its distance_to_optimum().
std::string broken(const ClusterResult& r, double d) {
  std::ostringstream why;
  const auto& s = r.syncer;
  if (r.timed_out) why << "the run stalled (no event left before the token budget); ";
  // Two refusals are expected of an honest learner's messages: `duplicate`, the network's copies and an
  // answer overtaken by the same learner's next one (sequence numbers only rise; the tape reorders within a
  // link), and `stale`, an answer from a base the syncer can no longer anchor at (answered with the current
  // fragment). Nothing else may be refused.
  const auto refused = s.rejected_total() - s.rejected[static_cast<std::size_t>(RejectReason::duplicate)] -
                       s.rejected[static_cast<std::size_t>(RejectReason::stale)];
  if (refused != 0) why << refused << " honest messages refused (" << s.line() << "); ";
  // At most one answer merged per pull, second asks included.
  if (s.contributions_accepted > s.pulls_sent)
    why << s.contributions_accepted << " answers merged for " << s.pulls_sent << " pulls; ";
  for (std::size_t p = 0; p < s.fragments.size(); ++p)
    if (s.fragments[p].merges == 0) why << "fragment " << p << " never merged; ";
  // From 0.7 at the start. The single-seed tests hold 0.05; across seeds a run
  // can end soon after a disturbance (a partition healed, a learner back),
  // before the global is back within that: the largest of 3000 seeds of each
  // setting was 0.074 (M = 16), 0.064 with four learners.
  if (!(d < 0.1)) why << "RMS distance to the optimum " << d << "; ";
  return why.str();
}

}  // namespace

TEST_CASE(
    "Pull rounds under seeded chaos: no run stalls, nothing honest is refused, no pull is answered into the "
    "merge twice, and every run trains",
    "[chaos][pull]") {
  const std::uint64_t first = env_count("DDILOCO_CHAOS_FIRST_SEED", 1);
  // 300 seeds: enough to catch the case fixed last (an answer to a pull sent to a learner's previous
  // incarnation, refused as unsolicited: seeds 117, 179 and 259 of the kill setting failed before 563dccf).
  const std::uint64_t seeds = env_count("DDILOCO_CHAOS_SEEDS", 300);
  const char* only = std::getenv("DDILOCO_CHAOS_SETTING");
  const auto chosen = [&](const Setting& s) {
    return only == nullptr || std::string_view(s.name).find(only) != std::string_view::npos;
  };
  const auto all = settings();
  if (std::none_of(all.begin(), all.end(), chosen))
    FAIL("DDILOCO_CHAOS_SETTING = '" << only << "' is in no setting's name (see settings() in " << __FILE__
                                     << ")");
  const auto& setting = all[GENERATE_COPY(range(std::size_t{0}, all.size()))];
  if (!chosen(setting)) return;
  INFO("setting: " << setting.name);
  std::vector<std::string> failures;
  double worst = 0.0;
  std::uint64_t worst_seed = first, stale = 0, duplicates = 0, redundant = 0, asked_again = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t seed = first; seed < first + seeds; ++seed) {
    ClusterConfig c = pulled(decoupled(setting.learners));
    c.syncer.reask_after_steps = 3;
    c.tape = FaultTape(seed);
    c.tape.set_message_faults(chaos_network(setting.loss, setting.duplicates));
    if (setting.faults) setting.faults(c.tape, seed);
    const auto r = Cluster(quad_plan(2), c, factory(setting.learners)).run_virtual();
    const double d = distance_to_optimum(r.global);
    if (auto why = broken(r, d); !why.empty()) failures.push_back("seed " + std::to_string(seed) + ": " + why);
    if (d > worst) {
      worst = d;
      worst_seed = seed;
    }
    stale += r.syncer.rejected[static_cast<std::size_t>(RejectReason::stale)];
    duplicates += r.syncer.rejected[static_cast<std::size_t>(RejectReason::duplicate)];
    redundant += r.syncer.answers_redundant;
    asked_again += r.syncer.pulls_repeated;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "chaos sweep, %s: seeds %llu..%llu, %zu broken, largest distance %.4f (seed %llu); in all: %llu stale, "
      "%llu duplicates, %llu second asks, %llu redundant answers; %.1f s\n",
      setting.name, static_cast<unsigned long long>(first),
      static_cast<unsigned long long>(first + seeds - 1), failures.size(), worst,
      static_cast<unsigned long long>(worst_seed), static_cast<unsigned long long>(stale),
      static_cast<unsigned long long>(duplicates), static_cast<unsigned long long>(asked_again),
      static_cast<unsigned long long>(redundant), secs);
  std::fflush(stdout);
  for (std::size_t i = 0; i < std::min<std::size_t>(failures.size(), 10); ++i) UNSCOPED_INFO(failures[i]);
  CHECK(failures.empty());
}
