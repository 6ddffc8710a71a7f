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

# The optional third-party integrations (Eigen, xtensor, libzmq) are found in
# ddilocoDependencies.cmake, for consumers too.

# DDILOCO_WITH_TORCH (the libtorch adapter tests and the torch_gpt example):
# on by default when libtorch is found, except under Clang: Debian 12's
# libtorch headers do not compile with Clang 14 in C++20 (ATen/core/ivalue_inl.h
# uses std::vector<c10::IValue> while IValue is still incomplete; GCC accepts
# it), so a Clang build leaves them out unless DDILOCO_WITH_TORCH=ON is given.
macro(ddiloco_torch_option)
  if(NOT DEFINED DDILOCO_WITH_TORCH)
    if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
      set(ddiloco_torch_default OFF)
      message(STATUS "ddiloco: Clang: the libtorch parts are off (Debian's libtorch headers need GCC in C++20)")
    else()
      find_package(Torch QUIET)
      set(ddiloco_torch_default ${Torch_FOUND})
    endif()
    option(DDILOCO_WITH_TORCH "Build the libtorch adapter tests and the torch_gpt example" ${ddiloco_torch_default})
  endif()
endmacro()
