// ddiloco/detail/checksum.hpp: CRC-32C (Castagnoli) written out in full.
//
// What it is: the checksum of wire frames (header and payload). CRC-32C is the
// CRC of iSCSI (RFC 3720 appendix B.4), ext4 and SCTP: the reflected polynomial
// 0x82F63B78 (0x1EDC6F41 bit-reversed), initial value 0xFFFFFFFF, final XOR
// 0xFFFFFFFF. Check value: crc32c("123456789") = 0xE3069283. It detects every
// burst error of up to 32 bits and every error of odd weight.
// What it is not: a cryptographic MAC. It catches corruption, not forgery
// (CURVE in the transport handles that).
//
// Three implementations that must agree bit for bit: a portable slicing-by-8
// table walk (8 lookups per 8 bytes, tables built at compile time); on x86-64
// the SSE4.2 `crc32` instruction in three chains; and, where the CPU has
// AVX-512 and VPCLMULQDQ, carry-less folding of 256 bytes per step, about 2.5x
// the crc32 chains in cache (docs/performance.md, "The payload checksum").
// crc32c_update picks the fastest the CPU runs, once.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <nmmintrin.h>
#define DDILOCO_CRC32C_HW 1
#endif

namespace ddiloco::detail {

inline constexpr std::uint32_t kCrc32cPoly = 0x82F63B78U;  // reflected Castagnoli polynomial

/// tables[0][b] = CRC of the single byte b (no init/final XOR); tables[k][b] =
/// the CRC of b followed by k zero bytes, so 8 bytes fold in with 8 lookups.
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_crc32c_tables() noexcept {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int k = 0; k < 8; ++k) c = (c & 1U) != 0 ? (c >> 1) ^ kCrc32cPoly : c >> 1;
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFU];
  }
  return t;
}

inline constexpr auto kCrc32cTables = make_crc32c_tables();

/// Portable update of a raw (pre-inverted) CRC state over `data`.
inline std::uint32_t crc32c_update_portable(std::uint32_t crc, std::span<const std::byte> data) noexcept {
  const auto& t = kCrc32cTables;
  std::size_t i = 0;
  const std::size_t n = data.size();
  auto at = [&](std::size_t k) { return std::to_integer<std::uint32_t>(data[k]); };
  auto le32 = [&](std::size_t k) {
    std::uint32_t v = 0;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(&v, data.data() + k, 4);
    } else {
      v = at(k) | (at(k + 1) << 8) | (at(k + 2) << 16) | (at(k + 3) << 24);
    }
    return v;
  };
  for (; i + 8 <= n; i += 8) {
    const std::uint32_t lo = crc ^ le32(i);
    const std::uint32_t hi = le32(i + 4);
    crc = t[7][lo & 0xFFU] ^ t[6][(lo >> 8) & 0xFFU] ^ t[5][(lo >> 16) & 0xFFU] ^ t[4][lo >> 24] ^
          t[3][hi & 0xFFU] ^ t[2][(hi >> 8) & 0xFFU] ^ t[1][(hi >> 16) & 0xFFU] ^ t[0][hi >> 24];
  }
  for (; i < n; ++i) crc = (crc >> 8) ^ t[0][(crc ^ at(i)) & 0xFFU];
  return crc;
}

/// a * b modulo the CRC polynomial, both in the reflected representation (bit
/// 31 is x^0): the GF(2) product that shifts CRC states (see crc32c_shift).
constexpr std::uint32_t crc32c_multiply(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t product = 0;
  for (std::uint32_t m = 1U << 31; m != 0; m >>= 1) {
    if ((a & m) != 0) product ^= b;
    b = (b & 1U) != 0 ? (b >> 1) ^ kCrc32cPoly : b >> 1;  // b * x
  }
  return product;
}

/// x^k modulo the polynomial (reflected, bit 31 = x^0), for any bit count k.
constexpr std::uint32_t crc32c_xpow(std::size_t k) noexcept {
  std::uint32_t power = 1U << 31;   // x^0
  std::uint32_t square = 1U << 30;  // x^1
  for (; k != 0; k >>= 1) {         // power *= x^k by squaring
    if ((k & 1U) != 0) power = crc32c_multiply(power, square);
    square = crc32c_multiply(square, square);
  }
  return power;
}

/// x^(8 n) modulo the polynomial (reflected): the state 1 (= x^0, bit 31) after
/// n zero bytes, so that crc32c_multiply(crc32c_x8n(n), s) is the raw state s
/// followed by n zero bytes. The raw update is linear in the state:
/// update(s, A || B) = shift(update(s, A), |B|) ^ update(0, B).
constexpr std::uint32_t crc32c_x8n(std::size_t n) noexcept { return crc32c_xpow(8 * n); }

