// Tests for the syncer's admission of contributions (ddiloco/syncer/admission.hpp,
// docs/algorithm.md, "Validation and staleness"): bounded claims (steps by the
// learner's step counter and the schedule, tokens by the declaration at join),
// the norm checked on the true norm against a robust reference, norm clipping
// in the merge and the weight cap. Driven with crafted messages on a virtual
// clock (no transport threads, no sleeps); every expected global is computed
// by a second syncer fed the honest contributions only, never hard-coded.
#include <ddiloco/syncer.hpp>

#include <ddiloco/outer_loop.hpp>
#include <ddiloco/transport/in_process.hpp>

#include <catch2/catch.hpp>

#include "syncer_test_util.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <vector>

using namespace ddiloco;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t kH = 8;                // sync_every
constexpr std::size_t kTau = 2;              // overlap
constexpr std::uint64_t kTokensPerStep = 16;  // every honest learner's batch in tokens
constexpr std::int64_t kHuge = std::int64_t{1} << 62;

// Two fragments, one with an embedding tensor (averaged plainly by RDA).
Plan admission_plan() { return make_plan({{"w", 48, false}, {"e", 16, true}, {"b", 40, false}}, 2); }

SyncerConfig base_config(std::size_t k) {
  SyncerConfig c = test::quorum_config(k);  // participation scaling off: merges identical whoever else is alive
  c.heartbeat_timeout = 600s;
  c.sync_every = kH;
  c.quorum.overlap = kTau;
  return c;
}

/// Joins, contributions and honest step counters for one or more syncers.
struct Driver {
  VirtualClock clock;
  Plan plan = admission_plan();
  std::vector<float> init = std::vector<float>(plan.total_numel(), 0.5f);
  Outbox out;
  test::StepCounters step;                 ///< each learner's inner step counter
  std::map<LearnerId, std::uint64_t> seq;  ///< each learner's last sequence number

  static std::uint64_t seq0() { return test::kSeq0; }

  /// A join stating the schedule (H, tau) and the learner's batch.
  Message join_message(LearnerId id, std::uint64_t tokens_per_step = kTokensPerStep) const {
    Message m = test::join_message(plan, id, 1000 + id);
    m.steps = static_cast<std::int64_t>(kH);
    m.tokens = static_cast<std::int64_t>(kTau);
    m.version = tokens_per_step;
    m.step = 0;
    return m;
  }
  template <class S>
  void join(S& s, LearnerId id, std::uint64_t tokens_per_step = kTokensPerStep) {
    s.handle(join_message(id, tokens_per_step), out);
    step.emplace(id, 0);
    seq.emplace(id, seq0());
  }

  /// A contribution of `values` with honest counters (H steps of
  /// kTokensPerStep tokens, the step counter advanced by H) unless overridden.
  Message contribution(LearnerId id, std::size_t p, std::vector<float> values, std::uint64_t version) {
    constexpr auto h = static_cast<std::int64_t>(kH);
    return test::contribution_message(plan, id, p, ++seq[id], version, std::move(values),
                                      {h, h * static_cast<std::int64_t>(kTokensPerStep), step.advance(id, h)});
  }

  std::size_t numel(std::size_t p) const { return plan.fragments()[p].numel; }
};

/// Gaussian values of fragment p for (learner, round): a learner's own direction.
std::vector<float> gaussian(std::size_t n, std::uint32_t seed, float sigma = 0.05f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = g(rng);
  return v;
}

std::vector<float> scaled(std::vector<float> v, float k) {
  for (float& x : v) x *= k;
  return v;
}

