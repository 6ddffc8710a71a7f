// ddiloco/fast/kernels.hpp: the syncer's and learner's hot loops, written to run
// at memory bandwidth.
//
// What it is: fused single-pass span kernels (squared norm; running-mean update
// that also returns the squared norm of the new mean; scaled Nesterov step),
// chunked codec decoders (fp32/bf16/fp16/int8/int4 into a small cache-resident
// buffer) and the learner's fused "outer gradient + encode". Every float loop is
// written for the compiler's auto-vectoriser (the int8/int4 block kernels, which
// it does not vectorise, use SSE2/AVX2 intrinsics; see "whole quantisation blocks"): fixed-width inner loops over
// kLanes independent accumulators (a reduction into one scalar is bound by the
// add latency, about 4 cycles per element; 16 independent lanes are not), no
// branches inside the lanes, __restrict__ pointers. The hot kernels are built
// twice, for baseline x86-64 (SSE2) and for AVX2, and picked at run time (see
// "run-time dispatch" below); both builds give bit-identical results.
// What it is not: the specification. The readable reference loops are
// <ddiloco/detail/kernels.hpp>, <ddiloco/codec.hpp> and the NesterovSGD loop of
// <ddiloco/outer_optimizer.hpp>; tests/test_fast_kernels.cpp checks every kernel
// here against them. Callers check sizes; these kernels assume them.
//
// Precision (stated tolerances of the tests): the reductions sum squares in fp32
// over blocks of kNormBlock elements (each of the kLanes lanes adds
// kNormBlock / kLanes = 16 terms, relative error <= 16 * 2^-24 ~ 1e-6) and add
// the blocks in double, so a 2^24-element norm stays within ~1e-6 relative of the
// reference's all-double sum. Element-wise results (mean update, decode, Nesterov)
// use the same fp32 operations in the same order as the reference: identical
// unless the compiler contracts a*b+c into an FMA (not on baseline x86-64).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>

#include <ddiloco/codec.hpp>
#include <ddiloco/detail/checksum.hpp>

#if defined(__SSE2__) || ((defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__))
#include <immintrin.h>
#endif

namespace ddiloco::fast {

/// Independent accumulators per reduction (one 512-bit or four 128-bit vectors).
inline constexpr std::size_t kLanes = 16;
/// Elements summed in fp32 before the partial sum is added in double.
inline constexpr std::size_t kNormBlock = 256;
/// Elements decoded at a time into a cache-resident buffer (16 KiB of fp32,
/// well inside a 48 KiB L1d); a multiple of kQuantBlock so chunks hold whole
/// quantisation blocks.
inline constexpr std::size_t kChunk = 4096;
static_assert(kChunk % kQuantBlock == 0 && kNormBlock % kLanes == 0);

namespace detail {
inline double lane_sum(const float (&acc)[kLanes]) noexcept {
  double s = 0.0;
  for (const float a : acc) s += static_cast<double>(a);
  return s;
}
}  // namespace detail

namespace detail {

/// sum_i x_i^2 (reference: ddiloco::detail::squared_norm).
[[gnu::always_inline]] inline double squared_norm_base(const float* __restrict__ x, std::size_t n) noexcept {
  double total = 0.0;
  const std::size_t full = n - n % kNormBlock;
  for (std::size_t i = 0; i < full; i += kNormBlock) {
    float acc[kLanes] = {};
    for (std::size_t k = 0; k < kNormBlock; k += kLanes) {
      for (std::size_t j = 0; j < kLanes; ++j) acc[j] += x[i + k + j] * x[i + k + j];
    }
    total += detail::lane_sum(acc);
  }
  for (std::size_t i = full; i < n; ++i) total += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return total;
}

/// mean_i += f * (s * x_i - mean_i) (reference: ddiloco::detail::running_mean_update)
/// and returns sum_i mean_i^2 of the updated mean, in the same pass.
[[gnu::always_inline]] inline double running_mean_update_sq_base(float f, float s, const float* __restrict__ x,
                                     float* __restrict__ mean, std::size_t n) noexcept {
  double total = 0.0;
  std::size_t i = 0;
  for (; i + kNormBlock <= n; i += kNormBlock) {
    float acc[kLanes] = {};
    for (std::size_t k = 0; k < kNormBlock; k += kLanes) {
      for (std::size_t j = 0; j < kLanes; ++j) {
        const float m = mean[i + k + j] + f * (s * x[i + k + j] - mean[i + k + j]);
        mean[i + k + j] = m;
        acc[j] += m * m;
      }
    }
    total += detail::lane_sum(acc);
  }
  for (; i < n; ++i) {
    const float m = mean[i] + f * (s * x[i] - mean[i]);
    mean[i] = m;
    total += static_cast<double>(m) * static_cast<double>(m);
  }
  return total;
}

/// mean_i = s * x_i (reference: ddiloco::detail::scale_copy) and returns sum_i mean_i^2.
[[gnu::always_inline]] inline double scale_copy_sq_base(float s, const float* __restrict__ x, float* __restrict__ mean,
                            std::size_t n) noexcept {
  double total = 0.0;
  std::size_t i = 0;
  for (; i + kNormBlock <= n; i += kNormBlock) {
    float acc[kLanes] = {};
    for (std::size_t k = 0; k < kNormBlock; k += kLanes) {
      for (std::size_t j = 0; j < kLanes; ++j) {
        const float m = s * x[i + k + j];
        mean[i + k + j] = m;
        acc[j] += m * m;
      }
    }
    total += detail::lane_sum(acc);
  }
  for (; i < n; ++i) {
    const float m = s * x[i];
    mean[i] = m;
    total += static_cast<double>(m) * static_cast<double>(m);
  }
  return total;
}

/// The merge's last step fused with the outer optimizer, one pass
/// (docs/algorithm.md, "Fast kernels"; reference: RDA finish, the syncer's
/// participation scaling, NesterovSGD::step):
///     Delta_i = (c * mean_i) * share
///     b_i     <- mu * b_i + Delta_i
///     Theta_i <- Theta_i - eta * (Delta_i + mu * b_i)
[[gnu::always_inline]] inline void scaled_nesterov_base(float c, float share, const float* __restrict__ mean, float mu, float eta,
                            float* __restrict__ theta, float* __restrict__ b, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float d = (c * mean[i]) * share;
    const float bi = mu * b[i] + d;
    b[i] = bi;
    theta[i] -= eta * (d + mu * bi);
  }
}

/// The batched merge's element loops (fast::RadialDirectional::add_batch,
/// docs/algorithm.md, "Fast kernels"): a chunk of the new mean is built in an L1-resident
/// buffer `acc` as  acc = a_0 mean + sum_b a_b x_b,  then stored:
///     scale_into     acc_i  = a * x_i
///     axpy           acc_i += a * x_i
///     axpy_store_sq  mean_i = acc_i + a * x_i, returns sum_i mean_i^2
/// (reference: the same sum written out in tests/test_fast_kernels.cpp).
[[gnu::always_inline]] inline void scale_into_base(float a, const float* __restrict__ x, float* __restrict__ out,
                                                   std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) out[i] = a * x[i];
}
[[gnu::always_inline]] inline void axpy_base(float a, const float* __restrict__ x, float* __restrict__ acc,
                                             std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) acc[i] += a * x[i];
}
[[gnu::always_inline]] inline double axpy_store_sq_base(float a, const float* __restrict__ x,
                                                        const float* __restrict__ acc, float* __restrict__ mean,
                                                        std::size_t n) noexcept {
  double total = 0.0;
  std::size_t i = 0;
  for (; i + kNormBlock <= n; i += kNormBlock) {
    float lanes[kLanes] = {};
    for (std::size_t k = 0; k < kNormBlock; k += kLanes) {
      for (std::size_t j = 0; j < kLanes; ++j) {
        const float m = acc[i + k + j] + a * x[i + k + j];
        mean[i + k + j] = m;
        lanes[j] += m * m;
      }
    }
    total += detail::lane_sum(lanes);
  }
  for (; i < n; ++i) {
    const float m = acc[i] + a * x[i];
    mean[i] = m;
    total += static_cast<double>(m) * static_cast<double>(m);
  }
  return total;
}

/// out_i = c * x_i (the non-fused finish).
inline void scale(float c, const float* __restrict__ x, float* __restrict__ out, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) out[i] = c * x[i];
}


