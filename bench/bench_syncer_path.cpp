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

// fast::scaled_nesterov (share 1) with theta read from one buffer and written
// into another: BM_OnePassBound's publish = 2.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
[[gnu::target_clones("arch=haswell", "default")]]  // the vector width of the kernels' AVX2 clones
#endif
void nesterov_out_of_place(float c, const float* __restrict__ mean, float mu, float eta,
                           const float* __restrict__ theta, float* __restrict__ b, float* __restrict__ out,
                           std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const float d = c * mean[i];
    const float bi = mu * b[i] + d;
    b[i] = bi;
    out[i] = theta[i] - eta * (d + mu * bi);
  }
}

// What BM_OnePassBound and BM_TensorInterleavedBound share: M fp32 contribution
// payloads of small random outer gradients with their CRC-32C (as sent), read
// as floats where they lie, and the fragment's buffers; finish() is the merge's
// end after the fold into `mean`.
struct BoundRound {
  BoundRound(std::size_t n, std::size_t m_learners)
      : layout(bench::make_layout(n)),
        payloads(m_learners, std::vector<std::byte>(4 * n)),
        sent_crc(m_learners),
        xs(m_learners),
        mean(n),
        theta(n, 0.5f),
        momentum(n, 0.0f),
        published(n),
        mean_sq(layout.size()) {
    std::mt19937 rng(7);
    std::normal_distribution<float> dist(0.0f, 1e-3f);
    std::vector<float> v(n);
    for (std::size_t m = 0; m < m_learners; ++m) {
      for (float& x : v) x = dist(rng);
      encode(Codec::fp32, v, payloads[m]);
      sent_crc[m] = detail::crc32c(payloads[m]);
      xs[m] = fast::fp32_in_place(Codec::fp32, payloads[m].data());
    }
  }

  /// The fused step per tensor (RDA's radial scale from mean_sq when rda), and
  /// the publication: 0 none, 1 the step in place and then a copy, as
  /// Syncer::merge does, 2 the step out of place into the buffer published,
  /// the two buffers swapping roles.
  void finish(bool rda, std::int64_t publish) {
    for (std::size_t t = 0; t < layout.size(); ++t) {
      const auto& seg = layout[t];
      const float c = rda ? static_cast<float>(1e-3 / std::sqrt(std::max(mean_sq[t], 1e-30))) : 1.0f;
      if (publish == 2) {
        nesterov_out_of_place(c, mean.data() + seg.offset, 0.9f, 0.7f, theta.data() + seg.offset,
                              momentum.data() + seg.offset, published.data() + seg.offset, seg.size);
      } else {
        fast::scaled_nesterov(c, 1.0f, mean.data() + seg.offset, 0.9f, 0.7f, theta.data() + seg.offset,
                              momentum.data() + seg.offset, seg.size);
      }
    }
    if (publish == 1) std::copy(theta.begin(), theta.end(), published.begin());
    if (publish == 2) theta.swap(published);
    benchmark::DoNotOptimize(published.data());
    benchmark::DoNotOptimize(theta.data());
  }

  /// Whether every running CRC (started at 0xFFFFFFFF) ends at the sent one.
  [[nodiscard]] bool checksums_match(std::span<const std::uint32_t> crc) const {
    for (std::size_t m = 0; m < crc.size(); ++m)
      if ((crc[m] ^ 0xFFFFFFFFU) != sent_crc[m]) return false;
    return true;
  }

  std::vector<TensorSegment> layout;
  std::vector<std::vector<std::byte>> payloads;
  std::vector<std::uint32_t> sent_crc;
  std::vector<const float*> xs;  // fp32 payloads are read where they lie
  std::vector<float> mean, theta, momentum, published;
  std::vector<double> mean_sq;  // per tensor: ||mean_t||^2
};

