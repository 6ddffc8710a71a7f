// ddiloco/syncer/membership.hpp: the syncer's membership: joins and the
// refusals that name a mismatch (docs/operations.md, "9. Joins"), observers,
// leaves, heartbeats and deaths, each learner's position and the global step
// of pull rounds (the lead bound, the carry past a departed leader;
// docs/algorithm.md, "Pull rounds (the paper's round)"), and rejoin requests
// to learners a restore does not know (docs/operations.md, "Crash and
// restore").
//
// Member functions of ddiloco::Syncer (syncer.hpp declares them and holds the
// state; this header defines them). A function whose name ends in _locked
// expects its caller to hold members_mutex_.
#pragma once

#include <ddiloco/syncer.hpp>

namespace ddiloco {

// ---- refusals and observers ----------------------------------------------
/// Why a join or observe request does not fit this run, if it does not. An
/// observe with fingerprint 0 takes whatever plan this syncer has.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::refusal_for(const Message& m) const -> std::optional<JoinRefusal> {
  if (m.fingerprint != plan_.fingerprint() && !(m.type == MessageType::observe && m.fingerprint == 0))
    return JoinRefusal::foreign_plan;
  if (m.type == MessageType::join && config_.sync_every != 0 && m.steps != 0 &&
      (static_cast<std::uint64_t>(m.steps) != config_.sync_every ||
       static_cast<std::uint64_t>(m.tokens) != config_.quorum.overlap))
    return JoinRefusal::schedule;
  if (m.type == MessageType::join && config_.max_tokens_per_step != 0 && m.version > config_.max_tokens_per_step)
    return JoinRefusal::tokens_per_step;
  // A join states its round mode in `fragment`'s low byte (0: a learner
  // predating the field) and the shard it addresses above it (count 0: a
  // learner that names none, which only an unsharded syncer serves).
  if (m.type == MessageType::join && (m.fragment & 0xffu) != 0 &&
      (m.fragment & 0xffu) != static_cast<std::uint32_t>(config_.round))
    return JoinRefusal::round_mode;
  if (m.type == MessageType::join) {
    const auto named = detail::join_shard(m.fragment);
    if (std::max<std::size_t>(named.count, 1) != config_.shard_count || named.index != config_.shard_index)
      return JoinRefusal::shard_map;
  }
  return std::nullopt;
}

/// Answers a request with join_refused (our plan and schedule, so the other
/// side can name both), counts it and records it for the log, rate limited.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::refuse(const Message& m, JoinRefusal why, TimePoint now, Outbox& out) -> void {
  Message r;
  r.type = MessageType::join_refused;
  r.fingerprint = plan_.fingerprint();
  r.learner = m.learner;
  r.fragment = static_cast<std::uint32_t>(why);
  r.version = plan_.num_fragments();
  r.step = plan_.total_numel();
  r.steps = static_cast<std::int64_t>(config_.sync_every);
  r.tokens = config_.sync_every != 0 ? static_cast<std::int64_t>(config_.quorum.overlap) : 0;
  r.sequence = m.sequence;
  if (why == JoinRefusal::tokens_per_step) r.version = config_.max_tokens_per_step;
  if (why == JoinRefusal::round_mode) r.version = static_cast<std::uint64_t>(config_.round);
  if (why == JoinRefusal::shard_map) {
    r.version = (static_cast<std::uint64_t>(config_.shard_count) << 32) | config_.shard_index;
    r.step = shard_map_.fingerprint();
    r.tokens = static_cast<std::int64_t>(m.fragment);
  }
  const std::size_t from = out.size();
  out.push_back({m.learner, std::move(r)});
  count_out(out, from);
  std::unique_lock lock(members_mutex_);
  if (why == JoinRefusal::foreign_plan) ++counters_.rejected[static_cast<std::size_t>(RejectReason::foreign_plan)];
  ++(m.type == MessageType::join ? counters_.joins_refused : counters_.observes_refused);
  if (!refusal_window_start_ || now - *refusal_window_start_ >= config_.refusal_log_interval) {
    refusal_window_start_ = now;
    refusal_window_count_ = 0;
  }
  // At most refusal_log_burst records per interval, and never more than 4
  // intervals' worth waiting for take_refusals().
  if (refusal_window_count_ >= config_.refusal_log_burst || refusals_.size() >= 4 * config_.refusal_log_burst) {
    ++refusals_suppressed_;
    return;
  }
  ++refusal_window_count_;
  RefusedRequest rec;
  rec.type = m.type;
  rec.learner = m.learner;
  rec.reason = why;
  rec.fingerprint = m.fingerprint;
  rec.sync_every = static_cast<std::uint64_t>(m.steps);
  rec.overlap = static_cast<std::uint64_t>(m.tokens);
  if (m.type == MessageType::join) rec.tokens_per_step = m.version;
  rec.our_max_tokens_per_step = config_.max_tokens_per_step;
  rec.our_fingerprint = plan_.fingerprint();
  rec.our_sync_every = config_.sync_every;
  rec.our_overlap = config_.quorum.overlap;
  if (m.type == MessageType::join) rec.round = m.fragment & 0xffu;
  if (m.type == MessageType::join) rec.shard = detail::join_shard(m.fragment);
  rec.our_round = config_.round;
  rec.our_shard = detail::JoinShard{config_.shard_index, config_.shard_count};
  rec.suppressed = std::exchange(refusals_suppressed_, 0);
  refusals_.push_back(rec);
}

