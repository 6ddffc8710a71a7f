// Tests for <ddiloco/testing.hpp>: the generators do what they say, the
// library's rules pass every property, and deliberately broken rules are caught
// by the property they break.
#include <ddiloco/testing.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <set>
#include <string>
#include <vector>

using Catch::Matchers::Contains;
using ddiloco::RadialDirectional;
using ddiloco::TensorSegment;
using ddiloco::WeightedAverage;
namespace dt = ddiloco::testing;
using dt::NormBehaviour;
using dt::PropertyResult;

namespace {

double norm_of(std::span<const float> x) {
  double s = 0.0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}

const PropertyResult& find(const std::vector<PropertyResult>& results, const std::string& prefix) {
  for (const auto& r : results) {
    if (r.property.rfind(prefix, 0) == 0) return r;
  }
  FAIL("no property named " << prefix);  // throws
  static const PropertyResult missing{};
  return missing;
}

// ---- Deliberately broken rules ---------------------------------------------
// A rule whose accumulator stores every contribution and combines them in
// finish() with a policy; each policy below breaks one property.
struct Stored {
  std::vector<float> v;
  double w;
};

template <class Policy>
struct StoringRule {
  static constexpr std::string_view name = Policy::name;
  class Accumulator {
   public:
    explicit Accumulator(std::span<const TensorSegment> /*layout*/) {}
    void add(std::span<const float> v, double w) {
      if (w == 0.0 && !Policy::keeps_zero_weights) return;
      items_.push_back({std::vector<float>(v.begin(), v.end()), w});
      total_ += w;
    }
    std::size_t count() const { return items_.size(); }
    double total_weight() const { return total_; }
    void finish(std::span<float> out) const { Policy::combine(items_, total_, out); }
    void reset() {
      if (!Policy::leaky_reset) items_.clear();
      total_ = 0.0;
    }

   private:
    std::vector<Stored> items_;
    double total_ = 0.0;
  };
  Accumulator make_accumulator(std::span<const TensorSegment> layout) const { return Accumulator(layout); }
};

// Clang 14 calls each policy's `name` an unused constant (-Wunused-const-variable:
// the harness reads it only through TestRule<Policy>::name), hence [[maybe_unused]].
struct DefaultPolicy {
  static constexpr bool keeps_zero_weights = false;
  static constexpr bool leaky_reset = false;
};

/// A correct weighted average: the control for the harness itself.
struct CorrectAverage : DefaultPolicy {
  [[maybe_unused]] static constexpr std::string_view name = "correct_average";
  static void combine(const std::vector<Stored>& items, double total, std::span<float> out) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      double s = 0.0;
      for (const auto& it : items) s += it.w * it.v[i];
      out[i] = static_cast<float>(s / total);
    }
  }
};

/// Ignores the weights: an unweighted mean of everything added, zero weights included.
struct IgnoresWeights : DefaultPolicy {
  [[maybe_unused]] static constexpr std::string_view name = "ignores_weights";
  static constexpr bool keeps_zero_weights = true;
  static void combine(const std::vector<Stored>& items, double, std::span<float> out) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      double s = 0.0;
      for (const auto& it : items) s += it.v[i];
      out[i] = static_cast<float>(s / static_cast<double>(items.size()));
    }
  }
};

/// An exponential moving average: later inputs count more.
struct DependsOnOrder : DefaultPolicy {
  [[maybe_unused]] static constexpr std::string_view name = "depends_on_order";
  static void combine(const std::vector<Stored>& items, double, std::span<float> out) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      double s = items.front().v[i];
      for (std::size_t k = 1; k < items.size(); ++k) s = 0.5 * s + 0.5 * items[k].v[i];
      out[i] = static_cast<float>(s);
    }
  }
};

/// Returns the first input it received.
struct FirstInput : DefaultPolicy {
  [[maybe_unused]] static constexpr std::string_view name = "first_input";
  static void combine(const std::vector<Stored>& items, double, std::span<float> out) {
    std::copy(items.front().v.begin(), items.front().v.end(), out.begin());
  }
};

