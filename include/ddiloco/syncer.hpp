// ddiloco/syncer.hpp: the syncer's state machine (docs/algorithm.md, "Roles",
// "Round timeline", "Decisions").
//
// What it is: everything the syncer knows and decides: the global fragments,
// the outer optimizer's state, a version per fragment, membership, the open
// round of each fragment (a streaming merge accumulator: memory does not grow
// with the number of learners), validation of every contribution, and the
// quorum/grace decision. It turns incoming messages and the passing of time
// into outgoing messages (an Outbox); handle_batch() takes several messages
// and folds one fragment's accepted contributions together. It is thread-safe: membership has one
// lock and each fragment its own, so contributions to different fragments are
// validated and accumulated in parallel by a runtime's worker pool.
// Its durable state can be copied out (snapshot()) and put back (restore())
// as a SyncerSnapshot; files are <ddiloco/checkpoint.hpp>'s business.
// Where to read what: this header holds the class (its public interface, its
// state, the declarations of its parts); the parts' member functions are in
// syncer/membership.hpp (joins, deaths, positions and the global step),
// syncer/admission.hpp (every check of a contribution, the anchor, the fold)
// and syncer/rounds.hpp (when a fragment merges, the merge, pull rounds).
// Its values are in syncer_config.hpp (SyncerConfig), syncer_status.hpp
// (RejectReason, SyncerStatus) and syncer_snapshot.hpp (SyncerSnapshot).
// What it is not: a network loop or a thread pool (see syncer_runtime.hpp),
// nor the maths of merging (merge.hpp; the default rule is the fused
// fast::RadialDirectional of fast/merge.hpp), of the outer step
// (outer_optimizer.hpp) or of waiting (quorum.hpp); those are policies.
//
// Round of fragment p (docs/algorithm.md, "Round timeline", steps 4-6):
//   1. contributions arrive; each valid one is added to p's accumulator with
//      weight w = WeightRule(c_steps, c_tokens) (token weights by default);
//      handle_batch() adds a batch's accepted contributions of p together
//      (one add_batch call) before step 2, so they land in one merge;
//   2. the wait policy decides (K distinct learners, then the grace window,
//      bounded by a hard deadline) when to merge;
//   3. merge: Delta = MergeRule.finish() (token-weighted RDA by default),
//      Theta_p <- OuterOptimizer(Theta_p, Delta) (Nesterov by default),
//      version_p += 1, and Theta_p goes to every live learner (or, with
//      SyncerConfig::send_merged_to = contributors, only to the learners whose
//      contributions are in this merge).
// In pull rounds (SyncerConfig::round = pull, the paper's round) steps 1-2
// are driven by the schedule instead: see "pull rounds" below (the global step,
// a round per fragment slot, the quorum over learners with progress, the pull,
// the merge of the answers, anchored at the current global).
// Rejections (never touch global state, each counted by reason): foreign plan
// fingerprint, unknown learner, bad fragment index, wrong size, non-finite
// values, norm far outside the recent range, inconsistent counters, duplicate
// or replayed sequence, base version too old (answered with the current
// fragment) or from the future, counters claiming more steps than the
// learner's step counter advanced (or than the schedule allows) or more tokens
// than it declared per step at join. An accepted contribution far above the
// recent norms is clipped (scaled down) and an outsized weight capped
// (docs/algorithm.md, "Validation and staleness": "Bounded claims").
// A contribution or heartbeat from an unknown
// learner (one that joined after the checkpoint this syncer restored) is also
// answered with MessageType::rejoin, rate limited per id and in total.
// Sequence spaces: bits 48-63 of a sequence are the restore epoch
// (SyncerSnapshot::sequence_epoch, see advance_epoch()), so a join after a
// crash restore never gets a space an incarnation lost in the crash used.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/fast/merge.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/histogram.hpp>
#include <ddiloco/merge.hpp>
#include <ddiloco/merge_weights.hpp>
#include <ddiloco/message.hpp>
#include <ddiloco/outer_optimizer.hpp>
#include <ddiloco/quorum.hpp>
#include <ddiloco/schedule.hpp>
#include <ddiloco/shard_map.hpp>
#include <ddiloco/syncer_config.hpp>
#include <ddiloco/syncer_snapshot.hpp>
#include <ddiloco/syncer_status.hpp>
#include <ddiloco/detail/robust_reference.hpp>

namespace ddiloco {

/// A message the syncer wants delivered.
struct Outgoing {
  LearnerId to = 0;
  Message message;
};
using Outbox = std::vector<Outgoing>;

namespace detail {

/// True when Rule's accumulator can finish, apply the participation share and
/// take Opt's step in one pass (fast::RadialDirectional with NesterovSGD):
/// merge() then calls acc.finish_step(opt, share, theta, state) instead of
/// finish(delta); delta *= share; opt.step(theta, delta, state).
template <class Acc, class Opt>
concept FusedFinishStep = std::same_as<Opt, NesterovSGD> &&
                          requires(Acc& acc, const Opt& opt, float share, std::span<float> x) {
                            acc.finish_step(opt, share, x, x);
                          };

/// True when Rule's accumulator folds several in-memory contributions in one
/// call (fast::RadialDirectional::Accumulator::add_batch): handle_batch() then
/// folds one fragment's accepted contributions with one call instead of one
/// add() each.
template <class Acc>
concept BatchAccumulator = requires(Acc& acc, std::span<const fast::Contribution> batch) { acc.add_batch(batch); };

/// The buffers of published fragments (the payload every receiver of a merge
/// shares), one spare per fragment kept mapped between merges: publishing
/// fragment p copies Theta_p into the spare its previous publication left
/// when its last holder (the transports, the learners' queues) let go, instead
/// of into fresh memory (a 64 MiB fragment: ~30 ms of page faults per merge).
/// Each publication is a new shared_ptr, so no holder ever sees its bytes
/// change. At most one spare per fragment: one more copy of the model at worst.
/// Thread-safe: payloads are released on transport threads.
class PublishedBuffers : public std::enable_shared_from_this<PublishedBuffers> {
 public:
  explicit PublishedBuffers(std::size_t fragments) : spare_(fragments) {}

  /// A payload holding a copy of `values`, for fragment p.
  Payload publish(std::size_t p, std::span<const float> values) {
    std::unique_ptr<std::vector<float>> v;
    {
      std::lock_guard lock(mutex_);
      v = std::move(spare_[p]);
    }
    if (v && v->size() == values.size()) {
      std::copy(values.begin(), values.end(), v->begin());
    } else {
      v = std::make_unique<std::vector<float>>(values.begin(), values.end());
    }
    auto self = shared_from_this();
    return Payload(v.release(), [self, p](const std::vector<float>* done) {
      // The vector was created non-const by publish(): taking it back is well defined.
      self->give_back(p, std::unique_ptr<std::vector<float>>(const_cast<std::vector<float>*>(done)));
    });
  }

