// ddiloco/sim/calibrate.hpp: fit the goodput simulator's baseline constants to
// published goodput figures (docs/algorithm.md, "Published figures").
//
// What it is: least-squares fits, by golden-section search on the simulator
// itself with a fixed seed (common random numbers make the objective smooth):
//   * data_parallel: restart_s;
//   * elastic: reconfigure_s.
// The mean slice recovery delay is not fitted: with the spare pool
// (FailureModel::spare_fraction) the baselines do not depend on it while the
// pool covers the slices in repair, so the figures cannot identify it.
// Only baseline constants are fitted; Decoupled DiLoCo's settings are never
// touched, so its goodput is a prediction of the calibrated physical model.
// What it is not: a general optimiser; the searches assume one minimum in
// their bracket, which holds here because goodput is monotone in each constant.
#pragma once

#include <cmath>
#include <functional>
#include <span>
#include <vector>

#include <ddiloco/error.hpp>
#include <ddiloco/sim/goodput.hpp>

namespace ddiloco::sim {

struct GoodputTarget {
  double chips = 0;
  double goodput = 0;  ///< fraction in (0, 1]
};

/// The goodput table in docs/algorithm.md, "Published figures" (Decoupled DiLoCo paper):
/// one interruption per chip per year.
inline std::vector<GoodputTarget> paper_data_parallel_targets() {
  return {{150e3, 0.72}, {300e3, 0.57}, {600e3, 0.38}, {1.2e6, 0.27}, {2.4e6, 0.18}};
}
inline std::vector<GoodputTarget> paper_elastic_targets() {
  return {{150e3, 0.88}, {300e3, 0.80}, {600e3, 0.69}, {1.2e6, 0.58}, {2.4e6, 0.40}};
}

struct FitCell {
  double chips = 0;
  double target = 0;
  double model = 0;
};

struct BaselineFit {
  double restart_s = 0;
  double reconfigure_s = 0;
  std::vector<FitCell> data_parallel;
  std::vector<FitCell> elastic;
  /// Root mean square of (model - target) over each system's cells.
  double data_parallel_rmse = 0;
  double elastic_rmse = 0;
};

namespace detail {
/// Golden-section search for the minimum of f on [lo, hi].
inline double golden_min(const std::function<double(double)>& f, double lo, double hi, int iterations) {
  const double r = (std::sqrt(5.0) - 1.0) / 2.0;
  double a = lo, b = hi;
  double x1 = b - r * (b - a), x2 = a + r * (b - a);
  double f1 = f(x1), f2 = f(x2);
  for (int i = 0; i < iterations; ++i) {
    if (f1 <= f2) {
      b = x2; x2 = x1; f2 = f1;
      x1 = b - r * (b - a); f1 = f(x1);
    } else {
      a = x1; x1 = x2; f1 = f2;
      x2 = a + r * (b - a); f2 = f(x2);
    }
  }
  return f1 <= f2 ? x1 : x2;
}

inline std::vector<FitCell> evaluate(GoodputConfig c, std::span<const GoodputTarget> targets) {
  std::vector<FitCell> out;
  for (const auto& t : targets) {
    c.chips = t.chips;
    out.push_back({t.chips, t.goodput, simulate_goodput(c).goodput});
  }
  return out;
}

inline double sse(const std::vector<FitCell>& cells) {
  double s = 0;
  for (const auto& c : cells) s += (c.model - c.target) * (c.model - c.target);
  return s;
}

inline void check_targets(std::span<const GoodputTarget> targets, const char* which) {
  if (targets.empty()) {
    throw InvalidArgument(ddiloco::detail::msg("calibrate_baselines: no ", which, " targets; pass at least one (chips, goodput)"));
  }
  for (const auto& t : targets) {
    if (!(t.chips >= 1) || !(t.goodput > 0 && t.goodput <= 1)) {
      throw InvalidArgument(ddiloco::detail::msg("calibrate_baselines: ", which, " target (chips = ", t.chips,
                                                 ", goodput = ", t.goodput, ") needs chips >= 1 and goodput in (0, 1]"));
    }
  }
}
}  // namespace detail

/// Fits restart_s to `dp` and reconfigure_s to `elastic`, starting from
/// `base` (its other fields, seed and horizon are kept). `iterations`
/// golden-section steps per search (each step shrinks the bracket by 0.618).
/// Brackets: restart 0..600 s, reconfigure 0..120 s.
inline BaselineFit calibrate_baselines(const GoodputConfig& base, std::span<const GoodputTarget> dp,
                                       std::span<const GoodputTarget> elastic, int iterations = 18) {
  detail::check_targets(dp, "data-parallel");
  detail::check_targets(elastic, "elastic");
  BaselineFit fit;

  GoodputConfig c = base;
  c.series_bin_s = 0;
  // One cost of one system fitted to that system's targets on [0, hi]; c keeps the fitted value.
  const auto fit_cost = [&](System system, double SystemCosts::*cost, std::span<const GoodputTarget> targets,
                            double hi) {
    c.system = system;
    c.costs.*cost = detail::golden_min(
        [&](double v) {
          c.costs.*cost = v;
          return detail::sse(detail::evaluate(c, targets));
        },
        0.0, hi, iterations);
    return c.costs.*cost;
  };
  fit.restart_s = fit_cost(System::data_parallel, &SystemCosts::restart_s, dp, 600.0);
  fit.data_parallel = detail::evaluate(c, dp);
  fit.reconfigure_s = fit_cost(System::elastic, &SystemCosts::reconfigure_s, elastic, 120.0);
  fit.elastic = detail::evaluate(c, elastic);
  fit.data_parallel_rmse = std::sqrt(detail::sse(fit.data_parallel) / static_cast<double>(dp.size()));
  fit.elastic_rmse = std::sqrt(detail::sse(fit.elastic) / static_cast<double>(elastic.size()));
  return fit;
}

}  // namespace ddiloco::sim
