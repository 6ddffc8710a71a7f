// ddiloco/fragmenter.hpp: split a model's tensors into P fragments.
//
// What it is: the pure function from (tensor list, P, strategy) to a `Plan`
// that every process of a run derives identically: which tensors form each
// fragment, where each tensor sits in its fragment's flat buffer, and a
// fingerprint that processes compare to make sure they agree
// (docs/algorithm.md, "Roles" and "Fragmentation"). Three strategies share one interface:
// `BalancedGreedy` (the default, Graham's LPT rule), `LayerContiguous` and
// `PerTensor`; the paper found model quality the same for all three and chose
// balanced because it flattens traffic.
// What it is not: anything that touches tensors' values, files, threads or
// clocks. Reading a tensor list from a file is <ddiloco/tensor_list.hpp>.
#pragma once

#include <algorithm>
#include <concepts>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddiloco/detail/hash.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/layout.hpp>

namespace ddiloco {

/// One tensor of the model, in model order.
struct TensorSpec {
  std::string name;        ///< unique within a model, no whitespace (see tensor_list.hpp)
  std::size_t numel = 0;   ///< number of elements, > 0
  /// embedding/unembedding: merged with a plain average (docs/algorithm.md,
  /// "Radial-Directional Averaging")
  bool embedding = false;

  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

/// One fragment: a set of whole tensors, synced together.
struct Fragment {
  std::vector<std::size_t> tensors;  ///< indices into `Plan::tensors()`, ascending
  std::size_t numel = 0;             ///< sum of its tensors' numel = its flat buffer's size

  friend bool operator==(const Fragment&, const Fragment&) = default;
};

/// A way of assigning tensors to fragments.
///
/// Requirements on a type S (with `const S s`, `std::span<const TensorSpec> t`,
/// `std::size_t p`):
///   1. `S::name` is a `static constexpr` value convertible to `std::string_view`,
///      non-empty and distinct from every other strategy's: it enters the plan's
///      fingerprint, so two processes using different strategies never agree.
///   2. `s.assign(t, p)` returns a `std::vector<std::size_t>` with one entry per
///      tensor: the fragment index of tensor i, in [0, p).
///   3. Every fragment in [0, p) receives at least one tensor.
///   4. The result is a pure function of (t, p): no randomness, no clocks, no
///      dependence on the platform, so every process derives the same plan.
/// `make_plan` calls `assign` only with p >= 1, t.size() >= p, every numel > 0,
/// unique names and a total that fits in `std::size_t`; it checks 2 and 3 and
/// throws InvalidArgument naming the strategy if they are broken.
template <class S>
concept FragmentStrategy = std::default_initializable<S> && requires(const S s, std::span<const TensorSpec> t, std::size_t p) {
  { std::string_view{S::name} } -> std::same_as<std::string_view>;
  { s.assign(t, p) } -> std::same_as<std::vector<std::size_t>>;
};

/// Graham's LPT rule (docs/algorithm.md, "Fragmentation"): visit tensors by size, largest first
/// (equal sizes: lower tensor index first), and put each into the currently
/// lightest fragment (equal loads: lower fragment index). The largest fragment
/// is at most (4/3 - 1/(3P)) times the optimum. O(n log n + n log P).
/// Example: sizes {25, 22, 3, 3}, P = 2 -> {0, 1, 1, 0}.
struct BalancedGreedy {
  static constexpr std::string_view name = "balanced-greedy";

