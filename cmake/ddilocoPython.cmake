# Decides the default of DDILOCO_BUILD_PYTHON: ON when ddiloco is the top-level
# project and the Python package's dependencies are found: the interpreter
# (/usr/bin/python3 first: the distribution's, with its numpy and torch) and its
# headers, pybind11 (pybind11-dev) and ZeroMQ (libzmq3-dev). Sets
# DDILOCO_PYTHON_DEFAULT; a status line says what is missing otherwise.
set(DDILOCO_PYTHON_DEFAULT OFF)
if(DDILOCO_IS_TOP_LEVEL)
  if(NOT DEFINED Python_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python_EXECUTABLE /usr/bin/python3 CACHE FILEPATH "Interpreter the ddiloco Python package is built for")
  endif()
  find_package(Python 3.9 QUIET COMPONENTS Interpreter Development.Module)
  if(Python_FOUND)
    find_package(pybind11 2.6 CONFIG QUIET)
  endif()
  if(DDILOCO_SANITIZE)
    # An instrumented extension cannot be loaded by the uninstrumented interpreter.
    message(STATUS "ddiloco: DDILOCO_SANITIZE is set: the Python package is not built in this build")
  elseif(NOT Python_FOUND)
    message(STATUS "ddiloco: Python interpreter or headers not found (apt-get install python3-dev): the Python package is not built")
  elseif(NOT pybind11_FOUND)
    message(STATUS "ddiloco: pybind11 not found (apt-get install pybind11-dev): the Python package is not built")
  elseif(NOT TARGET PkgConfig::DDILOCO_ZMQ)
    message(STATUS "ddiloco: ZeroMQ not found (apt-get install libzmq3-dev): the Python package is not built")
  else()
    set(DDILOCO_PYTHON_DEFAULT ON)
  endif()
endif()
