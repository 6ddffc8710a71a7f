// python/src/syncer.cpp: ddiloco._core.SyncerCore, an in-process ZeroMQ syncer.
//
// What it is: what programs/ddiloco_syncer.cpp serves, for tests and notebooks:
// a Syncer (merge rule and outer optimizer chosen by name) driven by a
// SyncerRuntime on its own threads over a ZmqSyncerTransport bound to an
// endpoint (port * picks a free port; `endpoint` says which). start() and
// stop() release the GIL; status() is a dict.
// With a checkpoint directory (SyncerOptions::checkpoint_dir) it resumes from
// the newest valid checkpoint there as the program does (a new epoch, written
// back at once), and checkpoint() writes its whole state atomically; the
// console syncer (python -m ddiloco syncer) calls it on an interval and on
// SIGTERM/SIGINT. Signals, status files and metrics are the caller's.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ddiloco/checkpoint.hpp>
#include <ddiloco/codec.hpp>
#include <ddiloco/fast/merge.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/merge.hpp>
#include <ddiloco/outer_optimizer.hpp>
#include <ddiloco/syncer.hpp>
#include <ddiloco/syncer_runtime.hpp>
#include <ddiloco/tensor_list.hpp>
#include <ddiloco/transport/zmq.hpp>

#include "common.hpp"

namespace ddiloco::python {

namespace {

struct SyncerOptions {
  std::string bind = "tcp://127.0.0.1:*";
  std::size_t fragments = 4;
  std::size_t overlap = 2;
  std::size_t sync_every = 0;   ///< H the learners must use (0: not checked; pull rounds need it)
  std::string round = "pull";   ///< "pull" or "push" (RoundMode), as SyncerConfig::round
  double pull_timeout_s = 0.0;  ///< pull rounds: longest wait for a round's answers (0: derived)
  std::size_t reask_after_steps = 3;  ///< pull rounds: SyncerConfig::reask_after_steps (0: never ask twice)
  std::size_t quorum = 1;
  double grace_gamma = 0.3;
  double grace_cap_s = 1.0;
  double deadline_s = 60.0;
  std::size_t max_staleness = 8;
  double heartbeat_timeout_s = 10.0;
  std::string send_merged_to = "alive";
  std::string merge = "rda";
  std::string outer_optimizer = "nesterov";
  float outer_lr = 0.7f;
  float outer_momentum = 0.9f;
  std::string global_codec = "fp32";
  bool plaintext = false;
  std::string keys;   ///< the syncer's key file (CURVE)
  std::string allow;  ///< allow-list file: `<learner-id> <public-key>` per line (CURVE)
  bool payload_crc = false;  ///< compare contributions' payload CRC-32C under CURVE too (ddiloco_syncer --payload-crc)
  std::size_t workers = 2;
  int io_threads = 1;
  std::string checkpoint_dir;  ///< resume from / checkpoint() into this directory (empty: no checkpoints)
  std::size_t shard_index = 0;  ///< this syncer's shard (docs/sharding.md)
  std::size_t shard_count = 1;  ///< 1: not sharded
};

class SyncerBase {
 public:
  virtual ~SyncerBase() = default;
  virtual void start() = 0;
  virtual void stop() = 0;
  [[nodiscard]] virtual SyncerStatus status() const = 0;
  [[nodiscard]] virtual ZmqCounters counters() const = 0;
  [[nodiscard]] virtual std::vector<float> global_parameters() const = 0;
  [[nodiscard]] virtual const std::string& endpoint() const = 0;
  [[nodiscard]] virtual PayloadChecks payload_checks() const = 0;
  [[nodiscard]] virtual const Plan& plan() const = 0;
  [[nodiscard]] virtual SyncerSnapshot snapshot() const = 0;
  virtual void restore(const SyncerSnapshot& s) = 0;
};

template <class Rule, class Opt>
class SyncerImpl final : public SyncerBase {
 public:
  SyncerImpl(Plan plan, std::span<const float> init, const SyncerConfig& sc, const ZmqSyncerConfig& zc,
             const SyncerRuntimeConfig& rc, Opt opt)
      : syncer_(std::move(plan), init, clock_, sc, Rule(), opt), link_(zc, clock_), runtime_(syncer_, link_, rc) {}
  ~SyncerImpl() override { runtime_.stop(); }
  void start() override { runtime_.start(); }
  void stop() override { runtime_.stop(); }
  [[nodiscard]] SyncerStatus status() const override { return syncer_.status(); }
  [[nodiscard]] ZmqCounters counters() const override { return link_.counters(); }
  [[nodiscard]] std::vector<float> global_parameters() const override { return syncer_.global_parameters(); }
  [[nodiscard]] const std::string& endpoint() const override { return link_.endpoint(); }
  [[nodiscard]] PayloadChecks payload_checks() const override { return link_.payload_checks_in_use(); }
  [[nodiscard]] const Plan& plan() const override { return syncer_.plan(); }
  [[nodiscard]] SyncerSnapshot snapshot() const override { return syncer_.snapshot(); }
  void restore(const SyncerSnapshot& s) override { syncer_.restore(s); }

