// ddiloco/transport/zmq.hpp: the learner/syncer protocol over ZeroMQ.
//
// What it is: `ZmqSyncerTransport` (a ROUTER socket the syncer binds) and
// `ZmqLearnerTransport` (a DEALER socket a learner connects), modelling the
// `SyncerTransport` / `LearnerTransport` concepts of message.hpp. Frames are
// the wire format of wire.hpp (validated before anything touches state; every
// decode failure is counted by kind). ZeroMQ reconnects by itself; peers come
// and go; high-water marks give back-pressure (a send that would block returns
// false); TCP keepalive detects dead connections (not ZMTP heartbeats: see
// detail::set_keepalive). Frames are handed to ZeroMQ
// without a copy (zmq_msg_init_data; ZeroMQ frees them once written). The
// syncer sends a frame with a payload as two message parts, the receiver's
// header and then the payload, which every receiver of one merge shares (it
// is encoded once); learners read one part or two (detail::ReceivedFrame).
//
// Security: CURVE encryption and authentication by default. The syncer runs a
// ZAP handler with an allow-list that binds each learner id to one public key:
// a learner whose key is not listed cannot connect, and a listed key can only
// speak for its own learner id. Routing ids are assigned by the ROUTER, never
// chosen by a peer, so no connection can take over another learner's replies. Plain text must be chosen explicitly
// (`ZmqSecurity::plaintext()`). Keys are Z85 text; `ddiloco_keygen` writes them.
//
// Saying what went wrong: the learner side watches its socket with ZeroMQ's
// monitor and tells a refused key, mismatched security (plaintext vs CURVE), a
// wrong syncer key and "nothing listening" apart (link_failure, link_summary;
// OuterLoop::join throws the first at once). The syncer side records whom it
// refused (take_refusals, rate limited) and answers a listed key that claims
// another id with JoinRefusal::identity. docs/troubleshooting.md lists every
// message and its fix.
// Full states stream: the full_state replies of a join (or an observe) are not
// queued all at once but handed to ZeroMQ fragment by fragment as the
// learner's connection drains, within its send budget; a retried request does
// not queue again what already went out on that connection (ZmqSyncerConfig,
// "join streams"; docs/operations.md, "Joins: sizes, links, time-outs").
// The global-model view: ZmqObserver / fetch_global read the syncer's current
// global state without being a learner (MessageType::observe).
//
// Threading: the syncer side owns its sockets on one thread of its own (under it,
// ZeroMQ's io_threads I/O threads move the bytes, each learner connection on
// one of them); send_to() may be called from any thread (the runtime's merge
// workers), receive from one.
// The learner side is used from the learner's thread only (as OuterLoop does).
// What it is not: a codec or a wire format (codec.hpp, wire.hpp).
#pragma once

#include <zmq.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <algorithm>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/codec.hpp>
#include <ddiloco/detail/frame_pool.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/message.hpp>
#include <ddiloco/shard_map.hpp>
#include <ddiloco/transport/bounds.hpp>
#include <ddiloco/wire.hpp>

namespace ddiloco {

// ---- keys ---------------------------------------------------------------

/// A CURVE key pair in Z85 text (40 characters each). `secret` may be empty
/// for a public-only key (what a syncer's allow-list or a learner needs of
/// the other side).
struct CurveKeys {
  std::string public_key;
  std::string secret_key;
};

inline CurveKeys generate_curve_keys() {
  char pub[41] = {}, sec[41] = {};
  if (zmq_curve_keypair(pub, sec) != 0)
    throw TransportError(detail::msg("zmq_curve_keypair failed: ", zmq_strerror(zmq_errno()),
                                     " (libzmq built without CURVE support?)"));
  return {pub, sec};
}

namespace detail {
inline void check_z85_key(const std::string& key, const std::string& what) {
  if (key.size() != 40)
    throw InvalidArgument(msg(what, " must be a 40-character Z85 CURVE key, got ", key.size(),
                              " characters; generate keys with ddiloco_keygen"));
  std::uint8_t bin[32];
  if (zmq_z85_decode(bin, key.c_str()) == nullptr)
    throw InvalidArgument(msg(what, " is not valid Z85 text"));
}
}  // namespace detail

/// Key file format: lines `public <z85>` and optionally `secret <z85>`;
/// `#` comments. Written with permissions 0600 when it holds a secret.
inline void write_key_file(const std::filesystem::path& path, const CurveKeys& keys) {
  {
    std::ofstream out(path, std::ios::trunc);
    if (!out) throw InvalidArgument(detail::msg("cannot write key file '", path.string(), "'"));
    out << "# ddiloco CURVE key (Z85)\npublic " << keys.public_key << "\n";
    if (!keys.secret_key.empty()) out << "secret " << keys.secret_key << "\n";
  }
  if (!keys.secret_key.empty())
    std::filesystem::permissions(path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write,
                                 std::filesystem::perm_options::replace);
}

inline CurveKeys read_key_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw InvalidArgument(detail::msg("cannot read key file '", path.string(), "'"));
  CurveKeys keys;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream is(line);
    std::string kind, value;
    is >> kind >> value;
    if (kind == "public") keys.public_key = value;
    else if (kind == "secret") keys.secret_key = value;
    else throw ProtocolError(detail::msg(path.string(), ": unknown line '", line, "' (expected public/secret)"));
  }
  detail::check_z85_key(keys.public_key, path.string() + ": public key");
  if (!keys.secret_key.empty()) detail::check_z85_key(keys.secret_key, path.string() + ": secret key");
  return keys;
}

/// Allow-list file: one `<learner-id> <public-key-z85>` per line, `#` comments.
inline std::map<LearnerId, std::string> read_allow_list(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw InvalidArgument(detail::msg("cannot read allow-list '", path.string(), "'"));
  std::map<LearnerId, std::string> allowed;
  std::string line;
  std::size_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream is(line);
    long long id = -1;
    std::string key;
    if (!(is >> id >> key) || id < 0 || id > 0xffffffffLL)
      throw ProtocolError(detail::msg(path.string(), ":", n, ": expected '<learner-id> <public-key>'"));
    detail::check_z85_key(key, detail::msg(path.string(), ":", n));
    allowed[static_cast<LearnerId>(id)] = key;
  }
  return allowed;
}

/// How a link is secured. Default-constructed: CURVE with no keys, which is
/// rejected when a socket is made: security is never off by accident.
struct ZmqSecurity {
  bool curve = true;
  CurveKeys own;                                    ///< syncer: server pair; learner: client pair
  std::string server_public_key;                    ///< learner: the syncer's public key
  std::map<LearnerId, std::string> allowed;         ///< syncer: learner id -> public key

  static ZmqSecurity plaintext() {
    ZmqSecurity s;
    s.curve = false;
    return s;
  }
};

/// A connection the syncer refused, for the operator's log
/// (ZmqSyncerTransport::take_refusals). Rate limited: at most
/// ZmqSyncerConfig::refusal_log_burst records per refusal_log_interval; the
/// refusals in between are counted in the next record's `suppressed`.
struct ZmqRefusal {
  enum class Kind : std::uint8_t {
    unlisted_key,    ///< ZAP: the CURVE public key is not on the allow-list
    wrong_id,        ///< a listed key spoke for another learner id (answered with JoinRefusal::identity)
    undecryptable,   ///< a CURVE hello this syncer cannot decrypt: the peer has another syncer public key
    wrong_mechanism, ///< a peer without CURVE (plaintext) against this CURVE syncer
  };
  Kind kind = Kind::unlisted_key;
  std::string public_key;  ///< Z85 (unlisted_key)
  std::string address;     ///< the peer's IP address as ZAP reports it (unlisted_key; unknown for the others)
  LearnerId claimed = 0;   ///< wrong_id: the id the message claimed ...
  LearnerId listed = 0;    ///< ... and the id the key is listed for
  std::uint64_t suppressed = 0;

  [[nodiscard]] std::string line() const {
    const std::string more =
        suppressed != 0 ? detail::msg("; ", suppressed, " earlier refusals not logged (rate limit)") : std::string();
    if (kind == Kind::wrong_id)
      return detail::msg("refused learner ", claimed, ": its key is on the allow-list for learner ", listed, more);
    // ZeroMQ names no peer address for a failed handshake on a bound socket.
    if (kind == Kind::undecryptable)
      return detail::msg("refused a connection: its CURVE hello could not be decrypted (a learner whose "
                         "--server-key is not this syncer's public key?)", more);
    if (kind == Kind::wrong_mechanism)
      return detail::msg("refused a connection without CURVE (a --plaintext learner against this CURVE syncer?)",
                         more);
    return detail::msg("refused connection from ", address.empty() ? "?" : address, ": public key ", public_key,
                       " is not on the allow-list", more);
  }
};

struct ZmqCounters {
  std::uint64_t frames_in = 0, frames_out = 0, bytes_in = 0, bytes_out = 0;
  std::uint64_t send_dropped = 0;         ///< high-water mark reached or peer unknown
  std::uint64_t decode_errors = 0;        ///< frames that failed validation
  std::uint64_t impersonations = 0;       ///< authenticated key spoke for another learner id
  std::uint64_t auth_denied = 0;          ///< ZAP refusals (unknown keys)
  std::uint64_t handshake_failures = 0;   ///< syncer: handshakes failed before ZAP (another server key, plaintext peer)
  WireCounters wire{};                    ///< decode failures by kind
  // Memory bounds (docs/operations.md, "Memory bounds").
  std::uint64_t send_over_budget = 0;  ///< syncer: frames not queued, the peer's or the total send budget full (also in send_dropped)
  std::uint64_t wrong_direction = 0;   ///< frames of a type this side never receives, refused before decoding (also in decode_errors)
  std::uint64_t disconnects = 0;       ///< syncer: connections closed, by the peer or by ZeroMQ (a frame over max_message_size, a heartbeat time-out)
  std::uint64_t receive_pauses = 0;    ///< syncer: times the I/O thread stopped reading because incoming messages reached their bound
  std::uint64_t peers_evicted = 0;     ///< syncer: reply routes forgotten to stay within max_peers (least recently heard first)
  std::uint64_t slow_peer_frames = 0;  ///< syncer: frames dropped on arrival from a connection that has not read for slow_peer_timeout
  std::uint64_t joins_dropped = 0;     ///< syncer: joins and observes dropped on arrival, their connection's join burst spent
  std::uint64_t send_queued_bytes = 0;   ///< syncer, now: bytes of frames queued for peers (charged against the send budgets)
  std::uint64_t incoming_queued_bytes = 0;  ///< syncer, now: bytes of received messages not yet taken
  std::uint64_t incoming_queued = 0;        ///< syncer, now: received messages not yet taken
  std::uint64_t peers = 0;                  ///< syncer, now: reply routes kept (peers heard from)
  // Join streams (full_state replies, docs/operations.md "Joins: sizes, links, time-outs").
  std::uint64_t state_frames_streamed = 0;  ///< syncer: full_state frames handed to ZeroMQ by a stream
  std::uint64_t state_duplicates = 0;  ///< syncer: full_state replies not queued: that fragment of that reply already went out on that connection
  std::uint64_t streams_abandoned = 0;  ///< syncer: streams whose waiting fragments were dropped (the connection took nothing for slow_peer_timeout)
  std::uint64_t stream_refusals = 0;    ///< syncer: full_state replies refused because max_join_streams were busy (also in send_dropped)
  std::uint64_t state_waiting = 0;      ///< syncer, now: full_state replies waiting in streams for room
  std::uint64_t streams = 0;            ///< syncer, now: streams kept (learner ids with a full state in flight or recently sent)
  std::uint64_t metadata_coalesced = 0;  ///< learner: metadata messages never sent, a newer one replaced them (metadata_interval)
  /// syncer: payloads encoded and checksummed for sending. Every receiver of
  /// one merged fragment shares one (its frames carry the same payload part),
  /// so after a merge sent to M learners this grows by 1 and frames_out by M.
  std::uint64_t payloads_encoded = 0;
  /// learner: received payloads decoded into a vector an earlier one had
  /// used (PayloadPool, ZmqLearnerConfig::idle_payload_buffers), not fresh memory.
  std::uint64_t payload_buffers_reused = 0;
};

