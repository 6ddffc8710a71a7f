// programs/metrics.hpp: the --metrics and --metrics-file flags of ddiloco_syncer
// and ddiloco_learner (Prometheus metrics over HTTP; docs/metrics.md).
//
// The series themselves are defined once, in <ddiloco/metrics/prometheus.hpp>;
// this file only turns the flags into a MetricsServer, prints where it
// listens and writes that to --metrics-file. Built without prometheus-cpp
// (DDILOCO_WITH_PROMETHEUS undefined), the programs still build and run, and
// a non-empty --metrics is an error that says how to get the metrics.
#pragma once

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

#include <ddiloco/error.hpp>
#include <ddiloco/message.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/syncer.hpp>

#if DDILOCO_WITH_PROMETHEUS
#include <ddiloco/metrics/prometheus.hpp>
#endif

#include "cli.hpp"

namespace ddiloco::cli {

inline void add_metrics_flags(Flags& f) {
#if DDILOCO_WITH_PROMETHEUS
  const std::string availability;
#else
  const std::string availability = " [this build has no metrics: it was built without prometheus-cpp-dev]";
#endif
  f.add("metrics", "",
        "serve Prometheus metrics at http://ADDR:PORT/metrics, e.g. 0.0.0.0:9100 (port 0: any free port; "
        "empty: no metrics); see docs/metrics.md" + availability);
  f.add("metrics-file", "", "write the metrics address actually served (ADDR:PORT) to this file once listening");
}

/// Checks --metrics before anything starts: a malformed address, or metrics
/// asked of a build without prometheus-cpp, is an error naming the fix.
inline void check_metrics_flags(const Flags& f, const char* program) {
  const std::string& listen = f.str("metrics");
  if (listen.empty()) return;
#if DDILOCO_WITH_PROMETHEUS
  (void)program;
  MetricsServer::check_address(listen);
#else
  throw InvalidArgument("--metrics '" + listen + "': this " + program +
                        " was built without prometheus-cpp; install it (Debian: apt-get install "
                        "prometheus-cpp-dev), reconfigure and rebuild, or leave --metrics empty");
#endif
}

namespace metrics_detail {
#if DDILOCO_WITH_PROMETHEUS
/// Starts the server, says where it listens (stdout and --metrics-file).
inline std::unique_ptr<MetricsServer> serve_metrics(const Flags& f, const std::string& who,
                                                    std::shared_ptr<prometheus::Registry> registry,
                                                    std::function<void()> before_scrape = {}) {
  auto server = std::make_unique<MetricsServer>(f.str("metrics"), std::move(registry), std::move(before_scrape));
  std::printf("%s: metrics on http://%s/metrics\n", who.c_str(), server->address().c_str());
  std::fflush(stdout);
  if (const std::string& path = f.str("metrics-file"); !path.empty()) {
    std::ofstream(path + ".tmp") << server->address() << "\n";
    std::filesystem::rename(path + ".tmp", path);
  }
  return server;
}
#endif
}  // namespace metrics_detail

/// The syncer's metrics, when --metrics is given. Declare it after the
/// syncer and its transport: it must stop serving before they go.
class SyncerMetricsFlag {
 public:
  SyncerMetricsFlag(const Flags& f, [[maybe_unused]] std::size_t min_quorum, [[maybe_unused]] bool checkpoints,
                    [[maybe_unused]] RoundMode round = RoundMode::push)
      : flags_(&f) {
    check_metrics_flags(f, "ddiloco_syncer");
#if DDILOCO_WITH_PROMETHEUS
    if (!f.str("metrics").empty())
      metrics_ = std::make_unique<SyncerMetrics>(
          *registry_, SyncerMetricsOptions{.min_quorum = min_quorum, .checkpoints = checkpoints, .round = round});
#endif
  }

  /// The counters count from `s` (a syncer restored from a checkpoint).
  void baseline([[maybe_unused]] const SyncerStatus& s) {
#if DDILOCO_WITH_PROMETHEUS
    if (metrics_) metrics_->baseline(s);
#endif
  }

  /// Starts serving; every scrape first updates the series from
  /// syncer.status() and link.counters() (both thread-safe).
  template <class S, class L>
  void serve([[maybe_unused]] S& syncer, [[maybe_unused]] L& link) {
#if DDILOCO_WITH_PROMETHEUS
    if (!metrics_) return;
    server_ = metrics_detail::serve_metrics(*flags_, "syncer", registry_,
                                    [this, &syncer, &link] { metrics_->update(syncer.status(), link.counters()); });
#endif
  }

  /// A checkpoint was written (the checkpoint age restarts).
  void checkpoint_written() {
#if DDILOCO_WITH_PROMETHEUS
    if (metrics_) metrics_->checkpoint_written();
#endif
  }

 private:
  const Flags* flags_;
#if DDILOCO_WITH_PROMETHEUS
  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  std::unique_ptr<SyncerMetrics> metrics_;
  std::unique_ptr<MetricsServer> server_;  // last: stops serving before the metrics go
#endif
};

/// A learner's metrics, when --metrics is given. OuterLoop::status() is not
/// thread-safe, so the training loop calls update(); scrapes read the registry.
class LearnerMetricsFlag {
 public:
  LearnerMetricsFlag(const Flags& f, [[maybe_unused]] LearnerId id) {
    check_metrics_flags(f, "ddiloco_learner");
#if DDILOCO_WITH_PROMETHEUS
    if (f.str("metrics").empty()) return;
    metrics_ = std::make_unique<LearnerMetrics>(*registry_, id);
    server_ = metrics_detail::serve_metrics(f, "learner " + std::to_string(id), registry_);
#endif
  }

  template <class C>
  void update([[maybe_unused]] const OuterLoopStatus& s, [[maybe_unused]] const C& transport_counters) {
#if DDILOCO_WITH_PROMETHEUS
    if (metrics_) metrics_->update(s, transport_counters);
#endif
  }

 private:
#if DDILOCO_WITH_PROMETHEUS
  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  std::unique_ptr<LearnerMetrics> metrics_;
  std::unique_ptr<MetricsServer> server_;
#endif
};

}  // namespace ddiloco::cli
