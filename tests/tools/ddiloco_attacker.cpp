// ddiloco_attacker: the attacks of the project's attack suite (docs/security.md),
// as one test tool that speaks the wire protocol to a ddiloco_syncer, in
// plaintext or under CURVE with a listed key (--keys, --server-key).
//
// --attack picks one:
//   poison              joins as --id and sends contributions whose payload is
//                       --magnitude per element (about 1000x an honest outer
//                       gradient's) with steps = tokens = 2^--counter-log2, at --rate/s;
//                       with --pull it also sends metadata each time and answers
//                       every pull with such a contribution (a pull-round learner).
//   contribution-flood  the same at a higher rate, every --nan-every'th payload
//                       holding NaN in half its elements.
//   join-flood          joins at --rate/s: with --fresh-ids a new id each time
//                       (--id, --id + 1, ...), else always --id with a new nonce
//                       (a listed CURVE key re-joining as itself); replies are read
//                       and discarded.
//   slow-reader         --peers connections, ids --id .. --id + peers - 1, join and
//                       send heartbeats but never read; after --hold-ms they leave
//                       and disconnect.
//   huge-frame          one frame of --frame-bytes payload bytes (a full_state, a
//                       type the syncer never takes) with a valid payload CRC.
// Each runs for --count messages (0: until SIGTERM/SIGINT) and prints what it sent
// ("attacker: <attack> sent N ...") every --report-every messages and at the end.
// What it is not: a fuzzer (tests/fuzz/), nor the malformed-frame client
// (ddiloco_chaos_client).
#include <ddiloco/detail/checksum.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/reference/char_lm.hpp>
#include <ddiloco/transport/zmq.hpp>
#include <ddiloco/wire.hpp>

#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli.hpp"

using namespace ddiloco;
using Clock_ = std::chrono::steady_clock;

namespace {

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }

struct Options {
  std::string connect;
  bool curve = false;
  CurveKeys own;
  std::string server_public_key;
};

/// A DEALER socket connected to the syncer (CURVE when keys were given).
void* open_socket(void* context, const Options& o, int rcvhwm, int rcvbuf) {
  void* s = zmq_socket(context, ZMQ_DEALER);
  if (s == nullptr) throw TransportError("attacker: cannot create a socket");
  int linger = 2000;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(s, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm);
  if (rcvbuf > 0) zmq_setsockopt(s, ZMQ_RCVBUF, &rcvbuf, sizeof rcvbuf);
  if (o.curve) {
    zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, o.server_public_key.c_str(), 41);
    zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, o.own.public_key.c_str(), 41);
    zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, o.own.secret_key.c_str(), 41);
  }
  if (zmq_connect(s, o.connect.c_str()) != 0)
    throw TransportError(detail::msg("attacker: cannot connect to '", o.connect, "'"));
  return s;
}

/// Sends one frame; false when the socket would block (the frame is then not sent).
bool send_frame(void* socket, std::span<const std::byte> frame, bool block = true) {
  return zmq_send(socket, frame.data(), frame.size(), block ? 0 : ZMQ_DONTWAIT) >= 0;
}

/// One received, valid frame, or nullopt (nothing within `wait_ms`, or invalid).
std::optional<Message> receive(void* socket, long wait_ms) {
  zmq_pollitem_t item{socket, 0, ZMQ_POLLIN, 0};
  if (zmq_poll(&item, 1, wait_ms) <= 0) return std::nullopt;
  ddiloco::detail::ReceivedFrame frame;  // one part, or header and payload
  std::optional<Message> out;
  if (frame.receive(socket, ZMQ_DONTWAIT)) {
    auto r = frame.decode({});
    if (r.ok()) out = std::move(r).value();
  }
  return out;
}

Message control(MessageType type, const Plan& plan, LearnerId id) {
  Message m;
  m.type = type;
  m.fingerprint = plan.fingerprint();
  m.learner = id;
  return m;
}

