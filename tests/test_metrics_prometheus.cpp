// Tests for ddiloco/metrics/prometheus.hpp: the series SyncerMetrics and
// LearnerMetrics derive from a real Syncer's and OuterLoop's status (virtual
// clock, in-process network), read back in Prometheus' text format; and
// MetricsServer serving them over loopback HTTP.
#include <ddiloco/metrics/prometheus.hpp>

#include <ddiloco/transport/in_process.hpp>

#include <prometheus/text_serializer.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include "syncer_test_util.hpp"

#include <sstream>
#include <string>

using namespace ddiloco;
using namespace std::chrono_literals;

namespace {

std::string text(const prometheus::Registry& r) { return prometheus::TextSerializer().Serialize(r.Collect()); }

/// The value of the sample `series` (name with its labels exactly as
/// serialised, e.g. `ddiloco_syncer_quorum_size_bucket{le="2"}`); NaN if absent.
double sample(const std::string& exposition, const std::string& series) {
  std::istringstream in(exposition);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nan("");
}

Plan two_fragments() { return test::small_plan(); }

/// A contribution with an honest step counter: 10 steps per contribution since the join.
Message contribution(const Plan& plan, LearnerId id, std::size_t p, std::uint64_t seq, std::uint64_t version = 0) {
  return test::contribution_message(plan, id, p, seq, version, test::filled(plan, p, 0.1f),
                                    {10, 100, 10 * (seq & 0xffffffffu)});
}

Message join(const Plan& plan, LearnerId id) { return test::join_message(plan, id, 1000 + id); }

struct FakeTransportCounters {
  std::uint64_t frames_in = 0, frames_out = 0, bytes_in = 0, bytes_out = 0, send_dropped = 0, decode_errors = 0;
  std::uint64_t auth_denied = 0, impersonations = 0, handshake_failures = 0;
};

}  // namespace

