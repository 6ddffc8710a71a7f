// ddiloco/testing.hpp: test helpers for people who write their own merge rule.
//
// What it is: seeded generators of merge inputs (random fragment layouts, random
// near-orthogonal outer gradients of given norms, learner counters) and property
// checks that any sound `MergeRule` (<ddiloco/merge.hpp>) should pass: identical
// inputs give that input, input order does not matter, zero-weight contributions
// change nothing, scaling the inputs scales the output, the output norm behaves
// as the rule documents, finish() is repeatable and reset() starts afresh. Each
// check returns a `PropertyResult` with a readable explanation of any failure;
// `check_merge_rule` runs them all.
// What it is not: a test framework. It depends on no framework and does no I/O:
// assert on the results with whatever you use (the tests use Catch2, the
// examples print them). Passing the checks on random inputs is evidence, not a
// proof.
//
// Example:
//   auto results = ddiloco::testing::check_merge_rule(MyRule{}, NormBehaviour::convex, 42);
//   for (const auto& r : results) std::cout << ddiloco::testing::to_string(r) << '\n';
//   return ddiloco::testing::all_passed(results) ? 0 : 1;
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <numbers>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddiloco/error.hpp>
#include <ddiloco/layout.hpp>
#include <ddiloco/merge.hpp>
#include <ddiloco/merge_weights.hpp>

namespace ddiloco::testing {

/// The outcome of one property check.
struct PropertyResult {
  bool passed = false;
  std::string property;  ///< e.g. "order_independence"
  std::string detail;    ///< what was checked, or why it failed (inputs, seed, error)

  explicit operator bool() const noexcept { return passed; }
};

/// "[PASS] property: detail" or "[FAIL] property: detail".
inline std::string to_string(const PropertyResult& r) {
  return (r.passed ? "[PASS] " : "[FAIL] ") + r.property + ": " + r.detail;
}

/// True when every result passed.
inline bool all_passed(std::span<const PropertyResult> results) noexcept {
  return std::all_of(results.begin(), results.end(), [](const PropertyResult& r) { return r.passed; });
}

/// What a rule promises about the norm of its output; its author picks one.
enum class NormBehaviour {
  none,           ///< no promise; the norm check is skipped
  convex,         ///< ||out|| <= max_m ||v_m|| (weighted averages, medians of norms ...)
  mean_of_norms,  ///< ||out|| = sum w ||v|| / sum w; equal-norm inputs give that norm (RDA-like)
};

inline std::string_view to_string(NormBehaviour b) noexcept {
  switch (b) {
    case NormBehaviour::none: return "none";
    case NormBehaviour::convex: return "convex";
    case NormBehaviour::mean_of_norms: return "mean_of_norms";
  }
  return "?";
}

/// Relative tolerance of the checks: fp32 rules round at ~1e-7 per operation.
inline constexpr double default_tolerance = 1e-4;

// ---- Generators ------------------------------------------------------------

/// A small seeded generator (SplitMix64) with portable uniform and normal
/// draws, so the same seed gives the same inputs on every platform (the
/// standard library's distributions are implementation-defined).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) noexcept : state_(seed) {}

  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1).
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// Uniform in [lo, hi].
  double uniform(double lo, double hi) noexcept { return lo + (hi - lo) * uniform(); }
  /// Uniform integer in [lo, hi] (lo <= hi).
  std::size_t uniform_index(std::size_t lo, std::size_t hi) noexcept {
    return lo + static_cast<std::size_t>(next() % (static_cast<std::uint64_t>(hi - lo) + 1));
  }
  /// Standard normal (Box-Muller).
  double normal() noexcept {
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::uint64_t state_;
};

/// Shape of the layouts random_layout draws.
struct LayoutOptions {
  std::size_t min_tensors = 1;
  std::size_t max_tensors = 6;
  std::size_t min_tensor_size = 1;
  std::size_t max_tensor_size = 256;
  bool embeddings = true;  ///< the first tensor is an embedding with probability 1/2
};

