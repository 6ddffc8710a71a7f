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

namespace ddiloco {

/// Why a message was refused. Every value is counted in SyncerStatus.
enum class RejectReason : std::uint8_t {
  foreign_plan,      ///< plan fingerprint differs from the syncer's
  unknown_learner,   ///< learner never joined (or left)
  bad_fragment,      ///< fragment index >= P
  wrong_size,        ///< payload size differs from the fragment's element count
  non_finite,        ///< NaN or infinity in the payload
  norm_outlier,      ///< per-step norm far above the fragment's recent range
  bad_counters,      ///< steps < 1, tokens < 0
  duplicate,         ///< sequence already seen (duplicate, replay or reordered)
  stale,             ///< base version older than the staleness bound
  future_version,    ///< base version newer than the syncer's
  unexpected_type,   ///< a syncer-to-learner message sent to the syncer
  bad_encoding,      ///< an encoded payload (Message::encoded) with invalid scales or codes
  /// steps above the advance of the learner's step counter since its previous
  /// contribution of the fragment (or its join), or above the schedule's ceiling
  steps_beyond_schedule,
  /// tokens above steps x the tokens per step the learner declared at join
  /// (or SyncerConfig::max_tokens_per_step when it declared none)
  tokens_beyond_declared,
  /// an encoded payload whose bytes do not match the frame's checksum
  /// (EncodedPayload::unchecked_crc: a transport that left the check to the syncer)
  bad_checksum,
  /// a fragment another syncer shard owns (SyncerConfig::shard_count > 1): the
  /// learner routes by a different shard map, or sent to the wrong endpoint
  wrong_shard,
  /// pull rounds: a contribution that answers no pull of this learner's for
  /// the fragment (it was not pulled, or has answered already); honest
  /// learners send fragments only to answer pulls, once each
  unsolicited,
  count_
};
inline constexpr std::size_t kRejectReasons = static_cast<std::size_t>(RejectReason::count_);

constexpr std::string_view to_string(RejectReason r) noexcept {
  constexpr std::array<std::string_view, kRejectReasons> names{
      "foreign_plan", "unknown_learner", "bad_fragment", "wrong_size",     "non_finite",     "norm_outlier",
      "bad_counters", "duplicate",       "stale",        "future_version", "unexpected_type",
      "bad_encoding", "steps_beyond_schedule", "tokens_beyond_declared", "bad_checksum", "wrong_shard",
      "unsolicited"};
  const auto i = static_cast<std::size_t>(r);
  return i < names.size() ? names[i] : "unknown";
}

/// One learner's contributions as the syncer handled them (SyncerConfig::tally_learners).
/// `contributions` counts every contribution from the id as it arrives, so
/// `contributions - accepted` are all its rejected contributions, whatever
/// check refused them (once the syncer has handled what arrived); `rejected`
/// breaks down those refused by the checks that name the learner (foreign
/// plan, size, counters, finiteness, duplicate, stale, future version, norm).
struct LearnerTally {
  std::uint64_t step = 0;  ///< the highest inner step counter (Message::step) its contributions carried
  std::uint64_t contributions = 0;
  std::uint64_t accepted = 0;
  std::array<std::uint64_t, kRejectReasons> rejected{};  ///< messages from this id refused, by reason
  [[nodiscard]] std::uint64_t rejected_total() const noexcept {
    return contributions > accepted ? contributions - accepted : 0;
  }
  /// Rejected contributions under no reason of `rejected` (e.g. unknown_learner).
  [[nodiscard]] std::uint64_t rejected_other() const noexcept {
    std::uint64_t named = 0;
    for (auto r : rejected) named += r;
    return rejected_total() > named ? rejected_total() - named : 0;
  }
};

/// Who receives a fragment's new global after a merge (SyncerConfig::send_merged_to).
enum class MergeRecipients : std::uint8_t {
  /// Every learner alive at the merge (the default).
  alive,
  /// Only the learners whose accepted contributions are in this merge (and are
  /// still alive). Every accepted contribution lands in exactly one merge, so
  /// each learner still gets exactly one global per contribution, tau steps
  /// after it sent (what it waits for); a stale contribution is answered with
  /// the global on rejection either way. Cuts the down-link by about alive / K:
  /// at K = 1 with M out-of-phase learners, `alive` sends M full fragments per
  /// contribution, which saturated 50-100 Mbit/s links
  /// (docs/wan.md).
  /// The price: a learner applies the global of its own merge and no longer
  /// hears merges made after it (until its next contribution's merge), so its
  /// base lags by those merges. Out of phase this is at most the merges of tau
  /// steps; learners in phase at K = 1 miss M - 1 of M merges per round, and
  /// with Nesterov (0.7, 0.9) that delay diverged a quadratic test task that
  /// `alive` solves (tests/test_syncer.cpp, lock-step test); at K = 2 and with
  /// plain SGD it converged. Prefer `alive` for in-phase learners at K = 1.
  contributors,
};

constexpr std::string_view to_string(MergeRecipients r) noexcept {
  switch (r) {
    case MergeRecipients::alive: return "alive";
    case MergeRecipients::contributors: return "contributors";
  }
  return "unknown";
}

struct SyncerConfig {
  /// K, tau, gamma, cap, deadline of the wait policy (docs/algorithm.md, "Quorum and grace window").
  QuorumConfig quorum{};
  /// A contribution whose base version is more than this many versions behind
  /// the fragment's current version is rejected and answered with the current
  /// fragment (docs/algorithm.md, "Validation and staleness").
  std::uint64_t max_staleness = 8;
  /// A learner not heard from for this long is declared dead (not counted as
  /// alive by the quorum; it comes back with its next valid message).
  Duration heartbeat_timeout = std::chrono::seconds(10);
  /// Reject a contribution whose norm ||v|| (the whole fragment's, as sent:
  /// never divided by a claimed count) exceeds this factor times the fragment's
  /// robust reference: the median over the last `reference_window` learners
  /// heard from of each one's largest accepted norm among its latest
  /// `reference_history`, so one learner holds one vote however often it
  /// sends. Applies after `norm_warmup` accepted contributions of the fragment.
  double norm_outlier_factor = 50.0;
  std::size_t norm_warmup = 4;
  /// The robust references of norms and weights (detail::RobustReference): the
  /// last `reference_window` learners heard from, each with its
  /// `reference_history` latest accepted values (fixed memory per fragment).
  std::size_t reference_window = 16;
  std::size_t reference_history = 8;
  /// Norm clipping in the merge: an accepted contribution whose norm exceeds
  /// clip_factor x the reference enters the merge scaled to that norm (under
  /// RDA: its radial part only; its direction counts as sent). Costs no pass
  /// over the payload (a factor per contribution inside the fold). 0: off.
  double clip_factor = 4.0;
  /// Weight cap: a contribution's weight (tokens^2 / steps) is capped at this
  /// factor times the weights' robust reference (as the norms'), so no learner
  /// dominates a merge by its claims. Honest weights differ by (batch ratio)^2
  /// between learners: 16 leaves 4x batches whole. 0: off.
  double weight_cap_factor = 16.0;
  /// Operator bound on the tokens one inner step may process (a learner's
  /// batch in tokens). A join declaring more is refused
  /// (JoinRefusal::tokens_per_step); a learner declaring none is held to this
  /// bound: tokens <= steps x max_tokens_per_step. 0: no operator bound (a
  /// declaration still binds its learner).
  std::uint64_t max_tokens_per_step = 0;
  /// Ceiling on a contribution's steps. 0 derives it from the schedule when
  /// sync_every (H) is set: H x (max_staleness + 1), the progress of one send
  /// interval plus max_staleness sends the transport refused (the learner
  /// carries refused progress into its next send); without H, only the step
  /// counter's advance bounds steps.
  std::uint64_t max_steps_per_contribution = 0;
  /// Pull rounds: how far one learner's position may lead every other alive
  /// learner's and still move the global step t (docs/algorithm.md, "Round
  /// timeline"): t is the furthest position with each capped at the
  /// runner-up's plus this many steps. So a step counter that jumps (2^62, a
  /// liar or a bug) opens each fragment's round at most once early and then
  /// leaves t at most this far ahead of the honest learners, instead of
  /// moving t past where any of them will ever reach (rounds would stop
  /// opening). An honest learner leads by more only when it is alone far
  /// ahead of all the others; rounds then follow the runner-up's pace plus
  /// this lead (its answers still carry all its steps). Learners that have
  /// stopped training (no step within `max_lead` of their own step times) do
  /// not count as runner-up, and alone nothing caps it. 0 derives it:
  /// kLeadRounds rounds, kLeadRounds x H (honest learners on a shared
  /// 2-core machine drift apart by 20% of their steps, about 400 steps in
  /// 2000; 64 rounds of H = 24 is 1536).
  std::uint64_t max_lead = 0;
  static constexpr std::uint64_t kLeadRounds = 64;
  /// Scale each merged outer gradient by k / alive, the share of the live
  /// learners it holds (a project decision; the paper is silent). Learners
  /// send only their own progress (docs/algorithm.md, "Participation
  /// scaling"), so when K = 1 and learners run out of phase, every merge holds one learner's progress and,
  /// unscaled, the global would take M full outer steps per round where
  /// synchronous DiLoCo takes one step of the average: measured on the
  /// reference model over ZeroMQ with 2 learners (mean quorum 1.02), the
  /// validation loss rose from 4.6 to 67. With the scale, a round of M
  /// single-learner merges moves the global by about the average progress,
  /// and a merge holding everyone is unchanged.
  bool participation_scaling = true;
  /// Who gets a fragment's new global after a merge (see MergeRecipients).
  MergeRecipients send_merged_to = MergeRecipients::alive;
  /// H the learners must use. When > 0, a join that states another schedule
  /// (H, or tau other than quorum.overlap) is refused with JoinRefusal::schedule;
  /// a join that states none (a learner predating the check) is taken. 0: not checked.
  std::size_t sync_every = 0;
  /// Who decides when a fragment merges (RoundMode). `pull`, the paper's round
  /// and the default (as in ddiloco_syncer and Python), needs sync_every (H;
  /// a config without it is refused, naming the fix): the syncer keeps the global step t (the furthest any
  /// alive learner has trained, each learner's steps counted from the global
  /// step at its join), opens fragment p's round at the steps where
  /// Schedule(P, H, tau) has p due, waits for the quorum of learners with
  /// progress on p (K, then the grace window), pulls p from each of them and
  /// merges their answers once (docs/algorithm.md, "Round timeline"). A join
  /// stating another mode is refused (JoinRefusal::round_mode). `push`, the
  /// earlier protocol kept for comparison: each learner sends at its own slots
  /// and a fragment merges when K of them have arrived.
  RoundMode round = RoundMode::pull;
  /// Sharding by fragment (docs/sharding.md): this syncer is shard
  /// `shard_index` of `shard_count` and serves only the fragments
  /// ShardMap(plan, shard_count) gives it; it holds no global, momentum or
  /// accumulator for the others, rejects their contributions (wrong_shard) and
  /// refuses a join addressed to another shard or map (JoinRefusal::shard_map).
  /// 1 (the default) is the unsharded syncer.
  std::size_t shard_index = 0;
  std::size_t shard_count = 1;
  /// Pull rounds: the longest the syncer waits for the answers to a round's
  /// pulls before merging those that are in (a learner answers at its next
  /// step boundary; one that died or whose answer was lost is not waited for
  /// longer). Answers arriving later are merged in the fragment's next round.
  /// 0 derives it per fragment: twice the larger of (tau + 1) x the measured
  /// inner-step time and the measured time from a pull to its answer (late
  /// answers included, so a link slower than a few steps does not time out
  /// every round), at least 1 ms, at most quorum.deadline (which it is until
  /// a step time is known).
  Duration pull_timeout = Duration{0};
  /// Pull rounds: a learner answers with v = Theta_p^(b) - theta, measured
  /// from the global b it last applied (what the codecs compress: a small
  /// difference). The merge wants the paper's outer gradient
  /// Theta_p^(t-H) - theta against the syncer's previous global: the same
  /// thing, bit for bit, when b is that global (the learner applied the
  /// latest merge); for b behind it, the syncer anchors the answer:
  /// u = (Theta_p - Theta_p^(b)) + v, in fp32, for b among the last
  /// `anchor_versions` versions, keeping that many previous globals of each
  /// fragment (one more copy of the model each). An answer from an older base
  /// is stale: rejected and answered with the current fragment. 0: no
  /// anchoring, answers merged as sent (staleness then as in push rounds).
  std::size_t anchor_versions = 1;
  /// Observers (MessageType::observe): each id is answered at most once per
  /// `observe_interval`, and all ids together at most `observe_burst` times
  /// per interval; other requests are dropped and counted (observes_limited).
  /// Each answer is the whole global state, so this bounds what observers cost.
  Duration observe_interval = std::chrono::seconds(1);
  std::size_t observe_burst = 4;
  /// Learner ids whose contributions are tallied one by one (Syncer::tally):
  /// accepted, and rejected by reason. A fixed list, so what it costs is
  /// bounded whatever ids a peer claims; it lets a test or an operator tell
  /// the rejections of known honest learners from an attacker's.
  std::vector<LearnerId> tally_learners;
  /// Refused joins and observes are recorded for the operator (take_refusals)
  /// at most `refusal_log_burst` times per `refusal_log_interval`; the rest are
  /// counted in the next record's `suppressed`, so a flood cannot fill the log.
  Duration refusal_log_interval = std::chrono::seconds(10);
  std::size_t refusal_log_burst = 8;
  /// Membership bounds (docs/operations.md, "Memory bounds"). At most
  /// `max_learners` learner ids are known at once: a join of a new id beyond
  /// that first prunes the learner that has been dead longest and, when every
  /// known learner is alive, is refused with JoinRefusal::full (counted in
  /// joins_over_capacity).
  std::size_t max_learners = 1024;
  /// Full-state answers to joins (each is the whole model): at most
  /// `join_burst_per_learner` per learner id and `join_burst` for all ids
  /// together per `join_interval`; joins beyond are dropped unanswered and
  /// counted (joins_limited). A learner resends its join every
  /// OuterLoopConfig::join_retry (1 s) until it has the state, so a dropped one
  /// is answered at its next retry.
  Duration join_interval = std::chrono::seconds(1);
  std::size_t join_burst_per_learner = 4;
  std::size_t join_burst = 64;
  /// A repeated join (same nonce, same incarnation) is answered again only when
  /// it may have lost its answer: the learner has not contributed since, and at
  /// least this long has passed since the previous answer (less than the
  /// learner's join_retry, so each honest retry is answered).
  Duration join_repeat_interval = std::chrono::milliseconds(500);
  /// A learner that left, or has been dead (no message within
  /// heartbeat_timeout) for this long, is forgotten: its entry and its
  /// per-fragment sequences are dropped (learners_pruned). If it comes back,
  /// its join starts an incarnation numbered above every pruned one, so its
  /// new sequences can never collide with its old ones.
  Duration prune_after = std::chrono::minutes(5);
  /// A contribution or heartbeat from a learner id the syncer does not know
  /// (it joined after the checkpoint this syncer restored, or was forgotten)
  /// is answered with MessageType::rejoin, at most once per `rejoin_interval`
  /// per id and at most `rejoin_burst` times per interval for all ids together;
  /// the rest are counted (rejoin_requests_limited), so a flood of unknown ids
  /// gets at most that many small replies.
  Duration rejoin_interval = std::chrono::seconds(1);
  std::size_t rejoin_burst = 64;
};

/// Validates a SyncerConfig; throws InvalidArgument naming the bad field.
inline void validate(const SyncerConfig& c) {
  if (c.max_staleness == 0)
    throw InvalidArgument("SyncerConfig::max_staleness = 0 would reject every contribution made while a "
                          "merge was in flight; use >= 1 (default 8)");
  if (c.heartbeat_timeout <= Duration{0})
    throw InvalidArgument(detail::msg("SyncerConfig::heartbeat_timeout = ", c.heartbeat_timeout.count(),
                                      " ns must be > 0"));
  if (!(c.norm_outlier_factor > 1.0) || !std::isfinite(c.norm_outlier_factor))
    throw InvalidArgument(detail::msg("SyncerConfig::norm_outlier_factor = ", c.norm_outlier_factor,
                                      " must be a finite number > 1 (default 50)"));
  if (c.send_merged_to != MergeRecipients::alive && c.send_merged_to != MergeRecipients::contributors)
    throw InvalidArgument(detail::msg("SyncerConfig::send_merged_to = ", static_cast<int>(c.send_merged_to),
                                      " is not a MergeRecipients value; use alive or contributors"));
  if (c.observe_interval <= Duration{0} || c.observe_burst == 0)
    throw InvalidArgument(detail::msg("SyncerConfig: observe_interval = ", c.observe_interval.count(),
                                      " ns and observe_burst = ", c.observe_burst,
                                      " must be > 0 (defaults 1 s and 4)"));
  if (c.refusal_log_interval <= Duration{0})
    throw InvalidArgument("SyncerConfig::refusal_log_interval must be > 0 (default 10 s)");
  if (c.max_learners == 0)
    throw InvalidArgument("SyncerConfig::max_learners = 0 would refuse every learner; use >= 1 (default 1024)");
  if (c.join_interval <= Duration{0} || c.join_burst_per_learner == 0 || c.join_burst == 0)
    throw InvalidArgument(detail::msg("SyncerConfig: join_interval = ", c.join_interval.count(),
                                      " ns, join_burst_per_learner = ", c.join_burst_per_learner,
                                      " and join_burst = ", c.join_burst, " must be > 0 (defaults 1 s, 4 and 64)"));
  if (c.join_repeat_interval < Duration{0})
    throw InvalidArgument(detail::msg("SyncerConfig::join_repeat_interval = ", c.join_repeat_interval.count(),
                                      " ns must be >= 0 (default 500 ms, below the learners' join_retry)"));
  if (c.prune_after <= Duration{0})
    throw InvalidArgument(detail::msg("SyncerConfig::prune_after = ", c.prune_after.count(),
                                      " ns must be > 0 (default 5 min)"));
  if (c.rejoin_interval <= Duration{0} || c.rejoin_burst == 0)
    throw InvalidArgument(detail::msg("SyncerConfig: rejoin_interval = ", c.rejoin_interval.count(),
                                      " ns and rejoin_burst = ", c.rejoin_burst,
                                      " must be > 0 (defaults 1 s and 64)"));
  if (c.reference_window == 0 || c.reference_window > 4096 || c.reference_history == 0 ||
      c.reference_history > 256)
    throw InvalidArgument(detail::msg("SyncerConfig::reference_window = ", c.reference_window,
                                      " and reference_history = ", c.reference_history,
                                      " must be in [1, 4096] learners and [1, 256] values (defaults 16 and 8)"));
  if (!(c.clip_factor == 0.0 || (c.clip_factor >= 1.0 && std::isfinite(c.clip_factor))))
    throw InvalidArgument(detail::msg("SyncerConfig::clip_factor = ", c.clip_factor,
                                      " must be 0 (off) or a finite number >= 1 (default 4)"));
  if (!(c.weight_cap_factor == 0.0 || (c.weight_cap_factor >= 1.0 && std::isfinite(c.weight_cap_factor))))
    throw InvalidArgument(detail::msg("SyncerConfig::weight_cap_factor = ", c.weight_cap_factor,
                                      " must be 0 (off) or a finite number >= 1 (default 16)"));
  if (c.max_tokens_per_step > (std::uint64_t{1} << 40))
    throw InvalidArgument(detail::msg("SyncerConfig::max_tokens_per_step = ", c.max_tokens_per_step,
                                      " is above 2^40; use the largest batch in tokens of any learner, or 0"));
  if (c.round != RoundMode::push && c.round != RoundMode::pull)
    throw InvalidArgument(detail::msg("SyncerConfig::round = ", static_cast<int>(c.round),
                                      " is not a RoundMode; use push or pull"));
  if (c.round == RoundMode::pull && c.sync_every == 0)
    throw InvalidArgument("SyncerConfig::round = pull (the default) needs sync_every (H, the learners' "
                          "--sync-every): the syncer opens each fragment's round at its slot of the schedule; "
                          "set sync_every, or round = RoundMode::push");
  if (c.shard_count == 0 || c.shard_count > kMaxShards || c.shard_index >= c.shard_count)
    throw InvalidArgument(detail::msg("SyncerConfig: shard ", c.shard_index, " of ", c.shard_count,
                                      " does not exist; shard_count must be in [1, ", kMaxShards,
                                      "] and shard_index in [0, shard_count) (--shard i/S, i counted from 0)"));
  if (c.anchor_versions > 64)
    throw InvalidArgument(detail::msg("SyncerConfig::anchor_versions = ", c.anchor_versions,
                                      " would keep that many copies of the model; use 0 to 64 (default 1)"));
  if (c.pull_timeout < Duration{0})
    throw InvalidArgument(detail::msg("SyncerConfig::pull_timeout = ", c.pull_timeout.count(),
                                      " ns must be >= 0 (0: derived from the step time)"));
  if (c.max_lead > (std::uint64_t{1} << 40))
    throw InvalidArgument(detail::msg("SyncerConfig::max_lead = ", c.max_lead,
                                      " steps is above 2^40; use a few times H, or 0 to derive it (64 x H)"));
  if (c.max_steps_per_contribution > (std::uint64_t{1} << 40))
    throw InvalidArgument(detail::msg("SyncerConfig::max_steps_per_contribution = ", c.max_steps_per_contribution,
                                      " is above 2^40; use a few times H, or 0 to derive it from sync_every"));
}

/// SyncerConfig::max_lead, derived when 0 (pull rounds: sync_every is set).
inline std::uint64_t lead_bound(const SyncerConfig& c) noexcept {
  if (c.max_lead != 0) return c.max_lead;
  return std::min<std::uint64_t>(c.sync_every, std::uint64_t{1} << 40) * SyncerConfig::kLeadRounds;
}

/// The ceiling on a contribution's steps under `c` (0: none), see
/// SyncerConfig::max_steps_per_contribution.
inline std::uint64_t steps_ceiling(const SyncerConfig& c) noexcept {
  if (c.max_steps_per_contribution != 0) return c.max_steps_per_contribution;
  if (c.sync_every == 0) return 0;
  const std::uint64_t slack = std::min<std::uint64_t>(c.max_staleness, std::uint64_t{1} << 20) + 1;
  return c.sync_every > (std::uint64_t{1} << 40) ? 0 : c.sync_every * slack;
}

/// A join or observe request the syncer refused, for the operator's log
/// (Syncer::take_refusals): the request's values ("theirs") and the syncer's.
struct RefusedRequest {
  MessageType type = MessageType::join;  ///< join or observe
  LearnerId learner = 0;
  JoinRefusal reason = JoinRefusal::foreign_plan;
  std::uint64_t fingerprint = 0;      ///< the request's plan fingerprint
  std::uint64_t sync_every = 0;       ///< the request's H (0: not stated)
  std::uint64_t overlap = 0;          ///< the request's tau
  std::uint64_t tokens_per_step = 0;  ///< the request's declared tokens per inner step (0: not stated)
  std::uint64_t our_max_tokens_per_step = 0;  ///< SyncerConfig::max_tokens_per_step
  std::uint64_t our_fingerprint = 0;  ///< the syncer's
  std::uint64_t our_sync_every = 0;
  std::uint64_t our_overlap = 0;
  std::uint32_t round = 0;      ///< the request's RoundMode (0: not stated)
  RoundMode our_round = RoundMode::push;
  detail::JoinShard shard{};     ///< the shard the request named (count 0: none)
  detail::JoinShard our_shard{0, 1};
  std::uint64_t suppressed = 0;  ///< refusals not recorded (rate limit) just before this one

