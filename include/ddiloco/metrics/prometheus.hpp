// ddiloco/metrics/prometheus.hpp: the syncer's and the learners' Prometheus
// metrics (optional integration: needs prometheus-cpp, Debian's
// prometheus-cpp-dev; link prometheus-cpp::core, and prometheus-cpp::pull for
// MetricsServer).
//
// What it is: the one place where the metric names, types, labels and help
// texts are defined (docs/metrics.md lists them). SyncerMetrics and
// LearnerMetrics register their series in a prometheus::Registry and bring
// them up to date from the library's status structs (SyncerStatus,
// OuterLoopStatus, and optionally a transport's counters such as ZmqCounters):
// counters grow by what the status totals grew since the previous update,
// gauges are set, and the status histograms (same bucket bounds) become
// Prometheus histograms. MetricsServer serves a registry over HTTP at
// /metrics, optionally refreshing it first at every scrape.
// What it is not: a source of figures of its own. Everything exported is
// counted by the library (or, for the checkpoint age, told by the caller), so
// C++ users get the same series as ddiloco_syncer and ddiloco_learner.
//
// Worked example (a syncer driven by SyncerRuntime):
//   auto registry = std::make_shared<prometheus::Registry>();
//   ddiloco::SyncerMetrics metrics(*registry, config.quorum.min_quorum);
//   ddiloco::MetricsServer server("0.0.0.0:9100", registry,
//                                 [&] { metrics.update(syncer.status(), link.counters()); });
// A learner's status is not thread-safe, so its loop updates the metrics:
//   ddiloco::LearnerMetrics metrics(*registry, id);
//   ddiloco::MetricsServer server("0.0.0.0:9101", registry);
//   for (;;) { ...; outer.step(params, tokens); metrics.update(outer.status(), link.counters()); }
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ddiloco/error.hpp>
#include <ddiloco/histogram.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/syncer.hpp>

namespace ddiloco {

/// A transport's frame counters, as ZmqCounters (<ddiloco/transport/zmq.hpp>)
/// has them; taken by shape so this header needs no transport.
template <class C>
concept TransportCounterSet = requires(const C& c) {
  { c.frames_in } -> std::convertible_to<std::uint64_t>;
  { c.frames_out } -> std::convertible_to<std::uint64_t>;
  { c.bytes_in } -> std::convertible_to<std::uint64_t>;
  { c.bytes_out } -> std::convertible_to<std::uint64_t>;
  { c.send_dropped } -> std::convertible_to<std::uint64_t>;
  { c.decode_errors } -> std::convertible_to<std::uint64_t>;
};

namespace detail {

/// A Prometheus counter fed from a running total: grows by the total's growth.
/// `count` = false only records the total as the base (nothing is counted).
/// A total that shrinks is taken as the new base.
class TotalCounter {
 public:
  TotalCounter() = default;
  explicit TotalCounter(prometheus::Counter& c) : counter_(&c) {}
  void set(std::uint64_t total, bool count = true) {
    if (count && total > last_) counter_->Increment(static_cast<double>(total - last_));
    last_ = total;
  }

 private:
  prometheus::Counter* counter_ = nullptr;
  std::uint64_t last_ = 0;
};

/// A Prometheus histogram fed from a ddiloco::Histogram with the same bounds.
class TotalHistogram {
 public:
  TotalHistogram() = default;
  explicit TotalHistogram(prometheus::Histogram& h, std::size_t buckets) : histogram_(&h), last_(buckets, 0) {}
  /// `counts`: per-bucket totals (not cumulative), one per bound plus +Inf.
  void set(const std::vector<std::uint64_t>& counts, double sum, bool count = true) {
    std::vector<double> inc(last_.size(), 0.0);
    bool any = false;
    for (std::size_t i = 0; i < last_.size() && i < counts.size(); ++i) {
      if (count && counts[i] > last_[i]) {
        inc[i] = static_cast<double>(counts[i] - last_[i]);
        any = true;
      }
      last_[i] = counts[i];
    }
    if (any) histogram_->ObserveMultiple(inc, sum > last_sum_ ? sum - last_sum_ : 0.0);
    last_sum_ = sum;
  }
  void set(const Histogram& h, bool count = true) {
    if (h.count() == last_count_) return;  // nothing new (the common case: an update per inner step)
    last_count_ = h.count();
    set(h.counts(), h.sum(), count);
  }

