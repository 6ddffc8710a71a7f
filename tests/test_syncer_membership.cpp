// Tests for the membership bounds of ddiloco/syncer/membership.hpp (SyncerConfig
// max_learners, join_interval / join_burst / join_burst_per_learner,
// join_repeat_interval, prune_after): what a join flood or a peer that keeps
// re-joining can make the syncer keep and send. Driven directly with crafted
// messages on a virtual clock (no transport, no threads).
#include <ddiloco/syncer.hpp>

#include <catch2/catch.hpp>

#include "syncer_test_util.hpp"

#include <algorithm>

using namespace ddiloco;
using namespace std::chrono_literals;

namespace {

using AvgSyncer = Syncer<WeightedAverage, AverageOnly>;

using test::kSeq0;
using test::small_plan;

SyncerConfig base_config() { return test::quorum_config(1); }

struct Rig {
  VirtualClock clock{TimePoint{100s}};
  Plan plan = small_plan();
  std::vector<float> init = std::vector<float>(6, 1.0f);
  Outbox out;

  Message control(MessageType type, LearnerId id, std::uint64_t sequence = 0) const {
    return test::control_message(plan, type, id, sequence);
  }
  /// Handles a join with `nonce`; returns the full_state messages it produced.
  std::vector<Outgoing> join(AvgSyncer& s, LearnerId id, std::uint64_t nonce) {
    out.clear();
    s.handle(test::join_message(plan, id, nonce), out);
    std::vector<Outgoing> states;
    for (auto& o : out)
      if (o.message.type == MessageType::full_state) states.push_back(o);
    return states;
  }
  /// A contribution to w's fragment with an honest step counter (claims within its advance).
  Message contribution(LearnerId id, std::uint64_t seq, std::uint64_t version = 0) const {
    const std::size_t p = fragment_of_w();
    return test::contribution_message(plan, id, p, seq, version, test::filled(plan, p, 0.25f),
                                      {10, 100, steps_so_far.advance(id, 10)});
  }
  std::size_t fragment_of_w() const { return plan.fragment_of(0); }
  mutable test::StepCounters steps_so_far;
};

std::uint64_t rejected(const AvgSyncer& s, RejectReason r) { return test::rejected(s.status(), r); }

}  // namespace

TEST_CASE("A repeated join is answered again only when its answer may have been lost", "[syncer][membership]") {
  Rig r;
  AvgSyncer s(r.plan, r.init, r.clock, base_config());
  REQUIRE(r.join(s, 1, 42).size() == r.plan.num_fragments());
  // A duplicate right behind the first (a retransmission, a replay): not answered.
  r.clock.advance(100ms);
  CHECK(r.join(s, 1, 42).empty());
  CHECK(s.status().joins_limited == 1);
  // The learner's retry after join_retry (1 s) means it got nothing: answered
  // again, in the same sequence space, and still one join.
  r.clock.advance(1s);
  const auto again = r.join(s, 1, 42);
  REQUIRE(again.size() == r.plan.num_fragments());
  for (const auto& o : again) CHECK(o.message.sequence == kSeq0);
  CHECK(s.status().joins == 1);
  // Once the learner has contributed it has its state: a later repeat is not answered.
  s.handle(r.contribution(1, kSeq0 + 1), r.out);
  REQUIRE(s.fragment(r.fragment_of_w()).second == 1);
  r.clock.advance(5s);
  CHECK(r.join(s, 1, 42).empty());
  CHECK(s.status().joins_limited == 2);
  CHECK(s.alive() == 1);
}

