// ddiloco/syncer/rounds.hpp: when a fragment merges and how (docs/algorithm.md,
// "Round timeline"): the wait policy's decision, the merge and outer step with
// the new global sent out, and the phases of a pull round (open at the slot,
// quorum and grace over learners with progress, the pull, a second ask of a
// learner whose answer looks lost, the time-out).
//
// Member functions of ddiloco::Syncer (syncer.hpp declares them and holds the
// state; this header defines them).
#pragma once

#include <ddiloco/syncer.hpp>

namespace ddiloco {

/// Asks the wait policy about fragment p's round; merges if told to.
/// Caller holds f.mutex.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::decide_and_merge(std::size_t p, FragmentState& f, TimePoint now, Outbox& out) -> bool {
  if (pull_schedule_) return decide_pull(p, f, now, out);
  {
    // A push round waits for the alive learners that have trained since
    // they joined (docs/algorithm.md, "Push rounds (for comparison)"): ids
    // that only joined, or only send heartbeats, would otherwise hold every
    // round for its grace window. K is still bounded by every alive one.
    std::unique_lock lock(members_mutex_);
    f.round.alive = alive_count_locked();
    f.round.training = training_count_locked();
  }
  const WaitDecision d = f.wait->decide(f.round, now);
  switch (d.kind) {
    case WaitDecision::Kind::idle: f.wake.reset(); return false;
    case WaitDecision::Kind::wait_until: f.wake = d.until; return false;
    case WaitDecision::Kind::merge_now: break;
  }
  merge(p, f, now, d, out);
  return true;
}

template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::merge(std::size_t p, FragmentState& f, TimePoint now, const WaitDecision& d, Outbox& out) -> void {
  const TimePoint started = clock_->now();
  float share = 1.0f;
  // Pull rounds merge once per H global steps with every available learner:
  // no share to scale by (docs/algorithm.md, "Participation scaling").
  if (config_.participation_scaling && !pull_schedule_) {
    // Shared among the learners that contribute (not every alive id: ids
    // that only joined would shrink every merge).
    std::size_t contributing = 0;
    {
      std::unique_lock lock(members_mutex_);
      contributing = contributing_count_locked();
    }
    const std::size_t k = f.contributors.size(), live = std::max(std::min(f.round.alive, contributing), k);
    if (k > 0 && k < live) share = static_cast<float>(k) / static_cast<float>(live);
  }
  if constexpr (kFused) {
    f.acc->finish_step(opt_, share, f.theta, f.state);
  } else {
    f.acc->finish(f.delta);
    if (share != 1.0f)
      for (float& x : f.delta) x *= share;
    opt_.step(f.theta, f.delta, f.state);
  }
  if (pull_schedule_ && config_.anchor_versions > 0) {  // Theta_p^(version) for anchor()
    f.previous.emplace_back(f.version, f.published);
    while (f.previous.size() > config_.anchor_versions) f.previous.pop_front();
  }
  ++f.version;
  {
    std::unique_lock lock(members_mutex_);
    f.version_steps.emplace_back(f.version, global_step_);
  }
  if (f.version_steps.size() > kVersionSteps) f.version_steps.pop_front();
  merges_total_.fetch_add(1, std::memory_order_relaxed);
  f.published = published_->publish(p, f.theta);
  const std::size_t k = f.contributors.size();
  if (f.quorum_sizes.size() <= k) f.quorum_sizes.resize(k + 1);
  ++f.quorum_sizes[k];
  ++f.status.merges;
  f.status.last_quorum_size = k;
  f.status.contributions_merged += k;
  // (A pull round's grace window ended when its pulls went out.)
  const TimePoint grace_end = f.phase == FragmentState::Phase::pulling ? f.pulled_at : now;
  if (f.round.quorum_at && grace_end > *f.round.quorum_at && d.reason.find("grace") != std::string_view::npos) {
    ++f.status.grace_waits;
    f.grace_wait_seconds.observe(std::chrono::duration<double>(grace_end - *f.round.quorum_at).count());
  }
  if (d.reason.find("deadline") != std::string_view::npos) ++f.status.deadline_merges;
  f.round_seconds.observe(std::chrono::duration<double>(std::max(Duration{0}, clock_->now() - f.round.start)).count());
  f.acc->reset();
  f.contributors.clear();
  f.round = RoundState{};
  f.wake.reset();
  const bool pulled = f.phase == FragmentState::Phase::pulling;
  close_pull_round(p, f);
  std::vector<LearnerId> receivers;
  {
    std::unique_lock lock(members_mutex_);
    if (config_.send_merged_to == MergeRecipients::contributors) {
      // Learners in this merge, still alive (one that left gets nothing).
      for (LearnerId id : f.accepted_from)
        if (auto it = learners_.find(id); it != learners_.end() && it->second.alive) receivers.push_back(id);
    } else {
      // Pull rounds: only learners that have trained since their join (the
      // rest have the state their join brought, and get the next merge
      // after their first step), so ids that join and never train (a
      // plaintext join flood: hundreds alive at once) cost no fan-out.
      for (const auto& [id, l] : learners_)
        if (l.alive && (l.reported || !pull_schedule_)) receivers.push_back(id);
    }
    for (LearnerId id : receivers) {  // pull rounds: what each has trained since it gets p
      auto& l = learners_.at(id);
      if (l.receipt_step.size() != fragments_.size()) l.receipt_step.assign(fragments_.size(), 0);
      l.receipt_step[p] = l.step;
      note_sent(l, p, f.version, l.step);
    }
  }
  f.accepted_from.clear();
  const std::size_t from = out.size();
  for (LearnerId id : receivers)
    out.push_back({id, global_message(p, f, id, MessageType::global_fragment)});
  // Pull rounds: the pull's round trip is part of the sync time the grace window must leave room for.
  f.wait->observe_sync_time(clock_->now() - (pulled ? f.pulled_at : started));
  count_out(out, from);
}