  /// One line for a log, e.g. "refused join from learner 3: plan fingerprint
  /// 00ab... differs from ours 00cd... (another model or --fragments)".
  [[nodiscard]] std::string line() const {
    const std::string why =
        reason == JoinRefusal::full
            ? std::string("the syncer already knows its maximum of learners, all alive (--max-learners)")
        : reason == JoinRefusal::foreign_plan
            ? detail::msg("plan fingerprint ", detail::hex16(fingerprint), " differs from ours ",
                          detail::hex16(our_fingerprint), " (another model, tensor list or fragment count)")
        : reason == JoinRefusal::tokens_per_step
            ? detail::msg("declared ", tokens_per_step, " tokens per inner step, above our bound ",
                          our_max_tokens_per_step, " (--max-tokens-per-step)")
        : reason == JoinRefusal::round_mode
            ? detail::msg("round mode ", to_string(static_cast<RoundMode>(round)), " differs from ours ",
                          to_string(our_round), " (--round)")
        : reason == JoinRefusal::shard_map
            ? detail::msg("addressed to shard ", shard.index, "/", std::max<std::size_t>(shard.count, 1),
                          " but this is shard ", our_shard.index, "/", our_shard.count,
                          " (the learner's --connect list must name every shard, in shard order)")
            : detail::msg("schedule H = ", sync_every, ", tau = ", overlap, " differs from ours H = ",
                          our_sync_every, ", tau = ", our_overlap);
    return detail::msg("refused ", to_string(type), " from learner ", learner, ": ", why,
                       suppressed != 0 ? detail::msg("; ", suppressed, " earlier refusals not logged (rate limit)")
                                       : std::string());
  }
};


/// A message the syncer wants delivered.
struct Outgoing {
  LearnerId to = 0;
  Message message;
};
using Outbox = std::vector<Outgoing>;

struct FragmentStatus {
  std::uint64_t version = 0;
  std::uint64_t merges = 0;
  std::size_t open_contributions = 0;     ///< in the current round
  std::size_t last_quorum_size = 0;       ///< contributions in the latest merge
  std::uint64_t contributions_merged = 0; ///< over all merges
  std::uint64_t grace_waits = 0;          ///< merges that waited for a grace window
  std::uint64_t deadline_merges = 0;      ///< merges forced by the hard deadline
  /// Served by this syncer (false: another shard's fragment, every figure 0).
  bool served = true;

