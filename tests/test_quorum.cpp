// Tests for ddiloco/quorum.hpp: minimum quorum and adaptive grace window
// (docs/algorithm.md, "Quorum and grace window"; paper Eq. 3), driven by a
// VirtualClock.
#include <ddiloco/quorum.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

using namespace std::chrono_literals;
using ddiloco::Duration;
using ddiloco::NoGrace;
using ddiloco::QuorumConfig;
using ddiloco::QuorumPolicy;
using ddiloco::RoundState;
using ddiloco::TimePoint;
using ddiloco::VirtualClock;
using ddiloco::WaitDecision;
using Kind = WaitDecision::Kind;

namespace {
struct NotOptedIn {  // has every member but no wait_policy_tag
  WaitDecision decide(RoundState&, TimePoint) { return {}; }
  void observe_step_time(Duration) {}
  void observe_sync_time(Duration) {}
  Duration grace() const { return {}; }
};

RoundState make_round(TimePoint start, std::size_t contributions, std::size_t alive) {
  RoundState r;
  r.start = start;
  r.contributions = contributions;
  r.alive = alive;
  return r;
}
}  // namespace

static_assert(ddiloco::WaitPolicy<QuorumPolicy>);
static_assert(ddiloco::WaitPolicy<NoGrace>);
static_assert(!ddiloco::WaitPolicy<NotOptedIn>);
static_assert(!ddiloco::WaitPolicy<int>);

TEST_CASE("A round with no contribution is idle", "[quorum]") {
  QuorumPolicy policy;
  RoundState r = make_round(TimePoint{0}, 0, 8);
  CHECK(policy.decide(r, TimePoint{5s}).kind == Kind::idle);
}

TEST_CASE("K = 1 with no slack merges at once", "[quorum]") {
  QuorumPolicy policy(QuorumConfig{.min_quorum = 1, .overlap = 2, .gamma = 0.3});
  policy.observe_step_time(1s);
  policy.observe_sync_time(3s);  // slack = 2 * 1 - (0 + 3) = -1 s -> grace 0
  VirtualClock clock(TimePoint{10s});
  RoundState r = make_round(clock.now(), 1, 8);
  const auto d = policy.decide(r, clock.now());
  CHECK(d.kind == Kind::merge_now);
  CHECK(d.until == clock.now());
  CHECK(policy.grace() == 0ns);
}

TEST_CASE("K = 1 without grace merges at once even when there is slack", "[quorum]") {
  NoGrace policy(QuorumConfig{.min_quorum = 1, .gamma = 0.5});
  policy.observe_step_time(1s);  // slack = 2 s, but the grace window is off
  RoundState r = make_round(TimePoint{0}, 1, 8);
  CHECK(policy.decide(r, TimePoint{0}).kind == Kind::merge_now);
  CHECK(policy.grace() == 0ns);
  CHECK_FALSE(policy.config().grace);
}

TEST_CASE("K = 1 with grace waits exactly gamma times the slack when below the cap", "[quorum]") {
  // Hand computation: tau = 2, xi_step = 1 s, xi_sync = 0.5 s, xi_quorum = 0
  // (K = 1: the first contribution both opens the round and forms the quorum).
  // slack = 2 * 1 - (0 + 0.5) = 1.5 s; gamma = 0.3 -> grace = 0.45 s < cap 1 s.
  QuorumPolicy policy(QuorumConfig{.min_quorum = 1, .overlap = 2, .gamma = 0.3, .cap = 1s});
  policy.observe_step_time(1s);
  policy.observe_sync_time(500ms);
  VirtualClock clock(TimePoint{10s});
  RoundState r = make_round(clock.now(), 1, 8);

  auto d = policy.decide(r, clock.now());
  REQUIRE(d.kind == Kind::wait_until);
  CHECK(d.until == TimePoint{10s + 450ms});
  CHECK(policy.grace() == 450ms);
  REQUIRE(r.quorum_at.has_value());
  CHECK(*r.quorum_at == TimePoint{10s});

  clock.advance(449ms);
  r.contributions = 2;  // a second learner arrives inside the window: keep waiting
  d = policy.decide(r, clock.now());
  CHECK(d.kind == Kind::wait_until);
  CHECK(d.until == TimePoint{10s + 450ms});

  clock.advance(1ms);
  CHECK(policy.decide(r, clock.now()).kind == Kind::merge_now);
}