TEST_CASE("Full-state answers to joins are rate limited per learner id and for all ids together",
          "[syncer][membership]") {
  Rig r;
  SyncerConfig c = base_config();
  c.join_interval = 1s;
  c.join_burst_per_learner = 2;
  c.join_burst = 3;
  AvgSyncer s(r.plan, r.init, r.clock, c);
  // One id re-joining with fresh nonces (one listed CURVE key re-joining as itself).
  CHECK(r.join(s, 1, 11).size() == 2);
  CHECK(r.join(s, 1, 12).size() == 2);
  CHECK(r.join(s, 1, 13).empty());  // third answer to id 1 within the interval
  CHECK(s.status().joins == 2);
  CHECK(r.join(s, 2, 21).size() == 2);  // the third answer of all ids
  CHECK(r.join(s, 3, 31).empty());      // the total is spent
  CHECK(s.status().joins_limited == 2);
  CHECK(s.status().learners_known == 2);  // a dropped join leaves no state behind
  // The next interval: learner 3's retry is answered.
  r.clock.advance(1s);
  CHECK(r.join(s, 3, 31).size() == 2);
  CHECK(s.status().learners_known == 3);
  // Invalid bounds name the field.
  SyncerConfig bad = base_config();
  bad.join_burst = 0;
  CHECK_THROWS_WITH(AvgSyncer(r.plan, r.init, r.clock, bad), Catch::Contains("join_burst"));
  bad = base_config();
  bad.max_learners = 0;
  CHECK_THROWS_WITH(AvgSyncer(r.plan, r.init, r.clock, bad), Catch::Contains("max_learners"));
  bad = base_config();
  bad.prune_after = 0s;
  CHECK_THROWS_WITH(AvgSyncer(r.plan, r.init, r.clock, bad), Catch::Contains("prune_after"));
}

TEST_CASE("A join beyond max_learners replaces the learner dead longest, or is refused as full when all are alive",
          "[syncer][membership]") {
  Rig r;
  SyncerConfig c = base_config();
  c.max_learners = 2;
  AvgSyncer s(r.plan, r.init, r.clock, c);
  r.join(s, 1, 11);
  r.join(s, 2, 21);
  // Both alive: learner 3 is refused with the reason, and nothing of it is kept.
  CHECK(r.join(s, 3, 31).empty());
  REQUIRE(r.out.size() == 1);
  CHECK(r.out[0].message.type == MessageType::join_refused);
  CHECK(static_cast<JoinRefusal>(r.out[0].message.fragment) == JoinRefusal::full);
  CHECK(r.out[0].message.sequence == 31);
  CHECK(s.status().joins_over_capacity == 1);
  CHECK(s.status().joins_refused == 1);
  CHECK(s.status().learners_known == 2);
  const auto refusals = s.take_refusals();
  REQUIRE(refusals.size() == 1);
  CHECK_THAT(refusals[0].line(), Catch::Contains("learner 3") && Catch::Contains("--max-learners"));
  // Learner 1 keeps heartbeating, learner 2 falls silent and dies.
  r.clock.advance(3s);
  s.handle(r.control(MessageType::heartbeat, 1), r.out);
  r.clock.advance(3s);
  s.expire_learners();
  REQUIRE(s.alive() == 1);
  // Now learner 3 takes learner 2's place; learner 2 is forgotten.
  CHECK(r.join(s, 3, 31).size() == 2);
  CHECK(s.status().learners_known == 2);
  CHECK(s.status().learners_pruned == 1);
  const auto before = rejected(s, RejectReason::unknown_learner);
  s.handle(r.control(MessageType::heartbeat, 2), r.out);
  CHECK(rejected(s, RejectReason::unknown_learner) == before + 1);
  for (const auto& f : s.snapshot().fragments) CHECK_FALSE(f.last_sequence.contains(2));
}

TEST_CASE("Learners that left or died are forgotten after prune_after, per-fragment sequences included",
          "[syncer][membership]") {
  Rig r;
  SyncerConfig c = base_config();
  c.prune_after = 60s;
  AvgSyncer s(r.plan, r.init, r.clock, c);
  r.join(s, 1, 11);
  r.join(s, 2, 21);
  r.join(s, 3, 31);
  s.handle(r.control(MessageType::leave, 1), r.out);  // left
  // Learner 2 dies (silent); learner 3 stays alive by heartbeats.
  for (int i = 0; i < 12; ++i) {
    r.clock.advance(4s);
    s.handle(r.control(MessageType::heartbeat, 3), r.out);
    s.expire_learners();
  }
  CHECK(s.status().learners_known == 3);  // 48 s: nobody departed 60 s ago yet
  r.clock.advance(13s);                   // 61 s after learner 1 left and learner 2 was last heard
  s.handle(r.control(MessageType::heartbeat, 3), r.out);
  Outbox ticks;
  s.tick(ticks);
  const auto st = s.status();
  CHECK(st.learners_known == 1);
  CHECK(st.learners_pruned == 2);
  for (const auto& f : s.snapshot().fragments) {
    CHECK(f.last_sequence.size() == 1);
    CHECK(f.last_sequence.contains(3));
  }
}

