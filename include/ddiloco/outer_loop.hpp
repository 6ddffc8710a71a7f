// ddiloco/outer_loop.hpp: the learner side of Decoupled DiLoCo.
//
// What it is: `OuterLoop<Transport, Tensor>`, the piece a user drops into an
// existing training loop, over their own tensor type:
//
//     ddiloco::OuterLoop<Transport, Eigen::MatrixXf> outer(plan, transport, config);
//     outer.join(params);                   // fetch the global state, become a learner
//     for (;;) {
//       inner_step(params);                 // the user's own optimizer step
//       outer.step(params, tokens_this_step);
//     }
//
// What it is not: an optimizer (the inner step is the user's) or a transport.
// Also here: `FragmentApplier<Tensor>`, the arithmetic of step 3 below on its own.
// OuterLoop applies through it, and StepReport::applied_fragments says which
// globals a step applied (with their values, shared), so that the other ranks
// of a learner that is a group of processes with replicated parameters apply
// the same globals at the same inner step and stay bit-identical
// (docs/python.md, "Learners that are groups").
//
// Per fragment p the learner keeps a base (the values its next outer gradient
// is measured from), the version of the last global it applied, the newest
// global received, and counters since the last send or receipt
// (docs/algorithm.md, "Round timeline"). At each inner step t:
//   1. drain the transport without blocking, keeping the newest global per fragment;
//   2. if p is due at t (Schedule): send v = base_p - theta_p with the counters,
//      then base_p <- theta_p and counters reset: each unit of local progress
//      is sent exactly once, even when a global is lost or late
//      (docs/algorithm.md, "Decisions");
//   3. for each fragment sent at step s with t >= s + tau whose newer global has
//      arrived: theta_p <- alpha * theta_p + (1 - alpha) * Theta_p, base_p <- Theta_p,
//      counters reset (docs/algorithm.md, "Round timeline", step 7). If it has
//      not arrived, it is applied on arrival (non-blocking), or, in lock-step mode, step() waits for it
//      (Streaming DiLoCo) for at most `lock_step_timeout`.
// In pull rounds (OuterLoopConfig::round = pull, the paper's round) step 2
// changes: after every step the learner sends metadata (its step counter and
// tokens), and it sends fragment p when the syncer has pulled it, at the next
// step boundary (never blocking): v = Theta_p^(b) - theta_p with the counters
// since it applied global b (base and counters reset only when a global is
// applied: the paper's c_steps / c_tokens). Step 3 applies a global tau steps
// after the answer, or at the next step if this learner was not pulled.
// Host copies are made only of the fragment being sent or applied.
// A syncer that does not know this learner (it restored a checkpoint older
// than the learner's join) answers with MessageType::rejoin: the learner then
// joins again with a fresh nonce, without blocking and without touching its
// parameters, bases or counters; it sends nothing until the reply (the new
// sequence base) is in, so no progress is sent into a rejection, and the
// reply's fragments count as received globals.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/fast/kernels.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/histogram.hpp>
#include <ddiloco/message.hpp>
#include <ddiloco/schedule.hpp>
#include <ddiloco/shard_map.hpp>
#include <ddiloco/tensor.hpp>
#include <ddiloco/wire.hpp>

