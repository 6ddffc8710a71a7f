// ddiloco/merge.hpp: merge rules that combine the learners' outer gradients of
// one fragment into one (docs/algorithm.md, "Radial-Directional Averaging"), as
// streaming accumulators.
//
// What it is: the `MergeRule` concept and two rules: `WeightedAverage`
// (sum w v / sum w) and `RadialDirectional` (RDA: average norms and directions
// separately, per tensor; embedding tensors averaged plainly). Contributions are
// added one at a time as they arrive and folded into O(fragment size) floats, so
// memory does not grow with the number of learners.
// What it is not: where weights come from (<ddiloco/merge_weights.hpp>), nor
// the outer optimizer that consumes the merged gradient
// (<ddiloco/outer_optimizer.hpp>), nor contribution validation (the syncer
// rejects non-finite or mis-sized payloads before they get here). Pure: no I/O,
// no threads, no clocks.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include <ddiloco/detail/kernels.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/layout.hpp>

namespace ddiloco {

/// A rule that merges weighted outer gradients of one fragment. A type R models
/// MergeRule when:
///   1. `R::name` is a `static constexpr std::string_view` naming the rule;
///   2. `R::Accumulator` is a type, and `r.make_accumulator(layout)` (const)
///      returns one for a fragment whose flat buffer is described by `layout`
///      (<ddiloco/layout.hpp>: each tensor's offset, size and embedding flag);
///   3. `acc.add(outer_gradient, weight)` folds in one contribution. It throws
///      ShapeMismatch unless outer_gradient.size() == layout_size(layout), and
///      InvalidArgument unless weight is finite and >= 0. A weight of 0 changes
///      nothing (an absent learner);
///   4. `acc.count()` returns the number of contributions added with weight > 0
///      (convertible to std::size_t) and `acc.total_weight()` their summed
///      weight (convertible to double);
///   5. `acc.finish(out)` writes the merged outer gradient into out (same size
///      as the layout, else ShapeMismatch) without changing the accumulator; it
///      throws StateError when the total weight is 0 (nothing to merge);
///   6. `acc.reset()` empties the accumulator for the next round, reusing its
///      memory.
/// A sound rule also passes the property checks of <ddiloco/testing.hpp>
/// (identical inputs, order, zero weights, scaling, norm behaviour).
template <class R>
concept MergeRule =
    requires(const R& r, std::span<const TensorSegment> layout) {
      { R::name } -> std::convertible_to<std::string_view>;
      typename R::Accumulator;
      { r.make_accumulator(layout) } -> std::same_as<typename R::Accumulator>;
    } &&
    requires(typename R::Accumulator& acc, std::span<const float> v, double w,
             std::span<float> out) {
      acc.add(v, w);
      { acc.count() } -> std::convertible_to<std::size_t>;
      { acc.total_weight() } -> std::convertible_to<double>;
      acc.finish(out);
      acc.reset();
    };

namespace detail {

/// Throws InvalidArgument unless the segments tile [0, layout_size) in order:
/// segment k starts where segment k-1 ends (layout.hpp: a fragment's buffer is
/// the concatenation of its tensors).
inline void check_layout(std::string_view rule, std::span<const TensorSegment> layout) {
  std::size_t end = 0;
  for (std::size_t k = 0; k < layout.size(); ++k) {
    if (layout[k].offset != end) {
      throw InvalidArgument(msg(rule, ": layout segment ", k, " starts at offset ",
                                layout[k].offset, " but the previous segments end at ", end,
                                "; segments must be contiguous and in buffer order "
                                "(use the fragmenter's layout)"));
    }
    end += layout[k].size;
  }
}

/// What every accumulator keeps besides its buffer: the layout, the number of
/// positive-weight contributions and their total weight, plus the checks of
/// MergeRule requirements 3 and 5.
class AccumulatorBookkeeping {
 public:
  [[nodiscard]] std::size_t count() const noexcept { return count_; }
  [[nodiscard]] double total_weight() const noexcept { return total_weight_; }
  /// Number of elements of the fragment (layout_size of the layout).
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::span<const TensorSegment> layout() const noexcept { return layout_; }

