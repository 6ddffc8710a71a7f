// ddiloco/detail/robust_reference.hpp: the robust reference the syncer's
// admission checks norms and weights against (docs/algorithm.md, "The robust
// reference, the norm check and clipping").
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include <ddiloco/message.hpp>

namespace ddiloco::detail {

/// The robust reference of one fragment's accepted norms (or weights). It
/// keeps, for each of the last `learners` learners heard from, that learner's
/// `history` latest values (a learner that sends again updates its own entry;
/// a new one evicts the learner heard from least recently), and answers the
/// lower median over learners of each learner's recent maximum. One learner
/// holds one vote however often it sends, so fewer than half of the learners
/// cannot move the reference past the honest values; the recent maximum keeps
/// a momentary dip of honest norms (the outer gradient passing through zero
/// under Nesterov momentum) from making the next normal contribution look
/// like an outlier. A learner holding fewer than `history` values votes no
/// lower than a floor (see put()): the maximum of one value is no guard
/// against a dip, and a learner whose first norm was one made the lower
/// median of two learners that dip, clipping honest contributions to 4x it
/// (a group learner restarted next to a converged single learner: 2.7e-6
/// against 3e-3, for the rest of the run) or rejecting them as outliers (at
/// the start of a run: 5.8e-4 against 0.12) (docs/algorithm.md, "The robust
/// reference, the norm check and clipping"). Memory is fixed: learners x
/// history doubles. Not thread-safe (the syncer holds the fragment's lock).
class RobustReference {
 public:
  explicit RobustReference(std::size_t learners = 16, std::size_t history = 8)
      : learners_(std::max<std::size_t>(learners, 1)), history_(std::max<std::size_t>(history, 1)) {
    entries_.reserve(learners_);
    scratch_.reserve(learners_);
    maxima_.reserve(learners_);
  }

  void put(LearnerId id, double value) {
    auto it = std::find_if(entries_.begin(), entries_.end(), [id](const Entry& e) { return e.id == id; });
    Entry e;
    if (it != entries_.end()) {
      e = std::move(*it);
      entries_.erase(it);
    } else if (entries_.size() >= learners_) {
      e = std::move(entries_.front());  // reuse the evicted learner's storage
      entries_.erase(entries_.begin());
      e.values.clear();
      e.next = 0;
    }
    e.id = id;
    if (e.values.size() < history_) {
      e.values.push_back(value);
    } else {
      e.values[e.next] = value;
      e.next = (e.next + 1) % history_;
    }
    entries_.push_back(std::move(e));
    // The floor of a partial learner's vote: the lower median of the full
    // learners' maxima or, while nobody's history is full (the first rounds
    // of a run), of the other learners' maxima; and no more than the
    // reference before this value (so that a flooding liar whose history
    // alone is full cannot lift it).
    const double before = median_.value_or(std::numeric_limits<double>::infinity());
    maxima_.clear();
    for (const Entry& x : entries_)
      if (x.values.size() >= history_) maxima_.push_back(recent_max(x));
    const bool any_full = !maxima_.empty();
    double full_floor = 0.0;
    if (any_full) {
      full_floor = std::min(lower_median(maxima_), before);
    } else {  // every learner's maximum, sorted, to take each one's others' lower median from
      for (const Entry& x : entries_) maxima_.push_back(recent_max(x));
      std::sort(maxima_.begin(), maxima_.end());
    }
    scratch_.clear();
    for (const Entry& x : entries_) {
      const double own = recent_max(x);
      if (x.values.size() >= history_) {
        scratch_.push_back(own);
      } else if (any_full) {
        scratch_.push_back(std::max(own, full_floor));
      } else if (maxima_.size() > 1) {
        scratch_.push_back(std::max(own, std::min(others_lower_median(own), before)));
      } else {
        scratch_.push_back(own);
      }
    }
    median_ = lower_median(scratch_);
  }

  /// The lower median (the ((n - 1) / 2)-th smallest of n: with two learners,
  /// the smaller) of the learners' votes: each one's recent maximum, raised to
  /// the floor above for a learner holding fewer than `history` values;
  /// nullopt when empty.
  [[nodiscard]] std::optional<double> median() const { return median_; }

  /// Learner `id`'s recent maximum; nullopt if it has no entry.
  [[nodiscard]] std::optional<double> recent_max(LearnerId id) const {
    auto it = std::find_if(entries_.begin(), entries_.end(), [id](const Entry& e) { return e.id == id; });
    if (it == entries_.end()) return std::nullopt;
    return recent_max(*it);
  }

  [[nodiscard]] std::size_t learners() const noexcept { return entries_.size(); }
  void clear() noexcept {
    entries_.clear();
    median_.reset();
  }

 private:
  struct Entry {
    LearnerId id = 0;
    std::vector<double> values;  ///< at most history_, a ring once full
    std::size_t next = 0;        ///< the ring's oldest value once full
  };
  static double recent_max(const Entry& e) { return *std::max_element(e.values.begin(), e.values.end()); }
  static double lower_median(std::vector<double>& v) {
    const auto mid = v.begin() + static_cast<std::ptrdiff_t>((v.size() - 1) / 2);
    std::nth_element(v.begin(), mid, v.end());
    return *mid;
  }
  /// The lower median of maxima_ (sorted, n >= 2 values) without one copy of
  /// `own`: the ((n - 2) / 2)-th smallest of the other n - 1.
  double others_lower_median(double own) const {
    const std::size_t k = (maxima_.size() - 2) / 2;
    const auto at = static_cast<std::size_t>(std::lower_bound(maxima_.begin(), maxima_.end(), own) - maxima_.begin());
    return at <= k ? maxima_[k + 1] : maxima_[k];
  }

  std::size_t learners_, history_;
  std::vector<Entry> entries_;  ///< least recently heard from first
  std::optional<double> median_;  ///< the votes' lower median after the latest put
  std::vector<double> scratch_;
  std::vector<double> maxima_;  ///< the full learners' maxima, or (none full) every learner's, sorted
};

}  // namespace ddiloco::detail
