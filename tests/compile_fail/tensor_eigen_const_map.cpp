// EXPECT-ERROR: this Eigen Map/Ref is read-only
// ddiloco writes merged parameters back, so a Map<const ...> cannot be a model tensor.
#include <Eigen/Core>
#include <cstddef>

#include <ddiloco/adapters/eigen.hpp>

std::size_t size_of_const_map(const float* buffer) {
  Eigen::Map<const Eigen::VectorXf> map(buffer, 4);
  return ddiloco::tensor_size(map);
}
