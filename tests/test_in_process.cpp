// Tests for ddiloco/transport/in_process.hpp: delivery, back-pressure, virtual
// and real time, faults from a tape, killed endpoints, shutdown, and many
// threads at once. Catch2 v2 assertions are not thread-safe, so worker
// threads only record what they saw; the main thread checks it.
// DDILOCO_TEST_LABEL(threaded)
#include <ddiloco/transport/in_process.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <latch>
#include <map>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

using namespace std::chrono_literals;
using ddiloco::Endpoint;
using ddiloco::EndpointCounters;
using ddiloco::FaultTape;
using ddiloco::InProcessLearnerTransport;
using ddiloco::InProcessNetwork;
using ddiloco::InProcessSyncerTransport;
using ddiloco::LearnerId;
using ddiloco::Message;
using ddiloco::MessageType;
using ddiloco::SteadyClock;
using ddiloco::TimePoint;
using ddiloco::VirtualClock;

static_assert(ddiloco::LearnerTransport<InProcessLearnerTransport>);
static_assert(ddiloco::SyncerTransport<InProcessSyncerTransport>);
static_assert(!ddiloco::LearnerTransport<InProcessSyncerTransport>);  // no send(Message&&)
static_assert(!ddiloco::SyncerTransport<InProcessLearnerTransport>);  // no send_to

namespace {
Message msg(MessageType type, LearnerId learner, std::uint64_t sequence = 0, std::vector<float> payload = {}) {
  Message m;
  m.type = type;
  m.learner = learner;
  m.sequence = sequence;
  if (!payload.empty()) m.payload = ddiloco::make_payload(std::move(payload));
  return m;
}

/// Waits (yielding, not sleeping) until `n` threads block on `e`; fails after 10 s.
void await_waiters(const InProcessNetwork& net, Endpoint e, std::size_t n) {
  const auto give_up = std::chrono::steady_clock::now() + 10s;
  while (net.waiters(e) < n) {
    REQUIRE(std::chrono::steady_clock::now() < give_up);
    std::this_thread::yield();
  }
}

/// A virtual-time driver: jumps the clock from delivery to delivery up to
/// `limit` (inclusive), handing each message to `on` with the time it arrived.
template <class OnMessage>
void deliver_until(VirtualClock& clock, InProcessNetwork& net, InProcessSyncerTransport& syncer, TimePoint limit,
                   OnMessage on) {
  while (auto t = net.next_delivery_time()) {
    if (*t > limit) break;
    clock.advance_to(*t);
    while (auto m = syncer.try_receive()) on(*m, clock.now());
  }
  clock.advance_to(limit);
}

/// (messages sent to `e`) + duplicated == delivered + dropped + pending.
void check_accounting(const InProcessNetwork& net, Endpoint e, std::uint64_t sent_to_it) {
  const auto c = net.counters(e);
  INFO("sent to it " << sent_to_it << ", duplicated " << c.duplicated << ", delivered " << c.delivered
                     << ", dropped " << c.dropped() << ", pending " << net.pending(e));
  CHECK(sent_to_it + c.duplicated == c.delivered + c.dropped() + net.pending(e));
}
}  // namespace