TEST_CASE("Syncer metrics follow the syncer's status: merges, quorum sizes, rejections by reason, membership",
          "[metrics]") {
  VirtualClock clock;
  const Plan plan = two_fragments();
  SyncerConfig c = test::quorum_config(2);
  c.participation_scaling = true;  // as a syncer runs
  Syncer<> s(plan, std::vector<float>(6, 1.0f), clock, c);
  prometheus::Registry registry;
  SyncerMetrics metrics(registry, {.min_quorum = c.quorum.min_quorum});
  Outbox out;
  for (LearnerId id : {1u, 2u, 3u}) {
    s.handle(join(plan, id), out);
    s.handle(test::trained_message(plan, id), out);  // training: the push round waits for it
  }
  const std::uint64_t seq0 = test::kSeq0;
  s.handle(contribution(plan, 1, 0, seq0 + 1), out);
  s.handle(contribution(plan, 2, 0, seq0 + 1), out);  // quorum of 2: merge
  s.handle(contribution(plan, 2, 0, seq0 + 1), out);  // replay: duplicate
  Message foreign = contribution(plan, 1, 1, seq0 + 2);
  foreign.fingerprint ^= 1;
  s.handle(foreign, out);
  metrics.update(s.status());
  std::string t = text(registry);
  CHECK(sample(t, "ddiloco_syncer_merges_total") == 1);
  CHECK(sample(t, "ddiloco_syncer_contributions_accepted_total") == 2);
  CHECK(sample(t, "ddiloco_syncer_contributions_rejected_total{reason=\"duplicate\"}") == 1);
  CHECK(sample(t, "ddiloco_syncer_contributions_rejected_total{reason=\"foreign_plan\"}") == 1);
  CHECK(sample(t, "ddiloco_syncer_contributions_rejected_total{reason=\"stale\"}") == 0);
  CHECK(sample(t, "ddiloco_syncer_learners_alive") == 3);
  CHECK(sample(t, "ddiloco_syncer_learners_known") == 3);
  CHECK(sample(t, "ddiloco_syncer_joins_total") == 3);
  CHECK(sample(t, "ddiloco_syncer_min_quorum") == 2);
  CHECK(sample(t, "ddiloco_syncer_quorum_size_bucket{le=\"1\"}") == 0);
  CHECK(sample(t, "ddiloco_syncer_quorum_size_bucket{le=\"2\"}") == 1);
  CHECK(sample(t, "ddiloco_syncer_quorum_size_count") == 1);
  CHECK(sample(t, "ddiloco_syncer_quorum_size_sum") == 2);
  CHECK(sample(t, "ddiloco_syncer_round_seconds_count") == 1);
  CHECK(sample(t, "ddiloco_syncer_fragment_version{fragment=\"0\"}") == 1);
  CHECK(sample(t, "ddiloco_syncer_fragment_version{fragment=\"1\"}") == 0);
  CHECK(sample(t, "ddiloco_syncer_message_received_bytes_total") > 0);
  // Without transport counters there are no transport series.
  CHECK(std::isnan(sample(t, "ddiloco_syncer_frames_received_total")));

  // Counters grow by what the totals grew, also when updated repeatedly.
  metrics.update(s.status());
  clock.advance(6s);  // every learner silent past the heartbeat time-out
  s.tick(out);
  s.handle(contribution(plan, 3, 1, seq0 + 1), out);  // revives 3; alone: waits for the deadline
  clock.advance(10s);
  s.tick(out);
  FakeTransportCounters z;
  z.frames_in = 7;
  z.bytes_in = 700;
  z.auth_denied = 2;
  z.handshake_failures = 3;
  s.handle(contribution(plan, 9, 1, seq0 + 1), out);  // an id that never joined: asked to rejoin
  metrics.update(s.status(), z);
  t = text(registry);
  CHECK(sample(t, "ddiloco_syncer_merges_total") == 2);
  CHECK(sample(t, "ddiloco_syncer_deadline_merges_total") == 0);  // 3 was the only one alive: merged at once
  CHECK(sample(t, "ddiloco_syncer_deaths_total") >= 2);
  CHECK(sample(t, "ddiloco_syncer_quorum_size_bucket{le=\"1\"}") == 1);
  CHECK(sample(t, "ddiloco_syncer_quorum_size_count") == 2);
  CHECK(sample(t, "ddiloco_syncer_frames_received_total") == 7);
  CHECK(sample(t, "ddiloco_syncer_received_bytes_total") == 700);
  CHECK(sample(t, "ddiloco_syncer_auth_denied_total") == 2);
  CHECK(sample(t, "ddiloco_syncer_impersonations_total") == 0);
  CHECK(sample(t, "ddiloco_syncer_handshake_failures_total") == 3);
  CHECK(sample(t, "ddiloco_syncer_rejoin_requests_total") == 1);
}

TEST_CASE("A baseline (a syncer restored from a checkpoint) is not counted; what follows is", "[metrics]") {
  VirtualClock clock;
  const Plan plan = two_fragments();
  SyncerConfig c = test::push_rounds();
  c.quorum.grace = false;
  Syncer<> s(plan, std::vector<float>(6, 1.0f), clock, c);
  Outbox out;
  s.handle(join(plan, 1), out);
  const std::uint64_t seq0 = test::kSeq0;
  s.handle(contribution(plan, 1, 0, seq0 + 1), out);
  s.handle(contribution(plan, 1, 0, seq0 + 1), out);  // duplicate
  prometheus::Registry registry;
  SyncerMetrics metrics(registry);
  metrics.baseline(s.status());
  std::string t = text(registry);
  CHECK(sample(t, "ddiloco_syncer_merges_total") == 0);
  CHECK(sample(t, "ddiloco_syncer_quorum_size_count") == 0);
  CHECK(sample(t, "ddiloco_syncer_contributions_rejected_total{reason=\"duplicate\"}") == 0);
  CHECK(sample(t, "ddiloco_syncer_learners_alive") == 1);  // gauges are what they are
  s.handle(contribution(plan, 1, 0, seq0 + 2, 1), out);
  metrics.update(s.status());
  t = text(registry);
  CHECK(sample(t, "ddiloco_syncer_merges_total") == 1);
  CHECK(sample(t, "ddiloco_syncer_quorum_size_count") == 1);
  CHECK(sample(t, "ddiloco_syncer_round_seconds_count") == 1);
}

