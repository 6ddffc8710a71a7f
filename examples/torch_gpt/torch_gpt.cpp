// torch_gpt: a small character-level GPT written with libtorch (gpt.hpp), trained on the fortunes
// corpus by M learners with ddiloco's OuterLoop; the model's parameters() go straight into it.
//
// Modes:
//   (default)   the comparison run: M learners in one process over the in-process transport
//               (LocalCluster, virtual time by default), two methods at equal token budgets:
//                 data-parallel without failures: average every step (P = 1, H = 1, tau = 0,
//                   lock-step, K = M, plain average, no outer optimizer);
//                 Decoupled DiLoCo with a failure tape (learner 1 killed a third of the way in
//                   and restarted, learner M-1 three times slower, lossy and slow messages):
//                   P fragments, H, tau = 2, non-blocking, K = 1 + grace window, token-weighted
//                   RDA + Nesterov.
//               Writes DIR/results.csv, DIR/curves.csv, DIR/results.md (DIR = --out);
//               examples/torch_gpt/plot_torch_gpt.py draws DIR/loss.png.
//   --smoke     seconds: a tiny model, Decoupled DiLoCo with the failure tape; exits 1 unless the
//               validation loss of the global parameters went down by 15%.
//   --export DIR  writes DIR/tensors.txt and DIR/init.f32 for the ddiloco_syncer program, and
//               DIR/model.safetensors (names, shapes, values) for `ddiloco_syncer --init` alone.
//   --connect EP  one learner process over ZeroMQ against ddiloco_syncer (see docs/torch.md).
//
// Time: with --driver virtual (default) every inner step costs --step-ms of SIMULATED cluster time
// times the learner's slowdown, while the compute is real, so the wall-time axis does not depend on
// the load of the machine; the real elapsed seconds are printed too. --driver threaded runs the
// learners as threads on the real clock (final loss only, no curve).
#include "gpt.hpp"

#include <ddiloco/local_cluster.hpp>
#include <ddiloco/tensor_list.hpp>
#ifdef DDILOCO_TORCH_GPT_ZMQ
#include <ddiloco/transport/zmq.hpp>
#endif
#ifdef DDILOCO_TORCH_GPT_SAFETENSORS
#include <ddiloco/safetensors.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "round_flag.hpp"

bool torch_gpt_sgemm_is_onednn();  // onednn_sgemm.cpp

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using ddiloco::Duration;
using torch_gpt::ref::Shard;

namespace {

struct Options {
  std::size_t learners = 4, steps = 120, sync_every = 20, fragments = 4, eval_batches = 8, samples = 12;
  std::string methods = "both";  ///< both, data-parallel or decoupled
  std::uint64_t seed = 1;
  double step_ms = 100.0;
  float outer_lr = 0.7f, momentum = 0.5f;
  bool threaded = false;
  std::string out = "results/torch";
  torch_gpt::TrainerConfig trainer;
};

double seconds(Duration d) { return std::chrono::duration<double>(d).count(); }

struct CurvePoint {
  std::string label;
  double sim_s, real_s;
  std::int64_t tokens;
  double val_loss;
};

struct Row {
  std::string label, failures;
  double val_loss = 0, sim_s = 0, real_s = 0, goodput = 0, downtime_s = 0;
  std::int64_t tokens = 0;
  std::uint64_t merges = 0, kills = 0, restarts = 0, bytes_sent = 0;
  bool timed_out = false;
};

/// Goodput is measured on virtual time only (LocalCluster::run_virtual); "-" for threaded runs.
std::string goodput_text(const Row& r, bool threaded) {
  if (threaded) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", r.goodput);
  return buf;
}

/// Everything shared by the runs: data, validation batches, a model to score global parameters.
struct Context {
  Options opt;
  torch_gpt::ref::FortuneCorpus corpus;
  std::vector<torch_gpt::SequenceBatch> validation;
  torch_gpt::Gpt scorer;
  std::vector<torch::Tensor> scorer_params;
  std::vector<ddiloco::TensorSpec> specs;
  std::vector<CurvePoint> curves;

