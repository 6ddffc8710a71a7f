// ddiloco/syncer/admission.hpp: what a contribution passes before it touches
// a fragment (docs/algorithm.md, "Validation and staleness"), and the fold.
//
// Order: precheck() without a fragment lock (index, shard, size, counters,
// one scan for finiteness, checksum and per-tensor norms, known learner);
// admit() under fragment p's lock (sequence, the pull it answers, version,
// staleness, bounded claims, the anchor of an older base at the current
// global, the norm against the robust reference, clipping, the weight cap);
// fold() adds a batch's accepted contributions of p to its accumulator in
// one add_batch call. Every refusal is counted by reason (reject()).
//
// Member functions of ddiloco::Syncer (syncer.hpp declares them and holds the
// state; this header defines them).
#pragma once

#include <ddiloco/syncer.hpp>

namespace ddiloco {

/// A contribution against base version `base` = m.version is stale when the
/// global had moved on from its base for more than max_staleness rounds when
/// the syncer received it: with H known (sync_every), rounds of H global steps
/// from the merge that superseded `base` (the global step of each recent
/// version is kept) to the global step at its receipt, so the bound does not
/// shrink as merges per round grow with M (push rounds at K = 1 make about one
/// merge per learner per round); without H, or for a base older than the
/// versions kept, versions. At its receipt, not when it is checked: a
/// contribution that waited in the syncer's own queue (SyncerRuntime drains
/// each fragment's queue on its own, so other fragments' contributions and
/// step reports move the global step on meanwhile) does not age there
/// (note_queued() keeps the step). Caller holds f.mutex.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::stale(const FragmentState& f, const Checked& c) const -> bool {
  const std::uint64_t base = c.m->version;
  if (base >= f.version) return false;  // the current global (a future base is rejected before)
  // Pull rounds: an answer is measured from the learner's base global, so it
  // can only be merged anchored at one of the previous globals kept.
  if (pull_schedule_ && config_.anchor_versions > 0)
    return std::none_of(f.previous.begin(), f.previous.end(), [&](const auto& e) { return e.first == base; });
  if (config_.sync_every != 0) {
    for (auto it = f.version_steps.rbegin(); it != f.version_steps.rend(); ++it) {
      if (it->first != base + 1) continue;
      std::uint64_t received = 0;
      {
        std::unique_lock lock(members_mutex_);
        received = std::min(global_step_, c.received_at.value_or(global_step_));
      }
      const std::uint64_t age = received > it->second ? received - it->second : 0;
      return age / config_.sync_every > config_.max_staleness;
    }
  }
  return f.version - base > config_.max_staleness;
}

/// Bounds a contribution's claims (docs/algorithm.md, "Validation and
/// staleness", "Bounded claims"), with s = m.step, b = the learner's step
/// counter at its previous contribution of fragment p (or its join):
///   steps <= s - b, steps <= steps_ceiling(config)   else steps_beyond_schedule;
///   tokens <= steps x tokens-per-step (declared at join, else
///             SyncerConfig::max_tokens_per_step; none: unbounded)
///                                                   else tokens_beyond_declared.
/// An honest learner counts steps and tokens since its last send or receipt
/// of p, which is at or after b, so it never exceeds either bound. b moves to
/// s (if later) whatever the outcome: the learner was at step s. In pull
/// rounds b is the learner's step when the answer's base version was sent
/// to it (LearnerInfo::sent), with no ceiling; unrecorded, its join's. Takes the
/// membership lock (under the fragment's, the usual order).
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::check_claims(std::size_t p, const Message& m) -> std::optional<RejectReason> {
  const auto steps = static_cast<std::uint64_t>(m.steps);  // >= 1 (precheck)
  const auto tokens = static_cast<std::uint64_t>(m.tokens);  // >= 0 (precheck)
  std::uint64_t base = 0, declared = 0;
  bool sent_known = false;
  {
    std::unique_lock lock(members_mutex_);
    if (auto it = learners_.find(m.learner); it != learners_.end()) {
      auto& l = it->second;
      if (l.step_base.size() != fragments_.size()) l.step_base.assign(fragments_.size(), 0);
      base = l.step_base[p];
      // Pull rounds count steps since the learner last applied p, the
      // version its answer is based on: at most the steps since that
      // version was sent to it. Without a record of that send (a restored
      // syncer, an older base) the base stays at its join and the ceiling
      // bounds each claim.
      if (!pull_schedule_) l.step_base[p] = std::max(base, m.step);
      else if (p < l.sent.size())
        for (const auto& s : l.sent[p])
          if (s.set && s.version == m.version) {
            base = s.step;
            sent_known = true;
            break;
          }
      declared = l.tokens_per_step;
    }
  }
  const std::uint64_t ceiling = sent_known ? 0 : steps_ceiling(config_);
  if (m.step < base || steps > m.step - base || (ceiling != 0 && steps > ceiling))
    return RejectReason::steps_beyond_schedule;
  const std::uint64_t per_step = declared != 0 ? declared : config_.max_tokens_per_step;
  // tokens > steps x per_step, without the product (it can overflow)
  if (per_step != 0 && (tokens / per_step > steps || (tokens / per_step == steps && tokens % per_step != 0)))
    return RejectReason::tokens_beyond_declared;
  return std::nullopt;
}

