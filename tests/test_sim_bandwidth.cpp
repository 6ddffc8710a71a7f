// Tests for ddiloco/sim/bandwidth.hpp: utilisation against bandwidth.
#include <ddiloco/sim/bandwidth.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
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

namespace {
/// Decoupled scenario for hand computation: 1.2e6 values, P = 24, H = 24,
/// T = 0.5 s (period H T = 12 s), int4 up, four learners, K = 1.
BandwidthScenario four_learners(SendMerged to, double global_bits) {
  BandwidthScenario s;
  s.params = 1.2e6;
  s.step_s = 0.5;
  s.decoupled_learners = 4;
  s.decoupled_quorum = 1;
  s.send_merged_to = to;
  s.global_bits = global_bits;
  return s;
}

/// The up-link-only model as it was before the down-link, written out
/// independently: min(1, H T / (P c)), c = params / P * quantized_bits / bw + latency.
double uplink_only(const BandwidthScenario& s, double gbps) {
  const double P = static_cast<double>(s.decoupled_fragments);
  const double c = s.params / P * s.quantized_bits / (gbps * s.gbit) + s.latency_s;
  return std::min(1.0, static_cast<double>(s.decoupled_sync_every) * s.step_s / (P * c));
}
}  // namespace

TEST_CASE("The down-link fanout is M / K to every alive learner and 1 to the contributors", "[sim][bandwidth]") {
  auto s = four_learners(SendMerged::alive, 32);
  CHECK(decoupled_fanout(s) == 4.0);  // K = 1, out of phase: each contribution merged alone, sent to all 4
  s.decoupled_quorum = 2;
  CHECK(decoupled_fanout(s) == 2.0);  // 2 merges per period, each to 4 learners, over 4 senders
  s.decoupled_quorum = 3;
  CHECK(decoupled_fanout(s) == Approx(4.0 / 3.0));
  s.decoupled_quorum = 4;
  CHECK(decoupled_fanout(s) == 1.0);  // K = M: one merge per period, as synchronous
  s.send_merged_to = SendMerged::contributors;
  for (std::size_t k = 1; k <= 4; ++k) {
    s.decoupled_quorum = k;
    CHECK(decoupled_fanout(s) == 1.0);  // M / K merges, each to its K contributors, over M senders
  }
  CHECK(decoupled_fanout(BandwidthScenario{}) == 1.0);  // defaults: one learner
}

TEST_CASE("The down-link rate is fanout * params * global bits / (H T) per learner", "[sim][bandwidth]") {
  // Up: 1.2e6 * 4 bits / 12 s = 4e5 bit/s whatever the down-link does.
  // alive fp32: 4 * 1.2e6 * 32 / 12 = 1.28e7; bf16: 6.4e6; int8: 3.2e6.
  // contributors fp32: 1.2e6 * 32 / 12 = 3.2e6; bf16: 1.6e6; int8: 8e5.
  const struct {
    SendMerged to;
    double bits, down;
  } cases[] = {{SendMerged::alive, 32, 1.28e7},       {SendMerged::alive, 16, 6.4e6},
               {SendMerged::alive, 8, 3.2e6},         {SendMerged::contributors, 32, 3.2e6},
               {SendMerged::contributors, 16, 1.6e6}, {SendMerged::contributors, 8, 8e5}};
  for (const auto& c : cases) {
    const DecoupledLink k = decoupled_link(four_learners(c.to, c.bits), 1.0);
    INFO("global bits " << c.bits);
    CHECK(k.up_bits_per_s == Approx(4e5));
    CHECK(k.down_bits_per_s == Approx(c.down));
  }
  // global_bits = 0 means "as the upload": int4, contributors: 1.2e6 * 4 / 12 = 4e5.
  CHECK(decoupled_link(four_learners(SendMerged::contributors, 0), 1.0).down_bits_per_s == Approx(4e5));
}

TEST_CASE("The down-link limits Decoupled utilisation when it carries more than the up-link", "[sim][bandwidth]") {
  // 24e9 values, P = H = 24, T = 0.5 s: period 12 s, one fragment 1e9 values.
  // At 8 Gbit/s: up int4 0.5 s per fragment (24 * 0.5 = 12 s: U = 1 on the up-link);
  // down bf16 2 s per fragment.
  auto s = four_learners(SendMerged::alive, 16);
  s.params = 24e9;
  CHECK(compute_utilisation(Method::decoupled, s, 8.0) == Approx(12.0 / (24 * 4 * 2.0)));  // f = 4: 1/16
  s.send_merged_to = SendMerged::contributors;
  CHECK(compute_utilisation(Method::decoupled, s, 8.0) == Approx(12.0 / (24 * 2.0)));  // 0.25
  s.global_bits = 4;
  CHECK(compute_utilisation(Method::decoupled, s, 8.0) == Approx(1.0));  // down = up
  s.send_merged_to = SendMerged::alive;
  CHECK(compute_utilisation(Method::decoupled, s, 8.0) == Approx(0.25));  // 4 * 24 * 0.5 = 48 s
  // U = 1 needs 24 f c_down <= 12 s: c_down = 0.5 / f, bw = 1e9 * 16 / c_down.
  s.global_bits = 16;
  CHECK(bandwidth_for_utilisation(Method::decoupled, s, 1.0) == Approx(128.0).epsilon(1e-6));
  s.send_merged_to = SendMerged::contributors;
  CHECK(bandwidth_for_utilisation(Method::decoupled, s, 1.0) == Approx(32.0).epsilon(1e-6));
}