// ---- whole quantisation blocks -------------------------------------------------
// The int8/int4 inner loops over one whole block of kQuantBlock codes: decode
// (o_j = q_j * s) and the integer sum_j q_j^2, each also returning nonzero when
// a code is the invalid -Q-1 (-128 / -8). Written with SSE2 intrinsics (part of
// baseline x86-64; scalar elsewhere) and AVX2 ones (the clones below): the
// interleaved nibbles and the byte-to-float widening defeat the auto-vectoriser.
// Same fp32 operations as the scalar reference loops (exact int -> float, one
// multiply), so all builds agree bit for bit. int4 layout: byte j holds codes
// 2j (low nibble) and 2j + 1 (high nibble), q = (nibble ^ 8) - 8.
static_assert(kQuantBlock == 64, "the block kernels below decode 64 codes per block");

#if defined(__SSE2__)
/// o[0..16) = (16 signed bytes of q, as floats) * s: sign-extend bytes -> 16 bit
/// -> 32 bit (duplicate, then shift right arithmetically), convert, multiply.
inline void store_scaled_i8x16(__m128i q, __m128 vs, float* o) noexcept {
  const __m128i w0 = _mm_srai_epi16(_mm_unpacklo_epi8(q, q), 8), w1 = _mm_srai_epi16(_mm_unpackhi_epi8(q, q), 8);
  _mm_storeu_ps(o, _mm_mul_ps(_mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpacklo_epi16(w0, w0), 16)), vs));
  _mm_storeu_ps(o + 4, _mm_mul_ps(_mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpackhi_epi16(w0, w0), 16)), vs));
  _mm_storeu_ps(o + 8, _mm_mul_ps(_mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpacklo_epi16(w1, w1), 16)), vs));
  _mm_storeu_ps(o + 12, _mm_mul_ps(_mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpackhi_epi16(w1, w1), 16)), vs));
}

/// The 32 int4 codes in the 16 bytes at c as two vectors of 16 signed bytes in
/// element order (q[0]: codes 0..15, q[1]: 16..31); sets the bytes of badv
/// where a code is the invalid -8. Shared by the SSE2 and AVX2 int4 decoders.
[[gnu::always_inline]] inline void unpack_int4x32(const unsigned char* c, __m128i& badv, __m128i (&q)[2]) noexcept {
  const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  badv = _mm_or_si128(badv, _mm_or_si128(_mm_cmpeq_epi8(lo, eight), _mm_cmpeq_epi8(hi, eight)));
  q[0] = _mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(lo, hi), eight), eight);
  q[1] = _mm_sub_epi8(_mm_xor_si128(_mm_unpackhi_epi8(lo, hi), eight), eight);
}
#endif

/// Decodes one whole int4 block (32 bytes at c) into o[0..64).
inline unsigned int4_block_decode(const unsigned char* c, float s, float* __restrict__ o) noexcept {
#if defined(__SSE2__)
  const __m128 vs = _mm_set1_ps(s);
  __m128i badv = _mm_setzero_si128();
  for (int h = 0; h < 2; ++h) {
    __m128i q[2];
    unpack_int4x32(c + 16 * h, badv, q);
    for (int k = 0; k < 2; ++k) store_scaled_i8x16(q[k], vs, o + 32 * h + 16 * k);
  }
  return static_cast<unsigned>(_mm_movemask_epi8(badv));
#else
  unsigned bad = 0;
  for (std::size_t j = 0; j < kQuantBlock / 2; ++j) {
    const unsigned lo4 = c[j] & 0xFU, hi4 = static_cast<unsigned>(c[j]) >> 4;
    bad |= (lo4 == 8U ? 1U : 0U) | (hi4 == 8U ? 1U : 0U);
    o[2 * j] = static_cast<float>(static_cast<int>(lo4 ^ 8U) - 8) * s;
    o[2 * j + 1] = static_cast<float>(static_cast<int>(hi4 ^ 8U) - 8) * s;
  }
  return bad;
#endif
}

/// Decodes one whole int8 block (64 bytes at c) into o[0..64).
inline unsigned int8_block_decode(const unsigned char* c, float s, float* __restrict__ o) noexcept {
#if defined(__SSE2__)
  const __m128i minus128 = _mm_set1_epi8(static_cast<char>(-128));
  const __m128 vs = _mm_set1_ps(s);
  __m128i badv = _mm_setzero_si128();
  for (int k = 0; k < 4; ++k) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * k));
    badv = _mm_or_si128(badv, _mm_cmpeq_epi8(q, minus128));
    store_scaled_i8x16(q, vs, o + 16 * k);
  }
  return static_cast<unsigned>(_mm_movemask_epi8(badv));
#else
  unsigned bad = 0;
  for (std::size_t j = 0; j < kQuantBlock; ++j) {
    bad |= c[j] == 0x80U ? 1U : 0U;
    o[j] = static_cast<float>(static_cast<signed char>(c[j])) * s;
  }
  return bad;
#endif
}

#if defined(__SSE2__)
/// The sum of acc's four 32-bit lanes (a block's sum of q^2); ors the byte
/// mask of badv (invalid codes found) into bad.
inline std::uint32_t block_sq_total(__m128i acc, __m128i badv, unsigned& bad) noexcept {
  acc = _mm_add_epi32(acc, _mm_shuffle_epi32(acc, 0x4E));
  acc = _mm_add_epi32(acc, _mm_shuffle_epi32(acc, 0xB1));
  bad |= static_cast<unsigned>(_mm_movemask_epi8(badv));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(acc));
}
#endif

/// sum_j q_j^2 of one whole int4 block; sets bad nonzero on a -8 code.
inline std::uint32_t int4_block_sq(const unsigned char* c, unsigned& bad) noexcept {
#if defined(__SSE2__)
  // In 16-bit lanes, no shuffles: each lane holds 4 nibbles u; v = u ^ 8 is
  // q + 8 in 0..15, extracted by shift and mask; q = v - 8; madd sums q^2 in pairs.
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x88)), low = _mm_set1_epi16(0x000F);
  const __m128i eight = _mm_set1_epi16(8), zero = _mm_setzero_si128();
  __m128i badv = zero, acc = zero;
  for (int h = 0; h < 2; ++h) {
    const __m128i v = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * h)), flip);
    const __m128i v0 = _mm_and_si128(v, low), v1 = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    const __m128i v2 = _mm_and_si128(_mm_srli_epi16(v, 8), low), v3 = _mm_srli_epi16(v, 12);
    badv = _mm_or_si128(badv, _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi16(v0, zero), _mm_cmpeq_epi16(v1, zero)),
                                           _mm_or_si128(_mm_cmpeq_epi16(v2, zero), _mm_cmpeq_epi16(v3, zero))));
    const __m128i q0 = _mm_sub_epi16(v0, eight), q1 = _mm_sub_epi16(v1, eight);
    const __m128i q2 = _mm_sub_epi16(v2, eight), q3 = _mm_sub_epi16(v3, eight);
    acc = _mm_add_epi32(acc, _mm_add_epi32(_mm_add_epi32(_mm_madd_epi16(q0, q0), _mm_madd_epi16(q1, q1)),
                                           _mm_add_epi32(_mm_madd_epi16(q2, q2), _mm_madd_epi16(q3, q3))));
  }
  return block_sq_total(acc, badv, bad);
#else
  std::uint32_t q2 = 0;
  for (std::size_t j = 0; j < kQuantBlock / 2; ++j) {
    const unsigned lo4 = c[j] & 0xFU, hi4 = static_cast<unsigned>(c[j]) >> 4;
    const int q0 = static_cast<int>(lo4 ^ 8U) - 8, q1 = static_cast<int>(hi4 ^ 8U) - 8;
    q2 += static_cast<std::uint32_t>(q0 * q0 + q1 * q1);
    bad |= (lo4 == 8U ? 1U : 0U) | (hi4 == 8U ? 1U : 0U);
  }
  return q2;
#endif
}

/// sum_j q_j^2 of one whole int8 block; sets bad nonzero on a -128 code.
inline std::uint32_t int8_block_sq(const unsigned char* c, unsigned& bad) noexcept {
#if defined(__SSE2__)
  const __m128i minus128 = _mm_set1_epi8(static_cast<char>(-128));
  __m128i badv = _mm_setzero_si128(), acc = _mm_setzero_si128();
  for (int k = 0; k < 4; ++k) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * k));
    badv = _mm_or_si128(badv, _mm_cmpeq_epi8(q, minus128));
    const __m128i w0 = _mm_srai_epi16(_mm_unpacklo_epi8(q, q), 8), w1 = _mm_srai_epi16(_mm_unpackhi_epi8(q, q), 8);
    acc = _mm_add_epi32(acc, _mm_add_epi32(_mm_madd_epi16(w0, w0), _mm_madd_epi16(w1, w1)));
  }
  return block_sq_total(acc, badv, bad);