 private:
  void give_back(std::size_t p, std::unique_ptr<std::vector<float>> v) {
    std::lock_guard lock(mutex_);
    if (!spare_[p]) spare_[p] = std::move(v);  // else v is freed: one spare is enough
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<std::vector<float>>> spare_;
};
}  // namespace detail

/// The merge rule defaults to fast::RadialDirectional (<ddiloco/fast/merge.hpp>):
/// the same token-weighted RDA as ddiloco::RadialDirectional (<ddiloco/merge.hpp>,
/// which stays the readable specification and is tested against it), with the
/// norm pass fused into the accumulation and, with NesterovSGD, finish + the
/// participation scaling + the outer step in one pass over the fragment.
/// Results differ from the reference rule by the summation order of the norms
/// (tests/test_syncer.cpp bounds the difference over many merges).
template <MergeRule Rule = fast::RadialDirectional, OuterOptimizer Opt = NesterovSGD, WeightRule Weights = TokenWeights,
          WaitPolicy Wait = QuorumPolicy>
class Syncer {
 public:
  /// `initial` holds the model's parameters in plan order (tensor 0, 1, ...),
  /// concatenated: plan.total_numel() floats.
  Syncer(Plan plan, std::span<const float> initial, const Clock& clock, SyncerConfig config = {},
         Rule rule = Rule(), Opt optimizer = Opt(), Weights weights = Weights())
      : plan_(std::move(plan)),
        config_(config),
        clock_(&clock),
        rule_(std::move(rule)),
        opt_(std::move(optimizer)),
        weights_(std::move(weights)),
        fragments_(plan_.num_fragments()),
        shard_map_(plan_, config_.shard_count) {
    validate(config_);
    if (config_.round == RoundMode::pull)
      pull_schedule_.emplace(plan_.num_fragments(), config_.sync_every, config_.quorum.overlap);
    for (LearnerId id : config_.tally_learners) tallies_[id];
    std::size_t off = 0;
    tensor_offsets_.reserve(plan_.num_tensors());
    for (const auto& spec : plan_.tensors()) {
      tensor_offsets_.push_back(off);
      off += spec.numel;
    }
    if (initial.size() != plan_.total_numel())
      throw ShapeMismatch(detail::msg("Syncer: initial parameters have ", initial.size(),
                                      " elements but the plan covers ", plan_.total_numel(),
                                      "; pass every tensor of the plan, concatenated in plan order"));
    for (std::size_t p = 0; p < fragments_.size(); ++p) {
      auto& f = fragments_[p];
      // Another shard's fragment: nothing held, no round ever opened.
      if (!serves(p)) continue;
      f.theta.resize(plan_.fragments()[p].numel);
      gather(p, initial, f.theta);
      f.state.assign(opt_.state_size(f.theta.size()), 0.0f);
      if constexpr (!kFused) f.delta.resize(f.theta.size());  // the fused step needs no delta buffer
      f.acc.emplace(rule_.make_accumulator(plan_.layout(p)));
      f.wait.emplace(Wait(config_.quorum));
      f.version_steps.emplace_back(0, 0);
      f.published = published_->publish(p, f.theta);
      f.norm_ref = detail::RobustReference(config_.reference_window, config_.reference_history);
      f.weight_ref = detail::RobustReference(config_.reference_window, config_.reference_history);
    }
  }

  Syncer(const Syncer&) = delete;
  Syncer& operator=(const Syncer&) = delete;

  [[nodiscard]] const Plan& plan() const noexcept { return plan_; }
  [[nodiscard]] const SyncerConfig& config() const noexcept { return config_; }
  /// Whether this syncer serves fragment p (always, unless sharded).
  [[nodiscard]] bool serves(std::size_t p) const noexcept {
    return p < shard_map_.num_fragments() && shard_map_.shard_of(p) == config_.shard_index;
  }
  /// ShardMap(plan, shard_count): the same in every shard of a run.
  [[nodiscard]] const ShardMap& shard_map() const noexcept { return shard_map_; }
  [[nodiscard]] std::uint64_t shard_map_fingerprint() const noexcept { return shard_map_.fingerprint(); }

  /// A contribution was received and waits in a queue to be handled (SyncerRuntime
  /// queues them per fragment for its workers, while other messages are handled
  /// at once). The global step now is kept with it: its staleness is measured
  /// at its receipt, not when a worker gets to it (stale()). In pull rounds,
  /// until it is handled, its learner's step reports do not make the syncer ask
  /// it again for that fragment (reask_after_steps), since its answer is in.
  /// Handling the contribution, by handle() or handle_batch(), ends this; each
  /// (learner, fragment) queue is first in, first out, as the runtime's is.
  void note_queued(const Message& m) {
    if (m.type != MessageType::contribution || m.fragment >= fragments_.size()) return;
    std::unique_lock lock(members_mutex_);
    queued_[{m.learner, m.fragment}].push_back(global_step_);
  }

  /// Handles one incoming message; replies go to `out`. Never throws for bad
  /// input: a bad message is counted and dropped (or answered).
  void handle(const Message& m, Outbox& out) {
    const TimePoint now = clock_->now();
    const auto received_at = count_in(m);
    if (m.type == MessageType::join || m.type == MessageType::observe) {
      // A request that does not fit this run is answered with the reason, so
      // the requester can say what is wrong instead of timing out.
      if (const auto why = refusal_for(m)) return refuse(m, *why, now, out);
      return m.type == MessageType::join ? on_join(m, now, out) : on_observe(m, now, out);
    }
    if (m.fingerprint != plan_.fingerprint()) return reject(RejectReason::foreign_plan, m);
    switch (m.type) {
      case MessageType::leave: return on_leave(m);
      case MessageType::heartbeat:
      case MessageType::metadata:
        // Any message counts as one from an alive learner at step m.step; in
        // pull mode the global step may have reached fragments' slots.
        touch(m.learner, now, m.step);
        open_due_rounds(now, out);
        refresh_waiting_rounds(now, out);
        reask_missing(m.learner, now, out);
        return send_rejoin_requests(out);
      case MessageType::contribution: on_contribution(m, now, received_at, out); return send_rejoin_requests(out);
      case MessageType::join:
      case MessageType::observe:
      case MessageType::full_state:
      case MessageType::global_fragment:
      case MessageType::join_refused:
      case MessageType::pull:
      case MessageType::rejoin: return reject(RejectReason::unexpected_type);
    }
    reject(RejectReason::unexpected_type);
  }

