// ddiloco/histogram.hpp: counts of observations in fixed buckets, as the
// status structs (SyncerStatus, OuterLoopStatus) carry them.
//
// What it is: a plain value: increasing upper bounds, one count per bucket
// (plus one above the last bound), the sum and the number of observations.
// A value x falls in the first bucket whose bound b satisfies x <= b, as in
// Prometheus (`le`), so an exporter turns it into a Prometheus histogram
// without re-bucketing (<ddiloco/metrics/prometheus.hpp> does). Two
// histograms with the same bounds add up (status() sums per-fragment ones).
// What it is not: thread-safe (the owner guards it, like any status counter)
// or a quantile estimator.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "error.hpp"

namespace ddiloco {

class Histogram {
 public:
  Histogram() = default;
  /// `bounds`: the buckets' upper bounds, strictly increasing and finite; a
  /// last bucket (+Inf) holds what lies above them.
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
    for (std::size_t i = 0; i < bounds_.size(); ++i) {
      if (!std::isfinite(bounds_[i]) || (i > 0 && !(bounds_[i] > bounds_[i - 1])))
        throw InvalidArgument(detail::msg("Histogram: bound ", i, " = ", bounds_[i],
                                          " must be finite and greater than the one before it; pass strictly "
                                          "increasing upper bounds (the +Inf bucket is implicit)"));
    }
  }

  /// Counts `x` in its bucket (NaN is not counted: it has no bucket).
  void observe(double x) noexcept {
    if (std::isnan(x)) return;
    if (counts_.empty()) counts_.assign(1, 0);
    const auto it = std::lower_bound(bounds_.begin(), bounds_.end(), x);
    ++counts_[static_cast<std::size_t>(it - bounds_.begin())];
    sum_ += x;
    ++count_;
  }

  /// Adds `other`'s observations; both must have the same bounds.
  Histogram& operator+=(const Histogram& other) {
    if (other.count_ == 0 && other.sum_ == 0.0) return *this;
    if (counts_.empty() && count_ == 0) {
      *this = other;
      return *this;
    }
    if (other.bounds_ != bounds_)
      throw InvalidArgument(detail::msg("Histogram: cannot add a histogram of ", other.bounds_.size(),
                                        " bounds to one of ", bounds_.size(),
                                        " (or different values); add only histograms made with the same bounds"));
    for (std::size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
    sum_ += other.sum_;
    count_ += other.count_;
    return *this;
  }

  /// Upper bounds (without the implicit +Inf).
  [[nodiscard]] const std::vector<double>& bounds() const noexcept { return bounds_; }
  /// counts()[i]: observations in bucket i (not cumulative); bounds().size() + 1 entries.
  [[nodiscard]] const std::vector<std::uint64_t>& counts() const noexcept { return counts_; }
  [[nodiscard]] double sum() const noexcept { return sum_; }
  [[nodiscard]] std::uint64_t count() const noexcept { return count_; }
  /// Observations <= bounds()[i] (what Prometheus calls the bucket le = bounds()[i]).
  [[nodiscard]] std::uint64_t cumulative(std::size_t i) const noexcept {
    std::uint64_t n = 0;
    for (std::size_t j = 0; j <= i && j < counts_.size(); ++j) n += counts_[j];
    return n;
  }

  bool operator==(const Histogram&) const = default;

 private:
  std::vector<double> bounds_;
  std::vector<std::uint64_t> counts_;
  double sum_ = 0.0;
  std::uint64_t count_ = 0;
};

}  // namespace ddiloco
