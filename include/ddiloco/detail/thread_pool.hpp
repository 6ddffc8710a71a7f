// ddiloco/detail/thread_pool.hpp: a small fixed-size worker pool.
//
// What it is: N threads draining one FIFO of tasks; `wait_idle()` blocks until
// every submitted task has finished. With N = 0 tasks run inline in submit(),
// which single-threaded deterministic drivers rely on.
// What it is not: a work-stealing scheduler or a future/promise library.
// Exceptions escaping a task are caught and counted; the pool keeps running.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ddiloco::detail {

class ThreadPool {
 public:
  explicit ThreadPool(std::size_t threads) {
    workers_.reserve(threads);
    for (std::size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    for (auto& w : workers_) w.join();
  }

  [[nodiscard]] std::size_t size() const noexcept { return workers_.size(); }

  void submit(std::function<void()> task) {
    if (workers_.empty()) {
      run(task);
      return;
    }
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(task));
      ++pending_;
    }
    ready_.notify_one();
  }

  /// Blocks until every task submitted so far has finished.
  void wait_idle() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return pending_ == 0; });
  }

  [[nodiscard]] std::size_t failures() const noexcept { return failures_.load(); }

 private:
  void run(std::function<void()>& task) {
    try {
      task();
    } catch (...) {
      failures_.fetch_add(1);
    }
  }

  void work() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopping and drained
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      run(task);
      {
        std::lock_guard lock(mutex_);
        if (--pending_ == 0) idle_.notify_all();
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_, idle_;
  std::deque<std::function<void()>> tasks_;
  std::size_t pending_ = 0;
  bool stopping_ = false;
  std::atomic<std::size_t> failures_{0};
  std::vector<std::thread> workers_;
};

}  // namespace ddiloco::detail
