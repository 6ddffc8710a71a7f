// ddiloco/outer_optimizer.hpp: the syncer's outer optimizers (docs/algorithm.md, "Outer optimizer").
//
// What it is: the `OuterOptimizer` concept and three optimizers that turn a
// fragment's merged outer gradient Delta into a new global fragment Theta:
// `NesterovSGD` (the paper's, PyTorch SGD(nesterov=True) form), `PlainSGD` and
// `AverageOnly` (Theta <- Theta - Delta, i.e. FedAvg). Optimizer state is a flat
// fp32 buffer owned by the caller, so the syncer checkpoints it as plain floats.
// What it is not: the merge of contributions (<ddiloco/merge.hpp>) nor the inner
// optimizer (AdamW runs inside the user's training loop). Pure: no I/O, no
// threads, no clocks.
#pragma once

#include <cmath>
#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>

#include <ddiloco/error.hpp>

namespace ddiloco {

/// An outer optimizer for one fragment. A type O models OuterOptimizer when:
///   1. `O::name` is a `static constexpr std::string_view` naming the optimizer
///      (used in logs and checkpoints);
///   2. `o.state_size(n)` (const) returns the number of fp32 state values needed
///      for a fragment of n elements (0 for stateless optimizers);
///   3. `o.step(theta, delta, state)` (const) updates theta in place from the
///      merged outer gradient delta (Delta = mean of Theta_base - theta_m, so
///      descending means theta -= ...) and updates state in place. It throws
///      ShapeMismatch unless delta.size() == theta.size() and state.size() ==
///      state_size(theta.size()). A fresh state is all zeros.
/// The optimizer object itself holds only hyper-parameters; all per-fragment
/// memory is the caller's `state` buffer.
template <class O>
concept OuterOptimizer = requires(const O& o, std::size_t n, std::span<float> theta,
                                  std::span<const float> delta, std::span<float> state) {
  { O::name } -> std::convertible_to<std::string_view>;
  { o.state_size(n) } -> std::same_as<std::size_t>;
  o.step(theta, delta, state);
};

namespace detail {
inline void check_learning_rate(std::string_view who, float lr) {
  if (!(std::isfinite(lr) && lr > 0.0f)) {
    throw InvalidArgument(msg(who, ": learning rate lr = ", lr,
                              " must be finite and > 0 (the paper's outer lr is 0.7)"));
  }
}

inline void check_step_shapes(std::string_view who, std::size_t theta, std::size_t delta,
                              std::size_t state, std::size_t expected_state) {
  if (delta != theta) {
    throw ShapeMismatch(msg(who, "::step: delta has ", delta, " elements but theta has ", theta,
                            "; pass the merged outer gradient of this same fragment"));
  }
  if (state != expected_state) {
    throw ShapeMismatch(msg(who, "::step: state has ", state, " elements but a fragment of ",
                            theta, " elements needs state_size(", theta, ") = ", expected_state,
                            "; allocate state_size(n) zero-initialised floats per fragment"));
  }
}
}  // namespace detail

/// SGD with Nesterov momentum exactly as PyTorch's SGD(nesterov=True, dampening=0,
/// weight_decay=0), per element (docs/algorithm.md, "Outer optimizer"):
///
///     b     <- mu * b + Delta
///     Theta <- Theta - eta * (Delta + mu * b)
///
/// PyTorch initialises b = Delta on the first step instead of applying the
/// update to b = 0; with no dampening the two agree, since mu * 0 + Delta =
/// Delta. So a zero-initialised state buffer reproduces PyTorch from step one
/// (the tests check the worked value 0.665 and a three-step sequence).
/// State: one momentum value per element.
class NesterovSGD {
 public:
  static constexpr std::string_view name = "nesterov_sgd";

  /// Throws InvalidArgument unless lr is finite and > 0 and 0 <= momentum < 1.
  explicit NesterovSGD(float lr = 0.7f, float momentum = 0.9f) : lr_(lr), momentum_(momentum) {
    detail::check_learning_rate("NesterovSGD", lr);
    if (!(momentum >= 0.0f && momentum < 1.0f)) {
      throw InvalidArgument(detail::msg("NesterovSGD: momentum = ", momentum,
                                        " must be in [0, 1) (the paper uses 0.9)"));
    }
  }

  [[nodiscard]] float lr() const noexcept { return lr_; }
  [[nodiscard]] float momentum() const noexcept { return momentum_; }

  [[nodiscard]] std::size_t state_size(std::size_t n) const noexcept { return n; }

  void step(std::span<float> theta, std::span<const float> delta, std::span<float> state) const {
    detail::check_step_shapes(name, theta.size(), delta.size(), state.size(),
                              state_size(theta.size()));
    const float mu = momentum_;
    const float eta = lr_;
    for (std::size_t i = 0; i < theta.size(); ++i) {
      const float b = mu * state[i] + delta[i];  // b <- mu * b + Delta
      state[i] = b;
      theta[i] -= eta * (delta[i] + mu * b);  // Theta <- Theta - eta * (Delta + mu * b)
    }
  }

 private:
  float lr_;
  float momentum_;
};

/// Plain SGD on the outer gradient: Theta <- Theta - eta * Delta. Stateless.
/// With lr = 1 it equals AverageOnly.
class PlainSGD {
 public:
  static constexpr std::string_view name = "plain_sgd";

  /// Throws InvalidArgument unless lr is finite and > 0.
  explicit PlainSGD(float lr = 1.0f) : lr_(lr) { detail::check_learning_rate("PlainSGD", lr); }

  [[nodiscard]] float lr() const noexcept { return lr_; }

  [[nodiscard]] std::size_t state_size(std::size_t /*n*/) const noexcept { return 0; }

  void step(std::span<float> theta, std::span<const float> delta, std::span<float> state) const {
    detail::check_step_shapes(name, theta.size(), delta.size(), state.size(), 0);
    for (std::size_t i = 0; i < theta.size(); ++i) theta[i] -= lr_ * delta[i];
  }

 private:
  float lr_;
};

/// No outer optimizer: Theta <- Theta - Delta, so Theta becomes the (merged)
/// average of the learners' parameters (FedAvg / model averaging). Stateless.
class AverageOnly {
 public:
  static constexpr std::string_view name = "average_only";

  [[nodiscard]] std::size_t state_size(std::size_t /*n*/) const noexcept { return 0; }

  void step(std::span<float> theta, std::span<const float> delta, std::span<float> state) const {
    detail::check_step_shapes(name, theta.size(), delta.size(), state.size(), 0);
    for (std::size_t i = 0; i < theta.size(); ++i) theta[i] -= delta[i];
  }
};

}  // namespace ddiloco
