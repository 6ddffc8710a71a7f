// tests/syncer_test_util.hpp: the crafted messages, plans and configurations
// of the tests that drive a Syncer directly (test_syncer*.cpp,
// test_metrics_prometheus.cpp), written once: joins, contributions with honest
// step counters, the quorum configuration most of them start from, and reads
// of what the syncer sent or counted. What it is not: a fake syncer; every
// message goes through the real Syncer::handle.
#pragma once

#include <ddiloco/syncer.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace ddiloco::test {

/// First sequence number of a learner's first incarnation (see Syncer::on_join).
inline constexpr std::uint64_t kSeq0 = std::uint64_t{1} << 32;

/// Two fragments: {w (4 elements)} and {b (2 elements)}; BalancedGreedy puts
/// the larger tensor alone.
inline Plan small_plan() { return make_plan({{"w", 4, false}, {"b", 2, false}}, 2); }

/// The library's default syncer configuration in push rounds (each learner
/// sends at its own slots), what the tests of the push state machine use; the
/// pull-round tests set RoundMode::pull and H themselves.
inline SyncerConfig push_rounds() {
  SyncerConfig c;
  c.round = RoundMode::push;
  return c;
}

/// A push-round syncer configuration that merges once `k` distinct contributions are in
/// (with the grace window only when `grace`), rounds bounded by 10 s, learners
/// dead after 5 s of silence, and participation scaling off (the merge
/// arithmetic is exact whoever else is alive; the scaling has its own tests).
inline SyncerConfig quorum_config(std::size_t k, bool grace = false) {
  using namespace std::chrono_literals;
  SyncerConfig c = push_rounds();
  c.quorum.min_quorum = k;
  c.quorum.grace = grace;
  c.quorum.deadline = 10s;
  c.heartbeat_timeout = 5s;
  c.participation_scaling = false;
  return c;
}

/// A message of `type` from learner `id` under `plan`'s fingerprint with
/// `sequence` (a join's nonce, a contribution's sequence number); no payload.
inline Message control_message(const Plan& plan, MessageType type, LearnerId id, std::uint64_t sequence = 0) {
  Message m;
  m.type = type;
  m.fingerprint = plan.fingerprint();
  m.learner = id;
  m.sequence = sequence;
  return m;
}

/// Pull rounds: learner `id`'s metadata after its inner step `step`, 10 tokens a step.
inline Message metadata_message(const Plan& plan, LearnerId id, std::uint64_t step) {
  Message m = control_message(plan, MessageType::metadata, id);
  m.step = step;
  m.tokens = static_cast<std::int64_t>(step * 10);
  return m;
}

/// Push rounds: the heartbeat OuterLoop sends at a learner's first inner step
/// after a join. A push round waits only for learners that have trained
/// since they joined; one that only joined is not counted.
inline Message trained_message(const Plan& plan, LearnerId id, std::uint64_t step = 1) {
  Message m = control_message(plan, MessageType::heartbeat, id);
  m.step = step;
  return m;
}

/// A join of learner `id` with nonce `nonce` that states no schedule and no batch.
inline Message join_message(const Plan& plan, LearnerId id, std::uint64_t nonce) {
  return control_message(plan, MessageType::join, id, nonce);
}

/// What a crafted contribution claims: its inner steps and tokens, and the
/// learner's inner step counter after them.
struct Claims {
  std::int64_t steps = 10;
  std::int64_t tokens = 100;
  std::uint64_t step = 0;
};

/// A contribution of `values` (the outer gradient, in fragment order) to
/// fragment `p` with base `version` and the given claims.
inline Message contribution_message(const Plan& plan, LearnerId id, std::size_t p, std::uint64_t sequence,
                                    std::uint64_t version, std::vector<float> values, Claims claims) {
  Message m = control_message(plan, MessageType::contribution, id, sequence);
  m.fragment = static_cast<std::uint32_t>(p);
  m.version = version;
  m.steps = claims.steps;
  m.tokens = claims.tokens;
  m.step = claims.step;
  m.payload = make_payload(std::move(values));
  return m;
}

/// `value` in every element of fragment `p`.
inline std::vector<float> filled(const Plan& plan, std::size_t p, float value) {
  return std::vector<float>(plan.fragments()[p].numel, value);
}

/// Each learner's inner step counter, advanced by the steps of each of its
/// contributions: honest counters (the syncer bounds a contribution's steps by
/// the counter's advance since the learner's previous contribution).
class StepCounters {
 public:
  /// Advances learner `id`'s counter by `steps`; returns the new counter.
  std::uint64_t advance(LearnerId id, std::int64_t steps) {
    return counters_[id] += static_cast<std::uint64_t>(steps);
  }
  /// Learner `id`'s counter (0 before its first contribution).
  std::uint64_t& operator[](LearnerId id) { return counters_[id]; }
  void emplace(LearnerId id, std::uint64_t start) { counters_.emplace(id, start); }

 private:
  std::map<LearnerId, std::uint64_t> counters_;
};

/// Messages of type `t` in `out`.
inline std::size_t count_of(const Outbox& out, MessageType t) {
  return static_cast<std::size_t>(
      std::count_if(out.begin(), out.end(), [t](const Outgoing& o) { return o.message.type == t; }));
}

/// Receivers of the global_fragment messages in `out`, sorted.
inline std::vector<LearnerId> global_receivers(const Outbox& out) {
  std::vector<LearnerId> ids;
  for (const auto& o : out)
    if (o.message.type == MessageType::global_fragment) ids.push_back(o.to);
  std::sort(ids.begin(), ids.end());
  return ids;
}

/// Contributions the syncer rejected for reason `r`.
inline std::uint64_t rejected(const SyncerStatus& s, RejectReason r) {
  return s.rejected[static_cast<std::size_t>(r)];
}

}  // namespace ddiloco::test
