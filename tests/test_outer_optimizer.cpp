// Tests for <ddiloco/outer_optimizer.hpp>: hand-computed sequences, PyTorch's
// first-step convention, state sizes and errors.
#include <ddiloco/outer_optimizer.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

using Catch::Matchers::Contains;
using ddiloco::AverageOnly;
using ddiloco::NesterovSGD;
using ddiloco::PlainSGD;

static_assert(ddiloco::OuterOptimizer<NesterovSGD>);
static_assert(ddiloco::OuterOptimizer<PlainSGD>);
static_assert(ddiloco::OuterOptimizer<AverageOnly>);
static_assert(!ddiloco::OuterOptimizer<int>);
struct NoName {
  std::size_t state_size(std::size_t) const { return 0; }
  void step(std::span<float>, std::span<const float>, std::span<float>) const {}
};
static_assert(!ddiloco::OuterOptimizer<NoName>, "requirement 1: a name is required");
struct NoStep {
  static constexpr std::string_view name = "no_step";
  std::size_t state_size(std::size_t) const { return 0; }
};
static_assert(!ddiloco::OuterOptimizer<NoStep>, "requirement 3: step is required");

namespace {
constexpr float kTol = 1e-5f;

void require_near(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": got " << got[i] << ", want " << want[i]);
    CHECK(std::abs(static_cast<double>(got[i]) - want[i]) <= tol);
  }
}
}  // namespace

TEST_CASE("Nesterov SGD reproduces the worked value 0.665 of docs/algorithm.md", "[outer_optimizer]") {
  const NesterovSGD opt;  // eta = 0.7, mu = 0.9
  std::vector<float> theta{1.0f};
  std::vector<float> delta{0.5f};
  std::vector<float> state(opt.state_size(1), 0.0f);
  opt.step(theta, delta, state);
  // Theta decreases by 0.7 * (0.5 + 0.9 * 0.5) = 0.665; b = 0.5.
  CHECK(theta[0] == Approx(1.0 - 0.665).margin(kTol));
  CHECK(state[0] == Approx(0.5).margin(kTol));
}

TEST_CASE("Nesterov SGD follows a hand-computed three-step sequence on three elements", "[outer_optimizer]") {
  const NesterovSGD opt(0.7f, 0.9f);
  std::vector<float> theta{1.0f, -2.0f, 0.5f};
  std::vector<float> state(3, 0.0f);

  // Step 1: b = d = [0.5, -1, 0]; Theta -= 0.7 * (d + 0.9 b) = [0.665, -1.33, 0].
  opt.step(theta, std::vector<float>{0.5f, -1.0f, 0.0f}, state);
  require_near(theta, {0.335, -0.67, 0.5}, kTol);
  require_near(state, {0.5, -1.0, 0.0}, kTol);

  // Step 2: b = 0.9 [0.5, -1, 0] + [0.25, 0.5, 1] = [0.7, -0.4, 1];
  // Theta -= 0.7 * ([0.25, 0.5, 1] + 0.9 b) = 0.7 * [0.88, 0.14, 1.9] = [0.616, 0.098, 1.33].
  opt.step(theta, std::vector<float>{0.25f, 0.5f, 1.0f}, state);
  require_near(theta, {-0.281, -0.768, -0.83}, kTol);
  require_near(state, {0.7, -0.4, 1.0}, kTol);

  // Step 3: b = 0.9 [0.7, -0.4, 1] + [-0.5, 0, 2] = [0.13, -0.36, 2.9];
  // Theta -= 0.7 * ([-0.5, 0, 2] + 0.9 b) = 0.7 * [-0.383, -0.324, 4.61].
  opt.step(theta, std::vector<float>{-0.5f, 0.0f, 2.0f}, state);
  require_near(theta, {-0.0129, -0.5412, -4.057}, kTol);
  require_near(state, {0.13, -0.36, 2.9}, kTol);
}

TEST_CASE("Nesterov SGD from a zero state matches PyTorch's buf = clone(grad) first step", "[outer_optimizer]") {
  // A literal transcription of torch.optim.SGD(nesterov=True, dampening=0,
  // weight_decay=0) in double: the momentum buffer is created from the first
  // gradient instead of being updated from zero.
  const double lr = 0.3, mu = 0.8;
  std::vector<double> ref_param{0.4, -1.5, 2.0, 0.0};
  std::optional<std::vector<double>> buf;
  const std::vector<std::vector<float>> grads{
      {0.1f, 0.2f, -0.3f, 1.0f}, {-0.4f, 0.0f, 0.5f, 0.25f}, {2.0f, -1.0f, 0.125f, 0.0f}, {0.3f, 0.3f, 0.3f, -0.6f}};

  const NesterovSGD opt(static_cast<float>(lr), static_cast<float>(mu));
  std::vector<float> theta{0.4f, -1.5f, 2.0f, 0.0f};
  std::vector<float> state(opt.state_size(theta.size()), 0.0f);

  for (const auto& g : grads) {
    if (!buf) {
      buf.emplace(g.begin(), g.end());  // buf = torch.clone(grad)
    } else {
      for (std::size_t i = 0; i < g.size(); ++i) (*buf)[i] = mu * (*buf)[i] + g[i];  // buf.mul_(mu).add_(grad)
    }
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double nesterov_grad = g[i] + mu * (*buf)[i];  // grad.add(buf, alpha=mu)
      ref_param[i] -= lr * nesterov_grad;                  // param.add_(grad, alpha=-lr)
    }
    opt.step(theta, g, state);
    require_near(theta, ref_param, kTol);
    require_near(state, *buf, kTol);
  }
}

