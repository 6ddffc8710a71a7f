// Tests for <ddiloco/merge.hpp>: WeightedAverage and RadialDirectional (RDA)
// against hand-computed values, their documented edge cases, errors and memory.
#include <ddiloco/merge.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

using Catch::Matchers::Contains;
using ddiloco::RadialDirectional;
using ddiloco::TensorSegment;
using ddiloco::WeightedAverage;

static_assert(ddiloco::MergeRule<WeightedAverage>);
static_assert(ddiloco::MergeRule<RadialDirectional>);
static_assert(!ddiloco::MergeRule<int>);
namespace {
struct NoResetAccumulator {
  void add(std::span<const float>, double) {}
  std::size_t count() const { return 0; }
  double total_weight() const { return 0; }
  void finish(std::span<float>) const {}
};
}  // namespace
struct RuleWithoutReset {
  static constexpr std::string_view name = "no_reset";
  using Accumulator = NoResetAccumulator;
  Accumulator make_accumulator(std::span<const TensorSegment>) const { return {}; }
};
static_assert(!ddiloco::MergeRule<RuleWithoutReset>, "requirement 6: reset is required");
struct RuleWithoutName {
  using Accumulator = WeightedAverage::Accumulator;
  Accumulator make_accumulator(std::span<const TensorSegment> l) const { return Accumulator(l); }
};
static_assert(!ddiloco::MergeRule<RuleWithoutName>, "requirement 1: a name is required");

namespace {

using Vec = std::vector<float>;

double norm_of(std::span<const float> x) {
  double s = 0.0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}

template <class Rule>
Vec merge(const Rule& rule, const std::vector<TensorSegment>& layout, const std::vector<Vec>& inputs,
          const std::vector<double>& weights) {
  auto acc = rule.make_accumulator(layout);
  for (std::size_t m = 0; m < inputs.size(); ++m) acc.add(inputs[m], weights[m]);
  Vec out(ddiloco::layout_size(layout));
  acc.finish(out);
  return out;
}

/// Contributions whose every tensor t has norm `norm` (Gaussian directions, so
/// nearly orthogonal for large tensors).
std::vector<Vec> random_inputs(const std::vector<TensorSegment>& layout, std::size_t count, double norm,
                               unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<Vec> out(count, Vec(ddiloco::layout_size(layout)));
  for (auto& v : out) {
    for (float& x : v) x = normal(gen);
    for (const auto& seg : layout) {
      auto t = std::span<float>(v).subspan(seg.offset, seg.size);
      const double scale = norm / norm_of(t);
      for (float& x : t) x = static_cast<float>(x * scale);
    }
  }
  return out;
}

std::vector<double> random_weights(std::size_t count, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> u(0.5, 20.0);
  std::vector<double> w(count);
  for (double& x : w) x = u(gen);
  return w;
}

double max_abs_diff(const Vec& a, const Vec& b) {
  double d = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(static_cast<double>(a[i]) - b[i]));
  return d;
}

double max_abs(const Vec& a) {
  double d = 0.0;
  for (float x : a) d = std::max(d, std::abs(static_cast<double>(x)));
  return d;
}

const std::vector<TensorSegment> kTwoTensors{{0, 2, false}, {2, 2, false}};

}  // namespace

TEST_CASE("Weighted average of a small two-tensor example matches hand values", "[merge]") {
  // v1 = [3, 4 | 1, 0] with w = 1, v2 = [0, 2 | 0, 2] with w = 3:
  // (1 v1 + 3 v2) / 4 = [0.75, 2.5 | 0.25, 1.5].
  const Vec out = merge(WeightedAverage{}, kTwoTensors, {{3, 4, 1, 0}, {0, 2, 0, 2}}, {1.0, 3.0});
  CHECK(out[0] == Approx(0.75).epsilon(1e-6));
  CHECK(out[1] == Approx(2.5).epsilon(1e-6));
  CHECK(out[2] == Approx(0.25).epsilon(1e-6));
  CHECK(out[3] == Approx(1.5).epsilon(1e-6));
}

