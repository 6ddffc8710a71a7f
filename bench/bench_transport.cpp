// bench_transport: fragment throughput over ZeroMQ (DEALER -> ROUTER, as a
// learner's contributions reach the syncer) against a plain TCP socket pair
// moving the same bytes, both on tcp loopback in the same run.
//
// What is measured: one iteration sends a batch of wire frames (encode_frame of
// an fp32 fragment, encoded once) totalling 64 MiB, and ends when the receiving
// thread has received the whole batch and answered with a one-byte ack, so
// queueing is never mistaken for delivery. The ZeroMQ sender copies each frame
// into a message (zmq_send), as ZmqLearnerTransport does; the receiver takes
// each one as a zmq_msg_t. The TCP baseline writes the same frames behind an
// 8-byte length (ZMTP's own framing is 9 bytes) with send(2) and reads them with
// recv(2) into one reused buffer. Bytes/s and frames/s; real time (the work is
// on two threads and the kernel). Target: ZeroMQ at least 80% of plain TCP.
// The CURVE rows show the cost of encryption (not part of the target).
// BM_SocketToMerge: eight learners' contribution frames on loopback folded by
// the syncer as ddiloco_syncer runs it, one merge round per iteration.
// BM_LearnerReceiveGlobal: a learner taking globals, into fresh vectors or
// recycled ones (ZmqLearnerConfig::idle_payload_buffers).
// BM_zmq_curve_io_threads: a CURVE syncer's down-link over k ZeroMQ I/O
// threads, and how the encryption work splits among them.
// BM_LearnerStepNothingDueZmq: OuterLoop::step with nothing due over a real
// ZmqLearnerTransport joined to a Syncer served on loopback, the setting of
// bench/python_step.py's Python Learner.step() (which drives this same OuterLoop);
// BM_LearnerStepNothingPulledZmq: the same in pull rounds (a metadata send a
// step: /0 every one through ZeroMQ, /1 coalesced, the default).
// BM_LearnerStepFragmentDueZmq: the same over one 2^20-float fragment with
// P = 1, H = 2, tau = 1, a pair of steps (one send, one apply if arrived) per
// iteration: python_step.py's due case.
// What it is not: a latency benchmark.
#include <benchmark/benchmark.h>

#include <ddiloco/clock.hpp>
#include <ddiloco/fast/merge.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/outer_optimizer.hpp>
#include <ddiloco/sim/capacity.hpp>
#include <ddiloco/syncer.hpp>
#include <ddiloco/syncer_runtime.hpp>
#include <ddiloco/transport/zmq.hpp>
#include <ddiloco/wire.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr std::size_t kBatchBytes = std::size_t{64} << 20;

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "bench_transport: %s failed: %s\n", what, std::strerror(errno));
  std::abort();
}

/// A wire frame carrying an fp32 fragment of `payload_bytes` bytes.
std::vector<std::byte> make_frame(std::size_t payload_bytes) {
  std::vector<float> v(payload_bytes / sizeof(float));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 1000) * 1e-3f;
  ddiloco::Message m;
  m.type = ddiloco::MessageType::contribution;
  m.fingerprint = 0x1234;
  m.learner = 1;
  m.sequence = 1;
  m.steps = 24;
  m.tokens = 24 * 4096;
  m.payload = ddiloco::make_payload(std::move(v));
  return ddiloco::encode_frame(m, ddiloco::Codec::fp32);
}

std::size_t frames_per_batch(std::size_t payload_bytes) { return std::max<std::size_t>(1, kBatchBytes / payload_bytes); }

/// A merged global for learner `to` (fingerprint 0x1234), as the syncer sends it.
ddiloco::Message global_for(ddiloco::LearnerId to, std::uint64_t version, ddiloco::Payload payload) {
  ddiloco::Message m;
  m.type = ddiloco::MessageType::global_fragment;
  m.fingerprint = 0x1234;
  m.learner = to;
  m.version = version;
  m.payload = std::move(payload);
  return m;
}

/// n fp32 values of a smooth ramp (what the globals of these benchmarks carry).
std::vector<float> ramp(std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 1000) * 1e-3f;
  return v;
}

/// Learner `id` joins through `learner` and the syncer takes the join (so it
/// knows the route); false if it did not arrive.
bool join_through(ddiloco::ZmqLearnerTransport& learner, ddiloco::ZmqSyncerTransport& syncer, ddiloco::LearnerId id,
                  const ddiloco::Clock& clock) {
  ddiloco::Message join;
  join.type = ddiloco::MessageType::join;
  join.fingerprint = 0x1234;
  join.learner = id;
  join.sequence = 1;
  return learner.send(std::move(join)) && syncer.receive_until(clock.now() + std::chrono::seconds(30)).has_value();
}

long minor_faults() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