namespace ddiloco {

struct OuterLoopConfig {
  LearnerId id = 0;             ///< this learner's id (unique among learners)
  std::size_t sync_every = 24;  ///< H: inner steps between two sends of a fragment
  std::size_t overlap = 2;      ///< tau: steps between a send and the application of its result
  float alpha = 0.0f;           ///< mixing on receipt: 0 overwrites (Decoupled DiLoCo default)
  bool lock_step = false;       ///< wait at send + tau for the result (Streaming DiLoCo, for comparison)
  /// Give up joining after this long. 0 (default): derived from the size of
  /// the global state and `join_link_mbit` (derived_join_timeout(): 30 s plus
  /// twice the state's time on that link); a value > 0 wins.
  Duration join_timeout = Duration{0};
  /// The learner's link to the syncer as declared, in Mbit/s (10^6 bit/s), for
  /// the derived join_timeout: a 1 GiB model at 100 Mbit/s needs 86 s on the
  /// wire, so it is given 30 + 2 x 86 = 202 s.
  double join_link_mbit = 100.0;
  /// Resend the join request when nothing of the state has arrived for this
  /// long (a lost request or reply must not leave a learner outside the run;
  /// a state still arriving is not re-requested).
  Duration join_retry = std::chrono::seconds(1);
  Duration lock_step_timeout = std::chrono::seconds(60);
  Duration heartbeat_interval = std::chrono::seconds(1);
  /// The most tokens one inner step processes (the batch in tokens), declared
  /// to the syncer at join: it rejects a contribution claiming more than steps x
  /// this (docs/algorithm.md, "Validation and staleness"), and step() refuses
  /// more. 0: not declared (the syncer's --max-tokens-per-step bounds it, if set).
  std::uint64_t tokens_per_step = 0;
  /// Who decides when a fragment is sent (RoundMode; the syncer's --round must
  /// match, a join is refused otherwise). pull (the default, the paper's
  /// round, as in ddiloco_learner and Python): it sends metadata (its step
  /// counter and tokens) after every step, and fragment p when the syncer
  /// pulls it, at the next step boundary; the global is applied tau steps
  /// after the answer (or on arrival, if later; at once if this learner was not
  /// pulled). push (the earlier protocol, kept for comparison): this learner
  /// sends fragment p at its slots of the schedule.
  RoundMode round = RoundMode::pull;
  /// Pull rounds: globals are applied only at steps that are multiples of
  /// this (1: at any step); one whose time has come waits for the next such
  /// step, at most apply_every - 1 steps. What a group learner needs: its ranks
  /// must apply each global at the same step, and they communicate only at
  /// those steps (ddiloco.GroupLearner). Push rounds: must be 1 (their apply
  /// steps follow the schedule).
  std::size_t apply_every = 1;
  /// Pull rounds: each apply is announced one apply step ahead (what the
  /// leader of a group learner needs so that its other ranks never wait for
  /// it, ddiloco.GroupLearner). At a step that may apply, the globals whose
  /// time has come are not applied but announced (StepReport::announced), and
  /// applied, exactly those values, at the next step that may apply
  /// (apply_every steps later) together with nothing else; a pull of an
  /// announced fragment is answered after its apply. Push rounds: must be false.
  bool announce_applies = false;
};

/// One global fragment a step applied: which, its version, and the values
/// applied (the received payload itself, shared: no copy). A group learner's
/// leader hands these to its other ranks, which apply them with
/// FragmentApplier at the same inner step.
struct AppliedFragment {
  std::size_t fragment = 0;
  std::uint64_t version = 0;
  Payload values;  ///< Theta_p in fragment order (Plan::offset_in_fragment), Plan fragment p's numel floats
};

struct StepReport {
  std::optional<std::size_t> sent;  ///< fragment sent at this step
  std::size_t applied = 0;          ///< global fragments applied at this step (= applied_fragments.size())
  /// Which: in the order applied (no allocation when none is).
  std::vector<AppliedFragment> applied_fragments;
  /// OuterLoopConfig::announce_applies: the globals this step announced, to be
  /// applied (these values) at the next step that may apply.
  std::vector<AppliedFragment> announced;
  bool waited = false;              ///< lock-step: this step waited for a global
};

/// Bucket bounds of OuterLoopStatus::staleness_versions and apply_delay_steps.
inline std::vector<double> staleness_bounds() { return {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128}; }

struct OuterLoopStatus {
  std::uint64_t step = 0;
  std::uint64_t tokens = 0;
  std::uint64_t sends = 0;
  std::uint64_t send_failures = 0;      ///< transport refused (progress kept for the next send)
  std::uint64_t applies = 0;
  std::uint64_t late_applies = 0;       ///< applied after send + tau (arrived late)
  std::uint64_t received = 0;
  std::uint64_t ignored = 0;            ///< foreign plan, bad index/size, old version
  std::uint64_t heartbeats = 0;
  std::uint64_t lock_step_waits = 0;
  std::uint64_t lock_step_timeouts = 0;
  std::uint64_t rejoins = 0;            ///< joins again asked for by the syncer (MessageType::rejoin)
  std::uint64_t pulls = 0;              ///< pull requests received (pull rounds)
  /// Pull rounds: second asks answered again (the first answer may have been lost).
  std::uint64_t pulls_repeated = 0;
  /// Pull rounds: steps at which a pull's answer waited for a global on its
  /// way (its base was older than the syncer can anchor at), summed over pulls.
  std::uint64_t pulls_deferred_steps = 0;
  std::uint64_t metadata_sent = 0;      ///< metadata messages sent (pull rounds: one per step)
  std::uint64_t bytes_sent = 0;
  /// Per apply after a send: versions the fragment's global moved between the
  /// base the sent outer gradient was computed from and the global applied
  /// (1 = only the merge holding this learner's contribution; more = merges of
  /// others' contributions this learner's base had not seen).
  Histogram staleness_versions{staleness_bounds()};
  /// Per apply after a send: inner steps from the send to the apply (tau when
  /// the global arrived in time; more when it arrived late).
  Histogram apply_delay_steps{staleness_bounds()};
};

/// Bytes of `plan`'s full state on the wire: one fp32 full_state frame per
/// fragment (what a join receives).
inline std::uint64_t full_state_bytes(const Plan& plan) noexcept {
  std::uint64_t bytes = 0;
  for (const auto& f : plan.fragments()) bytes += kFrameHeaderSize + 4 * static_cast<std::uint64_t>(f.numel);
  return bytes;
}

/// The join time-out OuterLoopConfig::join_timeout = 0 stands for: 30 s (the
/// round trips, the syncer's rate limits, a retry or two) plus twice the time
/// `state_bytes` take at `link_mbit` Mbit/s (the margin for a link shared with
/// other traffic and TCP's ramp-up).
inline Duration derived_join_timeout(std::uint64_t state_bytes, double link_mbit) {
  if (!(link_mbit > 0.0) || !(link_mbit < 1e9))
    throw InvalidArgument(detail::msg("derived_join_timeout: link_mbit = ", link_mbit,
                                      " Mbit/s must be > 0 and finite; declare the learner's link to the syncer "
                                      "(OuterLoopConfig::join_link_mbit, the learner's --join-link-mbit; 100 by "
                                      "default)"));
  const double wire_s = static_cast<double>(state_bytes) * 8.0 / (link_mbit * 1e6);
  return std::chrono::seconds(30) + std::chrono::duration_cast<Duration>(std::chrono::duration<double>(2.0 * wire_s));
}

namespace detail {
/// A join nonce: differs between incarnations (a restart happens at another
/// time), equal for retries of one join. SplitMix64 finaliser over the inputs.
inline std::uint64_t join_nonce(LearnerId id, std::uint64_t step, TimePoint now) noexcept {
  std::uint64_t x = (static_cast<std::uint64_t>(id) << 40) ^ step ^ static_cast<std::uint64_t>(now.count());
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return (x ^ (x >> 31)) | 1;  // never 0 (0 means "no nonce yet" in the syncer)
}
}  // namespace detail

/// Writes a global fragment into the local parameters, the arithmetic of an
/// apply (docs/algorithm.md, "Round timeline", step 7):
///     theta_p <- alpha * theta_p + (1 - alpha) * Theta_p
/// (alpha = 0 overwrites). OuterLoop applies every global through one, so a
/// copy of the parameters kept elsewhere (the other ranks of a group learner,
/// docs/python.md) that applies the same Theta_p with its own FragmentApplier
/// at the same inner step stays bit-identical to the learner's: the same code
/// on the same float32 inputs. Holds the plan (by reference: it must outlive
/// the applier) and a scratch buffer of one tensor, used only when mixing.
template <class T>
  requires Tensor<T>
class FragmentApplier {
 public:
  FragmentApplier(const Plan& plan, float alpha) : plan_(&plan), alpha_(alpha) {
    if (!(alpha >= 0.0f && alpha < 1.0f))
      throw InvalidArgument(detail::msg("FragmentApplier: alpha = ", alpha,
                                        " must be in [0, 1): 0 overwrites the local fragment (default), 0.5 mixes; "
                                        "use the learner's OuterLoopConfig::alpha"));
  }

  /// Applies `global` (fragment p's Theta_p, in fragment order) to `params`
  /// (every tensor of the plan, in plan order; only fragment p's are touched).
  /// Checks p, the global's size and the sizes of fragment p's tensors first,
  /// and throws before writing anything.
  void apply(std::span<T> params, std::size_t p, std::span<const float> global) {
    const auto& frags = plan_->fragments();
    if (p >= frags.size())
      throw InvalidArgument(detail::msg("FragmentApplier::apply: fragment ", p, " does not exist: the plan has ",
                                        frags.size(), " fragments (0 to ", frags.size() - 1,
                                        "); pass an index from StepReport::applied_fragments"));
    if (global.size() != frags[p].numel)
      throw ShapeMismatch(detail::msg("FragmentApplier::apply: the global of fragment ", p, " has ", global.size(),
                                      " values but the fragment has ", frags[p].numel,
                                      "; pass AppliedFragment::values of the same plan"));
    const auto& specs = plan_->tensors();
    if (params.size() != specs.size())
      throw ShapeMismatch(detail::msg("FragmentApplier::apply: got ", params.size(),
                                      " parameter tensors but the plan has ", specs.size(),
                                      "; pass the model's tensors in plan order"));
    for (std::size_t t : frags[p].tensors) {
      const auto n = tensor_size(params[t]);
      if (n != specs[t].numel)
        throw ShapeMismatch(detail::msg("FragmentApplier::apply: tensor ", t, " ('", specs[t].name, "') has ", n,
                                        " elements but the plan says ", specs[t].numel));
    }
    apply_unchecked(params, p, global, /*mix=*/true);
  }