  /// Handles `msgs` in order as handle() would, one message at a time, except
  /// that contributions are folded in batches: every message is validated
  /// exactly as handle() validates it (same reject counters, same replies),
  /// then the accepted contributions of one fragment are added to its
  /// accumulator together (one add_batch call when the rule has it, else one
  /// add each) and the wait policy is asked once per fragment. A message that
  /// is not a contribution (join, leave, heartbeat, wrong direction) ends the
  /// batch before it: what came before is folded first, so membership changes
  /// keep their place in the order.
  ///
  /// The semantic change: contributions folded together land in ONE merge,
  /// even at K = 1 where handle() would merge after each (a learner with two
  /// contributions in the batch is counted once in k, as in any round). When
  /// the quorum is not reached inside the batch, the result equals handling
  /// the messages one by one up to float summation order. SyncerRuntime passes
  /// everything queued for a fragment here.
  void handle_batch(std::span<const Message> msgs, Outbox& out) {
    std::vector<Checked> pending;
    for (const Message& m : msgs) {
      const TimePoint now = clock_->now();
      if (m.type == MessageType::contribution) {
        const auto received_at = count_in(m);
        if (m.fingerprint != plan_.fingerprint()) {
          reject(RejectReason::foreign_plan, m);
        } else if (auto c = precheck(m, now, received_at)) {
          pending.push_back(*c);
        }
        continue;
      }
      fold(pending, out);
      pending.clear();
      handle(m, out);
    }
    fold(pending, out);
    send_rejoin_requests(out);
  }

  /// Lets time pass: declares silent learners dead and merges every fragment
  /// whose wait is over. Call it at (or after) next_wakeup().
  void tick(Outbox& out) {
    expire_learners();
    open_due_rounds(clock_->now(), out);
    for (std::size_t p = 0; p < fragments_.size(); ++p)
      if (serves(p)) merge_if_due(p, out);
  }

  /// Declares learners not heard from within the heartbeat time-out dead.
  /// Learners that left or died more than SyncerConfig::prune_after ago are
  /// forgotten (membership entry and per-fragment sequences).
  void expire_learners() {
    const TimePoint now = clock_->now();
    std::vector<LearnerId> pruned;
    {
      std::unique_lock lock(members_mutex_);
      for (auto it = learners_.begin(); it != learners_.end();) {
        auto& l = it->second;
        if (l.alive && now - l.last_seen >= config_.heartbeat_timeout) {
          l.alive = false;
          ++counters_.deaths;
        }
        if (!l.alive && now - l.last_seen >= config_.prune_after) {
          pruned.push_back(it->first);
          forget_locked(it++);
        } else {
          ++it;
        }
      }
    }
    forget_sequences(pruned);
  }

  /// Merges fragment p if its wait policy says so now. Returns true if merged.
  bool merge_if_due(std::size_t p, Outbox& out) {
    auto& f = fragments_.at(p);
    std::unique_lock lock(f.mutex);
    return decide_and_merge(p, f, clock_->now(), out);
  }

  /// Fragments whose round has a decision due at or before `now`.
  [[nodiscard]] std::vector<std::size_t> due_fragments(TimePoint now) const {
    std::vector<std::size_t> due;
    for (std::size_t p = 0; p < fragments_.size(); ++p) {
      std::unique_lock lock(fragments_[p].mutex);
      if (fragments_[p].wake && *fragments_[p].wake <= now) due.push_back(p);
    }
    return due;
  }

  /// The earliest time at which tick() has something to do (a round's wait
  /// ends or a learner's heartbeat expires); nullopt if nothing is pending.
  [[nodiscard]] std::optional<TimePoint> next_wakeup() const {
    std::optional<TimePoint> t;
    auto consider = [&](TimePoint x) {
      if (!t || x < *t) t = x;
    };
    for (const auto& f : fragments_) {
      std::unique_lock lock(f.mutex);
      if (f.wake) consider(*f.wake);
    }
    std::unique_lock lock(members_mutex_);
    for (const auto& [id, l] : learners_)
      if (l.alive) consider(l.last_seen + config_.heartbeat_timeout);
    return t;
  }

  /// A copy of fragment p's global values and its version.
  [[nodiscard]] std::pair<std::vector<float>, std::uint64_t> fragment(std::size_t p) const {
    const auto& f = fragments_.at(p);
    std::unique_lock lock(f.mutex);
    return {f.theta, f.version};
  }

  /// The whole global model in plan order (tensor 0, 1, ...), concatenated.
  /// A shard fills its own fragments; the others' elements are 0.
  [[nodiscard]] std::vector<float> global_parameters() const {
    std::vector<float> flat(plan_.total_numel());
    for (std::size_t p = 0; p < fragments_.size(); ++p) {
      if (!serves(p)) continue;
      const auto& f = fragments_[p];
      std::unique_lock lock(f.mutex);
      scatter(p, f.theta, flat);
    }
    return flat;
  }

  [[nodiscard]] SyncerStatus status() const {
    SyncerStatus s;
    {
      std::unique_lock lock(members_mutex_);
      s = counters_;
      s.sequence_epoch = sequence_epoch_;
      s.learners_known = learners_.size();
      s.learners_alive = static_cast<std::size_t>(
          std::count_if(learners_.begin(), learners_.end(), [](const auto& kv) { return kv.second.alive; }));
      s.global_step = global_step_;
    }
    s.shard_index = config_.shard_index;
    s.shard_count = config_.shard_count;
    s.shard_map = shard_map_.fingerprint();
    s.fragments.resize(fragments_.size());
    for (std::size_t p = 0; p < fragments_.size(); ++p) {
      const auto& f = fragments_[p];
      std::unique_lock lock(f.mutex);
      s.fragments[p] = f.status;
      s.fragments[p].served = serves(p);
      s.fragments[p].version = f.version;
      s.fragments[p].open_contributions = f.round.contributions;
      s.merges += f.status.merges;
      if (s.quorum_sizes.size() < f.quorum_sizes.size()) s.quorum_sizes.resize(f.quorum_sizes.size());
      for (std::size_t k = 0; k < f.quorum_sizes.size(); ++k) s.quorum_sizes[k] += f.quorum_sizes[k];
      s.contributions_accepted += f.accepted;
      s.round_seconds += f.round_seconds;
      s.grace_wait_seconds += f.grace_wait_seconds;
      s.rejected[static_cast<std::size_t>(RejectReason::duplicate)] += f.rejected_duplicate;
      s.rejected[static_cast<std::size_t>(RejectReason::stale)] += f.rejected_stale;
      s.rejected[static_cast<std::size_t>(RejectReason::future_version)] += f.rejected_future;
      s.rejected[static_cast<std::size_t>(RejectReason::norm_outlier)] += f.rejected_norm;
      s.contributions_clipped += f.clipped;
      s.contributions_anchored += f.anchored;
      s.weights_capped += f.weights_capped;
    }
    return s;
  }

  /// The refused joins and observes recorded since the last call (at most
  /// SyncerConfig::refusal_log_burst per refusal_log_interval), oldest first,
  /// for the operator's log: each names the learner id and what differs.
  [[nodiscard]] std::vector<RefusedRequest> take_refusals() {
    std::unique_lock lock(members_mutex_);
    std::vector<RefusedRequest> out(refusals_.begin(), refusals_.end());
    refusals_.clear();
    return out;
  }

  /// The tally of learner `id`'s contributions since this Syncer was
  /// constructed; nullopt unless `id` is in SyncerConfig::tally_learners.
  [[nodiscard]] std::optional<LearnerTally> tally(LearnerId id) const {
    std::lock_guard lock(tally_mutex_);
    if (auto it = tallies_.find(id); it != tallies_.end()) return it->second;
    return std::nullopt;
  }

