// ddiloco/layout.hpp: where each tensor sits inside a fragment's flat buffer.
//
// What it is: the small vocabulary shared by the fragmenter (which produces a
// layout per fragment) and the merge rules (which work per tensor, and treat
// embedding tensors differently). A fragment's flat buffer is the
// concatenation of its tensors in ascending tensor index order.
// What it is not: a tensor type; segments describe ranges of a std::span<float>.
#pragma once

#include <cstddef>
#include <span>

namespace ddiloco {

/// One tensor's range inside a fragment's flat fp32 buffer.
struct TensorSegment {
  std::size_t offset = 0;  ///< first element inside the fragment buffer
  std::size_t size = 0;    ///< number of elements
  /// merged with a plain weighted average (docs/algorithm.md, "Radial-Directional Averaging")
  bool embedding = false;

  friend bool operator==(const TensorSegment&, const TensorSegment&) = default;
};

/// Total number of elements covered by a layout (the fragment buffer's size).
inline std::size_t layout_size(std::span<const TensorSegment> layout) noexcept {
  std::size_t end = 0;
  for (const auto& s : layout) {
    if (s.offset + s.size > end) end = s.offset + s.size;
  }
  return end;
}

}  // namespace ddiloco
