// EXPECT-ERROR: this xtensor type is a view or expression, not a container
// An xt::strided_view picks elements out of its container: not contiguous storage.
#include <vector>
#include <xtensor/xstrided_view.hpp>
#include <xtensor/xtensor.hpp>

#include <ddiloco/adapters/xtensor.hpp>

void read_strided(xt::xtensor<float, 2>& t, std::vector<float>& out) {
  auto column = xt::strided_view(t, {xt::all(), 1});
  ddiloco::read_tensor(column, out);
}