  /// Merges over all fragments so far (cheap: no lock).
  [[nodiscard]] std::uint64_t merges_total() const noexcept { return merges_total_.load(std::memory_order_relaxed); }

  /// Number of learners alive now (counted by the quorum).
  [[nodiscard]] std::size_t alive() const {
    std::unique_lock lock(members_mutex_);
    return alive_count_locked();
  }

  /// A consistent copy of the durable state (see SyncerSnapshot for what is
  /// not saved). Safe while other threads handle messages: it holds every
  /// fragment's lock, taken in index order, and then the membership lock, the
  /// same order as the message paths (which hold at most one fragment lock and
  /// may take the membership lock under it), so it cannot deadlock with them.
  [[nodiscard]] SyncerSnapshot snapshot() const {
    std::vector<std::unique_lock<std::mutex>> locks;
    locks.reserve(fragments_.size());
    for (const auto& f : fragments_) locks.emplace_back(f.mutex);
    std::unique_lock members(members_mutex_);
    SyncerSnapshot s;
    s.fingerprint = plan_.fingerprint();
    s.optimizer = std::string(Opt::name);
    s.fragments.reserve(fragments_.size());
    for (const auto& f : fragments_) {
      FragmentSnapshot fs;
      fs.theta = f.theta;
      fs.state = f.state;
      fs.version = f.version;
      fs.last_sequence = f.last_sequence;
      fs.norm_ema = f.norm_ema;
      fs.norm_samples = f.norm_samples;
      fs.status = f.status;
      fs.status.version = f.version;
      fs.status.open_contributions = 0;  // the open round is not saved
      fs.quorum_sizes = f.quorum_sizes;
      fs.accepted = f.accepted;
      fs.rejected_duplicate = f.rejected_duplicate;
      fs.rejected_stale = f.rejected_stale;
      fs.rejected_future = f.rejected_future;
      fs.rejected_norm = f.rejected_norm;
      s.fragments.push_back(std::move(fs));
    }
    s.learners.reserve(learners_.size());
    for (const auto& [id, l] : learners_) s.learners.push_back({id, l.incarnation, l.first_sequence, l.join_nonce});
    s.joins = counters_.joins;
    s.leaves = counters_.leaves;
    s.deaths = counters_.deaths;
    s.bytes_in = counters_.bytes_in;
    s.bytes_out = counters_.bytes_out;
    s.rejected = counters_.rejected;
    s.sequence_epoch = sequence_epoch_;
    s.shard_index = config_.shard_index;
    s.shard_count = config_.shard_count;
    s.shard_map = config_.shard_count > 1 ? shard_map_.fingerprint() : 0;  // unsharded: as before shards existed
    return s;
  }

  /// Replaces the durable state with `s` (normally right after construction,
  /// from the newest valid checkpoint). Every open round is discarded; every
  /// restored learner is alive, last seen now. Validates everything before
  /// changing anything: ProtocolError if `s` is from another plan or optimizer
  /// or is internally inconsistent, ShapeMismatch if a fragment's sizes differ
  /// from this syncer's plan. Contributions whose sequence is <= the restored
  /// last_sequence are rejected as duplicates afterwards.
  void restore(const SyncerSnapshot& s) {
    validate_snapshot(s);
    std::vector<std::unique_lock<std::mutex>> locks;
    locks.reserve(fragments_.size());
    for (auto& f : fragments_) locks.emplace_back(f.mutex);
    std::unique_lock members(members_mutex_);
    const TimePoint now = clock_->now();
    std::uint64_t merges = 0;
    for (std::size_t p = 0; p < fragments_.size(); ++p) {
      if (!serves(p)) continue;  // another shard's: nothing held
      auto& f = fragments_[p];
      const auto& fs = s.fragments[p];
      std::copy(fs.theta.begin(), fs.theta.end(), f.theta.begin());
      std::copy(fs.state.begin(), fs.state.end(), f.state.begin());
      f.version = fs.version;
      f.published = published_->publish(p, f.theta);
      f.acc->reset();
      f.wait.emplace(Wait(config_.quorum));
      f.round = RoundState{};
      f.phase = FragmentState::Phase::none;  // (waiting_rounds_ is cleared below: the membership lock is held)
      f.graced = false;
      f.pulled.clear();
      f.answered.clear();
      f.owed.clear();  // pulls of before the restore: their answers are unsolicited (the learner is pulled again)
      f.orphaned.clear();
      f.reasked.clear();
      f.version_steps.assign(1, {f.version, 0});
      f.previous.clear();  // the global step restarts at 0 (not saved)
      f.contributors.clear();
      f.accepted_from.clear();
      f.wake.reset();
      f.last_sequence = fs.last_sequence;
      // A snapshot cannot be taken between a join's membership update and its
      // per-fragment sequence bump, but a hand-made one could: re-establish the
      // invariant last_sequence >= first_sequence of the current incarnation.
      for (const auto& l : s.learners) {
        auto& last = f.last_sequence[l.id];
        last = std::max(last, l.first_sequence);
      }
      f.norm_ema = fs.norm_ema;
      f.norm_samples = static_cast<std::size_t>(fs.norm_samples);
      f.norm_ref.clear();  // not saved: re-learnt from the first accepted contributions
      f.weight_ref.clear();
      f.status = fs.status;
      f.status.version = fs.version;
      f.status.open_contributions = 0;
      f.quorum_sizes = fs.quorum_sizes;
      f.accepted = fs.accepted;
      f.rejected_duplicate = fs.rejected_duplicate;
      f.rejected_stale = fs.rejected_stale;
      f.rejected_future = fs.rejected_future;
      f.rejected_norm = fs.rejected_norm;
      merges += fs.status.merges;
    }
    learners_.clear();
    for (const auto& l : s.learners) {
      LearnerInfo info;
      info.incarnation = l.incarnation;
      info.first_sequence = l.first_sequence;
      info.join_nonce = l.join_nonce;
      info.last_seen = now;
      info.alive = true;
      info.contributed = true;
      info.reported = true;
      info.receipt_step.assign(fragments_.size(), 0);
      learners_.emplace(l.id, info);
    }
    counters_ = SyncerStatus{};
    counters_.joins = s.joins;
    // Learners forgotten before the snapshot are not in it; their incarnations
    // were <= the join count (see incarnation_floor_).
    incarnation_floor_ = s.joins;
    for (const auto& l : s.learners) incarnation_floor_ = std::max(incarnation_floor_, l.incarnation);
    // Their sequences are not in it either: each incarnation's space starts
    // 2^32 above its id's previous one, from the epoch's start, so none is
    // above the epoch's start + joins x 2^32 (nor above the highest sequence
    // the snapshot holds, which covers spaces of earlier epochs).
    sequence_floor_ = 0;
    for (const auto& f : s.fragments)
      for (const auto& [id, seq] : f.last_sequence) sequence_floor_ = std::max(sequence_floor_, seq);
    if (s.joins < (std::uint64_t{1} << (64 - kSequenceEpochShift)) &&
        s.sequence_epoch < (std::uint64_t{1} << (64 - kSequenceEpochShift)))
      sequence_floor_ = std::max(sequence_floor_, (s.sequence_epoch << kSequenceEpochShift) + (s.joins << kIncarnationShift));
    join_window_start_.reset();
    join_window_count_ = 0;
    counters_.leaves = s.leaves;
    counters_.deaths = s.deaths;
    counters_.bytes_in = s.bytes_in;
    counters_.bytes_out = s.bytes_out;
    counters_.rejected = s.rejected;
    sequence_epoch_ = s.sequence_epoch;
    rejoin_last_.clear();
    rejoin_due_.clear();
    rejoin_window_start_.reset();
    rejoin_window_count_ = 0;
    // The global step is not saved: it restarts at 0 and each restored
    // learner's steps count from its first message after the restore.
    global_step_ = 0;
    frontier_.reset();
    opened_through_ = 0;
    waiting_rounds_.clear();
    pulling_rounds_.clear();
    queued_.clear();
    merges_total_.store(merges, std::memory_order_relaxed);
  }

