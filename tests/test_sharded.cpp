// Tests of a syncer sharded by fragment: SyncerConfig::shard_index /
// shard_count (ddiloco/syncer.hpp), ShardedLearnerTransport
// (ddiloco/transport/sharded.hpp) and shard checkpoints. Learners and shards
// as in-process endpoints on one virtual clock, driven from one thread: one
// InProcessNetwork per shard, each learner holding a link into every one.
#include <ddiloco/checkpoint.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/syncer.hpp>
#include <ddiloco/transport/in_process.hpp>
#include <ddiloco/transport/sharded.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

using namespace ddiloco;
using namespace std::chrono_literals;

namespace {

using Flat = std::vector<float>;
using Link = InProcessLearnerTransport;
using Sharded = ShardedLearnerTransport<Link>;
using Learner = OuterLoop<Sharded, Flat>;
using TestSyncer = Syncer<WeightedAverage, NesterovSGD>;

static_assert(LearnerTransport<Sharded>);
static_assert(!ContributionEncodingTransport<Sharded>);  // the in-process links send fp32

// Four tensors, one fragment each; ShardMap(plan, 2) gives w (6) and d (2) to
// one shard, b (4) and c (3) to the other.
Plan four_plan() { return make_plan({{"w", 6, false}, {"b", 4, false}, {"c", 3, false}, {"d", 2, false}}, 4); }

Flat initial(const Plan& plan) {
  Flat v(plan.total_numel());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
  return v;
}

SyncerConfig shard_config(std::size_t index, std::size_t count, RoundMode round) {
  SyncerConfig c;
  c.quorum.min_quorum = 1;
  c.quorum.grace = false;
  c.quorum.overlap = 1;
  c.sync_every = 4;
  c.round = round;
  c.shard_index = index;
  c.shard_count = count;
  // Push rounds' participation share counts the learners that have
  // contributed to *this* syncer: a shard counts a learner from its first
  // contribution to one of the shard's fragments, so a fragment's first merges
  // may scale differently than unsharded (docs/sharding.md). Off here, so that
  // sharded and unsharded runs can be compared bit for bit.
  c.participation_scaling = false;
  return c;
}

OuterLoopConfig learner_config(LearnerId id, RoundMode round) {
  OuterLoopConfig c;
  c.id = id;
  c.sync_every = 4;
  c.overlap = 1;
  c.round = round;
  return c;
}

/// S shards, each a Syncer behind its own in-process network, and learners
/// whose links reach every shard (in `order`, normally 0..S-1).
struct Cluster {
  VirtualClock clock;
  Plan plan = four_plan();
  RoundMode round;
  std::vector<std::unique_ptr<InProcessNetwork>> nets;
  std::vector<std::unique_ptr<TestSyncer>> syncers;
  std::vector<bool> down;  ///< a shard that is down handles nothing (its mailbox waits)
  Outbox out;

  Cluster(std::size_t shards, RoundMode r) : round(r), down(shards, false) {
    for (std::size_t s = 0; s < shards; ++s) {
      nets.push_back(std::make_unique<InProcessNetwork>(clock));
      syncers.push_back(std::make_unique<TestSyncer>(plan, initial(plan), clock, shard_config(s, shards, r),
                                                     WeightedAverage(), NesterovSGD(0.7f, 0.9f)));
    }
  }

  std::unique_ptr<Sharded> transport(LearnerId id, std::vector<std::size_t> order = {}) {
    if (order.empty())
      for (std::size_t s = 0; s < nets.size(); ++s) order.push_back(s);
    std::vector<std::unique_ptr<Link>> links;
    for (std::size_t s : order) links.push_back(std::make_unique<Link>(nets[s]->learner(id)));
    return std::make_unique<Sharded>(plan, std::move(links));
  }

  /// Every shard that is up handles what reached it and sends its replies.
  void pump() {
    for (std::size_t s = 0; s < nets.size(); ++s) {
      if (down[s]) continue;
      auto link = nets[s]->syncer();
      while (auto m = link.try_receive()) {
        syncers[s]->handle(*m, out);
        for (auto& o : out) link.send_to(o.to, std::move(o.message));
        out.clear();
      }
      syncers[s]->tick(out);
      for (auto& o : out) link.send_to(o.to, std::move(o.message));
      out.clear();
    }
  }

