// EXPECT-ERROR: std::span<const float> is read-only
// ddiloco writes merged parameters back, so a model tensor must be mutable.
#include <cstddef>
#include <span>

#include <ddiloco/tensor.hpp>

std::size_t size_of_const_span(std::span<const float> weights) {
  return ddiloco::tensor_size(weights);
}
