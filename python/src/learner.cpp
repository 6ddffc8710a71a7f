// python/src/learner.cpp: ddiloco._core.LearnerCore, an OuterLoop over ZeroMQ
// whose tensors are the caller's torch parameters.
//
// What it is: the learner side for Python. The caller (the pure-Python
// ddiloco.Learner) passes the parameters in plan order with their names and
// embedding flags; the core builds the plan (make_plan), connects a
// ZmqLearnerTransport and drives an OuterLoop over the parameters' memory:
//   - host form (every parameter a CPU tensor): each parameter is a
//     std::span<float> over its own storage (data_ptr()), read and written in
//     place, so the module keeps the same tensors and the optimizer its state;
//   - staged form (some parameter on another device, or staging="always"):
//     only the tensors of the fragment being sent or applied are copied,
//     through two small Python callables (device -> host buffer, host buffer ->
//     device, both in place on the parameter) that the package passes in.
// Contract checks, with messages that name the tensor and the fix: float32,
// dense, contiguous, same element count as when the plan was built, same
// device. Every parameter is checked at construction and at join; at a step,
// exactly the tensors that step may read or write (the fragment due to be
// sent and the fragments sent and awaiting their result), before they are
// touched, so a step with nothing due calls no Python at all. A parameter whose
// storage moved (p.data = new tensor of the same shape) is followed.
// Blocking calls (join, leave, lock-step steps) release the GIL.
// What it is not: maths (OuterLoop, fast/), nor torch-specific beyond duck typing
// (dtype, data_ptr(), numel(), is_contiguous(), device.type, is_sparse).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddiloco/codec.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/transport/sharded.hpp>
#include <ddiloco/transport/zmq.hpp>

#include "common.hpp"

namespace ddiloco::python {

/// The two copies of the staged form, Python callables given by the package:
/// copy_out(param, buffer) writes the parameter's values into the writable
/// float32 buffer; copy_in(param, buffer) writes the buffer's values into the
/// parameter in place (under no_grad).
struct Staging {
  py::object copy_out;
  py::object copy_in;
};

/// A parameter in the staged form: the Python tensor and its element count.
struct StagedParam {
  PyObject* tensor = nullptr;  ///< borrowed: LearnerCore holds the reference
  std::size_t numel = 0;
  const Staging* staging = nullptr;
};

}  // namespace ddiloco::python

namespace ddiloco {

/// Staged form (tensor.hpp) for parameters the host cannot address in place.
template <>
struct tensor_traits<python::StagedParam> {
  static std::size_t size(const python::StagedParam& p) { return p.numel; }
  static void copy_to_host(const python::StagedParam& p, std::span<float> dst) { call(p.staging->copy_out, p, dst.data(), dst.size()); }
  static void copy_from_host(python::StagedParam& p, std::span<const float> src) {
    // The callable only reads the buffer (copy_in); it is lent writable because
    // torch.frombuffer warns on read-only buffers.
    call(p.staging->copy_in, p, const_cast<float*>(src.data()), src.size());
  }

 private:
  static void call(const pybind11::object& fn, const python::StagedParam& p, float* data, std::size_t n) {
    pybind11::gil_scoped_acquire gil;  // step() holds it already; join() released it
    auto view = pybind11::memoryview::from_buffer(data, {static_cast<pybind11::ssize_t>(n)},
                                                  {static_cast<pybind11::ssize_t>(sizeof(float))});
    fn(pybind11::handle(p.tensor), view);
  }
};

}  // namespace ddiloco