TEST_CASE("A message goes from a learner to the syncer and an answer comes back", "[in_process]") {
  VirtualClock clock;
  InProcessNetwork net(clock);
  auto learner = net.learner(7);
  auto syncer = net.syncer();
  CHECK(&learner.clock() == &clock);
  CHECK(&syncer.clock() == &clock);
  CHECK_FALSE(learner.failed());

  CHECK_FALSE(syncer.try_receive().has_value());
  auto join = msg(MessageType::join, 7, 0, {1.0F, 2.0F, 3.0F});
  const auto* payload_address = join.payload.get();
  REQUIRE(learner.send(std::move(join)));
  auto got = syncer.try_receive();
  REQUIRE(got.has_value());
  CHECK(got->type == MessageType::join);
  CHECK(got->learner == 7);
  CHECK(got->payload.get() == payload_address);  // moved, never copied
  CHECK_FALSE(syncer.try_receive().has_value());

  REQUIRE(syncer.send_to(7, msg(MessageType::full_state, 7, 42, {4.0F, 5.0F})));
  CHECK_FALSE(net.learner(8).try_receive().has_value());  // not for learner 8
  auto answer = learner.receive_until(clock.now() + 1s);
  REQUIRE(answer.has_value());
  CHECK(answer->type == MessageType::full_state);
  CHECK(answer->sequence == 42);
  REQUIRE(answer->payload);
  CHECK(*answer->payload == std::vector<float>{4.0F, 5.0F});

  const auto lc = net.counters(Endpoint::for_learner(7));
  CHECK(lc.sent == 1);
  CHECK(lc.bytes_sent == 3 * sizeof(float));
  CHECK(lc.delivered == 1);
  CHECK(lc.bytes_delivered == 2 * sizeof(float));
  CHECK(lc.dropped() == 0);
  const auto sc = net.counters(Endpoint::syncer());
  CHECK(sc.sent == 1);
  CHECK(sc.delivered == 1);
  CHECK(sc.bytes_delivered == 3 * sizeof(float));
}

TEST_CASE("A zero queue capacity is rejected", "[in_process]") {
  VirtualClock clock;
  CHECK_THROWS_AS(InProcessNetwork(clock, FaultTape{}, 0), ddiloco::InvalidArgument);
}

TEST_CASE("A full queue refuses the next message without blocking, and accepts again once drained",
          "[in_process]") {
  VirtualClock clock;
  InProcessNetwork net(clock, FaultTape::parse("latency 1s\n"), 4);  // nothing deliverable before 1 s
  auto learner = net.learner(1);
  auto syncer = net.syncer();
  for (std::uint64_t i = 0; i < 4; ++i) CHECK(learner.send(msg(MessageType::contribution, 1, i)));
  CHECK_FALSE(learner.send(msg(MessageType::contribution, 1, 4)));
  CHECK_FALSE(learner.send(msg(MessageType::contribution, 1, 5)));
  CHECK(net.pending(Endpoint::syncer()) == 4);
  CHECK(net.counters(Endpoint::syncer()).dropped_queue_full == 2);
  CHECK(net.counters(Endpoint::for_learner(1)).sent == 6);

  CHECK_FALSE(syncer.try_receive().has_value());  // still in flight
  clock.advance(1s);
  auto first = syncer.try_receive();
  REQUIRE(first.has_value());
  CHECK(first->sequence == 0);
  CHECK(learner.send(msg(MessageType::contribution, 1, 6)));
  CHECK_FALSE(learner.send(msg(MessageType::contribution, 1, 7)));

  // The syncer -> learner direction has its own bounded queue.
  for (std::uint64_t i = 0; i < 4; ++i) CHECK(syncer.send_to(1, msg(MessageType::global_fragment, 1, i)));
  CHECK_FALSE(syncer.send_to(1, msg(MessageType::global_fragment, 1, 4)));
  CHECK(net.counters(Endpoint::for_learner(1)).dropped_queue_full == 1);
  check_accounting(net, Endpoint::syncer(), 8);
  check_accounting(net, Endpoint::for_learner(1), 5);
}

TEST_CASE("A delayed message is invisible before its delivery time and visible from it on", "[in_process]") {
  VirtualClock clock(TimePoint{100s});
  InProcessNetwork net(clock, FaultTape::parse("latency 10ms\n"));
  auto learner = net.learner(3);
  auto syncer = net.syncer();
  CHECK_FALSE(net.next_delivery_time().has_value());
  REQUIRE(learner.send(msg(MessageType::heartbeat, 3)));
  REQUIRE(net.next_delivery_time().has_value());
  CHECK(*net.next_delivery_time() == TimePoint{100s + 10ms});

  // A virtual clock never blocks, whatever the deadline.
  CHECK_FALSE(syncer.receive_until(TimePoint{1000s}).has_value());
  clock.advance_to(TimePoint{100s + 10ms - 1ns});
  CHECK_FALSE(syncer.try_receive().has_value());
  CHECK_FALSE(syncer.receive_until(TimePoint{1000s}).has_value());
  CHECK(clock.now() == TimePoint{100s + 10ms - 1ns});  // receiving did not move time
  clock.advance_to(*net.next_delivery_time());
  auto m = syncer.receive_until(clock.now());
  REQUIRE(m.has_value());
  CHECK(m->learner == 3);
  CHECK_FALSE(net.next_delivery_time().has_value());
}