template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::on_contribution(const Message& m, TimePoint now,
                                                       std::optional<std::uint64_t> received_at, Outbox& out) -> void {
  if (auto c = precheck(m, now, received_at)) fold(std::span<Checked>(&*c, 1), out);
}

/// The checks of a contribution that need no fragment lock: index, size,
/// counters, finiteness (one pass computing every tensor's squared norm too,
/// which add_batch then does not compute again), known learner.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::precheck(const Message& m, TimePoint now,
                                                std::optional<std::uint64_t> received_at) -> std::optional<Checked> {
  const auto refuse = [this, &m](RejectReason why) -> std::optional<Checked> {
    reject(why, m);
    if (why != RejectReason::bad_fragment && why != RejectReason::wrong_shard) note_answer(m.learner, false);
    return std::nullopt;
  };
  if (m.fragment >= fragments_.size()) return refuse(RejectReason::bad_fragment);
  if (!serves(m.fragment)) return refuse(RejectReason::wrong_shard);
  const std::size_t n = fragments_[m.fragment].theta.size();
  if ((!m.payload && !m.encoded) || m.payload_size() != n) return refuse(RejectReason::wrong_size);
  if (m.steps < 1 || m.tokens < 0) return refuse(RejectReason::bad_counters);
  const auto layout = plan_.layout(m.fragment);
  std::vector<double> tensor_sq(layout.size(), 0.0);
  if (m.payload) {  // one pass over the payload: finiteness and the norms
    const std::vector<float>& v = *m.payload;
    for (std::size_t t = 0; t < layout.size(); ++t) {
      double sq = 0.0;
      for (std::size_t i = layout[t].offset; i < layout[t].offset + layout[t].size; ++i) {
        if (!std::isfinite(v[i])) return refuse(RejectReason::non_finite);
        sq += static_cast<double>(v[i]) * static_cast<double>(v[i]);
      }
      tensor_sq[t] = sq;
    }
  } else {
    // Still in its wire encoding (a transport's keep_contributions_encoded):
    // the bytes are checked (codes, and the frame's checksum when the
    // transport left it to us) and the norms taken in one scan, without
    // decoding (fast::checked_norms_and_checksum); a non-finite value of an
    // fp32/bf16/fp16 payload makes its tensor's sum non-finite.
    const EncodedPayload& e = *m.encoded;
    if (e.bytes.size() != encoded_size(e.codec, n)) return refuse(RejectReason::wrong_size);
    switch (fast::checked_norms_and_checksum(e.codec, e.bytes, n, layout, tensor_sq, e.unchecked_crc)) {
      case fast::PayloadCheck::ok: break;
      case fast::PayloadCheck::bad_encoding: return refuse(RejectReason::bad_encoding);
      case fast::PayloadCheck::bad_checksum: return refuse(RejectReason::bad_checksum);
    }
  }
  double sq = 0.0;
  for (double x : tensor_sq) sq += x;
  if (!std::isfinite(sq)) return refuse(RejectReason::non_finite);
  Checked c;
  c.m = &m;
  c.now = now;
  c.received_at = received_at;
  c.norm = std::sqrt(sq);
  if (!touch(m.learner, now, m.step, &c.step_time)) return std::nullopt;
  c.weight = weights_(Counters{m.steps, m.tokens});
  c.tensor_sq = std::move(tensor_sq);
  return c;
}