/// Forgets to divide by the total weight.
struct WeightedSum : DefaultPolicy {
  [[maybe_unused]] static constexpr std::string_view name = "weighted_sum";
  static void combine(const std::vector<Stored>& items, double, std::span<float> out) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      double s = 0.0;
      for (const auto& it : items) s += it.w * it.v[i];
      out[i] = static_cast<float>(s);
    }
  }
};

/// Clips each input to norm 1 before averaging: not homogeneous.
struct ClipsNorms : DefaultPolicy {
  [[maybe_unused]] static constexpr std::string_view name = "clips_norms";
  static void combine(const std::vector<Stored>& items, double total, std::span<float> out) {
    std::vector<double> acc(out.size(), 0.0);
    for (const auto& it : items) {
      const double n = norm_of(it.v);
      const double c = n > 1.0 ? 1.0 / n : 1.0;
      for (std::size_t i = 0; i < out.size(); ++i) acc[i] += it.w * c * it.v[i];
    }
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(acc[i] / total);
  }
};

/// A correct average whose reset() forgets to drop the previous round's inputs.
struct LeakyReset : CorrectAverage {
  [[maybe_unused]] static constexpr std::string_view name = "leaky_reset";
  static constexpr bool leaky_reset = true;
  static void combine(const std::vector<Stored>& items, double, std::span<float> out) {
    double total = 0.0;
    for (const auto& it : items) total += it.w;
    CorrectAverage::combine(items, total, out);
  }
};

/// Throws from add(): the checks report the exception instead of crashing.
struct Throws : DefaultPolicy {
  [[maybe_unused]] static constexpr std::string_view name = "throws";
  static void combine(const std::vector<Stored>&, double, std::span<float>) {
    throw ddiloco::StateError("this rule always fails");
  }
};

}  // namespace

static_assert(ddiloco::MergeRule<StoringRule<CorrectAverage>>);
static_assert(ddiloco::MergeRule<StoringRule<IgnoresWeights>>);

// ---- Generators ----------------------------------------------------------------

TEST_CASE("Random layouts tile the buffer contiguously within the requested shape", "[testing]") {
  dt::LayoutOptions options;
  options.min_tensors = 2;
  options.max_tensors = 5;
  options.min_tensor_size = 3;
  options.max_tensor_size = 40;
  std::set<std::size_t> counts;
  bool saw_embedding = false;
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const auto layout = dt::random_layout(seed, options);
    counts.insert(layout.size());
    REQUIRE(layout.size() >= 2);
    REQUIRE(layout.size() <= 5);
    std::size_t end = 0;
    for (std::size_t t = 0; t < layout.size(); ++t) {
      REQUIRE(layout[t].offset == end);
      REQUIRE(layout[t].size >= 3);
      REQUIRE(layout[t].size <= 40);
      if (t > 0) REQUIRE_FALSE(layout[t].embedding);
      saw_embedding = saw_embedding || layout[t].embedding;
      end += layout[t].size;
    }
  }
  CHECK(counts.size() == 4);  // 2, 3, 4 and 5 tensors all occur
  CHECK(saw_embedding);
  options.embeddings = false;
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    for (const auto& s : dt::random_layout(seed, options)) REQUIRE_FALSE(s.embedding);
  }
  CHECK_THROWS_AS(dt::random_layout(1, dt::LayoutOptions{0, 0, 1, 1, false}), ddiloco::InvalidArgument);
}

TEST_CASE("Generators are deterministic in their seed", "[testing]") {
  CHECK(dt::random_layout(7) == dt::random_layout(7));
  CHECK(dt::random_layout(7) != dt::random_layout(8));
  const auto layout = dt::random_layout(3);
  const std::vector<double> norms{1.0, 2.0};
  CHECK(dt::random_outer_gradients(layout, norms, 5) == dt::random_outer_gradients(layout, norms, 5));
  CHECK(dt::random_outer_gradients(layout, norms, 5) != dt::random_outer_gradients(layout, norms, 6));
  CHECK(dt::random_counters(4, 9) == dt::random_counters(4, 9));
}

