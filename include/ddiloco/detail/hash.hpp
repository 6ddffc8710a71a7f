// ddiloco/detail/hash.hpp: a 64-bit FNV-1a hash written out in full.
//
// What it is: the hash behind `Plan::fingerprint()`, which every process of a
// run (learners and syncer, on any platform) must compute to the same value.
// So nothing here depends on the platform: integers are fed least significant
// byte first, whatever the machine's byte order or `std::size_t` width, and
// strings are fed as their length followed by their bytes (so that "ab"+"c"
// and "a"+"bc" differ).
// What it is not: a cryptographic hash, nor a hash for hash tables under
// adversarial input.
//
// FNV-1a (Fowler, Noll, Vo), 64-bit variant: start from the offset basis
// 14695981039346656037 and, for each byte b, h = (h XOR b) * 1099511628211
// (mod 2^64).
#pragma once

#include <cstdint>
#include <string_view>

namespace ddiloco::detail {

class Fnv1a64 {
 public:
  static constexpr std::uint64_t offset_basis = 14695981039346656037ULL;
  static constexpr std::uint64_t prime = 1099511628211ULL;

  constexpr Fnv1a64& byte(std::uint8_t b) noexcept {
    h_ ^= b;
    h_ *= prime;
    return *this;
  }
  /// Raw bytes, no length prefix (use `str` for strings that sit next to others).
  constexpr Fnv1a64& bytes(std::string_view s) noexcept {
    for (char c : s) byte(static_cast<std::uint8_t>(c));
    return *this;
  }
  /// An unsigned integer as 8 bytes, least significant first.
  constexpr Fnv1a64& u64(std::uint64_t v) noexcept {
    for (int i = 0; i < 8; ++i) byte(static_cast<std::uint8_t>((v >> (8 * i)) & 0xFFU));
    return *this;
  }
  /// A string as its length (u64) followed by its bytes.
  constexpr Fnv1a64& str(std::string_view s) noexcept {
    u64(s.size());
    return bytes(s);
  }
  [[nodiscard]] constexpr std::uint64_t value() const noexcept { return h_; }

 private:
  std::uint64_t h_ = offset_basis;
};

/// FNV-1a of raw bytes, e.g. `fnv1a64("a") == 0xaf63dc4c8601ec8c`.
constexpr std::uint64_t fnv1a64(std::string_view s) noexcept { return Fnv1a64{}.bytes(s).value(); }

}  // namespace ddiloco::detail