/// The checks under fragment p's lock (sequence, version, staleness, claims,
/// norm), in this order; a stale contribution is answered with the current
/// fragment. An accepted one has its norm clipped and its weight capped
/// (c.scale, c.weight) and joins the open round's bookkeeping (not yet the
/// accumulator: fold() adds it). Returns true if accepted. Caller holds f.mutex.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::admit(std::size_t p, FragmentState& f, Checked& c, Outbox& out) -> bool {
  const Message& m = *c.m;
  if (c.step_time) f.wait->observe_step_time(*c.step_time);
  auto& last = f.last_sequence[m.learner];
  // Pull rounds: a learner asked twice (reask_missing) may answer twice. The
  // first answer that comes is the one merged; one after it is dropped and
  // counted (answers_redundant), not refused: the syncer asked for it. (The
  // second answer carries `repeat`; the first one, coming after it, has a
  // lower sequence number and nothing owed any more. A copy of the answer
  // taken, from the network, is a duplicate as any other.)
  // A second answer sent at or before the step at which its learner was last
  // asked again answers an earlier second ask (it came late): redundant too,
  // and the open second ask stays open.
  const auto reask = f.reasked.find(m.learner);
  if (reask != f.reasked.end()) {
    const auto& [round_step, learner_step, taken] = reask->second;
    const bool late_second = m.repeat && m.sequence > last && m.step <= learner_step;
    const bool second_of_two = taken && m.sequence != *taken && (m.repeat || !f.owed.contains(m.learner));
    if (late_second || second_of_two) {
      last = std::max(last, m.sequence);
      if (!late_second) f.reasked.erase(reask);
      count_redundant(m);
      return false;
    }
  }
  if (m.sequence <= last) {
    ++f.rejected_duplicate;
    count_tally(m, RejectReason::duplicate);
    return false;
  }
  if (pull_schedule_) {
    // Pull rounds: only the answer to a pull still owed (one per pull) goes
    // on; an unasked contribution touches nothing (a flood cannot stack
    // contributions in one round, nor contribute without being pulled). A
    // `repeat` answers only an open second ask.
    const auto owed = f.owed.find(m.learner);
    const bool asked_twice = reask != f.reasked.end() && !reask->second.taken;
    if (owed == f.owed.end() && !m.repeat) {
      // (The answer to a pull its previous incarnation was sent: redundant, as on_join says.)
      if (auto o = f.orphaned.find(m.learner); o != f.orphaned.end()) {
        last = m.sequence;
        if (--o->second == 0) f.orphaned.erase(o);
        count_redundant(m);
        return false;
      }
    }
    if (owed == f.owed.end() || (m.repeat && !asked_twice)) {
      last = m.sequence;  // refused: a replay of this one is a duplicate
      reject(RejectReason::unsolicited, m);
      return false;
    }
    if (--owed->second == 0) f.owed.erase(owed);
    if (asked_twice) reask->second.taken = m.sequence;
    // A pulled learner has answered, whatever the verdict below; how long it
    // took (a late answer, from the pull it answers) sets the time-out.
    // (Not from a learner whose answers are refused: its pace is not the
    // honest learners' time-out.)
    const bool pulled_now = f.phase == FragmentState::Phase::pulling && f.pulled.contains(m.learner);
    // Nor from a second answer: it came after a loss, not at the link's pace.
    const bool timed = !answers_refused(m.learner) && !m.repeat;
    if (f.overdue.erase(m.learner) != 0) {
      if (timed) f.answer_seconds.add(std::chrono::duration<double>(c.now - f.overdue_since).count());
    } else if (pulled_now && !f.answered.contains(m.learner) && timed) {
      f.answer_seconds.add(std::chrono::duration<double>(c.now - f.pulled_at).count());
    }
    if (pulled_now) f.answered.insert(m.learner);
  }
  if (m.version > f.version) {
    ++f.rejected_future;
    count_tally(m, RejectReason::future_version);
    return false;
  }
  if (stale(f, c)) {
    ++f.rejected_stale;
    count_tally(m, RejectReason::stale);
    last = m.sequence;  // answered: a replay of this one is a duplicate
    const std::size_t from = out.size();
    out.push_back({m.learner, global_message(p, f, m.learner, MessageType::global_fragment)});
    count_out(out, from);
    {
      std::unique_lock lock(members_mutex_);
      if (auto it = learners_.find(m.learner); it != learners_.end()) note_sent(it->second, p, f.version, it->second.step);
    }
    return false;
  }
  if (const auto why = check_claims(p, m)) {
    reject(*why);
    note_answer(m.learner, false);
    return false;
  }
  if (m.version < f.version && !anchor(p, f, c)) {
    reject(RejectReason::non_finite, m);
    note_answer(m.learner, false);
    return false;
  }
  // The true norm against the median of recent learners' accepted norms
  // (docs/algorithm.md, "Validation and staleness"); 0 means nothing to compare with.
  const bool warm = f.norm_samples >= config_.norm_warmup;
  std::optional<double> norm_ref = warm ? f.norm_ref.median() : std::nullopt;
  if (norm_ref && !(*norm_ref > 0.0)) norm_ref.reset();
  // Rejection is against the larger of the reference and this learner's own
  // recent (accepted, clipped) maximum: honest learners on different data
  // differ by large factors late in training (with two learners the
  // reference is the smaller one's), and clipping below bounds the influence
  // of whatever is accepted; a jump far above both is still refused.
  const double outlier_ref = norm_ref ? std::max(*norm_ref, f.norm_ref.recent_max(m.learner).value_or(0.0)) : 0.0;
  if (norm_ref && c.norm > config_.norm_outlier_factor * outlier_ref) {
    ++f.rejected_norm;
    count_tally(m, RejectReason::norm_outlier);
    note_answer(m.learner, false);
    return false;
  }
  last = m.sequence;
  c.scale = 1.0;
  if (config_.clip_factor > 0.0 && norm_ref && c.norm > config_.clip_factor * *norm_ref) {
    c.scale = config_.clip_factor * *norm_ref / c.norm;  // enters the merge with norm clip x reference
    ++f.clipped;
  }
  f.norm_ref.put(m.learner, c.norm * c.scale);
  if (c.weight > 0.0) {
    if (config_.weight_cap_factor > 0.0 && warm) {
      const auto weight_ref = f.weight_ref.median();
      if (weight_ref && *weight_ref > 0.0 && c.weight > config_.weight_cap_factor * *weight_ref) {
        c.weight = config_.weight_cap_factor * *weight_ref;
        ++f.weights_capped;
      }
    }
    f.weight_ref.put(m.learner, c.weight);
  }
  f.norm_ema = f.norm_samples == 0 ? c.norm : 0.9 * f.norm_ema + 0.1 * c.norm;
  ++f.norm_samples;
  ++f.accepted;
  f.accepted_from.insert(m.learner);
  count_tally(m, std::nullopt);
  note_answer(m.learner, true);
  if (c.weight > 0.0) {
    if (pull_schedule_) {
      f.contributors.insert(m.learner);  // the round itself is the schedule's (open_due_rounds)
    } else {
      if (f.round.contributions == 0 && f.contributors.empty()) {
        f.round = RoundState{};
        f.round.start = c.now;
      }
      if (f.contributors.insert(m.learner).second) f.round.contributions = f.contributors.size();
    }
  }
  return true;
}