TEST_CASE("The checkpoint age restarts at each checkpoint and checkpoints are counted", "[metrics]") {
  VirtualClock clock;
  const Plan plan = two_fragments();
  SyncerConfig c = test::push_rounds();
  Syncer<> s(plan, std::vector<float>(6, 1.0f), clock, c);
  prometheus::Registry registry;
  SyncerMetrics metrics(registry, {.checkpoints = true});
  metrics.update(s.status());
  std::string t = text(registry);
  CHECK(sample(t, "ddiloco_syncer_checkpoints_total") == 0);
  CHECK(sample(t, "ddiloco_syncer_checkpoint_age_seconds") >= 0);
  CHECK(std::isnan(sample(t, "ddiloco_syncer_min_quorum")));  // not given
  metrics.checkpoint_written();
  t = text(registry);
  CHECK(sample(t, "ddiloco_syncer_checkpoints_total") == 1);
  CHECK(sample(t, "ddiloco_syncer_checkpoint_age_seconds") == 0);
  // Without checkpoints configured the series appear only with the first one.
  prometheus::Registry plain;
  SyncerMetrics quiet(plain);
  quiet.update(s.status());
  CHECK(std::isnan(sample(text(plain), "ddiloco_syncer_checkpoint_age_seconds")));
  quiet.checkpoint_written();
  CHECK(sample(text(plain), "ddiloco_syncer_checkpoints_total") == 1);
}

TEST_CASE("Learner metrics follow the OuterLoop's status, with the learner id as a label", "[metrics]") {
  VirtualClock clock;
  const Plan plan = two_fragments();
  InProcessNetwork net(clock);
  InProcessSyncerTransport link(net.syncer());
  SyncerConfig c = test::push_rounds();
  c.quorum.grace = false;
  Syncer<> s(plan, std::vector<float>(6, 1.0f), clock, c);
  auto lt = net.learner(4);
  OuterLoopConfig oc;
  oc.round = RoundMode::push;
  oc.id = 4;
  oc.sync_every = 2;
  oc.overlap = 1;
  OuterLoop<InProcessLearnerTransport, std::vector<float>> outer(plan, lt, oc);
  std::vector<std::vector<float>> params{std::vector<float>(4, 0.0f), std::vector<float>(2, 0.0f)};
  auto pump = [&] {
    Outbox out;
    while (auto m = link.try_receive()) s.handle(*m, out);
    for (auto& o : out) link.send_to(o.to, std::move(o.message));
  };
  outer.begin_join(params);
  for (int i = 0; i < 8 && !outer.poll_join(params); ++i) pump();
  REQUIRE(outer.joined());
  prometheus::Registry registry;
  LearnerMetrics metrics(registry, 4);
  for (int step = 0; step < 8; ++step) {
    for (auto& t : params)
      for (float& x : t) x -= 0.01f;
    outer.step(params, 50);
    pump();
    metrics.update(outer.status());
  }
  const std::string t = text(registry);
  const auto& st = outer.status();
  CHECK(sample(t, "ddiloco_learner_steps_total{learner=\"4\"}") == 8);
  CHECK(sample(t, "ddiloco_learner_tokens_total{learner=\"4\"}") == 400);
  CHECK(sample(t, "ddiloco_learner_sends_total{learner=\"4\"}") == static_cast<double>(st.sends));
  CHECK(sample(t, "ddiloco_learner_rejoins_total{learner=\"4\"}") == 0);
  CHECK(st.sends >= 3);
  CHECK(sample(t, "ddiloco_learner_applies_total{learner=\"4\"}") == static_cast<double>(st.applies));
  CHECK(sample(t, "ddiloco_learner_staleness_versions_count{learner=\"4\"}") ==
        static_cast<double>(st.staleness_versions.count()));
  CHECK(st.staleness_versions.count() >= 2);
  CHECK(sample(t, "ddiloco_learner_staleness_versions_bucket{learner=\"4\",le=\"1\"}") ==
        static_cast<double>(st.staleness_versions.count()));  // alone: only its own merges
  CHECK(sample(t, "ddiloco_learner_apply_delay_steps_sum{learner=\"4\"}") == st.apply_delay_steps.sum());
  CHECK(sample(t, "ddiloco_learner_contribution_bytes_total{learner=\"4\"}") ==
        static_cast<double>(st.bytes_sent));
  // With a transport that recycles received payloads (ZmqLearnerTransport), their count too.
  struct Recycling : FakeTransportCounters {
    std::uint64_t payload_buffers_reused = 0;
  } z;
  z.payload_buffers_reused = 6;
  metrics.update(outer.status(), z);
  CHECK(sample(text(registry), "ddiloco_learner_payload_buffers_reused_total{learner=\"4\"}") == 6);
}

