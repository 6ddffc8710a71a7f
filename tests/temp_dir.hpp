// tests/temp_dir.hpp: a fresh, unique directory for one test, removed with
// everything in it at scope exit (shared by the tests that write files).
#pragma once

#include <atomic>
#include <cstddef>
#include <filesystem>
#include <iterator>
#include <random>
#include <string>
#include <system_error>

#include <unistd.h>

namespace ddiloco::test {

struct TempDir {
  std::filesystem::path path;
  /// `tag` names the test in the folder's name (ddiloco-test-<tag>-<pid>-<n>-<random>).
  explicit TempDir(const std::string& tag) {
    static std::atomic<unsigned> counter{0};
    std::random_device rd;
    path = std::filesystem::temp_directory_path() / ("ddiloco-test-" + tag + "-" + std::to_string(::getpid()) + "-" +
                                                     std::to_string(counter++) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  /// Number of entries directly in the folder.
  [[nodiscard]] std::size_t entries() const {
    return static_cast<std::size_t>(
        std::distance(std::filesystem::directory_iterator(path), std::filesystem::directory_iterator()));
  }
};

}  // namespace ddiloco::test
