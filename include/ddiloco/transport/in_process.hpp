// ddiloco/transport/in_process.hpp: learners and a syncer as threads of one
// process, talking through bounded in-memory queues, with injected faults.
//
// What it is: a hub (`InProcessNetwork`) that owns one mailbox per endpoint
// (the syncer and each learner) and hands out cheap endpoint handles that model
// ddiloco::LearnerTransport and ddiloco::SyncerTransport (message.hpp). Every
// message gets its fate from a FaultTape (fault_tape.hpp): dropped, delayed,
// duplicated, reordered, or lost to a partition. It also simulates a killed
// learner's endpoint (close / reopen) and counts everything per endpoint.
// What it is not: a network transport or a wire format (messages, payloads
// included, are moved by value and shared, never encoded), and it does not
// kill, slow or schedule learners: the harness does that from the same tape.
//
// # Delivery
// A message sent at time t (the clock's now()) with fate delay d becomes
// deliverable at t + d. A receiver sees only deliverable messages, earliest
// delivery time first, ties broken by a network-wide send counter, so that on
// a virtual clock driven from one thread delivery order is deterministic.
// Tape times (partition windows) are measured from the network's creation.
//
// # Waiting
// With a VirtualClock, receive_until never blocks: it returns a deliverable
// message or nullopt at once (a driver advances the clock to
// next_delivery_time()). With any other clock it waits on a condition
// variable until a message is deliverable, the deadline passes, the endpoint
// is closed or the network shuts down; a send wakes it, no polling.
//
// # Back-pressure and send results
// Each mailbox holds at most `queue_capacity` pending messages. `send`
// never blocks and returns false when the network refuses the message locally:
// the receiver's queue is full, or the sender or receiver endpoint is closed.
// Losses the tape injects (fault drops, partitions) are silent, as on a real
// network: send returns true and the loss is only counted.
//
// # Counters (EndpointCounters, per endpoint)
// `sent`/`bytes_sent` count the endpoint's send calls; `delivered`/
// `bytes_delivered` the messages it received; `duplicated` the extra copies the
// tape made of messages addressed to it; `dropped_*` the copies addressed to it
// that it will never receive, by reason. Per receiver, at every moment:
//   (messages sent to it) + duplicated = delivered + dropped_* + pending.
// Bytes are payload bytes (Message::payload_bytes()).
//
// # Threads and lifetime
// Every member of the network and of the handles is safe to call from any
// number of threads at once (one mutex guards the network). Handles refer to
// the network: destroy the network only after every thread that uses a handle
// has finished (call shutdown() first to wake blocked receivers).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/fault_tape.hpp>
#include <ddiloco/message.hpp>

namespace ddiloco {

/// What happened to the messages of one endpoint (see the header comment).
struct EndpointCounters {
  std::uint64_t sent = 0;                ///< send calls made by this endpoint
  std::uint64_t bytes_sent = 0;          ///< payload bytes of those calls
  std::uint64_t delivered = 0;           ///< messages this endpoint received
  std::uint64_t bytes_delivered = 0;     ///< payload bytes of those
  std::uint64_t duplicated = 0;          ///< extra copies of messages addressed to it
  std::uint64_t dropped_fault = 0;       ///< copies to it lost to the tape's drop probability
  std::uint64_t dropped_partition = 0;   ///< copies to it lost to a partition window
  std::uint64_t dropped_queue_full = 0;  ///< copies to it refused because its queue was full
  std::uint64_t dropped_closed = 0;      ///< copies to it lost because it or the sender was closed
  [[nodiscard]] std::uint64_t dropped() const noexcept {
    return dropped_fault + dropped_partition + dropped_queue_full + dropped_closed;
  }
  friend bool operator==(const EndpointCounters&, const EndpointCounters&) = default;
};

class InProcessLearnerTransport;
class InProcessSyncerTransport;

/// The hub: owns the mailboxes, the clock reference and the fault tape.
class InProcessNetwork {
 public:
  /// `clock` must outlive the network. `queue_capacity` (>= 1) bounds every
  /// mailbox. Throws InvalidArgument on a zero capacity.
  explicit InProcessNetwork(const Clock& clock, FaultTape tape = {}, std::size_t queue_capacity = 1024)
      : clock_(&clock),
        virtual_(dynamic_cast<const VirtualClock*>(&clock) != nullptr),
        tape_(std::move(tape)),
        capacity_(queue_capacity),
        origin_(clock.now()) {
    if (queue_capacity == 0) {
      throw InvalidArgument("InProcessNetwork queue_capacity is 0; give at least 1 (bounded queues, default 1024)");
    }
  }
  InProcessNetwork(const InProcessNetwork&) = delete;
  InProcessNetwork& operator=(const InProcessNetwork&) = delete;
  InProcessNetwork(InProcessNetwork&&) = delete;
  InProcessNetwork& operator=(InProcessNetwork&&) = delete;
  ~InProcessNetwork() = default;

