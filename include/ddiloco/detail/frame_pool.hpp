// ddiloco/detail/frame_pool.hpp: frame buffers kept warm between a learner's sends.
//
// What it is: FramePool and FrameBlock, the buffers ZmqLearnerTransport writes
// its frames into (and lends to OuterLoop for the payload, see
// ContributionBufferTransport). Reusing them avoids a page fault per 4 KiB of
// every multi-MiB frame. What it is not: tied to ZeroMQ (bench/bench_syncer.cpp
// uses it without a socket).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>

namespace ddiloco::detail {

class FramePool;

/// One frame buffer of a learner's send, given back to its pool when the last
/// owner (the sender's message, then ZeroMQ until the frame is on the wire)
/// lets go.
struct FrameBlock {
  std::unique_ptr<std::byte[]> data;
  std::size_t capacity = 0;  ///< bytes allocated
  std::size_t size = 0;      ///< bytes of this frame
  std::shared_ptr<FramePool> pool;
  FrameBlock() = default;
  FrameBlock(const FrameBlock&) = delete;
  FrameBlock& operator=(const FrameBlock&) = delete;
  ~FrameBlock();
};

/// Frame buffers kept warm between a learner's sends. A multi-MiB frame in
/// fresh memory costs a page fault per 4 KiB page (a 64 MiB frame: ~30 ms
/// here, more than writing it twice); a buffer ZeroMQ gives back once the
/// frame is sent is reused by the next frame of a similar size. At most kIdle
/// buffers wait here; frames under kMinPooled come from malloc as usual.
/// Thread-safe: buffers come back on ZeroMQ's I/O thread.
class FramePool : public std::enable_shared_from_this<FramePool> {
 public:
  static constexpr std::size_t kMinPooled = std::size_t{1} << 20;
  static constexpr std::size_t kIdle = 2;

  /// A frame buffer of `size` bytes (not zero-filled): an idle one holding
  /// between size and 2 * size bytes, else a new one.
  std::shared_ptr<FrameBlock> acquire(std::size_t size) {
    auto block = std::make_shared<FrameBlock>();
    block->size = size;
    if (size >= kMinPooled) {
      block->pool = shared_from_this();
      std::lock_guard lock(mutex_);
      for (auto it = idle_.begin(); it != idle_.end(); ++it) {
        if (it->second >= size && it->second / 2 <= size) {
          block->data = std::move(it->first);
          block->capacity = it->second;
          idle_.erase(it);
          ++reused_;
          return block;
        }
      }
    }
    block->data.reset(new std::byte[size]);
    block->capacity = size;
    return block;
  }

  /// Takes a buffer back, dropping the oldest idle one beyond kIdle.
  void give_back(std::unique_ptr<std::byte[]> data, std::size_t capacity) {
    std::unique_ptr<std::byte[]> dropped;  // freed outside the lock
    std::lock_guard lock(mutex_);
    idle_.emplace_back(std::move(data), capacity);
    if (idle_.size() > kIdle) {
      dropped = std::move(idle_.front().first);
      idle_.pop_front();
    }
  }

  /// Frames that reused an idle buffer, and buffers idle now (observability, tests).
  [[nodiscard]] std::uint64_t reused() const {
    std::lock_guard lock(mutex_);
    return reused_;
  }
  [[nodiscard]] std::size_t idle() const {
    std::lock_guard lock(mutex_);
    return idle_.size();
  }

 private:
  mutable std::mutex mutex_;
  std::deque<std::pair<std::unique_ptr<std::byte[]>, std::size_t>> idle_;
  std::uint64_t reused_ = 0;
};

inline FrameBlock::~FrameBlock() {
  if (pool && data) pool->give_back(std::move(data), capacity);
}

}  // namespace ddiloco::detail
