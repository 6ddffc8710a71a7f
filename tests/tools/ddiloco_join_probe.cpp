// ddiloco_join_probe: a learner of any model that says what its join cost, for
// the tests of joins over slow links (scripts/wan/run_wan.sh --join-test).
//
// It takes the model as ddiloco_syncer does (--tensors, --init,
// --reference-model; programs/model_flags.hpp) but needs only its tensor list,
// joins over ZeroMQ with OuterLoop (the derived or given join time-out,
// --join-link-mbit), and prints one line when the state is in:
//   probe <id>: joined in <s> s: <MiB> MiB of state, <MiB> MiB received, <n> join requests, time-out <s> s
// (received counts every byte that came in, duplicates of the state included).
// Then it runs --steps steps of a synthetic inner step (every parameter moves
// by -1e-3, --tokens-per-step tokens) every --step-ms, printing a progress line
// every --report-every steps (sends, applies, bytes in), and leaves. With
// --steps 0 it steps until --stop-file exists or SIGTERM/SIGINT.
// What it is not: a trainer (ddiloco_learner trains the reference model).
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/transport/zmq.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "model_flags.hpp"
#include "round_flag.hpp"

using namespace ddiloco;

namespace {
std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }
double mib(std::uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }
}  // namespace

int main(int argc, char** argv) try {
  cli::Flags f("ddiloco_join_probe", "a learner of any model that reports what its join cost (tests of slow links)");
  f.add("connect", "tcp://127.0.0.1:5555", "the syncer's endpoint");
  f.add("id", "0", "this learner's id");
  f.add("plaintext", "false", "connect without encryption (the only mode of this test tool)", true);
  cli::add_model_flags(f);
  f.add("fragments", "5", "P (must match the syncer)");
  f.add("sync-every", "24", "H (must match the syncer)");
  f.add("overlap", "2", "tau (must match the syncer)");
  cli::add_round_flag(f, "this probe");
  f.add("join-timeout-ms", "0", "give up joining after this long; 0: derived from the state and --join-link-mbit");
  f.add("join-link-mbit", "100", "the declared link to the syncer in Mbit/s (sizes the derived join time-out)");
  f.add("steps", "0", "synthetic inner steps after the join (0: until --stop-file or a signal)");
  f.add("step-ms", "100", "time between two inner steps");
  f.add("tokens-per-step", "32", "tokens each synthetic inner step declares");
  f.add("report-every", "10", "print a progress line every this many steps");
  f.add("stop-file", "", "stop (leave, exit 0) after the step at which this file exists");
  if (!f.parse(argc, argv)) return 0;
  if (!f.flag("plaintext")) throw InvalidArgument("ddiloco_join_probe runs in plaintext only: pass --plaintext");
  if (f.integer("join-timeout-ms") < 0)
    throw InvalidArgument(detail::msg("--join-timeout-ms = ", f.integer("join-timeout-ms"), " must be >= 0"));
  if (f.count("tokens-per-step") == 0) throw InvalidArgument("--tokens-per-step must be > 0 (the tokens of one step)");

  const cli::Model model = cli::model_from_flags(f, /*values=*/false);
  const Plan plan = make_plan(model.specs, f.count("fragments"));
  std::vector<std::vector<float>> params;
  for (const auto& s : plan.tensors()) params.emplace_back(s.numel, 0.0f);

  SteadyClock clock;
  ZmqLearnerConfig zc;
  zc.connect = f.str("connect");
  zc.id = static_cast<LearnerId>(f.integer("id"));
  zc.security = ZmqSecurity::plaintext();
  size_for_plan(zc, plan);
  ZmqLearnerTransport link(zc, clock);
  OuterLoopConfig oc;
  oc.id = zc.id;
  oc.sync_every = f.count("sync-every");
  oc.overlap = f.count("overlap");
  oc.round = cli::round_from_flags(f);  // the syncer's --round (the programs' default: pull)
  oc.tokens_per_step = f.count("tokens-per-step");
  oc.join_timeout = std::chrono::milliseconds(f.integer("join-timeout-ms"));
  oc.join_link_mbit = f.num("join-link-mbit");
  OuterLoop<ZmqLearnerTransport, std::vector<float>> outer(plan, link, oc);
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  std::printf("probe %u: joining %s (plan %016llx, %zu parameters, %.3f MiB of state, time-out %.1f s)\n", zc.id,
              zc.connect.c_str(), static_cast<unsigned long long>(plan.fingerprint()), plan.total_numel(),
              mib(full_state_bytes(plan)), std::chrono::duration<double>(outer.join_timeout()).count());
  std::fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  outer.join(std::span<std::vector<float>>(params));
  const double join_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("probe %u: joined in %.3f s: %.3f MiB of state, %.3f MiB received, %llu join requests, time-out %.1f s\n",
              zc.id, join_s, mib(outer.join_bytes_received()), mib(link.counters().bytes_in),
              static_cast<unsigned long long>(link.counters().frames_out),
              std::chrono::duration<double>(outer.join_timeout()).count());
  std::fflush(stdout);

  const std::size_t steps = f.count("steps"), every = std::max<std::size_t>(1, f.count("report-every"));
  const auto step_time = std::chrono::milliseconds(f.integer("step-ms"));
  const std::string stop_file = f.str("stop-file");
  const auto tokens = static_cast<std::int64_t>(f.count("tokens-per-step"));
  auto next = std::chrono::steady_clock::now();
  for (std::size_t s = 1; steps == 0 || s <= steps; ++s) {
    std::error_code ec;
    if (g_signal.load() != 0 || (!stop_file.empty() && std::filesystem::exists(stop_file, ec))) break;
    for (auto& t : params)
      for (float& x : t) x -= 1e-3f;
    outer.step(std::span<std::vector<float>>(params), tokens);
    if (s % every == 0) {
      const auto& st = outer.status();
      std::printf("probe %u: step %zu sends %llu applies %llu failed-sends %llu bytes-in %llu\n", zc.id, s,
                  static_cast<unsigned long long>(st.sends), static_cast<unsigned long long>(st.applies),
                  static_cast<unsigned long long>(st.send_failures),
                  static_cast<unsigned long long>(link.counters().bytes_in));
      std::fflush(stdout);
    }
    next += step_time;
    std::this_thread::sleep_until(next);
  }
  outer.leave();
  std::printf("probe %u: done\n", zc.id);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddiloco_join_probe: %s\n", e.what());
  return 1;
}
