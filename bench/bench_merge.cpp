// Benchmarks for <ddiloco/merge.hpp> and <ddiloco/outer_optimizer.hpp>: the
// syncer's per-fragment work, for fragments of 2^16 .. 2^24 fp32 elements split
// into six tensors (one embedding), with M = 8 contributions.
//
// Bytes processed are the minimum each operation must move, so the rates compare
// with the machine's memory bandwidth:
//   add     read v (4n) + read and write the accumulator (8n)        = 12n
//   finish  read the accumulator (4n) + write the output (4n)        =  8n
//   round   reset, 8 adds (the first only writes: 8n), finish        = 8n + 7*12n + 8n
//   nesterov step  read theta, delta, b (12n) + write theta, b (8n)   = 20n
#include <ddiloco/merge.hpp>
#include <ddiloco/outer_optimizer.hpp>

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "bench_common.hpp"

namespace {

constexpr std::size_t kM = 8;

using ddiloco::bench::make_layout;

/// M contributions of n elements, cached for the current n only (2^24 x 8 floats = 512 MiB).
const std::vector<std::vector<float>>& contributions(std::size_t n) {
  static std::vector<std::vector<float>> cache;
  if (cache.empty() || cache.front().size() != n) {
    cache.assign(kM, std::vector<float>(n));
    std::uint32_t state = 12345u;
    for (auto& v : cache) {
      for (float& x : v) {
        state = state * 1664525u + 1013904223u;  // LCG: cheap, deterministic values in [-1, 1)
        x = static_cast<float>(static_cast<double>(state) / 2147483648.0 - 1.0);
      }
    }
  }
  return cache;
}

const double kWeights[kM] = {1.0, 2.0, 0.5, 3.0, 1.5, 1.0, 4.0, 2.5};

void set_rates(benchmark::State& state, std::size_t n, std::size_t bytes_per_element) {
  const auto iterations = static_cast<std::int64_t>(state.iterations());
  state.SetBytesProcessed(iterations * static_cast<std::int64_t>(n * bytes_per_element));
  state.SetItemsProcessed(iterations * static_cast<std::int64_t>(n));
}

template <class Rule>
void BM_Add(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto layout = make_layout(n);
  const auto& inputs = contributions(n);
  auto acc = Rule{}.make_accumulator(layout);
  acc.add(inputs[0], kWeights[0]);  // steady state: every timed add is a running-mean update
  std::size_t k = 1;
  for (auto _ : state) {
    acc.add(inputs[k % kM], kWeights[k % kM]);
    ++k;
    benchmark::ClobberMemory();
  }
  set_rates(state, n, 12);
}

template <class Rule>
void BM_Finish(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto layout = make_layout(n);
  const auto& inputs = contributions(n);
  auto acc = Rule{}.make_accumulator(layout);
  for (std::size_t m = 0; m < kM; ++m) acc.add(inputs[m], kWeights[m]);
  std::vector<float> out(n);
  for (auto _ : state) {
    acc.finish(out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, n, 8);
}

/// One full merge round: reset, M = 8 adds, finish. Items are elements merged (n).
template <class Rule>
void BM_Round(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto layout = make_layout(n);
  const auto& inputs = contributions(n);
  auto acc = Rule{}.make_accumulator(layout);
  std::vector<float> out(n);
  for (auto _ : state) {
    acc.reset();
    for (std::size_t m = 0; m < kM; ++m) acc.add(inputs[m], kWeights[m]);
    acc.finish(out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, n, 8 + 7 * 12 + 8);
}

void BM_NesterovStep(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const ddiloco::NesterovSGD opt;
  std::vector<float> theta(n, 1.0f);
  std::vector<float> momentum(opt.state_size(n), 0.0f);
  const auto& delta = contributions(n).front();
  for (auto _ : state) {
    opt.step(theta, delta, momentum);
    benchmark::DoNotOptimize(theta.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, n, 20);
}

constexpr std::int64_t kMinN = std::int64_t{1} << 16;
constexpr std::int64_t kMaxN = std::int64_t{1} << 24;

}  // namespace

BENCHMARK_TEMPLATE(BM_Add, ddiloco::WeightedAverage)->RangeMultiplier(4)->Range(kMinN, kMaxN);
BENCHMARK_TEMPLATE(BM_Add, ddiloco::RadialDirectional)->RangeMultiplier(4)->Range(kMinN, kMaxN);
BENCHMARK_TEMPLATE(BM_Finish, ddiloco::WeightedAverage)->RangeMultiplier(4)->Range(kMinN, kMaxN);
BENCHMARK_TEMPLATE(BM_Finish, ddiloco::RadialDirectional)->RangeMultiplier(4)->Range(kMinN, kMaxN);
BENCHMARK_TEMPLATE(BM_Round, ddiloco::WeightedAverage)->RangeMultiplier(4)->Range(kMinN, kMaxN);
BENCHMARK_TEMPLATE(BM_Round, ddiloco::RadialDirectional)->RangeMultiplier(4)->Range(kMinN, kMaxN);
BENCHMARK(BM_NesterovStep)->RangeMultiplier(4)->Range(kMinN, kMaxN);

BENCHMARK_MAIN();
