// ddiloco/version.hpp: the library's version, for code and for the build.
//
// What it is: the one place the version number is written. The top-level
// CMakeLists.txt reads the three DDILOCO_VERSION_* lines below to set
// project(VERSION), so the CMake package (ddilocoConfigVersion.cmake), the
// pkg-config files, the .deb and every program's `--version` all report this
// number; tests/test_version.cpp checks that they agree.
// What it is not: a promise of ABI stability. ddiloco is header-only; a
// change of MINOR may change the wire or checkpoint format (both carry their
// own format version, checked on read).
//
//   #include <ddiloco/version.hpp>
//   static_assert(ddiloco::version.major == 0);
//   std::cout << "ddiloco " << ddiloco::version.string << '\n';   // "ddiloco 0.1.0"
#pragma once

#include <compare>
#include <string_view>

#define DDILOCO_VERSION_MAJOR 0
#define DDILOCO_VERSION_MINOR 1
#define DDILOCO_VERSION_PATCH 0

#define DDILOCO_DETAIL_STRINGIFY2(x) #x
#define DDILOCO_DETAIL_STRINGIFY(x) DDILOCO_DETAIL_STRINGIFY2(x)
/// "MAJOR.MINOR.PATCH", a string literal.
#define DDILOCO_VERSION_STRING                                                 \
  DDILOCO_DETAIL_STRINGIFY(DDILOCO_VERSION_MAJOR)                              \
  "." DDILOCO_DETAIL_STRINGIFY(DDILOCO_VERSION_MINOR) "." DDILOCO_DETAIL_STRINGIFY(DDILOCO_VERSION_PATCH)
/// MAJOR * 10000 + MINOR * 100 + PATCH, for `#if DDILOCO_VERSION >= 100` (0.1.0).
#define DDILOCO_VERSION (DDILOCO_VERSION_MAJOR * 10000 + DDILOCO_VERSION_MINOR * 100 + DDILOCO_VERSION_PATCH)

namespace ddiloco {

/// The version as values: compare with `ddiloco::version >= Version{0, 2, 0}`.
struct Version {
  int major = 0;
  int minor = 0;
  int patch = 0;
  std::string_view string{};

  friend constexpr bool operator==(const Version& a, const Version& b) {
    return a.major == b.major && a.minor == b.minor && a.patch == b.patch;
  }
  friend constexpr auto operator<=>(const Version& a, const Version& b) {
    if (a.major != b.major) return a.major <=> b.major;
    if (a.minor != b.minor) return a.minor <=> b.minor;
    return a.patch <=> b.patch;
  }
};

/// This library's version (the string field is DDILOCO_VERSION_STRING).
inline constexpr Version version{DDILOCO_VERSION_MAJOR, DDILOCO_VERSION_MINOR, DDILOCO_VERSION_PATCH,
                                 DDILOCO_VERSION_STRING};

}  // namespace ddiloco