  /// The same without the checks (OuterLoop has made them). `mix` = false
  /// overwrites whatever alpha is (a join writes the global state whole).
  void apply_unchecked(std::span<T> params, std::size_t p, std::span<const float> global, bool mix) {
    const auto& specs = plan_->tensors();
    for (std::size_t t : plan_->fragments()[p].tensors) {
      const std::size_t off = plan_->offset_in_fragment(t);
      const std::size_t n = specs[t].numel;
      const std::span<const float> g(global.data() + off, n);
      if (!mix || alpha_ == 0.0f) {
        write_tensor(params[t], g);
      } else {
        scratch_.resize(n);
        read_tensor(params[t], std::span<float>(scratch_));
        const float a = alpha_;
        for (std::size_t i = 0; i < n; ++i) scratch_[i] = a * scratch_[i] + (1.0f - a) * g[i];
        write_tensor(params[t], std::span<const float>(scratch_));
      }
    }
  }

  [[nodiscard]] float alpha() const noexcept { return alpha_; }
  [[nodiscard]] const Plan& plan() const noexcept { return *plan_; }

 private:
  const Plan* plan_;
  float alpha_;
  std::vector<float> scratch_;
};

template <class Transport, class T>
  requires LearnerTransport<Transport> && Tensor<T>
class OuterLoop {
 public:
  OuterLoop(const Plan& plan, Transport& transport, OuterLoopConfig config = {})
      : plan_(&plan),
        transport_(&transport),
        config_(validated(config, plan)),
        schedule_(plan.num_fragments(), config_.sync_every, config_.overlap),
        frags_(plan.num_fragments()),
        applier_(plan, config_.alpha),
        join_timeout_(config_.join_timeout > Duration{0}
                          ? config_.join_timeout
                          : derived_join_timeout(full_state_bytes(plan), config_.join_link_mbit)) {
    for (std::size_t p = 0; p < frags_.size(); ++p) frags_[p].base.resize(plan.fragments()[p].numel);
  }

  /// Joins the run: asks the syncer for the global state, waits for it (at
  /// most join_timeout()), and writes it into `params`. `names`, if given, are
  /// checked against the plan's tensor names.
  void join(std::span<T> params, std::span<const std::string> names = {}) {
    begin_join(params, names);
    const TimePoint deadline = transport_->clock().now() + join_timeout_;
    while (!poll_join(params)) {
      check_transport();
      auto m = transport_->receive_until(std::min(deadline, next_join_retry()));
      if constexpr (DiagnosingTransport<Transport>) {
        // A link that cannot work (refused key, mismatched security) is said at
        // once: waiting out the time-out would not change it.
        if (auto why = transport_->link_failure())
          throw TransportError(detail::msg("OuterLoop::join: learner ", config_.id, " cannot join: ", *why));
      }
      if (m) {
        on_message(std::move(*m));
      } else if (transport_->clock().now() >= deadline) {
        std::string seen = "is the syncer running and reachable?";
        if constexpr (DiagnosingTransport<Transport>) seen = transport_->link_summary();
        throw TransportError(detail::msg("OuterLoop::join: learner ", config_.id, " received ", join_received_,
                                         " of ", frags_.size(), " fragments of the global state within ",
                                         std::chrono::duration<double>(join_timeout_).count(), " s; ",
                                         join_timeout_text(), "; ", seen));
      }
    }
  }

  /// Non-blocking join, for drivers that run several learners in one thread:
  /// begin_join() sends the request, poll_join() returns true once the state
  /// has arrived and has been written into `params`.
  void begin_join(std::span<T> params, std::span<const std::string> names = {}) {
    check_params(params, names);
    check_transport();
    joined_ = false;
    rejoining_ = false;
    // One nonce per incarnation: retried or duplicated joins are idempotent.
    join_nonce_ = detail::join_nonce(config_.id, step_, transport_->clock().now());
    join_received_ = 0;
    join_bytes_ = 0;
    join_gap_ = Duration{0};
    join_fragment_at_ = transport_->clock().now();
    pending_.clear();
    pulls_.clear();
    arrived_.clear();
    for (auto& f : frags_) {
      const std::size_t n = f.base.size();
      f = FragmentState{};
      f.base.assign(n, 0.0f);
    }
    send_join();
  }

  /// True once joined. Resends the request when nothing of the state has
  /// arrived for `join_retry` (a lost request or reply must not leave a
  /// learner outside the run forever; a state still streaming in is not asked
  /// for again). A driver of begin_join/poll_join gives up after
  /// join_timeout() (join() does).
  bool poll_join(std::span<T> params) {
    if (joined_) return true;
    while (auto m = transport_->try_receive()) on_message(std::move(*m));
    if (join_received_ < frags_.size()) {
      if (transport_->clock().now() - join_heard_ >= join_retry_interval()) send_join();
      return false;
    }
    check_params(params, {});
    for (std::size_t p = 0; p < frags_.size(); ++p) apply(p, params, /*mix=*/false);
    joined_ = true;
    return true;
  }

  /// For a driver that prepares the tensors a step touches (the Python
  /// binding checks each one's storage, dtype and size, a few attribute reads
  /// a tensor): takes what the transport has now, as step() does first, and
  /// returns the fragments the next step() may read or write, in increasing
  /// order (push rounds: the fragment due at that step and those awaiting
  /// their global; pull rounds: the pulls to answer and the globals to apply
  /// or announce). That step() does not drain the transport again: what
  /// arrives in between is taken by the step after it. The list is this
  /// loop's, valid until the next call.
  const std::vector<std::size_t>& prepare_step() {
    if (!joined_) throw StateError("OuterLoop::prepare_step() called before join(); call join(params) first");
    check_transport();
    drain();
    prepared_ = true;
    touched_.clear();
    if (config_.round == RoundMode::pull) {
      if (!rejoining_) touched_.insert(touched_.end(), pulls_.begin(), pulls_.end());
      touched_.insert(touched_.end(), arrived_.begin(), arrived_.end());
      for (std::size_t p = 0; p < frags_.size(); ++p)
        if (frags_[p].announced) touched_.push_back(p);
    } else if (auto p = schedule_.due_at(step_ + 1); p && !rejoining_) {
      touched_.push_back(*p);
    }
    touched_.insert(touched_.end(), pending_.begin(), pending_.end());
    std::sort(touched_.begin(), touched_.end());
    touched_.erase(std::unique(touched_.begin(), touched_.end()), touched_.end());
    return touched_;
  }

