// Tests for ddiloco/checkpoint.hpp and the Syncer snapshot/restore API it
// serialises: round trips, duplicate rejection after a restart, corruption and
// truncation fall-back, retention, crash leftovers, foreign snapshots. Files go
// to a unique directory under the system's temporary directory, removed after.
// One test takes snapshots while two threads feed the syncer:
// DDILOCO_TEST_LABEL(threaded)
#include <ddiloco/checkpoint.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "syncer_test_util.hpp"
#include "temp_dir.hpp"

using namespace ddiloco;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// Each TempDir is named after this file.
struct TempDir : test::TempDir {
  TempDir() : test::TempDir("checkpoint") {}
};

std::vector<std::byte> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> b(c.size());
  if (!c.empty()) std::memcpy(b.data(), c.data(), c.size());
  return b;
}
void write_bytes(const fs::path& p, std::span<const std::byte> b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}
void put_u64(std::vector<std::byte>& b, std::size_t at, std::uint64_t v) {
  for (std::size_t i = 0; i < 8; ++i) b[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFU);
}
// Recomputes the trailer so a deliberately inconsistent body passes the checksum.
void reseal(std::vector<std::byte>& b) {
  const std::uint32_t crc = detail::crc32c(std::span<const std::byte>(b).first(b.size() - 4));
  for (std::size_t i = 0; i < 4; ++i) b[b.size() - 4 + i] = static_cast<std::byte>((crc >> (8 * i)) & 0xFFU);
}

// Two fragments: {w (4 elements)} and {b (2 elements)}.
Plan small_plan() { return make_plan({{"w", 4, false}, {"b", 2, false}}, 2); }

SyncerConfig k_of(std::size_t k) {
  SyncerConfig c;
  c.round = RoundMode::push;
  c.quorum.min_quorum = k;
  c.quorum.grace = false;
  c.quorum.deadline = 10s;
  c.heartbeat_timeout = 5s;
  return c;
}

constexpr std::uint64_t seq0 = std::uint64_t{1} << 32;  // first sequence of a first incarnation

struct Rig {
  VirtualClock clock;
  Plan plan = small_plan();
  std::vector<float> init = std::vector<float>(6, 1.0f);
  Outbox out;

  template <class S>
  void join(S& s, LearnerId id, std::uint64_t nonce) {
    Message m;
    m.type = MessageType::join;
    m.fingerprint = plan.fingerprint();
    m.learner = id;
    m.sequence = nonce;
    s.handle(m, out);
  }
  Message contribution(LearnerId id, std::size_t fragment, float value, std::uint64_t seq,
                       std::uint64_t version) const {
    Message m;
    m.type = MessageType::contribution;
    m.fingerprint = plan.fingerprint();
    m.learner = id;
    m.fragment = static_cast<std::uint32_t>(fragment);
    m.version = version;
    m.sequence = seq;
    m.steps = 10;
    m.tokens = 100;
    // An honest step counter: 10 steps per contribution, counted from the
    // incarnation's first sequence (the syncer bounds steps by its advance).
    m.step = 10 * (seq & 0xffffffffu);
    m.payload = make_payload(std::vector<float>(plan.fragments()[fragment].numel, value));
    return m;
  }
};

// A syncer with history: 3 learners, K = 2; fragment 0 merged twice, fragment 1
// once, one contribution open on fragment 1, one duplicate and one foreign-plan
// rejection. Works with any optimizer/merge rule.
template <class S>
void give_history(Rig& r, S& s) {
  for (LearnerId id : {1u, 2u, 3u}) r.join(s, id, 100 + id);
  s.handle(r.contribution(1, 0, 0.2f, seq0 + 1, 0), r.out);
  s.handle(r.contribution(2, 0, 0.4f, seq0 + 1, 0), r.out);  // merge: fragment 0 version 1
  s.handle(r.contribution(2, 0, 0.4f, seq0 + 1, 0), r.out);  // duplicate
  s.handle(r.contribution(1, 0, 0.1f, seq0 + 2, 1), r.out);
  s.handle(r.contribution(3, 0, 0.3f, seq0 + 1, 1), r.out);  // merge: fragment 0 version 2
  s.handle(r.contribution(1, 1, 0.5f, seq0 + 3, 0), r.out);
  s.handle(r.contribution(3, 1, 0.5f, seq0 + 2, 0), r.out);  // merge: fragment 1 version 1
  s.handle(r.contribution(2, 1, 0.7f, seq0 + 2, 1), r.out);  // open, not merged
  Message foreign = r.contribution(1, 0, 0.1f, seq0 + 9, 2);
  foreign.fingerprint ^= 1;
  s.handle(foreign, r.out);
}

using AvgSyncer = Syncer<WeightedAverage, AverageOnly, UniformWeights>;

}  // namespace

