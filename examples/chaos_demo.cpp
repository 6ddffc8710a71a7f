// chaos_demo: the project's main demonstration. Four learners of the reference character model
// (<ddiloco/reference/char_lm.hpp>) on the fortunes corpus, each on its own data shard, train with
// four methods at equal token budgets, with and without a failure tape, and the demo reports the
// validation loss of the GLOBAL parameters (the syncer's), simulated wall time, goodput and global
// downtime:
//   (a) synchronous data-parallel: average every step (P = 1, H = 1, tau = 0, lock-step, K = M,
//       WeightedAverage + AverageOnly);
//   (b) DiLoCo: P = 1, H, tau = 0, lock-step, K = M, WeightedAverage + Nesterov;
//   (c) Streaming DiLoCo: P = 5, H, tau = 2, lock-step, K = M, WeightedAverage + Nesterov;
//   (d) Decoupled DiLoCo: P = 5, H, tau = 2, non-blocking, K = 1 + grace window,
//       token-weighted RDA + Nesterov;
//   (e) (d) without the grace window, to measure what the grace window buys.
// Rows (d) and (e) run in both round modes (RoundMode): push (each learner sends at its own slot,
// the syncer merges on arrival) and pull (the paper's round: the syncer keeps the global step,
// opens each fragment's round at its slot, waits for K learners with progress plus the grace
// window and pulls from every learner available). With --m16 the demo also runs (d) at M = 16
// with four of the sixteen learners 2x slower, in both modes. With --ablation it also runs (d)
// on the failure tape split in two: the straggler and the kill, and the straggler and the message
// faults, to show which part of the tape costs what.
//
// Time is SIMULATED cluster time (LocalCluster::run_virtual): every inner step costs `--step-ms`
// of virtual time times the learner's slowdown, and the compute is real. So the timing
// comparison is deterministic and does not depend on the load of the machine running the demo;
// the demo also prints the real elapsed seconds.
//
// Usage: chaos_demo [--steps N] [--seed S] [--quick] [--m16] [--ablation] [--out DIR] [--H H] [--eval-examples E]
//                   [--step-ms MS] [--outer-lr LR] [--momentum MU] [--only TEXT] [--fortunes DIR]
//                   [--clip-factor C] [--weight-cap-factor W] [--shards contiguous|interleaved]
// Writes DIR/results.csv, DIR/curves.csv and DIR/results.md (default DIR = results/chaos);
// examples/plot_chaos.py draws DIR/loss_vs_time.png from them.
#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <ddiloco/adapters/eigen.hpp>
#include <ddiloco/local_cluster.hpp>
#include <ddiloco/reference/char_lm.hpp>

namespace ref = ddiloco::reference;
using namespace std::chrono_literals;
using ddiloco::Duration;