void report(benchmark::State& state, std::size_t frame_bytes, std::size_t per_batch, long faults_before) {
  const auto frames = static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(per_batch);
  // Page faults per frame (all threads): fresh buffers the kernel must map.
  state.counters["faults_per_frame"] =
      static_cast<double>(minor_faults() - faults_before) / static_cast<double>(std::max<std::int64_t>(1, frames));
  state.SetBytesProcessed(frames * static_cast<std::int64_t>(frame_bytes));
  state.SetItemsProcessed(frames);
}

// ---- ZeroMQ -------------------------------------------------------------

enum class ZmqSend { copy, zero_copy };

void zmq_throughput(benchmark::State& state, bool curve, ZmqSend how) {
  const auto frame = make_frame(static_cast<std::size_t>(state.range(0)));
  const std::size_t per_batch = frames_per_batch(static_cast<std::size_t>(state.range(0)));
  // One context (one I/O thread) per side, as in two processes.
  void* server_ctx = zmq_ctx_new();
  void* client_ctx = zmq_ctx_new();
  void* router = zmq_socket(server_ctx, ZMQ_ROUTER);
  void* dealer = zmq_socket(client_ctx, ZMQ_DEALER);
  const int zero = 0;
  zmq_setsockopt(router, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(dealer, ZMQ_LINGER, &zero, sizeof zero);
  if (curve) {
    // CURVE without a ZAP handler: any client key is accepted (encryption only).
    const auto server = ddiloco::generate_curve_keys(), client = ddiloco::generate_curve_keys();
    const int one = 1;
    zmq_setsockopt(router, ZMQ_CURVE_SERVER, &one, sizeof one);
    zmq_setsockopt(router, ZMQ_CURVE_SECRETKEY, server.secret_key.c_str(), 41);
    zmq_setsockopt(dealer, ZMQ_CURVE_SERVERKEY, server.public_key.c_str(), 41);
    zmq_setsockopt(dealer, ZMQ_CURVE_PUBLICKEY, client.public_key.c_str(), 41);
    zmq_setsockopt(dealer, ZMQ_CURVE_SECRETKEY, client.secret_key.c_str(), 41);
  }
  if (zmq_bind(router, "tcp://127.0.0.1:*") != 0) die("zmq_bind");
  char endpoint[256] = {};
  std::size_t len = sizeof endpoint;
  zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, endpoint, &len);
  if (zmq_connect(dealer, endpoint) != 0) die("zmq_connect");

  // Receiver: counts frames and acks each complete batch to the sender.
  std::thread receiver([&] {
    zmq_msg_t rid, body;
    zmq_msg_init(&rid);
    zmq_msg_init(&body);
    for (std::size_t got = 0;;) {
      if (zmq_msg_recv(&rid, router, 0) < 0) break;  // context terminated
      if (zmq_msg_recv(&body, router, 0) < 0) break;
      benchmark::DoNotOptimize(zmq_msg_data(&body));
      if (zmq_msg_size(&body) == 0) break;  // the sender's stop message
      if (++got % per_batch == 0) {
        zmq_send(router, zmq_msg_data(&rid), zmq_msg_size(&rid), ZMQ_SNDMORE);
        zmq_send(router, "k", 1, 0);
      }
    }
    zmq_msg_close(&rid);
    zmq_msg_close(&body);
  });

  char ack = 0;
  const long faults = minor_faults();
  for (auto _ : state) {
    for (std::size_t i = 0; i < per_batch; ++i) {
      if (how == ZmqSend::copy) {
        if (zmq_send(dealer, frame.data(), frame.size(), 0) < 0) die("zmq_send");
      } else {
        // ZeroMQ sends straight from our buffer (unchanged until the ack).
        zmq_msg_t msg;
        zmq_msg_init_data(&msg, const_cast<std::byte*>(frame.data()), frame.size(), nullptr, nullptr);
        if (zmq_msg_send(&msg, dealer, 0) < 0) die("zmq_msg_send");
      }
    }
    if (zmq_recv(dealer, &ack, 1, 0) < 0) die("zmq_recv (ack)");
  }
  report(state, frame.size(), per_batch, faults);
  zmq_send(dealer, "", 0, 0);
  receiver.join();
  zmq_close(dealer);
  zmq_close(router);
  zmq_ctx_term(client_ctx);
  zmq_ctx_term(server_ctx);
}

void BM_zmq_plaintext(benchmark::State& state) { zmq_throughput(state, false, ZmqSend::copy); }
void BM_zmq_plaintext_zero_copy(benchmark::State& state) { zmq_throughput(state, false, ZmqSend::zero_copy); }
void BM_zmq_curve(benchmark::State& state) { zmq_throughput(state, true, ZmqSend::copy); }

// ---- plain TCP ----------------------------------------------------------

void send_all(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) die("send");
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