TEST_CASE("With one delivery time, messages arrive in send order across senders", "[in_process]") {
  VirtualClock clock;
  InProcessNetwork net(clock);
  auto syncer = net.syncer();
  const std::vector<LearnerId> order{3, 1, 2, 1, 3, 3, 2};
  for (std::size_t i = 0; i < order.size(); ++i) {
    REQUIRE(net.learner(order[i]).send(msg(MessageType::contribution, order[i], i)));
  }
  for (std::size_t i = 0; i < order.size(); ++i) {
    auto m = syncer.try_receive();
    REQUIRE(m.has_value());
    CHECK(m->learner == order[i]);
    CHECK(m->sequence == i);
  }
}

TEST_CASE("Jittered delivery on a virtual clock is ordered by delivery time and the same in every run",
          "[in_process]") {
  const auto tape = FaultTape::parse("seed 5\nlatency 1ms jitter 20ms\n");
  const auto run = [&] {
    VirtualClock clock;
    InProcessNetwork net(clock, tape);
    auto syncer = net.syncer();
    std::vector<std::pair<std::uint64_t, TimePoint>> got;  // (sequence, time received)
    const auto record = [&](const Message& m, TimePoint at) { got.emplace_back(m.sequence, at); };
    for (std::uint64_t i = 0; i < 50; ++i) {  // a send every millisecond, round-robin over 4 learners
      REQUIRE(net.learner(static_cast<LearnerId>(i % 4)).send(msg(MessageType::contribution, 0, i)));
      deliver_until(clock, net, syncer, clock.now() + 1ms, record);
    }
    deliver_until(clock, net, syncer, clock.now() + 1s, record);
    return got;
  };
  const auto a = run();
  const auto b = run();
  REQUIRE(a.size() == 50);
  CHECK(a == b);
  std::size_t overtaken = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    // Sent at i ms: arrives within [i + 1, i + 21) ms.
    const auto sent = TimePoint{std::chrono::milliseconds(a[i].first)};
    CHECK(a[i].second >= sent + 1ms);
    CHECK(a[i].second < sent + 21ms);
    if (i > 0) {
      CHECK(a[i].second >= a[i - 1].second);
      overtaken += a[i].first < a[i - 1].first ? 1 : 0;
    }
  }
  CHECK(overtaken > 0);  // 20 ms of jitter on 1 ms spacing reorders some messages
}

TEST_CASE("A tape that drops everything delivers nothing and counts every loss", "[in_process]") {
  VirtualClock clock;
  InProcessNetwork net(clock, FaultTape::parse("drop 1\n"));
  auto learner = net.learner(2);
  auto syncer = net.syncer();
  for (std::uint64_t i = 0; i < 100; ++i) {
    CHECK(learner.send(msg(MessageType::contribution, 2, i)));  // a silent loss: send succeeds
    CHECK(syncer.send_to(2, msg(MessageType::global_fragment, 2, i)));
  }
  CHECK_FALSE(net.next_delivery_time().has_value());
  CHECK_FALSE(syncer.try_receive().has_value());
  CHECK_FALSE(learner.try_receive().has_value());
  CHECK(net.counters(Endpoint::syncer()).dropped_fault == 100);
  CHECK(net.counters(Endpoint::for_learner(2)).dropped_fault == 100);
  check_accounting(net, Endpoint::syncer(), 100);
}