  /// A handle for learner `id` (its mailbox is created on first use). Several
  /// handles for one id share its mailbox. Throws TransportError after shutdown.
  [[nodiscard]] InProcessLearnerTransport learner(LearnerId id);
  /// A handle for the syncer; several handles share its mailbox.
  [[nodiscard]] InProcessSyncerTransport syncer();

  [[nodiscard]] const Clock& clock() const noexcept { return *clock_; }
  [[nodiscard]] const FaultTape& tape() const noexcept { return tape_; }
  [[nodiscard]] std::size_t queue_capacity() const noexcept { return capacity_; }
  /// The clock's time at creation: tape times count from here.
  [[nodiscard]] TimePoint origin() const noexcept { return origin_; }

  /// Simulates learner `id` going down: its pending messages are discarded,
  /// messages to it are dropped (counted dropped_closed) and its own sends
  /// fail until reopen(). Wakes its blocked receivers (they return nullopt).
  void close(LearnerId id) {
    std::lock_guard lock(mu_);
    Mailbox& mb = mailbox(Endpoint::for_learner(id));
    mb.open = false;
    mb.counters.dropped_closed += mb.pending.size();
    mb.pending.clear();
    mb.cv.notify_all();
  }

  /// Brings learner `id` back (a restart) with an empty queue: whatever was
  /// addressed to the dead incarnation is gone.
  void reopen(LearnerId id) {
    std::lock_guard lock(mu_);
    Mailbox& mb = mailbox(Endpoint::for_learner(id));
    mb.open = true;
    mb.counters.dropped_closed += mb.pending.size();  // none in practice: closed mailboxes take nothing
    mb.pending.clear();
  }

  [[nodiscard]] bool is_open(LearnerId id) const {
    std::lock_guard lock(mu_);
    const auto it = learners_.find(id);
    return it == learners_.end() || it->second->open;
  }

  /// The earliest delivery time among all pending messages of open
  /// endpoints: the next event for a virtual-time driver. Empty: nothing in flight.
  [[nodiscard]] std::optional<TimePoint> next_delivery_time() const {
    std::lock_guard lock(mu_);
    std::optional<TimePoint> best;
    const auto consider = [&](const Mailbox& mb) {
      if (!mb.open || mb.pending.empty()) return;
      const auto t = mb.pending.front().deliver_at;
      if (!best || t < *best) best = t;
    };
    consider(syncer_);
    for (const auto& [id, mb] : learners_) consider(*mb);
    return best;
  }

  /// Messages queued for `e`, deliverable or not yet.
  [[nodiscard]] std::size_t pending(Endpoint e) const {
    std::lock_guard lock(mu_);
    const Mailbox* mb = find(e);
    return mb == nullptr ? 0 : mb->pending.size();
  }

  /// Threads blocked in receive_until on `e` right now (for tests and status).
  [[nodiscard]] std::size_t waiters(Endpoint e) const {
    std::lock_guard lock(mu_);
    const Mailbox* mb = find(e);
    return mb == nullptr ? 0 : mb->waiters;
  }

  [[nodiscard]] EndpointCounters counters(Endpoint e) const {
    std::lock_guard lock(mu_);
    const Mailbox* mb = find(e);
    return mb == nullptr ? EndpointCounters{} : mb->counters;
  }

  /// Stops the network for good: wakes every blocked receiver (their calls
  /// return nullopt); every later send/receive throws TransportError.
  void shutdown() {
    std::lock_guard lock(mu_);
    shut_down_ = true;
    syncer_.cv.notify_all();
    for (auto& [id, mb] : learners_) mb->cv.notify_all();
  }
  [[nodiscard]] bool failed() const {
    std::lock_guard lock(mu_);
    return shut_down_;
  }

