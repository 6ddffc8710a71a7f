// Tests for ddiloco/outer_loop.hpp: the learner side, driven in one thread on a
// virtual clock. A real Syncer sits behind the in-process network and is pumped
// by hand, so each test decides exactly when the syncer hears a contribution
// and when its answer reaches the learner. No threads, no sleeps.
//
// Reference values are hand-computed. To keep them exact in fp32, the "inner
// step" subtracts a multiple of 1/8 from every element (rate 1/8, 2/8, 3/8 for
// tensors w, b, c), and the syncer is configured so that a merge of one
// contribution gives back the sender's local fragment at send time:
// K = 1 without grace, uniform weights, plain average, AverageOnly
// (Theta <- Theta - v with v = base - local = Theta - local).
#include <ddiloco/outer_loop.hpp>

#include <ddiloco/adapters/eigen.hpp>
#include <ddiloco/syncer.hpp>
#include <ddiloco/transport/in_process.hpp>

#include <Eigen/Core>
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

/// A tensor ddiloco can only reach through host copies (the staged form of
/// <ddiloco/tensor.hpp>, like a GPU tensor): OuterLoop must take its copy path.
struct DeviceTensor {
  std::vector<float> device;
};

template <>
struct ddiloco::tensor_traits<DeviceTensor> {
  static std::size_t size(const DeviceTensor& t) { return t.device.size(); }
  static void copy_to_host(const DeviceTensor& t, std::span<float> dst) {
    std::copy(t.device.begin(), t.device.end(), dst.begin());
  }
  static void copy_from_host(DeviceTensor& t, std::span<const float> src) {
    std::copy(src.begin(), src.end(), t.device.begin());
  }
};

using namespace ddiloco;
using namespace std::chrono_literals;

static_assert(LearnerTransport<InProcessLearnerTransport>);
static_assert(SyncerTransport<InProcessSyncerTransport>);

namespace {

using Flat = std::vector<float>;
using VecParams = std::vector<Flat>;
using Outer = OuterLoop<InProcessLearnerTransport, Flat>;
using TestSyncer = Syncer<WeightedAverage, AverageOnly, UniformWeights>;

// Three tensors, two fragments. BalancedGreedy (LPT) puts w (4) into fragment
// 0, then b (2) and c (2) into the lighter fragment 1, at offsets 0 and 2.
Plan small_plan() { return make_plan({{"w", 4, false}, {"b", 2, false}, {"c", 2, false}}, 2); }
constexpr std::size_t kW = 0, kB = 1, kC = 2;  // tensor indices in plan order

// The syncer's initial state, tensor by tensor.
const std::vector<Flat> kInit = {{1, 2, 3, 4}, {5, 6}, {7, 8}};
// Per-step decrease of every element of tensor t in the user's "inner step".
constexpr float kRate[3] = {0.125f, 0.25f, 0.375f};

Flat concat(const std::vector<Flat>& tensors) {
  Flat flat;
  for (const auto& t : tensors) flat.insert(flat.end(), t.begin(), t.end());
  return flat;
}

// Tensor t as it is locally after `steps` inner steps from the initial state
// (no global applied in between): init - steps * rate.
Flat local_after(std::size_t t, double steps) {
  Flat v = kInit[t];
  for (float& x : v) x = static_cast<float>(x - steps * kRate[t]);
  return v;
}

template <class T>
Flat values(const T& t) {
  Flat v(tensor_size(t));
  read_tensor(t, std::span<float>(v));
  return v;
}

// The user's inner step: a known change of every parameter.
template <class T>
void inner_step(std::vector<T>& params) {
  for (std::size_t t = 0; t < params.size(); ++t) {
    Flat v = values(params[t]);
    for (float& x : v) x -= kRate[t];
    write_tensor(params[t], std::span<const float>(v));
  }
}

VecParams zero_params() { return {Flat(4, 0.0f), Flat(2, 0.0f), Flat(2, 0.0f)}; }

SyncerConfig one_per_round() {
  SyncerConfig c;
  c.round = RoundMode::push;
  c.quorum.min_quorum = 1;
  c.quorum.grace = false;
  // Merges here hold one of several joined learners; the hand-computed values
  // assume the merged outer gradient is applied whole.
  c.participation_scaling = false;
  return c;
}

OuterLoopConfig learner_config(LearnerId id, std::size_t tau, float alpha = 0.0f) {
  OuterLoopConfig c;
  c.round = RoundMode::push;
  c.id = id;
  c.sync_every = 4;  // H = 4, P = 2: fragment 0 at steps 4, 8, ...; fragment 1 at 2, 6, ...
  c.overlap = tau;
  c.alpha = alpha;
  return c;
}

template <class S = TestSyncer>
struct BasicRig {
  VirtualClock clock;
  Plan plan = small_plan();
  InProcessNetwork net;
  InProcessSyncerTransport link;
  S syncer;
  Outbox out;
  std::vector<Message> seen;  ///< every message the syncer handled, in order

  explicit BasicRig(std::size_t capacity = 1024, FaultTape tape = {}, SyncerConfig config = one_per_round())
      : net(clock, std::move(tape), capacity), link(net.syncer()), syncer(plan, concat(kInit), clock, config) {
    REQUIRE(plan.fragments()[0].tensors == std::vector<std::size_t>{kW});
    REQUIRE(plan.fragments()[1].tensors == std::vector<std::size_t>{kB, kC});
  }

  /// Lets the syncer handle everything deliverable now and sends its replies.
  std::size_t pump() {
    std::size_t n = 0;
    while (auto m = link.try_receive()) {
      seen.push_back(*m);
      syncer.handle(*m, out);
      for (auto& o : out) link.send_to(o.to, std::move(o.message));
      out.clear();
      ++n;
    }
    return n;
  }

  /// Takes what reached the syncer without handling it (a syncer that never
  /// answers), less the heartbeats (the first step's report after a join and
  /// the liveness ones) unless `heartbeats`.
  std::vector<Message> intercept(bool heartbeats = false) {
    std::vector<Message> got;
    while (auto m = link.try_receive())
      if (heartbeats || m->type != MessageType::heartbeat) got.push_back(std::move(*m));
    return got;
  }

  std::vector<Message> contributions() const {
    std::vector<Message> c;
    for (const auto& m : seen)
      if (m.type == MessageType::contribution) c.push_back(m);
    return c;
  }

  /// begin_join + pumping + poll_join, advancing the clock by `tick` between
  /// rounds so that messages with latency get delivered.
  template <class O, class P>
  void join(O& outer, P& params, Duration tick = 1ms) {
    outer.begin_join(params);
    for (int i = 0; i < 16; ++i) {
      pump();
      if (outer.poll_join(params)) return;
      clock.advance(tick);
    }
    FAIL("the learner did not finish joining within 16 rounds");
  }

  /// Tensor t of the syncer's global model.
  Flat global_tensor(std::size_t t) const {
    const auto flat = syncer.global_parameters();
    std::size_t off = 0;
    for (std::size_t i = 0; i < t; ++i) off += plan.tensors()[i].numel;
    return Flat(flat.begin() + static_cast<std::ptrdiff_t>(off),
                flat.begin() + static_cast<std::ptrdiff_t>(off + plan.tensors()[t].numel));
  }
};
using Rig = BasicRig<>;

// Globals applied after sends: join's writes of the full state (one per
// fragment) are counted in status().applies too, so tests count from there.
template <class O>
std::uint64_t applies_since_join(const O& outer) {
  return outer.status().applies - outer.schedule().num_fragments();
}

Flat payload(const Message& m) { return m.payload ? *m.payload : Flat{}; }

Flat filled(std::size_t n, float v) { return Flat(n, v); }

/// Learner 1 (push rounds, tau = 1) joined to a fresh Rig's syncer.
struct JoinedLearner {
  Rig r;
  InProcessLearnerTransport lt = r.net.learner(1);
  Outer outer{r.plan, lt, learner_config(1, 1)};
  VecParams params = zero_params();
  JoinedLearner() { r.join(outer, params); }
};

}  // namespace

// ---- contracts --------------------------------------------------------------

TEST_CASE("step() before join() throws StateError", "[outer_loop]") {
  Rig r;
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 1));
  VecParams params = zero_params();
  CHECK_THROWS_AS(outer.step(params, 1), StateError);
  CHECK_THROWS_WITH(outer.step(params, 1), Catch::Contains("join"));
  CHECK(outer.poll(params) == 0);  // poll before join does nothing
}

TEST_CASE("Parameters that do not match the plan throw ShapeMismatch naming the tensor", "[outer_loop]") {
  Rig r;
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 1));

  SECTION("a missing tensor at join") {
    VecParams params = {Flat(4), Flat(2)};
    CHECK_THROWS_AS(outer.begin_join(params), ShapeMismatch);
    CHECK_THROWS_WITH(outer.begin_join(params), Catch::Contains("got 2 parameter tensors") &&
                                                    Catch::Contains("plan has 3"));
  }
  SECTION("one tensor of the wrong size at join") {
    VecParams params = {Flat(4), Flat(3), Flat(2)};
    CHECK_THROWS_AS(outer.begin_join(params), ShapeMismatch);
    CHECK_THROWS_WITH(outer.begin_join(params), Catch::Contains("'b'") && Catch::Contains("3 elements"));
  }
  SECTION("names that differ from the plan's at join") {
    VecParams params = zero_params();
    const std::vector<std::string> names = {"w", "bias", "c"};
    CHECK_THROWS_AS(outer.begin_join(params, names), ShapeMismatch);
    CHECK_THROWS_WITH(outer.begin_join(params, names), Catch::Contains("'bias'") && Catch::Contains("'b'"));
    const std::vector<std::string> too_few = {"w", "b"};
    CHECK_THROWS_AS(outer.begin_join(params, too_few), ShapeMismatch);
    const std::vector<std::string> right = {"w", "b", "c"};
    CHECK_NOTHROW(outer.begin_join(params, right));
  }
  SECTION("a tensor resized after join, at a step that neither sends nor applies") {
    VecParams params = zero_params();
    r.join(outer, params);
    params[kC].resize(5);
    // Step 1 is no send slot (fragments are due at 2 and 4): the check must not
    // wait for the next send of c's fragment.
    CHECK_THROWS_AS(outer.step(params, 1), ShapeMismatch);
    CHECK_THROWS_WITH(outer.step(params, 1), Catch::Contains("'c'") && Catch::Contains("5 elements"));
    CHECK(outer.status().step == 0);  // the failed call did not count as a step
  }
  SECTION("a tensor missing after join") {
    VecParams params = zero_params();
    r.join(outer, params);
    VecParams fewer = {params[kW], params[kB]};
    CHECK_THROWS_AS(outer.step(fewer, 1), ShapeMismatch);
  }
}

TEST_CASE("Negative or zero tokens throw InvalidArgument naming the value and the fix", "[outer_loop]") {
  Rig r;
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 1));
  VecParams params = zero_params();
  r.join(outer, params);
  CHECK_THROWS_AS(outer.step(params, -1), InvalidArgument);
  CHECK_THROWS_WITH(outer.step(params, -3), Catch::Contains("-3"));
  // 0 would give the contribution no weight (tokens^2 / steps): refused, not silently weightless.
  CHECK_THROWS_AS(outer.step(params, 0), InvalidArgument);
  CHECK_THROWS_WITH(outer.step(params, 0), Catch::Contains("tokens = 0") && Catch::Contains("no weight") &&
                                               Catch::Contains("batch x sequence length"));
  CHECK(outer.status().step == 0);  // refused before anything changed
  CHECK_NOTHROW(outer.step(params, 1));
  CHECK(outer.status().step == 1);
}

TEST_CASE("A transport that failed permanently makes step() throw TransportError", "[outer_loop]") {
  Rig r;
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 1));
  VecParams params = zero_params();
  r.join(outer, params);
  outer.step(params, 1);
  r.net.shutdown();
  CHECK_THROWS_AS(outer.step(params, 1), TransportError);
  CHECK_THROWS_WITH(outer.step(params, 1), Catch::Contains("failed permanently"));
}