TEST_CASE("A tape that duplicates everything delivers each message twice, the copy one latency later",
          "[in_process]") {
  VirtualClock clock;
  InProcessNetwork net(clock, FaultTape::parse("duplicate 1\nlatency 5ms\n"));
  auto learner = net.learner(1);
  auto syncer = net.syncer();
  REQUIRE(learner.send(msg(MessageType::contribution, 1, 10)));
  REQUIRE(learner.send(msg(MessageType::contribution, 1, 11)));
  CHECK(net.counters(Endpoint::syncer()).duplicated == 2);
  CHECK(net.pending(Endpoint::syncer()) == 4);
  // Originals at 5 ms, copies at 10 ms: 10, 11, 10, 11.
  const std::vector<std::pair<std::uint64_t, TimePoint>> expected{
      {10, TimePoint{5ms}}, {11, TimePoint{5ms}}, {10, TimePoint{10ms}}, {11, TimePoint{10ms}}};
  std::vector<std::pair<std::uint64_t, TimePoint>> got;
  while (auto t = net.next_delivery_time()) {
    clock.advance_to(*t);
    while (auto m = syncer.try_receive()) got.emplace_back(m->sequence, clock.now());
  }
  CHECK(got == expected);
  check_accounting(net, Endpoint::syncer(), 2);
}

TEST_CASE("Reordering delays messages within the bound so that later ones overtake", "[in_process]") {
  VirtualClock clock;
  InProcessNetwork net(clock, FaultTape::parse("seed 11\nreorder 1 50ms\n"));
  auto learner = net.learner(1);
  auto syncer = net.syncer();
  std::vector<std::uint64_t> got;
  const auto check = [&](const Message& m, TimePoint at) {
    const auto sent = TimePoint{std::chrono::milliseconds(m.sequence)};
    CHECK(at >= sent);
    CHECK(at < sent + 50ms);
    got.push_back(m.sequence);
  };
  for (std::uint64_t i = 0; i < 100; ++i) {
    REQUIRE(learner.send(msg(MessageType::contribution, 1, i)));
    deliver_until(clock, net, syncer, clock.now() + 1ms - 1ns, check);
    clock.advance(1ns);
  }
  deliver_until(clock, net, syncer, clock.now() + 1s, check);
  REQUIRE(got.size() == 100);
  std::size_t overtaken = 0;
  for (std::size_t i = 1; i < got.size(); ++i) overtaken += got[i] < got[i - 1] ? 1 : 0;
  CHECK(overtaken > 0);
  std::vector<std::uint64_t> sorted = got;
  std::sort(sorted.begin(), sorted.end());
  for (std::uint64_t i = 0; i < 100; ++i) CHECK(sorted[i] == i);  // each exactly once
}

TEST_CASE("A partition cuts one learner off in both directions during its window only", "[in_process]") {
  VirtualClock clock(TimePoint{50s});  // tape times count from the network's creation
  InProcessNetwork net(clock, FaultTape::parse("partition 2 from 1s to 2s\n"));
  auto l1 = net.learner(1);
  auto l2 = net.learner(2);
  auto syncer = net.syncer();
  const auto exchange = [&](std::uint64_t tag) {
    REQUIRE(l1.send(msg(MessageType::heartbeat, 1, tag)));
    REQUIRE(l2.send(msg(MessageType::heartbeat, 2, tag)));
    REQUIRE(syncer.send_to(1, msg(MessageType::global_fragment, 1, tag)));
    REQUIRE(syncer.send_to(2, msg(MessageType::global_fragment, 2, tag)));
    std::map<LearnerId, int> at_syncer;
    while (auto m = syncer.try_receive()) ++at_syncer[m->learner];
    return std::tuple{at_syncer[1], at_syncer[2], l1.try_receive().has_value() ? 1 : 0,
                      l2.try_receive().has_value() ? 1 : 0};
  };
  CHECK(exchange(0) == std::tuple{1, 1, 1, 1});
  clock.advance_to(TimePoint{51s - 1ns});
  CHECK(exchange(1) == std::tuple{1, 1, 1, 1});
  clock.advance_to(TimePoint{51s});
  CHECK(exchange(2) == std::tuple{1, 0, 1, 0});
  clock.advance_to(TimePoint{52s - 1ns});
  CHECK(exchange(3) == std::tuple{1, 0, 1, 0});
  clock.advance_to(TimePoint{52s});
  CHECK(exchange(4) == std::tuple{1, 1, 1, 1});
  CHECK(net.counters(Endpoint::syncer()).dropped_partition == 2);
  CHECK(net.counters(Endpoint::for_learner(2)).dropped_partition == 2);
  CHECK(net.counters(Endpoint::for_learner(1)).dropped_partition == 0);
}