TEST_CASE("Random outer gradients have the requested norms, shared per tensor, and are nearly orthogonal",
          "[testing]") {
  const std::vector<TensorSegment> layout{{0, 3000, false}, {3000, 1000, true}, {4000, 0, false}, {4000, 96, false}};
  const std::vector<double> norms{0.5, 2.0, 7.25, 0.0};
  const auto v = dt::random_outer_gradients(layout, norms, 11);
  REQUIRE(v.size() == 4);
  for (std::size_t m = 0; m < v.size(); ++m) {
    REQUIRE(v[m].size() == 4096);
    CHECK(norm_of(v[m]) == Approx(norms[m]).epsilon(1e-6).margin(1e-12));
    for (const auto& seg : layout) {
      const double want = norms[m] * std::sqrt(static_cast<double>(seg.size) / 4096.0);
      CHECK(norm_of(std::span<const float>(v[m]).subspan(seg.offset, seg.size)) ==
            Approx(want).epsilon(1e-6).margin(1e-12));
    }
  }
  // Gaussian directions in 3000 dimensions: |cos| ~ 1/sqrt(3000) ~ 0.018.
  for (std::size_t a = 0; a < 3; ++a) {
    for (std::size_t b = a + 1; b < 3; ++b) {
      double dot = 0.0;
      for (std::size_t i = 0; i < 3000; ++i) dot += static_cast<double>(v[a][i]) * v[b][i];
      const double cos = dot / (norm_of(std::span<const float>(v[a]).first(3000)) *
                                norm_of(std::span<const float>(v[b]).first(3000)));
      CHECK(std::abs(cos) < 0.1);
    }
  }
}

TEST_CASE("Random counters are consistent and give positive token weights", "[testing]") {
  const auto counters = dt::random_counters(200, 3, 24, 512);
  for (const auto& c : counters) {
    REQUIRE(c.steps >= 1);
    REQUIRE(c.steps <= 24);
    REQUIRE(c.tokens % c.steps == 0);
    REQUIRE(c.tokens / c.steps >= 1);
    REQUIRE(c.tokens / c.steps <= 512);
    REQUIRE(ddiloco::TokenWeights{}(c) > 0.0);
  }
  CHECK_THROWS_AS(dt::random_counters(1, 1, 0), ddiloco::InvalidArgument);
}

// ---- The library's rules pass ----------------------------------------------

TEST_CASE("The library's merge rules pass every property check", "[testing]") {
  for (std::uint64_t seed : {1u, 2u, 3u, 42u, 2024u}) {
    INFO("seed " << seed);
    for (const auto& r : dt::check_merge_rule(WeightedAverage{}, NormBehaviour::convex, seed)) {
      INFO(dt::to_string(r));
      CHECK(r.passed);
    }
    for (const auto& r : dt::check_merge_rule(RadialDirectional{}, NormBehaviour::mean_of_norms, seed)) {
      INFO(dt::to_string(r));
      CHECK(r.passed);
    }
    // RDA's output norm is a weighted mean of input norms, so it is convex too.
    const auto convex = dt::check_norm_behaviour(RadialDirectional{}, NormBehaviour::convex, seed);
    INFO(dt::to_string(convex));
    CHECK(convex.passed);
  }
}