namespace ddiloco::python {

namespace {

struct LearnerOptions {
  std::string endpoint = "tcp://127.0.0.1:5555";
  LearnerId id = 0;
  std::size_t fragments = 4;
  std::size_t sync_every = 24;
  std::size_t overlap = 2;
  float alpha = 0.0f;
  bool lock_step = false;
  double join_timeout_s = 30.0;
  double join_retry_s = 1.0;
  double lock_step_timeout_s = 60.0;
  double heartbeat_s = 1.0;
  double metadata_interval_s = 0.001;  ///< ZmqLearnerConfig::metadata_interval (0: every step's metadata)
  std::string codec = "fp32";
  bool error_feedback = false;
  bool plaintext = false;
  std::string keys;        ///< this learner's key file (CURVE)
  std::string server_key;  ///< the syncer's public key file (CURVE)
  std::string staging = "auto";  ///< auto: host form when every parameter is on the CPU; always: staged form
  /// "pull" or "push" (RoundMode; the syncer's must match), as OuterLoopConfig::round.
  std::string round = "pull";
  /// OuterLoopConfig::apply_every: pull rounds apply globals only at multiples of this step.
  std::size_t apply_every = 1;
  /// OuterLoopConfig::announce_applies: each apply announced one apply step ahead (a group's leader).
  bool announce_applies = false;
};

struct StepResult {
  std::optional<std::size_t> sent;  ///< fragment sent at this step
  std::vector<std::size_t> applied;  ///< fragments whose global was applied at this step, ascending
  std::vector<std::uint64_t> versions;  ///< the version of each global in `applied` (same order)
  bool waited = false;               ///< lock-step: the step waited for a global
  /// announce_applies: fragments whose global this step announced (applied at the next step that may apply),
  /// ascending, and their versions.
  std::vector<std::size_t> announced;
  std::vector<std::uint64_t> announced_versions;
};

/// "[2, 3]" from a torch.Size / tuple.
std::string dims(py::handle seq) {
  std::string s = "[";
  bool first = true;
  for (py::handle d : seq) {
    if (!first) s += ", ";  // appended: GCC 12 misreports `"" + std::string` (-Wstringop-overflow under LTO)
    s += py::str(d).cast<std::string>();
    first = false;
  }
  return s + "]";
}

/// One parameter as the core tracks it.
struct Param {
  py::object tensor;
  std::string name;
  std::size_t numel = 0;
  std::string device;  ///< device type at construction ("cpu", "cuda", ...)
  std::uintptr_t data = 0;
};

/// A learner's links: one per syncer shard (one for an unsharded syncer), docs/sharding.md.
using LearnerLink = ShardedLearnerTransport<ZmqLearnerTransport>;

/// The OuterLoop behind a LearnerCore, for one tensor form.
class LoopBase {
 public:
  virtual ~LoopBase() = default;
  virtual void join() = 0;                       // GIL released by the caller
  virtual StepReport step(std::int64_t tokens) = 0;
  virtual const std::vector<std::size_t>& prepare_step() = 0;  // OuterLoop::prepare_step
  virtual void leave() = 0;
  virtual void set_data(std::size_t t, std::uintptr_t data) = 0;  // a host tensor's storage moved
  [[nodiscard]] virtual bool joined() const = 0;
  [[nodiscard]] virtual const OuterLoopStatus& status() const = 0;
  [[nodiscard]] virtual std::uint64_t base_version(std::size_t p) const = 0;
};

template <class T>
class Loop final : public LoopBase {
 public:
  Loop(const Plan& plan, LearnerLink& link, const OuterLoopConfig& config, std::vector<T> params)
      : params_(std::move(params)), outer_(plan, link, config) {}
  void join() override { outer_.join(params_); }
  StepReport step(std::int64_t tokens) override { return outer_.step(params_, tokens); }
  const std::vector<std::size_t>& prepare_step() override { return outer_.prepare_step(); }
  void leave() override { outer_.leave(); }
  void set_data(std::size_t t, std::uintptr_t data) override {
    if constexpr (std::is_same_v<T, std::span<float>>)
      params_[t] = std::span<float>(reinterpret_cast<float*>(data), params_[t].size());
  }
  [[nodiscard]] bool joined() const override { return outer_.joined(); }
  [[nodiscard]] const OuterLoopStatus& status() const override { return outer_.status(); }
  [[nodiscard]] std::uint64_t base_version(std::size_t p) const override { return outer_.base_version(p); }