/// Learner `l` counts for a round whose slot is global step `slot`: alive,
/// joined before the slot (at a lower global step) and trained since it
/// joined (eligible); has_progress: trained since it last received p.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::eligible(const LearnerInfo& l, std::uint64_t slot) noexcept -> bool {
  return l.alive && l.reported && l.join_global < slot;
}

template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::has_progress(const LearnerInfo& l, std::size_t p) noexcept -> bool {
  return p >= l.receipt_step.size() || l.step > l.receipt_step[p];
}

/// Opens the rounds of the fragments whose slots the global step has
/// passed since the last call (each fragment at most once per call; a
/// fragment whose previous round is still open keeps that round).
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::open_due_rounds(TimePoint now, Outbox& out) -> void {
  if (!pull_schedule_) return;
  std::vector<std::pair<std::size_t, std::uint64_t>> due;  // (fragment, slot step)
  {
    std::unique_lock lock(members_mutex_);
    const std::uint64_t from = opened_through_, to = global_step_;
    if (to <= from) return;
    opened_through_ = to;
    const std::uint64_t h = config_.sync_every;
    for (std::uint64_t t = to - std::min<std::uint64_t>(to - from, h) + 1; t <= to; ++t)
      if (auto p = pull_schedule_->due_at(t)) due.emplace_back(*p, t);
  }
  for (const auto& [p, t] : due) {
    if (!serves(p)) continue;  // another shard's slot
    auto& f = fragments_[p];
    std::unique_lock lock(f.mutex);
    if (f.phase != FragmentState::Phase::none) continue;
    set_phase(p, f, FragmentState::Phase::waiting);
    f.round = RoundState{};
    f.round.start = now;
    f.round_step = t;
    {
      std::unique_lock members(members_mutex_);
      ++counters_.pull_rounds;
    }
    decide_pull(p, f, now, out);
  }
}

/// Asks the wait policy again about every round waiting for its quorum (a
/// metadata message may have made a learner count). Only those fragments'
/// locks are taken: a fragment busy merging is never in that phase, so the
/// thread handling metadata never waits behind a merge.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::refresh_waiting_rounds(TimePoint now, Outbox& out) -> void {
  if (!pull_schedule_) return;
  std::vector<std::size_t> waiting;
  {
    std::unique_lock lock(members_mutex_);
    if (waiting_rounds_.empty()) return;
    waiting = waiting_rounds_;
  }
  for (std::size_t p : waiting) {
    auto& f = fragments_[p];
    std::unique_lock lock(f.mutex);
    if (f.phase == FragmentState::Phase::waiting) decide_pull(p, f, now, out);
  }
}

/// Keeps waiting_rounds_ and pulling_rounds_ (the fragments in those phases) in step with f.phase.
/// Caller holds f.mutex.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::set_phase(std::size_t p, FragmentState& f, typename FragmentState::Phase phase) -> void {
  using Phase = typename FragmentState::Phase;
  if (f.phase == phase) return;
  if (f.phase != Phase::none || phase != Phase::none) {
    std::unique_lock lock(members_mutex_);
    for (auto [listed, index] :
         {std::pair{Phase::waiting, &waiting_rounds_}, std::pair{Phase::pulling, &pulling_rounds_}}) {
      if (f.phase == listed) std::erase(*index, p);
      if (phase == listed) index->push_back(p);
    }
  }
  f.phase = phase;
}