  explicit Context(const Options& o)
      : opt(o), corpus(torch_gpt::ref::load_fortunes()), scorer(o.trainer.model), scorer_params(scorer->parameters()),
        specs(scorer->tensor_specs()) {
    // Fixed validation batches: the same for every run and every sample.
    torch_gpt::SequenceSampler s(corpus.validation, o.trainer.model.context, o.trainer.batch, 12345, Shard{0, 1});
    for (std::size_t i = 0; i < o.eval_batches; ++i) validation.push_back(s.next());
  }

  /// Validation loss of flat parameters in plan order (= parameters() order).
  double score(std::span<const float> flat) {
    std::size_t off = 0;
    for (auto& p : scorer_params) {
      const std::size_t n = ddiloco::tensor_size(p);
      ddiloco::write_tensor(p, flat.subspan(off, n));
      off += n;
    }
    return torch_gpt::evaluate(scorer, validation);
  }
};

/// A learner of the cluster: the GPT trainer plus the run's token counter (curves).
struct ClusterLearner {
  using tensor_type = torch::Tensor;
  torch_gpt::Learner learner;
  std::atomic<std::int64_t>* tokens;

  ClusterLearner(const torch_gpt::TrainerConfig& c, std::span<const torch_gpt::ref::Token> train, Shard shard,
                 std::uint64_t data_seed, std::atomic<std::int64_t>* t)
      : learner(c, train, shard, data_seed), tokens(t) {}
  std::span<torch::Tensor> parameters() { return learner.parameters(); }
  std::int64_t inner_step() {
    const std::int64_t n = learner.inner_step();
    tokens->fetch_add(n);
    return n;
  }
};
static_assert(ddiloco::ClusterTrainer<ClusterLearner>);

enum class Method { data_parallel, decoupled };

/// Learner 1 dies a third of the way in and is down for a fifth of the run (then rejoins),
/// learner M-1 is three times slower throughout, 1% of messages are lost, each takes 5-10 ms.
ddiloco::FaultTape failure_tape(const Options& o) {
  ddiloco::FaultTape tape(o.seed);
  const auto killed = static_cast<ddiloco::LearnerId>(1 % o.learners);
  auto slow = static_cast<ddiloco::LearnerId>(o.learners - 1);
  if (slow == killed && o.learners > 1) slow = 0;
  tape.add(ddiloco::Kill{killed, o.steps / 3, ddiloco::Downtime{o.steps / 5, Duration{0}}});
  tape.add(ddiloco::Slowdown{slow, 3.0, 0, std::nullopt});
  ddiloco::MessageFaults f;
  f.drop = 0.01;
  f.latency = 5ms;
  f.jitter = 5ms;
  tape.set_message_faults(f);
  return tape;
}

ddiloco::ClusterConfig cluster_config(Method m, bool failures, const Options& o) {
  ddiloco::ClusterConfig c;
  c.learners = o.learners;
  c.step_time = std::chrono::duration_cast<Duration>(std::chrono::duration<double, std::milli>(o.step_ms));
  c.token_budget = static_cast<std::int64_t>(o.learners * o.steps) * o.trainer.batch * o.trainer.model.context;
  if (failures) c.tape = failure_tape(o);
  const bool dp = m == Method::data_parallel;
  // Push rounds in process (the results in docs/torch.md); a --connect learner uses the syncer's --round.
  c.outer.round = c.syncer.round = ddiloco::RoundMode::push;
  c.outer.sync_every = dp ? 1 : o.sync_every;
  c.outer.overlap = dp ? 0 : 2;
  c.outer.lock_step = dp;
  // Liveness in units of the step time: a heartbeat every 10 steps, dead after 30 silent ones.
  c.outer.heartbeat_interval = c.step_time * 10;
  c.outer.join_retry = c.step_time * 10;
  c.syncer.heartbeat_timeout = c.step_time * 30;
  c.syncer.quorum.min_quorum = dp ? o.learners : 1;
  c.syncer.quorum.overlap = c.outer.overlap;
  c.syncer.quorum.grace = !dp;
  c.syncer.quorum.gamma = 0.3;
  c.syncer.quorum.cap = c.step_time;  // "about one inner step"
  const Duration round = c.step_time * static_cast<Duration::rep>(4 * c.outer.sync_every);
  c.syncer.quorum.deadline = std::max(round, c.syncer.heartbeat_timeout);
  c.outer.lock_step_timeout = c.syncer.quorum.deadline;
  c.sample_every = c.step_time * static_cast<Duration::rep>(std::max<std::size_t>(1, o.steps / o.samples));
  return c;
}

template <class Rule, class Opt>
Row run(Context& ctx, Method m, bool failures, Opt outer_opt) {
  const Options& o = ctx.opt;
  const bool dp = m == Method::data_parallel;
  Row row;
  row.label = dp ? "data-parallel" : "Decoupled DiLoCo";
  row.failures = failures ? "kill+restart, 3x slow, 1% loss" : "none";
  const ddiloco::Plan plan = ddiloco::make_plan(ctx.specs, dp ? 1 : o.fragments);
  ddiloco::ClusterConfig config = cluster_config(m, failures, o);
  std::atomic<std::int64_t> tokens{0};
  const auto t0 = std::chrono::steady_clock::now();
  auto real_s = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  config.on_sample = [&](ddiloco::TimePoint t, std::span<const float> global, const ddiloco::SyncerStatus& s) {
    const double loss = ctx.score(global);
    const double sim = seconds(t - ddiloco::TimePoint{0});
    ctx.curves.push_back({row.label, sim, real_s(), tokens.load(), loss});
    std::printf("  [%s] sim %7.1fs real %6.1fs tokens %8lld val %.4f | merges %llu\n", row.label.c_str(), sim,
                real_s(), static_cast<long long>(tokens.load()), loss, static_cast<unsigned long long>(s.merges));
    std::fflush(stdout);
  };
  auto factory = [&](ddiloco::LearnerId id, std::uint64_t incarnation) {
    // Same initial parameters everywhere (the seed); a restarted learner gets the global state at
    // its join and a new data order.
    return std::make_unique<ClusterLearner>(o.trainer, ctx.corpus.train, Shard{id, o.learners},
                                            o.seed + 1000 * incarnation, &tokens);
  };
  std::printf("run %s (failures: %s): M=%zu P=%zu H=%zu tau=%zu %s K=%zu%s\n", row.label.c_str(),
              row.failures.c_str(), o.learners, plan.num_fragments(), config.outer.sync_every, config.outer.overlap,
              config.outer.lock_step ? "lock-step" : "non-blocking", config.syncer.quorum.min_quorum,
              config.syncer.quorum.grace ? " + grace" : "");
  std::fflush(stdout);
  ddiloco::LocalCluster<ClusterLearner, Rule, Opt> cluster(plan, config, factory, Rule(), outer_opt);
  const ddiloco::ClusterResult r = o.threaded ? cluster.run_threaded() : cluster.run_virtual();
  row.real_s = real_s();
  row.val_loss = ctx.score(r.global);
  row.sim_s = seconds(r.elapsed);
  row.goodput = r.goodput;
  row.downtime_s = seconds(r.global_downtime);
  row.tokens = r.tokens;
  row.merges = r.syncer.merges;
  row.kills = r.kills;
  row.restarts = r.restarts;
  row.timed_out = r.timed_out;
  for (const auto& l : r.learners) row.bytes_sent += l.bytes_sent;
  std::printf("  done %s: val %.4f, %s time %.1f s, real %.1f s, goodput %s, merges %llu, kills %llu%s\n",
              row.label.c_str(), row.val_loss, o.threaded ? "real" : "simulated", row.sim_s, row.real_s,
              goodput_text(row, o.threaded).c_str(), static_cast<unsigned long long>(row.merges),
              static_cast<unsigned long long>(row.kills), r.timed_out ? " TIMED OUT" : "");
  std::fflush(stdout);
  return row;
}

Row run_decoupled(Context& ctx, bool failures) {
  return run<ddiloco::RadialDirectional>(ctx, Method::decoupled, failures,
                                         ddiloco::NesterovSGD(ctx.opt.outer_lr, ctx.opt.momentum));
}

Row run_data_parallel(Context& ctx, bool failures) {
  return run<ddiloco::WeightedAverage>(ctx, Method::data_parallel, failures, ddiloco::AverageOnly());
}

std::string table(const std::vector<Row>& rows, bool threaded) {
  std::ostringstream os;
  os << "| method | failures | tokens | val loss | " << (threaded ? "real" : "simulated")
     << " wall time (s) | goodput | merges | bytes sent (MB) | real time here (s) |\n";
  os << "|---|---|---|---|---|---|---|---|---|\n";
  char buf[512];
  for (const auto& r : rows) {
    std::snprintf(buf, sizeof buf, "| %s | %s | %lld | %.4f | %.1f | %s | %llu | %.1f | %.0f |%s\n", r.label.c_str(),
                  r.failures.c_str(), static_cast<long long>(r.tokens), r.val_loss, r.sim_s,
                  goodput_text(r, threaded).c_str(),
                  static_cast<unsigned long long>(r.merges), static_cast<double>(r.bytes_sent) / 1e6, r.real_s,
                  r.timed_out ? " TIMED OUT" : "");
    os << buf;
  }
  return os.str();
}

void write_outputs(const Context& ctx, const std::vector<Row>& rows, double initial_loss) {
  const fs::path dir = ctx.opt.out;
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "results.csv");
    f << "method,failures,tokens,val_loss,wall_time_s,goodput,merges,kills,restarts,bytes_sent,real_s\n";
    for (const auto& r : rows)
      f << r.label << ",\"" << r.failures << "\","  // the failures column holds commas: quoted
        << r.tokens << ',' << r.val_loss << ',' << r.sim_s << ','
        << r.goodput << ',' << r.merges << ',' << r.kills << ',' << r.restarts << ',' << r.bytes_sent << ','
        << r.real_s << '\n';
  }
  {
    std::ofstream f(dir / "curves.csv");
    f << "method,wall_time_s,real_s,tokens,val_loss\n";
    for (const auto& c : ctx.curves)
      f << c.label << ',' << c.sim_s << ',' << c.real_s << ',' << c.tokens << ',' << c.val_loss << '\n';
  }
  const auto& o = ctx.opt;
  const auto& m = o.trainer.model;
  std::ofstream f(dir / "results.md");
  f << "torch_gpt: M = " << o.learners << " learners, " << o.steps << " inner steps each (budget), GPT width "
    << m.width << ", " << m.layers << " blocks, " << m.heads << " heads, context " << m.context << ", batch "
    << o.trainer.batch << ", " << ctx.scorer->parameters().size() << " tensors, parameters "
    << [&] {
         std::int64_t n = 0;
         for (const auto& p : ctx.scorer_params) n += p.numel();
         return n;
       }()
    << "; Decoupled DiLoCo P = " << o.fragments << ", H = " << o.sync_every << ", tau = 2, Nesterov lr "
    << o.outer_lr << " momentum " << o.momentum << "; step " << o.step_ms << " ms simulated; seed " << o.seed
    << ". Initial validation loss " << initial_loss << ".\n\n"
    << table(rows, o.threaded);
}

