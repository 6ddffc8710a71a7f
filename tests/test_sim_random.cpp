// Tests for ddiloco/sim/random.hpp: portable variates and the exponentiated Weibull.
#include <ddiloco/sim/random.hpp>

#include <catch2/catch.hpp>

#include <cmath>

using ddiloco::sim::ExpWeibull;
using ddiloco::sim::Rng;

TEST_CASE("The generator is a pure function of its seed", "[sim][random]") {
  Rng a(7), b(7), c(8);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    const double x = a.uniform();
    CHECK(x == b.uniform());
    CHECK(x >= 0.0);
    CHECK(x < 1.0);
    differs = differs || x != c.uniform();
  }
  CHECK(differs);
}

TEST_CASE("Exponential and normal variates have the right moments", "[sim][random]") {
  Rng r(1);
  const int n = 200000;
  double se = 0, sn = 0, sn2 = 0;
  for (int i = 0; i < n; ++i) {
    se += r.exponential(4.0);
    const double z = r.normal();
    sn += z;
    sn2 += z * z;
  }
  CHECK(se / n == Approx(0.25).epsilon(0.01));  // mean 1 / rate; standard error 0.2%
  CHECK(sn / n == Approx(0.0).margin(0.01));
  CHECK(sn2 / n == Approx(1.0).epsilon(0.01));
}

TEST_CASE("The exponentiated Weibull follows its definition", "[sim][random]") {
  // F(x) = (1 - exp(-(x/scale)^shape))^exponent; by hand F(1) for shape 2,
  // exponent 2, scale 1 is (1 - e^-1)^2 = 0.399576...
  const ExpWeibull d{1.0, 2.0, 2.0};
  CHECK(d.cdf(1.0) == Approx(std::pow(1.0 - std::exp(-1.0), 2.0)).epsilon(1e-12));
  CHECK(d.cdf(0.0) == 0.0);
  // shape = exponent = 1 is the exponential: mean = scale.
  CHECK(ExpWeibull{3.0, 1.0, 1.0}.mean() == Approx(3.0).epsilon(1e-6));
  // exponent = 1 is Weibull: mean = scale * Gamma(1 + 1/shape).
  CHECK(ExpWeibull{2.0, 0.5, 1.0}.mean() == Approx(2.0 * std::tgamma(3.0)).epsilon(1e-5));
  // exponent = 2, shape = 1: max of two exponentials, mean 1.5 * scale.
  CHECK(ExpWeibull{1.0, 1.0, 2.0}.mean() == Approx(1.5).epsilon(1e-6));
  // with_mean keeps the shape and sets the mean.
  const ExpWeibull m = ExpWeibull{1.0, 0.8, 1.5}.with_mean(7200.0);
  CHECK(m.mean() == Approx(7200.0).epsilon(1e-6));
  CHECK(m.shape == 0.8);
  // Samples: empirical mean and CDF at one point.
  Rng r(3);
  const int n = 200000;
  double s = 0;
  int below = 0;
  for (int i = 0; i < n; ++i) {
    const double x = d.sample(r);
    s += x;
    below += x <= 1.0 ? 1 : 0;
  }
  CHECK(s / n == Approx(d.mean()).epsilon(0.01));
  CHECK(static_cast<double>(below) / n == Approx(d.cdf(1.0)).margin(0.005));
}

TEST_CASE("Invalid exponentiated Weibull parameters are rejected", "[sim][random]") {
  CHECK_THROWS_AS((ExpWeibull{0.0, 1.0, 1.0}.validate()), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH((ExpWeibull{1.0, -1.0, 1.0}.validate()), Catch::Matchers::Contains("shape = -1"));
  CHECK_NOTHROW((ExpWeibull{1.0, 1.0, 1.0}.validate()));
}
