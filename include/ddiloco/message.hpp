// ddiloco/message.hpp: what learners and the syncer say to each other.
//
// What it is: the in-memory form of the protocol's eleven messages and the
// transport concepts that carry them. Every transport (in-process queues,
// ZeroMQ) moves `Message` values; the wire encoding lives elsewhere.
// What it is not: a serialisation format, nor a transport.
//
// # The protocol (docs/algorithm.md, "Round timeline" and "Decisions")
//   learner -> syncer  join            "I am learner `learner`; send me the global state"
//   syncer  -> learner full_state      one per fragment: the fragment's values and version.
//                                      `sequence` carries the first sequence number this
//                                      incarnation of the learner must use.
//   learner -> syncer  contribution    outer gradient of one fragment: the learner's progress
//                                      since its previous send or receipt of that fragment
//                                      (so each unit of progress is sent exactly once),
//                                      with counters `steps`/`tokens` over the same span and
//                                      `version` = version of the global it last applied.
//   syncer  -> learner global_fragment the merged fragment after an outer step, with version.
//   learner -> syncer  heartbeat       "still alive" (any message also counts as one)
//   learner -> syncer  leave           "I am going away; stop counting me"
//   syncer  -> learner join_refused    "I will not take you": the join (or observe) does not
//                                      fit this run. `fragment` = JoinRefusal (why),
//                                      `fingerprint`, `version`, `step` = the syncer's plan
//                                      fingerprint, fragment count and parameter count,
//                                      `steps`/`tokens` = the syncer's H and tau (0: not
//                                      checked), `sequence` = the refused request's nonce.
//                                      For JoinRefusal::tokens_per_step, `version` = the
//                                      syncer's bound on tokens per inner step instead.
//   observer -> syncer observe         "send me the current global state; I do not train":
//                                      answered (rate limited) with one full_state per
//                                      fragment (`sequence` = the request's nonce, `step` =
//                                      the number of fragments); never counted as a learner.
//                                      `fingerprint` 0 accepts whatever plan the syncer has.
//   syncer  -> learner rejoin          "I do not know you: join again" (a contribution or
//                                      heartbeat from an id the syncer has no record of, e.g.
//                                      it restored a checkpoint older than the learner's
//                                      join). Rate limited per id; no payload, `sequence` 0.
//                                      The learner joins with a fresh nonce and keeps its
//                                      parameters and its unsent progress.
//   learner -> syncer  metadata        pull rounds, every inner step, never waited for: `step` = the
//                                      learner's inner step counter t_m, `tokens` = tokens processed
//                                      since it joined. No payload (one 88-byte frame). A newer one
//                                      supersedes an older one, so a transport may coalesce them
//                                      (ZmqLearnerConfig::metadata_interval).
//   syncer  -> learner pull            pull rounds: "send me fragment `fragment` now" (`version` =
//                                      the syncer's version of it, the round's anchor). The learner
//                                      answers with a contribution at its next step boundary, from
//                                      its training loop, never blocking it. `repeat`: a second
//                                      ask for the same round (the first pull or its answer
//                                      looked lost); a learner that answered it already answers
//                                      again, with `repeat` set on the contribution.
// A join states the learner's schedule: `steps` = H, `tokens` = tau (0, 0: unstated), in
// `fragment` its RoundMode (0: unstated, a learner predating pull rounds: push), its
// inner step counter in `step`, and in `version` the most tokens one of its inner steps
// processes (its batch in tokens; 0: unstated). The syncer bounds every later contribution
// by them (docs/algorithm.md, "Validation and staleness"): `steps` by the advance of `step`
// since the learner's previous contribution of that fragment (or its join), `tokens` by
// `steps` x the declared tokens per step.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/codec.hpp>

