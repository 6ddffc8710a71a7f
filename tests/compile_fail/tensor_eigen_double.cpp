// EXPECT-ERROR: this Eigen object's Scalar type is not float
// ddiloco works on fp32 storage: an Eigen::MatrixXd is rejected by name.
#include <Eigen/Core>
#include <vector>

#include <ddiloco/adapters/eigen.hpp>

void write_double(Eigen::MatrixXd& m, const std::vector<float>& in) {
  ddiloco::write_tensor(m, in);
}