TEST_CASE("A metrics address must be ADDR:PORT; the error names the value and the form", "[metrics]") {
  for (const char* bad : {"9100", "localhost", ":9100", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:x1"}) {
    INFO(bad);
    CHECK_THROWS_WITH(MetricsServer::check_address(bad),
                      Catch::Contains(std::string("'") + bad + "'") && Catch::Contains("ADDR:PORT"));
  }
  CHECK_NOTHROW(MetricsServer::check_address("0.0.0.0:0"));
  CHECK_NOTHROW(MetricsServer::check_address("127.0.0.1:9100"));
}

TEST_CASE("MetricsServer on port 0 picks a free port, serves /metrics and refreshes before each scrape",
          "[metrics]") {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& gauge = prometheus::BuildGauge().Name("ddiloco_test_scrapes").Help("scrapes").Register(*registry).Add({});
  int refreshes = 0;
  MetricsServer server("127.0.0.1:0", registry, [&] { gauge.Set(++refreshes); });
  REQUIRE(server.port() != 0);
  CHECK(server.address() == "127.0.0.1:" + std::to_string(server.port()));
  auto get = [&] {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(server.port());
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    REQUIRE(::send(fd, req.data(), req.size(), 0) == static_cast<ssize_t>(req.size()));
    std::string body;
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) body.append(buf, static_cast<std::size_t>(n));
    ::close(fd);
    return body;
  };
  CHECK(get().find("ddiloco_test_scrapes 1") != std::string::npos);
  CHECK(get().find("ddiloco_test_scrapes 2") != std::string::npos);
  // The same port again is refused with an error naming the address.
  CHECK_THROWS_WITH(MetricsServer(server.address(), registry),
                    Catch::Contains(server.address()) && Catch::Contains("port"));
}

namespace {
/// A transport's counters with the memory-bound fields of ZmqCounters.
struct FakeBoundCounters : FakeTransportCounters {
  std::uint64_t send_over_budget = 0, wrong_direction = 0, disconnects = 0, receive_pauses = 0, peers_evicted = 0,
                slow_peer_frames = 0, joins_dropped = 0, send_queued_bytes = 0, incoming_queued_bytes = 0, peers = 0;
  std::uint64_t payloads_encoded = 0;
};
}  // namespace

TEST_CASE("The memory-bound series follow the syncer's join limits and the transport's drops and queues",
          "[metrics]") {
  VirtualClock clock;
  const Plan plan = two_fragments();
  SyncerConfig c = test::push_rounds();
  c.max_learners = 1;
  c.join_burst_per_learner = 1;
  Syncer<WeightedAverage, AverageOnly> syncer(plan, std::vector<float>(6, 1.0f), clock, c);
  Outbox out;
  syncer.handle(join(plan, 1), out);
  Message again = join(plan, 1);
  again.sequence = 7;  // a new incarnation, over the per-learner burst
  syncer.handle(again, out);
  syncer.handle(join(plan, 2), out);  // learner 1 is alive: refused, full
  prometheus::Registry registry;
  SyncerMetrics metrics(registry);
  FakeBoundCounters z;
  z.send_over_budget = 5;
  z.wrong_direction = 2;
  z.disconnects = 1;
  z.receive_pauses = 3;
  z.peers_evicted = 4;
  z.slow_peer_frames = 6;
  z.joins_dropped = 9;
  z.send_queued_bytes = 1000;
  z.incoming_queued_bytes = 88;
  z.peers = 2;
  z.payloads_encoded = 11;
  metrics.update(syncer.status(), z);
  const std::string t = text(registry);
  CHECK(sample(t, "ddiloco_syncer_joins_limited_total") == 1);
  CHECK(sample(t, "ddiloco_syncer_joins_over_capacity_total") == 1);
  CHECK(sample(t, "ddiloco_syncer_learners_pruned_total") == 0);
  CHECK(sample(t, "ddiloco_syncer_frames_over_budget_total") == 5);
  CHECK(sample(t, "ddiloco_syncer_frames_wrong_direction_total") == 2);
  CHECK(sample(t, "ddiloco_syncer_disconnects_total") == 1);
  CHECK(sample(t, "ddiloco_syncer_receive_pauses_total") == 3);
  CHECK(sample(t, "ddiloco_syncer_peers_evicted_total") == 4);
  CHECK(sample(t, "ddiloco_syncer_frames_from_slow_peers_total") == 6);
  CHECK(sample(t, "ddiloco_syncer_joins_dropped_total") == 9);
  CHECK(sample(t, "ddiloco_syncer_send_queued_bytes") == 1000);
  CHECK(sample(t, "ddiloco_syncer_incoming_queued_bytes") == 88);
  CHECK(sample(t, "ddiloco_syncer_peers") == 2);
  CHECK(sample(t, "ddiloco_syncer_globals_encoded_total") == 11);
}