TEST_CASE("Nesterov SGD with momentum 0 is plain SGD", "[outer_optimizer]") {
  const NesterovSGD nesterov(0.5f, 0.0f);
  const PlainSGD plain(0.5f);
  std::vector<float> a{1.0f, 2.0f, -3.0f}, b = a;
  std::vector<float> state(3, 0.0f);
  for (const auto& d : {std::vector<float>{0.5f, -0.5f, 1.0f}, std::vector<float>{2.0f, 0.0f, -1.0f}}) {
    nesterov.step(a, d, state);
    plain.step(b, d, {});
  }
  CHECK(a == b);
}

TEST_CASE("Plain SGD follows a hand-computed three-step sequence", "[outer_optimizer]") {
  const PlainSGD opt(0.5f);
  std::vector<float> theta{1.0f, 2.0f};
  opt.step(theta, std::vector<float>{0.2f, -0.4f}, {});
  require_near(theta, {0.9, 2.2}, kTol);
  opt.step(theta, std::vector<float>{1.0f, 1.0f}, {});
  require_near(theta, {0.4, 1.7}, kTol);
  opt.step(theta, std::vector<float>{-2.0f, 0.5f}, {});
  require_near(theta, {1.4, 1.45}, kTol);
}

TEST_CASE("Average-only subtracts the merged outer gradient unchanged", "[outer_optimizer]") {
  const AverageOnly opt;
  std::vector<float> theta{1.0f, 2.0f};
  opt.step(theta, std::vector<float>{0.25f, -0.5f}, {});
  require_near(theta, {0.75, 2.5}, 0.0);
  opt.step(theta, std::vector<float>{1.0f, 1.0f}, {});
  require_near(theta, {-0.25, 1.5}, 0.0);
  opt.step(theta, std::vector<float>{0.5f, 0.5f}, {});
  require_near(theta, {-0.75, 1.0}, 0.0);
}

TEST_CASE("State sizes are one float per element for Nesterov and none otherwise", "[outer_optimizer]") {
  CHECK(NesterovSGD{}.state_size(0) == 0);
  CHECK(NesterovSGD{}.state_size(12345) == 12345);
  CHECK(PlainSGD{}.state_size(12345) == 0);
  CHECK(AverageOnly{}.state_size(12345) == 0);
  CHECK(NesterovSGD::name == "nesterov_sgd");
  CHECK(PlainSGD::name == "plain_sgd");
  CHECK(AverageOnly::name == "average_only");
}

TEST_CASE("Defaults are the paper's eta = 0.7 and mu = 0.9", "[outer_optimizer]") {
  CHECK(NesterovSGD{}.lr() == 0.7f);
  CHECK(NesterovSGD{}.momentum() == 0.9f);
  CHECK(PlainSGD{}.lr() == 1.0f);
}

TEST_CASE("Constructors reject bad learning rates and momenta, naming the value", "[outer_optimizer][errors]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(NesterovSGD(0.0f), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(NesterovSGD(0.0f), Contains("lr = 0"));
  CHECK_THROWS_WITH(NesterovSGD(-1.5f), Contains("lr = -1.5"));
  CHECK_THROWS_WITH(NesterovSGD(nan), Contains("lr = nan"));
  CHECK_THROWS_WITH(NesterovSGD(inf), Contains("lr = inf"));
  CHECK_THROWS_AS(NesterovSGD(0.7f, 1.0f), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(NesterovSGD(0.7f, 1.0f), Contains("momentum = 1"));
  CHECK_THROWS_WITH(NesterovSGD(0.7f, -0.25f), Contains("momentum = -0.25"));
  CHECK_THROWS_WITH(NesterovSGD(0.7f, nan), Contains("momentum = nan"));
  CHECK_NOTHROW(NesterovSGD(0.7f, 0.0f));
  CHECK_THROWS_AS(PlainSGD(0.0f), ddiloco::InvalidArgument);
  CHECK_THROWS_WITH(PlainSGD(-2.0f), Contains("lr = -2"));
}

TEST_CASE("Steps reject mismatched sizes, naming both sizes", "[outer_optimizer][errors]") {
  std::vector<float> theta(4, 0.0f), delta3(3, 0.0f), delta4(4, 0.0f), state3(3, 0.0f), state4(4, 0.0f);
  const NesterovSGD nesterov;
  CHECK_THROWS_AS(nesterov.step(theta, delta3, state4), ddiloco::ShapeMismatch);
  CHECK_THROWS_WITH(nesterov.step(theta, delta3, state4), Contains("delta has 3") && Contains("theta has 4"));
  CHECK_THROWS_AS(nesterov.step(theta, delta4, state3), ddiloco::ShapeMismatch);
  CHECK_THROWS_WITH(nesterov.step(theta, delta4, state3), Contains("state has 3") && Contains("state_size(4) = 4"));
  CHECK_THROWS_AS(PlainSGD{}.step(theta, delta3, {}), ddiloco::ShapeMismatch);
  CHECK_THROWS_AS(PlainSGD{}.step(theta, delta4, state4), ddiloco::ShapeMismatch);
  CHECK_THROWS_AS(AverageOnly{}.step(theta, delta3, {}), ddiloco::ShapeMismatch);
  CHECK_THROWS_AS(AverageOnly{}.step(theta, delta4, state4), ddiloco::ShapeMismatch);
  // A failed step leaves theta untouched.
  CHECK(theta == std::vector<float>(4, 0.0f));
}