 private:
  prometheus::Histogram* histogram_ = nullptr;
  std::vector<std::uint64_t> last_;
  double last_sum_ = 0.0;
  std::uint64_t last_count_ = 0;
};

inline prometheus::Family<prometheus::Counter>& counter_family(prometheus::Registry& r, const std::string& name,
                                                               const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r);
}
inline prometheus::Family<prometheus::Gauge>& gauge_family(prometheus::Registry& r, const std::string& name,
                                                           const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r);
}
inline prometheus::Family<prometheus::Histogram>& histogram_family(prometheus::Registry& r, const std::string& name,
                                                                   const std::string& help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r);
}

/// The transport series of one side (prefix ddiloco_syncer_ or ddiloco_learner_).
class TransportSeries {
 public:
  TransportSeries(prometheus::Registry& r, const std::string& prefix, const prometheus::Labels& labels) {
    auto add = [&](const char* name, const char* help) {
      return TotalCounter(counter_family(r, prefix + name, help).Add(labels));
    };
    frames_in_ = add("frames_received_total", "Frames received by the transport (valid or not).");
    frames_out_ = add("frames_sent_total", "Frames handed to the network by the transport.");
    bytes_in_ = add("received_bytes_total", "Bytes received on the wire (whole frames).");
    bytes_out_ = add("sent_bytes_total", "Bytes sent on the wire (whole frames).");
    dropped_ = add("frames_dropped_total",
                   "Frames not sent: the peer was unknown or its queue full (back-pressure).");
    invalid_ = add("frames_invalid_total", "Received frames that failed validation and were dropped.");
  }
  template <TransportCounterSet C>
  void set(const C& c) {
    frames_in_.set(c.frames_in);
    frames_out_.set(c.frames_out);
    bytes_in_.set(c.bytes_in);
    bytes_out_.set(c.bytes_out);
    dropped_.set(c.send_dropped);
    invalid_.set(c.decode_errors);
  }

 private:
  TotalCounter frames_in_, frames_out_, bytes_in_, bytes_out_, dropped_, invalid_;
};

/// Bounds of ddiloco_syncer_quorum_size (contributions per merge).
inline std::vector<double> quorum_size_bounds() { return {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256}; }

}  // namespace detail

/// What SyncerMetrics exports beyond the status.
struct SyncerMetricsOptions {
  /// K, exported as ddiloco_syncer_min_quorum so that alerts can compare it
  /// with ddiloco_syncer_learners_alive (0: not exported).
  std::size_t min_quorum = 0;
  /// Export ddiloco_syncer_checkpoints_total and checkpoint_age_seconds from
  /// the start (the caller checkpoints and calls checkpoint_written()); when
  /// false they appear at the first checkpoint_written().
  bool checkpoints = false;
  /// The syncer's round mode, exported as ddiloco_syncer_round_mode{mode="push"|"pull"} = 1
  /// (not exported when unset).
  std::optional<RoundMode> round{};
};