TEST_CASE("Bad configuration is rejected with InvalidArgument naming the field", "[outer_loop]") {
  Rig r;
  auto lt = r.net.learner(1);
  for (float alpha : {1.0f, 1.5f, -0.1f, std::numeric_limits<float>::quiet_NaN()}) {
    INFO("alpha = " << alpha);
    CHECK_THROWS_AS(Outer(r.plan, lt, learner_config(1, 1, alpha)), InvalidArgument);
    CHECK_THROWS_WITH(Outer(r.plan, lt, learner_config(1, 1, alpha)), Catch::Contains("alpha"));
  }
  CHECK_NOTHROW(Outer(r.plan, lt, learner_config(1, 1, 0.0f)));
  CHECK_NOTHROW(Outer(r.plan, lt, learner_config(1, 1, 0.999f)));

  auto c = learner_config(1, 1);
  c.join_timeout = Duration{-1};
  CHECK_THROWS_WITH(Outer(r.plan, lt, c), Catch::Contains("join_timeout"));
  c.join_timeout = Duration{0};  // derived: fine
  CHECK_NOTHROW(Outer(r.plan, lt, c));
  for (double mbit : {0.0, -5.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    INFO("join_link_mbit = " << mbit);
    c.join_link_mbit = mbit;
    CHECK_THROWS_AS(Outer(r.plan, lt, c), InvalidArgument);
    CHECK_THROWS_WITH(Outer(r.plan, lt, c), Catch::Contains("join_link_mbit") && Catch::Contains("--join-link-mbit"));
  }
  c = learner_config(1, 4);  // tau = H
  CHECK_THROWS_AS(Outer(r.plan, lt, c), InvalidArgument);
  c = learner_config(1, 1);
  c.sync_every = 1;  // P = 2 > H = 1
  CHECK_THROWS_AS(Outer(r.plan, lt, c), InvalidArgument);
}

// ---- join -------------------------------------------------------------------

namespace {
/// A syncer link on a virtual clock that a test scripts: waiting moves the
/// clock (to the deadline, or to the next scripted delivery), so join()'s own
/// deadline and retries run in virtual time. Counts the joins sent.
class ScriptedLink {
 public:
  explicit ScriptedLink(VirtualClock& clock) : clock_(&clock) {}
  bool send(Message&& m) {
    if (m.type == MessageType::join) join_times.push_back(clock_->now());
    return true;
  }
  std::optional<Message> try_receive() {
    if (!script.empty() && script.front().first <= clock_->now()) {
      Message m = std::move(script.front().second);
      script.erase(script.begin());
      return m;
    }
    return std::nullopt;
  }
  std::optional<Message> receive_until(TimePoint deadline) {
    if (auto m = try_receive()) return m;
    clock_->advance_to(script.empty() ? deadline : std::min(deadline, script.front().first));
    return try_receive();
  }
  [[nodiscard]] bool failed() const { return false; }
  [[nodiscard]] const Clock& clock() const { return *clock_; }

  std::vector<std::pair<TimePoint, Message>> script;  ///< (delivery time, message), in time order
  std::vector<TimePoint> join_times;                  ///< when each join request went out

 private:
  VirtualClock* clock_;
};
static_assert(LearnerTransport<ScriptedLink>);

/// Fragment p of the syncer's initial state as the join reply carries it.
Message full_state(const Plan& plan, std::size_t p, LearnerId to, std::uint64_t sequence) {
  const Flat init = concat(kInit);
  Message m;
  m.type = MessageType::full_state;
  m.fingerprint = plan.fingerprint();
  m.learner = to;
  m.fragment = static_cast<std::uint32_t>(p);
  m.version = 1;
  m.sequence = sequence;
  Flat values;
  for (std::size_t t : plan.fragments()[p].tensors) {
    std::size_t off = 0;
    for (std::size_t i = 0; i < t; ++i) off += plan.tensors()[i].numel;
    values.insert(values.end(), init.begin() + static_cast<std::ptrdiff_t>(off),
                  init.begin() + static_cast<std::ptrdiff_t>(off + plan.tensors()[t].numel));
  }
  m.payload = make_payload(std::move(values));
  return m;
}
}  // namespace

TEST_CASE("join_timeout 0 derives the time-out from the state's size and the declared link", "[outer_loop][join]") {
  // A plan of 2 x 16 Mi floats: 128 MiB + 2 headers of state.
  const Plan big = make_plan({{"a", std::size_t{1} << 24, false}, {"b", std::size_t{1} << 24, false}}, 2);
  const std::uint64_t bytes = full_state_bytes(big);
  CHECK(bytes == 2 * (kFrameHeaderSize + 4 * (std::uint64_t{1} << 24)));
  // 30 s + 2 x (bytes x 8 / link): at 100 Mbit/s 128 MiB is 10.74 s on the wire.
  const double wire_s = static_cast<double>(bytes) * 8.0 / 100e6;
  CHECK(std::chrono::duration<double>(derived_join_timeout(bytes, 100.0)).count() ==
        Approx(30.0 + 2.0 * wire_s).epsilon(1e-9));
  // Ten times slower, ten times the wire time; 1 GiB at 100 Mbit/s: 30 + 2 x 85.9 s.
  CHECK(std::chrono::duration<double>(derived_join_timeout(bytes, 10.0)).count() ==
        Approx(30.0 + 20.0 * wire_s).epsilon(1e-9));
  CHECK(std::chrono::duration<double>(derived_join_timeout(std::uint64_t{1} << 30, 100.0)).count() ==
        Approx(30.0 + 2.0 * 8.0 * 1073741824.0 / 100e6).epsilon(1e-9));
  CHECK_THROWS_WITH(derived_join_timeout(bytes, 0.0), Catch::Contains("link_mbit = 0") &&
                                                         Catch::Contains("--join-link-mbit"));

  VirtualClock clock;
  ScriptedLink link(clock);
  OuterLoopConfig c = learner_config(1, 1);
  c.join_link_mbit = 10.0;
  OuterLoop<ScriptedLink, Flat> derived(big, link, c);
  CHECK(derived.join_timeout() == derived_join_timeout(bytes, 10.0));
  c.join_timeout = 7s;  // an explicit value wins
  OuterLoop<ScriptedLink, Flat> explicit_timeout(big, link, c);
  CHECK(explicit_timeout.join_timeout() == 7s);
}

TEST_CASE("A join nobody answers times out at the derived deadline, naming size, link and flag",
          "[outer_loop][join]") {
  VirtualClock clock;
  ScriptedLink link(clock);
  const Plan plan = small_plan();
  OuterLoopConfig c = learner_config(1, 1);
  c.join_link_mbit = 0.001;  // 1 kbit/s: the 2 fragments (8 floats + 2 headers = 208 bytes) take 1.664 s
  OuterLoop<ScriptedLink, Flat> outer(plan, link, c);
  const Duration expected = derived_join_timeout(full_state_bytes(plan), 0.001);
  REQUIRE(std::chrono::duration<double>(expected).count() == Approx(30.0 + 2.0 * 1.664));
  VecParams params = zero_params();
  std::string what;
  try {
    outer.join(params);
  } catch (const TransportError& e) {
    what = e.what();
  }
  CHECK(clock.now() == expected);  // given up exactly at the derived deadline, not at a fixed 30 s
  CHECK_THAT(what, Catch::Contains("received 0 of 2 fragments") && Catch::Contains("within 33.328 s") &&
                       Catch::Contains("MiB state at a declared link of 0.001 Mbit/s") &&
                       Catch::Contains("--join-link-mbit") && Catch::Contains("--join-timeout-ms"));
  // Nothing arrived: the request was resent every join_retry (1 s), 34 times in 33.3 s.
  CHECK(link.join_times.size() == 34);

  // An explicit time-out names itself and what the link would need.
  VirtualClock clock2;
  ScriptedLink link2(clock2);
  c.join_timeout = 5s;
  OuterLoop<ScriptedLink, Flat> outer2(plan, link2, c);
  CHECK_THROWS_WITH(outer2.join(params), Catch::Contains("within 5 s") && Catch::Contains("the time-out was set") &&
                                             Catch::Contains("--join-timeout-ms"));
  CHECK(clock2.now() == TimePoint{5s});
}

TEST_CASE("A state still arriving is not requested again; a stalled one is", "[outer_loop][join]") {
  VirtualClock clock;
  ScriptedLink link(clock);
  const Plan plan = small_plan();
  OuterLoopConfig c = learner_config(1, 1);
  c.join_timeout = 60s;
  OuterLoop<ScriptedLink, Flat> outer(plan, link, c);
  // Fragment 0 arrives 0.9 s after the request: the request was heard and a
  // fragment takes about that long, so the retry waits for twice as long
  // (1.8 s > join_retry = 1 s) from the last fragment heard.
  SECTION("fragments that keep coming draw no retry, even with gaps above join_retry") {
    link.script.emplace_back(TimePoint{900ms}, full_state(plan, 0, 1, 77));
    link.script.emplace_back(TimePoint{2500ms}, full_state(plan, 1, 1, 77));  // 1.6 s later: < 1.8 s
    VecParams params = zero_params();
    outer.join(params);
    CHECK(outer.joined());
    CHECK(clock.now() == TimePoint{2500ms});
    CHECK(link.join_times == std::vector<TimePoint>{TimePoint{0}});  // asked once, never again
    CHECK(outer.join_fragments_received() == 2);
    CHECK(outer.join_bytes_received() == 4 * 8);
    CHECK(values(params[kW]) == kInit[kW]);
    CHECK(values(params[kC]) == kInit[kC]);
  }
  SECTION("a stalled state is asked for again every 1.8 s until it goes on") {
    link.script.emplace_back(TimePoint{900ms}, full_state(plan, 0, 1, 77));
    link.script.emplace_back(TimePoint{5000ms}, full_state(plan, 1, 1, 77));
    VecParams params = zero_params();
    outer.join(params);
    CHECK(outer.joined());
    CHECK(link.join_times == std::vector<TimePoint>{TimePoint{0}, TimePoint{2700ms}, TimePoint{4500ms}});
  }
  SECTION("with nothing heard at all the request goes out every join_retry") {
    link.script.emplace_back(TimePoint{3500ms}, full_state(plan, 0, 1, 77));
    link.script.emplace_back(TimePoint{3600ms}, full_state(plan, 1, 1, 77));
    VecParams params = zero_params();
    outer.join(params);
    CHECK(outer.joined());
    CHECK(link.join_times == std::vector<TimePoint>{TimePoint{0}, TimePoint{1s}, TimePoint{2s}, TimePoint{3s}});
  }
}

TEST_CASE("The join's retry interval is at most an eighth of the join time-out", "[outer_loop][join]") {
  VirtualClock clock;
  ScriptedLink link(clock);
  const Plan plan = small_plan();
  OuterLoopConfig c = learner_config(1, 1);
  c.join_timeout = 16s;  // cap: 2 s
  OuterLoop<ScriptedLink, Flat> outer(plan, link, c);
  // Each wait just under the retry interval would double it (0.95 s -> 1.9 s,
  // 1.85 s -> 3.7 s); the cap keeps it at 2 s. (A repeated fragment 0 is state arriving too.)
  link.script.emplace_back(TimePoint{950ms}, full_state(plan, 0, 1, 77));
  link.script.emplace_back(TimePoint{2800ms}, full_state(plan, 0, 1, 77));
  link.script.emplace_back(TimePoint{9s}, full_state(plan, 1, 1, 77));
  VecParams params = zero_params();
  outer.join(params);
  CHECK(outer.joined());
  // Uncapped, the requests would go out at 0 and 6.5 s only.
  CHECK(link.join_times ==
        std::vector<TimePoint>{TimePoint{0}, TimePoint{4800ms}, TimePoint{6800ms}, TimePoint{8800ms}});
}

TEST_CASE("After join the parameters equal the syncer's global state and its versions", "[outer_loop]") {
  Rig r;
  // Learner 1 moves the global state away from the initial values: its sends at
  // steps 2 (fragment 1) and 4 (fragment 0) are merged as they arrive.
  auto lt1 = r.net.learner(1);
  Outer first(r.plan, lt1, learner_config(1, 1));
  VecParams p1 = zero_params();
  r.join(first, p1);
  for (int t = 1; t <= 4; ++t) {
    inner_step(p1);
    first.step(p1, 1);
    r.pump();
  }
  REQUIRE(r.syncer.fragment(0).second == 1);
  REQUIRE(r.syncer.fragment(1).second == 1);

  auto lt2 = r.net.learner(2);
  Outer second(r.plan, lt2, learner_config(2, 1));
  VecParams p2 = zero_params();
  r.join(second, p2);
  CHECK(second.joined());
  // Hand values: w after 4 inner steps, b and c after 2 (their fragment was sent at step 2).
  CHECK(p2[kW] == Flat{0.5f, 1.5f, 2.5f, 3.5f});
  CHECK(p2[kB] == Flat{4.5f, 5.5f});
  CHECK(p2[kC] == Flat{6.25f, 7.25f});
  for (std::size_t t = 0; t < 3; ++t) CHECK(p2[t] == r.global_tensor(t));
  CHECK(second.base_version(0) == 1);
  CHECK(second.base_version(1) == 1);
  CHECK(second.status().applies == 2);  // one full-state write per fragment
  CHECK(second.status().step == 0);
}

// ---- schedule and counters ----------------------------------------------------

TEST_CASE("Fragments are sent exactly at the schedule's due steps with the counters since the last send or receipt",
          "[outer_loop]") {
  // P = 2, H = 4: offset(p) = floor(p * H / P) = {0, 2}, so fragment 1 is due at
  // steps 2, 6, 10 and fragment 0 at 4, 8, 12. Step t processes t tokens.
  const std::vector<std::optional<std::size_t>> due = {std::nullopt, std::nullopt, 1, std::nullopt, 0,
                                                       std::nullopt, 1,            std::nullopt, 0, std::nullopt,
                                                       1,            std::nullopt, 0};
  Rig r;
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 1));
  VecParams params = zero_params();
  r.join(outer, params);

  SECTION("with the syncer answering, the counters restart at each application (send + tau)") {
    for (std::uint64_t t = 1; t <= 12; ++t) {
      inner_step(params);
      const auto report = outer.step(params, static_cast<std::int64_t>(t));
      INFO("step " << t);
      CHECK(report.sent == due[t]);
      CHECK(outer.status().sends == (t / 2));
      r.pump();
    }
    const auto c = r.contributions();
    REQUIRE(c.size() == 6);
    // Fragment 1 sent at 2 (from join), then at 6 and 10 after applying at 3 and 7;
    // fragment 0 sent at 4 (from join), then at 8 and 12 after applying at 5 and 9.
    const std::vector<std::uint32_t> fragment = {1, 0, 1, 0, 1, 0};
    const std::vector<std::uint64_t> step = {2, 4, 6, 8, 10, 12};
    const std::vector<std::int64_t> steps = {2, 4, 3, 3, 3, 3};
    const std::vector<std::int64_t> tokens = {1 + 2, 1 + 2 + 3 + 4, 4 + 5 + 6, 6 + 7 + 8, 8 + 9 + 10, 10 + 11 + 12};
    const std::vector<std::uint64_t> version = {0, 0, 1, 1, 2, 2};
    for (std::size_t i = 0; i < c.size(); ++i) {
      INFO("contribution " << i);
      CHECK(c[i].learner == 1);
      CHECK(c[i].fragment == fragment[i]);
      CHECK(c[i].step == step[i]);
      CHECK(c[i].steps == steps[i]);
      CHECK(c[i].tokens == tokens[i]);
      CHECK(c[i].version == version[i]);
      if (i > 0) CHECK(c[i].sequence == c[i - 1].sequence + 1);
    }
    CHECK(r.syncer.status().contributions_accepted == 6);
    CHECK(r.syncer.status().rejected_total() == 0);
    CHECK(applies_since_join(outer) == 5);  // the send at 12 is applied at 13
    CHECK(outer.status().send_failures == 0);
  }
  SECTION("with no answer, the counters run from the previous send of the fragment") {
    for (std::uint64_t t = 1; t <= 12; ++t) {
      inner_step(params);
      CHECK(outer.step(params, static_cast<std::int64_t>(t)).sent == due[t]);
    }
    const auto c = r.intercept();
    REQUIRE(c.size() == 6);
    const std::vector<std::int64_t> steps = {2, 4, 4, 4, 4, 4};
    const std::vector<std::int64_t> tokens = {1 + 2, 1 + 2 + 3 + 4, 3 + 4 + 5 + 6, 5 + 6 + 7 + 8, 7 + 8 + 9 + 10,
                                              9 + 10 + 11 + 12};
    for (std::size_t i = 0; i < c.size(); ++i) {
      INFO("contribution " << i);
      CHECK(c[i].type == MessageType::contribution);
      CHECK(c[i].steps == steps[i]);
      CHECK(c[i].tokens == tokens[i]);
      CHECK(c[i].version == 0);
    }
    CHECK(applies_since_join(outer) == 0);
  }
}

