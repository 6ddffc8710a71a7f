// Performance benchmarks (docs/performance.md): the syncer's merge + outer step and the learner's
// step against the machine's memory bandwidth (<ddiloco/fast/merge.hpp>,
// <ddiloco/fast/kernels.hpp>, the references they are tested against, OuterLoop).
//
// Every rate is the MINIMUM bytes the operation must move divided by its time,
// so it compares with the STREAM-style triad measured here (scripts/bench.sh
// divides the two: the roofline ratio). For a fragment of n elements:
//   triad             a = b + s c: read b, c, write a                  = 12n (STREAM's count)
//   memcpy            read n floats, write n floats                    =  8n
//   merge round (RDA, M contributions, streaming, then the outer step):
//     contributions   read once each: fp32 4n, int4 4 ceil(n/64) + ceil(n/2)
//     accumulator     first add writes it (4n), every later add reads and
//                     writes it (8n): 4n + (M - 1) 8n
//     finish + step   read mean, theta, b; write theta, b              = 20n
//   merge round, batched (add_batch of all M, then the outer step):
//     contributions   read once each (as above)
//     accumulator     written once: 4n
//     finish + step   20n
//   learner due step  read local and base, write the new base and the payload
//                     = 12n + encoded_size
// The RDA norm pass re-reads each contribution; that second read is not in
// the minimum (it is what the tensor grouping tries to serve from cache).
//
// Arguments: merge rounds take {log2 n, M, threads}; the 16M-element case is
// log2 n = 24. Run with --benchmark_repetitions and report medians
// (scripts/bench.sh does).
#include <ddiloco/clock.hpp>
#include <ddiloco/codec.hpp>
#include <ddiloco/fast/kernels.hpp>
#include <ddiloco/fast/merge.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/merge.hpp>
#include <ddiloco/merge_weights.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/outer_optimizer.hpp>
#include <ddiloco/syncer.hpp>
#include <ddiloco/transport/in_process.hpp>
#include <ddiloco/wire.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace fast = ddiloco::fast;