namespace {

constexpr std::size_t kLearners = 4;   ///< M of the main table
constexpr std::size_t kLargeM = 16;    ///< M of the --m16 rows

struct Args {
  std::size_t steps = 1200;  ///< per-learner budget: the run stops at M * steps * batch tokens
  std::uint64_t seed = 1;
  std::size_t sync_every = 30;  ///< H of the DiLoCo methods
  std::size_t eval_examples = 4096;
  double step_ms = 100.0;  ///< simulated duration of one inner step at speed 1
  float outer_lr = 0.7f;   ///< Nesterov outer learning rate, the same for every Nesterov method
  /// Nesterov momentum, the same for every Nesterov method. 0.7, not the paper's (and the
  /// library's) 0.9: with 40 outer rounds per fragment, the DiLoCo baseline (b) is best at 0.7 of
  /// {0.3, 0.5, 0.7, 0.9} on seeds 1, 2 and 3 (docs/chaos_demo.md, "Outer momentum").
  float momentum = 0.7f;
  std::string only;        ///< run only rows whose "label / tape" contains this (experiments)
  /// SyncerConfig::clip_factor of every syncer (the library's default; 0: no clipping).
  double clip_factor = ddiloco::SyncerConfig{}.clip_factor;
  /// SyncerConfig::weight_cap_factor of every syncer (the library's default; 0: no cap).
  double weight_cap_factor = ddiloco::SyncerConfig{}.weight_cap_factor;
  std::string out = "results/chaos";
  std::string fortunes = ref::default_fortune_dir().string();
  bool quick = false;
  bool m16 = false;  ///< also run (d) at M = 16 with four 2x stragglers, push and pull
  bool ablation = false;  ///< also run (d) on the two halves of the failure tape, push and pull
  /// Target positions per block of the data shards (ref::Shard::block): learner m trains on
  /// blocks j with j mod M = m, spread over the whole corpus; 0: contiguous ranges (each learner
  /// on the fortune files of its range).
  std::size_t shard_block = 0;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "chaos_demo: %s\n"
               "usage: chaos_demo [--steps N] [--seed S] [--quick] [--m16] [--ablation] [--out DIR] [--H H] [--eval-examples E]\n"
               "                  [--step-ms MS] [--outer-lr LR] [--momentum MU] [--only TEXT] [--fortunes DIR]\n"
               "                  [--clip-factor C] [--weight-cap-factor W] [--shards contiguous|interleaved]\n"
               "  --steps N      inner steps per learner, the budget of every row (default 1200; --quick: 4 H)\n"
               "  --seed S       seed of the model, the data order and the fault tape (default 1)\n"
               "  --quick        a smoke run: 4 H steps, 512 validation examples\n"
               "  --m16          also run Decoupled DiLoCo at M = 16 with 4 learners 2x slower, push and pull\n"
               "  --ablation     also run Decoupled DiLoCo on the failure tape's two halves: the straggler\n"
               "                 and the kill, the straggler and the message faults (push and pull)\n"
               "                 (about 4x the compute of an M = 4 row each; off by default)\n"
               "  --out DIR      where results.csv, curves.csv and results.md go (default results/chaos)\n"
               "  --H H          inner steps per outer round (default 30, at least 3)\n"
               "  --eval-examples E  validation examples scored (default 4096; --quick: 512)\n"
               "  --step-ms MS   simulated duration of one inner step at speed 1 (default 100)\n"
               "  --outer-lr LR, --momentum MU  outer Nesterov of every Nesterov row (default 0.7, 0.7)\n"
               "  --only TEXT    run only the rows whose \"label / round / M / tape\" contains TEXT\n"
               "  --fortunes DIR the fortunes corpus (default: the distribution's)\n"
               "  --clip-factor C, --weight-cap-factor W  the syncer's admission bounds (0: off)\n"
               "  --shards contiguous|interleaved  data shards: one range of the corpus per learner, or\n"
               "                 blocks of 4096 characters dealt round-robin (default contiguous)\n",
               why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  bool steps_given = false, eval_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") usage("compares data-parallel, DiLoCo, Streaming and Decoupled DiLoCo");
    if (flag == "--quick") {
      a.quick = true;
      continue;
    }
    if (flag == "--m16") {
      a.m16 = true;
      continue;
    }
    if (flag == "--ablation") {
      a.ablation = true;
      continue;
    }
    if (i + 1 >= argc) usage("every option but --quick, --m16 and --ablation takes a value");
    const char* value = argv[++i];
    char* end = nullptr;
    if (flag == "--out") {
      a.out = value;
      continue;
    }
    if (flag == "--fortunes") {
      a.fortunes = value;
      continue;
    }
    if (flag == "--only") {
      a.only = value;
      continue;
    }
    if (flag == "--shards") {
      const std::string_view v = value;
      if (v != "contiguous" && v != "interleaved") usage("--shards takes contiguous or interleaved");
      a.shard_block = v == "interleaved" ? 4096 : 0;
      continue;
    }
    if (flag == "--steps") {
      a.steps = std::strtoull(value, &end, 10);
      steps_given = true;
    } else if (flag == "--seed") {
      a.seed = std::strtoull(value, &end, 10);
    } else if (flag == "--H") {
      a.sync_every = std::strtoull(value, &end, 10);
    } else if (flag == "--eval-examples") {
      a.eval_examples = std::strtoull(value, &end, 10);
      eval_given = true;
    } else if (flag == "--step-ms") {
      a.step_ms = std::strtod(value, &end);
    } else if (flag == "--outer-lr") {
      a.outer_lr = std::strtof(value, &end);
    } else if (flag == "--momentum") {
      a.momentum = std::strtof(value, &end);
    } else if (flag == "--clip-factor") {
      a.clip_factor = std::strtod(value, &end);
    } else if (flag == "--weight-cap-factor") {
      a.weight_cap_factor = std::strtod(value, &end);
    } else {
      usage("unknown option");
    }
    if (end == value || *end != '\0') usage("option value is not a number");
  }
  if (a.quick) {
    if (!steps_given) a.steps = 4 * a.sync_every;
    if (!eval_given) a.eval_examples = 512;
  }
  if (a.steps < a.sync_every) usage("--steps must be at least H (one outer round)");
  if (a.sync_every < 3) usage("--H must be at least 3 (tau = 2 < H, and P <= H)");
  if (!(a.step_ms > 0.0)) usage("--step-ms must be > 0");
  if (a.eval_examples == 0) usage("--eval-examples must be > 0");
  return a;
}

/// A learner for LocalCluster: the reference trainer on its shard (the ClusterTrainer concept).
struct Learner {
  using tensor_type = Eigen::MatrixXf;
  ref::Trainer trainer;
  std::int64_t* tokens;  ///< the run's token counter (progress lines)