/// An observer's request: the whole global state (one full_state per
/// fragment, `sequence` = the request's nonce, `step` = the fragment count),
/// rate limited (SyncerConfig::observe_interval / observe_burst). The
/// observer is not a learner: nothing about membership, quorum or liveness
/// changes.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::on_observe(const Message& m, TimePoint now, Outbox& out) -> void {
  {
    std::unique_lock lock(members_mutex_);
    if (!observe_window_start_ || now - *observe_window_start_ >= config_.observe_interval) {
      observe_window_start_ = now;
      observe_window_count_ = 0;
    }
    const auto last = observe_last_.find(m.learner);
    if (observe_window_count_ >= config_.observe_burst ||
        (last != observe_last_.end() && now - last->second < config_.observe_interval)) {
      ++counters_.observes_limited;
      return;
    }
    if (observe_last_.size() >= 1024) {  // ids that have not asked for an interval need no entry
      std::erase_if(observe_last_, [&](const auto& kv) { return now - kv.second >= config_.observe_interval; });
    }
    observe_last_[m.learner] = now;
    ++observe_window_count_;
    ++counters_.observes;
  }
  const std::size_t from = out.size();
  for (std::size_t p = 0; p < fragments_.size(); ++p) {
    if (!serves(p)) continue;  // a shard answers with its fragments (`step` still counts all P)
    auto& f = fragments_[p];
    std::unique_lock lock(f.mutex);
    Message reply = global_message(p, f, m.learner, MessageType::full_state);
    reply.sequence = m.sequence;
    reply.step = fragments_.size();
    out.push_back({m.learner, std::move(reply)});
  }
  count_out(out, from);
}