  bool operator==(const FragmentStatus&) const = default;
};

/// Bucket bounds of SyncerStatus::round_seconds: 5 ms to 2 min.
inline std::vector<double> round_seconds_bounds() {
  return {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
}
/// Bucket bounds of SyncerStatus::grace_wait_seconds: 1 ms to 5 s (the grace cap is about one inner step).
inline std::vector<double> grace_wait_seconds_bounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5};
}

struct SyncerStatus {
  std::size_t learners_known = 0;
  std::size_t learners_alive = 0;
  std::uint64_t joins = 0;
  std::uint64_t leaves = 0;
  std::uint64_t deaths = 0;  ///< heartbeat time-outs
  std::uint64_t merges = 0;
  std::uint64_t contributions_accepted = 0;
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_out = 0;
  std::array<std::uint64_t, kRejectReasons> rejected{};
  std::vector<FragmentStatus> fragments;
  /// Histogram: quorum_sizes[k] = number of merges that combined k contributions.
  std::vector<std::uint64_t> quorum_sizes;
  std::uint64_t joins_refused = 0;     ///< joins answered with join_refused (another plan or schedule)
  std::uint64_t observes = 0;          ///< observe requests answered with the global state
  std::uint64_t observes_limited = 0;  ///< observe requests dropped by the rate limit
  std::uint64_t observes_refused = 0;  ///< observe requests answered with join_refused (another plan)
  std::uint64_t joins_over_capacity = 0;  ///< joins refused with JoinRefusal::full (also in joins_refused)
  std::uint64_t joins_limited = 0;        ///< joins dropped unanswered by the join rate limits or repeat rule
  std::uint64_t learners_pruned = 0;      ///< departed learners forgotten (prune_after, or to make room)
  std::uint64_t rejoin_requests = 0;          ///< unknown learners answered with MessageType::rejoin
  std::uint64_t rejoin_requests_limited = 0;  ///< ... not answered (rate limit; still counted unknown_learner)
  /// Restores this syncer's state has been through (SyncerSnapshot::sequence_epoch).
  std::uint64_t sequence_epoch = 0;
  /// This syncer's shard (SyncerConfig::shard_index / shard_count) and the
  /// ShardMap fingerprint every shard of the run shares.
  std::size_t shard_index = 0;
  std::size_t shard_count = 1;
  std::uint64_t shard_map = 0;
  /// Accepted contributions whose norm was clipped to clip_factor x the
  /// reference, and whose weight was capped at weight_cap_factor x the
  /// reference (SyncerConfig). Since this Syncer was constructed (not checkpointed).
  std::uint64_t contributions_clipped = 0;
  std::uint64_t weights_capped = 0;
  /// Pull rounds (RoundMode::pull), since this Syncer was constructed: the
  /// global step t, rounds opened, pull requests sent, rounds merged at the
  /// pull time-out with answers missing, and rounds closed without a merge
  /// (no accepted answer).
  std::uint64_t global_step = 0;
  std::uint64_t pull_rounds = 0;
  std::uint64_t pulls_sent = 0;
  std::uint64_t pull_timeouts = 0;
  std::uint64_t pull_rounds_empty = 0;
  /// Pull rounds: messages whose step counter put their learner more than
  /// SyncerConfig::max_lead ahead of every other alive learner (the global
  /// step counted it at the runner-up plus the lead). Honest runs show a few
  /// when one learner races ahead alone; a steady climb is a counter that lies.
  std::uint64_t steps_beyond_lead = 0;
  /// Pull rounds: times the learner that last moved the global step died or
  /// left and the learners still training carried it on from there (instead
  /// of no round opening until one of them reached it).
  std::uint64_t frontier_carries = 0;
  /// Pull rounds: contributions from an older base anchored at the current global (SyncerConfig::anchor_versions).
  std::uint64_t contributions_anchored = 0;
  /// Per merge: seconds from its round's first accepted contribution to the
  /// merged fragment being published (queued for the learners). Since this
  /// Syncer was constructed (not checkpointed), summed over fragments.
  Histogram round_seconds{round_seconds_bounds()};
  /// Per merge that waited for a grace window (FragmentStatus::grace_waits):
  /// seconds from the quorum forming to the merge. Not checkpointed.
  Histogram grace_wait_seconds{grace_wait_seconds_bounds()};
  /// Merges that waited for a grace window / were forced by the deadline, over all fragments.
  [[nodiscard]] std::uint64_t grace_waits() const noexcept {
    std::uint64_t n = 0;
    for (const auto& f : fragments) n += f.grace_waits;
    return n;
  }
  [[nodiscard]] std::uint64_t deadline_merges() const noexcept {
    std::uint64_t n = 0;
    for (const auto& f : fragments) n += f.deadline_merges;
    return n;
  }