// ---- the outer gradient -----------------------------------------------------------

TEST_CASE("The outer gradient sent is base minus local: exactly the change made by the inner steps",
          "[outer_loop]") {
  JoinedLearner j;
  auto& [r, lt, outer, params] = j;

  SECTION("measured from the joined state, then from the previous send when nothing comes back") {
    for (int t = 1; t <= 8; ++t) {
      inner_step(params);
      outer.step(params, 1);
    }
    const auto c = r.intercept();
    REQUIRE(c.size() == 4);
    // Fragment 1 = [b | c]; at step 2: 2 steps of b (0.25 each) and of c (0.375 each).
    CHECK(payload(c[0]) == Flat{0.5f, 0.5f, 0.75f, 0.75f});
    CHECK(payload(c[1]) == filled(4, 0.5f));                   // w, 4 steps at 0.125
    CHECK(payload(c[2]) == Flat{1.0f, 1.0f, 1.5f, 1.5f});      // b, c: steps 3..6
    CHECK(payload(c[3]) == filled(4, 0.5f));                   // w: steps 5..8
  }
  SECTION("measured from the applied global once one comes back") {
    for (int t = 1; t <= 6; ++t) {
      inner_step(params);
      outer.step(params, 1);
      r.pump();
    }
    const auto c = r.contributions();
    REQUIRE(c.size() == 3);
    CHECK(payload(c[0]) == Flat{0.5f, 0.5f, 0.75f, 0.75f});
    // The global of fragment 1 (= local at step 2) overwrote b and c at step 3;
    // steps 4, 5, 6 are the new progress.
    CHECK(payload(c[2]) == Flat{0.75f, 0.75f, 1.125f, 1.125f});
    CHECK(params[kB] == Flat{4.5f - 0.75f, 5.5f - 0.75f});
  }
}

// ---- applying globals ------------------------------------------------------------

TEST_CASE("A received global is applied at send + tau, not before: overwritten with alpha = 0, mixed with alpha > 0",
          "[outer_loop]") {
  // tau = 2. Fragment 1 is sent at step 2; the syncer answers at once, so the
  // global (b = {4.5, 5.5}, c = {6.25, 7.25}: the local values at step 2) waits
  // in the learner's mailbox during step 3 and is applied at step 4.
  const float alpha = GENERATE(0.0f, 0.5f, 0.25f);
  INFO("alpha = " << alpha);
  Rig r;
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 2, alpha));
  VecParams params = zero_params();
  r.join(outer, params);
  for (int t = 1; t <= 2; ++t) {
    inner_step(params);
    outer.step(params, 1);
    r.pump();
  }
  REQUIRE(r.syncer.fragment(1).second == 1);
  REQUIRE(r.net.pending(Endpoint::for_learner(1)) == 1);  // the global has arrived

  inner_step(params);
  auto report = outer.step(params, 1);
  CHECK(report.applied == 0);
  CHECK(applies_since_join(outer) == 0);
  CHECK(outer.base_version(1) == 0);
  CHECK(params[kB] == local_after(kB, 3));
  CHECK(params[kC] == local_after(kC, 3));

  inner_step(params);
  report = outer.step(params, 1);
  CHECK(report.applied == 1);
  CHECK(applies_since_join(outer) == 1);
  CHECK(outer.status().late_applies == 0);
  CHECK(outer.base_version(1) == 1);
  CHECK(params[kW] == local_after(kW, 4));  // fragment 0 untouched
  // local at step 4: b = {4.0, 5.0}, c = {5.5, 6.5}; alpha * local + (1 - alpha) * global.
  if (alpha == 0.0f) {
    CHECK(params[kB] == Flat{4.5f, 5.5f});
    CHECK(params[kC] == Flat{6.25f, 7.25f});
  } else if (alpha == 0.5f) {
    CHECK(params[kB] == Flat{4.25f, 5.25f});
    CHECK(params[kC] == Flat{5.875f, 6.875f});
  } else {  // 0.25: tells alpha from 1 - alpha
    CHECK(params[kB] == Flat{4.375f, 5.375f});
    CHECK(params[kC] == Flat{6.0625f, 7.0625f});
  }
}

TEST_CASE("A global that arrives after send + tau is applied on arrival and counted as late; step() never waits",
          "[outer_loop]") {
  // Every message takes 1 ms and each inner step takes 1 ms of virtual time.
  // tau = 1: fragment 1 sent at step 2 is due at step 3, but the syncer only
  // hears it at step 3's time and its answer arrives at step 4's.
  MessageFaults latency;
  latency.latency = 1ms;
  FaultTape tape;
  tape.set_message_faults(latency);
  Rig r(1024, tape);
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 1));
  VecParams params = zero_params();
  r.join(outer, params);

  for (int t = 1; t <= 3; ++t) {
    r.clock.advance(1ms);
    inner_step(params);
    const auto report = outer.step(params, 1);
    CHECK(report.applied == 0);
    CHECK_FALSE(report.waited);
    CHECK_FALSE(outer.waiting_for_sync());
    r.pump();
  }
  CHECK(applies_since_join(outer) == 0);
  CHECK(params[kB] == local_after(kB, 3));  // training went on past the due step
  CHECK(r.syncer.fragment(1).second == 1);  // merged at step 3's time, answer in flight

  r.clock.advance(1ms);
  inner_step(params);
  const auto report = outer.step(params, 1);
  CHECK(report.applied == 1);
  CHECK(applies_since_join(outer) == 1);
  CHECK(outer.status().late_applies == 1);
  CHECK(outer.status().lock_step_waits == 0);
  CHECK(outer.base_version(1) == 1);
  CHECK(params[kB] == Flat{4.5f, 5.5f});  // the global: local at step 2
  CHECK(params[kC] == Flat{6.25f, 7.25f});
  CHECK(report.sent == std::optional<std::size_t>{0});  // and fragment 0 still goes out on time
}

TEST_CASE("Each apply after a send records its staleness in versions and its delay in steps", "[outer_loop]") {
  // Two learners send fragment 1 at step 2 from base version 0; the syncer
  // (K = 1) merges them one after the other (versions 1 and 2) and sends both
  // globals to both. At step 4 (= 2 + tau) each applies version 2: 2 versions
  // past its base, 2 steps after its send.
  Rig r;
  auto l1 = r.net.learner(1);
  auto l2 = r.net.learner(2);
  Outer o1(r.plan, l1, learner_config(1, 2)), o2(r.plan, l2, learner_config(2, 2));
  VecParams p1 = zero_params(), p2 = zero_params();
  r.join(o1, p1);
  r.join(o2, p2);
  CHECK(o1.status().staleness_versions.count() == 0);  // the join's full state is not an apply after a send
  for (int t = 1; t <= 4; ++t) {
    inner_step(p1);
    o1.step(p1, 1);
    inner_step(p2);
    o2.step(p2, 1);
    r.pump();
  }
  REQUIRE(r.syncer.fragment(1).second == 2);
  for (const Outer* o : {&o1, &o2}) {
    const auto& st = o->status();
    REQUIRE(st.staleness_versions.count() == 1);
    CHECK(st.staleness_versions.sum() == 2.0);
    REQUIRE(st.apply_delay_steps.count() == 1);
    CHECK(st.apply_delay_steps.sum() == 2.0);
    CHECK(st.staleness_versions.cumulative(1) == 0);  // not in le = 0 or le = 1
    CHECK(st.staleness_versions.cumulative(2) == 1);  // le = 2
  }
}

TEST_CASE("Push rounds: the first step after a join tells the syncer at once that the learner trains",
          "[outer_loop]") {
  JoinedLearner j;
  auto& [r, lt, outer, params] = j;
  const auto before = outer.status().heartbeats;
  for (int t = 1; t <= 3; ++t) {  // the clock stands still: no heartbeat falls due
    inner_step(params);
    outer.step(params, 1);
  }
  const auto got = r.intercept(/*heartbeats=*/true);
  REQUIRE(got.size() == 2);  // the report of step 1 and fragment 1's send at step 2
  CHECK(got[0].type == MessageType::heartbeat);
  CHECK(got[0].step == 1);
  CHECK(got[1].type == MessageType::contribution);
  CHECK(outer.status().heartbeats == before + 1);
}

// ---- a silent syncer ---------------------------------------------------------------

