// ddiloco/transport/zmq.hpp: the learner/syncer protocol over ZeroMQ.
//
// What it is: `ZmqSyncerTransport` (a ROUTER socket the syncer binds) and
// `ZmqLearnerTransport` (a DEALER socket a learner connects), modelling the
// `SyncerTransport` / `LearnerTransport` concepts of message.hpp. Frames are
// the wire format of wire.hpp (validated before anything touches state; every
// decode failure is counted by kind). ZeroMQ reconnects by itself; peers come
// and go; high-water marks give back-pressure (a send that would block returns
// false); ZMTP heartbeats detect dead connections. Frames are handed to ZeroMQ
// without a copy (zmq_msg_init_data; ZeroMQ frees them once written).
//
// Security: CURVE encryption and authentication by default. The syncer runs a
// ZAP handler with an allow-list that binds each learner id to one public key:
// a learner whose key is not listed cannot connect, and a listed key can only
// speak for its own learner id. Routing ids are assigned by the ROUTER, never
// chosen by a peer, so no connection can take over another learner's replies. Plain text must be chosen explicitly
// (`ZmqSecurity::plaintext()`). Keys are Z85 text; `ddiloco_keygen` writes them.
//
// Threading: the syncer side owns its sockets on one I/O thread; send_to() may
// be called from any thread (the runtime's merge workers), receive from one.
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
#include <ddiloco/message.hpp>
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

struct ZmqCounters {
  std::uint64_t frames_in = 0, frames_out = 0, bytes_in = 0, bytes_out = 0;
  std::uint64_t send_dropped = 0;         ///< high-water mark reached or peer unknown
  std::uint64_t decode_errors = 0;        ///< frames that failed validation
  std::uint64_t impersonations = 0;       ///< authenticated key spoke for another learner id
  std::uint64_t auth_denied = 0;          ///< ZAP refusals (unknown keys)
  WireCounters wire{};                    ///< decode failures by kind
};