/// --export DIR: the tensor list and the initial parameters for `ddiloco_syncer --tensors --init`.
void export_for_syncer(const Options& o, const std::string& dir) {
  torch::manual_seed(o.trainer.seed);
  torch_gpt::Gpt model(o.trainer.model);
  fs::create_directories(dir);
  const auto specs = model->tensor_specs();
  {
    std::ofstream f(fs::path(dir) / "tensors.txt");
    ddiloco::write_tensor_list(f, specs);
  }
  std::ofstream f(fs::path(dir) / "init.f32", std::ios::binary);
  std::vector<std::vector<float>> values;
  for (auto& p : model->parameters()) {
    std::vector<float> host(ddiloco::tensor_size(p));
    ddiloco::read_tensor(p, std::span<float>(host));
    f.write(reinterpret_cast<const char*>(host.data()), static_cast<std::streamsize>(host.size() * sizeof(float)));
    values.push_back(std::move(host));
  }
#ifdef DDILOCO_TORCH_GPT_SAFETENSORS
  // The same tensors with their names and shapes: `ddiloco_syncer --init DIR/model.safetensors`
  // needs no tensor list (its default embedding rule marks tok_emb., pos_emb. and head., as here).
  std::vector<ddiloco::SafetensorsView> views;
  std::size_t i = 0;
  for (const auto& p : model->named_parameters()) {
    std::vector<std::uint64_t> shape;
    for (auto d : p.value().sizes()) shape.push_back(static_cast<std::uint64_t>(d));
    views.push_back({p.key(), std::move(shape), values[i++]});
  }
  ddiloco::write_safetensors(fs::path(dir) / "model.safetensors", std::span<const ddiloco::SafetensorsView>(views),
                             {.metadata = {{"format", "pt"}}, .allow_non_finite = false});
  std::printf("wrote %s/model.safetensors; or start the syncer with --init %s/model.safetensors alone\n",
              dir.c_str(), dir.c_str());
#endif
  std::printf("wrote %s/tensors.txt (%zu tensors) and %s/init.f32; start the syncer with\n"
              "  ddiloco_syncer --plaintext --tensors %s/tensors.txt --init %s/init.f32 --fragments %zu "
              "--sync-every %zu\n",
              dir.c_str(), specs.size(), dir.c_str(), dir.c_str(), dir.c_str(), o.fragments, o.sync_every);
}