double norm(std::span<const float> v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

double distance(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += std::pow(static_cast<double>(a[i]) - b[i], 2);
  return std::sqrt(s);
}

using test::rejected;

constexpr LearnerId kHonest = 3;   // learners 1..3
constexpr LearnerId kPoisoner = 4;

/// Runs warm-up, attack and recovery rounds of three honest learners against
/// `attacked` (which also hears the poisoner, before the honest learners of
/// each round, so that it would be in the quorum if accepted) and `honest`
/// (which hears only the honest learners). `poison(p, version, v)` builds the
/// poisoner's contribution of fragment p from an honest-sized v. With
/// `poisoner_always`, the poisoner also sends v as it is outside the attack
/// rounds (it is then one of the quorum). Returns the honest contributions sent.
template <class S, class Poison>
std::size_t run_attack(Driver& d, S& attacked, S& honest, std::size_t warmup_rounds, std::size_t attack_rounds,
                       std::size_t after_rounds, const Poison& poison, bool poisoner_always = false) {
  std::size_t sent = 0;
  const std::size_t rounds = warmup_rounds + attack_rounds + after_rounds;
  for (std::size_t r = 0; r < rounds; ++r) {
    for (std::size_t p = 0; p < d.plan.num_fragments(); ++p) {
      const std::uint64_t version = attacked.fragment(p).second;
      REQUIRE(honest.fragment(p).second == version);  // the poisoner never made a merge of its own
      const bool attack = r >= warmup_rounds && r < warmup_rounds + attack_rounds;
      auto v = gaussian(d.numel(p), 7000u + static_cast<std::uint32_t>(r * 7 + p));
      if (attack) {
        attacked.handle(poison(p, version, std::move(v)), d.out);
      } else if (poisoner_always) {
        attacked.handle(d.contribution(kPoisoner, p, std::move(v), version), d.out);
      }
      for (LearnerId id = 1; id <= kHonest; ++id) {
        Message m = d.contribution(id, p, gaussian(d.numel(p), id * 100u + static_cast<std::uint32_t>(r * 7 + p)), version);
        attacked.handle(m, d.out);
        honest.handle(m, d.out);
        ++sent;
      }
    }
  }
  return sent;
}

}  // namespace

TEST_CASE("A poisoner claiming steps = tokens = 2^62 with 1000x the honest norm is rejected and the global stays "
          "the honest-only global",
          "[syncer][admission]") {
  Driver d;
  Syncer<> attacked(d.plan, d.init, d.clock, base_config(kHonest));
  Syncer<> honest(d.plan, d.init, d.clock, base_config(kHonest));
  for (LearnerId id = 1; id <= kHonest; ++id) {
    d.join(attacked, id);
    d.join(honest, id);
  }
  d.join(attacked, kPoisoner);
  std::size_t poisoned = 0;
  const auto sent = run_attack(d, attacked, honest, 2, 10, 5, [&](std::size_t p, std::uint64_t version, std::vector<float> v) {
    Message m = d.contribution(kPoisoner, p, scaled(std::move(v), 1000.0f), version);
    m.steps = m.tokens = kHuge;
    m.step = static_cast<std::uint64_t>(kHuge);  // a liar's step counter as well
    ++poisoned;
    return m;
  });
  const auto s = attacked.status();
  INFO(s.line());
  CHECK(rejected(s, RejectReason::steps_beyond_schedule) == poisoned);
  CHECK(s.contributions_accepted == sent);  // every honest contribution, before, during and after
  CHECK(s.rejected_total() == poisoned);
  CHECK(s.merges == honest.status().merges);
  CHECK(attacked.global_parameters() == honest.global_parameters());
}

TEST_CASE("A poisoner with honest counters and 1000x the honest norm is rejected as norm_outlier, and the "
          "reference is not poisoned: every honest contribution after the attack is accepted",
          "[syncer][admission]") {
  Driver d;
  Syncer<> attacked(d.plan, d.init, d.clock, base_config(kHonest));
  Syncer<> honest(d.plan, d.init, d.clock, base_config(kHonest));
  for (LearnerId id = 1; id <= kHonest; ++id) {
    d.join(attacked, id);
    d.join(honest, id);
  }
  d.join(attacked, kPoisoner);
  std::size_t poisoned = 0;
  const auto sent = run_attack(d, attacked, honest, 2, 20, 5, [&](std::size_t p, std::uint64_t version, std::vector<float> v) {
    ++poisoned;
    return d.contribution(kPoisoner, p, scaled(std::move(v), 1000.0f), version);
  });
  const auto s = attacked.status();
  INFO(s.line());
  CHECK(rejected(s, RejectReason::norm_outlier) == poisoned);
  CHECK(s.contributions_accepted == sent);
  CHECK(s.contributions_clipped == 0);  // honest norms stay within clip_factor of each other
  CHECK(attacked.global_parameters() == honest.global_parameters());
}

