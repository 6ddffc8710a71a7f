// Tests for ddiloco/sim/bandwidth.hpp: utilisation against bandwidth.
#include <ddiloco/sim/bandwidth.hpp>

#include <catch2/catch.hpp>

#include <cmath>

using namespace ddiloco::sim;

namespace {
BandwidthScenario one_layer() {
  BandwidthScenario s;
  s.params = 1e9;
  s.layers = 1;
  s.step_s = 1.0;
  s.sync_every = 10;
  s.fragments = 1;
  s.overlap = 1;
  s.bits = 16;
  s.workers = 2;  // ring factor 2 (2 - 1) / 2 = 1
  return s;
}
}  // namespace

TEST_CASE("Data-parallel with one layer stalls for the whole transfer after the backward pass", "[sim][bandwidth]") {
  // 1e9 values * 16 bits = 16 Gbit; at 16 Gbit/s the transfer takes 1 s and
  // starts when the backward pass ends (= the step ends): U = 1 / (1 + 1).
  const auto s = one_layer();
  CHECK(compute_utilisation(Method::data_parallel, s, 16.0) == Approx(0.5));
  CHECK(compute_utilisation(Method::data_parallel, s, 32.0) == Approx(1.0 / 1.5));
  CHECK(bandwidth_for_utilisation(Method::data_parallel, s, 0.5) == Approx(16.0).epsilon(1e-6));
  // DiLoCo pays the same stall once per H = 10 steps: 10 / 11.
  CHECK(compute_utilisation(Method::diloco, s, 16.0) == Approx(10.0 / 11.0));
}

TEST_CASE("Layer gradients overlap with the rest of the backward pass", "[sim][bandwidth]") {
  // Two layers, T = 0.3 s: F = 0.1, B = 0.2; layer 2 ready at 0.2 s, layer 1 at 0.3 s.
  // Each layer: 0.5e9 * 16 bits / 80 Gbit/s = 0.1 s. Link: 0.2 -> 0.3, then 0.3 -> 0.4.
  // Stall 0.1 s: U = 0.3 / 0.4. DiLoCo with H = 10: 3 / 3.1.
  BandwidthScenario s = one_layer();
  s.layers = 2;
  s.step_s = 0.3;
  s.fragments = 2;
  CHECK(compute_utilisation(Method::data_parallel, s, 80.0) == Approx(0.75));
  CHECK(compute_utilisation(Method::diloco, s, 80.0) == Approx(3.0 / 3.1));
  // Streaming, P = 2: fragment {2} leaves at 0.2, done 0.3 (no stall);
  // fragment {1} leaves at 0.3, done 0.4: stall 0.1 -> 3 / 3.1 as well.
  CHECK(compute_utilisation(Method::streaming, s, 80.0) == Approx(3.0 / 3.1));
  // With tau = 1 the window is one step (0.3 s): no stall at all.
  CHECK(compute_utilisation(Method::streaming_overlap, s, 80.0) == Approx(1.0));
  // Latency adds to each layer's transfer: 0.15 s each -> done 0.2 + 0.15 = 0.35, then 0.5: stall 0.2.
  s.latency_s = 0.05;
  CHECK(compute_utilisation(Method::data_parallel, s, 80.0) == Approx(0.3 / 0.5));
}

TEST_CASE("Quantised streaming needs a quarter of the bandwidth at 4 bits instead of 16", "[sim][bandwidth]") {
  const auto s = streaming_diloco_1b();
  for (const double u : {0.5, 0.9, 0.99}) {
    const double b16 = bandwidth_for_utilisation(Method::streaming_overlap, s, u);
    const double b4 = bandwidth_for_utilisation(Method::streaming_overlap_quantized, s, u);
    CHECK(b4 == Approx(b16 / 4.0).epsilon(1e-6));
  }
}

TEST_CASE("Decoupled DiLoCo is bound by the link's throughput only", "[sim][bandwidth]") {
  // 24e9 values, P = 24, int4: 4 Gbit per fragment; at 4 Gbit/s one fragment
  // takes 1 s, 24 take 24 s per period of H = 24 steps of 0.5 s = 12 s: U = 0.5.
  BandwidthScenario s;
  s.params = 24e9;
  s.step_s = 0.5;
  CHECK(compute_utilisation(Method::decoupled, s, 4.0) == Approx(0.5));
  CHECK(compute_utilisation(Method::decoupled, s, 8.0) == Approx(1.0));
  CHECK(bandwidth_for_utilisation(Method::decoupled, s, 1.0) == Approx(8.0).epsilon(1e-6));
}

TEST_CASE("One worker needs no communication", "[sim][bandwidth]") {
  BandwidthScenario s = one_layer();
  s.workers = 1;
  CHECK(compute_utilisation(Method::data_parallel, s, 1e-6) == 1.0);
}

TEST_CASE("The Streaming DiLoCo 1B table is reproduced within 15% per cell", "[sim][bandwidth]") {
  const double payload = fit_streaming_1b_payload();
  CHECK(payload > 0.9e9);  // a "1B" model
  CHECK(payload < 1.05e9);
  const auto s = streaming_diloco_1b(payload);
  for (std::size_t r = 0; r < 5; ++r) {
    for (std::size_t c = 0; c < 5; ++c) {
      const double v = bandwidth_for_utilisation(all_methods[r], s, streaming_1b_targets[c]);
      INFO(method_name(all_methods[r]) << " at " << streaming_1b_targets[c] << ": " << v << " vs "
                                       << streaming_1b_table[r][c]);
      CHECK(std::fabs(v / streaming_1b_table[r][c] - 1.0) <= 0.15);
    }
  }
}

TEST_CASE("The eight-datacentre headline: about 198 against 0.84 Gbit/s", "[sim][bandwidth]") {
  const Headline h = eight_datacentre_headline();
  CHECK(h.data_parallel_gbps == Approx(198.0).epsilon(1e-3));
  CHECK(h.decoupled_gbps == Approx(0.84).epsilon(0.15));
}

TEST_CASE("Invalid bandwidth scenarios are rejected", "[sim][bandwidth]") {
  using Catch::Matchers::Contains;
  BandwidthScenario s;
  s.params = 0;
  CHECK_THROWS_WITH(compute_utilisation(Method::diloco, s, 1.0), Contains("params = 0"));
  s = BandwidthScenario{};
  s.fragments = 200;  // > H = 100
  CHECK_THROWS_WITH(compute_utilisation(Method::streaming, s, 1.0), Contains("fragments = 200"));
  CHECK_THROWS_WITH(bandwidth_for_utilisation(Method::diloco, BandwidthScenario{}, 1.5), Contains("target = 1.5"));
}