#ifdef DDILOCO_TORCH_GPT_ZMQ
/// --connect EP: one learner process over ZeroMQ (unencrypted: for a trusted local network).
int run_zmq_learner(const Options& o, const std::string& endpoint, ddiloco::LearnerId id, std::size_t shards,
                    ddiloco::RoundMode round) {
  const auto corpus = torch_gpt::ref::load_fortunes();
  torch_gpt::Learner learner(o.trainer, corpus.train, Shard{id % shards, shards}, o.seed + id);
  const ddiloco::Plan plan = ddiloco::make_plan(learner.model()->tensor_specs(), o.fragments);
  ddiloco::SteadyClock clock;
  ddiloco::ZmqLearnerConfig zc;
  zc.connect = endpoint;
  zc.id = id;
  zc.security = ddiloco::ZmqSecurity::plaintext();
  ddiloco::ZmqLearnerTransport link(zc, clock);
  ddiloco::OuterLoopConfig oc;
  oc.id = id;
  oc.sync_every = o.sync_every;
  oc.overlap = 2;
  oc.round = round;  // the syncer's --round (ddiloco_syncer defaults to pull)
  ddiloco::OuterLoop<ddiloco::ZmqLearnerTransport, torch::Tensor> outer(plan, link, oc);
  // Fixed validation batches (the comparison's): the loss of this learner's parameters, which
  // are the global ones right after join.
  torch_gpt::SequenceSampler vs(corpus.validation, o.trainer.model.context, o.trainer.batch, 12345, Shard{0, 1});
  std::vector<torch_gpt::SequenceBatch> validation;
  for (std::size_t i = 0; i < o.eval_batches; ++i) validation.push_back(vs.next());
  outer.join(learner.parameters());
  std::printf("learner %u joined %s: validation loss %.4f\n", id, endpoint.c_str(),
              torch_gpt::evaluate(learner.model(), validation));
  for (std::size_t s = 1; s <= o.steps; ++s) {
    const std::int64_t tokens = learner.inner_step();
    outer.step(learner.parameters(), tokens);
    if (s % o.sync_every == 0 || s == o.steps)
      std::printf("learner %u step %zu train loss %.4f sends %llu applies %llu\n", id, s, learner.last_loss(),
                  static_cast<unsigned long long>(outer.status().sends),
                  static_cast<unsigned long long>(outer.status().applies));
    std::fflush(stdout);
  }
  std::printf("learner %u: done after %zu steps, sends %llu applies %llu, validation loss %.4f\n", id, o.steps,
              static_cast<unsigned long long>(outer.status().sends),
              static_cast<unsigned long long>(outer.status().applies),
              torch_gpt::evaluate(learner.model(), validation));
  std::fflush(stdout);
  outer.leave();
  return 0;
}
#endif