  [[nodiscard]] std::uint64_t rejected_total() const noexcept {
    std::uint64_t n = 0;
    for (auto r : rejected) n += r;
    return n;
  }
  [[nodiscard]] double mean_quorum_size() const noexcept {
    double n = 0, s = 0;
    for (std::size_t k = 0; k < quorum_sizes.size(); ++k) {
      n += static_cast<double>(quorum_sizes[k]);
      s += static_cast<double>(k) * static_cast<double>(quorum_sizes[k]);
    }
    return n > 0 ? s / n : 0.0;
  }
  /// One line for progress output.
  [[nodiscard]] std::string line() const {
    std::string rej;
    for (std::size_t i = 0; i < kRejectReasons; ++i) {
      if (rejected[i] == 0) continue;
      rej += detail::msg(rej.empty() ? "" : ",", to_string(static_cast<RejectReason>(i)), "=", rejected[i]);
    }
    return detail::msg("alive ", learners_alive, "/", learners_known, " merges ", merges, " mean-quorum ",
                       static_cast<double>(static_cast<int>(mean_quorum_size() * 100)) / 100, " accepted ",
                       contributions_accepted, " rejected ", rejected_total(), rej.empty() ? "" : " (", rej,
                       rej.empty() ? "" : ")",
                       contributions_clipped + weights_capped == 0
                           ? std::string()
                           : detail::msg(" clipped ", contributions_clipped, " capped ", weights_capped),
                       " in ", bytes_in / 1024, " KiB out ", bytes_out / 1024, " KiB",
                       shard_count > 1 ? detail::msg(" shard ", shard_index, "/", shard_count) : std::string());
  }
};

