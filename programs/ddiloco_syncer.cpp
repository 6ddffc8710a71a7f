// ddiloco_syncer: the Decoupled DiLoCo syncer as a program, over ZeroMQ.
//
// Binds a socket, serves any number of learners, merges with the quorum/grace
// policy, checkpoints its whole state atomically on an interval and on
// SIGTERM/SIGINT, resumes from the newest valid checkpoint, and prints a status
// line periodically; `--metrics ADDR:PORT` serves Prometheus metrics
// (docs/metrics.md). `--help` lists every flag with its default.
#include <ddiloco/checkpoint.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/reference/char_lm.hpp>
#include <ddiloco/syncer.hpp>
#include <ddiloco/syncer_runtime.hpp>
#include <ddiloco/tensor_list.hpp>
#include <ddiloco/transport/zmq.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>
#include <tuple>
#include <utility>

#include "cli.hpp"
#include "model_flags.hpp"
#include "metrics.hpp"
#include "round_flag.hpp"

using namespace ddiloco;
namespace fs = std::filesystem;

namespace {

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }

void write_status_file(const std::string& path, const SyncerStatus& s, const ZmqCounters& z,
                       const std::string& tallies, RoundMode round) {
  if (path.empty()) return;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << tallies;
    out << "learners_alive=" << s.learners_alive << "\nlearners_known=" << s.learners_known << "\njoins=" << s.joins
        << "\nmerges=" << s.merges << "\naccepted=" << s.contributions_accepted << "\nrejected=" << s.rejected_total()
        << "\njoins_refused=" << s.joins_refused << "\nobserves=" << s.observes
        << "\nobserves_limited=" << s.observes_limited << "\njoins_limited=" << s.joins_limited
        << "\njoins_over_capacity=" << s.joins_over_capacity << "\nlearners_pruned=" << s.learners_pruned
        << "\nrejoin_requests=" << s.rejoin_requests << "\nrejoin_requests_limited=" << s.rejoin_requests_limited
        << "\nsequence_epoch=" << s.sequence_epoch << "\nclipped=" << s.contributions_clipped
        << "\nweights_capped=" << s.weights_capped << "\n";
    // The round mode, the global step (kept in both modes) and the pull rounds' counters (0 in push rounds).
    out << "shard_index=" << s.shard_index << "\nshard_count=" << s.shard_count << "\nshard_map=" << s.shard_map << "\n";
    out << "round=" << to_string(round) << "\nglobal_step=" << s.global_step << "\npull_rounds=" << s.pull_rounds
        << "\npulls_sent=" << s.pulls_sent << "\npull_timeouts=" << s.pull_timeouts
        << "\npull_rounds_empty=" << s.pull_rounds_empty << "\npulls_repeated=" << s.pulls_repeated
        << "\nanswers_redundant=" << s.answers_redundant << "\nsteps_beyond_lead=" << s.steps_beyond_lead
        << "\nfrontier_carries=" << s.frontier_carries << "\n";
    for (std::size_t i = 0; i < kRejectReasons; ++i)
      out << "rejected_" << to_string(static_cast<RejectReason>(i)) << "=" << s.rejected[i] << "\n";
    out << "decode_errors=" << z.decode_errors << "\nauth_denied=" << z.auth_denied
        << "\nhandshake_failures=" << z.handshake_failures
        << "\nimpersonations=" << z.impersonations << "\nsend_dropped=" << z.send_dropped << "\nbytes_in=" << z.bytes_in << "\nbytes_out=" << z.bytes_out
        << "\nsend_over_budget=" << z.send_over_budget << "\nwrong_direction=" << z.wrong_direction
        << "\ndisconnects=" << z.disconnects << "\nreceive_pauses=" << z.receive_pauses
        << "\npeers_evicted=" << z.peers_evicted << "\nslow_peer_frames=" << z.slow_peer_frames
        << "\njoins_dropped=" << z.joins_dropped << "\nsend_queued_bytes=" << z.send_queued_bytes
        << "\nincoming_queued_bytes=" << z.incoming_queued_bytes << "\nstate_frames_streamed=" << z.state_frames_streamed
        << "\nstate_duplicates=" << z.state_duplicates << "\nstreams_abandoned=" << z.streams_abandoned
        << "\nstate_waiting=" << z.state_waiting << "\npayloads_encoded=" << z.payloads_encoded << "\n";
  }
  fs::rename(tmp, path);
}