namespace ddiloco {

using LearnerId = std::uint32_t;

enum class MessageType : std::uint8_t {
  join = 1,
  full_state = 2,
  contribution = 3,
  global_fragment = 4,
  heartbeat = 5,
  leave = 6,
  join_refused = 7,
  observe = 8,
  rejoin = 9,
  metadata = 10,
  pull = 11,
};

/// Who decides when a fragment is merged (docs/algorithm.md, "Round timeline").
/// Stable numbering: it travels in a join (Message::fragment).
enum class RoundMode : std::uint8_t {
  /// Each learner pushes its outer gradient at its own slot of the schedule;
  /// the syncer merges what has arrived once the quorum and grace window say
  /// so (our first protocol, kept for comparison).
  push = 1,
  /// The paper's round: learners send metadata every step; the syncer keeps
  /// the global step, opens fragment p's round at its slot, waits for the
  /// quorum of learners that have progress on p and the grace window, pulls p
  /// from every such learner and merges once per H global steps.
  pull = 2,
};

constexpr std::string_view to_string(RoundMode r) noexcept {
  switch (r) {
    case RoundMode::push: return "push";
    case RoundMode::pull: return "pull";
  }
  return "unknown";
}

constexpr std::string_view to_string(MessageType t) noexcept {
  switch (t) {
    case MessageType::join: return "join";
    case MessageType::full_state: return "full_state";
    case MessageType::contribution: return "contribution";
    case MessageType::global_fragment: return "global_fragment";
    case MessageType::heartbeat: return "heartbeat";
    case MessageType::leave: return "leave";
    case MessageType::join_refused: return "join_refused";
    case MessageType::observe: return "observe";
    case MessageType::rejoin: return "rejoin";
    case MessageType::metadata: return "metadata";
    case MessageType::pull: return "pull";
  }
  return "unknown";
}

/// Why the syncer refused a join or an observe request (Message::fragment of a
/// join_refused). Stable numbering: it travels on the wire.
enum class JoinRefusal : std::uint8_t {
  foreign_plan = 1,  ///< another plan: tensors, sizes, order or fragment count differ (fingerprint)
  schedule = 2,      ///< another schedule: H (sync every) or tau (overlap) differ from the syncer's
  identity = 3,      ///< the learner's key is on the allow-list for another id (`version` = that id)
  full = 4,          ///< the syncer knows SyncerConfig::max_learners learners, all of them alive
  /// the join declares more tokens per inner step than the syncer's bound
  /// (SyncerConfig::max_tokens_per_step, `version` = that bound)
  tokens_per_step = 5,
  /// another round mode (push or pull) than the syncer's (`version` = the syncer's RoundMode)
  round_mode = 6,
  /// addressed to another syncer shard, or derived from another shard count
  /// (`version` = the syncer's shard_count << 32 | shard_index, `step` = its
  /// ShardMap fingerprint, `tokens` = the shard the join named, as sent)
  shard_map = 7,
};

constexpr bool is_valid_join_refusal(std::uint32_t raw) noexcept { return raw >= 1 && raw <= 7; }

namespace detail {
/// A plan fingerprint as the programs print it: 16 hex digits.
inline std::string hex16(std::uint64_t v) {
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[static_cast<std::size_t>(i)] = "0123456789abcdef"[v & 15];
  return out;
}
}  // namespace detail

constexpr std::string_view to_string(JoinRefusal r) noexcept {
  switch (r) {
    case JoinRefusal::foreign_plan: return "foreign_plan";
    case JoinRefusal::schedule: return "schedule";
    case JoinRefusal::identity: return "identity";
    case JoinRefusal::full: return "full";
    case JoinRefusal::tokens_per_step: return "tokens_per_step";
    case JoinRefusal::round_mode: return "round_mode";
    case JoinRefusal::shard_map: return "shard_map";
  }
  return "unknown";
}

/// Fragment values or an outer gradient, shared so a broadcast never copies.
using Payload = std::shared_ptr<const std::vector<float>>;

/// A contribution's payload still in its wire encoding (<ddiloco/codec.hpp>), as a
/// transport received it: `bytes` (encoded_size(codec, elements) of them) stay
/// valid while `owner` lives. A transport hands these out only when asked to
/// (ZmqSyncerTransportConfig::keep_contributions_encoded) so the syncer can
/// validate and fold the bytes straight into its accumulator, without an fp32
/// copy of the payload. The transport has checked the frame's header and
/// sizes; the syncer checks the contents (valid codes, finite values) and,
/// when `unchecked_crc` is set, the payload checksum, in the one scan that
/// takes the norms (fast::checked_norms_and_checksum).
struct EncodedPayload {
  Codec codec = Codec::fp32;
  std::size_t elements = 0;
  std::span<const std::byte> bytes;
  std::shared_ptr<const void> owner;  ///< keeps `bytes` alive (a received network buffer)
  /// The frame's CRC-32C of `bytes`, not yet compared (decode_frame_keep_encoded
  /// with PayloadChecks::deferred); whoever reads the bytes must check it first.
  std::optional<std::uint32_t> unchecked_crc = std::nullopt;
};

/// A buffer a transport lends for the next contribution's encoded payload
/// (ContributionBufferTransport): the sender writes `bytes` and sends an
/// EncodedPayload over them with `owner`, and the transport frames them in place.
struct OutgoingPayload {
  std::span<std::byte> bytes;
  std::shared_ptr<const void> owner;
};

struct Message {
  MessageType type = MessageType::heartbeat;
  std::uint64_t fingerprint = 0;  ///< Plan::fingerprint() of the sender's plan
  LearnerId learner = 0;          ///< the learner this message is from or for
  std::uint32_t fragment = 0;     ///< fragment index (full_state, contribution, global_fragment)
  std::uint64_t version = 0;      ///< fragment version (base version for a contribution)
  std::uint64_t sequence = 0;     ///< contribution: per-learner, strictly increasing
  std::int64_t steps = 0;         ///< contribution: inner steps in this outer gradient
  std::int64_t tokens = 0;        ///< contribution: tokens in this outer gradient
  std::uint64_t step = 0;         ///< sender's inner step counter when sent (observability)
  /// Pull rounds. A pull: a second ask for the same round's answer (the
  /// learner's step counter moved on and no answer came: the first pull or its
  /// answer may be lost). A contribution: the answer to such a second ask,
  /// from the same base as the first answer (the syncer merges only one of
  /// the two). On the wire: bit 31 of the fragment field.
  bool repeat = false;
  Payload payload;                ///< may be null for control messages
  /// Set instead of `payload` for a contribution kept in its wire encoding.
  std::optional<EncodedPayload> encoded;

