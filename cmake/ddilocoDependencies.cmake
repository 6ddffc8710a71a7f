# Optional integrations and their targets, the same whether ddiloco is the
# top-level project, pulled in with add_subdirectory/FetchContent, or found
# installed with find_package (ddilocoConfig.cmake defines the same names):
#
#   ddiloco::ddiloco   the core: the standard library and threads only
#   ddiloco::zmq       + <ddiloco/transport/zmq.hpp>: links libzmq (pkg-config libzmq; libzmq3-dev)
#   ddiloco::eigen     + <ddiloco/adapters/eigen.hpp>: Eigen3::Eigen (libeigen3-dev)
#   ddiloco::reference + <ddiloco/reference/*.hpp>, the reference char LM: Eigen3::Eigen
#   ddiloco::xtensor   + <ddiloco/adapters/xtensor.hpp>: xtensor (xtensor-dev)
#   ddiloco::prometheus  + <ddiloco/metrics/prometheus.hpp>: prometheus-cpp::pull (prometheus-cpp-dev)
#   ddiloco::safetensors + <ddiloco/safetensors.hpp>: nlohmann_json (nlohmann-json3-dev)
#
# Each one is an INTERFACE target that links ddiloco::ddiloco and its
# dependency, so a consumer links only ddiloco's targets. A target whose
# dependency is missing is not defined here (a status line says which package
# to install); the exported copies are always installed, and the installed
# package checks for the dependency when it is found.
find_package(Eigen3 3.3 CONFIG QUIET)
find_package(xtensor CONFIG QUIET)
if(NOT TARGET prometheus-cpp::pull)
  find_package(prometheus-cpp CONFIG QUIET)
endif()
if(NOT TARGET nlohmann_json::nlohmann_json)
  find_package(nlohmann_json 3 CONFIG QUIET)
endif()
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND AND NOT TARGET PkgConfig::DDILOCO_ZMQ)
  pkg_check_modules(DDILOCO_ZMQ QUIET IMPORTED_TARGET libzmq)
endif()

# ddiloco_component(<name> <export set> <dependency target> <Debian package>)
function(ddiloco_component name export_set dependency package)
  add_library(ddiloco_${name} INTERFACE)
  set_target_properties(ddiloco_${name} PROPERTIES EXPORT_NAME ${name})
  target_link_libraries(ddiloco_${name} INTERFACE ddiloco::ddiloco ${dependency})
  if(DDILOCO_INSTALL)
    install(TARGETS ddiloco_${name} EXPORT ${export_set})
  endif()
  if(TARGET ${dependency})
    add_library(ddiloco::${name} ALIAS ddiloco_${name})
  else()
    message(STATUS "ddiloco: ${dependency} not found (apt-get install ${package}): target ddiloco::${name} not defined")
  endif()
endfunction()

ddiloco_component(zmq ddilocoZmqTargets PkgConfig::DDILOCO_ZMQ libzmq3-dev)
ddiloco_component(eigen ddilocoEigenTargets Eigen3::Eigen libeigen3-dev)
ddiloco_component(reference ddilocoEigenTargets Eigen3::Eigen libeigen3-dev)
ddiloco_component(xtensor ddilocoXtensorTargets xtensor xtensor-dev)
ddiloco_component(prometheus ddilocoPrometheusTargets prometheus-cpp::pull prometheus-cpp-dev)
ddiloco_component(safetensors ddilocoSafetensorsTargets nlohmann_json::nlohmann_json nlohmann-json3-dev)