TEST_CASE("With a syncer that never answers, step() always returns, failures are counted and no progress is lost",
          "[outer_loop]") {
  // The syncer's mailbox holds 5 messages and nobody reads it: the heartbeat
  // of step 1 (the learner trains) and the first four sends (steps 2, 4, 6,
  // 8) are queued, every later one is refused.
  Rig r(5);
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 1));
  VecParams params = zero_params();
  r.join(outer, params);

  std::uint64_t returned = 0;
  for (int t = 1; t <= 1000; ++t) {
    inner_step(params);
    const auto report = outer.step(params, 2);
    CHECK_FALSE(report.waited);
    ++returned;
  }
  CHECK(returned == 1000);
  CHECK(outer.status().step == 1000);
  CHECK(outer.status().tokens == 2000);
  CHECK(outer.status().sends == 4);
  CHECK(outer.status().send_failures == 500 - 4);  // 250 due steps per fragment
  CHECK(applies_since_join(outer) == 0);
  CHECK(r.net.counters(Endpoint::syncer()).dropped_queue_full == 496);

  // The syncer wakes up and empties its queue; the next send of each fragment
  // (steps 1002 and 1004) carries everything since its last queued send (6 and 8).
  auto seen = r.intercept();
  REQUIRE(seen.size() == 4);
  for (int t = 1001; t <= 1004; ++t) {
    inner_step(params);
    outer.step(params, 2);
  }
  CHECK(outer.status().sends == 6);
  for (auto& m : r.intercept()) seen.push_back(std::move(m));
  REQUIRE(seen.size() == 6);
  CHECK(seen[4].fragment == 1);
  CHECK(seen[4].steps == 1002 - 6);
  CHECK(seen[4].tokens == 2 * (1002 - 6));
  CHECK(seen[5].fragment == 0);
  CHECK(seen[5].steps == 1004 - 8);

  // Per fragment, the payloads add up to the total local change (exact: all
  // values are multiples of 1/8 far below 2^24).
  std::vector<std::vector<double>> sum = {std::vector<double>(4, 0.0), std::vector<double>(4, 0.0)};
  std::vector<std::int64_t> steps(2, 0);
  for (const auto& m : seen) {
    REQUIRE(m.type == MessageType::contribution);
    for (std::size_t i = 0; i < 4; ++i) sum[m.fragment][i] += (*m.payload)[i];
    steps[m.fragment] += m.steps;
  }
  CHECK(steps[0] == 1004);
  CHECK(steps[1] == 1002);
  for (std::size_t i = 0; i < 4; ++i) CHECK(sum[0][i] == 1004 * 0.125);
  CHECK(sum[1] == std::vector<double>{1002 * 0.25, 1002 * 0.25, 1002 * 0.375, 1002 * 0.375});

  // All six are valid for the syncer, and merging them reproduces the learner's
  // local state at the last send of each fragment.
  Outbox ignored;
  for (const auto& m : seen) r.syncer.handle(m, ignored);
  CHECK(r.syncer.status().contributions_accepted == 6);
  CHECK(r.syncer.status().rejected_total() == 0);
  CHECK(r.global_tensor(kW) == local_after(kW, 1004));
  CHECK(r.global_tensor(kB) == local_after(kB, 1002));
  CHECK(r.global_tensor(kC) == local_after(kC, 1002));
}

// ---- lock-step -----------------------------------------------------------------

TEST_CASE("In lock-step mode waiting_for_sync() is true at send + tau until the global arrives and poll() applies it",
          "[outer_loop]") {
  Rig r;
  auto lt = r.net.learner(1);
  auto config = learner_config(1, 1);
  config.lock_step = true;
  Outer outer(r.plan, lt, config);
  VecParams params = zero_params();
  r.join(outer, params);

  for (int t = 1; t <= 2; ++t) {
    inner_step(params);
    outer.step(params, 1);
  }
  CHECK_FALSE(outer.waiting_for_sync());  // sent at 2, due at 3

  inner_step(params);
  const auto report = outer.step(params, 1);
  CHECK(report.waited);
  CHECK(report.applied == 0);
  CHECK(outer.status().lock_step_waits == 1);
  CHECK(outer.waiting_for_sync());
  CHECK(outer.poll(params) == 0);  // the syncer has not answered yet
  CHECK(outer.waiting_for_sync());

  r.pump();  // merge; the global is now in the learner's mailbox
  CHECK(outer.waiting_for_sync());
  CHECK(outer.poll(params) == 1);
  CHECK_FALSE(outer.waiting_for_sync());
  CHECK(applies_since_join(outer) == 1);
  CHECK(outer.status().late_applies == 0);
  CHECK(params[kB] == Flat{4.5f, 5.5f});
  CHECK(params[kC] == Flat{6.25f, 7.25f});
}

// ---- resynchronisation -----------------------------------------------------------

TEST_CASE("A stale rejection answered with the current fragment resynchronises the learner", "[outer_loop]") {
  SyncerConfig config = one_per_round();
  config.max_staleness = 1;
  Rig r(1024, {}, config);
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 1));
  VecParams params = zero_params();
  r.join(outer, params);

  // Learner 2 (driven by hand) moves fragment 1 to version 2; the broadcasts
  // to learner 1 are lost (the outbox is discarded).
  Outbox lost;
  Message join;
  join.type = MessageType::join;
  join.fingerprint = r.plan.fingerprint();
  join.learner = 2;
  r.syncer.handle(join, lost);
  REQUIRE(!lost.empty());
  const std::uint64_t first_sequence = lost.front().message.sequence;
  for (std::uint64_t i = 1; i <= 2; ++i) {
    Message m;
    m.type = MessageType::contribution;
    m.fingerprint = r.plan.fingerprint();
    m.learner = 2;
    m.fragment = 1;
    m.version = i - 1;
    m.sequence = first_sequence + i;
    m.steps = 1;
    m.tokens = 1;
    m.step = i;  // one inner step per contribution
    m.payload = make_payload(filled(4, 0.5f));
    r.syncer.handle(m, lost);
  }
  lost.clear();
  REQUIRE(r.syncer.fragment(1).second == 2);

  // Learner 1 sends fragment 1 at step 2 against version 0: 2 behind > 1.
  for (int t = 1; t <= 2; ++t) {
    inner_step(params);
    outer.step(params, 1);
    r.pump();
  }
  CHECK(r.syncer.status().rejected[static_cast<std::size_t>(RejectReason::stale)] == 1);
  CHECK(outer.base_version(1) == 0);

  inner_step(params);
  CHECK(outer.step(params, 1).applied == 1);
  CHECK(outer.base_version(1) == 2);
  CHECK(params[kB] == Flat{4.0f, 5.0f});  // initial - 2 * 0.5
  CHECK(params[kC] == Flat{6.0f, 7.0f});

  // Its next contribution (step 6) is made against version 2 and accepted.
  for (int t = 4; t <= 6; ++t) {
    inner_step(params);
    outer.step(params, 1);
    r.pump();
  }
  const auto c = r.contributions();
  REQUIRE(c.size() == 3);
  CHECK(c[2].fragment == 1);
  CHECK(c[2].version == 2);
  CHECK(r.syncer.status().rejected[static_cast<std::size_t>(RejectReason::stale)] == 1);
  CHECK(r.syncer.status().contributions_accepted == 2 + 2);  // learner 2's two, learner 1's step 4 and 6
}

// ---- applied fragments and FragmentApplier (learners that are groups) ---------------

namespace {

/// A deterministic "inner step" with values that are not short binary
/// fractions (so mixing rounds): the same on every replica of a group.
template <class T>
void replicated_inner_step(std::vector<T>& params, int step) {
  for (std::size_t t = 0; t < params.size(); ++t) {
    Flat v = values(params[t]);
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] -= 0.01f * std::sin(0.37f * static_cast<float>(step) + 1.3f * static_cast<float>(t * 7 + i)) + 0.003f;
    write_tensor(params[t], std::span<const float>(v));
  }
}

