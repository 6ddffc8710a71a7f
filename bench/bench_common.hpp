// bench/bench_common.hpp: helpers the benchmark programs share.
#pragma once

#include <ddiloco/layout.hpp>

#include <cstddef>
#include <vector>

namespace ddiloco::bench {

/// Six tensors over n elements: an embedding of n/4, then 3n/8, n/8, n/8,
/// n/16 and the rest (a transformer-like mix of large and small tensors).
inline std::vector<TensorSegment> make_layout(std::size_t n) {
  const std::size_t sizes[] = {n / 4, 3 * n / 8, n / 8, n / 8, n / 16};
  std::vector<TensorSegment> layout;
  std::size_t offset = 0;
  for (std::size_t k = 0; k < 5; ++k) {
    layout.push_back({offset, sizes[k], k == 0});
    offset += sizes[k];
  }
  layout.push_back({offset, n - offset, false});
  return layout;
}

}  // namespace ddiloco::bench
