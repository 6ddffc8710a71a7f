// ddiloco/transport/bounds.hpp: the syncer's buffer bounds derived from a plan.
//
// What it is: the sizes ZmqSyncerTransport's defaults take from the plan
// (size_for_plan in transport/zmq.hpp) and the capacity planner
// (sim/capacity.hpp) adds to a shard's memory, computed in one place without
// ZeroMQ. docs/operations.md, "Memory bounds", explains each.
// What it is not: a transport.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <ddiloco/codec.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/shard_map.hpp>
#include <ddiloco/wire.hpp>

namespace ddiloco {

namespace detail {
/// The largest frame carrying `elements` payload elements in any codec.
inline std::size_t largest_frame(std::size_t elements) {
  std::size_t bytes = 0;
  for (std::uint8_t c = 0; is_valid_codec(c); ++c) bytes = std::max(bytes, encoded_size(static_cast<Codec>(c), elements));
  return kFrameHeaderSize + bytes;
}
}  // namespace detail

/// With F the largest frame (a contribution or global of the plan's largest
/// fragment in fp32, the widest codec) and S a full state in fp32 (every
/// fragment's frame):
///   largest_elements    = the largest fragment's elements, max_message_size = F;
///   peer_send_budget    = max(2 F, min(8 S, 64 MiB));
///   send_budget         = max(peer_send_budget, min(64 peer_send_budget, 1 GiB));
///   peer_receive_budget = 2 S (ZMQ_RCVHWM = max(4, 2 S / F) messages);
///   incoming_max_bytes  = max(4 F, min(64 S, 256 MiB)).
struct SyncerBufferBounds {
  std::size_t largest_elements = 0;
  std::size_t max_message_size = 0;
  std::size_t peer_send_budget = 0;
  std::size_t send_budget = 0;
  std::size_t peer_receive_budget = 0;
  std::size_t incoming_max_bytes = 0;
};

/// The bounds of a syncer serving fragments of these sizes (elements each).
inline SyncerBufferBounds syncer_buffer_bounds(std::span<const std::size_t> fragment_numels) {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  std::size_t largest = 0, state = 0;
  for (const std::size_t numel : fragment_numels) {
    largest = std::max(largest, numel);
    state += detail::largest_frame(numel);
  }
  SyncerBufferBounds b;
  const std::size_t frame = detail::largest_frame(largest);
  b.largest_elements = largest;
  b.max_message_size = frame;
  b.peer_send_budget = std::max(2 * frame, std::min(8 * state, 64 * MiB));
  b.send_budget = std::max(b.peer_send_budget, std::min(64 * b.peer_send_budget, 1024 * MiB));
  b.peer_receive_budget = 2 * state;
  b.incoming_max_bytes = std::max(4 * frame, std::min(64 * state, 256 * MiB));
  return b;
}

/// The bounds of a syncer serving every fragment of `plan`.
inline SyncerBufferBounds syncer_buffer_bounds(const Plan& plan) {
  std::vector<std::size_t> numels;
  numels.reserve(plan.num_fragments());
  for (const auto& f : plan.fragments()) numels.push_back(f.numel);
  return syncer_buffer_bounds(numels);
}

/// The bounds of syncer shard `shard` of `map`: its own fragments only.
inline SyncerBufferBounds syncer_buffer_bounds(const Plan& plan, const ShardMap& map, std::size_t shard) {
  std::vector<std::size_t> numels;
  for (const std::size_t p : map.fragments_of(shard)) numels.push_back(plan.fragments()[p].numel);
  return syncer_buffer_bounds(numels);
}

}  // namespace ddiloco