/// One fragment's durable state inside a SyncerSnapshot.
struct FragmentSnapshot {
  std::vector<float> theta;  ///< Theta_p, the global values
  std::vector<float> state;  ///< outer optimizer state (Opt::state_size(theta.size()) floats)
  std::uint64_t version = 0;
  /// Highest sequence seen per learner: restoring it is what makes a replay of a
  /// contribution merged before the checkpoint a duplicate after it.
  std::map<LearnerId, std::uint64_t> last_sequence;
  /// Moving average of accepted norms ||v|| (for the operator; admission uses
  /// the median reference, which is not saved: it is re-learnt after a restart).
  double norm_ema = 0.0;
  std::uint64_t norm_samples = 0;  ///< accepted contributions (the warm-up of the norm checks)
  /// Counters; `version` and `open_contributions` are ignored on restore
  /// (the version is the field above, the open round is not saved).
  FragmentStatus status{};
  std::vector<std::uint64_t> quorum_sizes;  ///< quorum_sizes[k] = merges of k contributions
  std::uint64_t accepted = 0;
  std::uint64_t rejected_duplicate = 0;
  std::uint64_t rejected_stale = 0;
  std::uint64_t rejected_future = 0;
  std::uint64_t rejected_norm = 0;

  bool operator==(const FragmentSnapshot&) const = default;
};

/// One known learner inside a SyncerSnapshot (its sequence space).
struct LearnerSnapshot {
  LearnerId id = 0;
  std::uint64_t incarnation = 0;
  std::uint64_t first_sequence = 0;
  std::uint64_t join_nonce = 0;

  bool operator==(const LearnerSnapshot&) const = default;
};

/// Everything a syncer needs to resume after a restart, as plain values (the
/// file format is <ddiloco/checkpoint.hpp>). Taken by Syncer::snapshot(),
/// applied by Syncer::restore().
///
/// Not saved, on purpose:
///   - the open round of each fragment (its accumulator, contributors, wait
///     state): contributions accepted but not yet merged are dropped on
///     restart. Their sequences are in last_sequence, so a replay is a
///     duplicate: nothing is ever merged twice, and at most one round per
///     fragment is lost;
///   - learner liveness: every restored learner starts alive, heard from at the
///     restore time, so the quorum counts it until the heartbeat time-out;
///   - step-time observations of the wait policy (re-learnt in a few rounds).
struct SyncerSnapshot {
  std::uint64_t fingerprint = 0;  ///< Plan::fingerprint() of the syncer's plan
  std::string optimizer;          ///< Opt::name: the state layout depends on it
  std::vector<FragmentSnapshot> fragments;  ///< in fragment order, one per fragment
  std::vector<LearnerSnapshot> learners;    ///< sorted by id, ids distinct
  std::uint64_t joins = 0;
  std::uint64_t leaves = 0;
  std::uint64_t deaths = 0;
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_out = 0;
  /// Syncer-wide rejections (the per-fragment ones are in FragmentSnapshot).
  std::array<std::uint64_t, kRejectReasons> rejected{};
  /// Restores after a crash so far (advance_epoch() adds one). Every sequence
  /// space a join hands out is at or above sequence_epoch << kSequenceEpochShift,
  /// so a learner that joins after a restore never gets a space that an
  /// incarnation lost in the crash (joined after the checkpoint) already used.
  std::uint64_t sequence_epoch = 0;
  /// The shard that wrote it (SyncerConfig::shard_index / shard_count) and its
  /// ShardMap fingerprint; a shard's snapshot holds no values (empty theta and
  /// state) for the fragments other shards serve. 0 / 1 / any: unsharded.
  std::uint64_t shard_index = 0;
  std::uint64_t shard_count = 1;
  std::uint64_t shard_map = 0;