 private:
  SteadyClock clock_;
  Syncer<Rule, Opt> syncer_;
  ZmqSyncerTransport link_;
  SyncerRuntime<Syncer<Rule, Opt>, ZmqSyncerTransport> runtime_;
};

template <class Rule>
std::unique_ptr<SyncerBase> make_with_rule(const SyncerOptions& o, Plan plan, std::span<const float> init,
                                           const SyncerConfig& sc, const ZmqSyncerConfig& zc,
                                           const SyncerRuntimeConfig& rc) {
  if (o.outer_optimizer == "nesterov")
    return std::make_unique<SyncerImpl<Rule, NesterovSGD>>(std::move(plan), init, sc, zc, rc,
                                                           NesterovSGD(o.outer_lr, o.outer_momentum));
  if (o.outer_optimizer == "sgd")
    return std::make_unique<SyncerImpl<Rule, PlainSGD>>(std::move(plan), init, sc, zc, rc, PlainSGD(o.outer_lr));
  if (o.outer_optimizer == "average")
    return std::make_unique<SyncerImpl<Rule, AverageOnly>>(std::move(plan), init, sc, zc, rc, AverageOnly());
  throw InvalidArgument("ddiloco.Syncer: outer_optimizer = '" + o.outer_optimizer +
                        "' must be 'nesterov' (the paper's), 'sgd' or 'average'");
}

class SyncerCore {
 public:
  SyncerCore(const SyncerOptions& o, const std::vector<std::string>& names, const std::vector<std::size_t>& numels,
             const std::vector<bool>& embedding, py::array_t<float, py::array::c_style | py::array::forcecast> init,
             const std::vector<std::vector<std::uint64_t>>& shapes) {
    if (names.size() != numels.size() || names.size() != embedding.size())
      throw ShapeMismatch(detail::msg("ddiloco.Syncer: ", names.size(), " names, ", numels.size(), " sizes and ",
                                      embedding.size(), " embedding flags; pass one of each per parameter"));
    if (!shapes.empty() && shapes.size() != names.size())
      throw ShapeMismatch(detail::msg("ddiloco.Syncer: ", shapes.size(), " shapes for ", names.size(),
                                      " parameters; pass one shape per parameter, or none"));
    std::vector<TensorSpec> specs;
    for (std::size_t i = 0; i < names.size(); ++i) specs.push_back({names[i], numels[i], static_cast<bool>(embedding[i])});
    Plan plan = make_plan(specs, o.fragments);
    if (static_cast<std::size_t>(init.size()) != plan.total_numel())
      throw ShapeMismatch(detail::msg("ddiloco.Syncer: the initial values hold ", init.size(), " floats but the "
                                      "parameters have ", plan.total_numel(), " elements; pass the model itself (its "
                                      "parameters are the initial values) or a flat float32 array in model order"));
    SyncerConfig sc;
    sc.quorum.min_quorum = o.quorum;
    sc.quorum.overlap = o.overlap;
    sc.quorum.gamma = o.grace_gamma;
    sc.quorum.grace = o.grace_gamma > 0;
    sc.quorum.cap = seconds(o.grace_cap_s, "grace_cap");
    sc.quorum.deadline = seconds(o.deadline_s, "deadline");
    sc.max_staleness = o.max_staleness;
    sc.sync_every = o.sync_every;
    sc.round = round_of(o.round, "ddiloco.Syncer");
    if (sc.round == RoundMode::pull && o.sync_every == 0)
      throw InvalidArgument("ddiloco.Syncer: round = 'pull' needs sync_every > 0 (the learners' sync_every: each "
                            "fragment's round opens at its slot of the schedule); pass sync_every=, or round='push'");
    if (o.pull_timeout_s != 0.0) sc.pull_timeout = seconds(o.pull_timeout_s, "pull_timeout");  // 0: derived
    sc.reask_after_steps = o.reask_after_steps;
    round_ = sc.round;
    sc.shard_index = o.shard_index;
    sc.shard_count = o.shard_count;
    sc.heartbeat_timeout = seconds(o.heartbeat_timeout_s, "heartbeat_timeout");
    if (o.send_merged_to == "alive") {
      sc.send_merged_to = MergeRecipients::alive;
    } else if (o.send_merged_to == "contributors") {
      sc.send_merged_to = MergeRecipients::contributors;
    } else {
      throw InvalidArgument("ddiloco.Syncer: send_merged_to = '" + o.send_merged_to +
                            "' must be 'alive' (every live learner) or 'contributors'");
    }
    ZmqSyncerConfig zc;
    zc.bind = o.bind;
    zc.global_codec = parse_codec(o.global_codec);
    if (o.io_threads < 1 || o.io_threads > kMaxIoThreads)
      throw InvalidArgument("ddiloco.Syncer: io_threads = " + std::to_string(o.io_threads) + " must be in [1, " +
                            std::to_string(kMaxIoThreads) + "] (default 1)");
    zc.io_threads = o.io_threads;
    zc.keep_contributions_encoded = true;
    // Memory bounds from the shard's own fragments, all of them unsharded (docs/operations.md,
    // "Memory bounds"); a bad shard is refused first, by the Syncer's own check.
    validate(sc);
    size_for_shard(zc, plan, ShardMap(plan, sc.shard_count), sc.shard_index);
    zc.security = security_of("ddiloco.Syncer", o.plaintext, o.keys, o.allow, "allow='allow.txt'");
    if (zc.security.curve) {
      zc.security.own = read_key_file(o.keys);
      zc.security.allowed = read_allow_list(o.allow);
    }
    zc.payload_crc_under_curve = o.payload_crc;
    SyncerRuntimeConfig rc;
    rc.workers = o.workers;
    // Checkpoints (as ddiloco_syncer): the newest valid one is read before the
    // state is allocated, and must be of this plan.
    std::optional<LoadedCheckpoint> loaded;
    if (!o.checkpoint_dir.empty()) {
      ckdir_ = o.checkpoint_dir;
      std::vector<std::vector<std::uint64_t>> dims = shapes;
      if (dims.empty())
        for (std::size_t n : numels) dims.push_back({n});
      if (o.shard_count <= 1) tensors_ = checkpoint_tensors(plan, dims);  // a shard's checkpoints hold no names
      std::error_code ec;
      std::filesystem::create_directories(ckdir_, ec);
      if (ec)
        throw InvalidArgument("ddiloco.Syncer: checkpoint_dir = '" + o.checkpoint_dir +
                              "' cannot be created (" + ec.message() + "); give a writable directory");
      std::vector<CheckpointProblem> problems;
      loaded = load_newest_valid(ckdir_, problems);
      for (const auto& p : problems) skipped_.push_back(p.path.string() + ": " + p.reason);
      if (loaded) check_checkpoint_plan(*loaded, plan, "the model given to ddiloco.Syncer");
    }
    const std::span<const float> values(init.data(), static_cast<std::size_t>(init.size()));
    if (o.merge == "rda") {
      impl_ = make_with_rule<fast::RadialDirectional>(o, std::move(plan), values, sc, zc, rc);
    } else if (o.merge == "average") {
      impl_ = make_with_rule<WeightedAverage>(o, std::move(plan), values, sc, zc, rc);
    } else {
      throw InvalidArgument("ddiloco.Syncer: merge = '" + o.merge +
                            "' must be 'rda' (token-weighted RDA, embeddings averaged) or 'average'");
    }
    if (loaded) {
      // A crash may have lost merges learners already applied: a new version
      // and sequence epoch, written back before anything is served.
      advance_epoch(loaded->snapshot);
      impl_->restore(loaded->snapshot);
      serial_ = loaded->serial;
      resumed_from_ = loaded->path.string();
      checkpoint_unlocked();
    }
  }