/// --profile N: where one learner's step goes (N timed inner steps after 3 warm-up ones), the
/// cost of one validation sample, and the GEMM rate of this libtorch's CPU backend.
int profile(const Options& o, std::size_t steps) {
  std::printf("libtorch %s: intra-op threads %d, MKL %s, oneDNN %s (enabled %s)\n", TORCH_VERSION,
              at::get_num_threads(), at::hasMKL() ? "yes" : "no", at::hasMKLDNN() ? "yes" : "no",
              at::globalContext().userEnabledMkldnn() ? "yes" : "no");
  {
    std::istringstream config(at::show_config());
    for (std::string line; std::getline(config, line);)
      if (line.find("BLAS") != std::string::npos || line.find("LAPACK") != std::string::npos)
        std::printf("  config:%s\n", line.c_str());
  }
  std::printf("  float32 GEMM (sgemm_): %s\n", torch_gpt_sgemm_is_onednn()
                                                   ? "oneDNN dnnl_sgemm (onednn_sgemm.cpp)"
                                                   : "the system BLAS (libblas.so.3)");
  using clock = std::chrono::steady_clock;
  auto since = [](clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); };
  {
    // The shape of the MLP's first Linear (B*T x d) * (d x 4d) at the gpt1m preset.
    const auto a = torch::randn({1024, 128}), b = torch::randn({128, 512});
    (void)torch::mm(a, b);
    const int reps = 20;
    const auto t0 = clock::now();
    for (int i = 0; i < reps; ++i) (void)torch::mm(a, b);
    const double s = since(t0);
    std::printf("  torch::mm 1024x128 * 128x512: %.2f ms, %.1f GFLOP/s\n", 1e3 * s / reps,
                2.0 * 1024 * 128 * 512 * reps / s / 1e9);
  }
  const auto corpus = torch_gpt::ref::load_fortunes();
  torch_gpt::Learner learner(o.trainer, corpus.train, Shard{0, 1}, o.seed);
  std::int64_t n = 0;
  for (const auto& p : learner.parameters()) n += p.numel();
  for (int i = 0; i < 3; ++i) (void)learner.inner_step();
  torch_gpt::StepTimes t;
  const auto t0 = clock::now();
  for (std::size_t i = 0; i < steps; ++i) (void)learner.inner_step(&t);
  const double wall = since(t0);
  const auto per = [&](double x) { return 1e3 * x / static_cast<double>(steps); };
  std::printf("  %lld parameters, batch %lld x context %lld: %.1f ms per inner step (%zu steps): data %.1f, "
              "forward %.1f, backward %.1f, clip %.1f, AdamW %.1f ms\n",
              static_cast<long long>(n), static_cast<long long>(o.trainer.batch),
              static_cast<long long>(o.trainer.model.context), per(wall), steps, per(t.data), per(t.forward),
              per(t.backward), per(t.clip), per(t.adamw));
  torch_gpt::SequenceSampler s(corpus.validation, o.trainer.model.context, o.trainer.batch, 12345, Shard{0, 1});
  std::vector<torch_gpt::SequenceBatch> validation;
  for (std::size_t i = 0; i < o.eval_batches; ++i) validation.push_back(s.next());
  const auto e0 = clock::now();
  const double loss = torch_gpt::evaluate(learner.model(), validation);
  std::printf("  one validation sample (%zu batches): %.1f ms (loss %.4f)\n", o.eval_batches, 1e3 * since(e0), loss);
  return 0;
}

