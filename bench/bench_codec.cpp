// Benchmarks for <ddiloco/codec.hpp> and <ddiloco/wire.hpp>: payload encode and
// decode per codec, CRC-32C, and whole frames, for 2^20 and 2^24 elements.
//
// Bytes processed are the fp32 side of the conversion (4 bytes per element), so
// "bytes_per_second" reads as GB/s of fp32 gradient encoded or decoded whatever
// the codec; items/s is elements/s. crc32c counts the bytes it checksums.
// Run with --benchmark_repetitions=5 (the default here) for medians.
#include <ddiloco/codec.hpp>
#include <ddiloco/detail/checksum.hpp>
#include <ddiloco/wire.hpp>

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace {

const std::vector<float>& values(std::size_t n) {
  static std::vector<float> cache;
  if (cache.size() != n) {
    cache.resize(n);
    std::mt19937 rng(3);
    std::normal_distribution<float> d(0.0f, 1e-3f);
    for (float& x : cache) x = d(rng);
  }
  return cache;
}

void set_rates(benchmark::State& state, std::size_t n, std::size_t bytes_per_element) {
  const auto it = static_cast<std::int64_t>(state.iterations());
  state.SetBytesProcessed(it * static_cast<std::int64_t>(n * bytes_per_element));
  state.SetItemsProcessed(it * static_cast<std::int64_t>(n));
}

ddiloco::Codec codec_arg(const benchmark::State& state) { return static_cast<ddiloco::Codec>(state.range(0)); }
std::size_t size_arg(const benchmark::State& state) { return std::size_t{1} << state.range(1); }

void BM_encode(benchmark::State& state) {
  const auto c = codec_arg(state);
  const std::size_t n = size_arg(state);
  const auto& x = values(n);
  std::vector<std::byte> out(ddiloco::encoded_size(c, n));
  for (auto _ : state) {
    ddiloco::encode(c, x, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetLabel(std::string(ddiloco::to_string(c)));
  set_rates(state, n, 4);
}

void BM_decode(benchmark::State& state) {
  const auto c = codec_arg(state);
  const std::size_t n = size_arg(state);
  const auto in = ddiloco::encode(c, values(n));
  std::vector<float> out(n);
  for (auto _ : state) {
    ddiloco::decode(c, in, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetLabel(std::string(ddiloco::to_string(c)));
  set_rates(state, n, 4);
}

void BM_error_feedback_encode(benchmark::State& state) {
  const auto c = codec_arg(state);
  const std::size_t n = size_arg(state);
  const auto& x = values(n);
  ddiloco::ErrorFeedbackEncoder ef(c);
  std::vector<std::byte> out(ddiloco::encoded_size(c, n));
  for (auto _ : state) {
    ef.encode(0, x, out);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetLabel(std::string(ddiloco::to_string(c)));
  set_rates(state, n, 4);
}

/// impl: 0 the portable table walk, 1 the SSE4.2 crc32 chains, 2 AVX-512
/// VPCLMULQDQ folding (skipped where the CPU lacks what an implementation needs).
void BM_crc32c(benchmark::State& state) {
  namespace d = ddiloco::detail;
  const std::size_t bytes = std::size_t{4} << state.range(0);
  std::vector<std::byte> buf(bytes, std::byte{0x5A});
  const auto impl = state.range(1);
  std::uint32_t (*update)(std::uint32_t, std::span<const std::byte>) noexcept = d::crc32c_update_portable;
  const char* label = "portable slicing-by-8";
#ifdef DDILOCO_CRC32C_HW
  if (impl == 1) update = d::crc32c_update_hw, label = "sse4.2 crc32, three chains";
  if (impl == 2) update = d::crc32c_update_vpclmul, label = "avx-512 vpclmulqdq folding";
  const bool runs = impl == 0 || (impl == 1 && d::crc32c_hw_available()) || (impl == 2 && d::crc32c_vpclmul_available());
#else
  const bool runs = impl == 0;
#endif
  if (!runs) {
    state.SkipWithError("this CPU lacks the instructions");
    return;
  }
  for (auto _ : state) {
    std::uint32_t crc = update(0xFFFFFFFFU, buf) ^ 0xFFFFFFFFU;
    benchmark::DoNotOptimize(crc);
  }
  state.SetLabel(label);
  const auto it = static_cast<std::int64_t>(state.iterations());
  state.SetBytesProcessed(it * static_cast<std::int64_t>(bytes));
}

ddiloco::Message contribution(std::size_t n) {
  ddiloco::Message m;
  m.type = ddiloco::MessageType::contribution;
  m.steps = 30;
  m.tokens = 30 * 4096;
  m.payload = ddiloco::make_payload(values(n));
  return m;
}

void BM_encode_frame(benchmark::State& state) {
  const auto c = codec_arg(state);
  const std::size_t n = size_arg(state);
  const auto m = contribution(n);
  for (auto _ : state) {
    auto f = ddiloco::encode_frame(m, c);
    benchmark::DoNotOptimize(f.data());
  }
  state.SetLabel(std::string(ddiloco::to_string(c)));
  set_rates(state, n, 4);
}

void BM_decode_frame(benchmark::State& state) {
  const auto c = codec_arg(state);
  const std::size_t n = size_arg(state);
  const auto f = ddiloco::encode_frame(contribution(n), c);
  for (auto _ : state) {
    auto r = ddiloco::decode_frame(f);
    if (!r.ok()) state.SkipWithError("decode failed");
    benchmark::DoNotOptimize(r);
  }
  state.SetLabel(std::string(ddiloco::to_string(c)));
  set_rates(state, n, 4);
}

void codec_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"codec", "log2n"})->ArgsProduct({{0, 1, 2, 3, 4}, {20, 24}});
  b->Repetitions(5)->ReportAggregatesOnly(true)->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_encode)->Apply(codec_args);
BENCHMARK(BM_decode)->Apply(codec_args);
BENCHMARK(BM_error_feedback_encode)->Apply(codec_args);
BENCHMARK(BM_encode_frame)->Apply(codec_args);
BENCHMARK(BM_decode_frame)->Apply(codec_args);
BENCHMARK(BM_crc32c)
    ->ArgNames({"log2n", "impl"})
    ->ArgsProduct({{20, 24}, {0, 1, 2}})
    ->Repetitions(5)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