  /// The global model as the shards serving each fragment hold it.
  Flat global() const {
    Flat flat(plan.total_numel(), 0.0f);
    for (const auto& s : syncers) {
      const Flat part = s->global_parameters();
      std::size_t off = 0;
      for (std::size_t t = 0; t < plan.num_tensors(); ++t) {
        const std::size_t n = plan.tensors()[t].numel;
        for (std::size_t p = 0; p < plan.num_fragments(); ++p) {
          const auto& ts = plan.fragments()[p].tensors;
          if (s->serves(p) && std::find(ts.begin(), ts.end(), t) != ts.end())
            std::copy_n(part.begin() + static_cast<std::ptrdiff_t>(off), n, flat.begin() + static_cast<std::ptrdiff_t>(off));
        }
        off += n;
      }
    }
    return flat;
  }
};

/// One learner: its parameters (one tensor per plan tensor) and its outer loop.
struct Member {
  std::unique_ptr<Sharded> link;
  std::vector<Flat> params;
  std::unique_ptr<Learner> outer;
  float rate;

  Member(Cluster& c, LearnerId id, float r, std::vector<std::size_t> order = {})
      : link(c.transport(id, std::move(order))), rate(r) {
    for (const auto& t : c.plan.tensors()) params.emplace_back(t.numel, 0.0f);
    outer = std::make_unique<Learner>(c.plan, *link, learner_config(id, c.round));
  }

  /// A deterministic inner step: every parameter moves towards 1 by `rate` of its distance.
  void inner_step() {
    for (auto& t : params)
      for (float& x : t) x += rate * (1.0f - x);
  }
};

void join_all(Cluster& c, std::vector<Member>& ms) {
  for (auto& m : ms) m.outer->begin_join(m.params);
  for (int round = 0; round < 16; ++round) {
    c.pump();
    bool all = true;
    for (auto& m : ms) all = m.outer->poll_join(m.params) && all;
    if (all) return;
    c.clock.advance(1ms);
  }
  FAIL("the learners did not join every shard within 16 rounds");
}

void train(Cluster& c, std::vector<Member>& ms, int steps) {
  for (int s = 0; s < steps; ++s) {
    for (auto& m : ms) {
      m.inner_step();
      m.outer->step(m.params, 16);
    }
    c.pump();
    c.clock.advance(10ms);
  }
}

/// Two push-round shards after one learner's 12 steps (the checkpoint tests' state).
struct TrainedShards {
  Cluster c{2, RoundMode::push};
  std::vector<Member> ms;
  TrainedShards() {
    ms.emplace_back(c, 0, 0.1f);
    join_all(c, ms);
    train(c, ms, 12);
  }
};

Flat flat(const std::vector<Flat>& tensors) {
  Flat v;
  for (const auto& t : tensors) v.insert(v.end(), t.begin(), t.end());
  return v;
}

}  // namespace

TEST_CASE("Two shards serve disjoint fragments by the shard map and hold nothing of the others", "[shard]") {
  Cluster c(2, RoundMode::push);
  const ShardMap map(c.plan, 2);
  for (std::size_t s = 0; s < 2; ++s) {
    const auto st = c.syncers[s]->status();
    CHECK(st.shard_index == s);
    CHECK(st.shard_count == 2);
    CHECK(st.shard_map == map.fingerprint());
    for (std::size_t p = 0; p < c.plan.num_fragments(); ++p) {
      CHECK(c.syncers[s]->serves(p) == (map.shard_of(p) == s));
      CHECK(st.fragments[p].served == (map.shard_of(p) == s));
      // Another shard's fragment costs no memory: nothing in the snapshot.
      CHECK(c.syncers[s]->snapshot().fragments[p].theta.empty() == (map.shard_of(p) != s));
    }
  }
  CHECK(c.syncers[0]->shard_map_fingerprint() == c.syncers[1]->shard_map_fingerprint());
}

TEST_CASE("A run on two shards equals the unsharded run bit for bit, in push and in pull rounds", "[shard]") {
  const RoundMode round = GENERATE(RoundMode::push, RoundMode::pull);
  CAPTURE(to_string(round));
  auto run = [&](std::size_t shards) {
    Cluster c(shards, round);
    std::vector<Member> ms;
    ms.emplace_back(c, 0, 0.05f);
    ms.emplace_back(c, 1, 0.11f);
    ms.emplace_back(c, 2, 0.08f);
    join_all(c, ms);
    train(c, ms, 40);
    std::uint64_t merges = 0;
    for (const auto& s : c.syncers) merges += s->status().merges;
    std::vector<Flat> out{c.global()};
    for (auto& m : ms) out.push_back(flat(m.params));
    return std::pair{out, merges};
  };
  const auto [one, merges_one] = run(1);
  const auto [two, merges_two] = run(2);
  CHECK(merges_one >= 20);  // every fragment merged several times
  CHECK(merges_two == merges_one);
  CHECK(one[0] != initial(four_plan()));
  for (std::size_t i = 0; i < one.size(); ++i) {
    CAPTURE(i);
    CHECK(two[i] == one[i]);
  }
}