/// Adds `b` to `a`, field by field (the "now" figures too: a sum over links).
inline ZmqCounters& operator+=(ZmqCounters& a, const ZmqCounters& b) noexcept {
  for (auto [x, y] : {std::pair{&a.frames_in, b.frames_in}, {&a.frames_out, b.frames_out},
                      {&a.bytes_in, b.bytes_in}, {&a.bytes_out, b.bytes_out}, {&a.send_dropped, b.send_dropped},
                      {&a.decode_errors, b.decode_errors}, {&a.impersonations, b.impersonations},
                      {&a.auth_denied, b.auth_denied}, {&a.handshake_failures, b.handshake_failures},
                      {&a.send_over_budget, b.send_over_budget}, {&a.wrong_direction, b.wrong_direction},
                      {&a.disconnects, b.disconnects}, {&a.receive_pauses, b.receive_pauses},
                      {&a.peers_evicted, b.peers_evicted}, {&a.slow_peer_frames, b.slow_peer_frames},
                      {&a.joins_dropped, b.joins_dropped},
                      {&a.send_queued_bytes, b.send_queued_bytes}, {&a.incoming_queued_bytes, b.incoming_queued_bytes},
                      {&a.incoming_queued, b.incoming_queued}, {&a.peers, b.peers},
                      {&a.state_frames_streamed, b.state_frames_streamed}, {&a.state_duplicates, b.state_duplicates},
                      {&a.streams_abandoned, b.streams_abandoned}, {&a.stream_refusals, b.stream_refusals},
                      {&a.state_waiting, b.state_waiting}, {&a.streams, b.streams},
                      {&a.metadata_coalesced, b.metadata_coalesced}, {&a.payloads_encoded, b.payloads_encoded},
                      {&a.payload_buffers_reused, b.payload_buffers_reused}})
    *x += y;
  a.wire.accepted += b.wire.accepted;
  for (std::size_t i = 0; i < a.wire.rejected_by.size(); ++i) a.wire.rejected_by[i] += b.wire.rejected_by[i];
  return a;
}

namespace detail {

inline void zmq_check(int rc, const char* what) {
  if (rc != 0) throw TransportError(msg(what, ": ", zmq_strerror(zmq_errno())));
}

inline void set_int(void* s, int option, int value, const char* what) {
  zmq_check(zmq_setsockopt(s, option, &value, sizeof value), what);
}

/// A dead peer's connection is found by TCP, not by ZMTP heartbeats: keepalive
/// probes after `interval` idle, every `interval` (whole seconds, at least 1),
/// and the connection dropped once sent data or probes went unacknowledged for
/// `timeout` (TCP_USER_TIMEOUT, as ZMQ_TCP_MAXRT). Why not ZMTP heartbeats:
/// libzmq 4.3.4 (Debian 12's) aborts the process when a heartbeat or a PONG is
/// written on a connection whose input was stopped by its receive high-water
/// mark and whose peer then went away (stream_engine_base.cpp, "!_io_error").
/// That is exactly a back-pressured syncer and a learner that leaves or is
/// killed; docs/operations.md, "Dead connections".
inline void set_keepalive(void* s, Duration interval, Duration timeout) {
  using std::chrono::ceil;
  using std::chrono::milliseconds;
  using std::chrono::seconds;
  const auto secs = [](Duration d) { return static_cast<int>(std::max<std::int64_t>(1, ceil<seconds>(d).count())); };
  set_int(s, ZMQ_HEARTBEAT_IVL, 0, "ZMQ_HEARTBEAT_IVL");  // no ZMTP PINGs from this side
  set_int(s, ZMQ_TCP_KEEPALIVE, 1, "ZMQ_TCP_KEEPALIVE");
  set_int(s, ZMQ_TCP_KEEPALIVE_IDLE, secs(interval), "ZMQ_TCP_KEEPALIVE_IDLE");
  set_int(s, ZMQ_TCP_KEEPALIVE_INTVL, secs(interval), "ZMQ_TCP_KEEPALIVE_INTVL");
  set_int(s, ZMQ_TCP_KEEPALIVE_CNT, std::max(1, secs(timeout) / secs(interval)), "ZMQ_TCP_KEEPALIVE_CNT");
  set_int(s, ZMQ_TCP_MAXRT,
          static_cast<int>(std::clamp<std::int64_t>(ceil<milliseconds>(timeout).count(), 1, 1 << 30)), "ZMQ_TCP_MAXRT");
}

/// ZeroMQ's hold on a frame until it is sent. The mutex is a handoff the race
/// detector can see: ZeroMQ passes messages between its threads with its own
/// lock-free queues (not instrumented), so without it ThreadSanitizer could not
/// tell that the sender's last touch of the block comes before ZeroMQ's thread
/// lets it go, and reported the block's later free as a race.
/// Bytes of one queued frame charged against its peer's and the total send
/// budget (ZmqSyncerConfig::peer_send_budget, send_budget) from send_to() until
/// ZeroMQ has written the frame out or dropped it (then this is destroyed).
class SendCharge {
 public:
  using Counter = std::shared_ptr<std::atomic<std::size_t>>;
  SendCharge() = default;
  /// `extra`, if given, is charged too (the join streams' share of the total).
  SendCharge(Counter peer, Counter total, std::size_t bytes, Counter extra = {})
      : peer_(std::move(peer)), total_(std::move(total)), extra_(std::move(extra)), bytes_(bytes) {
    if (peer_) peer_->fetch_add(bytes_);
    if (total_) total_->fetch_add(bytes_);
    if (extra_) extra_->fetch_add(bytes_);
  }
  SendCharge(SendCharge&& o) noexcept
      : peer_(std::move(o.peer_)),
        total_(std::move(o.total_)),
        extra_(std::move(o.extra_)),
        bytes_(std::exchange(o.bytes_, 0)) {}
  SendCharge& operator=(SendCharge&& o) noexcept {
    if (this != &o) {
      release();
      peer_ = std::move(o.peer_);
      total_ = std::move(o.total_);
      extra_ = std::move(o.extra_);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  SendCharge(const SendCharge&) = delete;
  SendCharge& operator=(const SendCharge&) = delete;
  ~SendCharge() { release(); }

 private:
  void release() noexcept {
    if (bytes_ == 0) return;
    if (peer_) peer_->fetch_sub(bytes_);
    if (total_) total_->fetch_sub(bytes_);
    if (extra_) extra_->fetch_sub(bytes_);
    bytes_ = 0;
  }
  Counter peer_, total_, extra_;
  std::size_t bytes_ = 0;
};

struct ZmqHold {
  std::mutex handoff;
  std::shared_ptr<FrameBlock> block;
  SendCharge charge;  ///< given back with the block
};

/// Sends a pooled block as one message part without copying it: ZeroMQ holds a
/// reference to the block until the bytes are written out (or dropped), then the
/// block returns to its pool (on ZeroMQ's I/O thread) once no other message
/// shares it (a merged fragment's payload part is one block for every receiver). A copying zmq_send of a
/// 16 MiB fragment costs a fresh 16 MiB buffer (page faults) plus the copy;
/// bench/bench_transport.cpp measures both. Returns what zmq_msg_send returns
/// (< 0 on failure, the block then given back here).
inline int send_frame_zero_copy(void* socket, std::shared_ptr<FrameBlock> block, int flags,
                                SendCharge charge = {}) {
  auto* hold = new ZmqHold;
  void* data = nullptr;
  std::size_t size = 0;
  {
    std::lock_guard lock(hold->handoff);  // released before ZeroMQ can call `release`
    hold->block = std::move(block);
    hold->charge = std::move(charge);
    data = hold->block->data.get();
    size = hold->block->size;
  }
  zmq_msg_t msg;
  const auto release = [](void*, void* hint) {
    auto* h = static_cast<ZmqHold*>(hint);
    { std::lock_guard lock(h->handoff); }  // everything the sender did happens before this
    delete h;
  };
  if (zmq_msg_init_data(&msg, data, size, release, hold) != 0) {
    delete hold;
    return -1;
  }
  const int rc = zmq_msg_send(&msg, socket, flags);
  if (rc < 0) zmq_msg_close(&msg);  // still ours on failure: gives the block back
  return rc;
}

/// One received ZeroMQ message part, closed when the last owner lets go.
struct ReceivedMessage {
  zmq_msg_t msg;
  ReceivedMessage() noexcept { zmq_msg_init(&msg); }
  ReceivedMessage(const ReceivedMessage&) = delete;
  ReceivedMessage& operator=(const ReceivedMessage&) = delete;
  ~ReceivedMessage() { zmq_msg_close(&msg); }
  /// The message's bytes (valid while it lives and is not received into again).
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept {
    auto& m = const_cast<zmq_msg_t&>(msg);  // zmq_msg_data takes no const
    return {static_cast<const std::byte*>(zmq_msg_data(&m)), zmq_msg_size(&m)};
  }
};

/// One frame from the syncer as a receiver reads it (after the routing id, if
/// any): one message part holding the whole frame, or two, the 88-byte header
/// and then the payload (ZmqSyncerTransport sends anything with a payload
/// so, one payload part shared by every receiver). More parts than two are
/// malformed: read to the end and reported as such.
struct ReceivedFrame {
  ReceivedMessage head, payload;
  bool two_parts = false;
  bool malformed = false;  ///< more than two parts

  /// Reads the next frame (flags: 0 or ZMQ_DONTWAIT for its first part; the
  /// rest of a message is there once its first part is). False if none.
  bool receive(void* socket, int flags) {
    if (zmq_msg_recv(&head.msg, socket, flags) < 0) return false;
    if (!zmq_msg_more(&head.msg)) return true;
    two_parts = true;
    zmq_msg_recv(&payload.msg, socket, 0);
    while (zmq_msg_more(&payload.msg)) {
      malformed = true;
      zmq_msg_recv(&payload.msg, socket, 0);
    }
    return true;
  }
  [[nodiscard]] std::span<const std::byte> head_bytes() const noexcept { return head.bytes(); }
  [[nodiscard]] std::span<const std::byte> payload_bytes() const noexcept {
    return two_parts ? payload.bytes() : std::span<const std::byte>{};
  }
  [[nodiscard]] std::size_t size() const noexcept { return head_bytes().size() + payload_bytes().size(); }
  /// decode_frame or decode_frame_parts; a frame of more than two parts is
  /// length_mismatch (trailing bytes).
  /// With `pool`, the payload is decoded into one of its vectors.
  [[nodiscard]] DecodeResult decode(const DecodeLimits& limits, PayloadPool* pool = nullptr) const {
    if (malformed) return WireError::length_mismatch;
    return two_parts ? decode_frame_parts(head_bytes(), payload_bytes(), limits, pool)
                     : decode_frame(head_bytes(), limits, pool);
  }
};

/// The ZAP handler (RFC 27): accepts a CURVE client whose public key is in
/// the allow-list and tags its connection with the learner id as User-Id.
/// Refusals waiting for the operator's log, rate limited (see ZmqRefusal).
class RefusalLog {
 public:
  RefusalLog(std::chrono::steady_clock::duration interval, std::size_t burst) : interval_(interval), burst_(burst) {}

  void add(ZmqRefusal r) {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    if (!window_start_ || now - *window_start_ >= interval_) {
      window_start_ = now;
      window_count_ = 0;
    }
    if (window_count_ >= burst_ || queue_.size() >= 4 * burst_) {
      ++suppressed_;
      return;
    }
    ++window_count_;
    r.suppressed = std::exchange(suppressed_, 0);
    queue_.push_back(std::move(r));
  }

  std::vector<ZmqRefusal> take() {
    std::lock_guard lock(mutex_);
    std::vector<ZmqRefusal> out(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.end()));
    queue_.clear();
    return out;
  }

 private:
  std::mutex mutex_;
  std::chrono::steady_clock::duration interval_;
  std::size_t burst_;
  std::optional<std::chrono::steady_clock::time_point> window_start_;
  std::size_t window_count_ = 0;
  std::uint64_t suppressed_ = 0;
  std::deque<ZmqRefusal> queue_;
};

class ZapHandler {
 public:
  ZapHandler(void* context, std::map<LearnerId, std::string> allowed, std::atomic<std::uint64_t>& denied,
             RefusalLog& log)
      : allowed_(std::move(allowed)), denied_(&denied), log_(&log) {
    socket_ = zmq_socket(context, ZMQ_REP);
    if (socket_ == nullptr) throw TransportError("ZAP: cannot create socket");
    zmq_check(zmq_bind(socket_, "inproc://zeromq.zap.01"), "ZAP bind inproc://zeromq.zap.01");
    thread_ = std::thread([this] { loop(); });
  }
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;
  ~ZapHandler() {
    stop_.store(true);
    thread_.join();
    zmq_close(socket_);
  }

 private:
  void loop() {
    while (!stop_.load()) {
      zmq_pollitem_t item{socket_, 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, 50) <= 0) continue;
      std::vector<std::string> frames;
      for (;;) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, socket_, 0) < 0) {
          zmq_msg_close(&part);
          break;
        }
        frames.emplace_back(static_cast<const char*>(zmq_msg_data(&part)), zmq_msg_size(&part));
        const bool more = zmq_msg_more(&part) != 0;
        zmq_msg_close(&part);
        if (!more) break;
      }
      // version, request id, domain, address, identity, mechanism, credentials...
      std::string status = "400", text = "denied", user;
      char z85[41] = {};
      if (frames.size() >= 7 && frames[0] == "1.0" && frames[5] == "CURVE" && frames[6].size() == 32) {
        zmq_z85_encode(z85, reinterpret_cast<const std::uint8_t*>(frames[6].data()), 32);
        for (const auto& [id, key] : allowed_)
          if (key == z85) {
            status = "200";
            text = "OK";
            user = std::to_string(id);
          }
      }
      if (status != "200") {
        denied_->fetch_add(1);
        ZmqRefusal r;
        r.public_key = z85[0] != 0 ? std::string(z85) : std::string("(none)");
        if (frames.size() > 3) r.address = frames[3];
        log_->add(std::move(r));
      }
      const std::string request_id = frames.size() > 1 ? frames[1] : std::string();
      const std::string reply[] = {"1.0", request_id, status, text, user, ""};
      for (std::size_t i = 0; i < 6; ++i)
        zmq_send(socket_, reply[i].data(), reply[i].size(), i + 1 < 6 ? ZMQ_SNDMORE : 0);
    }
  }

  void* socket_ = nullptr;
  std::map<LearnerId, std::string> allowed_;
  std::atomic<std::uint64_t>* denied_;
  RefusalLog* log_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// One event from a ZeroMQ socket monitor, if one is pending: the event code
