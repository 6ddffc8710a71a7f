// Tests for ddiloco/sim/capacity.hpp: sizing syncer shards and their hosts.
#include <ddiloco/sim/capacity.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

using namespace ddiloco::sim;
using ddiloco::Codec;
using ddiloco::TensorSpec;

namespace {
constexpr std::size_t kMi = std::size_t{1} << 20;

/// Four tensors of 2^20 elements: with P = 4 every fragment is one tensor (4 MiB in fp32).
std::vector<TensorSpec> four_equal() {
  return {{"a", kMi, false}, {"b", kMi, false}, {"c", kMi, false}, {"d", kMi, false}};
}

DeploymentSpec small_spec() {
  DeploymentSpec d;
  d.learners = 4;
  d.step_s = 1.0;
  d.link_gbps = 1.0;
  d.latency_s = 0.0;
  d.codec = Codec::fp32;
  d.global_codec = Codec::fp32;
  d.headroom = 1.0;
  d.fragment_counts = {4};
  d.sync_every = {10};
  d.overlaps = {1};
  return d;
}
}  // namespace

TEST_CASE("A shard's bytes, cores and memory are the formulas computed by hand", "[sim][capacity]") {
  const DeploymentSpec d = small_spec();
  const auto plan = ddiloco::make_plan(four_equal(), 4, ddiloco::BalancedGreedy{});
  const auto one = size_shards(plan, 1, 10, d);
  REQUIRE(one.size() == 1);
  const double payload = 4.0 * 4 * kMi;  // four fp32 fragments of 2^20
  CHECK(one[0].fragments == 4);
  CHECK(one[0].elements == 4 * kMi);
  CHECK(one[0].bytes_in_per_s == Approx(4 * payload / 10.0));   // M contributions of each fragment per H steps
  CHECK(one[0].bytes_out_per_s == Approx(4 * payload / 10.0));  // every merge to the M learners
  const double elems = 4.0 * 4 * kMi / 10.0;
  // The fold at CURVE's rate (the default: no payload CRC compared), or plaintext's.
  // Each merge is framed once for its M = 4 receivers (one shared payload).
  CHECK(one[0].merge_cores ==
        Approx(elems / d.costs.curve_fold_elements_per_s[0] + elems / 4 / d.costs.send_elements_per_s[0]));
  // In + out, at CURVE's rate (the default), or plaintext's; one I/O thread carries it all.
  CHECK(one[0].io_cores == Approx(2 * 4 * payload / 10.0 / d.costs.curve_io_bytes_per_s));
  CHECK(one[0].io_threads == 1);
  CHECK(one[0].io_busiest == Approx(one[0].io_cores));
  CHECK(one[0].cores == static_cast<std::size_t>(std::ceil(one[0].merge_cores)) + 1);
  DeploymentSpec plain = d;
  plain.curve = false;
  const auto plain_one = size_shards(plan, 1, 10, plain);
  CHECK(plain_one[0].io_cores == Approx(2 * 4 * payload / 10.0 / d.costs.io_bytes_per_s));
  CHECK(plain_one[0].merge_cores ==
        Approx(elems / d.costs.fold_elements_per_s[0] + elems / 4 / d.costs.send_elements_per_s[0]));
  // Theta, momentum, mean, published, spare, 1 anchor; one merge in flight: M contributions, and
  // the global's payload: M copies under CURVE (ZeroMQ encrypts one per learner), one in plaintext.
  CHECK(one[0].ram_steady_bytes == Approx(4.0 * 4 * kMi * 6 + 4 * (4.0 * kMi + 4.0 * kMi)));
  CHECK(plain_one[0].ram_steady_bytes == Approx(4.0 * 4 * kMi * 6 + 4 * 4.0 * kMi + 4.0 * kMi));
  const auto b = ddiloco::syncer_buffer_bounds(plan);
  CHECK(one[0].ram_bound_bytes == Approx(one[0].ram_steady_bytes + 8.0 * 4 * kMi + static_cast<double>(b.send_budget) +
                                         2.0 * static_cast<double>(b.incoming_max_bytes) +
                                         4.0 * static_cast<double>(b.peer_receive_budget)));
  // Two shards: each owns two fragments and half of every rate and of the state.
  const auto two = size_shards(plan, 2, 10, d);
  REQUIRE(two.size() == 2);
  for (const auto& z : two) {
    CHECK(z.fragments == 2);
    CHECK(z.bytes_in_per_s == Approx(one[0].bytes_in_per_s / 2));
    CHECK(z.merge_cores == Approx(one[0].merge_cores / 2));
    CHECK(z.ram_steady_bytes == Approx(4.0 * 2 * kMi * 6 + 4 * (4.0 * kMi + 4.0 * kMi)));  // same largest fragment
    // Its transport is sized by its own two fragments.
    const std::vector<std::size_t> own{kMi, kMi};
    const auto b2 = ddiloco::syncer_buffer_bounds(own);
    CHECK(z.ram_bound_bytes == Approx(z.ram_steady_bytes + 8.0 * 2 * kMi + static_cast<double>(b2.send_budget) +
                                      2.0 * static_cast<double>(b2.incoming_max_bytes) +
                                      4.0 * static_cast<double>(b2.peer_receive_budget)));
    CHECK(b2.peer_receive_budget == b.peer_receive_budget / 2);
  }
  // int4 contributions: 4.5 bits per value on the way in, the globals still fp32.
  DeploymentSpec q = d;
  q.codec = Codec::int4;
  const auto quant = size_shards(plan, 1, 10, q);
  CHECK(quant[0].bytes_in_per_s == Approx(4 * 4.0 * static_cast<double>(ddiloco::encoded_size(Codec::int4, kMi)) / 10.0));
  CHECK(quant[0].bytes_out_per_s == Approx(one[0].bytes_out_per_s));
}

