// ddiloco/transport/sharded.hpp: a learner's link to a syncer sharded by fragment.
//
// What it is: a LearnerTransport over S links, link i to syncer shard i of S
// (SyncerConfig::shard_index / shard_count, `ddiloco_syncer --shard i/S`).
// It derives the ShardMap from the plan, as every shard does, and routes:
//   - a contribution (or a pull's answer) of fragment p to shard_of(p);
//   - metadata, heartbeats and leaves to every shard (each keeps its own
//     membership and global step; metadata is a few dozen bytes);
//   - a join (a new incarnation) to every shard, and its retries to the
//     shards whose fragments' state has not all arrived, each copy naming the
//     shard it is meant for (a shard started with another S, or reached at the
//     wrong position of the endpoint list, refuses it with
//     JoinRefusal::shard_map, naming both). A rejoin that one shard asked for
//     (it restarted from a checkpoint older than the learner's join) is a new
//     incarnation at every shard: each answers with its state and a new
//     sequence base, and no shard is left with a base above the learner's;
//   - incoming messages from every link, round robin; a global, full state or
//     pull from shard i about a fragment shard i does not serve is dropped
//     (counted in misrouted()).
// OuterLoop needs nothing else: the full states of all shards add up to the
// P fragments a join waits for, and it numbers contributions above the
// highest sequence base any shard gave it (docs/sharding.md).
// A shard that is down only stops its fragments: sends to it fail (and
// OuterLoop keeps their progress for the next send) while the other links go
// on; when it is back it resumes from its checkpoint and its fragments move again.
// What it is not: a way to reach several independent syncers, nor a
// transport of its own: the links are ZmqLearnerTransport (or any
// LearnerTransport with the same clock).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddiloco/error.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/message.hpp>
#include <ddiloco/shard_map.hpp>

namespace ddiloco {

/// A link that can be waited on together with others: `poll_items(two)` fills
/// two zmq_pollitem_t, `after_poll(two)` handles their events (ZmqLearnerTransport).
template <class L>
concept PollableLink = requires(L& l, typename L::PollItem* items, Duration wait) {
  l.poll_items(items);
  l.after_poll(items);
  L::wait_any(items, std::size_t{2}, wait);
};

template <class Link>
  requires LearnerTransport<Link>
class ShardedLearnerTransport {
 public:
  /// `links[i]` reaches shard i of links.size(); `plan` is the learner's (the
  /// map is derived from it and S alone). Throws InvalidArgument for no link, a
  /// null link, links on different clocks, or S above the plan's fragments.
  ShardedLearnerTransport(const Plan& plan, std::vector<std::unique_ptr<Link>> links)
      : map_(plan, checked_count(links)), links_(std::move(links)) {
    for (std::size_t i = 0; i < links_.size(); ++i) {
      if (!links_[i]) throw InvalidArgument(detail::msg("ShardedLearnerTransport: link ", i, " is null"));
      if (&links_[i]->clock() != &links_[0]->clock())
        throw InvalidArgument(detail::msg("ShardedLearnerTransport: link ", i,
                                          " runs on another clock than link 0; give every link the same clock"));
    }
    shards_.resize(links_.size());
    for (std::size_t i = 0; i < links_.size(); ++i) shards_[i].owed = map_.fragments_of(i).size();
  }

  [[nodiscard]] const ShardMap& map() const noexcept { return map_; }
  [[nodiscard]] std::size_t shards() const noexcept { return links_.size(); }
  [[nodiscard]] Link& link(std::size_t i) { return *links_.at(i); }
  [[nodiscard]] const Clock& clock() const noexcept { return links_[0]->clock(); }
  [[nodiscard]] bool failed() const {
    for (const auto& l : links_)
      if (l->failed()) return true;
    return false;
  }
  /// Messages dropped because their shard does not serve their fragment.
  [[nodiscard]] std::uint64_t misrouted() const noexcept { return misrouted_; }

  bool send(Message&& m) {
    switch (m.type) {
      case MessageType::contribution:
        if (m.fragment >= map_.num_fragments()) return false;  // no shard serves it (OuterLoop never sends one)
        return links_[map_.shard_of(m.fragment)]->send(std::move(m));
      case MessageType::join: return send_join(std::move(m));
      default: {
        bool any = false;
        for (std::size_t i = 0; i < links_.size(); ++i) {
          Message copy = m;  // control messages: no payload to copy
          any = links_[i]->send(std::move(copy)) || any;
        }
        return any;
      }
    }
  }

  std::optional<Message> try_receive() {
    for (std::size_t k = 0; k < links_.size(); ++k) {
      const std::size_t i = (next_ + k) % links_.size();
      while (auto m = links_[i]->try_receive()) {
        if (!accept(i, *m)) continue;
        next_ = (i + 1) % links_.size();
        return m;
      }
    }
    return std::nullopt;
  }

