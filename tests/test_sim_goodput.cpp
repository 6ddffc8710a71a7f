// Tests for ddiloco/sim/goodput.hpp: the discrete-event goodput simulator.
#include <ddiloco/sim/goodput.hpp>

#include <catch2/catch.hpp>

#include <cmath>

using namespace ddiloco::sim;

namespace {
GoodputConfig quiet(System s, double hours = 12.0) {
  GoodputConfig c;
  c.system = s;
  c.chips = 150e3;
  c.horizon_hours = hours;
  c.failures.speed_cv = 0.0;
  return c;
}

// The elastic cases worked by hand: 150k chips, stalls C = 5 s, short steps and
// exponential repairs of 1 h, so that lambda = 150k / (8760 h) failures per second
// and a share f = 256 x 1 h / 8760 h (2.9%) of the slices is in repair on average.
constexpr double kStall = 5.0;
constexpr double kLambda = 150e3 / (8760.0 * 3600.0);
constexpr double kInRepair = 256.0 * 3600.0 / (8760.0 * 3600.0);
GoodputConfig by_hand_elastic() {
  GoodputConfig c = quiet(System::elastic, 200.0);
  c.costs.reconfigure_s = kStall;
  c.step_s = 0.05;
  c.failures.recovery = ExpWeibull{1.0, 1.0, 1.0}.with_mean(3600.0);
  return c;
}
}  // namespace

TEST_CASE("Without failures every system reaches 100% goodput", "[sim][goodput]") {
  for (const System s : {System::data_parallel, System::elastic, System::decoupled}) {
    GoodputConfig c = quiet(s);
    c.failures.chip_mtbi_hours = 1e30;
    const GoodputResult r = simulate_goodput(c);
    INFO(system_name(s));
    // 12 h of 2 s steps = 21600 steps; at most the step ending exactly at the horizon is not counted.
    CHECK(r.goodput == Approx(1.0).margin(1.0 / 21600 + 1e-12));
    CHECK(r.uptime == Approx(1.0));
    CHECK(r.failures == 0);
    CHECK(r.global_downtime_hours == Approx(0.0).margin(1e-9));
  }
}

TEST_CASE("Goodput does not increase when the time between interruptions shrinks", "[sim][goodput]") {
  for (const System s : {System::data_parallel, System::elastic, System::decoupled}) {
    double previous = 2.0;
    for (const double mtbi : {8760.0 * 16, 8760.0 * 4, 8760.0, 8760.0 / 4}) {
      GoodputConfig c = quiet(s, 8.0);
      c.failures.chip_mtbi_hours = mtbi;
      c.failures.speed_cv = 0.01;
      const double g = simulate_goodput(c).goodput;
      INFO(system_name(s) << ", MTBI " << mtbi << " h: " << g);
      CHECK(g <= previous);
      previous = g;
    }
  }
}

TEST_CASE("The same seed gives the same result and another seed a different one", "[sim][goodput]") {
  for (const System s : {System::data_parallel, System::elastic, System::decoupled}) {
    GoodputConfig c = quiet(s, 6.0);
    c.failures.speed_cv = 0.02;
    c.series_bin_s = 600;
    const auto a = simulate_goodput(c);
    const auto b = simulate_goodput(c);
    CHECK(a.goodput == b.goodput);
    CHECK(a.uptime == b.uptime);
    CHECK(a.failures == b.failures);
    CHECK(a.steps == b.steps);
    CHECK(a.merges == b.merges);
    REQUIRE(a.series.size() == b.series.size());
    for (std::size_t i = 0; i < a.series.size(); ++i) CHECK(a.series[i].goodput == b.series[i].goodput);
    c.seed = 2;
    CHECK(simulate_goodput(c).goodput != a.goodput);
  }
}

TEST_CASE("Data-parallel with exponential failures and a fixed restart matches its closed form", "[sim][goodput]") {
  // Renewal-reward: up periods U ~ Exp(lambda), then R; whole steps of s count:
  //   goodput = s * e^(-lambda s) / (1 - e^(-lambda s)) / (1 / lambda + R).
  // 600k chips at one interruption per chip-year: lambda = 600000 / 31536000 /s.
  GoodputConfig c = quiet(System::data_parallel, 400.0);
  c.chips = 600e3;
  c.costs.restart_s = 60.0;
  const double lambda = 600e3 / (8760.0 * 3600.0);
  const double s = 2.0;
  const double by_hand = s * std::exp(-lambda * s) / (1.0 - std::exp(-lambda * s)) / (1.0 / lambda + 60.0);
  CHECK(data_parallel_goodput_closed_form(600e3, 8760.0, 60.0, 2.0) == Approx(by_hand).epsilon(1e-12));
  const auto r = simulate_goodput(c);
  // ~27000 failures: the estimate's relative standard error is below 1%.
  CHECK(r.goodput == Approx(by_hand).epsilon(0.02));
  // With very short steps the closed form tends to 1 / (1 + lambda R).
  c.step_s = 0.01;
  c.horizon_hours = 100.0;
  CHECK(simulate_goodput(c).goodput == Approx(1.0 / (1.0 + lambda * 60.0)).epsilon(0.02));
}