/// Pull rounds: u = (Theta_p - Theta_p^(b)) + v for a contribution whose
/// base b is one of the previous globals kept (SyncerConfig::anchor_versions),
/// in fp32 (c.anchored, with c.norm and c.tensor_sq recomputed on u). No-op
/// otherwise. False if u is not finite. Caller holds f.mutex.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::anchor(std::size_t p, FragmentState& f, Checked& c) -> bool {
  const Message& m = *c.m;
  auto it = std::find_if(f.previous.begin(), f.previous.end(), [&](const auto& e) { return e.first == m.version; });
  if (it == f.previous.end()) return true;
  const std::vector<float>& old = *it->second;
  auto u = std::make_shared<std::vector<float>>(f.theta.size());
  if (m.payload) {
    std::copy(m.payload->begin(), m.payload->end(), u->begin());
  } else {
    decode(m.encoded->codec, m.encoded->bytes, *u);
  }
  const auto layout = plan_.layout(p);
  double sq = 0.0;
  for (std::size_t t = 0; t < layout.size(); ++t) {
    double st = 0.0;
    for (std::size_t i = layout[t].offset; i < layout[t].offset + layout[t].size; ++i) {
      const float x = (f.theta[i] - old[i]) + (*u)[i];
      (*u)[i] = x;
      st += static_cast<double>(x) * static_cast<double>(x);
    }
    c.tensor_sq[t] = st;
    sq += st;
  }
  if (!std::isfinite(sq)) return false;
  c.norm = std::sqrt(sq);
  c.anchored = std::move(u);
  ++f.anchored;
  return true;
}

