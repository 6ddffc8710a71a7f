// EXPECT-ERROR: this Eigen object is not contiguous storage
// An Eigen expression (a + b) has no storage of its own: ddiloco refuses it at
// compile time and says to .eval() it or to use a contiguous Map.
#include <Eigen/Core>
#include <vector>

#include <ddiloco/adapters/eigen.hpp>

void read_sum(const Eigen::VectorXf& a, const Eigen::VectorXf& b, std::vector<float>& out) {
  ddiloco::read_tensor(a + b, out);
}