  // ---- used by the endpoint handles ---------------------------------------

  /// Sends `m` from `from` to `to`; see "Back-pressure and send results".
  bool send(Endpoint from, Endpoint to, Message&& m) {
    std::lock_guard lock(mu_);
    throw_if_shut_down("send");
    Mailbox& src = mailbox(from);
    Mailbox& dst = mailbox(to);
    const auto bytes = static_cast<std::uint64_t>(m.payload_bytes());
    ++src.counters.sent;
    src.counters.bytes_sent += bytes;
    if (!src.open || !dst.open) {
      ++dst.counters.dropped_closed;
      return false;
    }
    // Ordinal of this send on its link: the learner's mailbox keeps both directions.
    std::uint64_t& link = from.is_syncer() ? dst.sends_from_syncer : src.sends_to_syncer;
    const std::uint64_t ordinal = link++;
    const TimePoint now = clock_->now();
    const MessageFate fate = tape_.fate(m, from, to, now - origin_, ordinal);
    dst.counters.duplicated += fate.copies - 1U;

    bool refused = false;
    for (std::size_t i = 0; i < fate.copies; ++i) {
      const auto& copy = fate.copy[i];
      if (copy.dropped == DropReason::fault) {
        ++dst.counters.dropped_fault;
        continue;
      }
      if (copy.dropped == DropReason::partition) {
        ++dst.counters.dropped_partition;
        continue;
      }
      if (dst.pending.size() >= capacity_) {
        ++dst.counters.dropped_queue_full;
        refused = refused || i == 0;  // the sender hears of it only for the original
        continue;
      }
      if (i + 1 == fate.copies) {
        dst.pending.push_back(Pending{now + copy.delay, next_seq_++, std::move(m)});
      } else {
        dst.pending.push_back(Pending{now + copy.delay, next_seq_++, m});  // payload shared, not copied
      }
      std::push_heap(dst.pending.begin(), dst.pending.end(), later);
    }
    dst.cv.notify_all();
    return !refused;
  }

  std::optional<Message> try_receive(Endpoint self) {
    std::lock_guard lock(mu_);
    throw_if_shut_down("try_receive");
    return pop_deliverable(mailbox(self));
  }

  std::optional<Message> receive_until(Endpoint self, TimePoint deadline) {
    std::unique_lock lock(mu_);
    throw_if_shut_down("receive_until");
    Mailbox& mb = mailbox(self);
    for (;;) {
      if (shut_down_) return std::nullopt;
      if (auto m = pop_deliverable(mb)) return m;
      const TimePoint now = clock_->now();
      if (virtual_ || !mb.open || now >= deadline) return std::nullopt;
      TimePoint wake = deadline;
      if (!mb.pending.empty()) wake = std::min(wake, mb.pending.front().deliver_at);
      // Wait in chunks of at most an hour so a far deadline cannot overflow
      // the steady clock's arithmetic inside wait_for.
      const Duration wait = std::min<Duration>(wake - now, std::chrono::hours(1));
      ++mb.waiters;
      mb.cv.wait_for(lock, wait);
      --mb.waiters;
    }
  }

 private:
  struct Pending {
    TimePoint deliver_at;
    std::uint64_t seq;
    Message message;
  };
  /// Heap order: the front is the earliest (deliver_at, seq).
  static bool later(const Pending& a, const Pending& b) noexcept {
    return a.deliver_at != b.deliver_at ? a.deliver_at > b.deliver_at : a.seq > b.seq;
  }

  struct Mailbox {
    std::vector<Pending> pending;  ///< a heap ordered by `later`
    std::condition_variable cv;
    bool open = true;
    std::size_t waiters = 0;
    std::uint64_t sends_to_syncer = 0;    ///< learner mailboxes: ordinal of the learner -> syncer link
    std::uint64_t sends_from_syncer = 0;  ///< learner mailboxes: ordinal of the syncer -> learner link
    EndpointCounters counters;
  };

  void throw_if_shut_down(const char* what) const {
    if (shut_down_) {
      throw TransportError(detail::msg("in-process network: ", what,
                                       " called after shutdown(); the network is gone, create a new one"));
    }
  }

