// ddiloco/codec.hpp: payload codecs for fragments and outer gradients on the wire.
//
// What it is: five byte formats for a vector of fp32 values (fp32, bf16, fp16,
// int8 and int4 with per-block scales), their exact sizes, encoders, validating
// decoders, and the learner-side error-feedback encoder that carries each
// send's quantisation residual into the next send of the same fragment.
// What it is not: a frame format (see wire.hpp), nor a transport. Nothing here
// allocates on the encode/decode path except ErrorFeedbackEncoder's residuals.
//
// # Formats (every multi-byte value little-endian, whatever the machine)
// n = number of elements, B = kQuantBlock = 64, nb = ceil(n / B).
//   fp32  4n bytes: the IEEE binary32 bit patterns, bit-exact (NaN, inf, -0 kept).
//   bf16  2n bytes: the upper 16 bits of binary32 after round-to-nearest-even on
//         the lower 16 (overflow rounds to +-inf). NaN stays NaN (quiet bit set,
//         sign and upper payload kept); subnormals are rounded like any value.
//   fp16  2n bytes: IEEE binary16, round-to-nearest-even. |x| >= 65520 -> +-inf;
//         results below 2^-14 are binary16 subnormals (step 2^-24); |x| <= 2^-25
//         -> +-0. NaN -> quiet NaN with sign and the upper 10 payload bits kept.
//   int8  4*nb + n bytes: nb fp32 scales, then n signed bytes q.
//   int4  4*nb + ceil(n/2) bytes: nb fp32 scales, then the codes packed two per
//         byte: element 2i in the low nibble of byte i, element 2i+1 in the high
//         nibble, each a two's-complement 4-bit value. For odd n the unused high
//         nibble of the last byte is 0.
// Block quantisation (int8: Q = 127, int4: Q = 7), for block b holding x_j:
//   s_b = max_j |x_j| / Q                       (fp32; s_b = 0 for an all-zero block)
//   q_j = clamp(round_half_even(x_j / s_b), -Q, Q)   (q_j = 0 when s_b = 0)
//   decoded x'_j = q_j * s_b, so |x_j - x'_j| <= s_b / 2 (+ fp32 rounding).
// Symmetric absmax quantisation as used for the int4 outer gradients of the
// DiLoCo papers (docs/algorithm.md, "Codecs and error feedback"); -128 / -8 are never produced.
// The int codecs reject non-finite inputs (InvalidArgument): a NaN or inf would
// poison a whole block's scale.
//
// # Decoding never trusts the bytes
// `decode` checks the byte count against encoded_size(codec, out.size()), that
// every scale is finite and >= 0, that no code is -128 / -8 (never written by
// the encoder) and that int4's padding nibble is 0; any failure is a
// ProtocolError. `detail::try_decode` is the same check without exceptions, for
// the frame decoder.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <ddiloco/error.hpp>

