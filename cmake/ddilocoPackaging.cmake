# CPack: `cpack -G DEB` in a build directory makes ddiloco_<version>_<arch>.deb
# from what `cmake --install` installs (headers, CMake package, pkg-config
# files, programs, model lists), under /usr. docs/install.md shows the steps.
set(DDILOCO_PACKAGE_MAINTAINER "ddiloco maintainers <maintainers@ddiloco.invalid>" CACHE STRING
    "Maintainer field of the .deb: set it to yourself (Name <email>) when you distribute the package")

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME ddiloco)
set(CPACK_PACKAGE_VENDOR "ddiloco")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
string(CONCAT CPACK_PACKAGE_DESCRIPTION
  "Header-only C++20 library and programs for Decoupled DiLoCo: learners stream parameter fragments "
  "to one CPU-only syncer without waiting; the syncer merges once a minimum quorum has arrived (with "
  "an adaptive grace window), by token-weighted radial-directional averaging and an outer Nesterov "
  "step. Contains the headers, the CMake package (find_package(ddiloco)), pkg-config files (ddiloco, "
  "ddiloco-zmq) and the programs ddiloco_syncer, ddiloco_learner, ddiloco_keygen, ddiloco_export and "
  "ddiloco_sim.")
set(CPACK_PACKAGE_CONTACT "${DDILOCO_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${DDILOCO_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_STRIP_FILES ON)

# Depends: the shared libraries the programs link (libzmq5, libstdc++6, libc6,
# ...), computed by dpkg-shlibdeps from the binaries themselves (without it, on
# a system that is not Debian, the list is written out), and the text
# ddiloco_learner trains on (fortunes).
find_program(DDILOCO_DPKG_SHLIBDEPS dpkg-shlibdeps)
if(DDILOCO_DPKG_SHLIBDEPS)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
  set(CPACK_DEBIAN_PACKAGE_DEPENDS "fortunes")
else()
  set(CPACK_DEBIAN_PACKAGE_DEPENDS "libzmq5, libstdc++6, libgcc-s1, libc6, fortunes")
endif()
# What the headers' optional parts need to compile against: libzmq's development
# files for the ZeroMQ transport, Eigen for the Eigen adapter and the reference
# model, xtensor for its adapter.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "libzmq3-dev, libeigen3-dev, pkgconf")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "xtensor-dev, cmake")

# The Python package is not in the .deb: Debian's interpreter looks for
# packages under dist-packages paths a prefix-relative install cannot name for
# both /usr and /usr/local. It installs on its own with
# `cmake --install <build> --component python` (docs/python.md).
get_cmake_property(ddiloco_components COMPONENTS)
list(REMOVE_ITEM ddiloco_components python)
set(CPACK_COMPONENTS_ALL ${ddiloco_components})

include(CPack)