bool recv_all(int fd, void* data, std::size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

void BM_tcp(benchmark::State& state) {
  const auto frame = make_frame(static_cast<std::size_t>(state.range(0)));
  const std::size_t per_batch = frames_per_batch(static_cast<std::size_t>(state.range(0)));
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) die("bind");
  if (::listen(listener, 1) != 0) die("listen");
  socklen_t alen = sizeof addr;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &alen);
  const int sender = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(sender, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) die("connect");
  const int conn = ::accept(listener, nullptr, nullptr);
  if (conn < 0) die("accept");
  const int one = 1;  // as libzmq does
  ::setsockopt(sender, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::setsockopt(conn, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

  std::thread receiver([&] {
    std::vector<std::byte> buffer(frame.size());
    for (std::size_t got = 0;;) {
      std::uint64_t size = 0;
      if (!recv_all(conn, &size, sizeof size) || size == 0) break;
      if (size > buffer.size() || !recv_all(conn, buffer.data(), size)) break;
      benchmark::DoNotOptimize(buffer.data());
      if (++got % per_batch == 0) send_all(conn, "k", 1);
    }
  });

  const std::uint64_t size = frame.size();
  char ack = 0;
  const long faults = minor_faults();
  for (auto _ : state) {
    for (std::size_t i = 0; i < per_batch; ++i) {
      send_all(sender, &size, sizeof size);
      send_all(sender, frame.data(), frame.size());
    }
    if (!recv_all(sender, &ack, 1)) die("recv (ack)");
  }
  report(state, frame.size(), per_batch, faults);
  const std::uint64_t stop = 0;
  send_all(sender, &stop, sizeof stop);
  receiver.join();
  ::close(sender);
  ::close(conn);
  ::close(listener);
}

// ---- the syncer's down-link ------------------------------------------------

/// What a merge costs the syncer's thread in ZmqSyncerTransport::send_to: the
/// merged fragment (one shared payload, 2^log2n fp32 elements) framed for each
/// of M learners in the global codec: encoded and checksummed once, then a
/// header per learner, every learner's message sharing the payload part. No
/// learner is connected, so the I/O thread drops the frames (their buffers go
/// back to the transport's pool): this times the framing, not the network.
/// Two merged payloads alternate (Syncer publishes into a spare buffer), so
/// every iteration encodes one. Items: the fragment's elements, once per merge
/// (SyncerCosts::send_elements_per_s). Arguments {log2 n, M, codec}.
void BM_syncer_send_merged(benchmark::State& state) {
  const auto n = std::size_t{1} << state.range(0);
  const auto m_learners = static_cast<ddiloco::LearnerId>(state.range(1));
  ddiloco::ZmqSyncerConfig config;
  config.bind = "tcp://127.0.0.1:*";
  config.security = ddiloco::ZmqSecurity::plaintext();
  config.global_codec = static_cast<ddiloco::Codec>(state.range(2));
  const ddiloco::SteadyClock clock;
  ddiloco::ZmqSyncerTransport syncer(config, clock);
  const ddiloco::Payload merged[2] = {ddiloco::make_payload(ramp(n)), ddiloco::make_payload(ramp(n))};
  std::uint64_t version = 0;
  const auto encoded_before = syncer.counters().payloads_encoded;
  for (auto _ : state) {
    ++version;
    for (ddiloco::LearnerId id = 1; id <= m_learners; ++id)
      benchmark::DoNotOptimize(syncer.send_to(id, global_for(id, version, merged[version % 2])));
  }
  if (syncer.counters().payloads_encoded - encoded_before != static_cast<std::uint64_t>(state.iterations())) {
    state.SkipWithError("not one payload encoded per merge");
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(ddiloco::encoded_size(config.global_codec, n)));
  state.SetLabel(std::string(ddiloco::to_string(config.global_codec)));
}

// ---- the down-link under CURVE, over several I/O threads ---------------------

/// The tids of this process's ZeroMQ I/O threads (named "ZMQbg/IO/<i>" by libzmq).
std::vector<std::string> zmq_io_threads() {
  std::vector<std::string> out;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name.rfind("ZMQbg/IO/", 0) == 0) out.push_back(task.path().filename().string());
  }
  return out;
}

/// CPU seconds (user + system) thread `tid` of this process has used.
double thread_cpu_seconds(const std::string& tid) {
  std::ifstream stat("/proc/self/task/" + tid + "/stat");
  std::string line;
  std::getline(stat, line);
  std::istringstream rest(line.substr(line.rfind(')') + 2));  // the name may hold spaces
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i)
    if (i >= 14) ticks += std::stod(field);  // utime, stime
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