 private:
  std::vector<T> params_;
  OuterLoop<LearnerLink, T> outer_;
};

/// Every contract of parameter p, with a message naming it, `owner` (the
/// Python class) and the fix. `first`: at construction (records size, device
/// and storage). Returns true when the storage moved (same size, dtype and
/// device, new memory: p.data = ...), which the caller follows.
bool check_parameter(Param& p, const py::object& float32, bool first, const char* owner) {
  const py::handle t = p.tensor;
  const std::string_view full(owner);
  const std::string_view noun = full.substr(full.rfind('.') + 1);  // "Learner" in "the Learner was created"
  const std::string who = detail::msg(owner, ": parameter '", p.name, "'");
  if (!py::hasattr(t, "data_ptr") || !py::hasattr(t, "dtype"))
    throw InvalidArgument(detail::msg(who, " is a ", py::str(py::type::of(t).attr("__name__")).cast<std::string>(),
                                      ", not a torch tensor; pass model.named_parameters() or (name, tensor) pairs"));
  const std::string shape = dims(t.attr("shape"));
  if (py::hasattr(t, "is_sparse") && t.attr("is_sparse").cast<bool>())
    throw InvalidArgument(detail::msg(who, " (shape ", shape, ") is sparse; ddiloco needs dense parameters: "
                                           "call .to_dense() on it before creating the ", noun));
  if (!py::object(t.attr("dtype")).is(float32))
    throw InvalidArgument(detail::msg(who, " (shape ", shape, ") has dtype ", py::str(t.attr("dtype")).cast<std::string>(),
                                      "; ddiloco works on float32 parameters: convert the model with model.float() "
                                      "(keep bfloat16 for the forward pass with torch.autocast) before creating "
                                      "the ", noun));
  if (!t.attr("is_contiguous")().cast<bool>())
    throw InvalidArgument(detail::msg(
        who, " (shape ", shape, ", strides ", dims(t.attr("stride")()),
        ") is not contiguous (a transposed or sliced view?); ddiloco writes merged values back in place, so a "
        ".contiguous() copy would lose them: make the parameter itself contiguous "
        "(with torch.no_grad(): p.data = p.data.contiguous()) before creating the ", noun));
  const auto numel = t.attr("numel")().cast<std::size_t>();
  const auto device = py::str(t.attr("device").attr("type")).cast<std::string>();
  const auto data = t.attr("data_ptr")().cast<std::uintptr_t>();
  if (first) {
    if (numel == 0)
      throw InvalidArgument(detail::msg(who, " has no elements; leave empty parameters out (", owner,
                                        "(((n, p) for n, p in model.named_parameters() if p.numel()), ...))"));
    p.numel = numel;
    p.device = device;
    p.data = data;
    return false;
  }
  if (numel != p.numel)
    throw ShapeMismatch(detail::msg(who, " has ", numel, " elements (shape ", shape, ") but had ", p.numel,
                                    " when the ", noun, " was created: the plan is fixed; resize parameters before "
                                    "creating the ", noun, " (and the Syncer), never after"));
  if (device != p.device)
    throw InvalidArgument(detail::msg(who, " is on device ", device, " but was on ", p.device, " when the ", noun,
                                      " was created; move the model (model.to(device)) before creating the ", noun));
  if (data == p.data) return false;
  p.data = data;  // same size, dtype and device, new storage (p.data = ...): followed
  return true;
}

/// The per-step check of one tensor: unchanged storage, size, dtype and
/// contiguity cost four attribute reads; anything else goes to check_parameter.
bool check_parameter_fast(Param& p, const py::object& float32, const char* owner) {
  const py::handle t = p.tensor;
  const auto data = t.attr("data_ptr")().cast<std::uintptr_t>();
  if (data == p.data && py::object(t.attr("dtype")).is(float32) && t.attr("numel")().cast<std::size_t>() == p.numel &&
      t.attr("is_contiguous")().cast<bool>())
    return false;
  return check_parameter(p, float32, false, owner);
}

/// A float32 buffer (numpy array, memoryview) of exactly `n` elements,
/// C-contiguous, as a span; `writable`: it will be written. Throws naming
/// `who`, `fragment` and the fix.
std::span<float> float_buffer(const py::buffer& b, std::size_t n, const char* who, std::size_t fragment,
                              bool writable = true) {
  const py::buffer_info info = b.request(writable);
  if (info.itemsize != static_cast<py::ssize_t>(sizeof(float)) || (info.format != "f" && info.format != "<f" && info.format != "=f"))
    throw InvalidArgument(detail::msg(who, ": the buffer for fragment ", fragment, " has format '", info.format,
                                      "' (item size ", info.itemsize, "); pass a float32 array"));
  py::ssize_t expect = info.itemsize;
  for (py::ssize_t d = info.ndim; d-- > 0;) {
    if (info.shape[static_cast<std::size_t>(d)] != 1 && info.strides[static_cast<std::size_t>(d)] != expect)
      throw InvalidArgument(detail::msg(who, ": the buffer for fragment ", fragment,
                                        " is not contiguous; pass a contiguous float32 array (.contiguous())"));
    expect *= info.shape[static_cast<std::size_t>(d)];
  }
  if (static_cast<std::size_t>(info.size) != n)
    throw ShapeMismatch(detail::msg(who, ": the buffer for fragment ", fragment, " has ", info.size,
                                    " elements but the fragment has ", n, "; pass one of exactly that size"));
  return {static_cast<float*>(info.ptr), n};
}

/// The plan as Python sees it: fingerprint, fragments (tensor names of each),
/// fragment_numel (floats of each), embedding (names), numel.
py::dict plan_dict(const Plan& plan) {
  py::dict d;
  d["fingerprint"] = plan.fingerprint();
  std::vector<std::vector<std::string>> frags;
  std::vector<std::size_t> numels;
  for (const auto& f : plan.fragments()) {
    auto& names = frags.emplace_back();
    for (std::size_t t : f.tensors) names.push_back(plan.tensors()[t].name);
    numels.push_back(f.numel);
  }
  d["fragments"] = frags;
  d["fragment_numel"] = numels;
  std::vector<std::string> emb;
  for (const auto& t : plan.tensors())
    if (t.embedding) emb.push_back(t.name);
  d["embedding"] = emb;
  d["numel"] = plan.total_numel();
  return d;
}

class LearnerCore {
 public:
  LearnerCore(const LearnerOptions& o, const std::vector<std::string>& names, const py::list& tensors,
              const std::vector<bool>& embedding, py::object float32, py::object copy_out, py::object copy_in)
      : options_(o), float32_(std::move(float32)), staging_{std::move(copy_out), std::move(copy_in)} {
    if (names.size() != tensors.size() || names.size() != embedding.size())
      throw ShapeMismatch(detail::msg("ddiloco.Learner: ", names.size(), " names, ", tensors.size(),
                                      " tensors and ", embedding.size(), " embedding flags; pass one of each per "
                                      "parameter"));
    if (o.staging != "auto" && o.staging != "always")
      throw InvalidArgument("ddiloco.Learner: staging = '" + o.staging +
                            "' must be 'auto' (in place for CPU parameters, staged copies for others) or 'always'");
    std::vector<TensorSpec> specs;
    params_.reserve(names.size());
    for (std::size_t i = 0; i < names.size(); ++i) {
      Param p;
      p.tensor = py::reinterpret_borrow<py::object>(tensors[i]);
      p.name = names[i];
      params_.push_back(std::move(p));
      check_full(i, /*first=*/true);
      specs.push_back({names[i], params_[i].numel, static_cast<bool>(embedding[i])});
    }
    plan_ = std::make_unique<Plan>(make_plan(specs, o.fragments));
    const bool all_cpu = std::all_of(params_.begin(), params_.end(), [](const Param& p) { return p.device == "cpu"; });
    staged_ = o.staging == "always" || !all_cpu;

    ZmqLearnerConfig zc;
    zc.connect = o.endpoint;
    zc.id = o.id;
    zc.codec = parse_codec(o.codec);
    zc.error_feedback = o.error_feedback;
    if (!(std::isfinite(o.metadata_interval_s) && o.metadata_interval_s >= 0))
      throw InvalidArgument(detail::msg("ddiloco.Learner: metadata_interval = ", o.metadata_interval_s,
                                        " s must be a finite number of seconds >= 0 (0: send every step's metadata)"));
    zc.metadata_interval = std::chrono::duration_cast<Duration>(std::chrono::duration<double>(o.metadata_interval_s));
    size_for_plan(zc, *plan_);  // a syncer frame larger than the largest fragment's cuts the connection
    zc.security = security_of("ddiloco.Learner", o.plaintext, o.keys, o.server_key, "server_key='syncer.pub'");
    if (zc.security.curve) {
      zc.security.own = read_key_file(o.keys);
      zc.security.server_public_key = read_key_file(o.server_key).public_key;
    }
    // One endpoint, or one per syncer shard in shard order, comma-separated.
    std::vector<std::string> endpoints;
    for (std::size_t at = 0; at <= o.endpoint.size();) {
      const std::size_t end = std::min(o.endpoint.find(',', at), o.endpoint.size());
      endpoints.push_back(o.endpoint.substr(at, end - at));
      at = end + 1;
    }
    for (const auto& e : endpoints)
      if (e.rfind("tcp://", 0) != 0 && e.rfind("ipc://", 0) != 0 && e.rfind("inproc://", 0) != 0)
        throw InvalidArgument("ddiloco.Learner: endpoint = '" + o.endpoint +
                              (endpoints.size() > 1 ? "': '" + e + "'" : std::string("'")) +
                              " is not a ZeroMQ endpoint; give the syncer's address as 'tcp://HOST:PORT' "
                              "(ddiloco.Syncer(...).endpoint in the same process), or a list of every syncer "
                              "shard's, in shard order");
    if (endpoints.size() > plan_->num_fragments())
      throw InvalidArgument(detail::msg("ddiloco.Learner: endpoint lists ", endpoints.size(),
                                        " syncer shards but the plan has ", plan_->num_fragments(),
                                        " fragments (each shard serves at least one)"));
    OuterLoopConfig lc;
    lc.id = o.id;
    lc.sync_every = o.sync_every;
    lc.overlap = o.overlap;
    lc.alpha = o.alpha;
    lc.lock_step = o.lock_step;
    lc.round = round_of(o.round, "ddiloco.Learner");
    lc.apply_every = o.apply_every;
    lc.announce_applies = o.announce_applies;
    pull_ = lc.round == RoundMode::pull;
    lc.join_timeout = seconds(o.join_timeout_s, "join_timeout");
    lc.join_retry = seconds(o.join_retry_s, "join_retry");
    lc.lock_step_timeout = seconds(o.lock_step_timeout_s, "lock_step_timeout");
    lc.heartbeat_interval = seconds(o.heartbeat_s, "heartbeat");
    try {
      std::vector<std::unique_ptr<ZmqLearnerTransport>> links;
      for (const auto& e : endpoints) {
        ZmqLearnerConfig one = zc;
        one.connect = e;
        links.push_back(std::make_unique<ZmqLearnerTransport>(one, clock_));
      }
      link_ = std::make_unique<LearnerLink>(*plan_, std::move(links));
    } catch (const TransportError& e) {
      throw TransportError(detail::msg(message_of(e), "; give the syncer's address as 'tcp://HOST:PORT' (a host name or "
                                                 "IP address, and a port number)"));
    }
    if (staged_) {
      std::vector<StagedParam> v;
      for (auto& p : params_) v.push_back({p.tensor.ptr(), p.numel, &staging_});
      loop_ = std::make_unique<Loop<StagedParam>>(*plan_, *link_, lc, std::move(v));
    } else {
      std::vector<std::span<float>> v;
      for (auto& p : params_) v.emplace_back(reinterpret_cast<float*>(p.data), p.numel);
      loop_ = std::make_unique<Loop<std::span<float>>>(*plan_, *link_, lc, std::move(v));
    }
    schedule_.emplace(plan_->num_fragments(), o.sync_every, o.overlap);
  }

