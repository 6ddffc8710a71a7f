// Tests for <ddiloco/merge_weights.hpp>: hand values and rejected counters.
#include <ddiloco/merge_weights.hpp>

#include <catch2/catch.hpp>

#include <cstdint>

using Catch::Matchers::Contains;
using ddiloco::Counters;
using ddiloco::TokenWeights;
using ddiloco::UniformWeights;

static_assert(ddiloco::WeightRule<TokenWeights>);
static_assert(ddiloco::WeightRule<UniformWeights>);
struct ReturnsFloat {
  static constexpr std::string_view name = "returns_float";
  float operator()(const Counters&) const { return 1.0f; }
};
static_assert(!ddiloco::WeightRule<ReturnsFloat>, "requirement 2: the weight is a double");
struct Nameless {
  double operator()(const Counters&) const { return 1.0; }
};
static_assert(!ddiloco::WeightRule<Nameless>, "requirement 1: a name is required");

TEST_CASE("Token weights are tokens squared over steps", "[merge_weights]") {
  const TokenWeights w;
  CHECK(w(Counters{1, 1}) == 1.0);
  CHECK(w(Counters{2, 10}) == 50.0);        // 10 * (10 / 2)
  CHECK(w(Counters{24, 24 * 4096}) == 24.0 * 4096.0 * 4096.0);  // batch 4096, 24 steps
  CHECK(w(Counters{3, 7}) == Approx(49.0 / 3.0).epsilon(1e-15));
  CHECK(w(Counters{5, 0}) == 0.0);  // steps without tokens carry no weight
}

TEST_CASE("Token weights are proportional to steps when batch sizes are equal", "[merge_weights]") {
  const TokenWeights w;
  const std::int64_t batch = 512;
  const double one_step = w(Counters{1, batch});
  for (std::int64_t steps : {2, 7, 24, 100}) {
    CHECK(w(Counters{steps, steps * batch}) == Approx(static_cast<double>(steps) * one_step).epsilon(1e-15));
  }
  // A learner with twice the batch size counts twice as much per token (quality).
  CHECK(w(Counters{10, 10 * 2 * batch}) == Approx(4.0 * w(Counters{10, 10 * batch})).epsilon(1e-15));
}

TEST_CASE("Token weights of large counters stay finite and exact enough", "[merge_weights]") {
  const TokenWeights w;
  const std::int64_t tokens = std::int64_t{1} << 40;  // ~1.1e12 tokens
  CHECK(w(Counters{1 << 20, tokens}) == Approx(1099511627776.0 * 1048576.0).epsilon(1e-15));
}

TEST_CASE("Absent learners weigh zero under both rules", "[merge_weights]") {
  CHECK(TokenWeights{}(Counters{}) == 0.0);
  CHECK(UniformWeights{}(Counters{}) == 0.0);
}

TEST_CASE("Uniform weights count every learner that stepped as one", "[merge_weights]") {
  const UniformWeights w;
  CHECK(w(Counters{1, 100}) == 1.0);
  CHECK(w(Counters{1000, 1}) == 1.0);
  CHECK(w(Counters{3, 0}) == 1.0);
}

TEMPLATE_TEST_CASE("Inconsistent counters are rejected, naming them", "[merge_weights][errors]", TokenWeights,
                   UniformWeights) {
  const TestType w;
  CHECK_THROWS_AS(w(Counters{-1, 0}), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(w(Counters{-1, 0}), Contains("steps = -1"));
  CHECK_THROWS_AS(w(Counters{2, -5}), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(w(Counters{2, -5}), Contains("tokens = -5"));
  CHECK_THROWS_AS(w(Counters{0, 10}), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(w(Counters{0, 10}), Contains("steps = 0") && Contains("tokens = 10"));
}