namespace {

using ddiloco::Codec;

using ddiloco::bench::make_layout;

std::vector<float> lcg_vector(std::size_t n, std::uint32_t seed) {
  std::vector<float> v(n);
  std::uint32_t state = seed;
  for (float& x : v) {
    state = state * 1664525u + 1013904223u;  // LCG: cheap, deterministic values in [-1, 1)
    x = static_cast<float>(static_cast<double>(state) / 2147483648.0 - 1.0);
  }
  return v;
}

/// M distinct contributions of n elements in `codec` (raw fp32 vectors for fp32),
/// cached for the last (n, M, codec) only: 2^24 x 8 fp32 = 512 MiB.
struct Contributions {
  std::size_t n = 0, m = 0;
  Codec codec = Codec::fp32;
  std::vector<std::vector<float>> fp32;
  std::vector<std::vector<std::byte>> encoded;
};
const Contributions& contributions(std::size_t n, std::size_t m, Codec codec) {
  static Contributions c;
  if (c.n != n || c.m != m || c.codec != codec) {
    c = Contributions{};
    c.n = n;
    c.m = m;
    c.codec = codec;
    for (std::size_t k = 0; k < m; ++k) {
      auto v = lcg_vector(n, static_cast<std::uint32_t>(12345 + k));
      if (codec == Codec::fp32) {
        c.fp32.push_back(std::move(v));
      } else {
        c.encoded.push_back(ddiloco::encode(codec, v));
      }
    }
  }
  return c;
}

double weight(std::size_t k) { return 1.0 + static_cast<double>(k % 7) * 0.5; }

std::size_t min_round_bytes(std::size_t n, std::size_t m, Codec codec) {
  return m * ddiloco::encoded_size(codec, n) + 4 * n + (m - 1) * 8 * n + 20 * n;
}

std::size_t min_batch_round_bytes(std::size_t n, std::size_t m, Codec codec) {
  return m * ddiloco::encoded_size(codec, n) + 4 * n + 20 * n;
}

/// The batch of all M contributions (spans into the cached inputs).
template <Codec C, class In>
std::vector<fast::Contribution> make_batch(const In& in, std::size_t m) {
  std::vector<fast::Contribution> batch(m);
  for (std::size_t k = 0; k < m; ++k) {
    batch[k].codec = C;
    batch[k].weight = weight(k);
    if constexpr (C == Codec::fp32) {
      batch[k].values = in.fp32[k];
    } else {
      batch[k].bytes = in.encoded[k];
    }
  }
  return batch;
}

/// One batched syncer round: add_batch of all M contributions, then finish + Nesterov.
template <class Acc>
void fast_batch_round(Acc& acc, const std::vector<fast::Contribution>& batch, const ddiloco::NesterovSGD& opt,
                      std::vector<float>& theta, std::vector<float>& momentum) {
  acc.reset();
  acc.add_batch(batch);
  acc.finish_step(opt, 1.0f, theta, momentum);
}

/// One syncer round with the fast kernels: M contributions accumulated (fp32,
/// or decoded inside the merge passes), then finish + Nesterov in one pass.
template <Codec C, class Acc, class In>
void fast_round(Acc& acc, const In& in, std::size_t m, const ddiloco::NesterovSGD& opt, std::vector<float>& theta,
                std::vector<float>& momentum) {
  acc.reset();
  for (std::size_t k = 0; k < m; ++k) {
    if constexpr (C == Codec::fp32) {
      acc.add(in.fp32[k], weight(k));
    } else {
      acc.add_encoded(C, in.encoded[k], weight(k));
    }
  }
  acc.finish_step(opt, 1.0f, theta, momentum);
}

void set_rates(benchmark::State& state, std::size_t bytes, std::size_t items) {
  const auto it = static_cast<std::int64_t>(state.iterations());
  state.SetBytesProcessed(it * static_cast<std::int64_t>(bytes));
  state.SetItemsProcessed(it * static_cast<std::int64_t>(items));
}

fast::Workers& workers(std::size_t threads) {
  static std::map<std::size_t, std::unique_ptr<fast::Workers>> pool;
  auto& w = pool[threads];
  if (!w) w = std::make_unique<fast::Workers>(threads);
  return *w;
}

// ---- machine bandwidth ----------------------------------------------------------

/// STREAM triad a = b + s c over 2^25-float arrays (3 x 128 MiB), split over threads.
void BM_Triad(benchmark::State& state) {
  const auto n = std::size_t{1} << state.range(0);
  const auto threads = static_cast<std::size_t>(state.range(1));
  std::vector<float> a(n, 0.0f), b(n, 1.0f), c(n, 2.0f);
  auto& w = workers(threads);
  for (auto _ : state) {
    w.run([&](std::size_t p) {
      const std::size_t lo = n * p / threads, hi = n * (p + 1) / threads;
      float* __restrict__ pa = a.data();
      const float* __restrict__ pb = b.data();
      const float* __restrict__ pc = c.data();
      for (std::size_t i = lo; i < hi; ++i) pa[i] = pb[i] + 3.0f * pc[i];
    });
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, 12 * n, n);
}

/// memcpy of 2^24 floats (64 MiB): 8n bytes moved.
void BM_Memcpy(benchmark::State& state) {
  const auto n = std::size_t{1} << state.range(0);
  std::vector<float> src(n, 1.0f), dst(n, 0.0f);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), 4 * n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, 8 * n, n);
}

// ---- syncer: RDA merge of M contributions + Nesterov step ------------------------