namespace detail {

inline void zmq_check(int rc, const char* what) {
  if (rc != 0) throw TransportError(msg(what, ": ", zmq_strerror(zmq_errno())));
}

inline void set_int(void* s, int option, int value, const char* what) {
  zmq_check(zmq_setsockopt(s, option, &value, sizeof value), what);
}

/// ZeroMQ's hold on a frame until it is sent. The mutex is a handoff the race
/// detector can see: ZeroMQ passes messages between its threads with its own
/// lock-free queues (not instrumented), so without it ThreadSanitizer could not
/// tell that the sender's last touch of the block comes before ZeroMQ's thread
/// lets it go, and reported the block's later free as a race.
struct ZmqHold {
  std::mutex handoff;
  std::shared_ptr<FrameBlock> block;
};

/// Sends a pooled frame as one message without copying it: ZeroMQ holds a
/// reference to the block until the bytes are written out (or dropped), then the
/// block returns to its pool (on ZeroMQ's I/O thread). A copying zmq_send of a
/// 16 MiB fragment costs a fresh 16 MiB buffer (page faults) plus the copy;
/// bench/bench_transport.cpp measures both. Returns what zmq_msg_send returns
/// (< 0 on failure, the block then given back here).
inline int send_frame_zero_copy(void* socket, std::shared_ptr<FrameBlock> block, int flags) {
  auto* hold = new ZmqHold;
  void* data = nullptr;
  std::size_t size = 0;
  {
    std::lock_guard lock(hold->handoff);  // released before ZeroMQ can call `release`
    hold->block = std::move(block);
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
};

/// The ZAP handler (RFC 27): accepts a CURVE client whose public key is in
/// the allow-list and tags its connection with the learner id as User-Id.
class ZapHandler {
 public:
  ZapHandler(void* context, std::map<LearnerId, std::string> allowed, std::atomic<std::uint64_t>& denied)
      : allowed_(std::move(allowed)), denied_(&denied) {
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
      if (frames.size() >= 7 && frames[0] == "1.0" && frames[5] == "CURVE" && frames[6].size() == 32) {
        char z85[41] = {};
        zmq_z85_encode(z85, reinterpret_cast<const std::uint8_t*>(frames[6].data()), 32);
        for (const auto& [id, key] : allowed_)
          if (key == z85) {
            status = "200";
            text = "OK";
            user = std::to_string(id);
          }
      }
      if (status != "200") denied_->fetch_add(1);
      const std::string request_id = frames.size() > 1 ? frames[1] : std::string();
      const std::string reply[] = {"1.0", request_id, status, text, user, ""};
      for (std::size_t i = 0; i < 6; ++i)
        zmq_send(socket_, reply[i].data(), reply[i].size(), i + 1 < 6 ? ZMQ_SNDMORE : 0);
    }
  }

  void* socket_ = nullptr;
  std::map<LearnerId, std::string> allowed_;
  std::atomic<std::uint64_t>* denied_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace detail

struct ZmqSyncerConfig {
  std::string bind = "tcp://127.0.0.1:5555";  ///< loopback by default; tcp://0.0.0.0:PORT for other hosts
  ZmqSecurity security{};
  Codec global_codec = Codec::fp32;           ///< codec of the fragments sent to learners
  int send_hwm = 1000;                        ///< frames queued per peer before sends are refused
  int recv_hwm = 1000;
  Duration heartbeat_interval = std::chrono::seconds(1);
  Duration heartbeat_timeout = std::chrono::seconds(5);
  DecodeLimits limits{};
  /// Contributions are handed to the syncer in their wire encoding
  /// (Message::encoded, holding the received buffer) instead of decoded to
  /// fp32: the frame is still checked here (header, sizes, checksums, valid
  /// codes), and the syncer folds the bytes into its accumulator with the
  /// fused decode (no copy of the payload between the socket and the
  /// accumulator; docs/performance.md). Off: every payload is decoded to fp32 here.
  bool keep_contributions_encoded = false;
};

/// The syncer's end: binds a ROUTER socket and serves any number of learners.
class ZmqSyncerTransport {
 public:
  explicit ZmqSyncerTransport(ZmqSyncerConfig config, const Clock& clock)
      : config_(std::move(config)), clock_(&clock) {
    context_ = zmq_ctx_new();
    if (context_ == nullptr) throw TransportError("zmq_ctx_new failed");
    try {
      if (config_.security.curve) {
        detail::check_z85_key(config_.security.own.public_key, "syncer public key");
        detail::check_z85_key(config_.security.own.secret_key, "syncer secret key");
        if (config_.security.allowed.empty())
          throw InvalidArgument("ZmqSyncerConfig: CURVE needs an allow-list of learner keys (or choose plaintext)");
        zap_.emplace(context_, config_.security.allowed, denied_);
      }
      router_ = zmq_socket(context_, ZMQ_ROUTER);
      detail::set_int(router_, ZMQ_ROUTER_MANDATORY, 1, "ZMQ_ROUTER_MANDATORY");
      detail::set_int(router_, ZMQ_SNDHWM, config_.send_hwm, "ZMQ_SNDHWM");
      detail::set_int(router_, ZMQ_RCVHWM, config_.recv_hwm, "ZMQ_RCVHWM");
      detail::set_int(router_, ZMQ_LINGER, 0, "ZMQ_LINGER");
      detail::set_int(router_, ZMQ_HEARTBEAT_IVL, ms(config_.heartbeat_interval), "ZMQ_HEARTBEAT_IVL");
      detail::set_int(router_, ZMQ_HEARTBEAT_TIMEOUT, ms(config_.heartbeat_timeout), "ZMQ_HEARTBEAT_TIMEOUT");
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

  bool send_to(LearnerId id, Message&& m) {
    std::shared_ptr<detail::FrameBlock> frame = frame_of(m);
    {
      std::lock_guard lock(mutex_);
      if (outgoing_.size() >= static_cast<std::size_t>(config_.send_hwm) * 4) {
        ++counters_.send_dropped;
        return false;
      }
      outgoing_.push_back({id, std::move(frame)});
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
    return c;
  }

 private:
  struct Outgoing {
    LearnerId to;
    std::shared_ptr<detail::FrameBlock> frame;
  };

  /// m's frame in a pooled buffer. A merge sends the same global fragment (one
  /// shared payload) to every learner: it is encoded and checksummed for the
  /// first, and each further frame copies the encoded payload and its CRC and
  /// writes its own header.
  std::shared_ptr<detail::FrameBlock> frame_of(const Message& m) {
    const Codec codec = config_.global_codec;
    const std::size_t size = frame_size(m, codec);
    auto block = pool_->acquire(size);
    const std::span<std::byte> out(block->data.get(), size);
    std::shared_ptr<detail::FrameBlock> previous;
    {
      std::lock_guard lock(frame_cache_mutex_);
      if (m.payload && m.payload == cached_payload_ && cached_frame_ && cached_frame_->size == size) {
        previous = cached_frame_;
      }
    }
    if (previous) {
      std::memcpy(out.data() + kFrameHeaderSize, previous->data.get() + kFrameHeaderSize, size - kFrameHeaderSize);
      finish_frame(m, codec, frame_payload_crc(std::span<const std::byte>(previous->data.get(), size)), out);
      return block;
    }
    encode_frame_into(m, codec, out);
    if (m.payload) {
      std::lock_guard lock(frame_cache_mutex_);
      cached_payload_ = m.payload;
      cached_frame_ = block;
    }
    return block;
  }

  static int ms(Duration d) { return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()); }

  std::optional<Message> pop_locked() {
    if (incoming_.empty()) return std::nullopt;
    Message m = std::move(incoming_.front());
    incoming_.pop_front();
    return m;
  }

  void wake() {
    std::lock_guard lock(wake_mutex_);
    if (wake_send_ != nullptr) zmq_send(wake_send_, "", 0, ZMQ_DONTWAIT);
  }

  void io_loop() {
    while (!stop_.load()) {
      zmq_pollitem_t items[2] = {{router_, 0, ZMQ_POLLIN, 0}, {wake_recv_, 0, ZMQ_POLLIN, 0}};
      zmq_poll(items, 2, 100);
      if (items[1].revents & ZMQ_POLLIN) {
        char b;
        while (zmq_recv(wake_recv_, &b, 1, ZMQ_DONTWAIT) >= 0) {
        }
      }
      flush_outgoing();
      if (items[0].revents & ZMQ_POLLIN) receive_all();
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
        if (auto it = routes_.find(o.to); it != routes_.end()) rid = it->second;
      }
      const std::size_t size = o.frame->size;
      const bool ok = !rid.empty() && zmq_send(router_, rid.data(), rid.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0 &&
                      detail::send_frame_zero_copy(router_, std::move(o.frame), ZMQ_DONTWAIT) >= 0;
      std::lock_guard lock(mutex_);
      if (ok) {
        ++counters_.frames_out;
        counters_.bytes_out += size;
      } else {
        ++counters_.send_dropped;  // unknown peer (EHOSTUNREACH) or high-water mark (EAGAIN)
      }
    }
  }

  void receive_all() {
    for (;;) {
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
      const std::span<const std::byte> bytes(static_cast<const std::byte*>(zmq_msg_data(&body->msg)),
                                             zmq_msg_size(&body->msg));
      {
        std::lock_guard lock(mutex_);
        ++counters_.frames_in;
        counters_.bytes_in += bytes.size();
      }
      // Decoding (validation + payload conversion) happens outside the lock.
      DecodeResult r = config_.keep_contributions_encoded ? decode_frame_keep_encoded(bytes, config_.limits, body)
                                                          : decode_frame(bytes, config_.limits);
      {
        std::lock_guard lock(mutex_);
        counters_.wire.record(r);
        if (extra || !r.ok()) {
          ++counters_.decode_errors;
        } else if (user != nullptr && std::to_string(r.value().learner) != user) {
          ++counters_.impersonations;  // a listed key speaking for another learner id
        } else {
          // The connection this learner spoke from last is where its replies go
          // (a restarted learner comes back on a new connection).
          routes_[r.value().learner] =
              std::string(static_cast<const char*>(zmq_msg_data(&rid)), zmq_msg_size(&rid));
          incoming_.push_back(std::move(r).value());
          arrived_.notify_one();
        }
      }
      zmq_msg_close(&rid);
    }
  }

  void close_sockets() {
    std::lock_guard lock(wake_mutex_);
    for (void** s : {&router_, &wake_recv_, &wake_send_})
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
  std::mutex wake_mutex_;
  std::atomic<std::uint64_t> denied_{0};
  std::optional<detail::ZapHandler> zap_;
  std::string endpoint_;
  mutable std::mutex mutex_;
  std::condition_variable arrived_;
  std::deque<Message> incoming_;
  std::deque<Outgoing> outgoing_;
  std::shared_ptr<detail::FramePool> pool_ = std::make_shared<detail::FramePool>();
  std::mutex frame_cache_mutex_;
  Payload cached_payload_;                          ///< the payload of the last frame encoded ...
  std::shared_ptr<detail::FrameBlock> cached_frame_;  ///< ... and that frame (see frame_of)
  std::map<LearnerId, std::string> routes_;  ///< learner id -> ROUTER routing id of its latest connection
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
  Duration heartbeat_interval = std::chrono::seconds(1);
  Duration heartbeat_timeout = std::chrono::seconds(5);
  DecodeLimits limits{};
};

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
      detail::set_int(dealer_, ZMQ_IMMEDIATE, config_.immediate ? 1 : 0, "ZMQ_IMMEDIATE");
      detail::set_int(dealer_, ZMQ_RECONNECT_IVL, 100, "ZMQ_RECONNECT_IVL");
      detail::set_int(dealer_, ZMQ_RECONNECT_IVL_MAX, 2000, "ZMQ_RECONNECT_IVL_MAX");
      detail::set_int(dealer_, ZMQ_HEARTBEAT_IVL, ms(config_.heartbeat_interval), "ZMQ_HEARTBEAT_IVL");
      detail::set_int(dealer_, ZMQ_HEARTBEAT_TIMEOUT, ms(config_.heartbeat_timeout), "ZMQ_HEARTBEAT_TIMEOUT");
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

  std::optional<Message> try_receive() { return receive(0); }

  std::optional<Message> receive_until(TimePoint deadline) {
    for (;;) {
      if (auto m = receive(0)) return m;
      const TimePoint now = clock_->now();
      if (now >= deadline) return std::nullopt;
      zmq_pollitem_t item{dealer_, 0, ZMQ_POLLIN, 0};
      const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
      zmq_poll(&item, 1, static_cast<long>(std::clamp<long long>(wait, 1, 1000)));
    }
  }

  [[nodiscard]] const ZmqCounters& counters() const noexcept { return counters_; }

 private:
  static int ms(Duration d) { return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()); }

  std::optional<Message> receive(int flags) {
    if (dealer_ == nullptr) throw TransportError("ZmqLearnerTransport: closed");
    for (;;) {
      zmq_msg_t body;
      zmq_msg_init(&body);
      if (zmq_msg_recv(&body, dealer_, flags | ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&body);
        return std::nullopt;
      }
      const std::span<const std::byte> bytes(static_cast<const std::byte*>(zmq_msg_data(&body)), zmq_msg_size(&body));
      DecodeResult r = decode_frame(bytes, config_.limits);
      ++counters_.frames_in;
      counters_.bytes_in += bytes.size();
      zmq_msg_close(&body);
      counters_.wire.record(r);
      if (r.ok()) return std::move(r).value();
      ++counters_.decode_errors;
    }
  }

  void close() {
    if (dealer_ != nullptr) zmq_close(dealer_);
    dealer_ = nullptr;
    if (context_ != nullptr) zmq_ctx_term(context_);
    context_ = nullptr;
  }

  ZmqLearnerConfig config_;
  const Clock* clock_;
  void* context_ = nullptr;
  void* dealer_ = nullptr;
  std::optional<ErrorFeedbackEncoder> feedback_;
  detail::LendingFramer framer_;
  ZmqCounters counters_{};
};

}  // namespace ddiloco