#else
  std::uint32_t q2 = 0;
  for (std::size_t j = 0; j < kQuantBlock; ++j) {
    const int q = static_cast<signed char>(c[j]);
    q2 += static_cast<std::uint32_t>(q * q);
    bad |= c[j] == 0x80U ? 1U : 0U;
  }
  return q2;
#endif
}

// The learner's side of the same blocks: the largest magnitude of 64 floats and
// their quantised codes. Same arithmetic as ddiloco::detail::block_scale and
// quantise (see encode_range): the magnitude as its bit pattern (sign cleared;
// the integer order of those patterns is the order of |x|, NaN and inf are the
// patterns >= 0x7F800000), and round(x * inv) to nearest even by cvtps2dq (the
// reference's add-and-subtract-1.5*2^23 in the default rounding mode), then
// signed-saturating packs to 16 and 8 bits. No clamp: with inv from
// inverse_scale, |x * inv| <= q (1 + 3 * 2^-24) rounds into [-q, q]. Codes of a
// block with a NaN or inf are never sent (the caller throws), so only finite
// blocks have to agree with the reference; they do, bit for bit.

/// max_i (bits of x_i with the sign cleared) of x[0..len): a partial block.
inline std::uint32_t absmax_bits(const float* __restrict__ x, std::size_t len) noexcept {
  std::uint32_t m = 0;
  for (std::size_t i = 0; i < len; ++i) {
    std::uint32_t b;
    std::memcpy(&b, x + i, 4);
    b &= 0x7FFFFFFFU;
    m = b > m ? b : m;
  }
  return m;
}

/// The same over one whole block x[0..64).
inline std::uint32_t block_absmax_bits(const float* __restrict__ x) noexcept {
#if defined(__SSE2__)
  const __m128i mask = _mm_set1_epi32(0x7FFFFFFF);
  __m128i m[4];
  for (int k = 0; k < 4; ++k) m[k] = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 4 * k)), mask);
  for (int j = 1; j < 4; ++j) {
    for (int k = 0; k < 4; ++k) {
      const __m128i v = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16 * j + 4 * k)), mask);
      const __m128i gt = _mm_cmpgt_epi32(v, m[k]);  // signed compare: both are >= 0
      m[k] = _mm_or_si128(_mm_and_si128(gt, v), _mm_andnot_si128(gt, m[k]));
    }
  }
  alignas(16) std::uint32_t lanes[16];
  for (int k = 0; k < 4; ++k) _mm_store_si128(reinterpret_cast<__m128i*>(lanes + 4 * k), m[k]);
  std::uint32_t r = 0;
  for (const std::uint32_t l : lanes) r = l > r ? l : r;
  return r;
#else
  return absmax_bits(x, kQuantBlock);
#endif
}

#if defined(__SSE2__)
/// The codes of x[0..16) as 16 signed bytes: round(x * inv).
inline __m128i quantise_x16(const float* __restrict__ x, __m128 inv) noexcept {
  const __m128i a = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x), inv));
  const __m128i b = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + 4), inv));
  const __m128i c = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + 8), inv));
  const __m128i d = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + 12), inv));
  return _mm_packs_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, d));
}
/// Two codes per byte from 16 signed byte codes: read as 16-bit lanes
/// (q_2k | q_2k+1 << 8), lane -> (lane & 0x0F) | ((lane >> 4) & 0xF0).
inline __m128i pair_nibbles(__m128i q) noexcept {
  return _mm_or_si128(_mm_and_si128(q, _mm_set1_epi16(0x000F)), _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi16(0x00F0)));
}
#endif

/// Codes of one whole block x[0..64) for q_max = 7 (int4, 32 bytes at c: low
/// nibble first) given inv = 1 / scale (0 for a zero block).
inline void int4_block_encode(const float* __restrict__ x, float inv, unsigned char* __restrict__ c) noexcept {
#if defined(__SSE2__)
  const __m128 vi = _mm_set1_ps(inv);
  for (int h = 0; h < 2; ++h) {
    const __m128i q0 = pair_nibbles(quantise_x16(x + 32 * h, vi));
    const __m128i q1 = pair_nibbles(quantise_x16(x + 32 * h + 16, vi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16 * h), _mm_packus_epi16(q0, q1));
  }
#else
  for (std::size_t j = 0; j < kQuantBlock / 2; ++j) {
    const auto q0 = static_cast<unsigned>(ddiloco::detail::quantise(x[2 * j], inv, 7)) & 0xFU;
    const auto q1 = static_cast<unsigned>(ddiloco::detail::quantise(x[2 * j + 1], inv, 7)) & 0xFU;
    c[j] = static_cast<unsigned char>(q0 | (q1 << 4));
  }
#endif
}

/// Codes of one whole block x[0..64) for q_max = 127 (int8, 64 bytes at c).
inline void int8_block_encode(const float* __restrict__ x, float inv, unsigned char* __restrict__ c) noexcept {
#if defined(__SSE2__)
  const __m128 vi = _mm_set1_ps(inv);
  for (int k = 0; k < 4; ++k) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16 * k), quantise_x16(x + 16 * k, vi));
  }
#else
  for (std::size_t j = 0; j < kQuantBlock; ++j) {
    c[j] = static_cast<unsigned char>(static_cast<signed char>(ddiloco::detail::quantise(x[j], inv, 127)));
  }
#endif
}

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define DDILOCO_FAST_HAVE_AVX2_BLOCKS 1
// AVX2 versions of the four block kernels (the 256-bit byte-to-int32 widening,
// and a pshufb table of squared int4 codes summed with psadbw).
__attribute__((target("avx2"))) inline unsigned int4_block_decode_avx2(const unsigned char* c, float s,
                                                                       float* __restrict__ o) noexcept {
  const __m256 vs = _mm256_set1_ps(s);
  __m128i badv = _mm_setzero_si128();
  for (int h = 0; h < 2; ++h) {
    __m128i q[2];
    unpack_int4x32(c + 16 * h, badv, q);
    for (int k = 0; k < 2; ++k) {
      float* ok = o + 32 * h + 16 * k;
      _mm256_storeu_ps(ok, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q[k])), vs));
      _mm256_storeu_ps(ok + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q[k], 8))), vs));
    }
  }
  return static_cast<unsigned>(_mm_movemask_epi8(badv));
}

__attribute__((target("avx2"))) inline unsigned int8_block_decode_avx2(const unsigned char* c, float s,
                                                                       float* __restrict__ o) noexcept {
  const __m256i minus128 = _mm256_set1_epi8(static_cast<char>(-128));
  const __m256 vs = _mm256_set1_ps(s);
  const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
  const __m256i badv = _mm256_or_si256(_mm256_cmpeq_epi8(q0, minus128), _mm256_cmpeq_epi8(q1, minus128));
  for (int k = 0; k < 8; ++k) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * k));
    _mm256_storeu_ps(o + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vs));
  }
  return static_cast<unsigned>(_mm256_movemask_epi8(badv));
}

__attribute__((target("avx2"))) inline std::uint32_t int4_block_sq_avx2(const unsigned char* c,
                                                                        unsigned& bad) noexcept {
  const __m256i mask = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  // q^2 of each nibble value: nibble v holds q = (v ^ 8) - 8.
  const __m256i squares = _mm256_setr_epi8(0, 1, 4, 9, 16, 25, 36, 49, 64, 49, 36, 25, 16, 9, 4, 1,  //
                                           0, 1, 4, 9, 16, 25, 36, 49, 64, 49, 36, 25, 16, 9, 4, 1);
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  const __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
  const __m256i badv = _mm256_or_si256(_mm256_cmpeq_epi8(lo, eight), _mm256_cmpeq_epi8(hi, eight));
  // Per byte at most 64 + 64 = 128: fits the unsigned bytes psadbw sums.
  const __m256i sq = _mm256_add_epi8(_mm256_shuffle_epi8(squares, lo), _mm256_shuffle_epi8(squares, hi));
  const __m256i sums = _mm256_sad_epu8(sq, _mm256_setzero_si256());  // four 64-bit partial sums
  const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  bad |= static_cast<unsigned>(_mm256_movemask_epi8(badv));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(_mm_add_epi64(s2, _mm_unpackhi_epi64(s2, s2))));
}

