// custom_merge_rule: write your own merge rule and check it with ddiloco::testing.
//
// The rule here is a weighted, coordinate-wise trimmed mean: for every element,
// sort the learners' values, discard a fraction `trim` of the total weight from
// each end, and take the weighted mean of what remains. It resists a few
// outlying learners, at a price: its accumulator STORES every contribution
// (memory grows with the number of learners, unlike the library's streaming
// rules), since a trimmed mean cannot be computed from running sums.
//
// The program checks the rule's properties, shows its robustness to an outlier
// next to WeightedAverage, and exits non-zero if any check fails.
#include <ddiloco/merge.hpp>
#include <ddiloco/testing.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

/// Weighted coordinate-wise trimmed mean. With weights w_m and total W, the
/// sorted values of element i occupy consecutive weight intervals of [0, W); the
/// rule keeps the part of each interval inside [trim W, (1 - trim) W) and
/// returns the kept-weight mean. trim = 0 is the weighted average; trim -> 0.5
/// approaches the weighted median.
///
/// NormBehaviour::none: a coordinate-wise statistic is not convex in norm. Three
/// inputs (1,1,0), (1,0,1), (0,1,1) of norm sqrt(2) have coordinate medians
/// (1,1,1) of norm sqrt(3). So the rule promises nothing about its norm.
class TrimmedMean {
 public:
  static constexpr std::string_view name = "trimmed_mean";

  explicit TrimmedMean(double trim = 0.2) : trim_(trim) {
    if (!(trim >= 0.0 && trim < 0.5)) {
      throw ddiloco::InvalidArgument(ddiloco::detail::msg("TrimmedMean: trim = ", trim, " must be in [0, 0.5)"));
    }
  }

  class Accumulator {
   public:
    Accumulator(std::span<const ddiloco::TensorSegment> layout, double trim)
        : size_(ddiloco::layout_size(layout)), trim_(trim) {}

    void add(std::span<const float> v, double weight) {
      if (v.size() != size_) {
        throw ddiloco::ShapeMismatch(ddiloco::detail::msg("TrimmedMean::add: outer gradient has ", v.size(),
                                                          " elements, the layout ", size_));
      }
      if (!(weight >= 0.0 && weight < std::numeric_limits<double>::infinity())) {
        throw ddiloco::InvalidArgument(ddiloco::detail::msg("TrimmedMean::add: weight = ", weight,
                                                            " must be finite and >= 0"));
      }
      if (weight == 0.0) return;  // requirement 3: weight 0 changes nothing
      inputs_.emplace_back(v.begin(), v.end());
      weights_.push_back(weight);
      total_ += weight;
    }

    [[nodiscard]] std::size_t count() const { return inputs_.size(); }
    [[nodiscard]] double total_weight() const { return total_; }

    void finish(std::span<float> out) const {
      if (out.size() != size_) {
        throw ddiloco::ShapeMismatch(ddiloco::detail::msg("TrimmedMean::finish: output has ", out.size(),
                                                          " elements, the layout ", size_));
      }
      if (!(total_ > 0.0)) throw ddiloco::StateError("TrimmedMean::finish: nothing to merge (total weight 0)");
      const double lo = trim_ * total_;
      const double hi = (1.0 - trim_) * total_;
      std::vector<std::pair<float, double>> column(inputs_.size());
      for (std::size_t i = 0; i < size_; ++i) {
        for (std::size_t m = 0; m < inputs_.size(); ++m) column[m] = {inputs_[m][i], weights_[m]};
        std::sort(column.begin(), column.end());  // by value, ties by weight: order independent
        double start = 0.0, kept_sum = 0.0, kept_weight = 0.0;
        for (const auto& [x, w] : column) {
          const double kept = std::max(0.0, std::min(start + w, hi) - std::max(start, lo));
          kept_sum += kept * static_cast<double>(x);
          kept_weight += kept;
          start += w;
        }
        out[i] = static_cast<float>(kept_sum / kept_weight);
      }
    }

    void reset() {
      inputs_.clear();  // keeps capacity for the next round
      weights_.clear();
      total_ = 0.0;
    }

   private:
    std::size_t size_;
    double trim_;
    std::vector<std::vector<float>> inputs_;  // grows with the number of learners
    std::vector<double> weights_;
    double total_ = 0.0;
  };

  [[nodiscard]] Accumulator make_accumulator(std::span<const ddiloco::TensorSegment> layout) const {
    return Accumulator(layout, trim_);
  }

 private:
  double trim_;
};

static_assert(ddiloco::MergeRule<TrimmedMean>);

}  // namespace

int main() {
  namespace dt = ddiloco::testing;

  std::printf("Property checks for %s (trim = 0.2):\n", std::string(TrimmedMean::name).c_str());
  bool ok = true;
  for (const std::uint64_t seed : {1u, 2u, 3u}) {
    const auto results = dt::check_merge_rule(TrimmedMean(0.2), dt::NormBehaviour::none, seed);
    for (const auto& r : results) std::printf("  %s\n", dt::to_string(r).c_str());
    ok = ok && dt::all_passed(results);
  }

  // Robustness: 7 learners agree on a direction, one sends garbage 100x larger.
  const std::vector<ddiloco::TensorSegment> layout{{0, 512, false}};
  auto inputs = dt::random_outer_gradients(layout, std::vector<double>{1.0}, 7);
  inputs.resize(7, inputs.front());
  inputs.push_back(dt::random_outer_gradients(layout, std::vector<double>{100.0}, 8).front());
  const std::vector<double> weights(inputs.size(), 1.0);
  const auto trimmed = dt::merge_all(TrimmedMean(0.2), layout, inputs, weights);
  const auto average = dt::merge_all(ddiloco::WeightedAverage{}, layout, inputs, weights);
  auto distance = [&](const std::vector<float>& x) {
    double d = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double e = static_cast<double>(x[i]) - static_cast<double>(inputs.front()[i]);
      d += e * e;
    }
    return std::sqrt(d);
  };
  std::printf("Distance from the 7 agreeing learners' gradient (norm 1) with one outlier of norm 100:\n");
  std::printf("  trimmed mean:     %.4f\n", distance(trimmed));
  std::printf("  weighted average: %.4f\n", distance(average));
  ok = ok && distance(trimmed) < distance(average);

  std::printf("%s\n", ok ? "All checks passed." : "Some checks FAILED.");
  return ok ? 0 : 1;
}