TEST_CASE("A shard refuses a join addressed to another shard or map, naming both", "[shard]") {
  Cluster c(2, RoundMode::push);
  SECTION("the links in the wrong order") {
    Member m(c, 0, 0.1f, {1, 0});
    m.outer->begin_join(m.params);
    c.pump();
    try {
      (void)m.outer->poll_join(m.params);
      FAIL("the join was not refused");
    } catch (const ProtocolError& e) {
      const std::string what = e.what();
      CAPTURE(what);
      // Shard 1, reached first, answers the copy meant for shard 0.
      CHECK(what.find("it is shard 1 of 2 (shard map " + detail::hex16(c.syncers[1]->shard_map_fingerprint()) +
                      ") but this learner addressed it as shard 0 of 2") != std::string::npos);
      CHECK(what.find("--connect A,B") != std::string::npos);
    }
    const auto refusals = c.syncers[1]->take_refusals();
    REQUIRE(refusals.size() == 1);
    CHECK(refusals[0].reason == JoinRefusal::shard_map);
    CHECK(refusals[0].line().find("addressed to shard 0/2 but this is shard 1/2") != std::string::npos);
  }
  SECTION("a learner that knows of one syncer only") {
    auto link = c.nets[0]->learner(7);
    Flat params(c.plan.total_numel());
    OuterLoop<Link, Flat> outer(c.plan, link, learner_config(7, RoundMode::push));
    std::vector<Flat> ps;
    for (const auto& t : c.plan.tensors()) ps.emplace_back(t.numel, 0.0f);
    outer.begin_join(ps);
    c.pump();
    CHECK_THROWS_WITH(outer.poll_join(ps), Catch::Contains("it is shard 0 of 2") &&
                                               Catch::Contains("addressed it as shard 0 of 1"));
    CHECK(c.syncers[0]->status().joins_refused == 1);
    CHECK(c.syncers[0]->status().learners_known == 0);
  }
}

TEST_CASE("A contribution of another shard's fragment is rejected as wrong_shard before it touches state", "[shard]") {
  Cluster c(2, RoundMode::push);
  std::vector<Member> ms;
  ms.emplace_back(c, 0, 0.1f);
  join_all(c, ms);
  const ShardMap map(c.plan, 2);
  const std::size_t theirs = map.fragments_of(1)[0];
  Message m;
  m.type = MessageType::contribution;
  m.fingerprint = c.plan.fingerprint();
  m.learner = 0;
  m.fragment = static_cast<std::uint32_t>(theirs);
  m.sequence = std::uint64_t{1} << 40;
  m.steps = 1;
  m.tokens = 16;
  m.step = 1;
  m.payload = make_payload(Flat(c.plan.fragments()[theirs].numel, 0.5f));
  const auto before = c.syncers[0]->snapshot();
  c.syncers[0]->handle(m, c.out);
  CHECK(c.out.empty());
  const auto st = c.syncers[0]->status();
  CHECK(st.rejected[static_cast<std::size_t>(RejectReason::wrong_shard)] == 1);
  CHECK(st.contributions_accepted == 0);
  CHECK(c.syncers[0]->snapshot().fragments == before.fragments);
}