TEST_CASE("size_deployment takes the fewest shards whose busiest one fits the host, and says what limited it",
          "[sim][capacity]") {
  DeploymentSpec d = small_spec();
  // One shard takes 4 x 16 MiB / 10 s = 6.7 MB/s = 0.0537 Gbit/s in; a 0.04 Gbit/s NIC needs two shards.
  d.nic_gbps = 0.04;
  const auto two = size_deployment(four_equal(), d);
  CHECK(two.fits);
  CHECK(two.shards == 2);
  CHECK(two.limited_by == "nic");
  CHECK(two.nic_gbps_per_shard == Approx(0.0268).epsilon(0.01));  // the busiest of the two shards
  CHECK(two.schedule.fragments == 4);
  CHECK(two.schedule.sync_every == 10);
  CHECK(two.predicted_utilisation == Approx(1.0));
  // A NIC for one shard: one shard, and cores = ceil(merge cores / headroom) + one I/O thread.
  d.nic_gbps = 10;
  const auto one = size_deployment(four_equal(), d);
  CHECK(one.shards == 1);
  CHECK(one.limited_by == "one shard is enough");
  CHECK(one.cores_per_shard == 2);
  // I/O at 10 MB/s per thread: 2 x 6.7 MB/s is 1.34 cores. Held to one thread (--io-threads 1), two
  // shards carry 0.67 each.
  DeploymentSpec io = d;
  io.costs.curve_io_bytes_per_s = 1e7;
  io.io_threads = 1;
  const auto io_bound = size_deployment(four_equal(), io);
  CHECK(io_bound.shards == 2);
  CHECK(io_bound.limited_by == "io threads");
  CHECK(io_bound.io_threads_per_shard == 1);
  // Chosen: two threads take the M = 4 connections two each, 0.67 cores the busiest, so one shard
  // with 2 I/O threads and ceil(merge / headroom) = 1 merge core.
  io.io_threads = 0;
  const auto spread = size_deployment(four_equal(), io);
  CHECK(spread.shards == 1);
  CHECK(spread.limited_by == "one shard is enough");
  CHECK(spread.io_threads_per_shard == 2);
  CHECK(spread.cores_per_shard == 3);
  REQUIRE(spread.per_shard.size() == 1);
  CHECK(spread.per_shard[0].io_busiest == Approx(spread.per_shard[0].io_cores / 2));
  // Three threads help no more than two with four connections (two of them share one thread):
  // the busiest is still half, so three are never chosen.
  CHECK(detail::busiest_io_thread(1.34, 4, 3) == Approx(0.67));
  // At 3 MB/s per thread one shard's 4.47 cores are too much for even four threads (one connection
  // each, 1.12 the busiest); two shards carry 2.23 each, on four threads of 0.56 (with two or three,
  // some thread has two of the four connections: 1.12).
  io.costs.curve_io_bytes_per_s = 3e6;
  const auto four = size_deployment(four_equal(), io);
  CHECK(four.limited_by == "io threads");
  CHECK(four.shards == 2);
  CHECK(four.io_threads_per_shard == 4);
  CHECK(four.per_shard[0].io_busiest == Approx(4 * 16.0 * kMi / 10.0 / 3e6 / 4));
  // Threads are bounded by the host: as many as cores leave none to merge on.
  io.io_threads = io.host_cores;
  CHECK_THROWS_WITH(size_deployment(four_equal(), io), Catch::Contains("io_threads = 16 leaves no core of 16"));
  // A host too small for even one fragment: the most shards, flagged as not fitting.
  d.host_ram_gib = 0.001;
  const auto none = size_deployment(four_equal(), d);
  CHECK_FALSE(none.fits);
  CHECK(none.shards == 4);
  CHECK(none.limited_by == "ram");
  // A given shard count (a running sharded syncer): exactly that many, whether or not it fits.
  DeploymentSpec given = small_spec();
  given.nic_gbps = 10;
  given.shards = 2;
  const auto fixed = size_deployment(four_equal(), given);
  CHECK(fixed.shards == 2);
  CHECK(fixed.fits);
  CHECK(fixed.limited_by == "given");
  REQUIRE(fixed.per_shard.size() == 2);
  CHECK(fixed.per_shard[0].bytes_in_per_s == Approx(one.per_shard[0].bytes_in_per_s / 2));
  given.shards = 5;
  CHECK_THROWS_WITH(size_deployment(four_equal(), given), Catch::Contains("shards = 5 but the plan has 4 fragments"));
}