 protected:
  AccumulatorBookkeeping(std::string_view rule, std::span<const TensorSegment> layout)
      : rule_(rule), layout_(layout.begin(), layout.end()), size_(layout_size(layout)) {
    check_layout(rule, layout);
  }

  /// Requirement 3: sizes and weight. Returns false for a weight of 0 (ignore).
  bool check_add(std::span<const float> v, double weight) const {
    if (v.size() != size_) {
      throw ShapeMismatch(msg(rule_, "::add: outer gradient has ", v.size(),
                              " elements but the fragment layout has ", size_,
                              "; pass the whole fragment's flat buffer"));
    }
    if (!(std::isfinite(weight) && weight >= 0.0)) {
      throw InvalidArgument(msg(rule_, "::add: weight = ", weight,
                                " must be finite and >= 0 (use 0 for an absent learner)"));
    }
    return weight > 0.0;
  }

  /// Requirement 5: output size and something to merge.
  void check_finish(std::span<const float> out) const {
    if (out.size() != size_) {
      throw ShapeMismatch(msg(rule_, "::finish: output has ", out.size(),
                              " elements but the fragment layout has ", size_));
    }
    if (!(total_weight_ > 0.0)) {
      throw StateError(msg(rule_, "::finish: total weight is 0 (", count_,
                           " contributions with weight > 0); add at least one contribution "
                           "with a positive weight before finishing"));
    }
  }

  /// Records an accepted contribution; returns f = w / W_new for the running mean.
  float record(double weight) noexcept {
    total_weight_ += weight;
    ++count_;
    return static_cast<float>(weight / total_weight_);
  }

  void reset_bookkeeping() noexcept {
    count_ = 0;
    total_weight_ = 0.0;
  }

  [[nodiscard]] std::size_t bookkeeping_bytes() const noexcept {
    return layout_.capacity() * sizeof(TensorSegment);
  }

  std::string_view rule_;
  std::vector<TensorSegment> layout_;
  std::size_t size_;
  std::size_t count_ = 0;
  double total_weight_ = 0.0;
};

}  // namespace detail

/// The weighted average of the outer gradients, every tensor alike:
///
///     out = sum_m w_m v_m / sum_m w_m
///
/// Kept as a running mean (mean += (w / W_new) (v - mean), see
/// detail::running_mean_update), one pass per contribution. Identical inputs
/// give that input exactly. Near-orthogonal inputs of norm R give a norm of
/// about R / sqrt(M) (docs/algorithm.md, "Radial-Directional Averaging"), which is why RDA exists.
/// State: one float per fragment element.
struct WeightedAverage {
  static constexpr std::string_view name = "weighted_average";

  class Accumulator : public detail::AccumulatorBookkeeping {
   public:
    explicit Accumulator(std::span<const TensorSegment> layout)
        : AccumulatorBookkeeping(name, layout), mean_(size_, 0.0f) {}

    void add(std::span<const float> v, double weight) {
      if (!check_add(v, weight)) return;
      const bool first = count_ == 0;
      const float f = record(weight);
      if (first) {
        detail::scale_copy(1.0f, v, mean_);
      } else {
        detail::running_mean_update(f, 1.0f, v, mean_);
      }
    }

    void finish(std::span<float> out) const {
      check_finish(out);
      std::copy(mean_.begin(), mean_.end(), out.begin());
    }

    void reset() noexcept { reset_bookkeeping(); }  // the first add overwrites mean_

    /// Bytes held (buffers only); constant after construction.
    [[nodiscard]] std::size_t memory_bytes() const noexcept {
      return mean_.capacity() * sizeof(float) + bookkeeping_bytes();
    }

   private:
    std::vector<float> mean_;  // running weighted mean of v
  };

