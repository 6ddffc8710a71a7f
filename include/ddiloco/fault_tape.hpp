// ddiloco/fault_tape.hpp: a seeded, replayable schedule of failures.
//
// What it is: one value that says what goes wrong in a run, so that a failure
// seen once can be replayed exactly. It holds two kinds of faults:
//   - message faults, applied by a transport (see transport/in_process.hpp):
//     drop, duplicate, reorder, latency + jitter, and partitions that cut one
//     learner off from the syncer for a window of time;
//   - learner faults, applied by the harness that runs the learners: kill a
//     learner at one of its inner steps (it comes back after a down time), slow
//     a learner down by a factor, and scavenged learners that join the run for
//     a while and leave again.
// What it is not: a transport, a clock or a scheduler. It never sleeps, never
// reads a clock and holds no mutable state; every query is a pure function.
//
// # Determinism
// The fate of a message is a pure function of the tape's seed and of the
// message itself: (sender, receiver, type, learner, fragment, sequence,
// version, step) plus the ordinal of the send on its link (the n-th message
// from this sender to this receiver), hashed with SplitMix64. It never comes
// from a random generator consumed in arrival order, so threads that
// interleave differently from run to run still see the same faults for the
// same messages. (The ordinal is itself deterministic whenever one thread
// sends on a link, or the sends on a link are otherwise ordered.)
//
// # Time and steps
// Times in the tape (partition windows) are durations since the start of the
// run: the transport passes "now minus the moment the network was created".
// Learner-fault steps are the learner's own inner-step counter as the harness
// counts it (across restarts), except scavenging windows, which are given in
// *run steps*: the harness's reference step counter (for example its
// virtual-time tick measured in nominal inner steps), because a learner that
// has not joined yet has no steps of its own.
//
// # Text form (one directive per line; '#' starts a comment)
//   seed 42
//   drop 0.05                        P(message lost)
//   duplicate 0.02                   P(a second copy is delivered later)
//   reorder 0.05 20ms                P(extra delay uniform in [0, 20ms)), so later messages overtake
//   latency 2ms jitter 1ms           every copy waits 2ms + uniform [0, 1ms)
//   partition 2 from 1.5s to 3s      learner 2 <-> syncer cut during [1.5s, 3s)
//   kill 1 at-step 300 down 200      killed at its step 300, down for 200 of its step times
//   kill 1 at-step 900 down 1.5s     ... or for a fixed duration (unit given)
//   slow 3 x3 from-step 0            learner 3 runs 3x slower from its step 0 on
//   slow 3 x2 from-step 10 to-step 50
//   join 5 at-step 100 leave-at-step 400   scavenged learner 5 present in run steps [100, 400)
// Durations take a unit: ns, us, ms, s (decimals allowed: 1.5s). `to_string()`
// writes a text that `parse()` reads back to an equal tape.
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <ddiloco/clock.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/message.hpp>

namespace ddiloco {

/// One end of a link: the syncer or a learner.
struct Endpoint {
  enum class Role : std::uint8_t { learner = 0, syncer = 1 };
  Role role = Role::syncer;
  LearnerId id = 0;  ///< the learner's id; 0 for the syncer

  [[nodiscard]] static constexpr Endpoint syncer() noexcept { return Endpoint{Role::syncer, 0}; }
  [[nodiscard]] static constexpr Endpoint for_learner(LearnerId learner) noexcept {
    return Endpoint{Role::learner, learner};
  }
  [[nodiscard]] constexpr bool is_syncer() const noexcept { return role == Role::syncer; }
  friend constexpr bool operator==(Endpoint, Endpoint) = default;
};

/// Why a copy of a message is not delivered.
enum class DropReason : std::uint8_t { none = 0, fault = 1, partition = 2 };

/// What happens to one message: up to two copies (the original and, when the
/// tape duplicates it, a second copy delivered later), each with its delivery
/// delay after the send and whether the network loses it.
struct MessageFate {
  struct Copy {
    Duration delay{0};
    DropReason dropped = DropReason::none;
    friend bool operator==(const Copy&, const Copy&) = default;
  };
  std::array<Copy, 2> copy{};
  std::uint8_t copies = 1;  ///< 1, or 2 when duplicated

