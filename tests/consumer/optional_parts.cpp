// A downstream program that uses ddiloco's optional parts, linked only with
// ddiloco's own targets (ddiloco::zmq, ddiloco::eigen, ddiloco::reference):
// proves the package brings libzmq (zmq_curve_keypair must link) and Eigen.
#include <ddiloco/adapters/eigen.hpp>
#include <ddiloco/reference/char_lm.hpp>
#include <ddiloco/transport/zmq.hpp>
#include <ddiloco/version.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const ddiloco::CurveKeys keys = ddiloco::generate_curve_keys();  // libzmq at link and run time
  if (keys.public_key.size() != 40 || keys.secret_key.size() != 40) {
    std::puts("consumer_optional: CURVE keys are not 40 Z85 characters");
    return 1;
  }

  Eigen::MatrixXf m = Eigen::MatrixXf::Constant(2, 3, 0.5f);  // the Eigen adapter
  std::vector<float> flat(ddiloco::tensor_size(m));
  ddiloco::read_tensor(m, flat);
  if (flat != std::vector<float>(6, 0.5f)) {
    std::puts("consumer_optional: Eigen tensor round trip failed");
    return 1;
  }

  ddiloco::reference::CharLm model({});  // the reference model (Eigen)
  const auto params = model.init(/*seed=*/1);
  ddiloco::reference::Batch batch;
  batch.size = 1;
  batch.context = model.config().context;
  batch.contexts.assign(batch.context, 0);
  batch.targets.assign(1, 0);
  const double loss = model.loss(params, batch);
  if (!std::isfinite(loss) || loss <= 0.0) {
    std::printf("consumer_optional: reference model loss %g is not a positive number\n", loss);
    return 1;
  }
  std::printf("consumer_optional: ok (ddiloco %s, %zu-parameter reference model, loss %.3f)\n",
              DDILOCO_VERSION_STRING, model.parameter_count(), loss);
  return 0;
}