 private:
  /// restore()'s checks, before anything changes.
  void validate_snapshot(const SyncerSnapshot& s) const {
    if (s.fingerprint != plan_.fingerprint())
      throw ProtocolError(detail::msg("Syncer::restore: snapshot plan fingerprint 0x", std::hex, s.fingerprint,
                                      " differs from this syncer's 0x", plan_.fingerprint(), std::dec,
                                      "; restore only a checkpoint written by a syncer with the same tensor "
                                      "list, P and fragmentation strategy"));
    if (s.optimizer != Opt::name)
      throw ProtocolError(detail::msg("Syncer::restore: snapshot optimizer '", s.optimizer,
                                      "' differs from this syncer's '", Opt::name,
                                      "'; its state cannot be reused, start with the same outer optimizer"));
    if (s.fragments.size() != fragments_.size())
      throw ShapeMismatch(detail::msg("Syncer::restore: snapshot has ", s.fragments.size(),
                                      " fragments but the plan has ", fragments_.size()));
    if (s.shard_count != config_.shard_count || s.shard_index != config_.shard_index ||
        (s.shard_count > 1 && s.shard_map != shard_map_.fingerprint()))
      throw ProtocolError(detail::msg("Syncer::restore: the snapshot is of shard ", s.shard_index, "/", s.shard_count,
                                      " (map ", detail::hex16(s.shard_map), ") but this syncer is shard ",
                                      config_.shard_index, "/", config_.shard_count, " (map ",
                                      detail::hex16(shard_map_.fingerprint()),
                                      "); give each shard its own checkpoint directory and the same --shard i/S "
                                      "it was written with"));
    for (std::size_t p = 0; p < fragments_.size(); ++p) {
      const auto& fs = s.fragments[p];
      const std::size_t n = fragments_[p].theta.size();  // 0 for another shard's fragment
      if (fs.theta.size() != n)
        throw ShapeMismatch(detail::msg("Syncer::restore: fragment ", p, " theta has ", fs.theta.size(),
                                        " elements but the plan's fragment has ", n));
      if (fs.state.size() != opt_.state_size(n))
        throw ShapeMismatch(detail::msg("Syncer::restore: fragment ", p, " optimizer state has ", fs.state.size(),
                                        " elements but ", Opt::name, " needs ", opt_.state_size(n)));
      for (std::size_t i = 0; i < n; ++i)
        if (!std::isfinite(fs.theta[i]))
          throw ProtocolError(detail::msg("Syncer::restore: fragment ", p, " theta[", i, "] = ", fs.theta[i],
                                          " is not finite; use an older checkpoint"));
      if (!std::isfinite(fs.norm_ema) || fs.norm_ema < 0.0)
        throw ProtocolError(detail::msg("Syncer::restore: fragment ", p, " norm_ema = ", fs.norm_ema,
                                        " must be finite and >= 0"));
    }
    if (detail::highest_sequence_epoch(s) >= (std::uint64_t{1} << (64 - kSequenceEpochShift)))
      throw ProtocolError(detail::msg("Syncer::restore: snapshot sequence epoch ", detail::highest_sequence_epoch(s),
                                      " does not fit in ", 64 - kSequenceEpochShift,
                                      " bits (that many restores); start the run afresh"));
    for (std::size_t i = 1; i < s.learners.size(); ++i)
      if (s.learners[i].id <= s.learners[i - 1].id)
        throw ProtocolError(detail::msg("Syncer::restore: learner ids must be distinct and sorted, but id ",
                                        s.learners[i].id, " follows ", s.learners[i - 1].id));
  }

  struct LearnerInfo {
    std::uint64_t incarnation = 0;
    std::uint64_t first_sequence = 0;  ///< sequences <= this are from an older incarnation
    std::uint64_t join_nonce = 0;      ///< the current incarnation's join nonce
    TimePoint last_seen{0};
    bool alive = false;
    std::optional<std::pair<TimePoint, std::uint64_t>> last_contribution;  ///< (arrival, step) for xi_step
    /// Has contributed in this incarnation (or was restored from a snapshot,
    /// which keeps only learners that joined): counted by the participation share.
    bool contributed = false;
    std::optional<TimePoint> last_join_answer;  ///< when a join was last answered with the full state
    std::optional<TimePoint> window_start;      ///< this id's join rate window ...
    std::size_t window_count = 0;               ///< ... and the answers in it
    std::uint64_t tokens_per_step = 0;  ///< declared at join (Message::version; 0: not stated)
    /// Per fragment: the learner's step counter at its latest contribution of
    /// the fragment, or at its join; empty = 0 for every fragment (a learner
    /// restored from a checkpoint).
    std::vector<std::uint64_t> step_base;
    // Pull rounds and the global step (docs/algorithm.md, "Round timeline").
    std::uint64_t step = 0;                    ///< the highest inner step counter it has sent
    std::optional<std::uint64_t> join_step;    ///< its step counter at join (unset: restored, not heard yet)
    std::uint64_t join_global = 0;             ///< the global step at its join: its steps count from there
    /// Steps added to its position when the furthest learner died or left
    /// and this one, still training, carried t on (carry_on_locked).
    std::uint64_t carried = 0;
    std::optional<std::pair<TimePoint, std::uint64_t>> step_seen;  ///< (when, step) its step counter last rose
    double step_interval_s = 0.0;  ///< its own seconds per inner step (moving average; 0: not measured yet)
    bool reported = false;                     ///< has trained a step since it joined (counted by the quorum)
    /// Pull rounds: its latest contribution was refused for what it holds
    /// (payload, claims or norm; not stale, duplicate or unsolicited). Rounds
    /// still pull it and take a valid answer, which clears this, but do not
    /// wait for its answers: a peer whose answers are all refused cannot
    /// hold every round to its pull time-out.
    bool answers_refused = false;
    /// Per fragment: its step counter when the syncer last sent it that
    /// fragment (join or merge); it has progress on p once `step` is above.
    std::vector<std::uint64_t> receipt_step;
    /// Pull rounds, per fragment: the versions last sent to it (newest first)
    /// and its step counter when each went out (a join's: less the steps it
    /// may carry). An answer based on version v counts the steps since the
    /// learner applied v, which is at or after v was sent: check_claims bounds
    /// it by `step - sent.step`.
    struct Sent {
      std::uint64_t version = 0;
      std::uint64_t step = 0;
      bool set = false;
    };
    static constexpr std::size_t kSentVersions = 4;
    std::vector<std::array<Sent, kSentVersions>> sent;
  };