void apply_preset(Options& o, const std::string& preset) {
  auto& m = o.trainer.model;
  if (preset == "gpt1m") {  // the ~1M-parameter model (0.82 M): 0.13-0.2 s per inner step on a shared 2-core box
    m.width = 128;
    m.layers = 4;
    m.heads = 4;
    m.context = 64;
    o.trainer.batch = 16;
  } else if (preset == "small") {  // the default comparison: 0.11 M parameters
    m.width = 64;
    m.layers = 2;
    m.heads = 4;
    m.context = 64;
    o.trainer.batch = 8;
  } else if (preset == "smoke") {  // CI: a few seconds
    m.width = 32;
    m.layers = 1;
    m.heads = 2;
    m.context = 32;
    o.trainer.batch = 8;
    o.learners = 2;
    o.steps = 80;
    o.sync_every = 10;
    o.fragments = 2;
    o.eval_batches = 4;
  } else {
    throw ddiloco::InvalidArgument("--preset '" + preset + "': use gpt1m, small or smoke");
  }
}

}  // namespace

int main(int argc, char** argv) try {
  ddiloco::cli::Flags f("torch_gpt", "a libtorch character GPT trained with Decoupled DiLoCo (see docs/torch.md)");
  f.add("preset", "small", "model and run size: small (default comparison), gpt1m (0.82 M parameters), smoke");
  f.add("smoke", "false", "CI: tiny run with failures, exit 1 unless the validation loss fell by 15%", true);
  f.add("learners", "", "M learners (default: from the preset, 4)");
  f.add("steps", "", "inner steps per learner: the token budget is M x steps x batch x context (default 120)");
  f.add("H", "", "Decoupled DiLoCo: inner steps between two syncs of a fragment (default 20)");
  f.add("fragments", "", "Decoupled DiLoCo: P fragments (default 4)");
  f.add("lr", "3e-3", "AdamW learning rate (inner)");
  f.add("outer-lr", "0.7", "Nesterov outer learning rate");
  f.add("momentum", "0.5", "Nesterov outer momentum");
  f.add("step-ms", "100", "simulated duration of one inner step (virtual driver)");
  f.add("eval-batches", "", "validation batches per sample (default 8)");
  f.add("samples", "12", "validation samples of the global parameters per run (the curve's points)");
  f.add("methods", "both",
        "both, data-parallel or decoupled: run one method only (two processes can run the two in parallel; "
        "plot_torch_gpt.py --merge joins their outputs)");
  f.add("seed", "1", "initial parameters, data order and fault seed");
  f.add("driver", "virtual", "virtual (one thread, simulated time, curves) or threaded (real threads and clock)");
  f.add("out", "results/torch", "output directory of the comparison");
  f.add("export", "", "write DIR/tensors.txt and DIR/init.f32 for ddiloco_syncer, then exit");
  f.add("connect", "", "run ONE learner over ZeroMQ against ddiloco_syncer at this endpoint");
  f.add("id", "0", "--connect: this learner's id (its data shard is id mod --shards)");
  f.add("shards", "4", "--connect: number of data shards");
  ddiloco::cli::add_round_flag(f, "--connect: this learner");
  f.add("profile", "0", "time N inner steps of one learner by phase, and one validation sample, then exit");
  if (!f.parse(argc, argv)) return 0;

  // One intra-op thread: the learners share the machine (and the virtual driver runs them in turn).
  at::set_num_threads(1);
  Options o;
  const bool smoke = f.flag("smoke");
  apply_preset(o, smoke ? "smoke" : f.str("preset"));
  if (!f.str("learners").empty()) o.learners = f.count("learners");
  if (!f.str("steps").empty()) o.steps = f.count("steps");
  if (!f.str("H").empty()) o.sync_every = f.count("H");
  if (!f.str("fragments").empty()) o.fragments = f.count("fragments");
  if (!f.str("eval-batches").empty()) o.eval_batches = f.count("eval-batches");
  o.trainer.lr = f.num("lr");
  o.outer_lr = static_cast<float>(f.num("outer-lr"));
  o.momentum = static_cast<float>(f.num("momentum"));
  o.step_ms = f.num("step-ms");
  o.seed = static_cast<std::uint64_t>(f.integer("seed"));
  o.trainer.seed = o.seed;
  o.out = f.str("out");
  o.samples = std::max<std::size_t>(1, f.count("samples"));
  o.methods = f.str("methods");
  if (o.methods != "both" && o.methods != "data-parallel" && o.methods != "decoupled")
    throw ddiloco::InvalidArgument("--methods '" + o.methods + "': use both, data-parallel or decoupled");
  if (f.str("driver") != "virtual" && f.str("driver") != "threaded")
    throw ddiloco::InvalidArgument("--driver '" + f.str("driver") + "': use virtual or threaded");
  o.threaded = f.str("driver") == "threaded";
  if (o.learners == 0 || o.steps < o.sync_every || o.sync_every < 3)
    throw ddiloco::InvalidArgument("need --learners >= 1, --H >= 3 and --steps >= --H");

  if (f.count("profile") > 0) return profile(o, f.count("profile"));
  if (!f.str("export").empty()) {
    export_for_syncer(o, f.str("export"));
    return 0;
  }
  if (!f.str("connect").empty()) {
#ifdef DDILOCO_TORCH_GPT_ZMQ
    return run_zmq_learner(o, f.str("connect"), static_cast<ddiloco::LearnerId>(f.integer("id")), f.count("shards"),
                           ddiloco::cli::parse_round(f.str("round")));
#else
    throw ddiloco::InvalidArgument("--connect: this build has no ZeroMQ (install libzmq3-dev and reconfigure)");
#endif
  }

  Context ctx(o);
  torch::manual_seed(o.seed);
  const double initial = ctx.score(ddiloco::detail::flatten(std::span<torch::Tensor>(
      torch_gpt::Learner(o.trainer, ctx.corpus.train, Shard{0, 1}, o.seed).parameters())));
  std::printf("torch_gpt: %zu tensors, initial validation loss %.4f (ln 97 = 4.575)\n", ctx.specs.size(), initial);

  if (smoke) {
    const Row r = run_decoupled(ctx, /*failures=*/true);
    const bool ok = r.val_loss < 0.85 * initial && !r.timed_out && r.kills == 1 && r.restarts == 1;
    std::printf("smoke: validation loss %.4f -> %.4f (must fall below %.4f), kills %llu restarts %llu: %s\n", initial,
                r.val_loss, 0.85 * initial, static_cast<unsigned long long>(r.kills),
                static_cast<unsigned long long>(r.restarts), ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
  }
  std::vector<Row> rows;
  if (o.methods != "decoupled") rows.push_back(run_data_parallel(ctx, /*failures=*/false));
  if (o.methods != "data-parallel") rows.push_back(run_decoupled(ctx, /*failures=*/true));
  write_outputs(ctx, rows, initial);
  std::printf("\n%s\nwrote %s/{results.csv,curves.csv,results.md}\n", table(rows, o.threaded).c_str(), o.out.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "torch_gpt: %s\n", e.what());
  return 1;
}
