// ddiloco/syncer_config.hpp: what a syncer is told (SyncerConfig), its
// validation, and the bounds derived from it (docs/operations.md, "7. Memory
// bounds" and "8. Admission bounds").
//
// What it is: plain settings with defaults and one validate() that names the
// bad value; lead_bound() and steps_ceiling() derive the claim bounds of
// docs/algorithm.md, "Validation and staleness", from them.
// What it is not: the state machine that reads them (syncer.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/message.hpp>
#include <ddiloco/quorum.hpp>
#include <ddiloco/shard_map.hpp>

namespace ddiloco {

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
  /// Push rounds: a contribution whose base had been superseded for more than
  /// this many rounds of H global steps when the syncer received it (versions
  /// when sync_every is 0) is rejected and answered with the current fragment
  /// (docs/algorithm.md, "Validation and staleness"). Pull rounds bound the
  /// base by the anchor_versions kept instead.
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
  /// Pull rounds: a pulled learner that has reported this many inner steps
  /// past its step at the pull with no answer in, once 1.5 times the
  /// fragment's measured pull-to-answer time has passed (none measured yet:
  /// not asked), is asked once more
  /// (a pull with Message::repeat) before the round's time-out: the pull or
  /// its answer was most likely lost (a learner answers at its next step
  /// boundary), and without the second ask that learner's steps on the
  /// fragment are lost when it applies the merge it was left out of. It
  /// answers the second ask at its next step boundary, again from the same
  /// base if it had answered; the syncer merges one of the two answers and
  /// drops the other (SyncerStatus::answers_redundant). 0: never ask twice.
  std::uint64_t reask_after_steps = 3;
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
  if (c.reask_after_steps > (std::uint64_t{1} << 20))
    throw InvalidArgument(detail::msg("SyncerConfig::reask_after_steps = ", c.reask_after_steps,
                                      " steps is above 2^20; use a few steps (default 3), or 0 to never ask twice"));
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

}  // namespace ddiloco