namespace ddiloco {

enum class Codec : std::uint8_t { fp32 = 0, bf16 = 1, fp16 = 2, int8 = 3, int4 = 4 };

inline constexpr Codec all_codecs[] = {Codec::fp32, Codec::bf16, Codec::fp16, Codec::int8, Codec::int4};

/// Elements per fp32 scale in the int8 and int4 formats.
inline constexpr std::size_t kQuantBlock = 64;

constexpr std::string_view to_string(Codec c) noexcept {
  switch (c) {
    case Codec::fp32: return "fp32";
    case Codec::bf16: return "bf16";
    case Codec::fp16: return "fp16";
    case Codec::int8: return "int8";
    case Codec::int4: return "int4";
  }
  return "unknown";
}

/// The codec named `name` ("fp32", "bf16", "fp16", "int8", "int4"); throws
/// InvalidArgument naming the value and the choices otherwise.
inline Codec parse_codec(std::string_view name) {
  for (Codec c : all_codecs)
    if (to_string(c) == name) return c;
  throw InvalidArgument(detail::msg("unknown codec '", name, "': expected fp32, bf16, fp16, int8 or int4"));
}

/// True iff `raw` is the value of one of the Codec enumerators.
constexpr bool is_valid_codec(std::uint8_t raw) noexcept { return raw <= static_cast<std::uint8_t>(Codec::int4); }

namespace detail {

/// Largest element count any codec accepts (keeps every size computation far from overflow).
inline constexpr std::uint64_t kMaxCodecElements = std::uint64_t{1} << 60;

constexpr std::uint64_t quant_blocks(std::uint64_t n) noexcept { return (n + kQuantBlock - 1) / kQuantBlock; }

/// encoded_size without exceptions; 0 with `ok = false` when n is too large or the codec unknown.
constexpr std::uint64_t encoded_size_unchecked(Codec c, std::uint64_t n, bool& ok) noexcept {
  ok = n <= kMaxCodecElements;
  if (!ok) return 0;
  switch (c) {
    case Codec::fp32: return 4 * n;
    case Codec::bf16:
    case Codec::fp16: return 2 * n;
    case Codec::int8: return 4 * quant_blocks(n) + n;
    case Codec::int4: return 4 * quant_blocks(n) + (n + 1) / 2;
  }
  ok = false;
  return 0;
}

// ---- little-endian scalar access ------------------------------------------

inline void store_u16(std::byte* p, std::uint16_t v) noexcept {
  p[0] = static_cast<std::byte>(v & 0xFFU);
  p[1] = static_cast<std::byte>(v >> 8);
}
inline std::uint16_t load_u16(const std::byte* p) noexcept {
  return static_cast<std::uint16_t>(std::to_integer<std::uint16_t>(p[0]) |
                                    (std::to_integer<std::uint16_t>(p[1]) << 8));
}
inline void store_u32(std::byte* p, std::uint32_t v) noexcept {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(p, &v, 4);
  } else {
    for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFU);
  }
}
inline std::uint32_t load_u32(const std::byte* p) noexcept {
  std::uint32_t v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, 4);
  } else {
    for (int i = 0; i < 4; ++i) v |= std::to_integer<std::uint32_t>(p[i]) << (8 * i);
  }
  return v;
}
inline void store_u64(std::byte* p, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFU);
}
inline std::uint64_t load_u64(const std::byte* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= std::to_integer<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

// ---- half-precision conversions, written out bit by bit --------------------

/// binary32 -> bfloat16, round to nearest, ties to even. NaN stays a quiet NaN.
constexpr std::uint16_t float_to_bf16(float x) noexcept {
  const std::uint32_t f = std::bit_cast<std::uint32_t>(x);
  if ((f & 0x7FFFFFFFU) > 0x7F800000U) return static_cast<std::uint16_t>((f >> 16) | 0x0040U);
  // Add 0x7FFF plus the lowest kept bit: a tie rounds up only when that bit is odd.
  const std::uint32_t rounded = f + 0x7FFFU + ((f >> 16) & 1U);
  return static_cast<std::uint16_t>(rounded >> 16);
}

constexpr float bf16_to_float(std::uint16_t h) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

/// binary32 -> binary16, round to nearest, ties to even (IEEE 754 section 4.3.1).
constexpr std::uint16_t float_to_fp16(float x) noexcept {
  const std::uint32_t f = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((f >> 16) & 0x8000U);
  const std::uint32_t a = f & 0x7FFFFFFFU;
  if (a > 0x7F800000U) return static_cast<std::uint16_t>(sign | 0x7E00U | ((a >> 13) & 0x3FFU));  // NaN
  if (a >= 0x47800000U) return static_cast<std::uint16_t>(sign | 0x7C00U);  // >= 2^16 or inf -> inf
  if (a >= 0x38800000U) {
    // Normal binary16 (|x| >= 2^-14): rebias the exponent by 127 - 15 = 112 and
    // drop 13 mantissa bits with ties to even. A carry out of the mantissa bumps
    // the exponent, which is exactly right (and gives inf above 65504 + 16).
    std::uint32_t m = a - (112U << 23);
    m += 0xFFFU + ((m >> 13) & 1U);
    return static_cast<std::uint16_t>(sign | (m >> 13));
  }
  if (a <= 0x33000000U) return sign;  // |x| <= 2^-25: rounds to +-0 (2^-25 is a tie to even 0)
  // Subnormal binary16: code = |x| / 2^-24 rounded. |x| = mant * 2^(e - 150) with
  // the implicit bit, so code = mant * 2^(e - 126), a right shift by 126 - e in [14, 23].
  const std::uint32_t e = a >> 23;
  const std::uint32_t mant = (a & 0x7FFFFFU) | 0x800000U;
  const std::uint32_t shift = 126U - e;
  std::uint32_t q = mant >> shift;
  const std::uint32_t rem = mant & ((1U << shift) - 1U);
  const std::uint32_t half = 1U << (shift - 1U);
  if (rem > half || (rem == half && (q & 1U) != 0U)) ++q;  // may reach 0x400: the smallest normal
  return static_cast<std::uint16_t>(sign | q);
}

constexpr float fp16_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t e = (h >> 10) & 0x1FU;
  const std::uint32_t mant = h & 0x3FFU;
  if (e == 0) {
    // Zero or subnormal: mant * 2^-24, exact in binary32.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign != 0 ? -v : v;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7F800000U | (mant << 13));  // inf / NaN
  return std::bit_cast<float>(sign | ((e + 112U) << 23) | (mant << 13));
}

// ---- block quantisation ----------------------------------------------------

/// Scale of one block: absmax / Q. Sets `finite = false` on NaN or inf.
inline float block_scale(std::span<const float> x, float q_max, bool& finite) noexcept {
  float m = 0.0f;
  bool ok = true;
  for (float v : x) {
    const float a = std::fabs(v);
    ok &= a <= std::numeric_limits<float>::max();  // false for inf and NaN
    m = a > m ? a : m;
  }
  finite = ok;
  return m / q_max;
}

/// 1 / s for a block scale s, or 0 when s is 0 or so small (below 2^-128, a
/// block whose largest magnitude is under ~1e-38) that 1 / s overflows: such a
/// block is sent as codes 0. With a finite inverse |x * inv| <= q_max (1 + 3 * 2^-24)
/// for every x of the block, so the codes never need the clamp below.
inline float inverse_scale(float s) noexcept {
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  return inv <= std::numeric_limits<float>::max() ? inv : 0.0f;
}

/// round_half_even(x * inv_scale) clamped to [-q_max, q_max]. |x * inv_scale| <= q_max
/// (+ rounding) by construction, far below 2^22, where adding and subtracting
/// 1.5 * 2^23 rounds to an integer in the default (to nearest, ties to even) mode:
/// the sum's ulp is 1. Same result as std::nearbyint, but vectorisable. Needs
/// IEEE arithmetic (no -ffast-math, which may fold the two additions away).
inline int quantise(float x, float inv_scale, int q_max) noexcept {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float r = (x * inv_scale + kRound) - kRound;
  const int q = static_cast<int>(r);
  return std::clamp(q, -q_max, q_max);
}

template <int QMax>
void encode_blocks(std::span<const float> in, std::span<std::byte> out) {
  const std::size_t n = in.size();
  const std::size_t nb = quant_blocks(n);
  std::byte* scales = out.data();
  std::byte* codes = out.data() + 4 * nb;
  for (std::size_t b = 0; b < nb; ++b) {
    const std::size_t lo = b * kQuantBlock;
    const std::size_t len = std::min(kQuantBlock, n - lo);
    const auto block = in.subspan(lo, len);
    bool finite = true;
    const float s = block_scale(block, static_cast<float>(QMax), finite);
    if (!finite) {
      throw InvalidArgument(msg("codec ", QMax == 127 ? "int8" : "int4", ": block ", b,
                                " (elements ", lo, "..", lo + len - 1,
                                ") holds a NaN or infinity; quantised codecs need finite values; "
                                "check the outer gradient or send with fp32/bf16/fp16"));
    }
    store_u32(scales + 4 * b, std::bit_cast<std::uint32_t>(s));
    const float inv = inverse_scale(s);
    if constexpr (QMax == 127) {
      for (std::size_t j = 0; j < len; ++j) {
        codes[lo + j] = static_cast<std::byte>(static_cast<std::uint8_t>(static_cast<std::int8_t>(quantise(block[j], inv, QMax))));
      }
    } else {
      // lo is even (kQuantBlock is even), so pairs never straddle blocks.
      for (std::size_t j = 0; j < len; j += 2) {
        const auto q0 = static_cast<unsigned>(quantise(block[j], inv, QMax)) & 0xFU;
        const auto q1 = j + 1 < len ? static_cast<unsigned>(quantise(block[j + 1], inv, QMax)) & 0xFU : 0U;
        codes[(lo + j) / 2] = static_cast<std::byte>(q0 | (q1 << 4));
      }
    }
  }
}

/// Returns false (out partly written) on a bad scale, a -Q-1 code or nonzero int4 padding.
template <int QMax>
bool decode_blocks(std::span<const std::byte> in, std::span<float> out) noexcept {
  const std::size_t n = out.size();
  const std::size_t nb = quant_blocks(n);
  const std::byte* scales = in.data();
  const std::byte* codes = in.data() + 4 * nb;
  bool ok = true;
  for (std::size_t b = 0; b < nb; ++b) {
    const float s = std::bit_cast<float>(load_u32(scales + 4 * b));
    if (!(s >= 0.0f && s <= std::numeric_limits<float>::max())) return false;  // NaN, inf, negative
    const std::size_t lo = b * kQuantBlock;
    const std::size_t len = std::min(kQuantBlock, n - lo);
    float* o = out.data() + lo;
    if constexpr (QMax == 127) {
      for (std::size_t j = 0; j < len; ++j) {
        const auto q = static_cast<std::int8_t>(std::to_integer<std::uint8_t>(codes[lo + j]));
        ok &= q != -128;
        o[j] = static_cast<float>(q) * s;
      }
    } else {
      for (std::size_t j = 0; j < len; j += 2) {
        const auto byte = std::to_integer<unsigned>(codes[(lo + j) / 2]);
        // Sign-extend each nibble: (v ^ 8) - 8 maps 0..7 -> 0..7 and 8..15 -> -8..-1.
        const int q0 = static_cast<int>((byte & 0xFU) ^ 8U) - 8;
        const int q1 = static_cast<int>((byte >> 4) ^ 8U) - 8;
        ok &= q0 != -8;
        o[j] = static_cast<float>(q0) * s;
        if (j + 1 < len) {
          ok &= q1 != -8;
          o[j + 1] = static_cast<float>(q1) * s;
        } else {
          ok &= q1 == 0;  // padding nibble of an odd-length vector
        }
      }
    }
  }
  return ok;
}

}  // namespace detail