template <class T>
std::vector<T> copy_as(const VecParams& from) {
  std::vector<T> out;
  for (const Flat& f : from) {
    if constexpr (std::is_same_v<T, DeviceTensor>) {
      out.push_back(DeviceTensor{f});
    } else {
      out.push_back(f);
    }
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("A follower applying the leader's reported fragments at the same step stays bit-identical to it",
                   "[outer_loop][group]", std::vector<float>, DeviceTensor) {
  using F = TestType;  // the follower's tensor type: in place, or staged like a device tensor
  const float alpha = GENERATE(0.0f, 0.3f, 0.7f);
  INFO("alpha = " << alpha);
  Rig r(1024, {}, [] {
    SyncerConfig c = one_per_round();
    c.quorum.min_quorum = 2;  // merges of two learners: the global differs from either's local values
    return c;
  }());
  auto lt1 = r.net.learner(1);
  auto lt2 = r.net.learner(2);
  Outer leader(r.plan, lt1, learner_config(1, 1, alpha));
  Outer other(r.plan, lt2, learner_config(2, 2, alpha));
  VecParams lp = zero_params(), op = zero_params();
  r.join(leader, lp);
  r.join(other, op);
  std::vector<F> follower = copy_as<F>(lp);  // the group broadcasts the joined state
  FragmentApplier<F> applier(r.plan, alpha);

  std::size_t followed = 0;
  std::vector<std::size_t> applied_per_fragment(2, 0);
  for (int t = 1; t <= 200; ++t) {
    replicated_inner_step(lp, t);
    replicated_inner_step(follower, t);
    replicated_inner_step(op, 1000 + t);
    const StepReport report = leader.step(lp, 3);
    other.step(op, 3);
    REQUIRE(report.applied == report.applied_fragments.size());
    for (const AppliedFragment& a : report.applied_fragments) {
      // What was applied is what the leader now has as its base and global.
      REQUIRE(a.values);
      CHECK(a.version == leader.base_version(a.fragment));
      CHECK(a.version == leader.global_version(a.fragment));
      CHECK(a.values->data() == leader.global_fragment(a.fragment).data());  // shared, not copied
      applier.apply(std::span<F>(follower), a.fragment, std::span<const float>(*a.values));
      ++applied_per_fragment[a.fragment];
      ++followed;
    }
    // Bit-identical after every step, not only at the end.
    for (std::size_t k = 0; k < lp.size(); ++k) REQUIRE(values(follower[k]) == lp[k]);
    r.pump();
  }
  CHECK(followed == applies_since_join(leader));
  CHECK(applied_per_fragment[0] >= 20);
  CHECK(applied_per_fragment[1] >= 20);
  // Quorum 2: every merge the leader applied held the other learner's contribution too.
  CHECK(r.syncer.fragment(0).second >= applied_per_fragment[0]);
  CHECK(lp != op);
}

TEST_CASE("FragmentApplier mixes as alpha * local + (1 - alpha) * global, and overwrites with alpha = 0",
          "[outer_loop][group]") {
  const Plan plan = small_plan();
  VecParams params = {{1, 2, 3, 4}, {5, 6}, {7, 8}};
  const Flat global1 = {10, 20, 30, 40};  // fragment 1: b then c
  FragmentApplier<Flat> mix(plan, 0.25f);
  mix.apply(std::span<Flat>(params), 1, std::span<const float>(global1));
  CHECK(params[kW] == Flat{1, 2, 3, 4});
  CHECK(params[kB] == Flat{0.25f * 5 + 0.75f * 10, 0.25f * 6 + 0.75f * 20});
  CHECK(params[kC] == Flat{0.25f * 7 + 0.75f * 30, 0.25f * 8 + 0.75f * 40});
  FragmentApplier<Flat> overwrite(plan, 0.0f);
  const Flat global0 = {-1, -2, -3, -4};
  overwrite.apply(std::span<Flat>(params), 0, std::span<const float>(global0));
  CHECK(params[kW] == global0);
}

TEST_CASE("FragmentApplier refuses a bad fragment index, global size, tensor count or size, or alpha, naming it, "
          "before writing anything",
          "[outer_loop][group]") {
  const Plan plan = small_plan();
  const VecParams before = {{1, 2, 3, 4}, {5, 6}, {7, 8}};
  VecParams params = before;
  FragmentApplier<Flat> applier(plan, 0.5f);
  const Flat global1(4, 9.0f);
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(applier.apply(std::span<Flat>(params), 2, std::span<const float>(global1)),
                    Contains("fragment 2 does not exist") && Contains("2 fragments"));
  CHECK_THROWS_AS(applier.apply(std::span<Flat>(params), 2, std::span<const float>(global1)), InvalidArgument);
  const Flat short_global(3, 9.0f);
  CHECK_THROWS_WITH(applier.apply(std::span<Flat>(params), 1, std::span<const float>(short_global)),
                    Contains("fragment 1 has 3 values but the fragment has 4"));
  CHECK_THROWS_AS(applier.apply(std::span<Flat>(params), 1, std::span<const float>(short_global)), ShapeMismatch);
  VecParams two = {before[0], before[1]};
  CHECK_THROWS_WITH(applier.apply(std::span<Flat>(two), 1, std::span<const float>(global1)),
                    Contains("got 2 parameter tensors but the plan has 3"));
  VecParams resized = before;
  resized[kC].push_back(0.0f);
  CHECK_THROWS_WITH(applier.apply(std::span<Flat>(resized), 1, std::span<const float>(global1)),
                    Contains("tensor 2 ('c') has 3 elements but the plan says 2"));
  CHECK(resized[kB] == before[kB]);  // checked before writing: b is untouched
  CHECK(params == before);
  CHECK_THROWS_WITH(FragmentApplier<Flat>(plan, 1.0f), Contains("alpha = 1") && Contains("[0, 1)"));
  CHECK_THROWS_AS(FragmentApplier<Flat>(plan, -0.1f), InvalidArgument);
}

// ---- tensor types ------------------------------------------------------------------

namespace {

template <class T>
T make_tensor(Eigen::Index rows, Eigen::Index cols) {
  if constexpr (std::is_same_v<T, Flat>) {
    return Flat(static_cast<std::size_t>(rows * cols), 0.0f);
  } else if constexpr (std::is_same_v<T, DeviceTensor>) {
    return DeviceTensor{std::vector<float>(static_cast<std::size_t>(rows * cols), 0.0f)};
  } else if constexpr (std::is_same_v<T, Eigen::VectorXf>) {
    return Eigen::VectorXf::Zero(rows * cols);
  } else {
    return T::Zero(rows, cols);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("Join, inner steps and applied globals give the same values for every tensor type", "[outer_loop]",
                   std::vector<float>, Eigen::VectorXf, Eigen::MatrixXf, DeviceTensor) {
  using T = TestType;
  Rig r;
  auto lt = r.net.learner(1);
  OuterLoop<InProcessLearnerTransport, T> outer(r.plan, lt, learner_config(1, 1));
  std::vector<T> params;
  params.push_back(make_tensor<T>(2, 2));  // w
  params.push_back(make_tensor<T>(2, 1));  // b
  params.push_back(make_tensor<T>(1, 2));  // c
  r.join(outer, params);
  for (std::size_t t = 0; t < 3; ++t) CHECK(values(params[t]) == kInit[t]);

  for (int t = 1; t <= 5; ++t) {
    inner_step(params);
    outer.step(params, 1);
    r.pump();
  }
  // Fragment 1 sent at 2, applied at 3, then 2 more steps; fragment 0 sent at 4, applied at 5.
  CHECK(values(params[kW]) == Flat{0.5f, 1.5f, 2.5f, 3.5f});
  CHECK(values(params[kB]) == Flat{4.0f, 5.0f});
  CHECK(values(params[kC]) == Flat{5.5f, 6.5f});
  CHECK(r.syncer.global_parameters() == Flat{0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f, 6.25f, 7.25f});
  CHECK(outer.status().sends == 2);
  CHECK(applies_since_join(outer) == 2);
  CHECK(outer.base_version(0) == 1);
  CHECK(outer.base_version(1) == 1);
}

// ---- contributions encoded by the learner ------------------------------------------

namespace {
/// The in-process transport plus the optional contribution_codec() (as
/// ZmqLearnerTransport has it): OuterLoop then sends Message::encoded.
struct EncodingTransport {
  InProcessLearnerTransport inner;
  std::optional<Codec> codec;
  std::vector<const std::byte*> sent_buffers;  ///< bytes.data() of each contribution sent

  [[nodiscard]] std::optional<Codec> contribution_codec() const noexcept { return codec; }
  bool send(Message&& m) {
    if (m.type == MessageType::contribution && m.encoded) sent_buffers.push_back(m.encoded->bytes.data());
    return inner.send(std::move(m));
  }
  std::optional<Message> try_receive() { return inner.try_receive(); }
  std::optional<Message> receive_until(TimePoint d) { return inner.receive_until(d); }
  [[nodiscard]] bool failed() const { return inner.failed(); }
  [[nodiscard]] const Clock& clock() const noexcept { return inner.clock(); }
};
static_assert(ContributionEncodingTransport<EncodingTransport>);
static_assert(!ContributionEncodingTransport<InProcessLearnerTransport>);

/// A rig with one joined learner whose transport takes encoded contributions.
struct EncodingRig {
  Rig r;
  EncodingTransport lt;
  OuterLoop<EncodingTransport, Flat> outer;
  VecParams params = zero_params();
  explicit EncodingRig(Codec codec) : lt{r.net.learner(1), codec, {}}, outer(r.plan, lt, learner_config(1, 1)) {
    r.join(outer, params);
  }
};

std::vector<std::byte> encoded_bytes(const Message& m) {
  REQUIRE(m.encoded);
  return {m.encoded->bytes.begin(), m.encoded->bytes.end()};
}
}  // namespace

TEMPLATE_TEST_CASE("A transport with a contribution codec gets encode(codec, base - local), for every tensor type",
                   "[outer_loop][codec]", std::vector<float>, Eigen::MatrixXf, DeviceTensor) {
  using T = TestType;
  for (const Codec codec : {Codec::fp32, Codec::bf16, Codec::int8, Codec::int4}) {
    Rig r;
    EncodingTransport lt{r.net.learner(1), codec, {}};
    OuterLoop<EncodingTransport, T> outer(r.plan, lt, learner_config(1, 1));
    std::vector<T> params;
    params.push_back(make_tensor<T>(2, 2));
    params.push_back(make_tensor<T>(2, 1));
    params.push_back(make_tensor<T>(1, 2));
    r.join(outer, params);
    for (int t = 1; t <= 8; ++t) {
      inner_step(params);
      outer.step(params, 1);
    }
    const auto c = r.intercept();  // held here: each send needed a fresh buffer
    INFO(to_string(codec));
    REQUIRE(c.size() == 4);
    // The outer gradients of the fp32 test above, encoded with the codec.
    const std::vector<Flat> expected = {{0.5f, 0.5f, 0.75f, 0.75f}, filled(4, 0.5f), {1.0f, 1.0f, 1.5f, 1.5f},
                                        filled(4, 0.5f)};
    for (std::size_t k = 0; k < 4; ++k) {
      CHECK_FALSE(c[k].payload);
      REQUIRE(c[k].encoded);
      CHECK(c[k].encoded->codec == codec);
      CHECK(c[k].encoded->elements == 4);
      CHECK(encoded_bytes(c[k]) == encode(codec, expected[k]));
    }
    CHECK(outer.status().sends == 4);
  }
}

TEST_CASE("The encoded contribution's buffer is reused once the transport lets go of it, never while it is held",
          "[outer_loop][codec]") {
  EncodingRig e(Codec::int4);
  auto& [r, lt, outer, params] = e;
  std::vector<Message> held;
  for (int t = 1; t <= 8; ++t) {
    inner_step(params);
    outer.step(params, 1);
    auto got = r.intercept();
    if (t <= 4) held.insert(held.end(), got.begin(), got.end());  // the first two sends stay alive
  }
  // Sends at steps 2, 4 (held), 6, 8 (dropped at once). Both fragments have 4 elements.
  REQUIRE(lt.sent_buffers.size() == 4);
  CHECK(lt.sent_buffers[0] != lt.sent_buffers[1]);  // the first was still held
  CHECK(lt.sent_buffers[2] != lt.sent_buffers[0]);
  CHECK(lt.sent_buffers[2] != lt.sent_buffers[1]);
  CHECK(lt.sent_buffers[3] == lt.sent_buffers[2]);  // released after step 6: reused at step 8
  REQUIRE(held.size() == 2);
  CHECK(encoded_bytes(held[0]) == encode(Codec::int4, Flat{0.5f, 0.5f, 0.75f, 0.75f}));  // untouched by later sends
  CHECK(encoded_bytes(held[1]) == encode(Codec::int4, filled(4, 0.5f)));
}

TEST_CASE("A NaN under a quantised contribution codec throws from step() and leaves base and counters alone",
          "[outer_loop][codec]") {
  EncodingRig e(Codec::int4);
  auto& [r, lt, outer, params] = e;
  inner_step(params);
  outer.step(params, 1);  // step 1: nothing due
  inner_step(params);
  const float good = params[kC][1];
  params[kC][1] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(outer.step(params, 1), InvalidArgument);  // step 2: fragment 1 due
  CHECK(outer.status().sends == 0);
  CHECK(r.intercept().empty());
  // Repaired, the next due send of fragment 1 (step 6) carries all progress since the join.
  params[kC][1] = good;
  for (int t = 3; t <= 6; ++t) {
    inner_step(params);
    outer.step(params, 1);
  }
  const auto c = r.intercept();
  REQUIRE(c.size() == 2);  // fragment 0 at step 4, fragment 1 at step 6
  CHECK(encoded_bytes(c[1]) == encode(Codec::int4, Flat{1.5f, 1.5f, 2.25f, 2.25f}));
}

// ---- the global view and refused joins ------------------------------------------

TEST_CASE("read_global gives the newest global received for every fragment, applied or still due", "[outer_loop]") {
  Rig r;
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, /*tau=*/2));
  VecParams p = zero_params();
  VecParams g = zero_params();
  CHECK_THROWS_AS(outer.read_global(g), StateError);
  r.join(outer, p);
  outer.read_global(g);
  CHECK(g == kInit);  // joined: the global is the initial state
  CHECK(outer.global_version(0) == 0);
  CHECK(outer.global_fragment(0).size() == 4);
  // Step 2 sends fragment 1; its merged result arrives at once but applies only at step 4.
  for (int t = 1; t <= 2; ++t) {
    inner_step(p);
    outer.step(p, 1);
  }
  r.pump();
  inner_step(p);
  outer.step(p, 1);  // step 3: the global is received, not yet applied
  outer.read_global(g);
  CHECK(outer.global_version(1) == 1);
  CHECK(g[kW] == kInit[kW]);  // fragment 0 not merged yet
  CHECK(g[kB] == r.global_tensor(kB));
  CHECK(g[kC] == r.global_tensor(kC));
  CHECK(g[kB] == local_after(kB, 2));  // the merge of one contribution is the sender's fragment at send time
  CHECK(p[kB] == local_after(kB, 3));  // the local parameters still run ahead: not applied before step 4
}

TEST_CASE("A join the syncer refuses throws ProtocolError naming both plans, or both schedules", "[outer_loop]") {
  SECTION("another plan") {
    Rig r;
    const Plan other = make_plan({{"w", 4, false}, {"b", 2, false}, {"c", 2, false}}, 1);
    auto lt = r.net.learner(1);
    OuterLoop<InProcessLearnerTransport, Flat> outer(other, lt, learner_config(1, 1));
    VecParams p = zero_params();
    outer.begin_join(p);
    r.pump();
    CHECK_THROWS_WITH(outer.poll_join(p), Catch::Contains("the syncer refused learner 1: its plan") &&
                                              Catch::Contains(detail::hex16(r.plan.fingerprint()) + ", 2 fragments") &&
                                              Catch::Contains(detail::hex16(other.fingerprint()) + ", 1 fragments"));
  }
  SECTION("another schedule") {
    SyncerConfig sc = one_per_round();
    sc.sync_every = 8;
    sc.quorum.overlap = 1;
    Rig r(1024, {}, sc);
    auto lt = r.net.learner(1);
    Outer outer(r.plan, lt, learner_config(1, 1));  // H = 4
    VecParams p = zero_params();
    outer.begin_join(p);
    r.pump();
    CHECK_THROWS_AS(outer.poll_join(p), ProtocolError);
    CHECK_FALSE(outer.joined());
  }
  SECTION("a refusal of an older join (another nonce) is ignored") {
    Rig r;
    auto lt = r.net.learner(1);
    Outer outer(r.plan, lt, learner_config(1, 1));
    VecParams p = zero_params();
    outer.begin_join(p);
    Message stale;
    stale.type = MessageType::join_refused;
    stale.learner = 1;
    stale.fragment = static_cast<std::uint32_t>(JoinRefusal::foreign_plan);
    stale.sequence = 12345;  // not this join's nonce
    r.link.send_to(1, std::move(stale));
    r.pump();
    CHECK(outer.poll_join(p));
  }
}

TEST_CASE("A learner the restored syncer does not know is asked to rejoin, rejoins without losing progress and its "
          "contributions are accepted again",
          "[outer_loop][rejoin]") {
  Rig r;
  // The checkpoint the syncer will crash back to: taken before learner 1 joined.
  SyncerSnapshot checkpoint = r.syncer.snapshot();
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 1));  // H = 4: fragment 1 due at 2, 6, 10; fragment 0 at 4, 8, 12
  VecParams params = zero_params();
  r.join(outer, params);
  const auto step = [&](bool pump) {
    inner_step(params);
    outer.step(params, 1);
    if (pump) r.pump();
  };
  for (int t = 1; t <= 5; ++t) step(true);
  REQUIRE(r.syncer.status().contributions_accepted == 2);
  REQUIRE(outer.status().sends == 2);

  // The syncer crashes and restores the older checkpoint (a new epoch).
  advance_epoch(checkpoint);
  r.syncer.restore(checkpoint);
  REQUIRE(r.syncer.status().learners_known == 0);
  r.seen.clear();

  step(true);  // step 6: fragment 1 goes out, the syncer does not know learner 1 and asks it to rejoin
  CHECK(r.syncer.status().rejected[static_cast<std::size_t>(RejectReason::unknown_learner)] == 1);
  CHECK(r.syncer.status().rejoin_requests == 1);
  const VecParams before_rejoin = params;
  outer.poll(params);  // the request arrives: a join goes out, nothing else changes
  CHECK(outer.status().rejoins == 1);
  CHECK(outer.rejoining());
  CHECK(outer.joined());
  CHECK(params == before_rejoin);
  step(false);  // step 7, and step 8 (fragment 0 due) before the reply: that send waits
  step(false);
  CHECK(outer.status().sends == 3);
  r.pump();  // the join is answered
  step(true);  // step 9: the reply (the new sequence base) is in
  CHECK_FALSE(outer.rejoining());
  for (int t = 10; t <= 12; ++t) step(true);
  CHECK(outer.status().sends == 5);

  const auto c = r.contributions();
  REQUIRE(c.size() == 3);  // steps 6 (rejected), 10 and 12
  CHECK(c[1].fragment == 1);
  CHECK(c[1].steps == 1);  // 9 (the reply's fragment 1 applied there, late, as step 6's answer) -> 10
  CHECK(c[2].fragment == 0);
  CHECK(c[2].steps == 7);  // 5 (applied) -> 12: the send skipped at 8 lost nothing
  for (std::size_t i = 1; i < c.size(); ++i) CHECK(c[i].sequence >> kSequenceEpochShift == 1);
  const auto st = r.syncer.status();
  // Step 10's is accepted; step 12's base (version 1) is from before the new
  // epoch: answered with the current fragment, as for any learner after a
  // crash restore (advance_epoch). The restored counters start from the checkpoint's 0.
  CHECK(st.contributions_accepted == 1);
  CHECK(st.rejected[static_cast<std::size_t>(RejectReason::stale)] == 1);
  CHECK(st.rejected[static_cast<std::size_t>(RejectReason::duplicate)] == 0);
  CHECK(st.rejoin_requests == 1);
  CHECK(st.learners_known == 1);
  CHECK(outer.status().rejoins == 1);
}

TEST_CASE("A rejoin request for another learner or plan, or before joining, is ignored", "[outer_loop][rejoin]") {
  Rig r;
  auto lt = r.net.learner(1);
  Outer outer(r.plan, lt, learner_config(1, 1));
  VecParams params = zero_params();
  r.join(outer, params);
  Message ask;
  ask.type = MessageType::rejoin;
  ask.fingerprint = r.plan.fingerprint();
  ask.learner = 2;
  r.link.send_to(1, Message(ask));
  ask.learner = 1;
  ask.fingerprint ^= 1;
  r.link.send_to(1, Message(ask));
  const auto ignored = outer.status().ignored;
  outer.poll(params);
  CHECK(outer.status().rejoins == 0);
  CHECK_FALSE(outer.rejoining());
  CHECK(outer.status().ignored == ignored + 2);
}

// ---- Pull rounds (RoundMode::pull): the syncer owns the schedule ------------
// H = 4, P = 2 as above: fragment 1's slot is at global steps 2, 6, ...,
// fragment 0's at 4, 8, ... Every learner sends metadata after each step and
// answers a pull at its next step.

namespace {
SyncerConfig pull_config(std::size_t tau, std::size_t k = 1) {
  SyncerConfig c = one_per_round();
  c.round = RoundMode::pull;
  c.sync_every = 4;
  c.quorum.overlap = tau;
  c.quorum.min_quorum = k;
  return c;
}
OuterLoopConfig pull_learner(LearnerId id, std::size_t tau) {
  OuterLoopConfig c = learner_config(id, tau);
  c.round = RoundMode::pull;
  return c;
}
/// Learner 1 in pull rounds (H = 4, tau = 1), joined to a pull syncer.
/// (`capacity` bounds every mailbox; `tape` plays the network's faults.)
struct OnePullLearner {
  Rig r;
  VecParams a = zero_params();
  InProcessLearnerTransport ta = r.net.learner(1);
  Outer la{r.plan, ta, pull_learner(1, 1)};
  explicit OnePullLearner(std::size_t capacity = 1024, FaultTape tape = {})
      : r(capacity, std::move(tape), pull_config(/*tau=*/1)) {
    r.join(la, a);
  }
};
/// The syncer's pull of fragment 1 at `slot` (version 0) to learner 1; a second ask if `repeat`.
Message pull_of_fragment_1(const Plan& plan, std::uint64_t slot, bool repeat = false) {
  Message m;
  m.type = MessageType::pull;
  m.fingerprint = plan.fingerprint();
  m.learner = 1;
  m.fragment = 1;
  m.version = 0;
  m.step = slot;
  m.repeat = repeat;
  return m;
}
std::vector<Message> of_type(const std::vector<Message>& seen, MessageType t) {
  std::vector<Message> r;
  for (const auto& m : seen)
    if (m.type == t) r.push_back(m);
  return r;
}
}  // namespace

TEST_CASE("Pull rounds: each fragment is pulled at its slot from every learner with progress, merged once, and "
          "applied tau steps after the answer; the answer is the paper's outer gradient bit for bit",
          "[outer_loop][pull]") {
  Rig r(1024, {}, pull_config(/*tau=*/1));
  VecParams a = zero_params(), b = zero_params();
  auto ta = r.net.learner(1), tb = r.net.learner(2);
  Outer la(r.plan, ta, pull_learner(1, 1)), lb(r.plan, tb, pull_learner(2, 1));
  r.join(la, a);
  r.join(lb, b);
  const Flat theta0 = r.syncer.fragment(1).first;  // Theta_1 at version 0: the learners' base
  for (int s = 1; s <= 2; ++s) {
    inner_step(a), la.step(a, 16);
    inner_step(b), lb.step(b, 16);
    r.pump();
  }
  // Global step 2 is fragment 1's slot: both learners have progress, both pulled, nothing sent yet.
  CHECK(r.syncer.status().pull_rounds == 1);
  CHECK(r.syncer.status().pulls_sent == 2);
  CHECK(r.contributions().empty());
  CHECK(of_type(r.seen, MessageType::metadata).size() == 4);
  inner_step(a), la.step(a, 16);
  const Flat local_a = concat({values(a[kB]), values(a[kC])});
  inner_step(b), lb.step(b, 16);
  r.pump();
  const auto answers = r.contributions();
  REQUIRE(answers.size() == 2);
  for (const auto& m : answers) {
    CHECK(m.fragment == 1);
    CHECK(m.steps == 3);
    CHECK(m.tokens == 48);
    CHECK(m.version == 0);
  }
  // Learner 1's answer, v = base - theta with base = Theta^(t-H): the same fp32 subtraction, bit for bit.
  const auto& va = answers[0].learner == 1 ? *answers[0].payload : *answers[1].payload;
  REQUIRE(va.size() == local_a.size());
  for (std::size_t i = 0; i < va.size(); ++i) CHECK(std::bit_cast<std::uint32_t>(va[i]) ==
                                                    std::bit_cast<std::uint32_t>(theta0[i] - local_a[i]));
  // One merge of both answers: Theta_1 = the learners' fragment after 3 steps.
  CHECK(r.syncer.status().fragments[1].merges == 1);
  CHECK(r.syncer.status().fragments[1].last_quorum_size == 2);
  CHECK(r.global_tensor(kB) == local_after(kB, 3));
  // Applied at answer (step 3) + tau = step 4: overwritten with the global.
  inner_step(a);
  const auto rep = la.step(a, 16);
  CHECK(rep.applied == 1);
  CHECK(values(a[kB]) == local_after(kB, 3));
  CHECK(la.status().pulls == 1);
}

TEST_CASE("Pull rounds: a learner whose answer is lost is asked again once it has moved on, and its steps reach "
          "the merge; the first answer, arriving after all, is dropped, not merged twice",
          "[outer_loop][pull]") {
  // H = 4, P = 2, tau = 1: fragment 1's slot is global step 2; both learners answer it after step 3.
  // Learner 1's answer does not reach the syncer; the round waits for it (no time passes, so the
  // pull time-out never comes). The syncer pulled learner 1 at its step 2, so its metadata for step
  // 2 + reask_after_steps (3) = 5 brings a second ask, answered after step 6 with every step since
  // its base: the merge holds learner 1's 6 steps and learner 2's 3.
  const bool late = GENERATE(false, true);  // the first answer is lost / only late
  INFO((late ? "late" : "lost"));
  Rig r(1024, {}, pull_config(/*tau=*/1));
  REQUIRE(r.syncer.config().reask_after_steps == 3);
  VecParams a = zero_params(), b = zero_params();
  auto ta = r.net.learner(1), tb = r.net.learner(2);
  Outer la(r.plan, ta, pull_learner(1, 1)), lb(r.plan, tb, pull_learner(2, 1));
  r.join(la, a);
  r.join(lb, b);
  std::optional<Message> held;  // learner 1's first answer, kept from the syncer
  const auto pump = [&] {
    while (auto m = r.link.try_receive()) {
      if (!held && m->type == MessageType::contribution && m->learner == 1 && m->fragment == 1) {
        held = std::move(*m);
        continue;
      }
      r.seen.push_back(*m);
      r.syncer.handle(*m, r.out);
      for (auto& o : r.out) r.link.send_to(o.to, std::move(o.message));
      r.out.clear();
    }
  };
  for (int s = 1; s <= 6; ++s) {
    inner_step(a), la.step(a, 16);
    inner_step(b), lb.step(b, 16);
    pump();
    if (s < 5) CHECK(r.syncer.status().pulls_repeated == 0);
    if (s < 6) CHECK(r.syncer.status().fragments[1].merges == 0);  // learner 1's answer is awaited
  }
  REQUIRE(held.has_value());
  CHECK_FALSE(held->repeat);
  CHECK(held->steps == 3);
  const auto st = r.syncer.status();
  CHECK(st.pulls_repeated == 1);
  CHECK(la.status().pulls_repeated == 1);
  CHECK(lb.status().pulls_repeated == 0);
  std::vector<Message> again;
  for (const auto& m : r.contributions())
    if (m.learner == 1 && m.fragment == 1) again.push_back(m);
  REQUIRE(again.size() == 1);
  CHECK(again[0].repeat);
  CHECK(again[0].version == 0);  // the same base as the lost answer: every step since it
  CHECK(again[0].steps == 6);
  CHECK(again[0].tokens == 6 * 16);
  CHECK(st.fragments[1].merges == 1);
  CHECK(st.fragments[1].last_quorum_size == 2);
  CHECK(st.pull_timeouts == 0);
  // Equal weights: Theta_1 = the mean of the two learners' fragments, after 6 and 3 steps.
  CHECK(r.global_tensor(kB) == local_after(kB, 4.5));
  CHECK(r.global_tensor(kC) == local_after(kC, 4.5));
  CHECK(st.rejected_total() == 0);
  if (late) {
    // A network copy of the answer taken is a duplicate; the first answer, coming after all, is
    // redundant: dropped, not refused, and merged nowhere.
    const auto global = r.syncer.global_parameters();
    r.syncer.handle(again[0], r.out);
    r.syncer.handle(*held, r.out);
    r.out.clear();
    const auto after = r.syncer.status();
    CHECK(after.answers_redundant == 1);
    CHECK(after.rejected_total() == 1);
    CHECK(after.rejected[static_cast<std::size_t>(RejectReason::duplicate)] == 1);
    CHECK(after.contributions_accepted == st.contributions_accepted);
    CHECK(after.fragments[1].merges == 1);
    CHECK(r.syncer.global_parameters() == global);
  }
}

TEST_CASE_METHOD(OnePullLearner,
                 "Pull rounds: a learner answers a second ask of the pull it answered once, from the same base, and not "
                 "one for a pull whose answer is still to be sent",
                 "[outer_loop][pull]") {
  for (int s = 1; s <= 2; ++s) {
    inner_step(a), la.step(a, 16);
    r.pump();  // global step 2: fragment 1's round pulls learner 1
  }
  REQUIRE(r.syncer.status().pulls_sent == 1);
  const Message ask = pull_of_fragment_1(r.plan, 2, /*repeat=*/true);  // the same pull, asked again
  // Before the answer went out: the second ask changes nothing (one answer, not marked).
  r.link.send_to(1, Message(ask));
  inner_step(a), la.step(a, 16);
  auto got = r.intercept();
  std::vector<Message> answers;
  for (auto& m : got)
    if (m.type == MessageType::contribution) answers.push_back(m);
  REQUIRE(answers.size() == 1);
  CHECK_FALSE(answers[0].repeat);
  CHECK(la.status().pulls_repeated == 0);
  // After it: answered again, marked, with every step since the base; a copy of the ask (a
  // duplicated message) and a later one are not answered a third time.
  r.link.send_to(1, Message(ask));
  r.link.send_to(1, Message(ask));
  answers.clear();
  for (int s = 4; s <= 6; ++s) {
    if (s == 5) r.link.send_to(1, Message(ask));
    inner_step(a), la.step(a, 16);
    for (auto& m : r.intercept())
      if (m.type == MessageType::contribution) answers.push_back(m);
  }
  REQUIRE(answers.size() == 1);
  CHECK(answers[0].repeat);
  CHECK(answers[0].fragment == 1);
  CHECK(answers[0].version == 0);
  CHECK(answers[0].steps == 4);
  CHECK(la.status().pulls_repeated == 1);
}

TEST_CASE("Pull rounds: a second answer still unsent when the next round's pull comes answers that pull, unmarked, "
          "and a second ask of that pull is answered again",
          "[outer_loop][pull]") {
  // The syncer's mailbox holds 2 messages, so an answer can wait in the learner (refused by the
  // transport). A `repeat` answer is one the syncer takes only for an open second ask: once it
  // has the first answer, it drops a `repeat` as redundant. Sent for the new round's pull, it
  // would be dropped and that round would lose this learner's answer.
  OnePullLearner one(2);
  auto& [r, a, ta, la] = one;
  for (int s = 1; s <= 2; ++s) {
    inner_step(a), la.step(a, 16);
    r.pump();  // global step 2: fragment 1's round pulls learner 1
  }
  REQUIRE(r.syncer.status().pulls_sent == 1);
  const auto answers_in = [](const std::vector<Message>& got) { return of_type(got, MessageType::contribution); };
  inner_step(a), la.step(a, 16);  // step 3: the first answer and the step's metadata fill the mailbox
  CHECK(la.status().send_failures == 0);
  // The syncer asks again (the first answer had not reached it); the second answer is refused
  // by the full mailbox and waits.
  r.link.send_to(1, pull_of_fragment_1(r.plan, 2, /*repeat=*/true));
  inner_step(a), la.step(a, 16);  // step 4
  CHECK(la.status().pulls_repeated == 1);
  CHECK(la.status().send_failures >= 1);
  const auto first = answers_in(r.intercept(true));
  REQUIRE(first.size() == 1);
  CHECK_FALSE(first[0].repeat);
  // The first answer was merged (version 1); the next round's pull comes while the second
  // answer still waits. The mailbox is full again before the step that reads it.
  Message next = pull_of_fragment_1(r.plan, 6);
  next.version = 1;
  r.link.send_to(1, std::move(next));
  Message ask_next = pull_of_fragment_1(r.plan, 6, /*repeat=*/true);
  ask_next.version = 1;
  Message filler;
  filler.type = MessageType::heartbeat;
  filler.fingerprint = r.plan.fingerprint();
  filler.learner = 9;
  auto other = r.net.learner(9);
  REQUIRE(other.send(Message(filler)));
  REQUIRE(other.send(Message(filler)));
  inner_step(a), la.step(a, 16);  // step 5: the new pull is taken, the answer still waits
  CHECK(la.status().pulls == 2);
  CHECK(answers_in(r.intercept(true)).empty());
  inner_step(a), la.step(a, 16);  // step 6: it goes, as the new pull's answer
  auto sent = answers_in(r.intercept(true));
  REQUIRE(sent.size() == 1);
  CHECK_FALSE(sent[0].repeat);
  CHECK(sent[0].steps == 6);
  // A second ask of the new round's pull is answered again, marked, once.
  r.link.send_to(1, Message(ask_next));
  inner_step(a), la.step(a, 16);  // step 7
  sent = answers_in(r.intercept(true));
  REQUIRE(sent.size() == 1);
  CHECK(sent[0].repeat);
  CHECK(sent[0].steps == 7);
  CHECK(la.status().pulls_repeated == 2);
}

TEST_CASE("Pull rounds are the default: a learner whose config names no round joins a pull syncer, sends metadata "
          "every step and answers its pull",
          "[outer_loop][pull]") {
  CHECK(OuterLoopConfig{}.round == RoundMode::pull);
  Rig r(1024, {}, pull_config(/*tau=*/1));
  VecParams a = zero_params();
  auto ta = r.net.learner(1);
  OuterLoopConfig c;  // as in the README: an id, H and tau, nothing else
  c.id = 1;
  c.sync_every = 4;
  c.overlap = 1;
  Outer la(r.plan, ta, c);
  r.join(la, a);
  for (int s = 1; s <= 3; ++s) {
    inner_step(a), la.step(a, 16);
    r.pump();
  }
  CHECK(of_type(r.seen, MessageType::metadata).size() == 3);
  CHECK(la.status().pulls == 1);
  REQUIRE(r.contributions().size() == 1);
  CHECK(r.syncer.status().fragments[1].merges == 1);
}

TEST_CASE("prepare_step() names exactly the fragments the next step reads or writes, and that step does not drain "
          "again",
          "[outer_loop][pull]") {
  using Frags = std::vector<std::size_t>;
  SECTION("pull rounds: a pull to answer, then the global to apply; nothing between") {
    Rig r(1024, {}, pull_config(/*tau=*/1));
    VecParams a = zero_params(), b = zero_params();
    auto ta = r.net.learner(1), tb = r.net.learner(2);
    Outer la(r.plan, ta, pull_learner(1, 1)), lb(r.plan, tb, pull_learner(2, 1));
    r.join(la, a);
    r.join(lb, b);
    CHECK_THROWS_AS(Outer(r.plan, ta, pull_learner(1, 1)).prepare_step(), StateError);  // before join
    for (int s = 1; s <= 2; ++s) {
      CHECK(la.prepare_step() == Frags{});
      inner_step(a), la.step(a, 16);
      inner_step(b), lb.step(b, 16);
      r.pump();  // global step 2: fragment 1 is pulled from both
    }
    CHECK(la.prepare_step() == Frags{1});  // the pull, answered by this step
    inner_step(a);
    CHECK(la.step(a, 16).sent == std::optional<std::size_t>{1});
    inner_step(b), lb.step(b, 16);
    r.pump();  // both answers in: merged, the global sent
    CHECK(la.prepare_step() == Frags{1});  // answer (step 3) + tau: applied by step 4
    inner_step(a);
    CHECK(la.step(a, 16).applied == 1);
    CHECK(la.prepare_step() == Frags{});
    inner_step(a);
    const auto quiet = la.step(a, 16);
    CHECK((!quiet.sent && quiet.applied == 0));
  }
  SECTION("a message that arrives between prepare_step() and step() waits for the step after") {
    OnePullLearner one;
    Rig& r = one.r;
    VecParams& a = one.a;
    Outer& la = one.la;
    for (int s = 1; s <= 2; ++s) {
      inner_step(a), la.step(a, 16);
      if (s == 1) r.pump();
    }
    CHECK(la.prepare_step() == Frags{});  // step 2's metadata has not reached the syncer yet
    r.pump();                             // it has now: fragment 1's round opens, its pull is delivered
    REQUIRE(r.syncer.status().pulls_sent == 1);
    inner_step(a);
    CHECK_FALSE(la.step(a, 16).sent.has_value());  // prepared without the pull: not taken by this step
    CHECK(la.status().pulls == 0);
    CHECK(la.prepare_step() == Frags{1});
    inner_step(a);
    CHECK(la.step(a, 16).sent == std::optional<std::size_t>{1});
    CHECK(la.status().pulls == 1);
  }
  SECTION("push rounds: the fragment due at the next step and those awaiting their global") {
    Rig r;
    auto lt = r.net.learner(1);
    Outer outer(r.plan, lt, learner_config(1, /*tau=*/2));
    VecParams params = zero_params();
    r.join(outer, params);
    // H = 4, P = 2: fragment 1 due at 2, fragment 0 at 4; tau = 2.
    const std::vector<Frags> expect = {{}, {}, {1}, {1}, {0, 1}, {0}, {0, 1}};
    for (std::uint64_t t = 1; t <= 6; ++t) {
      INFO("step " << t);
      CHECK(outer.prepare_step() == expect[t]);
      inner_step(params);
      outer.step(params, 1);
      r.pump();
    }
  }
}

TEST_CASE("Pull rounds: with apply_every = 3 a global whose time has come waits for the next multiple of 3, in "
          "step() and in poll(); push rounds refuse apply_every",
          "[outer_loop][pull]") {
  Rig r(1024, {}, pull_config(/*tau=*/1));
  VecParams a = zero_params(), b = zero_params();
  auto ta = r.net.learner(1), tb = r.net.learner(2);
  OuterLoopConfig held = pull_learner(1, 1);
  held.apply_every = 3;
  Outer la(r.plan, ta, held), lb(r.plan, tb, pull_learner(2, 1));
  r.join(la, a);
  r.join(lb, b);
  std::vector<std::size_t> applied_a, applied_b;  // the steps at which each learner applied a global
  for (std::size_t s = 1; s <= 12; ++s) {
    inner_step(a);
    if (la.step(a, 16).applied > 0) applied_a.push_back(s);
    inner_step(b);
    if (lb.step(b, 16).applied > 0) applied_b.push_back(s);
    r.pump();
    CHECK(la.poll(a) == 0);  // between steps nothing is applied off the grid either
  }
  // Both answered fragment 1's pull (slot 2) at step 3: learner 2 applies at 3 + tau = 4, learner 1 at 6.
  REQUIRE(!applied_b.empty());
  CHECK(applied_b.front() == 4);
  REQUIRE(!applied_a.empty());
  CHECK(applied_a.front() == 6);
  for (std::size_t s : applied_a) CHECK(s % 3 == 0);
  CHECK(la.status().applies == lb.status().applies);  // held, not lost
  CHECK(la.status().late_applies > 0);
  OuterLoopConfig push = learner_config(3, 1);
  push.apply_every = 2;
  auto t3 = r.net.learner(3);
  CHECK_THROWS_WITH(Outer(r.plan, t3, push), Catch::Contains("apply_every = 2") && Catch::Contains("pull"));
  held.apply_every = 0;
  CHECK_THROWS_WITH(Outer(r.plan, t3, held), Catch::Contains("apply_every = 0"));
}

TEST_CASE("Pull rounds: announce_applies announces each global at a step that may apply and applies exactly those "
          "values apply_every steps later, in step() only; an announced fragment's pull waits for the apply",
          "[outer_loop][pull]") {
  Rig r(1024, {}, pull_config(/*tau=*/1));
  VecParams a = zero_params(), b = zero_params();
  auto ta = r.net.learner(1), tb = r.net.learner(2);
  OuterLoopConfig ahead = pull_learner(1, 1);
  ahead.apply_every = 3;
  ahead.announce_applies = true;
  Outer la(r.plan, ta, ahead), lb(r.plan, tb, pull_learner(2, 1));
  r.join(la, a);
  r.join(lb, b);
  struct Announced {
    std::size_t step;
    AppliedFragment global;
  };
  std::vector<Announced> out;  // announced, not yet applied
  std::size_t announced = 0, applied = 0;
  const std::uint64_t applies_at_join = la.status().applies;  // the join writes every fragment
  for (std::size_t s = 1; s <= 24; ++s) {
    inner_step(a);
    const StepReport rep = la.step(a, 16);
    if (rep.sent) {
      for (const auto& x : out) CHECK(x.global.fragment != *rep.sent);  // its pull waits for the apply
    }
    REQUIRE(rep.applied_fragments.size() == rep.applied);
    for (const AppliedFragment& g : rep.applied_fragments) {
      ++applied;
      CHECK(s % 3 == 0);
      const auto it = std::find_if(out.begin(), out.end(), [&](const Announced& x) { return x.global.fragment == g.fragment; });
      REQUIRE(it != out.end());
      CHECK(it->step + 3 == s);  // at the next step that may apply
      CHECK(it->global.version == g.version);
      CHECK(it->global.values == g.values);  // the announced values themselves
      for (std::size_t t : r.plan.fragments()[g.fragment].tensors) {  // written into the parameters (alpha = 0)
        const std::size_t off = r.plan.offset_in_fragment(t), n = r.plan.tensors()[t].numel;
        CHECK(values(a[t]) == Flat(g.values->begin() + off, g.values->begin() + off + n));
      }
      CHECK(la.base_version(g.fragment) == g.version);
      out.erase(it);
    }
    for (const AppliedFragment& g : rep.announced) {
      ++announced;
      CHECK(s % 3 == 0);
      for (const auto& x : out) CHECK(x.global.fragment != g.fragment);  // one announcement at a time per fragment
      out.push_back({s, g});
    }
    inner_step(b);
    lb.step(b, 16);
    r.pump();
    CHECK(la.poll(a) == 0);  // poll() neither applies nor announces
  }
  CHECK(announced >= 4);
  CHECK(applied + out.size() == announced);
  CHECK(la.status().applies - applies_at_join == applied);
  CHECK(la.status().pulls_deferred_steps > 0);
  OuterLoopConfig push = learner_config(3, 1);
  push.announce_applies = true;
  auto t3 = r.net.learner(3);
  CHECK_THROWS_WITH(Outer(r.plan, t3, push), Catch::Contains("announce_applies") && Catch::Contains("pull"));
}

TEST_CASE("Pull rounds: learners that joined and never trained are not waited for, so a flood of idle ids costs "
          "no grace window",
          "[outer_loop][pull]") {
  SyncerConfig c = pull_config(1);
  c.quorum.grace = true;
  c.quorum.cap = 1s;
  c.quorum.gamma = 1.0;
  Rig r(4096, {}, c);
  VecParams a = zero_params();
  auto ta = r.net.learner(1);
  Outer la(r.plan, ta, pull_learner(1, 1));
  r.join(la, a);
  for (LearnerId id = 100; id < 150; ++id) {  // join, then stay silent
    Message j;
    j.type = MessageType::join;
    j.fingerprint = r.plan.fingerprint();
    j.learner = id;
    j.sequence = 7 + id;
    r.syncer.handle(j, r.out);
    r.out.clear();
  }
  REQUIRE(r.syncer.alive() == 51);
  for (int s = 1; s <= 3; ++s) {
    r.clock.advance(100ms);  // 100 ms steps: the grace budget tau x xi_step is there
    inner_step(a), la.step(a, 16);
    r.pump();
  }
  // The round at step 2 pulled learner 1 at once (it is the only learner with
  // progress) and merged its answer at step 3, without waiting for the 50.
  CHECK(r.syncer.status().pulls_sent == 1);
  CHECK(r.syncer.status().fragments[1].merges == 1);
  CHECK(r.syncer.status().grace_waits() == 0);
}

TEST_CASE("Pull rounds: K learners, then the grace window, then the pull; a pulled learner that never answers is "
          "not waited for beyond the pull time-out",
          "[outer_loop][pull]") {
  SyncerConfig c = pull_config(1, /*k=*/1);
  c.quorum.grace = true;
  c.quorum.cap = 50ms;
  c.quorum.gamma = 1.0;
  c.pull_timeout = 200ms;
  Rig r(1024, {}, c);
  VecParams a = zero_params(), b = zero_params();
  auto ta = r.net.learner(1), tb = r.net.learner(2);
  Outer la(r.plan, ta, pull_learner(1, 1)), lb(r.plan, tb, pull_learner(2, 1));
  r.join(la, a);
  r.join(lb, b);
  // Learner 2 trains one step and stops (it is alive: heartbeat time-out 10 s).
  inner_step(b), lb.step(b, 16);
  r.pump();
  r.clock.advance(100ms);
  inner_step(a), la.step(a, 16);
  r.pump();
  r.clock.advance(100ms);
  inner_step(a), la.step(a, 16);  // global step 2: fragment 1's round opens
  r.pump();
  // Both have progress on fragment 1: the quorum (K = 1) is there, every
  // eligible learner too, so the pull goes out at once to both.
  CHECK(r.syncer.status().pulls_sent == 2);
  inner_step(a), la.step(a, 16);  // learner 1 answers; learner 2 is not stepping
  r.pump();
  CHECK(r.syncer.status().fragments[1].merges == 0);  // waiting for learner 2's answer
  const auto wake = r.syncer.next_wakeup();
  REQUIRE(wake);
  r.clock.advance(300ms);
  r.syncer.tick(r.out);
  r.out.clear();
  CHECK(r.syncer.status().fragments[1].merges == 1);
  CHECK(r.syncer.status().pull_timeouts == 1);
  CHECK(r.syncer.status().fragments[1].last_quorum_size == 1);
}

TEST_CASE("Pull rounds: a straggler's answer weighs in by its progress (tokens^2 / steps)", "[outer_loop][pull]") {
  BasicRig<Syncer<WeightedAverage, AverageOnly, TokenWeights>> r(1024, {}, pull_config(1));
  VecParams a = zero_params(), b = zero_params();
  auto ta = r.net.learner(1), tb = r.net.learner(2);
  Outer la(r.plan, ta, pull_learner(1, 1)), lb(r.plan, tb, pull_learner(2, 1));
  r.join(la, a);
  r.join(lb, b);
  // Learner 1 steps every tick, learner 2 every other tick (2x slower).
  int b_steps = 0;
  for (int s = 1; s <= 2; ++s) {
    inner_step(a), la.step(a, 16);
    if (s % 2 == 1) inner_step(b), lb.step(b, 16), ++b_steps;
    r.pump();
  }
  REQUIRE(r.syncer.status().pulls_sent == 2);
  inner_step(a), la.step(a, 16);  // learner 1 answers with 3 steps
  r.pump();
  inner_step(b), lb.step(b, 16), ++b_steps;  // learner 2 answers with 2 steps
  r.pump();
  REQUIRE(r.syncer.status().fragments[1].merges == 1);
  // w1 = 48^2 / 3 = 768, w2 = 32^2 / 2 = 512: Theta = init - (768 v1 + 512 v2) / 1280.
  const double w1 = 48.0 * 48.0 / 3.0, w2 = 32.0 * 32.0 / 2.0;
  const Flat g = r.global_tensor(kB);
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double v1 = 3.0 * kRate[kB], v2 = static_cast<double>(b_steps) * kRate[kB];
    CHECK(g[i] == Approx(kInit[kB][i] - (w1 * v1 + w2 * v2) / (w1 + w2)).epsilon(1e-6));
  }
}