// ---- membership ---------------------------------------------------------
/// A join carries a nonce in `sequence`, chosen by the learner once per
/// incarnation: a retried or duplicated join (same nonce) keeps the same
/// sequence base and is answered again only if its answer may have been lost
/// (SyncerConfig::join_repeat_interval); a new nonce starts a new
/// incarnation. Answers are rate limited per id and in total, and a new id
/// beyond max_learners is refused (see SyncerConfig, "Membership bounds").
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::on_join(const Message& m, TimePoint now, Outbox& out) -> void {
  std::uint64_t first_sequence = 0;
  std::vector<LearnerId> pruned;
  bool new_incarnation = false;
  std::vector<std::size_t> rounds_to_decide;
  {
    std::unique_lock lock(members_mutex_);
    auto it = learners_.find(m.learner);
    const bool fresh = it == learners_.end();
    if (fresh && !join_allowed_locked(nullptr, now)) return;
    if (fresh && learners_.size() >= config_.max_learners) {
      // Make room by forgetting the learner dead longest; refuse if all are alive.
      auto victim = learners_.end();
      for (auto j = learners_.begin(); j != learners_.end(); ++j)
        if (!j->second.alive && (victim == learners_.end() || j->second.last_seen < victim->second.last_seen))
          victim = j;
      if (victim == learners_.end()) {
        ++counters_.joins_over_capacity;
        lock.unlock();
        return refuse(m, JoinRefusal::full, now, out);
      }
      pruned.push_back(victim->first);
      forget_locked(victim);
    }
    if (!fresh) {
      LearnerInfo& known = it->second;
      const bool repeat = known.incarnation != 0 && known.join_nonce == m.sequence;
      // A repeat whose learner has contributed since has its state; one that
      // comes sooner than a lost answer's retry would is a duplicate.
      if (repeat && (known.last_contribution ||
                     (known.last_join_answer && now - *known.last_join_answer < config_.join_repeat_interval))) {
        ++counters_.joins_limited;
        known.last_seen = std::max(known.last_seen, now);
        known.alive = true;
        return;
      }
      if (!join_allowed_locked(&known, now)) return;
    }
    auto& l = learners_[m.learner];
    if (fresh) {
      // Numbered above every forgotten incarnation (its sequences are gone).
      l.incarnation = incarnation_floor_;
      l.first_sequence = sequence_floor_;
      l.window_start = now;
      l.window_count = 1;
    }
    l.last_join_answer = now;
    if (fresh || l.incarnation == 0 || l.join_nonce != m.sequence) {
      ++l.incarnation;
      // Each incarnation gets its own sequence space, so a late message from a
      // previous incarnation can never be mistaken for a new one; after a
      // restore the space is in the new epoch, above any space lost in the crash.
      l.first_sequence = std::max(l.first_sequence + (std::uint64_t{1} << kIncarnationShift),
                                  sequence_epoch_ << kSequenceEpochShift);
      l.join_nonce = m.sequence;
      l.last_contribution.reset();
      l.contributed = false;
      l.tokens_per_step = m.version;  // the claims of this incarnation are bounded by its join
      // A learner asked to rejoin keeps its unsent progress (OuterLoop), so
      // its next contribution of a fragment may span steps from before this
      // join: at most the ceiling (all of them when there is none).
      const std::uint64_t ceiling = steps_ceiling(config_);
      const std::uint64_t carried = ceiling != 0 ? std::min<std::uint64_t>(m.step, ceiling) : m.step;
      l.step_base.assign(fragments_.size(), m.step - carried);
      // Its steps count from the global step now; the state it receives
      // is a receipt of every fragment; it waits for rounds opened after now.
      l.join_step = m.step;
      l.join_global = global_step_;
      l.carried = 0;
      l.step = m.step;
      l.reported = false;
      l.receipt_step.assign(fragments_.size(), m.step);
      l.sent.assign(fragments_.size(), {});
      new_incarnation = true;
      ++counters_.joins;
    }
    l.last_seen = now;
    l.alive = true;
    first_sequence = l.first_sequence;
  }
  forget_sequences(pruned);
  const std::size_t from = out.size();
  for (std::size_t p = 0; p < fragments_.size(); ++p) {
    if (!serves(p)) continue;  // another shard answers for its fragments
    auto& f = fragments_[p];
    std::unique_lock lock(f.mutex);
    auto& last = f.last_sequence[m.learner];
    last = std::max(last, first_sequence);
    Message reply = global_message(p, f, m.learner, MessageType::full_state);
    reply.sequence = first_sequence;
    out.push_back({m.learner, std::move(reply)});
    if (pull_schedule_) {  // a receipt; it may carry steps from before the join (step_base)
      std::unique_lock members(members_mutex_);
      if (auto it = learners_.find(m.learner); it != learners_.end()) {
        auto& l = it->second;
        note_sent(l, p, f.version, p < l.step_base.size() ? l.step_base[p] : 0);
      }
    }
    // A new incarnation is not waited for on its predecessor's pulls; one of
    // them that reaches it anyway is answered, and that answer is dropped (orphaned).
    if (new_incarnation) {
      if (auto o = f.owed.find(m.learner); o != f.owed.end()) {
        f.orphaned[m.learner] = o->second;
        f.owed.erase(o);
      } else {
        f.orphaned.erase(m.learner);
      }
    }
    if (new_incarnation && f.phase == FragmentState::Phase::pulling && !f.answered.contains(m.learner) &&
        f.pulled.erase(m.learner) != 0)
      rounds_to_decide.push_back(p);
  }
  count_out(out, from);
  for (std::size_t p : rounds_to_decide) merge_if_due(p, out);
}