/// and its value from the first part; the second part (the endpoint) is read
/// and dropped. A first part too short to hold them reads as event 0.
struct MonitorEvent {
  std::uint16_t event = 0;
  std::uint32_t value = 0;
};
inline std::optional<MonitorEvent> next_monitor_event(void* monitor) {
  zmq_msg_t head;
  zmq_msg_init(&head);
  if (zmq_msg_recv(&head, monitor, ZMQ_DONTWAIT) < 0) {
    zmq_msg_close(&head);
    return std::nullopt;
  }
  MonitorEvent e;
  if (zmq_msg_size(&head) >= 6) {
    std::memcpy(&e.event, zmq_msg_data(&head), 2);
    std::memcpy(&e.value, static_cast<const char*>(zmq_msg_data(&head)) + 2, 4);
  }
  const bool more = zmq_msg_more(&head) != 0;
  zmq_msg_close(&head);
  if (more) {
    zmq_msg_t address;
    zmq_msg_init(&address);
    zmq_msg_recv(&address, monitor, 0);
    zmq_msg_close(&address);
  }
  return e;
}

}  // namespace detail

/// The most ZeroMQ I/O threads a syncer transport starts (ZmqSyncerConfig::io_threads).
inline constexpr int kMaxIoThreads = 64;

struct ZmqSyncerConfig {
  std::string bind = "tcp://127.0.0.1:5555";  ///< loopback by default; tcp://0.0.0.0:PORT for other hosts
  ZmqSecurity security{};
  Codec global_codec = Codec::fp32;           ///< codec of the fragments sent to learners
  /// ZeroMQ I/O threads (ZMQ_IO_THREADS), at most kMaxIoThreads. libzmq gives
  /// each accepted connection to the least loaded one, and that thread moves
  /// (under CURVE, encrypts and decrypts) every byte of the connection, so the
  /// learners' connections spread over them. Under CURVE one thread moves about
  /// 0.65 GB/s (docs/simulator.md): `ddiloco_sim size` says how many a shard
  /// needs. Threads beyond the number of learners stay idle.
  int io_threads = 1;
  /// ZMQ_SNDHWM: messages ZeroMQ queues per peer. 0 (default): derived from
  /// peer_send_budget (the budget in frames of the smallest size), so the byte
  /// budget is what binds.
  int send_hwm = 0;
  /// ZMQ_RCVHWM: messages ZeroMQ queues per connection before it stops reading
  /// that connection (TCP then pushes back on the sender). 0 (default):
  /// peer_receive_budget / max_message_size, at least 4 and at most 1000.
  int recv_hwm = 0;
  /// Dead connections (detail::set_keepalive): TCP keepalive probes after this
  /// long idle and this often (whole seconds) ...
  Duration heartbeat_interval = std::chrono::seconds(1);
  /// ... and the connection dropped after this long without an acknowledgement.
  Duration heartbeat_timeout = std::chrono::seconds(5);
  DecodeLimits limits{};
  // ---- memory bounds (docs/operations.md, "Memory bounds"; size_for_plan()) ----
  /// ZMQ_MAXMSGSIZE: a peer that sends a larger message is disconnected by
  /// ZeroMQ before the message is allocated (counted in disconnects). 0: the
  /// largest frame `limits` lets through (header + fp32 of max_elements);
  /// size_for_plan() sets it to the largest contribution of the plan.
  std::size_t max_message_size = 0;
  /// Bytes of frames queued for one peer connection (every learner id that
  /// speaks on it together; in this transport and in ZeroMQ, not yet written
  /// to its socket) and for all peers together; a frame beyond either is
  /// dropped and counted (send_over_budget), so a peer that does not read
  /// costs at most its budget.
  std::size_t peer_send_budget = std::size_t{64} << 20;
  std::size_t send_budget = std::size_t{1} << 30;
  /// Bytes ZeroMQ may hold per connection in received messages (sizes
  /// recv_hwm when that is 0).
  std::size_t peer_receive_budget = std::size_t{64} << 20;
  /// Received messages waiting for the syncer (receive_until): when either
  /// bound is reached the I/O thread stops reading until the syncer takes
  /// some; nothing is dropped (receive_pauses).
  std::size_t incoming_max_messages = 4096;
  std::size_t incoming_max_bytes = std::size_t{256} << 20;
  /// Reply routes kept (one per learner id heard from); beyond this the least
  /// recently heard are forgotten (peers_evicted) and heard again with their
  /// next message. Bounds what a plaintext peer inventing ids can make us keep.
  std::size_t max_peers = 4096;
  /// Joins and observes taken from one connection per
  /// `connection_join_interval`: beyond `connection_join_burst` they are
  /// dropped on arrival (joins_dropped), before the syncer's join rate limits
  /// see them, so one connection flooding joins (fresh ids in plaintext, or a
  /// listed key re-joining) cannot spend the join budget that every other
  /// joiner draws on. An honest learner asks once per join_retry (1 s).
  std::size_t connection_join_burst = 8;
  Duration connection_join_interval = std::chrono::seconds(1);
  /// A connection whose send queue was full and has taken no frame for this
  /// long (it does not read) is not heard from until its queue has drained: its
  /// frames are dropped on arrival (slow_peer_frames), so the syncer declares
  /// its learners dead after their heartbeat time-out and stops sending to them.
  Duration slow_peer_timeout = std::chrono::seconds(10);
  // ---- join streams (docs/operations.md, "Joins: sizes, links, time-outs") ----
  // A full_state reply (a join's or an observe's, one per fragment) is never
  // dropped for want of budget: it waits in its learner id's stream (the
  // message, sharing the syncer's payload: no frame is built) and is framed
  // and handed to ZeroMQ when the connection's queue has room, so a state far
  // larger than peer_send_budget streams out as the link drains and never more
  // than the budget is queued for one joiner. The streams together take at most
  // half of send_budget, so the other learners' traffic keeps the other half.
  // A reply for a fragment of the same reply (same sequence) that already went
  // out on the same connection is not queued again (state_duplicates): a
  // retried request costs no second copy. A new sequence (a new join) or a new
  // connection starts afresh. A stream whose connection takes nothing for
  // slow_peer_timeout drops its waiting replies (streams_abandoned; the
  // learner's next retry asks again), so a joiner that does not read pins no
  // payload, and is muted like any peer that does not read (a stream blocked
  // on its connection's budget starts the slow-peer clock; every frame it
  // moves stops it): slow_peer_timeout must exceed one fragment's time on the
  // slowest link (a 16 MiB fragment at 100 Mbit/s: 1.3 s).
  /// Learner ids with a stream at once (a finished stream is kept for
  /// join_stream_linger to recognise retries); beyond, a full_state reply takes
  /// the budget path of any other frame (dropped when over budget).
  std::size_t max_join_streams = 256;
  /// How long a stream whose every reply went out is remembered (retries of
  /// that join are then not sent again).
  Duration join_stream_linger = std::chrono::seconds(60);
  /// Contributions are handed to the syncer in their wire encoding
  /// (Message::encoded, holding the received buffer) instead of decoded to
  /// fp32: the frame is still checked here (header, sizes; the payload as
  /// payload_checks says), and the syncer folds the bytes into its accumulator with the
  /// fused decode (no copy of the payload between the socket and the
  /// accumulator; docs/performance.md). Off: every payload is decoded to fp32 here.
  bool keep_contributions_encoded = false;
  /// With keep_contributions_encoded: who checks a contribution's payload
  /// checksum and codes. `deferred` (the default) leaves both to the Syncer,
  /// which does them in the scan that takes the norms (one read of the
  /// payload instead of three; a mismatch is RejectReason::bad_checksum and
  /// counted there, not in wire errors); `now` checks them on the receive
  /// thread, for a consumer other than ddiloco::Syncer. Under CURVE,
  /// `deferred` becomes `authenticated` (payload_checks_in_use()): the
  /// message's MAC already covers every byte, so the payload CRC-32C is not
  /// compared, which saves a third of an fp32 merge (docs/performance.md).
  PayloadChecks payload_checks = PayloadChecks::deferred;
  /// Compare the payload CRC-32C under CURVE as well (`deferred` stays
  /// `deferred`): for an operator who wants the end-to-end checksum whatever
  /// the transport; it protects nothing the MAC does not.
  bool payload_crc_under_curve = false;
  /// Refused connections are recorded for the log (take_refusals) at most
  /// `refusal_log_burst` times per `refusal_log_interval`.
  Duration refusal_log_interval = std::chrono::seconds(10);
  std::size_t refusal_log_burst = 8;
};

namespace detail {
/// Bytes a queued message costs besides its frame (ZeroMQ's message and
/// routing-id parts, our queue entry): charged with every frame, so even
/// header-only frames are bounded by the byte budgets.
inline constexpr std::size_t kQueuedMessageOverhead = 256;

/// Bytes a security mechanism adds around each message before ZeroMQ checks
/// ZMQ_MAXMSGSIZE on the wire: CURVE sends every message as a MESSAGE command
/// (its name, an 8-byte nonce, a flags byte and a 16-byte MAC: 33 bytes in
/// libzmq 4.3). Under CURVE the limit is the largest ddiloco frame plus this,
/// so an honest frame is never cut (a frame up to this much larger reaches the
/// decoder, which refuses it); in plaintext it is exact.
inline constexpr std::size_t kMechanismOverhead = 256;

}  // namespace detail

/// Sizes the bounds of `config` from `b`, or from `plan` (docs/operations.md,
/// "Memory bounds"; the formulas are syncer_buffer_bounds' in
/// transport/bounds.hpp); set your own budgets after calling it.
inline void size_for_bounds(ZmqSyncerConfig& config, const SyncerBufferBounds& b) {
  config.limits.max_elements = b.largest_elements;
  config.max_message_size = b.max_message_size;
  config.peer_send_budget = b.peer_send_budget;
  config.send_budget = b.send_budget;
  config.peer_receive_budget = b.peer_receive_budget;
  config.incoming_max_bytes = b.incoming_max_bytes;
}
inline void size_for_plan(ZmqSyncerConfig& config, const Plan& plan) { size_for_bounds(config, syncer_buffer_bounds(plan)); }
/// The same for syncer shard `shard` of `map`: its own fragments only (a
/// frame of another shard's larger fragment is cut like any oversized frame;
/// with one shard, the same as size_for_plan).
inline void size_for_shard(ZmqSyncerConfig& config, const Plan& plan, const ShardMap& map, std::size_t shard) {
  size_for_bounds(config, syncer_buffer_bounds(plan, map, shard));
}