  void join() {
    for (std::size_t i = 0; i < params_.size(); ++i) check_full(i, false);
    try {
      py::gil_scoped_release release;
      loop_->join();
    } catch (const TransportError& e) {
      throw TransportError(detail::msg(message_of(e), " (endpoint ", options_.endpoint, ", security ",
                                       options_.plaintext ? "plaintext" : "CURVE",
                                       "; the syncer must use the same)"));
    }
  }

  /// step() as Python sees it: a step that sent, applied and waited for nothing
  /// returns one shared, immutable report (no allocation on the common path).
  py::object step_py(std::int64_t tokens) {
    StepResult r = step(tokens);
    if (!r.sent && r.applied.empty() && r.announced.empty() && !r.waited) {
      if (!nothing_) nothing_ = py::cast(StepResult{{}, {}, {}, false, {}, {}});
      return nothing_;
    }
    return py::cast(std::move(r));
  }

  StepResult step(std::int64_t tokens) {
    check(loop_ != nullptr, "step");
    // The tensors this step may touch, checked (and followed, if their storage
    // moved) before it reads or writes them: the OuterLoop names their
    // fragments once it has taken what the network brought (a pull to answer,
    // a global to apply); every other tensor is left unread.
    if (loop_->joined())
      for (std::size_t p : loop_->prepare_step()) check_fragment(p);
    StepReport r;
    if (options_.lock_step) {
      py::gil_scoped_release release;
      r = loop_->step(tokens);
    } else {
      r = loop_->step(tokens);
    }
    StepResult out;
    out.waited = r.waited;
    // The globals this step applied (and, announce_applies, announced), kept
    // (shared, no copy) until the next step for copy_applied() and
    // copy_announced(): a group's leader hands them to its other ranks. Each
    // list in fragment order, its fragments and versions into the report.
    const auto keep = [](std::vector<AppliedFragment>& kept, std::vector<AppliedFragment>&& fresh,
                         std::vector<std::size_t>& fragments, std::vector<std::uint64_t>& versions) {
      kept = std::move(fresh);
      std::sort(kept.begin(), kept.end(),
                [](const AppliedFragment& a, const AppliedFragment& b) { return a.fragment < b.fragment; });
      for (const AppliedFragment& a : kept) {
        fragments.push_back(a.fragment);
        versions.push_back(a.version);
      }
    };
    keep(last_applied_, std::move(r.applied_fragments), out.applied, out.versions);
    keep(last_announced_, std::move(r.announced), out.announced, out.announced_versions);
    out.sent = r.sent;
    return out;
  }