/// A CURVE syncer with k I/O threads (ZmqSyncerConfig::io_threads) sends a
/// merged fp32 fragment of 2^22 elements (16 MiB) to M learners and every
/// learner receives it; one iteration is one merge. The learners are
/// ZmqLearnerTransports in this process, each with its own context (one I/O
/// thread, as in its own process). Counters: the syncer's I/O threads' CPU
/// seconds per merge, all together (io_cpu_per_merge) and the busiest's share
/// of it (busiest_share): libzmq gives each connection to its least loaded
/// thread, so with M connections on k threads the capacity planner
/// (sim/capacity.hpp) gives the busiest ceil(M / k) / M of the bytes at the
/// measured one-thread rate (planned_busiest_cpu_per_merge, against
/// busiest_cpu_per_merge measured). The learners' I/O threads decrypt on the
/// same cores, so on a small machine the wall time gains less than the
/// busiest thread's CPU. Arguments {k, M}.
void BM_zmq_curve_io_threads(benchmark::State& state) {
  const auto threads = static_cast<int>(state.range(0));
  const auto m_learners = static_cast<ddiloco::LearnerId>(state.range(1));
  const ddiloco::SteadyClock clock;
  const auto server = ddiloco::generate_curve_keys();
  std::vector<ddiloco::CurveKeys> keys;
  ddiloco::ZmqSyncerConfig config;
  config.bind = "tcp://127.0.0.1:*";
  config.security.own = server;
  config.io_threads = threads;
  for (ddiloco::LearnerId id = 1; id <= m_learners; ++id) {
    keys.push_back(ddiloco::generate_curve_keys());
    config.security.allowed[id] = keys.back().public_key;
  }
  const auto before = zmq_io_threads();
  ddiloco::ZmqSyncerTransport syncer(config, clock);
  // The syncer's I/O threads: the ones its context started. A thread names itself once it runs,
  // so its name may show a moment after the constructor returns.
  std::vector<std::string> own;
  for (const auto deadline = clock.now() + std::chrono::seconds(10);
       own.size() < static_cast<std::size_t>(threads) && clock.now() < deadline;) {
    own.clear();
    for (const auto& t : zmq_io_threads())
      if (std::find(before.begin(), before.end(), t) == before.end()) own.push_back(t);
  }
  if (own.size() != static_cast<std::size_t>(threads)) {
    state.SkipWithError(("the syncer started " + std::to_string(own.size()) + " I/O threads, not " + std::to_string(threads)).c_str());
    return;
  }
  std::vector<std::unique_ptr<ddiloco::ZmqLearnerTransport>> learners;
  for (ddiloco::LearnerId id = 1; id <= m_learners; ++id) {
    ddiloco::ZmqLearnerConfig c;
    c.connect = syncer.endpoint();
    c.id = id;
    c.security.own = keys[id - 1];
    c.security.server_public_key = server.public_key;
    c.immediate = false;
    learners.push_back(std::make_unique<ddiloco::ZmqLearnerTransport>(c, clock));
    if (!join_through(*learners.back(), syncer, id, clock)) {
      state.SkipWithError("a learner's join did not arrive");
      return;
    }
  }
  const std::size_t n = std::size_t{1} << 22;
  const ddiloco::Payload merged[2] = {ddiloco::make_payload(ramp(n)), ddiloco::make_payload(ramp(n))};
  std::vector<double> cpu0;
  for (const auto& t : own) cpu0.push_back(thread_cpu_seconds(t));
  std::uint64_t version = 0;
  for (auto _ : state) {
    ++version;
    for (ddiloco::LearnerId id = 1; id <= m_learners; ++id)
      if (!syncer.send_to(id, global_for(id, version, merged[version % 2]))) state.SkipWithError("send_to refused a global");
    for (auto& l : learners) {
      const auto got = l->receive_until(clock.now() + std::chrono::seconds(60));
      if (!got || got->version != version) {
        state.SkipWithError("a learner did not receive the merge");
        return;
      }
    }
  }
  double total = 0, busiest = 0;
  for (std::size_t i = 0; i < own.size(); ++i) {
    const double used = thread_cpu_seconds(own[i]) - cpu0[i];
    total += used;
    busiest = std::max(busiest, used);
  }
  const auto merges = static_cast<double>(state.iterations());
  const double bytes = static_cast<double>(m_learners) * static_cast<double>(ddiloco::encoded_size(ddiloco::Codec::fp32, n));
  state.counters["io_cpu_per_merge"] = total / merges;
  state.counters["busiest_cpu_per_merge"] = busiest / merges;
  state.counters["busiest_share"] = total > 0 ? busiest / total : 0;
  // What the capacity planner predicts for the busiest thread: the merge's bytes at
  // SyncerCosts::curve_io_bytes_per_s, its share ceil(M / k) / M.
  state.counters["planned_busiest_cpu_per_merge"] = ddiloco::sim::detail::busiest_io_thread(
      bytes / ddiloco::sim::SyncerCosts{}.curve_io_bytes_per_s, m_learners, static_cast<std::size_t>(threads));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * m_learners *
                          static_cast<std::int64_t>(ddiloco::encoded_size(ddiloco::Codec::fp32, n)));
}