/// The syncer's series (prefix ddiloco_syncer_). update() is thread-safe.
class SyncerMetrics {
 public:
  explicit SyncerMetrics(prometheus::Registry& r, SyncerMetricsOptions options = {})
      : registry_(&r), started_(std::chrono::steady_clock::now()) {
    using namespace detail;
    auto total = [&](const char* name, const char* help) {
      return TotalCounter(counter_family(r, std::string("ddiloco_syncer_") + name, help).Add({}));
    };
    auto gauge = [&](const char* name, const char* help) -> prometheus::Gauge& {
      return gauge_family(r, std::string("ddiloco_syncer_") + name, help).Add({});
    };
    merges_ = total("merges_total", "Merges over all fragments (each publishes a new version of one fragment).");
    grace_waits_ = total("grace_waits_total", "Merges that waited for a grace window after the quorum formed.");
    deadline_merges_ = total("deadline_merges_total",
                             "Merges forced by the round deadline (with fewer than K contributions).");
    accepted_ = total("contributions_accepted_total", "Contributions accepted into a round.");
    clipped_ = total("contributions_clipped_total",
                     "Accepted contributions whose norm was clipped to clip_factor x the robust reference.");
    capped_ = total("weights_capped_total",
                    "Accepted contributions whose weight was capped at weight_cap_factor x the robust reference.");
    joins_ = total("joins_total", "Learner joins (a new incarnation of a learner id).");
    leaves_ = total("leaves_total", "Learners that left with a leave message.");
    deaths_ = total("deaths_total", "Learners declared dead after the heartbeat time-out.");
    joins_limited_ = total("joins_limited_total",
                           "Joins dropped unanswered by the join rate limits or as repeats of an answered join.");
    joins_full_ = total("joins_over_capacity_total",
                        "Joins refused because the syncer knows its maximum of learners, all alive.");
    pruned_ = total("learners_pruned_total", "Departed learners forgotten (after the prune time, or to make room).");
    rejoin_requests_ = total("rejoin_requests_total",
                             "Unknown learners (e.g. joined after the restored checkpoint) asked to join again.");
    pull_rounds_ = total("pull_rounds_total", "Pull rounds opened (a fragment's slot came at the global step).");
    pulls_sent_ = total("pulls_sent_total", "Pull requests sent to learners (one per learner with progress per round).");
    pull_timeouts_ = total("pull_timeouts_total",
                           "Pull rounds merged at the pull time-out with answers still missing.");
    pull_rounds_empty_ = total("pull_rounds_empty_total", "Pull rounds closed without a merge (no accepted answer).");
    pulls_repeated_ = total("pulls_repeated_total",
                            "Second asks sent to pulled learners that moved on with no answer in (reask_after_steps).");
    answers_redundant_ = total("answers_redundant_total",
                               "Second answers to a pull asked twice, dropped because the first had come (merged once).");
    steps_beyond_lead_ = total("steps_beyond_lead_total",
                               "Step counters more than max_lead ahead of every other learner (counted at the runner-up plus the lead).");
    frontier_carries_ = total("frontier_carries_total",
                              "Times the learner furthest ahead died or left and the learners still training carried the global step on.");
    in_ = total("message_received_bytes_total", "Bytes of the messages the syncer handled (header + payload).");
    out_ = total("message_sent_bytes_total", "Bytes of the messages the syncer queued for learners (header + payload).");
    auto& rejected = counter_family(r, "ddiloco_syncer_contributions_rejected_total",
                                    "Messages refused, by reason (label reason); global state untouched.");
    for (std::size_t i = 0; i < kRejectReasons; ++i)
      rejected_[i] = TotalCounter(rejected.Add({{"reason", std::string(to_string(static_cast<RejectReason>(i)))}}));
    alive_ = &gauge("learners_alive", "Learners heard from within the heartbeat time-out (counted by the quorum).");
    known_ = &gauge("learners_known", "Learner ids that ever joined this syncer (alive or not).");
    global_step_ = &gauge("global_step",
                          "The global step: the furthest any learner has trained, each learner's steps counted from "
                          "the global step at its join (pull rounds open with it; kept in push rounds too).");
    if (options.round)
      gauge_family(r, "ddiloco_syncer_round_mode", "The syncer's round mode (label mode: push or pull), always 1.")
          .Add({{"mode", std::string(to_string(*options.round))}})
          .Set(1.0);
    if (options.checkpoints) register_checkpoint_series();
    if (options.min_quorum > 0)
      gauge("min_quorum", "K: minimum distinct contributions before a merge.")
          .Set(static_cast<double>(options.min_quorum));
    const auto qb = detail::quorum_size_bounds();
    quorum_ = TotalHistogram(histogram_family(r, "ddiloco_syncer_quorum_size",
                                              "Distinct contributions combined per merge.")
                                 .Add({}, qb),
                             qb.size() + 1);
    const auto rb = round_seconds_bounds();
    round_ = TotalHistogram(histogram_family(r, "ddiloco_syncer_round_seconds",
                                             "Seconds from a round's first accepted contribution to its merge "
                                             "being published.")
                                .Add({}, rb),
                            rb.size() + 1);
    const auto gb = grace_wait_seconds_bounds();
    grace_ = TotalHistogram(histogram_family(r, "ddiloco_syncer_grace_wait_seconds",
                                             "Seconds a merge waited in its grace window after the quorum formed.")
                                .Add({}, gb),
                            gb.size() + 1);
    versions_ = &gauge_family(r, "ddiloco_syncer_fragment_version",
                              "Current version of each fragment's global values (label fragment).");
  }