/// "0,1,7" -> {0, 1, 7} (--tally-learners); empty -> {}.
std::vector<LearnerId> parse_ids(const std::string& s) {
  std::vector<LearnerId> ids;
  std::size_t at = 0;
  while (at < s.size()) {
    const std::size_t end = std::min(s.find(',', at), s.size());
    const std::string item = s.substr(at, end - at);
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 10)
      throw InvalidArgument("--tally-learners '" + s + "': expected learner ids separated by commas, e.g. 0,1");
    ids.push_back(static_cast<LearnerId>(std::stoul(item)));
    at = end + 1;
  }
  return ids;
}

/// The status file's lines of the tallied learners (--tally-learners):
/// learner_<id>_step (its highest step counter), _contributions, _accepted,
/// _rejected (all refused: contributions - accepted), _rejected_<reason> and
/// _rejected_other (refused under no reason named per learner).
template <class S>
std::string tally_lines(const S& syncer) {
  std::string out;
  for (LearnerId id : syncer.config().tally_learners) {
    const auto t = syncer.tally(id);
    if (!t) continue;
    const std::string key = "learner_" + std::to_string(id) + "_";
    out += key + "step=" + std::to_string(t->step) + "\n" + key + "contributions=" +
           std::to_string(t->contributions) + "\n" + key + "accepted=" + std::to_string(t->accepted) + "\n" + key +
           "rejected=" + std::to_string(t->rejected_total()) + "\n" + key + "redundant=" +
           std::to_string(t->redundant) + "\n" + key + "rejected_other=" +
           std::to_string(t->rejected_other()) + "\n";
    for (std::size_t i = 0; i < kRejectReasons; ++i)
      out += key + "rejected_" + std::string(to_string(static_cast<RejectReason>(i))) + "=" +
             std::to_string(t->rejected[i]) + "\n";
  }
  return out;
}

/// The status line's round part: " round push", or in pull rounds the global
/// step and the rounds' counters.
std::string round_line(RoundMode round, const SyncerStatus& s) {
  if (round != RoundMode::pull) return " round push";
  return " round pull global-step " + std::to_string(s.global_step) + " pull-rounds " + std::to_string(s.pull_rounds) +
         " pulls-sent " + std::to_string(s.pulls_sent) + " pull-timeouts " + std::to_string(s.pull_timeouts) +
         " pull-rounds-empty " + std::to_string(s.pull_rounds_empty) +
         (s.pulls_repeated != 0 ? " pulls-repeated " + std::to_string(s.pulls_repeated) +
                                      " answers-redundant " + std::to_string(s.answers_redundant)
                                : std::string()) +
         (s.steps_beyond_lead != 0 ? " steps-beyond-lead " + std::to_string(s.steps_beyond_lead) : std::string()) +
         (s.frontier_carries != 0 ? " frontier-carries " + std::to_string(s.frontier_carries) : std::string());
}

/// "i/S" (--shard) -> (i, S); i counted from 0.
std::pair<std::size_t, std::size_t> parse_shard(const std::string& s) {
  const auto slash = s.find('/');
  const auto digits = [](const std::string& x) {
    return !x.empty() && x.size() <= 4 && x.find_first_not_of("0123456789") == std::string::npos;
  };
  if (slash != std::string::npos && digits(s.substr(0, slash)) && digits(s.substr(slash + 1))) {
    const std::size_t i = std::stoul(s.substr(0, slash)), n = std::stoul(s.substr(slash + 1));
    if (n >= 1 && n <= kMaxShards && i < n) return {i, n};
  }
  throw InvalidArgument("--shard '" + s + "': expected i/S with S in [1, " + std::to_string(kMaxShards) +
                        "] and i in [0, S), e.g. 0/2 and 1/2 for two shards (0/1: not sharded)");
}