/// Exact byte count of `n` elements in `codec` (see the format table above).
constexpr std::size_t encoded_size(Codec codec, std::size_t n) {
  bool ok = true;
  const std::uint64_t s = detail::encoded_size_unchecked(codec, n, ok);
  if (!ok) {
    throw InvalidArgument(detail::msg("encoded_size: codec ", static_cast<int>(codec), " with ", n,
                                      " elements is unknown or above 2^60 elements; use a Codec "
                                      "enumerator and split the payload"));
  }
  return static_cast<std::size_t>(s);
}

/// Encodes `in` into exactly encoded_size(codec, in.size()) bytes of `out`.
inline void encode(Codec codec, std::span<const float> in, std::span<std::byte> out) {
  const std::size_t need = encoded_size(codec, in.size());
  if (out.size() != need) {
    throw ShapeMismatch(detail::msg("encode(", to_string(codec), "): ", in.size(), " elements need ", need,
                                    " bytes but the output span has ", out.size(),
                                    "; size it with encoded_size()"));
  }
  const std::size_t n = in.size();
  std::byte* o = out.data();
  switch (codec) {
    case Codec::fp32:
      if constexpr (std::endian::native == std::endian::little) {
        if (n != 0) std::memcpy(o, in.data(), 4 * n);
      } else {
        for (std::size_t i = 0; i < n; ++i) detail::store_u32(o + 4 * i, std::bit_cast<std::uint32_t>(in[i]));
      }
      return;
    case Codec::bf16:
      for (std::size_t i = 0; i < n; ++i) detail::store_u16(o + 2 * i, detail::float_to_bf16(in[i]));
      return;
    case Codec::fp16:
      for (std::size_t i = 0; i < n; ++i) detail::store_u16(o + 2 * i, detail::float_to_fp16(in[i]));
      return;
    case Codec::int8: detail::encode_blocks<127>(in, out); return;
    case Codec::int4: detail::encode_blocks<7>(in, out); return;
  }
}