TEST_CASE("A snapshot written, loaded and restored gives a syncer equal to the original", "[checkpoint]") {
  TempDir dir;
  Rig r;
  Syncer<> a(r.plan, r.init, r.clock, k_of(2));
  give_history(r, a);
  const SyncerSnapshot snap = a.snapshot();
  REQUIRE(snap.fragments.size() == 2);
  CHECK(snap.fragments[0].version == 2);  // counted by hand from give_history
  CHECK(snap.fragments[1].version == 1);
  CHECK(snap.learners.size() == 3);

  const fs::path written = write_checkpoint(dir.path, snap, 7);
  CHECK(written.filename() == "checkpoint-00000000000000000007.ddck");
  std::vector<CheckpointProblem> problems;
  const auto loaded = load_newest_valid(dir.path, problems);
  REQUIRE(loaded.has_value());
  CHECK(problems.empty());
  CHECK(loaded->serial == 7);
  CHECK(loaded->path == written);
  CHECK(loaded->snapshot == snap);

  VirtualClock clock2(TimePoint{1000s});
  Syncer<> b(r.plan, std::vector<float>(6, -3.0f), clock2, k_of(2));
  b.restore(loaded->snapshot);

  CHECK(b.global_parameters() == a.global_parameters());
  for (std::size_t p = 0; p < 2; ++p) CHECK(b.fragment(p).second == a.fragment(p).second);
  const SyncerStatus sa = a.status(), sb = b.status();
  CHECK(sb.learners_known == 3);
  CHECK(sb.learners_alive == 3);
  CHECK(sb.joins == 3);
  CHECK(sb.joins == sa.joins);
  CHECK(sb.merges == 3);
  CHECK(sb.merges == sa.merges);
  CHECK(b.merges_total() == a.merges_total());
  CHECK(sb.contributions_accepted == sa.contributions_accepted);
  CHECK(sb.rejected == sa.rejected);
  CHECK(sb.rejected[static_cast<std::size_t>(RejectReason::duplicate)] == 1);
  CHECK(sb.rejected[static_cast<std::size_t>(RejectReason::foreign_plan)] == 1);
  CHECK(sb.quorum_sizes == sa.quorum_sizes);
  CHECK(sb.bytes_in == sa.bytes_in);
  CHECK(sb.bytes_out == sa.bytes_out);
  REQUIRE(sb.fragments.size() == 2);
  CHECK(sa.fragments[1].open_contributions == 1);
  CHECK(sb.fragments[1].open_contributions == 0);  // the open round is not saved
  for (std::size_t p = 0; p < 2; ++p) {
    FragmentStatus fa = sa.fragments[p];
    fa.open_contributions = 0;
    CHECK(sb.fragments[p] == fa);
  }
  CHECK(b.snapshot() == snap);
}

TEST_CASE("A restored syncer continues exactly as the original would, optimizer momentum included",
          "[checkpoint]") {
  Rig r;
  Syncer<> a(r.plan, r.init, r.clock, k_of(1));
  give_history(r, a);
  VirtualClock clock2;
  Syncer<> b(r.plan, r.init, clock2, k_of(1));
  b.restore(decode_checkpoint(encode_checkpoint(a.snapshot(), 1)).snapshot);
  // The same new contribution to both: Nesterov uses the restored momentum, so
  // any state not carried over would make the results differ.
  Outbox oa, ob;
  const auto v = a.fragment(0).second;
  a.handle(r.contribution(3, 0, -0.05f, seq0 + 5, v), oa);
  b.handle(r.contribution(3, 0, -0.05f, seq0 + 5, v), ob);
  CHECK(a.fragment(0).second == v + 1);
  CHECK(b.fragment(0) == a.fragment(0));
  CHECK(b.global_parameters() == a.global_parameters());
}

TEST_CASE("After a crash restore in a new epoch, a learner ahead of the checkpoint is answered and rebases",
          "[checkpoint]") {
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  r.join(a, 1, 101);
  SyncerSnapshot snap = a.snapshot();  // checkpoint at version 0
  // After the checkpoint the old syncer merged 3 times and the learner applied them.
  VirtualClock clock2;
  AvgSyncer exact(r.plan, r.init, clock2, k_of(1));
  exact.restore(snap);
  Outbox out;
  exact.handle(r.contribution(1, 0, 0.25f, seq0 + 4, /*version=*/3), out);
  CHECK(exact.status().rejected[static_cast<std::size_t>(RejectReason::future_version)] == 1);
  CHECK(out.empty());  // no answer: without a new epoch the learner would never resync

  advance_epoch(snap);
  AvgSyncer resumed(r.plan, r.init, clock2, k_of(1));
  resumed.restore(snap);
  out.clear();
  resumed.handle(r.contribution(1, 0, 0.25f, seq0 + 4, /*version=*/3), out);
  CHECK(resumed.status().rejected[static_cast<std::size_t>(RejectReason::stale)] == 1);
  REQUIRE(out.size() == 1);
  CHECK(out[0].message.type == MessageType::global_fragment);
  CHECK(out[0].message.version == (std::uint64_t{1} << 32));  // newer than anything the learner holds
}