TEST_CASE("A learner that comes back after being forgotten gets a fresh sequence space and is accepted",
          "[syncer][membership]") {
  Rig r;
  SyncerConfig c = base_config();
  c.prune_after = 60s;
  AvgSyncer s(r.plan, r.init, r.clock, c);
  const auto p = r.fragment_of_w();
  r.join(s, 1, 11);
  for (std::uint64_t i = 1; i <= 3; ++i) s.handle(r.contribution(1, kSeq0 + i, s.fragment(p).second), r.out);
  REQUIRE(s.fragment(p).second == 3);
  s.handle(r.control(MessageType::leave, 1), r.out);
  r.clock.advance(61s);
  s.expire_learners();
  REQUIRE(s.status().learners_known == 0);
  REQUIRE(s.status().learners_pruned == 1);
  // Back with a new nonce: a sequence space above the forgotten incarnation's.
  const auto states = r.join(s, 1, 12);
  REQUIRE(states.size() == 2);
  const std::uint64_t first = states.front().message.sequence;
  CHECK(first >= (std::uint64_t{2} << 32));
  // Its contributions are accepted ...
  s.handle(r.contribution(1, first + 1, s.fragment(p).second), r.out);
  CHECK(s.fragment(p).second == 4);
  // ... and one from the old incarnation (a sequence it never used) is not.
  s.handle(r.contribution(1, kSeq0 + 4, s.fragment(p).second), r.out);
  CHECK(s.fragment(p).second == 4);
  CHECK(rejected(s, RejectReason::duplicate) == 1);
}

TEST_CASE("After a restore, a learner forgotten before the checkpoint still comes back in a fresh sequence space",
          "[syncer][membership]") {
  Rig r;
  SyncerConfig c = base_config();
  c.prune_after = 60s;
  AvgSyncer a(r.plan, r.init, r.clock, c);
  r.join(a, 1, 11);
  r.join(a, 1, 12);  // a second incarnation: sequences up to 3 << 32
  a.handle(r.control(MessageType::leave, 1), r.out);
  r.join(a, 2, 21);
  r.clock.advance(61s);
  a.handle(r.control(MessageType::heartbeat, 2), r.out);
  a.expire_learners();
  REQUIRE(a.status().learners_known == 1);  // learner 1 forgotten, not in the snapshot
  AvgSyncer b(r.plan, r.init, r.clock, c);
  b.restore(a.snapshot());
  const auto states = r.join(b, 1, 13);
  REQUIRE(states.size() == 2);
  CHECK(states.front().message.sequence >= (std::uint64_t{3} << 32));
}

TEST_CASE("A flood of fresh learner ids keeps the membership state within max_learners", "[syncer][membership]") {
  Rig r;
  SyncerConfig c = base_config();
  c.max_learners = 8;
  c.join_burst = 1000;
  AvgSyncer s(r.plan, r.init, r.clock, c);
  std::uint64_t answered = 0, refused = 0;
  for (LearnerId id = 1000; id < 3000; ++id) {
    if (id % 16 == 0) {  // every 16 ids the earlier ones have gone silent long enough to die
      r.clock.advance(6s);
      s.expire_learners();
    }
    answered += r.join(s, id, id).empty() ? 0 : 1;
    refused += static_cast<std::uint64_t>(std::count_if(
        r.out.begin(), r.out.end(), [](const Outgoing& o) { return o.message.type == MessageType::join_refused; }));
    const auto st = s.status();
    REQUIRE(st.learners_known <= 8);
  }
  CHECK(answered > 0);
  CHECK(refused > 0);
  CHECK(answered + refused == 2000);
  CHECK(s.status().joins_over_capacity == refused);
  for (const auto& f : s.snapshot().fragments) CHECK(f.last_sequence.size() <= 8);
}