/// The syncer's end: binds a ROUTER socket and serves any number of learners.
class ZmqSyncerTransport {
 public:
  explicit ZmqSyncerTransport(ZmqSyncerConfig config, const Clock& clock)
      : config_(std::move(config)), clock_(&clock) {
    check_bounds(config_);
    context_ = zmq_ctx_new();
    if (context_ == nullptr) throw TransportError("zmq_ctx_new failed");
    try {
      // Before the first socket: libzmq starts its I/O threads with it.
      detail::zmq_check(zmq_ctx_set(context_, ZMQ_IO_THREADS, config_.io_threads), "ZMQ_IO_THREADS");
      if (config_.security.curve) {
        detail::check_z85_key(config_.security.own.public_key, "syncer public key");
        detail::check_z85_key(config_.security.own.secret_key, "syncer secret key");
        if (config_.security.allowed.empty())
          throw InvalidArgument("ZmqSyncerConfig: CURVE needs an allow-list of learner keys (or choose plaintext)");
        zap_.emplace(context_, config_.security.allowed, denied_, refusals_);
      }
      router_ = zmq_socket(context_, ZMQ_ROUTER);
      if (router_ == nullptr) throw TransportError("ZmqSyncerTransport: cannot create the ROUTER socket");
      {
        // Handshakes that fail before ZAP (a peer with another syncer key, or
        // without CURVE) are seen only by the socket monitor: logged, unnamed.
        // Disconnections are counted (ZeroMQ closes a connection that sends a
        // message over ZMQ_MAXMSGSIZE, and says nothing else about it).
        const std::string monitor = detail::msg("inproc://ddiloco-syncer-monitor-",
                                                reinterpret_cast<std::uintptr_t>(this));
        detail::zmq_check(zmq_socket_monitor(router_, monitor.c_str(),
                                             ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_DISCONNECTED),
                          "zmq_socket_monitor");
        monitor_ = zmq_socket(context_, ZMQ_PAIR);
        if (monitor_ == nullptr) throw TransportError("ZmqSyncerTransport: cannot create the monitor socket");
        detail::set_int(monitor_, ZMQ_LINGER, 0, "ZMQ_LINGER");
        detail::zmq_check(zmq_connect(monitor_, monitor.c_str()), "monitor connect");
      }
      detail::set_int(router_, ZMQ_ROUTER_MANDATORY, 1, "ZMQ_ROUTER_MANDATORY");
      detail::set_int(router_, ZMQ_SNDHWM, send_hwm(), "ZMQ_SNDHWM");
      detail::set_int(router_, ZMQ_RCVHWM, recv_hwm(), "ZMQ_RCVHWM");
      const auto max_message = static_cast<std::int64_t>(max_message_size() + (config_.security.curve ? detail::kMechanismOverhead : 0));
      detail::zmq_check(zmq_setsockopt(router_, ZMQ_MAXMSGSIZE, &max_message, sizeof max_message), "ZMQ_MAXMSGSIZE");
      detail::set_int(router_, ZMQ_LINGER, 0, "ZMQ_LINGER");
      detail::set_keepalive(router_, config_.heartbeat_interval, config_.heartbeat_timeout);
      if (config_.security.curve) {
        detail::set_int(router_, ZMQ_CURVE_SERVER, 1, "ZMQ_CURVE_SERVER");
        detail::zmq_check(zmq_setsockopt(router_, ZMQ_CURVE_SECRETKEY, config_.security.own.secret_key.c_str(), 41),
                          "ZMQ_CURVE_SECRETKEY");
        const char domain[] = "ddiloco";
        detail::zmq_check(zmq_setsockopt(router_, ZMQ_ZAP_DOMAIN, domain, sizeof domain - 1), "ZMQ_ZAP_DOMAIN");
      }
      if (zmq_bind(router_, config_.bind.c_str()) != 0)
        throw TransportError(detail::msg("cannot bind the syncer to '", config_.bind, "': ", zmq_strerror(zmq_errno()),
                                         "; is another syncer running on that port?"));
      char endpoint[256] = {};
      std::size_t len = sizeof endpoint;
      zmq_getsockopt(router_, ZMQ_LAST_ENDPOINT, endpoint, &len);
      endpoint_ = endpoint;
      wake_recv_ = zmq_socket(context_, ZMQ_PAIR);
      wake_send_ = zmq_socket(context_, ZMQ_PAIR);
      const std::string wake = detail::msg("inproc://ddiloco-wake-", reinterpret_cast<std::uintptr_t>(this));
      detail::zmq_check(zmq_bind(wake_recv_, wake.c_str()), "wake bind");
      detail::zmq_check(zmq_connect(wake_send_, wake.c_str()), "wake connect");
    } catch (...) {
      close_sockets();
      throw;
    }
    io_ = std::thread([this] { io_loop(); });
  }
  ZmqSyncerTransport(const ZmqSyncerTransport&) = delete;
  ZmqSyncerTransport& operator=(const ZmqSyncerTransport&) = delete;
  ~ZmqSyncerTransport() {
    stop_.store(true);
    wake();
    io_.join();
    close_sockets();
  }

  /// The bound endpoint (with the actual port when bound to port *).
  [[nodiscard]] const std::string& endpoint() const noexcept { return endpoint_; }
  [[nodiscard]] const Clock& clock() const noexcept { return *clock_; }
  /// How a kept-encoded contribution's payload is checked (ZmqSyncerConfig::
  /// payload_checks, with `deferred` made `authenticated` under CURVE unless
  /// payload_crc_under_curve).
  [[nodiscard]] PayloadChecks payload_checks_in_use() const noexcept {
    const bool mac = config_.security.curve && !config_.payload_crc_under_curve;
    return config_.payload_checks == PayloadChecks::deferred && mac ? PayloadChecks::authenticated
                                                                   : config_.payload_checks;
  }

  /// Queues m for learner `id`; false (counted) when the frame would exceed the
  /// peer connection's or the total send budget (unless that queue is empty):
  /// nothing is encoded then. A peer not heard from is charged only against the
  /// total (its frame is dropped when sent).
  /// A full_state reply is queued in its learner's join stream instead (see
  /// ZmqSyncerConfig, "join streams") and true returned: it goes out as the
  /// connection drains, or not at all when that fragment of that reply went out
  /// on this connection already.
  bool send_to(LearnerId id, Message&& m) {
    if (m.type == MessageType::full_state) {
      if (auto queued = stream_to(id, m)) {
        if (*queued) {
          pump_streams();
          wake();
        }
        return true;  // queued in its stream, or that fragment of that reply is out already
      }
    }
    const std::size_t charge = frame_size(m, config_.global_codec) + detail::kQueuedMessageOverhead;
    detail::SendCharge held;
    {
      std::lock_guard lock(mutex_);
      std::shared_ptr<Connection> conn;
      if (auto it = routes_.find(id); it != routes_.end()) conn = it->second.conn;
      // An empty queue always takes one frame, so a frame larger than a budget
      // still goes out (each bound is then exceeded by at most that frame).
      const std::size_t mine = conn ? conn->queued.load() : 0, all = send_queued_->load();
      const bool peer_full = mine != 0 && mine + charge > config_.peer_send_budget;
      if (peer_full || (all != 0 && all + charge > config_.send_budget)) {
        ++counters_.send_dropped;
        ++counters_.send_over_budget;
        if (peer_full && !conn->over_since) conn->over_since = clock_->now();
        return false;
      }
      detail::SendCharge::Counter peer;
      if (conn) {
        conn->over_since.reset();  // it reads again
        peer = detail::SendCharge::Counter(conn, &conn->queued);
      }
      held = detail::SendCharge(std::move(peer), send_queued_, charge);
    }
    Framed frame = frame_of(m);
    {
      std::lock_guard lock(mutex_);
      outgoing_.push_back({id, std::move(frame), std::move(held), std::nullopt});
    }
    wake();
    return true;
  }

  std::optional<Message> try_receive() {
    std::lock_guard lock(mutex_);
    return pop_locked();
  }

  std::optional<Message> receive_until(TimePoint deadline) {
    std::unique_lock lock(mutex_);
    for (;;) {
      if (auto m = pop_locked()) return m;
      const TimePoint now = clock_->now();
      if (now >= deadline || stop_.load()) return std::nullopt;
      arrived_.wait_for(lock, std::min<Duration>(deadline - now, std::chrono::milliseconds(100)));
    }
  }

  [[nodiscard]] ZmqCounters counters() const {
    std::lock_guard lock(mutex_);
    ZmqCounters c = counters_;
    c.auth_denied = denied_.load();
    c.send_queued_bytes = send_queued_->load();
    c.payloads_encoded = payloads_encoded_.load();
    c.incoming_queued_bytes = incoming_bytes_;
    c.incoming_queued = incoming_.size();
    c.peers = routes_.size();
    c.streams = streams_.size();
    c.state_waiting = 0;
    for (const auto& [id, st] : streams_) c.state_waiting += st.pending.size();
    return c;
  }

  /// The bounds in force (0s of the config resolved): ZMQ_SNDHWM, ZMQ_RCVHWM, ZMQ_MAXMSGSIZE.
  [[nodiscard]] int send_hwm() const noexcept {
    if (config_.send_hwm > 0) return config_.send_hwm;
    const std::size_t frames = config_.peer_send_budget / (kFrameHeaderSize + detail::kQueuedMessageOverhead);
    return static_cast<int>(std::clamp<std::size_t>(frames, 16, std::size_t{1} << 20));
  }
  [[nodiscard]] int recv_hwm() const noexcept {
    if (config_.recv_hwm > 0) return config_.recv_hwm;
    return static_cast<int>(std::clamp<std::size_t>(config_.peer_receive_budget / max_message_size(), 4, 1000));
  }
  [[nodiscard]] std::size_t max_message_size() const noexcept {
    if (config_.max_message_size != 0) return config_.max_message_size;
    return kFrameHeaderSize + 4 * static_cast<std::size_t>(std::min<std::uint64_t>(
                                      config_.limits.max_elements, detail::kMaxCodecElements));
  }

  /// Connections refused since the last call (keys not on the allow-list,
  /// listed keys speaking for another id), oldest first, rate limited (see
  /// ZmqRefusal): what the operator's log should say.
  [[nodiscard]] std::vector<ZmqRefusal> take_refusals() { return refusals_.take(); }

 private:
  /// A frame as it goes out: the header alone (a message without a payload),
  /// or the header, then the payload as a second message part. The payload
  /// part of a merge is one block that every receiver's message shares.
  struct Framed {
    std::shared_ptr<detail::FrameBlock> head;     ///< the 88-byte header
    std::shared_ptr<detail::FrameBlock> payload;  ///< the encoded payload; null: none
    [[nodiscard]] std::size_t size() const noexcept { return head->size + (payload ? payload->size : 0); }
  };

  struct Outgoing {
    LearnerId to;
    Framed frame;
    detail::SendCharge charge;  ///< released when ZeroMQ lets go of the frame (its payload part)
    /// A stream's full_state (sequence, fragment): if ZeroMQ refuses it, it is
    /// unmarked as sent, so the learner's retry asks for it again.
    std::optional<std::pair<std::uint64_t, std::uint32_t>> streamed;
  };

  /// A peer connection: the bytes queued on it (peer_send_budget) and since
  /// when its queue has been full (under mutex_).
  struct Connection {
    std::atomic<std::size_t> queued{0};
    std::optional<TimePoint> over_since;
    std::optional<TimePoint> join_window;  ///< start of its connection_join_interval (under mutex_)
    std::size_t joins = 0;                 ///< joins and observes taken in it
  };
  /// Where a learner's replies go.
  struct Route {
    std::string rid;                    ///< ROUTER routing id of its latest connection
    std::shared_ptr<Connection> conn;   ///< that connection
    TimePoint heard{0};                 ///< last message from it (eviction order)
  };
  struct Incoming {
    Message message;
    std::size_t bytes = 0;  ///< what it holds in memory (incoming_max_bytes)
  };
  /// One learner id's full state on its way (ZmqSyncerConfig, "join streams").
  struct Stream {
    std::shared_ptr<Connection> conn;          ///< the connection `sent` went out on
    std::uint64_t sequence = 0;                ///< the reply's sequence (a join's base, an observe's nonce)
    std::map<std::uint32_t, Message> pending;  ///< replies waiting for room, one per fragment, lowest first
    std::vector<std::uint32_t> sent;           ///< fragments of this reply handed to ZeroMQ on `conn`
    TimePoint last_moved{0};                   ///< when it last handed a frame to ZeroMQ (or began)
  };

  /// Files a full_state reply in learner `id`'s stream: true when queued
  /// there, false when its fragment already went out (a duplicate: nothing to
  /// do, reported as sent by send_to). nullopt when no stream can be made
  /// (max_join_streams busy): send_to's budget path takes it.
  std::optional<bool> stream_to(LearnerId id, Message& m) {
    std::lock_guard lock(mutex_);
    const TimePoint now = clock_->now();
    std::shared_ptr<Connection> conn;
    if (auto r = routes_.find(id); r != routes_.end()) conn = r->second.conn;
    auto it = streams_.find(id);
    if (it == streams_.end()) {
      if (streams_.size() >= config_.max_join_streams) {
        // Room from the finished stream that moved last longest ago, if any.
        auto victim = streams_.end();
        for (auto j = streams_.begin(); j != streams_.end(); ++j)
          if (j->second.pending.empty() && (victim == streams_.end() || j->second.last_moved < victim->second.last_moved))
            victim = j;
        if (victim == streams_.end()) {
          ++counters_.stream_refusals;
          return std::nullopt;
        }
        streams_.erase(victim);
      }
      it = streams_.emplace(id, Stream{}).first;
      it->second.conn = conn;
      it->second.sequence = m.sequence;
      it->second.last_moved = now;
    }
    Stream& st = it->second;
    if (st.sequence != m.sequence) {
      // A new reply (a new join or fetch): the old one's waiting fragments are stale.
      st.pending.clear();
      st.sent.clear();
      st.sequence = m.sequence;
      st.last_moved = now;
    }
    if (st.conn != conn) {
      // Another connection: what went out on the old one may never arrive.
      st.sent.clear();
      st.conn = conn;
    }
    if (std::find(st.sent.begin(), st.sent.end(), m.fragment) != st.sent.end()) {
      ++counters_.state_duplicates;
      return false;
    }
    if (st.pending.empty()) st.last_moved = std::max(st.last_moved, now);  // waiting from now on
    st.pending.insert_or_assign(m.fragment, std::move(m));  // a newer copy replaces a waiting one
    return true;
  }