TEST_CASE("RDA of a small two-tensor example matches hand values", "[merge][rda]") {
  // Same inputs. Tensor A: norms 5 and 2, mean norm (1*5 + 3*2)/4 = 2.75;
  // directions [0.6, 0.8] and [0, 1], mean direction [0.15, 0.95], whose norm
  // is sqrt(0.925). Tensor B: norms 1 and 2, mean norm 7/4 = 1.75; directions
  // [1, 0] and [0, 1], mean [0.25, 0.75], norm sqrt(0.625).
  const Vec out = merge(RadialDirectional{}, kTwoTensors, {{3, 4, 1, 0}, {0, 2, 0, 2}}, {1.0, 3.0});
  const double a = 2.75 / std::sqrt(0.925);
  const double b = 1.75 / std::sqrt(0.625);
  CHECK(out[0] == Approx(a * 0.15).epsilon(1e-6));
  CHECK(out[1] == Approx(a * 0.95).epsilon(1e-6));
  CHECK(out[2] == Approx(b * 0.25).epsilon(1e-6));
  CHECK(out[3] == Approx(b * 0.75).epsilon(1e-6));
  CHECK(norm_of(std::span<const float>(out).first(2)) == Approx(2.75).epsilon(1e-6));
  CHECK(norm_of(std::span<const float>(out).last(2)) == Approx(1.75).epsilon(1e-6));
}

TEST_CASE("RDA averages an embedding segment plainly", "[merge][rda]") {
  // The same example with tensor B flagged as an embedding: B is the plain
  // weighted average [0.25, 1.5], A is unchanged.
  const std::vector<TensorSegment> layout{{0, 2, false}, {2, 2, true}};
  const Vec out = merge(RadialDirectional{}, layout, {{3, 4, 1, 0}, {0, 2, 0, 2}}, {1.0, 3.0});
  const double a = 2.75 / std::sqrt(0.925);
  CHECK(out[0] == Approx(a * 0.15).epsilon(1e-6));
  CHECK(out[1] == Approx(a * 0.95).epsilon(1e-6));
  CHECK(out[2] == Approx(0.25).epsilon(1e-6));
  CHECK(out[3] == Approx(1.5).epsilon(1e-6));

  // On larger random inputs, the embedding segment equals WeightedAverage's.
  const std::vector<TensorSegment> big{{0, 300, true}, {300, 500, false}, {800, 200, false}};
  const auto inputs = random_inputs(big, 6, 2.0, 7);
  const auto weights = random_weights(6, 8);
  const Vec rda = merge(RadialDirectional{}, big, inputs, weights);
  const Vec avg = merge(WeightedAverage{}, big, inputs, weights);
  for (std::size_t i = 0; i < 300; ++i) REQUIRE(rda[i] == Approx(avg[i]).margin(1e-6));
  CHECK(norm_of(std::span<const float>(rda).subspan(300, 500)) == Approx(2.0).epsilon(1e-5));
  CHECK(norm_of(std::span<const float>(avg).subspan(300, 500)) < 1.5);  // the plain average shrinks
}

TEMPLATE_TEST_CASE("Identical inputs merge to that input", "[merge]", WeightedAverage, RadialDirectional) {
  const std::vector<TensorSegment> layout{{0, 100, false}, {100, 37, true}, {137, 63, false}};
  const Vec v = random_inputs(layout, 1, 3.5, 1)[0];
  const std::vector<Vec> inputs(5, v);
  const Vec out = merge(TestType{}, layout, inputs, {1.0, 2.0, 0.25, 10.0, 3.0});
  CHECK(max_abs_diff(out, v) <= 1e-6 * max_abs(v));
}

