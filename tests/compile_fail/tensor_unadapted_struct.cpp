// EXPECT-ERROR: this type is not an adapted tensor
// A type nobody specialised ddiloco::tensor_traits for is refused with a pointer
// to the adapter headers and to <ddiloco/tensor.hpp>.
#include <cstddef>

#include <ddiloco/tensor.hpp>

struct MyLayerWeights {
  float values[16];
};

std::size_t size_of(const MyLayerWeights& w) { return ddiloco::tensor_size(w); }