TEST_CASE("With the outlier check off, clipping bounds a 1000x poisoner's influence on the global", "[syncer][admission]") {
  // The poisoner is in every merge (its counters are honest and no norm is
  // rejected); clipping scales it to clip_factor x the reference. Distances to
  // the honest-only global, with and without clipping, over the same rounds.
  auto distance_after_attack = [](double clip) {
    Driver d;
    SyncerConfig c = base_config(kHonest + 1);
    c.norm_outlier_factor = 1e12;
    c.clip_factor = clip;
    SyncerConfig hc = base_config(kHonest);
    Syncer<> attacked(d.plan, d.init, d.clock, c);
    Syncer<> honest(d.plan, d.init, d.clock, hc);
    for (LearnerId id = 1; id <= kHonest; ++id) {
      d.join(attacked, id);
      d.join(honest, id);
    }
    d.join(attacked, kPoisoner);
    std::size_t poisoned = 0;
    run_attack(
        d, attacked, honest, 2, 10, 0,
        [&](std::size_t p, std::uint64_t version, std::vector<float> v) {
          ++poisoned;
          return d.contribution(kPoisoner, p, scaled(std::move(v), 1000.0f), version);
        },
        /*poisoner_always=*/true);
    // The first 2 rounds warm up: the poisoner's contributions come after.
    CHECK(attacked.status().contributions_clipped == (clip > 0 ? poisoned : 0));
    return distance(attacked.global_parameters(), honest.global_parameters());
  };
  const double unclipped = distance_after_attack(0.0), clipped = distance_after_attack(4.0);
  INFO("distance to the honest-only global: unclipped " << unclipped << ", clipped " << clipped);
  CHECK(clipped * 20 < unclipped);
}

TEST_CASE("A flood of half-NaN contributions with huge counters is rejected as non_finite and leaves the global as "
          "it was",
          "[syncer][admission]") {
  Driver d;
  Syncer<> s(d.plan, d.init, d.clock, base_config(1));
  d.join(s, 1);
  d.join(s, 2);
  const auto before = s.global_parameters();
  for (int i = 0; i < 200; ++i) {
    const std::size_t p = static_cast<std::size_t>(i) % d.plan.num_fragments();
    auto v = gaussian(d.numel(p), static_cast<std::uint32_t>(i));
    for (std::size_t k = 0; k < v.size(); k += 2) v[k] = std::numeric_limits<float>::quiet_NaN();
    Message m = d.contribution(2, p, std::move(v), 0);
    m.steps = m.tokens = kHuge;
    s.handle(m, d.out);
  }
  auto st = s.status();
  CHECK(rejected(st, RejectReason::non_finite) == 200);
  CHECK(st.rejected_total() == 200);
  CHECK(s.global_parameters() == before);
  // The honest learner is not affected.
  s.handle(d.contribution(1, 0, gaussian(d.numel(0), 5), 0), d.out);
  st = s.status();
  CHECK(st.contributions_accepted == 1);
  CHECK(st.merges == 1);
}

TEST_CASE("Steps beyond the advance of the learner's step counter, or beyond the schedule's ceiling, are rejected",
          "[syncer][admission]") {
  Driver d;
  SyncerConfig c = base_config(1);
  c.max_staleness = 2;  // ceiling H x (2 + 1) = 24 steps
  REQUIRE(steps_ceiling(c) == 24);
  Syncer<> s(d.plan, d.init, d.clock, c);
  d.join(s, 1);
  const auto v = gaussian(d.numel(0), 1);
  auto send = [&](std::int64_t steps, std::uint64_t step_counter) {
    Message m = d.contribution(1, 0, v, s.fragment(0).second);
    m.steps = steps;
    m.tokens = steps * static_cast<std::int64_t>(kTokensPerStep);
    m.step = step_counter;
    s.handle(m, d.out);
    return rejected(s.status(), RejectReason::steps_beyond_schedule);
  };
  CHECK(send(8, 8) == 0);    // 8 steps since the join at step 0
  CHECK(send(8, 12) == 1);   // 8 claimed, the counter advanced by 4
  CHECK(send(4, 12) == 2);   // the previous one was at step 12: no advance since
  CHECK(send(4, 16) == 2);   // 4 since step 12
  CHECK(send(4, 10) == 3);   // a counter running backwards
  CHECK(send(25, 1000) == 4);  // above the ceiling, whatever the counter says
  CHECK(send(24, 2000) == 4);  // at the ceiling
  CHECK(s.status().contributions_accepted == 3);
  // Another fragment has its own base: the join's step 0.
  Message other = d.contribution(1, 1, gaussian(d.numel(1), 2), 0);
  other.steps = 24;
  other.tokens = 24 * static_cast<std::int64_t>(kTokensPerStep);
  other.step = 2000;
  s.handle(other, d.out);
  CHECK(s.status().contributions_accepted == 4);
}