TEST_CASE("RDA keeps norm R for M inputs of norm R while the plain average shrinks like 1/sqrt(M)",
          "[merge][rda]") {
  const std::vector<TensorSegment> layout{{0, 4096, false}, {4096, 2048, false}};
  const double R = 0.8;
  for (std::size_t M : {1u, 2u, 4u, 8u, 16u, 64u}) {
    INFO("M = " << M);
    const auto inputs = random_inputs(layout, M, R, static_cast<unsigned>(100 + M));
    const std::vector<double> weights(M, 1.0);
    const Vec rda = merge(RadialDirectional{}, layout, inputs, weights);
    const Vec avg = merge(WeightedAverage{}, layout, inputs, weights);
    for (const auto& seg : layout) {
      const double rda_norm = norm_of(std::span<const float>(rda).subspan(seg.offset, seg.size));
      const double avg_norm = norm_of(std::span<const float>(avg).subspan(seg.offset, seg.size));
      CHECK(rda_norm == Approx(R).epsilon(1e-5));
      // Gaussian directions in >= 2048 dimensions have |cos| ~ 0.02, so the
      // plain average's norm is R / sqrt(M) to within a few percent.
      CHECK(avg_norm == Approx(R / std::sqrt(static_cast<double>(M))).epsilon(0.05));
    }
  }
}

TEMPLATE_TEST_CASE("The merged result does not depend on input order beyond fp32 rounding", "[merge]",
                   WeightedAverage, RadialDirectional) {
  const std::vector<TensorSegment> layout{{0, 50, true}, {50, 200, false}, {250, 7, false}};
  auto inputs = random_inputs(layout, 8, 1.0, 11);
  auto weights = random_weights(8, 12);
  const Vec reference = merge(TestType{}, layout, inputs, weights);
  std::vector<std::size_t> perm(8);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 gen(13);
  for (int trial = 0; trial < 10; ++trial) {
    std::shuffle(perm.begin(), perm.end(), gen);
    std::vector<Vec> in2;
    std::vector<double> w2;
    for (auto k : perm) {
      in2.push_back(inputs[k]);
      w2.push_back(weights[k]);
    }
    CHECK(max_abs_diff(merge(TestType{}, layout, in2, w2), reference) <= 1e-5 * max_abs(reference));
  }
}

TEMPLATE_TEST_CASE("Zero-weight contributions change nothing", "[merge]", WeightedAverage, RadialDirectional) {
  const std::vector<TensorSegment> layout{{0, 40, true}, {40, 60, false}};
  const auto inputs = random_inputs(layout, 4, 1.0, 21);
  const auto junk = random_inputs(layout, 4, 1e6, 22);
  const auto weights = random_weights(4, 23);

  auto clean = TestType{}.make_accumulator(layout);
  auto noisy = TestType{}.make_accumulator(layout);
  noisy.add(junk[0], 0.0);  // a zero-weight contribution first must not become the "first" one
  for (std::size_t m = 0; m < 4; ++m) {
    clean.add(inputs[m], weights[m]);
    noisy.add(inputs[m], weights[m]);
    noisy.add(junk[m], 0.0);
  }
  Vec a(100), b(100);
  clean.finish(a);
  noisy.finish(b);
  CHECK(a == b);
  CHECK(noisy.count() == 4);
  CHECK(noisy.total_weight() == clean.total_weight());
}

TEST_CASE("RDA counts a zero contribution in the weight and the mean norm but not the direction",
          "[merge][rda]") {
  // [3, 4] and [0, 0], equal weights: mean norm (5 + 0) / 2 = 2.5, direction
  // phi([0.6, 0.8] / 2) = [0.6, 0.8], so the result is [1.5, 2].
  const std::vector<TensorSegment> layout{{0, 2, false}};
  auto acc = RadialDirectional{}.make_accumulator(layout);
  acc.add(Vec{0, 0}, 1.0);  // first contribution is the zero one
  acc.add(Vec{3, 4}, 1.0);
  Vec out(2);
  acc.finish(out);
  CHECK(acc.count() == 2);
  CHECK(acc.total_weight() == 2.0);
  CHECK(out[0] == Approx(1.5).epsilon(1e-6));
  CHECK(out[1] == Approx(2.0).epsilon(1e-6));

  // Only zero contributions: the result is zero (phi(0) = 0, mean norm 0).
  const Vec zeros = merge(RadialDirectional{}, layout, {{0, 0}, {0, 0}}, {1.0, 2.0});
  CHECK(zeros == Vec{0, 0});
}

