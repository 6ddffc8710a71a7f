// Tests for <ddiloco/schedule.hpp>: the streaming schedule
// (docs/algorithm.md, "Schedule").
// Expected offsets and steps are worked out by hand in the comments next to them.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <ddiloco/schedule.hpp>

using ddiloco::Schedule;

TEST_CASE("The schedule keeps the P, H and tau it was built with", "[schedule]") {
  const Schedule s(4, 100, 3);
  CHECK(s.num_fragments() == 4);
  CHECK(s.sync_every() == 100);
  CHECK(s.overlap() == 3);
}

TEST_CASE("With the paper defaults P = H = 24, tau = 2 exactly one fragment is due at every step",
          "[schedule]") {
  const Schedule s(24, 24, 2);
  // offset(p) = floor(p * 24 / 24) = p, so step t sends fragment t mod 24.
  for (std::size_t p = 0; p < 24; ++p) CHECK(s.offset(p) == p);
  for (std::uint64_t t = 1; t <= 24 * 50; ++t) {
    const auto due = s.due_at(t);
    REQUIRE(due.has_value());
    CHECK(*due == t % 24);
  }
  CHECK(s.apply_step(24) == 26);
}

TEST_CASE("With P = 4 and H = 100 the offsets are 0, 25, 50 and 75", "[schedule]") {
  const Schedule s(4, 100, 2);
  CHECK(s.offset(0) == 0);
  CHECK(s.offset(1) == 25);
  CHECK(s.offset(2) == 50);
  CHECK(s.offset(3) == 75);
  CHECK(s.due_at(25) == std::optional<std::size_t>(1));
  CHECK(s.due_at(150) == std::optional<std::size_t>(2));
  CHECK(s.due_at(275) == std::optional<std::size_t>(3));
  CHECK(s.due_at(100) == std::optional<std::size_t>(0));
  CHECK_FALSE(s.due_at(26).has_value());
  CHECK_FALSE(s.due_at(99).has_value());
}

TEST_CASE("Offsets are floor(p * H / P) when P does not divide H", "[schedule]") {
  // P = 3, H = 10: 0, floor(10/3) = 3, floor(20/3) = 6.
  const Schedule a(3, 10, 1);
  CHECK(a.offset(0) == 0);
  CHECK(a.offset(1) == 3);
  CHECK(a.offset(2) == 6);
  // P = 7, H = 10: floor(10p/7) for p = 0..6 = 0, 1, 2, 4, 5, 7, 8.
  const Schedule b(7, 10, 1);
  const std::vector<std::size_t> expected{0, 1, 2, 4, 5, 7, 8};
  for (std::size_t p = 0; p < 7; ++p) CHECK(b.offset(p) == expected[p]);
}

TEST_CASE("Step 0 is never a send slot and fragment 0 first sends at step H", "[schedule]") {
  const Schedule s(4, 100, 2);
  CHECK_FALSE(s.due_at(0).has_value());
  CHECK(s.next_send(0, 0) == 100);
  // With P = H every other step 1..H-1 is taken, and still step 0 sends nothing.
  const Schedule full(24, 24, 2);
  CHECK_FALSE(full.due_at(0).has_value());
  CHECK(full.due_at(24) == std::optional<std::size_t>(0));
}

TEST_CASE("Every fragment is due exactly once in every period of H steps over many rounds",
          "[schedule]") {
  struct Case {
    std::size_t p, h;
  };
  for (const Case c : {Case{1, 1}, Case{1, 7}, Case{3, 10}, Case{4, 100}, Case{7, 10}, Case{24, 24},
                       Case{24, 500}, Case{13, 14}}) {
    CAPTURE(c.p, c.h);
    const Schedule s(c.p, c.h, 0);
    const std::uint64_t rounds = 40;
    // Periods [k*H + 1, (k+1)*H] for k = 0 .. rounds-1.
    for (std::uint64_t k = 0; k < rounds; ++k) {
      std::vector<int> sends(c.p, 0);
      std::size_t idle = 0;
      for (std::uint64_t t = k * c.h + 1; t <= (k + 1) * c.h; ++t) {
        if (const auto due = s.due_at(t)) {
          REQUIRE(*due < c.p);
          ++sends[*due];
        } else {
          ++idle;
        }
      }
      for (std::size_t p = 0; p < c.p; ++p) REQUIRE(sends[p] == 1);
      REQUIRE(idle == c.h - c.p);
    }
  }
}

TEST_CASE("A fragment's sends are exactly H steps apart", "[schedule]") {
  const Schedule s(5, 17, 4);
  for (std::size_t p = 0; p < 5; ++p) {
    std::uint64_t previous = 0;
    for (std::uint64_t t = 1; t <= 17 * 30; ++t) {
      if (s.due_at(t) != std::optional<std::size_t>(p)) continue;
      if (previous != 0) CHECK(t - previous == 17);
      previous = t;
    }
  }
}

TEST_CASE("A result is applied tau steps after its send, before the fragment's next send",
          "[schedule]") {
  const Schedule s(4, 100, 3);
  CHECK(s.apply_step(25) == 28);
  CHECK(s.apply_step(0) == 3);
  const Schedule no_overlap(4, 100, 0);
  CHECK(no_overlap.apply_step(25) == 25);
  // The largest allowed tau = H - 1 still applies before the next send.
  const Schedule longest(4, 100, 99);
  const std::uint64_t send = longest.next_send(1, 0);  // 25
  CHECK(send == 25);
  CHECK(longest.apply_step(send) == 124);
  CHECK(longest.apply_step(send) < longest.next_send(1, send));  // 124 < 125
}