  /// Hands waiting full_state replies to the I/O thread while they fit: the
  /// connection's queue within peer_send_budget (or empty), all queues within
  /// send_budget and the streams within half of it (or empty). Forgets
  /// streams finished for join_stream_linger and abandons those whose
  /// connection took nothing for slow_peer_timeout. Frames are built outside
  /// the lock.
  void pump_streams() {
    struct Move {
      LearnerId to;
      Message message;
      detail::SendCharge charge;
    };
    std::vector<Move> moves;
    // One pump at a time (send_to's caller and the I/O thread both pump): two
    // that framed their moves side by side could queue a stream's fragments
    // out of order.
    std::lock_guard pumping(pump_mutex_);
    {
      std::lock_guard lock(mutex_);
      if (streams_.empty()) return;
      const TimePoint now = clock_->now();
      const std::size_t stream_share = std::max<std::size_t>(config_.send_budget / 2, 1);
      for (auto it = streams_.begin(); it != streams_.end();) {
        Stream& st = it->second;
        if (auto r = routes_.find(it->first); r != routes_.end() && r->second.conn != st.conn) {
          // The learner came back on another connection: its budget is that
          // one's, and what went out on the old one may never arrive.
          st.conn = r->second.conn;
          st.sent.clear();
        }
        while (!st.pending.empty()) {
          auto first = st.pending.begin();
          const std::size_t charge = frame_size(first->second, config_.global_codec) + detail::kQueuedMessageOverhead;
          const std::size_t mine = st.conn ? st.conn->queued.load() : 0, all = send_queued_->load(),
                            streams = stream_queued_->load();
          const bool peer_full = mine != 0 && mine + charge > config_.peer_send_budget;
          if (peer_full || (all != 0 && all + charge > config_.send_budget) ||
              (streams != 0 && streams + charge > stream_share)) {
            // Its own queue is full: as for a refused send, the slow-peer clock
            // runs until a frame moves (muted_locked: a joiner that does not read
            // is muted after slow_peer_timeout, like any peer).
            if (peer_full && st.conn && !st.conn->over_since) st.conn->over_since = now;
            break;
          }
          detail::SendCharge::Counter peer;
          if (st.conn) {
            st.conn->over_since.reset();  // it drains: not a peer that does not read
            peer = detail::SendCharge::Counter(st.conn, &st.conn->queued);
          }
          moves.push_back({it->first, std::move(first->second),
                           detail::SendCharge(std::move(peer), send_queued_, charge, stream_queued_)});
          st.sent.push_back(first->first);
          // Counted with `sent`, under the same lock: a retry that finds it
          // sent (state_duplicates) never sees it uncounted here.
          ++counters_.state_frames_streamed;
          st.pending.erase(first);
          st.last_moved = now;
        }
        if (!st.pending.empty() && now - st.last_moved >= config_.slow_peer_timeout && st.conn &&
            st.conn->queued.load() != 0) {
          ++counters_.streams_abandoned;  // its connection does not read: pin no payload for it
          st.pending.clear();
          st.last_moved = now;
        }
        if (st.pending.empty() && now - st.last_moved >= config_.join_stream_linger) {
          it = streams_.erase(it);
        } else {
          ++it;
        }
      }
    }
    if (moves.empty()) return;
    std::vector<Outgoing> framed;
    framed.reserve(moves.size());
    for (auto& mv : moves) {
      const std::pair<std::uint64_t, std::uint32_t> key{mv.message.sequence, mv.message.fragment};
      framed.push_back({mv.to, frame_of(mv.message), std::move(mv.charge), key});
    }
    std::lock_guard lock(mutex_);
    for (auto& o : framed) outgoing_.push_back(std::move(o));
  }

  static void check_bounds(const ZmqSyncerConfig& c) {
    if (c.io_threads < 1 || c.io_threads > kMaxIoThreads)
      throw InvalidArgument(detail::msg("ZmqSyncerConfig::io_threads = ", c.io_threads, " must be in [1, ",
                                        kMaxIoThreads, "] (default 1; one per 0.65 GB/s of CURVE traffic)"));
    if (c.send_hwm < 0 || c.recv_hwm < 0)
      throw InvalidArgument(detail::msg("ZmqSyncerConfig: send_hwm = ", c.send_hwm, " and recv_hwm = ", c.recv_hwm,
                                        " must be >= 0 (0: derived from the byte budgets)"));
    if (c.max_message_size != 0 && c.max_message_size < kFrameHeaderSize)
      throw InvalidArgument(detail::msg("ZmqSyncerConfig::max_message_size = ", c.max_message_size,
                                        " is below a frame header (", kFrameHeaderSize,
                                        " bytes); use 0 (derived) or size_for_plan()"));
    if (c.max_message_size > (std::size_t{1} << 62))
      throw InvalidArgument(detail::msg("ZmqSyncerConfig::max_message_size = ", c.max_message_size, " is too large"));
    const std::size_t smallest = kFrameHeaderSize + detail::kQueuedMessageOverhead;
    if (c.peer_send_budget < smallest || c.send_budget < c.peer_send_budget)
      throw InvalidArgument(detail::msg("ZmqSyncerConfig: peer_send_budget = ", c.peer_send_budget,
                                        " bytes must be >= ", smallest, " and send_budget = ", c.send_budget,
                                        " bytes >= peer_send_budget (defaults 64 MiB and 1 GiB)"));
    if (c.slow_peer_timeout <= Duration{0})
      throw InvalidArgument(detail::msg("ZmqSyncerConfig::slow_peer_timeout = ", c.slow_peer_timeout.count(),
                                        " ns must be > 0 (default 10 s)"));
    if (c.connection_join_burst == 0 || c.connection_join_interval <= Duration{0})
      throw InvalidArgument(detail::msg("ZmqSyncerConfig: connection_join_burst = ", c.connection_join_burst,
                                        " must be > 0 and connection_join_interval = ", c.connection_join_interval.count(),
                                        " ns > 0 (defaults 8 and 1 s): a learner's join would never be taken"));
    if (c.max_join_streams == 0 || c.join_stream_linger < Duration{0})
      throw InvalidArgument(detail::msg("ZmqSyncerConfig: max_join_streams = ", c.max_join_streams,
                                        " must be > 0 and join_stream_linger = ", c.join_stream_linger.count(),
                                        " ns >= 0 (defaults 256 and 60 s)"));
    if (c.peer_receive_budget == 0 || c.incoming_max_messages == 0 || c.incoming_max_bytes == 0 || c.max_peers == 0)
      throw InvalidArgument(detail::msg("ZmqSyncerConfig: peer_receive_budget = ", c.peer_receive_budget,
                                        ", incoming_max_messages = ", c.incoming_max_messages,
                                        ", incoming_max_bytes = ", c.incoming_max_bytes, " and max_peers = ",
                                        c.max_peers, " must all be > 0"));
  }

  /// True when incoming_ holds as much as it may: the I/O thread stops reading.
  [[nodiscard]] bool incoming_full_locked() const noexcept {
    return incoming_.size() >= config_.incoming_max_messages ||
           (!incoming_.empty() && incoming_bytes_ >= config_.incoming_max_bytes);
  }

  /// m's frame as it goes out (Framed). A merge sends the same global
  /// fragment (one shared payload) to every learner: its payload is encoded
  /// and checksummed once, for the first, into a pooled block that every
  /// receiver's message then shares (ZeroMQ holds a reference per message, see
  /// send_frame_zero_copy); each receiver gets only its own 88-byte header.
  Framed frame_of(const Message& m) {
    const Codec codec = config_.global_codec;
    Framed f;
    f.head = pool_->acquire(kFrameHeaderSize);
    const auto write_head = [&](std::uint32_t crc) {
      const auto head = frame_header(m, codec, crc);
      std::memcpy(f.head->data.get(), head.data(), head.size());
    };
    const std::size_t bytes = encoded_size(codec, m.payload_size());
    if (bytes == 0) {
      write_head(0);  // the CRC-32C of no bytes
      return f;
    }
    std::uint32_t crc = 0;
    {
      std::lock_guard lock(frame_cache_mutex_);
      if (m.payload && m.payload == cached_payload_ && cached_block_ && cached_block_->size == bytes) {
        f.payload = cached_block_;
        crc = cached_crc_;
      }
    }
    if (!f.payload) {
      f.payload = pool_->acquire(bytes);
      crc = encode_payload_into(m, codec, std::span<std::byte>(f.payload->data.get(), bytes));
      payloads_encoded_.fetch_add(1);
      if (m.payload) {
        std::lock_guard lock(frame_cache_mutex_);
        cached_payload_ = m.payload;
        cached_block_ = f.payload;
        cached_crc_ = crc;
      }
    }
    write_head(crc);
    return f;
  }

  std::optional<Message> pop_locked() {
    if (incoming_.empty()) return std::nullopt;
    Message m = std::move(incoming_.front().message);
    incoming_bytes_ -= incoming_.front().bytes;
    incoming_.pop_front();
    if (receive_paused_ && !incoming_full_locked()) {
      receive_paused_ = false;
      wake();  // the I/O thread reads again
    }
    return m;
  }

  void wake() {
    std::lock_guard lock(wake_mutex_);
    if (wake_send_ != nullptr) zmq_send(wake_send_, "", 0, ZMQ_DONTWAIT);
  }

  void io_loop() {
    while (!stop_.load()) {
      bool paused = false;
      {
        std::lock_guard lock(mutex_);
        paused = receive_paused_;
      }
      // While incoming_ is full the router is not read: ZeroMQ's RCVHWM, then
      // TCP, push back on the senders.
      zmq_pollitem_t items[3] = {{router_, 0, static_cast<short>(paused ? 0 : ZMQ_POLLIN), 0},
                                 {wake_recv_, 0, ZMQ_POLLIN, 0},
                                 {monitor_, 0, ZMQ_POLLIN, 0}};
      zmq_poll(items, monitor_ != nullptr ? 3 : 2, 100);
      if (items[1].revents & ZMQ_POLLIN) {
        char b;
        while (zmq_recv(wake_recv_, &b, 1, ZMQ_DONTWAIT) >= 0) {
        }
      }
      if (monitor_ != nullptr && (items[2].revents & ZMQ_POLLIN)) drain_monitor();
      pump_streams();  // full states go on as their connections drain
      flush_outgoing();
      if (!paused && (items[0].revents & ZMQ_POLLIN)) receive_all();
    }
  }

  void flush_outgoing() {
    std::deque<Outgoing> batch;
    {
      std::lock_guard lock(mutex_);
      batch.swap(outgoing_);
    }
    for (auto& o : batch) {
      std::string rid;
      {
        std::lock_guard lock(mutex_);
        if (auto it = routes_.find(o.to); it != routes_.end()) rid = it->second.rid;
      }
      const std::size_t size = o.frame.size();
      // The routing id, the header, then (if any) the payload: ZeroMQ takes a
      // message's parts all or none, so once the routing id is accepted the
      // rest is too.
      bool ok = !rid.empty() && zmq_send(router_, rid.data(), rid.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0;
      if (ok && o.frame.payload) {
        ok = detail::send_frame_zero_copy(router_, std::move(o.frame.head), ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
             detail::send_frame_zero_copy(router_, std::move(o.frame.payload), ZMQ_DONTWAIT, std::move(o.charge)) >= 0;
      } else if (ok) {
        ok = detail::send_frame_zero_copy(router_, std::move(o.frame.head), ZMQ_DONTWAIT, std::move(o.charge)) >= 0;
      }
      o.charge = detail::SendCharge{};  // a frame not sent gives its bytes back now
      std::lock_guard lock(mutex_);
      if (ok) {
        ++counters_.frames_out;
        counters_.bytes_out += size;
      } else {
        ++counters_.send_dropped;  // unknown peer (EHOSTUNREACH) or high-water mark (EAGAIN)
        if (o.streamed) {
          // Not out after all: a retried request may ask for it again.
          if (auto st = streams_.find(o.to); st != streams_.end() && st->second.sequence == o.streamed->first)
            std::erase(st->second.sent, o.streamed->second);
        }
      }
    }
  }

  void receive_all() {
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (incoming_full_locked()) {
          receive_paused_ = true;
          ++counters_.receive_pauses;
          return;
        }
      }
      zmq_msg_t rid;
      zmq_msg_init(&rid);
      if (zmq_msg_recv(&rid, router_, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&rid);
        return;
      }
      if (!zmq_msg_more(&rid)) {  // a frame without a body: malformed
        zmq_msg_close(&rid);
        std::lock_guard lock(mutex_);
        ++counters_.decode_errors;
        continue;
      }
      // The body is received into a shared owner: a contribution kept encoded
      // (keep_contributions_encoded) points into it until the syncer is done.
      auto body = std::make_shared<detail::ReceivedMessage>();
      zmq_msg_recv(&body->msg, router_, 0);
      // Drop any further parts of a multi-part message: the protocol has one.
      bool extra = false;
      while (zmq_msg_more(&body->msg)) {
        extra = true;
        body = std::make_shared<detail::ReceivedMessage>();
        zmq_msg_recv(&body->msg, router_, 0);
      }
      const char* user = config_.security.curve ? zmq_msg_gets(&body->msg, "User-Id") : nullptr;
      const std::span<const std::byte> bytes = body->bytes();
      {
        std::lock_guard lock(mutex_);
        ++counters_.frames_in;
        counters_.bytes_in += bytes.size();
        // A type a syncer never receives (full_state, global_fragment,
        // join_refused, rejoin) is refused on its header byte, before any decoding.
        if (!extra && bytes.size() >= kFrameHeaderSize && !syncer_receives(bytes[detail::frame_offset::type])) {
          ++counters_.wrong_direction;
          ++counters_.decode_errors;
          zmq_msg_close(&rid);
          continue;
        }
      }
      // Decoding (validation + payload conversion) happens outside the lock.
      DecodeResult r = config_.keep_contributions_encoded
                           ? decode_frame_keep_encoded(bytes, config_.limits, body, payload_checks_in_use())
                           : decode_frame(bytes, config_.limits);
      {
        std::lock_guard lock(mutex_);
        counters_.wire.record(r);
        if (extra || !r.ok()) {
          ++counters_.decode_errors;
        } else if (user != nullptr && std::to_string(r.value().learner) != user) {
          ++counters_.impersonations;  // a listed key speaking for another learner id
          if (r.value().type == MessageType::join || r.value().type == MessageType::observe)
            refuse_identity(rid, r.value(), user);
        } else if ((r.value().type == MessageType::join || r.value().type == MessageType::observe) &&
                   !join_allowed_locked(rid)) {
          ++counters_.joins_dropped;  // before a route: a flood of fresh ids evicts nobody
        } else {
          // The connection this learner spoke from last is where its replies go
          // (a restarted learner comes back on a new connection).
          Route& route = route_locked(r.value().learner);
          if (route.rid.size() != zmq_msg_size(&rid) ||
              std::memcmp(route.rid.data(), zmq_msg_data(&rid), route.rid.size()) != 0) {
            route.rid.assign(static_cast<const char*>(zmq_msg_data(&rid)), zmq_msg_size(&rid));
            route.conn = connection_locked(route.rid);
          }
          if (muted_locked(*route.conn)) {
            // It has not read for slow_peer_timeout: not heard from until it
            // does, so the syncer declares it dead and stops sending to it.
            ++counters_.slow_peer_frames;
          } else {
            // What the message keeps alive: the received buffer (a contribution
            // kept encoded) or its decoded payload.
            const std::size_t held = sizeof(Incoming) + std::max(bytes.size(), r.value().payload_bytes());
            incoming_.push_back({std::move(r).value(), held});
            incoming_bytes_ += held;
            arrived_.notify_one();
          }
        }
      }
      zmq_msg_close(&rid);
    }
  }