  /// Copies that reach the receiver's queue (0, 1 or 2).
  [[nodiscard]] int delivered() const noexcept {
    int n = 0;
    for (std::size_t i = 0; i < copies; ++i) n += copy[i].dropped == DropReason::none ? 1 : 0;
    return n;
  }
  friend bool operator==(const MessageFate&, const MessageFate&) = default;
};

/// Message faults applied to every link. All zero: a perfect network.
struct MessageFaults {
  double drop = 0.0;          ///< P(message lost), in [0, 1]
  double duplicate = 0.0;     ///< P(a second copy, delivered after the first), in [0, 1]
  double reorder = 0.0;       ///< P(extra delay uniform in [0, reorder_max)), in [0, 1]
  Duration reorder_max{0};    ///< bound of the reorder delay, >= 0
  Duration latency{0};        ///< fixed delay of every copy, >= 0
  Duration jitter{0};         ///< extra delay uniform in [0, jitter), >= 0
  friend bool operator==(const MessageFaults&, const MessageFaults&) = default;
};

/// Learner `learner` and the syncer cannot reach each other during [from, to)
/// (times since the start of the run). A copy is lost when its flight
/// [send, send + delay] overlaps the window, in either direction.
struct Partition {
  LearnerId learner = 0;
  Duration from{0};
  Duration to{0};
  friend bool operator==(const Partition&, const Partition&) = default;
};

/// How long a killed learner stays down.
struct Downtime {
  /// Set: down for this many of its own inner-step times (the harness converts
  /// with the learner's nominal or measured step time). Empty: down for `time`.
  std::optional<std::uint64_t> steps;
  Duration time{0};
  friend bool operator==(const Downtime&, const Downtime&) = default;
};

/// Kill learner `learner` when it reaches inner step `at_step` (before running
/// that step); it restarts after `down` and rejoins with a fresh state.
struct Kill {
  LearnerId learner = 0;
  std::uint64_t at_step = 0;
  Downtime down;
  friend bool operator==(const Kill&, const Kill&) = default;
};

/// Learner `learner` takes `factor` times its normal step time for inner steps
/// in [from_step, to_step) (to_step empty: forever). Overlapping slowdowns multiply.
struct Slowdown {
  LearnerId learner = 0;
  double factor = 1.0;  ///< >= 1
  std::uint64_t from_step = 0;
  std::optional<std::uint64_t> to_step;
  friend bool operator==(const Slowdown&, const Slowdown&) = default;
};

/// Scavenged learner `learner` is part of the run for run steps [at_step,
/// leave_step) (leave_step empty: until the end). A learner with no Scavenge
/// entry is present for the whole run.
struct Scavenge {
  LearnerId learner = 0;
  std::uint64_t at_step = 0;
  std::optional<std::uint64_t> leave_step;
  friend bool operator==(const Scavenge&, const Scavenge&) = default;
};

/// A kill or a change of speed of one learner, at one of its inner steps.
struct LearnerEvent {
  enum class Kind : std::uint8_t { kill = 0, slow_begin = 1, slow_end = 2 };
  Kind kind = Kind::kill;
  std::uint64_t step = 0;
  Downtime down;        ///< kill only
  double factor = 1.0;  ///< slow_begin / slow_end: the slowdown that begins or ends
  friend bool operator==(const LearnerEvent&, const LearnerEvent&) = default;
};

namespace detail {

/// SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mixer
/// whose output bits each depend on every input bit.
constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

/// Uniform double in [0, 1) from the top 53 bits of `x`.
constexpr double unit_interval(std::uint64_t x) noexcept {
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

/// floor(u * d) for u in [0, 1): a uniform draw in [0, d).
inline Duration scale(Duration d, double u) noexcept {
  return Duration{static_cast<Duration::rep>(std::floor(u * static_cast<double>(d.count())))};
}

inline std::uint64_t endpoint_code(Endpoint e) noexcept {
  return (static_cast<std::uint64_t>(e.role) << 32) | e.id;
}

inline std::optional<std::string> check_probability(std::string_view name, double p) {
  if (!(p >= 0.0 && p <= 1.0)) return msg(name, " probability ", p, " must be in [0, 1]");
  return std::nullopt;
}

inline std::optional<std::string> check_message_faults(const MessageFaults& f) {
  if (auto e = check_probability("drop", f.drop)) return e;
  if (auto e = check_probability("duplicate", f.duplicate)) return e;
  if (auto e = check_probability("reorder", f.reorder)) return e;
  if (f.reorder_max < Duration{0}) return msg("reorder bound ", f.reorder_max.count(), "ns must be >= 0");
  if (f.latency < Duration{0}) return msg("latency ", f.latency.count(), "ns must be >= 0");
  if (f.jitter < Duration{0}) return msg("jitter ", f.jitter.count(), "ns must be >= 0");
  return std::nullopt;
}

inline std::optional<std::string> check_partition(const Partition& p) {
  if (p.from < Duration{0}) return msg("partition start ", p.from.count(), "ns must be >= 0");
  if (!(p.from < p.to)) {
    return msg("partition of learner ", p.learner, " ends at ", p.to.count(), "ns, not after its start ",
               p.from.count(), "ns; give 'from' < 'to'");
  }
  return std::nullopt;
}

inline std::optional<std::string> check_kill(const Kill& k) {
  if (!k.down.steps && k.down.time < Duration{0}) {
    return msg("down time ", k.down.time.count(), "ns of learner ", k.learner, " must be >= 0");
  }
  return std::nullopt;
}

inline std::optional<std::string> check_slowdown(const Slowdown& s) {
  if (!(s.factor >= 1.0) || !std::isfinite(s.factor)) {
    return msg("slowdown factor ", s.factor, " of learner ", s.learner, " must be finite and >= 1");
  }
  if (s.to_step && *s.to_step <= s.from_step) {
    return msg("slowdown of learner ", s.learner, " ends at step ", *s.to_step, ", not after its start ",
               s.from_step, "; give to-step > from-step");
  }
  return std::nullopt;
}

inline std::optional<std::string> check_scavenge(const Scavenge& s, const std::vector<Scavenge>& existing) {
  if (s.leave_step && *s.leave_step <= s.at_step) {
    return msg("learner ", s.learner, " leaves at run step ", *s.leave_step, ", not after it joins at ", s.at_step,
               "; give leave-at-step > at-step");
  }
  constexpr auto open_end = std::numeric_limits<std::uint64_t>::max();
  for (const auto& o : existing) {
    if (o.learner != s.learner) continue;
    const auto a_end = s.leave_step.value_or(open_end);
    const auto b_end = o.leave_step.value_or(open_end);
    if (s.at_step < b_end && o.at_step < a_end) {
      return msg("scavenging windows of learner ", s.learner, " overlap (joins at run steps ", o.at_step, " and ",
                 s.at_step, "); one learner id is present at most once at a time");
    }
  }
  return std::nullopt;
}

/// Writes a duration in the largest unit that keeps it an integer.
inline std::string format_duration(Duration d) {
  const auto n = d.count();
  if (n != 0 && n % 1'000'000'000 == 0) return msg(n / 1'000'000'000, "s");
  if (n != 0 && n % 1'000'000 == 0) return msg(n / 1'000'000, "ms");
  if (n != 0 && n % 1'000 == 0) return msg(n / 1'000, "us");
  return msg(n, "ns");
}

/// Shortest text that reads back to the same double.
inline std::string format_double(double v) {
  std::array<char, 64> buf{};
  const auto res = std::to_chars(buf.data(), buf.data() + buf.size(), v);
  return std::string(buf.data(), res.ptr);
}

/// Reads tape text line by line; every error names the line and the token.
class TapeParser {
 public:
  explicit TapeParser(std::size_t line_no, std::string_view line) : line_no_(line_no), line_(line) {
    std::size_t i = 0;
    while (i < line.size()) {
      while (i < line.size() && is_space(line[i])) ++i;
      if (i >= line.size() || line[i] == '#') break;
      std::size_t j = i;
      while (j < line.size() && !is_space(line[j]) && line[j] != '#') ++j;
      tokens_.push_back(line.substr(i, j - i));
      i = j;
    }
  }

  [[nodiscard]] bool empty() const noexcept { return tokens_.empty(); }
  [[nodiscard]] std::size_t size() const noexcept { return tokens_.size(); }
  [[nodiscard]] std::string_view token(std::size_t i) const noexcept { return tokens_[i]; }

  [[noreturn]] void fail(std::string_view token, std::string_view what) const {
    throw ProtocolError(msg("fault tape line ", line_no_, " ('", line_, "'): token '", token, "' ", what));
  }
  [[noreturn]] void fail_line(std::string_view what) const {
    throw ProtocolError(msg("fault tape line ", line_no_, " ('", line_, "'): ", what));
  }

  /// Requires exactly `n` tokens, or between `n` and `max_n`.
  void expect_count(std::size_t n, std::size_t max_n, std::string_view usage) const {
    if (tokens_.size() < n) fail_line(msg("is incomplete; expected '", usage, "'"));
    if (tokens_.size() > max_n) fail(tokens_[max_n], msg("is unexpected; expected '", usage, "'"));
  }

  /// Requires token i to be the keyword `word`.
  void keyword(std::size_t i, std::string_view word, std::string_view usage) const {
    if (tokens_[i] != word) fail(tokens_[i], msg("should be '", word, "'; expected '", usage, "'"));
  }

  [[nodiscard]] std::uint64_t u64(std::size_t i) const {
    const auto t = tokens_[i];
    std::uint64_t v = 0;
    const auto res = std::from_chars(t.data(), t.data() + t.size(), v);
    if (res.ec != std::errc{} || res.ptr != t.data() + t.size()) {
      fail(t, "is not a non-negative integer");
    }
    return v;
  }

  [[nodiscard]] LearnerId learner(std::size_t i) const {
    const auto v = u64(i);
    if (v > std::numeric_limits<LearnerId>::max()) fail(tokens_[i], "is too large for a learner id");
    return static_cast<LearnerId>(v);
  }

  [[nodiscard]] double number(std::string_view t) const {
    double v = 0.0;
    const auto res = std::from_chars(t.data(), t.data() + t.size(), v);
    if (res.ec != std::errc{} || res.ptr != t.data() + t.size() || !std::isfinite(v)) {
      fail(t, "is not a finite number");
    }
    return v;
  }

  [[nodiscard]] double probability(std::size_t i) const {
    const double p = number(tokens_[i]);
    if (!(p >= 0.0 && p <= 1.0)) fail(tokens_[i], "is not a probability in [0, 1]");
    return p;
  }

  /// "x3" or "x1.5": a slowdown factor >= 1.
  [[nodiscard]] double factor(std::size_t i) const {
    const auto t = tokens_[i];
    if (t.size() < 2 || t[0] != 'x') fail(t, "is not a factor; write it as x<number>, e.g. x3");
    const double f = number(t.substr(1));
    if (!(f >= 1.0)) fail(t, "is a factor below 1; a slowdown factor must be >= 1");
    return f;
  }

  /// Whether token i carries a unit (a duration) rather than a bare integer.
  [[nodiscard]] bool has_unit(std::size_t i) const noexcept {
    const auto t = tokens_[i];
    return !t.empty() && ((t.back() >= 'a' && t.back() <= 'z') || (t.back() >= 'A' && t.back() <= 'Z'));
  }

  /// A non-negative duration with a unit: 250ns, 20us, 2ms, 1.5s.
  [[nodiscard]] Duration duration(std::size_t i) const {
    const auto t = tokens_[i];
    std::size_t split = 0;
    while (split < t.size() && ((t[split] >= '0' && t[split] <= '9') || t[split] == '.')) ++split;
    const auto num = t.substr(0, split);
    const auto unit = t.substr(split);
    std::int64_t scale_ns = 0;
    if (unit == "ns") {
      scale_ns = 1;
    } else if (unit == "us") {
      scale_ns = 1'000;
    } else if (unit == "ms") {
      scale_ns = 1'000'000;
    } else if (unit == "s") {
      scale_ns = 1'000'000'000;
    } else {
      fail(t, "is not a duration; give a number with a unit ns, us, ms or s (e.g. 20ms, 1.5s)");
    }
    if (num.empty()) fail(t, "has no number before its unit");
    constexpr double max_ns = 9.0e18;
    if (num.find('.') == std::string_view::npos) {
      std::uint64_t v = 0;
      const auto res = std::from_chars(num.data(), num.data() + num.size(), v);
      if (res.ec != std::errc{} || res.ptr != num.data() + num.size() ||
          static_cast<double>(v) * static_cast<double>(scale_ns) > max_ns) {
        fail(t, "is not a representable duration");
      }
      return Duration{static_cast<Duration::rep>(v) * scale_ns};
    }
    const double v = number(num) * static_cast<double>(scale_ns);
    if (!(v <= max_ns)) fail(t, "is not a representable duration");
    return Duration{static_cast<Duration::rep>(std::llround(v))};
  }

 private:
  static constexpr bool is_space(char c) noexcept { return c == ' ' || c == '\t' || c == '\r'; }

  std::size_t line_no_;
  std::string_view line_;
  std::vector<std::string_view> tokens_;
};

}  // namespace detail

/// A seeded, replayable fault schedule. A default-constructed tape injects no
/// fault at all. Adders validate and throw InvalidArgument on a bad value.
class FaultTape {
 public:
  FaultTape() = default;
  explicit FaultTape(std::uint64_t seed) : seed_(seed) {}