  /// Call once after every inner step. Never blocks on the network unless
  /// lock-step mode is on. `tokens`: tokens processed by this inner step
  /// (batch x sequence length), > 0.
  StepReport step(std::span<T> params, std::int64_t tokens) {
    if (!joined_) throw StateError("OuterLoop::step() called before join(); call join(params) first");
    if (tokens <= 0)
      throw InvalidArgument(detail::msg("OuterLoop::step: tokens = ", tokens,
                                        " must be > 0 (a contribution's weight is tokens^2 / steps: 0 would give "
                                        "this learner's progress no weight); pass the tokens this inner step "
                                        "processed (batch x sequence length)"));
    if (config_.tokens_per_step != 0 && static_cast<std::uint64_t>(tokens) > config_.tokens_per_step)
      throw InvalidArgument(detail::msg("OuterLoop::step: tokens = ", tokens, " exceeds the ", config_.tokens_per_step,
                                        " tokens per step this learner declared at join "
                                        "(OuterLoopConfig::tokens_per_step); the syncer would reject the "
                                        "contribution: declare the largest batch in tokens"));
    // Every tensor's size, every step: a tensor resized after join() must fail
    // here, naming it, not at its fragment's next send or (half-way) apply.
    // One size query per tensor, no copy.
    check_params(params, {});
    check_transport();
    ++step_;
    tokens_total_ += static_cast<std::uint64_t>(tokens);
    status_.step = step_;
    status_.tokens = tokens_total_;
    StepReport report;
    if (prepared_) {
      prepared_ = false;  // prepare_step() drained the transport
    } else {
      drain();
    }
    maybe_resend_rejoin();
    // Send before applying: with tau = 0 the fragment sent at this step is
    // also the one applied at this step (synchronous DiLoCo / data-parallel);
    // applying first would discard this step's progress and leave nothing to
    // send, so a lock-step learner synced only every other step. With tau >= 1
    // a fragment is never due for both in one step, so the order is moot.
    if (config_.round == RoundMode::pull) {
      // Answer the syncer's pulls; one with no progress yet (or refused by the
      // transport) is answered at the next step that has some. An answer on a
      // base older than the syncer can anchor at would be refused as stale:
      // the newer global is on its way (this learner outran the merge round
      // trip), so the answer waits until it is applied, at most H steps (a
      // global lost on the way: the stale answer makes the syncer send it again).
      for (std::size_t i = 0; i < pulls_.size() && !rejoining_;) {
        auto& pf = frags_[pulls_[i]];
        // An announced global is applied at the next step that may apply: the
        // answer waits for it (at most apply_every steps), as it would for a
        // global on its way.
        if (pf.announced || (pf.base_version < pf.pull_floor && step_ - pf.pulled_at_step <= config_.sync_every)) {
          ++status_.pulls_deferred_steps;
          ++i;
          continue;
        }
        const bool again = pf.repeat_answer;
        if (send_fragment(pulls_[i], params)) {
          pf.answer = typename FragmentState::Answer{pf.pulled_round ? pf.pulled_round->second : 0, pf.base_version,
                                                     step_, again};
          report.sent = pulls_[i];
          pulls_.erase(pulls_.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;
        }
      }
    } else if (auto p = schedule_.due_at(step_); p && !rejoining_) {  // rejoining: progress kept for the next send
      if (send_fragment(*p, params)) report.sent = *p;
    }
    report.applied = apply_due(params, report);
    if (config_.round == RoundMode::push && report_training_ && !rejoining_) {
      // Push rounds wait only for learners that have trained since they
      // joined (docs/algorithm.md, "Push rounds (for comparison)"): the first
      // step after a join says so at once, not a heartbeat interval later.
      report_training_ = false;
      if (!report.sent) {
        ++status_.heartbeats;
        send(header(MessageType::heartbeat));
      }
    }
    if (config_.round == RoundMode::pull) {
      Message meta = header(MessageType::metadata);
      meta.tokens = static_cast<std::int64_t>(tokens_total_ & 0x7fffffffffffffffULL);
      send(std::move(meta));
      ++status_.metadata_sent;
    }
    maybe_heartbeat();
    return report;
  }

  /// Drains the transport and applies every global that is due, without
  /// stepping. A single-threaded driver calls this while a lock-step learner
  /// is waiting (see waiting_for_sync()).
  /// Also sends a heartbeat when one is due: a lock-step learner waiting for a
  /// slow round is alive, and must not be declared dead by the syncer (which
  /// would stop sending it the very global it waits for).
  /// The fragments poll() applies are counted, not reported: the leader of a
  /// group learner applies only in step(), whose report its other ranks follow.
  std::size_t poll(std::span<T> params) {
    if (!joined_) return 0;
    check_params(params, {});
    drain();
    maybe_resend_rejoin();
    StepReport ignored;
    const std::size_t applied = apply_due(params, ignored, /*may_block=*/false);
    maybe_heartbeat();
    return applied;
  }

  /// When the next heartbeat is due (a single-threaded driver wakes a waiting
  /// learner then, so that it calls poll()).
  [[nodiscard]] TimePoint next_heartbeat() const noexcept { return last_send_ + config_.heartbeat_interval; }

  /// While joining (begin_join() until poll_join() returns true): when the
  /// request goes out again if nothing more of the state arrives (a
  /// single-threaded driver wakes a joining learner then, so that it calls
  /// poll_join(): a lost request or reply is otherwise never retried).
  [[nodiscard]] TimePoint next_join_retry() const noexcept { return join_heard_ + join_retry_interval(); }

  /// Lock-step mode only: true when the next step() would have to wait for a
  /// global fragment (a driver in virtual time uses this instead of blocking).
  [[nodiscard]] bool waiting_for_sync() const {
    if (!config_.lock_step || !joined_) return false;
    for (std::size_t p : pending_)
      if (step_ >= *frags_[p].sent_at + config_.overlap && !frags_[p].has_newer()) return true;
    return false;
  }

  /// Tells the syncer this learner is going away (best effort).
  void leave() {
    if (!joined_) return;
    send(header(MessageType::leave));
    joined_ = false;
  }

  [[nodiscard]] bool joined() const noexcept { return joined_; }
  /// True between a rejoin request from the syncer and its reply (no sends meanwhile).
  [[nodiscard]] bool rejoining() const noexcept { return rejoining_; }
  [[nodiscard]] const OuterLoopStatus& status() const noexcept { return status_; }
  [[nodiscard]] const Schedule& schedule() const noexcept { return schedule_; }
  [[nodiscard]] const OuterLoopConfig& config() const noexcept { return config_; }
  /// The join time-out in force: OuterLoopConfig::join_timeout, or when that
  /// is 0 the one derived from the plan's full_state_bytes() and join_link_mbit.
  [[nodiscard]] Duration join_timeout() const noexcept { return join_timeout_; }
  /// Fragments of the global state received by the join in progress (or the last), and their payload bytes.
  [[nodiscard]] std::size_t join_fragments_received() const noexcept { return join_received_; }
  [[nodiscard]] std::uint64_t join_bytes_received() const noexcept { return join_bytes_; }
  [[nodiscard]] std::uint64_t base_version(std::size_t p) const { return frags_.at(p).base_version; }

  /// The learner's view of the global model: the newest global this learner
  /// received for fragment p (applied already or due later; the join's state
  /// before any merge), in fragment order (Plan::offset_in_fragment), and its
  /// version. Read-only; empty before join() has received fragment p.
  [[nodiscard]] std::span<const float> global_fragment(std::size_t p) const {
    const auto& g = frags_.at(p).global;
    return g ? std::span<const float>(*g) : std::span<const float>();
  }
  [[nodiscard]] std::uint64_t global_version(std::size_t p) const { return frags_.at(p).global_version; }

  /// Writes that global model into `out` (tensors in plan order, sized as the
  /// plan says), e.g. to evaluate it next to the local parameters. Throws
  /// StateError before join().
  void read_global(std::span<T> out) const {
    if (!joined_) throw StateError("OuterLoop::read_global() called before join(); call join(params) first");
    check_params(out, {});
    const auto& specs = plan_->tensors();
    for (std::size_t p = 0; p < frags_.size(); ++p) {
      const std::vector<float>& theta = *frags_[p].global;
      for (std::size_t t : plan_->fragments()[p].tensors)
        write_tensor(out[t], std::span<const float>(theta.data() + plan_->offset_in_fragment(t), specs[t].numel));
    }
  }

 private:
  struct FragmentState {
    std::vector<float> base;
    std::uint64_t base_version = 0;
    Payload latest;  ///< newest global received and not yet applied
    std::uint64_t latest_version = 0;
    std::optional<std::uint64_t> sent_at;  ///< step of the last send awaiting its result
    std::uint64_t steps_at_reset = 0;
    std::uint64_t tokens_at_reset = 0;
    bool received = false;
    Payload global;  ///< newest global received (global_fragment()), shared with `latest`: no copy
    std::uint64_t global_version = 0;
    /// Pull rounds: (slot, version) of the newest pull taken.
    std::optional<std::pair<std::uint64_t, std::uint64_t>> pulled_round;
    /// Pull rounds: the oldest base the syncer can anchor an answer at (the
    /// pull's `tokens`; 0: not stated), and this learner's step when the pull came.
    std::uint64_t pull_floor = 0;
    std::uint64_t pulled_at_step = 0;
    /// Pull rounds: the last answer sent.
    struct Answer {
      std::uint64_t pull_version = 0;  ///< the version the pull it answered named
      std::uint64_t base_version = 0;  ///< this learner's base then
      std::uint64_t step = 0;          ///< its step then
      bool repeated = false;           ///< it answered a second ask (answered at most once)
    };
    std::optional<Answer> answer;
    bool repeat_answer = false;  ///< the next answer is a second one (Message::repeat)
    /// OuterLoopConfig::announce_applies: the global announced, applied at
    /// the next step that may apply.
    Payload announced;
    std::uint64_t announced_version = 0;

    [[nodiscard]] bool has_newer() const noexcept { return latest && latest_version > base_version; }
  };

  static OuterLoopConfig validated(OuterLoopConfig c, const Plan& plan) {
    if (!(c.alpha >= 0.0f && c.alpha < 1.0f))
      throw InvalidArgument(detail::msg("OuterLoopConfig::alpha = ", c.alpha,
                                        " must be in [0, 1): 0 overwrites the local fragment (default), 0.5 mixes"));
    if (c.join_timeout < Duration{0})
      throw InvalidArgument(detail::msg("OuterLoopConfig::join_timeout = ", c.join_timeout.count(),
                                        " ns must be >= 0 (0: derived from the state's size and join_link_mbit)"));
    if (!(c.join_link_mbit > 0.0) || !(c.join_link_mbit < 1e9))
      throw InvalidArgument(detail::msg("OuterLoopConfig::join_link_mbit = ", c.join_link_mbit,
                                        " must be > 0 and finite: the learner's link to the syncer in Mbit/s "
                                        "(--join-link-mbit; default 100)"));
    if (c.join_retry <= Duration{0} || c.lock_step_timeout <= Duration{0} || c.heartbeat_interval <= Duration{0})
      throw InvalidArgument("OuterLoopConfig: join_retry, lock_step_timeout and heartbeat_interval must be > 0");
    if (plan.num_fragments() == 0) throw InvalidArgument("OuterLoop: the plan has no fragments");
    if (c.apply_every == 0)
      throw InvalidArgument("OuterLoopConfig::apply_every = 0 must be >= 1 (1: apply a global at any step)");
    if (c.announce_applies && c.round != RoundMode::pull)
      throw InvalidArgument("OuterLoopConfig::announce_applies needs pull rounds (push rounds apply at their "
                            "schedule's steps); use round = pull or leave it false");
    if (c.apply_every != 1 && c.round != RoundMode::pull)
      throw InvalidArgument(detail::msg("OuterLoopConfig::apply_every = ", c.apply_every,
                                        " needs pull rounds (push rounds apply at their schedule's steps); "
                                        "use apply_every = 1 or round = pull"));
    if (c.tokens_per_step > (std::uint64_t{1} << 40))
      throw InvalidArgument(detail::msg("OuterLoopConfig::tokens_per_step = ", c.tokens_per_step,
                                        " is above 2^40; declare the batch in tokens of one inner step, or 0"));
    return c;
  }

  void check_transport() const {
    if (transport_->failed())
      throw TransportError(detail::msg("OuterLoop: learner ", config_.id,
                                       "'s transport failed permanently; create a new transport and join again"));
  }

  void check_params(std::span<T> params, std::span<const std::string> names) const {
    const auto& specs = plan_->tensors();
    if (params.size() != specs.size())
      throw ShapeMismatch(detail::msg("OuterLoop: got ", params.size(), " parameter tensors but the plan has ",
                                      specs.size(), "; pass the model's tensors in plan order"));
    if (!names.empty() && names.size() != specs.size())
      throw ShapeMismatch(detail::msg("OuterLoop: got ", names.size(), " names for ", specs.size(), " tensors"));
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const auto n = tensor_size(params[i]);
      if (n != specs[i].numel)
        throw ShapeMismatch(detail::msg("OuterLoop: tensor ", i, " ('", specs[i].name, "') has ", n,
                                        " elements but the plan says ", specs[i].numel));
      if (!names.empty() && names[i] != specs[i].name)
        throw ShapeMismatch(detail::msg("OuterLoop: tensor ", i, " is named '", names[i], "' but the plan has '",
                                        specs[i].name, "' there; pass tensors in plan order"));
    }
  }

