// Tests for ddiloco/adapters/torch.hpp: a libtorch module's parameters through
// OuterLoop and a real Syncer on the in-process network, pumped by hand on a
// virtual clock (as in tests/test_outer_loop.cpp), plus the adapter's refusals.
//
// Reference values are hand-computed and exact in fp32: the "inner step"
// subtracts 1/8, 2/8, 3/8 from every element of tensors w, b, c, and the
// syncer (K = 1, no grace, uniform weights, plain average, AverageOnly) turns
// one contribution into the sender's local fragment at send time.
//
// Devices: this machine has no GPU, so only CPU tensors are exercised; the
// non-CPU branch (.to(kCPU) to read, copy_ on the device to write) is not run
// here. A CUDA build should add a case that moves the module to the GPU.
#include <ddiloco/adapters/torch.hpp>

#include <ddiloco/outer_loop.hpp>
#include <ddiloco/syncer.hpp>
#include <ddiloco/transport/in_process.hpp>

#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

using namespace ddiloco;
using namespace std::chrono_literals;

static_assert(StagedTensor<torch::Tensor>);
static_assert(!HostTensor<torch::Tensor>);
static_assert(Tensor<torch::Tensor>);

namespace {

using Flat = std::vector<float>;
using Outer = OuterLoop<InProcessLearnerTransport, torch::Tensor>;
using TestSyncer = Syncer<WeightedAverage, AverageOnly, UniformWeights>;

// In the order of Module::parameters(): the module's own parameter c (2) first,
// then its child's fc.weight (2x2) and fc.bias (2). LPT puts fc.weight into
// fragment 0 and c, fc.bias into fragment 1.
Plan small_plan() { return make_plan({{"c", 2, false}, {"fc.weight", 4, false}, {"fc.bias", 2, false}}, 2); }
constexpr std::size_t kC = 0, kW = 1, kB = 2;
const std::vector<Flat> kInit = {{7, 8}, {1, 2, 3, 4}, {5, 6}};
constexpr float kRate[3] = {0.375f, 0.125f, 0.25f};

// A module with exactly those parameters, in plan order.
struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  torch::Tensor c;
  NetImpl() {
    fc = register_module("fc", torch::nn::Linear(2, 2));
    c = register_parameter("c", torch::zeros({2}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x) + c; }
};
TORCH_MODULE(Net);

Flat concat(const std::vector<Flat>& tensors) {
  Flat flat;
  for (const auto& t : tensors) flat.insert(flat.end(), t.begin(), t.end());
  return flat;
}

Flat values(const torch::Tensor& t) {
  const auto c = t.detach().contiguous();
  return Flat(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// The user's inner step: a known change of every parameter, in place.
void inner_step(std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  for (std::size_t t = 0; t < params.size(); ++t) params[t].sub_(kRate[t]);
}

SyncerConfig one_per_round() {
  SyncerConfig c;
  c.round = RoundMode::push;
  c.quorum.min_quorum = 1;
  c.quorum.grace = false;
  c.participation_scaling = false;
  return c;
}

OuterLoopConfig learner_config(LearnerId id) {
  OuterLoopConfig c;
  c.round = RoundMode::push;
  c.id = id;
  c.sync_every = 4;  // H = 4, P = 2: fragment 1 sent at steps 2, 6; fragment 0 at 4, 8
  c.overlap = 1;
  return c;
}

struct Rig {
  VirtualClock clock;
  Plan plan = small_plan();
  InProcessNetwork net{clock, FaultTape{}, 1024};
  InProcessSyncerTransport link = net.syncer();
  TestSyncer syncer{plan, concat(kInit), clock, one_per_round()};
  Outbox out;

  Rig() {
    REQUIRE(plan.fragments()[0].tensors == std::vector<std::size_t>{kW});
    REQUIRE(plan.fragments()[1].tensors == std::vector<std::size_t>{kC, kB});
  }

  void pump() {
    while (auto m = link.try_receive()) {
      syncer.handle(*m, out);
      for (auto& o : out) link.send_to(o.to, std::move(o.message));
      out.clear();
    }
  }

  void join(Outer& outer, std::vector<torch::Tensor>& params, std::span<const std::string> names = {}) {
    outer.begin_join(params, names);
    for (int i = 0; i < 16; ++i) {
      pump();
      if (outer.poll_join(params)) return;
      clock.advance(1ms);
    }
    FAIL("the learner did not finish joining within 16 rounds");
  }
};

std::string error_of(const auto& call) {
  try {
    call();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no InvalidArgument thrown";
}

}  // namespace

TEST_CASE("A module's parameters round-trip through fragments and stay the same tensors", "[adapters][torch]") {
  torch::manual_seed(0);
  Net net;
  std::vector<torch::Tensor> params = net->parameters();
  REQUIRE(params.size() == 3);
  std::vector<const void*> impls, storage;
  for (const auto& p : params) {
    impls.push_back(p.unsafeGetTensorImpl());
    storage.push_back(p.data_ptr());
  }

  std::vector<std::string> names;
  for (const auto& item : net->named_parameters()) names.push_back(item.key());
  REQUIRE(names == std::vector<std::string>{"c", "fc.weight", "fc.bias"});

  Rig r;
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1));
  r.join(outer, params, names);
  for (std::size_t t = 0; t < 3; ++t) CHECK(values(params[t]) == kInit[t]);
  // The module sees the joined values: fc(0) + c = bias + c.
  CHECK(values(net->forward(torch::zeros({1, 2}))) == Flat{12.0f, 14.0f});

  for (int t = 1; t <= 5; ++t) {
    inner_step(params);
    outer.step(params, 1);
    r.pump();
  }
  // Fragment 1 sent at 2 (b = {4.5, 5.5}, c = {6.25, 7.25}), applied at 3, then
  // two more steps; fragment 0 sent at 4 (w = init - 4/8), applied at 5.
  CHECK(values(params[kW]) == Flat{0.5f, 1.5f, 2.5f, 3.5f});
  CHECK(values(params[kB]) == Flat{4.0f, 5.0f});
  CHECK(values(params[kC]) == Flat{5.5f, 6.5f});
  CHECK(r.syncer.global_parameters() == Flat{6.25f, 7.25f, 0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f});
  CHECK(outer.status().sends == 2);

  // Same objects: the module's own parameter list, impl and storage unchanged.
  const auto now = net->parameters();
  for (std::size_t t = 0; t < 3; ++t) {
    CHECK(now[t].unsafeGetTensorImpl() == impls[t]);
    CHECK(now[t].data_ptr() == storage[t]);
    CHECK(now[t].requires_grad());
    CHECK(now[t].is_leaf());
  }
}

TEST_CASE("After ddiloco writes a global, autograd and AdamW still train the same parameters", "[adapters][torch]") {
  torch::manual_seed(1);
  Net net;
  std::vector<torch::Tensor> params = net->parameters();
  torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(0.1));
  Rig r;
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1));
  r.join(outer, params);
  Flat w_sent;
  for (int t = 1; t <= 5; ++t) {
    adamw.zero_grad();
    const auto loss = net->forward(torch::ones({4, 2})).pow(2).sum();
    loss.backward();
    for (const auto& p : params) REQUIRE(p.grad().defined());
    const Flat before = values(params[kC]);
    adamw.step();
    CHECK(values(params[kC]) != before);  // the optimizer moves the very tensors ddiloco writes
    if (t == 4) w_sent = values(params[kW]);  // fragment 0 is sent at step 4
    outer.step(params, 4);
    r.pump();
  }
  CHECK(outer.status().sends == 2);
  CHECK(outer.status().applies == 2 + 2);  // join writes both fragments, then one global each
  // K = 1 with AverageOnly: the global of fragment 0 is w as sent at step 4; applied at step 5
  // (tau = 1) it overwrites what AdamW did at step 5.
  CHECK(values(params[kW]) == w_sent);
}

