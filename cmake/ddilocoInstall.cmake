# What `cmake --install` puts under the prefix (docs/install.md lists it):
#   include/ddiloco/...                      every header, reference/ included
#   lib/cmake/ddiloco/                       the CMake package: find_package(ddiloco [COMPONENTS ...])
#   share/pkgconfig/ddiloco.pc, ddiloco-zmq.pc
#   bin/ddiloco_*, share/ddiloco/models/     the programs and ddiloco_sim's model lists (programs/)
set(DDILOCO_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/ddiloco)

install(TARGETS ddiloco EXPORT ddilocoTargets)
install(DIRECTORY include/ddiloco DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(set IN ITEMS ddilocoTargets ddilocoZmqTargets ddilocoEigenTargets ddilocoXtensorTargets
                    ddilocoPrometheusTargets ddilocoSafetensorsTargets)
  install(EXPORT ${set} NAMESPACE ddiloco:: DESTINATION ${DDILOCO_CMAKE_DIR})
endforeach()
configure_package_config_file(cmake/ddilocoConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/ddilocoConfig.cmake
  INSTALL_DESTINATION ${DDILOCO_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/ddilocoConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/ddilocoConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/ddilocoConfigVersion.cmake
        DESTINATION ${DDILOCO_CMAKE_DIR})

# pkg-config files. They are written at install time, with the prefix the
# install really uses (`cmake --install --prefix P`, or /usr inside the .deb),
# because a relocatable `${pcfiledir}/../..` prefix would print
# `-I/usr/share/pkgconfig/../../include` for a system install: a spelling of
# /usr/include that pkg-config does not filter, and that breaks GCC's
# `#include_next` in <cstdlib>. ddiloco is header-only, so they go to the
# architecture-independent share/pkgconfig.
set(DDILOCO_PC_DIR ${CMAKE_INSTALL_DATADIR}/pkgconfig)
install(CODE "
  set(ddiloco_pc_prefix \"\${CMAKE_INSTALL_PREFIX}\")
  set(ddiloco_pc_includedir \"${CMAKE_INSTALL_INCLUDEDIR}\")
  if(NOT IS_ABSOLUTE \"\${ddiloco_pc_includedir}\")
    set(ddiloco_pc_includedir \"\\\${prefix}/\${ddiloco_pc_includedir}\")
  endif()
  set(ddiloco_pc_dir \"${DDILOCO_PC_DIR}\")
  if(NOT IS_ABSOLUTE \"\${ddiloco_pc_dir}\")
    set(ddiloco_pc_dir \"\${CMAKE_INSTALL_PREFIX}/\${ddiloco_pc_dir}\")
  endif()
  set(PROJECT_VERSION \"${PROJECT_VERSION}\")
  set(PROJECT_DESCRIPTION \"${PROJECT_DESCRIPTION}\")
  foreach(pc IN ITEMS ddiloco ddiloco-zmq)
    configure_file(\"${PROJECT_SOURCE_DIR}/cmake/\${pc}.pc.in\" \"\$ENV{DESTDIR}\${ddiloco_pc_dir}/\${pc}.pc\" @ONLY)
    list(APPEND CMAKE_INSTALL_MANIFEST_FILES \"\${ddiloco_pc_dir}/\${pc}.pc\")
    message(STATUS \"Installing: \$ENV{DESTDIR}\${ddiloco_pc_dir}/\${pc}.pc\")
  endforeach()
")