TEST_CASE("size_deployment picks the smallest H whose utilisation reaches the target", "[sim][capacity]") {
  DeploymentSpec d = small_spec();
  d.sync_every = {2, 4, 40};
  // Each fragment takes 4 MiB x 8 / 0.01 Gbit/s = 3.36 s to send; all four 13.4 s per period:
  // H = 2 and 4 (2 s, 4 s periods) starve the link, H = 40 does not.
  d.link_gbps = 0.01;
  const auto plan = size_deployment(four_equal(), d);
  CHECK(plan.schedule.sync_every == 40);
  CHECK(plan.predicted_utilisation == Approx(1.0));
  // When no candidate reaches the target the best one is taken, and its utilisation reported.
  d.sync_every = {4, 8};
  const auto best = size_deployment(four_equal(), d);
  CHECK(best.schedule.sync_every == 8);
  CHECK(best.predicted_utilisation == Approx(8.0 / (4 * 4.0 * kMi * 8 / 0.01e9)));
}

TEST_CASE("size_deployment refuses a bad spec naming the field", "[sim][capacity]") {
  DeploymentSpec d = small_spec();
  d.learners = 0;
  CHECK_THROWS_WITH(size_deployment(four_equal(), d), Catch::Contains("learners = 0"));
  d = small_spec();
  d.headroom = 1.5;
  CHECK_THROWS_WITH(size_deployment(four_equal(), d), Catch::Contains("headroom = 1.5"));
  d = small_spec();
  d.host_cores = 1;
  CHECK_THROWS_WITH(size_deployment(four_equal(), d), Catch::Contains("host_cores = 1"));
  d = small_spec();
  d.step_s = 0;
  CHECK_THROWS_WITH(size_deployment(four_equal(), d), Catch::Contains("step_s = 0"));
  CHECK_THROWS_WITH(size_deployment({}, small_spec()), Catch::Contains("tensor list is empty"));
  d = small_spec();
  d.fragment_counts = {9};  // more fragments than tensors
  CHECK_THROWS_WITH(size_deployment(four_equal(), d), Catch::Contains("no (P, H, tau)"));
  d = small_spec();
  d.costs.curve_io_bytes_per_s = 0;
  CHECK_THROWS_WITH(size_deployment(four_equal(), d), Catch::Contains("curve_io_bytes_per_s = 0"));
  d = small_spec();
  d.costs.curve_fold_elements_per_s[4] = -1;
  CHECK_THROWS_WITH(size_deployment(four_equal(), d), Catch::Contains("costs.curve_fold_elements_per_s has -1"));
}
