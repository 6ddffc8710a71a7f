// EXPECT-ERROR: this Eigen object is not contiguous storage
// A Map with an inner stride skips elements of the user's buffer.
#include <Eigen/Core>
#include <vector>

#include <ddiloco/adapters/eigen.hpp>

void read_every_other(float* buffer, std::vector<float>& out) {
  Eigen::Map<Eigen::VectorXf, 0, Eigen::InnerStride<2>> every_other(buffer, 4);
  ddiloco::read_tensor(every_other, out);
}