  Mailbox& mailbox(Endpoint e) {
    if (e.is_syncer()) return syncer_;
    auto& slot = learners_[e.id];
    if (!slot) slot = std::make_unique<Mailbox>();
    return *slot;
  }
  const Mailbox* find(Endpoint e) const {
    if (e.is_syncer()) return &syncer_;
    const auto it = learners_.find(e.id);
    return it == learners_.end() ? nullptr : it->second.get();
  }

  std::optional<Message> pop_deliverable(Mailbox& mb) {
    if (!mb.open || mb.pending.empty() || mb.pending.front().deliver_at > clock_->now()) return std::nullopt;
    std::pop_heap(mb.pending.begin(), mb.pending.end(), later);
    Message m = std::move(mb.pending.back().message);
    mb.pending.pop_back();
    ++mb.counters.delivered;
    mb.counters.bytes_delivered += static_cast<std::uint64_t>(m.payload_bytes());
    return m;
  }

  mutable std::mutex mu_;
  const Clock* clock_;
  bool virtual_;
  FaultTape tape_;
  std::size_t capacity_;
  TimePoint origin_;
  bool shut_down_ = false;
  std::uint64_t next_seq_ = 0;
  Mailbox syncer_;
  std::map<LearnerId, std::unique_ptr<Mailbox>> learners_;
};

/// Learner `id`'s link to the syncer. Models ddiloco::LearnerTransport.
/// A cheap handle: copy it freely; it must not outlive its network.
class InProcessLearnerTransport {
 public:
  InProcessLearnerTransport(InProcessNetwork& network, LearnerId id) : net_(&network), id_(id) {}

  [[nodiscard]] LearnerId id() const noexcept { return id_; }
  [[nodiscard]] Endpoint endpoint() const noexcept { return Endpoint::for_learner(id_); }

  /// LearnerTransport 1: never blocks; false when refused (queue full, closed).
  bool send(Message&& m) { return net_->send(endpoint(), Endpoint::syncer(), std::move(m)); }
  /// LearnerTransport 2.
  std::optional<Message> try_receive() { return net_->try_receive(endpoint()); }
  /// LearnerTransport 3.
  std::optional<Message> receive_until(TimePoint deadline) { return net_->receive_until(endpoint(), deadline); }
  /// LearnerTransport 4: true once the network was shut down.
  [[nodiscard]] bool failed() const { return net_->failed(); }
  /// LearnerTransport 5.
  [[nodiscard]] const Clock& clock() const noexcept { return net_->clock(); }
  [[nodiscard]] InProcessNetwork& network() const noexcept { return *net_; }

 private:
  InProcessNetwork* net_;
  LearnerId id_;
};

/// The syncer's side. Models ddiloco::SyncerTransport. A cheap handle.
class InProcessSyncerTransport {
 public:
  explicit InProcessSyncerTransport(InProcessNetwork& network) : net_(&network) {}

  [[nodiscard]] Endpoint endpoint() const noexcept { return Endpoint::syncer(); }

  /// SyncerTransport 1: never blocks; false when refused (queue full, learner closed).
  bool send_to(LearnerId learner, Message&& m) {
    return net_->send(Endpoint::syncer(), Endpoint::for_learner(learner), std::move(m));
  }
  /// SyncerTransport 2.
  std::optional<Message> try_receive() { return net_->try_receive(endpoint()); }
  /// SyncerTransport 3.
  std::optional<Message> receive_until(TimePoint deadline) { return net_->receive_until(endpoint(), deadline); }
  /// True once the network was shut down.
  [[nodiscard]] bool failed() const { return net_->failed(); }
  /// SyncerTransport 4.
  [[nodiscard]] const Clock& clock() const noexcept { return net_->clock(); }
  [[nodiscard]] InProcessNetwork& network() const noexcept { return *net_; }

 private:
  InProcessNetwork* net_;
};

inline InProcessLearnerTransport InProcessNetwork::learner(LearnerId id) {
  {
    std::lock_guard lock(mu_);
    throw_if_shut_down("learner()");
    (void)mailbox(Endpoint::for_learner(id));
  }
  return InProcessLearnerTransport(*this, id);
}

inline InProcessSyncerTransport InProcessNetwork::syncer() {
  {
    std::lock_guard lock(mu_);
    throw_if_shut_down("syncer()");
  }
  return InProcessSyncerTransport(*this);
}

}  // namespace ddiloco
