// Tests for ddiloco/histogram.hpp: bucket placement (Prometheus' le), sums and
// counts, adding histograms, and bad bounds.
#include <ddiloco/histogram.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

using namespace ddiloco;

TEST_CASE("A value lands in the first bucket whose upper bound is at least the value", "[histogram]") {
  Histogram h({1, 2, 5});
  for (double x : {0.5, 1.0, 1.5, 2.0, 4.9, 5.0, 5.1, 100.0}) h.observe(x);
  CHECK(h.counts() == std::vector<std::uint64_t>{2, 2, 2, 2});  // <=1, <=2, <=5, +Inf
  CHECK(h.count() == 8);
  CHECK(h.sum() == Approx(0.5 + 1 + 1.5 + 2 + 4.9 + 5 + 5.1 + 100));
  CHECK(h.cumulative(0) == 2);
  CHECK(h.cumulative(2) == 6);
  CHECK(h.cumulative(3) == 8);
}

TEST_CASE("NaN is not counted; infinities go to the first and the last bucket", "[histogram]") {
  Histogram h({0, 1});
  h.observe(std::nan(""));
  CHECK(h.count() == 0);
  h.observe(-std::numeric_limits<double>::infinity());
  h.observe(std::numeric_limits<double>::infinity());
  CHECK(h.counts() == std::vector<std::uint64_t>{1, 0, 1});
}

TEST_CASE("Histograms with the same bounds add up; different bounds are an error naming the fix", "[histogram]") {
  Histogram a({1, 2}), b({1, 2}), total;
  a.observe(0.5);
  b.observe(1.5);
  b.observe(3);
  total += a;  // a default histogram takes the first one's bounds
  total += b;
  CHECK(total.bounds() == a.bounds());
  CHECK(total.counts() == std::vector<std::uint64_t>{1, 1, 1});
  CHECK(total.count() == 3);
  CHECK(total.sum() == Approx(5.0));
  Histogram c({1, 3});
  c.observe(1);
  CHECK_THROWS_WITH(total += c, Catch::Contains("same bounds"));
  total += Histogram({7});  // an empty histogram adds nothing, whatever its bounds
  CHECK(total.count() == 3);
}

TEST_CASE("Bounds must be finite and strictly increasing", "[histogram]") {
  CHECK_THROWS_AS(Histogram({1, 1}), InvalidArgument);
  CHECK_THROWS_WITH(Histogram({2, 1}), Catch::Contains("bound 1 = 1") && Catch::Contains("strictly increasing"));
  CHECK_THROWS_AS(Histogram({1, std::numeric_limits<double>::infinity()}), InvalidArgument);
  CHECK_NOTHROW(Histogram(std::vector<double>{}));
}