__attribute__((target("avx2"))) inline std::uint32_t int8_block_sq_avx2(const unsigned char* c,
                                                                        unsigned& bad) noexcept {
  const __m256i minus128 = _mm256_set1_epi8(static_cast<char>(-128));
  __m256i acc = _mm256_setzero_si256(), badv = _mm256_setzero_si256();
  for (int k = 0; k < 2; ++k) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * k));
    badv = _mm256_or_si256(badv, _mm256_cmpeq_epi8(q, minus128));
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
    acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(w0, w0), _mm256_madd_epi16(w1, w1)));
  }
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
  bad |= static_cast<unsigned>(_mm256_movemask_epi8(badv));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(a));
}

__attribute__((target("avx2"))) inline std::uint32_t block_absmax_bits_avx2(const float* __restrict__ x) noexcept {
  const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i m[2];
  for (int k = 0; k < 2; ++k) m[k] = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * k)), mask);
  for (int j = 2; j < 8; j += 2) {
    for (int k = 0; k < 2; ++k) {
      const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * (j + k))), mask);
      m[k] = _mm256_max_epu32(m[k], v);
    }
  }
  const __m256i m01 = _mm256_max_epu32(m[0], m[1]);
  __m128i r = _mm_max_epu32(_mm256_castsi256_si128(m01), _mm256_extracti128_si256(m01, 1));
  r = _mm_max_epu32(r, _mm_shuffle_epi32(r, 0x4E));
  r = _mm_max_epu32(r, _mm_shuffle_epi32(r, 0xB1));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(r));
}

/// The codes of x[0..32) as 32 signed bytes in element order (quantise_x16 in
/// 256 bits; the in-lane packs leave groups of four in the order 0 2 4 6 1 3 5 7,
/// which one cross-lane permute puts back).
__attribute__((target("avx2"))) inline __m256i quantise_x32_avx2(const float* __restrict__ x, __m256 inv) noexcept {
  const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inv));
  const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), inv));
  const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), inv));
  const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), inv));
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

__attribute__((target("avx2"))) inline void int4_block_encode_avx2(const float* __restrict__ x, float inv,
                                                                   unsigned char* __restrict__ c) noexcept {
  const __m256 vi = _mm256_set1_ps(inv);
  const __m256i low = _mm256_set1_epi16(0x000F), high = _mm256_set1_epi16(0x00F0);
  __m256i n[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i v = quantise_x32_avx2(x + 32 * h, vi);
    n[h] = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), high));
  }
  // packus works per 128-bit lane: 64-bit quarters come out as n0.lo n1.lo n0.hi n1.hi.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(n[0], n[1]), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), packed);
}

__attribute__((target("avx2"))) inline void int8_block_encode_avx2(const float* __restrict__ x, float inv,
                                                                   unsigned char* __restrict__ c) noexcept {
  const __m256 vi = _mm256_set1_ps(inv);
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 32 * h), quantise_x32_avx2(x + 32 * h, vi));
  }
}
#endif

/// The block kernels of one build: Avx2 = false the baseline ones.
template <bool Avx2>
struct BlockKernels {
  static unsigned int4_decode(const unsigned char* c, float s, float* __restrict__ o) noexcept {
    return int4_block_decode(c, s, o);
  }
  static unsigned int8_decode(const unsigned char* c, float s, float* __restrict__ o) noexcept {
    return int8_block_decode(c, s, o);
  }
  static std::uint32_t int4_sq(const unsigned char* c, unsigned& bad) noexcept { return int4_block_sq(c, bad); }
  static std::uint32_t int8_sq(const unsigned char* c, unsigned& bad) noexcept { return int8_block_sq(c, bad); }
  static std::uint32_t absmax(const float* __restrict__ x) noexcept { return block_absmax_bits(x); }
  static void int4_encode(const float* __restrict__ x, float inv, unsigned char* __restrict__ c) noexcept {
    int4_block_encode(x, inv, c);
  }
  static void int8_encode(const float* __restrict__ x, float inv, unsigned char* __restrict__ c) noexcept {
    int8_block_encode(x, inv, c);
  }
};
#ifdef DDILOCO_FAST_HAVE_AVX2_BLOCKS
template <>
struct BlockKernels<true> {
  __attribute__((target("avx2"))) static unsigned int4_decode(const unsigned char* c, float s,
                                                              float* __restrict__ o) noexcept {
    return int4_block_decode_avx2(c, s, o);
  }
  __attribute__((target("avx2"))) static unsigned int8_decode(const unsigned char* c, float s,
                                                              float* __restrict__ o) noexcept {
    return int8_block_decode_avx2(c, s, o);
  }
  __attribute__((target("avx2"))) static std::uint32_t int4_sq(const unsigned char* c, unsigned& bad) noexcept {
    return int4_block_sq_avx2(c, bad);
  }
  __attribute__((target("avx2"))) static std::uint32_t int8_sq(const unsigned char* c, unsigned& bad) noexcept {
    return int8_block_sq_avx2(c, bad);
  }
  __attribute__((target("avx2"))) static std::uint32_t absmax(const float* __restrict__ x) noexcept {
    return block_absmax_bits_avx2(x);
  }
  __attribute__((target("avx2"))) static void int4_encode(const float* __restrict__ x, float inv,
                                                          unsigned char* __restrict__ c) noexcept {
    int4_block_encode_avx2(x, inv, c);
  }
  __attribute__((target("avx2"))) static void int8_encode(const float* __restrict__ x, float inv,
                                                          unsigned char* __restrict__ c) noexcept {
    int8_block_encode_avx2(x, inv, c);
  }
};
#endif

// ---- chunked decoding --------------------------------------------------------

/// ddiloco::detail::fp16_to_float with selects instead of branches, so the
/// decode loop vectorises (the branchy form ran at a fifth of bf16's rate):
/// the same bits for all 65536 inputs (tests/test_fast_kernels.cpp checks each).
[[gnu::always_inline]] inline float fp16_to_float_select(std::uint32_t h) noexcept {
  const std::uint32_t sign = (h & 0x8000U) << 16;
  const std::uint32_t em = h & 0x7FFFU;  // exponent and mantissa
  const std::uint32_t e = em >> 10;
  const std::uint32_t normal = sign | ((em << 13) + (112U << 23));
  const std::uint32_t inf_nan = sign | 0x7F800000U | ((em & 0x3FFU) << 13);
  // e == 0: zero or subnormal, mant * 2^-24 (exact in binary32), signed.
  const std::uint32_t sub = sign | std::bit_cast<std::uint32_t>(static_cast<float>(static_cast<std::int32_t>(em & 0x3FFU)) *
                                                                5.9604644775390625e-8f);
  const std::uint32_t is_sub = 0U - static_cast<std::uint32_t>(e == 0);  // all ones or zero
  const std::uint32_t is_top = 0U - static_cast<std::uint32_t>(e == 31);
  return std::bit_cast<float>((sub & is_sub) | (inf_nan & is_top) | (normal & ~(is_sub | is_top)));
}