TEST_CASE("Pull rounds: an answer from the previous global is anchored at the current one: (Theta - Theta^(b)) + v",
          "[outer_loop][pull]") {
  Rig r(1024, {}, pull_config(1));
  VecParams a = zero_params(), b = zero_params();
  auto ta = r.net.learner(1), tb = r.net.learner(2);
  Outer la(r.plan, ta, pull_learner(1, 1)), lb(r.plan, tb, pull_learner(2, 1));
  r.join(la, a);
  r.join(lb, b);
  // Round 1 of fragment 1 (slot 2) merges both learners; learner 2 never gets the result.
  const auto pump_dropping_b = [&] {
    while (auto m = r.link.try_receive()) {
      r.seen.push_back(*m);
      r.syncer.handle(*m, r.out);
      for (auto& o : r.out)
        if (!(o.to == 2 && o.message.type == MessageType::global_fragment)) r.link.send_to(o.to, std::move(o.message));
      r.out.clear();
    }
  };
  for (int s = 1; s <= 6; ++s) {
    inner_step(a), la.step(a, 16);
    inner_step(b), lb.step(b, 16);
    pump_dropping_b();
  }
  // Step 6 opened round 2 of fragment 1; learner 2 still has base version 0.
  REQUIRE(r.syncer.fragment(1).second == 1);
  REQUIRE(lb.base_version(1) == 0);
  const Flat theta1 = r.syncer.fragment(1).first;
  inner_step(a), la.step(a, 16);
  inner_step(b), lb.step(b, 16);
  const Flat local_b = concat({values(b[kB]), values(b[kC])});
  pump_dropping_b();
  CHECK(r.syncer.status().contributions_anchored == 1);
  CHECK(r.syncer.fragment(1).second == 2);
  // Learner 2's anchored outer gradient is Theta^(1) - theta_b, so (with the
  // plain average of AverageOnly) it pulls the global towards theta_b exactly
  // as learner 1's pulls it towards theta_a: Theta^(2) = mean(theta_a, theta_b).
  const Flat local_a = concat({values(a[kB]), values(a[kC])});
  const Flat theta2 = r.syncer.fragment(1).first;
  for (std::size_t i = 0; i < theta2.size(); ++i)
    CHECK(theta2[i] == Approx(0.5 * (local_a[i] + local_b[i])).margin(1e-5));
  (void)theta1;
}