// ---- a learner receiving globals ---------------------------------------------

/// A learner's ZmqLearnerTransport receives a merged fp32 global of 2^log2n
/// elements from a plaintext ZmqSyncerTransport on loopback; one iteration is
/// one global, sent and taken (decoded into fp32), the previous one let go as
/// OuterLoop lets a fragment's previous global go. Argument idle: the
/// learner's idle_payload_buffers (0: every global in a fresh vector; 2, the
/// default: a vector an earlier global used). Counter faults_per_global: page
/// faults (all threads) per global. Arguments {log2 n, idle}.
void BM_LearnerReceiveGlobal(benchmark::State& state) {
  const auto n = std::size_t{1} << state.range(0);
  const ddiloco::SteadyClock clock;
  ddiloco::ZmqSyncerConfig sc;
  sc.bind = "tcp://127.0.0.1:*";
  sc.security = ddiloco::ZmqSecurity::plaintext();
  ddiloco::ZmqSyncerTransport syncer(sc, clock);
  ddiloco::ZmqLearnerConfig lc;
  lc.connect = syncer.endpoint();
  lc.id = 1;
  lc.security = ddiloco::ZmqSecurity::plaintext();
  lc.immediate = false;
  lc.idle_payload_buffers = static_cast<std::size_t>(state.range(1));
  ddiloco::ZmqLearnerTransport learner(lc, clock);
  if (!join_through(learner, syncer, 1, clock)) {
    state.SkipWithError("the learner's join did not arrive");
    return;
  }
  const ddiloco::Payload merged = ddiloco::make_payload(ramp(n));
  ddiloco::Payload current;  // the global the learner holds
  std::uint64_t version = 0;
  const long faults = minor_faults();
  for (auto _ : state) {
    if (!syncer.send_to(1, global_for(1, ++version, merged))) state.SkipWithError("send_to refused the global");
    auto got = learner.receive_until(clock.now() + std::chrono::seconds(60));
    if (!got || got->version != version || !got->payload) {
      state.SkipWithError("the learner did not receive the global");
      return;
    }
    current = std::move(got->payload);  // the previous global is let go
  }
  state.counters["faults_per_global"] =
      static_cast<double>(minor_faults() - faults) / static_cast<double>(std::max<std::int64_t>(1, state.iterations()));
  state.counters["reused"] = static_cast<double>(learner.counters().payload_buffers_reused);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(4 * n));
}

// ---- socket to merge ---------------------------------------------------------

