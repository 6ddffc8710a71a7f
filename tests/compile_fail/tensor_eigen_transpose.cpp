// EXPECT-ERROR: this Eigen object is not contiguous storage
// .transpose() is an expression over the matrix, not storage in the transposed order.
#include <Eigen/Core>
#include <cstddef>

#include <ddiloco/adapters/eigen.hpp>

std::size_t size_of_transpose(const Eigen::MatrixXf& m) {
  return ddiloco::tensor_size(m.transpose());
}