TEST_CASE("Pull rounds: a learner in push mode is refused by a pull syncer, naming both modes", "[outer_loop][pull]") {
  Rig r(1024, {}, pull_config(1));
  VecParams a = zero_params();
  OuterLoopConfig c = learner_config(1, 1);
  c.round = RoundMode::push;
  auto ta = r.net.learner(1);
  Outer la(r.plan, ta, c);
  la.begin_join(a);
  r.pump();
  try {
    la.poll_join(a);
    FAIL("the join was not refused");
  } catch (const ProtocolError& e) {
    const std::string what = e.what();
    CHECK(what.find("runs pull rounds but this learner runs push rounds") != std::string::npos);
    CHECK(what.find("--round") != std::string::npos);
  }
}

TEST_CASE("Pull rounds: a duplicated pull is answered once", "[outer_loop][pull]") {
  FaultTape tape(3);
  MessageFaults f;
  f.duplicate = 1.0;  // every message twice, pulls included
  tape.set_message_faults(f);
  OnePullLearner one(1024, tape);
  auto& [r, a, ta, la] = one;
  for (int s = 1; s <= 5; ++s) {
    inner_step(a), la.step(a, 16);
    r.pump();
  }
  CHECK(la.status().pulls == 2);  // fragment 1 at slot 2, fragment 0 at slot 4
  CHECK(la.status().sends == 2);
  CHECK(r.syncer.status().fragments[1].last_quorum_size == 1);
}