/// A random fragment layout: contiguous segments tiling [0, layout_size).
inline std::vector<TensorSegment> random_layout(std::uint64_t seed, const LayoutOptions& options = {}) {
  if (options.min_tensors == 0 || options.min_tensors > options.max_tensors ||
      options.min_tensor_size > options.max_tensor_size) {
    throw InvalidArgument(detail::msg("random_layout: options tensors [", options.min_tensors, ", ",
                                      options.max_tensors, "] and sizes [", options.min_tensor_size, ", ",
                                      options.max_tensor_size,
                                      "] must be non-empty ranges with at least one tensor"));
  }
  Rng rng(seed);
  const std::size_t tensors = rng.uniform_index(options.min_tensors, options.max_tensors);
  std::vector<TensorSegment> layout;
  std::size_t offset = 0;
  for (std::size_t t = 0; t < tensors; ++t) {
    const std::size_t size = rng.uniform_index(options.min_tensor_size, options.max_tensor_size);
    const bool embedding = options.embeddings && t == 0 && (rng.next() & 1u) != 0;
    layout.push_back({offset, size, embedding});
    offset += size;
  }
  return layout;
}

/// One outer gradient per entry of `norms`, with Gaussian (hence, for tensors of
/// more than a few elements, nearly orthogonal) directions. Contribution m has
/// norm norms[m] and each tensor t carries the same share of it in every
/// contribution: ||v_m[t]|| = norms[m] * sqrt(size_t / layout_size). So
/// per-tensor and whole-fragment norm statements agree.
inline std::vector<std::vector<float>> random_outer_gradients(std::span<const TensorSegment> layout,
                                                              std::span<const double> norms,
                                                              std::uint64_t seed) {
  const std::size_t n = layout_size(layout);
  Rng rng(seed);
  std::vector<std::vector<float>> out;
  out.reserve(norms.size());
  for (const double norm : norms) {
    std::vector<float> v(n);
    for (const auto& seg : layout) {
      if (seg.size == 0) continue;
      std::vector<double> g(seg.size);
      double sq = 0.0;
      for (double& x : g) {
        x = rng.normal();
        sq += x * x;
      }
      const double target = norm * std::sqrt(static_cast<double>(seg.size) / static_cast<double>(n));
      const double scale = sq > 0.0 ? target / std::sqrt(sq) : 0.0;
      for (std::size_t i = 0; i < seg.size; ++i) v[seg.offset + i] = static_cast<float>(g[i] * scale);
    }
    out.push_back(std::move(v));
  }
  return out;
}

/// Counters of `count` learners: steps in [1, max_steps], a per-learner batch
/// of [1, max_batch_tokens] tokens, tokens = steps * batch.
inline std::vector<Counters> random_counters(std::size_t count, std::uint64_t seed,
                                             std::int64_t max_steps = 48,
                                             std::int64_t max_batch_tokens = 4096) {
  if (max_steps < 1 || max_batch_tokens < 1) {
    throw InvalidArgument(detail::msg("random_counters: max_steps = ", max_steps,
                                      " and max_batch_tokens = ", max_batch_tokens, " must be >= 1"));
  }
  Rng rng(seed);
  std::vector<Counters> out(count);
  for (auto& c : out) {
    c.steps = static_cast<std::int64_t>(rng.uniform_index(1, static_cast<std::size_t>(max_steps)));
    const auto batch = static_cast<std::int64_t>(rng.uniform_index(1, static_cast<std::size_t>(max_batch_tokens)));
    c.tokens = c.steps * batch;
  }
  return out;
}

/// Token weights (tokens^2 / steps) of random counters: realistic, widely spread weights.
inline std::vector<double> random_token_weights(std::size_t count, std::uint64_t seed) {
  const TokenWeights rule;
  std::vector<double> w;
  for (const auto& c : random_counters(count, seed)) w.push_back(rule(c));
  return w;
}