  // ---- building ---------------------------------------------------------
  FaultTape& set_seed(std::uint64_t seed) noexcept {
    seed_ = seed;
    return *this;
  }
  FaultTape& set_message_faults(const MessageFaults& f) {
    if (auto e = detail::check_message_faults(f)) throw InvalidArgument(*e);
    messages_ = f;
    return *this;
  }
  FaultTape& add(const Partition& p) {
    if (auto e = detail::check_partition(p)) throw InvalidArgument(*e);
    partitions_.push_back(p);
    return *this;
  }
  FaultTape& add(const Kill& k) {
    if (auto e = detail::check_kill(k)) throw InvalidArgument(*e);
    kills_.push_back(k);
    return *this;
  }
  FaultTape& add(const Slowdown& s) {
    if (auto e = detail::check_slowdown(s)) throw InvalidArgument(*e);
    slowdowns_.push_back(s);
    return *this;
  }
  FaultTape& add(const Scavenge& s) {
    if (auto e = detail::check_scavenge(s, scavenges_)) throw InvalidArgument(*e);
    scavenges_.push_back(s);
    return *this;
  }

  // ---- contents ---------------------------------------------------------
  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }
  [[nodiscard]] const MessageFaults& message_faults() const noexcept { return messages_; }
  [[nodiscard]] const std::vector<Partition>& partitions() const noexcept { return partitions_; }
  [[nodiscard]] const std::vector<Kill>& kills() const noexcept { return kills_; }
  [[nodiscard]] const std::vector<Slowdown>& slowdowns() const noexcept { return slowdowns_; }
  [[nodiscard]] const std::vector<Scavenge>& scavenges() const noexcept { return scavenges_; }
  friend bool operator==(const FaultTape&, const FaultTape&) = default;