  std::vector<std::size_t> assign(std::span<const TensorSpec> tensors, std::size_t p) const {
    const std::size_t n = tensors.size();
    // (numel, index) pairs sorted once: contiguous keys sort far faster than
    // indices compared through the spec array.
    std::vector<std::pair<std::size_t, std::size_t>> order(n);
    for (std::size_t i = 0; i < n; ++i) order[i] = {tensors[i].numel, i};
    std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    // Min-heap on (load, fragment index): the root is the lightest fragment,
    // the lower index among equally light ones. Keys are distinct (indices
    // differ), so the result does not depend on the heap's internals. Each
    // tensor grows the root's load and sifts it down: one pass per tensor.
    using Load = std::pair<std::size_t, std::size_t>;
    std::vector<Load> heap(p);
    for (std::size_t f = 0; f < p; ++f) heap[f] = {0, f};  // sorted, hence a valid heap
    std::vector<std::size_t> out(n);
    for (const auto& [numel, i] : order) {
      out[i] = heap[0].second;
      const Load moved{heap[0].first + numel, heap[0].second};
      std::size_t hole = 0;
      while (true) {
        std::size_t child = 2 * hole + 1;
        if (child >= p) break;
        if (child + 1 < p && heap[child + 1] < heap[child]) ++child;
        if (!(heap[child] < moved)) break;
        heap[hole] = heap[child];
        hole = child;
      }
      heap[hole] = moved;
    }
    return out;
  }
};

/// Contiguous runs of tensors in model order (layer-wise fragments, as in
/// Streaming DiLoCo). The rule: let B* be the smallest possible largest
/// fragment over all partitions of the sequence into P non-empty contiguous
/// runs (found by binary search on B with the greedy feasibility test "fill
/// a run while it stays <= B"); then, from the front, make each run as long as
/// it can be while staying <= B* and leaving at least one tensor for each run
/// still to come. The result is an optimal contiguous partition (its largest
/// fragment is B*); among optimal ones, earlier runs are as long as possible.
/// O(n log(total)).
struct LayerContiguous {
  static constexpr std::string_view name = "layer-contiguous";

  std::vector<std::size_t> assign(std::span<const TensorSpec> tensors, std::size_t p) const {
    const std::size_t n = tensors.size();
    std::size_t lo = 0;
    std::size_t hi = 0;
    for (const auto& t : tensors) {
      lo = std::max(lo, t.numel);
      hi += t.numel;  // make_plan guarantees no overflow
    }
    lo = std::max(lo, hi / p + (hi % p != 0 ? 1 : 0));  // no run can beat the mean, ceil(total / P)
    // Runs needed when each run may hold at most `cap` elements (cap >= max numel).
    auto runs_needed = [&](std::size_t cap) {
      std::size_t runs = 1;
      std::size_t fill = 0;
      for (const auto& t : tensors) {
        if (fill + t.numel > cap) {
          ++runs;
          fill = 0;
        }
        fill += t.numel;
      }
      return runs;
    };
    while (lo < hi) {  // smallest cap with runs_needed(cap) <= p
      const std::size_t mid = lo + (hi - lo) / 2;
      if (runs_needed(mid) <= p) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const std::size_t cap = lo;
    std::vector<std::size_t> out(n);
    std::size_t run = 0;
    std::size_t fill = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const bool starts_run = (i == 0);
      // Close the current run if the tensor does not fit, or if every tensor
      // left (including this one) is needed to give each later run one.
      if (!starts_run && run + 1 < p && (fill + tensors[i].numel > cap || n - i <= p - run - 1)) {
        ++run;
        fill = 0;
      }
      out[i] = run;
      fill += tensors[i].numel;
    }
    return out;
  }
};

/// Round-robin in model order (the "per-tensor" or strided strategy): tensor
/// i goes to fragment i mod P. Ignores sizes; every fragment gets a mix of
/// layers.
struct PerTensor {
  static constexpr std::string_view name = "per-tensor";

