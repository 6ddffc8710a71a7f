// Tests for <ddiloco/adapters/eigen.hpp>: Eigen dense objects as host-form
// tensors, read and written in place, flattened in storage order.
#include <catch2/catch.hpp>

#include <Eigen/Core>
#include <array>
#include <cstddef>
#include <vector>

#include <ddiloco/adapters/eigen.hpp>

// Accepted types: plain float objects of every shape and storage order, and
// Maps/Refs with unit inner stride and no outer-stride gaps.
static_assert(ddiloco::HostTensor<Eigen::VectorXf>);
static_assert(ddiloco::HostTensor<Eigen::RowVectorXf>);
static_assert(ddiloco::HostTensor<Eigen::MatrixXf>);
static_assert(ddiloco::HostTensor<Eigen::Matrix4f>);
static_assert(ddiloco::HostTensor<Eigen::Matrix<float, 3, 5, Eigen::RowMajor>>);
static_assert(ddiloco::HostTensor<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>);
static_assert(ddiloco::HostTensor<Eigen::ArrayXXf>);
static_assert(ddiloco::HostTensor<Eigen::Map<Eigen::VectorXf>>);
static_assert(ddiloco::HostTensor<Eigen::Map<Eigen::MatrixXf>>);
static_assert(ddiloco::HostTensor<Eigen::Map<Eigen::MatrixXf, Eigen::Aligned16>>);
static_assert(ddiloco::HostTensor<Eigen::Map<Eigen::VectorXf, 0, Eigen::InnerStride<1>>>);
static_assert(ddiloco::HostTensor<Eigen::Map<Eigen::VectorXf, 0, Eigen::OuterStride<>>>);  // vector: no outer dimension
static_assert(ddiloco::HostTensor<Eigen::Ref<Eigen::VectorXf>>);
static_assert(ddiloco::HostTensor<const Eigen::MatrixXf&>);
static_assert(!ddiloco::StagedTensor<Eigen::MatrixXf>);
// Rejected types (double scalars, expressions, strided maps, const maps) are
// hard compile errors with a message, pinned by tests/compile_fail/eigen_*.cpp.

TEMPLATE_TEST_CASE("An Eigen float object round-trips its values through ddiloco", "[eigen]",
                   Eigen::VectorXf, Eigen::RowVectorXf, Eigen::MatrixXf,
                   (Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>),
                   Eigen::ArrayXXf) {
  TestType t;
  if constexpr (TestType::IsVectorAtCompileTime) {
    t.resize(6);
  } else {
    t.resize(2, 3);
  }
  REQUIRE(ddiloco::tensor_size(t) == 6);
  const std::vector<float> in{1.0f, -2.0f, 3.5f, 0.0f, 1e-3f, 42.0f};
  ddiloco::write_tensor(t, in);
  std::vector<float> out(6, -1.0f);
  ddiloco::read_tensor(t, out);
  CHECK(out == in);
}

TEST_CASE("host_view of an Eigen object is its own storage (no copy)", "[eigen]") {
  Eigen::MatrixXf m = Eigen::MatrixXf::Zero(3, 4);
  auto view = ddiloco::host_view(m);
  CHECK(view.data() == m.data());
  CHECK(view.size() == 12);
  view[5] = 7.0f;  // column-major: element 5 is (row 2, col 1)
  CHECK(m(2, 1) == 7.0f);

  Eigen::Matrix3f fixed = Eigen::Matrix3f::Zero();
  CHECK(ddiloco::host_view(fixed).data() == fixed.data());
  CHECK(ddiloco::host_view(fixed).size() == 9);

  const Eigen::VectorXf v = Eigen::VectorXf::LinSpaced(4, 0.0f, 3.0f);
  std::span<const float> cview = ddiloco::host_view(v);
  CHECK(cview.data() == v.data());
}

TEST_CASE("A column-major matrix flattens column by column", "[eigen]") {
  Eigen::MatrixXf m(2, 3);
  m << 1, 2, 3,  //
      4, 5, 6;
  std::vector<float> out(6);
  ddiloco::read_tensor(m, out);
  CHECK(out == std::vector<float>{1, 4, 2, 5, 3, 6});
}

TEST_CASE("A row-major matrix flattens row by row", "[eigen]") {
  Eigen::Matrix<float, 2, 3, Eigen::RowMajor> m;
  m << 1, 2, 3,  //
      4, 5, 6;
  std::vector<float> out(6);
  ddiloco::read_tensor(m, out);
  CHECK(out == std::vector<float>{1, 2, 3, 4, 5, 6});

  // Writing follows the same order.
  const std::vector<float> in{10, 20, 30, 40, 50, 60};
  ddiloco::write_tensor(m, in);
  CHECK(m(0, 2) == 30.0f);
  CHECK(m(1, 0) == 40.0f);
}

TEST_CASE("An Eigen::Map over a user buffer reads and writes that buffer in place", "[eigen]") {
  std::array<float, 6> buffer{1, 2, 3, 4, 5, 6};
  Eigen::Map<Eigen::MatrixXf> map(buffer.data(), 2, 3);
  CHECK(ddiloco::tensor_size(map) == 6);
  CHECK(ddiloco::host_view(map).data() == buffer.data());

  std::vector<float> out(6);
  ddiloco::read_tensor(map, out);
  CHECK(out == std::vector<float>{1, 2, 3, 4, 5, 6});

  const std::vector<float> in{-1, -2, -3, -4, -5, -6};
  ddiloco::write_tensor(map, in);
  CHECK(buffer == std::array<float, 6>{-1, -2, -3, -4, -5, -6});
  CHECK(map(1, 2) == -6.0f);  // column-major map: (1, 2) is element 1 + 2 * 2 = 5

  // A const Map object (not a Map<const ...>) is still readable.
  const Eigen::Map<Eigen::MatrixXf>& cmap = map;
  ddiloco::read_tensor(cmap, out);
  CHECK(out == in);
}

TEST_CASE("A Map or Ref over a vector with an outer stride is still contiguous", "[eigen]") {
  std::array<float, 4> buffer{1, 2, 3, 4};
  Eigen::Map<Eigen::VectorXf, 0, Eigen::OuterStride<>> map(buffer.data(), 4, Eigen::OuterStride<>(100));
  CHECK(ddiloco::host_view(map).data() == buffer.data());
  CHECK(ddiloco::tensor_size(map) == 4);

  Eigen::VectorXf v = Eigen::VectorXf::Zero(3);
  Eigen::Ref<Eigen::VectorXf> ref(v);
  const std::vector<float> in{7, 8, 9};
  ddiloco::write_tensor(ref, in);
  CHECK(v(0) == 7.0f);
  CHECK(v(2) == 9.0f);
  CHECK(ddiloco::host_view(ref).data() == v.data());
}