  Message header(MessageType type) const {
    Message m;
    m.type = type;
    m.fingerprint = plan_->fingerprint();
    m.learner = config_.id;
    m.step = step_;
    return m;
  }

  bool send(Message&& m) {
    const auto bytes = m.payload_bytes();
    const bool ok = transport_->send(std::move(m));
    last_send_ = transport_->clock().now();
    if (ok) status_.bytes_sent += bytes;
    return ok;
  }

  /// How long a join waits for the next fragment of its state before asking
  /// again: join_retry, or twice the longest wait for a fragment so far (from
  /// the join's start or the fragment before: the request was heard, the link
  /// is slow), if longer, but at most an eighth of the join time-out.
  [[nodiscard]] Duration join_retry_interval() const noexcept {
    return std::max(config_.join_retry, std::min(2 * join_gap_, join_timeout_ / 8));
  }

  /// What the join time-out was made of, for its message: the state's size,
  /// the link figure, and the flag to change.
  std::string join_timeout_text() const {
    const double mib = static_cast<double>(full_state_bytes(*plan_)) / (1024.0 * 1024.0);
    const double wire_s = static_cast<double>(full_state_bytes(*plan_)) * 8.0 / (config_.join_link_mbit * 1e6);
    if (config_.join_timeout > Duration{0})
      return detail::msg("the time-out was set (OuterLoopConfig::join_timeout, the learner's --join-timeout-ms); the ",
                         mib, " MiB state needs ", wire_s, " s on the wire at ", config_.join_link_mbit,
                         " Mbit/s: raise the time-out, or set 0 to derive it from the link");
    return detail::msg("the time-out was derived from the ", mib, " MiB state at a declared link of ",
                       config_.join_link_mbit, " Mbit/s (", wire_s,
                       " s on the wire, x2 + 30 s); on a slower link declare it (OuterLoopConfig::join_link_mbit, "
                       "the learner's --join-link-mbit) or set the time-out (--join-timeout-ms)");
  }

