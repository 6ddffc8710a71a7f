// tests/cluster_test_util.hpp: the synthetic task and cluster settings of the
// tests that run LocalCluster (test_local_cluster.cpp, test_chaos_sweep.cpp),
// written once: a quadratic task with a known optimum, its plan, the distance
// to that optimum, and the Decoupled DiLoCo configuration they start from.
#pragma once

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ddiloco/local_cluster.hpp>
#include <memory>
#include <random>
#include <span>
#include <vector>

namespace ddiloco::test {

// A fast synthetic task with a known optimum: learner m minimises
// 0.5 * ||x - c_m||^2 with noisy SGD, where c_m = c + offset_m and the offsets
// sum to zero, so the global optimum is c. Two tensors: one embedding-like.
// The offsets are small (+-0.05): at the optimum the learners' outer gradients
// cancel, and RDA restores the mean norm to whatever direction is left, so the
// global parameters jitter around c by about the offset (measured: RMS 0.06
// with offsets of +-0.5, 0.006 with +-0.05). The tests measure the protocol,
// from a start at RMS distance 0.7.
inline constexpr std::size_t kA = 48, kB = 16;

struct QuadraticTrainer {
  using tensor_type = std::vector<float>;
  std::vector<std::vector<float>> params;
  std::vector<float> target;  // c_m, flattened over both tensors
  std::mt19937 rng;
  float lr = 0.05f;

  QuadraticTrainer(LearnerId id, std::uint64_t incarnation, std::size_t learners, std::size_t a = kA,
                   std::size_t b = kB)
      : params{std::vector<float>(a, 0.0f), std::vector<float>(b, 0.0f)},
        target(a + b),
        rng(static_cast<std::uint32_t>(1000 * id + incarnation + 1)) {
    for (std::size_t i = 0; i < target.size(); ++i) {
      const float c = std::sin(static_cast<float>(i));
      // Scavenged learners (id >= learners) and an odd one out have no offset.
      const bool paired = id < learners && (learners % 2 == 0 || id + 1 < learners);
      const float offset = paired ? (id % 2 == 0 ? 0.05f : -0.05f) : 0.0f;
      target[i] = c + offset;
    }
  }
  std::span<std::vector<float>> parameters() { return params; }
  std::int64_t inner_step() {
    std::normal_distribution<float> noise(0.0f, 0.01f);
    std::size_t k = 0;
    for (auto& t : params)
      for (auto& x : t) {
        x -= lr * (x - target[k++] + noise(rng));
      }
    return 64;
  }
};

static_assert(ClusterTrainer<QuadraticTrainer>);

inline Plan quad_plan(std::size_t P, std::size_t a = kA, std::size_t b = kB) {
  return make_plan({{"a", a, false}, {"b", b, true}}, P);
}

/// RMS distance of the global parameters from the optimum c (0.7 at the start).
inline double distance_to_optimum(std::span<const float> global) {
  double d = 0;
  for (std::size_t i = 0; i < global.size(); ++i) {
    const double e = global[i] - std::sin(static_cast<double>(i));
    d += e * e;
  }
  return std::sqrt(d / static_cast<double>(global.size()));
}

/// Decoupled DiLoCo with M learners in push rounds (pulled() makes it the
/// paper's pull rounds): H = 8, tau = 2, K = 1 with the grace window, 10 ms
/// steps, 400 steps' tokens per learner.
inline ClusterConfig decoupled(std::size_t M) {
  using namespace std::chrono_literals;
  ClusterConfig c;
  c.outer.round = RoundMode::push;
  c.syncer.round = RoundMode::push;
  c.learners = M;
  c.outer.sync_every = 8;
  c.outer.overlap = 2;
  c.syncer.quorum.min_quorum = 1;
  c.syncer.quorum.overlap = 2;
  c.syncer.quorum.grace = true;
  c.syncer.quorum.cap = 10ms;
  c.syncer.quorum.deadline = 2s;
  c.syncer.heartbeat_timeout = 1s;
  c.outer.heartbeat_interval = 100ms;
  c.step_time = 10ms;
  c.token_budget = 64 * 400 * static_cast<std::int64_t>(M);
  return c;
}

/// The same in pull rounds (the syncer told H, as a pull-round syncer must be).
inline ClusterConfig pulled(ClusterConfig c) {
  c.outer.round = RoundMode::pull;
  c.syncer.round = RoundMode::pull;
  c.syncer.sync_every = c.outer.sync_every;
  return c;
}

/// The chaos tests' network: 1 ms latency, 5% of messages lost, 10%
/// duplicated, 10% delayed by up to 15 ms more (reordered); loss and
/// duplicates can be left out.
inline MessageFaults chaos_network(bool loss = true, bool duplicates = true) {
  using namespace std::chrono_literals;
  MessageFaults f;
  f.drop = loss ? 0.05 : 0.0;
  f.latency = 1ms;
  f.duplicate = duplicates ? 0.1 : 0.0;
  f.reorder = 0.1;
  f.reorder_max = 15ms;
  return f;
}

/// A trainer factory for M base learners of the quadratic task.
inline auto factory(std::size_t M) {
  return [M](LearnerId id, std::uint64_t inc) { return std::make_unique<QuadraticTrainer>(id, inc, M); };
}

using Cluster = LocalCluster<QuadraticTrainer, RadialDirectional, NesterovSGD, TokenWeights>;

}  // namespace ddiloco::test