  SyncerMetrics(const SyncerMetrics&) = delete;
  SyncerMetrics& operator=(const SyncerMetrics&) = delete;

  /// Brings every ddiloco_syncer_ series up to `s`.
  void update(const SyncerStatus& s) {
    std::lock_guard lock(mutex_);
    update_locked(s, true);
  }
  /// Takes `s` as the starting point without counting it: the counters then
  /// count from here, as Prometheus expects of a process that just started.
  /// For a syncer restored from a checkpoint (whose totals carry the previous
  /// process's counts); call it before the first update().
  void baseline(const SyncerStatus& s) {
    std::lock_guard lock(mutex_);
    update_locked(s, false);
  }
  /// The same, plus the transport's frame counters (ZmqSyncerTransport::counters()).
  template <TransportCounterSet C>
  void update(const SyncerStatus& s, const C& transport) {
    std::lock_guard lock(mutex_);
    update_locked(s, true);
    if (!transport_) transport_.emplace(*registry_, "ddiloco_syncer_", prometheus::Labels{});
    transport_->set(transport);
    if constexpr (requires { transport.auth_denied; transport.impersonations; }) {
      if (!auth_denied_) {
        auth_denied_.emplace(detail::counter_family(*registry_, "ddiloco_syncer_auth_denied_total",
                                                    "CURVE handshakes refused (key not in the allow-list).")
                                 .Add({}));
        impersonations_.emplace(detail::counter_family(*registry_, "ddiloco_syncer_impersonations_total",
                                                       "Frames from a listed key that spoke for another learner id.")
                                    .Add({}));
      }
      auth_denied_->set(transport.auth_denied);
      impersonations_->set(transport.impersonations);
    }
    if constexpr (requires { transport.send_over_budget; transport.send_queued_bytes; transport.slow_peer_frames; }) {
      if (!bounds_) bounds_.emplace(*registry_);
      bounds_->set(transport);
    }
    if constexpr (requires { transport.handshake_failures; }) {
      if (!handshake_failures_)
        handshake_failures_.emplace(
            detail::counter_family(*registry_, "ddiloco_syncer_handshake_failures_total",
                                   "Handshakes failed before authentication (a plaintext peer or another server key).")
                .Add({}));
      handshake_failures_->set(transport.handshake_failures);
    }
    if constexpr (requires { transport.payloads_encoded; }) {
      if (!globals_encoded_)
        globals_encoded_.emplace(
            detail::counter_family(*registry_, "ddiloco_syncer_globals_encoded_total",
                                   "Merged fragments encoded for sending: one per merge, whose payload every "
                                   "learner's frame shares.")
                .Add({}));
      globals_encoded_->set(transport.payloads_encoded);
    }
  }

  /// A checkpoint was written successfully now.
  void checkpoint_written() {
    std::lock_guard lock(mutex_);
    if (!checkpoint_age_) register_checkpoint_series();
    ++checkpoint_count_;
    checkpoints_.set(checkpoint_count_);
    last_checkpoint_ = std::chrono::steady_clock::now();
    checkpoint_age_->Set(0.0);
  }