  /// Records that `sent_version` of fragment p went to `l` when its step
  /// counter was `at_step`. A version sent again keeps its first entry: the
  /// learner applies the first copy and ignores the others.
  void note_sent(LearnerInfo& l, std::size_t p, std::uint64_t sent_version, std::uint64_t at_step) const {
    if (!pull_schedule_) return;
    if (l.sent.size() != fragments_.size()) l.sent.assign(fragments_.size(), {});
    auto& s = l.sent[p];
    if (s[0].set && s[0].version == sent_version) return;
    std::move_backward(s.begin(), s.end() - 1, s.end());
    s[0] = {sent_version, at_step, true};
  }

  struct FragmentState {
    mutable std::mutex mutex;
    std::vector<float> theta;  ///< Theta_p, the global values
    std::vector<float> state;  ///< outer optimizer state
    std::vector<float> delta;  ///< scratch: the merged outer gradient (empty with the fused step)
    std::vector<float> decoded;  ///< scratch: an encoded contribution decoded for a rule without add_batch
    std::uint64_t version = 0;
    Payload published;         ///< Theta_p as last broadcast (shared by all receivers)
    std::optional<typename Rule::Accumulator> acc;
    std::optional<Wait> wait;
    RoundState round{};
    std::set<LearnerId> contributors;  ///< distinct learners in the open round (weight > 0)
    /// Learners with an accepted contribution in the open round, weight 0
    /// included: the receivers of the merge under MergeRecipients::contributors.
    std::set<LearnerId> accepted_from;
    std::map<LearnerId, std::uint64_t> last_sequence;
    std::optional<TimePoint> wake;
    double norm_ema = 0.0;  ///< moving average of accepted norms (observability; checkpointed)
    std::size_t norm_samples = 0;
    detail::RobustReference norm_ref, weight_ref;  ///< robust references (accepted norms, weights)
    std::uint64_t clipped = 0, weights_capped = 0;
    FragmentStatus status{};
    std::vector<std::uint64_t> quorum_sizes;
    std::uint64_t accepted = 0, rejected_duplicate = 0, rejected_stale = 0, rejected_future = 0,
                  rejected_norm = 0;
    Histogram round_seconds{round_seconds_bounds()}, grace_wait_seconds{grace_wait_seconds_bounds()};
    // Pull rounds: none -> waiting (quorum and grace window over the learners
    // with progress on p) -> pulling (answers awaited) -> merge -> none.
    enum class Phase : std::uint8_t { none, waiting, pulling } phase = Phase::none;
    std::uint64_t round_step = 0;     ///< the global step at which the open round's slot came
    /// The learners asked for p in this round, each with its step counter then.
    std::map<LearnerId, std::uint64_t> pulled;
    std::set<LearnerId> answered;     ///< ... whose answer has been admitted (accepted or rejected)
    TimePoint pulled_at{0};
    bool graced = false;  ///< the open round's pull waited for a grace window
    /// Time from a pull to its answer, over answers in time and late ones
    /// (pull_timeout() waits twice this); `overdue`: the learners whose answer
    /// to the pull sent at `overdue_since` was still missing at its time-out,
    /// each with whether the next round has already skipped it (start_pull).
    detail::Ema answer_seconds{0.25};
    std::map<LearnerId, bool> overdue;
    TimePoint overdue_since{0};
    /// The answers owed for p: per learner pulled, how many of its pulls
    /// (from any round, so a late answer is still expected) have had no
    /// answer yet, at most kOwedAnswers: as many as the versions whose sends
    /// the syncer keeps to bound claims (LearnerInfo::kSentVersions), so a
    /// learner whose answers lag that many rounds is still heard, and one
    /// that ignores pulls cannot bank more. A contribution with none owed is
    /// `unsolicited`, so a learner adds at most one contribution per pull.
    /// At most one entry per known learner (start_pull drops forgotten ones).
    static constexpr std::uint8_t kOwedAnswers = 4;
    std::map<LearnerId, std::uint8_t> owed;
    /// The answers its previous incarnation owed when a learner joined again
    /// (on_join): a pull sent to the old one just before the join can reach
    /// the new one, which answers it. Such an answer, with none owed, is
    /// dropped as redundant (answers_redundant), not refused as unsolicited;
    /// at most kOwedAnswers per learner, until its next join.
    std::map<LearnerId, std::uint8_t> orphaned;
    /// The learners asked a second time (reask_missing(); Message::repeat):
    /// the slot of the round they were asked again in, and whether an answer
    /// from them has come since. Until the second of the two possible answers
    /// comes (or a later round asks it twice again), one that comes after an
    /// answer is dropped (answers_redundant), not merged: the syncer asked
    /// twice, it merges once. At most one entry per known learner.
    struct Reask {
      std::uint64_t round_step = 0;
      std::uint64_t learner_step = 0;     ///< its step counter when asked again: a second answer is sent later
      std::optional<std::uint64_t> taken;  ///< the sequence number of the answer taken since, if one came
    };
    std::map<LearnerId, Reask> reasked;
    /// Pull rounds: the previous globals (version, values), oldest first, at
    /// most SyncerConfig::anchor_versions, to anchor contributions (anchor()).
    std::deque<std::pair<std::uint64_t, Payload>> previous;
    std::uint64_t anchored = 0;  ///< contributions anchored at the current global
    /// (version, global step at which it was made) of the latest versions,
    /// oldest first, at most kVersionSteps (staleness in rounds: stale()).
    std::deque<std::pair<std::uint64_t, std::uint64_t>> version_steps;
  };
  static constexpr std::size_t kVersionSteps = 4096;

  // ---- plan order <-> fragment buffers ----------------------------------
  void gather(std::size_t p, std::span<const float> flat, std::span<float> frag) const {
    for (std::size_t t : plan_.fragments()[p].tensors) {
      const auto off = tensor_offset(t);
      const auto n = plan_.tensors()[t].numel;
      std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(off), n,
                  frag.begin() + static_cast<std::ptrdiff_t>(plan_.offset_in_fragment(t)));
    }
  }
  void scatter(std::size_t p, std::span<const float> frag, std::span<float> flat) const {
    for (std::size_t t : plan_.fragments()[p].tensors) {
      const auto n = plan_.tensors()[t].numel;
      std::copy_n(frag.begin() + static_cast<std::ptrdiff_t>(plan_.offset_in_fragment(t)), n,
                  flat.begin() + static_cast<std::ptrdiff_t>(tensor_offset(t)));
    }
  }
  std::size_t tensor_offset(std::size_t t) const { return tensor_offsets_[t]; }

