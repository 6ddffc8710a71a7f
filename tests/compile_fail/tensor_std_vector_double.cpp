// EXPECT-ERROR: std::vector<T> with T other than float is not fp32 storage
// A std::vector<double> is not silently converted: the user converts it first.
#include <vector>

#include <ddiloco/tensor.hpp>

void read_doubles(const std::vector<double>& v, std::vector<float>& out) {
  ddiloco::read_tensor(v, out);
}