  bool operator==(const SyncerSnapshot&) const = default;
};

/// Sequence numbers: bits 0-31 count one incarnation's contributions, bits
/// 32-47 its incarnation within a restore epoch, bits 48-63 the epoch
/// (SyncerSnapshot::sequence_epoch). A join takes the next 2^32 block after
/// the learner's previous one, or the epoch's first block if that is higher.
inline constexpr unsigned kSequenceEpochShift = 48;
inline constexpr unsigned kIncarnationShift = 32;

namespace detail {
/// The highest sequence epoch any sequence recorded in `s` belongs to.
inline std::uint64_t highest_sequence_epoch(const SyncerSnapshot& s) noexcept {
  std::uint64_t e = s.sequence_epoch;
  for (const auto& l : s.learners) e = std::max(e, l.first_sequence >> kSequenceEpochShift);
  for (const auto& f : s.fragments)
    for (const auto& [id, seq] : f.last_sequence) e = std::max(e, seq >> kSequenceEpochShift);
  return e;
}
}  // namespace detail

/// Prepares a snapshot for a restart after a crash: moves every fragment's
/// version to the start of the next 2^32 block (a new epoch). Merges made
/// after the checkpoint died with the old process, but learners may have
/// applied them, so their base versions can be ahead of the checkpoint's; the
/// syncer would reject their contributions as future_version without an
/// answer, and a learner ignores globals older than what it holds, so the run
/// would never re-synchronise. In a new epoch every pre-crash base is more than
/// max_staleness behind: the syncer answers each such contribution with its
/// current fragment, newer than anything the learner holds, and the learner
/// rebases on it (tests/multiprocess/kill_syncer.sh). An exact restore (same
/// process, no lost merges) does not need this.
///
/// It also starts a new sequence epoch (SyncerSnapshot::sequence_epoch, one
/// above the highest epoch any recorded sequence is in): joins after the
/// restore get sequence spaces above everything handed out before the crash,
/// recorded or lost with it, so an honest learner's contributions are never
/// taken for duplicates. The epoch only protects against crashes if it is on
/// disk before the syncer serves: write a checkpoint of the restored state
/// first (ddiloco_syncer does), or two crashes in a row from one checkpoint
/// would hand out the same epoch (and the same versions) twice.
inline void advance_epoch(SyncerSnapshot& s) noexcept {
  for (auto& f : s.fragments) f.version = ((f.version >> 32) + 1) << 32;
  s.sequence_epoch = detail::highest_sequence_epoch(s) + 1;
}

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

/// The robust reference of one fragment's accepted norms (or weights). It
/// keeps, for each of the last `learners` learners heard from, that learner's
/// `history` latest values (a learner that sends again updates its own entry;
/// a new one evicts the learner heard from least recently), and answers the
/// lower median over learners of each learner's recent maximum. One learner
/// holds one vote however often it sends, so fewer than half of the learners
/// cannot move the reference past the honest values; the recent maximum keeps
/// a momentary dip of honest norms (the outer gradient passing through zero
/// under Nesterov momentum) from making the next normal contribution look
/// like an outlier. A learner holding fewer than `history` values votes no
/// lower than a floor (see put()): the maximum of one value is no guard
/// against a dip, and a newcomer whose first norm was one (a group learner
/// restarted next to a converged single learner: 2.7e-6 against 3e-3) made
/// the lower median of two learners that dip, clipping every honest
/// contribution to 4x it for the rest of the run (docs/algorithm.md, "The
/// robust reference, the norm check and clipping"). Memory is fixed: learners
/// x history doubles. Not thread-safe (the syncer holds the fragment's lock).
class RobustReference {
 public:
  explicit RobustReference(std::size_t learners = 16, std::size_t history = 8)
      : learners_(std::max<std::size_t>(learners, 1)), history_(std::max<std::size_t>(history, 1)) {
    entries_.reserve(learners_);
    scratch_.reserve(learners_);
  }

  void put(LearnerId id, double value) {
    auto it = std::find_if(entries_.begin(), entries_.end(), [id](const Entry& e) { return e.id == id; });
    Entry e;
    if (it != entries_.end()) {
      e = std::move(*it);
      entries_.erase(it);
    } else if (entries_.size() >= learners_) {
      e = std::move(entries_.front());  // reuse the evicted learner's storage
      entries_.erase(entries_.begin());
      e.values.clear();
      e.next = 0;
    }
    e.id = id;
    if (e.values.size() < history_) {
      e.values.push_back(value);
    } else {
      e.values[e.next] = value;
      e.next = (e.next + 1) % history_;
    }
    entries_.push_back(std::move(e));
    // The floor of a partial learner's vote: the lower median of the full
    // learners' maxima, and no more than the reference before this value (so
    // that a flooding liar whose history alone is full cannot lift it).
    scratch_.clear();
    for (const Entry& x : entries_)
      if (x.values.size() >= history_) scratch_.push_back(recent_max(x));
    std::optional<double> floor;
    if (!scratch_.empty()) floor = std::min(lower_median(scratch_), median_.value_or(std::numeric_limits<double>::infinity()));
    scratch_.clear();
    for (const Entry& x : entries_)
      scratch_.push_back(floor && x.values.size() < history_ ? std::max(recent_max(x), *floor) : recent_max(x));
    median_ = lower_median(scratch_);
  }

  /// The lower median (the ((n - 1) / 2)-th smallest of n: with two learners,
  /// the smaller) of the learners' votes: each one's recent maximum, raised to
  /// the floor above for a learner holding fewer than `history` values;
  /// nullopt when empty.
  [[nodiscard]] std::optional<double> median() const { return median_; }

  /// Learner `id`'s recent maximum; nullopt if it has no entry.
  [[nodiscard]] std::optional<double> recent_max(LearnerId id) const {
    auto it = std::find_if(entries_.begin(), entries_.end(), [id](const Entry& e) { return e.id == id; });
    if (it == entries_.end()) return std::nullopt;
    return recent_max(*it);
  }

  [[nodiscard]] std::size_t learners() const noexcept { return entries_.size(); }
  void clear() noexcept {
    entries_.clear();
    median_.reset();
  }

 private:
  struct Entry {
    LearnerId id = 0;
    std::vector<double> values;  ///< at most history_, a ring once full
    std::size_t next = 0;        ///< the ring's oldest value once full
  };
  static double recent_max(const Entry& e) { return *std::max_element(e.values.begin(), e.values.end()); }
  static double lower_median(std::vector<double>& v) {
    const auto mid = v.begin() + static_cast<std::ptrdiff_t>((v.size() - 1) / 2);
    std::nth_element(v.begin(), mid, v.end());
    return *mid;
  }