  // ---- message faults (for a transport) -----------------------------------

  /// The fate of `m` sent from `from` to `to` at `now` (time since the start
  /// of the run), as the `ordinal`-th message on that link. Pure: the same
  /// arguments always give the same fate.
  ///
  /// From h = hash(seed, from, to, m.type, m.learner, m.fragment, m.sequence,
  /// m.version, m.step, ordinal), independent uniforms u_k = U(splitmix64(h + k)):
  ///   lost (fault)            if u_0 < drop (then no copy survives)
  ///   delay_0 = latency + jitter * u_1 + [u_2 < reorder] * reorder_max * u_3
  ///   duplicated              if u_4 < duplicate, with
  ///   delay_1 = delay_0 + latency + jitter * u_5     (so the copy comes after)
  ///   copy i lost (partition) if [now, now + delay_i] overlaps a window of a
  ///                           partition of the learner on this link.
  [[nodiscard]] MessageFate fate(const Message& m, Endpoint from, Endpoint to, TimePoint now,
                                 std::uint64_t ordinal = 0) const noexcept {
    std::uint64_t h = detail::splitmix64(seed_);
    for (std::uint64_t field :
         {detail::endpoint_code(from), detail::endpoint_code(to), static_cast<std::uint64_t>(m.type),
          static_cast<std::uint64_t>(m.learner), static_cast<std::uint64_t>(m.fragment), m.sequence, m.version,
          m.step, ordinal}) {
      h = detail::splitmix64(h ^ field);
    }
    const auto u = [h](std::uint64_t k) { return detail::unit_interval(detail::splitmix64(h + k)); };

    MessageFate f;
    if (u(0) < messages_.drop) {
      f.copy[0].dropped = DropReason::fault;
      return f;
    }
    f.copy[0].delay = messages_.latency + detail::scale(messages_.jitter, u(1));
    if (u(2) < messages_.reorder) f.copy[0].delay += detail::scale(messages_.reorder_max, u(3));
    if (u(4) < messages_.duplicate) {
      f.copies = 2;
      f.copy[1].delay = f.copy[0].delay + messages_.latency + detail::scale(messages_.jitter, u(5));
    }
    // A partition concerns the link between its learner and the syncer.
    const auto* learner_end = from.is_syncer() ? &to : (to.is_syncer() ? &from : nullptr);
    if (learner_end != nullptr && !learner_end->is_syncer()) {
      for (std::size_t i = 0; i < f.copies; ++i) {
        const auto arrive = now + f.copy[i].delay;
        for (const auto& p : partitions_) {
          if (p.learner == learner_end->id && now < p.to && p.from <= arrive) {
            f.copy[i].dropped = DropReason::partition;
            break;
          }
        }
      }
    }
    return f;
  }