  [[nodiscard]] Accumulator make_accumulator(std::span<const TensorSegment> layout) const {
    return Accumulator(layout);
  }
};

/// Radial-Directional Averaging (docs/algorithm.md, "Radial-Directional Averaging"), per tensor:
///
///     RDA = ( sum_m w_m ||v_m|| / sum_m w_m ) * phi( sum_m w_m phi(v_m) / sum_m w_m )
///     phi(x) = x / ||x||,  phi(0) = 0
///
/// Embedding tensors (TensorSegment::embedding) take the plain weighted average
/// instead, as in the paper's main runs.
///
/// Streaming form: when a contribution arrives, each non-embedding tensor's norm
/// is computed (pass 1 over the contribution) and phi(v) is folded into a running
/// weighted mean of directions (pass 2); sum w ||v|| is a double per tensor.
/// finish() takes the norm of each mean direction and rescales it.
///
/// Edge cases (all tested):
///   - A zero tensor (norm below FLT_MIN, whose direction fp32 cannot represent)
///     has phi = 0: it counts in the total weight and pulls the mean norm down,
///     but adds no direction.
///   - Cancelling directions: ||mean direction|| <= 1 always (a mean of unit
///     vectors). When it is below `cancellation_threshold`, the directions cancel
///     to within fp32 rounding (about M * 6e-8) and normalising the remainder
///     would amplify rounding noise to full norm, so that tensor's output is 0.
///   - If every ||v_m|| = R the output has norm R, whatever M is.
/// State: one float per fragment element plus one double per tensor.
struct RadialDirectional {
  static constexpr std::string_view name = "radial_directional";
  /// Below this norm the weighted mean of unit directions is treated as 0.
  static constexpr double cancellation_threshold = 1e-5;

  class Accumulator : public detail::AccumulatorBookkeeping {
   public:
    explicit Accumulator(std::span<const TensorSegment> layout)
        : AccumulatorBookkeeping(name, layout),
          mean_(size_, 0.0f),
          weighted_norm_sum_(layout_.size(), 0.0) {}

    void add(std::span<const float> v, double weight) {
      if (!check_add(v, weight)) return;
      const bool first = count_ == 0;
      const float f = record(weight);
      for (std::size_t t = 0; t < layout_.size(); ++t) {
        const TensorSegment& seg = layout_[t];
        const auto src = v.subspan(seg.offset, seg.size);
        const auto dst = std::span<float>(mean_).subspan(seg.offset, seg.size);
        float s = 1.0f;  // embedding: running mean of v itself
        if (!seg.embedding) {
          const double norm = detail::norm(src);                 // pass 1: ||v_t||
          weighted_norm_sum_[t] += weight * norm;                // sum w ||v||
          s = norm >= FLT_MIN ? static_cast<float>(1.0 / norm) : 0.0f;  // phi(0) = 0
        }
        if (first) {
          detail::scale_copy(s, src, dst);  // pass 2: mean = phi(v)
        } else {
          detail::running_mean_update(f, s, src, dst);  // pass 2: mean += f (phi(v) - mean)
        }
      }
    }

    void finish(std::span<float> out) const {
      check_finish(out);
      for (std::size_t t = 0; t < layout_.size(); ++t) {
        const TensorSegment& seg = layout_[t];
        const auto src = std::span<const float>(mean_).subspan(seg.offset, seg.size);
        const auto dst = out.subspan(seg.offset, seg.size);
        if (seg.embedding) {
          std::copy(src.begin(), src.end(), dst.begin());
          continue;
        }
        const double mean_norm = weighted_norm_sum_[t] / total_weight_;
        const double direction_norm = detail::norm(src);
        if (direction_norm < cancellation_threshold) {
          std::fill(dst.begin(), dst.end(), 0.0f);
        } else {
          detail::scale_copy(static_cast<float>(mean_norm / direction_norm), src, dst);
        }
      }
    }

    void reset() noexcept {
      reset_bookkeeping();  // the first add overwrites mean_
      std::fill(weighted_norm_sum_.begin(), weighted_norm_sum_.end(), 0.0);
    }

    /// Bytes held (buffers only); constant after construction.
    [[nodiscard]] std::size_t memory_bytes() const noexcept {
      return mean_.capacity() * sizeof(float) +
             weighted_norm_sum_.capacity() * sizeof(double) + bookkeeping_bytes();
    }

   private:
    std::vector<float> mean_;  // per tensor: running mean of phi(v) (embedding: of v)
    std::vector<double> weighted_norm_sum_;  // per tensor: sum_m w_m ||v_m||
  };

  [[nodiscard]] Accumulator make_accumulator(std::span<const TensorSegment> layout) const {
    return Accumulator(layout);
  }
};

}  // namespace ddiloco
