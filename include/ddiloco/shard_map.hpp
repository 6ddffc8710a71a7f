// ddiloco/shard_map.hpp: which syncer shard owns each fragment.
//
// What it is: the assignment of a Plan's P fragments to S syncer shards,
// balanced by bytes, derived from the plan and S alone so that every process
// of a run (each shard, each learner, the planner) computes the same map and
// can compare it by fingerprint. The rule is longest-processing-time greedy:
// fragments in decreasing numel (ties: lower index first), each to the shard
// holding the fewest elements so far (ties: lower shard index). Its largest
// shard is within 4/3 of the best possible, and never above the mean plus one
// fragment (docs/simulator.md, "Sizing a deployment").
// What it is not: the sharded protocol (which shard a learner talks to about a
// fragment); it is the map that protocol and the planner share.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include <ddiloco/detail/hash.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/fragmenter.hpp>

namespace ddiloco {

/// The most syncer shards a run may have: a join names its shard in 12 bits.
inline constexpr std::size_t kMaxShards = 4095;

namespace detail {
/// The shard a join is addressed to travels in the join's `fragment` field:
/// bits 0-7 the round mode, bits 8-19 the shard count S, bits 20-31 the shard
/// index i. S = 0 is a learner that names no shard (one syncer).
struct JoinShard {
  std::size_t index = 0;
  std::size_t count = 0;
};
constexpr std::uint32_t join_shard_bits(std::size_t index, std::size_t count) noexcept {
  return static_cast<std::uint32_t>(((count & 0xfffu) << 8) | ((index & 0xfffu) << 20));
}
constexpr JoinShard join_shard(std::uint32_t field) noexcept {
  return JoinShard{(field >> 20) & 0xfffu, (field >> 8) & 0xfffu};
}
}  // namespace detail

class ShardMap {
 public:
  /// Throws InvalidArgument unless 1 <= shards <= plan.num_fragments() (a
  /// shard without a fragment would have nothing to serve).
  ShardMap(const Plan& plan, std::size_t shards) : shard_of_(plan.num_fragments()), elements_(shards, 0) {
    const std::size_t p = plan.num_fragments();
    if (shards == 0 || shards > p || shards > kMaxShards) {
      throw InvalidArgument(detail::msg("ShardMap: shards = ", shards, " must be in [1, ", std::min(p, kMaxShards),
                                        "] (the plan has ", p, " fragments; each shard serves at least one)"));
    }
    std::vector<std::size_t> order(p);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return plan.fragments()[a].numel > plan.fragments()[b].numel;
    });
    members_.resize(shards);
    for (const std::size_t f : order) {
      const auto least = static_cast<std::size_t>(std::min_element(elements_.begin(), elements_.end()) - elements_.begin());
      shard_of_[f] = least;
      elements_[least] += plan.fragments()[f].numel;
      members_[least].push_back(f);
    }
    for (auto& m : members_) std::sort(m.begin(), m.end());
    detail::Fnv1a64 h;
    h.str("ddiloco.shard_map.v1").u64(plan.fingerprint()).u64(shards);
    for (const std::size_t s : shard_of_) h.u64(s);
    fingerprint_ = h.value();
  }

  [[nodiscard]] std::size_t shards() const noexcept { return elements_.size(); }
  [[nodiscard]] std::size_t num_fragments() const noexcept { return shard_of_.size(); }

  /// The shard that owns fragment f; throws InvalidArgument for f >= P.
  [[nodiscard]] std::size_t shard_of(std::size_t f) const {
    if (f >= shard_of_.size()) {
      throw InvalidArgument(detail::msg("ShardMap::shard_of: fragment ", f, " does not exist; the plan has ",
                                        shard_of_.size(), " fragments"));
    }
    return shard_of_[f];
  }

  /// Shard s's fragments, ascending; throws InvalidArgument for s >= S.
  [[nodiscard]] std::span<const std::size_t> fragments_of(std::size_t s) const {
    check_shard(s, "fragments_of");
    return members_[s];
  }

  /// Elements shard s owns (the sum of its fragments' numel).
  [[nodiscard]] std::size_t elements_of(std::size_t s) const {
    check_shard(s, "elements_of");
    return elements_[s];
  }

  /// Largest shard's elements over the mean (>= 1; 1 is perfect).
  [[nodiscard]] double imbalance() const noexcept {
    const std::size_t total = std::accumulate(elements_.begin(), elements_.end(), std::size_t{0});
    const std::size_t largest = *std::max_element(elements_.begin(), elements_.end());
    return static_cast<double>(largest) * static_cast<double>(elements_.size()) / static_cast<double>(total);
  }

  /// Hash of the plan's fingerprint, S and the assignment: equal in every
  /// process that derived the same map.
  [[nodiscard]] std::uint64_t fingerprint() const noexcept { return fingerprint_; }

 private:
  void check_shard(std::size_t s, const char* what) const {
    if (s >= elements_.size()) {
      throw InvalidArgument(detail::msg("ShardMap::", what, ": shard ", s, " does not exist; the map has ",
                                        elements_.size(), " shards (valid: 0..", elements_.size() - 1, ")"));
    }
  }

  std::vector<std::size_t> shard_of_;               ///< per fragment
  std::vector<std::size_t> elements_;               ///< per shard
  std::vector<std::vector<std::size_t>> members_;  ///< per shard, ascending
  std::uint64_t fingerprint_ = 0;
};

}  // namespace ddiloco