  void leave() {
    if (!loop_) return;
    py::gil_scoped_release release;
    loop_->leave();
  }

  /// Leaves (best effort) and closes the socket; the core is unusable after.
  void close() {
    if (loop_ && loop_->joined()) leave();
    py::gil_scoped_release release;
    loop_.reset();
    link_.reset();
  }

  [[nodiscard]] bool joined() const { return loop_ && loop_->joined(); }
  [[nodiscard]] bool staged() const { return staged_; }

  [[nodiscard]] py::dict status() const {
    check(loop_ != nullptr, "status");
    const auto& s = loop_->status();
    py::dict d;
    d["step"] = s.step;
    d["tokens"] = s.tokens;
    d["sends"] = s.sends;
    d["send_failures"] = s.send_failures;
    d["applies"] = s.applies;
    d["late_applies"] = s.late_applies;
    d["received"] = s.received;
    d["ignored"] = s.ignored;
    d["heartbeats"] = s.heartbeats;
    d["lock_step_waits"] = s.lock_step_waits;
    d["lock_step_timeouts"] = s.lock_step_timeouts;
    d["rejoins"] = s.rejoins;
    d["round"] = pull_ ? "pull" : "push";
    d["pulls"] = s.pulls;
    d["pulls_deferred_steps"] = s.pulls_deferred_steps;
    d["pulls_repeated"] = s.pulls_repeated;
    d["metadata_sent"] = s.metadata_sent;
    d["bytes_sent"] = s.bytes_sent;
    std::vector<std::uint64_t> versions;
    for (std::size_t p = 0; p < plan_->num_fragments(); ++p) versions.push_back(loop_->base_version(p));
    d["base_versions"] = versions;
    const auto z = link_->counters();  // summed over the shards' links
    d["frames_in"] = z.frames_in;
    d["frames_out"] = z.frames_out;
    d["bytes_in"] = z.bytes_in;
    d["bytes_out"] = z.bytes_out;
    d["send_dropped"] = z.send_dropped;
    d["decode_errors"] = z.decode_errors;
    d["metadata_coalesced"] = z.metadata_coalesced;
    d["payload_buffers_reused"] = z.payload_buffers_reused;
    d["joined"] = loop_->joined();
    return d;
  }

  [[nodiscard]] py::dict plan() const { return plan_dict(*plan_); }

  /// The fragment due to be sent at inner step `step` (1-based), or None.
  [[nodiscard]] std::optional<std::size_t> due_at(std::uint64_t step) const { return schedule_->due_at(step); }