TEST_CASE("Tokens beyond steps x the declared tokens per step are rejected; a join declaring more than the "
          "syncer's bound is refused",
          "[syncer][admission]") {
  Driver d;
  SyncerConfig c = base_config(1);
  c.max_tokens_per_step = 32;
  Syncer<> s(d.plan, d.init, d.clock, c);
  d.join(s, 1);                    // declares 16 tokens per step
  d.join(s, 2, /*tokens_per_step=*/0);  // declares none: held to the syncer's 32
  auto send = [&](LearnerId id, std::int64_t tokens) {
    Message m = d.contribution(id, 0, gaussian(d.numel(0), id), s.fragment(0).second);
    m.tokens = tokens;
    s.handle(m, d.out);
    return rejected(s.status(), RejectReason::tokens_beyond_declared);
  };
  constexpr auto h = static_cast<std::int64_t>(kH);
  CHECK(send(1, h * 16 + 1) == 1);
  CHECK(send(1, h * 16) == 1);
  CHECK(send(2, h * 32 + 1) == 2);
  CHECK(send(2, h * 32) == 2);
  CHECK(s.status().contributions_accepted == 2);

  d.out.clear();
  s.handle(d.join_message(3, 64), d.out);
  REQUIRE(d.out.size() == 1);
  const Message& no = d.out[0].message;
  CHECK(no.type == MessageType::join_refused);
  CHECK(static_cast<JoinRefusal>(no.fragment) == JoinRefusal::tokens_per_step);
  CHECK(no.version == 32);
  CHECK(s.status().joins_refused == 1);
  const auto refusals = s.take_refusals();
  REQUIRE(refusals.size() == 1);
  CHECK_THAT(refusals[0].line(), Catch::Contains("declared 64 tokens per inner step") && Catch::Contains("32"));
}

TEST_CASE("Clipping: a contribution at the reference is unchanged, one at 10x merges as one at clip_factor x",
          "[syncer][admission]") {
  // Learner 1 warms the reference up with contributions of norm R; then learner
  // 2 sends once. Syncers on a fresh state each time, identical but for what
  // learner 2 sends.
  auto global_after = [](float k2, double clip, auto rule_tag) {
    using S = Syncer<decltype(rule_tag), PlainSGD>;
    Driver d;
    SyncerConfig c = base_config(1);
    c.clip_factor = clip;
    c.norm_warmup = 4;
    S s(d.plan, d.init, d.clock, c, decltype(rule_tag)(), PlainSGD(1.0f));
    d.join(s, 1);
    d.join(s, 2);
    const auto base = gaussian(d.numel(0), 11);
    for (int i = 0; i < 4; ++i) s.handle(d.contribution(1, 0, base, s.fragment(0).second), d.out);
    const auto before = s.global_parameters();
    const auto other = gaussian(d.numel(0), 12);
    const auto k = k2 * static_cast<float>(norm(base) / norm(other));  // norm k2 x R
    s.handle(d.contribution(2, 0, scaled(other, k), s.fragment(0).second), d.out);
    REQUIRE(s.status().contributions_accepted == 5);
    return std::make_tuple(before, s.global_parameters(), s.status().contributions_clipped);
  };
  for (int rule = 0; rule < 3; ++rule) {
    auto run = [&](float k2, double clip) {
      if (rule == 0) return global_after(k2, clip, fast::RadialDirectional{});
      if (rule == 1) return global_after(k2, clip, RadialDirectional{});  // no add_batch: the scaled-copy path
      return global_after(k2, clip, WeightedAverage{});
    };
    INFO("rule " << rule);
    // At the reference: the same with clipping on and off.
    const auto [b0, at_ref_on, n0] = run(1.0f, 4.0);
    const auto [b1, at_ref_off, n1] = run(1.0f, 0.0);
    CHECK(n0 == 0);
    CHECK(at_ref_on == at_ref_off);
    // 10x with clip 4 against 4x unclipped: the same merge up to fp32 rounding.
    const auto [b2, ten_clipped, n2] = run(10.0f, 4.0);
    const auto [b3, four, n3] = run(4.0f, 0.0);
    CHECK(n2 == 1);
    CHECK(n3 == 0);
    REQUIRE(b2 == b3);
    std::vector<float> step_ten(b2.size()), step_four(b3.size());
    for (std::size_t i = 0; i < b2.size(); ++i) {
      step_ten[i] = b2[i] - ten_clipped[i];
      step_four[i] = b3[i] - four[i];
    }
    CHECK(distance(step_ten, step_four) <= 1e-5 * norm(step_four));
    // And it differs from the unclipped 10x.
    const auto [b4, ten, n4] = run(10.0f, 0.0);
    CHECK(distance(ten, four) > 0.1 * norm(step_four));
  }
}