/// Socket to merge: M learners' contribution frames (one fp32 fragment of
/// 2^log2n elements, encoded once, sent zero-copy from M DEALER sockets on one
/// client context, only their headers rewritten each round) reach
/// ZmqSyncerTransport + SyncerRuntime + Syncer<> on loopback, set up as
/// ddiloco_syncer runs them (contributions kept encoded, payload checks in the
/// syncer's norm scan, 2 merge workers), with K = M. One iteration is one
/// round: every learner sends, the syncer merges the M contributions, and every
/// learner receives the merged global (int4, so the down-link takes an eighth
/// of the up-link's bytes). Bytes: the contribution frames, so bytes/s is the
/// rate the syncer absorbs contributions; BM_zmq_plaintext_zero_copy at the
/// same frame size in the same run is what one loopback socket pair delivers.
/// Arguments {log2 n, M}.
void BM_SocketToMerge(benchmark::State& state) {
  using SyncerT = ddiloco::Syncer<>;
  const std::size_t n = std::size_t{1} << state.range(0);
  const auto m_learners = static_cast<ddiloco::LearnerId>(state.range(1));
  const ddiloco::Plan plan = ddiloco::make_plan({{"w", n, false}}, 1);
  const ddiloco::SteadyClock clock;
  ddiloco::SyncerConfig sc;
  sc.round = ddiloco::RoundMode::push;
  sc.quorum.min_quorum = m_learners;
  sc.quorum.grace = false;
  sc.quorum.deadline = std::chrono::hours(1);
  sc.heartbeat_timeout = std::chrono::hours(1);
  sc.send_merged_to = ddiloco::MergeRecipients::contributors;
  SyncerT syncer(plan, std::vector<float>(n, 0.5f), clock, sc);
  ddiloco::ZmqSyncerConfig zc;
  zc.bind = "tcp://127.0.0.1:*";
  zc.security = ddiloco::ZmqSecurity::plaintext();
  zc.keep_contributions_encoded = true;
  zc.global_codec = ddiloco::Codec::int4;
  ddiloco::size_for_plan(zc, plan);
  ddiloco::ZmqSyncerTransport served(zc, clock);
  ddiloco::SyncerRuntime<SyncerT, ddiloco::ZmqSyncerTransport> runtime(syncer, served);
  runtime.start();

  void* ctx = zmq_ctx_new();
  std::vector<void*> dealers;
  const int zero = 0;
  for (ddiloco::LearnerId id = 0; id < m_learners; ++id) {
    void* d = zmq_socket(ctx, ZMQ_DEALER);
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_connect(d, served.endpoint().c_str()) != 0) die("zmq_connect");
    dealers.push_back(d);
  }
  // The next frame of `type` on dealer d (others dropped); false after 30 s.
  const auto await = [&](void* d, ddiloco::MessageType type, std::uint64_t* sequence) {
    zmq_pollitem_t item{d, 0, ZMQ_POLLIN, 0};
    for (;;) {
      if (zmq_poll(&item, 1, 30000) <= 0) return false;
      ddiloco::detail::ReceivedFrame frame;  // one part, or header and payload
      if (!frame.receive(d, 0)) die("zmq_msg_recv");
      const auto head = frame.head_bytes();
      if (head.size() >= ddiloco::kFrameHeaderSize &&
          head[ddiloco::detail::frame_offset::type] == static_cast<std::byte>(type)) {
        if (sequence != nullptr) {
          *sequence = ddiloco::detail::load_u64(head.data() + ddiloco::detail::frame_offset::sequence);
        }
        return true;
      }
    }
  };
  std::vector<std::uint64_t> base(m_learners);
  for (ddiloco::LearnerId id = 0; id < m_learners; ++id) {
    ddiloco::Message join;
    join.type = ddiloco::MessageType::join;
    join.fingerprint = plan.fingerprint();
    join.learner = id;
    join.sequence = 1000 + id;
    const auto f = ddiloco::encode_frame(join, ddiloco::Codec::fp32);
    if (zmq_send(dealers[id], f.data(), f.size(), 0) < 0) die("zmq_send (join)");
    if (!await(dealers[id], ddiloco::MessageType::full_state, &base[id])) {
      state.SkipWithError("a learner got no full state after joining");
      return;
    }
  }
  // Each learner's contribution frame: encoded once, its header rewritten per round.
  std::vector<ddiloco::Message> contribution(m_learners);
  std::vector<std::vector<std::byte>> frames;
  std::vector<std::uint32_t> crcs;
  for (ddiloco::LearnerId id = 0; id < m_learners; ++id) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 7 + id) % 1000) * 1e-6f;
    ddiloco::Message& c = contribution[id];
    c.type = ddiloco::MessageType::contribution;
    c.fingerprint = plan.fingerprint();
    c.learner = id;
    c.steps = 24;
    c.tokens = 24 * 4096;
    c.payload = ddiloco::make_payload(std::move(v));
    frames.push_back(ddiloco::encode_frame(c, ddiloco::Codec::fp32));
    crcs.push_back(ddiloco::frame_payload_crc(frames.back()));
  }
  std::uint64_t round = 0;
  for (auto _ : state) {
    for (ddiloco::LearnerId id = 0; id < m_learners; ++id) {
      ddiloco::Message& c = contribution[id];
      c.sequence = base[id] + 1 + round;
      c.version = round;
      c.step = 24 * (round + 1);
      ddiloco::finish_frame(c, ddiloco::Codec::fp32, crcs[id], frames[id]);
      zmq_msg_t msg;  // sent from our buffer: unchanged until the round's globals are back
      zmq_msg_init_data(&msg, frames[id].data(), frames[id].size(), nullptr, nullptr);
      if (zmq_msg_send(&msg, dealers[id], 0) < 0) die("zmq_msg_send");
    }
    for (ddiloco::LearnerId id = 0; id < m_learners; ++id) {
      if (!await(dealers[id], ddiloco::MessageType::global_fragment, nullptr)) {
        state.SkipWithError("no merged global within 30 s");
        break;
      }
    }
    ++round;
  }
  runtime.stop();
  for (void* d : dealers) zmq_close(d);
  zmq_ctx_term(ctx);
  if (syncer.status().merges != round || syncer.status().rejected_total() != 0) {
    state.SkipWithError("not every round merged all contributions");
    return;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * m_learners *
                          static_cast<std::int64_t>(frames[0].size()));
  state.counters["merges_per_s"] =
      benchmark::Counter(static_cast<double>(round), benchmark::Counter::kIsRate);
}

// ---- the learner's step ----------------------------------------------------