  /// Copies the global of `fragment` that the last step applied (fragment
  /// order, its numel floats) into `out`, a writable float32 buffer of exactly
  /// that size (the leader of a group fills its broadcast buffer with it);
  /// returns its version.
  std::uint64_t copy_applied(std::size_t fragment, py::buffer out) const {
    return copy_global(last_applied_, fragment, out, "copy_applied", "applied");
  }

  /// The same for a global the last step announced (announce_applies).
  std::uint64_t copy_announced(std::size_t fragment, py::buffer out) const {
    return copy_global(last_announced_, fragment, out, "copy_announced", "announced");
  }

 private:
  std::uint64_t copy_global(const std::vector<AppliedFragment>& list, std::size_t fragment, py::buffer out,
                            const char* what, const char* did) const {
    check(loop_ != nullptr, what);
    const auto it = std::find_if(list.begin(), list.end(),
                                 [&](const AppliedFragment& a) { return a.fragment == fragment; });
    if (it == list.end()) {
      std::string which;
      for (const AppliedFragment& a : list) {
        if (!which.empty()) which += ", ";  // appended: see dims()
        which += std::to_string(a.fragment);
      }
      throw StateError(detail::msg("ddiloco.Learner.", what, ": fragment ", fragment, " was not ", did,
                                   " at the last step (", did, ": [", which, "]); pass a fragment from the last "
                                   "StepReport.", did));
    }
    const std::span<float> dst = float_buffer(out, it->values->size(), (std::string("ddiloco.Learner.") + what).c_str(), fragment);
    std::copy(it->values->begin(), it->values->end(), dst.begin());
    return it->version;
  }

  void check(bool open, const char* what) const {
    if (!open) throw StateError(detail::msg("ddiloco.Learner.", what, "(): the learner is closed; create a new one"));
  }

  void check_fragment(std::size_t p) {
    for (std::size_t t : plan_->fragments()[p].tensors) check_fast(t);
  }

  /// The per-step check of one tensor (check_parameter_fast), following moved storage.
  void check_fast(std::size_t i) {
    if (check_parameter_fast(params_[i], float32_, "ddiloco.Learner") && !staged_) loop_->set_data(i, params_[i].data);
  }

  /// Every contract of parameter i (check_parameter), following moved storage.
  void check_full(std::size_t i, bool first) {
    if (check_parameter(params_[i], float32_, first, "ddiloco.Learner") && !staged_) loop_->set_data(i, params_[i].data);
  }

  LearnerOptions options_;
  py::object float32_;
  Staging staging_;
  std::vector<Param> params_;
  std::unique_ptr<Plan> plan_;
  bool staged_ = false;
  bool pull_ = false;  ///< pull rounds (LearnerOptions::round)
  SteadyClock clock_;
  std::unique_ptr<LearnerLink> link_;
  std::unique_ptr<LoopBase> loop_;
  std::optional<Schedule> schedule_;
  std::vector<AppliedFragment> last_announced_;  ///< the globals the last step announced (announce_applies)
  std::vector<AppliedFragment> last_applied_;  ///< the globals the last step applied (shared payloads)
  py::object nothing_;                  ///< the shared report of a step that did nothing
};

/// FragmentApplier over a follower's parameters, for one tensor form.
class ApplierBase {
 public:
  virtual ~ApplierBase() = default;
  virtual void apply(std::size_t p, std::span<const float> global) = 0;
  virtual void set_data(std::size_t t, std::uintptr_t data) = 0;  // a host tensor's storage moved
};

template <class T>
class Applier final : public ApplierBase {
 public:
  Applier(const Plan& plan, float alpha, std::vector<T> params) : params_(std::move(params)), applier_(plan, alpha) {}
  void apply(std::size_t p, std::span<const float> global) override {
    applier_.apply(std::span<T>(params_), p, global);
  }
  void set_data(std::size_t t, std::uintptr_t data) override {
    if constexpr (std::is_same_v<T, std::span<float>>)
      params_[t] = std::span<float>(reinterpret_cast<float*>(data), params_[t].size());
  }