  /// Writes the whole state into checkpoint_dir (atomically: a new serial); returns the file's path.
  std::string checkpoint() {
    open();
    if (ckdir_.empty())
      throw StateError("ddiloco.Syncer: checkpoint() needs a checkpoint directory; create the syncer with "
                       "checkpoint_dir='DIR'");
    return checkpoint_unlocked();
  }
  [[nodiscard]] const std::string& resumed_from() const { return resumed_from_; }
  [[nodiscard]] const std::vector<std::string>& skipped_checkpoints() const { return skipped_; }
  [[nodiscard]] std::uint64_t checkpoint_serial() const { return serial_; }

  void start() { open().start(); }
  void stop() {
    if (impl_) impl_->stop();
  }
  void close() {
    py::gil_scoped_release release;
    impl_.reset();
  }

  [[nodiscard]] py::dict status() const {
    const SyncerStatus s = open().status();
    const ZmqCounters z = open().counters();
    py::dict d;
    d["learners_known"] = s.learners_known;
    d["learners_alive"] = s.learners_alive;
    d["joins"] = s.joins;
    d["leaves"] = s.leaves;
    d["deaths"] = s.deaths;
    d["rejoin_requests"] = s.rejoin_requests;
    d["round"] = std::string(to_string(round_));
    d["global_step"] = s.global_step;
    d["pull_rounds"] = s.pull_rounds;
    d["pulls_sent"] = s.pulls_sent;
    d["pull_timeouts"] = s.pull_timeouts;
    d["pulls_repeated"] = s.pulls_repeated;
    d["answers_redundant"] = s.answers_redundant;
    d["pull_rounds_empty"] = s.pull_rounds_empty;
    d["steps_beyond_lead"] = s.steps_beyond_lead;
    d["frontier_carries"] = s.frontier_carries;
    d["merges"] = s.merges;
    d["contributions_accepted"] = s.contributions_accepted;
    d["mean_quorum_size"] = s.mean_quorum_size();
    d["bytes_in"] = s.bytes_in;
    d["bytes_out"] = s.bytes_out;
    py::dict rejected;
    for (std::size_t i = 0; i < kRejectReasons; ++i)
      rejected[py::str(std::string(to_string(static_cast<RejectReason>(i))))] = s.rejected[i];
    d["rejected"] = rejected;
    d["rejected_total"] = s.rejected_total();
    d["quorum_sizes"] = s.quorum_sizes;
    py::list frags;
    for (const auto& f : s.fragments) {
      py::dict fd;
      fd["version"] = f.version;
      fd["merges"] = f.merges;
      fd["open_contributions"] = f.open_contributions;
      fd["last_quorum_size"] = f.last_quorum_size;
      fd["contributions_merged"] = f.contributions_merged;
      fd["grace_waits"] = f.grace_waits;
      fd["deadline_merges"] = f.deadline_merges;
      fd["served"] = f.served;
      frags.append(fd);
    }
    d["fragments"] = frags;
    d["shard"] = py::make_tuple(s.shard_index, s.shard_count);
    d["decode_errors"] = z.decode_errors;
    d["auth_denied"] = z.auth_denied;
    d["impersonations"] = z.impersonations;
    d["joins_dropped"] = z.joins_dropped;
    d["frames_in"] = z.frames_in;
    d["frames_out"] = z.frames_out;
    d["payloads_encoded"] = z.payloads_encoded;  // one per merge sent, shared by its receivers' frames
    // Who checks a contribution's payload CRC-32C: 'deferred' (the syncer compares it) or
    // 'authenticated' (CURVE's MAC covers every byte; not compared unless payload_crc=True).
    d["payload_checks"] = std::string(to_string(open().payload_checks()));
    d["line"] = s.line();
    return d;
  }

