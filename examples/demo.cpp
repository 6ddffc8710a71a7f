// The main job (for now): the building blocks of Decoupled DiLoCo on a real
// model's tensor list, end to end for one fragment round.
//
//   demo [tensor-list] [learners]      default: examples/models/llama-1b.txt, 4
//
// 1. Fragmenter: the three strategies at P = 24, imbalance and fingerprint.
// 2. Streaming schedule: P = H = 24, tau = 2: who sends when, when it applies.
// 3. Quorum/grace policy on a virtual clock: learners at different speeds.
// 4. Token weights, then RDA vs plain averaging of M near-orthogonal outer
//    gradients on the real layout of one fragment (norms printed), and the
//    outer Nesterov step.
#include <ddiloco/ddiloco.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

using namespace ddiloco;
using namespace std::chrono_literals;

namespace {

double norm(std::span<const float> v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string path = argc > 1 ? argv[1] : std::string(DDILOCO_SOURCE_DIR) + "/examples/models/llama-1b.txt";
  const std::size_t M = argc > 2 ? std::stoul(argv[2]) : 4;
  const auto specs = read_tensor_list_file(path);
  std::size_t total = 0;
  for (const auto& s : specs) total += s.numel;
  std::printf("model: %s: %zu tensors, %.3f B parameters\n\n", path.c_str(), specs.size(), static_cast<double>(total) / 1e9);

  // 1. Fragmenter.
  std::printf("## 1. Fragmenter, P = 24\n| strategy | largest fragment (M params) | imbalance | fingerprint |\n|---|---|---|---|\n");
  auto row = [](const Plan& p) {
    std::size_t largest = 0;
    for (const auto& f : p.fragments()) largest = std::max(largest, f.numel);
    std::printf("| %s | %.1f | %.3f | %016llx |\n", std::string(p.strategy()).c_str(), static_cast<double>(largest) / 1e6,
                p.imbalance(), static_cast<unsigned long long>(p.fingerprint()));
  };
  const Plan plan = make_plan(specs, 24, BalancedGreedy{});
  row(plan);
  row(make_plan(specs, 24, LayerContiguous{}));
  row(make_plan(specs, 24, PerTensor{}));
  std::printf("(LPT bound: largest <= (4/3 - 1/72) x optimum; a single tensor larger than the mean sets the floor)\n\n");

  // 2. Schedule.
  const Schedule schedule(24, 24, 2);
  std::printf("## 2. Streaming schedule P = 24, H = 24, tau = 2\n");
  for (std::uint64_t t = 1; t <= 6; ++t) {
    const auto p = schedule.due_at(t);
    std::printf("step %llu: fragment %zu sends (%.1f MB fp32), applies at step %llu\n",
                static_cast<unsigned long long>(t), *p, static_cast<double>(plan.fragments()[*p].numel) * 4 / 1e6,
                static_cast<unsigned long long>(schedule.apply_step(t)));
  }
  std::printf("every step sends exactly one fragment: peak traffic = largest fragment, not the model\n\n");

  // 3. Quorum and grace on a virtual clock: learners with a 100 ms step,
  // contributions of one round arriving 0, 20, 45 and 160 ms after the first.
  std::printf("## 3. Quorum K = 1 + adaptive grace (gamma 0.5, cap 100 ms), virtual clock\n");
  QuorumConfig qc;
  qc.min_quorum = 1;
  qc.overlap = 2;
  qc.gamma = 0.5;
  qc.cap = 100ms;
  qc.deadline = 2s;
  QuorumPolicy policy(qc);
  for (int i = 0; i < 10; ++i) policy.observe_step_time(100ms);
  policy.observe_sync_time(10ms);
  RoundState round;
  round.start = TimePoint{0};
  round.alive = M;
  const std::vector<Duration> arrivals{0ms, 20ms, 45ms, 160ms};
  for (std::size_t i = 0; i < arrivals.size() && i < M; ++i) {
    round.contributions = i + 1;
    const auto d = policy.decide(round, TimePoint{arrivals[i]});
    std::printf("t = %3lld ms: %zu in -> %s%s\n", static_cast<long long>(arrivals[i].count() / 1000000), i + 1,
                std::string(d.reason).c_str(),
                d.kind == WaitDecision::Kind::wait_until
                    ? (" until t = " + std::to_string(d.until.count() / 1000000) + " ms").c_str()
                    : "");
    if (d.kind == WaitDecision::Kind::merge_now) break;
    if (i + 1 < arrivals.size() && d.kind == WaitDecision::Kind::wait_until && arrivals[i + 1] >= d.until) {
      std::printf("t = %3lld ms: grace over -> merge with %zu\n", static_cast<long long>(d.until.count() / 1000000), i + 1);
      break;
    }
  }
  std::printf("grace = clamp(gamma * (tau * xi_step - xi_quorum - xi_sync), 0, cap) = %.1f ms\n\n",
              std::chrono::duration<double, std::milli>(policy.grace()).count());

  // 4. One merge on the real layout of the median-sized fragment.
  std::vector<std::size_t> order(plan.num_fragments());
  for (std::size_t p = 0; p < order.size(); ++p) order[p] = p;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return plan.fragments()[a].numel < plan.fragments()[b].numel; });
  const std::size_t p = order[order.size() / 2];
  const auto layout = plan.layout(p);
  const std::size_t n = plan.fragments()[p].numel;
  std::printf("## 4. One merge of fragment %zu (%zu tensors, %.1f M elements) from %zu learners\n", p, layout.size(),
              static_cast<double>(n) / 1e6, M);
  const auto t0 = std::chrono::steady_clock::now();
  RadialDirectional rda;
  WeightedAverage avg;
  auto acc_rda = rda.make_accumulator(layout);
  auto acc_avg = avg.make_accumulator(layout);
  TokenWeights weights;
  std::mt19937 rng(42);
  std::vector<float> v(n);
  const double R = 1.0;
  for (std::size_t m = 0; m < M; ++m) {
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (auto& x : v) x = g(rng);  // independent Gaussians: near-orthogonal across learners
    const double scale = R / norm(v);
    for (auto& x : v) x = static_cast<float>(x * scale);
    // Learner m ran 20 + 4 m steps of 4096 tokens: faster learners weigh more.
    const Counters c{static_cast<std::int64_t>(20 + 4 * m), static_cast<std::int64_t>((20 + 4 * m) * 4096)};
    const double w = weights(c);
    acc_rda.add(v, w);
    acc_avg.add(v, w);
    std::printf("learner %zu: %lld steps, %lld tokens, weight %.3g, ||v|| = %.3f\n", m,
                static_cast<long long>(c.steps), static_cast<long long>(c.tokens), w, norm(v));
  }
  std::vector<float> delta_rda(n), delta_avg(n);
  acc_rda.finish(delta_rda);
  acc_avg.finish(delta_avg);
  std::printf("||RDA merge|| = %.3f (keeps the learners' norm), ||plain average|| = %.3f (~ 1/sqrt(M) = %.3f)\n",
              norm(delta_rda), norm(delta_avg), 1.0 / std::sqrt(static_cast<double>(M)));
  // (RDA is per tensor; whole-fragment norms are shown.)
  NesterovSGD nesterov;  // lr 0.7, momentum 0.9
  std::vector<float> theta(n, 0.0f), state(nesterov.state_size(n), 0.0f);
  nesterov.step(theta, delta_rda, state);
  std::printf("outer Nesterov step (lr 0.7, mu 0.9, zero momentum): ||Theta change|| = %.3f = 0.7 x 1.9 x ||Delta||\n",
              norm(theta));
  std::printf("merge of %zu x %.1f M elements took %.2f s\n", M, static_cast<double>(n) / 1e6, seconds_since(t0));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "demo: %s\n", e.what());
  return 1;
}