/// Decodes elements [lo, lo + len) of an n-element payload `in` (encoded with
/// `codec`, in.size() == encoded_size(codec, n), checked by the caller) into out.
/// lo must be a multiple of kQuantBlock and lo + len either n or a multiple of
/// kQuantBlock, so only whole blocks are read. Returns false when the decoded
/// blocks are not a valid encoding (same checks as ddiloco::decode: scale finite
/// and >= 0, no -Q-1 code, zero int4 padding nibble); out is then unspecified.
/// Reference: ddiloco::detail::try_decode on the whole payload.
template <bool Avx2>
[[gnu::always_inline]] inline bool decode_range_impl(Codec codec, const std::byte* in, std::size_t n, std::size_t lo,
                         std::size_t len, float* __restrict__ out) noexcept {
  const auto* u8 = reinterpret_cast<const unsigned char*>(in);
  switch (codec) {
    case Codec::fp32:
      if constexpr (std::endian::native == std::endian::little) {
        if (len != 0) std::memcpy(out, in + 4 * lo, 4 * len);
      } else {
        for (std::size_t i = 0; i < len; ++i) out[i] = std::bit_cast<float>(ddiloco::detail::load_u32(in + 4 * (lo + i)));
      }
      return true;
    case Codec::bf16:
      for (std::size_t i = 0; i < len; ++i) {
        const std::size_t p = 2 * (lo + i);
        const auto h = static_cast<std::uint32_t>(u8[p]) | (static_cast<std::uint32_t>(u8[p + 1]) << 8);
        out[i] = std::bit_cast<float>(h << 16);
      }
      return true;
    case Codec::fp16:
      for (std::size_t i = 0; i < len; ++i) {
        const std::size_t p = 2 * (lo + i);
        out[i] = fp16_to_float_select(static_cast<std::uint32_t>(u8[p]) | (static_cast<std::uint32_t>(u8[p + 1]) << 8));
      }
      return true;
    case Codec::int8:
    case Codec::int4: break;
  }
  const std::size_t nb = ddiloco::detail::quant_blocks(n);
  const std::byte* scales = in;
  const unsigned char* codes = u8 + 4 * nb;
  bool ok = true;
  for (std::size_t e = 0; e < len; e += kQuantBlock) {
    const std::size_t b = (lo + e) / kQuantBlock;
    const float s = std::bit_cast<float>(ddiloco::detail::load_u32(scales + 4 * b));
    ok &= s >= 0.0f && s <= std::numeric_limits<float>::max();  // false for NaN, inf, negative
    const std::size_t blen = std::min(kQuantBlock, len - e);
    float* __restrict__ o = out + e;
    if (codec == Codec::int8) {
      const unsigned char* c = codes + lo + e;
      if (blen == kQuantBlock) {
        ok &= BlockKernels<Avx2>::int8_decode(c, s, o) == 0;
      } else {
        for (std::size_t j = 0; j < blen; ++j) {
          ok &= c[j] != 0x80U;
          o[j] = static_cast<float>(static_cast<signed char>(c[j])) * s;
        }
      }
    } else {
      const unsigned char* c = codes + (lo + e) / 2;
      if (blen == kQuantBlock) {
        ok &= BlockKernels<Avx2>::int4_decode(c, s, o) == 0;
      } else {
        // Sign-extend each nibble: (v ^ 8) - 8 maps 0..7 -> 0..7, 8..15 -> -8..-1.
        for (std::size_t j = 0; j < blen; j += 2) {
          const unsigned lo4 = c[j / 2] & 0xFU, hi4 = static_cast<unsigned>(c[j / 2]) >> 4;
          ok &= lo4 != 8U;
          o[j] = static_cast<float>(static_cast<int>(lo4 ^ 8U) - 8) * s;
          if (j + 1 < blen) {
            ok &= hi4 != 8U;
            o[j + 1] = static_cast<float>(static_cast<int>(hi4 ^ 8U) - 8) * s;
          } else {
            ok &= hi4 == 0U;  // padding nibble of an odd-length payload
          }
        }
      }
    }
  }
  return ok;
}
[[gnu::always_inline]] inline bool decode_range_base(Codec codec, const std::byte* in, std::size_t n, std::size_t lo,
                                                     std::size_t len, float* __restrict__ out) noexcept {
  return decode_range_impl<false>(codec, in, n, lo, len, out);
}

// ---- run-time dispatch -------------------------------------------------------
// Each kernel above is compiled twice: for baseline x86-64 (SSE2) and, through
// GCC/Clang's target attribute, for AVX2 (no FMA, so results stay identical),
// chosen at run time. Other compilers and CPUs get the baseline build.
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define DDILOCO_FAST_HAVE_AVX2_CLONES 1
#define DDILOCO_FAST_AVX2 __attribute__((target("avx2")))
DDILOCO_FAST_AVX2 inline double squared_norm_avx2(const float* __restrict__ x, std::size_t n) noexcept { return squared_norm_base(x, n); }
DDILOCO_FAST_AVX2 inline double running_mean_update_sq_avx2(float f, float s, const float* __restrict__ x,
                                     float* __restrict__ mean, std::size_t n) noexcept { return running_mean_update_sq_base(f, s, x, mean, n); }
DDILOCO_FAST_AVX2 inline double scale_copy_sq_avx2(float s, const float* __restrict__ x, float* __restrict__ mean,
                            std::size_t n) noexcept { return scale_copy_sq_base(s, x, mean, n); }
DDILOCO_FAST_AVX2 inline void scaled_nesterov_avx2(float c, float share, const float* __restrict__ mean, float mu, float eta,
                            float* __restrict__ theta, float* __restrict__ b, std::size_t n) noexcept { return scaled_nesterov_base(c, share, mean, mu, eta, theta, b, n); }
DDILOCO_FAST_AVX2 inline bool decode_range_avx2(Codec codec, const std::byte* in, std::size_t n, std::size_t lo,
                         std::size_t len, float* __restrict__ out) noexcept {
  return decode_range_impl<true>(codec, in, n, lo, len, out);
}
DDILOCO_FAST_AVX2 inline void scale_into_avx2(float a, const float* __restrict__ x, float* __restrict__ out,
                                                std::size_t n) noexcept { scale_into_base(a, x, out, n); }
DDILOCO_FAST_AVX2 inline void axpy_avx2(float a, const float* __restrict__ x, float* __restrict__ acc,
                                          std::size_t n) noexcept { axpy_base(a, x, acc, n); }
DDILOCO_FAST_AVX2 inline double axpy_store_sq_avx2(float a, const float* __restrict__ x, const float* __restrict__ acc,
                                                     float* __restrict__ mean, std::size_t n) noexcept {
  return axpy_store_sq_base(a, x, acc, mean, n);
}
#undef DDILOCO_FAST_AVX2
#endif

/// Whether the AVX2 clones run (true when the CPU has AVX2, unless turned off).
inline bool& avx2_enabled() noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  static bool on = __builtin_cpu_supports("avx2");
#else
  static bool on = false;
#endif
  return on;
}

}  // namespace detail

/// out_i = c * x_i (the non-fused finish; memory bound, baseline build only).
inline void scale(float c, const float* __restrict__ x, float* __restrict__ out, std::size_t n) noexcept {
  detail::scale(c, x, out, n);
}

/// Selects the baseline kernels even on an AVX2 machine (true), or the best the
/// CPU has (false, the default). For tests and comparisons; not thread-safe
/// against kernels running concurrently.
inline void use_baseline_kernels(bool baseline) noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  detail::avx2_enabled() = !baseline && __builtin_cpu_supports("avx2");
#else
  (void)baseline;
#endif
}

/// sum_i x_i^2, summed in fp32 lanes per block of kNormBlock and in double
/// across blocks. Finite values near the fp32 limit (|x| above ~1.8e19) overflow
/// an fp32 lane: when the fast sum is not finite it is taken again element by
/// element in double, so the result is infinite or NaN only when a value is.
inline double squared_norm(const float* __restrict__ x, std::size_t n) noexcept {
  double sq = 0.0;
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  if (detail::avx2_enabled()) {
    sq = detail::squared_norm_avx2(x, n);
  } else {
    sq = detail::squared_norm_base(x, n);
  }
#else
  sq = detail::squared_norm_base(x, n);
#endif
  if (std::isfinite(sq)) return sq;
  double exact = 0.0;
  for (std::size_t i = 0; i < n; ++i) exact += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return exact;
}

inline double running_mean_update_sq(float f, float s, const float* __restrict__ x,
                                     float* __restrict__ mean, std::size_t n) noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  if (detail::avx2_enabled()) return detail::running_mean_update_sq_avx2(f, s, x, mean, n);
#endif
  return detail::running_mean_update_sq_base(f, s, x, mean, n);
}

inline double scale_copy_sq(float s, const float* __restrict__ x, float* __restrict__ mean,
                            std::size_t n) noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  if (detail::avx2_enabled()) return detail::scale_copy_sq_avx2(s, x, mean, n);
#endif
  return detail::scale_copy_sq_base(s, x, mean, n);
}

inline void scaled_nesterov(float c, float share, const float* __restrict__ mean, float mu, float eta,
                            float* __restrict__ theta, float* __restrict__ b, std::size_t n) noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  if (detail::avx2_enabled()) return detail::scaled_nesterov_avx2(c, share, mean, mu, eta, theta, b, n);
#endif
  return detail::scaled_nesterov_base(c, share, mean, mu, eta, theta, b, n);
}