TEST_CASE("Tensors of another dtype are refused with InvalidArgument naming the dtype and shape",
          "[adapters][torch]") {
  Flat buffer(6);
  SECTION("float64") {
    torch::Tensor t = torch::zeros({2, 3}, torch::kFloat64);
    const auto what = error_of([&] { (void)tensor_size(t); });
    CHECK_THAT(what, Catch::Contains("Double") && Catch::Contains("[2, 3]") && Catch::Contains("float32") &&
                         Catch::Contains("name"));
    CHECK_THROWS_AS(read_tensor(t, std::span<float>(buffer)), InvalidArgument);
    CHECK_THROWS_AS(write_tensor(t, std::span<const float>(buffer)), InvalidArgument);
  }
  SECTION("int32") {
    torch::Tensor t = torch::zeros({6}, torch::kInt32);
    CHECK_THAT(error_of([&] { (void)tensor_size(t); }), Catch::Contains("Int") && Catch::Contains("[6]"));
    CHECK_THROWS_AS(write_tensor(t, std::span<const float>(buffer)), InvalidArgument);
  }
  SECTION("int64") {
    torch::Tensor t = torch::zeros({3, 2}, torch::kInt64);
    CHECK_THAT(error_of([&] { (void)tensor_size(t); }), Catch::Contains("Long") && Catch::Contains("[3, 2]"));
  }
  SECTION("a float64 module is refused at join, before anything is written") {
    Net net;
    net->to(torch::kFloat64);
    std::vector<torch::Tensor> params = net->parameters();
    Rig r;
    auto lt = r.net.learner(1);
    Outer outer(r.plan, lt, learner_config(1));
    CHECK_THROWS_AS(outer.begin_join(params), InvalidArgument);
  }
}

