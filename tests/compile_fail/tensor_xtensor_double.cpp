// EXPECT-ERROR: this xtensor expression's value_type is not float
// ddiloco works on fp32 storage: an xt::xarray<double> is rejected by name.
#include <vector>
#include <xtensor/xarray.hpp>

#include <ddiloco/adapters/xtensor.hpp>

void write_double(xt::xarray<double>& t, const std::vector<float>& in) {
  ddiloco::write_tensor(t, in);
}