 private:
  std::vector<T> params_;
  FragmentApplier<T> applier_;
};

/// A rank of a group learner other than its leader (ddiloco.GroupLearner):
/// the leader's plan and parameter contracts, no connection. apply() writes a
/// global the leader's step applied into this rank's parameters with the
/// leader's arithmetic (FragmentApplier, the code OuterLoop applies with), in
/// place on the CPU or through the staged copies otherwise, as LearnerCore.
class FollowerCore {
 public:
  FollowerCore(const LearnerOptions& o, const std::vector<std::string>& names, const py::list& tensors,
               const std::vector<bool>& embedding, py::object float32, py::object copy_out, py::object copy_in)
      : float32_(std::move(float32)), staging_{std::move(copy_out), std::move(copy_in)} {
    if (names.size() != tensors.size() || names.size() != embedding.size())
      throw ShapeMismatch(detail::msg("ddiloco.GroupLearner: ", names.size(), " names, ", tensors.size(),
                                      " tensors and ", embedding.size(), " embedding flags; pass one of each per "
                                      "parameter"));
    if (o.staging != "auto" && o.staging != "always")
      throw InvalidArgument("ddiloco.GroupLearner: staging = '" + o.staging +
                            "' must be 'auto' (in place for CPU parameters, staged copies for others) or 'always'");
    std::vector<TensorSpec> specs;
    for (std::size_t i = 0; i < names.size(); ++i) {
      Param p;
      p.tensor = py::reinterpret_borrow<py::object>(tensors[i]);
      p.name = names[i];
      check_parameter(p, float32_, /*first=*/true, "ddiloco.GroupLearner");
      specs.push_back({names[i], p.numel, static_cast<bool>(embedding[i])});
      params_.push_back(std::move(p));
    }
    plan_ = std::make_unique<Plan>(make_plan(specs, o.fragments));
    const bool all_cpu = std::all_of(params_.begin(), params_.end(), [](const Param& p) { return p.device == "cpu"; });
    staged_ = o.staging == "always" || !all_cpu;
    if (staged_) {
      std::vector<StagedParam> v;
      for (auto& p : params_) v.push_back({p.tensor.ptr(), p.numel, &staging_});
      applier_ = std::make_unique<Applier<StagedParam>>(*plan_, o.alpha, std::move(v));
    } else {
      std::vector<std::span<float>> v;
      for (auto& p : params_) v.emplace_back(reinterpret_cast<float*>(p.data), p.numel);
      applier_ = std::make_unique<Applier<std::span<float>>>(*plan_, o.alpha, std::move(v));
    }
    versions_.assign(plan_->num_fragments(), 0);
    schedule_.emplace(plan_->num_fragments(), o.sync_every, o.overlap);
  }

  /// The fragment due to be sent at inner step `step` (1-based), or None: the
  /// leader's schedule (the group communicates at the steps that may send or apply).
  [[nodiscard]] std::optional<std::size_t> due_at(std::uint64_t step) const { return schedule_->due_at(step); }

  /// Writes `values` (the global of `fragment` the leader's step applied, its
  /// fragment's numel float32 values in fragment order) into this rank's
  /// parameters, and records `version`.
  void apply(std::size_t fragment, std::uint64_t version, const py::buffer& values) {
    const std::size_t count = plan_->num_fragments();
    if (fragment >= count)
      throw InvalidArgument(detail::msg("ddiloco.GroupLearner: fragment ", fragment, " does not exist: the plan has ",
                                        count, " fragments (0 to ", count - 1,
                                        "); every rank must build the same plan (same model, same fragments=)"));
    const std::span<float> g = float_buffer(values, plan_->fragments()[fragment].numel, "ddiloco.GroupLearner.apply",
                                            fragment, /*writable=*/false);
    for (std::size_t t : plan_->fragments()[fragment].tensors)
      if (check_parameter_fast(params_[t], float32_, "ddiloco.GroupLearner") && !staged_)
        applier_->set_data(t, params_[t].data);
    applier_->apply(fragment, std::span<const float>(g));
    versions_[fragment] = version;
    ++applies_;
  }

  /// Every parameter's contracts (at a join, before the leader's state is written).
  void check_all() {
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (check_parameter(params_[i], float32_, false, "ddiloco.GroupLearner") && !staged_)
        applier_->set_data(i, params_[i].data);
  }

  /// The base versions the leader has (at a join: the state it fetched).
  void set_versions(const std::vector<std::uint64_t>& versions) {
    if (versions.size() != versions_.size())
      throw ShapeMismatch(detail::msg("ddiloco.GroupLearner: ", versions.size(), " versions for ", versions_.size(),
                                      " fragments; every rank must build the same plan"));
    versions_ = versions;
  }

  [[nodiscard]] py::dict status() const {
    py::dict d;
    d["applies"] = applies_;
    d["base_versions"] = versions_;
    return d;
  }
  [[nodiscard]] py::dict plan() const { return plan_dict(*plan_); }
  [[nodiscard]] bool staged() const { return staged_; }