  std::vector<std::size_t> assign(std::span<const TensorSpec> tensors, std::size_t p) const {
    std::vector<std::size_t> out(tensors.size());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = i % p;
    return out;
  }
};

class Plan;

namespace detail {
using NameIndex = std::vector<std::pair<std::uint64_t, std::size_t>>;
Plan build_plan(std::vector<TensorSpec> tensors, std::size_t num_fragments, std::string_view strategy,
                const std::vector<std::size_t>& assignment, NameIndex name_index);
}  // namespace detail

/// The agreed split of a model into fragments. Immutable; cheap to query.
/// A fragment's flat buffer is the concatenation of its tensors in ascending
/// tensor index (layout.hpp), so `offset_in_fragment` grows with the index.
class Plan {
 public:
  [[nodiscard]] const std::vector<TensorSpec>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] const std::vector<Fragment>& fragments() const noexcept { return fragments_; }
  [[nodiscard]] std::size_t num_fragments() const noexcept { return fragments_.size(); }
  [[nodiscard]] std::size_t num_tensors() const noexcept { return tensors_.size(); }
  [[nodiscard]] std::size_t total_numel() const noexcept { return total_numel_; }
  [[nodiscard]] std::string_view strategy() const noexcept { return strategy_; }

  [[nodiscard]] std::size_t fragment_of(std::size_t tensor) const {
    check_tensor(tensor, "fragment_of");
    return fragment_of_[tensor];
  }
  /// Element offset of the tensor inside its fragment's flat buffer.
  [[nodiscard]] std::size_t offset_in_fragment(std::size_t tensor) const {
    check_tensor(tensor, "offset_in_fragment");
    return offset_[tensor];
  }
  /// One segment per tensor of the fragment, ascending tensor index.
  [[nodiscard]] std::span<const TensorSegment> layout(std::size_t fragment) const {
    if (fragment >= fragments_.size()) {
      throw InvalidArgument(detail::msg("Plan::layout: fragment ", fragment, " does not exist; the plan has ",
                                        fragments_.size(), " fragments (valid: 0..", fragments_.size() - 1, ")"));
    }
    return std::span<const TensorSegment>(segments_).subspan(segment_begin_[fragment],
                                                             segment_begin_[fragment + 1] - segment_begin_[fragment]);
  }
  /// Index of the tensor with this name, or nullopt.
  [[nodiscard]] std::optional<std::size_t> find(std::string_view name) const {
    const std::uint64_t h = detail::fnv1a64(name);
    auto it = std::lower_bound(by_hash_.begin(), by_hash_.end(), std::pair<std::uint64_t, std::size_t>{h, 0});
    for (; it != by_hash_.end() && it->first == h; ++it) {
      if (tensors_[it->second].name == name) return it->second;
    }
    return std::nullopt;
  }
  /// Largest fragment's numel divided by the mean fragment numel (>= 1; 1 is perfect).
  [[nodiscard]] double imbalance() const noexcept {
    std::size_t largest = 0;
    for (const auto& f : fragments_) largest = std::max(largest, f.numel);
    const double mean = static_cast<double>(total_numel_) / static_cast<double>(fragments_.size());
    return static_cast<double>(largest) / mean;
  }
  /// 64-bit FNV-1a (detail/hash.hpp) over, in this order: the tag
  /// "ddiloco.plan.v1", the strategy name, P, the number of tensors, then per
  /// tensor its name, numel, embedding flag (one byte) and fragment index.
  /// Integers are fed as 8 bytes little-endian, strings length-prefixed, so
  /// the value is the same in every process on every platform.
  [[nodiscard]] std::uint64_t fingerprint() const noexcept { return fingerprint_; }

  /// A human-readable table: a header line with strategy, P, tensor and element
  /// counts, imbalance and fingerprint (hex), then one line per fragment with
  /// its element count, tensor count and tensor names.
  [[nodiscard]] std::string describe() const {
    std::ostringstream os;
    os << "plan: strategy " << strategy_ << ", " << fragments_.size() << " fragments, " << tensors_.size()
       << " tensors, " << total_numel_ << " elements\n";
    os << "imbalance " << std::fixed << std::setprecision(4) << imbalance() << ", fingerprint 0x" << std::hex
       << std::setw(16) << std::setfill('0') << fingerprint_ << std::dec << std::setfill(' ') << '\n';
    os << "fragment      elements  tensors\n";
    for (std::size_t f = 0; f < fragments_.size(); ++f) {
      const auto& frag = fragments_[f];
      os << std::setw(8) << f << "  " << std::setw(12) << frag.numel << "  " << std::setw(7) << frag.tensors.size()
         << ':';
      for (std::size_t i = 0; i < frag.tensors.size(); ++i) {
        os << (i == 0 ? " " : ", ") << tensors_[frag.tensors[i]].name;
      }
      os << '\n';
    }
    return os.str();
  }