/// The join rate limits (SyncerConfig::join_interval, join_burst and, for a
/// known learner `l`, join_burst_per_learner): true, and counted against
/// them, if one more full-state answer fits now; else counted in joins_limited.
/// Caller holds members_mutex_.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::join_allowed_locked(LearnerInfo* l, TimePoint now) -> bool {
  if (!join_window_start_ || now - *join_window_start_ >= config_.join_interval) {
    join_window_start_ = now;
    join_window_count_ = 0;
  }
  if (l != nullptr && (!l->window_start || now - *l->window_start >= config_.join_interval)) {
    l->window_start = now;
    l->window_count = 0;
  }
  if (join_window_count_ >= config_.join_burst || (l != nullptr && l->window_count >= config_.join_burst_per_learner)) {
    ++counters_.joins_limited;
    return false;
  }
  ++join_window_count_;
  if (l != nullptr) ++l->window_count;
  return true;
}

/// Forgets a learner's membership entry; its per-fragment sequences go in
/// forget_sequences() (which takes the fragment locks this caller may not).
/// Later incarnations of the id are numbered above this one's. Caller holds
/// members_mutex_.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::forget_locked(typename std::map<LearnerId, LearnerInfo>::iterator it) -> void {
  incarnation_floor_ = std::max(incarnation_floor_, it->second.incarnation);
  sequence_floor_ = std::max(sequence_floor_, it->second.first_sequence);
  learners_.erase(it);
  ++counters_.learners_pruned;
}

/// Drops the per-fragment sequences of forgotten learners, unless one of them
/// joined again meanwhile (its new incarnation's sequences are then kept).
/// Takes each fragment's lock, then the membership lock (the usual order).
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::forget_sequences(const std::vector<LearnerId>& ids) -> void {
  if (ids.empty()) return;
  for (auto& f : fragments_) {
    std::unique_lock lock(f.mutex);
    std::unique_lock members(members_mutex_);
    for (LearnerId id : ids)
      if (!learners_.contains(id)) f.last_sequence.erase(id);
  }
}

template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::on_leave(const Message& m) -> void {
  std::unique_lock lock(members_mutex_);
  auto it = learners_.find(m.learner);
  if (it == learners_.end()) {
    ++counters_.rejected[static_cast<std::size_t>(RejectReason::unknown_learner)];
    return;
  }
  if (it->second.alive) ++counters_.leaves;
  it->second.alive = false;
}

/// Marks a known learner as heard from now, at inner step `step` (every
/// message carries the sender's step counter), and moves the global step.
/// `step_time` is given for a contribution: it is set to the learner's
/// inner-step time since its previous contribution. False if the learner is unknown.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::touch(LearnerId id, TimePoint now, std::uint64_t step, std::optional<Duration>* step_time) -> bool {
  std::unique_lock lock(members_mutex_);
  auto it = learners_.find(id);
  if (it == learners_.end()) {
    ++counters_.rejected[static_cast<std::size_t>(RejectReason::unknown_learner)];
    ask_rejoin_locked(id, now);
    return false;
  }
  auto& l = it->second;
  l.last_seen = std::max(l.last_seen, now);
  l.alive = true;
  advance_locked(id, l, step);
  if (step_time) {
    if (l.last_contribution && step > l.last_contribution->second && now > l.last_contribution->first) {
      const auto steps = step - l.last_contribution->second;
      *step_time = (now - l.last_contribution->first) / static_cast<Duration::rep>(steps);
    }
    l.last_contribution = std::make_pair(now, step);
    l.contributed = true;
  }
  return true;
}

