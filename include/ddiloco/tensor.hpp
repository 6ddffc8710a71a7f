// ddiloco/tensor.hpp: how ddiloco sees a user's tensor.
//
// What it is: the one trait, `ddiloco::tensor_traits<T>`, that adapts a tensor
// type to the library, the `Tensor` concept built on it, and the adapters for
// the standard library (`std::vector<float>`, `std::span<float>`).
// What it is not: a tensor library. The maths of ddiloco works on contiguous
// fp32 storage (`std::span<float>`); a user's type is adapted once, at the
// boundary. Eigen, xtensor and libtorch adapters live in
// <ddiloco/adapters/*.hpp> so that this header needs only the standard library.
//
// # Adapting your own tensor type
// Specialise `ddiloco::tensor_traits<YourTensor>` in one of two forms.
//
// Host form (the tensor's elements are contiguous fp32 in host memory):
//   1. `static std::span<float> host_data(YourTensor&)`
//   2. `static std::span<const float> host_data(const YourTensor&)`
//
// Staged form (device or framework tensors that must be copied to the host):
//   1. `static std::size_t size(const YourTensor&)`: element count.
//   2. `static void copy_to_host(const YourTensor&, std::span<float> dst)`:
//      writes exactly `size()` elements (row-major order of the storage).
//   3. `static void copy_from_host(YourTensor&, std::span<const float> src)`:
//      reads exactly `size()` elements back.
//
// A specialisation may instead REJECT a type with its own message: a
// static_assert that names the problem, plus `static constexpr bool rejected =
// true;` so that ddiloco adds no second message (see std::vector<double> below).
//
// Both forms may throw a `ddiloco::Error` for a value they cannot take (a
// framework tensor of the wrong dtype, say). ddiloco only ever calls the
// staged functions for the fragment being sent or applied.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include <ddiloco/error.hpp>

