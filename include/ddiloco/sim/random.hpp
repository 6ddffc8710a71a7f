// ddiloco/sim/random.hpp: portable random variates for the simulators.
//
// What it is: a seeded generator (std::mt19937_64, whose output sequence the
// C++ standard fixes) and inverse-CDF samplers written here, so a seed gives the
// same run with every standard library (std::*_distribution may differ between
// libraries). Includes the exponentiated Weibull distribution the Decoupled
// DiLoCo paper uses for recovery delays.
// What it is not: a statistics library; only what the simulators draw.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

#include <ddiloco/error.hpp>

namespace ddiloco::sim {

/// A seeded stream of uniform and derived variates. Same seed, same sequence.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : engine_(seed) {}

  /// Uniform in [0, 1) with 53 random bits.
  [[nodiscard]] double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }
  /// Uniform in (0, 1]: safe to take the logarithm of.
  [[nodiscard]] double uniform_pos() { return 1.0 - uniform(); }
  /// Exponential with the given rate (mean 1 / rate): -ln(U) / rate.
  [[nodiscard]] double exponential(double rate) { return -std::log(uniform_pos()) / rate; }
  /// Standard normal by Box-Muller (one of the pair; simple and portable).
  [[nodiscard]] double normal() {
    const double u1 = uniform_pos();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * 3.14159265358979323846 * u2);
  }
  /// Uniform integer in [0, n), n >= 1 (multiply-shift; bias below 2^-11 for n < 2^53).
  [[nodiscard]] std::uint64_t below(std::uint64_t n) {
    return static_cast<std::uint64_t>(uniform() * static_cast<double>(n)) % n;
  }

 private:
  std::mt19937_64 engine_;
};

/// Exponentiated Weibull distribution (Mudholkar and Srivastava, 1993):
///     F(x) = (1 - exp(-(x / scale)^shape))^exponent,   x >= 0
/// exponent = 1 is the Weibull distribution, shape = 1 and exponent = 1 the
/// exponential. Sampling inverts F: x = scale * (-ln(1 - U^(1/exponent)))^(1/shape).
struct ExpWeibull {
  double scale = 1.0;     ///< sigma > 0, in the caller's time unit
  double shape = 1.0;     ///< k > 0: < 1 gives a heavy tail of long recoveries
  double exponent = 1.0;  ///< alpha > 0: > 1 moves mass away from very short delays

  void validate() const {
    if (!(scale > 0.0) || !(shape > 0.0) || !(exponent > 0.0) || !std::isfinite(scale) || !std::isfinite(shape) ||
        !std::isfinite(exponent)) {
      throw InvalidArgument(ddiloco::detail::msg("ExpWeibull(scale = ", scale, ", shape = ", shape, ", exponent = ", exponent,
                                        "): every parameter must be finite and > 0"));
    }
  }

  [[nodiscard]] double cdf(double x) const {
    if (x <= 0.0) return 0.0;
    return std::pow(-std::expm1(-std::pow(x / scale, shape)), exponent);
  }

  [[nodiscard]] double sample(Rng& rng) const {
    const double u = rng.uniform();  // [0, 1): u^(1/a) < 1, so the log is finite
    return scale * std::pow(-std::log1p(-std::pow(u, 1.0 / exponent)), 1.0 / shape);
  }

  /// E[X] = integral of (1 - F(x)) dx, by the trapezoid rule on a geometric
  /// grid (relative error below 1e-6 for shape in [0.3, 5], exponent in [0.2, 10]).
  [[nodiscard]] double mean() const {
    // Substitute x = scale * e^s: E[X] = scale * integral of (1 - F) e^s ds.
    const double lo = -30.0;
    const double hi = std::log(60.0) / std::min(1.0, shape) + 4.0;
    const int n = 20000;
    const double h = (hi - lo) / n;
    double sum = 0.0;
    for (int i = 0; i <= n; ++i) {
      const double s = lo + h * i;
      const double x = std::exp(s);
      const double tail = 1.0 - std::pow(-std::expm1(-std::pow(x, shape)), exponent);
      const double f = tail * x;
      sum += (i == 0 || i == n) ? 0.5 * f : f;
    }
    return scale * (sum * h + std::exp(lo));  // + integral over (0, e^lo) where 1 - F ~ 1
  }

  /// The same shape and exponent, rescaled so that the mean is `m`.
  [[nodiscard]] ExpWeibull with_mean(double m) const {
    ExpWeibull unit{1.0, shape, exponent};
    return ExpWeibull{m / unit.mean(), shape, exponent};
  }
};

}  // namespace ddiloco::sim