TEST_CASE("Elastic data-parallel without spares loses the reconfiguration stalls and the slices that are down",
          "[sim][goodput]") {
  // Every failure costs two stalls C (shrink, grow back) at near-full capacity,
  // and on average a fraction f = slice * E[X] / MTBI of the slices is down:
  //   goodput ~= (1 - f) / (1 + 2 lambda C) when stalls rarely overlap.
  GoodputConfig c = by_hand_elastic();
  c.failures.spare_fraction = 0.0;
  const double by_hand = (1.0 - kInRepair) / (1.0 + 2.0 * kLambda * kStall);
  CHECK(simulate_goodput(c).goodput == Approx(by_hand).epsilon(0.01));
}

TEST_CASE("With spares an elastic failure costs one stall; a pool that runs dry costs the slices it lacks",
          "[sim][goodput]") {
  GoodputConfig c = by_hand_elastic();
  // The default pool (10%) covers the repairs: the spare comes in during the
  // shrink's stall, so each failure costs one stall C and no capacity.
  const double one_stall = 1.0 / (1.0 + kLambda * kStall);
  CHECK(simulate_goodput(c).goodput == Approx(one_stall).epsilon(0.005));
  // A swap time longer than the stall: the job runs without the slice until
  // the spare is in, then stalls again to grow.
  c.failures.spare_swap_s = 600.0;
  const double swap = (1.0 - kLambda * 600.0 * 256.0 / 150e3) / (1.0 + 2.0 * kLambda * kStall);
  CHECK(simulate_goodput(c).goodput == Approx(swap).epsilon(0.005));
  c.failures.spare_swap_s = 0.0;
  // A pool of 1% of the slices (6 spares) against 2.9% in repair (17 slices on
  // average): the pool is almost always empty, so about 1.9% of the positions
  // wait for a repaired slice, and a failure costs two stalls again (shrink,
  // then grow when the repaired slice comes).
  c.failures.spare_fraction = 0.01;
  const double dry = simulate_goodput(c).goodput;
  CHECK(dry == Approx((1.0 - (kInRepair - 0.01)) / (1.0 + 2.0 * kLambda * kStall)).epsilon(0.01));
  CHECK(dry < one_stall - 0.01);
}

TEST_CASE("Data-parallel needs every position: without spares it waits for each repair", "[sim][goodput]") {
  GoodputConfig c = quiet(System::data_parallel, 72.0);
  const double with_spares = simulate_goodput(c).goodput;
  c.failures.spare_fraction = 0.0;
  // 586 slices with 5.6% of them in repair on average: some slice is almost
  // always in repair, so the job barely runs.
  const double without = simulate_goodput(c).goodput;
  CHECK(with_spares > 0.7);
  CHECK(without < 0.1);
}

TEST_CASE("With failures rare every system tends to 1 minus the cost of the speed spread", "[sim][goodput]") {
  // The reference: the same cluster (same slice speeds) without failures.
  const auto no_failures = [](GoodputConfig c) {
    c.failures.chip_mtbi_hours = 1e30;
    return simulate_goodput(c).goodput;
  };
  SECTION("chip MTBI to infinity") {
    for (const System s : {System::data_parallel, System::elastic, System::decoupled}) {
      GoodputConfig c;
      c.system = s;
      c.horizon_hours = 24.0;
      c.failures.chip_mtbi_hours = 1e9;
      INFO(system_name(s));
      const double ideal = no_failures(c);
      CHECK(ideal < 0.99);  // the speed spread costs something
      CHECK(simulate_goodput(c).goodput == Approx(ideal).margin(0.001));
    }
  }
  SECTION("few chips per job, at one interruption per chip per year") {
    // An elastic job of 10 slices fails about once every 3.4 h; 64 learners of
    // 9 slices over 150k chips each fail about once every 3 h. The small job
    // gets 3 spares: with 0.56 of its 10 slices in repair on average, the
    // default 10% (one spare) runs dry 11% of the time.
    GoodputConfig e;
    e.system = System::elastic;
    e.chips = 2560;
    e.horizon_hours = 72.0;
    e.failures.spare_fraction = 0.3;
    GoodputConfig d;
    d.system = System::decoupled;
    d.chips = 150e3;
    d.horizon_hours = 24.0;
    d.decoupled.learners = 64;
    for (GoodputConfig c : {e, d}) {
      INFO(system_name(c.system) << " with " << c.chips << " chips");
      const double ideal = no_failures(c);
      CHECK(simulate_goodput(c).goodput == Approx(ideal).margin(0.005));
      // Without spares every position is down for its slice's repair: 5.6% of
      // the slices at the defaults, whatever the job's size.
      c.failures.spare_fraction = 0.0;
      CHECK(simulate_goodput(c).goodput < ideal - 0.04);
    }
  }
}

