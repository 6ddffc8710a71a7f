// ddiloco/adapters/eigen.hpp: Eigen dense objects as ddiloco tensors.
//
// What it is: a host-form `ddiloco::tensor_traits` for every Eigen object whose
// fp32 coefficients sit in one contiguous block of memory, so ddiloco reads and
// writes them in place, without a copy (see <ddiloco/tensor.hpp>):
//   - plain objects: `Eigen::Matrix<float, R, C, Options>` and
//     `Eigen::Array<float, R, C, Options>` of any fixed or dynamic size, column-
//     or row-major (VectorXf, RowVectorXf, MatrixXf, Matrix4f, ArrayXXf, ...);
//   - `Eigen::Map<P, O, S>` and `Eigen::Ref<P, O, S>` over such a plain type P
//     whose stride type S has inner stride 1 (or the default) and the default
//     outer stride, or any outer stride when P is a vector at compile time
//     (a vector has no outer dimension). `Ref<VectorXf>` qualifies;
//     `Ref<MatrixXf>` does not (its default `OuterStride<>` may be a block).
// The flat order ddiloco sees is the STORAGE order: column by column for a
// column-major object, row by row for a row-major one. A tensor must keep the
// same storage order on every learner and on the syncer.
//
// What it is not: a way to feed expressions. Any other Eigen type is rejected at
// compile time with a message that names the problem:
//   - a Scalar other than float (double, int, complex): "Scalar type is not float";
//   - an expression (`a + b`, `.transpose()`, a Block, a product) or a strided
//     Map/Ref: "not contiguous storage" (`.eval()` it into a VectorXf/MatrixXf or
//     map contiguous memory);
//   - a `Map<const P>` or `Ref<const P>`: "read-only". ddiloco writes merged
//     parameters back into every model tensor, so a tensor must be writable;
//     map the mutable buffer instead (`Eigen::Map<Eigen::VectorXf>`).
// Include this header only where Eigen is available; the core needs only the
// standard library.
#pragma once

#include <Eigen/Core>
#include <cstddef>
#include <span>
#include <type_traits>

#include <ddiloco/tensor.hpp>

namespace ddiloco {

namespace detail {

/// Any Eigen dense or sparse object (every one derives from EigenBase<itself>).
template <class T>
concept eigen_object = std::is_base_of_v<Eigen::EigenBase<T>, T>;

/// Matrix or Array: owns its coefficients, contiguous in storage order.
template <class T>
inline constexpr bool eigen_plain = std::is_base_of_v<Eigen::PlainObjectBase<T>, T>;

/// Map and Ref: a plain type P seen through a stride type S.
template <class T>
struct eigen_mapped : std::false_type {};
template <class P, int Options, class S>
struct eigen_mapped<Eigen::Map<P, Options, S>> : std::true_type {
  using plain = std::remove_const_t<P>;
  using stride = S;
  static constexpr bool read_only = std::is_const_v<P>;
};
template <class P, int Options, class S>
struct eigen_mapped<Eigen::Ref<P, Options, S>> : std::true_type {
  using plain = std::remove_const_t<P>;
  using stride = S;
  static constexpr bool read_only = std::is_const_v<P>;
};

/// A Map/Ref is contiguous when its inner stride is 1 (0 = "the default", which
/// is 1) and its outer stride is the default, or P has no outer dimension.
template <class T>
constexpr bool eigen_mapped_contiguous() {
  if constexpr (eigen_mapped<T>::value) {
    using S = typename eigen_mapped<T>::stride;
    using P = typename eigen_mapped<T>::plain;
    constexpr bool inner_ok = S::InnerStrideAtCompileTime == 0 || S::InnerStrideAtCompileTime == 1;
    constexpr bool outer_ok = S::OuterStrideAtCompileTime == 0 || P::IsVectorAtCompileTime;
    return eigen_plain<P> && inner_ok && outer_ok;
  } else {
    return false;
  }
}

template <class T>
inline constexpr bool eigen_contiguous = eigen_plain<T> || eigen_mapped_contiguous<T>();

template <class T>
constexpr bool eigen_read_only() {
  if constexpr (eigen_mapped<T>::value) {
    return eigen_mapped<T>::read_only;
  } else {
    return false;
  }
}

}  // namespace detail

/// Host form for every Eigen object (one specialisation for the whole family,
/// selected through the Enable parameter); the static_asserts turn every type
/// outside the supported set into a named compile error.
template <class T>
struct tensor_traits<T, std::enable_if_t<detail::eigen_object<T>>> {
  static_assert(std::is_same_v<typename T::Scalar, float>,
                "ddiloco: this Eigen object's Scalar type is not float. ddiloco works on fp32 "
                "storage: convert it with .template cast<float>() into an Eigen::VectorXf/MatrixXf "
                "that your model owns.");
  static_assert(!std::is_same_v<typename T::Scalar, float> || detail::eigen_contiguous<T>,
                "ddiloco: this Eigen object is not contiguous storage (an expression such as a + b, "
                ".transpose(), a Block, or a strided Map/Ref). .eval() it into an "
                "Eigen::VectorXf/MatrixXf, or use an Eigen::Map with no stride over contiguous "
                "memory.");
  static_assert(!std::is_same_v<typename T::Scalar, float> || !detail::eigen_contiguous<T> ||
                    !detail::eigen_read_only<T>(),
                "ddiloco: this Eigen Map/Ref is read-only (Map<const ...>). ddiloco writes merged "
                "parameters back into every tensor: map the mutable buffer instead, for example "
                "Eigen::Map<Eigen::VectorXf>.");

  /// True for the supported types; the bodies below are compiled only for them,
  /// so a rejected type gets the one message above and no follow-up errors.
  static constexpr bool supported = std::is_same_v<typename T::Scalar, float> &&
                                    detail::eigen_contiguous<T> && !detail::eigen_read_only<T>();

  static std::span<float> host_data(T& t) {
    if constexpr (supported) {
      return {t.data(), static_cast<std::size_t>(t.size())};
    } else {
      return {};
    }
  }
  static std::span<const float> host_data(const T& t) {
    if constexpr (supported) {
      return {t.data(), static_cast<std::size_t>(t.size())};
    } else {
      return {};
    }
  }
};

}  // namespace ddiloco