/// A learner joined over ZeroMQ (plaintext, loopback) to a Syncer +
/// SyncerRuntime (its default 2 workers, as ddiloco.Syncer builds them) on
/// their own threads, its tensors spans over caller-owned memory, as
/// ddiloco.Learner's CPU parameters are: the setting of both learner-step
/// benchmarks. Leaves and stops the runtime when it goes.
struct LoopbackLearner {
  using Syncer = ddiloco::Syncer<ddiloco::fast::RadialDirectional, ddiloco::NesterovSGD>;
  struct Options {
    ddiloco::SyncerConfig syncer;     ///< the syncer's configuration
    ddiloco::OuterLoopConfig learner;  ///< the learner's (its id is set to 1)
    /// size_for_plan on both sides, the syncer keeping contributions in their
    /// wire encoding, the learner sending fp32 (the Python binding's settings).
    bool sized = false;
    /// ZmqLearnerConfig::metadata_interval (pull rounds' metadata coalescing).
    ddiloco::Duration metadata_interval = ddiloco::ZmqLearnerConfig{}.metadata_interval;
  };

  ddiloco::Plan plan;
  ddiloco::SteadyClock clock;
  Syncer syncer;
  ddiloco::ZmqSyncerTransport served;
  ddiloco::SyncerRuntime<Syncer, ddiloco::ZmqSyncerTransport> runtime;
  ddiloco::ZmqLearnerTransport link;
  ddiloco::OuterLoop<ddiloco::ZmqLearnerTransport, std::span<float>> outer;
  std::vector<float> storage;
  std::vector<std::span<float>> params;

  LoopbackLearner(ddiloco::Plan p, const Options& o)
      : plan(std::move(p)),
        syncer(plan, std::vector<float>(plan.total_numel(), 0.0f), clock, o.syncer),
        served(served_config(plan, o), clock),
        runtime(syncer, served),
        link(learner_config(plan, o, served.endpoint()), clock),
        outer(plan, link, with_id(o.learner)),
        storage(plan.total_numel(), 0.0f) {
    runtime.start();
    std::size_t at = 0;
    for (const auto& t : plan.tensors()) {
      params.emplace_back(storage.data() + at, t.numel);
      at += t.numel;
    }
  }
  LoopbackLearner(const LoopbackLearner&) = delete;
  LoopbackLearner& operator=(const LoopbackLearner&) = delete;
  ~LoopbackLearner() {
    if (outer.joined()) outer.leave();
    runtime.stop();
  }

  /// Joins the syncer; false, with the error on `state`, if that failed.
  bool join(benchmark::State& state) {
    try {
      outer.join(params);
      return true;
    } catch (const std::exception& e) {
      state.SkipWithError(e.what());
      return false;
    }
  }

 private:
  static ddiloco::ZmqSyncerConfig served_config(const ddiloco::Plan& plan, const Options& o) {
    ddiloco::ZmqSyncerConfig sc;
    sc.bind = "tcp://127.0.0.1:*";
    sc.security = ddiloco::ZmqSecurity::plaintext();
    if (o.sized) {
      sc.keep_contributions_encoded = true;
      ddiloco::size_for_plan(sc, plan);
    }
    return sc;
  }
  static ddiloco::ZmqLearnerConfig learner_config(const ddiloco::Plan& plan, const Options& o,
                                                  const std::string& endpoint) {
    ddiloco::ZmqLearnerConfig lcz;
    lcz.connect = endpoint;
    lcz.id = 1;
    lcz.security = ddiloco::ZmqSecurity::plaintext();
    lcz.metadata_interval = o.metadata_interval;
    if (o.sized) {
      lcz.codec = ddiloco::Codec::fp32;
      ddiloco::size_for_plan(lcz, plan);
    }
    return lcz;
  }
  static ddiloco::OuterLoopConfig with_id(ddiloco::OuterLoopConfig lc) {
    lc.id = 1;
    return lc;
  }
};

/// OuterLoop::step when no fragment is due (and nothing arrives): P = 24
/// fragments of one 1024-float tensor each, H = 24 x 2^16, so no send happens
/// for 2^16 steps, in the LoopbackLearner setting. What a step costs here: the
/// transport's non-blocking drain and the schedule check. Its Python twin is
/// bench/python_step.py (the same setting through the binding). Pull rounds
/// (BM_LearnerStepNothingPulledZmq): the same, nothing pulled (each
/// fragment's first round opens after 2^16 global steps), and every step
/// hands the learner's metadata to the transport: /0 sends every step's frame
/// through ZeroMQ (metadata_interval 0), /1 coalesces them (the default 1 ms;
/// the counter `frames` says how many went out).
void learner_step_nothing_due(benchmark::State& state, ddiloco::RoundMode round,
                              ddiloco::Duration metadata_interval = ddiloco::ZmqLearnerConfig{}.metadata_interval) {
  constexpr std::size_t kP = 24, kN = 1024;
  std::vector<ddiloco::TensorSpec> specs;
  for (std::size_t t = 0; t < kP; ++t) {
    std::string name = std::to_string(t);
    name.insert(name.begin(), 't');
    specs.push_back({name, kN, false});
  }
  LoopbackLearner::Options o;
  o.syncer.round = o.learner.round = round;
  o.learner.sync_every = kP << 16;
  o.metadata_interval = metadata_interval;
  if (round == ddiloco::RoundMode::pull) o.syncer.sync_every = o.learner.sync_every;
  LoopbackLearner l(ddiloco::make_plan(specs, kP), o);
  if (!l.join(state)) return;
  std::size_t sent = 0;
  const std::uint64_t metadata = l.outer.status().metadata_sent;
  const std::uint64_t frames = l.link.counters().frames_out;
  for (auto _ : state) {
    const auto report = l.outer.step(l.params, 1);
    sent += report.sent ? 1 : 0;
  }
  state.counters["sent"] = static_cast<double>(sent);
  state.counters["metadata"] = static_cast<double>(l.outer.status().metadata_sent - metadata);
  state.counters["frames"] = static_cast<double>(l.link.counters().frames_out - frames);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
}