/// Adds every input with its weight to a fresh accumulator and returns the merge.
template <MergeRule R>
std::vector<float> merge_all(const R& rule, std::span<const TensorSegment> layout,
                             std::span<const std::vector<float>> inputs, std::span<const double> weights) {
  if (inputs.size() != weights.size()) {
    throw ShapeMismatch(detail::msg("merge_all: ", inputs.size(), " inputs but ", weights.size(),
                                    " weights; pass one weight per input"));
  }
  auto acc = rule.make_accumulator(layout);
  for (std::size_t m = 0; m < inputs.size(); ++m) acc.add(inputs[m], weights[m]);
  std::vector<float> out(layout_size(layout));
  acc.finish(out);
  return out;
}

// ---- Property checks -------------------------------------------------------

}  // namespace ddiloco::testing

namespace ddiloco::detail {

using testing::Rng;

/// ||got - want|| / ||want|| (absolute difference when want is 0).
inline double relative_distance(std::span<const float> got, std::span<const float> want) {
  double diff = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    diff += d * d;
  }
  const double scale = norm(want);
  return std::sqrt(diff) / (scale > 0.0 ? scale : 1.0);
}

/// One random scenario: a layout, M inputs of varied norms, token weights.
struct MergeScenario {
  std::uint64_t seed = 0;
  std::vector<TensorSegment> layout;
  std::vector<std::vector<float>> inputs;
  std::vector<double> norms;
  std::vector<double> weights;

  [[nodiscard]] std::string describe() const {
    std::size_t embeddings = 0;
    for (const auto& s : layout) embeddings += s.embedding ? 1 : 0;
    return msg("seed ", seed, ", ", layout.size(), " tensors (", embeddings, " embedding), ",
               layout_size(layout), " elements, M = ", inputs.size());
  }
};

/// Tensors of at least 8 elements keep random directions from cancelling by chance.
inline MergeScenario make_merge_scenario(std::uint64_t seed, std::size_t min_m, std::size_t max_m, bool embeddings,
                              bool equal_norms) {
  Rng rng(seed);
  MergeScenario s;
  s.seed = seed;
  testing::LayoutOptions options;
  options.min_tensor_size = 8;
  options.embeddings = embeddings;
  s.layout = testing::random_layout(rng.next(), options);
  const std::size_t m = rng.uniform_index(min_m, max_m);
  const double base = rng.uniform(0.1, 10.0);
  for (std::size_t k = 0; k < m; ++k) s.norms.push_back(equal_norms ? base : rng.uniform(0.1, 10.0));
  s.inputs = testing::random_outer_gradients(s.layout, s.norms, rng.next());
  s.weights = testing::random_token_weights(m, rng.next());
  return s;
}

inline constexpr int property_trials = 4;

/// Runs body(trial_seed) for property_trials seeds; body returns "" on success or a
/// failure description. Exceptions thrown by the rule are reported as failures.
template <class Body>
testing::PropertyResult run_property_trials(std::string property, std::string summary, std::uint64_t seed, Body&& body) {
  Rng seeds(seed);
  for (int trial = 0; trial < property_trials; ++trial) {
    const std::uint64_t trial_seed = seeds.next();
    std::string failure;
    try {
      failure = body(trial_seed);
    } catch (const std::exception& e) {
      failure = msg("threw: ", e.what(), " (trial seed ", trial_seed, ")");
    }
    if (!failure.empty()) return {false, std::move(property), msg("trial ", trial, ": ", failure)};
  }
  return {true, std::move(property), msg(summary, " (", property_trials, " random trials, seed ", seed, ")")};
}

}  // namespace ddiloco::detail