TEST_CASE("M Decoupled DiLoCo learners behave like one elastic job with M times fewer chips", "[sim][goodput]") {
  GoodputConfig d = quiet(System::decoupled, 24.0);
  d.chips = 1.2e6;
  d.decoupled.learners = 8;
  GoodputConfig e = quiet(System::elastic, 24.0);
  e.chips = 150e3;
  const auto rd = simulate_goodput(d);
  const auto re = simulate_goodput(e);
  CHECK(rd.goodput == Approx(re.goodput).margin(0.02));
  CHECK(rd.uptime > 0.999);  // some learner is always training
  CHECK(re.uptime < 0.97);
}

TEST_CASE("The syncer merges with the quorum policy: K = 1 never blocks a learner, K = M makes fast ones wait",
          "[sim][goodput]") {
  GoodputConfig c = quiet(System::decoupled, 2.0);
  c.failures.chip_mtbi_hours = 1e30;
  c.chips = 1024;             // four slices: one per learner,
  c.failures.speed_cv = 0.2;  // so the learners run at very different speeds
  c.decoupled.learners = 4;
  const auto k1 = simulate_goodput(c);
  CHECK(k1.blocked_sends == 0);
  CHECK(k1.merges > 0);
  CHECK(k1.mean_merge_size >= 1.0);
  c.decoupled.min_quorum = 4;
  const auto k4 = simulate_goodput(c);
  CHECK(k4.blocked_sends > 0);
  CHECK(k4.goodput < k1.goodput - 0.02);
  CHECK(k4.mean_merge_size > k1.mean_merge_size);
}

TEST_CASE("The time series covers the horizon and averages to the goodput", "[sim][goodput]") {
  GoodputConfig c = quiet(System::elastic, 6.0);
  c.series_bin_s = 900;
  const auto r = simulate_goodput(c);
  REQUIRE(r.series.size() == 24);
  double sum = 0;
  std::uint64_t failures = 0;
  for (const auto& p : r.series) sum += p.goodput, failures += p.failures;
  CHECK(sum / 24.0 == Approx(r.goodput).epsilon(1e-9));
  CHECK(failures == r.failures);
  CHECK(r.series[1].t_hours == Approx(0.25));
}

TEST_CASE("Invalid simulator settings are rejected with the value named", "[sim][goodput]") {
  using Catch::Matchers::Contains;
  GoodputConfig c;
  c.chips = 0;
  CHECK_THROWS_WITH(simulate_goodput(c), Contains("chips = 0"));
  c = GoodputConfig{};
  c.horizon_hours = -1;
  CHECK_THROWS_WITH(simulate_goodput(c), Contains("horizon_hours = -1"));
  c = GoodputConfig{};
  c.system = System::decoupled;
  c.chips = 1000;
  c.decoupled.learners = 16;
  CHECK_THROWS_WITH(simulate_goodput(c), Contains("more learners than slices"));
  c = GoodputConfig{};
  c.failures.spare_fraction = -0.1;
  CHECK_THROWS_WITH(simulate_goodput(c), Contains("spare_fraction = -0.1"));
  c = GoodputConfig{};
  c.failures.spare_swap_s = -1;
  CHECK_THROWS_WITH(simulate_goodput(c), Contains("spare_swap_s = -1"));
  c = GoodputConfig{};
  c.system = System::decoupled;
  c.decoupled.fragments = 30;  // P > H: Schedule rejects it
  CHECK_THROWS_AS(simulate_goodput(c), ddiloco::InvalidArgument);
}
