// Benchmarks for ddiloco/fragmenter.hpp: make_plan with each strategy, 10^3 to
// 10^6 tensors of random size into 24 fragments (the paper's P). Items are
// tensors; bytes are the tensor specs' names and sizes read by the planner.
// A later issue needs 10^6 tensors planned "well under a second": run with
// --benchmark_repetitions=5 --benchmark_report_aggregates_only=true for medians.
#include <ddiloco/fragmenter.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace {

std::vector<ddiloco::TensorSpec> random_tensors(std::size_t n) {
  std::mt19937_64 rng(12345);
  // Sizes from 1 to 2^24 with a log-uniform spread, as in real models (norm
  // vectors next to 2048 x 8192 matrices).
  std::uniform_int_distribution<int> log2_dist(0, 24);
  std::vector<ddiloco::TensorSpec> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t hi = std::size_t{1} << log2_dist(rng);
    const std::size_t numel = std::uniform_int_distribution<std::size_t>(1, hi)(rng);
    out.push_back({"layers." + std::to_string(i / 16) + ".t" + std::to_string(i % 16), numel, i % 1000 == 0});
  }
  return out;
}

std::size_t spec_bytes(const std::vector<ddiloco::TensorSpec>& ts) {
  std::size_t b = 0;
  for (const auto& t : ts) b += t.name.size() + sizeof(t.numel) + sizeof(t.embedding);
  return b;
}

template <class Strategy>
void bm_make_plan(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto tensors = random_tensors(n);
  double imbalance = 0.0;
  for (auto _ : state) {
    state.PauseTiming();
    auto copy = tensors;  // make_plan takes the list by value
    state.ResumeTiming();
    const auto plan = ddiloco::make_plan(std::move(copy), 24, Strategy{});
    benchmark::DoNotOptimize(plan.fingerprint());
    imbalance = plan.imbalance();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(spec_bytes(tensors)));
  state.counters["imbalance"] = imbalance;
}

}  // namespace

BENCHMARK_TEMPLATE(bm_make_plan, ddiloco::BalancedGreedy)->RangeMultiplier(10)->Range(1000, 1000000)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(bm_make_plan, ddiloco::LayerContiguous)->RangeMultiplier(10)->Range(1000, 1000000)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(bm_make_plan, ddiloco::PerTensor)->RangeMultiplier(10)->Range(1000, 1000000)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