  static bool syncer_receives(std::byte type) noexcept {
    const auto t = static_cast<MessageType>(std::to_integer<std::uint8_t>(type));
    return t != MessageType::full_state && t != MessageType::global_fragment && t != MessageType::join_refused &&
           t != MessageType::rejoin && t != MessageType::pull;
  }

  /// The route of learner `id`, made if new; evicts the least recently heard
  /// routes (an eighth of max_peers at a time) to stay within max_peers. A
  /// peer evicted with frames still queued keeps them charged against the
  /// total budget. Called with mutex_ held, on the I/O thread.
  Route& route_locked(LearnerId id) {
    const TimePoint now = clock_->now();
    auto it = routes_.find(id);
    if (it == routes_.end()) {
      if (routes_.size() >= config_.max_peers) {
        std::vector<std::pair<TimePoint, LearnerId>> by_age;
        by_age.reserve(routes_.size());
        for (const auto& [peer, route] : routes_) by_age.emplace_back(route.heard, peer);
        const std::size_t drop = std::max<std::size_t>(1, config_.max_peers / 8);
        std::nth_element(by_age.begin(), by_age.begin() + static_cast<std::ptrdiff_t>(drop - 1), by_age.end());
        for (std::size_t i = 0; i < drop; ++i) routes_.erase(by_age[i].second);
        counters_.peers_evicted += drop;
      }
      it = routes_.emplace(id, Route{{}, nullptr, now}).first;
    }
    it->second.heard = now;
    return it->second;
  }

  /// One connection (routing id) and its send budget, shared by every learner
  /// id that speaks on it: a peer inventing ids on one connection gets one
  /// peer_send_budget, not one per id. Entries nobody holds any more (no
  /// route, no queued frame) are dropped once there are more than max_peers.
  /// Called with mutex_ held.
  /// True, and counted against it, if connection `rid` may send one more join
  /// or observe in its current connection_join_interval. Called with mutex_ held.
  bool join_allowed_locked(zmq_msg_t& rid) {
    const std::shared_ptr<Connection> conn =
        connection_locked(std::string(static_cast<const char*>(zmq_msg_data(&rid)), zmq_msg_size(&rid)));
    const TimePoint now = clock_->now();
    if (!conn->join_window || now - *conn->join_window >= config_.connection_join_interval) {
      conn->join_window = now;
      conn->joins = 0;
    }
    if (conn->joins >= config_.connection_join_burst) return false;
    ++conn->joins;
    return true;
  }

  std::shared_ptr<Connection> connection_locked(const std::string& rid) {
    auto& conn = connections_[rid];
    if (!conn) conn = std::make_shared<Connection>();
    std::shared_ptr<Connection> held = conn;
    if (connections_.size() > config_.max_peers)
      std::erase_if(connections_, [](const auto& kv) { return kv.second.use_count() == 1; });
    return held;
  }

  /// True once a connection's send queue was full (a send refused) and no send
  /// to it has been taken for slow_peer_timeout since, until its queue has
  /// drained completely (it reads again). Called with mutex_ held.
  bool muted_locked(Connection& c) const {
    if (!c.over_since || clock_->now() - *c.over_since < config_.slow_peer_timeout) return false;
    if (c.queued.load() != 0) return true;
    c.over_since.reset();  // it has read everything since
    return false;
  }

  /// Answers a join from a listed key that claims another id with
  /// JoinRefusal::identity (on the connection it came from: it has no route of
  /// its own), so that learner can say which id its key belongs to. Called
  /// with mutex_ held, on the I/O thread.
  void refuse_identity(zmq_msg_t& rid, const Message& m, const char* user) {
    ZmqRefusal log;
    log.kind = ZmqRefusal::Kind::wrong_id;
    log.claimed = m.learner;
    log.listed = static_cast<LearnerId>(std::stoul(user));
    refusals_.add(log);
    Message r;
    r.type = MessageType::join_refused;
    r.fingerprint = m.fingerprint;
    r.learner = m.learner;
    r.fragment = static_cast<std::uint32_t>(JoinRefusal::identity);
    r.version = log.listed;
    r.sequence = m.sequence;
    const std::vector<std::byte> frame = encode_frame(r, Codec::fp32);
    if (zmq_send(router_, zmq_msg_data(&rid), zmq_msg_size(&rid), ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
        zmq_send(router_, frame.data(), frame.size(), ZMQ_DONTWAIT) >= 0) {
      ++counters_.frames_out;
      counters_.bytes_out += frame.size();
    } else {
      ++counters_.send_dropped;
    }
  }

  /// Failed handshakes the monitor reported (two parts each: event + value, endpoint).
  void drain_monitor() {
    for (;;) {
      const auto e = detail::next_monitor_event(monitor_);
      if (!e) return;
      const auto [event, value] = *e;
      if (event == ZMQ_EVENT_DISCONNECTED) {
        std::lock_guard lock(mutex_);
        ++counters_.disconnects;
        continue;
      }
      if (event != ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) continue;
      {
        std::lock_guard lock(mutex_);
        ++counters_.handshake_failures;
      }
      ZmqRefusal r;
      if (value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC) {
        r.kind = ZmqRefusal::Kind::undecryptable;
      } else if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
        r.kind = ZmqRefusal::Kind::wrong_mechanism;
      } else {
        continue;  // counted; other protocol errors are not a configuration we can name
      }
      refusals_.add(std::move(r));
    }
  }

  void close_sockets() {
    std::lock_guard lock(wake_mutex_);
    if (router_ != nullptr && monitor_ != nullptr) zmq_socket_monitor(router_, nullptr, 0);
    for (void** s : {&router_, &wake_recv_, &wake_send_, &monitor_})
      if (*s != nullptr) {
        zmq_close(*s);
        *s = nullptr;
      }
    zap_.reset();
    if (context_ != nullptr) {
      zmq_ctx_term(context_);
      context_ = nullptr;
    }
  }

  ZmqSyncerConfig config_;
  const Clock* clock_;
  void* context_ = nullptr;
  void* router_ = nullptr;
  void* wake_recv_ = nullptr;
  void* wake_send_ = nullptr;
  void* monitor_ = nullptr;  ///< PAIR socket reading router_'s failed handshakes (CURVE only)
  std::mutex wake_mutex_;
  std::atomic<std::uint64_t> denied_{0};
  detail::RefusalLog refusals_{config_.refusal_log_interval, config_.refusal_log_burst};
  std::optional<detail::ZapHandler> zap_;
  std::string endpoint_;
  std::mutex pump_mutex_;  ///< held through pump_streams(), taken before mutex_
  mutable std::mutex mutex_;
  std::condition_variable arrived_;
  std::deque<Incoming> incoming_;
  std::size_t incoming_bytes_ = 0;  ///< sum of incoming_'s `bytes`
  bool receive_paused_ = false;     ///< incoming_ full: the I/O thread does not read the router
  std::deque<Outgoing> outgoing_;
  /// Bytes of all frames queued for peers (send_budget), shared with the charges.
  detail::SendCharge::Counter send_queued_ = std::make_shared<std::atomic<std::size_t>>(0);
  /// The part of send_queued_ that join streams queued (at most half of send_budget).
  detail::SendCharge::Counter stream_queued_ = std::make_shared<std::atomic<std::size_t>>(0);
  std::map<LearnerId, Stream> streams_;  ///< join streams by learner id (at most max_join_streams)
  std::shared_ptr<detail::FramePool> pool_ = std::make_shared<detail::FramePool>();
  std::mutex frame_cache_mutex_;
  Payload cached_payload_;                            ///< the payload last encoded ...
  std::shared_ptr<detail::FrameBlock> cached_block_;  ///< ... its encoded bytes (see frame_of) ...
  std::uint32_t cached_crc_ = 0;                      ///< ... and their CRC-32C
  std::atomic<std::uint64_t> payloads_encoded_{0};    ///< ZmqCounters::payloads_encoded
  std::map<LearnerId, Route> routes_;  ///< learner id -> its reply route (at most max_peers)
  std::map<std::string, std::shared_ptr<Connection>> connections_;  ///< routing id -> its connection
  ZmqCounters counters_{};
  std::atomic<bool> stop_{false};
  std::thread io_;
};

struct ZmqLearnerConfig {
  std::string connect = "tcp://127.0.0.1:5555";
  LearnerId id = 0;
  ZmqSecurity security{};
  Codec codec = Codec::fp32;  ///< codec of the contributions this learner sends
  bool error_feedback = false;  ///< carry the quantisation residual into the next send
  int send_hwm = 100;
  int recv_hwm = 1000;
  /// Queue messages only on a completed connection (ZMQ_IMMEDIATE): while the
  /// syncer is unreachable sends fail at once (OuterLoop keeps the progress
  /// for the next send) instead of piling up stale contributions.
  bool immediate = true;
  /// Dead connections (detail::set_keepalive): TCP keepalive probes after this
  /// long idle and this often (whole seconds) ...
  Duration heartbeat_interval = std::chrono::seconds(1);
  /// ... and the connection dropped after this long without an acknowledgement.
  Duration heartbeat_timeout = std::chrono::seconds(5);
  DecodeLimits limits{};
  /// ZMQ_MAXMSGSIZE, checked by ZeroMQ on each message part (a global's
  /// header and payload are two): a syncer that sends a larger part is
  /// disconnected. 0: header + fp32 of limits.max_elements; size_for_plan()
  /// sets the largest global fragment of the plan.
  std::size_t max_message_size = 0;
  /// try_receive() asks the socket at most this often once it found nothing
  /// (wall time): an empty non-blocking receive costs libzmq a system call
  /// (the poll of its command mailbox), about 1 us, which a training loop
  /// stepping in microseconds would pay at every step. A message that arrives
  /// meanwhile is taken by the first try_receive() after the interval, or at
  /// once by receive_until(). 0: ask at every call.
  Duration receive_poll_interval = std::chrono::microseconds(20);
  /// Pull rounds' per-step metadata is coalesced: at most one metadata frame
  /// goes out per metadata_interval (wall time). A newer metadata message
  /// supersedes an older one (message.hpp), so one sent within the interval
  /// of the last is held, replacing any held before it, and goes out at the
  /// first send() or try_receive() after the interval, before any other
  /// message, or before receive_until() waits. The syncer therefore hears the
  /// learner's step at most this late while the learner keeps stepping (every
  /// message carries the step too). A training loop of millisecond steps sends
  /// every step's; one stepping in microseconds sends about 1000 a second
  /// instead of hundreds of thousands (each a system call here and a round
  /// check at the syncer). 0: every metadata message is sent.
  Duration metadata_interval = std::chrono::milliseconds(1);
  /// Received globals are decoded into vectors that earlier ones used once
  /// their holders let go (PayloadPool): at most this many wait, the largest
  /// kept, so the learner holds at most this many of its largest fragment
  /// beyond the globals in use. A fresh vector of a large fragment is fresh
  /// pages (faulted in and zeroed: about 36 ms more for 2^24 values). 0: every
  /// global in a fresh vector.
  std::size_t idle_payload_buffers = 2;
};