MergeRecipients parse_recipients(const std::string& s) {
  if (s == "alive") return MergeRecipients::alive;
  if (s == "contributors") return MergeRecipients::contributors;
  throw InvalidArgument("--send-merged-to '" + s + "': expected alive or contributors");
}

template <class Rule, class Opt>
int serve(const cli::Flags& f, Plan plan, std::vector<float> init, std::vector<CheckpointTensor> tensors,
          const std::string& zero_init, Rule rule, Opt opt) {
  SteadyClock clock;
  SyncerConfig sc;
  sc.tally_learners = parse_ids(f.str("tally-learners"));
  sc.quorum.min_quorum = f.count("quorum");
  sc.quorum.overlap = f.count("overlap");
  sc.quorum.gamma = f.num("grace-gamma");
  sc.quorum.cap = std::chrono::milliseconds(f.integer("grace-cap-ms"));
  sc.quorum.grace = f.num("grace-gamma") > 0;
  sc.quorum.deadline = std::chrono::milliseconds(f.integer("deadline-ms"));
  sc.max_staleness = f.count("max-staleness");
  sc.heartbeat_timeout = std::chrono::milliseconds(f.integer("heartbeat-timeout-ms"));
  sc.send_merged_to = parse_recipients(f.str("send-merged-to"));
  sc.sync_every = f.count("sync-every");  // a learner with another H or tau is refused, with both named
  sc.round = cli::round_from_flags(f);     // a learner with the other mode is refused, with both named
  sc.pull_timeout = std::chrono::milliseconds(f.count("pull-timeout-ms"));
  sc.reask_after_steps = f.count("reask-after-steps");
  // Admission (docs/algorithm.md, "Validation and staleness"): bounded claims,
  // the robust norm reference, clipping and the weight cap.
  sc.max_tokens_per_step = f.count("max-tokens-per-step");
  sc.max_steps_per_contribution = f.count("max-steps-per-contribution");
  sc.max_lead = f.count("max-lead");
  sc.norm_outlier_factor = f.num("norm-outlier-factor");
  sc.norm_warmup = f.count("norm-warmup");
  sc.clip_factor = f.num("clip-factor");
  sc.weight_cap_factor = f.num("weight-cap-factor");
  sc.reference_window = f.count("reference-window");
  sc.reference_history = f.count("reference-history");
  sc.observe_interval = std::chrono::milliseconds(f.integer("observe-interval-ms"));
  sc.observe_burst = f.count("observe-burst");
  sc.max_learners = f.count("max-learners");
  sc.join_burst = f.count("join-burst");
  sc.join_burst_per_learner = f.count("join-burst-per-learner");
  sc.prune_after = std::chrono::seconds(f.integer("prune-after-s"));
  std::tie(sc.shard_index, sc.shard_count) = parse_shard(f.str("shard"));
  // The newest valid checkpoint is read before the syncer allocates its state,
  // so a refused start (all-zero parameters and nothing to resume) costs nothing.
  const std::string ckdir = f.str("checkpoint-dir");
  std::uint64_t serial = 0;
  std::optional<LoadedCheckpoint> loaded;
  if (!ckdir.empty()) {
    fs::create_directories(ckdir);
    std::vector<CheckpointProblem> skipped;
    loaded = load_newest_valid(ckdir, skipped);
    for (const auto& p : skipped)
      std::printf("syncer: skipped damaged checkpoint %s: %s\n", p.path.string().c_str(), p.reason.c_str());
    if (!loaded && !zero_init.empty())
      throw InvalidArgument(zero_init + " (no valid checkpoint in " + ckdir + " to resume from)");
  } else if (!zero_init.empty()) {
    throw InvalidArgument(zero_init);
  }
  Syncer<Rule, Opt> syncer(plan, init, clock, sc, rule, opt);
  // A shard's checkpoints hold its fragments only: no tensor names (ddiloco_export needs a whole model).
  if (sc.shard_count > 1) tensors.clear();
  if (loaded) {
    // A crash may have lost merges that learners already applied: start a
    // new version epoch so that every learner is answered and rebases.
    // It also starts a new sequence epoch, so that learners joining from now
    // on get sequence spaces no incarnation lost in the crash has used.
    advance_epoch(loaded->snapshot);
    syncer.restore(loaded->snapshot);
    serial = loaded->serial;
    // The new epochs go to disk before anything is served: a second crash
    // before the next interval's checkpoint must not restore the old epochs
    // again and hand out the same sequence spaces and versions twice.
    const auto path = write_checkpoint(ckdir, syncer.snapshot(), ++serial, {}, tensors);
    std::printf("syncer: resumed from %s (serial %llu), sequence epoch %llu, written as %s\n",
                loaded->path.string().c_str(), static_cast<unsigned long long>(loaded->serial),
                static_cast<unsigned long long>(loaded->snapshot.sequence_epoch), path.string().c_str());
  } else if (!ckdir.empty()) {
    std::printf("syncer: no valid checkpoint in %s, starting fresh\n", ckdir.c_str());
  }

  ZmqSyncerConfig zc;
  zc.bind = f.str("bind");
  zc.global_codec = parse_codec(f.str("global-codec"));
  {
    const long long io = f.integer("io-threads");
    if (io < 1 || io > kMaxIoThreads)
      throw InvalidArgument("--io-threads " + std::to_string(io) + ": expected 1 to " + std::to_string(kMaxIoThreads));
    zc.io_threads = static_cast<int>(io);
  }
  // Contributions reach the merge in their wire encoding (no fp32 copy), unless asked otherwise.
  zc.keep_contributions_encoded = !f.flag("decode-contributions");
  // Memory bounds (docs/operations.md): the largest legal frame is a contribution
  // of the largest fragment in fp32; anything larger cuts the sender's connection.
  // A shard's bounds follow its own fragments (about 1/S of the model's).
  size_for_shard(zc, plan, syncer.shard_map(), sc.shard_index);
  constexpr std::size_t MiB = std::size_t{1} << 20;
  // 0: as size_for_plan derived it from the model (docs/operations.md gives the formulas).
  if (f.count("peer-send-budget-mb") != 0) zc.peer_send_budget = f.count("peer-send-budget-mb") * MiB;
  if (f.count("send-budget-mb") != 0) zc.send_budget = f.count("send-budget-mb") * MiB;
  if (f.count("peer-receive-budget-mb") != 0) zc.peer_receive_budget = f.count("peer-receive-budget-mb") * MiB;
  if (f.count("incoming-max-mb") != 0) zc.incoming_max_bytes = f.count("incoming-max-mb") * MiB;
  zc.max_peers = f.count("max-peers");
  zc.connection_join_burst = f.count("connection-join-burst");
  zc.slow_peer_timeout = std::chrono::milliseconds(f.integer("slow-peer-timeout-ms"));
  if (f.flag("plaintext")) {
    zc.security = ZmqSecurity::plaintext();
    std::printf("syncer: WARNING: running without encryption or authentication (--plaintext)\n");
  } else {
    if (f.str("keys").empty() || f.str("allow").empty())
      throw InvalidArgument("CURVE security needs --keys (syncer key file) and --allow (learner allow-list); "
                            "pass --plaintext to run unencrypted on a trusted network");
    zc.security.own = read_key_file(f.str("keys"));
    zc.security.allowed = read_allow_list(f.str("allow"));
  }
  zc.payload_crc_under_curve = f.flag("payload-crc");
  ZmqSyncerTransport link(zc, clock);
  if (zc.keep_contributions_encoded) {
    std::printf("syncer: contribution payloads: %s\n",
                link.payload_checks_in_use() == PayloadChecks::authenticated
                    ? "codes and norms checked, CRC-32C not compared (CURVE authenticates every byte; "
                      "--payload-crc to compare it too)"
                    : "codes, norms and CRC-32C checked");
  }
  std::printf("syncer: serving %zu tensors in %zu fragments (fingerprint %016llx) on %s, K = %zu, merged "
              "fragments to %s, %s rounds (H = %zu, tau = %zu), %d I/O thread%s\n",
              plan.num_tensors(), plan.num_fragments(), static_cast<unsigned long long>(plan.fingerprint()),
              link.endpoint().c_str(), sc.quorum.min_quorum, std::string(to_string(sc.send_merged_to)).c_str(),
              std::string(to_string(sc.round)).c_str(), sc.sync_every, sc.quorum.overlap, zc.io_threads,
              zc.io_threads == 1 ? "" : "s");
  if (!f.str("endpoint-file").empty()) {
    std::ofstream(f.str("endpoint-file") + ".tmp") << link.endpoint() << "\n";
    fs::rename(f.str("endpoint-file") + ".tmp", f.str("endpoint-file"));
  }
  if (sc.shard_count > 1) {
    const ShardMap& map = syncer.shard_map();
    std::string frags;
    for (std::size_t p : map.fragments_of(sc.shard_index)) frags += (frags.empty() ? "" : ",") + std::to_string(p);
    std::printf("syncer: shard %zu/%zu (map %016llx): fragments %s, %zu of %zu parameters\n", sc.shard_index,
                sc.shard_count, static_cast<unsigned long long>(map.fingerprint()), frags.c_str(),
                map.elements_of(sc.shard_index), plan.total_numel());
  }
  std::fflush(stdout);

  SyncerRuntimeConfig rc;
  rc.workers = f.count("workers");
  rc.max_queued_bytes = f.count("queue-max-mb") != 0 ? f.count("queue-max-mb") * (std::size_t{1} << 20)
                                                    : zc.incoming_max_bytes;
  rc.status_every = std::chrono::milliseconds(f.integer("status-every-ms"));
  rc.on_status = [&](const SyncerStatus& s) {
    const auto z = link.counters();
    std::printf("status: %s decode-errors %llu auth-denied %llu handshake-failures %llu send-dropped %llu "
                "rejoin-requests %llu%s\n",
                s.line().c_str(), static_cast<unsigned long long>(z.decode_errors),
                static_cast<unsigned long long>(z.auth_denied), static_cast<unsigned long long>(z.handshake_failures),
                static_cast<unsigned long long>(z.send_dropped), static_cast<unsigned long long>(s.rejoin_requests),
                round_line(sc.round, s).c_str());
    std::fflush(stdout);
    write_status_file(f.str("status-file"), s, z, tally_lines(syncer), sc.round);
  };
  SyncerRuntime runtime(syncer, link, rc);
  // After the syncer, the transport and the runtime: it stops serving first.
  // Its counters start from the restored totals (they count this process).
  cli::SyncerMetricsFlag metrics(f, sc.quorum.min_quorum, !ckdir.empty(), sc.round);
  metrics.baseline(syncer.status());
  runtime.start();
  metrics.serve(syncer, link);

  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  const auto every = std::chrono::milliseconds(f.integer("checkpoint-every-ms"));
  auto checkpoint = [&] {
    if (ckdir.empty()) return;
    const auto path = write_checkpoint(ckdir, syncer.snapshot(), ++serial, {}, tensors);
    metrics.checkpoint_written();
    std::printf("syncer: checkpoint %s\n", path.string().c_str());
    std::fflush(stdout);
  };
  // Refused connections and joins, as the transport and the syncer recorded
  // them (each rate limited: a flood is counted, not logged line by line).
  auto log_refusals = [&] {
    for (const auto& r : link.take_refusals()) std::printf("syncer: %s\n", r.line().c_str());
    for (const auto& r : syncer.take_refusals()) std::printf("syncer: %s\n", r.line().c_str());
    std::fflush(stdout);
  };
  auto next = std::chrono::steady_clock::now() + every;
  while (g_signal.load() == 0) {
    // The loop wakes every 50 ms to notice a signal; checkpoints follow the interval.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    log_refusals();
    if (std::chrono::steady_clock::now() >= next) {
      checkpoint();
      next = std::chrono::steady_clock::now() + every;
    }
  }
  std::printf("syncer: signal %d: stopping\n", g_signal.load());
  runtime.stop();
  log_refusals();
  checkpoint();
  rc.on_status(syncer.status());
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  cli::Flags f("ddiloco_syncer", "the Decoupled DiLoCo syncer over ZeroMQ");
  f.add("config", "", "file of `name = value` lines with any of these flags");
  f.add("bind", "tcp://127.0.0.1:5555", "ZeroMQ endpoint to bind (tcp://0.0.0.0:PORT to serve other hosts)");
  f.add("endpoint-file", "", "write the bound endpoint here (useful with port *)");
  cli::add_model_flags(f);  // --tensors, --reference-model, --seed, --init, --embedding-pattern
  f.add("allow-zero-init", "false",
        "start from all-zero parameters when --init is not given (or holds only zeros); refused otherwise, "
        "unless a valid checkpoint in --checkpoint-dir is resumed from",
        true);
  f.add("fragments", "5", "P: number of fragments (whole tensors each; <= number of tensors)");
  f.add("sync-every", "24",
        "H: inner steps between two syncs of a fragment (learners must use the same H and --overlap: a join "
        "with another schedule is refused, naming both; 0: not checked, push rounds only)");
  f.add("overlap", "2", "tau: steps between a send and the application of its result");
  cli::add_round_flag(f, "every learner");
  f.add("pull-timeout-ms", "0",
        "pull rounds: the longest a round waits for the answers to its pulls before merging those in (later "
        "answers go to the fragment's next round); 0: twice the larger of (tau + 1) x the measured inner-step "
        "time and the measured pull-to-answer time, at most --deadline-ms");
  f.add("reask-after-steps", "3",
        "pull rounds: ask a pulled learner once more when it has reported this many steps past the pull with no "
        "answer in (the pull or the answer was likely lost); one of its two answers is merged, the other dropped "
        "(answers_redundant); 0: never ask twice");
  f.add("quorum", "1", "K: minimum distinct contributions before a merge");
  f.add("grace-gamma", "0.3", "gamma: safety factor of the adaptive grace window (0 disables the window)");
  f.add("grace-cap-ms", "1000", "cap of the grace window, milliseconds (about one inner step)");
  f.add("deadline-ms", "60000", "hard bound of a round, milliseconds");
  f.add("max-staleness", "8",
        "push rounds: rounds of H global steps a contribution's base may have been superseded for when it was "
        "received, before it is rejected and answered (versions without H)");
  f.add("heartbeat-timeout-ms", "10000", "a learner silent this long is declared dead");
  f.add("max-tokens-per-step", "0",
        "bound on the tokens one inner step of a learner may process (its batch in tokens): a join declaring "
        "more is refused; a learner declaring none may claim at most steps x this many tokens (0: no bound "
        "beyond each learner's own declaration)");
  f.add("max-steps-per-contribution", "0",
        "a contribution claiming more inner steps is rejected (steps_beyond_schedule); 0: H x (max-staleness + 1). "
        "Every contribution's steps are also bounded by the advance of its learner's step counter");
  f.add("max-lead", "0",
        "pull rounds: a learner's step counter moves the global step at most this many steps ahead of the "
        "next learner still training (a counter that jumps opens each round at most once early); 0: 64 x H");
  f.add("norm-outlier-factor", "50",
        "reject a contribution whose norm exceeds this x the fragment's robust reference (the median over recent "
        "learners of each one's largest recent accepted norm)");
  f.add("norm-warmup", "4", "accepted contributions of a fragment before its norm checks, clipping and weight cap apply");
  f.add("clip-factor", "4",
        "merge a contribution whose norm exceeds this x the robust reference as if scaled to that norm (0: off)");
  f.add("weight-cap-factor", "16",
        "cap a contribution's weight (tokens^2 / steps) at this x the robust reference of recent weights (0: off)");
  f.add("reference-window", "16", "learners the robust references of norms and weights hold (per fragment)");
  f.add("reference-history", "8", "accepted values per learner in the robust references (their maximum votes)");
  f.add("send-merged-to", "alive",
        "who gets a merged fragment: alive (every live learner) or contributors (only the learners whose "
        "contributions are in the merge: about alive/K times less down-link)");
  f.add("merge", "rda", "merge rule: rda (token-weighted RDA, embeddings averaged) or average");
  f.add("outer-optimizer", "nesterov", "nesterov, sgd or average");
  f.add("outer-lr", "0.7", "outer learning rate");
  f.add("outer-momentum", "0.9", "outer Nesterov momentum");
  f.add("global-codec", "fp32", "codec of fragments sent to learners: fp32, bf16, fp16, int8, int4");
  f.add("decode-contributions", "false",
        "decode contributions to fp32 on receipt instead of folding their encoded bytes straight into the "
        "merge (slower; for comparison)",
        true);
  f.add("checkpoint-dir", "", "directory for checkpoints (empty: no checkpoints)");
  f.add("checkpoint-every-ms", "30000", "checkpoint interval, milliseconds (also on SIGTERM/SIGINT)");
  f.add("keys", "", "syncer key file (from ddiloco_keygen)");
  f.add("allow", "", "allow-list file: `<learner-id> <public-key>` per line");
  f.add("plaintext", "false", "run WITHOUT encryption or authentication (explicit choice)", true);
  f.add("payload-crc", "false",
        "compare each contribution's payload CRC-32C under CURVE too (by default only without CURVE: its "
        "MAC already authenticates every byte, and the CRC costs about a third of an fp32 merge)",
        true);
  f.add("observe-interval-ms", "1000",
        "observers (ddiloco_learner --observe) get the global state at most once per this interval each");
  f.add("observe-burst", "4", "... and all observers together at most this many times per interval");
  f.add("max-learners", "1024",
        "learner ids known at once: a new id beyond this replaces the learner dead longest, or is refused "
        "(JoinRefusal full) when all are alive");
  f.add("prune-after-s", "300", "a learner that left or has been dead this many seconds is forgotten (its id may "
                                "join again, in a fresh sequence space)");
  f.add("join-burst", "64", "full-state answers to joins per second, all learners together (each is the whole "
                            "model; the rest are dropped and answered at the learner's next retry)");
  f.add("join-burst-per-learner", "4", "... and per learner id");
  f.add("peer-send-budget-mb", "0",
        "MiB of frames queued for one learner connection (one that does not read loses frames beyond this, "
        "counted); 0: 8 full states, at least 2 of the largest frames, at most 64 MiB unless a frame needs more");
  f.add("send-budget-mb", "0", "MiB of frames queued for all learners together; 0: 64 peer budgets, at most 1 GiB");
  f.add("peer-receive-budget-mb", "0",
        "MiB ZeroMQ may hold in received messages per connection (sets its receive high-water mark, at least "
        "4 messages); 0: 2 full states");
  f.add("incoming-max-mb", "0",
        "MiB of received messages waiting for the syncer; beyond it the socket is not read (TCP pushes back); "
        "0: 64 full states, at most 256 MiB, at least 4 of the largest frames");
  f.add("queue-max-mb", "0", "MiB of contributions waiting for the merge workers; beyond it nothing more is "
                             "taken from the socket until they drain; 0: as --incoming-max-mb");
  f.add("slow-peer-timeout-ms", "10000",
        "a learner connection whose send queue has stayed full this long (it does not read) is not heard from "
        "until it reads again, so it is declared dead after --heartbeat-timeout-ms and sent nothing more");
  f.add("max-peers", "4096", "reply routes kept (learner ids heard from); beyond it the least recently heard are "
                             "forgotten");
  f.add("connection-join-burst", "8",
        "joins and observes taken from one connection per second; beyond it they are dropped on arrival "
        "(joins_dropped), so one connection flooding joins cannot spend the join budget of every other joiner");
  f.add("shard", "0/1",
        "i/S: serve only shard i of S (counted from 0) of the fragments, as ShardMap derives them from the plan; "
        "run one syncer per shard, each with its own --bind and --checkpoint-dir, and give learners every "
        "shard's endpoint in shard order (--connect A,B); 0/1: one syncer serves everything");
  f.add("workers", "2", "merge worker threads");
  f.add("io-threads", "1",
        "ZeroMQ I/O threads; learners' connections are spread over them, and each moves (under CURVE "
        "encrypts) its connections' bytes, about 0.65 GB/s a thread under CURVE: `ddiloco_sim size` says how many");
  f.add("status-every-ms", "5000", "status line interval, milliseconds");
  f.add("status-file", "", "also write the latest status as key=value lines to this file");
  f.add("tally-learners", "",
        "learner ids (comma-separated) whose contributions the status file also counts one by one: "
        "learner_<id>_step, learner_<id>_accepted, learner_<id>_rejected_<reason>");
  cli::add_metrics_flags(f);
  if (!f.parse(argc, argv)) return 0;
  cli::check_metrics_flags(f, "ddiloco_syncer");

  cli::Model model = cli::model_from_flags(f, /*values=*/true);
  Plan plan = make_plan(model.specs, f.count("fragments"));
  std::vector<float> init = std::move(model.init);
  if (init.empty()) init.assign(plan.total_numel(), 0.0f);
  // All-zero parameters are almost always a forgotten --init (a model trained
  // from zeros keeps its symmetric units identical): refused unless asked for,
  // or unless a checkpoint replaces them (serve() decides once it has looked).
  std::string zero_init;
  if (std::all_of(init.begin(), init.end(), [](float v) { return v == 0.0f; }) && !f.flag("allow-zero-init"))
    zero_init = f.str("init").empty()
                    ? "no --init: the syncer would start from all-zero parameters; give the initial weights "
                      "(--init model.safetensors, or --init FILE.f32 with --tensors), or pass --allow-zero-init "
                      "to start from zeros on purpose"
                    : "--init '" + f.str("init") + "' holds only zeros; give the model's real initial weights, "
                      "or pass --allow-zero-init to start from zeros on purpose";
  const std::vector<CheckpointTensor> tensors = checkpoint_tensors(plan, model.shapes);
  std::printf("syncer: %zu tensors (%zu embeddings), %zu parameters from %s\n", plan.num_tensors(),
              static_cast<std::size_t>(std::count_if(model.specs.begin(), model.specs.end(),
                                                     [](const TensorSpec& t) { return t.embedding; })),
              plan.total_numel(), model.source.c_str());

  const std::string merge = f.str("merge"), opt = f.str("outer-optimizer");
  const auto lr = static_cast<float>(f.num("outer-lr")), mu = static_cast<float>(f.num("outer-momentum"));
  if (merge != "rda" && merge != "average") throw InvalidArgument("--merge '" + merge + "': expected rda or average");
  if (opt == "nesterov") {
    return merge == "rda" ? serve(f, plan, init, tensors, zero_init, fast::RadialDirectional(), NesterovSGD(lr, mu))
                          : serve(f, plan, init, tensors, zero_init, WeightedAverage(), NesterovSGD(lr, mu));
  }
  if (opt == "sgd") {
    return merge == "rda" ? serve(f, plan, init, tensors, zero_init, fast::RadialDirectional(), PlainSGD(lr))
                          : serve(f, plan, init, tensors, zero_init, WeightedAverage(), PlainSGD(lr));
  }
  if (opt == "average") {
    return merge == "rda" ? serve(f, plan, init, tensors, zero_init, fast::RadialDirectional(), AverageOnly())
                          : serve(f, plan, init, tensors, zero_init, WeightedAverage(), AverageOnly());
  }
  throw InvalidArgument("--outer-optimizer '" + opt + "': expected nesterov, sgd or average");
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddiloco_syncer: %s\n", e.what());
  return 1;
}