/// Waits for the full state of every fragment after a join: versions and the sequence base.
struct Joined {
  std::vector<std::uint64_t> versions;
  std::uint64_t sequence = 0;
};
Joined join_and_wait(void* socket, const Plan& plan, LearnerId id, std::uint64_t nonce, long timeout_ms) {
  Message join = control(MessageType::join, plan, id);
  join.sequence = nonce;
  if (!send_frame(socket, encode_frame(join, Codec::fp32))) throw TransportError("attacker: sending the join failed");
  Joined j;
  j.versions.assign(plan.num_fragments(), 0);
  std::vector<bool> seen(plan.num_fragments(), false);
  std::size_t have = 0;
  const auto deadline = Clock_::now() + std::chrono::milliseconds(timeout_ms);
  while (have < plan.num_fragments()) {
    if (Clock_::now() >= deadline) throw TransportError("attacker: no full state after the join; is the syncer up?");
    const auto m = receive(socket, 100);
    if (!m) continue;
    if (m->type == MessageType::join_refused)
      throw TransportError(detail::msg("attacker: the syncer refused the join (reason ", m->fragment, ")"));
    if (m->type != MessageType::full_state || m->fragment >= plan.num_fragments()) continue;
    j.versions[m->fragment] = m->version;
    j.sequence = m->sequence;
    if (!seen[m->fragment]) {
      seen[m->fragment] = true;
      ++have;
    }
  }
  return j;
}

/// Sleeps until the n-th message of a run at `rate` per second is due (rate 0: no pause).
void pace(Clock_::time_point start, std::uint64_t n, double rate) {
  if (rate <= 0) return;
  const auto due = start + std::chrono::duration_cast<Clock_::duration>(std::chrono::duration<double>(static_cast<double>(n) / rate));
  while (g_signal.load() == 0 && Clock_::now() < due)
    std::this_thread::sleep_for(std::min<Clock_::duration>(due - Clock_::now(), std::chrono::milliseconds(50)));
}

bool keep_going(std::uint64_t sent, std::uint64_t count) { return g_signal.load() == 0 && (count == 0 || sent < count); }