  void send_join() {
    report_training_ = true;
    join_sent_ = transport_->clock().now();
    join_heard_ = join_sent_;
    Message m = header(MessageType::join);
    m.sequence = join_nonce_;
    m.steps = static_cast<std::int64_t>(config_.sync_every);  // the schedule, checked by a syncer that knows it
    m.tokens = static_cast<std::int64_t>(config_.overlap);
    m.version = config_.tokens_per_step;  // bounds this learner's token claims at the syncer (0: unstated)
    m.fragment = static_cast<std::uint32_t>(config_.round);  // checked against the syncer's --round
    send(std::move(m));
  }

  void maybe_heartbeat() {
    if (transport_->clock().now() - last_send_ < config_.heartbeat_interval) return;
    ++status_.heartbeats;
    send(header(MessageType::heartbeat));
  }

  void drain() {
    while (auto m = transport_->try_receive()) on_message(std::move(*m));
  }

  /// While rejoining, the join request is sent again every join_retry (a lost
  /// request or reply must not stop this learner's sends for good).
  void maybe_resend_rejoin() {
    if (rejoining_ && transport_->clock().now() - join_sent_ >= config_.join_retry) send_join();
  }

  void on_message(Message&& m) {
    ++status_.received;
    if (m.type == MessageType::join_refused && (!joined_ || rejoining_) && m.learner == config_.id &&
        m.sequence == join_nonce_)
      throw ProtocolError(refusal_text(m));
    if (m.type == MessageType::rejoin) {
      if (!joined_ || rejoining_ || m.learner != config_.id || m.fingerprint != plan_->fingerprint()) {
        ++status_.ignored;  // joining or rejoining already, or not for this learner and plan
        return;
      }
      // The syncer has no record of this learner: a new incarnation (fresh
      // nonce), the same parameters, bases and counters.
      rejoining_ = true;
      ++status_.rejoins;
      join_nonce_ = detail::join_nonce(config_.id, step_, transport_->clock().now());
      send_join();
      return;
    }
    if (m.type == MessageType::pull) {
      if (!joined_ || config_.round != RoundMode::pull || m.learner != config_.id ||
          m.fingerprint != plan_->fingerprint() || m.fragment >= frags_.size()) {
        ++status_.ignored;
        return;
      }
      // One answer per round: a duplicate of the newest pull taken (same slot
      // m.step, same version) is ignored. (Not "older than": a restored syncer
      // counts global steps from 0 again.)
      auto& f = frags_[m.fragment];
      const bool pending = std::find(pulls_.begin(), pulls_.end(), m.fragment) != pulls_.end();
      if (f.pulled_round && *f.pulled_round == std::make_pair(m.step, m.version)) {
        // A second ask of a pull taken (the syncer's step counter of this
        // learner moved on and no answer came): an answer still to send goes
        // out as planned; one sent from the base this learner still holds may
        // be lost, so it answers again, marked `repeat` (the syncer merges
        // one of the two), once. After a newer global was applied, the round is over.
        if (m.repeat && !pending && f.answer && !f.answer->repeated && f.answer->pull_version == m.version &&
            f.answer->base_version == f.base_version) {
          ++status_.pulls_repeated;
          f.repeat_answer = true;
          pulls_.push_back(m.fragment);
          return;
        }
        ++status_.ignored;
        return;
      }
      // A pull of the version this learner answered last, from the same base,
      // within H steps: the syncer timed the round out before that answer
      // reached it, and will count it when it does. A second answer from
      // that base, merged after the first, would be stale. (Later than H
      // steps, the answer may have been lost: answered again.)
      if (f.answer && f.answer->pull_version == m.version && f.answer->base_version == f.base_version &&
          step_ - f.answer->step <= config_.sync_every) {
        ++status_.ignored;
        return;
      }
      f.pulled_round = std::make_pair(m.step, m.version);
      f.pull_floor = m.tokens > 0 ? static_cast<std::uint64_t>(m.tokens) : 0;
      f.pulled_at_step = step_;
      ++status_.pulls;
      // A second answer still to send now answers this pull: not marked
      // `repeat` (the syncer drops a `repeat` once it has the first answer,
      // and this round would lose this learner's answer).
      f.repeat_answer = false;
      if (!pending) pulls_.push_back(m.fragment);
      return;
    }
    const bool global = m.type == MessageType::global_fragment || m.type == MessageType::full_state;
    if (!global || m.fingerprint != plan_->fingerprint() || m.learner != config_.id || m.fragment >= frags_.size() ||
        !m.payload || m.payload->size() != frags_[m.fragment].base.size()) {
      ++status_.ignored;
      return;
    }
    // A full state answers a join of this learner (a retry's answer, or one
    // of several syncer shards' after a rejoin, may come while joined): its
    // sequence base is a floor for every later contribution (the highest
    // base of all shards serves each of them, docs/sharding.md).
    if (m.type == MessageType::full_state) sequence_ = std::max(sequence_, m.sequence);
    if (m.type == MessageType::full_state && rejoining_) {
      // The rejoin's reply: sequences go on from the new incarnation's base;
      // the fragment itself is a received global like any other, handled below.
      rejoining_ = false;
    }
    auto& f = frags_[m.fragment];
    if (m.type == MessageType::full_state && !joined_) {
      // Each syncer shard gives its own base (taken above); a subsequence of
      // increasing numbers is increasing, so the highest serves them all.
      if (!f.received) {
        f.received = true;
        ++join_received_;
        join_bytes_ += 4 * m.payload->size();
      }
      // The state is arriving: no retry while it does. Fragments that each take
      // longer than join_retry on a slow link must not draw a request per
      // second: the retry waits for twice the longest gap seen between them.
      const TimePoint now = transport_->clock().now();
      join_gap_ = std::max(join_gap_, now - join_fragment_at_);
      join_heard_ = join_fragment_at_ = now;
      f.latest = std::move(m.payload);
      f.latest_version = m.version;
      f.base_version = 0;
      f.global = f.latest;
      f.global_version = m.version;
      return;
    }
    if (f.latest && m.version <= f.latest_version) {
      ++status_.ignored;
      return;
    }
    if (m.version <= f.base_version && joined_) {
      ++status_.ignored;
      return;
    }
    f.latest = std::move(m.payload);
    f.latest_version = m.version;
    f.global = f.latest;
    f.global_version = m.version;
    // Pull rounds: a global for a fragment this learner has no answer out for
    // (it was not pulled, or its answer's result came already) is applied at
    // the next step; one it answered waits for answer + tau (apply_due).
    if (config_.round == RoundMode::pull && std::find(arrived_.begin(), arrived_.end(), m.fragment) == arrived_.end())
      arrived_.push_back(m.fragment);
  }