namespace ddiloco::testing {

/// M copies of one input, with different weights, merge to that input.
template <MergeRule R>
PropertyResult check_identical_inputs(const R& rule, std::uint64_t seed,
                                      double tolerance = default_tolerance) {
  return detail::run_property_trials("identical_inputs", "M copies of v merge to v", seed, [&](std::uint64_t s) {
    auto sc = detail::make_merge_scenario(s, 1, 8, true, false);
    const std::vector<float> v = sc.inputs.front();
    std::vector<std::vector<float>> copies(sc.inputs.size(), v);
    const auto out = merge_all(rule, sc.layout, copies, sc.weights);
    const double err = detail::relative_distance(out, v);
    if (err <= tolerance) return std::string();
    return detail::msg(sc.describe(), ": merging ", copies.size(), " copies of an input of norm ",
                       detail::norm(v), " gave an output of norm ", detail::norm(out),
                       " at relative distance ", err, " from the input (tolerance ", tolerance, ")");
  });
}

/// Adding the same contributions in another order (reversed, shuffled) gives the
/// same merge up to fp rounding.
template <MergeRule R>
PropertyResult check_order_independence(const R& rule, std::uint64_t seed,
                                        double tolerance = default_tolerance) {
  return detail::run_property_trials(
      "order_independence", "reversed and shuffled input orders give the same merge", seed,
      [&](std::uint64_t s) {
        auto sc = detail::make_merge_scenario(s, 2, 8, true, false);
        const auto reference = merge_all(rule, sc.layout, sc.inputs, sc.weights);
        std::vector<std::size_t> order(sc.inputs.size());
        for (std::size_t k = 0; k < order.size(); ++k) order[k] = order.size() - 1 - k;  // reversed
        Rng rng(s ^ 0x5DEECE66Dull);
        for (int variant = 0; variant < 3; ++variant) {
          std::vector<std::vector<float>> inputs;
          std::vector<double> weights;
          for (auto k : order) {
            inputs.push_back(sc.inputs[k]);
            weights.push_back(sc.weights[k]);
          }
          const auto out = merge_all(rule, sc.layout, inputs, weights);
          const double err = detail::relative_distance(out, reference);
          if (err > tolerance) {
            return detail::msg(sc.describe(), ": ", variant == 0 ? "the reversed order" : "a shuffled order",
                               " gave a merge at relative distance ", err,
                               " from the given order's (tolerance ", tolerance, ")");
          }
          for (std::size_t k = order.size(); k > 1; --k) std::swap(order[k - 1], order[rng.uniform_index(0, k - 1)]);
        }
        return std::string();
      });
}

/// Contributions of weight 0 (absent learners; here with huge values) change
/// neither the merge nor count() nor total_weight(), wherever they arrive.
template <MergeRule R>
PropertyResult check_zero_weights(const R& rule, std::uint64_t seed, double tolerance = default_tolerance) {
  return detail::run_property_trials(
      "zero_weights", "zero-weight contributions change neither the merge nor count() nor total_weight()",
      seed, [&](std::uint64_t s) {
        auto sc = detail::make_merge_scenario(s, 1, 6, true, false);
        const std::vector<double> junk_norms(sc.inputs.size() + 1, 1e3);
        const auto junk = random_outer_gradients(sc.layout, junk_norms, s + 1);
        auto clean = rule.make_accumulator(sc.layout);
        auto noisy = rule.make_accumulator(sc.layout);
        noisy.add(junk.front(), 0.0);  // before any real contribution
        for (std::size_t m = 0; m < sc.inputs.size(); ++m) {
          clean.add(sc.inputs[m], sc.weights[m]);
          noisy.add(sc.inputs[m], sc.weights[m]);
          noisy.add(junk[m + 1], 0.0);
        }
        if (static_cast<std::size_t>(noisy.count()) != sc.inputs.size()) {
          return detail::msg(sc.describe(), ": count() is ", static_cast<std::size_t>(noisy.count()),
                             " after ", sc.inputs.size(), " positive-weight and ", junk.size(),
                             " zero-weight contributions; it must count only weights > 0");
        }
        if (static_cast<double>(noisy.total_weight()) != static_cast<double>(clean.total_weight())) {
          return detail::msg(sc.describe(), ": total_weight() is ", static_cast<double>(noisy.total_weight()),
                             " with zero-weight contributions but ", static_cast<double>(clean.total_weight()),
                             " without");
        }
        std::vector<float> a(layout_size(sc.layout)), b(a.size());
        clean.finish(a);
        noisy.finish(b);
        const double err = detail::relative_distance(b, a);
        if (err <= tolerance) return std::string();
        return detail::msg(sc.describe(), ": adding ", junk.size(),
                           " zero-weight contributions of norm 1e3 moved the merge by relative distance ", err,
                           " (tolerance ", tolerance, ")");
      });
}

/// Multiplying every input by c > 0 multiplies the merge by c (c = 0.125, 3.7, 1000).
template <MergeRule R>
PropertyResult check_scaling(const R& rule, std::uint64_t seed, double tolerance = default_tolerance) {
  return detail::run_property_trials(
      "scaling", "scaling every input by c > 0 scales the merge by c", seed, [&](std::uint64_t s) {
        auto sc = detail::make_merge_scenario(s, 1, 8, true, false);
        const auto base = merge_all(rule, sc.layout, sc.inputs, sc.weights);
        for (const double c : {0.125, 3.7, 1000.0}) {
          auto scaled = sc.inputs;
          for (auto& v : scaled)
            for (float& x : v) x = static_cast<float>(c * static_cast<double>(x));
          std::vector<float> want(base.size());
          for (std::size_t i = 0; i < base.size(); ++i) want[i] = static_cast<float>(c * static_cast<double>(base[i]));
          const auto out = merge_all(rule, sc.layout, scaled, sc.weights);
          const double err = detail::relative_distance(out, want);
          if (err > tolerance) {
            return detail::msg(sc.describe(), ": with inputs scaled by c = ", c, " the merge has norm ",
                               detail::norm(out), " but c times the unscaled merge has norm ", detail::norm(want),
                               "; relative distance ", err, " (tolerance ", tolerance, ")");
          }
        }
        return std::string();
      });
}

/// The output norm behaves as `behaviour` says:
///   - convex: ||out|| <= max_m ||v_m|| (1 + tolerance);
///   - mean_of_norms: equal-norm inputs give that norm, and inputs of varied
///     norms give the weighted mean of their norms. Checked on layouts without
///     embedding tensors (RDA averages those plainly) whose inputs share the same
///     per-tensor norm proportions (see random_outer_gradients), so per-tensor and
///     whole-fragment norm averaging agree;
///   - none: nothing to check (passes).
template <MergeRule R>
PropertyResult check_norm_behaviour(const R& rule, NormBehaviour behaviour, std::uint64_t seed,
                                    double tolerance = default_tolerance) {
  std::string property = detail::msg("norm_behaviour(", to_string(behaviour), ")");
  switch (behaviour) {
    case NormBehaviour::none:
      return {true, std::move(property), "the rule promises nothing about its output norm: not checked"};
    case NormBehaviour::convex:
      return detail::run_property_trials(
          std::move(property), "the merge's norm never exceeds the largest input norm", seed,
          [&](std::uint64_t s) {
            auto sc = detail::make_merge_scenario(s, 1, 16, true, false);
            const auto out = merge_all(rule, sc.layout, sc.inputs, sc.weights);
            const double largest = *std::max_element(sc.norms.begin(), sc.norms.end());
            const double got = detail::norm(out);
            if (got <= largest * (1.0 + tolerance)) return std::string();
            return detail::msg(sc.describe(), ": the merge has norm ", got,
                               " but the largest input norm is ", largest);
          });
    case NormBehaviour::mean_of_norms:
      return detail::run_property_trials(
          std::move(property), "equal input norms R give norm R; varied norms give their weighted mean", seed,
          [&](std::uint64_t s) {
            for (const bool equal : {true, false}) {
              auto sc = detail::make_merge_scenario(s, 1, 16, false, equal);
              const auto out = merge_all(rule, sc.layout, sc.inputs, sc.weights);
              double weighted = 0.0, total = 0.0;
              for (std::size_t m = 0; m < sc.norms.size(); ++m) {
                weighted += sc.weights[m] * sc.norms[m];
                total += sc.weights[m];
              }
              const double want = weighted / total;
              const double got = detail::norm(out);
              if (std::abs(got - want) > tolerance * want) {
                return detail::msg(sc.describe(), ": ", equal ? "inputs all of norm " : "inputs of varied norms, weighted mean ",
                                   want, " gave a merge of norm ", got, " (relative tolerance ", tolerance, ")");
              }
            }
            return std::string();
          });
  }
  return {false, std::move(property), "unknown NormBehaviour value"};
}

/// finish() can be called twice with the same result, and after reset() the
/// accumulator is empty and merges a new round exactly like a fresh one.
template <MergeRule R>
PropertyResult check_finish_and_reset(const R& rule, std::uint64_t seed, double tolerance = default_tolerance) {
  return detail::run_property_trials(
      "finish_and_reset", "finish() is repeatable and reset() starts a fresh round", seed,
      [&](std::uint64_t s) {
        auto first = detail::make_merge_scenario(s, 1, 6, true, false);
        auto acc = rule.make_accumulator(first.layout);
        for (std::size_t m = 0; m < first.inputs.size(); ++m) acc.add(first.inputs[m], first.weights[m]);
        std::vector<float> a(layout_size(first.layout)), b(a.size());
        acc.finish(a);
        acc.finish(b);
        if (detail::relative_distance(b, a) > tolerance) {
          return detail::msg(first.describe(), ": a second finish() differs from the first by relative distance ",
                             detail::relative_distance(b, a));
        }
        acc.reset();
        if (static_cast<std::size_t>(acc.count()) != 0 || static_cast<double>(acc.total_weight()) != 0.0) {
          return detail::msg(first.describe(), ": after reset() count() = ", static_cast<std::size_t>(acc.count()),
                             " and total_weight() = ", static_cast<double>(acc.total_weight()), "; both must be 0");
        }
        // Second round on the same layout, fresh inputs.
        std::vector<double> norms(3);
        Rng rng(s + 7);
        for (double& n : norms) n = rng.uniform(0.1, 10.0);
        const auto inputs = random_outer_gradients(first.layout, norms, rng.next());
        const auto weights = random_token_weights(norms.size(), rng.next());
        for (std::size_t m = 0; m < inputs.size(); ++m) acc.add(inputs[m], weights[m]);
        acc.finish(a);
        const auto fresh = merge_all(rule, first.layout, inputs, weights);
        const double err = detail::relative_distance(a, fresh);
        if (err <= tolerance) return std::string();
        return detail::msg(first.describe(), ": after reset(), a new round merged to relative distance ", err,
                           " from a fresh accumulator's merge of the same inputs; reset() must forget the "
                           "previous round");
      });
}

/// Runs every property check above and returns their results in order.
template <MergeRule R>
std::vector<PropertyResult> check_merge_rule(const R& rule, NormBehaviour behaviour, std::uint64_t seed,
                                             double tolerance = default_tolerance) {
  Rng seeds(seed);
  std::vector<PropertyResult> results;
  results.push_back(check_identical_inputs(rule, seeds.next(), tolerance));
  results.push_back(check_order_independence(rule, seeds.next(), tolerance));
  results.push_back(check_zero_weights(rule, seeds.next(), tolerance));
  results.push_back(check_scaling(rule, seeds.next(), tolerance));
  results.push_back(check_norm_behaviour(rule, behaviour, seeds.next(), tolerance));
  results.push_back(check_finish_and_reset(rule, seeds.next(), tolerance));
  return results;
}

}  // namespace ddiloco::testing