TEST_CASE("RDA outputs zero for a tensor whose directions cancel", "[merge][rda]") {
  const std::vector<TensorSegment> layout{{0, 2, false}};
  SECTION("two opposite directions of different norms") {
    const Vec out = merge(RadialDirectional{}, layout, {{3, 4}, {-0.6f, -0.8f}}, {2.0, 2.0});
    CHECK(out == Vec{0, 0});
  }
  SECTION("three directions 120 degrees apart (cancel only to within rounding)") {
    const float s = static_cast<float>(std::sqrt(3.0) / 2.0);
    const Vec out = merge(RadialDirectional{}, layout, {{1, 0}, {-0.5f, s}, {-0.5f, -s}}, {1.0, 1.0, 1.0});
    CHECK(out == Vec{0, 0});
  }
}

TEST_CASE("RDA handles a mixture of cancelling, zero, ordinary and embedding tensors", "[merge][rda]") {
  // Tensor A [0,2): directions cancel -> 0.
  // Tensor B [2,4): [0, 2], [0, 0], [0, 6] with weights 1, 1, 2: mean norm
  //   (2 + 0 + 12) / 4 = 3.5, direction [0, 1] -> [0, 3.5].
  // Tensor E [4,6) embedding: plain (1 [1, 1] + 1 [3, -1] + 2 [0, 0]) / 4 = [1, 0].
  const std::vector<TensorSegment> layout{{0, 2, false}, {2, 2, false}, {4, 2, true}};
  const std::vector<Vec> inputs{{1, 1, 0, 2, 1, 1}, {-1, -1, 0, 0, 3, -1}, {0, 0, 0, 6, 0, 0}};
  const Vec out = merge(RadialDirectional{}, layout, inputs, {1.0, 1.0, 2.0});
  // A: [1,1] and [-1,-1] cancel; the zero third contribution adds no direction.
  CHECK(out[0] == 0.0f);
  CHECK(out[1] == 0.0f);
  CHECK(out[2] == Approx(0.0).margin(1e-7));
  CHECK(out[3] == Approx(3.5).epsilon(1e-6));
  CHECK(out[4] == Approx(1.0).epsilon(1e-6));
  CHECK(out[5] == Approx(0.0).margin(1e-7));
}

TEMPLATE_TEST_CASE("Huge weights such as tokens^2/steps do not overflow", "[merge]", WeightedAverage,
                   RadialDirectional) {
  const std::vector<TensorSegment> layout{{0, 2, false}};
  // Weights 1e30 and 3e30: the weighted sum would overflow fp32 (max 3.4e38) for v ~ 1e9.
  const Vec out = merge(TestType{}, layout, {{2e9f, 0}, {2e9f, 0}}, {1e30, 3e30});
  CHECK(out[0] == Approx(2e9).epsilon(1e-6));
  CHECK(out[1] == 0.0f);
}

TEMPLATE_TEST_CASE("Finish leaves the accumulator unchanged and reset starts a fresh round", "[merge]",
                   WeightedAverage, RadialDirectional) {
  const std::vector<TensorSegment> layout{{0, 30, false}, {30, 10, true}};
  const auto round1 = random_inputs(layout, 3, 5.0, 31);
  const auto round2 = random_inputs(layout, 4, 0.5, 32);
  const auto w = random_weights(4, 33);
  auto acc = TestType{}.make_accumulator(layout);
  for (std::size_t m = 0; m < 3; ++m) acc.add(round1[m], w[m]);
  Vec first(40), second(40);
  acc.finish(first);
  acc.finish(second);
  CHECK(first == second);

  acc.reset();
  CHECK(acc.count() == 0);
  CHECK(acc.total_weight() == 0.0);
  CHECK_THROWS_AS(acc.finish(first), ddiloco::StateError);
  for (std::size_t m = 0; m < 4; ++m) acc.add(round2[m], w[m]);
  Vec reused(40);
  acc.finish(reused);
  CHECK(reused == merge(TestType{}, layout, round2, w));
}

