// Tests for <ddiloco/adapters/xtensor.hpp>: row-major xtensor containers as
// host-form tensors, read and written in place, flattened in row-major order.
#include <catch2/catch.hpp>

#include <array>
#include <cstddef>
#include <vector>
#include <xtensor/xadapt.hpp>
#include <xtensor/xarray.hpp>
#include <xtensor/xfixed.hpp>
#include <xtensor/xtensor.hpp>

#include <ddiloco/adapters/xtensor.hpp>

// Accepted types: float containers with the (default) row-major layout and the
// adaptors over mutable user buffers.
static_assert(ddiloco::HostTensor<xt::xtensor<float, 1>>);
static_assert(ddiloco::HostTensor<xt::xtensor<float, 3>>);
static_assert(ddiloco::HostTensor<xt::xarray<float>>);
static_assert(ddiloco::HostTensor<xt::xtensor_fixed<float, xt::xshape<2, 3>>>);
static_assert(ddiloco::HostTensor<const xt::xtensor<float, 2>&>);
static_assert(!ddiloco::StagedTensor<xt::xarray<float>>);
// Rejected types (views, column-major, double) are hard compile errors with a
// message, pinned by tests/compile_fail/tensor_xtensor_*.cpp.

namespace {
template <class T>
T make_2x3() {
  if constexpr (std::is_same_v<T, xt::xarray<float>>) {
    return xt::xarray<float>::from_shape({2, 3});
  } else if constexpr (std::is_same_v<T, xt::xtensor<float, 2>>) {
    return xt::xtensor<float, 2>::from_shape({2, 3});
  } else {
    return T{};  // fixed shape 2 x 3
  }
}
}  // namespace

TEMPLATE_TEST_CASE("An xtensor float container round-trips its values through ddiloco",
                   "[xtensor]", (xt::xtensor<float, 2>), xt::xarray<float>,
                   (xt::xtensor_fixed<float, xt::xshape<2, 3>>)) {
  TestType t = make_2x3<TestType>();
  REQUIRE(ddiloco::tensor_size(t) == 6);
  const std::vector<float> in{1.0f, -2.0f, 3.5f, 0.0f, 1e-3f, 42.0f};
  ddiloco::write_tensor(t, in);
  std::vector<float> out(6, -1.0f);
  ddiloco::read_tensor(t, out);
  CHECK(out == in);
  CHECK(ddiloco::host_view(t).data() == t.data());  // zero copy
}

TEST_CASE("An xtensor container flattens in row-major order", "[xtensor]") {
  xt::xtensor<float, 2> t = {{1, 2, 3}, {4, 5, 6}};
  std::vector<float> out(6);
  ddiloco::read_tensor(t, out);
  CHECK(out == std::vector<float>{1, 2, 3, 4, 5, 6});

  const std::vector<float> in{10, 20, 30, 40, 50, 60};
  ddiloco::write_tensor(t, in);
  CHECK(t(0, 2) == 30.0f);
  CHECK(t(1, 0) == 40.0f);

  // Three dimensions: the last index moves fastest, element (i, j, k) is at 4i + 2j + k.
  xt::xarray<float> cube = xt::xarray<float>::from_shape({2, 2, 2});
  ddiloco::write_tensor(cube, std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(cube(1, 0, 1) == 5.0f);
  CHECK(cube(0, 1, 1) == 3.0f);
}

TEST_CASE("host_view of an xtensor container is its own storage (no copy)", "[xtensor]") {
  xt::xarray<float> a = xt::zeros<float>({3, 4});
  auto view = ddiloco::host_view(a);
  CHECK(view.data() == a.data());
  CHECK(view.size() == 12);
  view[6] = 9.0f;  // row-major: element 6 is (row 1, col 2)
  CHECK(a(1, 2) == 9.0f);

  const xt::xtensor<float, 1> v = {1.0f, 2.0f};
  std::span<const float> cview = ddiloco::host_view(v);
  CHECK(cview.data() == v.data());
}

TEST_CASE("xt::adapt over a user buffer reads and writes that buffer in place", "[xtensor]") {
  std::array<float, 6> buffer{1, 2, 3, 4, 5, 6};
  const std::array<std::size_t, 2> shape{2, 3};
  auto adapted = xt::adapt(buffer.data(), buffer.size(), xt::no_ownership(), shape);
  static_assert(ddiloco::HostTensor<decltype(adapted)>);
  CHECK(ddiloco::tensor_size(adapted) == 6);
  CHECK(ddiloco::host_view(adapted).data() == buffer.data());

  const std::vector<float> in{-1, -2, -3, -4, -5, -6};
  ddiloco::write_tensor(adapted, in);
  CHECK(buffer == std::array<float, 6>{-1, -2, -3, -4, -5, -6});
  CHECK(adapted(1, 0) == -4.0f);
}
