// ddiloco/syncer_status.hpp: what a syncer reports: why it refused a message
// (RejectReason), per-learner tallies, refused join/observe requests, and the
// status of every fragment and of the whole syncer (docs/metrics.md).
//
// What it is: values, copied out of a running Syncer (Syncer::status(),
// take_refusals()); the metrics exporters and the status file read them.
// What it is not: durable state (syncer_snapshot.hpp) or settings
// (syncer_config.hpp).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/histogram.hpp>
#include <ddiloco/message.hpp>
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
/// `contributions - accepted - redundant` are all its rejected contributions, whatever
/// check refused them (once the syncer has handled what arrived); `rejected`
/// breaks down those refused by the checks that name the learner (foreign
/// plan, size, counters, finiteness, duplicate, stale, future version, norm).
struct LearnerTally {
  std::uint64_t step = 0;  ///< the highest inner step counter (Message::step) its contributions carried
  std::uint64_t contributions = 0;
  std::uint64_t accepted = 0;
  /// Pull rounds: second answers to a pull asked twice, dropped (merged once; not rejections).
  std::uint64_t redundant = 0;
  std::array<std::uint64_t, kRejectReasons> rejected{};  ///< messages from this id refused, by reason
  [[nodiscard]] std::uint64_t rejected_total() const noexcept {
    return contributions > accepted + redundant ? contributions - accepted - redundant : 0;
  }
  /// Rejected contributions under no reason of `rejected` (e.g. unknown_learner).
  [[nodiscard]] std::uint64_t rejected_other() const noexcept {
    std::uint64_t named = 0;
    for (auto r : rejected) named += r;
    return rejected_total() > named ? rejected_total() - named : 0;
  }
};

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
  /// Pull rounds: second asks sent (SyncerConfig::reask_after_steps: a pulled
  /// learner moved on with no answer in), and second answers dropped because
  /// the first had come (each pull is merged once; not counted as rejections).
  std::uint64_t pulls_repeated = 0;
  std::uint64_t answers_redundant = 0;
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

}  // namespace ddiloco
