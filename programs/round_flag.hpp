// programs/round_flag.hpp: the --round flag of ddiloco_syncer and ddiloco_learner.
//
// `--round pull` (the programs' default) is the paper's round: learners send
// metadata after every inner step and the syncer pulls each fragment from them
// once per H global steps; `--round push` is the earlier protocol, where each
// learner sends fragment p at its own slots (docs/algorithm.md, "Round
// timeline"). The syncer and its learners must agree: a learner with the other
// mode is refused at join (JoinRefusal::round_mode), naming both.
#pragma once

#include <ddiloco/error.hpp>
#include <ddiloco/message.hpp>

#include <string>

#include "cli.hpp"

namespace ddiloco::cli {

/// The programs' default round mode (the library's default is still push).
inline constexpr const char* kDefaultRound = "pull";

inline void add_round_flag(Flags& f, const std::string& who) {
  f.add("round", kDefaultRound,
        "round mode: pull (the paper's round: learners send metadata every inner step and the syncer pulls each "
        "fragment once per H global steps; needs --sync-every) or push (each learner sends fragment p at its own "
        "slots of the schedule); " + who + " and the syncer must use the same mode (a join with the other one is "
        "refused, naming both)");
}

/// "push" or "pull" -> the RoundMode; anything else is an error naming the value.
inline RoundMode parse_round(const std::string& s) {
  if (s == "pull") return RoundMode::pull;
  if (s == "push") return RoundMode::push;
  throw InvalidArgument("--round '" + s + "': expected pull (the paper's round, the default) or push");
}

/// --round, checked against --sync-every (pull rounds open each fragment's
/// round at its slot of the schedule, so they need H).
inline RoundMode round_from_flags(const Flags& f) {
  const RoundMode r = parse_round(f.str("round"));
  if (r == RoundMode::pull && f.count("sync-every") == 0)
    throw InvalidArgument("--round pull needs --sync-every H > 0 (the learners' H: each fragment's round opens at "
                          "its slot of the schedule); give --sync-every, or use --round push");
  return r;
}

}  // namespace ddiloco::cli