  /// Elements of the payload, decoded or encoded.
  [[nodiscard]] std::size_t payload_size() const noexcept {
    return payload ? payload->size() : encoded ? encoded->elements : 0;
  }
  /// Bytes the payload occupies in memory (fp32 when decoded, else its encoding).
  [[nodiscard]] std::size_t payload_bytes() const noexcept {
    return payload ? payload->size() * sizeof(float) : encoded ? encoded->bytes.size() : 0;
  }
};

inline Payload make_payload(std::vector<float> values) {
  return std::make_shared<const std::vector<float>>(std::move(values));
}

/// Recycles the vectors of received payloads. A receiver decodes each global
/// into a fresh vector otherwise, and a large vector is fresh memory from the
/// kernel every time (glibc maps blocks over 32 MiB on their own and unmaps
/// them when freed): page faults and zeroing cost more than the decode itself
/// (a 2^24-element fp32 global: about 44 ms fresh, 8 ms into a used vector).
/// A Payload made here goes back to the pool when its last holder lets go,
/// and the next make() of at most its capacity reuses it. At most `max_idle`
/// vectors wait (the largest are kept); a payload released after the pool is
/// gone is freed. Thread-safe: a payload may be released on any thread.
class PayloadPool {
 public:
  explicit PayloadPool(std::size_t max_idle = 2) : state_(std::make_shared<State>()) { state_->max_idle = max_idle; }

  /// A payload of `n` values written by `fill(std::span<float>) -> bool`
  /// (which sees whatever the recycled vector held); null if fill fails, and
  /// the vector waits for the next make().
  template <class Fill>
  Payload make(std::size_t n, Fill&& fill) {
    std::vector<float> v = take(n);
    if (!fill(std::span<float>(v))) {
      state_->give_back(std::move(v));
      return nullptr;
    }
    const std::weak_ptr<State> pool = state_;
    return Payload(new std::vector<float>(std::move(v)), [pool](const std::vector<float>* done) {
      std::unique_ptr<std::vector<float>> owned(const_cast<std::vector<float>*>(done));  // made non-const above
      if (const auto s = pool.lock()) s->give_back(std::move(*owned));
    });
  }

  [[nodiscard]] std::uint64_t reused() const noexcept {
    std::lock_guard lock(state_->mu);
    return state_->reused;
  }
  [[nodiscard]] std::uint64_t allocated() const noexcept {
    std::lock_guard lock(state_->mu);
    return state_->allocated;
  }
  [[nodiscard]] std::size_t idle() const noexcept {
    std::lock_guard lock(state_->mu);
    return state_->idle.size();
  }

 private:
  struct State {
    mutable std::mutex mu;
    std::vector<std::vector<float>> idle;
    std::size_t max_idle = 2;
    std::uint64_t reused = 0, allocated = 0;

    void give_back(std::vector<float> v) {
      std::lock_guard lock(mu);
      if (max_idle == 0) return;
      if (idle.size() == max_idle) {  // keep the largest: they fit the most requests
        auto smallest = std::min_element(idle.begin(), idle.end(),
                                         [](const auto& a, const auto& b) { return a.capacity() < b.capacity(); });
        if (smallest->capacity() >= v.capacity()) return;
        *smallest = std::move(v);
        return;
      }
      idle.push_back(std::move(v));
    }
  };