 private:
  py::object float32_;
  Staging staging_;
  std::vector<Param> params_;
  std::unique_ptr<Plan> plan_;
  bool staged_ = false;
  std::unique_ptr<ApplierBase> applier_;
  std::optional<Schedule> schedule_;
  std::vector<std::uint64_t> versions_;
  std::uint64_t applies_ = 0;
};

}  // namespace

void bind_learner(py::module_& m) {
  py::class_<LearnerOptions>(m, "LearnerOptions", "Settings of a LearnerCore (see ddiloco.Learner)")
      .def(py::init<>())
      .def_readwrite("endpoint", &LearnerOptions::endpoint)
      .def_readwrite("id", &LearnerOptions::id)
      .def_readwrite("fragments", &LearnerOptions::fragments)
      .def_readwrite("sync_every", &LearnerOptions::sync_every)
      .def_readwrite("overlap", &LearnerOptions::overlap)
      .def_readwrite("alpha", &LearnerOptions::alpha)
      .def_readwrite("lock_step", &LearnerOptions::lock_step)
      .def_readwrite("join_timeout_s", &LearnerOptions::join_timeout_s)
      .def_readwrite("join_retry_s", &LearnerOptions::join_retry_s)
      .def_readwrite("lock_step_timeout_s", &LearnerOptions::lock_step_timeout_s)
      .def_readwrite("heartbeat_s", &LearnerOptions::heartbeat_s)
      .def_readwrite("metadata_interval_s", &LearnerOptions::metadata_interval_s)
      .def_readwrite("codec", &LearnerOptions::codec)
      .def_readwrite("error_feedback", &LearnerOptions::error_feedback)
      .def_readwrite("plaintext", &LearnerOptions::plaintext)
      .def_readwrite("keys", &LearnerOptions::keys)
      .def_readwrite("server_key", &LearnerOptions::server_key)
      .def_readwrite("staging", &LearnerOptions::staging)
      .def_readwrite("round", &LearnerOptions::round)
      .def_readwrite("apply_every", &LearnerOptions::apply_every)
      .def_readwrite("announce_applies", &LearnerOptions::announce_applies);

  py::class_<StepResult>(m, "StepReport", "What one Learner.step() did")
      .def(py::init([](std::optional<std::size_t> sent, std::vector<std::size_t> applied,
                       std::vector<std::uint64_t> versions, bool waited) {
             if (versions.size() != applied.size())
               throw ShapeMismatch(detail::msg("ddiloco.StepReport: ", applied.size(), " applied fragments and ",
                                               versions.size(), " versions; give one version per applied fragment"));
             return StepResult{sent, std::move(applied), std::move(versions), waited, {}, {}};
           }),
           py::kw_only(), py::arg("sent") = py::none(), py::arg("applied") = std::vector<std::size_t>{},
           py::arg("versions") = std::vector<std::uint64_t>{}, py::arg("waited") = false)
      .def_readonly("sent", &StepResult::sent, "fragment sent at this step, or None")
      .def_readonly("applied", &StepResult::applied, "fragments whose global was applied at this step (ascending)")
      .def_readonly("versions", &StepResult::versions, "the version of each global in applied (same order)")
      .def_readonly("waited", &StepResult::waited, "lock-step: the step waited for a global")
      .def_readonly("announced", &StepResult::announced,
                    "announce_applies: fragments whose global this step announced (applied at the next step that "
                    "may apply), ascending")
      .def_readonly("announced_versions", &StepResult::announced_versions,
                    "the version of each global in announced (same order)")
      .def("__repr__", [](const StepResult& r) {
        std::string a;
        for (std::size_t p : r.applied) a += (a.empty() ? "" : ", ") + std::to_string(p);
        return detail::msg("StepReport(sent=", r.sent ? std::to_string(*r.sent) : "None", ", applied=[", a,
                           "], waited=", r.waited ? "True" : "False", ")");
      });

  py::class_<LearnerCore>(m, "LearnerCore", "An OuterLoop over ZeroMQ on torch parameters (see ddiloco.Learner)")
      .def(py::init<const LearnerOptions&, const std::vector<std::string>&, const py::list&, const std::vector<bool>&,
                    py::object, py::object, py::object>(),
           py::arg("options"), py::arg("names"), py::arg("tensors"), py::arg("embedding"), py::arg("float32"),
           py::arg("copy_out"), py::arg("copy_in"))
      .def("join", &LearnerCore::join)
      .def("step", &LearnerCore::step_py, py::arg("tokens"))
      .def("leave", &LearnerCore::leave)
      .def("close", &LearnerCore::close)
      .def_property_readonly("joined", &LearnerCore::joined)
      .def_property_readonly("staged", &LearnerCore::staged)
      .def("status", &LearnerCore::status)
      .def("plan", &LearnerCore::plan)
      .def("due_at", &LearnerCore::due_at, py::arg("step"))
      .def("copy_applied", &LearnerCore::copy_applied, py::arg("fragment"), py::arg("out"))
      .def("copy_announced", &LearnerCore::copy_announced, py::arg("fragment"), py::arg("out"));

  py::class_<FollowerCore>(m, "FollowerCore",
                           "A rank of a group learner other than its leader (see ddiloco.GroupLearner)")
      .def(py::init<const LearnerOptions&, const std::vector<std::string>&, const py::list&, const std::vector<bool>&,
                    py::object, py::object, py::object>(),
           py::arg("options"), py::arg("names"), py::arg("tensors"), py::arg("embedding"), py::arg("float32"),
           py::arg("copy_out"), py::arg("copy_in"))
      .def("apply", &FollowerCore::apply, py::arg("fragment"), py::arg("version"), py::arg("values"))
      .def("check_all", &FollowerCore::check_all)
      .def("set_versions", &FollowerCore::set_versions, py::arg("versions"))
      .def("due_at", &FollowerCore::due_at, py::arg("step"))
      .def_property_readonly("staged", &FollowerCore::staged)
      .def("status", &FollowerCore::status)
      .def("plan", &FollowerCore::plan);
}

}  // namespace ddiloco::python