TEST_CASE("detail::RobustReference: a learner with a short history votes no lower than the full learners, and "
          "a liar whose history alone is full cannot lift the reference",
          "[syncer][admission]") {
  SECTION("a newcomer's first value, a dip, leaves the reference at the full learner's") {
    detail::RobustReference r(16, 4);
    for (double v : {1.0, 3.0, 2.0, 2.5}) r.put(1, v);
    REQUIRE(r.median() == 3.0);
    r.put(2, 1e-4);
    CHECK(r.median() == 3.0);
    for (double v : {2.0, 1.5, 2.2}) r.put(2, v);  // learner 2's history is full now: its maximum votes
    CHECK(r.median() == 2.2);
  }
  SECTION("a liar that filled its history first, lifting its values 4x a time, cannot lift the newcomers' votes to its own") {
    detail::RobustReference r(16, 4);
    r.put(1, 1.0);
    r.put(2, 1.2);
    double lie = 1.0;
    for (int i = 0; i < 12; ++i) r.put(9, lie *= 4.0);
    r.put(1, 0.9);
    r.put(2, 1.1);
    CHECK(*r.median() <= 1.2);
  }
  SECTION("with every history short, a learner's dip votes no lower than the other learners' maxima") {
    // The first rounds of a run: nobody holds 8 values yet.
    detail::RobustReference r(16, 8);
    r.put(1, 2.0);
    r.put(2, 1e-4);
    CHECK(r.median() == 2.0);
    r.put(1, 1.5);
    r.put(2, 1.0);  // learner 2's own maximum now, under the floor of learner 1's 2.0
    CHECK(r.median() == 2.0);
    r.put(3, 3.0);  // three learners: the lower median of 2.0 (learner 1), 2.0 (learner 2 lifted), 3.0
    CHECK(r.median() == 2.0);
  }
  SECTION("with every history short, one liar among three cannot lift an honest learner's vote past the honest") {
    detail::RobustReference r(16, 8);
    r.put(9, 1e6);  // the liar speaks first
    r.put(1, 1.0);
    r.put(2, 1.2);
    CHECK(*r.median() <= 1.2);
    r.put(9, 1e7);
    r.put(3, 1e-4);  // a third honest learner's first value, a dip: lifted to the honest maxima, not to the liar's
    CHECK(r.median() == 1.2);
  }
  SECTION("clear forgets the reference") {
    detail::RobustReference r(16, 2);
    r.put(1, 2.0);
    r.clear();
    CHECK_FALSE(r.median().has_value());
  }
}