/// acc_i = a * x_i (batched merge; see detail::scale_into_base).
inline void scale_into(float a, const float* __restrict__ x, float* __restrict__ out, std::size_t n) noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  if (detail::avx2_enabled()) return detail::scale_into_avx2(a, x, out, n);
#endif
  detail::scale_into_base(a, x, out, n);
}

/// acc_i += a * x_i (batched merge).
inline void axpy(float a, const float* __restrict__ x, float* __restrict__ acc, std::size_t n) noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  if (detail::avx2_enabled()) return detail::axpy_avx2(a, x, acc, n);
#endif
  detail::axpy_base(a, x, acc, n);
}

/// mean_i = acc_i + a * x_i, returns sum_i mean_i^2 (batched merge, last contribution).
inline double axpy_store_sq(float a, const float* __restrict__ x, const float* __restrict__ acc,
                            float* __restrict__ mean, std::size_t n) noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  if (detail::avx2_enabled()) return detail::axpy_store_sq_avx2(a, x, acc, mean, n);
#endif
  return detail::axpy_store_sq_base(a, x, acc, mean, n);
}

inline bool decode_range(Codec codec, const std::byte* in, std::size_t n, std::size_t lo,
                         std::size_t len, float* __restrict__ out) noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  if (detail::avx2_enabled()) return detail::decode_range_avx2(codec, in, n, lo, len, out);
#endif
  return detail::decode_range_base(codec, in, n, lo, len, out);
}

/// An fp32 payload's floats read where they are (a received frame, no copy):
/// `in` itself when the codec is fp32, the machine little-endian (the wire
/// order) and `in` aligned for float; nullptr otherwise, and the caller decodes.
inline const float* fp32_in_place(Codec codec, const std::byte* in) noexcept {
  if constexpr (std::endian::native != std::endian::little) return nullptr;
  if (codec != Codec::fp32 || reinterpret_cast<std::uintptr_t>(in) % alignof(float) != 0) return nullptr;
  return reinterpret_cast<const float*>(in);
}

namespace detail {
/// encoded_squared_norm, and with Check also the validity of every block it
/// reads (the checks of valid_encoding), or-ed into `bad`.
template <bool Check, bool Avx2 = false>
[[gnu::always_inline]] inline double encoded_squared_norm_impl(Codec codec, const std::byte* in, std::size_t n, std::size_t lo,
                                        std::size_t len, unsigned& bad) noexcept {
  alignas(64) float buf[kQuantBlock];
  double total = 0.0;
  const std::size_t hi = lo + len;
  if (const float* f = fp32_in_place(codec, in)) return squared_norm(f + lo, len);
  if (codec != Codec::int8 && codec != Codec::int4) {
    alignas(64) float chunk[kChunk];
    for (std::size_t a = lo; a < hi; a += kChunk) {
      const std::size_t l = std::min(kChunk, hi - a);
      decode_range(codec, in, n, a, l, chunk);
      total += squared_norm(chunk, l);
    }
    return total;
  }
  const std::size_t nb = ddiloco::detail::quant_blocks(n);
  const auto* codes = reinterpret_cast<const unsigned char*>(in + 4 * nb);
  for (std::size_t b = lo / kQuantBlock; b * kQuantBlock < hi; ++b) {
    const std::size_t blo = b * kQuantBlock, bhi = std::min(n, blo + kQuantBlock);
    const std::size_t a = std::max(lo, blo), e = std::min(hi, bhi);
    if (a != blo || e != bhi || bhi - blo != kQuantBlock) {  // partial block: decode it
      const bool ok = decode_range(codec, in, n, blo, bhi - blo, buf);
      if constexpr (Check) bad |= ok ? 0U : 1U;
      total += squared_norm(buf + (a - blo), e - a);
      continue;
    }
    const float sf = std::bit_cast<float>(ddiloco::detail::load_u32(in + 4 * b));
    if constexpr (Check) bad |= sf >= 0.0f && sf <= std::numeric_limits<float>::max() ? 0U : 1U;
    const auto s = static_cast<double>(sf);
    unsigned bad_codes = 0;
    const std::uint32_t q2 = codec == Codec::int8 ? BlockKernels<Avx2>::int8_sq(codes + blo, bad_codes)
                                                  : BlockKernels<Avx2>::int4_sq(codes + blo / 2, bad_codes);
    if constexpr (!Check) bad_codes = 0;
    bad |= bad_codes;
    total += s * s * static_cast<double>(q2);
  }
  return total;
}

#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
// The code scans vectorise into 32-byte lanes: built for AVX2 as well.
__attribute__((target("avx2"))) inline double encoded_squared_norm_avx2(Codec codec, const std::byte* in,
                                                                        std::size_t n, std::size_t lo,
                                                                        std::size_t len) noexcept {
  unsigned unused = 0;
  return encoded_squared_norm_impl<false, true>(codec, in, n, lo, len, unused);
}
__attribute__((target("avx2"))) inline double checked_encoded_squared_norm_avx2(Codec codec, const std::byte* in,
                                                                                std::size_t n, std::size_t lo,
                                                                                std::size_t len,
                                                                                unsigned& bad) noexcept {
  return encoded_squared_norm_impl<true, true>(codec, in, n, lo, len, bad);
}
#endif
}  // namespace detail

/// sum of the squares of elements [lo, lo + len) of a VALID n-element payload
/// (any lo, len), without decoding to floats where whole quantisation blocks
/// are covered: block b contributes s_b^2 * sum_j q_j^2 (an integer sum), in
/// double. Equals the squared norm of ddiloco::decode's output up to the fp32
/// rounding of each q_j * s_b there (~1e-7 relative). Any codec; the others
/// decode into a stack buffer.
inline double encoded_squared_norm(Codec codec, const std::byte* in, std::size_t n, std::size_t lo,
                                   std::size_t len) noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  if (detail::avx2_enabled()) return detail::encoded_squared_norm_avx2(codec, in, n, lo, len);
#endif
  unsigned unused = 0;
  return detail::encoded_squared_norm_impl<false>(codec, in, n, lo, len, unused);
}

/// encoded_squared_norm of any payload, also checking the blocks it reads in
/// the same scan: sets `valid` to false when one of them fails the checks of
/// valid_encoding (leaves it unchanged otherwise). Covering [0, n) with calls
/// checks the whole payload, as valid_encoding does, while computing norms.
inline double checked_encoded_squared_norm(Codec codec, const std::byte* in, std::size_t n, std::size_t lo,
                                           std::size_t len, bool& valid) noexcept {
  unsigned bad = 0;
#ifdef DDILOCO_FAST_HAVE_AVX2_CLONES
  const double sq = detail::avx2_enabled() ? detail::checked_encoded_squared_norm_avx2(codec, in, n, lo, len, bad)
                                           : detail::encoded_squared_norm_impl<true>(codec, in, n, lo, len, bad);
#else
  const double sq = detail::encoded_squared_norm_impl<true>(codec, in, n, lo, len, bad);
#endif
  if (bad != 0) valid = false;
  return sq;
}

/// True when the n-element payload `in` (encoded_size(codec, n) bytes, checked by
/// the caller) is a valid encoding, by a scan of its bytes without decoding:
/// the checks of ddiloco::decode (finite scales >= 0, no -128 / -8 code, zero
/// int4 padding nibble). fp32/bf16/fp16: every bit pattern is valid.
inline bool valid_encoding(Codec codec, const std::byte* in, std::size_t n) noexcept {
  if (codec != Codec::int8 && codec != Codec::int4) return true;
  const std::size_t nb = ddiloco::detail::quant_blocks(n);
  unsigned bad = 0;
  for (std::size_t b = 0; b < nb; ++b) {
    const float s = std::bit_cast<float>(ddiloco::detail::load_u32(in + 4 * b));
    bad |= s >= 0.0f && s <= std::numeric_limits<float>::max() ? 0U : 1U;
  }
  const auto* c = reinterpret_cast<const unsigned char*>(in + 4 * nb);
  if (codec == Codec::int8) {
    for (std::size_t i = 0; i < n; ++i) bad |= c[i] == 0x80U ? 1U : 0U;
    return bad == 0;
  }
  const std::size_t full = n / 2;  // bytes holding two elements
  for (std::size_t i = 0; i < full; ++i) {
    bad |= ((c[i] & 0xFU) == 8U ? 1U : 0U) | ((c[i] >> 4) == 8U ? 1U : 0U);
  }
  if (n % 2 != 0) bad |= ((c[full] & 0xFU) == 8U || (c[full] >> 4) != 0U) ? 1U : 0U;
  return bad == 0;
}