TEST_CASE("Pull rounds: the syncer exports its round mode, global step and pull counters, the learner its pulls "
          "and metadata",
          "[metrics][pull]") {
  VirtualClock clock;
  const Plan plan = two_fragments();
  InProcessNetwork net(clock);
  InProcessSyncerTransport link(net.syncer());
  SyncerConfig c;
  c.quorum.grace = false;
  c.round = RoundMode::pull;
  c.sync_every = 2;
  c.quorum.overlap = 1;
  Syncer<> s(plan, std::vector<float>(6, 1.0f), clock, c);
  auto lt = net.learner(4);
  OuterLoopConfig oc;
  oc.id = 4;
  oc.sync_every = 2;
  oc.overlap = 1;
  oc.round = RoundMode::pull;
  OuterLoop<InProcessLearnerTransport, std::vector<float>> outer(plan, lt, oc);
  std::vector<std::vector<float>> params{std::vector<float>(4, 0.0f), std::vector<float>(2, 0.0f)};
  auto pump = [&] {
    Outbox out;
    while (auto m = link.try_receive()) s.handle(*m, out);
    if (auto wake = s.next_wakeup(); wake && *wake <= clock.now()) s.tick(out);
    for (auto& o : out) link.send_to(o.to, std::move(o.message));
  };
  outer.begin_join(params);
  for (int i = 0; i < 8 && !outer.poll_join(params); ++i) pump();
  REQUIRE(outer.joined());
  prometheus::Registry syncer_registry, learner_registry;
  SyncerMetrics syncer_metrics(syncer_registry, SyncerMetricsOptions{.min_quorum = 1, .round = RoundMode::pull});
  LearnerMetrics learner_metrics(learner_registry, 4);
  for (int step = 0; step < 12; ++step) {
    clock.advance(10ms);
    for (auto& t : params)
      for (float& x : t) x -= 0.01f;
    outer.step(params, 50);
    pump();
    learner_metrics.update(outer.status());
  }
  syncer_metrics.update(s.status());
  const auto st = s.status();
  const auto& lst = outer.status();
  INFO(st.line() << " global step " << st.global_step << " pull rounds " << st.pull_rounds << " pulls sent "
                 << st.pulls_sent);
  // One learner, one metadata message a step: the global step is its step counter.
  REQUIRE(st.global_step == 12);
  REQUIRE(st.pull_rounds >= 4);
  REQUIRE(st.merges >= 3);
  const std::string t = text(syncer_registry);
  CHECK(sample(t, "ddiloco_syncer_round_mode{mode=\"pull\"}") == 1);
  CHECK(std::isnan(sample(t, "ddiloco_syncer_round_mode{mode=\"push\"}")));
  CHECK(sample(t, "ddiloco_syncer_global_step") == 12);
  CHECK(sample(t, "ddiloco_syncer_pull_rounds_total") == static_cast<double>(st.pull_rounds));
  CHECK(sample(t, "ddiloco_syncer_pulls_sent_total") == static_cast<double>(st.pulls_sent));
  CHECK(sample(t, "ddiloco_syncer_pull_timeouts_total") == static_cast<double>(st.pull_timeouts));
  CHECK(sample(t, "ddiloco_syncer_pull_rounds_empty_total") == static_cast<double>(st.pull_rounds_empty));
  CHECK(sample(t, "ddiloco_syncer_merges_total") == static_cast<double>(st.merges));
  const std::string lt_text = text(learner_registry);
  CHECK(sample(lt_text, "ddiloco_learner_metadata_sent_total{learner=\"4\"}") == 12);
  CHECK(sample(lt_text, "ddiloco_learner_pulls_total{learner=\"4\"}") == static_cast<double>(lst.pulls));
  // Every pull reached the learner (an in-process network loses nothing) but the last pump's, which the
  // learner reads at its next step.
  CHECK(lst.pulls <= st.pulls_sent);
  CHECK(lst.pulls + 1 >= st.pulls_sent);
  CHECK(lst.pulls >= 3);
}