  Learner(const ref::TrainerConfig& config, std::span<const ref::Token> train, ref::Shard shard, std::int64_t* t)
      : trainer(config, train, shard), tokens(t) {}
  std::span<Eigen::MatrixXf> parameters() { return trainer.params(); }
  std::int64_t inner_step() {
    trainer.step();
    const auto n = static_cast<std::int64_t>(trainer.tokens_per_step());
    *tokens += n;
    return n;
  }
};
static_assert(ddiloco::ClusterTrainer<Learner>);

enum class Kind { data_parallel, diloco, streaming, decoupled, decoupled_no_grace };
/// straggler: learner 3 of 4 is 3x slower; stragglers: the last quarter of the learners (4 of 16)
/// are 2x slower; straggler_kill and straggler_messages (--ablation): the failure tape without
/// its message faults, and without its kill.
enum class Tape { none, chaos, straggler, stragglers, straggler_kill, straggler_messages };

struct Method {
  Kind kind;
  std::string label;  ///< short name for tables and plots
  std::size_t fragments, sync_every, overlap;
  bool lock_step;
  std::size_t quorum;
  bool grace;
  ddiloco::RoundMode round = ddiloco::RoundMode::push;
  std::size_t learners = kLearners;
};

const char* round_name(ddiloco::RoundMode r) { return r == ddiloco::RoundMode::pull ? "pull" : "push"; }

const char* tape_name(Tape t) {
  switch (t) {
    case Tape::none: return "none";
    case Tape::chaos: return "chaos";
    case Tape::straggler: return "straggler";
    case Tape::stragglers: return "stragglers";
    case Tape::straggler_kill: return "straggler_kill";
    case Tape::straggler_messages: return "straggler_messages";
  }
  return "?";
}

struct Row {
  Method method;
  Tape tape;
  double val_loss = 0;
  double sim_s = 0, real_s = 0, goodput = 0, downtime_s = 0, mean_quorum = 0;
  std::size_t windows = 0, windows_without_merge = 0;
  std::uint64_t merges = 0, kills = 0, restarts = 0, deadline_merges = 0, grace_waits = 0, rejected = 0;
  std::uint64_t stale = 0;                  ///< contributions rejected as stale (in `rejected`)
  std::uint64_t bytes_out = 0, bytes_in = 0;  ///< syncer down-link / up-link bytes
  std::uint64_t global_step = 0, pull_rounds = 0, pulls_sent = 0, pull_timeouts = 0, pull_rounds_empty = 0;
  std::uint64_t pulls_repeated = 0, answers_redundant = 0;
  std::int64_t tokens = 0;
  bool timed_out = false;
};

struct CurvePoint {
  std::string label;
  ddiloco::RoundMode round;
  std::size_t learners;
  Tape tape;
  double sim_s;
  std::int64_t tokens;
  double val_loss;
};

struct Context {
  Args args;
  ref::FortuneCorpus corpus;
  ref::TrainerConfig trainer;
  std::vector<ddiloco::TensorSpec> specs;
  std::vector<CurvePoint> curves;
};

double seconds(Duration d) { return std::chrono::duration<double>(d).count(); }

/// The global parameters (flat, plan order = model order) scored on the validation split.
double validation_loss(Context& ctx, std::span<const float> flat) {
  ref::CharLm model(ctx.trainer.model);
  ref::Params p = model.zeros();
  std::size_t off = 0;
  for (auto& t : p) {
    std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(off), t.size(), t.data());
    off += static_cast<std::size_t>(t.size());
  }
  return ref::evaluate(model, p, ctx.corpus.validation, ctx.args.eval_examples);
}

/// The failure tape: learner 1 dies a third of the way in and is down for a fifth of the budget
/// (it restarts and rejoins), learner 3 runs 3x slower throughout, 2% of messages are lost and
/// every message takes 5 ms + up to 5 ms jitter. The straggler tape has only the slow learner;
/// --ablation's two tapes have the slow learner and either the kill or the message faults.
/// The M = 16 tape ("stragglers"): the last quarter of the learners are 2x slower throughout.
ddiloco::FaultTape make_tape(Tape kind, const Args& a, std::size_t learners) {
  ddiloco::FaultTape tape(a.seed);
  if (kind == Tape::none) return tape;
  if (kind == Tape::stragglers) {
    for (std::size_t id = learners - learners / 4; id < learners; ++id)
      tape.add(ddiloco::Slowdown{static_cast<ddiloco::LearnerId>(id), 2.0, 0, std::nullopt});
    return tape;
  }
  tape.add(ddiloco::Slowdown{3, 3.0, 0, std::nullopt});
  if (kind == Tape::straggler) return tape;
  if (kind != Tape::straggler_messages)
    tape.add(ddiloco::Kill{1, a.steps / 3, ddiloco::Downtime{a.steps / 5, Duration{0}}});
  if (kind != Tape::straggler_kill) {
    ddiloco::MessageFaults f;
    f.drop = 0.02;
    f.latency = 5ms;
    f.jitter = 5ms;
    tape.set_message_faults(f);
  }
  return tape;
}