/// Carry-less folding with AVX-512 VPCLMULQDQ (4 x 128-bit products per
/// instruction), for CPUs that have it; same result as crc32c_update_hw.
///
/// The maths. Read a 16-byte block as a polynomial the way the reflected CRC
/// reads bytes: bit k of the little-endian 128-bit value is the coefficient of
/// x^(127-k), so the block is L x^64 + H with L its first 8 bytes and H its last
/// 8, each a 64-bit reflected polynomial. The CRC depends on the message only
/// through (message polynomial) mod P, so a block may be replaced by any
/// polynomial congruent to it moved D bits later: L x^(D+64) + H x^D, reduced
/// as L (x^(D+64) mod P) + H (x^D mod P), degree below 96, fits a block. The
/// carry-less product of two reflected 64-bit values is their polynomial product
/// times x (bit k holds x^(126-k), the block's bit k is x^(127-k)), hence the
/// constants x^(D+63) and x^(D-1) mod P, each a 32-bit reflected value placed in
/// the top half of its 64-bit lane (bit 63-d holds x^d). The state enters as
/// the first four bytes' XOR (update(s, M) = update(0, M with s XORed into its
/// first 4 bytes)), and the last block, with every earlier one folded into it,
/// is finished by the crc32 instruction from state 0: the earlier bytes are now
/// zero and leave state 0 unchanged.
namespace crc32c_fold {
/// The 128-bit lane of constants that moves a block D bits later.
constexpr std::uint64_t lo_constant(std::size_t d) noexcept {
  return std::uint64_t{crc32c_xpow(d + 63)} << 32;
}
constexpr std::uint64_t hi_constant(std::size_t d) noexcept {
  return std::uint64_t{crc32c_xpow(d - 1)} << 32;
}
}  // namespace crc32c_fold

#ifdef DDILOCO_CRC32C_HW
/// SSE4.2 update of a raw CRC state (same result as the portable one). The
/// crc32 instruction takes 3 cycles and can start one per cycle, so one chain
/// runs at a third of the possible rate: blocks of 3 x kLane bytes are run as
/// three independent chains (the last two from state 0) and joined with
/// update(s, A || B || C) = shift(a, 2 kLane) ^ shift(b, kLane) ^ c.
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_update_hw(std::uint32_t crc,
                                                                        std::span<const std::byte> data) noexcept {
  constexpr std::size_t kLane = 4096;
  constexpr std::uint32_t kShift1 = crc32c_x8n(kLane), kShift2 = crc32c_x8n(2 * kLane);
  const std::byte* p = data.data();
  std::size_t n = data.size();
  for (; n >= 3 * kLane; n -= 3 * kLane, p += 3 * kLane) {
    std::uint64_t a = crc, b = 0, c = 0;
    for (std::size_t i = 0; i < kLane; i += 8) {
      std::uint64_t wa = 0, wb = 0, wc = 0;
      std::memcpy(&wa, p + i, 8);
      std::memcpy(&wb, p + kLane + i, 8);
      std::memcpy(&wc, p + 2 * kLane + i, 8);
      a = _mm_crc32_u64(a, wa);
      b = _mm_crc32_u64(b, wb);
      c = _mm_crc32_u64(c, wc);
    }
    crc = crc32c_multiply(kShift2, static_cast<std::uint32_t>(a)) ^
          crc32c_multiply(kShift1, static_cast<std::uint32_t>(b)) ^ static_cast<std::uint32_t>(c);
  }
  std::uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t w = 0;
    std::memcpy(&w, p, 8);  // x86-64 is little-endian: the bytes in stream order
    c = _mm_crc32_u64(c, w);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, std::to_integer<std::uint8_t>(*p));
  return c32;
}

inline bool crc32c_hw_available() noexcept {
  static const bool available = __builtin_cpu_supports("sse4.2") != 0;
  return available;
}

#define DDILOCO_CRC32C_FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))
namespace crc32c_fold {
/// A constant pair (lo, hi) in each of the four 128-bit lanes.
DDILOCO_CRC32C_FOLD_TARGET inline __m512i lanes(std::uint64_t lo, std::uint64_t hi) noexcept {
  return _mm512_set_epi64(static_cast<long long>(hi), static_cast<long long>(lo), static_cast<long long>(hi),
                          static_cast<long long>(lo), static_cast<long long>(hi), static_cast<long long>(lo),
                          static_cast<long long>(hi), static_cast<long long>(lo));
}
/// Every 128-bit block of x moved by k's distance, XORed onto y.
DDILOCO_CRC32C_FOLD_TARGET inline __m512i fold(__m512i x, __m512i k, __m512i y) noexcept {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), y,
                                   0x96);
}
}  // namespace crc32c_fold