/// The global step t (docs/algorithm.md, "Round timeline"): each learner's
/// position is the global step at its join plus the inner steps it has
/// trained since, and t is the furthest position any learner has reached.
/// Learners whose own counters differ (one restarted from 0, one resumed
/// at 5000) are on one axis; a learner that restarts does not move t back.
/// Caller holds members_mutex_.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::advance_locked(LearnerId id, LearnerInfo& l, std::uint64_t step) -> void {
  if (!l.join_step) {  // restored from a snapshot: its steps count from here
    l.join_step = step;
    l.join_global = global_step_;
    l.step = step;
  }
  if (step <= l.step) return;
  // The inner-step time, from any two messages of one learner (pull rounds:
  // metadata every step), for the pull time-out.
  const TimePoint now = l.last_seen;
  if (l.step_seen && now > l.step_seen->first && step > l.step_seen->second) {
    const double per_step = std::chrono::duration<double>(now - l.step_seen->first).count() /
                            static_cast<double>(step - l.step_seen->second);
    step_seconds_.add(per_step);
    l.step_interval_s = l.step_interval_s == 0.0 ? per_step : 0.9 * l.step_interval_s + 0.1 * per_step;
  }
  l.step_seen = std::make_pair(now, step);
  l.step = step;
  if (step <= *l.join_step) return;
  l.reported = true;
  if (!pull_schedule_) {  // push rounds keep t for staleness and status; their schedule is the learners'
    global_step_ = std::max(global_step_, position(l));
    return;
  }
  const std::uint64_t pos = carried_position(l);
  if (pos <= global_step_) {
    carry_on_locked(id, now);
    return;
  }
  // The leader: counted at most lead_bound() ahead of the runner-up
  // (SyncerConfig::max_lead), among the other learners still training: alive,
  // and whose step counter rose within the time it takes that learner for
  // `lead` of its own steps (one paused, or stopped without leaving, holds
  // nobody back for longer; each learner's own pace, so the leader's
  // counter cannot shorten the others' window). Only a message that would
  // move t pays this scan over the learners: O(M) per global step, not per message.
  // The runner-up's position is its own, without what it carried: a learner
  // that lies about its step counter, goes quiet until it is declared dead
  // and comes back gains nothing from the others having carried t on.
  const std::uint64_t lead = lead_bound(config_);
  std::optional<std::uint64_t> runner_up;
  for (const auto& [other, o] : learners_) {
    if (other == id || !still_training(o, now, lead)) continue;
    runner_up = std::max(runner_up.value_or(0), position(o));
  }
  std::uint64_t counted = pos;
  if (runner_up && *runner_up < pos && pos - *runner_up > lead) {
    counted = *runner_up + lead;
    ++counters_.steps_beyond_lead;
  }
  if (counted > global_step_) {
    global_step_ = counted;
    frontier_ = id;
  }
}

/// A learner the leader's lead is counted against: alive, trained since its
/// join, and its step counter rose within the time it takes it for `lead`
/// of its own steps. Caller holds members_mutex_.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::still_training(const LearnerInfo& o, TimePoint now, std::uint64_t lead) noexcept -> bool {
  if (!o.alive || !o.reported) return false;
  return !(o.step_interval_s > 0.0 && o.step_seen &&
           std::chrono::duration<double>(now - o.step_seen->first).count() >
               o.step_interval_s * static_cast<double>(lead));
}