TEST_CASE("The grace window is capped", "[quorum]") {
  // slack = 2 * 10 - 0 = 20 s; gamma = 1 -> 20 s, capped at 1 s.
  QuorumPolicy policy(QuorumConfig{.min_quorum = 1, .overlap = 2, .gamma = 1.0, .cap = 1s});
  policy.observe_step_time(10s);
  RoundState r = make_round(TimePoint{0}, 1, 4);
  const auto d = policy.decide(r, TimePoint{0});
  CHECK(d.kind == Kind::wait_until);
  CHECK(d.until == TimePoint{1s});
}

TEST_CASE("The grace window, once frozen, does not move when the averages change", "[quorum]") {
  QuorumPolicy policy(QuorumConfig{.min_quorum = 1, .overlap = 2, .gamma = 0.5, .cap = 10s, .ema_beta = 1.0});
  policy.observe_step_time(1s);  // grace = 0.5 * 2 = 1 s
  RoundState r = make_round(TimePoint{0}, 1, 4);
  CHECK(policy.decide(r, TimePoint{0}).until == TimePoint{1s});
  policy.observe_step_time(4s);  // grace would now be 4 s
  CHECK(policy.grace() == 4s);
  CHECK(policy.decide(r, TimePoint{500ms}).until == TimePoint{1s});
}

TEST_CASE("K = M waits for everyone until the deadline", "[quorum]") {
  const std::size_t m = 4;
  QuorumPolicy policy(QuorumConfig{.min_quorum = m, .overlap = 2, .gamma = 0.3, .cap = 1s, .deadline = 30s});
  policy.observe_step_time(1s);
  VirtualClock clock(TimePoint{100s});
  RoundState r = make_round(clock.now(), 1, m);
  for (std::size_t c = 1; c < m; ++c) {
    r.contributions = c;
    const auto d = policy.decide(r, clock.now());
    CHECK(d.kind == Kind::wait_until);
    CHECK(d.until == TimePoint{130s});
    clock.advance(5s);
  }
  SECTION("the last learner arrives: merge at once") {
    r.contributions = m;
    CHECK(policy.decide(r, clock.now()).kind == Kind::merge_now);
  }
  SECTION("the last learner never arrives: merge at the deadline with what is there") {
    clock.advance_to(TimePoint{130s} - 1ns);
    CHECK(policy.decide(r, clock.now()).kind == Kind::wait_until);
    clock.advance(1ns);
    const auto d = policy.decide(r, clock.now());
    CHECK(d.kind == Kind::merge_now);
    CHECK(d.reason == "deadline reached below quorum");
  }
}

TEST_CASE("K larger than the alive learners is still bounded by the deadline", "[quorum]") {
  QuorumPolicy policy(QuorumConfig{.min_quorum = 8, .deadline = 10s});
  RoundState r = make_round(TimePoint{0}, 2, 8);
  CHECK(policy.decide(r, TimePoint{1s}).until == TimePoint{10s});
  r.alive = 3;  // five learners died: wait for the remaining one only
  CHECK(policy.decide(r, TimePoint{2s}).kind == Kind::wait_until);
  r.contributions = 3;
  CHECK(policy.decide(r, TimePoint{3s}).kind == Kind::merge_now);
}

TEST_CASE("Learners that are alive but do not train hold no round once the quorum is met and the training ones "
          "are in",
          "[quorum]") {
  // 2 learners train, 32 ids are alive but never trained (a join flood, peers
  // that only send heartbeats). The grace window would be 1 s.
  QuorumPolicy policy(QuorumConfig{.min_quorum = 1, .overlap = 2, .gamma = 1.0, .cap = 1s});
  policy.observe_step_time(1s);
  RoundState r = make_round(TimePoint{0}, 1, 34);
  r.training = 2;
  auto d = policy.decide(r, TimePoint{0});
  CHECK(d.kind == Kind::wait_until);  // one training learner still out: the grace window
  CHECK(d.until == TimePoint{1s});
  r.contributions = 2;
  d = policy.decide(r, TimePoint{100ms});
  CHECK(d.kind == Kind::merge_now);
  CHECK(d.reason == "every training learner contributed");
  SECTION("without the count, the same round waits out its grace window for the 32") {
    r.training.reset();
    CHECK(policy.decide(r, TimePoint{100ms}).until == TimePoint{1s});
  }
}