  friend bool operator==(const Plan& a, const Plan& b) {
    return a.fingerprint_ == b.fingerprint_ && a.strategy_ == b.strategy_ && a.tensors_ == b.tensors_ &&
           a.fragment_of_ == b.fragment_of_ && a.fragments_.size() == b.fragments_.size();
  }

 private:
  friend Plan detail::build_plan(std::vector<TensorSpec>, std::size_t, std::string_view,
                                 const std::vector<std::size_t>&, detail::NameIndex);
  Plan() = default;

  void check_tensor(std::size_t tensor, const char* what) const {
    if (tensor >= tensors_.size()) {
      throw InvalidArgument(detail::msg("Plan::", what, ": tensor ", tensor, " does not exist; the plan has ",
                                        tensors_.size(), " tensors (valid: 0..", tensors_.size() - 1,
                                        "); use find(name) to look a tensor up"));
    }
  }

  std::vector<TensorSpec> tensors_;
  std::vector<Fragment> fragments_;
  std::vector<std::size_t> fragment_of_;
  std::vector<std::size_t> offset_;
  std::vector<TensorSegment> segments_;       // fragment-major, ascending tensor index within
  std::vector<std::size_t> segment_begin_;    // P + 1 entries into segments_
  detail::NameIndex by_hash_;                 // (fnv1a64(name), index), sorted
  std::string strategy_;
  std::size_t total_numel_ = 0;
  std::uint64_t fingerprint_ = 0;
};

namespace detail {

/// Checks what does not depend on the strategy (P, sizes, total, unique
/// names) and returns the name index that `Plan::find` searches.
inline NameIndex validate_plan_input(const std::vector<TensorSpec>& tensors, std::size_t num_fragments) {
  if (num_fragments == 0) {
    throw InvalidArgument("make_plan: num_fragments = 0; pass P >= 1 (the paper uses P = 24)");
  }
  if (tensors.empty()) {
    throw InvalidArgument("make_plan: the tensor list is empty; pass the model's tensors (name, numel) in model order");
  }
  if (num_fragments > tensors.size()) {
    // An empty fragment would have a sync slot with nothing to send.
    throw InvalidArgument(msg("make_plan: num_fragments = ", num_fragments, " is more than the ", tensors.size(),
                              " tensors; fragments hold whole tensors and none may be empty, so use P <= ",
                              tensors.size()));
  }
  std::size_t total = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.numel == 0) {
      throw InvalidArgument(msg("make_plan: tensor '", t.name, "' (index ", i,
                                ") has numel = 0; drop it from the list or give its real size"));
    }
    if (t.numel > std::numeric_limits<std::size_t>::max() - total) {
      throw InvalidArgument(msg("make_plan: the total element count overflows std::size_t at tensor '", t.name,
                                "' (index ", i, ", numel ", t.numel, "); check the sizes"));
    }
    total += t.numel;
  }
  // Name index, and duplicate names: sort by hash, compare names only on equal hashes.
  const std::size_t n = tensors.size();
  NameIndex index;
  index.resize(n);
  for (std::size_t i = 0; i < n; ++i) index[i] = {fnv1a64(tensors[i].name), i};
  std::sort(index.begin(), index.end());
  for (std::size_t a = 0; a < n;) {
    std::size_t b = a + 1;
    while (b < n && index[b].first == index[a].first) ++b;
    for (std::size_t x = a; x < b; ++x) {
      for (std::size_t y = x + 1; y < b; ++y) {
        const std::size_t i = index[x].second;
        const std::size_t j = index[y].second;
        if (tensors[i].name == tensors[j].name) {
          throw InvalidArgument(msg("make_plan: tensor name '", tensors[i].name, "' appears twice (indices ", i,
                                    " and ", j, "); names identify tensors across processes, make them unique"));
        }
      }
    }
    a = b;
  }
  return index;
}

