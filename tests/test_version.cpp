// Tests for <ddiloco/version.hpp>: the macros, the constexpr value and the
// CMake project version agree (CMake reads the header; this checks the read).
#include <ddiloco/version.hpp>

#include <catch2/catch.hpp>

#include <string>

#ifndef DDILOCO_PROJECT_VERSION
#error "tests/CMakeLists.txt passes DDILOCO_PROJECT_VERSION (the CMake project version) to this test"
#endif

static_assert(ddiloco::version.major == DDILOCO_VERSION_MAJOR);
static_assert(ddiloco::version.minor == DDILOCO_VERSION_MINOR);
static_assert(ddiloco::version.patch == DDILOCO_VERSION_PATCH);
static_assert(DDILOCO_VERSION == DDILOCO_VERSION_MAJOR * 10000 + DDILOCO_VERSION_MINOR * 100 + DDILOCO_VERSION_PATCH);

TEST_CASE("The version header says the CMake project version", "[version]") {
  CHECK(std::string(DDILOCO_VERSION_STRING) == DDILOCO_PROJECT_VERSION);
  CHECK(ddiloco::version.string == DDILOCO_PROJECT_VERSION);
  const std::string parts = std::to_string(DDILOCO_VERSION_MAJOR) + "." + std::to_string(DDILOCO_VERSION_MINOR) +
                            "." + std::to_string(DDILOCO_VERSION_PATCH);
  CHECK(parts == DDILOCO_PROJECT_VERSION);
}

TEST_CASE("Versions compare by major, then minor, then patch", "[version]") {
  using ddiloco::Version;
  STATIC_REQUIRE(Version{0, 2, 0} > Version{0, 1, 9});
  STATIC_REQUIRE(Version{1, 0, 0} > Version{0, 99, 99});
  STATIC_REQUIRE(Version{0, 1, 1} > Version{0, 1, 0});
  STATIC_REQUIRE(Version{0, 1, 0, "x"} == Version{0, 1, 0, "y"});  // the string is not compared
  CHECK(ddiloco::version >= Version{0, 1, 0});
}
