// A downstream program: proves that the installed / add_subdirectory'd
// ddiloco target gives the headers and C++20 without further set-up.
#include <ddiloco/ddiloco.hpp>

#include <cstdio>
#include <vector>

int main() {
  std::vector<float> weights(8, 1.0f);
  std::vector<float> copy(ddiloco::tensor_size(weights));
  ddiloco::read_tensor(weights, copy);
  if (copy != weights) {
    std::puts("consumer: tensor round trip failed");
    return 1;
  }
  std::puts("consumer: ok");
  return 0;
}