inline std::vector<std::byte> encode(Codec codec, std::span<const float> in) {
  std::vector<std::byte> out(encoded_size(codec, in.size()));
  encode(codec, in, out);
  return out;
}

namespace detail {
/// decode() without exceptions: false if the sizes disagree or the bytes are not
/// a valid encoding (see "Decoding never trusts the bytes"); `out` is then unspecified.
inline bool try_decode(Codec codec, std::span<const std::byte> in, std::span<float> out) noexcept {
  bool ok = true;
  const std::uint64_t need = encoded_size_unchecked(codec, out.size(), ok);
  if (!ok || in.size() != need) return false;
  const std::size_t n = out.size();
  const std::byte* p = in.data();
  switch (codec) {
    case Codec::fp32:
      if constexpr (std::endian::native == std::endian::little) {
        if (n != 0) std::memcpy(out.data(), p, 4 * n);
      } else {
        for (std::size_t i = 0; i < n; ++i) out[i] = std::bit_cast<float>(load_u32(p + 4 * i));
      }
      return true;
    case Codec::bf16:
      for (std::size_t i = 0; i < n; ++i) out[i] = bf16_to_float(load_u16(p + 2 * i));
      return true;
    case Codec::fp16:
      for (std::size_t i = 0; i < n; ++i) out[i] = fp16_to_float(load_u16(p + 2 * i));
      return true;
    case Codec::int8: return decode_blocks<127>(in, out);
    case Codec::int4: return decode_blocks<7>(in, out);
  }
  return false;
}
}  // namespace detail