TEST_CASE("After a restore a contribution merged before the checkpoint is a duplicate and a new one is merged",
          "[checkpoint]") {
  TempDir dir;
  Rig r;
  // K = 2 with both live learners in every merge, so each merge is the plain
  // mean of the two contributions and AverageOnly subtracts it.
  AvgSyncer a(r.plan, r.init, r.clock, k_of(2));
  for (LearnerId id : {1u, 2u}) r.join(a, id, 100 + id);
  a.handle(r.contribution(1, 0, 0.25f, seq0 + 1, 0), r.out);
  a.handle(r.contribution(2, 0, 0.25f, seq0 + 1, 0), r.out);  // merged: theta = 1 - 0.25
  write_checkpoint(dir.path, a.snapshot(), 1);

  VirtualClock clock2;
  AvgSyncer b(r.plan, r.init, clock2, k_of(2));
  b.restore(load_newest_valid(dir.path).value().snapshot);
  REQUIRE(b.fragment(0).second == 1);
  for (float x : b.fragment(0).first) CHECK(x == Approx(0.75f).margin(1e-6));

  Outbox out;
  b.handle(r.contribution(1, 0, 0.25f, seq0 + 1, 0), out);  // replays of the merged ones
  b.handle(r.contribution(2, 0, 0.25f, seq0 + 1, 0), out);
  CHECK(b.status().rejected[static_cast<std::size_t>(RejectReason::duplicate)] == 2);
  CHECK(b.status().fragments[0].open_contributions == 0);
  CHECK(b.fragment(0).second == 1);
  for (float x : b.fragment(0).first) CHECK(x == Approx(0.75f).margin(1e-6));

  b.handle(r.contribution(1, 0, 0.1f, seq0 + 2, 1), out);  // new ones: theta = 0.75 - (0.1 + 0.3) / 2
  b.handle(r.contribution(2, 0, 0.3f, seq0 + 2, 1), out);
  CHECK(b.fragment(0).second == 2);
  for (float x : b.fragment(0).first) CHECK(x == Approx(0.55f).margin(1e-6));
  // Fragment 1 had no contribution before the checkpoint: the learners' next
  // sequences are accepted there too (theta = 1 - 0.5).
  b.handle(r.contribution(1, 1, 0.5f, seq0 + 3, 0), out);
  b.handle(r.contribution(2, 1, 0.5f, seq0 + 3, 0), out);
  CHECK(b.fragment(1).second == 1);
  for (float x : b.fragment(1).first) CHECK(x == Approx(0.5f).margin(1e-6));
  CHECK(b.status().rejected[static_cast<std::size_t>(RejectReason::duplicate)] == 2);
}

TEST_CASE("A contribution accepted but not yet merged at checkpoint time is dropped, and its replay is a duplicate",
          "[checkpoint]") {
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(2));
  for (LearnerId id : {1u, 2u}) {
    r.join(a, id, 100 + id);
    a.handle(test::trained_message(r.plan, id), r.out);  // training: the round waits for it
  }
  a.handle(r.contribution(1, 0, 0.2f, seq0 + 1, 0), r.out);  // open, waits for K = 2
  REQUIRE(a.status().fragments[0].open_contributions == 1);
  VirtualClock clock2;
  AvgSyncer b(r.plan, r.init, clock2, k_of(2));
  b.restore(a.snapshot());
  Outbox out;
  b.handle(r.contribution(1, 0, 0.2f, seq0 + 1, 0), out);
  CHECK(b.status().rejected[static_cast<std::size_t>(RejectReason::duplicate)] == 1);
  b.handle(r.contribution(2, 0, 0.4f, seq0 + 1, 0), out);
  CHECK(b.fragment(0).second == 0);  // one contribution in the new round: K = 2 not reached
  b.handle(r.contribution(1, 0, 0.6f, seq0 + 2, 0), out);
  REQUIRE(b.fragment(0).second == 1);
  for (float x : b.fragment(0).first) CHECK(x == Approx(1.0f - 0.5f).margin(1e-6));  // mean of 0.4, 0.6
}

TEST_CASE("Restored learners count as alive until their heartbeat time-out", "[checkpoint]") {
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  for (LearnerId id : {1u, 2u, 3u}) r.join(a, id, 100 + id);
  VirtualClock clock2(TimePoint{500s});
  AvgSyncer b(r.plan, r.init, clock2, k_of(1));
  b.restore(a.snapshot());
  CHECK(b.alive() == 3);
  clock2.advance(4s);
  b.expire_learners();
  CHECK(b.alive() == 3);
  clock2.advance(1s);  // heartbeat_timeout = 5 s after the restore
  b.expire_learners();
  CHECK(b.alive() == 0);
  // A rejoin with the same nonce is a retry: same incarnation, no new join counted.
  Outbox out;
  r.join(b, 2, 102);
  CHECK(b.status().joins == 3);
  CHECK(out.empty());  // r.join writes into r.out
  REQUIRE(!r.out.empty());
  CHECK(r.out.back().message.sequence == seq0);
}

