// Benchmark of the target "no extra copies of payloads between the socket and
// the accumulator" (docs/performance.md): one merge round of the Syncer fed from received wire
// frames, the path a ZeroMQ syncer runs minus the socket itself:
//   decoded  decode_frame (checks, then an fp32 vector per contribution), then
//            Syncer::handle_batch of the fp32 payloads (finiteness + norm scan,
//            add_batch, merge);  ZmqSyncerConfig::keep_contributions_encoded = false
//   encoded  decode_frame_keep_encoded with PayloadChecks::deferred (header
//            and sizes; the payload stays in the frame, its checksum is handed
//            on), then handle_batch of the encoded payloads (ONE scan of the
//            bytes for checksum + code validity + norms, add_batch decoding
//            chunk by chunk in L1, merge); keep_contributions_encoded = true
//            with the default payload_checks, what ddiloco_syncer runs.
//   encoded_checked_on_receive  the same with PayloadChecks::now: the
//            checksum and the codes are checked at decode (a pass of their
//            own), as before the syncer took them over.
// M = 8 learners, one fragment of 2^24 elements (the layout of bench_common.hpp),
// K = M so every round is one merge of all eight, one thread. Counted bytes: the
// frames' payloads (what arrived over the network), so GB/s is the rate at
// which the syncer absorbs contributions.
#include <ddiloco/clock.hpp>
#include <ddiloco/codec.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/message.hpp>
#include <ddiloco/syncer.hpp>
#include <ddiloco/wire.hpp>

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "bench_common.hpp"

namespace {

using namespace ddiloco;

enum class Path { decoded, encoded_checked_on_receive, encoded };

template <Codec C, Path P>
void BM_SyncerRoundFromFrames(benchmark::State& state) {
  const std::size_t n = std::size_t{1} << state.range(0);
  const auto m_learners = static_cast<LearnerId>(state.range(1));
  std::vector<TensorSpec> specs;
  const char* names[] = {"emb", "t1", "t2", "t3", "t4", "t5"};  // make_layout's six tensors
  for (const auto& seg : bench::make_layout(n)) specs.push_back({names[specs.size()], seg.size, seg.embedding});
  const Plan plan = make_plan(specs, 1);
  VirtualClock clock;
  SyncerConfig config;
  config.round = RoundMode::push;
  config.quorum.min_quorum = m_learners;
  config.quorum.grace = false;
  config.quorum.deadline = std::chrono::hours(1);
  config.heartbeat_timeout = std::chrono::hours(1);
  Syncer<> syncer(plan, std::vector<float>(n, 0.5f), clock, config);

  Outbox out;
  std::vector<std::uint64_t> base(m_learners);
  for (LearnerId id = 0; id < m_learners; ++id) {
    Message join;
    join.type = MessageType::join;
    join.fingerprint = plan.fingerprint();
    join.learner = id;
    join.sequence = 1000 + id;
    syncer.handle(join, out);
    base[id] = out.back().message.sequence;  // the incarnation's first sequence number
    out.clear();
  }
  // One received frame per learner (its payload: small random outer gradients).
  std::vector<std::shared_ptr<const std::vector<std::byte>>> frames;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1e-3f);
  for (LearnerId id = 0; id < m_learners; ++id) {
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    Message m;
    m.type = MessageType::contribution;
    m.fingerprint = plan.fingerprint();
    m.learner = id;
    m.steps = 24;
    m.tokens = 24 * 4096;
    m.payload = make_payload(std::move(v));
    frames.push_back(std::make_shared<const std::vector<std::byte>>(encode_frame(m, C)));
  }
  const DecodeLimits limits{n};
  std::uint64_t round = 0;
  std::vector<Message> batch;
  for (auto _ : state) {
    batch.clear();
    for (LearnerId id = 0; id < m_learners; ++id) {
      DecodeResult r = P == Path::decoded ? decode_frame(*frames[id], limits)
                                          : decode_frame_keep_encoded(*frames[id], limits, frames[id],
                                                                      P == Path::encoded ? PayloadChecks::deferred
                                                                                         : PayloadChecks::now);
      if (!r.ok()) {
        state.SkipWithError("a frame failed to decode");
        return;
      }
      Message m = std::move(r).value();
      // The same bytes replayed: give each round its own sequence and base version.
      m.sequence = base[id] + 1 + round;
      m.version = round;
      m.step = 24 * (round + 1);  // an honest step counter: 24 steps per round (the syncer bounds steps by it)
      batch.push_back(std::move(m));
    }
    syncer.handle_batch(batch, out);
    out.clear();
    ++round;
  }
  if (syncer.status().merges != round || syncer.status().rejected_total() != 0) {
    state.SkipWithError("not every round merged all contributions");
    return;
  }
  const std::size_t payload = encoded_size(C, n);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * m_learners *
                          static_cast<std::int64_t>(payload));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * m_learners * static_cast<std::int64_t>(n));
}

void args(benchmark::internal::Benchmark* b) {
  b->Args({22, 8})->Args({24, 8})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
}

}  // namespace

BENCHMARK_TEMPLATE(BM_SyncerRoundFromFrames, Codec::int4, Path::encoded)->Name("BM_SyncerRoundFromFrames<int4>/encoded")->Apply(args);
BENCHMARK_TEMPLATE(BM_SyncerRoundFromFrames, Codec::int4, Path::encoded_checked_on_receive)
    ->Name("BM_SyncerRoundFromFrames<int4>/encoded_checked_on_receive")
    ->Apply(args);
BENCHMARK_TEMPLATE(BM_SyncerRoundFromFrames, Codec::int4, Path::decoded)->Name("BM_SyncerRoundFromFrames<int4>/decoded")->Apply(args);
BENCHMARK_TEMPLATE(BM_SyncerRoundFromFrames, Codec::fp32, Path::encoded)->Name("BM_SyncerRoundFromFrames<fp32>/encoded")->Apply(args);
BENCHMARK_TEMPLATE(BM_SyncerRoundFromFrames, Codec::fp32, Path::encoded_checked_on_receive)
    ->Name("BM_SyncerRoundFromFrames<fp32>/encoded_checked_on_receive")
    ->Apply(args);
BENCHMARK_TEMPLATE(BM_SyncerRoundFromFrames, Codec::fp32, Path::decoded)->Name("BM_SyncerRoundFromFrames<fp32>/decoded")->Apply(args);
// The other codecs on the product path (sim/capacity.hpp's SyncerCosts quotes every codec's fold rate).
BENCHMARK_TEMPLATE(BM_SyncerRoundFromFrames, Codec::bf16, Path::encoded)->Name("BM_SyncerRoundFromFrames<bf16>/encoded")->Apply(args);
BENCHMARK_TEMPLATE(BM_SyncerRoundFromFrames, Codec::fp16, Path::encoded)->Name("BM_SyncerRoundFromFrames<fp16>/encoded")->Apply(args);
BENCHMARK_TEMPLATE(BM_SyncerRoundFromFrames, Codec::int8, Path::encoded)->Name("BM_SyncerRoundFromFrames<int8>/encoded")->Apply(args);

BENCHMARK_MAIN();