TEST_CASE("A closed learner loses its queue and its traffic; reopened, it starts empty", "[in_process]") {
  VirtualClock clock;
  InProcessNetwork net(clock, FaultTape::parse("latency 1ms\n"));
  auto learner = net.learner(4);
  auto syncer = net.syncer();
  REQUIRE(syncer.send_to(4, msg(MessageType::global_fragment, 4, 1)));
  REQUIRE(syncer.send_to(4, msg(MessageType::global_fragment, 4, 2)));
  REQUIRE(learner.send(msg(MessageType::contribution, 4, 9)));  // in flight when it dies

  net.close(4);
  CHECK_FALSE(net.is_open(4));
  CHECK(net.pending(Endpoint::for_learner(4)) == 0);
  CHECK(net.counters(Endpoint::for_learner(4)).dropped_closed == 2);
  CHECK_FALSE(syncer.send_to(4, msg(MessageType::global_fragment, 4, 3)));
  CHECK_FALSE(learner.send(msg(MessageType::heartbeat, 4)));
  CHECK(net.counters(Endpoint::for_learner(4)).dropped_closed == 3);
  CHECK(net.counters(Endpoint::syncer()).dropped_closed == 1);
  clock.advance(1ms);
  CHECK_FALSE(learner.try_receive().has_value());
  auto in_flight = syncer.try_receive();  // sent before the kill: still delivered
  REQUIRE(in_flight.has_value());
  CHECK(in_flight->sequence == 9);

  net.reopen(4);
  CHECK(net.is_open(4));
  CHECK_FALSE(learner.try_receive().has_value());
  REQUIRE(syncer.send_to(4, msg(MessageType::full_state, 4, 100)));
  REQUIRE(learner.send(msg(MessageType::join, 4)));
  clock.advance(1ms);
  auto fresh = learner.try_receive();
  REQUIRE(fresh.has_value());
  CHECK(fresh->sequence == 100);
  CHECK(syncer.try_receive().has_value());
  check_accounting(net, Endpoint::for_learner(4), 4);
  check_accounting(net, Endpoint::syncer(), 3);
}

TEST_CASE("Counters add up under a tape with every message fault", "[in_process]") {
  VirtualClock clock;
  InProcessNetwork net(
      clock, FaultTape::parse("seed 77\ndrop 0.2\nduplicate 0.3\nreorder 0.3 5ms\nlatency 1ms jitter 2ms\n"
                              "partition 1 from 20ms to 40ms\n"),
      8);
  auto syncer = net.syncer();
  std::map<LearnerId, std::uint64_t> to_learner;
  std::uint64_t to_syncer = 0;
  for (std::uint64_t i = 0; i < 400; ++i) {
    const auto id = static_cast<LearnerId>(i % 3);
    (void)net.learner(id).send(msg(MessageType::contribution, id, i));
    ++to_syncer;
    (void)syncer.send_to(id, msg(MessageType::global_fragment, id, i));
    ++to_learner[id];
    if (i % 5 == 0) (void)syncer.try_receive();
    if (i % 7 == 0) (void)net.learner(id).try_receive();
    clock.advance(250us);
  }
  check_accounting(net, Endpoint::syncer(), to_syncer);
  for (const auto& [id, n] : to_learner) check_accounting(net, Endpoint::for_learner(id), n);
  const auto c = net.counters(Endpoint::syncer());
  CHECK(c.dropped_fault > 0);
  CHECK(c.dropped_partition > 0);
  CHECK(c.dropped_queue_full > 0);
  CHECK(c.duplicated > 0);
}