ddiloco::ClusterConfig make_config(const Method& m, Tape tape, const Context& ctx) {
  const Args& a = ctx.args;
  ddiloco::ClusterConfig c;
  c.learners = m.learners;
  c.step_time = std::chrono::duration_cast<Duration>(std::chrono::duration<double, std::milli>(a.step_ms));
  c.token_budget = static_cast<std::int64_t>(m.learners * a.steps * ctx.trainer.batch_size);
  c.tape = make_tape(tape, a, m.learners);
  // Round mode: pull rounds need the syncer to know H (the global step's schedule).
  c.outer.round = m.round;
  c.syncer.round = m.round;
  c.outer.sync_every = m.sync_every;
  c.outer.overlap = m.overlap;
  c.outer.lock_step = m.lock_step;
  c.outer.alpha = 0.0f;
  // Liveness, in units of the step time so the settings scale with --step-ms:
  // a heartbeat every 10 steps, declared dead after 30 silent steps.
  c.outer.heartbeat_interval = c.step_time * 10;
  c.outer.join_retry = c.step_time * 10;
  c.syncer.heartbeat_timeout = c.step_time * 30;
  c.syncer.quorum.min_quorum = m.quorum;
  // Admission: the schedule (the ceiling on a contribution's steps), each
  // learner's declared batch (its token claims) and norm clipping.
  c.syncer.sync_every = m.sync_every;
  c.syncer.clip_factor = a.clip_factor;
  c.syncer.weight_cap_factor = a.weight_cap_factor;
  c.outer.tokens_per_step = ctx.trainer.batch_size;
  c.syncer.quorum.overlap = m.overlap;
  c.syncer.quorum.grace = m.grace;
  c.syncer.quorum.gamma = 0.3;
  c.syncer.quorum.cap = c.step_time;  // "about one inner step" (paper)
  // A wait-for-all round must wait for the 3x straggler, which sends 2H step times after the
  // fast learners: the hard deadline is 4H step times after the round's first contribution (and
  // at least the heartbeat time-out). It bounds a round whose contribution was lost; a dead
  // learner unblocks the others sooner, when its heartbeat times out. A lock-step learner whose
  // global was lost gives up waiting after the same time and goes on.
  const Duration round = c.step_time * static_cast<Duration::rep>(4 * m.sync_every);
  c.syncer.quorum.deadline = std::max(round, c.syncer.heartbeat_timeout);
  c.outer.lock_step_timeout = c.syncer.quorum.deadline;
  c.sample_every = c.step_time * 100;
  return c;
}

/// "label / round / M / tape": the row's name in progress lines and what --only matches.
std::string row_key(const Method& m, Tape tape) {
  return m.label + " / " + round_name(m.round) + " / M=" + std::to_string(m.learners) + " / " + tape_name(tape);
}