namespace ddiloco {

/// The adaptation point. Left undefined for types nobody adapted.
template <class T, class Enable = void>
struct tensor_traits;

namespace detail {
template <class T>
inline constexpr bool always_false = false;

template <class T>
concept has_traits = requires { sizeof(tensor_traits<T>); };
}  // namespace detail

/// A tensor whose fp32 elements can be viewed in place, without a copy.
template <class T>
concept HostTensor = detail::has_traits<std::remove_cvref_t<T>> &&
    requires(std::remove_cvref_t<T>& t, const std::remove_cvref_t<T>& ct) {
      { tensor_traits<std::remove_cvref_t<T>>::host_data(t) } -> std::same_as<std::span<float>>;
      { tensor_traits<std::remove_cvref_t<T>>::host_data(ct) } -> std::same_as<std::span<const float>>;
    };

/// A tensor that ddiloco reads and writes through host copies (device tensors).
template <class T>
concept StagedTensor = detail::has_traits<std::remove_cvref_t<T>> &&
    requires(std::remove_cvref_t<T>& t, const std::remove_cvref_t<T>& ct, std::span<float> dst,
             std::span<const float> src) {
      { tensor_traits<std::remove_cvref_t<T>>::size(ct) } -> std::convertible_to<std::size_t>;
      tensor_traits<std::remove_cvref_t<T>>::copy_to_host(ct, dst);
      tensor_traits<std::remove_cvref_t<T>>::copy_from_host(t, src);
    };

/// Any type ddiloco accepts as a model tensor.
template <class T>
concept Tensor = HostTensor<T> || StagedTensor<T>;

namespace detail {
/// A specialisation that exists only to reject a type with its own message
/// (it declares `static constexpr bool rejected = true;`).
template <class T>
concept rejected_tensor = has_traits<T> && requires { tensor_traits<T>::rejected; };

/// Fails compilation with a message that names the problem when T is not a
/// tensor; returns Tensor<T> so that callers can skip their body and add no
/// further errors after that message.
template <class T>
constexpr bool require_tensor() {
  using U = std::remove_cvref_t<T>;
  static_assert(has_traits<U>,
                "ddiloco: this type is not an adapted tensor. ddiloco works on contiguous fp32 "
                "storage: include the adapter header for your library (<ddiloco/adapters/eigen.hpp>, "
                "<ddiloco/adapters/xtensor.hpp>) or specialise ddiloco::tensor_traits<T> "
                "(see <ddiloco/tensor.hpp>).");
  static_assert(!has_traits<U> || rejected_tensor<U> || Tensor<T>,
                "ddiloco: tensor_traits<T> is specialised but provides neither the host form "
                "(host_data) nor the staged form (size, copy_to_host, copy_from_host).");
  return Tensor<T>;
}

/// Throws ShapeMismatch unless a host buffer has exactly the tensor's size.
inline void check_buffer_size(const char* what, std::size_t buffer, std::size_t tensor) {
  if (buffer != tensor) {
    throw ShapeMismatch(msg("ddiloco::", what, ": the host buffer has ", buffer,
                            " elements but the tensor has ", tensor,
                            "; pass a buffer of exactly tensor_size(t) elements."));
  }
}
}  // namespace detail

/// Number of fp32 elements in `t`.
template <class T>
std::size_t tensor_size(const T& t) {
  if constexpr (!detail::require_tensor<T>()) {
    return 0;
  } else if constexpr (HostTensor<T>) {
    return tensor_traits<std::remove_cvref_t<T>>::host_data(t).size();
  } else {
    return static_cast<std::size_t>(tensor_traits<std::remove_cvref_t<T>>::size(t));
  }
}

/// Copies the elements of `t` into `dst`. Throws ShapeMismatch unless
/// dst.size() == tensor_size(t).
template <class T>
void read_tensor(const T& t, std::span<float> dst) {
  if constexpr (!detail::require_tensor<T>()) {
    return;
  } else if constexpr (HostTensor<T>) {
    auto src = tensor_traits<std::remove_cvref_t<T>>::host_data(t);
    detail::check_buffer_size("read_tensor", dst.size(), src.size());
    std::copy(src.begin(), src.end(), dst.begin());
  } else {
    detail::check_buffer_size("read_tensor", dst.size(), tensor_size(t));
    tensor_traits<std::remove_cvref_t<T>>::copy_to_host(t, dst);
  }
}

/// Overwrites the elements of `t` with `src`. Throws ShapeMismatch unless
/// src.size() == tensor_size(t).
template <class T>
void write_tensor(T& t, std::span<const float> src) {
  static_assert(!std::is_const_v<T>,
                "ddiloco::write_tensor: the tensor is const; pass the mutable model tensor.");
  if constexpr (!detail::require_tensor<T>()) {
    return;
  } else if constexpr (HostTensor<T>) {
    auto dst = tensor_traits<std::remove_cvref_t<T>>::host_data(t);
    detail::check_buffer_size("write_tensor", src.size(), dst.size());
    std::copy(src.begin(), src.end(), dst.begin());
  } else {
    detail::check_buffer_size("write_tensor", src.size(), tensor_size(t));
    tensor_traits<std::remove_cvref_t<T>>::copy_from_host(t, src);
  }
}

/// In-place view of a host tensor's elements (no copy).
template <HostTensor T>
std::span<float> host_view(T& t) {
  return tensor_traits<std::remove_cvref_t<T>>::host_data(t);
}
template <HostTensor T>
std::span<const float> host_view(const T& t) {
  return tensor_traits<std::remove_cvref_t<T>>::host_data(t);
}

// ---- Standard library adapters ------------------------------------------

template <class Alloc>
struct tensor_traits<std::vector<float, Alloc>> {
  static std::span<float> host_data(std::vector<float, Alloc>& v) { return {v.data(), v.size()}; }
  static std::span<const float> host_data(const std::vector<float, Alloc>& v) {
    return {v.data(), v.size()};
  }
};

template <std::size_t Extent>
struct tensor_traits<std::span<float, Extent>> {
  static std::span<float> host_data(std::span<float, Extent>& s) { return s; }
  static std::span<const float> host_data(const std::span<float, Extent>& s) { return s; }
};

/// A span of const float is read-only: ddiloco writes merged parameters back.
template <std::size_t Extent>
struct tensor_traits<std::span<const float, Extent>> {
  static_assert(detail::always_false<std::span<const float, Extent>>,
                "ddiloco: std::span<const float> is read-only. ddiloco writes merged parameters "
                "back into every tensor: pass a std::span<float> over the mutable buffer.");
  static constexpr bool rejected = true;
};

/// Vectors of another element type are rejected with a message naming the problem.
template <class U, class Alloc>
  requires(!std::same_as<U, float>)
struct tensor_traits<std::vector<U, Alloc>> {
  static_assert(detail::always_false<U>,
                "ddiloco: std::vector<T> with T other than float is not fp32 storage; convert it to "
                "std::vector<float> first.");
  static constexpr bool rejected = true;
};

}  // namespace ddiloco
