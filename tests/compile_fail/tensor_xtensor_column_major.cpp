// EXPECT-ERROR: this xtensor container is not row-major
// ddiloco flattens in row-major order; a column-major container is rejected by name.
#include <cstddef>
#include <xtensor/xtensor.hpp>

#include <ddiloco/adapters/xtensor.hpp>

std::size_t size_of_column_major(const xt::xtensor<float, 2, xt::layout_type::column_major>& t) {
  return ddiloco::tensor_size(t);
}