  /// The global parameters, flat in model order (a copy).
  [[nodiscard]] py::array_t<float> global_parameters() const {
    const std::vector<float> v = open().global_parameters();
    py::array_t<float> out(static_cast<py::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), out.mutable_data());
    return out;
  }

  [[nodiscard]] std::string endpoint() const { return open().endpoint(); }
  [[nodiscard]] std::uint64_t fingerprint() const { return open().plan().fingerprint(); }

 private:
  SyncerBase& open() const {
    if (!impl_) throw StateError("ddiloco.Syncer: the syncer is closed; create a new one");
    return *impl_;
  }
  std::string checkpoint_unlocked() {
    const std::lock_guard<std::mutex> lock(checkpoint_mutex_);  // one serial per file, from any thread
    return write_checkpoint(ckdir_, impl_->snapshot(), ++serial_, {}, tensors_).string();
  }
  std::unique_ptr<SyncerBase> impl_;
  std::filesystem::path ckdir_;
  std::vector<CheckpointTensor> tensors_;
  std::uint64_t serial_ = 0;
  std::mutex checkpoint_mutex_;
  std::string resumed_from_;
  std::vector<std::string> skipped_;
  RoundMode round_ = RoundMode::push;
};

}  // namespace

void bind_syncer(py::module_& m) {
  m.def(
      "write_curve_keys",
      [](const std::string& name) {
        const CurveKeys keys = generate_curve_keys();
        write_key_file(name + ".key", keys);
        write_key_file(name + ".pub", {keys.public_key, ""});
        return keys.public_key;
      },
      py::arg("name"),
      "As ddiloco_keygen NAME: a new CURVE key pair in NAME.key (public and secret, mode 0600) and NAME.pub "
      "(public only); returns the public key (Z85 text, what an allow-list line holds)");
  m.def(
      "read_tensor_list",
      [](const std::string& path) {
        std::vector<std::tuple<std::string, std::size_t, bool>> out;
        for (const TensorSpec& t : read_tensor_list_file(path)) out.emplace_back(t.name, t.numel, t.embedding);
        return out;
      },
      py::arg("path"),
      "A tensor list file (`name numel [embedding]` per line, model order; ddiloco_syncer --tensors): "
      "[(name, numel, embedding)]");
  py::class_<SyncerOptions>(m, "SyncerOptions", "Settings of a SyncerCore (see ddiloco.Syncer)")
      .def(py::init<>())
      .def_readwrite("bind", &SyncerOptions::bind)
      .def_readwrite("fragments", &SyncerOptions::fragments)
      .def_readwrite("overlap", &SyncerOptions::overlap)
      .def_readwrite("sync_every", &SyncerOptions::sync_every)
      .def_readwrite("round", &SyncerOptions::round)
      .def_readwrite("pull_timeout_s", &SyncerOptions::pull_timeout_s)
      .def_readwrite("reask_after_steps", &SyncerOptions::reask_after_steps)
      .def_readwrite("quorum", &SyncerOptions::quorum)
      .def_readwrite("grace_gamma", &SyncerOptions::grace_gamma)
      .def_readwrite("grace_cap_s", &SyncerOptions::grace_cap_s)
      .def_readwrite("deadline_s", &SyncerOptions::deadline_s)
      .def_readwrite("max_staleness", &SyncerOptions::max_staleness)
      .def_readwrite("heartbeat_timeout_s", &SyncerOptions::heartbeat_timeout_s)
      .def_readwrite("send_merged_to", &SyncerOptions::send_merged_to)
      .def_readwrite("merge", &SyncerOptions::merge)
      .def_readwrite("outer_optimizer", &SyncerOptions::outer_optimizer)
      .def_readwrite("outer_lr", &SyncerOptions::outer_lr)
      .def_readwrite("outer_momentum", &SyncerOptions::outer_momentum)
      .def_readwrite("global_codec", &SyncerOptions::global_codec)
      .def_readwrite("plaintext", &SyncerOptions::plaintext)
      .def_readwrite("keys", &SyncerOptions::keys)
      .def_readwrite("allow", &SyncerOptions::allow)
      .def_readwrite("payload_crc", &SyncerOptions::payload_crc)
      .def_readwrite("workers", &SyncerOptions::workers)
      .def_readwrite("io_threads", &SyncerOptions::io_threads)
      .def_readwrite("shard_index", &SyncerOptions::shard_index)
      .def_readwrite("shard_count", &SyncerOptions::shard_count)
      .def_readwrite("checkpoint_dir", &SyncerOptions::checkpoint_dir);

  py::class_<SyncerCore>(m, "SyncerCore", "An in-process ZeroMQ syncer (see ddiloco.Syncer)")
      .def(py::init<const SyncerOptions&, const std::vector<std::string>&, const std::vector<std::size_t>&,
                    const std::vector<bool>&, py::array_t<float, py::array::c_style | py::array::forcecast>,
                    const std::vector<std::vector<std::uint64_t>>&>(),
           py::arg("options"), py::arg("names"), py::arg("numels"), py::arg("embedding"), py::arg("init"),
           py::arg("shapes") = std::vector<std::vector<std::uint64_t>>{})
      .def("start", &SyncerCore::start, py::call_guard<py::gil_scoped_release>())
      .def("stop", &SyncerCore::stop, py::call_guard<py::gil_scoped_release>())
      .def("close", &SyncerCore::close)
      .def("status", &SyncerCore::status)
      .def("global_parameters", &SyncerCore::global_parameters)
      .def("checkpoint", &SyncerCore::checkpoint, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("resumed_from", &SyncerCore::resumed_from)
      .def_property_readonly("skipped_checkpoints", &SyncerCore::skipped_checkpoints)
      .def_property_readonly("checkpoint_serial", &SyncerCore::checkpoint_serial)
      .def_property_readonly("endpoint", &SyncerCore::endpoint)
      .def_property_readonly("fingerprint", &SyncerCore::fingerprint);
}

}  // namespace ddiloco::python