/// The pull-mode decision for fragment p's round (steps 2, 3 and 5 of the list in
/// syncer.hpp). Caller holds f.mutex.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::decide_pull(std::size_t p, FragmentState& f, TimePoint now, Outbox& out) -> bool {
  using Phase = typename FragmentState::Phase;
  if (f.phase == Phase::none) {
    f.wake.reset();
    return false;
  }
  if (f.phase == Phase::waiting) {
    {
      std::unique_lock lock(members_mutex_);
      f.round.contributions = 0;
      f.round.alive = 0;
      for (const auto& [id, l] : learners_) {
        if (!eligible(l, f.round_step)) continue;
        ++f.round.alive;
        if (has_progress(l, p)) ++f.round.contributions;
      }
    }
    const WaitDecision d = f.wait->decide(f.round, now);
    if (d.kind == WaitDecision::Kind::idle) {
      f.wake.reset();  // nobody to pull yet: asked again at the next metadata
      return false;
    }
    if (d.kind == WaitDecision::Kind::wait_until) {
      f.wake = d.until;
      return false;
    }
    f.graced = d.reason.find("grace") != std::string_view::npos;
    start_pull(p, f, now, out);
  }
  // Pulling: merge once every pulled learner has answered or died, or at the
  // pull time-out (an answer takes at most one of the learner's steps; the
  // quorum and the grace window were the waiting phase's).
  bool waiting_for_answers = false;
  {
    std::unique_lock lock(members_mutex_);
    for (const auto& [id, at] : f.pulled) {
      if (f.answered.contains(id)) continue;
      auto it = learners_.find(id);
      if (it != learners_.end() && it->second.alive && !it->second.answers_refused) waiting_for_answers = true;
    }
  }
  const TimePoint timeout = detail::saturating_add(f.pulled_at, pull_timeout(f));
  if (waiting_for_answers && now < timeout) {
    f.wake = timeout;
    return false;
  }
  if (waiting_for_answers) {  // timed out: their answers, when they come, still measure the wait
    f.overdue.clear();
    for (const auto& [id, at] : f.pulled)
      if (!f.answered.contains(id)) f.overdue.emplace(id, false);
    f.overdue_since = f.pulled_at;
  }
  if (f.contributors.empty()) {  // nothing accepted: no merge, the global stays
    std::unique_lock lock(members_mutex_);
    ++counters_.pull_rounds_empty;
    if (waiting_for_answers) ++counters_.pull_timeouts;
    lock.unlock();
    close_pull_round(p, f);
    f.round = RoundState{};
    f.wake.reset();
    return false;
  }
  if (waiting_for_answers) {
    std::unique_lock lock(members_mutex_);
    ++counters_.pull_timeouts;
  }
  WaitDecision d{WaitDecision::Kind::merge_now, now,
                 f.graced ? std::string_view("pull answered, grace window waited") : std::string_view("pull answered")};
  merge(p, f, now, d, out);
  return true;
}

/// Sends fragment p's pull to every eligible learner with progress on p. Caller holds f.mutex.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::start_pull(std::size_t p, FragmentState& f, TimePoint now, Outbox& out) -> void {
  set_phase(p, f, FragmentState::Phase::pulling);
  f.pulled_at = now;
  f.pulled.clear();
  f.answered.clear();
  {
    std::unique_lock lock(members_mutex_);
    const auto forgotten = [&](const auto& kv) { return !learners_.contains(kv.first); };
    std::erase_if(f.owed, forgotten);
    std::erase_if(f.orphaned, forgotten);
    std::erase_if(f.reasked, forgotten);
    for (const auto& [id, l] : learners_) {
      // (One whose late answer to the previous round is already in the accumulator is not asked again.)
      if (!eligible(l, f.round_step) || !has_progress(l, p) || f.contributors.contains(id)) continue;
      // Nor is one whose answer to the pull that timed out is on its way: a second answer
      // from the same base, merged after the first, would be stale. Skipped once (an answer
      // that was lost is asked for again in the round after).
      if (auto it = f.overdue.find(id); it != f.overdue.end() && !it->second) {
        it->second = true;
        continue;
      }
      f.pulled.emplace(id, l.step);
      auto& owed = f.owed[id];
      owed = std::min<std::uint8_t>(static_cast<std::uint8_t>(owed + 1), FragmentState::kOwedAnswers);
    }
    counters_.pulls_sent += f.pulled.size();
  }
  const std::size_t from = out.size();
  for (const auto& [id, at] : f.pulled) out.push_back({id, pull_message(p, f, id, false)});
  count_out(out, from);
}