TEST_CASE("K is still bounded by the alive learners, not by the training ones", "[quorum]") {
  // K = M = 4, all alive; at the first round only learner 1 is known to train
  // (the others' first reports are on their way): the round waits for K.
  QuorumPolicy policy(QuorumConfig{.min_quorum = 4, .deadline = 10s, .grace = false});
  RoundState r = make_round(TimePoint{0}, 1, 4);
  r.training = 1;
  CHECK(policy.decide(r, TimePoint{0}).until == TimePoint{10s});
  r.contributions = 3;
  r.training = 3;
  CHECK(policy.decide(r, TimePoint{1s}).until == TimePoint{10s});
  r.alive = 3;  // the fourth died: the three training ones are everyone
  CHECK(policy.decide(r, TimePoint{2s}).kind == Kind::merge_now);
}

TEST_CASE("The moving averages follow their definition", "[quorum]") {
  // beta = 0.1; ema <- 0.9 * ema + 0.1 * sample, the first sample initialises.
  // step samples 1, 2, 3 s: 1 -> 0.9 + 0.2 = 1.1 -> 0.99 + 0.3 = 1.29
  // sync samples 0.5, 1.5 s: 0.5 -> 0.45 + 0.15 = 0.6
  QuorumPolicy policy(QuorumConfig{.min_quorum = 2, .overlap = 2, .gamma = 0.5, .cap = 10s, .ema_beta = 0.1});
  CHECK(policy.ema_step_seconds() == 0.0);
  policy.observe_step_time(1s);
  CHECK(policy.ema_step_seconds() == Approx(1.0).epsilon(1e-12));
  policy.observe_step_time(2s);
  CHECK(policy.ema_step_seconds() == Approx(1.1).epsilon(1e-12));
  policy.observe_step_time(3s);
  CHECK(policy.ema_step_seconds() == Approx(1.29).epsilon(1e-12));
  policy.observe_sync_time(500ms);
  policy.observe_sync_time(1500ms);
  CHECK(policy.ema_sync_seconds() == Approx(0.6).epsilon(1e-12));

  // xi_quorum is fed by decide(), once per round, with quorum_at - start.
  // Round 1: quorum after 0.4 s -> 0.4. Round 2: after 0.2 s -> 0.36 + 0.02 = 0.38.
  RoundState r1 = make_round(TimePoint{0}, 2, 8);
  r1.quorum_at = TimePoint{400ms};
  (void)policy.decide(r1, TimePoint{400ms});
  (void)policy.decide(r1, TimePoint{450ms});  // same round: not fed again
  CHECK(policy.ema_quorum_seconds() == Approx(0.4).epsilon(1e-12));
  RoundState r2 = make_round(TimePoint{10s}, 2, 8);
  (void)policy.decide(r2, TimePoint{10s + 200ms});
  CHECK(policy.ema_quorum_seconds() == Approx(0.38).epsilon(1e-12));
  REQUIRE(r2.quorum_at.has_value());
  CHECK(*r2.quorum_at == TimePoint{10s + 200ms});

  // slack = 2 * 1.29 - (0.38 + 0.6) = 1.6 s; grace = 0.5 * 1.6 = 0.8 s.
  CHECK(policy.slack_seconds() == Approx(1.6).epsilon(1e-12));
  CHECK(std::chrono::duration<double>(policy.grace()).count() == Approx(0.8).epsilon(1e-9));
}