  /// Whether learner `learner` and the syncer are cut off at `now` (time since
  /// the start of the run).
  [[nodiscard]] bool partitioned(LearnerId learner, TimePoint now) const noexcept {
    return std::any_of(partitions_.begin(), partitions_.end(),
                       [&](const Partition& p) { return p.learner == learner && p.from <= now && now < p.to; });
  }

  // ---- learner faults (for the harness) -----------------------------------

  /// Kills and speed changes of `learner`, sorted by inner step (ties keep the
  /// order kill, slow_end, slow_begin, then tape order).
  [[nodiscard]] std::vector<LearnerEvent> learner_events(LearnerId learner) const {
    std::vector<LearnerEvent> out;
    for (const auto& k : kills_) {
      if (k.learner == learner) out.push_back({LearnerEvent::Kind::kill, k.at_step, k.down, 1.0});
    }
    for (const auto& s : slowdowns_) {
      if (s.learner != learner) continue;
      out.push_back({LearnerEvent::Kind::slow_begin, s.from_step, {}, s.factor});
      if (s.to_step) out.push_back({LearnerEvent::Kind::slow_end, *s.to_step, {}, s.factor});
    }
    const auto rank = [](LearnerEvent::Kind k) {
      switch (k) {
        case LearnerEvent::Kind::kill: return 0;
        case LearnerEvent::Kind::slow_end: return 1;
        case LearnerEvent::Kind::slow_begin: return 2;
      }
      return 3;
    };
    std::stable_sort(out.begin(), out.end(), [&](const LearnerEvent& a, const LearnerEvent& b) {
      return a.step != b.step ? a.step < b.step : rank(a.kind) < rank(b.kind);
    });
    return out;
  }

