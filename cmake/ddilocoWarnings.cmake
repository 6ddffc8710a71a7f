# Settings for ddiloco's *own* targets (tests, examples, benchmarks): strict
# warnings as errors and optional sanitizers. Never applied to consumers.
function(ddiloco_own_target target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion -Werror)
  if(DDILOCO_SANITIZE)
    # GCC 12 reports false -Wmaybe-uninitialized inside libstdc++ (<regex>,
    # std::function, std::optional) once sanitizers instrument the code.
    target_compile_options(${target} PRIVATE -fsanitize=${DDILOCO_SANITIZE} -fno-omit-frame-pointer
                           -fno-sanitize-recover=all -Wno-maybe-uninitialized)
    target_link_options(${target} PRIVATE -fsanitize=${DDILOCO_SANITIZE})
  endif()
endfunction()

# Optional third-party integrations, found once for all our own targets.
find_package(Eigen3 3.3 CONFIG QUIET)
find_package(xtensor CONFIG QUIET)

# ZeroMQ (libzmq3-dev) for the network transport, found through pkg-config.
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(DDILOCO_ZMQ QUIET IMPORTED_TARGET libzmq)
endif()
