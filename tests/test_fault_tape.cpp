// Tests for ddiloco/fault_tape.hpp: the text form, validation, deterministic
// message fates (rates checked against the binomial law) and learner faults.
#include <ddiloco/fault_tape.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using ddiloco::Downtime;
using ddiloco::DropReason;
using ddiloco::Duration;
using ddiloco::Endpoint;
using ddiloco::FaultTape;
using ddiloco::Kill;
using ddiloco::LearnerEvent;
using ddiloco::Message;
using ddiloco::MessageFaults;
using ddiloco::MessageType;
using ddiloco::Partition;
using ddiloco::Scavenge;
using ddiloco::Slowdown;
using ddiloco::TimePoint;

namespace {
constexpr const char* example_tape =
    "seed 42\n"
    "drop 0.05\n"
    "duplicate 0.02\n"
    "reorder 0.05 20ms\n"
    "latency 2ms jitter 1ms\n"
    "partition 2 from 1.5s to 3s\n"
    "kill 1 at-step 300 down 200\n"
    "slow 3 x3 from-step 0\n"
    "join 5 at-step 100 leave-at-step 400\n";

Message contribution(std::uint64_t sequence, std::uint32_t fragment = 0, ddiloco::LearnerId learner = 1) {
  Message m;
  m.type = MessageType::contribution;
  m.learner = learner;
  m.fragment = fragment;
  m.sequence = sequence;
  m.version = sequence / 3;
  return m;
}

/// The message is thrown as a ProtocolError whose text contains every piece.
void check_parse_error(const std::string& text, const std::vector<std::string>& pieces) {
  INFO("tape:\n" << text);
  CHECK_THROWS_AS(FaultTape::parse(text), ddiloco::ProtocolError);
  try {
    (void)FaultTape::parse(text);
  } catch (const ddiloco::ProtocolError& e) {
    const std::string what = e.what();
    for (const auto& piece : pieces) {
      INFO("message: " << what);
      CHECK(what.find(piece) != std::string::npos);
    }
  }
}
}  // namespace

TEST_CASE("The example tape parses into the values written on each line", "[fault_tape]") {
  const auto tape = FaultTape::parse(example_tape);
  CHECK(tape.seed() == 42);
  const auto& f = tape.message_faults();
  CHECK(f.drop == 0.05);
  CHECK(f.duplicate == 0.02);
  CHECK(f.reorder == 0.05);
  CHECK(f.reorder_max == 20'000'000ns);
  CHECK(f.latency == 2'000'000ns);
  CHECK(f.jitter == 1'000'000ns);
  REQUIRE(tape.partitions().size() == 1);
  CHECK(tape.partitions()[0] == Partition{2, 1'500'000'000ns, 3'000'000'000ns});
  REQUIRE(tape.kills().size() == 1);
  CHECK(tape.kills()[0].learner == 1);
  CHECK(tape.kills()[0].at_step == 300);
  CHECK(tape.kills()[0].down.steps == std::optional<std::uint64_t>{200});
  REQUIRE(tape.slowdowns().size() == 1);
  CHECK(tape.slowdowns()[0] == Slowdown{3, 3.0, 0, std::nullopt});
  REQUIRE(tape.scavenges().size() == 1);
  CHECK(tape.scavenges()[0] == Scavenge{5, 100, 400});
}

TEST_CASE("Comments, blank lines and tabs are ignored", "[fault_tape]") {
  const auto tape = FaultTape::parse("# a comment\n\n\tseed\t7   # trailing comment\r\n   \ndrop 1\n");
  CHECK(tape.seed() == 7);
  CHECK(tape.message_faults().drop == 1.0);
  CHECK(FaultTape::parse("") == FaultTape{});
}

TEST_CASE("The example tape survives to_string and parse unchanged", "[fault_tape]") {
  const auto tape = FaultTape::parse(example_tape);
  CHECK(FaultTape::parse(tape.to_string()) == tape);
  CHECK(FaultTape::parse(tape.to_string()).to_string() == tape.to_string());
}

