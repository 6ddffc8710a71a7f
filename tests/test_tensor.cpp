// Tests for <ddiloco/tensor.hpp>: the tensor trait, its concepts, the standard
// library adapters, and, as the worked example for users, how to adapt a tensor
// type of your own in each of the two forms.
#include <catch2/catch.hpp>

#include <array>
#include <cstddef>
#include <list>
#include <memory>
#include <memory_resource>
#include <numeric>
#include <span>
#include <vector>

#include <ddiloco/tensor.hpp>

// ---------------------------------------------------------------------------
// Example: adapting your own tensor types.
//
// `demo::HostBlob` keeps its floats in host memory and hands out a pointer to
// them: it takes the HOST form, and ddiloco reads and writes it in place.
//
// `demo::DeviceBuffer` stands for an accelerator tensor: its storage is private
// and only reachable through explicit copies (here they count themselves). It
// takes the STAGED form, and ddiloco copies through a host buffer.
// ---------------------------------------------------------------------------
namespace demo {

class HostBlob {
 public:
  explicit HostBlob(std::size_t count) : count_(count), values_(new float[count]()) {}
  float* values() { return values_.get(); }
  const float* values() const { return values_.get(); }
  std::size_t count() const { return count_; }

 private:
  std::size_t count_;
  std::unique_ptr<float[]> values_;
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t length) : memory_(length, 0.0f) {}
  std::size_t length() const { return memory_.size(); }
  void download(float* dst) const {
    ++downloads_;
    std::copy(memory_.begin(), memory_.end(), dst);
  }
  void upload(const float* src) {
    ++uploads_;
    std::copy(src, src + memory_.size(), memory_.begin());
  }
  int downloads() const { return downloads_; }
  int uploads() const { return uploads_; }

 private:
  std::vector<float> memory_;  // "device memory": no pointer to it ever leaves the class
  mutable int downloads_ = 0;
  int uploads_ = 0;
};

}  // namespace demo

namespace ddiloco {

// Host form: two host_data overloads returning in-place views.
template <>
struct tensor_traits<demo::HostBlob> {
  static std::span<float> host_data(demo::HostBlob& t) { return {t.values(), t.count()}; }
  static std::span<const float> host_data(const demo::HostBlob& t) {
    return {t.values(), t.count()};
  }
};

// Staged form: the element count and the two copies.
template <>
struct tensor_traits<demo::DeviceBuffer> {
  static std::size_t size(const demo::DeviceBuffer& t) { return t.length(); }
  static void copy_to_host(const demo::DeviceBuffer& t, std::span<float> dst) {
    t.download(dst.data());
  }
  static void copy_from_host(demo::DeviceBuffer& t, std::span<const float> src) {
    t.upload(src.data());
  }
};

}  // namespace ddiloco

// --------------------------------------------------------------------------
// Concepts: which types are tensors, and in which form.
// --------------------------------------------------------------------------
namespace {
struct Unadapted {};
struct Misadapted {};  // a specialisation that provides neither form
}  // namespace
template <>
struct ddiloco::tensor_traits<Misadapted> {};

static_assert(ddiloco::HostTensor<std::vector<float>>);
static_assert(ddiloco::HostTensor<std::span<float>>);
static_assert(ddiloco::HostTensor<std::span<float, 4>>);
static_assert(ddiloco::HostTensor<demo::HostBlob>);
static_assert(ddiloco::HostTensor<const demo::HostBlob&>);  // cv-ref qualifiers are ignored
static_assert(!ddiloco::StagedTensor<demo::HostBlob>);
static_assert(ddiloco::StagedTensor<demo::DeviceBuffer>);
static_assert(!ddiloco::HostTensor<demo::DeviceBuffer>);
static_assert(ddiloco::Tensor<demo::HostBlob>);
static_assert(ddiloco::Tensor<demo::DeviceBuffer>);
static_assert(!ddiloco::Tensor<Unadapted>);
static_assert(!ddiloco::Tensor<Misadapted>);
static_assert(!ddiloco::Tensor<float>);
static_assert(!ddiloco::Tensor<float*>);
static_assert(!ddiloco::Tensor<std::list<float>>);      // not contiguous
static_assert(!ddiloco::Tensor<std::array<float, 3>>);  // not adapted (use a std::span over it)

// Fills a tensor of each adapted type with `n` elements.
namespace {
template <class T>
T make_tensor(std::size_t n) {
  return T(n);
}
std::vector<float> iota_values(std::size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}
}  // namespace

TEMPLATE_TEST_CASE("An adapted tensor round-trips its values through write_tensor and read_tensor",
                   "[tensor]", std::vector<float>, demo::HostBlob, demo::DeviceBuffer) {
  TestType t = make_tensor<TestType>(5);
  REQUIRE(ddiloco::tensor_size(t) == 5);

  const std::vector<float> in{1.5f, -2.0f, 0.0f, 3.25f, 1e-7f};
  ddiloco::write_tensor(t, in);
  std::vector<float> out(5, 99.0f);
  ddiloco::read_tensor(t, out);
  CHECK(out == in);

  // A second write replaces every element.
  const std::vector<float> again = iota_values(5, 10.0f);  // 10, 11, 12, 13, 14
  ddiloco::write_tensor(t, again);
  ddiloco::read_tensor(t, out);
  CHECK(out == std::vector<float>{10.0f, 11.0f, 12.0f, 13.0f, 14.0f});
}

