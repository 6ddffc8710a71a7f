// ddiloco/error.hpp: the library's exception hierarchy.
//
// What it is: the one place that defines how a broken contract is reported.
// Every error carries a stable id (for example "ddiloco.invalid_argument") and
// a message that names the bad value and says what to do about it.
// What it is not: a channel for expected outcomes. A quorum not reached, a
// learner declared dead or a contribution rejected are returned values or
// counted events, never exceptions (see style.md, rule 5).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace ddiloco {

/// Base of every exception ddiloco throws. `id()` is stable across releases.
class Error : public std::runtime_error {
 public:
  Error(std::string id, const std::string& message)
      : std::runtime_error("[" + id + "] " + message), id_(std::move(id)) {}
  [[nodiscard]] const std::string& id() const noexcept { return id_; }

 private:
  std::string id_;
};

/// A caller passed a value outside its documented domain (P = 0, lr <= 0, ...).
class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& message) : Error("ddiloco.invalid_argument", message) {}
};

/// Tensors or buffers whose count, sizes or names do not match the plan.
class ShapeMismatch : public Error {
 public:
  explicit ShapeMismatch(const std::string& message) : Error("ddiloco.shape_mismatch", message) {}
};

/// An operation called in a state that does not allow it (step() before join()).
class StateError : public Error {
 public:
  explicit StateError(const std::string& message) : Error("ddiloco.state", message) {}
};

/// A message or file from outside the process that failed validation.
class ProtocolError : public Error {
 public:
  explicit ProtocolError(const std::string& message) : Error("ddiloco.protocol", message) {}
};

/// A transport that failed permanently (closed, unreachable after its deadline).
class TransportError : public Error {
 public:
  explicit TransportError(const std::string& message) : Error("ddiloco.transport", message) {}
};

namespace detail {
/// Concatenate streamable values into a message: `msg("P = ", p, " must be > 0")`.
template <class... Args>
std::string msg(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace ddiloco