TEST_CASE("A tape with every kind of directive round-trips exactly", "[fault_tape]") {
  FaultTape tape(0xFFFF'FFFF'FFFF'FFFFULL);
  tape.set_message_faults(MessageFaults{.drop = 0.1 + 0.2,
                                        .duplicate = 1.0 / 3.0,
                                        .reorder = 1e-7,
                                        .reorder_max = 1'234'567ns,
                                        .latency = 1ns,
                                        .jitter = 3'000us});
  tape.add(Partition{0, 0ns, 1ns});
  tape.add(Partition{4'000'000'000U, 7s, 90'000'000'001ns});
  tape.add(Kill{2, 0, Downtime{std::nullopt, 1'500ms}});
  tape.add(Kill{2, 50, Downtime{0, 0ns}});
  tape.add(Slowdown{1, 1.25, 10, 20});
  tape.add(Slowdown{1, 7.0, 0, std::nullopt});
  tape.add(Scavenge{9, 0, 5});
  tape.add(Scavenge{9, 5, std::nullopt});
  const auto text = tape.to_string();
  INFO(text);
  const auto back = FaultTape::parse(text);
  CHECK(back == tape);
  CHECK(back.to_string() == text);
  CHECK(back.message_faults().drop == 0.1 + 0.2);  // bit-exact, not rounded
  CHECK(back.kills()[0].down == Downtime{std::nullopt, 1'500'000'000ns});
  CHECK(back.kills()[1].down == Downtime{0, 0ns});
}

TEST_CASE("Decimal durations are read exactly in nanoseconds", "[fault_tape]") {
  const auto tape = FaultTape::parse("latency 0.5ms jitter 250ns\nreorder 0 2.25s\npartition 1 from 3us to 1.000001s\n");
  CHECK(tape.message_faults().latency == 500'000ns);
  CHECK(tape.message_faults().jitter == 250ns);
  CHECK(tape.message_faults().reorder_max == 2'250'000'000ns);
  CHECK(tape.partitions()[0].from == 3'000ns);
  CHECK(tape.partitions()[0].to == 1'000'001'000ns);
}

TEST_CASE("Parse errors name the line and the offending token", "[fault_tape]") {
  check_parse_error("seed 1\ndrop 1.5\n", {"line 2", "'1.5'", "[0, 1]"});
  check_parse_error("seed 1\n\n# c\nexplode 3\n", {"line 4", "'explode'", "not a directive"});
  check_parse_error("slow 3 x0.5 from-step 0\n", {"line 1", "'x0.5'", ">= 1"});
  check_parse_error("slow 3 3 from-step 0\n", {"line 1", "'3'", "x<number>"});
  check_parse_error("latency 2\n", {"line 1", "'2'", "unit"});
  check_parse_error("latency 2ms jitter 1parsec\n", {"line 1", "'1parsec'"});
  check_parse_error("partition 2 from 3s to 1s\n", {"line 1", "'1s'", "'from' < 'to'"});
  check_parse_error("partition 2 since 1s to 3s\n", {"line 1", "'since'", "'from'"});
  check_parse_error("drop 0.1\nduplicate 0\ndrop 0.2\n", {"line 3", "'drop'", "line 1"});
  check_parse_error("join 5 at-step 100\njoin 5 at-step 200 leave-at-step 300\n", {"line 2", "'5'", "overlap"});
  check_parse_error("join 5 at-step 100 leave-at-step 100\n", {"line 1", "'100'", "leave-at-step > at-step"});
  check_parse_error("kill 1 at-step 300 down 200 now\n", {"line 1", "'now'", "unexpected"});
  check_parse_error("kill 1 at-step 300\n", {"line 1", "incomplete"});
  check_parse_error("kill -1 at-step 300 down 2\n", {"line 1", "'-1'", "integer"});
  check_parse_error("kill 4294967296 at-step 300 down 2\n", {"line 1", "'4294967296'", "learner id"});
  check_parse_error("seed 1 2\n", {"line 1", "'2'"});
  check_parse_error("drop nan\n", {"line 1", "'nan'"});
}

TEST_CASE("Building a tape in code rejects out-of-range values", "[fault_tape]") {
  FaultTape tape;
  CHECK_THROWS_AS(tape.set_message_faults(MessageFaults{.drop = -0.1}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(tape.set_message_faults(MessageFaults{.duplicate = 1.01}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(tape.set_message_faults(MessageFaults{.reorder = std::nan("")}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(tape.set_message_faults(MessageFaults{.latency = -1ns}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(tape.add(Partition{1, 2s, 2s}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(tape.add(Slowdown{1, 0.99, 0, std::nullopt}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(tape.add(Slowdown{1, INFINITY, 0, std::nullopt}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(tape.add(Slowdown{1, 2.0, 5, 5}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(tape.add(Kill{1, 5, Downtime{std::nullopt, -1s}}), ddiloco::InvalidArgument);
  tape.add(Scavenge{3, 10, 20});
  CHECK_THROWS_AS(tape.add(Scavenge{3, 19, 25}), ddiloco::InvalidArgument);
  CHECK_NOTHROW(tape.add(Scavenge{3, 20, 25}));  // back-to-back windows do not overlap
  CHECK(tape == FaultTape{}.add(Scavenge{3, 10, 20}).add(Scavenge{3, 20, 25}));  // failed adds left no trace
}

TEST_CASE("A tape without faults delivers every message once, at once", "[fault_tape]") {
  const FaultTape tape;
  for (std::uint64_t s = 0; s < 1000; ++s) {
    const auto f = tape.fate(contribution(s), Endpoint::for_learner(1), Endpoint::syncer(), TimePoint{5s}, s);
    REQUIRE(f.copies == 1);
    REQUIRE(f.copy[0].dropped == DropReason::none);
    REQUIRE(f.copy[0].delay == 0ns);
    REQUIRE(f.delivered() == 1);
  }
}

TEST_CASE("A message's fate depends only on the seed and the message, not on query order", "[fault_tape]") {
  const auto tape = FaultTape::parse("seed 9\ndrop 0.3\nduplicate 0.3\nreorder 0.5 10ms\nlatency 1ms jitter 1ms\n");
  const auto same = FaultTape::parse(tape.to_string());
  const auto from = Endpoint::for_learner(4);
  const auto to = Endpoint::syncer();
  constexpr std::size_t n = 2000;
  std::vector<ddiloco::MessageFate> forward;
  for (std::size_t i = 0; i < n; ++i) forward.push_back(tape.fate(contribution(i), from, to, TimePoint{0}, i));
  // Query a copy of the tape in reverse order, twice: every fate repeats.
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t i = n; i-- > 0;) {
      REQUIRE(same.fate(contribution(i), from, to, TimePoint{0}, i) == forward[i]);
    }
  }
  // The fates are not all alike, and another seed gives other fates.
  std::size_t dropped = 0;
  std::size_t differs = 0;
  auto other = tape;
  other.set_seed(10);
  for (std::size_t i = 0; i < n; ++i) {
    dropped += forward[i].copy[0].dropped == DropReason::fault ? 1 : 0;
    differs += other.fate(contribution(i), from, to, TimePoint{0}, i) == forward[i] ? 0 : 1;
  }
  CHECK(dropped > 0);
  CHECK(dropped < n);
  CHECK(differs > n / 2);
  // Every field of the message takes part: changing one changes some fates.
  std::size_t fragment_differs = 0;
  std::size_t direction_differs = 0;
  std::size_t ordinal_differs = 0;
  for (std::size_t i = 0; i < n; ++i) {
    fragment_differs += tape.fate(contribution(i, 1), from, to, TimePoint{0}, i) == forward[i] ? 0 : 1;
    direction_differs += tape.fate(contribution(i), to, from, TimePoint{0}, i) == forward[i] ? 0 : 1;
    ordinal_differs += tape.fate(contribution(i), from, to, TimePoint{0}, i + 1) == forward[i] ? 0 : 1;
  }
  CHECK(fragment_differs > n / 2);
  CHECK(direction_differs > n / 2);
  CHECK(ordinal_differs > n / 2);
}

TEST_CASE("Drop and duplicate rates over 10^5 messages are within 3 sigma of the tape's probabilities",
          "[fault_tape]") {
  const double p_drop = GENERATE(0.05, 0.5);
  const double p_dup = 0.02;
  FaultTape tape(1234);
  tape.set_message_faults(MessageFaults{.drop = p_drop, .duplicate = p_dup});
  constexpr std::size_t n = 100'000;
  std::size_t dropped = 0;
  std::size_t duplicated = 0;
  for (std::size_t i = 0; i < n; ++i) {
    // Synthetic traffic: 8 learners, 24 fragments, both directions.
    const auto learner = static_cast<ddiloco::LearnerId>(i % 8);
    const auto m = contribution(i / 8, static_cast<std::uint32_t>(i % 24), learner);
    const bool up = (i / 3) % 2 == 0;
    const auto from = up ? Endpoint::for_learner(learner) : Endpoint::syncer();
    const auto to = up ? Endpoint::syncer() : Endpoint::for_learner(learner);
    const auto f = tape.fate(m, from, to, TimePoint{0}, i / 8);
    if (f.copy[0].dropped == DropReason::fault) {
      ++dropped;
    } else if (f.copies == 2) {
      ++duplicated;
    }
  }
  // Binomial(n, p): mean n p, standard deviation sqrt(n p (1 - p)).
  const double nd = static_cast<double>(n);
  const double drop_sigma = std::sqrt(nd * p_drop * (1 - p_drop));
  CHECK(std::abs(static_cast<double>(dropped) - nd * p_drop) < 3 * drop_sigma);
  // Duplicates are drawn among the messages that were not dropped.
  const double kept = static_cast<double>(n - dropped);
  const double dup_sigma = std::sqrt(kept * p_dup * (1 - p_dup));
  CHECK(std::abs(static_cast<double>(duplicated) - kept * p_dup) < 3 * dup_sigma);
}

TEST_CASE("Delays stay within latency, jitter and reorder bounds, and a duplicate comes later", "[fault_tape]") {
  const auto tape = FaultTape::parse("seed 3\nduplicate 0.5\nreorder 0.25 20ms\nlatency 2ms jitter 1ms\n");
  constexpr std::size_t n = 20'000;
  std::size_t reordered = 0;
  std::size_t duplicated = 0;
  double jitter_sum_ms = 0.0;
  std::size_t jitter_count = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto f = tape.fate(contribution(i), Endpoint::syncer(), Endpoint::for_learner(1), TimePoint{0}, i);
    const auto d0 = f.copy[0].delay;
    REQUIRE(d0 >= 2ms);
    REQUIRE(d0 < 2ms + 1ms + 20ms);
    if (d0 >= 3ms) {
      ++reordered;
    } else {
      jitter_sum_ms += std::chrono::duration<double, std::milli>(d0 - 2ms).count();
      ++jitter_count;
    }
    if (f.copies == 2) {
      ++duplicated;
      REQUIRE(f.copy[1].delay >= d0 + 2ms);
      REQUIRE(f.copy[1].delay < d0 + 3ms);
    }
  }
  // Not every reordered message lands beyond 3 ms, so P(d0 >= 3ms) is a bit below 0.25;
  // uniform [0,1ms) jitter + uniform [0,20ms) extra lands beyond 3 ms with P = 1 - 1/40 (hand integral).
  const double p_late = 0.25 * (1.0 - 1.0 / 40.0);
  const double nd = static_cast<double>(n);
  CHECK(std::abs(static_cast<double>(reordered) - nd * p_late) < 3 * std::sqrt(nd * p_late * (1 - p_late)));
  CHECK(std::abs(static_cast<double>(duplicated) - nd * 0.5) < 3 * std::sqrt(nd * 0.25));
  // Unreordered jitter is uniform on [0, 1ms): mean 0.5 ms, sd 1/sqrt(12) ms. (The 0.6% of reordered
  // messages that stay below 3 ms bias the mean by about -0.0014 ms, well inside the tolerance.)
  const double mean = jitter_sum_ms / static_cast<double>(jitter_count);
  CHECK(std::abs(mean - 0.5) < 4 * (1.0 / std::sqrt(12.0)) / std::sqrt(static_cast<double>(jitter_count)));
}

TEST_CASE("A partition drops only inside its window and only for its learner", "[fault_tape]") {
  const auto tape = FaultTape::parse("partition 2 from 1s to 3s\n");
  const auto fate = [&](Endpoint from, Endpoint to, Duration now) {
    return tape.fate(contribution(0), from, to, TimePoint{now}).copy[0].dropped;
  };
  const auto l1 = Endpoint::for_learner(1);
  const auto l2 = Endpoint::for_learner(2);
  const auto s = Endpoint::syncer();
  for (const auto& [from, to] : {std::pair{l2, s}, std::pair{s, l2}}) {
    CHECK(fate(from, to, 999'999'999ns) == DropReason::none);
    CHECK(fate(from, to, 1s) == DropReason::partition);
    CHECK(fate(from, to, 2s) == DropReason::partition);
    CHECK(fate(from, to, 2'999'999'999ns) == DropReason::partition);
    CHECK(fate(from, to, 3s) == DropReason::none);
  }
  for (const auto& [from, to] : {std::pair{l1, s}, std::pair{s, l1}}) {
    CHECK(fate(from, to, 2s) == DropReason::none);
  }
  CHECK(tape.partitioned(2, TimePoint{1s}));
  CHECK_FALSE(tape.partitioned(2, TimePoint{3s}));
  CHECK_FALSE(tape.partitioned(1, TimePoint{2s}));
}

TEST_CASE("A message in flight when a partition begins is lost", "[fault_tape]") {
  const auto tape = FaultTape::parse("latency 500ms\npartition 2 from 1s to 3s\n");
  const auto fate = [&](Duration now) {
    return tape.fate(contribution(0), Endpoint::for_learner(2), Endpoint::syncer(), TimePoint{now}).copy[0];
  };
  CHECK(fate(499'999'999ns).dropped == DropReason::none);  // arrives just before 1 s
  CHECK(fate(499'999'999ns).delay == 500ms);
  CHECK(fate(500ms).dropped == DropReason::partition);  // arrives at 1 s
  CHECK(fate(3s).dropped == DropReason::none);
}

TEST_CASE("Learner events come sorted by step with their parameters", "[fault_tape]") {
  const auto tape = FaultTape::parse(
      "kill 1 at-step 300 down 200\n"
      "slow 1 x2 from-step 100 to-step 300\n"
      "kill 1 at-step 50 down 2s\n"
      "slow 1 x1.5 from-step 300\n"
      "kill 2 at-step 10 down 1\n");
  using Kind = LearnerEvent::Kind;
  const std::vector<LearnerEvent> expected{
      {Kind::kill, 50, Downtime{std::nullopt, 2s}, 1.0},
      {Kind::slow_begin, 100, Downtime{}, 2.0},
      {Kind::kill, 300, Downtime{200, 0ns}, 1.0},
      {Kind::slow_end, 300, Downtime{}, 2.0},
      {Kind::slow_begin, 300, Downtime{}, 1.5},
  };
  CHECK(tape.learner_events(1) == expected);
  CHECK(tape.learner_events(2).size() == 1);
  CHECK(tape.learner_events(7).empty());
  CHECK(tape.is_killed_at(1, 50));
  CHECK(tape.is_killed_at(1, 300));
  CHECK_FALSE(tape.is_killed_at(1, 51));
  CHECK_FALSE(tape.is_killed_at(2, 300));
  REQUIRE(tape.kill_at(2, 10).has_value());
  CHECK(tape.kill_at(2, 10)->down.steps == std::optional<std::uint64_t>{1});
}

TEST_CASE("Slowdowns apply inside their step range and overlapping ones multiply", "[fault_tape]") {
  const auto tape = FaultTape::parse("slow 3 x3 from-step 0\nslow 3 x2 from-step 10 to-step 20\nslow 4 x5 from-step 7\n");
  CHECK(tape.slowdown(3, 0) == 3.0);
  CHECK(tape.slowdown(3, 9) == 3.0);
  CHECK(tape.slowdown(3, 10) == 6.0);
  CHECK(tape.slowdown(3, 19) == 6.0);
  CHECK(tape.slowdown(3, 20) == 3.0);
  CHECK(tape.slowdown(4, 6) == 1.0);
  CHECK(tape.slowdown(4, 7) == 5.0);
  CHECK(tape.slowdown(1, 10) == 1.0);
}

TEST_CASE("Scavenged learners are members only inside their windows", "[fault_tape]") {
  const auto tape = FaultTape::parse("join 5 at-step 100 leave-at-step 400\njoin 5 at-step 600\n");
  CHECK_FALSE(tape.is_member_at(5, 0));
  CHECK_FALSE(tape.is_member_at(5, 99));
  CHECK(tape.is_member_at(5, 100));
  CHECK(tape.is_member_at(5, 399));
  CHECK_FALSE(tape.is_member_at(5, 400));
  CHECK(tape.is_member_at(5, 600));
  CHECK(tape.is_member_at(5, 1'000'000));
  CHECK(tape.is_member_at(0, 0));  // no window: always a member
  CHECK(tape.scavenges_of(5).size() == 2);
  CHECK(tape.scavenges_of(0).empty());
}