/// fast::RadialDirectional: reset, M adds (fp32 floats or encoded bytes), fused finish + Nesterov.
template <Codec C>
void BM_FastRound(benchmark::State& state) {
  const auto n = std::size_t{1} << state.range(0);
  const auto m = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  const auto layout = make_layout(n);
  const auto& in = contributions(n, m, C);
  auto acc = fast::RadialDirectional{&workers(threads)}.make_accumulator(layout);
  const ddiloco::NesterovSGD opt;
  std::vector<float> theta(n, 1.0f), momentum(n, 0.0f);
  for (auto _ : state) {
    fast_round<C>(acc, in, m, opt, theta, momentum);
    benchmark::DoNotOptimize(theta.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, min_round_bytes(n, m, C), n);
}

/// fast::RadialDirectional, batched: reset, one add_batch of all M, fused finish + Nesterov.
/// Clipped: every other contribution enters scaled by 1/4 (fast::Contribution::scale,
/// what the syncer's norm clipping sets), to show that clipping costs the fold nothing.
template <Codec C, bool Clipped = false>
void BM_FastBatchRound(benchmark::State& state) {
  const auto n = std::size_t{1} << state.range(0);
  const auto m = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  const auto layout = make_layout(n);
  const auto& in = contributions(n, m, C);
  auto batch = make_batch<C>(in, m);
  if constexpr (Clipped) {
    for (std::size_t k = 0; k < m; k += 2) batch[k].scale = 0.25;
  }
  auto acc = fast::RadialDirectional{&workers(threads)}.make_accumulator(layout);
  const ddiloco::NesterovSGD opt;
  std::vector<float> theta(n, 1.0f), momentum(n, 0.0f);
  for (auto _ : state) {
    fast_batch_round(acc, batch, opt, theta, momentum);
    benchmark::DoNotOptimize(theta.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, min_batch_round_bytes(n, m, C), n);
}

/// The readable reference: decode (int4) into a buffer, ddiloco::RadialDirectional
/// adds, finish into delta, NesterovSGD::step.
template <Codec C>
void BM_ReferenceRound(benchmark::State& state) {
  const auto n = std::size_t{1} << state.range(0);
  const auto m = static_cast<std::size_t>(state.range(1));
  const auto layout = make_layout(n);
  const auto& in = contributions(n, m, C);
  auto acc = ddiloco::RadialDirectional{}.make_accumulator(layout);
  const ddiloco::NesterovSGD opt;
  std::vector<float> theta(n, 1.0f), momentum(n, 0.0f), delta(n), decoded(C == Codec::fp32 ? 0 : n);
  for (auto _ : state) {
    acc.reset();
    for (std::size_t k = 0; k < m; ++k) {
      if constexpr (C == Codec::fp32) {
        acc.add(in.fp32[k], weight(k));
      } else {
        ddiloco::decode(C, in.encoded[k], decoded);
        acc.add(decoded, weight(k));
      }
    }
    acc.finish(delta);
    opt.step(theta, delta, momentum);
    benchmark::DoNotOptimize(theta.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, min_round_bytes(n, m, C), n);
}

/// The roofline ratio measured pairwise, for a loaded machine: each iteration
/// times one triad pass (2^25 floats, same threads) and then one fast merge
/// round, back to back, so both see the same background load. Counters:
/// ratio = (round min bytes / round time) / (triad bytes / triad time) over
/// the repetition, and the two rates. Arguments {log2 n, M, threads, baseline}:
/// baseline = 1 runs the SSE2 build of the kernels even where AVX2 is available.
/// Batched = true times the add_batch round (BM_RooflinePairBatch) against its
/// own minimum bytes (min_batch_round_bytes).
template <Codec C, bool Batched = false>
void BM_RooflinePair(benchmark::State& state) {
  using Clock = std::chrono::steady_clock;
  const auto n = std::size_t{1} << state.range(0);
  const auto m = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  fast::use_baseline_kernels(state.range(3) == 1);  // 1: SSE2 baseline build even on an AVX2 CPU
  const auto layout = make_layout(n);
  const auto& in = contributions(n, m, C);
  auto& w = workers(threads);
  auto acc = fast::RadialDirectional{&w}.make_accumulator(layout);
  const ddiloco::NesterovSGD opt;
  std::vector<float> theta(n, 1.0f), momentum(n, 0.0f);
  const auto batch = make_batch<C>(in, m);
  const std::size_t round_bytes = Batched ? min_batch_round_bytes(n, m, C) : min_round_bytes(n, m, C);
  const std::size_t tn = std::size_t{1} << 25;
  std::vector<float> a(tn, 0.0f), b(tn, 1.0f), c(tn, 2.0f);
  double triad_s = 0.0, round_s = 0.0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    w.run([&](std::size_t p) {
      const std::size_t lo = tn * p / threads, hi = tn * (p + 1) / threads;
      float* __restrict__ pa = a.data();
      const float* __restrict__ pb = b.data();
      const float* __restrict__ pc = c.data();
      for (std::size_t i = lo; i < hi; ++i) pa[i] = pb[i] + 3.0f * pc[i];
    });
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
    const auto t1 = Clock::now();
    if constexpr (Batched) {
      fast_batch_round(acc, batch, opt, theta, momentum);
    } else {
      fast_round<C>(acc, in, m, opt, theta, momentum);
    }
    benchmark::DoNotOptimize(theta.data());
    benchmark::ClobberMemory();
    const auto t2 = Clock::now();
    triad_s += std::chrono::duration<double>(t1 - t0).count();
    round_s += std::chrono::duration<double>(t2 - t1).count();
  }
  const double triad_bw = 12.0 * static_cast<double>(tn) * static_cast<double>(state.iterations()) / triad_s;
  const double round_bw = static_cast<double>(round_bytes) * static_cast<double>(state.iterations()) / round_s;
  state.counters["triad_Bps"] = triad_bw;
  state.counters["round_Bps"] = round_bw;
  state.counters["round_s"] = round_s / static_cast<double>(state.iterations());
  state.counters["ratio"] = round_bw / triad_bw;
  fast::use_baseline_kernels(false);
}

// ---- learner side ---------------------------------------------------------------

/// The due step: snapshot (copy) + outer gradient + encode, fused. Each
/// iteration also times a memcpy of the same n floats just before, so the
/// `vs_memcpy` counter compares the two under the same background load.
/// Arguments {log2 n, baseline}: baseline = 1 runs the SSE2 build of the kernels.
template <Codec C>
void BM_LearnerDueFast(benchmark::State& state) {
  using Clock = std::chrono::steady_clock;
  const auto n = std::size_t{1} << state.range(0);
  fast::use_baseline_kernels(state.range(1) == 1);
  const auto local = lcg_vector(n, 1), base = lcg_vector(n, 2);
  std::vector<float> new_base(n), copy(n);
  std::vector<std::byte> out(ddiloco::encoded_size(C, n));
  double memcpy_s = 0.0, due_s = 0.0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    std::memcpy(copy.data(), base.data(), 4 * n);
    benchmark::DoNotOptimize(copy.data());
    benchmark::ClobberMemory();
    const auto t1 = Clock::now();
    fast::snapshot_outer_gradient(C, local, base, new_base, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    const auto t2 = Clock::now();
    memcpy_s += std::chrono::duration<double>(t1 - t0).count();
    due_s += std::chrono::duration<double>(t2 - t1).count();
  }
  const auto it = static_cast<double>(state.iterations());
  const double due_bw = static_cast<double>(12 * n + out.size()) * it / due_s;
  const double memcpy_bw = 8.0 * static_cast<double>(n) * it / memcpy_s;
  state.counters["due_Bps"] = due_bw;
  state.counters["memcpy_Bps"] = memcpy_bw;
  state.counters["due_s"] = due_s / it;
  state.counters["vs_memcpy"] = due_bw / memcpy_bw;
  fast::use_baseline_kernels(false);
}

/// The same as OuterLoop::send_fragment + transport encode do it today: copy,
/// subtract into a fresh vector, encode.
template <Codec C>
void BM_LearnerDueReference(benchmark::State& state) {
  const auto n = std::size_t{1} << state.range(0);
  const auto local = lcg_vector(n, 1), base = lcg_vector(n, 2);
  std::vector<float> new_base(n);
  std::vector<std::byte> out(ddiloco::encoded_size(C, n));
  for (auto _ : state) {
    std::copy(local.begin(), local.end(), new_base.begin());
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = base[i] - new_base[i];
    ddiloco::encode(C, v, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, 12 * n + out.size(), n);
}

/// Joins `outer` (over the in-process network `net`, learner side) to a syncer
/// on `plan`, as the learner-step benchmarks need before they time anything.
template <class Outer, class Params>
bool join_syncer(const ddiloco::Plan& plan, ddiloco::InProcessNetwork& net, const ddiloco::Clock& clock, Outer& outer,
                 Params& params) {
  auto link = net.syncer();
  ddiloco::SyncerConfig sc;
  sc.quorum.min_quorum = 1;
  sc.round = outer.config().round;  // a join states its round mode
  if (sc.round == ddiloco::RoundMode::pull) sc.sync_every = outer.config().sync_every;
  ddiloco::Syncer<ddiloco::WeightedAverage, ddiloco::AverageOnly, ddiloco::UniformWeights> syncer(
      plan, std::vector<float>(plan.total_numel(), 0.5f), clock, sc);
  outer.begin_join(params);
  ddiloco::Outbox out;
  for (int i = 0; i < 16 && !outer.poll_join(params); ++i) {
    while (auto msg = link.try_receive()) {
      syncer.handle(*msg, out);
      for (auto& o : out) link.send_to(o.to, std::move(o.message));
      out.clear();
    }
  }
  return outer.poll_join(params);
}

/// OuterLoop::step() with no fragment due, P = 24 fragments of 24 tensors,
/// over the in-process transport on a virtual clock (time never moves, so no
/// heartbeat is due either). H = 24 * 2^16: the first send is at step 2^16,
/// so the fixed 60000 iterations never send.
void BM_LearnerStepNothingDue(benchmark::State& state) {
  using Flat = std::vector<float>;
  constexpr std::size_t kP = 24;
  std::vector<ddiloco::TensorSpec> specs;
  for (std::size_t t = 0; t < kP; ++t) {
    std::string name = std::to_string(t);  // (not "t" + ...: GCC 12's false -Wrestrict at -O3)
    name.insert(name.begin(), 't');
    specs.push_back({name, 1024, false});
  }
  const ddiloco::Plan plan = ddiloco::make_plan(specs, kP);
  ddiloco::VirtualClock clock;
  ddiloco::InProcessNetwork net(clock);
  auto lt = net.learner(1);
  ddiloco::OuterLoopConfig lc;
  lc.round = ddiloco::RoundMode::push;
  lc.id = 1;
  lc.sync_every = kP << 16;
  ddiloco::OuterLoop<ddiloco::InProcessLearnerTransport, Flat> outer(plan, lt, lc);
  std::vector<Flat> params(kP, Flat(1024, 0.0f));
  if (!join_syncer(plan, net, clock, outer, params)) {
    state.SkipWithError("the learner did not join");
    return;
  }
  std::size_t sent = 0;
  for (auto _ : state) {
    const auto report = outer.step(params, 1);
    sent += report.sent ? 1 : 0;
  }
  state.counters["sent"] = static_cast<double>(sent);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
}

/// The learner side of ZmqLearnerTransport without the socket, framing as it
/// does (detail::LendingFramer: pooled frame buffers, the payload encoded by
/// OuterLoop straight into the lent frame, encode_frame_into for the header and
/// CRC32C); the frame is then dropped, as if ZeroMQ had put it on the wire at
/// once (its buffer goes back to the pool). Everything else goes over the
/// in-process network. Without `encoding` it offers no codec: OuterLoop sends
/// fp32 and the frame encodes it (the learner's send path before the lent-frame encoder, less
/// the zero-filled buffers it also had).
struct FramingTransport {
  explicit FramingTransport(ddiloco::InProcessLearnerTransport t) : inner(std::move(t)) {}
  ddiloco::InProcessLearnerTransport inner;
  Codec codec = Codec::fp32;
  bool encoding = true;
  ddiloco::detail::LendingFramer framer;
  std::size_t frame_bytes = 0;

  [[nodiscard]] std::optional<Codec> contribution_codec() const noexcept {
    return encoding ? std::optional<Codec>(codec) : std::nullopt;
  }
  ddiloco::OutgoingPayload contribution_buffer(std::size_t bytes) { return framer.lend(bytes); }
  /// Pull rounds' per-step metadata: framed as the ZeroMQ transport frames it
  /// (true) or dropped unframed (false: the step's own cost); never delivered.
  bool frame_metadata = true;
  std::size_t metadata = 0;
  bool send(ddiloco::Message&& m) {
    if (m.type == ddiloco::MessageType::metadata) {
      ++metadata;
      if (frame_metadata) {
        const auto frame = framer.frame(m, Codec::fp32);
        benchmark::DoNotOptimize(frame->data.get());
        frame_bytes = frame->size;
      }
      return true;
    }
    if (m.type != ddiloco::MessageType::contribution) return inner.send(std::move(m));
    const auto frame = framer.frame(m, codec);
    benchmark::DoNotOptimize(frame->data.get());
    frame_bytes = frame->size;
    return true;
  }
  std::optional<ddiloco::Message> try_receive() { return inner.try_receive(); }
  std::optional<ddiloco::Message> receive_until(ddiloco::TimePoint d) { return inner.receive_until(d); }
  [[nodiscard]] bool failed() const { return inner.failed(); }
  [[nodiscard]] const ddiloco::Clock& clock() const noexcept { return inner.clock(); }
};

/// OuterLoop::step() in pull rounds with nothing pulled (the plan of
/// BM_LearnerStepNothingDue): the step plus its metadata message. Argument 1
/// frames each metadata as ZmqLearnerTransport does (88-byte header, CRC32C)
/// before dropping it; argument 0 drops it unframed, leaving the step's own
/// cost. The ZeroMQ send itself is BM_LearnerStepNothingDueZmq's business.
void BM_LearnerStepNothingDuePull(benchmark::State& state) {
  using Flat = std::vector<float>;
  constexpr std::size_t kP = 24;
  std::vector<ddiloco::TensorSpec> specs;
  for (std::size_t t = 0; t < kP; ++t) {
    std::string name = std::to_string(t);
    name.insert(name.begin(), 't');
    specs.push_back({name, 1024, false});
  }
  const ddiloco::Plan plan = ddiloco::make_plan(specs, kP);
  ddiloco::VirtualClock clock;
  ddiloco::InProcessNetwork net(clock);
  FramingTransport tr{net.learner(1)};
  tr.frame_metadata = state.range(0) == 1;
  ddiloco::OuterLoopConfig lc;
  lc.id = 1;
  lc.sync_every = kP;
  lc.round = ddiloco::RoundMode::pull;
  ddiloco::OuterLoop<FramingTransport, Flat> outer(plan, tr, lc);
  std::vector<Flat> params(kP, Flat(1024, 0.0f));
  if (!join_syncer(plan, net, clock, outer, params)) {
    state.SkipWithError("the learner did not join");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(outer.step(params, 1));
  state.counters["metadata"] = static_cast<double>(tr.metadata);
  state.counters["frame_bytes"] = static_cast<double>(tr.frame_bytes);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
}

/// The due step as a user's trainer pays for it: OuterLoop::step() with the one
/// fragment (16 tensors, 2^log2n elements in all) due at every step, through
/// a transport that frames the contribution as the ZeroMQ transport does.
/// Each iteration first times a memcpy of the same n floats (vs_memcpy as in
/// BM_LearnerDueFast; the same bytes counted: 12n + the encoded payload).
/// Arguments {log2 n, encoding}: encoding = 0 is the path without a
/// contribution codec (fp32 outer gradient, encoded when framed).
template <Codec C>
void BM_LearnerSendPath(benchmark::State& state) {
  using Clock = std::chrono::steady_clock;
  using Flat = std::vector<float>;
  const auto n = std::size_t{1} << state.range(0);
  constexpr std::size_t kTensors = 16;
  std::vector<ddiloco::TensorSpec> specs;
  for (std::size_t t = 0; t < kTensors; ++t) {
    std::string name = std::to_string(t);
    name.insert(name.begin(), 'w');
    specs.push_back({name, n / kTensors, false});
  }
  const ddiloco::Plan plan = ddiloco::make_plan(specs, 1);
  ddiloco::VirtualClock clock;
  ddiloco::InProcessNetwork net(clock);
  FramingTransport tr{net.learner(1)};
  tr.codec = C;
  tr.encoding = state.range(1) == 1;
  ddiloco::OuterLoopConfig lc;
  lc.round = ddiloco::RoundMode::push;
  lc.id = 1;
  lc.sync_every = 1;
  lc.overlap = 0;  // tau < H = 1: every step sends (results never come: the frames are dropped)
  ddiloco::OuterLoop<FramingTransport, Flat> outer(plan, tr, lc);
  std::vector<Flat> params(kTensors, Flat(n / kTensors, 0.0f));
  if (!join_syncer(plan, net, clock, outer, params)) {
    state.SkipWithError("the learner did not join");
    return;
  }
  const auto src = lcg_vector(n, 1);
  Flat copy(n);
  double memcpy_s = 0.0, due_s = 0.0;
  std::size_t sent = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (std::size_t t = 0; t < kTensors; ++t) {  // a training step moved every parameter
      std::copy_n(src.begin() + static_cast<std::ptrdiff_t>(t * (n / kTensors)), n / kTensors, params[t].begin());
    }
    state.ResumeTiming();
    const auto t0 = Clock::now();
    std::memcpy(copy.data(), src.data(), 4 * n);
    benchmark::DoNotOptimize(copy.data());
    benchmark::ClobberMemory();
    const auto t1 = Clock::now();
    sent += outer.step(params, 1).sent ? 1 : 0;
    benchmark::ClobberMemory();
    const auto t2 = Clock::now();
    memcpy_s += std::chrono::duration<double>(t1 - t0).count();
    due_s += std::chrono::duration<double>(t2 - t1).count();
  }
  if (sent != static_cast<std::size_t>(state.iterations())) {
    state.SkipWithError("a step did not send its fragment");
    return;
  }
  const auto it = static_cast<double>(state.iterations());
  const double due_bw = static_cast<double>(12 * n + ddiloco::encoded_size(C, n)) * it / due_s;
  const double memcpy_bw = 8.0 * static_cast<double>(n) * it / memcpy_s;
  state.counters["due_Bps"] = due_bw;
  state.counters["memcpy_Bps"] = memcpy_bw;
  state.counters["due_s"] = due_s / it;
  state.counters["vs_memcpy"] = due_bw / memcpy_bw;
  state.counters["frame_bytes"] = static_cast<double>(tr.frame_bytes);
}

// Arguments: {log2 n, M, threads}.
void headline(benchmark::internal::Benchmark* b) {
  b->Args({24, 8, 1})->Args({24, 8, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
}
void size_scaling(benchmark::internal::Benchmark* b) {
  for (int k = 16; k <= 26; k += 2) b->Args({k, 8, 1});
  b->Args({25, 8, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
}
void m_scaling(benchmark::internal::Benchmark* b) {
  for (int m : {1, 2, 4, 8, 16, 32, 64}) b->Args({20, m, 1});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_Triad)->Args({25, 1})->Args({25, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Memcpy)->Arg(24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_FastRound, Codec::fp32)->Apply(headline);
BENCHMARK_TEMPLATE(BM_FastRound, Codec::int4)->Apply(headline);
void pairs(benchmark::internal::Benchmark* b) {
  b->Args({24, 8, 1, 0})->Args({24, 8, 2, 0})->Args({24, 8, 1, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
}
BENCHMARK_TEMPLATE(BM_RooflinePair, Codec::fp32)->Apply(pairs);
BENCHMARK_TEMPLATE(BM_RooflinePair, Codec::int4)->Apply(pairs);
BENCHMARK_TEMPLATE(BM_FastBatchRound, Codec::fp32)->Apply(headline);
BENCHMARK_TEMPLATE(BM_FastBatchRound, Codec::int4)->Apply(headline);
void batch_pairs(benchmark::internal::Benchmark* b) {
  b->Args({24, 8, 1, 0})->Args({24, 8, 2, 0})->Unit(benchmark::kMillisecond)->UseRealTime();
}
BENCHMARK_TEMPLATE(BM_RooflinePair, Codec::fp32, true)->Name("BM_RooflinePairBatch<fp32>")->Apply(batch_pairs);
BENCHMARK_TEMPLATE(BM_RooflinePair, Codec::int4, true)->Name("BM_RooflinePairBatch<int4>")->Apply(batch_pairs);
BENCHMARK_TEMPLATE(BM_FastBatchRound, Codec::fp32)->Name("BM_FastBatchRound<fp32>/learners")->Apply(m_scaling);
BENCHMARK_TEMPLATE(BM_FastBatchRound, Codec::fp32, false)->Name("BM_FastBatchRound<fp32>/unclipped")->Args({22, 8, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_FastBatchRound, Codec::fp32, true)->Name("BM_FastBatchRound<fp32>/clipped")->Args({22, 8, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_ReferenceRound, Codec::fp32)->Args({24, 8, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_ReferenceRound, Codec::int4)->Args({24, 8, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_FastRound, Codec::fp32)->Name("BM_FastRound<fp32>/size")->Apply(size_scaling);
BENCHMARK_TEMPLATE(BM_FastRound, Codec::fp32)->Name("BM_FastRound<fp32>/learners")->Apply(m_scaling);
BENCHMARK_TEMPLATE(BM_LearnerDueFast, Codec::fp32)->Args({24, 0})->Args({24, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LearnerDueFast, Codec::int4)->Args({24, 0})->Args({24, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LearnerDueReference, Codec::fp32)->Arg(24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LearnerDueReference, Codec::int4)->Arg(24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LearnerSendPath, Codec::fp32)->Args({24, 1})->Args({24, 0})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LearnerSendPath, Codec::int4)->Args({24, 1})->Args({24, 0})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_LearnerStepNothingDue)->Iterations(60000)->Unit(benchmark::kNanosecond);
BENCHMARK(BM_LearnerStepNothingDuePull)->Arg(0)->Arg(1)->Iterations(60000)->Repetitions(5)->Unit(benchmark::kNanosecond);

BENCHMARK_MAIN();