/// poison and contribution-flood: hostile contributions from a joined learner.
int contributions(const cli::Flags& f, const Options& o, const Plan& plan, void* context, const std::string& attack) {
  const auto id = static_cast<LearnerId>(f.integer("id"));
  void* s = open_socket(context, o, 1000, 0);
  Joined j = join_and_wait(s, plan, id, 0xa77ac, f.integer("timeout-ms"));
  const auto counter = std::int64_t{1} << f.integer("counter-log2");
  const float magnitude = static_cast<float>(f.num("magnitude"));
  const std::uint64_t nan_every = f.count("nan-every"), count = f.count("count"), report = f.count("report-every");
  const double rate = f.num("rate");
  const bool advance = f.flag("advance-step"), pull = f.flag("pull");
  if (advance && f.integer("counter-log2") > 40)
    throw InvalidArgument("--advance-step with --counter-log2 = " + std::to_string(f.integer("counter-log2")) +
                          " would overflow the step counter; pass --counter-log2 40 or less");
  std::printf("attacker: %s as learner %u: payload %g per element, steps = tokens = 2^%lld, %g/s, NaN in every "
              "%llu-th\n",
              attack.c_str(), id, static_cast<double>(magnitude), f.integer("counter-log2"), rate,
              static_cast<unsigned long long>(nan_every));
  std::fflush(stdout);
  std::mt19937_64 rng(static_cast<std::uint64_t>(f.integer("seed")));
  std::uint64_t sent = 0, nan = 0, blocked = 0, ticks = 0, answers = 0;
  std::uint64_t step = 0;  // the step counter it sends (--advance-step, --pull)
  double norm_sum = 0;
  // One hostile contribution of fragment p, claiming `counter` steps and tokens at step counter `step`.
  const auto send_poison = [&](std::size_t p) {
    std::vector<float> v(plan.fragments()[p].numel);
    double sq = 0;
    for (auto& x : v) {
      x = (rng() & 1) != 0 ? magnitude : -magnitude;
      sq += static_cast<double>(x) * static_cast<double>(x);
    }
    const bool with_nan = nan_every > 0 && (sent + 1) % nan_every == 0;
    if (with_nan) {
      for (std::size_t i = 0; i < v.size(); i += 2) v[i] = std::numeric_limits<float>::quiet_NaN();
      ++nan;
    } else {
      norm_sum += std::sqrt(sq);
    }
    Message c = control(MessageType::contribution, plan, id);
    c.fragment = static_cast<std::uint32_t>(p);
    c.version = j.versions[p];
    c.sequence = ++j.sequence;
    c.steps = counter;
    c.tokens = counter;
    c.step = step;
    c.payload = make_payload(std::move(v));
    if (!send_frame(s, encode_frame(c, Codec::fp32), false)) ++blocked;
    ++sent;
    if (report > 0 && sent % report == 0) {
      std::printf("attacker: %s sent %llu contributions (%llu with NaN, %llu not queued, %llu answering pulls)\n",
                  attack.c_str(), static_cast<unsigned long long>(sent), static_cast<unsigned long long>(nan),
                  static_cast<unsigned long long>(blocked), static_cast<unsigned long long>(answers));
      std::fflush(stdout);
    }
  };
  std::vector<std::size_t> pulled;  // --pull: fragments the syncer asked this attacker for, not yet answered
  const auto start = Clock_::now();
  while (keep_going(sent, count)) {
    pace(start, ticks++, rate);
    if (g_signal.load() != 0) break;
    while (auto m = receive(s, 0)) {  // follow the versions (stay within the staleness bound)
      if ((m->type == MessageType::global_fragment || m->type == MessageType::full_state) &&
          m->fragment < plan.num_fragments())
        j.versions[m->fragment] = std::max(j.versions[m->fragment], m->version);
      if (pull && m->type == MessageType::pull && m->fragment < plan.num_fragments() &&
          std::find(pulled.begin(), pulled.end(), m->fragment) == pulled.end())
        pulled.push_back(m->fragment);
    }
    if (advance || pull) step += advance ? static_cast<std::uint64_t>(counter) : 1;
    if (pull) {  // a pull-round learner: metadata every tick, and each pull answered with poison
      Message meta = control(MessageType::metadata, plan, id);
      meta.step = step;
      meta.tokens = static_cast<std::int64_t>(step & 0x3fffffffffffffffULL);
      if (!send_frame(s, encode_frame(meta, Codec::fp32), false)) ++blocked;
      for (std::size_t p : pulled) {
        ++answers;
        send_poison(p);
      }
      pulled.clear();
    }
    send_poison(sent % plan.num_fragments());  // unasked (push rounds' way; pull rounds refuse it)
  }
  const auto finite = sent - nan;
  std::printf("attacker: %s done: sent %llu contributions (%llu with NaN, %llu not queued, %llu answering pulls), "
              "mean norm %.1f\n",
              attack.c_str(), static_cast<unsigned long long>(sent), static_cast<unsigned long long>(nan),
              static_cast<unsigned long long>(blocked), static_cast<unsigned long long>(answers),
              finite > 0 ? norm_sum / static_cast<double>(finite) : 0.0);
  zmq_close(s);
  return 0;
}

int join_flood(const cli::Flags& f, const Options& o, const Plan& plan, void* context) {
  const auto base = static_cast<LearnerId>(f.integer("id"));
  const bool fresh = f.flag("fresh-ids");
  void* s = open_socket(context, o, 1000, 0);
  const std::uint64_t count = f.count("count"), report = f.count("report-every");
  const double rate = f.num("rate");
  std::printf("attacker: join-flood %s from %u, %g/s\n", fresh ? "with fresh ids" : "re-joining as one id", base, rate);
  std::fflush(stdout);
  std::uint64_t sent = 0, replies = 0, blocked = 0;
  const auto start = Clock_::now();
  while (keep_going(sent, count)) {
    pace(start, sent, rate);
    if (g_signal.load() != 0) break;
    while (auto m = receive(s, 0)) ++replies;  // read and dropped: this is not the slow-reader attack
    Message join = control(MessageType::join, plan, fresh ? base + static_cast<LearnerId>(sent) : base);
    join.sequence = 0x10000 + sent;  // a new nonce every time
    if (!send_frame(s, encode_frame(join, Codec::fp32), false)) ++blocked;
    ++sent;
    if (report > 0 && sent % report == 0) {
      std::printf("attacker: join-flood sent %llu joins (%llu replies read, %llu not queued)\n",
                  static_cast<unsigned long long>(sent), static_cast<unsigned long long>(replies),
                  static_cast<unsigned long long>(blocked));
      std::fflush(stdout);
    }
  }
  std::printf("attacker: join-flood done: sent %llu joins (%llu replies read, %llu not queued)\n",
              static_cast<unsigned long long>(sent), static_cast<unsigned long long>(replies),
              static_cast<unsigned long long>(blocked));
  zmq_close(s);
  return 0;
}