TEMPLATE_TEST_CASE("A buffer of the wrong size is rejected with ShapeMismatch naming both sizes",
                   "[tensor]", std::vector<float>, demo::HostBlob, demo::DeviceBuffer) {
  TestType t = make_tensor<TestType>(4);
  std::vector<float> three(3);
  std::vector<float> five(5);
  CHECK_THROWS_AS(ddiloco::read_tensor(t, three), ddiloco::ShapeMismatch);
  CHECK_THROWS_WITH(ddiloco::read_tensor(t, three),
                    Catch::Contains("3 elements") && Catch::Contains("has 4"));
  CHECK_THROWS_AS(ddiloco::write_tensor(t, five), ddiloco::ShapeMismatch);
  CHECK_THROWS_WITH(ddiloco::write_tensor(t, five),
                    Catch::Contains("5 elements") && Catch::Contains("has 4"));
  CHECK_THROWS_AS(ddiloco::write_tensor(t, std::span<const float>{}), ddiloco::ShapeMismatch);
}

TEST_CASE("A tensor of size zero round-trips an empty buffer", "[tensor]") {
  std::vector<float> v;
  demo::DeviceBuffer d(0);
  CHECK(ddiloco::tensor_size(v) == 0);
  CHECK(ddiloco::tensor_size(d) == 0);
  CHECK_NOTHROW(ddiloco::write_tensor(v, std::span<const float>{}));
  CHECK_NOTHROW(ddiloco::read_tensor(d, std::span<float>{}));
}

TEST_CASE("A std::span<float> tensor writes through to the memory it views", "[tensor]") {
  std::array<float, 4> storage{1.0f, 2.0f, 3.0f, 4.0f};
  std::span<float> s(storage);
  CHECK(ddiloco::tensor_size(s) == 4);

  std::vector<float> out(4);
  ddiloco::read_tensor(s, out);
  CHECK(out == std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f});

  const std::vector<float> in{-1.0f, -2.0f, -3.0f, -4.0f};
  ddiloco::write_tensor(s, in);
  CHECK(storage == std::array<float, 4>{-1.0f, -2.0f, -3.0f, -4.0f});

  // A fixed-extent span works the same way.
  std::span<float, 4> fixed(storage);
  CHECK(ddiloco::tensor_size(fixed) == 4);
  CHECK(ddiloco::host_view(fixed).data() == storage.data());
}

TEST_CASE("host_view of a host tensor is the tensor's own memory, not a copy", "[tensor]") {
  std::vector<float> v{1.0f, 2.0f, 3.0f};
  auto view = ddiloco::host_view(v);
  CHECK(view.data() == v.data());
  CHECK(view.size() == 3);
  view[1] = 20.0f;  // writing through the view changes the tensor
  CHECK(v[1] == 20.0f);

  const std::vector<float>& cv = v;
  std::span<const float> cview = ddiloco::host_view(cv);
  CHECK(cview.data() == v.data());

  demo::HostBlob blob(2);
  CHECK(ddiloco::host_view(blob).data() == blob.values());
}

TEST_CASE("A staged tensor is copied exactly once per read or write and never by tensor_size",
          "[tensor]") {
  demo::DeviceBuffer d(3);
  CHECK(ddiloco::tensor_size(d) == 3);
  CHECK(d.downloads() == 0);
  CHECK(d.uploads() == 0);

  const std::vector<float> in{7.0f, 8.0f, 9.0f};
  ddiloco::write_tensor(d, in);
  CHECK(d.uploads() == 1);
  CHECK(d.downloads() == 0);

  std::vector<float> out(3);
  ddiloco::read_tensor(d, out);
  CHECK(d.downloads() == 1);
  CHECK(d.uploads() == 1);
  CHECK(out == in);

  // A buffer of the wrong size is rejected before any copy is attempted.
  std::vector<float> wrong(2);
  CHECK_THROWS_AS(ddiloco::read_tensor(d, wrong), ddiloco::ShapeMismatch);
  CHECK(d.downloads() == 1);
}

TEST_CASE("A vector with its own allocator is a host tensor too", "[tensor]") {
  // The adapter is written over std::vector<float, Alloc>, not only the default allocator.
  static_assert(ddiloco::HostTensor<std::pmr::vector<float>>);
  std::pmr::vector<float> v(2);
  const std::vector<float> in{4.0f, 5.0f};
  ddiloco::write_tensor(v, in);
  CHECK(v[0] == 4.0f);
  CHECK(v[1] == 5.0f);
}