 private:
  void register_checkpoint_series() {
    checkpoints_ = detail::TotalCounter(
        detail::counter_family(*registry_, "ddiloco_syncer_checkpoints_total", "Checkpoints written successfully.")
            .Add({}));
    checkpoint_age_ = &detail::gauge_family(*registry_, "ddiloco_syncer_checkpoint_age_seconds",
                                            "Seconds since the last successful checkpoint (since start before the "
                                            "first).")
                           .Add({});
  }

  void update_locked(const SyncerStatus& s, bool count) {
    merges_.set(s.merges, count);
    grace_waits_.set(s.grace_waits(), count);
    deadline_merges_.set(s.deadline_merges(), count);
    accepted_.set(s.contributions_accepted, count);
    clipped_.set(s.contributions_clipped, count);
    capped_.set(s.weights_capped, count);
    joins_.set(s.joins, count);
    leaves_.set(s.leaves, count);
    deaths_.set(s.deaths, count);
    joins_limited_.set(s.joins_limited, count);
    joins_full_.set(s.joins_over_capacity, count);
    pruned_.set(s.learners_pruned, count);
    rejoin_requests_.set(s.rejoin_requests, count);
    pull_rounds_.set(s.pull_rounds, count);
    pulls_sent_.set(s.pulls_sent, count);
    pull_timeouts_.set(s.pull_timeouts, count);
    pull_rounds_empty_.set(s.pull_rounds_empty, count);
    pulls_repeated_.set(s.pulls_repeated, count);
    answers_redundant_.set(s.answers_redundant, count);
    steps_beyond_lead_.set(s.steps_beyond_lead, count);
    frontier_carries_.set(s.frontier_carries, count);
    global_step_->Set(static_cast<double>(s.global_step));
    in_.set(s.bytes_in, count);
    out_.set(s.bytes_out, count);
    for (std::size_t i = 0; i < kRejectReasons; ++i) rejected_[i].set(s.rejected[i], count);
    alive_->Set(static_cast<double>(s.learners_alive));
    known_->Set(static_cast<double>(s.learners_known));
    if (checkpoint_age_) {
      const auto since = last_checkpoint_.value_or(started_);
      checkpoint_age_->Set(std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count());
    }
    // quorum_sizes[k] = merges of k contributions -> the buckets of quorum_size.
    Histogram q(detail::quorum_size_bounds());
    std::vector<std::uint64_t> counts(q.counts().size(), 0);
    double sum = 0;
    for (std::size_t k = 0; k < s.quorum_sizes.size(); ++k) {
      const auto& b = q.bounds();
      const auto at = static_cast<std::size_t>(std::lower_bound(b.begin(), b.end(), double(k)) - b.begin());
      counts[at] += s.quorum_sizes[k];
      sum += static_cast<double>(k) * static_cast<double>(s.quorum_sizes[k]);
    }
    quorum_.set(counts, sum, count);
    round_.set(s.round_seconds, count);
    grace_.set(s.grace_wait_seconds, count);
    // One series per fragment this syncer serves (a shard: its own).
    if (version_gauges_.size() < s.fragments.size()) version_gauges_.resize(s.fragments.size(), nullptr);
    for (std::size_t p = 0; p < s.fragments.size(); ++p) {
      if (!s.fragments[p].served) continue;
      if (version_gauges_[p] == nullptr) version_gauges_[p] = &versions_->Add({{"fragment", std::to_string(p)}});
      version_gauges_[p]->Set(static_cast<double>(s.fragments[p].version));
    }
  }