  /// The message of a refused join: what the syncer has, what this learner has, the fix.
  std::string refusal_text(const Message& m) const {
    const auto theirs = static_cast<JoinRefusal>(m.fragment);
    if (theirs == JoinRefusal::identity) {
      return detail::msg("OuterLoop::join: the syncer refused learner ", config_.id,
                         ": this learner's key is on the syncer's allow-list for learner id ", m.version, ", not ",
                         config_.id, "; run with --id ", m.version, " or give learner ", config_.id,
                         " its own key and allow-list line");
    }
    if (theirs == JoinRefusal::full) {
      return detail::msg("OuterLoop::join: the syncer refused learner ", config_.id,
                         ": it already serves its maximum number of learners, all of them alive; raise the "
                         "syncer's --max-learners or stop a learner first");
    }
    if (theirs == JoinRefusal::tokens_per_step) {
      return detail::msg("OuterLoop::join: the syncer refused learner ", config_.id, ": it declares ",
                         config_.tokens_per_step, " tokens per inner step but the syncer allows at most ", m.version,
                         " (--max-tokens-per-step); use a smaller batch or raise the syncer's bound");
    }
    if (theirs == JoinRefusal::round_mode) {
      return detail::msg("OuterLoop::join: the syncer refused learner ", config_.id, ": it runs ",
                         to_string(static_cast<RoundMode>(m.version)), " rounds but this learner runs ",
                         to_string(config_.round), " rounds; start the learner with the syncer's --round (",
                         to_string(static_cast<RoundMode>(m.version)), ")");
    }
    if (theirs == JoinRefusal::shard_map) {
      const auto named = detail::join_shard(static_cast<std::uint32_t>(m.tokens));
      return detail::msg("OuterLoop::join: the syncer refused learner ", config_.id, ": it is shard ",
                         m.version & 0xffffffffu, " of ", m.version >> 32, " (shard map ", detail::hex16(m.step),
                         ") but this learner addressed it as shard ", named.index, " of ",
                         std::max<std::size_t>(named.count, 1),
                         "; give the learner every shard's endpoint, in shard order (--connect A,B,...), and "
                         "start shard i of S with --shard i/S");
    }
    if (theirs == JoinRefusal::schedule) {
      return detail::msg("OuterLoop::join: the syncer refused learner ", config_.id, ": it runs H = ", m.steps,
                         " (sync every), tau = ", m.tokens, " (overlap) but this learner runs H = ",
                         config_.sync_every, ", tau = ", config_.overlap,
                         "; start the learner with the syncer's --sync-every and --overlap");
    }
    return detail::msg("OuterLoop::join: the syncer refused learner ", config_.id, ": its plan (fingerprint ",
                       detail::hex16(m.fingerprint), ", ", m.version, " fragments, ", m.step,
                       " parameters) differs from this learner's (fingerprint ", detail::hex16(plan_->fingerprint()),
                       ", ", plan_->num_fragments(), " fragments, ", plan_->total_numel(),
                       " parameters); start every process with the same model (tensor list, sizes, order), "
                       "and fragment count (--fragments)");
  }