template <class Rule, class Opt>
Row run(Context& ctx, const Method& m, Tape tape, Opt opt) {
  const Args& a = ctx.args;
  const ddiloco::Plan plan = ddiloco::make_plan(ctx.specs, m.fragments);
  ddiloco::ClusterConfig config = make_config(m, tape, ctx);
  std::int64_t tokens = 0;
  const std::string name = row_key(m, tape);
  Duration next_progress{0};
  const Duration progress_every = config.step_time * 300;
  config.on_sample = [&](ddiloco::TimePoint t, std::span<const float> global, const ddiloco::SyncerStatus& s) {
    const double loss = validation_loss(ctx, global);
    const double sim = seconds(t - ddiloco::TimePoint{0});
    ctx.curves.push_back({m.label, m.round, m.learners, tape, sim, tokens, loss});
    if (t - ddiloco::TimePoint{0} >= next_progress) {
      std::printf("  [%s] t=%7.1fs tokens=%8lld val=%.4f | %s\n", name.c_str(), sim, static_cast<long long>(tokens),
                  loss, s.line().c_str());
      std::fflush(stdout);
      next_progress = t - ddiloco::TimePoint{0} + progress_every;
    }
  };
  const ref::TrainerConfig base = ctx.trainer;
  const auto& train = ctx.corpus.train;
  auto factory = [&, base](ddiloco::LearnerId id, std::uint64_t incarnation) {
    ref::TrainerConfig c = base;
    // Every learner starts from the same initial parameters (the seed); a restarted learner gets
    // them from the syncer at its join, and a new data order (seed + incarnation).
    c.seed = base.seed + incarnation;
    return std::make_unique<Learner>(c, train, ref::Shard{id, m.learners, ctx.args.shard_block}, &tokens);
  };
  std::printf("run %s: M=%zu P=%zu H=%zu tau=%zu %s K=%zu%s, %s rounds\n", name.c_str(), m.learners, m.fragments,
              m.sync_every, m.overlap, m.lock_step ? "lock-step" : "non-blocking", m.quorum, m.grace ? " + grace" : "",
              round_name(m.round));
  std::fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  ddiloco::LocalCluster<Learner, Rule, Opt, ddiloco::TokenWeights> cluster(plan, config, factory, Rule(), opt);
  const ddiloco::ClusterResult r = cluster.run_virtual();
  Row row{m, tape};
  row.real_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  row.val_loss = validation_loss(ctx, r.global);
  row.sim_s = seconds(r.elapsed);
  row.goodput = r.goodput;
  row.downtime_s = seconds(r.global_downtime);
  row.windows = r.windows;
  row.windows_without_merge = r.windows_alive_without_merge;
  row.merges = r.syncer.merges;
  row.mean_quorum = r.syncer.mean_quorum_size();
  row.tokens = r.tokens;
  row.kills = r.kills;
  row.restarts = r.restarts;
  row.rejected = r.syncer.rejected_total();
  row.stale = r.syncer.rejected[static_cast<std::size_t>(ddiloco::RejectReason::stale)];
  row.bytes_out = r.syncer.bytes_out;
  row.bytes_in = r.syncer.bytes_in;
  row.global_step = r.syncer.global_step;
  row.pull_rounds = r.syncer.pull_rounds;
  row.pulls_sent = r.syncer.pulls_sent;
  row.pull_timeouts = r.syncer.pull_timeouts;
  row.pull_rounds_empty = r.syncer.pull_rounds_empty;
  row.pulls_repeated = r.syncer.pulls_repeated;
  row.answers_redundant = r.syncer.answers_redundant;
  row.timed_out = r.timed_out;
  for (const auto& f : r.syncer.fragments) {
    row.deadline_merges += f.deadline_merges;
    row.grace_waits += f.grace_waits;
  }
  std::printf("  done %s: val=%.4f sim=%.1fs goodput=%.3f downtime=%.1fs merges=%llu mean-quorum=%.2f "
              "deadline-merges=%llu grace-waits=%llu stale=%llu down-MB=%.2f pull-rounds=%llu pull-timeouts=%llu "
              "pull-empty=%llu second-asks=%llu redundant-answers=%llu real=%.1fs%s\n",
              name.c_str(), row.val_loss, row.sim_s, row.goodput, row.downtime_s,
              static_cast<unsigned long long>(row.merges), row.mean_quorum,
              static_cast<unsigned long long>(row.deadline_merges), static_cast<unsigned long long>(row.grace_waits),
              static_cast<unsigned long long>(row.stale), static_cast<double>(row.bytes_out) / 1e6,
              static_cast<unsigned long long>(row.pull_rounds), static_cast<unsigned long long>(row.pull_timeouts),
              static_cast<unsigned long long>(row.pull_rounds_empty), static_cast<unsigned long long>(row.pulls_repeated),
              static_cast<unsigned long long>(row.answers_redundant), row.real_s, r.timed_out ? " TIMED OUT" : "");
  std::fflush(stdout);
  (void)a;
  return row;
}

Row run_method(Context& ctx, const Method& m, Tape tape) {
  // One outer optimizer for every Nesterov method (--outer-lr, --momentum).
  const ddiloco::NesterovSGD nesterov(ctx.args.outer_lr, ctx.args.momentum);
  switch (m.kind) {
    case Kind::data_parallel: return run<ddiloco::WeightedAverage>(ctx, m, tape, ddiloco::AverageOnly());
    case Kind::diloco:
    case Kind::streaming: return run<ddiloco::WeightedAverage>(ctx, m, tape, nesterov);
    case Kind::decoupled:
    case Kind::decoupled_no_grace: return run<ddiloco::RadialDirectional>(ctx, m, tape, nesterov);
  }
  throw ddiloco::InvalidArgument("chaos_demo: unknown method");
}

const char* failures_name(Tape t) {
  switch (t) {
    case Tape::none: return "no";
    case Tape::chaos: return "yes";
    case Tape::straggler: return "straggler";
    case Tape::stragglers: return "4 of 16 2x slower";
    case Tape::straggler_kill: return "straggler + kill";
    case Tape::straggler_messages: return "straggler + message faults";
  }
  return "?";
}