TEST_CASE("Pull rounds: unsolicited contributions and step counters capped at the lead are exported",
          "[metrics][pull]") {
  VirtualClock clock;
  const Plan plan = two_fragments();
  SyncerConfig c;
  c.round = RoundMode::pull;
  c.sync_every = 4;
  c.max_lead = 8;
  Syncer<> s(plan, std::vector<float>(6, 1.0f), clock, c);
  prometheus::Registry registry;
  SyncerMetrics metrics(registry, SyncerMetricsOptions{.round = RoundMode::pull});
  Outbox out;
  s.handle(join(plan, 1), out);
  s.handle(join(plan, 2), out);
  clock.advance(1ms);
  s.handle(test::metadata_message(plan, 1, 1), out);
  s.handle(test::metadata_message(plan, 2, 1), out);
  // No slot has come yet (fragment 0's are at t = 0 mod 4, fragment 1's at 2 mod 4): nobody was pulled.
  // It still carries learner 2's step counter (10): 9 ahead of learner 1, beyond the lead of 8.
  s.handle(contribution(plan, 2, 1, (std::uint64_t{1} << 32) + 1), out);
  s.handle(test::metadata_message(plan, 2, 1000), out);  // 999 steps ahead of learner 1: counted at 1 + 8
  metrics.update(s.status());
  const std::string t = text(registry);
  CHECK(s.status().global_step == 9);
  CHECK(sample(t, "ddiloco_syncer_steps_beyond_lead_total") == 2);
  CHECK(sample(t, "ddiloco_syncer_contributions_rejected_total{reason=\"unsolicited\"}") == 1);
  // Learner 2, the furthest, leaves: learner 1's next step carries the global step on from 9.
  s.handle(test::control_message(plan, MessageType::leave, 2), out);
  clock.advance(1ms);
  s.handle(test::metadata_message(plan, 1, 2), out);
  s.handle(test::metadata_message(plan, 1, 3), out);
  metrics.update(s.status());
  CHECK(s.status().global_step == 10);
  CHECK(sample(text(registry), "ddiloco_syncer_frontier_carries_total") == 1);
}

TEST_CASE("Push rounds export the pull series at 0 and the round mode push", "[metrics][pull]") {
  VirtualClock clock;
  const Plan plan = two_fragments();
  SyncerConfig c = test::push_rounds();
  Syncer<> s(plan, std::vector<float>(6, 1.0f), clock, c);
  prometheus::Registry registry;
  SyncerMetrics metrics(registry, SyncerMetricsOptions{.round = RoundMode::push});
  Outbox out;
  s.handle(join(plan, 1), out);
  s.handle(contribution(plan, 1, 0, (std::uint64_t{1} << 32) + 1), out);
  metrics.update(s.status());
  const std::string t = text(registry);
  CHECK(sample(t, "ddiloco_syncer_round_mode{mode=\"push\"}") == 1);
  // Push rounds keep the global step too: the contribution's step counter (10), counted from the join's 0.
  CHECK(s.status().global_step == 10);
  CHECK(sample(t, "ddiloco_syncer_global_step") == 10);
  CHECK(sample(t, "ddiloco_syncer_pull_rounds_total") == 0);
  CHECK(sample(t, "ddiloco_syncer_pulls_sent_total") == 0);
  CHECK(sample(t, "ddiloco_syncer_merges_total") == 1);
}