TEST_CASE("A snapshot from another plan or optimizer, or with wrong sizes, is refused and changes nothing",
          "[checkpoint]") {
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  for (LearnerId id : {1u, 2u}) r.join(a, id, 100 + id);
  a.handle(r.contribution(1, 0, 0.25f, seq0 + 1, 0), r.out);
  const SyncerSnapshot good = a.snapshot();

  const Plan other = make_plan({{"w", 4, false}, {"c", 2, false}}, 2);
  VirtualClock clock2;
  AvgSyncer foreign(other, r.init, clock2, k_of(1));
  CHECK_THROWS_AS(foreign.restore(good), ProtocolError);
  CHECK_THROWS_WITH(foreign.restore(good), Catch::Contains("fingerprint"));
  CHECK(foreign.fragment(0).second == 0);
  CHECK(foreign.global_parameters() == r.init);

  Syncer<WeightedAverage, NesterovSGD, UniformWeights> nesterov(r.plan, r.init, clock2, k_of(1));
  CHECK_THROWS_WITH(nesterov.restore(good), Catch::Contains("optimizer") && Catch::Contains("average_only"));

  AvgSyncer b(r.plan, r.init, clock2, k_of(1));
  SyncerSnapshot bad = good;
  bad.fragments[1].theta.push_back(0.0f);
  CHECK_THROWS_AS(b.restore(bad), ShapeMismatch);
  CHECK_THROWS_WITH(b.restore(bad), Catch::Contains("fragment 1") && Catch::Contains("3 elements"));
  bad = good;
  bad.fragments.pop_back();
  CHECK_THROWS_AS(b.restore(bad), ShapeMismatch);
  bad = good;
  bad.fragments[0].state.push_back(1.0f);
  CHECK_THROWS_WITH(b.restore(bad), Catch::Contains("optimizer state"));
  bad = good;
  bad.fragments[0].theta[2] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(b.restore(bad), ProtocolError);
  bad = good;
  bad.learners.push_back(bad.learners.front());
  CHECK_THROWS_AS(b.restore(bad), ProtocolError);
  CHECK(b.global_parameters() == r.init);
  CHECK(b.status().learners_known == 0);
}

TEST_CASE("Encoding then decoding a snapshot gives it back field for field", "[checkpoint]") {
  SyncerSnapshot s;
  s.fingerprint = 0x0123456789ABCDEFULL;
  s.optimizer = "nesterov_sgd";
  s.joins = 5;
  s.leaves = 1;
  s.deaths = 2;
  s.bytes_in = 1ULL << 40;
  s.bytes_out = 3;
  s.rejected[0] = 9;
  s.rejected[kRejectReasons - 1] = 11;
  FragmentSnapshot f;
  f.theta = {1.5f, -0.0f, 3e-38f, -7.25f};
  f.state = {0.1f, 0.2f, 0.3f, 0.4f};
  f.version = 42;
  f.last_sequence = {{1, seq0 + 7}, {0xFFFFFFFFu, 3}};
  f.norm_ema = 0.123456789012345;
  f.norm_samples = 17;
  f.status.merges = 42;
  f.status.last_quorum_size = 3;
  f.status.contributions_merged = 100;
  f.status.grace_waits = 4;
  f.status.deadline_merges = 5;
  f.status.version = 42;
  f.quorum_sizes = {0, 2, 30, 10};
  f.accepted = 110;
  f.rejected_duplicate = 1;
  f.rejected_stale = 2;
  f.rejected_future = 3;
  f.rejected_norm = 4;
  s.fragments = {f, FragmentSnapshot{}};
  s.learners = {{1, 1, seq0, 77}, {9, 3, 3 * seq0, 78}};
  const auto bytes = encode_checkpoint(s, 12);
  const LoadedCheckpoint c = decode_checkpoint(bytes);
  CHECK(c.serial == 12);
  CHECK(c.snapshot == s);
  // Little-endian on disk: the header's serial at bytes 16..23, least significant first.
  CHECK(std::to_integer<int>(bytes[16]) == 12);
  for (std::size_t i = 17; i < 24; ++i) CHECK(std::to_integer<int>(bytes[i]) == 0);
  CHECK(std::string_view(reinterpret_cast<const char*>(bytes.data()), 8) == "DDILOCKP");
}

namespace {
// Lengths/offsets to exercise through the files: the header and trailer
// boundaries plus every 23rd position (every position is covered in memory).
std::vector<std::size_t> file_positions(std::size_t size) {
  std::vector<std::size_t> v{0, 1, 7, 8, 15, 16, 23, 24, 31, 32, 39, 40, 47, 48, size - 5, size - 4, size - 1};
  for (std::size_t i = 0; i < size; i += 23) v.push_back(i);
  return v;
}
bool names_truncation(const std::string& reason) {
  return reason.find("short file") != std::string::npos || reason.find("bad magic") != std::string::npos ||
         reason.find("length mismatch") != std::string::npos;
}
}  // namespace

TEST_CASE("A checkpoint cut short at any length is rejected with a reason", "[checkpoint]") {
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  for (LearnerId id : {1u, 2u}) r.join(a, id, 100 + id);
  a.handle(r.contribution(1, 0, 0.25f, seq0 + 1, 0), r.out);
  const auto full = encode_checkpoint(a.snapshot(), 3);
  REQUIRE(full.size() > 100);
  std::size_t rejected = 0;
  for (std::size_t len = 0; len < full.size(); ++len) {
    LoadedCheckpoint c;
    const std::string reason = detail::parse_checkpoint(std::span(full).first(len), c);
    if (names_truncation(reason)) ++rejected;
    else FAIL_CHECK("length " << len << ": '" << reason << "'");
  }
  CHECK(rejected == full.size());
}