DDILOCO_CRC32C_FOLD_TARGET inline std::uint32_t crc32c_update_vpclmul(std::uint32_t crc,
                                                                      std::span<const std::byte> data) noexcept {
  using namespace crc32c_fold;
  constexpr std::size_t kStride = 256;  // four 64-byte accumulators
  const std::byte* p = data.data();
  std::size_t n = data.size();
  if (n < 2 * kStride) return crc32c_update_hw(crc, data);
  constexpr std::uint64_t kStrideLo = lo_constant(8 * kStride), kStrideHi = hi_constant(8 * kStride);
  constexpr std::uint64_t k64Lo = lo_constant(8 * 64), k64Hi = hi_constant(8 * 64);
  constexpr std::uint64_t k48Lo = lo_constant(8 * 48), k48Hi = hi_constant(8 * 48);
  constexpr std::uint64_t k32Lo = lo_constant(8 * 32), k32Hi = hi_constant(8 * 32);
  constexpr std::uint64_t k16Lo = lo_constant(8 * 16), k16Hi = hi_constant(8 * 16);
  const __m512i k_stride = lanes(kStrideLo, kStrideHi), k_64 = lanes(k64Lo, k64Hi);
  __m512i x0 = _mm512_loadu_si512(p), x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
  x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  p += kStride;
  n -= kStride;
  for (; n >= kStride; n -= kStride, p += kStride) {
    x0 = fold(x0, k_stride, _mm512_loadu_si512(p));
    x1 = fold(x1, k_stride, _mm512_loadu_si512(p + 64));
    x2 = fold(x2, k_stride, _mm512_loadu_si512(p + 128));
    x3 = fold(x3, k_stride, _mm512_loadu_si512(p + 192));
  }
  x1 = fold(x0, k_64, x1);
  x2 = fold(x1, k_64, x2);
  x3 = fold(x2, k_64, x3);
  for (; n >= 64; n -= 64, p += 64) x3 = fold(x3, k_64, _mm512_loadu_si512(p));
  // The four blocks of x3 onto its last one: moved by 48, 32, 16 and 0 bytes.
  const __m512i k_tail = _mm512_set_epi64(0, 0, static_cast<long long>(k16Hi), static_cast<long long>(k16Lo),
                                          static_cast<long long>(k32Hi), static_cast<long long>(k32Lo),
                                          static_cast<long long>(k48Hi), static_cast<long long>(k48Lo));
  const __m512i moved = _mm512_xor_si512(_mm512_clmulepi64_epi128(x3, k_tail, 0x00),
                                         _mm512_clmulepi64_epi128(x3, k_tail, 0x11));
  std::uint64_t m[8], x[8];  // NOLINT: the lanes, to XOR as scalars
  _mm512_storeu_si512(m, moved);
  _mm512_storeu_si512(x, x3);
  std::uint64_t c = _mm_crc32_u64(0, m[0] ^ m[2] ^ m[4] ^ x[6]);  // the last block's first 8 bytes
  c = _mm_crc32_u64(c, m[1] ^ m[3] ^ m[5] ^ x[7]);                 // and its last 8
  return crc32c_update_hw(static_cast<std::uint32_t>(c), std::span<const std::byte>(p, n));
}

inline bool crc32c_vpclmul_available() noexcept {
  static const bool available = __builtin_cpu_supports("avx512f") != 0 &&
                                __builtin_cpu_supports("vpclmulqdq") != 0 && __builtin_cpu_supports("sse4.2") != 0;
  return available;
}
#undef DDILOCO_CRC32C_FOLD_TARGET
#endif

/// Raw state update: start from 0xFFFFFFFF, feed chunks, XOR with 0xFFFFFFFF at the end.
inline std::uint32_t crc32c_update(std::uint32_t crc, std::span<const std::byte> data) noexcept {
#ifdef DDILOCO_CRC32C_HW
  if (crc32c_vpclmul_available()) return crc32c_update_vpclmul(crc, data);
  if (crc32c_hw_available()) return crc32c_update_hw(crc, data);
#endif
  return crc32c_update_portable(crc, data);
}

/// CRC-32C of `data`.
inline std::uint32_t crc32c(std::span<const std::byte> data) noexcept {
  return crc32c_update(0xFFFFFFFFU, data) ^ 0xFFFFFFFFU;
}

}  // namespace ddiloco::detail