TEST_CASE("Latency is paid once per transfer each way and delays the apply beyond tau", "[sim][bandwidth]") {
  auto s = four_learners(SendMerged::contributors, 16);
  s.params = 24e9;
  s.latency_s = 0.1;
  // 80 Gbit/s: c_up = 4e9 / 80e9 + 0.1 = 0.15 s, c_down = 16e9 / 80e9 + 0.1 = 0.3 s.
  DecoupledLink k = decoupled_link(s, 80.0);
  CHECK(k.up_fragment_s == Approx(0.15));
  CHECK(k.down_fragment_s == Approx(0.3));
  CHECK(k.round_trip_s == Approx(0.45));
  CHECK(k.apply_delay_steps == Approx(2.0));  // 0.9 steps < tau = 2
  CHECK(k.utilisation == Approx(1.0));        // 24 * 0.3 = 7.2 s <= 12 s
  s.send_merged_to = SendMerged::alive;
  CHECK(decoupled_link(s, 80.0).utilisation == Approx(12.0 / (24 * 4 * 0.3)));  // 28.8 s of down-link
  // 8 Gbit/s: c_up = 0.6, c_down = 2.1: round trip 2.7 s = 5.4 steps > tau.
  k = decoupled_link(s, 8.0);
  CHECK(k.round_trip_s == Approx(2.7));
  CHECK(k.apply_delay_steps == Approx(5.4));
  // No bandwidth: nothing arrives.
  k = decoupled_link(s, 0.0);
  CHECK(std::isinf(k.round_trip_s));
  CHECK(k.utilisation == 0.0);
}

TEST_CASE("Default down-link settings leave the up-link-only Decoupled numbers unchanged", "[sim][bandwidth]") {
  // Defaults: one learner, K = 1, global bits as the upload: the down-link mirrors the up-link.
  for (const double latency : {0.0, 0.01, 0.2}) {
    BandwidthScenario s;
    s.params = 24e9;
    s.step_s = 0.5;
    s.latency_s = latency;
    for (const double gbps : {0.5, 1.0, 4.0, 8.0, 100.0}) {
      INFO("latency " << latency << " gbps " << gbps);
      CHECK(compute_utilisation(Method::decoupled, s, gbps) == Approx(uplink_only(s, gbps)).epsilon(1e-12));
    }
  }
  // The other methods do not read the Decoupled down-link fields.
  const auto s = streaming_diloco_1b();
  auto t = s;
  t.decoupled_learners = 8;
  t.global_bits = 32;
  for (std::size_t r = 0; r < 5; ++r) {
    CHECK(bandwidth_for_utilisation(all_methods[r], t, 0.9) == bandwidth_for_utilisation(all_methods[r], s, 0.9));
  }
}

TEST_CASE("The down-link needs more bandwidth with more learners, fewer per merge and more global bits",
          "[sim][bandwidth]") {
  auto s = four_learners(SendMerged::alive, 32);
  s.decoupled_learners = 8;
  s.params = 24e9;
  s.latency_s = 0.01;
  const auto need = [](BandwidthScenario x) { return bandwidth_for_utilisation(Method::decoupled, x, 0.9); };
  double prev = 0;
  for (std::size_t m = 1; m <= 8; ++m) {  // alive: grows with M
    s.decoupled_learners = m;
    const double n = need(s);
    CHECK(n > prev);
    prev = n;
  }
  for (std::size_t k = 2; k <= 8; ++k) {  // alive: falls with K
    s.decoupled_quorum = k;
    const double n = need(s);
    CHECK(n < prev);
    prev = n;
  }
  s.decoupled_quorum = 1;
  auto c = s;
  c.send_merged_to = SendMerged::contributors;
  CHECK(need(c) < need(s));
  const double c8 = need(c);
  c.decoupled_learners = 2;
  CHECK(need(c) == Approx(c8).epsilon(1e-9));  // contributors: independent of M
  prev = 0;
  for (const double bits : {4.0, 8.0, 16.0, 32.0}) {  // more global bits: more bandwidth
    s.global_bits = bits;
    const double n = need(s);
    CHECK(n >= prev);
    prev = n;
  }
  // Utilisation never falls when the link gets faster.
  double u = 0;
  for (double g = 0.01; g < 1e4; g *= 1.7) {
    const double v = compute_utilisation(Method::decoupled, s, g);
    CHECK(v >= u);
    u = v;
  }
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
  s = BandwidthScenario{};
  s.decoupled_learners = 4;
  s.decoupled_quorum = 5;  // K > M
  CHECK_THROWS_WITH(decoupled_fanout(s), Contains("decoupled_quorum = 5"));
  s.decoupled_quorum = 1;
  s.global_bits = -1;
  CHECK_THROWS_WITH(decoupled_link(s, 1.0), Contains("global_bits = -1"));
}
