// ddiloco_chaos_client: sends malformed and hostile frames to a plaintext
// ddiloco_syncer, for the multi-process tests (tests/multiprocess/).
//
// It joins as learner --id (so its valid frames reach the syncer's semantic
// checks), then sends, in order:
//   1. --garbage random byte strings (not frames at all)        -> decode_errors
//   2. a valid contribution cut in half                         -> decode_errors (too_short)
//   3. a header claiming 2^40 elements (header CRC resealed)    -> decode_errors (too_large)
//   4. a header whose payload-length field is 2^62              -> decode_errors (length_mismatch)
//   5. a valid contribution under another plan fingerprint      -> rejected_foreign_plan
//   6. a valid contribution, then the very same bytes again     -> accepted, then rejected_duplicate
// and leaves. What it is not: a fuzzer (tests/fuzz/ is), nor usable against a
// CURVE syncer (a key that is not listed never gets a frame through).
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/reference/char_lm.hpp>
#include <ddiloco/transport/zmq.hpp>
#include <ddiloco/wire.hpp>

#include <zmq.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli.hpp"

using namespace ddiloco;

namespace {

void send_bytes(void* socket, std::span<const std::byte> bytes, const char* what) {
  if (zmq_send(socket, bytes.data(), bytes.size(), 0) < 0)
    throw TransportError(detail::msg("chaos client: sending ", what, " failed: ", zmq_strerror(zmq_errno())));
  std::printf("chaos: sent %s (%zu bytes)\n", what, bytes.size());
}

/// A bare 88-byte header with a resealed header CRC and no payload.
std::vector<std::byte> header_only(const FrameHeader& h) {
  std::vector<std::byte> out(kFrameHeaderSize);
  detail::write_frame_header(std::span<std::byte, kFrameHeaderSize>(out.data(), kFrameHeaderSize), h);
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  cli::Flags f("ddiloco_chaos_client", "sends malformed and hostile frames to a plaintext ddiloco_syncer");
  f.add("connect", "tcp://127.0.0.1:5555", "the syncer's endpoint");
  f.add("id", "99", "learner id to join as");
  f.add("seed", "1", "seed of the reference model (as the syncer's)");
  f.add("fragments", "5", "P (as the syncer's)");
  f.add("garbage", "3", "number of random garbage messages");
  f.add("timeout-ms", "10000", "give up waiting for the join reply after this long");
  if (!f.parse(argc, argv)) return 0;

  reference::TrainerConfig tc;
  reference::CharLm model(tc.model);
  const Plan plan = make_plan(model.tensor_specs(), f.count("fragments"));
  const auto id = static_cast<LearnerId>(f.integer("id"));

  void* context = zmq_ctx_new();
  void* socket = zmq_socket(context, ZMQ_DEALER);
  // Closing waits up to 30 s for the queued frames to go out (the test waits as
  // long for their effect): with 2 s, a syncer busy with two fast learners on a
  // loaded CI machine once had not read the last 1.2 MB when the client exited,
  // and the valid contribution and its replay were dropped unsent.
  int linger = 30000;
  zmq_setsockopt(socket, ZMQ_LINGER, &linger, sizeof linger);
  if (zmq_connect(socket, f.str("connect").c_str()) != 0)
    throw TransportError(detail::msg("chaos client: cannot connect to '", f.str("connect"), "'"));

  // Join, and wait for the full state of fragment 0 (its version and our sequence base).
  Message join;
  join.type = MessageType::join;
  join.fingerprint = plan.fingerprint();
  join.learner = id;
  join.sequence = 0x5eed;  // the join nonce
  send_bytes(socket, encode_frame(join, Codec::fp32), "join");
  std::optional<Message> state;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(f.integer("timeout-ms"));
  while (!state) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) throw TransportError("chaos client: no full_state reply to the join; is the syncer up?");
    zmq_pollitem_t item{socket, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, static_cast<long>(left.count())) <= 0) continue;
    ddiloco::detail::ReceivedFrame frame;  // one part, or header and payload
    if (frame.receive(socket, 0)) {
      auto r = frame.decode({});
      if (r.ok() && r.value().type == MessageType::full_state && r.value().fragment == 0) state = std::move(r).value();
    }
  }
  std::printf("chaos: joined, fragment 0 at version %llu, sequence base %llu\n",
              static_cast<unsigned long long>(state->version), static_cast<unsigned long long>(state->sequence));

  Message c;
  c.type = MessageType::contribution;
  c.fingerprint = plan.fingerprint();
  c.learner = id;
  c.fragment = 0;
  c.version = state->version;
  c.sequence = state->sequence + 1;
  c.steps = 1;
  c.tokens = 64;
  c.step = 1;  // one inner step since the join (at step 0): the syncer bounds steps by this advance
  c.payload = make_payload(std::vector<float>(plan.fragments()[0].numel, 0.0f));
  const std::vector<std::byte> valid = encode_frame(c, Codec::fp32);

  // 1. Garbage.
  std::mt19937_64 rng(7);
  for (std::size_t i = 0; i < f.count("garbage"); ++i) {
    std::vector<std::byte> g(64 + rng() % 512);
    for (auto& b : g) b = static_cast<std::byte>(rng() & 0xff);
    send_bytes(socket, g, "garbage");
  }
  // 2. Truncated.
  send_bytes(socket, std::span<const std::byte>(valid).first(valid.size() / 2), "truncated contribution");
  // 3. and 4. Huge length fields.
  FrameHeader h;
  h.type = MessageType::contribution;
  h.fingerprint = plan.fingerprint();
  h.learner = id;
  h.sequence = c.sequence;
  h.steps = 1;
  h.elements = std::uint64_t{1} << 40;
  h.payload_bytes = h.elements * 4;
  send_bytes(socket, header_only(h), "header claiming 2^40 elements");
  h.elements = 16;
  h.payload_bytes = std::uint64_t{1} << 62;
  send_bytes(socket, header_only(h), "header claiming 2^62 payload bytes");
  // 5. Another plan.
  Message foreign = c;
  foreign.fingerprint ^= 1;
  send_bytes(socket, encode_frame(foreign, Codec::fp32), "contribution with a wrong plan fingerprint");
  // 6. A valid contribution and its replay.
  send_bytes(socket, valid, "valid contribution");
  send_bytes(socket, valid, "replay of the valid contribution");

  Message leave;
  leave.type = MessageType::leave;
  leave.fingerprint = plan.fingerprint();
  leave.learner = id;
  send_bytes(socket, encode_frame(leave, Codec::fp32), "leave");
  zmq_close(socket);  // lingers until the frames are out
  zmq_ctx_term(context);
  std::printf("chaos: done\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddiloco_chaos_client: %s\n", e.what());
  return 1;
}