/// The pull of fragment p's open round for learner `id` (a second ask: `repeat`). Caller holds f.mutex.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::pull_message(std::size_t p, const FragmentState& f, LearnerId id,
                                                    bool repeat) const -> Message {
  Message m;
  m.type = MessageType::pull;
  m.fingerprint = plan_.fingerprint();
  m.learner = id;
  m.fragment = static_cast<std::uint32_t>(p);
  m.version = f.version;
  m.step = f.round_step;
  m.repeat = repeat;
  // The oldest base an answer can be anchored at (stale()): a learner on an
  // older one waits for the global on its way before it answers.
  // (0: not stated, when answers are not anchored.)
  if (config_.anchor_versions > 0)
    m.tokens = static_cast<std::int64_t>(f.previous.empty() ? f.version : f.previous.front().first);
  return m;
}

/// Asks learner `id` once more for every fragment whose open pull it has not
/// answered although its step counter has moved SyncerConfig::reask_after_steps
/// past its step at the pull and 1.5 times the fragment's typical
/// pull-to-answer time has passed: it answers at its next step boundary, so
/// the pull or the answer was most likely lost, and without a second ask its
/// steps on p would be lost when it applies the merge it was left out of
/// (docs/algorithm.md, "Pull rounds (the paper's round)", step 4). (The time
/// keeps a link slower than a few steps from asking twice every round.) Once
/// per learner per round, not before an answer time has been measured for p,
/// and not while an answer from it waits in a queue (note_queued()): its step
/// reports are handled before it. Called on each of its step reports; a
/// fragment busy merging is skipped (its round is closing), so this never
/// waits behind a merge.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::reask_missing(LearnerId id, TimePoint now, Outbox& out) -> void {
  if (!pull_schedule_ || config_.reask_after_steps == 0) return;
  std::vector<std::size_t> pulling;
  std::uint64_t step = 0;
  {
    std::unique_lock lock(members_mutex_);
    if (pulling_rounds_.empty()) return;
    const auto it = learners_.find(id);
    if (it == learners_.end() || !it->second.alive || it->second.answers_refused) return;
    step = it->second.step;
    // (Not for a fragment whose answer from it is in, queued to be handled: note_queued().)
    for (std::size_t p : pulling_rounds_)
      if (!queued_.contains({id, static_cast<std::uint32_t>(p)})) pulling.push_back(p);
  }
  const std::size_t from = out.size();
  std::uint64_t asked = 0;
  for (std::size_t p : pulling) {
    auto& f = fragments_[p];
    std::unique_lock lock(f.mutex, std::try_to_lock);
    if (!lock.owns_lock() || f.phase != FragmentState::Phase::pulling) continue;
    const auto at = f.pulled.find(id);
    if (at == f.pulled.end() || f.answered.contains(id) || step < at->second + config_.reask_after_steps) continue;
    // (No answer time measured yet, as in a fragment's first rounds: no evidence of a loss.)
    if (!f.answer_seconds.has_value() ||
        std::chrono::duration<double>(now - f.pulled_at).count() < 1.5 * f.answer_seconds.value())
      continue;
    auto [r, fresh] = f.reasked.try_emplace(id);
    if (!fresh && r->second.round_step == f.round_step) continue;  // asked twice in this round already
    r->second = typename FragmentState::Reask{f.round_step, step, std::nullopt};
    out.push_back({id, pull_message(p, f, id, true)});
    ++asked;
  }
  if (asked == 0) return;
  count_out(out, from);
  std::unique_lock lock(members_mutex_);
  counters_.pulls_repeated += asked;
}

/// Ends fragment p's pull round (merged, empty, or discarded by a restore). Caller holds f.mutex.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::close_pull_round(std::size_t p, FragmentState& f) -> void {
  f.graced = false;
  set_phase(p, f, FragmentState::Phase::none);
  f.pulled.clear();
  f.answered.clear();
}

/// SyncerConfig::pull_timeout, or twice the larger of (tau + 1) inner steps
/// as measured from the learners' step counters and fragment p's measured
/// pull-to-answer time (quorum.deadline until a step time is measured).
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::pull_timeout(const FragmentState& f) const -> Duration {
  if (config_.pull_timeout > Duration{0}) return config_.pull_timeout;
  const Duration deadline = config_.quorum.deadline;
  double step = 0.0;
  {
    std::unique_lock lock(members_mutex_);
    if (step_seconds_.has_value()) step = step_seconds_.value();
  }
  if (!(step > 0.0)) return deadline;
  const double answer = f.answer_seconds.has_value() ? f.answer_seconds.value() : 0.0;
  const double t = 2.0 * std::max(static_cast<double>(config_.quorum.overlap + 1) * step, answer);
  if (t >= std::chrono::duration<double>(deadline).count()) return deadline;
  return std::max<Duration>(std::chrono::milliseconds(1),
                            std::chrono::duration_cast<Duration>(std::chrono::duration<double>(t)));
}

}  // namespace ddiloco
