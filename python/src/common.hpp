// python/src/common.hpp: what the binding files of ddiloco._core share.
//
// What it is: the declarations of the per-area binding functions, the Python
// security choice (plaintext or CURVE key files) turned into a ZmqSecurity, and
// seconds (Python floats) turned into ddiloco::Duration.
// What it is not: maths; every algorithm stays in the C++ headers.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cmath>
#include <map>
#include <string>

#include <ddiloco/clock.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/transport/zmq.hpp>

namespace ddiloco::python {

namespace py = pybind11;

void bind_errors(py::module_& m);
void bind_learner(py::module_& m);
void bind_syncer(py::module_& m);
void bind_sim(py::module_& m);

/// An Error's message without its "[id] " prefix (to rethrow it with more context).
inline std::string message_of(const Error& e) {
  const std::string w = e.what();
  const std::string prefix = "[" + e.id() + "] ";
  return w.rfind(prefix, 0) == 0 ? w.substr(prefix.size()) : w;
}

/// `what` seconds as a Duration; throws InvalidArgument unless finite and > 0.
inline Duration seconds(double s, const char* what) {
  if (!(std::isfinite(s) && s > 0))
    throw InvalidArgument(detail::msg(what, " = ", s, " s must be a finite number of seconds > 0"));
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

/// The link's security as the user chose it. `who` names the caller in messages.
/// Learner: keys = its own key file, peer_keys = the syncer's public key file.
/// Syncer: keys = its key file, allow = the allow-list file.
inline ZmqSecurity security_of(const char* who, bool plaintext, const std::string& keys, const std::string& peer,
                               const char* peer_flag) {
  if (plaintext) {
    if (!keys.empty() || !peer.empty())
      throw InvalidArgument(detail::msg(who, ": plaintext=True and key files were both given; choose one: "
                                             "plaintext=True (no encryption) or the key files (CURVE)"));
    return ZmqSecurity::plaintext();
  }
  if (keys.empty() || peer.empty())
    throw InvalidArgument(detail::msg(who, ": choose the link's security: plaintext=True (no encryption, trusted "
                                           "networks only) or keys='<file>.key' and ", peer_flag,
                                      " (files written by ddiloco_keygen)"));
  return ZmqSecurity{};
}

/// "pull" / "push" -> RoundMode; anything else names the value and the choices.
inline RoundMode round_of(const std::string& round, const char* who) {
  if (round == "pull") return RoundMode::pull;
  if (round == "push") return RoundMode::push;
  throw InvalidArgument(std::string(who) + ": round = '" + round +
                        "' must be 'pull' (the paper's round: the syncer pulls each fragment once per sync_every "
                        "global steps) or 'push' (each learner sends at its own slots); the learners and the "
                        "syncer must agree");
}

}  // namespace ddiloco::python