  /// The kill of `learner` at inner step `step`, if the tape has one.
  [[nodiscard]] std::optional<Kill> kill_at(LearnerId learner, std::uint64_t step) const {
    for (const auto& k : kills_) {
      if (k.learner == learner && k.at_step == step) return k;
    }
    return std::nullopt;
  }
  [[nodiscard]] bool is_killed_at(LearnerId learner, std::uint64_t step) const {
    return kill_at(learner, step).has_value();
  }

  /// Step-time multiplier of `learner` at inner step `step`: the product of
  /// the factors of every slowdown with from_step <= step < to_step; 1 if none.
  [[nodiscard]] double slowdown(LearnerId learner, std::uint64_t step) const noexcept {
    double f = 1.0;
    for (const auto& s : slowdowns_) {
      if (s.learner == learner && s.from_step <= step && (!s.to_step || step < *s.to_step)) f *= s.factor;
    }
    return f;
  }

  /// Whether `learner` takes part in the run at run step `run_step`: always
  /// for a learner without Scavenge entries, else inside one of its windows.
  [[nodiscard]] bool is_member_at(LearnerId learner, std::uint64_t run_step) const noexcept {
    bool scavenged = false;
    for (const auto& s : scavenges_) {
      if (s.learner != learner) continue;
      scavenged = true;
      if (s.at_step <= run_step && (!s.leave_step || run_step < *s.leave_step)) return true;
    }
    return !scavenged;
  }

