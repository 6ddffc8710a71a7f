// ddiloco_learner: one learner training the reference character LM with
// Decoupled DiLoCo over ZeroMQ (the syncer is ddiloco_syncer --reference-model).
//
// It joins (receives the global state), trains its data shard with AdamW and
// calls OuterLoop::step after every inner step; it never waits for the syncer.
// Prints progress lines: step, train loss, validation loss of its local
// parameters (val) and of the global model as it last received it
// (val-global), tokens/s, sends/applies. With --observe it trains nothing and
// prints the validation loss of the global model it fetches from the syncer.
// SIGTERM/SIGINT stop it after the current inner step: it leaves and exits 0.
// `--metrics ADDR:PORT` serves Prometheus metrics (docs/metrics.md).
// It declares its batch (tokens per inner step) at join; the syncer bounds its
// token counts by it (docs/algorithm.md, "Validation and staleness").
// `--help` lists every flag.
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/adapters/eigen.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/reference/char_lm.hpp>
#include <ddiloco/transport/sharded.hpp>
#include <ddiloco/transport/zmq.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "metrics.hpp"
#include "round_flag.hpp"

using namespace ddiloco;
namespace ref = ddiloco::reference;

namespace {
std::atomic<int> g_signal{0};
// The first SIGTERM/SIGINT asks for a clean stop; a second one ends the process
// at once (a lock-step wait for a syncer that is gone can last its time-out).
extern "C" void on_signal(int sig) {
  g_signal.store(sig);
  std::signal(sig, SIG_DFL);
}

/// "A,B,C" (--connect) -> {"A", "B", "C"}; an empty item is an error.
std::vector<std::string> split_endpoints(const std::string& s) {
  std::vector<std::string> out;
  std::size_t at = 0;
  for (;;) {
    const std::size_t end = std::min(s.find(',', at), s.size());
    if (end == at)
      throw InvalidArgument("--connect '" + s + "': an empty endpoint; give tcp://HOST:PORT, or one per syncer "
                            "shard separated by commas (no spaces)");
    out.push_back(s.substr(at, end - at));
    if (end == s.size()) return out;
    at = end + 1;
  }
}

/// --observe: fetches the global state every --observe-every-ms and prints its
/// validation loss; never trains, never counted as a learner by the syncer.
int observe(const cli::Flags& f, const ZmqLearnerConfig& zc, const Plan& plan, ref::CharLm& scorer,
            const auto& corpus, ref::Params params) {
  SteadyClock clock;
  ZmqObserver observer(zc, clock);
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  const auto every = std::chrono::milliseconds(f.integer("observe-every-ms"));
  const Duration timeout =
      f.integer("join-timeout-ms") > 0
          ? Duration{std::chrono::milliseconds(f.integer("join-timeout-ms"))}
          : derived_join_timeout(full_state_bytes(plan), f.num("join-link-mbit"));
  const std::size_t count = f.count("observe-count");
  std::printf("observer %u: observing %s (plan %016llx)\n", zc.id, zc.connect.c_str(),
              static_cast<unsigned long long>(plan.fingerprint()));
  std::fflush(stdout);
  for (std::size_t n = 1; (count == 0 || n <= count) && g_signal.load() == 0; ++n) {
    const auto started = std::chrono::steady_clock::now();
    const GlobalView view = observer.fetch(plan.fingerprint(), timeout);
    const std::vector<float> flat = view.in_plan_order(plan);
    std::size_t at = 0;
    for (auto& t : params) {
      std::copy_n(flat.data() + at, t.size(), t.data());
      at += static_cast<std::size_t>(t.size());
    }
    std::string versions;
    for (auto v : view.versions) {  // appended: GCC 12 -O3 misreports `"," + std::string` as -Wrestrict
      if (!versions.empty()) versions += ',';
      versions += std::to_string(v);
    }
    std::printf("observer %u: fetch %zu versions %s val-global %.4f\n", zc.id, n, versions.c_str(),
                ref::evaluate(scorer, params, corpus.validation, f.count("eval-examples")));
    std::fflush(stdout);
    while (g_signal.load() == 0 && (count == 0 || n < count) && std::chrono::steady_clock::now() - started < every)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::printf("observer %u: done\n", zc.id);
  return 0;
}
/// Joins and trains over `link` (one syncer, or every shard of a sharded one).
template <class Link>
int train(const cli::Flags& f, Link& link, const ZmqLearnerConfig& zc, const std::string& endpoints,
          ref::Trainer& trainer, ref::CharLm& scorer, const auto& corpus, const Plan& plan) {
  OuterLoopConfig oc;
  oc.id = zc.id;
  oc.sync_every = f.count("sync-every");
  oc.overlap = f.count("overlap");
  oc.round = cli::round_from_flags(f);  // must match the syncer's --round: a join with the other is refused
  // Declared at join: the syncer rejects a contribution claiming more than
  // steps x this many tokens (and refuses the join above --max-tokens-per-step).
  oc.tokens_per_step = trainer.tokens_per_step();
  if (f.integer("join-timeout-ms") < 0)
    throw InvalidArgument(detail::msg("--join-timeout-ms = ", f.integer("join-timeout-ms"),
                                      " must be >= 0 (0: derived from the model's size and --join-link-mbit)"));
  oc.join_timeout = std::chrono::milliseconds(f.integer("join-timeout-ms"));
  oc.join_link_mbit = f.num("join-link-mbit");
  oc.lock_step = f.flag("lock-step");
  oc.lock_step_timeout = std::chrono::milliseconds(f.integer("lock-step-timeout-ms"));
  OuterLoop<Link, Eigen::MatrixXf> outer(plan, link, oc);
  cli::LearnerMetricsFlag metrics(f, zc.id);  // serving from now on (steps 0 while joining)
  metrics.update(outer.status(), link.counters());
  auto& params = trainer.params();
  std::printf("learner %u: joining %s (plan %016llx, %zu parameters, %s rounds)\n", zc.id, endpoints.c_str(),
              static_cast<unsigned long long>(plan.fingerprint()), trainer.model().parameter_count(),
              std::string(to_string(oc.round)).c_str());
  std::fflush(stdout);
  const auto join_start = std::chrono::steady_clock::now();
  outer.join(params);
  const double join_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - join_start).count();
  // SIGTERM/SIGINT from here on: stop after the current step, leave, exit 0.
  // Installed before "joined" is printed: a test that signals on that line
  // must find the handler in place.
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  std::printf("learner %u: joined in %.3f s (%.3f MiB of state, time-out %.1f s)\n", zc.id, join_s,
              static_cast<double>(outer.join_bytes_received()) / (1024.0 * 1024.0),
              std::chrono::duration<double>(outer.join_timeout()).count());
  std::fflush(stdout);  // tests wait for this line
  if (const std::string start_file = f.str("start-file"); !start_file.empty()) {
    // Joined, not training: polls the link (heartbeats, arrived globals)
    // until the file exists, so that a test starts several learners' first
    // steps together, whenever each join completed.
    std::printf("learner %u: waiting for %s before step 1\n", zc.id, start_file.c_str());
    std::fflush(stdout);
    std::error_code ec;
    while (g_signal.load() == 0 && !std::filesystem::exists(start_file, ec)) {
      outer.poll(params);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  ref::Params global = params;  // the global model's view, for val-global
  const std::size_t steps = f.count("steps"), every = std::max<std::size_t>(1, f.count("eval-every"));
  const auto t0 = std::chrono::steady_clock::now();
  double loss_sum = 0;
  const std::string stop_file = f.str("stop-file");
  const std::size_t pause_after = f.count("pause-after-steps");
  std::uint64_t rejoins = 0;
  bool rejoining = false;
  for (std::size_t s = 1; steps == 0 || s <= steps; ++s) {
    if (g_signal.load() != 0) {
      std::printf("learner %u: signal %d: stopping after step %zu\n", zc.id, g_signal.load(), s - 1);
      break;
    }
    std::error_code ec;
    if (!stop_file.empty() && std::filesystem::exists(stop_file, ec)) {
      std::printf("learner %u: %s exists: stopping after step %zu\n", zc.id, stop_file.c_str(), s - 1);
      break;
    }
    const auto before = trainer.tokens();
    loss_sum += trainer.step();
    outer.step(params, static_cast<std::int64_t>(trainer.tokens() - before));
    metrics.update(outer.status(), link.counters());
    if (outer.status().rejoins != rejoins) {
      rejoins = outer.status().rejoins;
      std::printf("learner %u: the syncer does not know this learner (restored from a checkpoint older than its "
                  "join?): joining again (rejoin %llu) at step %zu\n",
                  zc.id, static_cast<unsigned long long>(rejoins), s);
      std::fflush(stdout);
      rejoining = true;  // its end is said below, even when the reply came in this same step
    }
    if (outer.rejoining() != rejoining) {
      rejoining = outer.rejoining();
      if (!rejoining) std::printf("learner %u: rejoined at step %zu\n", zc.id, s);
      std::fflush(stdout);
    }
    if (s % every == 0 || s == steps) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const auto& st = outer.status();
      // val: this learner's parameters; val-global: the global model as this
      // learner last received it (every fragment's newest global).
      outer.read_global(global);
      const auto examples = f.count("eval-examples");
      const double val = ref::evaluate(scorer, params, corpus.validation, examples);
      const double val_global = ref::evaluate(scorer, global, corpus.validation, examples);
      std::printf("learner %u: step %zu train %.4f val %.4f val-global %.4f tokens/s %.0f sends %llu applies %llu "
                  "failed-sends %llu rejoins %llu round %s pulls %llu metadata %llu\n",
                  zc.id, s, loss_sum / static_cast<double>(every), val, val_global,
                  static_cast<double>(trainer.tokens()) / secs, static_cast<unsigned long long>(st.sends),
                  static_cast<unsigned long long>(st.applies), static_cast<unsigned long long>(st.send_failures),
                  static_cast<unsigned long long>(st.rejoins), std::string(to_string(oc.round)).c_str(),
                  static_cast<unsigned long long>(st.pulls), static_cast<unsigned long long>(st.metadata_sent));
      std::fflush(stdout);
      loss_sum = 0;
    }
    if (s == pause_after) {
      std::printf("learner %u: pausing after step %zu (SIGSTOP)\n", zc.id, s);
      std::fflush(stdout);
      std::raise(SIGSTOP);
    }
  }
  outer.leave();
  std::printf("learner %u: done\n", zc.id);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  cli::Flags f("ddiloco_learner", "a Decoupled DiLoCo learner training the reference model over ZeroMQ");
  f.add("config", "", "file of `name = value` lines with any of these flags");
  f.add("connect", "tcp://127.0.0.1:5555",
        "the syncer's endpoint; for a syncer sharded by fragment every shard's, comma-separated in shard order "
        "(shard i of S runs --shard i/S; all shards share one key pair under CURVE)");
  f.add("id", "0", "this learner's id (unique; the allow-list binds it to this learner's key)");
  f.add("shard", "0", "data shard index of this learner");
  f.add("shards", "1", "number of data shards (usually the number of learners)");
  f.add("steps", "1000", "inner-step budget (0: no limit; stop with SIGTERM/SIGINT or --stop-file)");
  f.add("stop-file", "",
        "stop (leave, exit 0) after the inner step at which this file exists; tests use it to keep a learner "
        "training until they have seen what they wait for");
  f.add("start-file", "",
        "after joining, wait (still joined: heartbeats go on) until this file exists before the first inner step; "
        "tests use it to start several learners' training together");
  f.add("pause-after-steps", "0",
        "after this inner step (and its progress line, if one is due) stop the process with SIGSTOP until SIGCONT, "
        "still joined; tests freeze learners at an exact step this way (0: never)");
  f.add("seed", "1", "seed of the model's initial values (must match the syncer's)");
  f.add("fragments", "5", "P (must match the syncer)");
  f.add("sync-every", "24", "H: inner steps between two syncs of a fragment");
  f.add("overlap", "2", "tau: steps between a send and the application of its result");
  cli::add_round_flag(f, "this learner");
  f.add("codec", "fp32", "codec of the outer gradients sent: fp32, bf16, fp16, int8, int4");
  f.add("error-feedback", "false", "carry the quantisation residual into the next send", true);
  f.add("keys", "", "this learner's key file (from ddiloco_keygen)");
  f.add("server-key", "", "the syncer's public key file");
  f.add("plaintext", "false", "connect WITHOUT encryption or authentication (explicit choice)", true);
  f.add("join-timeout-ms", "0",
        "give up joining after this long; 0: derived from the model's size and --join-link-mbit (30 s + twice the "
        "state's time on that link)");
  f.add("join-link-mbit", "100",
        "this learner's link to the syncer in Mbit/s, as declared: sizes the derived join time-out (a 1 GiB model "
        "at 100 Mbit/s: 30 + 2 x 86 s)");
  f.add("lock-step", "false",
        "wait at send + tau for each fragment's merged result (synchronous / Streaming DiLoCo baseline)", true);
  f.add("lock-step-timeout-ms", "60000", "in lock-step mode, stop waiting for a result after this long");
  f.add("eval-every", "200", "print a progress line every this many steps");
  f.add("eval-examples", "2048", "validation examples per progress line");
  f.add("observe", "false",
        "observe instead of training: fetch the global model every --observe-every-ms and print its validation "
        "loss (never counted as a learner; under CURVE its --id and key must be on the allow-list: give it an "
        "id of its own)",
        true);
  f.add("observe-every-ms", "5000", "with --observe: time between two fetches of the global model");
  f.add("observe-count", "0", "with --observe: stop after this many fetches (0: until SIGTERM/SIGINT)");
  cli::add_metrics_flags(f);
  if (!f.parse(argc, argv)) return 0;
  cli::check_metrics_flags(f, "ddiloco_learner");
  if (f.count("steps") != 0 && f.count("pause-after-steps") > f.count("steps"))
    throw InvalidArgument("--pause-after-steps = " + std::to_string(f.count("pause-after-steps")) +
                          " is beyond --steps = " + std::to_string(f.count("steps")) +
                          ": it would never pause; pass at most --steps, or 0");

  const auto corpus = ref::load_fortunes();
  ref::TrainerConfig tc;
  tc.seed = static_cast<std::uint64_t>(f.integer("seed"));
  ref::Trainer trainer(tc, corpus.train, ref::Shard{f.count("shard"), f.count("shards")});
  ref::CharLm scorer(tc.model);
  const Plan plan = make_plan(trainer.model().tensor_specs(), f.count("fragments"));

  SteadyClock clock;
  ZmqLearnerConfig zc;
  zc.connect = f.str("connect");
  zc.id = static_cast<LearnerId>(f.integer("id"));
  zc.error_feedback = f.flag("error-feedback");
  zc.codec = parse_codec(f.str("codec"));
  size_for_plan(zc, plan);  // a syncer frame larger than the plan's largest fragment cuts the connection
  if (f.flag("plaintext")) {
    zc.security = ZmqSecurity::plaintext();
  } else {
    if (f.str("keys").empty() || f.str("server-key").empty())
      throw InvalidArgument("CURVE security needs --keys and --server-key; pass --plaintext to run unencrypted");
    zc.security.own = read_key_file(f.str("keys"));
    zc.security.server_public_key = read_key_file(f.str("server-key")).public_key;
  }
  const std::vector<std::string> endpoints = split_endpoints(f.str("connect"));
  if (f.flag("observe") && endpoints.size() > 1)
    throw InvalidArgument("--observe takes one syncer endpoint; a sharded syncer's global model is the union of "
                          "its shards' fragments, which the observer does not assemble yet: observe an unsharded "
                          "run, or read each shard's status");
  if (f.flag("observe")) return observe(f, zc, plan, scorer, corpus, trainer.params());
  if (endpoints.size() == 1) {
    ZmqLearnerTransport link(zc, clock);
    return train(f, link, zc, zc.connect, trainer, scorer, corpus, plan);
  }
  // A syncer sharded by fragment: one link per shard, in shard order (docs/sharding.md).
  if (endpoints.size() > plan.num_fragments())
    throw InvalidArgument(detail::msg("--connect lists ", endpoints.size(), " syncer shards but the plan has ",
                                      plan.num_fragments(), " fragments (each shard serves at least one); "
                                      "list one endpoint per shard, or raise --fragments"));
  std::vector<std::unique_ptr<ZmqLearnerTransport>> links;
  for (const auto& e : endpoints) {
    ZmqLearnerConfig one = zc;
    one.connect = e;
    links.push_back(std::make_unique<ZmqLearnerTransport>(one, clock));
  }
  ShardedLearnerTransport<ZmqLearnerTransport> link(plan, std::move(links));
  return train(f, link, zc, f.str("connect"), trainer, scorer, corpus, plan);
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddiloco_learner: %s\n", e.what());
  return 1;
}
