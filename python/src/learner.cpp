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
#include <vector>

#include <ddiloco/codec.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/outer_loop.hpp>
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
  std::string codec = "fp32";
  bool error_feedback = false;
  bool plaintext = false;
  std::string keys;        ///< this learner's key file (CURVE)
  std::string server_key;  ///< the syncer's public key file (CURVE)
  std::string staging = "auto";  ///< auto: host form when every parameter is on the CPU; always: staged form
};

struct StepResult {
  std::optional<std::size_t> sent;  ///< fragment sent at this step
  std::vector<std::size_t> applied;  ///< fragments whose global was applied at this step, ascending
  bool waited = false;               ///< lock-step: the step waited for a global
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

/// The OuterLoop behind a LearnerCore, for one tensor form.
class LoopBase {
 public:
  virtual ~LoopBase() = default;
  virtual void join() = 0;                       // GIL released by the caller
  virtual StepReport step(std::int64_t tokens) = 0;
  virtual void leave() = 0;
  virtual void set_data(std::size_t t, std::uintptr_t data) = 0;  // a host tensor's storage moved
  [[nodiscard]] virtual bool joined() const = 0;
  [[nodiscard]] virtual const OuterLoopStatus& status() const = 0;
  [[nodiscard]] virtual std::uint64_t base_version(std::size_t p) const = 0;
};

template <class T>
class Loop final : public LoopBase {
 public:
  Loop(const Plan& plan, ZmqLearnerTransport& link, const OuterLoopConfig& config, std::vector<T> params)
      : params_(std::move(params)), outer_(plan, link, config) {}
  void join() override { outer_.join(params_); }
  StepReport step(std::int64_t tokens) override { return outer_.step(params_, tokens); }
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
  OuterLoop<ZmqLearnerTransport, T> outer_;
};

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
    zc.security = security_of("ddiloco.Learner", o.plaintext, o.keys, o.server_key, "server_key='syncer.pub'");
    if (zc.security.curve) {
      zc.security.own = read_key_file(o.keys);
      zc.security.server_public_key = read_key_file(o.server_key).public_key;
    }
    if (o.endpoint.rfind("tcp://", 0) != 0 && o.endpoint.rfind("ipc://", 0) != 0 &&
        o.endpoint.rfind("inproc://", 0) != 0)
      throw InvalidArgument("ddiloco.Learner: endpoint = '" + o.endpoint +
                            "' is not a ZeroMQ endpoint; give the syncer's address as 'tcp://HOST:PORT' "
                            "(ddiloco.Syncer(...).endpoint in the same process)");
    OuterLoopConfig lc;
    lc.id = o.id;
    lc.sync_every = o.sync_every;
    lc.overlap = o.overlap;
    lc.alpha = o.alpha;
    lc.lock_step = o.lock_step;
    lc.join_timeout = seconds(o.join_timeout_s, "join_timeout");
    lc.join_retry = seconds(o.join_retry_s, "join_retry");
    lc.lock_step_timeout = seconds(o.lock_step_timeout_s, "lock_step_timeout");
    lc.heartbeat_interval = seconds(o.heartbeat_s, "heartbeat");
    try {
      link_ = std::make_unique<ZmqLearnerTransport>(zc, clock_);
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
    sent_at_.assign(plan_->num_fragments(), kNone);
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
    std::fill(sent_at_.begin(), sent_at_.end(), kNone);
    pending_.clear();
  }

  /// step() as Python sees it: a step that sent, applied and waited for nothing
  /// returns one shared, immutable report (no allocation on the common path).
  py::object step_py(std::int64_t tokens) {
    StepResult r = step(tokens);
    if (!r.sent && r.applied.empty() && !r.waited) {
      if (!nothing_) nothing_ = py::cast(StepResult{});
      return nothing_;
    }
    return py::cast(std::move(r));
  }