  /// The transport's memory-bound series (ZmqCounters, docs/operations.md "Memory bounds").
  struct BoundSeries {
    explicit BoundSeries(prometheus::Registry& r) {
      auto total = [&](const char* name, const char* help) {
        return detail::TotalCounter(detail::counter_family(r, std::string("ddiloco_syncer_") + name, help).Add({}));
      };
      auto gauge = [&](const char* name, const char* help) -> prometheus::Gauge& {
        return detail::gauge_family(r, std::string("ddiloco_syncer_") + name, help).Add({});
      };
      over_budget = total("frames_over_budget_total",
                          "Frames not queued: the learner's or the total send budget was full (a slow reader).");
      wrong_direction = total("frames_wrong_direction_total",
                              "Received frames of a type a syncer never receives, refused before decoding.");
      disconnects = total("disconnects_total",
                          "Connections closed (by the peer, a heartbeat time-out, or a message over the maximum size).");
      pauses = total("receive_pauses_total", "Times the syncer stopped reading its socket: received messages at their bound.");
      evicted = total("peers_evicted_total", "Reply routes forgotten to stay within --max-peers.");
      slow = total("frames_from_slow_peers_total",
                   "Frames dropped on arrival from a connection that has not read for --slow-peer-timeout-ms.");
      joins_dropped = total("joins_dropped_total",
                            "Joins and observes dropped on arrival: their connection's --connection-join-burst was spent.");
      send_queued = &gauge("send_queued_bytes", "Bytes of frames queued for learners, not yet written to their sockets.");
      incoming_queued = &gauge("incoming_queued_bytes", "Bytes of received messages waiting for the syncer.");
      peers = &gauge("peers", "Reply routes kept (learner ids heard from).");
    }
    template <class C>
    void set(const C& c) {
      over_budget.set(c.send_over_budget);
      wrong_direction.set(c.wrong_direction);
      disconnects.set(c.disconnects);
      pauses.set(c.receive_pauses);
      evicted.set(c.peers_evicted);
      slow.set(c.slow_peer_frames);
      joins_dropped.set(c.joins_dropped);
      send_queued->Set(static_cast<double>(c.send_queued_bytes));
      incoming_queued->Set(static_cast<double>(c.incoming_queued_bytes));
      peers->Set(static_cast<double>(c.peers));
    }
    detail::TotalCounter over_budget, wrong_direction, disconnects, pauses, evicted, slow, joins_dropped;
    prometheus::Gauge* send_queued = nullptr;
    prometheus::Gauge* incoming_queued = nullptr;
    prometheus::Gauge* peers = nullptr;
  };

  std::mutex mutex_;
  prometheus::Registry* registry_;
  std::optional<detail::TransportSeries> transport_;  ///< registered at the first update with transport counters
  std::optional<BoundSeries> bounds_;                  ///< likewise, for a transport with memory-bound counters
  detail::TotalCounter merges_, grace_waits_, deadline_merges_, accepted_, joins_, leaves_, deaths_, in_, out_,
      checkpoints_, joins_limited_, joins_full_, pruned_, rejoin_requests_, clipped_, capped_, pull_rounds_,
      pulls_sent_, pull_timeouts_, pull_rounds_empty_, pulls_repeated_, answers_redundant_, steps_beyond_lead_,
      frontier_carries_;
  std::array<detail::TotalCounter, kRejectReasons> rejected_{};
  std::optional<detail::TotalCounter> auth_denied_, impersonations_, handshake_failures_, globals_encoded_;
  prometheus::Gauge* alive_ = nullptr;
  prometheus::Gauge* known_ = nullptr;
  prometheus::Gauge* global_step_ = nullptr;
  prometheus::Gauge* checkpoint_age_ = nullptr;
  detail::TotalHistogram quorum_, round_, grace_;
  prometheus::Family<prometheus::Gauge>* versions_ = nullptr;
  std::vector<prometheus::Gauge*> version_gauges_;
  std::chrono::steady_clock::time_point started_;
  std::optional<std::chrono::steady_clock::time_point> last_checkpoint_;
  std::uint64_t checkpoint_count_ = 0;
};