/// Sizes the receive limits of a learner's `config` from `plan`: the largest
/// legal frame from the syncer is a full_state or global_fragment of the plan's
/// largest fragment, in the widest codec.
inline void size_for_plan(ZmqLearnerConfig& config, const Plan& plan) {
  std::size_t largest = 0;
  for (const auto& f : plan.fragments()) largest = std::max(largest, f.numel);
  config.limits.max_elements = largest;
  config.max_message_size = detail::largest_frame(largest);
}

/// A learner's end: a DEALER socket connected to the syncer. Used from one thread.
class ZmqLearnerTransport {
 public:
  ZmqLearnerTransport(ZmqLearnerConfig config, const Clock& clock) : config_(std::move(config)), clock_(&clock) {
    context_ = zmq_ctx_new();
    if (context_ == nullptr) throw TransportError("zmq_ctx_new failed");
    try {
      dealer_ = zmq_socket(context_, ZMQ_DEALER);
      detail::set_int(dealer_, ZMQ_SNDHWM, config_.send_hwm, "ZMQ_SNDHWM");
      detail::set_int(dealer_, ZMQ_RCVHWM, config_.recv_hwm, "ZMQ_RCVHWM");
      detail::set_int(dealer_, ZMQ_LINGER, 0, "ZMQ_LINGER");
      if (config_.receive_poll_interval < Duration::zero())
        throw InvalidArgument(detail::msg("ZmqLearnerConfig::receive_poll_interval = ",
                                          config_.receive_poll_interval.count(),
                                          " ns is negative; use 0 to ask the socket at every try_receive()"));
      if (config_.metadata_interval < Duration::zero())
        throw InvalidArgument(detail::msg("ZmqLearnerConfig::metadata_interval = ", config_.metadata_interval.count(),
                                          " ns is negative; use 0 to send every step's metadata"));
      if (config_.max_message_size != 0 && config_.max_message_size < kFrameHeaderSize)
        throw InvalidArgument(detail::msg("ZmqLearnerConfig::max_message_size = ", config_.max_message_size,
                                          " is below a frame header (", kFrameHeaderSize,
                                          " bytes); use 0 (derived) or size_for_plan()"));
      const auto max_message = static_cast<std::int64_t>(
          config_.max_message_size != 0
              ? config_.max_message_size
              : kFrameHeaderSize + 4 * std::min<std::uint64_t>(config_.limits.max_elements, detail::kMaxCodecElements)) +
          static_cast<std::int64_t>(config_.security.curve ? detail::kMechanismOverhead : 0);
      detail::zmq_check(zmq_setsockopt(dealer_, ZMQ_MAXMSGSIZE, &max_message, sizeof max_message), "ZMQ_MAXMSGSIZE");
      detail::set_int(dealer_, ZMQ_IMMEDIATE, config_.immediate ? 1 : 0, "ZMQ_IMMEDIATE");
      detail::set_int(dealer_, ZMQ_RECONNECT_IVL, 100, "ZMQ_RECONNECT_IVL");
      detail::set_int(dealer_, ZMQ_RECONNECT_IVL_MAX, 2000, "ZMQ_RECONNECT_IVL_MAX");
      detail::set_keepalive(dealer_, config_.heartbeat_interval, config_.heartbeat_timeout);
      if (config_.security.curve) {
        detail::check_z85_key(config_.security.own.public_key, "learner public key");
        detail::check_z85_key(config_.security.own.secret_key, "learner secret key");
        detail::check_z85_key(config_.security.server_public_key, "syncer public key");
        detail::zmq_check(zmq_setsockopt(dealer_, ZMQ_CURVE_SERVERKEY, config_.security.server_public_key.c_str(), 41),
                          "ZMQ_CURVE_SERVERKEY");
        detail::zmq_check(zmq_setsockopt(dealer_, ZMQ_CURVE_PUBLICKEY, config_.security.own.public_key.c_str(), 41),
                          "ZMQ_CURVE_PUBLICKEY");
        detail::zmq_check(zmq_setsockopt(dealer_, ZMQ_CURVE_SECRETKEY, config_.security.own.secret_key.c_str(), 41),
                          "ZMQ_CURVE_SECRETKEY");
      }
      // The socket monitor reports the connection's life (TCP connects,
      // handshakes and their failures): link_failure() / link_summary(). It is
      // connected before the DEALER connects, so no event is missed.
      const std::string monitor = detail::msg("inproc://ddiloco-monitor-", reinterpret_cast<std::uintptr_t>(this));
      detail::zmq_check(zmq_socket_monitor(dealer_, monitor.c_str(),
                                           ZMQ_EVENT_CONNECTED | ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_DISCONNECTED |
                                               ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                               ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL),
                        "zmq_socket_monitor");
      monitor_ = zmq_socket(context_, ZMQ_PAIR);
      if (monitor_ == nullptr) throw TransportError("ZmqLearnerTransport: cannot create the monitor socket");
      detail::set_int(monitor_, ZMQ_LINGER, 0, "ZMQ_LINGER");
      detail::zmq_check(zmq_connect(monitor_, monitor.c_str()), "monitor connect");
      if (zmq_connect(dealer_, config_.connect.c_str()) != 0)
        throw TransportError(detail::msg("cannot connect to '", config_.connect, "': ", zmq_strerror(zmq_errno())));
    } catch (...) {
      close();
      throw;
    }
  }
  ZmqLearnerTransport(const ZmqLearnerTransport&) = delete;
  ZmqLearnerTransport& operator=(const ZmqLearnerTransport&) = delete;
  ~ZmqLearnerTransport() { close(); }

  [[nodiscard]] const Clock& clock() const noexcept { return *clock_; }
  [[nodiscard]] bool failed() const noexcept { return dealer_ == nullptr; }
  [[nodiscard]] LearnerId id() const noexcept { return config_.id; }

  /// The codec contributions go out in, for an OuterLoop that encodes them
  /// itself (Message::encoded, see OuterLoop); none with error feedback, which
  /// needs the fp32 outer gradient to carry the residual.
  [[nodiscard]] std::optional<Codec> contribution_codec() const noexcept {
    if (config_.error_feedback) return std::nullopt;
    return config_.codec;
  }

  /// The payload part of the next contribution's frame, `bytes` long, for
  /// OuterLoop to encode into (ContributionBufferTransport): send() then writes
  /// the header and checksum around it and hands the frame to ZeroMQ, with no
  /// copy of the payload. A buffer lent and not sent is simply given back.
  [[nodiscard]] OutgoingPayload contribution_buffer(std::size_t bytes) { return framer_.lend(bytes); }

  /// Frames written into the buffer of an earlier, sent frame, and such buffers
  /// waiting now (see FramePool).
  [[nodiscard]] std::uint64_t reused_frame_buffers() const { return framer_.pool().reused(); }
  [[nodiscard]] std::size_t idle_frame_buffers() const { return framer_.pool().idle(); }

  bool send(Message&& m) {
    if (dealer_ == nullptr) throw TransportError("ZmqLearnerTransport: closed");
    if (m.type == MessageType::metadata && config_.metadata_interval > Duration::zero()) {
      const auto now = std::chrono::steady_clock::now();
      if (held_metadata_) ++counters_.metadata_coalesced;  // the held one is superseded, sent or not
      if (now < next_metadata_) {
        held_metadata_ = std::move(m);
        return true;
      }
      held_metadata_.reset();
      next_metadata_ = now + config_.metadata_interval;
      return send_now(std::move(m));
    }
    flush_metadata();  // the held metadata keeps its place before this message
    return send_now(std::move(m));
  }

  /// Sends the held metadata message, if any, now (see metadata_interval);
  /// receive_until() does this before it waits.
  void flush_metadata() {
    if (!held_metadata_) return;
    Message m = std::move(*held_metadata_);
    held_metadata_.reset();
    next_metadata_ = std::chrono::steady_clock::now() + config_.metadata_interval;
    send_now(std::move(m));
  }

  /// A frame if one is here, without blocking; after an empty receive the
  /// socket is asked again only once receive_poll_interval has passed. A held
  /// metadata message whose interval has passed is sent first.
  std::optional<Message> try_receive() {
    if (config_.receive_poll_interval == Duration::zero() && !held_metadata_) return receive(0);
    const auto now = std::chrono::steady_clock::now();
    if (held_metadata_ && now >= next_metadata_) flush_metadata();
    if (config_.receive_poll_interval == Duration::zero()) return receive(0);
    if (now < next_receive_) return std::nullopt;
    auto m = receive(0);
    if (!m) next_receive_ = now + config_.receive_poll_interval;
    return m;
  }

  std::optional<Message> receive_until(TimePoint deadline) {
    flush_metadata();  // about to wait: the syncer hears the newest step now
    for (;;) {
      if (auto m = receive(0)) return m;
      const TimePoint now = clock_->now();
      if (now >= deadline) return std::nullopt;
      zmq_pollitem_t items[2] = {{dealer_, 0, ZMQ_POLLIN, 0}, {monitor_, 0, ZMQ_POLLIN, 0}};
      const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
      zmq_poll(items, 2, static_cast<long>(std::clamp<long long>(wait, 1, 1000)));
      if (items[1].revents & ZMQ_POLLIN) drain_monitor();
    }
  }

  [[nodiscard]] const ZmqCounters& counters() const noexcept { return counters_; }

