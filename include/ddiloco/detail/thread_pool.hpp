// ddiloco/detail/thread_pool.hpp: a small fixed-size worker pool.
//
// What it is: N threads, each draining its own FIFO of tasks. `submit(key,
// task)` sends every task with the same key to the same worker, so tasks of
// one key run one at a time and in submission order (the syncer keys by
// fragment: two contributions of one learner to one fragment are handled in
// the order they arrived; with one shared queue two workers could take them
// concurrently and the later one could win, rejecting the earlier as a
// duplicate). `wait_idle()` blocks until every submitted task has finished.
// With N = 0 tasks run inline in submit(), which single-threaded
// deterministic drivers rely on.
// What it is not: a work-stealing scheduler or a future/promise library.
// Exceptions escaping a task are caught and counted; the pool keeps running.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ddiloco::detail {

class ThreadPool {
 public:
  explicit ThreadPool(std::size_t threads) {
    queues_.reserve(threads);
    for (std::size_t i = 0; i < threads; ++i) queues_.push_back(std::make_unique<Queue>());
    workers_.reserve(threads);
    for (std::size_t i = 0; i < threads; ++i) workers_.emplace_back([this, i] { work(*queues_[i]); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    for (auto& q : queues_) {
      {
        std::lock_guard lock(q->mutex);
        q->stopping = true;
      }
      q->ready.notify_all();
    }
    for (auto& w : workers_) w.join();
  }

  [[nodiscard]] std::size_t size() const noexcept { return workers_.size(); }

  /// Runs `task` on the worker of `key` (inline when the pool has no workers).
  void submit(std::size_t key, std::function<void()> task) {
    if (workers_.empty()) {
      run(task);
      return;
    }
    {
      std::lock_guard lock(idle_mutex_);
      ++pending_;
    }
    Queue& q = *queues_[key % queues_.size()];
    {
      std::lock_guard lock(q.mutex);
      q.tasks.push_back(std::move(task));
    }
    q.ready.notify_one();
  }

  /// Runs `task` on the next worker in turn.
  void submit(std::function<void()> task) { submit(next_.fetch_add(1), std::move(task)); }

  /// Blocks until every task submitted so far has finished.
  void wait_idle() {
    std::unique_lock lock(idle_mutex_);
    idle_.wait(lock, [this] { return pending_ == 0; });
  }

  [[nodiscard]] std::size_t failures() const noexcept { return failures_.load(); }

 private:
  struct Queue {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<std::function<void()>> tasks;
    bool stopping = false;
  };

  void run(std::function<void()>& task) {
    try {
      task();
    } catch (...) {
      failures_.fetch_add(1);
    }
  }

  void work(Queue& q) {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(q.mutex);
        q.ready.wait(lock, [&q] { return q.stopping || !q.tasks.empty(); });
        if (q.tasks.empty()) return;  // stopping and drained
        task = std::move(q.tasks.front());
        q.tasks.pop_front();
      }
      run(task);
      {
        std::lock_guard lock(idle_mutex_);
        if (--pending_ == 0) idle_.notify_all();
      }
    }
  }

  std::vector<std::unique_ptr<Queue>> queues_;
  std::mutex idle_mutex_;
  std::condition_variable idle_;
  std::size_t pending_ = 0;
  std::atomic<std::size_t> next_{0};
  std::atomic<std::size_t> failures_{0};
  std::vector<std::thread> workers_;
};

}  // namespace ddiloco::detail