/// One learner's series (prefix ddiloco_learner_, label learner = its id).
/// update() is thread-safe, but OuterLoop::status() is not: call it from the
/// thread that drives the OuterLoop.
class LearnerMetrics {
 public:
  LearnerMetrics(prometheus::Registry& r, LearnerId id)
      : registry_(&r), labels_{{"learner", std::to_string(id)}} {
    using namespace detail;
    auto total = [&](const char* name, const char* help) {
      return TotalCounter(counter_family(r, std::string("ddiloco_learner_") + name, help).Add(labels_));
    };
    steps_ = total("steps_total", "Inner steps taken (OuterLoop::step calls).");
    tokens_ = total("tokens_total", "Training tokens consumed by the inner steps.");
    sends_ = total("sends_total", "Outer gradients (fragment contributions) sent.");
    send_failures_ = total("send_failures_total",
                           "Sends the transport refused (the progress is kept for the next send).");
    applies_ = total("applies_total", "Global fragments applied after a send.");
    late_applies_ = total("late_applies_total", "Applies later than send + tau (the global arrived late).");
    received_ = total("globals_received_total", "Global fragments received from the syncer.");
    ignored_ = total("globals_ignored_total", "Received messages ignored (foreign plan, bad size, old version).");
    heartbeats_ = total("heartbeats_total", "Heartbeats sent (nothing else sent for a heartbeat interval).");
    rejoins_ = total("rejoins_total", "Joins again because the syncer did not know this learner (after a restore).");
    payload_ = total("contribution_bytes_total", "Payload bytes of the messages this learner sent.");
    pulls_ = total("pulls_total", "Pull requests received from the syncer (pull rounds).");
    pulls_repeated_ = total("pulls_repeated_total",
                            "Second asks of a pull already answered, answered again (the first answer may be lost).");
    metadata_ = total("metadata_sent_total", "Metadata messages sent (pull rounds: one per inner step).");
    deferred_ = total("pull_deferred_steps_total",
                      "Steps a pull's answer waited for a global on its way (its base older than the syncer anchors at).");
    auto hist = [&](const char* name, const char* help) {
      const auto b = staleness_bounds();
      return TotalHistogram(histogram_family(r, std::string("ddiloco_learner_") + name, help).Add(labels_, b),
                            b.size() + 1);
    };
    staleness_ = hist("staleness_versions",
                      "Per apply: versions the global moved past the base the sent gradient was computed from "
                      "(1 = only the merge holding it).");
    delay_ = hist("apply_delay_steps", "Per apply: inner steps from the send to the apply (tau when on time).");
  }

  LearnerMetrics(const LearnerMetrics&) = delete;
  LearnerMetrics& operator=(const LearnerMetrics&) = delete;

  void update(const OuterLoopStatus& s) {
    std::lock_guard lock(mutex_);
    update_locked(s);
  }
  /// The same, plus the transport's frame counters (ZmqLearnerTransport::counters()).
  template <TransportCounterSet C>
  void update(const OuterLoopStatus& s, const C& transport) {
    std::lock_guard lock(mutex_);
    update_locked(s);
    if (!transport_) transport_.emplace(*registry_, "ddiloco_learner_", labels_);
    transport_->set(transport);
    if constexpr (requires { transport.payload_buffers_reused; }) {
      if (!buffers_reused_)
        buffers_reused_.emplace(
            detail::counter_family(*registry_, "ddiloco_learner_payload_buffers_reused_total",
                                   "Received globals decoded into a vector an earlier global used, not fresh memory.")
                .Add(labels_));
      buffers_reused_->set(transport.payload_buffers_reused);
    }
  }

 private:
  void update_locked(const OuterLoopStatus& s) {
    steps_.set(s.step);
    tokens_.set(s.tokens);
    sends_.set(s.sends);
    send_failures_.set(s.send_failures);
    applies_.set(s.applies);
    late_applies_.set(s.late_applies);
    received_.set(s.received);
    ignored_.set(s.ignored);
    heartbeats_.set(s.heartbeats);
    rejoins_.set(s.rejoins);
    payload_.set(s.bytes_sent);
    pulls_.set(s.pulls);
    pulls_repeated_.set(s.pulls_repeated);
    metadata_.set(s.metadata_sent);
    deferred_.set(s.pulls_deferred_steps);
    staleness_.set(s.staleness_versions);
    delay_.set(s.apply_delay_steps);
  }