TEMPLATE_TEST_CASE("Accumulator memory does not grow with the number of contributions", "[merge]",
                   WeightedAverage, RadialDirectional) {
  const std::vector<TensorSegment> layout{{0, 1000, true}, {1000, 3000, false}, {4000, 96, false}};
  const auto inputs = random_inputs(layout, 4, 1.0, 41);
  auto acc = TestType{}.make_accumulator(layout);
  const std::size_t before = acc.memory_bytes();
  // O(fragment) floats + O(tensors) scalars: 4096 floats, 3 segments, 3 doubles.
  CHECK(before <= 4096 * sizeof(float) + 3 * (sizeof(TensorSegment) + sizeof(double)));
  CHECK(before >= 4096 * sizeof(float));
  for (int k = 0; k < 1000; ++k) acc.add(inputs[static_cast<std::size_t>(k) % 4], 1.0 + k % 7);
  CHECK(acc.count() == 1000);
  CHECK(acc.memory_bytes() == before);
}

TEMPLATE_TEST_CASE("Accumulators count positive-weight contributions and sum their weights", "[merge]",
                   WeightedAverage, RadialDirectional) {
  const std::vector<TensorSegment> layout{{0, 3, false}};
  auto acc = TestType{}.make_accumulator(layout);
  acc.add(Vec{1, 2, 3}, 2.5);
  acc.add(Vec{1, 2, 3}, 0.0);
  acc.add(Vec{4, 5, 6}, 1.5);
  CHECK(acc.count() == 2);
  CHECK(acc.total_weight() == 4.0);
  CHECK(acc.size() == 3);
}

TEMPLATE_TEST_CASE("Contract violations throw errors that name the bad value", "[merge][errors]",
                   WeightedAverage, RadialDirectional) {
  const std::vector<TensorSegment> layout{{0, 3, false}, {3, 2, true}};
  auto acc = TestType{}.make_accumulator(layout);
  Vec good(5, 1.0f), short_v(4, 1.0f), out(5), bad_out(6);

  CHECK_THROWS_AS(acc.add(short_v, 1.0), ddiloco::ShapeMismatch);
  CHECK_THROWS_WITH(acc.add(short_v, 1.0), Contains("has 4 elements") && Contains("has 5"));
  CHECK_THROWS_AS(acc.add(short_v, 0.0), ddiloco::ShapeMismatch);  // size checked even for weight 0
  CHECK_THROWS_AS(acc.add(good, -1.0), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(acc.add(good, -1.0), Contains("weight = -1"));
  CHECK_THROWS_WITH(acc.add(good, std::numeric_limits<double>::quiet_NaN()), Contains("weight = nan"));
  CHECK_THROWS_WITH(acc.add(good, std::numeric_limits<double>::infinity()), Contains("weight = inf"));
  CHECK(acc.count() == 0);

  CHECK_THROWS_AS(acc.finish(out), ddiloco::StateError);
  acc.add(good, 0.0);
  CHECK_THROWS_AS(acc.finish(out), ddiloco::StateError);
  CHECK_THROWS_WITH(acc.finish(out), Contains("total weight is 0"));
  acc.add(good, 1.0);
  CHECK_THROWS_AS(acc.finish(bad_out), ddiloco::ShapeMismatch);
  CHECK_THROWS_WITH(acc.finish(bad_out), Contains("output has 6"));
  CHECK_NOTHROW(acc.finish(out));
  CHECK(out == good);
}

TEMPLATE_TEST_CASE("Layouts with gaps or overlaps are rejected", "[merge][errors]", WeightedAverage,
                   RadialDirectional) {
  const std::vector<TensorSegment> gap{{0, 3, false}, {4, 2, false}};
  const std::vector<TensorSegment> overlap{{0, 3, false}, {2, 2, false}};
  const std::vector<TensorSegment> late_start{{1, 3, false}};
  CHECK_THROWS_AS(TestType{}.make_accumulator(gap), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(TestType{}.make_accumulator(gap), Contains("segment 1 starts at offset 4") && Contains("end at 3"));
  CHECK_THROWS_AS(TestType{}.make_accumulator(overlap), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(TestType{}.make_accumulator(late_start), ddiloco::InvalidArgument);
  // Empty tensors are fine.
  const std::vector<TensorSegment> with_empty{{0, 2, false}, {2, 0, false}, {2, 1, true}};
  CHECK_NOTHROW(TestType{}.make_accumulator(with_empty));
  CHECK(merge(TestType{}, with_empty, {{1, 0, 5}}, {1.0}) == Vec{1, 0, 5});
}