  /// Waiting on several links at once (ShardedLearnerTransport, PollableLink):
  /// poll_items() fills two items (the DEALER and its monitor), wait_any()
  /// polls any number of them for at most `wait`, after_poll() handles what
  /// the monitor reported.
  using PollItem = zmq_pollitem_t;
  void poll_items(zmq_pollitem_t* two) const noexcept {
    two[0] = {dealer_, 0, ZMQ_POLLIN, 0};
    two[1] = {monitor_, 0, ZMQ_POLLIN, 0};
  }
  void after_poll(const zmq_pollitem_t* two) {
    if (two[0].revents & ZMQ_POLLIN) next_receive_ = {};  // a frame is here: the next try_receive() takes it
    if (two[1].revents & ZMQ_POLLIN) drain_monitor();
  }
  static void wait_any(zmq_pollitem_t* items, std::size_t n, Duration wait) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(wait).count();
    zmq_poll(items, static_cast<int>(n), static_cast<long>(std::clamp<long long>(ms, 1, 1000)));
  }

  /// What the socket monitor has seen of the connection to the syncer.
  struct LinkEvents {
    std::uint64_t connects = 0;           ///< TCP connections made
    std::uint64_t connect_retries = 0;    ///< TCP connects refused or timed out, retried
    std::uint64_t disconnects = 0;
    std::uint64_t handshakes = 0;         ///< ZMTP handshakes completed (authenticated under CURVE)
    std::uint64_t auth_failures = 0;      ///< ZAP refused this learner's key (since the last handshake)
    std::uint64_t protocol_failures = 0;  ///< ZMTP protocol errors, e.g. mechanism mismatch (same)
    std::uint64_t silent_failures = 0;    ///< handshakes the peer closed without a reason (same)
    int last_auth_status = 0;             ///< ZAP status code of the last auth failure (400: denied)
    int last_protocol_error = 0;          ///< ZMQ_PROTOCOL_ERROR_* of the last protocol failure
  };
  [[nodiscard]] LinkEvents link_events() {
    drain_monitor();
    return events_;
  }

  /// DiagnosingTransport: why this link cannot work as configured, when the
  /// handshake says so (empty otherwise). What libzmq 4.3 reports, measured:
  ///   key not on the syncer's allow-list  -> HANDSHAKE_FAILED_AUTH, ZAP status 400
  ///   plaintext vs CURVE (either side)    -> HANDSHAKE_FAILED_PROTOCOL, mechanism mismatch
  ///   wrong syncer public key             -> HANDSHAKE_FAILED_NO_DETAIL (the syncer cannot
  ///                                          decrypt our HELLO and closes), on every retry
  /// Which side notices a mechanism mismatch first is a race: the learner may
  /// see the syncer hang up (NO_DETAIL) instead of the mismatch, so a silent
  /// failure counts only once it happened 3 times (each retry is another draw,
  /// and one syncer stopping mid-handshake is not a configuration error), and
  /// its message names both possible causes. A handshake that succeeds clears
  /// earlier failures (a syncer restarted with the right keys).
  [[nodiscard]] std::optional<std::string> link_failure() {
    drain_monitor();
    const std::string& at = config_.connect;
    if (events_.auth_failures > 0) {
      return detail::msg("the syncer at ", at, " refused this learner's CURVE key (ZAP status ",
                         events_.last_auth_status, "): public key ", config_.security.own.public_key,
                         " is not on its allow-list; add the line '", config_.id, " ",
                         config_.security.own.public_key,
                         "' to the syncer's --allow file and restart the syncer, or use the key file that line "
                         "was made from (--keys)");
    }
    if (events_.protocol_failures > 0) {
      if (events_.last_protocol_error == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
        return config_.security.curve
                   ? detail::msg("the syncer at ", at, " runs without encryption (--plaintext) but this learner "
                                 "uses CURVE; give the syncer --keys and --allow, or run both with --plaintext")
                   : detail::msg("the syncer at ", at, " requires CURVE encryption but this learner connects in "
                                 "plaintext; pass --keys (this learner's key file) and --server-key (the "
                                 "syncer's syncer.pub) instead of --plaintext");
      }
      return detail::msg("the ZeroMQ handshake with ", at, " failed (protocol error 0x", std::hex,
                         events_.last_protocol_error, std::dec,
                         "); is that endpoint a ddiloco syncer, of a compatible version?");
    }
    if (events_.silent_failures >= 3) {
      return config_.security.curve
                 ? detail::msg("the syncer at ", at, " closed the connection during the CURVE handshake ",
                               events_.silent_failures, " times: the syncer public key this learner was given "
                               "(--server-key, ", config_.security.server_public_key,
                               ") is most likely not the syncer's (it cannot decrypt our hello); copy the "
                               "syncer's .pub file from the syncer host. (A syncer that runs --plaintext, or "
                               "crashes while accepting, can look the same: check its log.)")
                 : detail::msg("the syncer at ", at, " closed the connection during the ZeroMQ handshake ",
                               events_.silent_failures, " times: it most likely requires CURVE encryption and "
                               "this learner connects in plaintext; pass --keys (this learner's key file) and "
                               "--server-key (the syncer's syncer.pub) instead of --plaintext (or the endpoint "
                               "is not a ddiloco syncer)");
    }
    return std::nullopt;
  }

  /// DiagnosingTransport: what the link saw, for a join that timed out.
  [[nodiscard]] std::string link_summary() {
    drain_monitor();
    const std::string& at = config_.connect;
    if (events_.connects == 0 && events_.connect_retries > 0) {
      return detail::msg("nothing accepted a TCP connection at ", at, " (", events_.connect_retries,
                         " attempts refused or unanswered): no syncer is listening there; check that the syncer "
                         "is running and that --connect's host and port match its --bind");
    }
    if (events_.connects == 0) {
      return detail::msg("no TCP connection to ", at, " completed: the host may be down or unreachable, or a "
                         "firewall drops the packets; check --connect and the network");
    }
    if (events_.handshakes == 0) {
      return detail::msg("connected to ", at, " but the ZeroMQ handshake never completed: is that endpoint a "
                         "ddiloco syncer?");
    }
    return detail::msg("connected", config_.security.curve ? " and authenticated" : "", " to the syncer at ", at,
                       ", but it did not answer: it may be overloaded or stalled (see its log and status), or "
                       "an older syncer that ignores a request for another plan");
  }

 private:
  /// Encodes m and hands it to ZeroMQ without blocking; false (counted) on
  /// back-pressure.
  bool send_now(Message&& m) {
    std::vector<std::byte> with_feedback;  // the payload encoded with the residual carried in
    if (m.type == MessageType::contribution && config_.error_feedback && m.payload) {
      if (!feedback_) feedback_.emplace(config_.codec);
      with_feedback = feedback_->encode(m.fragment, *m.payload);
      const std::size_t elements = m.payload->size();
      m.payload.reset();
      m.encoded = EncodedPayload{config_.codec, elements, with_feedback, nullptr};
    }
    // The frame the payload was written into (contribution_buffer), else a pooled one.
    std::shared_ptr<detail::FrameBlock> frame =
        framer_.frame(m, m.type == MessageType::contribution ? config_.codec : Codec::fp32);
    const std::size_t size = frame->size;
    m = Message{};  // drop the sender's reference: ZeroMQ's is the last one
    if (detail::send_frame_zero_copy(dealer_, std::move(frame), ZMQ_DONTWAIT) < 0) {
      ++counters_.send_dropped;  // no connection (IMMEDIATE) or high-water mark: back-pressure
      return false;
    }
    ++counters_.frames_out;
    counters_.bytes_out += size;
    return true;
  }

  std::optional<Message> receive(int flags) {
    if (dealer_ == nullptr) throw TransportError("ZmqLearnerTransport: closed");
    for (;;) {
      detail::ReceivedFrame frame;
      if (!frame.receive(dealer_, flags | ZMQ_DONTWAIT)) return std::nullopt;
      const std::span<const std::byte> bytes = frame.head_bytes();
      ++counters_.frames_in;
      counters_.bytes_in += frame.size();
      // A learner receives only full_state, global_fragment, join_refused,
      // rejoin and pull: anything else is refused on its header byte, before decoding.
      if (bytes.size() >= kFrameHeaderSize) {
        const auto t = static_cast<MessageType>(std::to_integer<std::uint8_t>(bytes[detail::frame_offset::type]));
        if (t != MessageType::full_state && t != MessageType::global_fragment && t != MessageType::join_refused &&
            t != MessageType::rejoin && t != MessageType::pull) {
          ++counters_.wrong_direction;
          ++counters_.decode_errors;
          continue;
        }
      }
      DecodeResult r = frame.decode(config_.limits, &payloads_);
      counters_.wire.record(r);
      counters_.payload_buffers_reused = payloads_.reused();
      if (r.ok()) return std::move(r).value();
      ++counters_.decode_errors;
    }
  }

  /// Reads every pending monitor event (two parts each: event + value, endpoint).
  void drain_monitor() {
    if (monitor_ == nullptr) return;
    for (;;) {
      const auto e = detail::next_monitor_event(monitor_);
      if (!e) return;
      const auto [event, value] = *e;
      switch (event) {
        case ZMQ_EVENT_CONNECTED: ++events_.connects; break;
        case ZMQ_EVENT_CONNECT_RETRIED: ++events_.connect_retries; break;
        case ZMQ_EVENT_DISCONNECTED: ++events_.disconnects; break;
        case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
          ++events_.handshakes;
          events_.auth_failures = events_.protocol_failures = events_.silent_failures = 0;
          break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
          ++events_.auth_failures;
          events_.last_auth_status = static_cast<int>(value);
          break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
          ++events_.protocol_failures;
          events_.last_protocol_error = static_cast<int>(value);
          break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL: ++events_.silent_failures; break;
        default: break;
      }
    }
  }

  void close() {
    if (dealer_ != nullptr) zmq_socket_monitor(dealer_, nullptr, 0);
    if (monitor_ != nullptr) zmq_close(monitor_);
    monitor_ = nullptr;
    if (dealer_ != nullptr) zmq_close(dealer_);
    dealer_ = nullptr;
    if (context_ != nullptr) zmq_ctx_term(context_);
    context_ = nullptr;
  }

  ZmqLearnerConfig config_;
  const Clock* clock_;
  void* context_ = nullptr;
  void* dealer_ = nullptr;
  void* monitor_ = nullptr;  ///< PAIR socket reading dealer_'s monitor events
  LinkEvents events_{};
  std::optional<ErrorFeedbackEncoder> feedback_;
  detail::LendingFramer framer_;
  ZmqCounters counters_{};
  PayloadPool payloads_{config_.idle_payload_buffers};  ///< received globals' vectors, recycled
  std::chrono::steady_clock::time_point next_receive_{};  ///< try_receive(): the socket is not asked before
  std::chrono::steady_clock::time_point next_metadata_{};  ///< no metadata frame goes out before (metadata_interval)
  std::optional<Message> held_metadata_;  ///< the newest metadata not sent yet
};

// ---- the global-model view ------------------------------------------------

/// The syncer's current global parameters, as an observer fetched them.
struct GlobalView {
  std::uint64_t fingerprint = 0;          ///< the syncer's plan fingerprint
  std::vector<std::uint64_t> versions;    ///< per fragment
  std::vector<Payload> fragments;         ///< per fragment, in fragment order (Plan::offset_in_fragment)

  /// Every tensor's values in plan order (Plan::tensors(), flat), checked
  /// against `plan`: ProtocolError if it is another plan.
  [[nodiscard]] std::vector<float> in_plan_order(const Plan& plan) const {
    if (fingerprint != plan.fingerprint() || fragments.size() != plan.num_fragments())
      throw ProtocolError(detail::msg("GlobalView: the syncer's plan (fingerprint ", detail::hex16(fingerprint),
                                      ", ", fragments.size(), " fragments) is not this plan (fingerprint ",
                                      detail::hex16(plan.fingerprint()), ", ", plan.num_fragments(),
                                      " fragments); build the plan from the syncer's model and --fragments"));
    std::vector<std::size_t> offset(plan.num_tensors() + 1, 0);
    for (std::size_t t = 0; t < plan.num_tensors(); ++t) offset[t + 1] = offset[t] + plan.tensors()[t].numel;
    std::vector<float> flat(plan.total_numel());
    for (std::size_t p = 0; p < fragments.size(); ++p)
      for (std::size_t t : plan.fragments()[p].tensors)
        std::copy_n(fragments[p]->data() + plan.offset_in_fragment(t), plan.tensors()[t].numel,
                    flat.data() + offset[t]);
    return flat;
  }
};

/// A read-only observer of the run: fetches the syncer's current global state
/// without contributing (for evaluation and export). It sends `observe`
/// requests (MessageType::observe) and is never a learner: the syncer does not
/// count it in quorum, liveness or membership, and answers it at most once per
/// SyncerConfig::observe_interval. Under CURVE it authenticates like a
/// learner, so its id and key must be on the allow-list: give it an id of its
/// own (not a training learner's, whose replies would then reach it).
/// Connection problems are diagnosed as for a learner (link_failure). Used
/// from one thread.
class ZmqObserver {
 public:
  ZmqObserver(ZmqLearnerConfig config, const Clock& clock) : link_(std::move(config), clock) {}

  /// The current global state. `fingerprint` 0 takes whatever plan the syncer
  /// has; another value must be the syncer's (else ProtocolError naming both).
  /// The request is repeated every `retry` (a rate-limited or lost one goes
  /// unanswered); throws TransportError after `timeout` or at once when the
  /// link cannot work (refused key, mismatched security).
  GlobalView fetch(std::uint64_t fingerprint = 0, Duration timeout = std::chrono::seconds(30),
                   Duration retry = std::chrono::milliseconds(1100)) {
    const Clock& clock = link_.clock();
    const TimePoint deadline = clock.now() + timeout;
    const std::uint64_t nonce = ++nonce_ | (static_cast<std::uint64_t>(clock.now().count()) << 20);
    GlobalView view;
    std::size_t received = 0;
    TimePoint sent{0};
    bool ever_sent = false;
    for (;;) {
      if (!ever_sent || clock.now() - sent >= retry) {
        Message m;
        m.type = MessageType::observe;
        m.fingerprint = fingerprint;
        m.learner = id();
        m.sequence = nonce;
        link_.send(std::move(m));
        sent = clock.now();
        ever_sent = true;
      }
      auto m = link_.receive_until(std::min(deadline, sent + retry));
      if (auto why = link_.link_failure())
        throw TransportError(detail::msg("ZmqObserver: observer ", id(), " cannot fetch the global state: ", *why));
      if (m && m->sequence == nonce && m->learner == id()) {
        if (m->type == MessageType::join_refused) throw ProtocolError(refusal_text(*m, fingerprint));
        if (m->type == MessageType::full_state && m->step > 0 && m->step <= (std::uint64_t{1} << 20) && m->payload) {
          if (view.fragments.empty() || view.fingerprint != m->fingerprint) {
            view = GlobalView{m->fingerprint, std::vector<std::uint64_t>(m->step, 0),
                              std::vector<Payload>(m->step)};
            received = 0;
          }
          if (m->fragment < view.fragments.size() && view.fragments.size() == m->step) {
            if (!view.fragments[m->fragment]) ++received;
            view.fragments[m->fragment] = m->payload;
            view.versions[m->fragment] = m->version;
            if (received == view.fragments.size()) return view;
          }
        }
        continue;
      }
      if (!m && clock.now() >= deadline) {
        throw TransportError(detail::msg("ZmqObserver: observer ", id(), " received ", received, " of ",
                                         view.fragments.empty() ? std::string("the") : std::to_string(view.fragments.size()),
                                         " fragments of the global state within ",
                                         std::chrono::duration<double>(timeout).count(), " s; ", link_.link_summary()));
      }
    }
  }

  [[nodiscard]] ZmqLearnerTransport& transport() noexcept { return link_; }

 private:
  [[nodiscard]] LearnerId id() const noexcept { return link_.id(); }

  static std::string refusal_text(const Message& m, std::uint64_t ours) {
    if (static_cast<JoinRefusal>(m.fragment) == JoinRefusal::identity)
      return detail::msg("ZmqObserver: the syncer refused observer ", m.learner,
                         ": its key is on the allow-list for learner id ", m.version, "; observe with --id ",
                         m.version, " or give the observer its own allow-list line");
    return detail::msg("ZmqObserver: the syncer refused observer ", m.learner, ": its plan (fingerprint ",
                       detail::hex16(m.fingerprint), ", ", m.version, " fragments, ", m.step,
                       " parameters) is not the one asked for (fingerprint ", detail::hex16(ours),
                       "); build the plan from the syncer's model and --fragments, or ask for fingerprint 0");
  }

  ZmqLearnerTransport link_;
  std::uint64_t nonce_ = 0;
};

/// One fetch through a fresh ZmqObserver (connects, fetches, disconnects).
inline GlobalView fetch_global(ZmqLearnerConfig config, std::uint64_t fingerprint = 0,
                               Duration timeout = std::chrono::seconds(30)) {
  SteadyClock clock;
  ZmqObserver observer(std::move(config), clock);
  return observer.fetch(fingerprint, timeout);
}

}  // namespace ddiloco