  // ---- counters -----------------------------------------------------------
  /// Counts an incoming message; for a contribution noted as queued
  /// (note_queued()), ends that and returns the global step at its receipt.
  std::optional<std::uint64_t> count_in(const Message& m) {
    std::optional<std::uint64_t> received_at;
    {
      std::unique_lock lock(members_mutex_);
      counters_.bytes_in += sizeof(Message) + m.payload_bytes();
      if (m.type == MessageType::contribution && !queued_.empty()) {
        if (auto it = queued_.find({m.learner, m.fragment}); it != queued_.end()) {
          received_at = it->second.front();
          it->second.pop_front();
          if (it->second.empty()) queued_.erase(it);
        }
      }
    }
    if (m.type == MessageType::contribution && !tallies_.empty()) {
      std::lock_guard lock(tally_mutex_);
      if (auto it = tallies_.find(m.learner); it != tallies_.end()) ++it->second.contributions;
    }
    return received_at;
  }
  void count_out(const Outbox& out, std::size_t from) {
    std::uint64_t bytes = 0;
    for (std::size_t i = from; i < out.size(); ++i) bytes += sizeof(Message) + out[i].message.payload_bytes();
    std::unique_lock lock(members_mutex_);
    counters_.bytes_out += bytes;
  }
  void reject(RejectReason r) {
    std::unique_lock lock(members_mutex_);
    ++counters_.rejected[static_cast<std::size_t>(r)];
  }
  /// A second answer of a learner asked twice, dropped (not a rejection).
  void count_redundant(const Message& m) {
    {
      std::unique_lock lock(members_mutex_);
      ++counters_.answers_redundant;
    }
    if (tallies_.empty()) return;
    std::lock_guard lock(tally_mutex_);
    if (auto it = tallies_.find(m.learner); it != tallies_.end()) ++it->second.redundant;
  }
  void reject(RejectReason r, const Message& m) {
    reject(r);
    count_tally(m, r);
  }
  /// Adds contribution m to its learner's tally, if it has one: a rejection
  /// for `r`, an acceptance for nullopt. tally_mutex_ is a leaf lock (taken under any other, never the
  /// other way round).
  void count_tally(const Message& m, std::optional<RejectReason> r) {
    if (tallies_.empty() || m.type != MessageType::contribution) return;
    std::lock_guard lock(tally_mutex_);
    auto it = tallies_.find(m.learner);
    if (it == tallies_.end()) return;
    it->second.step = std::max(it->second.step, m.step);
    if (r) {
      ++it->second.rejected[static_cast<std::size_t>(*r)];
    } else {
      ++it->second.accepted;
    }
  }
  std::size_t alive_count_locked() const {
    return static_cast<std::size_t>(
        std::count_if(learners_.begin(), learners_.end(), [](const auto& kv) { return kv.second.alive; }));
  }
  /// Alive learners that have trained a step since they joined: the ones a
  /// push round waits for (RoundState::training).
  std::size_t training_count_locked() const {
    return static_cast<std::size_t>(std::count_if(learners_.begin(), learners_.end(), [](const auto& kv) {
      return kv.second.alive && kv.second.reported;
    }));
  }
  /// Alive learners that have sent a contribution since they joined: the
  /// learners a merge's participation share counts. An id that only joined
  /// (or only sends heartbeats) is alive but not counted here, so a join flood
  /// or peers that never contribute cannot shrink every merge.
  std::size_t contributing_count_locked() const {
    return static_cast<std::size_t>(std::count_if(learners_.begin(), learners_.end(), [](const auto& kv) {
      return kv.second.alive && kv.second.contributed;
    }));
  }

  Message global_message(std::size_t p, const FragmentState& f, LearnerId to, MessageType type) const {
    Message m;
    m.type = type;
    m.fingerprint = plan_.fingerprint();
    m.learner = to;
    m.fragment = static_cast<std::uint32_t>(p);
    m.version = f.version;
    m.payload = f.published;
    return m;
  }

  // ---- membership (definitions in syncer/membership.hpp) -------------------
  // Joins and their refusals, observers, leaves, heartbeats and deaths, each
  // learner's position and the global step of pull rounds, rejoin requests.
  std::optional<JoinRefusal> refusal_for(const Message& m) const;
  void refuse(const Message& m, JoinRefusal why, TimePoint now, Outbox& out);
  void on_observe(const Message& m, TimePoint now, Outbox& out);
  void on_join(const Message& m, TimePoint now, Outbox& out);
  bool join_allowed_locked(LearnerInfo* l, TimePoint now);
  void forget_locked(typename std::map<LearnerId, LearnerInfo>::iterator it);
  void forget_sequences(const std::vector<LearnerId>& ids);
  void on_leave(const Message& m);
  bool touch(LearnerId id, TimePoint now, std::uint64_t step, std::optional<Duration>* step_time = nullptr);
  void advance_locked(LearnerId id, LearnerInfo& l, std::uint64_t step);
  static bool still_training(const LearnerInfo& o, TimePoint now, std::uint64_t lead) noexcept;
  void carry_on_locked(LearnerId id, TimePoint now);
  static std::uint64_t carried_position(const LearnerInfo& l) noexcept;
  static std::uint64_t position(const LearnerInfo& l) noexcept;

  /// a + b, or the largest std::uint64_t where that overflows.
  static constexpr std::uint64_t saturating_sum(std::uint64_t a, std::uint64_t b) noexcept {
    return b <= std::numeric_limits<std::uint64_t>::max() - a ? a + b : std::numeric_limits<std::uint64_t>::max();
  }

  void note_answer(LearnerId id, bool accepted);
  bool answers_refused(LearnerId id) const;
  void ask_rejoin_locked(LearnerId id, TimePoint now);
  void send_rejoin_requests(Outbox& out);

  // ---- admission (definitions in syncer/admission.hpp) ---------------------
  // Every check a contribution passes before it touches a fragment
  // (precheck, then admit under the fragment's lock), the anchor of a pull
  // answer at the current global, and the fold into the round's accumulator.
  std::optional<RejectReason> check_claims(std::size_t p, const Message& m);

  // ---- contributions ------------------------------------------------------
  /// A contribution that passed the checks needing no fragment lock.
  struct Checked {
    const Message* m = nullptr;
    TimePoint now{0};  ///< when it was handled (round start, step time)
    /// The global step when it was received, if it waited in a queue
    /// (note_queued()); else it is handled as it is received.
    std::optional<std::uint64_t> received_at;
    double norm = 0.0;    ///< ||v|| of the whole fragment, as sent
    double weight = 0.0;  ///< WeightRule of the claims; admit() caps it
    double scale = 1.0;   ///< set by admit(): the factor v enters the merge with (clipping)
    std::optional<Duration> step_time;
    std::vector<double> tensor_sq;  ///< ||v_t||^2 per tensor of the fragment (handed to add_batch)
    /// Pull rounds: the contribution anchored at the current global (set by
    /// anchor(); merged instead of the payload, norms recomputed).
    std::shared_ptr<const std::vector<float>> anchored;
  };