TEST_CASE("Eight learner threads fan in to the syncer without losing a message", "[in_process][threaded]") {
  SteadyClock clock;
  constexpr std::uint64_t per_learner = 500;
  constexpr LearnerId learners = 8;
  const std::size_t capacity = GENERATE(std::size_t{8 * 500}, std::size_t{16});
  INFO("queue capacity " << capacity);
  InProcessNetwork net(clock, FaultTape{}, capacity);
  auto syncer = net.syncer();
  std::atomic<std::uint64_t> refused{0};
  std::latch start(learners + 1);
  std::vector<std::thread> threads;
  for (LearnerId id = 0; id < learners; ++id) {
    threads.emplace_back([&, id] {
      auto t = net.learner(id);
      start.arrive_and_wait();
      for (std::uint64_t s = 0; s < per_learner; ++s) {
        // Back-pressure: a refused send is retried, as a learner would on its next step.
        while (!t.send(msg(MessageType::contribution, id, s))) {
          refused.fetch_add(1, std::memory_order_relaxed);
          std::this_thread::yield();
        }
      }
    });
  }
  start.arrive_and_wait();
  std::map<LearnerId, std::uint64_t> next;  // per learner: the sequence expected next (FIFO per sender)
  std::uint64_t received = 0;
  bool in_order = true;
  while (received < learners * per_learner) {
    auto m = syncer.receive_until(clock.now() + 10s);  // the deadline only guards against a hang
    REQUIRE(m.has_value());
    in_order = in_order && m->sequence == next[m->learner];
    next[m->learner] = m->sequence + 1;
    ++received;
  }
  for (auto& th : threads) th.join();
  CHECK(in_order);
  CHECK_FALSE(syncer.try_receive().has_value());
  for (LearnerId id = 0; id < learners; ++id) {
    CHECK(next[id] == per_learner);
    CHECK(net.counters(Endpoint::for_learner(id)).sent >= per_learner);
  }
  const auto c = net.counters(Endpoint::syncer());
  CHECK(c.delivered == learners * per_learner);
  CHECK(c.dropped_queue_full == refused.load());
  CHECK(c.dropped() == c.dropped_queue_full);
  if (capacity >= learners * per_learner) CHECK(refused.load() == 0);
}