std::string table(const std::vector<Row>& rows) {
  std::ostringstream o;
  o << "| method | round | M | failures | val loss | sim time (s) | goodput | global downtime (s) | windows w/o merge | "
       "merges | mean quorum | deadline merges | stale rejections | down-link MB | pull timeouts / empty rounds / second asks |\n";
  o << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  char buf[768];
  for (const auto& r : rows) {
    char pull[64] = "-";
    if (r.method.round == ddiloco::RoundMode::pull)
      std::snprintf(pull, sizeof pull, "%llu / %llu / %llu", static_cast<unsigned long long>(r.pull_timeouts),
                    static_cast<unsigned long long>(r.pull_rounds_empty),
                    static_cast<unsigned long long>(r.pulls_repeated));
    std::snprintf(buf, sizeof buf,
                  "| %s | %s | %zu | %s | %.4f | %.1f | %.3f | %.2f | %zu/%zu | %llu | %.2f | %llu | %llu | %.1f | %s |%s\n",
                  r.method.label.c_str(), round_name(r.method.round), r.method.learners, failures_name(r.tape),
                  r.val_loss, r.sim_s, r.goodput, r.downtime_s, r.windows_without_merge, r.windows,
                  static_cast<unsigned long long>(r.merges), r.mean_quorum,
                  static_cast<unsigned long long>(r.deadline_merges), static_cast<unsigned long long>(r.stale),
                  static_cast<double>(r.bytes_out) / 1e6, pull, r.timed_out ? " TIMED OUT" : "");
    o << buf;
  }
  return o.str();
}

const Row* find(const std::vector<Row>& rows, Kind k, Tape t, ddiloco::RoundMode round = ddiloco::RoundMode::push,
                std::size_t learners = kLearners) {
  for (const auto& r : rows)
    if (r.method.kind == k && r.tape == t && r.method.round == round && r.method.learners == learners) return &r;
  return nullptr;
}

/// The targets, measured on this run's rows (a row not run leaves its target out). The issue's
/// targets are the pull-mode ones; the push rows are checked against the same bounds for comparison.
std::string targets(const std::vector<Row>& rows) {
  std::ostringstream o;
  char buf[768];
  const Row* dil = find(rows, Kind::diloco, Tape::none);
  for (ddiloco::RoundMode mode : {ddiloco::RoundMode::pull, ddiloco::RoundMode::push}) {
    const char* rn = round_name(mode);
    const char* why = mode == ddiloco::RoundMode::pull ? "" : " (push, for comparison)";
    const Row* dec = find(rows, Kind::decoupled, Tape::chaos, mode);
    if (dec && dil) {
      const double rel = (dec->val_loss - dil->val_loss) / dil->val_loss * 100.0;
      std::snprintf(buf, sizeof buf,
                    "- %s: Decoupled under failures %.4f vs DiLoCo without failures %.4f: %+.2f%% (target within "
                    "2%%)%s: %s\n",
                    rn, dec->val_loss, dil->val_loss, rel, why, rel <= 2.0 ? "MET" : "MISSED");
      o << buf;
      // The only instants at which no learner computes under K = 1 are before the first global state
      // arrives: the initial join costs a request and a reply, each 5 ms + up to 5 ms jitter.
      const bool startup_only = dec->downtime_s <= 0.020;
      std::snprintf(buf, sizeof buf,
                    "- %s: Decoupled under failures: global downtime %.1f ms%s, windows alive without a merge %zu "
                    "of %zu (target 0): %s\n",
                    rn, 1000.0 * dec->downtime_s, startup_only ? " (the initial join round trip at t = 0)" : "",
                    dec->windows_without_merge, dec->windows,
                    startup_only && dec->windows_without_merge == 0 ? "MET after start-up" : "MISSED");
      o << buf;
    }
    if (dec) {
      bool beats = true;
      std::string others;
      for (Kind k : {Kind::data_parallel, Kind::diloco, Kind::streaming}) {
        const Row* w = find(rows, k, Tape::chaos);
        if (!w) continue;
        beats = beats && dec->sim_s < w->sim_s;
        std::snprintf(buf, sizeof buf, "%s%s %.1f s", others.empty() ? "" : ", ", w->method.label.c_str(), w->sim_s);
        others += buf;
      }
      if (!others.empty()) {
        std::snprintf(buf, sizeof buf, "- %s: wall time under failures: Decoupled %.1f s vs %s: %s\n", rn, dec->sim_s,
                      others.c_str(), beats ? "MET" : "MISSED");
        o << buf;
      }
    }
    const Row* g = find(rows, Kind::decoupled, Tape::straggler, mode);
    const Row* ng = find(rows, Kind::decoupled_no_grace, Tape::straggler, mode);
    if (g && ng) {
      std::snprintf(buf, sizeof buf,
                    "- %s: straggler: K = 1 + grace %.4f (mean quorum %.2f) vs K = 1 without grace %.4f (mean "
                    "quorum %.2f)%s: %s\n",
                    rn, g->val_loss, g->mean_quorum, ng->val_loss, ng->mean_quorum, why,
                    g->val_loss < ng->val_loss ? "grace better (MET)" : "grace not better (MISSED)");
      o << buf;
    }
  }
  const Row* pull16 = find(rows, Kind::decoupled, Tape::stragglers, ddiloco::RoundMode::pull, kLargeM);
  const Row* push16 = find(rows, Kind::decoupled, Tape::stragglers, ddiloco::RoundMode::push, kLargeM);
  if (pull16 && push16) {
    const bool met = pull16->val_loss <= push16->val_loss && pull16->merges < push16->merges;
    std::snprintf(buf, sizeof buf,
                  "- M = 16, 4 learners 2x slower: pull %.4f with %llu merges (mean quorum %.2f, %llu stale) vs push "
                  "%.4f with %llu merges (mean quorum %.2f, %llu stale); target pull loss <= push loss with fewer "
                  "merges: %s\n",
                  pull16->val_loss, static_cast<unsigned long long>(pull16->merges), pull16->mean_quorum,
                  static_cast<unsigned long long>(pull16->stale), push16->val_loss,
                  static_cast<unsigned long long>(push16->merges), push16->mean_quorum,
                  static_cast<unsigned long long>(push16->stale), met ? "MET" : "MISSED");
    o << buf;
  }
  return o.str();
}