// The bound of a design this path does not have (docs/performance.md, "Where
// the 2^22 fp32 cell stands"): learners send each tensor's norm with the
// contribution, so the syncer can fold a piece of every contribution while the
// piece is in L2, checking the checksum and the norm in the same visit. The
// merge's end is Syncer::merge's: the fused step in place, then the publication
// copy. Bytes: each contribution read once (32n for M = 8 fp32), the mean
// written once (4n), the step (20n), the copy (8n): 64n against the product
// path's 96n. Built from the library's own kernels (crc32c_update,
// squared_norm, scale_into / axpy, scaled_nesterov), without the
// Syncer's bookkeeping, so it measures memory traffic and arithmetic only: what
// the product path would take at best if that design were built. Levels:
//   2  that design: checksum, norms, fold, step, publication copy (64n bytes);
//   1  without the CRC-32C (a transport whose MAC covers the bytes, CURVE,
//      would make it redundant);
//   0  the PyTorch peer's work in these kernels: a weighted average (no norms,
//      no checksum) and the step, no copy (56n bytes): how fast the kernels are
//      at the peer's own job, which separates the kernels from the design.
// The fourth argument is how the new global is published: 1 the step in place,
// then a copy (Syncer::merge today); 0 no publication at all (a floor); 2 the
// step reads theta from one buffer and writes it into another, which is
// published while the two swap roles every merge (no copy, but a write stream
// that the in-place step does not have).
void BM_OnePassBound(benchmark::State& state) {
  const std::size_t n = std::size_t{1} << state.range(0);
  const auto m_learners = static_cast<std::size_t>(state.range(1));
  const auto level = state.range(2);  // 0: the peer's work, 1: + norms, 2: + the checksum
  const bool checksum = level >= 2, rda = level >= 1;
  const auto publish = state.range(3);  // 0: none, 1: step in place + copy, 2: step out of place
  BoundRound r(n, m_learners);
  const auto& layout = r.layout;
  float* mean = r.mean.data();
  // What the learners would send: every tensor's squared norm.
  std::vector<std::vector<double>> sent_sq(m_learners, std::vector<double>(layout.size()));
  std::vector<std::vector<float>> coef(m_learners, std::vector<float>(layout.size()));
  for (std::size_t m = 0; m < m_learners; ++m) {
    for (std::size_t t = 0; t < layout.size(); ++t) {
      sent_sq[m][t] = fast::squared_norm(r.xs[m] + layout[t].offset, layout[t].size);
      coef[m][t] = static_cast<float>(1.0 / (static_cast<double>(m_learners) * std::sqrt(sent_sq[m][t])));
    }
  }
  std::vector<std::uint32_t> crc(m_learners);
  std::vector<std::vector<double>> sq(m_learners, std::vector<double>(layout.size()));
  for (auto _ : state) {
    std::fill(crc.begin(), crc.end(), 0xFFFFFFFFU);
    for (auto& s : sq) std::fill(s.begin(), s.end(), 0.0);
    std::fill(r.mean_sq.begin(), r.mean_sq.end(), 0.0);
    for (std::size_t a = 0; a < n; a += fast::kCheckPiece) {
      const std::size_t b = std::min(n, a + fast::kCheckPiece);
      for (std::size_t m = 0; m < m_learners; ++m) {
        if (checksum) crc[m] = detail::crc32c_update(crc[m], std::span(r.payloads[m]).subspan(4 * a, 4 * (b - a)));
        const float* x = r.xs[m];
        for (std::size_t t = 0; t < layout.size(); ++t) {
          const std::size_t lo = std::max(a, layout[t].offset), hi = std::min(b, layout[t].offset + layout[t].size);
          if (lo >= hi) continue;
          if (rda) sq[m][t] += fast::squared_norm(x + lo, hi - lo);
          if (m == 0) {
            fast::scale_into(coef[m][t], x + lo, mean + lo, hi - lo);
          } else {
            fast::axpy(coef[m][t], x + lo, mean + lo, hi - lo);
            // the last contribution: the mean's squared norm while the piece is in L2
            if (rda && m + 1 == m_learners) r.mean_sq[t] += fast::squared_norm(mean + lo, hi - lo);
          }
        }
      }
    }
    if ((checksum && !r.checksums_match(crc)) || (rda && sq != sent_sq)) {
      state.SkipWithError("a checksum or a sent norm did not match");
      return;
    }
    r.finish(rda, publish);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(m_learners) *
                          static_cast<std::int64_t>(4 * n));
}
BENCHMARK(BM_OnePassBound)
    ->ArgNames({"log2n", "M", "level", "publish"})
    ->Args({22, 8, 2, 1})
    ->Args({24, 8, 2, 1})
    ->Args({22, 8, 1, 1})
    ->Args({24, 8, 1, 1})
    ->Args({22, 8, 0, 0})
    ->Args({24, 8, 0, 0})
    ->Args({22, 8, 1, 0})
    ->Args({24, 8, 1, 0})
    ->Args({22, 8, 1, 2})
    ->Args({24, 8, 1, 2})
    ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);