/// What checked_norms_and_checksum found.
enum class PayloadCheck : std::uint8_t { ok, bad_encoding, bad_checksum };

/// The syncer's one scan of a received encoded payload (encoded_size(codec, n)
/// bytes, the size checked by the caller): sq[t] = the squared norm of elements
/// [segs[t].offset, segs[t].offset + segs[t].size) (encoded_squared_norm), the
/// codes checked as valid_encoding checks them, and, when `crc` is set, the
/// CRC-32C of all the bytes compared with *crc (the frame's payload checksum).
/// The bytes are taken in pieces of kCheckPiece elements, each checksummed and
/// then scanned while it is in cache, so the payload is read from memory once
/// instead of twice (docs/performance.md, "Where the syncer's time goes"). The
/// int8/int4 scales lead the payload: they are checksummed first. segs must be
/// in increasing offset order without overlap (a Plan's layout is); elements
/// outside every segment are checksummed and checked but not summed.
inline constexpr std::size_t kCheckPiece = std::size_t{1} << 14;
static_assert(kCheckPiece % kQuantBlock == 0);

template <class Segments>
PayloadCheck checked_norms_and_checksum(Codec codec, std::span<const std::byte> bytes, std::size_t n,
                                        const Segments& segs, std::span<double> sq,
                                        std::optional<std::uint32_t> crc) noexcept {
  std::fill(sq.begin(), sq.end(), 0.0);
  const std::size_t lead = codec == Codec::int8 || codec == Codec::int4 ? 4 * ddiloco::detail::quant_blocks(n) : 0;
  // The first byte of element a's code (a a multiple of kQuantBlock, or n).
  const auto byte_of = [&](std::size_t a) -> std::size_t {
    if (a == n) return bytes.size();
    switch (codec) {
      case Codec::fp32: return 4 * a;
      case Codec::bf16:
      case Codec::fp16: return 2 * a;
      case Codec::int8: return lead + a;
      case Codec::int4: return lead + a / 2;
    }
    return bytes.size();
  };
  std::uint32_t state = 0xFFFFFFFFU;
  if (crc && lead != 0) state = ddiloco::detail::crc32c_update(state, bytes.first(lead));
  bool valid = true;
  std::size_t t = 0;
  for (std::size_t a = 0; a < n; a += kCheckPiece) {
    const std::size_t b = std::min(n, a + kCheckPiece);
    if (crc) state = ddiloco::detail::crc32c_update(state, bytes.subspan(byte_of(a), byte_of(b) - byte_of(a)));
    // The segments [a, b) meets, from the first one not yet done.
    while (t < segs.size() && segs[t].offset + segs[t].size <= a) ++t;
    bool covered = false;
    for (std::size_t u = t; u < segs.size() && segs[u].offset < b; ++u) {
      const std::size_t lo = std::max(a, segs[u].offset), hi = std::min(b, segs[u].offset + segs[u].size);
      if (lo >= hi) continue;
      sq[u] += checked_encoded_squared_norm(codec, bytes.data(), n, lo, hi - lo, valid);
      covered = covered || (lo == a && hi == b);
    }
    // Codes outside the segments are still checked (a plan's segments cover the fragment).
    if (!covered && codec != Codec::fp32 && codec != Codec::bf16 && codec != Codec::fp16) {
      std::size_t at = a;
      for (std::size_t u = t; u < segs.size() && segs[u].offset < b; ++u) {
        const std::size_t lo = std::max(a, segs[u].offset);
        if (lo > at) (void)checked_encoded_squared_norm(codec, bytes.data(), n, at, lo - at, valid);
        at = std::max(at, std::min(b, segs[u].offset + segs[u].size));
      }
      if (at < b) (void)checked_encoded_squared_norm(codec, bytes.data(), n, at, b - at, valid);
    }
  }
  if (crc && (state ^ 0xFFFFFFFFU) != *crc) return PayloadCheck::bad_checksum;
  return valid ? PayloadCheck::ok : PayloadCheck::bad_encoding;
}

// ---- learner side --------------------------------------------------------------

namespace detail {

/// Encodes x[0..len) = elements [lo, lo + len) of an n-element vector into the
/// matching bytes of `out` (the whole payload, encoded_size(codec, n) bytes);
/// lo and len as for decode_range. Returns false on a non-finite value for int8/int4.
/// Reference: ddiloco::encode (detail::encode_blocks).
template <bool Avx2>
[[gnu::always_inline]] inline bool encode_range_impl(Codec codec, const float* __restrict__ x, std::size_t n,
                                                     std::size_t lo, std::size_t len, std::byte* out) noexcept {
  switch (codec) {
    case Codec::fp32:
      if constexpr (std::endian::native == std::endian::little) {
        if (len != 0) std::memcpy(out + 4 * lo, x, 4 * len);
      } else {
        for (std::size_t i = 0; i < len; ++i) ddiloco::detail::store_u32(out + 4 * (lo + i), std::bit_cast<std::uint32_t>(x[i]));
      }
      return true;
    case Codec::bf16:
      for (std::size_t i = 0; i < len; ++i) ddiloco::detail::store_u16(out + 2 * (lo + i), ddiloco::detail::float_to_bf16(x[i]));
      return true;
    case Codec::fp16:
      for (std::size_t i = 0; i < len; ++i) ddiloco::detail::store_u16(out + 2 * (lo + i), ddiloco::detail::float_to_fp16(x[i]));
      return true;
    case Codec::int8:
    case Codec::int4: break;
  }
  const int q_max = codec == Codec::int8 ? 127 : 7;
  const std::size_t nb = ddiloco::detail::quant_blocks(n);
  auto* codes = reinterpret_cast<unsigned char*>(out + 4 * nb);
  bool ok = true;
  for (std::size_t e = 0; e < len; e += kQuantBlock) {
    const std::size_t blen = std::min(kQuantBlock, len - e);
    const bool whole = blen == kQuantBlock;
    const float* xb = x + e;
    // max |x| as the largest magnitude bit pattern (see block_absmax_bits):
    // same value as ddiloco::detail::block_scale, but an integer max vectorises.
    const std::uint32_t max_bits = whole ? BlockKernels<Avx2>::absmax(xb) : detail::absmax_bits(xb, blen);
    ok &= max_bits < 0x7F800000U;
    const float s = std::bit_cast<float>(max_bits) / static_cast<float>(q_max);
    ddiloco::detail::store_u32(out + 4 * ((lo + e) / kQuantBlock), std::bit_cast<std::uint32_t>(s));
    const float inv = ddiloco::detail::inverse_scale(s);
    if (codec == Codec::int8) {
      unsigned char* c = codes + lo + e;
      if (whole) {
        BlockKernels<Avx2>::int8_encode(xb, inv, c);
      } else {
        for (std::size_t j = 0; j < blen; ++j) {
          c[j] = static_cast<unsigned char>(static_cast<signed char>(ddiloco::detail::quantise(xb[j], inv, q_max)));
        }
      }
    } else {
      unsigned char* c = codes + (lo + e) / 2;
      if (whole) {
        BlockKernels<Avx2>::int4_encode(xb, inv, c);
      } else {
        for (std::size_t j = 0; j < blen; j += 2) {
          const auto q0 = static_cast<unsigned>(ddiloco::detail::quantise(xb[j], inv, q_max)) & 0xFU;
          const auto q1 = j + 1 < blen ? static_cast<unsigned>(ddiloco::detail::quantise(xb[j + 1], inv, q_max)) & 0xFU : 0U;
          c[j / 2] = static_cast<unsigned char>(q0 | (q1 << 4));
        }
      }
    }
  }
  return ok;
}

/// The learner's per-element step: next_i = theta_i (the snapshot that becomes
/// the next base) and v_i = base_i - theta_i (the outer gradient).
[[gnu::always_inline]] inline void snapshot_difference_impl(const float* __restrict__ theta,
                                                            const float* __restrict__ base, float* __restrict__ next,
                                                            float* __restrict__ v, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float x = theta[i];
    next[i] = x;
    v[i] = base[i] - x;
  }
}
/// v_i = base_i - next_i, for a snapshot already in `next` (a staged tensor).
[[gnu::always_inline]] inline void difference_impl(const float* __restrict__ base, const float* __restrict__ next,
                                                   float* __restrict__ v, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) v[i] = base[i] - next[i];
}
inline void snapshot_difference_base(const float* __restrict__ theta, const float* __restrict__ base,
                                     float* __restrict__ next, float* __restrict__ v, std::size_t n) noexcept {
  snapshot_difference_impl(theta, base, next, v, n);
}
inline void difference_base(const float* __restrict__ base, const float* __restrict__ next, float* __restrict__ v,
                            std::size_t n) noexcept {
  difference_impl(base, next, v, n);
}
inline bool encode_range_base(Codec codec, const float* __restrict__ x, std::size_t n, std::size_t lo,
                              std::size_t len, std::byte* out) noexcept {
  return encode_range_impl<false>(codec, x, n, lo, len, out);
}
#ifdef DDILOCO_FAST_HAVE_AVX2_BLOCKS
__attribute__((target("avx2"))) inline bool encode_range_avx2(Codec codec, const float* __restrict__ x, std::size_t n,
                                                              std::size_t lo, std::size_t len, std::byte* out) noexcept {
  return encode_range_impl<true>(codec, x, n, lo, len, out);
}
__attribute__((target("avx2"))) inline void snapshot_difference_avx2(const float* __restrict__ theta,
                                                                     const float* __restrict__ base,
                                                                     float* __restrict__ next, float* __restrict__ v,
                                                                     std::size_t n) noexcept {
  snapshot_difference_impl(theta, base, next, v, n);
}
__attribute__((target("avx2"))) inline void difference_avx2(const float* __restrict__ base,
                                                            const float* __restrict__ next, float* __restrict__ v,
                                                            std::size_t n) noexcept {
  difference_impl(base, next, v, n);
}
#endif
}  // namespace detail

