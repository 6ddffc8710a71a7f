// ddiloco/syncer_snapshot.hpp: a syncer's durable state as a value
// (SyncerSnapshot: globals, optimizer state, versions, membership, sequences)
// and the sequence-space layout that makes restores safe (advance_epoch()).
//
// What it is: what Syncer::snapshot() copies out and restore() puts back
// (with each fragment's counters, a FragmentStatus).
// What it is not: files (checkpoint.hpp writes and reads them) or the checks
// of a snapshot against a plan (Syncer::restore()).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/message.hpp>
#include <ddiloco/syncer_status.hpp>

namespace ddiloco {

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

}  // namespace ddiloco
