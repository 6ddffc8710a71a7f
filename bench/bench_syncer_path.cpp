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
#include <ddiloco/detail/checksum.hpp>
#include <ddiloco/fast/kernels.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using namespace ddiloco;

// encoded: ddiloco_syncer without CURVE (the syncer compares the payload CRC in
// its norm scan); encoded_authenticated: with CURVE (the MAC covers the bytes,
// no CRC compared); encoded_checked_on_receive and decoded: earlier designs.
enum class Path { decoded, encoded_checked_on_receive, encoded, encoded_authenticated };

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
      const PayloadChecks checks = P == Path::encoded                 ? PayloadChecks::deferred
                                   : P == Path::encoded_authenticated ? PayloadChecks::authenticated
                                                                      : PayloadChecks::now;
      DecodeResult r = P == Path::decoded ? decode_frame(*frames[id], limits)
                                          : decode_frame_keep_encoded(*frames[id], limits, frames[id], checks);
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

// The bound of a design this path does not have (docs/performance.md, "Where
// the 2^22 fp32 cell stands"): learners send each tensor's norm with the
// contribution, so the syncer can fold a piece of every contribution while the
// piece is in L2, checking the checksum and the norm in the same visit. The
// merge's end is Syncer::merge's: the fused step in place, then the publication
// copy. Bytes: each contribution read once (32n for M = 8 fp32), the mean
// written once (4n), the step (20n), the copy (8n): 64n against the product
// path's 96n. Built from the library's own kernels (crc32c_update,
// squared_norm, scale_into / axpy / axpy_store_sq, scaled_nesterov), without the
// Syncer's bookkeeping, so it measures memory traffic and arithmetic only: what
// the product path would take at best if that design were built. Levels:
//   2  that design: checksum, norms, fold, step, publication copy (64n bytes);
//   1  without the CRC-32C (a transport whose MAC covers the bytes, CURVE,
//      would make it redundant);
//   0  the PyTorch peer's work in these kernels: a weighted average (no norms,
//      no checksum) and the step, no copy (56n bytes): how fast the kernels are
//      at the peer's own job, which separates the kernels from the design.
void BM_OnePassBound(benchmark::State& state) {
  const std::size_t n = std::size_t{1} << state.range(0);
  const auto m_learners = static_cast<std::size_t>(state.range(1));
  const auto level = state.range(2);  // 0: the peer's work, 1: + norms and the copy, 2: + the checksum
  const bool checksum = level >= 2, rda = level >= 1;
  const auto layout = bench::make_layout(n);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1e-3f);
  std::vector<std::vector<std::byte>> payloads(m_learners, std::vector<std::byte>(4 * n));
  std::vector<std::uint32_t> sent_crc(m_learners);
  std::vector<std::vector<double>> sent_sq(m_learners, std::vector<double>(layout.size()));
  std::vector<std::vector<float>> coef(m_learners, std::vector<float>(layout.size()));
  for (std::size_t m = 0; m < m_learners; ++m) {
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    encode(Codec::fp32, v, payloads[m]);
    sent_crc[m] = detail::crc32c(payloads[m]);
    for (std::size_t t = 0; t < layout.size(); ++t) {
      sent_sq[m][t] = fast::squared_norm(v.data() + layout[t].offset, layout[t].size);
      coef[m][t] = static_cast<float>(1.0 / (static_cast<double>(m_learners) * std::sqrt(sent_sq[m][t])));
    }
  }
  std::vector<const float*> xs(m_learners);  // fp32 payloads are read where they lie
  for (std::size_t m = 0; m < m_learners; ++m) xs[m] = fast::fp32_in_place(Codec::fp32, payloads[m].data());
  std::vector<float> mean(n), theta(n, 0.5f), momentum(n, 0.0f), published(n);
  std::vector<std::uint32_t> crc(m_learners);
  std::vector<std::vector<double>> sq(m_learners, std::vector<double>(layout.size()));
  std::vector<double> mean_sq(layout.size());
  for (auto _ : state) {
    std::fill(crc.begin(), crc.end(), 0xFFFFFFFFU);
    for (auto& s : sq) std::fill(s.begin(), s.end(), 0.0);
    std::fill(mean_sq.begin(), mean_sq.end(), 0.0);
    for (std::size_t a = 0; a < n; a += fast::kCheckPiece) {
      const std::size_t b = std::min(n, a + fast::kCheckPiece);
      for (std::size_t m = 0; m < m_learners; ++m) {
        if (checksum) crc[m] = detail::crc32c_update(crc[m], std::span(payloads[m]).subspan(4 * a, 4 * (b - a)));
        const float* x = xs[m];
        for (std::size_t t = 0; t < layout.size(); ++t) {
          const std::size_t lo = std::max(a, layout[t].offset), hi = std::min(b, layout[t].offset + layout[t].size);
          if (lo >= hi) continue;
          if (rda) sq[m][t] += fast::squared_norm(x + lo, hi - lo);
          if (m == 0) {
            fast::scale_into(coef[m][t], x + lo, mean.data() + lo, hi - lo);
          } else if (m + 1 < m_learners || !rda) {
            fast::axpy(coef[m][t], x + lo, mean.data() + lo, hi - lo);
          } else {  // the last contribution: the mean's squared norm in the same pass
            mean_sq[t] += fast::axpy_store_sq(coef[m][t], x + lo, mean.data() + lo, mean.data() + lo, hi - lo);
          }
        }
      }
    }
    for (std::size_t m = 0; m < m_learners; ++m) {
      if ((checksum && (crc[m] ^ 0xFFFFFFFFU) != sent_crc[m]) || (rda && sq[m] != sent_sq[m])) {
        state.SkipWithError("a checksum or a sent norm did not match");
        return;
      }
    }
    // The fused step in place, then the publication copy, as Syncer::merge does.
    for (std::size_t t = 0; t < layout.size(); ++t) {
      const auto& seg = layout[t];
      const float c = rda ? static_cast<float>(1e-3 / std::sqrt(std::max(mean_sq[t], 1e-30))) : 1.0f;
      fast::scaled_nesterov(c, 1.0f,
                            mean.data() + seg.offset, 0.9f, 0.7f, theta.data() + seg.offset,
                            momentum.data() + seg.offset, seg.size);
    }
    if (rda) std::copy(theta.begin(), theta.end(), published.begin());
    benchmark::DoNotOptimize(published.data());
    benchmark::DoNotOptimize(theta.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(m_learners) *
                          static_cast<std::int64_t>(4 * n));
}
BENCHMARK(BM_OnePassBound)
    ->ArgNames({"log2n", "M", "level"})
    ->Args({22, 8, 2})
    ->Args({24, 8, 2})
    ->Args({22, 8, 1})
    ->Args({24, 8, 1})
    ->Args({22, 8, 0})
    ->Args({24, 8, 0})
    ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);