  /// Applies every pending fragment whose time has come and whose result is
  /// here; with announce_applies (called from step() only), applies what the
  /// previous step that may apply announced and announces those instead.
  std::size_t apply_due(std::span<T> params, StepReport& report, bool may_block = true) {
    std::size_t applied = 0;
    if (step_ % config_.apply_every != 0) return 0;  // pull rounds: held until a step that may apply
    const bool announce = config_.announce_applies;
    if (announce) {
      if (!may_block) return 0;  // poll(): only steps apply, so every rank of a group applies at the same step
      for (std::size_t p = 0; p < frags_.size(); ++p) {
        auto& f = frags_[p];
        if (!f.announced) continue;
        report.applied_fragments.push_back({p, f.announced_version, f.announced});
        const Payload values = std::move(f.announced);
        apply_values(p, params, *values, f.announced_version, /*mix=*/true);
        ++applied;
      }
    }
    // Takes fragment p's newest global: applies it now, or announces it.
    const auto take = [&](std::size_t p) {
      auto& f = frags_[p];
      if (announce) {
        f.announced = f.latest;
        f.announced_version = f.latest_version;
        report.announced.push_back({p, f.latest_version, f.latest});
        return;
      }
      report.applied_fragments.push_back({p, f.latest_version, f.latest});
      apply(p, params, /*mix=*/true);
      ++applied;
    };
    for (std::size_t p : arrived_) {  // pull rounds only (on_message)
      auto& f = frags_[p];
      if (f.sent_at || !f.has_newer() || f.announced) continue;  // an answer is out: applied at answer + tau below
      status_.staleness_versions.observe(static_cast<double>(f.latest_version - f.base_version));
      take(p);
    }
    arrived_.clear();
    for (std::size_t i = 0; i < pending_.size();) {
      const std::size_t p = pending_[i];
      auto& f = frags_[p];
      const std::uint64_t due = *f.sent_at + config_.overlap;
      if (step_ < due || f.announced) {
        ++i;
        continue;
      }
      if (!f.has_newer() && config_.lock_step && may_block) {
        report.waited = true;
        wait_for(p);
      }
      if (f.has_newer()) {
        if (step_ > due) ++status_.late_applies;
        status_.apply_delay_steps.observe(static_cast<double>(step_ - *f.sent_at));
        status_.staleness_versions.observe(
            static_cast<double>(f.latest_version > f.base_version ? f.latest_version - f.base_version : 0));
        take(p);
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    return applied;
  }

  void wait_for(std::size_t p) {
    ++status_.lock_step_waits;
    const TimePoint deadline = transport_->clock().now() + config_.lock_step_timeout;
    while (!frags_[p].has_newer()) {
      check_transport();
      maybe_heartbeat();  // waiting is not dying (see poll())
      const TimePoint until = std::min(deadline, next_heartbeat());
      auto m = transport_->receive_until(until);
      if (m) {
        on_message(std::move(*m));
      } else if (transport_->clock().now() >= deadline) {
        ++status_.lock_step_timeouts;
        return;
      } else if (transport_->clock().now() >= until) {
        continue;  // a heartbeat is due: the loop sends it and waits on
      } else {
        return;  // a virtual clock does not block: the driver advances time
      }
    }
  }

  /// theta_p <- alpha * theta_p + (1 - alpha) * Theta_p (FragmentApplier); base_p <- Theta_p.
  void apply(std::size_t p, std::span<T> params, bool mix) {
    auto& f = frags_[p];
    const Payload theta = std::move(f.latest);
    apply_values(p, params, *theta, f.latest_version, mix);
  }

  /// The same for the global `theta` of version `of_version` (the newest, or an
  /// announced one): `latest` is dropped if it is not newer.
  void apply_values(std::size_t p, std::span<T> params, const std::vector<float>& theta, std::uint64_t of_version,
                    bool mix) {
    auto& f = frags_[p];
    applier_.apply_unchecked(params, p, std::span<const float>(theta), mix);
    std::copy(theta.begin(), theta.end(), f.base.begin());
    f.base_version = of_version;
    if (f.latest && f.latest_version <= of_version) f.latest.reset();
    f.sent_at.reset();
    f.steps_at_reset = step_;
    f.tokens_at_reset = tokens_total_;
    ++status_.applies;
  }

  /// Sends fragment p's outer gradient v = base - theta, then base <- theta.
  bool send_fragment(std::size_t p, std::span<T> params) {
    auto& f = frags_[p];
    const auto steps = static_cast<std::int64_t>(step_ - f.steps_at_reset);
    if (steps <= 0) return false;  // nothing new since the last receipt
    Message m = header(MessageType::contribution);
    m.fragment = static_cast<std::uint32_t>(p);
    m.version = f.base_version;
    m.sequence = sequence_ + 1;
    m.steps = steps;
    m.tokens = static_cast<std::int64_t>(tokens_total_ - f.tokens_at_reset);
    m.repeat = f.repeat_answer;
    local_.resize(f.base.size());
    std::optional<Codec> codec;
    if constexpr (ContributionEncodingTransport<Transport>) codec = transport_->contribution_codec();
    if (codec) {
      m.encoded = encode_outer_gradient(p, params, *codec);
    } else {
      m.payload = make_payload(outer_gradient(p, params));
    }
    if (!send(std::move(m))) {
      ++status_.send_failures;  // not queued: keep base and counters, the next send carries this progress
      return false;
    }
    ++sequence_;
    ++status_.sends;
    f.repeat_answer = false;
    if (config_.round == RoundMode::push) {
      // Push: the next send carries only the progress made after this one.
      f.base.swap(local_);
      f.steps_at_reset = step_;
      f.tokens_at_reset = tokens_total_;
    }
    // Pull (the paper's counters): base and counters stay those of the last
    // global applied, so an answer is always Theta^(b) - theta with every step
    // since b; the syncer anchors it at its current global (SyncerConfig::anchor_versions).
    if (!f.sent_at) pending_.push_back(p);
    f.sent_at = step_;
    return true;
  }

  /// v = base_p - theta_p as fp32, and local_ <- theta_p (the next base).
  std::vector<float> outer_gradient(std::size_t p, std::span<T> params) {
    const auto& f = frags_[p];
    const auto& specs = plan_->tensors();
    std::vector<float> v(f.base.size());
    // One pass per tensor (no extra copy): local_ <- theta (the next base) and
    // v <- base - theta together; a host tensor is read in place (step()
    // checked its size), a staged (device) tensor is first copied to the host
    // by its trait.
    for (std::size_t t : plan_->fragments()[p].tensors) {
      const std::size_t off = plan_->offset_in_fragment(t), n = specs[t].numel;
      const float* __restrict__ base = f.base.data() + off;
      float* __restrict__ next = local_.data() + off;
      float* __restrict__ out = v.data() + off;
      if constexpr (HostTensor<T>) {
        const float* __restrict__ theta = host_view(std::as_const(params[t])).data();
        for (std::size_t i = 0; i < n; ++i) {
          const float x = theta[i];
          next[i] = x;
          out[i] = base[i] - x;
        }
      } else {
        read_tensor(params[t], std::span<float>(next, n));
        for (std::size_t i = 0; i < n; ++i) out[i] = base[i] - next[i];
      }
    }
    return v;
  }

  /// The same v, encoded with `codec` as it is computed (fast::OuterGradientEncoder:
  /// one pass, no fp32 copy of v), into the buffer the transport lends
  /// (ContributionBufferTransport: the frame itself), else into one reused from
  /// the previous send once the transport has let go of it; local_ <- theta_p as above.
  EncodedPayload encode_outer_gradient(std::size_t p, std::span<T> params, Codec codec) {
    const auto& f = frags_[p];
    const auto& specs = plan_->tensors();
    const std::size_t n = f.base.size(), bytes = encoded_size(codec, n);
    OutgoingPayload buffer;
    if constexpr (FragmentBufferTransport<Transport>) {
      buffer = transport_->contribution_buffer(bytes, p);  // from the link fragment p goes out on
    } else if constexpr (ContributionBufferTransport<Transport>) {
      buffer = transport_->contribution_buffer(bytes);
    }
    if constexpr (ContributionBufferTransport<Transport> || FragmentBufferTransport<Transport>) {
      if (buffer.bytes.size() != bytes) {
        throw TransportError(detail::msg("OuterLoop: the transport lent ", buffer.bytes.size(),
                                         " bytes for a contribution of ", bytes, " (fragment ", p, ")"));
      }
    } else {
      if (encoded_buffer_ && encoded_buffer_.use_count() == 1 && encoded_bytes_ == bytes) {
        // The transport released its reference (the count went to 1 with a release
        // decrement); the fence orders its last reads of the bytes before our writes.
        std::atomic_thread_fence(std::memory_order_acquire);
      } else {
        encoded_buffer_ = std::shared_ptr<std::byte[]>(new std::byte[bytes]);  // not zero-filled: every byte is written
        encoded_bytes_ = bytes;
      }
      buffer = OutgoingPayload{std::span<std::byte>(encoded_buffer_.get(), bytes), encoded_buffer_};
    }
    const std::span<std::byte> out = buffer.bytes;
    fast::OuterGradientEncoder enc(codec, n, out);
    for (std::size_t t : plan_->fragments()[p].tensors) {
      const std::size_t off = plan_->offset_in_fragment(t), len = specs[t].numel;
      float* next = local_.data() + off;
      if constexpr (HostTensor<T>) {
        enc.add(host_view(std::as_const(params[t])).data(), f.base.data() + off, next, len);
      } else {
        read_tensor(params[t], std::span<float>(next, len));
        enc.add(next, f.base.data() + off, next, len);  // theta is already in next
      }
    }
    return EncodedPayload{codec, n, out, std::move(buffer.owner)};
  }

  const Plan* plan_;
  Transport* transport_;
  OuterLoopConfig config_;
  Schedule schedule_;
  std::vector<FragmentState> frags_;
  std::vector<std::size_t> pending_;  ///< fragments sent and awaiting their result
  std::vector<std::size_t> pulls_;    ///< pull rounds: fragments the syncer pulled, not yet answered
  std::vector<std::size_t> arrived_;  ///< pull rounds: fragments whose newer global came since the last step
  std::vector<std::size_t> touched_;  ///< prepare_step(): the fragments the next step may touch
  bool prepared_ = false;             ///< prepare_step() has drained the transport for the next step
  std::vector<float> local_;
  FragmentApplier<T> applier_;
  std::shared_ptr<std::byte[]> encoded_buffer_;  ///< the last encoded contribution (see encode_outer_gradient)
  std::size_t encoded_bytes_ = 0;
  std::uint64_t step_ = 0;
  std::uint64_t tokens_total_ = 0;
  std::uint64_t sequence_ = 0;
  std::uint64_t join_nonce_ = 0;
  std::size_t join_received_ = 0;
  bool joined_ = false;
  bool rejoining_ = false;  ///< a rejoin request is out, its reply not yet in
  bool report_training_ = false;  ///< push rounds: the first step since the last join is not yet reported
  TimePoint last_send_{0};
  TimePoint join_sent_{0};
  TimePoint join_heard_{0};  ///< the last join request sent or fragment of its state received
  Duration join_gap_{0};     ///< the longest wait for a fragment of this join's state so far (join_retry_interval())
  TimePoint join_fragment_at_{0};  ///< when the last fragment of this join's state came (its start before the first)
  std::uint64_t join_bytes_ = 0;
  Duration join_timeout_;    ///< config_.join_timeout, or derived (join_timeout())
  OuterLoopStatus status_{};
};

}  // namespace ddiloco