  std::vector<float> take(std::size_t n) {
    {
      std::lock_guard lock(state_->mu);
      auto& idle = state_->idle;
      auto best = idle.end();  // the smallest that holds n: the larger ones stay for larger requests
      for (auto it = idle.begin(); it != idle.end(); ++it)
        if (it->capacity() >= n && (best == idle.end() || it->capacity() < best->capacity())) best = it;
      if (best != idle.end()) {
        std::vector<float> v = std::move(*best);
        idle.erase(best);
        ++state_->reused;
        v.resize(n);  // within its capacity: no allocation
        return v;
      }
      ++state_->allocated;
    }
    return std::vector<float>(n);
  }

  std::shared_ptr<State> state_;
};

// ---- Transport concepts -------------------------------------------------
//
// LearnerTransport<T>: a learner's link to the syncer.
//   1. `t.send(Message&&) -> bool` never blocks. It returns false when the
//      message could not be queued (back-pressure, link down); the message is
//      then dropped and the caller goes on training.
//   2. `t.try_receive() -> std::optional<Message>` never blocks.
//   3. `t.receive_until(TimePoint deadline) -> std::optional<Message>` waits
//      at most until `deadline` (on the transport's clock) and returns nullopt
//      on time-out. A transport on a virtual clock returns at once.
//   4. `t.failed() -> bool`: true once the transport failed permanently; every
//      later call may throw TransportError.
//   5. `t.clock() -> const Clock&`: the clock deadlines are measured on.
//   Optional (ContributionEncodingTransport): `t.contribution_codec() ->
//   std::optional<Codec>`. A codec there means contributions go out in it, and
//   OuterLoop then hands them over already encoded (Message::encoded, codec set,
//   payload null) in one pass over the fragment; nullopt keeps fp32 payloads.
//   Optional as well (ContributionBufferTransport): `t.contribution_buffer(bytes)
//   -> OutgoingPayload`, a buffer the transport lends for that encoded payload
//   (ZmqLearnerTransport: the payload part of a frame, so nothing is copied).
//
// SyncerTransport<T>: the syncer's side.
//   1. `t.send_to(LearnerId, Message&&) -> bool` never blocks (false: dropped).
//   2. `t.try_receive()`, 3. `t.receive_until(deadline)` as above.
//   4. `t.clock() -> const Clock&`.
template <class T>
concept LearnerTransport = requires(T& t, Message m, TimePoint deadline) {
  { t.send(std::move(m)) } -> std::same_as<bool>;
  { t.try_receive() } -> std::same_as<std::optional<Message>>;
  { t.receive_until(deadline) } -> std::same_as<std::optional<Message>>;
  { std::as_const(t).failed() } -> std::same_as<bool>;
  { std::as_const(t).clock() } -> std::convertible_to<const Clock&>;
};

template <class T>
concept ContributionEncodingTransport = LearnerTransport<T> && requires(const T& t) {
  { t.contribution_codec() } -> std::same_as<std::optional<Codec>>;
};

template <class T>
concept ContributionBufferTransport = ContributionEncodingTransport<T> && requires(T& t, std::size_t bytes) {
  { t.contribution_buffer(bytes) } -> std::same_as<OutgoingPayload>;
};

// FragmentBufferTransport<T> (optional, a transport over several links, such
// as ShardedLearnerTransport): `t.contribution_buffer(bytes, fragment) ->
// OutgoingPayload`, the same loan from the link that fragment's contribution
// goes out on. OuterLoop prefers it to contribution_buffer(bytes).
template <class T>
concept FragmentBufferTransport = ContributionEncodingTransport<T> && requires(T& t, std::size_t n) {
  { t.contribution_buffer(n, n) } -> std::same_as<OutgoingPayload>;
};

// DiagnosingTransport<T> (optional, a LearnerTransport that can say why its
// link does not work; ZmqLearnerTransport):
//   1. `t.link_failure() -> std::optional<std::string>`: a reason the link
//      cannot work as configured (refused authentication, mismatched security),
//      known before any reply: OuterLoop::join throws it at once.
//   2. `t.link_summary() -> std::string`: what the link saw so far (nothing
//      listening, connected but silent), added to a join time-out's message.
template <class T>
concept DiagnosingTransport = LearnerTransport<T> && requires(T& t) {
  { t.link_failure() } -> std::same_as<std::optional<std::string>>;
  { t.link_summary() } -> std::same_as<std::string>;
};

template <class T>
concept SyncerTransport = requires(T& t, Message m, LearnerId id, TimePoint deadline) {
  { t.send_to(id, std::move(m)) } -> std::same_as<bool>;
  { t.try_receive() } -> std::same_as<std::optional<Message>>;
  { t.receive_until(deadline) } -> std::same_as<std::optional<Message>>;
  { std::as_const(t).clock() } -> std::convertible_to<const Clock&>;
};

}  // namespace ddiloco