TEST_CASE("A truncated newest checkpoint file is reported and the previous good one is loaded", "[checkpoint]") {
  TempDir dir;
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  for (LearnerId id : {1u, 2u}) r.join(a, id, 100 + id);
  write_checkpoint(dir.path, a.snapshot(), 1);
  a.handle(r.contribution(1, 0, 0.25f, seq0 + 1, 0), r.out);
  write_checkpoint(dir.path, a.snapshot(), 2);
  a.handle(r.contribution(1, 0, 0.25f, seq0 + 2, 1), r.out);
  const fs::path newest = write_checkpoint(dir.path, a.snapshot(), 3);
  const auto full = read_bytes(newest);
  REQUIRE(full.size() > 100);

  for (std::size_t len : file_positions(full.size())) {
    write_bytes(newest, std::span(full).first(len));
    std::vector<CheckpointProblem> problems;
    const auto loaded = load_newest_valid(dir.path, problems);
    REQUIRE(loaded.has_value());
    CHECK(loaded->serial == 2);
    CHECK(loaded->snapshot.fragments[0].version == 1);
    REQUIRE(problems.size() == 1);
    CHECK(problems[0].path == newest);
    CHECK(names_truncation(problems[0].reason));
  }
  write_bytes(newest, full);
  CHECK(load_newest_valid(dir.path).value().serial == 3);
}

TEST_CASE("Flipping any bit of a checkpoint makes it invalid with a reason", "[checkpoint]") {
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  for (LearnerId id : {1u, 2u}) r.join(a, id, 100 + id);
  a.handle(r.contribution(2, 1, 0.5f, seq0 + 1, 0), r.out);
  const auto full = encode_checkpoint(a.snapshot(), 5);
  std::size_t rejected = 0, checksum = 0;
  for (std::size_t i = 0; i < full.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      auto bad = full;
      bad[i] ^= static_cast<std::byte>(1U << bit);
      LoadedCheckpoint c;
      const std::string reason = detail::parse_checkpoint(bad, c);
      if (!reason.empty()) ++rejected;
      else FAIL_CHECK("byte " << i << " bit " << bit << " accepted");
      if (reason.find("checksum mismatch") != std::string::npos) ++checksum;
    }
  }
  CHECK(rejected == 8 * full.size());
  // Outside magic (8 bytes), format version (4) and body length (8), the checksum catches it.
  CHECK(checksum == 8 * (full.size() - 20));
}

TEST_CASE("Flipping a byte of the newest checkpoint file makes the loader report it and fall back",
          "[checkpoint]") {
  TempDir dir;
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  for (LearnerId id : {1u, 2u}) r.join(a, id, 100 + id);
  write_checkpoint(dir.path, a.snapshot(), 4);
  a.handle(r.contribution(2, 1, 0.5f, seq0 + 1, 0), r.out);
  const fs::path newest = write_checkpoint(dir.path, a.snapshot(), 5);
  const auto full = read_bytes(newest);
  for (std::size_t i : file_positions(full.size())) {
    auto bad = full;
    bad[i] ^= std::byte{0x10};
    write_bytes(newest, bad);
    std::vector<CheckpointProblem> problems;
    const auto loaded = load_newest_valid(dir.path, problems);
    REQUIRE(loaded.has_value());
    CHECK(loaded->serial == 4);
    REQUIRE(problems.size() == 1);
    CHECK(problems[0].path == newest);
    CHECK_FALSE(problems[0].reason.empty());
  }
}

TEST_CASE("Checksummed files with lying lengths or counts are rejected with a reason, never trusted",
          "[checkpoint]") {
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  for (LearnerId id : {1u, 2u}) r.join(a, id, 100 + id);
  a.handle(r.contribution(2, 1, 0.5f, seq0 + 1, 0), r.out);
  const auto full = encode_checkpoint(a.snapshot(), 1);
  // The first section's length field (right after the header and tag) set huge.
  {
    auto bad = full;
    put_u64(bad, 32 + 8, ~std::uint64_t{0});
    reseal(bad);
    CHECK_THROWS_WITH(decode_checkpoint(bad), Catch::Contains("exceeds"));
  }
  // The header's body length not matching the file.
  {
    auto bad = full;
    put_u64(bad, 24, full.size());
    reseal(bad);
    CHECK_THROWS_WITH(decode_checkpoint(bad), Catch::Contains("length mismatch"));
  }
  // Every 8-byte word of the body overwritten with a huge value, resealed: each
  // is either rejected with a reason (a length, count, index or id) or accepted
  // as a (plain counter) value; never a crash or a huge allocation.
  std::size_t rejected = 0, accepted = 0;
  for (std::size_t at = 32; at + 8 <= full.size() - 4; at += 8) {
    for (std::uint64_t v : {~std::uint64_t{0}, std::uint64_t{1} << 40, std::uint64_t{7}}) {
      auto bad = full;
      put_u64(bad, at, v);
      reseal(bad);
      try {
        (void)decode_checkpoint(bad);
        ++accepted;
      } catch (const ProtocolError& e) {
        CHECK(std::string(e.what()).size() > 20);
        ++rejected;
      }
    }
  }
  CHECK(rejected > 0);
  CHECK(accepted > 0);
}

TEST_CASE("Only the newest K checkpoint files are kept", "[checkpoint]") {
  TempDir dir;
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  for (std::uint64_t serial = 1; serial <= 6; ++serial) write_checkpoint(dir.path, a.snapshot(), serial);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"checkpoint-00000000000000000004.ddck",
                                          "checkpoint-00000000000000000005.ddck",
                                          "checkpoint-00000000000000000006.ddck"});
  write_checkpoint(dir.path, a.snapshot(), 7, CheckpointOptions{1});
  names.clear();
  for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  CHECK(names == std::vector<std::string>{"checkpoint-00000000000000000007.ddck"});
  CHECK_THROWS_AS(write_checkpoint(dir.path, a.snapshot(), 8, CheckpointOptions{0}), InvalidArgument);
}