// The bound of the other single-read design, one that needs no protocol change
// (docs/performance.md, "Two designs that read each contribution from memory
// once"): the syncer takes a tensor at a time, and for each contribution scans
// that tensor's slice (CRC-32C when crc = 1, and its squared norm) and at once
// folds it into the mean, while the slice is still in cache; the direction's
// coefficient needs only that tensor's norm. It reads each contribution from
// DRAM once only while a tensor's slice and the mean's fit in the last-level
// cache together (make_layout's largest tensor is 3n/8 elements: 6 MiB at 2^22,
// 24 MiB at 2^24, against this host's 32 MiB L3). In a syncer the fold would
// run before admission has seen the whole contribution's norm, so it would be
// a guess that admission confirms or undoes. Built from the same kernels as
// BM_OnePassBound, without the Syncer's bookkeeping; the step and the
// publication copy as Syncer::merge does them.
void BM_TensorInterleavedBound(benchmark::State& state) {
  const std::size_t n = std::size_t{1} << state.range(0);
  const auto m_learners = static_cast<std::size_t>(state.range(1));
  const bool checksum = state.range(2) != 0;
  BoundRound r(n, m_learners);
  std::vector<std::uint32_t> crc(m_learners);
  for (auto _ : state) {
    std::fill(crc.begin(), crc.end(), 0xFFFFFFFFU);
    for (std::size_t t = 0; t < r.layout.size(); ++t) {  // in payload order: each CRC runs over its bytes in order
      const auto& seg = r.layout[t];
      float* acc = r.mean.data() + seg.offset;
      r.mean_sq[t] = 0.0;
      for (std::size_t m = 0; m < m_learners; ++m) {
        const float* x = r.xs[m] + seg.offset;
        double sq = 0.0;
        for (std::size_t a = 0; a < seg.size; a += fast::kCheckPiece) {
          const std::size_t len = std::min(seg.size - a, fast::kCheckPiece);
          const auto bytes = std::span(r.payloads[m]).subspan(4 * (seg.offset + a), 4 * len);
          if (checksum) crc[m] = detail::crc32c_update(crc[m], bytes);
          sq += fast::squared_norm(x + a, len);
        }
        const auto c = static_cast<float>(1.0 / (static_cast<double>(m_learners) * std::sqrt(sq)));
        for (std::size_t a = 0; a < seg.size; a += fast::kCheckPiece) {
          const std::size_t len = std::min(seg.size - a, fast::kCheckPiece);
          if (m == 0) {
            fast::scale_into(c, x + a, acc + a, len);
          } else {
            fast::axpy(c, x + a, acc + a, len);
            // the last contribution: the mean's squared norm while the piece is in L2
            if (m + 1 == m_learners) r.mean_sq[t] += fast::squared_norm(acc + a, len);
          }
        }
      }
    }
    if (checksum && !r.checksums_match(crc)) {
      state.SkipWithError("a checksum did not match");
      return;
    }
    r.finish(true, 1);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(m_learners) *
                          static_cast<std::int64_t>(4 * n));
}
BENCHMARK(BM_TensorInterleavedBound)
    ->ArgNames({"log2n", "M", "crc"})
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
