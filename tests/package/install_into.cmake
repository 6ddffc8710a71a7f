# cmake -DBUILD_DIR=<build> -DPREFIX=<prefix> -P install_into.cmake
# A fresh install: PREFIX is emptied first, so no file from an earlier install
# can stand in for one that is no longer installed.
if(NOT BUILD_DIR OR NOT PREFIX)
  message(FATAL_ERROR "usage: cmake -DBUILD_DIR=<build dir> -DPREFIX=<empty prefix> -P install_into.cmake")
endif()
file(REMOVE_RECURSE "${PREFIX}")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed (${rc})")
endif()