TEST_CASE("A temporary file left by a crash mid-write is ignored by the loader and removed by the next write",
          "[checkpoint]") {
  TempDir dir;
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  write_checkpoint(dir.path, a.snapshot(), 1);
  const auto good = read_bytes(dir.path / checkpoint_file_name(1));
  // A crash after writing half of checkpoint 2's temporary file.
  const fs::path stray = dir.path / ".checkpoint-00000000000000000002.ddck.tmp-12345";
  write_bytes(stray, std::span(good).first(good.size() / 2));
  std::vector<CheckpointProblem> problems;
  const auto loaded = load_newest_valid(dir.path, problems);
  REQUIRE(loaded.has_value());
  CHECK(loaded->serial == 1);
  CHECK(problems.empty());
  write_checkpoint(dir.path, a.snapshot(), 2);
  CHECK_FALSE(fs::exists(stray));
  CHECK(load_newest_valid(dir.path).value().serial == 2);
}

TEST_CASE("A checkpoint whose file name and header disagree on the serial is skipped", "[checkpoint]") {
  TempDir dir;
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  write_checkpoint(dir.path, a.snapshot(), 1);
  write_checkpoint(dir.path, a.snapshot(), 2);
  fs::copy_file(dir.path / checkpoint_file_name(2), dir.path / checkpoint_file_name(9));
  std::vector<CheckpointProblem> problems;
  const auto loaded = load_newest_valid(dir.path, problems);
  REQUIRE(loaded.has_value());
  CHECK(loaded->serial == 2);
  REQUIRE(problems.size() == 1);
  CHECK(problems[0].reason.find("serial 9") != std::string::npos);
}

TEST_CASE("An empty or missing directory has no checkpoint, and when every file is bad each is reported",
          "[checkpoint]") {
  TempDir dir;
  CHECK_FALSE(load_newest_valid(dir.path).has_value());
  CHECK_FALSE(load_newest_valid(dir.path / "missing").has_value());
  write_bytes(dir.path / checkpoint_file_name(1), std::vector<std::byte>(10));
  write_bytes(dir.path / checkpoint_file_name(2), std::vector<std::byte>(100, std::byte{0x44}));
  write_bytes(dir.path / "notes.txt", std::vector<std::byte>(3));
  std::vector<CheckpointProblem> problems;
  CHECK_FALSE(load_newest_valid(dir.path, problems).has_value());
  REQUIRE(problems.size() == 2);
  CHECK(problems[0].path.filename() == checkpoint_file_name(2));  // newest first
  CHECK(problems[0].reason.find("bad magic") != std::string::npos);
  CHECK(problems[1].reason.find("short file") != std::string::npos);
}

TEST_CASE("Checkpoint file names sort like their serials and other names are not checkpoints", "[checkpoint]") {
  CHECK(checkpoint_file_name(0) == "checkpoint-00000000000000000000.ddck");
  CHECK(checkpoint_file_name(~std::uint64_t{0}) == "checkpoint-18446744073709551615.ddck");
  CHECK(checkpoint_serial(checkpoint_file_name(123456)) == std::optional<std::uint64_t>(123456));
  CHECK(checkpoint_serial("checkpoint-5.ddck") == std::optional<std::uint64_t>(5));
  CHECK_FALSE(checkpoint_serial(".checkpoint-00000000000000000002.ddck.tmp-1").has_value());
  CHECK_FALSE(checkpoint_serial("checkpoint-.ddck").has_value());
  CHECK_FALSE(checkpoint_serial("checkpoint-12a.ddck").has_value());
  CHECK_FALSE(checkpoint_serial("checkpoint-99999999999999999999.ddck").has_value());  // > 2^64 - 1
}

TEST_CASE("Snapshots taken while two threads feed contributions are consistent and never deadlock",
          "[checkpoint][threaded]") {
  Rig r;
  // One learner, K = 1, AverageOnly, every contribution 0.125, so every merge
  // holds every live learner: after v merges Theta = 1 - v / 8 exactly
  // (multiples of 1/8 are exact in fp32). Each thread feeds one fragment (the
  // learner's sequences are per fragment), so no contribution is ever stale.
  AvgSyncer s(r.plan, r.init, r.clock, k_of(1));
  r.join(s, 1, 101);
  constexpr int kPerThread = 2000;
  std::atomic<int> finished{0};
  auto feed = [&](std::size_t p) {
    Outbox out;
    for (int i = 0; i < kPerThread; ++i) {
      const auto version = s.fragment(p).second;
      s.handle(r.contribution(1, p, 0.125f, seq0 + 1 + static_cast<std::uint64_t>(i), version), out);
      out.clear();
    }
    ++finished;
  };
  std::thread t1(feed, 0), t2(feed, 1);
  std::size_t snapshots = 0;
  bool consistent = true;
  do {  // at least one snapshot, even if the feeders finish first on a loaded machine
    const SyncerSnapshot snap = s.snapshot();
    ++snapshots;
    for (const auto& f : snap.fragments) {
      std::uint64_t merges = 0;
      for (auto q : f.quorum_sizes) merges += q;
      const float expected = 1.0f - static_cast<float>(f.version) * 0.125f;
      consistent = consistent && merges == f.version && f.status.merges == f.version && f.accepted == f.version &&
                   std::all_of(f.theta.begin(), f.theta.end(), [&](float x) { return x == expected; });
    }
  } while (finished.load() < 2);
  t1.join();
  t2.join();
  CHECK(consistent);
  CHECK(snapshots >= 1);
  const SyncerSnapshot last = s.snapshot();
  CHECK(last.fragments[0].version == kPerThread);
  CHECK(last.fragments[1].version == kPerThread);
  CHECK(s.merges_total() == 2 * kPerThread);
}