int slow_reader(const cli::Flags& f, const Options& o, const Plan& plan, void* context) {
  const auto base = static_cast<LearnerId>(f.integer("id"));
  const std::size_t peers = f.count("peers");
  const auto hold = std::chrono::milliseconds(f.integer("hold-ms"));
  std::vector<void*> sockets;
  for (std::size_t i = 0; i < peers; ++i) {
    // A one-frame receive queue and a small kernel buffer: what the syncer
    // sends piles up on its side of the connection.
    void* s = open_socket(context, o, 1, 4096);
    Message join = control(MessageType::join, plan, base + static_cast<LearnerId>(i));
    join.sequence = 0x51000 + i;
    send_frame(s, encode_frame(join, Codec::fp32));
    sockets.push_back(s);
  }
  std::printf("attacker: slow-reader: %zu peers joined as %u..%zu, never reading; holding %lld ms\n", peers, base,
              base + peers - 1, static_cast<long long>(hold.count()));
  std::fflush(stdout);
  std::uint64_t beats = 0;
  const auto start = Clock_::now();
  while (g_signal.load() == 0 && (hold.count() == 0 || Clock_::now() - start < hold)) {
    for (std::size_t i = 0; i < peers; ++i)
      if (send_frame(sockets[i],
                     encode_frame(control(MessageType::heartbeat, plan, base + static_cast<LearnerId>(i)), Codec::fp32),
                     false))
        ++beats;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  for (std::size_t i = 0; i < peers; ++i) {
    send_frame(sockets[i], encode_frame(control(MessageType::leave, plan, base + static_cast<LearnerId>(i)), Codec::fp32),
               false);
    zmq_close(sockets[i]);
  }
  std::printf("attacker: slow-reader done: %zu peers sent %llu heartbeats, left and disconnected\n", peers,
              static_cast<unsigned long long>(beats));
  return 0;
}

int huge_frame(const cli::Flags& f, const Options& o, const Plan& plan, void* context) {
  const auto id = static_cast<LearnerId>(f.integer("id"));
  const std::uint64_t bytes = f.count("frame-bytes") / 4 * 4, count = std::max<std::uint64_t>(1, f.count("count"));
  void* s = open_socket(context, o, 1000, 0);
  for (std::uint64_t n = 0; n < count && g_signal.load() == 0; ++n) {
    // Built in place (zeros, their CRC, the header) and handed to ZeroMQ without a copy.
    auto* frame = new std::vector<std::byte>(kFrameHeaderSize + bytes);
    FrameHeader h;
    h.type = MessageType::full_state;
    h.fingerprint = plan.fingerprint();
    h.learner = id;
    h.elements = bytes / 4;
    h.payload_bytes = bytes;
    h.payload_crc = detail::crc32c_update(0xFFFFFFFFU, std::span<const std::byte>(frame->data() + kFrameHeaderSize,
                                                                                 bytes)) ^
                    0xFFFFFFFFU;
    detail::write_frame_header(std::span<std::byte, kFrameHeaderSize>(frame->data(), kFrameHeaderSize), h);
    zmq_msg_t msg;
    zmq_msg_init_data(
        &msg, frame->data(), frame->size(), [](void*, void* hint) { delete static_cast<std::vector<std::byte>*>(hint); },
        frame);
    if (zmq_msg_send(&msg, s, 0) < 0) {
      zmq_msg_close(&msg);
      throw TransportError("attacker: sending the huge frame failed");
    }
    std::printf("attacker: huge-frame sent a full_state frame of %llu payload bytes (valid CRC)\n",
                static_cast<unsigned long long>(bytes));
    std::fflush(stdout);
  }
  int linger = 60000;  // until the frame is out
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  zmq_close(s);
  std::printf("attacker: huge-frame done\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  cli::Flags f("ddiloco_attacker", "the attack suite's attacks against a ddiloco_syncer (docs/security.md)");
  f.add("attack", "", "poison, contribution-flood, join-flood, slow-reader or huge-frame");
  f.add("connect", "tcp://127.0.0.1:5555", "the syncer's endpoint");
  f.add("id", "100", "learner id to join as (the first id of join-flood --fresh-ids and slow-reader)");
  f.add("keys", "", "this attacker's key file (CURVE; a listed key); none: plaintext");
  f.add("server-key", "", "the syncer's public key file (with --keys)");
  f.add("seed", "1", "seed of the random payloads");
  f.add("fragments", "5", "P (as the syncer's)");
  f.add("count", "0", "messages to send (0: until SIGTERM/SIGINT); huge-frame: frames (default 1)");
  f.add("rate", "20", "messages per second (0: as fast as the socket takes them)");
  f.add("report-every", "100", "print a progress line every this many messages (0: only at the end)");
  f.add("magnitude", "10", "poison, contribution-flood: value of every payload element (with a random sign)");
  f.add("counter-log2", "62", "poison, contribution-flood: steps = tokens = 2^this");
  f.add("nan-every", "0", "poison, contribution-flood: every this-many-th payload holds NaN (0: none)");
  f.add("advance-step", "false",
        "poison, contribution-flood: send a step counter that advances by steps with every contribution, so the "
        "claims stay within it (with a small --counter-log2 only the norm checks, clipping and the weight cap "
        "stand in the way)",
        true);
  f.add("pull", "false",
        "poison, contribution-flood: also act as a pull-round learner: a metadata message with every contribution "
        "(the step counter +1, or +steps with --advance-step) and every pull answered with a hostile contribution",
        true);
  f.add("fresh-ids", "false", "join-flood: a new id per join (else --id each time, a new nonce)", true);
  f.add("peers", "8", "slow-reader: connections that never read");
  f.add("hold-ms", "0", "slow-reader: leave and disconnect after this long (0: at SIGTERM/SIGINT)");
  f.add("frame-bytes", "1073741824", "huge-frame: payload bytes of the frame");
  f.add("timeout-ms", "10000", "give up waiting for the join's reply after this long");
  if (!f.parse(argc, argv)) return 0;
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);

  Options o;
  o.connect = f.str("connect");
  if (!f.str("keys").empty()) {
    if (f.str("server-key").empty()) throw InvalidArgument("--keys needs --server-key (the syncer's public key file)");
    o.curve = true;
    o.own = read_key_file(f.str("keys"));
    o.server_public_key = read_key_file(f.str("server-key")).public_key;
  }
  reference::TrainerConfig tc;
  reference::CharLm model(tc.model);
  const Plan plan = make_plan(model.tensor_specs(), f.count("fragments"));
  void* context = zmq_ctx_new();
  const std::string attack = f.str("attack");
  int rc = 0;
  if (attack == "poison" || attack == "contribution-flood") {
    rc = contributions(f, o, plan, context, attack);
  } else if (attack == "join-flood") {
    rc = join_flood(f, o, plan, context);
  } else if (attack == "slow-reader") {
    rc = slow_reader(f, o, plan, context);
  } else if (attack == "huge-frame") {
    rc = huge_frame(f, o, plan, context);
  } else {
    throw InvalidArgument("--attack '" + attack +
                          "': expected poison, contribution-flood, join-flood, slow-reader or huge-frame");
  }
  std::fflush(stdout);
  zmq_ctx_term(context);
  return rc;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddiloco_attacker: %s\n", e.what());
  return 1;
}
