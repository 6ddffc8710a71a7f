// ddiloco/detail/kernels.hpp: the small span kernels the merge rules and outer
// optimizers are written with (dot, squared norm, norm, scaled copy, running mean).
//
// What it is: the readable reference. Each kernel is one pass over fp32 buffers;
// reductions accumulate in double so a 2^24-element norm is exact to fp32 precision.
// What it is not: tuned. A later issue makes these run at memory bandwidth and
// keeps these loops as the reference they are tested against. Callers check sizes;
// the kernels assume equal-length spans.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>

namespace ddiloco::detail {

/// sum_i x_i * y_i, accumulated in double.
inline double dot(std::span<const float> x, std::span<const float> y) noexcept {
  double sum = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sum += static_cast<double>(x[i]) * static_cast<double>(y[i]);
  }
  return sum;
}

/// ||x||^2 = sum_i x_i^2, accumulated in double.
inline double squared_norm(std::span<const float> x) noexcept {
  double sum = 0.0;
  for (const float v : x) {
    const auto d = static_cast<double>(v);
    sum += d * d;
  }
  return sum;
}

/// Euclidean norm ||x||.
inline double norm(std::span<const float> x) noexcept { return std::sqrt(squared_norm(x)); }

/// out_i = a * x_i (out and x may be the same buffer).
inline void scale_copy(float a, std::span<const float> x, std::span<float> out) noexcept {
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = a * x[i];
}

/// y_i += a * x_i.
inline void axpy(float a, std::span<const float> x, std::span<float> y) noexcept {
  for (std::size_t i = 0; i < x.size(); ++i) y[i] += a * x[i];
}

/// Running weighted mean update: mean_i += f * (s * x_i - mean_i).
///
/// With f = w / W_new (W_new the total weight including w) this turns the mean
/// of the previous contributions into the mean including s * x: the incremental
/// form of sum_m w_m (s_m x_m) / sum_m w_m. It never forms the (possibly huge)
/// weighted sum, so weights like tokens^2 / steps ~ 1e11 cannot overflow fp32, and
/// identical contributions leave the mean exactly unchanged. For the first
/// contribution callers use scale_copy instead (it does not read the stale buffer).
/// s lets RDA feed phi(x) = x / ||x|| without a temporary.
inline void running_mean_update(float f, float s, std::span<const float> x,
                                std::span<float> mean) noexcept {
  for (std::size_t i = 0; i < x.size(); ++i) mean[i] += f * (s * x[i] - mean[i]);
}

/// True when every element is finite (no NaN, no infinity).
inline bool all_finite(std::span<const float> x) noexcept {
  for (const float v : x) {
    if (!std::isfinite(v)) return false;
  }
  return true;
}

}  // namespace ddiloco::detail