/// Decodes `in` into `out`; `out.size()` is the element count. Throws
/// ProtocolError when the byte count or the contents are not a valid encoding.
inline void decode(Codec codec, std::span<const std::byte> in, std::span<float> out) {
  bool ok = true;
  const std::uint64_t need = detail::encoded_size_unchecked(codec, out.size(), ok);
  if (!ok || in.size() != need) {
    throw ProtocolError(detail::msg("decode(codec ", static_cast<int>(codec), "): ", in.size(),
                                    " bytes for ", out.size(), " elements, expected ", need,
                                    "; the payload is truncated or was encoded with another codec/length"));
  }
  if (!detail::try_decode(codec, in, out)) {
    throw ProtocolError(detail::msg("decode(", to_string(codec), "): ", out.size(),
                                    " elements hold a negative/non-finite scale, a code outside [-Q, Q] "
                                    "or a nonzero padding nibble; the payload is corrupt, drop it"));
  }
}

/// Learner-side error feedback (EF, as in 1-bit SGD / EF-SGD): per fragment f,
///   v'   = v + r_f                      (carry the previous residual in)
///   send   Q(v')
///   r_f  = v' - dequant(Q(v'))          (what this send failed to deliver)
/// so sum_t dequant(Q(v'_t)) = sum_t v_t - r_f: the total delivered tracks the
/// total intended up to one residual, which stays bounded by one send's
/// quantisation error (int8/int4: |r| <= s/2 per element).
/// Not thread-safe; one encoder per learner.
class ErrorFeedbackEncoder {
 public:
  explicit ErrorFeedbackEncoder(Codec codec) : codec_(codec) {}

  [[nodiscard]] Codec codec() const noexcept { return codec_; }

  /// Encodes v + r_fragment into `out` (encoded_size(codec(), v.size()) bytes)
  /// and updates r_fragment. The first call for a fragment fixes its length.
  void encode(std::uint32_t fragment, std::span<const float> v, std::span<std::byte> out) {
    auto& r = residuals_[fragment];
    if (r.empty()) r.assign(v.size(), 0.0f);
    if (r.size() != v.size()) {
      throw ShapeMismatch(detail::msg("ErrorFeedbackEncoder: fragment ", fragment, " has ", v.size(),
                                      " elements but its residual has ", r.size(),
                                      "; call reset(fragment) if the plan changed"));
    }
    vprime_.resize(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) vprime_[i] = v[i] + r[i];
    ddiloco::encode(codec_, vprime_, out);  // may throw: r is still untouched
    ddiloco::decode(codec_, out, r);        // r = dequant(Q(v'))
    for (std::size_t i = 0; i < v.size(); ++i) r[i] = vprime_[i] - r[i];
  }

  [[nodiscard]] std::vector<std::byte> encode(std::uint32_t fragment, std::span<const float> v) {
    std::vector<std::byte> out(ddiloco::encoded_size(codec_, v.size()));
    encode(fragment, v, out);
    return out;
  }

  /// The residual carried into the next send of `fragment` (empty if none yet).
  [[nodiscard]] std::span<const float> residual(std::uint32_t fragment) const {
    const auto it = residuals_.find(fragment);
    return it == residuals_.end() ? std::span<const float>{} : std::span<const float>(it->second);
  }

  /// Forget a fragment's residual (after a full-state resync, say).
  void reset(std::uint32_t fragment) { residuals_.erase(fragment); }
  void reset() { residuals_.clear(); }

 private:
  Codec codec_;
  std::unordered_map<std::uint32_t, std::vector<float>> residuals_;
  std::vector<float> vprime_;
};

}  // namespace ddiloco