/// encode_range of the build in use (see use_baseline_kernels): encodes
/// x[0..len) = elements [lo, lo + len) of an n-element vector into the matching
/// bytes of the whole payload `out` (encoded_size(codec, n) bytes). lo must be
/// a multiple of kQuantBlock and lo + len either n or a multiple of kQuantBlock.
/// Returns false on a NaN or infinity under int8/int4.
inline bool encode_range(Codec codec, const float* __restrict__ x, std::size_t n, std::size_t lo, std::size_t len,
                         std::byte* out) noexcept {
#ifdef DDILOCO_FAST_HAVE_AVX2_BLOCKS
  if (detail::avx2_enabled()) return detail::encode_range_avx2(codec, x, n, lo, len, out);
#endif
  return detail::encode_range_base(codec, x, n, lo, len, out);
}

/// The learner's due step (docs/algorithm.md, "Round timeline", step 3) over a fragment made of
/// several tensors, in one pass over memory: the caller feeds the fragment's
/// tensors in fragment order, and for each element
///     next_i = theta_i            (the snapshot that becomes the next base)
///     v_i    = base_i - theta_i   (the outer gradient, never stored whole)
/// while every kChunk elements of v are encoded into `out` as soon as they are
/// complete (v lives in a kChunk-element buffer inside this object).
/// Reference: the copy and subtraction of OuterLoop's reference path +
/// ddiloco::encode; tests/test_fast_kernels.cpp checks the bytes are equal.
class OuterGradientEncoder {
 public:
  /// `out` must hold encoded_size(codec, n) bytes (ShapeMismatch otherwise).
  OuterGradientEncoder(Codec codec, std::size_t n, std::span<std::byte> out) : codec_(codec), n_(n), out_(out) {
    if (out.size() != encoded_size(codec, n)) {
      throw ShapeMismatch(ddiloco::detail::msg("fast::OuterGradientEncoder: ", n, " elements in ", to_string(codec),
                                               " take ", encoded_size(codec, n), " bytes but the output has ",
                                               out.size(), "; size it with encoded_size()"));
    }
  }
  OuterGradientEncoder(const OuterGradientEncoder&) = delete;
  OuterGradientEncoder& operator=(const OuterGradientEncoder&) = delete;

  /// The next `len` elements. theta may equal next (a snapshot already copied
  /// there); otherwise the three ranges must not overlap. Throws InvalidArgument
  /// when int8/int4 meet a NaN or infinity, and when more than n elements come.
  void add(const float* theta, const float* base, float* next, std::size_t len) {
    if (len > n_ - done_) {
      throw InvalidArgument(ddiloco::detail::msg("fast::OuterGradientEncoder: ", done_ + len, " elements given for ",
                                                 n_, "; feed exactly the fragment's tensors"));
    }
    while (len != 0) {
      const std::size_t k = std::min(len, kChunk - fill_);
      float* v = v_ + fill_;
      const bool staged = theta == next;
#ifdef DDILOCO_FAST_HAVE_AVX2_BLOCKS
      if (detail::avx2_enabled()) {
        staged ? detail::difference_avx2(base, next, v, k) : detail::snapshot_difference_avx2(theta, base, next, v, k);
      } else {
        staged ? detail::difference_base(base, next, v, k) : detail::snapshot_difference_base(theta, base, next, v, k);
      }
#else
      staged ? detail::difference_base(base, next, v, k) : detail::snapshot_difference_base(theta, base, next, v, k);
#endif
      theta += k, base += k, next += k, len -= k;
      fill_ += k, done_ += k;
      if (fill_ == kChunk || done_ == n_) flush();
    }
  }

  /// Elements given so far; the payload is complete when this is n.
  [[nodiscard]] std::size_t done() const noexcept { return done_; }

 private:
  void flush() {
    const std::size_t lo = done_ - fill_;
    if (!encode_range(codec_, v_, n_, lo, fill_, out_.data())) {
      throw InvalidArgument(ddiloco::detail::msg("fast::OuterGradientEncoder(", to_string(codec_), "): elements ", lo,
                                                 "..", done_ - 1,
                                                 " of the outer gradient hold a NaN or infinity; quantised "
                                                 "codecs need finite values; check the parameters"));
    }
    fill_ = 0;
  }

  Codec codec_;
  std::size_t n_;
  std::span<std::byte> out_;
  std::size_t done_ = 0;
  std::size_t fill_ = 0;
  alignas(64) float v_[kChunk];
};

/// The learner's due step in one pass over memory (docs/algorithm.md, "Round timeline",
/// step 3):
///     new_base_i = local_i            (the snapshot that becomes the next base)
///     v_i        = base_i - local_i   (the outer gradient, never stored whole)
///     out        = encode(codec, v)
/// chunk by chunk, v living only in a kChunk-element stack buffer.
/// Reference: std::copy + the subtraction loop of OuterLoop::send_fragment +
/// ddiloco::encode. Throws ShapeMismatch on mismatched sizes and InvalidArgument
/// when int8/int4 meet a non-finite value (as ddiloco::encode does).
/// new_base may not alias base or local.
inline void snapshot_outer_gradient(Codec codec, std::span<const float> local, std::span<const float> base,
                                    std::span<float> new_base, std::span<std::byte> out) {
  const std::size_t n = local.size();
  if (base.size() != n || new_base.size() != n || out.size() != encoded_size(codec, n)) {
    throw ShapeMismatch(ddiloco::detail::msg("fast::snapshot_outer_gradient: local has ", n, " elements, base ",
                                             base.size(), ", new_base ", new_base.size(), ", out ", out.size(),
                                             " bytes (need ", encoded_size(codec, n),
                                             "); pass one fragment's buffers sized with encoded_size()"));
  }
  OuterGradientEncoder enc(codec, n, out);
  enc.add(local.data(), base.data(), new_base.data(), n);
}

/// ddiloco::encode with the block kernels (the learner's send path:
/// wire::encode_frame): the same bytes, the same errors (ShapeMismatch for a
/// wrong output size; InvalidArgument naming the block for a NaN or infinity
/// under int8/int4, raised by the reference, which re-runs only in that case).
inline void encode(Codec codec, std::span<const float> in, std::span<std::byte> out) {
  const std::size_t n = in.size();
  if (out.size() != encoded_size(codec, n)) {
    ddiloco::encode(codec, in, out);  // throws its ShapeMismatch
    return;
  }
  for (std::size_t lo = 0; lo < n; lo += kChunk) {
    const std::size_t len = std::min(kChunk, n - lo);
    if (!encode_range(codec, in.data() + lo, n, lo, len, out.data())) {
      ddiloco::encode(codec, in, out);  // throws InvalidArgument naming the first bad block
      return;
    }
  }
}

}  // namespace ddiloco::fast