void args(benchmark::internal::Benchmark* b) {
  b->Args({22, 8})->Args({24, 8})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
}

/// One round's registration under its printed name, e.g. BM_SyncerRoundFromFrames<fp32>/encoded.
template <Codec C, Path P>
void round(const char* path) {
  benchmark::RegisterBenchmark(("BM_SyncerRoundFromFrames<" + std::string(ddiloco::to_string(C)) + ">/" + path).c_str(),
                               BM_SyncerRoundFromFrames<C, P>)
      ->Apply(args);
}

[[maybe_unused]] const bool registered = [] {
  round<Codec::int4, Path::encoded>("encoded");
  round<Codec::int4, Path::encoded_checked_on_receive>("encoded_checked_on_receive");
  round<Codec::int4, Path::decoded>("decoded");
  round<Codec::fp32, Path::encoded>("encoded");
  round<Codec::fp32, Path::encoded_checked_on_receive>("encoded_checked_on_receive");
  round<Codec::fp32, Path::encoded_authenticated>("authenticated");
  round<Codec::int4, Path::encoded_authenticated>("authenticated");
  round<Codec::fp32, Path::decoded>("decoded");
  // The other codecs on the product path, plaintext and CURVE (sim/capacity.hpp's SyncerCosts
  // quotes every codec's fold rates).
  round<Codec::bf16, Path::encoded>("encoded");
  round<Codec::fp16, Path::encoded>("encoded");
  round<Codec::int8, Path::encoded>("encoded");
  round<Codec::bf16, Path::encoded_authenticated>("authenticated");
  round<Codec::fp16, Path::encoded_authenticated>("authenticated");
  round<Codec::int8, Path::encoded_authenticated>("authenticated");
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