void write_outputs(const Context& ctx, const std::vector<Row>& rows, const std::string& md) {
  namespace fs = std::filesystem;
  const fs::path dir = ctx.args.out;
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "results.csv");
    f << "method,label,tape,val_loss,sim_time_s,goodput,global_downtime_s,windows,windows_alive_without_merge,"
         "merges,mean_quorum,deadline_merges,grace_waits,rejected,tokens,kills,restarts,timed_out,real_s,round,learners,"
         "stale,bytes_out,bytes_in,global_step,pull_rounds,pulls_sent,pull_timeouts,pull_rounds_empty,"
         "pulls_repeated,answers_redundant\n";
    for (const auto& r : rows) {
      f << static_cast<int>(r.method.kind) << ',' << r.method.label << ',' << tape_name(r.tape) << ',' << r.val_loss
        << ',' << r.sim_s << ',' << r.goodput << ',' << r.downtime_s << ',' << r.windows << ','
        << r.windows_without_merge << ',' << r.merges << ',' << r.mean_quorum << ',' << r.deadline_merges << ','
        << r.grace_waits << ',' << r.rejected << ',' << r.tokens << ',' << r.kills << ',' << r.restarts << ','
        << (r.timed_out ? 1 : 0) << ',' << r.real_s << ',' << round_name(r.method.round) << ',' << r.method.learners
        << ',' << r.stale << ',' << r.bytes_out << ',' << r.bytes_in << ',' << r.global_step << ',' << r.pull_rounds
        << ',' << r.pulls_sent << ',' << r.pull_timeouts << ',' << r.pull_rounds_empty << ','
        << r.pulls_repeated << ',' << r.answers_redundant << '\n';
    }
  }
  {
    std::ofstream f(dir / "curves.csv");
    f << "label,tape,sim_time_s,tokens,val_loss,round,learners\n";
    for (const auto& c : ctx.curves)
      f << c.label << ',' << tape_name(c.tape) << ',' << c.sim_s << ',' << c.tokens << ',' << c.val_loss << ','
        << round_name(c.round) << ',' << c.learners << '\n';
  }
  {
    std::ofstream f(dir / "results.md");
    f << md;
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Context ctx{parse(argc, argv), {}, {}, {}, {}};
    const Args& a = ctx.args;
    Eigen::setNbThreads(1);
    const auto t_start = std::chrono::steady_clock::now();
    ctx.corpus = ref::load_fortunes({.dir = a.fortunes});
    ctx.trainer.seed = a.seed;
    ctx.specs = ref::CharLm(ctx.trainer.model).tensor_specs();
    const std::size_t P = ctx.specs.size();  // one fragment per tensor: P = 5
    const std::size_t H = a.sync_every;
    std::printf("chaos_demo: M = %zu learners of the reference char LM (%zu tensors), fortunes %zu train / %zu "
                "validation characters\n",
                kLearners, P, ctx.corpus.train.size(), ctx.corpus.validation.size());
    std::printf("budget: %zu inner steps per learner = %zu tokens in all, every method; batch %zu; H = %zu\n", a.steps,
                kLearners * a.steps * ctx.trainer.batch_size, ctx.trainer.batch_size, H);
    if (a.shard_block == 0)
      std::printf("data: each learner on one contiguous range of the training stream (its own fortune files)\n");
    else
      std::printf("data: blocks of %zu characters dealt round-robin, each learner's shard spread over the whole corpus\n",
                  a.shard_block);
    std::printf("time: SIMULATED cluster time (virtual clock, one inner step = %.0f ms x slowdown, real compute);\n"
                "      deterministic and independent of this machine's load. Real seconds are printed too.\n",
                a.step_ms);
    std::printf("failure tape: learner 1 killed at its step %zu, down %zu step times, then rejoins; learner 3 "
                "3x slower; 2%% of messages dropped; latency 5 ms + up to 5 ms jitter\n",
                a.steps / 3, a.steps / 5);
    std::printf("rows (d), (e): push and pull rounds%s\n",
                a.m16 ? "; (d) also at M = 16 with learners 12-15 2x slower (--m16)" : " (--m16 adds M = 16 rows)");
    std::printf("outer optimizer of every Nesterov method: lr %g, momentum %g\n", static_cast<double>(a.outer_lr),
                static_cast<double>(a.momentum));
    std::printf("validation: loss of the syncer's global parameters on %zu fixed validation examples (nats/char)\n\n",
                a.eval_examples);

    const std::vector<Method> methods = {
        {Kind::data_parallel, "(a) data-parallel", 1, 1, 0, true, kLearners, false},
        {Kind::diloco, "(b) DiLoCo", 1, H, 0, true, kLearners, false},
        {Kind::streaming, "(c) Streaming DiLoCo", P, H, 2, true, kLearners, false},
        {Kind::decoupled, "(d) Decoupled DiLoCo", P, H, 2, false, 1, true},
    };
    const Method no_grace{Kind::decoupled_no_grace, "(e) Decoupled K=1 no grace", P, H, 2, false, 1, false};
    // Rows (d) and (e) in both round modes; the wait-for-all methods push (lock-step, K = M).
    auto with = [](Method m, ddiloco::RoundMode r, std::size_t learners) {
      m.round = r;
      m.learners = learners;
      return m;
    };

    std::vector<std::pair<Method, Tape>> plan;
    for (const auto& m : methods) {
      for (Tape t : {Tape::none, Tape::chaos}) {
        plan.emplace_back(m, t);
        if (m.kind == Kind::decoupled) plan.emplace_back(with(m, ddiloco::RoundMode::pull, kLearners), t);
      }
    }
    for (ddiloco::RoundMode r : {ddiloco::RoundMode::push, ddiloco::RoundMode::pull}) {
      plan.emplace_back(with(methods[3], r, kLearners), Tape::straggler);
      plan.emplace_back(with(no_grace, r, kLearners), Tape::straggler);
    }
    if (a.ablation)
      for (Tape t : {Tape::straggler_kill, Tape::straggler_messages})
        for (ddiloco::RoundMode r : {ddiloco::RoundMode::push, ddiloco::RoundMode::pull})
          plan.emplace_back(with(methods[3], r, kLearners), t);
    if (a.m16)
      for (ddiloco::RoundMode r : {ddiloco::RoundMode::push, ddiloco::RoundMode::pull})
        plan.emplace_back(with(methods[3], r, kLargeM), Tape::stragglers);
    auto selected = [&](const Method& m, Tape t) {
      return a.only.empty() || row_key(m, t).find(a.only) != std::string::npos;
    };
    if (std::none_of(plan.begin(), plan.end(), [&](const auto& mt) { return selected(mt.first, mt.second); })) {
      std::string keys;
      for (const auto& [m, t] : plan) keys += "\n  " + row_key(m, t);
      std::string more;
      if (!a.m16) more += " (--m16 adds the M=16 rows)";
      if (!a.ablation) more += " (--ablation adds the failure tape's halves)";
      std::fprintf(stderr, "chaos_demo: --only \"%s\" matches no row; pass part of one of these names%s:%s\n",
                   a.only.c_str(), more.c_str(), keys.c_str());
      return 2;
    }
    std::vector<Row> rows;
    for (const auto& [m, t] : plan)
      if (selected(m, t)) rows.push_back(run_method(ctx, m, t));

    std::ostringstream md;
    md << "Equal budget: " << a.steps << " inner steps per learner (" << kLearners * a.steps * ctx.trainer.batch_size
       << " tokens at M = " << kLearners << ", " << kLargeM * a.steps * ctx.trainer.batch_size << " at M = " << kLargeM
       << "), H = " << H << ", seed " << a.seed << ", outer Nesterov lr " << a.outer_lr << " momentum " << a.momentum
       << ". Time is simulated cluster time (one inner step = " << a.step_ms << " ms).\n\n";
    md << table(rows) << "\nTargets (measured):\n" << targets(rows);
    const double real = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    md << "\nReal elapsed: " << static_cast<int>(real) << " s\n";
    std::printf("\n%s", md.str().c_str());
    write_outputs(ctx, rows, md.str());
    std::printf("wrote %s/results.csv, %s/curves.csv, %s/results.md\n", a.out.c_str(), a.out.c_str(), a.out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "chaos_demo: %s\n", e.what());
    return 1;
  }
}