TEST_CASE("A checkpoint records its tensors' names and shapes, and files without them still load",
          "[checkpoint]") {
  TempDir dir;
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  give_history(r, a);
  const std::vector<std::vector<std::uint64_t>> shapes{{2, 2}, {2}};
  const auto records = checkpoint_tensors(r.plan, shapes);
  CHECK(records == std::vector<CheckpointTensor>{{"w", {2, 2}, false}, {"b", {2}, false}});
  CHECK(checkpoint_tensors(r.plan) == std::vector<CheckpointTensor>{{"w", {4}, false}, {"b", {2}, false}});
  const auto path = write_checkpoint(dir.path, a.snapshot(), 3, {}, records);
  const LoadedCheckpoint c = read_checkpoint(path);
  CHECK(c.tensors == records);
  CHECK(c.snapshot == a.snapshot());
  CHECK(checkpoint_plan(c) == r.plan);
  // Without the section (as every file written before it existed): the same
  // snapshot, no names; the bytes differ only by the section.
  const auto bare = encode_checkpoint(a.snapshot(), 3);
  const LoadedCheckpoint old = decode_checkpoint(bare);
  CHECK(old.tensors.empty());
  CHECK(old.snapshot == c.snapshot);
  CHECK(read_bytes(path).size() > bare.size());
  CHECK_THROWS_AS(checkpoint_tensors(r.plan, std::vector<std::vector<std::uint64_t>>{{3}, {2}}), ShapeMismatch);
  CHECK_THROWS_AS(checkpoint_tensors(r.plan, std::vector<std::vector<std::uint64_t>>{{4}}), ShapeMismatch);
}

TEST_CASE("A tensors section that disagrees with the fragments or repeats a name is refused", "[checkpoint]") {
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  const auto snap = a.snapshot();
  const auto refused = [&](std::vector<CheckpointTensor> t, const std::string& reason) {
    CHECK_THROWS_WITH(decode_checkpoint(encode_checkpoint(snap, 1, t)), Catch::Contains(reason));
  };
  refused({{"w", {4}, false}, {"b", {3}, false}}, "names 7 elements but the fragments hold 6");
  refused({{"w", {4}, false}, {"w", {2}, false}}, "the name 'w' appears twice");
  refused({{"", {4}, false}, {"b", {2}, false}}, "has an empty name");
  refused({{"w", {4, 0}, false}, {"b", {2}, false}}, "has dimension 0");
  // Unknown flag bits: the flags word of the first record, set to 2.
  auto bytes = encode_checkpoint(snap, 1, checkpoint_tensors(r.plan));
  const auto plain = encode_checkpoint(snap, 1);
  // tensors section: 16-byte section header, count, then "w" (u64 length + 1 byte), then flags.
  const std::size_t flags_at = plain.size() - 4 + 16 + 8 + 8 + 1;
  put_u64(bytes, flags_at, 2);
  reseal(bytes);
  CHECK_THROWS_WITH(decode_checkpoint(bytes), Catch::Contains("unknown flags 2"));
}