TEST_CASE("next_send gives the first send step strictly after the given step", "[schedule]") {
  const Schedule s(4, 100, 2);  // offsets 0, 25, 50, 75
  CHECK(s.next_send(1, 0) == 25);
  CHECK(s.next_send(1, 24) == 25);
  CHECK(s.next_send(1, 25) == 125);  // strictly after: 25 itself is excluded
  CHECK(s.next_send(1, 26) == 125);
  CHECK(s.next_send(3, 1000) == 1075);
  CHECK(s.next_send(0, 0) == 100);
  CHECK(s.next_send(0, 99) == 100);
  CHECK(s.next_send(0, 100) == 200);
  CHECK(s.next_send(2, 1'000'000'000'000ULL) == 1'000'000'000'050ULL);
}

TEST_CASE("next_send agrees with scanning due_at step by step", "[schedule]") {
  const Schedule s(7, 10, 1);
  for (std::size_t p = 0; p < 7; ++p) {
    for (std::uint64_t after = 0; after < 60; ++after) {
      std::uint64_t t = after + 1;
      while (s.due_at(t) != std::optional<std::size_t>(p)) ++t;
      CHECK(s.next_send(p, after) == t);
    }
  }
}

TEST_CASE("Steps far beyond one period wrap around the slot table", "[schedule]") {
  const Schedule s(4, 100, 2);
  const std::uint64_t big = 12'345'678'900ULL;  // a multiple of 100: fragment 0's slot
  CHECK(s.due_at(big) == std::optional<std::size_t>(0));
  CHECK(s.due_at(big + 75) == std::optional<std::size_t>(3));
  CHECK_FALSE(s.due_at(big + 1).has_value());
}

TEST_CASE("Invalid combinations of P, H and tau throw InvalidArgument naming the value",
          "[schedule]") {
  using ddiloco::InvalidArgument;
  CHECK_THROWS_AS(Schedule(0, 24, 2), InvalidArgument);
  CHECK_THROWS_WITH(Schedule(0, 24, 2), Catch::Contains("P = 0"));

  CHECK_THROWS_AS(Schedule(1, 0, 0), InvalidArgument);
  CHECK_THROWS_WITH(Schedule(1, 0, 0), Catch::Contains("H = 0"));

  CHECK_THROWS_AS(Schedule(25, 24, 2), InvalidArgument);
  CHECK_THROWS_WITH(Schedule(25, 24, 2),
                    Catch::Contains("P = 25") && Catch::Contains("H = 24") &&
                        Catch::Contains("share a send slot"));

  CHECK_THROWS_AS(Schedule(24, 24, 24), InvalidArgument);
  CHECK_THROWS_WITH(Schedule(24, 24, 24), Catch::Contains("tau = 24") && Catch::Contains("H = 24"));
  CHECK_THROWS_AS(Schedule(4, 10, 30), InvalidArgument);
  CHECK_THROWS_WITH(Schedule(4, 10, 30), Catch::Contains("tau = 30"));

  // The boundaries themselves are valid.
  CHECK_NOTHROW(Schedule(24, 24, 23));
  CHECK_NOTHROW(Schedule(1, 1, 0));
}

TEST_CASE("Asking about a fragment that does not exist throws InvalidArgument", "[schedule]") {
  const Schedule s(4, 100, 2);
  CHECK_THROWS_AS(s.offset(4), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(s.offset(4), Catch::Contains("fragment 4"));
  CHECK_THROWS_AS(s.next_send(9, 0), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(s.next_send(9, 0), Catch::Contains("fragment 9"));
}

TEST_CASE("due_at matches t mod H == offset(p) computed by plain division, across 2^32",
          "[schedule]") {
  // due_at takes step mod H by multiplication while step < 2^32 and by division
  // above; both must agree with the definition. The reference here is the `%`
  // operator applied to the offsets, fragment by fragment.
  const std::uint64_t two32 = std::uint64_t{1} << 32;
  for (const std::size_t h : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{7},
                              std::size_t{24}, std::size_t{100}, std::size_t{997},
                              std::size_t{65'537}, std::size_t{4'000'037}}) {
    const std::size_t p_count = h < 5 ? h : 5;
    const Schedule s(p_count, h, 0);
    const auto expected = [&](std::uint64_t t) -> std::optional<std::size_t> {
      if (t == 0) return std::nullopt;
      for (std::size_t p = 0; p < p_count; ++p) {
        if (t % h == s.offset(p)) return p;
      }
      return std::nullopt;
    };
    CAPTURE(h);
    for (std::uint64_t t = 0; t < 3000; ++t) REQUIRE(s.due_at(t) == expected(t));
    for (std::uint64_t t = two32 - 3000; t < two32 + 3000; ++t) REQUIRE(s.due_at(t) == expected(t));
    // Every offset of every fragment, and the step just before and after it, near 2^32 - 1.
    for (std::size_t p = 0; p < p_count; ++p) {
      const std::uint64_t t = s.next_send(p, two32 - 2 * h);
      for (const std::uint64_t u : {t - 1, t, t + 1}) REQUIRE(s.due_at(u) == expected(u));
    }
  }
}