  std::optional<Message> receive_until(TimePoint deadline) {
    if constexpr (requires(Link& l) { l.flush_metadata(); })
      for (auto& link : links_) link->flush_metadata();  // about to wait: held metadata goes out first
    for (;;) {
      if (auto m = try_receive()) return m;
      const TimePoint now = clock().now();
      if (now >= deadline) return std::nullopt;
      if constexpr (PollableLink<Link>) {
        std::vector<typename Link::PollItem> items(2 * links_.size());
        for (std::size_t i = 0; i < links_.size(); ++i) links_[i]->poll_items(&items[2 * i]);
        Link::wait_any(items.data(), items.size(), deadline - now);
        for (std::size_t i = 0; i < links_.size(); ++i) links_[i]->after_poll(&items[2 * i]);
      } else {
        // One link waited on at a time, in short turns (a virtual clock returns at once).
        auto m = links_[next_]->receive_until(std::min(deadline, now + std::chrono::milliseconds(2)));
        const std::size_t i = next_;
        next_ = (next_ + 1) % links_.size();
        if (m && accept(i, *m)) return m;
      }
    }
  }

  /// ContributionEncodingTransport: every link sends in the same codec (link 0's).
  [[nodiscard]] std::optional<Codec> contribution_codec() const
    requires ContributionEncodingTransport<Link>
  {
    return links_[0]->contribution_codec();
  }

  /// FragmentBufferTransport: the buffer of the link fragment p goes out on.
  [[nodiscard]] OutgoingPayload contribution_buffer(std::size_t bytes, std::size_t fragment)
    requires ContributionBufferTransport<Link>
  {
    return links_[map_.shard_of(fragment)]->contribution_buffer(bytes);
  }

  /// DiagnosingTransport: the first link that cannot work, named by shard
  /// (one link: its own words).
  [[nodiscard]] std::optional<std::string> link_failure()
    requires DiagnosingTransport<Link>
  {
    for (std::size_t i = 0; i < links_.size(); ++i)
      if (auto why = links_[i]->link_failure()) return shard_prefix(i) + *why;
    return std::nullopt;
  }
  [[nodiscard]] std::string link_summary()
    requires DiagnosingTransport<Link>
  {
    std::string out;
    for (std::size_t i = 0; i < links_.size(); ++i)
      out += (i == 0 ? "" : "; ") + shard_prefix(i) + links_[i]->link_summary();
    return out;
  }

  /// The links' counters added up (ZmqCounters).
  [[nodiscard]] auto counters() const
    requires requires(const Link& l) { l.counters(); }
  {
    std::decay_t<decltype(links_[0]->counters())> sum{};
    for (const auto& l : links_) sum += l->counters();
    return sum;
  }

 private:
  struct Shard {
    std::size_t owed = 0;              ///< fragments of the current join's state not yet received
    std::vector<std::uint32_t> got;    ///< fragments received for the current join (no duplicates counted)
  };

  [[nodiscard]] std::string shard_prefix(std::size_t i) const {
    if (links_.size() == 1) return {};
    return detail::msg("shard ", i, "/", links_.size(), shards_[i].owed == 0 ? " (state received)" : "", ": ");
  }

  static std::size_t checked_count(const std::vector<std::unique_ptr<Link>>& links) {
    if (links.empty())
      throw InvalidArgument("ShardedLearnerTransport: no link; give one per syncer shard, in shard order");
    return links.size();
  }

  /// A join (OuterLoop: a new nonce per incarnation, the same for its
  /// retries) goes to every shard when its nonce is new, and a retry only to
  /// the shards that still owe part of their state: one that answered is not
  /// asked to send its fragments again while another shard is down.
  bool send_join(Message&& m) {
    if (!join_nonce_ || *join_nonce_ != m.sequence) {
      join_nonce_ = m.sequence;
      for (std::size_t i = 0; i < shards_.size(); ++i) {
        shards_[i].owed = map_.fragments_of(i).size();
        shards_[i].got.clear();
      }
    }
    bool any = false;
    for (std::size_t i = 0; i < links_.size(); ++i) {
      if (shards_[i].owed == 0) continue;
      Message copy = m;
      copy.fragment = (m.fragment & 0xffu) | detail::join_shard_bits(i, links_.size());
      any = links_[i]->send(std::move(copy)) || any;
    }
    return any;
  }

  /// Whether a message from shard i goes on to the caller; bookkeeping of joins.
  bool accept(std::size_t i, const Message& m) {
    const bool about_fragment = m.type == MessageType::full_state || m.type == MessageType::global_fragment ||
                                m.type == MessageType::pull;
    if (about_fragment && (m.fragment >= map_.num_fragments() || map_.shard_of(m.fragment) != i)) {
      ++misrouted_;
      return false;
    }
    auto& s = shards_[i];
    if (m.type == MessageType::full_state && s.owed > 0 &&
        std::find(s.got.begin(), s.got.end(), m.fragment) == s.got.end()) {
      s.got.push_back(m.fragment);
      if (--s.owed == 0) s.got.clear();
    }
    return true;
  }

  ShardMap map_;
  std::vector<std::unique_ptr<Link>> links_;
  std::vector<Shard> shards_;
  std::optional<std::uint64_t> join_nonce_;
  std::size_t next_ = 0;  ///< the link read first next time (round robin)
  std::uint64_t misrouted_ = 0;
};

}  // namespace ddiloco