  /// The scavenging windows of `learner`, in tape order.
  [[nodiscard]] std::vector<Scavenge> scavenges_of(LearnerId learner) const {
    std::vector<Scavenge> out;
    for (const auto& s : scavenges_) {
      if (s.learner == learner) out.push_back(s);
    }
    return out;
  }

  // ---- text form ----------------------------------------------------------

  /// Reads the text form (see the top of this header). Throws ProtocolError
  /// naming the line and the token on anything it cannot read or accept.
  [[nodiscard]] static FaultTape parse(std::string_view text) {
    FaultTape tape;
    std::array<std::size_t, 5> seen{};  // line of seed, drop, duplicate, reorder, latency (0: not seen)
    std::size_t line_no = 0;
    while (!text.empty()) {
      const auto eol = text.find('\n');
      const auto line = text.substr(0, eol);
      text = eol == std::string_view::npos ? std::string_view{} : text.substr(eol + 1);
      ++line_no;
      const detail::TapeParser p(line_no, line);
      if (p.empty()) continue;
      const auto word = p.token(0);
      const auto once = [&](std::size_t slot) {
        if (seen[slot] != 0) p.fail(word, detail::msg("was already given on line ", seen[slot], "; give it once"));
        seen[slot] = line_no;
      };
      if (word == "seed") {
        p.expect_count(2, 2, "seed <integer>");
        once(0);
        tape.seed_ = p.u64(1);
      } else if (word == "drop") {
        p.expect_count(2, 2, "drop <probability>");
        once(1);
        tape.messages_.drop = p.probability(1);
      } else if (word == "duplicate") {
        p.expect_count(2, 2, "duplicate <probability>");
        once(2);
        tape.messages_.duplicate = p.probability(1);
      } else if (word == "reorder") {
        p.expect_count(3, 3, "reorder <probability> <max delay, e.g. 20ms>");
        once(3);
        tape.messages_.reorder = p.probability(1);
        tape.messages_.reorder_max = p.duration(2);
      } else if (word == "latency") {
        constexpr std::string_view usage = "latency <duration> [jitter <duration>]";
        p.expect_count(2, 4, usage);
        if (p.size() == 3) p.fail_line(detail::msg("is incomplete; expected '", usage, "'"));
        once(4);
        tape.messages_.latency = p.duration(1);
        if (p.size() == 4) {
          p.keyword(2, "jitter", usage);
          tape.messages_.jitter = p.duration(3);
        }
      } else if (word == "partition") {
        constexpr std::string_view usage = "partition <learner> from <time> to <time>";
        p.expect_count(6, 6, usage);
        p.keyword(2, "from", usage);
        p.keyword(4, "to", usage);
        const Partition part{p.learner(1), p.duration(3), p.duration(5)};
        if (!(part.from < part.to)) p.fail(p.token(5), "is not after the partition's start; give 'from' < 'to'");
        tape.partitions_.push_back(part);
      } else if (word == "kill") {
        constexpr std::string_view usage = "kill <learner> at-step <step> down <steps | duration>";
        p.expect_count(6, 6, usage);
        p.keyword(2, "at-step", usage);
        p.keyword(4, "down", usage);
        Kill k{p.learner(1), p.u64(3), {}};
        if (p.has_unit(5)) {
          k.down.time = p.duration(5);
        } else {
          k.down.steps = p.u64(5);
        }
        tape.kills_.push_back(k);
      } else if (word == "slow") {
        constexpr std::string_view usage = "slow <learner> x<factor> from-step <step> [to-step <step>]";
        p.expect_count(5, 7, usage);
        if (p.size() == 6) p.fail_line(detail::msg("is incomplete; expected '", usage, "'"));
        p.keyword(3, "from-step", usage);
        Slowdown s{p.learner(1), p.factor(2), p.u64(4), std::nullopt};
        if (p.size() == 7) {
          p.keyword(5, "to-step", usage);
          s.to_step = p.u64(6);
          if (*s.to_step <= s.from_step) p.fail(p.token(6), "is not after from-step; give to-step > from-step");
        }
        tape.slowdowns_.push_back(s);
      } else if (word == "join") {
        constexpr std::string_view usage = "join <learner> at-step <run step> [leave-at-step <run step>]";
        p.expect_count(4, 6, usage);
        if (p.size() == 5) p.fail_line(detail::msg("is incomplete; expected '", usage, "'"));
        p.keyword(2, "at-step", usage);
        Scavenge s{p.learner(1), p.u64(3), std::nullopt};
        if (p.size() == 6) {
          p.keyword(4, "leave-at-step", usage);
          s.leave_step = p.u64(5);
          if (*s.leave_step <= s.at_step) {
            p.fail(p.token(5), "is not after at-step; give leave-at-step > at-step");
          }
        }
        if (auto e = detail::check_scavenge(s, tape.scavenges_)) p.fail(p.token(1), *e);
        tape.scavenges_.push_back(s);
      } else {
        p.fail(word,
               "is not a directive; use seed, drop, duplicate, reorder, latency, partition, kill, slow or join");
      }
    }
    return tape;
  }