  std::size_t learners_, history_;
  std::vector<Entry> entries_;  ///< least recently heard from first
  std::optional<double> median_;  ///< the votes' lower median after the latest put
  std::vector<double> scratch_;
};

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

  /// Handles one incoming message; replies go to `out`. Never throws for bad
  /// input: a bad message is counted and dropped (or answered).
  void handle(const Message& m, Outbox& out) {
    const TimePoint now = clock_->now();
    count_in(m);
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
        return send_rejoin_requests(out);
      case MessageType::contribution: on_contribution(m, now, out); return send_rejoin_requests(out);
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
        count_in(m);
        if (m.fingerprint != plan_.fingerprint()) {
          reject(RejectReason::foreign_plan, m);
        } else if (auto c = precheck(m, now)) {
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
    std::set<LearnerId> pulled;       ///< the learners asked for p in this round
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
  void count_in(const Message& m) {
    {
      std::unique_lock lock(members_mutex_);
      counters_.bytes_in += sizeof(Message) + m.payload_bytes();
    }
    if (m.type == MessageType::contribution && !tallies_.empty()) {
      std::lock_guard lock(tally_mutex_);
      if (auto it = tallies_.find(m.learner); it != tallies_.end()) ++it->second.contributions;
    }
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

  // ---- refusals and observers ----------------------------------------------
  /// Why a join or observe request does not fit this run, if it does not. An
  /// observe with fingerprint 0 takes whatever plan this syncer has.
  std::optional<JoinRefusal> refusal_for(const Message& m) const {
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
  void refuse(const Message& m, JoinRefusal why, TimePoint now, Outbox& out) {
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
  void on_observe(const Message& m, TimePoint now, Outbox& out) {
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
  void on_join(const Message& m, TimePoint now, Outbox& out) {
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
      // A new incarnation will not answer its predecessor's pull: not waited for.
      if (new_incarnation) f.owed.erase(m.learner);
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
  bool join_allowed_locked(LearnerInfo* l, TimePoint now) {
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
  void forget_locked(typename std::map<LearnerId, LearnerInfo>::iterator it) {
    incarnation_floor_ = std::max(incarnation_floor_, it->second.incarnation);
    sequence_floor_ = std::max(sequence_floor_, it->second.first_sequence);
    learners_.erase(it);
    ++counters_.learners_pruned;
  }

  /// Drops the per-fragment sequences of forgotten learners, unless one of them
  /// joined again meanwhile (its new incarnation's sequences are then kept).
  /// Takes each fragment's lock, then the membership lock (the usual order).
  void forget_sequences(const std::vector<LearnerId>& ids) {
    if (ids.empty()) return;
    for (auto& f : fragments_) {
      std::unique_lock lock(f.mutex);
      std::unique_lock members(members_mutex_);
      for (LearnerId id : ids)
        if (!learners_.contains(id)) f.last_sequence.erase(id);
    }
  }

  void on_leave(const Message& m) {
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
  bool touch(LearnerId id, TimePoint now, std::uint64_t step, std::optional<Duration>* step_time = nullptr) {
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
  void advance_locked(LearnerId id, LearnerInfo& l, std::uint64_t step) {
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
  static bool still_training(const LearnerInfo& o, TimePoint now, std::uint64_t lead) noexcept {
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
  void carry_on_locked(LearnerId id, TimePoint now) {
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
  static std::uint64_t carried_position(const LearnerInfo& l) noexcept {
    return saturating_sum(position(l), l.carried);
  }

  /// A learner's position on the global-step axis: the global step at its
  /// join plus the inner steps it has trained since (saturating). Caller holds members_mutex_.
  static std::uint64_t position(const LearnerInfo& l) noexcept {
    if (!l.join_step || l.step <= *l.join_step) return l.join_global;
    return saturating_sum(l.join_global, l.step - *l.join_step);
  }

  /// a + b, or the largest std::uint64_t where that overflows.
  static constexpr std::uint64_t saturating_sum(std::uint64_t a, std::uint64_t b) noexcept {
    return b <= std::numeric_limits<std::uint64_t>::max() - a ? a + b : std::numeric_limits<std::uint64_t>::max();
  }

  /// Pull rounds: records whether learner `id`'s latest contribution was
  /// accepted (LearnerInfo::answers_refused). Takes the membership lock.
  void note_answer(LearnerId id, bool accepted) {
    if (!pull_schedule_) return;
    std::unique_lock lock(members_mutex_);
    if (auto it = learners_.find(id); it != learners_.end()) it->second.answers_refused = !accepted;
  }
  bool answers_refused(LearnerId id) const {
    std::unique_lock lock(members_mutex_);
    const auto it = learners_.find(id);
    return it != learners_.end() && it->second.answers_refused;
  }

  /// Notes that unknown learner `id` should be asked to join again, unless it
  /// was asked less than rejoin_interval ago or the interval's burst for all
  /// ids is spent (then only counted). Caller holds members_mutex_.
  void ask_rejoin_locked(LearnerId id, TimePoint now) {
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
  void send_rejoin_requests(Outbox& out) {
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

  /// A contribution against base version `base` is stale when the global
  /// has moved on from its base for more than max_staleness rounds: with H
  /// known (sync_every), rounds of H global steps since the merge that
  /// superseded `base` (the global step of each recent version is kept), so
  /// the bound does not shrink as merges per round grow with M (push rounds at
  /// K = 1 make about one merge per learner per round); without H, or for a
  /// base older than the versions kept, versions. Caller holds f.mutex.
  bool stale(const FragmentState& f, std::uint64_t base) const {
    if (base >= f.version) return false;  // the current global (a future base is rejected before)
    // Pull rounds: an answer is measured from the learner's base global, so it
    // can only be merged anchored at one of the previous globals kept.
    if (pull_schedule_ && config_.anchor_versions > 0)
      return std::none_of(f.previous.begin(), f.previous.end(), [&](const auto& e) { return e.first == base; });
    if (config_.sync_every != 0) {
      for (auto it = f.version_steps.rbegin(); it != f.version_steps.rend(); ++it) {
        if (it->first != base + 1) continue;
        std::uint64_t now_step = 0;
        {
          std::unique_lock lock(members_mutex_);
          now_step = global_step_;
        }
        const std::uint64_t age = now_step > it->second ? now_step - it->second : 0;
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
  std::optional<RejectReason> check_claims(std::size_t p, const Message& m) {
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

  // ---- contributions ------------------------------------------------------
  /// A contribution that passed the checks needing no fragment lock.
  struct Checked {
    const Message* m = nullptr;
    TimePoint now{0};  ///< when it was handled (round start, step time)
    double norm = 0.0;    ///< ||v|| of the whole fragment, as sent
    double weight = 0.0;  ///< WeightRule of the claims; admit() caps it
    double scale = 1.0;   ///< set by admit(): the factor v enters the merge with (clipping)
    std::optional<Duration> step_time;
    std::vector<double> tensor_sq;  ///< ||v_t||^2 per tensor of the fragment (handed to add_batch)
    /// Pull rounds: the contribution anchored at the current global (set by
    /// anchor(); merged instead of the payload, norms recomputed).
    std::shared_ptr<const std::vector<float>> anchored;
  };

  void on_contribution(const Message& m, TimePoint now, Outbox& out) {
    if (auto c = precheck(m, now)) fold(std::span<Checked>(&*c, 1), out);
  }

  /// The checks of a contribution that need no fragment lock: index, size,
  /// counters, finiteness (one pass computing every tensor's squared norm too,
  /// which add_batch then does not compute again), known learner.
  std::optional<Checked> precheck(const Message& m, TimePoint now) {
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
  bool admit(std::size_t p, FragmentState& f, Checked& c, Outbox& out) {
    const Message& m = *c.m;
    if (c.step_time) f.wait->observe_step_time(*c.step_time);
    auto& last = f.last_sequence[m.learner];
    if (m.sequence <= last) {
      ++f.rejected_duplicate;
      count_tally(m, RejectReason::duplicate);
      return false;
    }
    if (pull_schedule_) {
      // Pull rounds: only the answer to a pull still owed (one per pull) goes
      // on; an unasked contribution touches nothing (a flood cannot stack
      // contributions in one round, nor contribute without being pulled).
      const auto owed = f.owed.find(m.learner);
      if (owed == f.owed.end()) {
        last = m.sequence;  // refused: a replay of this one is a duplicate
        reject(RejectReason::unsolicited, m);
        return false;
      }
      if (--owed->second == 0) f.owed.erase(owed);
      // A pulled learner has answered, whatever the verdict below; how long it
      // took (a late answer, from the pull it answers) sets the time-out.
      // (Not from a learner whose answers are refused: its pace is not the
      // honest learners' time-out.)
      const bool pulled_now = f.phase == FragmentState::Phase::pulling && f.pulled.contains(m.learner);
      const bool timed = !answers_refused(m.learner);
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
    if (stale(f, m.version)) {
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
  bool anchor(std::size_t p, FragmentState& f, Checked& c) {
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
  void fold(std::span<Checked> batch, Outbox& out) {
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

  void accumulate(FragmentState& f, std::span<const Checked* const> items) {
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

  /// Asks the wait policy about fragment p's round; merges if told to.
  /// Caller holds f.mutex.
  bool decide_and_merge(std::size_t p, FragmentState& f, TimePoint now, Outbox& out) {
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

  void merge(std::size_t p, FragmentState& f, TimePoint now, const WaitDecision& d, Outbox& out) {
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

  // ---- pull rounds (RoundMode::pull; docs/algorithm.md, "Round timeline") --
  //   1. the global step t reaches fragment p's slot (Schedule::due_at(t) = p):
  //      the round opens (open_due_rounds), phase waiting;
  //   2. the wait policy decides over the learners that have progress on p
  //      (RoundState::contributions = reported, alive = eligible): K of them,
  //      then the grace window, or all of them;
  //   3. a pull goes to every learner with progress on p (start_pull), phase
  //      pulling; each answers with a contribution at its next step boundary;
  //   4. once every pulled learner has answered or died, or at the pull
  //      time-out, the answers are merged (merge()) and Theta_p goes out.
  // Contributions that arrive outside a round (a late answer) stay in the
  // accumulator and are merged in the fragment's next round.

  /// Learner `l` counts for a round whose slot is global step `slot`: alive,
  /// joined before the slot (at a lower global step) and trained since it
  /// joined (eligible); has_progress: trained since it last received p.
  static bool eligible(const LearnerInfo& l, std::uint64_t slot) noexcept {
    return l.alive && l.reported && l.join_global < slot;
  }
  static bool has_progress(const LearnerInfo& l, std::size_t p) noexcept {
    return p >= l.receipt_step.size() || l.step > l.receipt_step[p];
  }

  /// Opens the rounds of the fragments whose slots the global step has
  /// passed since the last call (each fragment at most once per call; a
  /// fragment whose previous round is still open keeps that round).
  void open_due_rounds(TimePoint now, Outbox& out) {
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
  void refresh_waiting_rounds(TimePoint now, Outbox& out) {
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

  /// Keeps waiting_rounds_ (the fragments in phase waiting) in step with f.phase. Caller holds f.mutex.
  void set_phase(std::size_t p, FragmentState& f, typename FragmentState::Phase phase) {
    using Phase = typename FragmentState::Phase;
    if (f.phase == phase) return;
    if (f.phase == Phase::waiting || phase == Phase::waiting) {
      std::unique_lock lock(members_mutex_);
      if (phase == Phase::waiting) {
        waiting_rounds_.push_back(p);
      } else {
        std::erase(waiting_rounds_, p);
      }
    }
    f.phase = phase;
  }

  /// The pull-mode decision for fragment p's round (steps 2-4 above). Caller holds f.mutex.
  bool decide_pull(std::size_t p, FragmentState& f, TimePoint now, Outbox& out) {
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
      for (LearnerId id : f.pulled) {
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
      for (LearnerId id : f.pulled)
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
  void start_pull(std::size_t p, FragmentState& f, TimePoint now, Outbox& out) {
    set_phase(p, f, FragmentState::Phase::pulling);
    f.pulled_at = now;
    f.pulled.clear();
    f.answered.clear();
    {
      std::unique_lock lock(members_mutex_);
      std::erase_if(f.owed, [&](const auto& kv) { return !learners_.contains(kv.first); });  // forgotten ids
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
        f.pulled.insert(id);
        auto& owed = f.owed[id];
        owed = std::min<std::uint8_t>(static_cast<std::uint8_t>(owed + 1), FragmentState::kOwedAnswers);
      }
      counters_.pulls_sent += f.pulled.size();
    }
    const std::size_t from = out.size();
    for (LearnerId id : f.pulled) {
      Message m;
      m.type = MessageType::pull;
      m.fingerprint = plan_.fingerprint();
      m.learner = id;
      m.fragment = static_cast<std::uint32_t>(p);
      m.version = f.version;
      m.step = f.round_step;
      // The oldest base an answer can be anchored at (stale()): a learner on an
      // older one waits for the global on its way before it answers.
      // (0: not stated, when answers are not anchored.)
      if (config_.anchor_versions > 0)
        m.tokens = static_cast<std::int64_t>(f.previous.empty() ? f.version : f.previous.front().first);
      out.push_back({id, std::move(m)});
    }
    count_out(out, from);
  }

  /// Ends fragment p's pull round (merged, empty, or discarded by a restore). Caller holds f.mutex.
  void close_pull_round(std::size_t p, FragmentState& f) {
    f.graced = false;
    set_phase(p, f, FragmentState::Phase::none);
    f.pulled.clear();
    f.answered.clear();
  }

  /// SyncerConfig::pull_timeout, or twice the larger of (tau + 1) inner steps
  /// as measured from the learners' step counters and fragment p's measured
  /// pull-to-answer time (quorum.deadline until a step time is measured).
  Duration pull_timeout(const FragmentState& f) const {
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
  detail::Ema step_seconds_{0.1};            ///< inner-step time over all learners' messages
};

}  // namespace ddiloco
