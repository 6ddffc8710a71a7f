// ddiloco/syncer_runtime.hpp: drives a Syncer from a transport with threads.
//
// What it is: the syncer's event loop. One receive thread takes messages off
// the transport and handles control messages (join, heartbeat, leave) inline;
// contributions and merges go to a small worker pool, so receiving never
// stalls behind a large merge (the Syncer locks per fragment, so different
// fragments are accumulated and merged in parallel). It wakes at the syncer's
// next deadline (grace expiry, heartbeat time-out) and prints nothing itself:
// a status callback receives a SyncerStatus every `status_every` (steady
// clock) on a thread of its own, so a callback that blocks (stdout to a full
// pipe, a status file on a disk busy with writeback) never stalls receiving.
// What it is not: the state machine (syncer.hpp) or a transport.
//
// Contributions are batched per fragment. Each fragment has a queue; a
// contribution is appended to its fragment's queue and, if no drain task for
// that fragment is pending, one is submitted to the pool keyed by the
// fragment. The drain task takes everything queued for its fragment and
// passes it to Syncer::handle_batch, which validates each message as handle()
// does and folds the accepted ones with one add_batch call. Invariants: at
// most one drain task per fragment is pending or running (the `scheduled`
// flag, set and cleared under the queue's lock, so a message appended while a
// drain runs is either taken by it or by the task it submits next: never
// lost, never handled twice); a fragment's messages are handled in the order
// they were queued (one drain at a time, each taking the queue front to back);
// a drain that finds more queued after its batch re-submits itself at the back
// of its worker's queue, so a busy fragment does not starve the others.
// Semantic change from one task per contribution: contributions that queue up
// while a merge or a batch of their fragment is running are folded together
// and land in ONE merge, even at K = 1 (see Syncer::handle_batch). When the
// workers keep up, batches hold one contribution and nothing changes.
//
// Bounded: the contributions queued for the workers (all fragments together)
// are at most SyncerRuntimeConfig::max_queued messages and max_queued_bytes
// bytes, plus the one message that crosses the bound. While they are over, the
// receive thread takes nothing more from the transport (it keeps ticking the
// syncer): the transport's own bound then stops it reading the network, and
// TCP pushes back on the senders (docs/operations.md, "Memory bounds").
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
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
  /// Progress output (optional), called on the runtime's status thread.
  std::function<void(const SyncerStatus&)> on_status;
  /// Contributions waiting for the workers, all fragments together: beyond
  /// either bound the receive thread stops taking messages until they drain.
  std::size_t max_queued = 4096;
  std::size_t max_queued_bytes = std::size_t{256} << 20;
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
    if (config_.max_queued == 0 || config_.max_queued_bytes == 0)
      throw InvalidArgument(detail::msg("SyncerRuntimeConfig: max_queued = ", config_.max_queued,
                                        " and max_queued_bytes = ", config_.max_queued_bytes,
                                        " must be > 0 (defaults 4096 and 256 MiB)"));
    for (auto& s : scheduled_) s.store(false);
    queues_.reserve(syncer.plan().num_fragments());
    for (std::size_t p = 0; p < syncer.plan().num_fragments(); ++p) queues_.push_back(std::make_unique<Queue>());
  }
  SyncerRuntime(const SyncerRuntime&) = delete;
  SyncerRuntime& operator=(const SyncerRuntime&) = delete;
  ~SyncerRuntime() { stop(); }

  /// Starts the receive thread (and the status thread, with on_status).
  void start() {
    if (thread_.joinable()) return;
    thread_ = std::jthread([this](std::stop_token st) { loop(st); });
    if (config_.on_status) status_thread_ = std::jthread([this](std::stop_token st) { report(st); });
  }

  /// Stops receiving, then waits for the workers to finish what they have
  /// (also what deliver() queued without a receive thread).
  void stop() {
    for (std::jthread* t : {&status_thread_, &thread_})
      if (t->joinable()) {
        t->request_stop();
        t->join();
      }
    pool_.wait_idle();
  }

  /// Runs the loop on the calling thread until `st` is stopped (the status
  /// callback on a thread of its own meanwhile).
  void run(std::stop_token st) {
    {
      std::jthread status;
      if (config_.on_status) status = std::jthread([this](std::stop_token s) { report(s); });
      loop(st);
    }
    pool_.wait_idle();
  }

  /// Handles one message as if the transport had delivered it: a contribution
  /// to a known fragment is queued for its fragment's drain task, anything else
  /// is handled on the calling thread (replies sent through the transport).
  /// Thread-safe; the receive loop calls it for every message it takes.
  void deliver(Message m) {
    if (m.type == MessageType::contribution && m.fragment < queues_.size()) {
      const std::size_t p = m.fragment;
      Queue& q = *queues_[p];
      {
        std::lock_guard room(room_mutex_);
        ++queued_;
        queued_bytes_ += queued_size(m);
      }
      // Its learner's step reports, handled first, must not ask for it again.
      if constexpr (requires { syncer_->note_queued(m); }) syncer_->note_queued(m);
      {
        std::lock_guard lock(q.mutex);
        q.pending.push_back(std::move(m));
        if (q.scheduled) return;  // the pending or running drain will take it
        q.scheduled = true;
      }
      submit_drain(p);
      return;
    }
    Outbox out;
    syncer_->handle(m, out);
    flush(out);
  }

  /// Blocks until every queued contribution and submitted merge task has been
  /// handled (the receive thread may still add more).
  void wait_idle() { pool_.wait_idle(); }

  [[nodiscard]] std::uint64_t send_failures() const noexcept { return send_failures_.load(); }
  /// Times the receive thread paused because the queued contributions reached
  /// their bound, and what is queued now (messages, bytes).
  [[nodiscard]] std::uint64_t receive_pauses() const noexcept { return receive_pauses_.load(); }
  [[nodiscard]] std::pair<std::size_t, std::size_t> queued() const {
    std::lock_guard room(room_mutex_);
    return {queued_, queued_bytes_};
  }
  [[nodiscard]] std::size_t task_failures() const noexcept { return pool_.failures(); }

 private:
  void flush(Outbox& out) {
    for (auto& o : out)
      if (!transport_->send_to(o.to, std::move(o.message))) send_failures_.fetch_add(1);
    out.clear();
  }

  /// What a queued contribution holds in memory.
  static std::size_t queued_size(const Message& m) noexcept { return sizeof(Message) + m.payload_bytes(); }

  /// The queued contributions are at their bound. Caller holds room_mutex_.
  [[nodiscard]] bool full_locked() const noexcept {
    return queued_ >= config_.max_queued || queued_bytes_ >= config_.max_queued_bytes;
  }

  /// Handled contributions leave the bound.
  void release(const std::vector<Message>& batch) {
    std::size_t bytes = 0;
    for (const Message& m : batch) bytes += queued_size(m);
    {
      std::lock_guard room(room_mutex_);
      queued_ -= batch.size();
      queued_bytes_ -= bytes;
    }
    room_.notify_all();
  }

  struct Queue {
    std::mutex mutex;
    std::vector<Message> pending;  ///< queued contributions, arrival order
    bool scheduled = false;        ///< a drain task is pending or running
  };

  void submit_drain(std::size_t p) {
    pool_.submit(p, [this, p] { drain(p); });
  }

  /// Handles everything queued for fragment p as one batch. Then, if more
  /// arrived meanwhile, goes again: inline when the pool has no workers, else
  /// by re-submitting itself (other fragments on this worker get their turn).
  void drain(std::size_t p) {
    Queue& q = *queues_[p];
    std::vector<Message> batch;
    for (;;) {
      {
        std::lock_guard lock(q.mutex);
        if (q.pending.empty()) {
          q.scheduled = false;
          return;
        }
        batch.swap(q.pending);
      }
      Outbox out;
      try {
        syncer_->handle_batch(batch, out);
      } catch (...) {
        // A throwing batch is counted by the pool; keep the queue alive.
        release(batch);
        batch.clear();
        flush(out);
        finish_or_resubmit(q, p);
        throw;
      }
      release(batch);
      batch.clear();
      flush(out);
      if (pool_.size() > 0) return finish_or_resubmit(q, p);
    }
  }

  /// Clears `scheduled` if nothing is queued, else submits the next drain.
  void finish_or_resubmit(Queue& q, std::size_t p) {
    {
      std::lock_guard lock(q.mutex);
      if (q.pending.empty()) {
        q.scheduled = false;
        return;
      }
    }
    submit_drain(p);
  }

  /// The status thread: on_status every status_every until stopped.
  void report(std::stop_token st) {
    std::mutex m;
    std::condition_variable_any cv;
    std::unique_lock lock(m);
    while (!cv.wait_for(lock, st, config_.status_every, [] { return false; }) && !st.stop_requested())
      config_.on_status(syncer_->status());
  }

  void loop(std::stop_token st) {
    const Clock& clock = transport_->clock();
    while (!st.stop_requested()) {
      TimePoint deadline = clock.now() + config_.poll;
      if (auto wake = syncer_->next_wakeup(); wake && *wake < deadline) deadline = *wake;
      bool full = false;
      {
        std::unique_lock room(room_mutex_);
        if (full_locked()) {
          // Back-pressure: leave the messages in the transport until the
          // workers drain (at most one poll interval, then tick again).
          full = true;
          receive_pauses_.fetch_add(1);
          room_.wait_for(room, config_.poll, [&] { return !full_locked() || st.stop_requested(); });
        }
      }
      if (!full)
        if (auto m = transport_->receive_until(deadline)) deliver(std::move(*m));
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
    }
  }

  SyncerT* syncer_;
  Transport* transport_;
  SyncerRuntimeConfig config_;
  detail::ThreadPool pool_;
  std::vector<std::atomic<bool>> scheduled_;   ///< per fragment: a merge task is queued
  std::vector<std::unique_ptr<Queue>> queues_;  ///< per fragment: contributions waiting for a drain
  std::atomic<std::uint64_t> send_failures_{0};
  mutable std::mutex room_mutex_;  ///< guards queued_ and queued_bytes_
  std::condition_variable room_;   ///< notified when queued contributions are handled
  std::size_t queued_ = 0, queued_bytes_ = 0;
  std::atomic<std::uint64_t> receive_pauses_{0};
  std::jthread thread_;
  std::jthread status_thread_;  ///< with on_status: report()
};

}  // namespace ddiloco