  /// The text form: `parse(to_string())` equals this tape. Message faults
  /// that are zero are left out.
  [[nodiscard]] std::string to_string() const {
    std::string out = detail::msg("seed ", seed_, "\n");
    const auto& f = messages_;
    if (f.drop != 0.0) out += detail::msg("drop ", detail::format_double(f.drop), "\n");
    if (f.duplicate != 0.0) out += detail::msg("duplicate ", detail::format_double(f.duplicate), "\n");
    if (f.reorder != 0.0 || f.reorder_max != Duration{0}) {
      out += detail::msg("reorder ", detail::format_double(f.reorder), " ", detail::format_duration(f.reorder_max),
                         "\n");
    }
    if (f.latency != Duration{0} || f.jitter != Duration{0}) {
      out += detail::msg("latency ", detail::format_duration(f.latency));
      if (f.jitter != Duration{0}) out += detail::msg(" jitter ", detail::format_duration(f.jitter));
      out += "\n";
    }
    for (const auto& p : partitions_) {
      out += detail::msg("partition ", p.learner, " from ", detail::format_duration(p.from), " to ",
                         detail::format_duration(p.to), "\n");
    }
    for (const auto& k : kills_) {
      out += detail::msg("kill ", k.learner, " at-step ", k.at_step, " down ",
                         k.down.steps ? std::to_string(*k.down.steps) : detail::format_duration(k.down.time), "\n");
    }
    for (const auto& s : slowdowns_) {
      out += detail::msg("slow ", s.learner, " x", detail::format_double(s.factor), " from-step ", s.from_step);
      if (s.to_step) out += detail::msg(" to-step ", *s.to_step);
      out += "\n";
    }
    for (const auto& s : scavenges_) {
      out += detail::msg("join ", s.learner, " at-step ", s.at_step);
      if (s.leave_step) out += detail::msg(" leave-at-step ", *s.leave_step);
      out += "\n";
    }
    return out;
  }

 private:
  std::uint64_t seed_ = 0;
  MessageFaults messages_;
  std::vector<Partition> partitions_;
  std::vector<Kill> kills_;
  std::vector<Slowdown> slowdowns_;
  std::vector<Scavenge> scavenges_;
};

}  // namespace ddiloco
