// ddiloco/adapters/xtensor.hpp: xtensor containers as ddiloco tensors.
//
// What it is: a host-form `ddiloco::tensor_traits` for xtensor CONTAINERS of
// float with a row-major static layout, so ddiloco reads and writes them in
// place, without a copy (see <ddiloco/tensor.hpp>):
//   - `xt::xtensor<float, N>`, `xt::xarray<float>`, `xt::xtensor_fixed<float, S>`
//     (default layout row_major);
//   - the adaptors over user buffers, `xt::adapt(float*, ...)`
//     (`xt::xtensor_adaptor`, `xt::xarray_adaptor`), which ddiloco sees as the
//     user's own memory.
// Every xtensor container keeps its elements in one contiguous buffer starting
// at data(); with the row_major layout the flat order ddiloco sees is the
// row-major (C) order of the shape, the same on every process.
//
// What it is not: a way to feed expressions or views. Any other xtensor type is
// rejected at compile time with a message that names the problem:
//   - a value_type other than float: "value_type is not float";
//   - a view or expression (xt::view, xt::strided_view, xt::transpose, a + b):
//     "not a container" (evaluate it into an xt::xtensor<float, N> first);
//   - a container whose layout is column_major or dynamic: "not row-major"
//     (its flat order would depend on the layout, not on the shape);
//   - an adaptor over const memory: "read-only" (ddiloco writes merged
//     parameters back into every tensor).
// Include this header only where xtensor is available.
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>
#include <xtensor/xcontainer.hpp>
#include <xtensor/xexpression.hpp>
#include <xtensor/xlayout.hpp>

#include <ddiloco/tensor.hpp>

namespace ddiloco {

namespace detail {

/// Any xtensor expression (containers, views, functions) derives from xexpression<itself>.
template <class T>
concept xt_expression = xt::is_xexpression<T>::value;

/// Containers and container adaptors own (or adopt) one contiguous buffer.
template <class T>
inline constexpr bool xt_container = std::is_base_of_v<xt::xcontainer<T>, T>;

template <class T>
constexpr bool xt_row_major() {
  if constexpr (xt_container<T>) {
    return T::static_layout == xt::layout_type::row_major;
  } else {
    return false;
  }
}

template <class T>
constexpr bool xt_writable() {
  if constexpr (xt_container<T>) {
    return std::is_same_v<decltype(std::declval<T&>().data()), float*>;
  } else {
    return false;
  }
}

}  // namespace detail

/// Host form for every xtensor expression (one specialisation for the family,
/// selected through the Enable parameter); the static_asserts turn every type
/// outside the supported set into a named compile error.
template <class T>
struct tensor_traits<T, std::enable_if_t<detail::xt_expression<T>>> {
  static constexpr bool is_float = std::is_same_v<std::remove_cv_t<typename T::value_type>, float>;
  static_assert(is_float,
                "ddiloco: this xtensor expression's value_type is not float. ddiloco works on fp32 "
                "storage: convert it with xt::cast<float>(...) into an xt::xtensor<float, N>.");
  static_assert(!is_float || detail::xt_container<T>,
                "ddiloco: this xtensor type is a view or expression, not a container "
                "(xt::view, xt::strided_view, xt::transpose, a + b), so it is not contiguous "
                "storage. Evaluate it into an xt::xtensor<float, N> / xt::xarray<float> first.");
  static_assert(!is_float || !detail::xt_container<T> || detail::xt_row_major<T>(),
                "ddiloco: this xtensor container is not row-major (layout column_major or "
                "dynamic). ddiloco flattens tensors in row-major order: use the default "
                "xt::layout_type::row_major.");
  static_assert(!is_float || !detail::xt_container<T> || !detail::xt_row_major<T>() ||
                    detail::xt_writable<T>(),
                "ddiloco: this xtensor adaptor is read-only (it adapts const memory). ddiloco "
                "writes merged parameters back into every tensor: adapt the mutable buffer.");

  /// True for the supported types; the bodies below are compiled only for them,
  /// so a rejected type gets the one message above and no follow-up errors.
  static constexpr bool supported = is_float && detail::xt_container<T> &&
                                    detail::xt_row_major<T>() && detail::xt_writable<T>();

  static std::span<float> host_data(T& t) {
    if constexpr (supported) {
      return {t.data(), t.size()};
    } else {
      return {};
    }
  }
  static std::span<const float> host_data(const T& t) {
    if constexpr (supported) {
      return {t.data(), t.size()};
    } else {
      return {};
    }
  }
};

}  // namespace ddiloco
