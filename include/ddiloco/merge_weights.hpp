// ddiloco/merge_weights.hpp: how much each learner's contribution counts in a
// merge (docs/algorithm.md, "Merge weights").
//
// What it is: the per-(learner, fragment) `Counters` a learner sends with its
// outer gradient, the `WeightRule` concept, and two rules: `TokenWeights` (the
// paper's tokens^2 / steps, "quantity times quality") and `UniformWeights`
// (every learner that took a step counts the same).
// What it is not: the merge itself (<ddiloco/merge.hpp> takes the weights these
// rules return). Pure: no I/O, no threads, no clocks.
#pragma once

#include <concepts>
#include <cstdint>
#include <string_view>

#include <ddiloco/error.hpp>

namespace ddiloco {

/// What learner m did to fragment p since it last received p (docs/algorithm.md, "Round timeline").
struct Counters {
  std::int64_t steps = 0;   ///< inner steps, c_steps[m,p]
  std::int64_t tokens = 0;  ///< tokens processed, c_tokens[m,p]

  friend bool operator==(const Counters&, const Counters&) = default;
};

/// A rule that turns counters into a merge weight. A type W models WeightRule when:
///   1. `W::name` is a `static constexpr std::string_view` naming the rule;
///   2. `w(counters)` (const) returns a finite weight >= 0 as a double; 0 means
///      "does not count" (an absent learner, or one that took no step), and it
///      throws InvalidArgument for inconsistent counters (negative values, tokens
///      without steps).
template <class W>
concept WeightRule = requires(const W& w, const Counters& c) {
  { W::name } -> std::convertible_to<std::string_view>;
  { w(c) } -> std::same_as<double>;
};

namespace detail {
/// Throws InvalidArgument for counters no learner can produce.
inline void check_counters(std::string_view who, const Counters& c) {
  if (c.steps < 0 || c.tokens < 0) {
    throw InvalidArgument(msg(who, ": counters steps = ", c.steps, ", tokens = ", c.tokens,
                              " must both be >= 0; they count work since the last receipt"));
  }
  if (c.steps == 0 && c.tokens > 0) {
    throw InvalidArgument(msg(who, ": counters steps = 0 with tokens = ", c.tokens,
                              " are inconsistent; tokens are only processed by inner steps, "
                              "so count the steps too"));
  }
}
}  // namespace detail

/// The paper's weight (docs/algorithm.md, "Merge weights"):
///
///     w = c_tokens * (c_tokens / c_steps) = c_tokens^2 / c_steps,  0 if c_steps = 0
///
/// Quantity (tokens) times quality (tokens per step, i.e. batch size). With equal
/// batch sizes the weight is proportional to the number of steps.
struct TokenWeights {
  static constexpr std::string_view name = "token_weights";

  double operator()(const Counters& c) const {
    detail::check_counters(name, c);
    if (c.steps == 0) return 0.0;  // then tokens == 0 too (checked above)
    const auto tokens = static_cast<double>(c.tokens);
    return tokens * (tokens / static_cast<double>(c.steps));
  }
};

/// Every learner that took at least one step since its last receipt counts 1.
struct UniformWeights {
  static constexpr std::string_view name = "uniform_weights";

  double operator()(const Counters& c) const {
    detail::check_counters(name, c);
    return c.steps > 0 ? 1.0 : 0.0;
  }
};

}  // namespace ddiloco