TEST_CASE("Syncer threads and learner threads exchange messages concurrently", "[in_process][threaded]") {
  SteadyClock clock;
  constexpr LearnerId learners = 4;
  constexpr std::uint64_t rounds = 200;
  InProcessNetwork net(clock);
  std::vector<std::thread> threads;
  std::atomic<std::uint64_t> echoed{0};
  std::atomic<int> refused{0};
  // Two syncer threads echo every message back to its learner.
  for (int s = 0; s < 2; ++s) {
    threads.emplace_back([&] {
      auto syncer = net.syncer();
      while (echoed.load() < learners * rounds) {
        if (auto m = syncer.receive_until(clock.now() + 50ms)) {
          const auto id = m->learner;
          if (!syncer.send_to(id, std::move(*m))) refused.fetch_add(1);
          echoed.fetch_add(1);
        }
      }
    });
  }
  std::vector<std::uint64_t> answered(learners, 0);
  for (LearnerId id = 0; id < learners; ++id) {
    threads.emplace_back([&, id] {
      auto t = net.learner(id);
      for (std::uint64_t r = 0; r < rounds; ++r) {
        if (!t.send(msg(MessageType::heartbeat, id, r))) refused.fetch_add(1);
        auto back = t.receive_until(clock.now() + 10s);
        if (back && back->sequence == r && back->learner == id) ++answered[id];
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(refused.load() == 0);
  for (LearnerId id = 0; id < learners; ++id) CHECK(answered[id] == rounds);
}

TEST_CASE("receive_until on a real clock wakes up when another thread sends", "[in_process][threaded]") {
  SteadyClock clock;
  InProcessNetwork net(clock);
  auto learner = net.learner(1);
  std::optional<Message> got;
  std::chrono::steady_clock::duration waited{};
  std::thread receiver([&] {
    const auto t0 = std::chrono::steady_clock::now();
    got = learner.receive_until(clock.now() + 10s);  // failure guard only
    waited = std::chrono::steady_clock::now() - t0;
  });
  await_waiters(net, Endpoint::for_learner(1), 1);  // it is blocked now
  REQUIRE(net.syncer().send_to(1, msg(MessageType::global_fragment, 1, 5)));
  receiver.join();
  REQUIRE(got.has_value());
  CHECK(got->sequence == 5);
  CHECK(waited < 5s);
  CHECK(net.waiters(Endpoint::for_learner(1)) == 0);
}

TEST_CASE("receive_until on a real clock waits for a delayed message's delivery time", "[in_process]") {
  SteadyClock clock;
  InProcessNetwork net(clock, FaultTape::parse("latency 30ms\n"));
  auto syncer = net.syncer();
  const auto sent_at = clock.now();
  REQUIRE(net.learner(1).send(msg(MessageType::heartbeat, 1)));
  auto m = syncer.receive_until(sent_at + 10s);
  const auto got_at = clock.now();
  REQUIRE(m.has_value());
  CHECK(got_at - sent_at >= 30ms);
  CHECK(got_at - sent_at < 5s);
}

TEST_CASE("receive_until on a real clock returns nothing once a short deadline passes", "[in_process]") {
  SteadyClock clock;
  InProcessNetwork net(clock);
  auto syncer = net.syncer();
  const auto t0 = clock.now();
  CHECK_FALSE(syncer.receive_until(t0 + 20ms).has_value());
  const auto waited = clock.now() - t0;
  CHECK(waited >= 20ms);
  CHECK(waited < 5s);
  CHECK_FALSE(syncer.receive_until(t0).has_value());  // a past deadline returns at once
}

TEST_CASE("Closing a learner wakes its blocked receiver", "[in_process][threaded]") {
  SteadyClock clock;
  InProcessNetwork net(clock);
  auto learner = net.learner(2);
  std::optional<Message> got{Message{}};
  std::thread receiver([&] { got = learner.receive_until(clock.now() + 10s); });
  await_waiters(net, Endpoint::for_learner(2), 1);
  net.close(2);
  receiver.join();
  CHECK_FALSE(got.has_value());
  CHECK_FALSE(learner.failed());  // a closed endpoint is not a failed network
}

TEST_CASE("Shutdown wakes blocked receivers, then every call throws TransportError", "[in_process][threaded]") {
  SteadyClock clock;
  InProcessNetwork net(clock);
  auto learner = net.learner(1);
  auto syncer = net.syncer();
  std::optional<Message> at_learner{Message{}};
  std::optional<Message> at_syncer{Message{}};
  std::thread a([&] { at_learner = learner.receive_until(clock.now() + 30s); });
  std::thread b([&] { at_syncer = syncer.receive_until(clock.now() + 30s); });
  await_waiters(net, Endpoint::for_learner(1), 1);
  await_waiters(net, Endpoint::syncer(), 1);
  const auto t0 = clock.now();
  net.shutdown();
  a.join();
  b.join();
  CHECK(clock.now() - t0 < 5s);
  CHECK_FALSE(at_learner.has_value());
  CHECK_FALSE(at_syncer.has_value());
  CHECK(learner.failed());
  CHECK(syncer.failed());
  CHECK_THROWS_AS(learner.send(msg(MessageType::heartbeat, 1)), ddiloco::TransportError);
  CHECK_THROWS_AS(learner.try_receive(), ddiloco::TransportError);
  CHECK_THROWS_AS(learner.receive_until(clock.now()), ddiloco::TransportError);
  CHECK_THROWS_AS(syncer.send_to(1, msg(MessageType::heartbeat, 1)), ddiloco::TransportError);
  CHECK_THROWS_AS(net.learner(3), ddiloco::TransportError);
  CHECK_THROWS_WITH(syncer.try_receive(), Catch::Contains("after shutdown"));
}