void BM_LearnerStepNothingDueZmq(benchmark::State& state) {
  learner_step_nothing_due(state, ddiloco::RoundMode::push);  // as bench/python_step.py's first case
}

void BM_LearnerStepNothingPulledZmq(benchmark::State& state) {
  learner_step_nothing_due(state, ddiloco::RoundMode::pull,
                           state.range(0) == 0 ? ddiloco::Duration::zero() : ddiloco::ZmqLearnerConfig{}.metadata_interval);
}

/// Decoupled DiLoCo's due case, the C++ twin of bench/python_step.py's `due`:
/// one fragment of 2^20 floats (P = 1, H = 2, tau = 1) in the LoopbackLearner
/// setting, sized (fp32 codec, size_for_plan on both sides). One iteration is
/// a pair of steps: one sends the fragment (encoded into the ZeroMQ frame),
/// the other applies the merged global if it has arrived (never waiting). 10
/// pairs per repetition, 15 repetitions: the Python side's 15 batches of 10 pairs.
void BM_LearnerStepFragmentDueZmq(benchmark::State& state) {
  constexpr std::size_t kN = std::size_t{1} << 20;
  LoopbackLearner::Options o;
  o.syncer.round = o.learner.round = ddiloco::RoundMode::push;  // as bench/python_step.py
  o.syncer.quorum.overlap = 1;
  o.learner.sync_every = 2;
  o.learner.overlap = 1;
  o.sized = true;
  LoopbackLearner l(ddiloco::make_plan({{"w", kN, false}}, 1), o);
  if (!l.join(state)) return;
  std::size_t sent = 0, applied = 0;
  for (auto _ : state) {
    const auto a = l.outer.step(l.params, 1);
    const auto b = l.outer.step(l.params, 1);
    sent += (a.sent ? 1 : 0) + (b.sent ? 1 : 0);
    applied += a.applied + b.applied;
  }
  state.counters["sent"] = static_cast<double>(sent);
  state.counters["applied"] = static_cast<double>(applied);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
}

void sizes(benchmark::internal::Benchmark* b) {
  b->Arg(1 << 20)->Arg(16 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_tcp)->Apply(sizes);
BENCHMARK(BM_zmq_plaintext)->Apply(sizes);
BENCHMARK(BM_zmq_plaintext_zero_copy)->Apply(sizes);
BENCHMARK(BM_zmq_curve)->Apply(sizes);
BENCHMARK(BM_syncer_send_merged)
    ->Args({24, 8, static_cast<int>(ddiloco::Codec::fp32)})
    ->Args({24, 8, static_cast<int>(ddiloco::Codec::int8)})
    ->Args({24, 8, static_cast<int>(ddiloco::Codec::bf16)})
    ->Args({24, 8, static_cast<int>(ddiloco::Codec::fp16)})
    ->Args({24, 8, static_cast<int>(ddiloco::Codec::int4)})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_zmq_curve_io_threads)
    ->Args({1, 4})
    ->Args({2, 4})
    ->Args({3, 4})
    ->Args({4, 4})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

BENCHMARK(BM_LearnerReceiveGlobal)
    ->Args({22, 0})
    ->Args({22, 2})
    ->Args({24, 0})
    ->Args({24, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_SocketToMerge)->Args({22, 8})->Args({24, 8})->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);

// 60000 steps, 15 repetitions: the median is what bench/python_step.py compares with.
BENCHMARK(BM_LearnerStepNothingDueZmq)->Iterations(60000)->Repetitions(15)->Unit(benchmark::kNanosecond);
BENCHMARK(BM_LearnerStepNothingPulledZmq)->Arg(0)->Arg(1)->Iterations(60000)->Repetitions(15)->Unit(benchmark::kNanosecond);
BENCHMARK(BM_LearnerStepFragmentDueZmq)->Iterations(10)->Repetitions(15)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