TEST_CASE("The sequence epoch is saved in its own section, and a file without it loads with epoch 0",
          "[checkpoint][epoch]") {
  Rig r;
  AvgSyncer a(r.plan, r.init, r.clock, k_of(1));
  give_history(r, a);
  SyncerSnapshot snap = a.snapshot();
  CHECK(snap.sequence_epoch == 0);
  SyncerSnapshot advanced = snap;
  advance_epoch(advanced);
  CHECK(advanced.sequence_epoch == 1);
  advance_epoch(advanced);
  CHECK(advanced.sequence_epoch == 2);
  // The new epoch is above every epoch a recorded sequence is in, whatever the field says.
  SyncerSnapshot high = snap;
  high.fragments[0].last_sequence[1] = (std::uint64_t{3} << kSequenceEpochShift) + 5;
  advance_epoch(high);
  CHECK(high.sequence_epoch == 4);
  snap.sequence_epoch = 2;
  const auto bytes = encode_checkpoint(snap, 4);
  CHECK(decode_checkpoint(bytes).snapshot == snap);
  // The file as a writer without the section made it: the epoch section (the
  // last one when there is no tensors section: 16-byte header + u64) removed,
  // the section count and body length patched, the checksum recomputed.
  constexpr std::size_t kEpochSection = 16 + 8;
  const std::size_t at = bytes.size() - 4 - kEpochSection;
  REQUIRE(std::to_integer<int>(bytes[at]) == 5);  // the tag
  std::vector<std::byte> old(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(at));
  old.insert(old.end(), bytes.end() - 4, bytes.end());
  old[12] = static_cast<std::byte>(std::to_integer<int>(old[12]) - 1);  // section_count, low byte
  put_u64(old, 24, old.size() - 32 - 4);
  reseal(old);
  const LoadedCheckpoint legacy = decode_checkpoint(old);
  CHECK(legacy.snapshot.sequence_epoch == 0);
  SyncerSnapshot expected = snap;
  expected.sequence_epoch = 0;
  CHECK(legacy.snapshot == expected);
  // A restore of such a file still moves past every sequence it records.
  SyncerSnapshot from_legacy = legacy.snapshot;
  advance_epoch(from_legacy);
  CHECK(from_legacy.sequence_epoch == 1);

  // Two epoch sections, or an epoch that does not fit, are refused.
  std::vector<std::byte> twice(bytes.begin(), bytes.end() - 4);
  twice.insert(twice.end(), bytes.begin() + static_cast<std::ptrdiff_t>(at), bytes.end());
  twice[12] = static_cast<std::byte>(std::to_integer<int>(twice[12]) + 1);
  put_u64(twice, 24, twice.size() - 32 - 4);
  reseal(twice);
  CHECK_THROWS_WITH(decode_checkpoint(twice), Catch::Contains("a second epoch section"));
  snap.sequence_epoch = std::uint64_t{1} << 16;
  CHECK_THROWS_WITH(decode_checkpoint(encode_checkpoint(snap, 5)), Catch::Contains("does not fit in 16 bits"));
  VirtualClock clock2;
  AvgSyncer b(r.plan, r.init, clock2, k_of(1));
  CHECK_THROWS_WITH(b.restore(snap), Catch::Contains("sequence epoch 65536"));
}

TEST_CASE("Two crash restores in a row, each checkpointed before serving, never reuse a sequence space and never "
          "reject an honest contribution as a duplicate",
          "[checkpoint][epoch]") {
  TempDir dir;
  Rig r;
  std::uint64_t serial = 0;
  // The program's restart: newest valid checkpoint, new epochs, restore, and
  // the restored state written before anything is served.
  const auto restart = [&](VirtualClock& clock) {
    auto s = std::make_unique<AvgSyncer>(r.plan, r.init, clock, k_of(1));
    LoadedCheckpoint c = load_newest_valid(dir.path).value();
    advance_epoch(c.snapshot);
    s->restore(c.snapshot);
    write_checkpoint(dir.path, s->snapshot(), ++serial);
    return s;
  };
  // A learner: joins (new incarnation), then contributes with its own sequences.
  std::uint64_t nonce = 500, next = 0, version = 0;
  std::set<std::uint64_t> spaces;  // every first_sequence handed out
  const auto join = [&](AvgSyncer& s) {
    Outbox out;
    Message m;
    m.type = MessageType::join;
    m.fingerprint = r.plan.fingerprint();
    m.learner = 1;
    m.sequence = ++nonce;
    s.handle(m, out);
    REQUIRE(!out.empty());
    next = out.front().message.sequence;
    version = out.front().message.version;
    CHECK(spaces.insert(next).second);  // never a space handed out before
  };
  const auto contribute = [&](AvgSyncer& s, int n) {
    for (int i = 0; i < n; ++i) {
      Outbox out;
      s.handle(r.contribution(1, 0, 0.01f, ++next, version), out);
      for (const auto& o : out)
        if (o.message.type == MessageType::global_fragment) version = o.message.version;
    }
  };
  const auto duplicates = [](const AvgSyncer& s) {
    return s.status().rejected[static_cast<std::size_t>(RejectReason::duplicate)];
  };

  auto first = std::make_unique<AvgSyncer>(r.plan, r.init, r.clock, k_of(1));
  join(*first);
  contribute(*first, 2);
  write_checkpoint(dir.path, first->snapshot(), ++serial);
  // After the checkpoint the learner restarts (a new incarnation the checkpoint
  // does not know) and contributes; then the syncer crashes.
  join(*first);
  contribute(*first, 3);
  CHECK(duplicates(*first) == 0);
  first.reset();

  VirtualClock clock2(TimePoint{100s});
  auto second = restart(clock2);
  CHECK(second->status().sequence_epoch == 1);
  contribute(*second, 2);  // the lost incarnation goes on: accepted
  join(*second);           // the learner restarts again: a space of epoch 1
  CHECK(next >> kSequenceEpochShift == 1);
  auto accepted = second->status().contributions_accepted;
  contribute(*second, 4);
  CHECK(second->status().contributions_accepted == accepted + 4);
  CHECK(duplicates(*second) == 0);
  second.reset();  // a second crash before any interval checkpoint

  VirtualClock clock3(TimePoint{200s});
  auto third = restart(clock3);  // from the checkpoint the second one wrote at once: epoch 2
  CHECK(third->status().sequence_epoch == 2);
  contribute(*third, 2);
  join(*third);
  CHECK(next >> kSequenceEpochShift == 2);
  accepted = third->status().contributions_accepted;
  contribute(*third, 3);
  CHECK(third->status().contributions_accepted == accepted + 3);
  CHECK(duplicates(*third) == 0);
  CHECK(spaces.size() == 4);
}