TEST_CASE_METHOD(OnePullLearner,
                 "Pull rounds: a learner that outran the merge round trip waits for the global on its way instead of "
                 "answering on a base the syncer can no longer anchor at",
                 "[outer_loop][pull]") {
  // anchor_versions = 1: one previous global kept.
  // The syncer's globals are held back (a slow down-link) until `hold` is lifted.
  std::vector<Outbox::value_type> held;
  bool hold = true;
  auto pump = [&] {
    while (auto m = r.link.try_receive()) {
      r.seen.push_back(*m);
      r.syncer.handle(*m, r.out);
      for (auto& o : r.out) {
        if (hold && o.message.type == MessageType::global_fragment) held.push_back(std::move(o));
        else r.link.send_to(o.to, std::move(o.message));
      }
      r.out.clear();
    }
  };
  auto step = [&] {
    inner_step(a);
    la.step(a, 16);
    pump();
  };
  // Fragment 1's slots are global steps 2, 6, 10. Its answers at steps 3 and 7 are on base 0:
  // merged as versions 1 and 2, which do not arrive. The pull at 10 anchors at version 1 or later.
  for (int s = 1; s <= 11; ++s) step();
  const auto& st = r.syncer.status();
  CHECK(r.syncer.status().fragments[1].merges == 2);
  CHECK(la.base_version(1) == 0);
  CHECK(la.status().pulls == 3 + 2);  // fragment 0 at 4 and 8 as well
  CHECK(la.status().pulls_deferred_steps == 1);  // step 11: no answer on base 0
  CHECK(st.rejected[static_cast<std::size_t>(RejectReason::stale)] == 0);
  // The globals arrive: applied at step 12 (answer + tau has passed), answered at 13 on version 2.
  hold = false;
  for (auto& o : held) r.link.send_to(o.to, std::move(o.message));
  held.clear();
  step();
  CHECK(la.base_version(1) == 2);
  const std::size_t before = r.contributions().size();
  step();
  const auto c = r.contributions();
  REQUIRE(c.size() > before);
  const auto& answer = c.back().fragment == 1 ? c.back() : c[c.size() - 2];
  CHECK(answer.fragment == 1);
  CHECK(answer.version == 2);
  CHECK(answer.steps == 1);  // step 13, since the apply at 12
  const auto after = r.syncer.status();
  CHECK(after.fragments[1].merges == 3);
  CHECK(after.rejected[static_cast<std::size_t>(RejectReason::stale)] == 0);
  CHECK(la.status().pulls_deferred_steps == 2);  // steps 11 and 12
}

TEST_CASE_METHOD(OnePullLearner,
                 "Pull rounds: a pull repeated after a time-out, of the version just answered from the same base, is not "
                 "answered twice within H steps; later it is (the answer may have been lost)",
                 "[outer_loop][pull]") {
  auto pull = [&](std::uint64_t slot) { r.link.send_to(1, pull_of_fragment_1(r.plan, slot)); };
  auto step = [&] {
    inner_step(a);
    la.step(a, 16);
    (void)r.intercept();  // a syncer that never answers
  };
  step();
  pull(1);
  step();  // answered at step 2
  CHECK(la.status().sends == 1);
  pull(5);  // the round timed out before the answer arrived: pulled again
  step();
  step();
  CHECK(la.status().sends == 1);
  CHECK(la.status().pulls == 1);
  for (int s = 0; s < 4; ++s) step();  // step 8: more than H = 4 steps after the answer
  pull(9);
  step();
  CHECK(la.status().sends == 2);
  CHECK(la.status().pulls == 2);
}