TEST_CASE("A learner whose first norm is a dip near zero does not pull the reference down, so nobody is clipped "
          "or rejected after it",
          "[syncer][admission]") {
  // Learner 1 sends norms near R; learner 2's first accepted contribution has
  // norm 1e-4 R (an outer gradient passing through zero). With two learners
  // the reference is the smaller recent maximum: counting learner 2's one
  // value made it 1e-4 R, so learner 1's next ordinary contribution was
  // clipped to 4e-4 R and learner 2's next one rejected as norm_outlier.
  Driver d;
  SyncerConfig c = base_config(1);
  // Learner 1's contributions before the dip, and after it before learner 2 sends again.
  std::size_t before = 0, after = 0;
  SECTION("next to a learner whose history is full (tests/python/test_group.py, 1 run in 10)") {
    before = c.reference_history;
  }
  SECTION("in the first rounds of a run, before anyone's history is full (tests/python/test_shards.py, "
          "1 run in 100 under load)") {
    before = 1;
    after = c.norm_warmup - 2;  // the reference is in force from learner 2's next contribution
  }
  Syncer<fast::RadialDirectional, PlainSGD> s(d.plan, d.init, d.clock, c, fast::RadialDirectional{}, PlainSGD(1.0f));
  d.join(s, 1);
  d.join(s, 2);
  const auto base = gaussian(d.numel(0), 21);
  std::uint32_t seed = 100;
  for (std::size_t r = 0; r < before; ++r)
    s.handle(d.contribution(1, 0, gaussian(d.numel(0), seed++), s.fragment(0).second), d.out);
  s.handle(d.contribution(2, 0, scaled(base, 1e-4f), s.fragment(0).second), d.out);
  for (std::size_t r = 0; r < after; ++r)
    s.handle(d.contribution(1, 0, gaussian(d.numel(0), seed++), s.fragment(0).second), d.out);
  REQUIRE(s.status().contributions_accepted == before + 1 + after);
  for (std::uint32_t r = 0; r < 4; ++r) {
    s.handle(d.contribution(1, 0, gaussian(d.numel(0), 200 + r), s.fragment(0).second), d.out);
    s.handle(d.contribution(2, 0, gaussian(d.numel(0), 300 + r), s.fragment(0).second), d.out);
  }
  CHECK(s.status().contributions_accepted == before + 1 + after + 8);
  CHECK(s.status().contributions_clipped == 0);
  CHECK(s.status().rejected_total() == 0);
}

TEST_CASE("fast::RadialDirectional add_batch with a scale equals the reference rule fed the scaled vector",
          "[syncer][admission]") {
  const std::vector<TensorSegment> layout{{0, 40, false}, {40, 24, true}, {64, 33, false}};
  fast::RadialDirectional fr;
  RadialDirectional rr;
  auto fa = fr.make_accumulator(layout);
  auto ra = rr.make_accumulator(layout);
  const auto a = gaussian(97, 1), b = gaussian(97, 2, 3.0f);
  std::vector<fast::Contribution> batch(2);
  batch[0].values = a;
  batch[0].weight = 2.0;
  batch[1].values = b;
  batch[1].weight = 1.0;
  batch[1].scale = 0.125;
  fa.add_batch(batch);
  ra.add(a, 2.0);
  ra.add(scaled(b, 0.125f), 1.0);
  std::vector<float> fo(97), ro(97);
  fa.finish(fo);
  ra.finish(ro);
  CHECK(distance(fo, ro) <= 1e-5 * norm(ro));
  batch[1].scale = 0.0;
  CHECK_THROWS_WITH(fa.add_batch(batch), Catch::Contains("scale"));
}

