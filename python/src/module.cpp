// python/src/module.cpp: the compiled module ddiloco._core.
//
// What it is: the module entry point and the exception translation: every
// ddiloco::Error subclass becomes a Python exception of the same name, with
// the same message (which names the value and the fix), deriving from
// ddiloco.Error and from the closest built-in exception (ValueError,
// RuntimeError, ConnectionError) so that ordinary `except` clauses work.
// What it is not: the user-facing API; that is the pure-Python package over it.
#include "common.hpp"

namespace ddiloco::python {

namespace {
/// A Python exception class `name` in `m` with bases `bases` (a tuple).
py::object new_exception(py::module_& m, const char* name, py::tuple bases, const char* doc) {
  py::dict ns;
  ns["__doc__"] = doc;
  ns["__module__"] = "ddiloco";
  py::object cls = py::reinterpret_steal<py::object>(PyErr_NewException(("ddiloco." + std::string(name)).c_str(),
                                                                         bases.ptr(), ns.ptr()));
  if (!cls) throw py::error_already_set();
  m.attr(name) = cls;
  return cls;
}
}  // namespace

void bind_errors(py::module_& m) {
  const py::object builtins = py::module_::import("builtins");
  static py::handle error = new_exception(m, "Error", py::make_tuple(builtins.attr("Exception")),
                                          "Base of every error ddiloco raises (a broken contract).")
                                .release();
  static py::handle invalid = new_exception(m, "InvalidArgument", py::make_tuple(error, builtins.attr("ValueError")),
                                            "A value outside its documented domain.");
  static py::handle shape = new_exception(m, "ShapeMismatch", py::make_tuple(error, builtins.attr("ValueError")),
                                          "Tensors whose count, sizes or names do not match the plan.");
  static py::handle state = new_exception(m, "StateError", py::make_tuple(error, builtins.attr("RuntimeError")),
                                          "An operation called in a state that does not allow it.");
  static py::handle protocol = new_exception(m, "ProtocolError", py::make_tuple(error),
                                             "A message or file from outside the process that failed validation.");
  static py::handle transport =
      new_exception(m, "TransportError", py::make_tuple(error, builtins.attr("ConnectionError")),
                    "A link that failed (cannot connect, no reply within the time-out).");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(invalid.ptr(), e.what());
    } catch (const ShapeMismatch& e) {
      PyErr_SetString(shape.ptr(), e.what());
    } catch (const StateError& e) {
      PyErr_SetString(state.ptr(), e.what());
    } catch (const ProtocolError& e) {
      PyErr_SetString(protocol.ptr(), e.what());
    } catch (const TransportError& e) {
      PyErr_SetString(transport.ptr(), e.what());
    } catch (const Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });
}

}  // namespace ddiloco::python

PYBIND11_MODULE(_core, m) {
  m.doc() = "ddiloco's compiled core (an implementation detail: import ddiloco instead)";
  ddiloco::python::bind_errors(m);
  ddiloco::python::bind_learner(m);
  ddiloco::python::bind_syncer(m);
  ddiloco::python::bind_sim(m);
}