  void on_contribution(const Message& m, TimePoint now, std::optional<std::uint64_t> received_at, Outbox& out);
  bool stale(const FragmentState& f, const Checked& c) const;
  std::optional<Checked> precheck(const Message& m, TimePoint now, std::optional<std::uint64_t> received_at = {});
  bool admit(std::size_t p, FragmentState& f, Checked& c, Outbox& out);
  bool anchor(std::size_t p, FragmentState& f, Checked& c);
  void fold(std::span<Checked> batch, Outbox& out);
  void accumulate(FragmentState& f, std::span<const Checked* const> items);

  // ---- rounds (definitions in syncer/rounds.hpp) ---------------------------
  // When a fragment merges (the wait policy, push or pull), the merge and
  // outer step, and the pull round's phases.
  bool decide_and_merge(std::size_t p, FragmentState& f, TimePoint now, Outbox& out);
  void merge(std::size_t p, FragmentState& f, TimePoint now, const WaitDecision& d, Outbox& out);

  // ---- pull rounds (RoundMode::pull; docs/algorithm.md, "Round timeline") --
  //   1. the global step t reaches fragment p's slot (Schedule::due_at(t) = p):
  //      the round opens (open_due_rounds), phase waiting;
  //   2. the wait policy decides over the learners that have progress on p
  //      (RoundState::contributions = reported, alive = eligible): K of them,
  //      then the grace window, or all of them;
  //   3. a pull goes to every learner with progress on p (start_pull), phase
  //      pulling; each answers with a contribution at its next step boundary;
  //   4. a pulled learner whose step counter moves reask_after_steps past
  //      its step at the pull with no answer in is asked once more
  //      (reask_missing(), a pull with Message::repeat);
  //   5. once every pulled learner has answered or died, or at the pull
  //      time-out, the answers are merged (merge()) and Theta_p goes out.
  // Contributions that arrive outside a round (a late answer) stay in the
  // accumulator and are merged in the fragment's next round.

  static bool eligible(const LearnerInfo& l, std::uint64_t slot) noexcept;
  static bool has_progress(const LearnerInfo& l, std::size_t p) noexcept;
  void open_due_rounds(TimePoint now, Outbox& out);
  void refresh_waiting_rounds(TimePoint now, Outbox& out);
  void set_phase(std::size_t p, FragmentState& f, typename FragmentState::Phase phase);
  bool decide_pull(std::size_t p, FragmentState& f, TimePoint now, Outbox& out);
  void start_pull(std::size_t p, FragmentState& f, TimePoint now, Outbox& out);
  Message pull_message(std::size_t p, const FragmentState& f, LearnerId id, bool repeat) const;
  void reask_missing(LearnerId id, TimePoint now, Outbox& out);
  void close_pull_round(std::size_t p, FragmentState& f);
  Duration pull_timeout(const FragmentState& f) const;

  static constexpr bool kFused = detail::FusedFinishStep<typename Rule::Accumulator, Opt>;

  Plan plan_;
  SyncerConfig config_;
  const Clock* clock_;
  Rule rule_;
  Opt opt_;
  Weights weights_;
  std::vector<FragmentState> fragments_;
  ShardMap shard_map_;  ///< which shard serves each fragment; this one is SyncerConfig::shard_index
  std::shared_ptr<detail::PublishedBuffers> published_ =
      std::make_shared<detail::PublishedBuffers>(plan_.fragments().size());
  std::vector<std::size_t> tensor_offsets_;  ///< element offset of each tensor in plan order

  std::atomic<std::uint64_t> merges_total_{0};
  mutable std::mutex members_mutex_;
  mutable std::mutex tally_mutex_;
  std::map<LearnerId, LearnerTally> tallies_;  ///< SyncerConfig::tally_learners only (under tally_mutex_)
  std::map<LearnerId, LearnerInfo> learners_;
  SyncerStatus counters_{};
  // Rate limits of refusals' records and of observers (under members_mutex_).
  std::deque<RefusedRequest> refusals_;
  std::uint64_t refusals_suppressed_ = 0;
  std::optional<TimePoint> refusal_window_start_;
  std::size_t refusal_window_count_ = 0;
  std::map<LearnerId, TimePoint> observe_last_;
  std::optional<TimePoint> observe_window_start_;
  std::size_t observe_window_count_ = 0;
  // Join answers of all ids in the current join_interval (under members_mutex_).
  std::optional<TimePoint> join_window_start_;
  std::size_t join_window_count_ = 0;
  /// The highest incarnation of any forgotten learner (under members_mutex_):
  /// a forgotten id's next incarnation is numbered above it. Not in
  /// SyncerSnapshot: restore() sets it to the snapshot's join count, which no
  /// incarnation number ever exceeds (each is issued with one join counted).
  std::uint64_t incarnation_floor_ = 0;
  /// The highest first sequence of any forgotten learner (under
  /// members_mutex_): a forgotten id that comes back starts its sequence space
  /// above it, so its new sequences never collide with its old ones.
  std::uint64_t sequence_floor_ = 0;
  // Rejoin requests to unknown learners (under members_mutex_): ids due an
  // answer, the last answer per id, and the all-ids window.
  std::uint64_t sequence_epoch_ = 0;  ///< SyncerSnapshot::sequence_epoch
  std::vector<LearnerId> rejoin_due_;
  std::map<LearnerId, TimePoint> rejoin_last_;
  std::optional<TimePoint> rejoin_window_start_;
  std::size_t rejoin_window_count_ = 0;
  // Pull rounds (under members_mutex_): the global step t and the step up to
  // which the schedule's slots have been opened.
  std::optional<Schedule> pull_schedule_;
  std::uint64_t global_step_ = 0;
  std::optional<LearnerId> frontier_;  ///< the learner whose step last moved the global step
  std::uint64_t opened_through_ = 0;
  std::vector<std::size_t> waiting_rounds_;  ///< fragments whose pull round waits for its quorum
  std::vector<std::size_t> pulling_rounds_;  ///< fragments whose pull round waits for its answers
  /// (learner, fragment) -> the global step at the receipt of each of its
  /// contributions received and queued, not yet handled, oldest first
  /// (note_queued(); at most what the runtime's queues hold).
  std::map<std::pair<LearnerId, std::uint32_t>, std::deque<std::uint64_t>> queued_;
  detail::Ema step_seconds_{0.1};            ///< inner-step time over all learners' messages
};

}  // namespace ddiloco

// The members of the three parts above, each in its own header so that it
// reads on its own (they include this one).
#include <ddiloco/syncer/admission.hpp>
#include <ddiloco/syncer/membership.hpp>
#include <ddiloco/syncer/rounds.hpp>