inline Plan build_plan(std::vector<TensorSpec> tensors, std::size_t num_fragments, std::string_view strategy,
                       const std::vector<std::size_t>& assignment, NameIndex name_index) {
  const std::size_t n = tensors.size();
  const std::size_t p = num_fragments;
  if (assignment.size() != n) {
    throw InvalidArgument(msg("make_plan: strategy '", strategy, "' returned ", assignment.size(),
                              " fragment indices for ", n, " tensors; a strategy must return one per tensor"));
  }
  Plan plan;
  plan.strategy_ = std::string(strategy);
  plan.by_hash_ = std::move(name_index);

  // Fragments: counts first, so each fragment's index list is allocated once.
  std::vector<std::size_t> count(p, 0);
  for (std::size_t i = 0; i < n; ++i) {
    if (assignment[i] >= p) {
      throw InvalidArgument(msg("make_plan: strategy '", strategy, "' put tensor ", i, " into fragment ",
                                assignment[i], ", but there are only ", p, " fragments; fix the strategy"));
    }
    ++count[assignment[i]];
  }
  for (std::size_t f = 0; f < p; ++f) {
    if (count[f] == 0) {
      throw InvalidArgument(msg("make_plan: strategy '", strategy, "' left fragment ", f,
                                " empty; every fragment needs at least one tensor, fix the strategy"));
    }
  }
  plan.fragments_.resize(p);
  plan.segment_begin_.resize(p + 1, 0);
  for (std::size_t f = 0; f < p; ++f) {
    plan.fragments_[f].tensors.reserve(count[f]);
    plan.segment_begin_[f + 1] = plan.segment_begin_[f] + count[f];
  }
  plan.fragment_of_ = assignment;
  plan.offset_.resize(n);
  plan.segments_.resize(n);
  std::vector<std::size_t> cursor(plan.segment_begin_.begin(), plan.segment_begin_.end() - 1);
  for (std::size_t i = 0; i < n; ++i) {  // ascending i: each fragment's list comes out ascending
    auto& frag = plan.fragments_[assignment[i]];
    plan.offset_[i] = frag.numel;
    plan.segments_[cursor[assignment[i]]++] = TensorSegment{frag.numel, tensors[i].numel, tensors[i].embedding};
    frag.tensors.push_back(i);
    frag.numel += tensors[i].numel;
    plan.total_numel_ += tensors[i].numel;
  }

  Fnv1a64 h;
  h.str("ddiloco.plan.v1").str(strategy).u64(p).u64(n);
  for (std::size_t i = 0; i < n; ++i) {
    h.str(tensors[i].name).u64(tensors[i].numel).byte(tensors[i].embedding ? 1 : 0).u64(assignment[i]);
  }
  plan.fingerprint_ = h.value();
  plan.tensors_ = std::move(tensors);
  return plan;
}

}  // namespace detail

/// Split `tensors` (in model order) into `num_fragments` fragments with the
/// given strategy. Throws InvalidArgument for P = 0, an empty list, a tensor
/// with numel 0, duplicate names, P > number of tensors (an empty fragment
/// would have an empty sync slot), a total that overflows std::size_t, or a
/// strategy that breaks `FragmentStrategy`'s requirements 2 and 3.
template <FragmentStrategy S = BalancedGreedy>
Plan make_plan(std::vector<TensorSpec> tensors, std::size_t num_fragments, S strategy = {}) {
  detail::NameIndex name_index = detail::validate_plan_input(tensors, num_fragments);
  const std::vector<std::size_t> assignment =
      std::as_const(strategy).assign(std::span<const TensorSpec>(tensors), num_fragments);
  return detail::build_plan(std::move(tensors), num_fragments, S::name, assignment, std::move(name_index));
}

}  // namespace ddiloco