  StepResult step(std::int64_t tokens) {
    check(loop_ != nullptr, "step");
    const std::uint64_t t = loop_->status().step + 1;
    // The tensors this step may touch: the fragment due now, and every fragment
    // sent and awaiting its result once its apply step has come.
    if (loop_->joined()) {
      if (auto due = schedule_->due_at(t)) check_fragment(*due);
      for (std::size_t p : pending_)
        if (t >= sent_at_[p] + options_.overlap) check_fragment(p);
    }
    before_.clear();
    for (std::size_t p : pending_) before_.push_back(loop_->base_version(p));
    StepReport r;
    if (options_.lock_step) {
      py::gil_scoped_release release;
      r = loop_->step(tokens);
    } else {
      r = loop_->step(tokens);
    }
    StepResult out;
    out.waited = r.waited;
    if (r.applied > 0) {
      for (std::size_t i = 0, j = 0; i < pending_.size(); ++j) {
        const std::size_t p = pending_[i];
        if (loop_->base_version(p) != before_[j]) {
          out.applied.push_back(p);
          sent_at_[p] = kNone;
          pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;
        }
      }
      std::sort(out.applied.begin(), out.applied.end());
    }
    if (r.sent) {
      out.sent = *r.sent;
      if (sent_at_[*r.sent] == kNone) pending_.push_back(*r.sent);
      sent_at_[*r.sent] = t;
    }
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
    d["bytes_sent"] = s.bytes_sent;
    std::vector<std::uint64_t> versions;
    for (std::size_t p = 0; p < plan_->num_fragments(); ++p) versions.push_back(loop_->base_version(p));
    d["base_versions"] = versions;
    const auto& z = link_->counters();
    d["frames_in"] = z.frames_in;
    d["frames_out"] = z.frames_out;
    d["bytes_in"] = z.bytes_in;
    d["bytes_out"] = z.bytes_out;
    d["send_dropped"] = z.send_dropped;
    d["decode_errors"] = z.decode_errors;
    d["joined"] = loop_->joined();
    return d;
  }

  [[nodiscard]] py::dict plan() const {
    py::dict d;
    d["fingerprint"] = plan_->fingerprint();
    std::vector<std::vector<std::string>> frags;
    for (const auto& f : plan_->fragments()) {
      auto& names = frags.emplace_back();
      for (std::size_t t : f.tensors) names.push_back(plan_->tensors()[t].name);
    }
    d["fragments"] = frags;
    std::vector<std::string> emb;
    for (const auto& t : plan_->tensors())
      if (t.embedding) emb.push_back(t.name);
    d["embedding"] = emb;
    d["numel"] = plan_->total_numel();
    return d;
  }

  /// The fragment due to be sent at inner step `step` (1-based), or None.
  [[nodiscard]] std::optional<std::size_t> due_at(std::uint64_t step) const { return schedule_->due_at(step); }

 private:
  static constexpr std::uint64_t kNone = ~std::uint64_t{0};

  void check(bool open, const char* what) const {
    if (!open) throw StateError(detail::msg("ddiloco.Learner.", what, "(): the learner is closed; create a new one"));
  }

  void check_fragment(std::size_t p) {
    for (std::size_t t : plan_->fragments()[p].tensors) check_fast(t);
  }

  /// The per-step check of one tensor: unchanged storage, size, dtype and
  /// contiguity cost four attribute reads; anything else goes to check_full.
  void check_fast(std::size_t i) {
    Param& p = params_[i];
    const py::handle t = p.tensor;
    const auto data = t.attr("data_ptr")().cast<std::uintptr_t>();
    if (data == p.data && py::object(t.attr("dtype")).is(float32_) && t.attr("numel")().cast<std::size_t>() == p.numel &&
        t.attr("is_contiguous")().cast<bool>())
      return;
    check_full(i, false);
  }