TEST_CASE("ShardedLearnerTransport routes by the map, asks only shards that owe state, drops misrouted globals",
          "[shard]") {
  Cluster c(2, RoundMode::push);
  const ShardMap map(c.plan, 2);
  auto t = c.transport(3);
  auto s0 = c.nets[0]->syncer(), s1 = c.nets[1]->syncer();
  auto drain = [](InProcessSyncerTransport& s) {
    std::vector<Message> got;
    while (auto m = s.try_receive()) got.push_back(std::move(*m));
    return got;
  };
  // A contribution goes to its fragment's shard only.
  for (std::size_t p = 0; p < c.plan.num_fragments(); ++p) {
    Message m;
    m.type = MessageType::contribution;
    m.fragment = static_cast<std::uint32_t>(p);
    m.payload = make_payload(Flat(c.plan.fragments()[p].numel, 0.0f));
    REQUIRE(t->send(std::move(m)));
    CHECK(drain(map.shard_of(p) == 0 ? s0 : s1).size() == 1);
    CHECK(drain(map.shard_of(p) == 0 ? s1 : s0).empty());
  }
  // Metadata and heartbeats go to every shard.
  Message meta;
  meta.type = MessageType::metadata;
  REQUIRE(t->send(Message(meta)));
  CHECK(drain(s0).size() == 1);
  CHECK(drain(s1).size() == 1);
  // A join goes to both, each copy naming its shard; after shard 0's state
  // has all arrived, a retry (same nonce) goes to shard 1 only.
  Message join;
  join.type = MessageType::join;
  join.sequence = 99;
  join.fragment = static_cast<std::uint32_t>(RoundMode::push);
  REQUIRE(t->send(Message(join)));
  auto j0 = drain(s0), j1 = drain(s1);
  REQUIRE(j0.size() == 1);
  REQUIRE(j1.size() == 1);
  CHECK(detail::join_shard(j0[0].fragment).index == 0);
  CHECK(detail::join_shard(j1[0].fragment).index == 1);
  CHECK(detail::join_shard(j1[0].fragment).count == 2);
  CHECK((j1[0].fragment & 0xffu) == static_cast<std::uint32_t>(RoundMode::push));
  for (std::size_t p : map.fragments_of(0)) {
    Message st;
    st.type = MessageType::full_state;
    st.learner = 3;
    st.fragment = static_cast<std::uint32_t>(p);
    s0.send_to(3, std::move(st));
  }
  while (t->try_receive()) {
  }
  REQUIRE(t->send(Message(join)));
  CHECK(drain(s0).empty());
  CHECK(drain(s1).size() == 1);
  // A global from shard 0 of a fragment shard 1 serves is dropped.
  Message g;
  g.type = MessageType::global_fragment;
  g.learner = 3;
  g.fragment = static_cast<std::uint32_t>(map.fragments_of(1)[0]);
  s0.send_to(3, std::move(g));
  CHECK_FALSE(t->try_receive().has_value());
  CHECK(t->misrouted() == 1);
}

TEST_CASE("ShardedLearnerTransport refuses no links, null links and more shards than fragments", "[shard]") {
  Cluster c(2, RoundMode::push);
  CHECK_THROWS_WITH(Sharded(c.plan, {}), Catch::Contains("no link"));
  std::vector<std::unique_ptr<Link>> with_null;
  with_null.push_back(std::make_unique<Link>(c.nets[0]->learner(1)));
  with_null.push_back(nullptr);
  CHECK_THROWS_WITH(Sharded(c.plan, std::move(with_null)), Catch::Contains("link 1 is null"));
  std::vector<std::unique_ptr<Link>> five;
  for (int i = 0; i < 5; ++i) five.push_back(std::make_unique<Link>(c.nets[0]->learner(1)));
  CHECK_THROWS_WITH(Sharded(c.plan, std::move(five)), Catch::Contains("shards = 5"));
  CHECK_THROWS_WITH((TestSyncer(c.plan, initial(c.plan), c.clock, shard_config(2, 2, RoundMode::push))),
                    Catch::Contains("shard 2 of 2 does not exist"));
  CHECK_THROWS_WITH((TestSyncer(c.plan, initial(c.plan), c.clock, shard_config(0, 5, RoundMode::push))),
                    Catch::Contains("shards = 5"));
}

TEST_CASE("A shard that is down stops only its fragments; restored from its snapshot, they move again", "[shard]") {
  const RoundMode round = GENERATE(RoundMode::push, RoundMode::pull);
  CAPTURE(to_string(round));
  Cluster c(2, round);
  const ShardMap map(c.plan, 2);
  std::vector<Member> ms;
  ms.emplace_back(c, 0, 0.05f);
  ms.emplace_back(c, 1, 0.09f);
  join_all(c, ms);
  train(c, ms, 24);
  const SyncerSnapshot saved = c.syncers[1]->snapshot();
  const auto merges0 = c.syncers[0]->status().merges, merges1 = c.syncers[1]->status().merges;
  REQUIRE(merges1 > 0);
  // Shard 1 crashes after a few more merges (lost with it), then stays down.
  train(c, ms, 8);
  c.down[1] = true;
  const auto steps_before = ms[0].outer->status().step;
  train(c, ms, 24);
  CHECK(ms[0].outer->status().step == steps_before + 24);  // the learners never waited
  CHECK(c.syncers[0]->status().merges >= merges0 + 10);      // shard 0 kept merging
  // Restarted from its snapshot in a new epoch (as ddiloco_syncer does).
  SyncerSnapshot restored = saved;
  advance_epoch(restored);
  c.syncers[1] = std::make_unique<TestSyncer>(c.plan, initial(c.plan), c.clock, shard_config(1, 2, round),
                                              WeightedAverage(), NesterovSGD(0.7f, 0.9f));
  c.syncers[1]->restore(restored);
  c.down[1] = false;
  train(c, ms, 40);
  const auto after = c.syncers[1]->status();
  CHECK(after.merges >= merges1 + 5);
  CHECK(after.rejected[static_cast<std::size_t>(RejectReason::duplicate)] == 0);
  CHECK(after.rejected[static_cast<std::size_t>(RejectReason::wrong_shard)] == 0);
  // Every learner holds a global of each of shard 1's fragments from the new epoch.
  for (auto& m : ms)
    for (std::size_t p : map.fragments_of(1)) CHECK(m.outer->global_version(p) > restored.fragments[p].version);
}