/// Admits prechecked contributions fragment by fragment (fragments in order
/// of first appearance, each fragment's contributions in their order, under
/// its lock), folds the accepted ones of a fragment into its accumulator with
/// one add_batch call when the accumulator has it (else add by add), then
/// asks the wait policy once.
template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::fold(std::span<Checked> batch, Outbox& out) -> void {
  std::vector<bool> seen(fragments_.size(), false);
  std::vector<const Checked*> accepted;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const std::size_t p = batch[i].m->fragment;
    if (seen[p]) continue;
    seen[p] = true;
    auto& f = fragments_[p];
    std::unique_lock lock(f.mutex);
    bool any = false;
    accepted.clear();
    for (std::size_t j = i; j < batch.size(); ++j) {
      if (batch[j].m->fragment != p || !admit(p, f, batch[j], out)) continue;
      any = true;
      if (batch[j].weight > 0.0) accepted.push_back(&batch[j]);
    }
    accumulate(f, accepted);
    // Pull rounds: a refused answer (stale, say) is an answer too; once every
    // pulled learner has answered the round closes now, not at its time-out.
    const bool pulling = pull_schedule_ && f.phase == FragmentState::Phase::pulling;
    if (any || pulling) decide_and_merge(p, f, batch.size() == 1 ? batch[0].now : clock_->now(), out);
  }
}

template <MergeRule Rule, OuterOptimizer Opt, WeightRule Weights, WaitPolicy Wait>
auto Syncer<Rule, Opt, Weights, Wait>::accumulate(FragmentState& f, std::span<const Checked* const> items) -> void {
  if constexpr (detail::BatchAccumulator<typename Rule::Accumulator>) {
    if (items.size() > 1 ||
        (items.size() == 1 && (items[0]->m->encoded || items[0]->scale != 1.0 || items[0]->anchored))) {
      // Encoded payloads go in as their bytes: the accumulator decodes them
      // chunk by chunk inside its merge loops (no fp32 copy).
      std::vector<fast::Contribution> batch(items.size());
      for (std::size_t i = 0; i < items.size(); ++i) {
        const Message& m = *items[i]->m;
        if (items[i]->anchored) {
          batch[i].values = std::span<const float>(*items[i]->anchored);
        } else if (m.payload) {
          batch[i].values = std::span<const float>(*m.payload);
        } else {
          batch[i].codec = m.encoded->codec;
          batch[i].bytes = m.encoded->bytes;
        }
        batch[i].weight = items[i]->weight;
        batch[i].tensor_sq = items[i]->tensor_sq;  // computed by precheck(): no second norm pass
        batch[i].scale = items[i]->scale;          // clipping: a factor inside the fold, no pass of its own
      }
      f.acc->add_batch(batch);
      return;
    }
  }
  for (const Checked* c : items) {
    const Message& m = *c->m;
    if (c->anchored && c->scale == 1.0) {
      f.acc->add(std::span<const float>(*c->anchored), c->weight);
      continue;
    }
    if (m.payload && c->scale == 1.0 && !c->anchored) {
      f.acc->add(std::span<const float>(*m.payload), c->weight);
      continue;
    }
    // A rule without add_batch: decode to fp32 first (checked in precheck),
    // and scale a clipped contribution's copy (one pass, clipped ones only).
    if (c->anchored) {
      f.decoded.assign(c->anchored->begin(), c->anchored->end());
    } else if (m.payload) {
      f.decoded.assign(m.payload->begin(), m.payload->end());
    } else {
      f.decoded.resize(m.encoded->elements);
      decode(m.encoded->codec, m.encoded->bytes, f.decoded);
    }
    if (c->scale != 1.0) {
      const auto k = static_cast<float>(c->scale);
      for (float& x : f.decoded) x *= k;
    }
    f.acc->add(std::span<const float>(f.decoded), c->weight);
  }
}

}  // namespace ddiloco