  /// Every contract of parameter i, with a message naming it and the fix.
  void check_full(std::size_t i, bool first) {
    Param& p = params_[i];
    const py::handle t = p.tensor;
    const std::string who = detail::msg("ddiloco.Learner: parameter '", p.name, "'");
    if (!py::hasattr(t, "data_ptr") || !py::hasattr(t, "dtype"))
      throw InvalidArgument(detail::msg(who, " is a ", py::str(py::type::of(t).attr("__name__")).cast<std::string>(),
                                        ", not a torch tensor; pass model.named_parameters() or (name, tensor) pairs"));
    const std::string shape = dims(t.attr("shape"));
    if (py::hasattr(t, "is_sparse") && t.attr("is_sparse").cast<bool>())
      throw InvalidArgument(detail::msg(who, " (shape ", shape, ") is sparse; ddiloco needs dense parameters: "
                                             "call .to_dense() on it before creating the Learner"));
    if (!py::object(t.attr("dtype")).is(float32_))
      throw InvalidArgument(detail::msg(who, " (shape ", shape, ") has dtype ", py::str(t.attr("dtype")).cast<std::string>(),
                                        "; ddiloco works on float32 parameters: convert the model with model.float() "
                                        "(keep bfloat16 for the forward pass with torch.autocast) before creating "
                                        "the Learner"));
    if (!t.attr("is_contiguous")().cast<bool>())
      throw InvalidArgument(detail::msg(
          who, " (shape ", shape, ", strides ", dims(t.attr("stride")()),
          ") is not contiguous (a transposed or sliced view?); ddiloco writes merged values back in place, so a "
          ".contiguous() copy would lose them: make the parameter itself contiguous "
          "(with torch.no_grad(): p.data = p.data.contiguous()) before creating the Learner"));
    const auto numel = t.attr("numel")().cast<std::size_t>();
    const auto device = py::str(t.attr("device").attr("type")).cast<std::string>();
    const auto data = t.attr("data_ptr")().cast<std::uintptr_t>();
    if (first) {
      if (numel == 0)
        throw InvalidArgument(detail::msg(who, " has no elements; leave empty parameters out "
                                               "(ddiloco.Learner(((n, p) for n, p in model.named_parameters() if p.numel())))"));
      p.numel = numel;
      p.device = device;
      p.data = data;
      return;
    }
    if (numel != p.numel)
      throw ShapeMismatch(detail::msg(who, " has ", numel, " elements (shape ", shape, ") but had ", p.numel,
                                      " when the Learner was created: the plan is fixed; resize parameters before "
                                      "creating the Learner (and the Syncer), never after"));
    if (device != p.device)
      throw InvalidArgument(detail::msg(who, " is on device ", device, " but was on ", p.device,
                                        " when the Learner was created; move the model (model.to(device)) before "
                                        "creating the Learner"));
    if (data != p.data) {
      // Same size, dtype and device, new storage (p.data = ...): follow it.
      p.data = data;
      if (!staged_) loop_->set_data(i, data);
    }
  }

  LearnerOptions options_;
  py::object float32_;
  Staging staging_;
  std::vector<Param> params_;
  std::unique_ptr<Plan> plan_;
  bool staged_ = false;
  SteadyClock clock_;
  std::unique_ptr<ZmqLearnerTransport> link_;
  std::unique_ptr<LoopBase> loop_;
  std::optional<Schedule> schedule_;
  std::vector<std::uint64_t> sent_at_;  ///< per fragment: step of the send awaiting its result, kNone if none
  std::vector<std::size_t> pending_;    ///< fragments sent and awaiting their result
  std::vector<std::uint64_t> before_;   ///< scratch: base versions of pending_ before a step
  py::object nothing_;                  ///< the shared report of a step that did nothing
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
      .def_readwrite("codec", &LearnerOptions::codec)
      .def_readwrite("error_feedback", &LearnerOptions::error_feedback)
      .def_readwrite("plaintext", &LearnerOptions::plaintext)
      .def_readwrite("keys", &LearnerOptions::keys)
      .def_readwrite("server_key", &LearnerOptions::server_key)
      .def_readwrite("staging", &LearnerOptions::staging);

  py::class_<StepResult>(m, "StepReport", "What one Learner.step() did")
      .def_readonly("sent", &StepResult::sent, "fragment sent at this step, or None")
      .def_readonly("applied", &StepResult::applied, "fragments whose global was applied at this step (ascending)")
      .def_readonly("waited", &StepResult::waited, "lock-step: the step waited for a global")
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
      .def("due_at", &LearnerCore::due_at, py::arg("step"));
}

}  // namespace ddiloco::python