TEST_CASE("check_merge_rule runs six named properties and reports them readably", "[testing]") {
  const auto results = dt::check_merge_rule(StoringRule<CorrectAverage>{}, NormBehaviour::convex, 5);
  REQUIRE(results.size() == 6);
  CHECK(results[0].property == "identical_inputs");
  CHECK(results[1].property == "order_independence");
  CHECK(results[2].property == "zero_weights");
  CHECK(results[3].property == "scaling");
  CHECK(results[4].property == "norm_behaviour(convex)");
  CHECK(results[5].property == "finish_and_reset");
  CHECK(dt::all_passed(results));
  CHECK_THAT(dt::to_string(results[0]), Contains("[PASS] identical_inputs"));
  const auto none = dt::check_norm_behaviour(StoringRule<CorrectAverage>{}, NormBehaviour::none, 5);
  CHECK(none.passed);
  CHECK_THAT(none.detail, Contains("not checked"));
}

// ---- Broken rules are caught -----------------------------------------------

TEST_CASE("A rule that ignores weights fails the zero-weight property", "[testing]") {
  const auto results = dt::check_merge_rule(StoringRule<IgnoresWeights>{}, NormBehaviour::convex, 1);
  const auto& r = find(results, "zero_weights");
  CHECK_FALSE(r.passed);
  CHECK_THAT(r.detail, Contains("count()"));  // it counts zero-weight contributions
  CHECK_FALSE(dt::all_passed(results));
  CHECK_THAT(dt::to_string(r), Contains("[FAIL] zero_weights"));
}

TEST_CASE("An order-dependent rule fails the order property", "[testing]") {
  const auto r = dt::check_order_independence(StoringRule<DependsOnOrder>{}, 1);
  CHECK_FALSE(r.passed);
  CHECK_THAT(r.detail, Contains("order") && Contains("relative distance"));
  // Identical inputs cannot reveal it.
  CHECK(dt::check_identical_inputs(StoringRule<DependsOnOrder>{}, 1).passed);
}

TEST_CASE("A rule that returns the first input fails the order property", "[testing]") {
  const auto results = dt::check_merge_rule(StoringRule<FirstInput>{}, NormBehaviour::convex, 3);
  CHECK_FALSE(find(results, "order_independence").passed);
  CHECK(find(results, "identical_inputs").passed);
}

TEST_CASE("A rule that forgets to divide by the total weight fails identity and the convex norm", "[testing]") {
  const auto results = dt::check_merge_rule(StoringRule<WeightedSum>{}, NormBehaviour::convex, 4);
  CHECK_FALSE(find(results, "identical_inputs").passed);
  CHECK_FALSE(find(results, "norm_behaviour").passed);
  CHECK_THAT(find(results, "norm_behaviour").detail, Contains("largest input norm"));
}

TEST_CASE("A rule that clips norms fails the scaling property", "[testing]") {
  const auto r = dt::check_scaling(StoringRule<ClipsNorms>{}, 2);
  CHECK_FALSE(r.passed);
  CHECK_THAT(r.detail, Contains("scaled by c ="));
}

TEST_CASE("A plain average that claims mean_of_norms fails the norm property", "[testing]") {
  const auto r = dt::check_norm_behaviour(WeightedAverage{}, NormBehaviour::mean_of_norms, 6);
  CHECK_FALSE(r.passed);
  CHECK_THAT(r.detail, Contains("gave a merge of norm"));
  CHECK(dt::check_norm_behaviour(WeightedAverage{}, NormBehaviour::convex, 6).passed);
}

TEST_CASE("A reset that keeps the previous round fails the reset property", "[testing]") {
  const auto r = dt::check_finish_and_reset(StoringRule<LeakyReset>{}, 8);
  CHECK_FALSE(r.passed);
  CHECK_THAT(r.detail, Contains("reset()"));
}

TEST_CASE("A rule that throws is reported as failing with the exception's message", "[testing]") {
  const auto results = dt::check_merge_rule(StoringRule<Throws>{}, NormBehaviour::convex, 9);
  for (const auto& r : results) {
    INFO(dt::to_string(r));
    CHECK_FALSE(r.passed);
    CHECK_THAT(r.detail, Contains("threw") && Contains("this rule always fails"));
  }
}