  std::mutex mutex_;
  prometheus::Registry* registry_;
  prometheus::Labels labels_;
  std::optional<detail::TransportSeries> transport_;  ///< registered at the first update with transport counters
  std::optional<detail::TotalCounter> buffers_reused_;
  detail::TotalCounter steps_, tokens_, sends_, send_failures_, applies_, late_applies_, received_, ignored_,
      heartbeats_, payload_, rejoins_, pulls_, pulls_repeated_, metadata_, deferred_;
  detail::TotalHistogram staleness_, delay_;
};

/// Serves `registry` over HTTP at http://ADDR:PORT/metrics. `listen` is
/// "ADDR:PORT" (e.g. "127.0.0.1:9100", "0.0.0.0:9100"; port 0 picks a free
/// port, see port()). `before_scrape`, when given, runs at every scrape
/// before the registry is read (to update() the metrics from a live status);
/// it runs on the server's threads. Throws InvalidArgument for a malformed
/// address and TransportError when the address cannot be bound.
class MetricsServer {
 public:
  MetricsServer(const std::string& listen, std::shared_ptr<prometheus::Registry> registry,
                std::function<void()> before_scrape = {})
      : collectable_(std::make_shared<Refreshing>(std::move(registry), std::move(before_scrape))) {
    check_address(listen);
    try {
      exposer_ = std::make_unique<prometheus::Exposer>(listen, 2);
    } catch (const std::exception& e) {
      throw TransportError(detail::msg("metrics: cannot serve on '", listen, "' (", e.what(),
                                       "): is the port in use or the address not on this host? Use another "
                                       "port, or port 0 for any free one"));
    }
    exposer_->RegisterCollectable(collectable_);
    const auto ports = exposer_->GetListeningPorts();
    if (ports.empty()) throw TransportError(detail::msg("metrics: '", listen, "' bound no port"));
    port_ = static_cast<std::uint16_t>(ports.front());
    host_ = listen.substr(0, listen.rfind(':'));
  }

  /// The port listened on (the one picked when `listen` asked for port 0).
  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  /// "ADDR:PORT" with the actual port.
  [[nodiscard]] std::string address() const { return host_ + ":" + std::to_string(port_); }

  /// Throws InvalidArgument unless `listen` looks like ADDR:PORT with PORT in [0, 65535].
  static void check_address(const std::string& listen) {
    const auto colon = listen.rfind(':');
    const std::string port = colon == std::string::npos ? "" : listen.substr(colon + 1);
    bool digits = !port.empty() && port.size() <= 5;
    for (char c : port) digits = digits && c >= '0' && c <= '9';
    if (colon == 0 || !digits || std::stoul(port) > 65535)
      throw InvalidArgument(detail::msg("metrics address '", listen,
                                        "': expected ADDR:PORT, e.g. 127.0.0.1:9100 or 0.0.0.0:9100 (port 0: "
                                        "any free port)"));
  }

 private:
  class Refreshing : public prometheus::Collectable {
   public:
    Refreshing(std::shared_ptr<prometheus::Registry> r, std::function<void()> f)
        : registry_(std::move(r)), refresh_(std::move(f)) {}
    std::vector<prometheus::MetricFamily> Collect() const override {
      // A failing refresh must not take the HTTP thread down: the scrape then
      // serves the values of the previous update.
      try {
        if (refresh_) refresh_();
      } catch (...) {
      }
      return registry_->Collect();
    }

   private:
    std::shared_ptr<prometheus::Registry> registry_;
    std::function<void()> refresh_;
  };

  std::shared_ptr<Refreshing> collectable_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::uint16_t port_ = 0;
  std::string host_;
};

}  // namespace ddiloco
