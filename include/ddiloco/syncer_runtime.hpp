// ddiloco/syncer_runtime.hpp: drives a Syncer from a transport with threads.
//
// What it is: the syncer's event loop. One receive thread takes messages off
// the transport and handles control messages (join, heartbeat, leave) inline;
// contributions and merges go to a small worker pool, so receiving never
// stalls behind a large merge (the Syncer locks per fragment, so different
// fragments are accumulated and merged in parallel). It wakes at the syncer's
// next deadline (grace expiry, heartbeat time-out) and prints nothing itself:
// a status callback receives a SyncerStatus every `status_every`.
// What it is not: the state machine (syncer.hpp) or a transport.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <thread>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/detail/thread_pool.hpp>
#include <ddiloco/message.hpp>
#include <ddiloco/syncer.hpp>

namespace ddiloco {

struct SyncerRuntimeConfig {
  std::size_t workers = 2;  ///< merge worker threads (0: everything on the receive thread)
  Duration poll = std::chrono::milliseconds(50);  ///< longest sleep between two looks at the clock
  Duration status_every = std::chrono::seconds(5);
  std::function<void(const SyncerStatus&)> on_status;  ///< progress output (optional)
};

template <class SyncerT, class Transport>
  requires SyncerTransport<Transport>
class SyncerRuntime {
 public:
  SyncerRuntime(SyncerT& syncer, Transport& transport, SyncerRuntimeConfig config = {})
      : syncer_(&syncer),
        transport_(&transport),
        config_(std::move(config)),
        pool_(config_.workers),
        scheduled_(syncer.plan().num_fragments()) {
    for (auto& s : scheduled_) s.store(false);
  }
  SyncerRuntime(const SyncerRuntime&) = delete;
  SyncerRuntime& operator=(const SyncerRuntime&) = delete;
  ~SyncerRuntime() { stop(); }

  /// Starts the receive thread.
  void start() {
    if (thread_.joinable()) return;
    thread_ = std::jthread([this](std::stop_token st) { loop(st); });
  }

  /// Stops receiving, then waits for the workers to finish what they have.
  void stop() {
    if (!thread_.joinable()) return;
    thread_.request_stop();
    thread_.join();
    pool_.wait_idle();
  }

  /// Runs the loop on the calling thread until `st` is stopped.
  void run(std::stop_token st) {
    loop(st);
    pool_.wait_idle();
  }

  [[nodiscard]] std::uint64_t send_failures() const noexcept { return send_failures_.load(); }
  [[nodiscard]] std::size_t task_failures() const noexcept { return pool_.failures(); }

 private:
  void flush(Outbox& out) {
    for (auto& o : out)
      if (!transport_->send_to(o.to, std::move(o.message))) send_failures_.fetch_add(1);
    out.clear();
  }

  void loop(std::stop_token st) {
    const Clock& clock = transport_->clock();
    TimePoint next_status = clock.now() + config_.status_every;
    Outbox out;
    while (!st.stop_requested()) {
      TimePoint deadline = clock.now() + config_.poll;
      if (auto wake = syncer_->next_wakeup(); wake && *wake < deadline) deadline = *wake;
      if (auto m = transport_->receive_until(deadline)) {
        if (m->type == MessageType::contribution) {
          // Keyed by fragment: one fragment's contributions are handled in arrival order.
          const std::size_t key = m->fragment;
          pool_.submit(key, [this, msg = std::move(*m)] {
            Outbox local;
            syncer_->handle(msg, local);
            flush(local);
          });
        } else {
          syncer_->handle(*m, out);
          flush(out);
        }
      }
      syncer_->expire_learners();
      const TimePoint now = clock.now();
      for (std::size_t p : syncer_->due_fragments(now)) {
        if (scheduled_[p].exchange(true)) continue;  // a merge task for p is already queued
        pool_.submit(p, [this, p] {
          scheduled_[p].store(false);
          Outbox local;
          syncer_->merge_if_due(p, local);
          flush(local);
        });
      }
      if (config_.on_status && now >= next_status) {
        config_.on_status(syncer_->status());
        next_status = now + config_.status_every;
      }
    }
  }

  SyncerT* syncer_;
  Transport* transport_;
  SyncerRuntimeConfig config_;
  detail::ThreadPool pool_;
  std::vector<std::atomic<bool>> scheduled_;
  std::atomic<std::uint64_t> send_failures_{0};
  std::jthread thread_;
};

}  // namespace ddiloco