TEST_CASE("A weight beyond weight_cap_factor x the reference is capped: it merges as one at the cap",
          "[syncer][admission]") {
  // Honest weight: tokens^2 / steps = (8 x 16)^2 / 8 = 2048. Learner 2 declares
  // 128 tokens per step; claiming 1024 tokens gives 131072 = 64x, capped at 16x
  // = 32768, which 512 tokens give exactly.
  auto global_after = [](std::int64_t tokens) {
    Driver d;
    SyncerConfig c = base_config(2);
    Syncer<> s(d.plan, d.init, d.clock, c);
    d.join(s, 1);
    d.join(s, 2, 128);
    d.join(s, 3);
    for (std::uint32_t i = 0; i < 2; ++i) {  // warm-up: 4 accepted, weights 2048
      for (LearnerId id : {1u, 3u})
        s.handle(d.contribution(id, 0, gaussian(d.numel(0), id * 10u + i), s.fragment(0).second), d.out);
    }
    Message big = d.contribution(2, 0, gaussian(d.numel(0), 99), s.fragment(0).second);
    big.tokens = tokens;
    s.handle(big, d.out);
    s.handle(d.contribution(1, 0, gaussian(d.numel(0), 98), s.fragment(0).second), d.out);
    const auto st = s.status();
    REQUIRE(st.contributions_accepted == 6);
    return std::make_pair(s.global_parameters(), st.weights_capped);
  };
  const auto [capped, n_capped] = global_after(1024);
  const auto [at_cap, n_at_cap] = global_after(512);
  const auto [below, n_below] = global_after(256);
  CHECK(n_capped == 1);
  CHECK(n_at_cap == 0);
  CHECK(n_below == 0);
  CHECK(capped == at_cap);
  CHECK(below != at_cap);
}

TEST_CASE("SyncerConfig rejects bad admission bounds, naming the field", "[syncer][admission]") {
  Driver d;
  auto make = [&](auto edit) {
    SyncerConfig c = base_config(1);
    edit(c);
    Syncer<> s(d.plan, d.init, d.clock, c);
  };
  CHECK_THROWS_WITH(make([](SyncerConfig& c) { c.clip_factor = 0.5; }), Catch::Contains("clip_factor = 0.5"));
  CHECK_THROWS_WITH(make([](SyncerConfig& c) { c.weight_cap_factor = -1; }), Catch::Contains("weight_cap_factor"));
  CHECK_THROWS_WITH(make([](SyncerConfig& c) { c.reference_window = 0; }), Catch::Contains("reference_window = 0"));
  CHECK_THROWS_WITH(make([](SyncerConfig& c) { c.reference_history = 0; }), Catch::Contains("reference_history = 0"));
  CHECK_THROWS_WITH(make([](SyncerConfig& c) { c.max_tokens_per_step = std::uint64_t{1} << 50; }),
                    Catch::Contains("max_tokens_per_step"));
  CHECK_NOTHROW(make([](SyncerConfig& c) { c.clip_factor = 0; c.weight_cap_factor = 0; }));
}

TEST_CASE("OuterLoop declares its tokens per step at join and refuses a step above it", "[syncer][admission]") {
  VirtualClock clock;
  const Plan plan = make_plan({{"w", 4, false}, {"b", 2, false}}, 2);
  InProcessNetwork net(clock);
  InProcessSyncerTransport link(net.syncer());
  Syncer<> syncer(plan, std::vector<float>(6, 0.0f), clock, base_config(1));
  auto lt = net.learner(1);
  OuterLoopConfig oc;
  oc.round = RoundMode::push;
  oc.id = 1;
  oc.sync_every = kH;
  oc.overlap = kTau;
  oc.tokens_per_step = 16;
  OuterLoop<InProcessLearnerTransport, std::vector<float>> outer(plan, lt, oc);
  std::vector<std::vector<float>> params{std::vector<float>(4, 0.0f), std::vector<float>(2, 0.0f)};
  outer.begin_join(params);
  Outbox out;
  std::optional<Message> join;
  for (int i = 0; i < 16 && !outer.poll_join(params); ++i) {
    while (auto m = link.try_receive()) {
      if (m->type == MessageType::join) join = *m;
      syncer.handle(*m, out);
      for (auto& o : out) link.send_to(o.to, std::move(o.message));
      out.clear();
    }
    clock.advance(1ms);
  }
  REQUIRE(outer.joined());
  REQUIRE(join);
  CHECK(join->version == 16);
  CHECK_NOTHROW(outer.step(params, 16));
  CHECK_THROWS_WITH(outer.step(params, 17), Catch::Contains("tokens = 17") && Catch::Contains("tokens_per_step"));
  OuterLoopConfig bad = oc;
  bad.tokens_per_step = std::uint64_t{1} << 41;
  CHECK_THROWS_WITH((OuterLoop<InProcessLearnerTransport, std::vector<float>>(plan, lt, bad)),
                    Catch::Contains("tokens_per_step"));
}