/// Pull rounds: when the learner that last moved t (frontier_) has died or
/// left, t would wait until another learner trained past the lead it had
/// (docs/algorithm.md, "Pull rounds (the paper's round)"). Instead, every learner still
/// training has its position raised by the same amount, so that the
/// furthest of them is at t and their next steps move t at their pace.
/// Called when learner `id`'s step did not move t; O(log M) unless the
/// frontier has gone, then O(M) once. Caller holds members_mutex_.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::carry_on_locked(LearnerId id, TimePoint now) -> void {
  if (!frontier_ || *frontier_ == id) return;
  const auto f = learners_.find(*frontier_);
  if (f != learners_.end() && f->second.alive) return;
  const std::uint64_t lead = lead_bound(config_);
  std::uint64_t furthest = 0;
  std::optional<LearnerId> next;
  std::vector<LearnerInfo*> training;
  for (auto& [other, o] : learners_) {
    if (!still_training(o, now, lead)) continue;
    training.push_back(&o);
    if (const std::uint64_t pos = carried_position(o); !next || pos > furthest) {
      furthest = pos;
      next = other;
    }
  }
  if (!next) return;
  frontier_ = next;
  const std::uint64_t raise = global_step_ - std::min(furthest, global_step_);
  if (raise == 0) return;
  for (LearnerInfo* o : training) o->carried = saturating_sum(o->carried, raise);
  ++counters_.frontier_carries;
}

/// The position the global step follows: position() plus what the learner
/// carried when a furthest learner died (saturating). Caller holds members_mutex_.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::carried_position(const LearnerInfo& l) noexcept -> std::uint64_t {
  return saturating_sum(position(l), l.carried);
}

/// A learner's position on the global-step axis: the global step at its
/// join plus the inner steps it has trained since (saturating). Caller holds members_mutex_.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::position(const LearnerInfo& l) noexcept -> std::uint64_t {
  if (!l.join_step || l.step <= *l.join_step) return l.join_global;
  return saturating_sum(l.join_global, l.step - *l.join_step);
}

/// Pull rounds: records whether learner `id`'s latest contribution was
/// accepted (LearnerInfo::answers_refused). Takes the membership lock.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::note_answer(LearnerId id, bool accepted) -> void {
  if (!pull_schedule_) return;
  std::unique_lock lock(members_mutex_);
  if (auto it = learners_.find(id); it != learners_.end()) it->second.answers_refused = !accepted;
}

template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::answers_refused(LearnerId id) const -> bool {
  std::unique_lock lock(members_mutex_);
  const auto it = learners_.find(id);
  return it != learners_.end() && it->second.answers_refused;
}

/// Notes that unknown learner `id` should be asked to join again, unless it
/// was asked less than rejoin_interval ago or the interval's burst for all
/// ids is spent (then only counted). Caller holds members_mutex_.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::ask_rejoin_locked(LearnerId id, TimePoint now) -> void {
  if (!rejoin_window_start_ || now - *rejoin_window_start_ >= config_.rejoin_interval) {
    rejoin_window_start_ = now;
    rejoin_window_count_ = 0;
  }
  const auto last = rejoin_last_.find(id);
  if (rejoin_window_count_ >= config_.rejoin_burst ||
      (last != rejoin_last_.end() && now - last->second < config_.rejoin_interval)) {
    ++counters_.rejoin_requests_limited;
    return;
  }
  if (rejoin_last_.size() >= 1024)  // ids not asked within an interval need no entry
    std::erase_if(rejoin_last_, [&](const auto& kv) { return now - kv.second >= config_.rejoin_interval; });
  rejoin_last_[id] = now;
  ++rejoin_window_count_;
  ++counters_.rejoin_requests;
  rejoin_due_.push_back(id);
}

/// Queues a MessageType::rejoin for every id ask_rejoin_locked() noted.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::send_rejoin_requests(Outbox& out) -> void {
  std::vector<LearnerId> ids;
  {
    std::unique_lock lock(members_mutex_);
    if (rejoin_due_.empty()) return;
    ids.swap(rejoin_due_);
  }
  const std::size_t from = out.size();
  for (LearnerId id : ids) {
    Message r;
    r.type = MessageType::rejoin;
    r.fingerprint = plan_.fingerprint();
    r.learner = id;
    out.push_back({id, std::move(r)});
  }
  count_out(out, from);
}

}  // namespace ddiloco