TEST_CASE("A shard's checkpoint round-trips with its shard and is refused by another shard", "[shard][checkpoint]") {
  TrainedShards t;
  Cluster& c = t.c;
  const SyncerSnapshot s1 = c.syncers[1]->snapshot();
  CHECK(s1.shard_index == 1);
  CHECK(s1.shard_count == 2);
  CHECK(s1.shard_map == c.syncers[1]->shard_map_fingerprint());
  const auto loaded = decode_checkpoint(encode_checkpoint(s1, 7));
  CHECK(loaded.snapshot == s1);
  CHECK_THROWS_WITH(encode_checkpoint(s1, 8, checkpoint_tensors(c.plan, {})), Catch::Contains("no tensors section"));
  CHECK_THROWS_WITH(c.syncers[0]->restore(loaded.snapshot),
                    Catch::Contains("snapshot is of shard 1/2") && Catch::Contains("this syncer is shard 0/2"));
  // An unsharded snapshot has no shard section and reads as shard 0 of 1.
  Cluster one(1, RoundMode::push);
  const SyncerSnapshot u = one.syncers[0]->snapshot();
  CHECK(u.shard_count == 1);
  CHECK(u.shard_map == 0);
  CHECK(decode_checkpoint(encode_checkpoint(u, 1)).snapshot == u);
  CHECK_THROWS_WITH(c.syncers[0]->restore(u), Catch::Contains("snapshot is of shard 0/1"));
  // A restore into the same shard works.
  TestSyncer again(c.plan, initial(c.plan), c.clock, shard_config(1, 2, RoundMode::push));
  again.restore(loaded.snapshot);
  CHECK(again.global_parameters() == c.syncers[1]->global_parameters());
}

TEST_CASE("combine_shards assembles the global model from one checkpoint of each shard, and refuses gaps", "[shard][checkpoint]") {
  TrainedShards t;
  Cluster& c = t.c;
  auto as_loaded = [](const SyncerSnapshot& s, const char* name) {
    LoadedCheckpoint l = decode_checkpoint(encode_checkpoint(s, 3));
    l.path = name;
    return l;
  };
  const std::vector<LoadedCheckpoint> both{as_loaded(c.syncers[1]->snapshot(), "c1"),
                                           as_loaded(c.syncers[0]->snapshot(), "c0")};
  const LoadedCheckpoint whole = combine_shards(both);
  CHECK(whole.snapshot.shard_count == 1);
  CHECK(whole.snapshot.fingerprint == c.plan.fingerprint());
  const Flat global = c.global();
  std::size_t off = 0;
  for (std::size_t p = 0; p < c.plan.num_fragments(); ++p) {
    // One tensor per fragment, in plan order: fragment p is tensor p.
    REQUIRE(c.plan.fragments()[p].tensors == std::vector<std::size_t>{p});
    const auto& theta = whole.snapshot.fragments[p].theta;
    REQUIRE(theta.size() == c.plan.fragments()[p].numel);
    CHECK(std::equal(theta.begin(), theta.end(), global.begin() + static_cast<std::ptrdiff_t>(off)));
    off += theta.size();
  }
  const std::vector<LoadedCheckpoint> one{both[0]};
  CHECK_THROWS_WITH(combine_shards(one), Catch::Contains("the run has 2 shards, but 1 checkpoints"));
  const std::vector<LoadedCheckpoint> twice{both[0], both[0]};
  CHECK_THROWS_WITH(combine_shards(twice), Catch::Contains("two checkpoints of shard 1/2"));
  Cluster three(3, RoundMode::push);
  const std::vector<LoadedCheckpoint> mixed{both[0], as_loaded(three.syncers[0]->snapshot(), "other")};
  CHECK_THROWS_WITH(combine_shards(mixed), Catch::Contains("'other'") && Catch::Contains("is not of the run of 'c1'"));
}
