// Tests for ddiloco/sim/planner.hpp: comparing fragment schedules.
#include <ddiloco/sim/planner.hpp>

#include <catch2/catch.hpp>

#include <vector>

using namespace ddiloco::sim;
using ddiloco::TensorSpec;

namespace {
std::vector<TensorSpec> four_tensors() {
  // Sizes {25, 22, 3, 3} million: balanced into 2 fragments gives {25+3, 22+3} = {28, 25} million.
  return {{"a", 25'000'000, false}, {"b", 22'000'000, false}, {"c", 3'000'000, false}, {"d", 3'000'000, false}};
}
}  // namespace

TEST_CASE("The planner reports bytes, bandwidth and utilisation computed by hand", "[sim][planner]") {
  const std::vector<std::size_t> p = {2}, h = {2}, tau = {1};
  LinkSpec link;
  link.gbps = 0.1;
  link.latency_s = 0.0;
  link.step_s = 1.0;
  link.bits = 8;
  const auto rows = compare_fragment_plans(four_tensors(), p, h, tau, link);
  REQUIRE(rows.size() == 3);  // one per strategy
  const PlanRow& r = rows[0];
  CHECK(r.strategy == "balanced-greedy");
  CHECK(r.imbalance == Approx(28.0 / 26.5));
  CHECK(r.max_fragment_bytes == Approx(28e6));
  CHECK(r.mean_fragment_bytes == Approx(26.5e6));
  CHECK(r.peak_gbps == Approx(28e6 * 8 / 1.0 / 1e9));  // 0.224
  CHECK(r.mean_gbps == Approx(53e6 * 8 / 2.0 / 1e9));  // 0.212
  // Transfers at 0.1 Gbit/s: 2.24 s and 2.0 s; period 2 s, window 1 s.
  CHECK(r.on_time_fraction == 0.0);
  CHECK(r.decoupled_utilisation == Approx(2.0 / 4.24));
  CHECK(r.streaming_utilisation == Approx(2.0 / (2.0 + 1.24 + 1.0)));
  // Layer-contiguous keeps model order: {25} and {22, 3, 3} = {25, 28}: same sizes, same peak.
  CHECK(rows[1].strategy == "layer-contiguous");
  CHECK(rows[1].max_fragment_bytes == Approx(28e6));
  // Per-tensor (round-robin): {25 + 3, 22 + 3}.
  CHECK(rows[2].strategy == "per-tensor");
  CHECK(rows[2].max_fragment_bytes == Approx(28e6));
}

TEST_CASE("The planner skips combinations the schedule or the plan would reject", "[sim][planner]") {
  const std::vector<std::size_t> p = {1, 2, 4, 8}, h = {2, 4}, tau = {0, 1, 4};
  const auto rows = compare_fragment_plans(four_tensors(), p, h, tau, LinkSpec{});
  for (const auto& r : rows) {
    CHECK(r.fragments <= r.sync_every);
    CHECK(r.fragments <= 4);
    CHECK(r.overlap >= 1);
    CHECK(r.overlap < r.sync_every);
  }
  // P in {1, 2, 4} x (H = 2: tau 1 with P <= 2; H = 4: tau 1) per strategy: (2 + 3) * 3 = 15.
  CHECK(rows.size() == 15);
}

TEST_CASE("The planner rejects an empty model and a dead link", "[sim][planner]") {
  const std::vector<std::size_t> one = {1};
  CHECK_THROWS_AS(compare_fragment_plans({}, one, one, one, LinkSpec{}), ddiloco::InvalidArgument);
  LinkSpec dead;
  dead.gbps = 0;
  CHECK_THROWS_WITH(compare_fragment_plans(four_tensors(), one, one, one, dead), Catch::Matchers::Contains("gbps = 0"));
}