TEST_CASE("Decisions never wait past the cap after quorum nor past the deadline", "[quorum][property]") {
  for (unsigned seed = 1; seed <= 300; ++seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::uniform_int_distribution<std::size_t> small(1, 10);
    const std::size_t m = small(rng);
    QuorumConfig cfg;
    cfg.min_quorum = std::uniform_int_distribution<std::size_t>(1, m + 2)(rng);  // also K > M
    cfg.overlap = std::uniform_int_distribution<std::size_t>(0, 4)(rng);
    cfg.gamma = u(rng);
    cfg.cap = Duration{static_cast<Duration::rep>(u(rng) * 2e9)};
    cfg.deadline = Duration{1 + static_cast<Duration::rep>(u(rng) * 5e9)};
    cfg.ema_beta = 0.01 + 0.99 * u(rng);
    cfg.grace = u(rng) < 0.8;
    QuorumPolicy policy(cfg);
    VirtualClock clock(TimePoint{static_cast<Duration::rep>(u(rng) * 1e12)});

    for (int round = 0; round < 20; ++round) {
      policy.observe_step_time(Duration{static_cast<Duration::rep>(u(rng) * 3e9)});
      policy.observe_sync_time(Duration{static_cast<Duration::rep>(u(rng) * 1e9)});
      RoundState r = make_round(clock.now(), 1, m);
      // Pending arrivals of the other learners (some never come).
      std::vector<TimePoint> arrivals;
      for (std::size_t i = 1; i < m; ++i) {
        if (u(rng) < 0.7) arrivals.push_back(clock.now() + Duration{static_cast<Duration::rep>(u(rng) * 8e9)});
      }
      std::sort(arrivals.begin(), arrivals.end());
      std::size_t next = 0;
      bool merged = false;
      for (int guard = 0; guard < 1000 && !merged; ++guard) {
        const auto d = policy.decide(r, clock.now());
        const TimePoint hard = r.start + cfg.deadline;
        REQUIRE(d.kind != Kind::idle);
        if (d.kind == Kind::merge_now) {
          CHECK(clock.now() <= std::max(hard, r.start));
          merged = true;
          break;
        }
        CHECK(d.until <= hard);
        CHECK(d.until > clock.now());
        if (r.quorum_at) CHECK(d.until <= *r.quorum_at + cfg.cap);
        // Move time to the earlier of the next arrival and the decision time.
        if (next < arrivals.size() && arrivals[next] < d.until) {
          clock.advance_to(arrivals[next++]);
          r.contributions = std::min(r.contributions + 1, m);
        } else {
          clock.advance_to(d.until);
        }
        if (u(rng) < 0.05 && r.alive > 1) --r.alive;  // a learner dies
      }
      REQUIRE(merged);
      clock.advance(Duration{static_cast<Duration::rep>(u(rng) * 1e9)});
    }
  }
}

TEST_CASE("Invalid configurations are rejected with the bad value named", "[quorum]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_AS(QuorumPolicy(QuorumConfig{.min_quorum = 0}), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(QuorumPolicy(QuorumConfig{.min_quorum = 0}), Contains("min_quorum (K) = 0"));
  CHECK_THROWS_WITH(QuorumPolicy(QuorumConfig{.gamma = 1.5}), Contains("gamma = 1.5"));
  CHECK_THROWS_WITH(QuorumPolicy(QuorumConfig{.gamma = -0.1}), Contains("gamma = -0.1"));
  CHECK_THROWS_WITH(QuorumPolicy(QuorumConfig{.cap = -1ns}), Contains("cap = -1"));
  CHECK_THROWS_WITH(QuorumPolicy(QuorumConfig{.deadline = 0ns}), Contains("deadline = 0"));
  CHECK_THROWS_WITH(QuorumPolicy(QuorumConfig{.ema_beta = 0.0}), Contains("ema_beta = 0"));
  CHECK_THROWS_WITH(QuorumPolicy(QuorumConfig{.ema_beta = 1.5}), Contains("ema_beta = 1.5"));
  CHECK_THROWS_AS(QuorumPolicy(QuorumConfig{.gamma = std::nan("")}), ddiloco::InvalidArgument);
  QuorumPolicy ok;
  CHECK_THROWS_WITH(ok.observe_step_time(-1s), Contains("negative"));
  CHECK_NOTHROW(QuorumPolicy(QuorumConfig{.min_quorum = 3, .gamma = 0.0, .cap = 0ns, .ema_beta = 1.0}));
}