TEST_CASE("A non-contiguous view is refused with InvalidArgument naming its shape and strides",
          "[adapters][torch]") {
  torch::Tensor base = torch::arange(6, torch::kFloat32).reshape({2, 3});
  torch::Tensor transposed = base.t();
  REQUIRE_FALSE(transposed.is_contiguous());
  Flat buffer(6);
  CHECK_THAT(error_of([&] { (void)tensor_size(transposed); }),
             Catch::Contains("[3, 2]") && Catch::Contains("strides [1, 3]") && Catch::Contains("not contiguous"));
  CHECK_THROWS_AS(read_tensor(transposed, std::span<float>(buffer)), InvalidArgument);
  CHECK_THROWS_AS(write_tensor(transposed, std::span<const float>(buffer)), InvalidArgument);
  CHECK(values(base) == Flat{0, 1, 2, 3, 4, 5});  // nothing was written

  torch::Tensor column = base.select(1, 0);  // stride 3
  CHECK_THROWS_AS(tensor_size(column), InvalidArgument);
  torch::Tensor undefined;
  CHECK_THAT(error_of([&] { (void)tensor_size(undefined); }), Catch::Contains("undefined"));
}

TEST_CASE("CPU tensors are read and written in row-major order, in place", "[adapters][torch]") {
  // Only CPU here (no GPU on the test machine); see the comment at the top.
  torch::Tensor t = torch::zeros({2, 3});
  const void* storage = t.data_ptr();
  CHECK(tensor_size(t) == 6);
  const Flat src = {1, 2, 3, 4, 5, 6};
  write_tensor(t, std::span<const float>(src));
  CHECK(t.data_ptr() == storage);
  CHECK(t.index({1, 0}).item<float>() == 4.0f);  // row-major: element (1, 0) is the 4th
  Flat dst(6);
  read_tensor(t, std::span<float>(dst));
  CHECK(dst == src);
  Flat wrong(5);
  CHECK_THROWS_AS(read_tensor(t, std::span<float>(wrong)), ShapeMismatch);
  // A contiguous slice along the first dimension is a contiguous view: written in place.
  torch::Tensor row = t.select(0, 1);
  REQUIRE(row.is_contiguous());
  const Flat r = {7, 8, 9};
  write_tensor(row, std::span<const float>(r));
  CHECK(values(t) == Flat{1, 2, 3, 7, 8, 9});
}
