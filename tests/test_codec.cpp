// Tests for <ddiloco/codec.hpp>: formats checked byte by byte against hand
// encodings, half-precision conversions against hand values and against the
// compiler's own _Float16 conversion, error bounds derived from each format,
// and error feedback.
//
// Measured round-trip error (relative L2, n = 100000, seed 7; see
// "every codec's measured error stays within the bound its format implies"):
//   codec  bytes/elem  Gaussian(0, 1e-3)  Student-t(3) x 1e-3
//   fp32   4.0000      0                  0
//   bf16   2.0000      1.66e-3            1.65e-3
//   fp16   2.0000      2.07e-4            2.04e-4
//   int8   1.0625      5.89e-3            1.03e-2
//   int4   0.5625      1.07e-1            1.80e-1
// (int formats: 4 bytes of scale per 64 elements.)
#include <ddiloco/codec.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

using ddiloco::Codec;
using ddiloco::detail::bf16_to_float;
using ddiloco::detail::float_to_bf16;
using ddiloco::detail::float_to_fp16;
using ddiloco::detail::fp16_to_float;

float from_bits(std::uint32_t b) { return std::bit_cast<float>(b); }
std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }

std::vector<std::byte> bytes_of(std::initializer_list<unsigned> v) {
  std::vector<std::byte> out;
  for (unsigned b : v) out.push_back(static_cast<std::byte>(b));
  return out;
}

std::vector<float> gaussian(std::size_t n, double sigma, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(d(rng));
  return v;
}

/// Student-t with 3 degrees of freedom (finite variance, heavy tails), scaled.
std::vector<float> heavy_tailed(std::size_t n, double scale, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::student_t_distribution<double> d(3.0);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * d(rng));
  return v;
}

std::vector<float> round_trip(Codec c, const std::vector<float>& x) {
  const auto enc = ddiloco::encode(c, x);
  REQUIRE(enc.size() == ddiloco::encoded_size(c, x.size()));
  std::vector<float> y(x.size());
  ddiloco::decode(c, enc, y);
  return y;
}

double rel_l2(const std::vector<float>& x, const std::vector<float>& y) {
  double num = 0.0;
  double den = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double d = static_cast<double>(x[i]) - static_cast<double>(y[i]);
    num += d * d;
    den += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  }
  return std::sqrt(num / den);
}

/// Per-element error bound implied by each format (independent of the codec code):
///   bf16: unit roundoff 2^-8 (8 significant bits); fp16: 2^-11 in the normal
///   range, half a subnormal step 2^-25 below 2^-14; int: s_b / 2 with
///   s_b = absmax_b / Q, plus a few fp32 ulps for the multiply by s_b.
std::vector<double> element_bounds(Codec c, const std::vector<float>& x) {
  std::vector<double> b(x.size(), 0.0);
  const double q = c == Codec::int8 ? 127.0 : 7.0;
  for (std::size_t lo = 0; lo < x.size(); lo += 64) {
    const std::size_t hi = std::min(x.size(), lo + 64);
    double absmax = 0.0;
    for (std::size_t i = lo; i < hi; ++i) absmax = std::max(absmax, std::fabs(static_cast<double>(x[i])));
    for (std::size_t i = lo; i < hi; ++i) {
      const double a = std::fabs(static_cast<double>(x[i]));
      switch (c) {
        case Codec::fp32: b[i] = 0.0; break;
        case Codec::bf16: b[i] = a * 0x1p-8; break;
        case Codec::fp16: b[i] = std::max(a * 0x1p-11, 0x1p-25); break;
        case Codec::int8:
        case Codec::int4: b[i] = absmax / q / 2.0 + absmax * 0x1p-21; break;
      }
    }
  }
  return b;
}

}  // namespace

TEST_CASE("encoded sizes follow the documented format table", "[codec]") {
  using ddiloco::encoded_size;
  CHECK(encoded_size(Codec::fp32, 10) == 40);
  CHECK(encoded_size(Codec::bf16, 10) == 20);
  CHECK(encoded_size(Codec::fp16, 7) == 14);
  CHECK(encoded_size(Codec::int8, 0) == 0);
  CHECK(encoded_size(Codec::int8, 64) == 4 + 64);
  CHECK(encoded_size(Codec::int8, 65) == 8 + 65);
  CHECK(encoded_size(Codec::int4, 1) == 4 + 1);
  CHECK(encoded_size(Codec::int4, 65) == 8 + 33);
  CHECK(encoded_size(Codec::int4, 128) == 8 + 64);
  CHECK_THROWS_AS(encoded_size(Codec::fp32, (std::size_t{1} << 60) + 1), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(encoded_size(static_cast<Codec>(9), 1), ddiloco::InvalidArgument);
}

TEST_CASE("fp32 round trip is bit-exact, NaN payloads, infinities, -0 and subnormals included", "[codec]") {
  const std::vector<float> x = {1.5f, -0.0f, from_bits(0x7FC01234U), from_bits(0x7F800001U),
                                std::numeric_limits<float>::infinity(), from_bits(0x00000001U),
                                std::numeric_limits<float>::max(), -3.25e-20f};
  const auto enc = ddiloco::encode(Codec::fp32, x);
  // Little-endian on the wire: 1.5f = 0x3FC00000.
  CHECK(enc[0] == std::byte{0x00});
  CHECK(enc[2] == std::byte{0xC0});
  CHECK(enc[3] == std::byte{0x3F});
  std::vector<float> y(x.size());
  ddiloco::decode(Codec::fp32, enc, y);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(bits(y[i]) == bits(x[i]));
}

TEST_CASE("bf16 rounds to nearest with ties to even and keeps NaN a NaN", "[codec]") {
  CHECK(float_to_bf16(1.0f) == 0x3F80);
  CHECK(float_to_bf16(from_bits(0x3F807FFFU)) == 0x3F80);  // below the halfway point
  CHECK(float_to_bf16(from_bits(0x3F808000U)) == 0x3F80);  // tie, 0x3F80 is even
  CHECK(float_to_bf16(from_bits(0x3F808001U)) == 0x3F81);  // above the halfway point
  CHECK(float_to_bf16(from_bits(0x3F818000U)) == 0x3F82);  // tie, 0x3F82 is even
  CHECK(float_to_bf16(from_bits(0x40490FDBU)) == 0x4049);  // pi -> 3.140625
  CHECK(bf16_to_float(0x4049) == 3.140625f);
  CHECK(float_to_bf16(-0.0f) == 0x8000);
  CHECK(float_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // overflows to +inf
  CHECK(float_to_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(float_to_bf16(-std::numeric_limits<float>::infinity()) == 0xFF80);
  // A NaN whose payload sits only in the low 16 bits would truncate to inf.
  CHECK(float_to_bf16(from_bits(0x7F800001U)) == 0x7FC0);
  CHECK(float_to_bf16(from_bits(0xFFC00000U)) == 0xFFC0);
  // Subnormals round like any value: 2^-149 -> 0, a tie at 0x8000 -> even 0, 0x18000 -> 2.
  CHECK(float_to_bf16(from_bits(0x00000001U)) == 0x0000);
  CHECK(float_to_bf16(from_bits(0x00008000U)) == 0x0000);
  CHECK(float_to_bf16(from_bits(0x00018000U)) == 0x0002);
  CHECK(bits(bf16_to_float(0x0002)) == 0x00020000U);
}

TEST_CASE("fp16 rounds to nearest with ties to even across normal, subnormal and overflow ranges", "[codec]") {
  CHECK(float_to_fp16(1.0f) == 0x3C00);
  CHECK(float_to_fp16(-2.0f) == 0xC000);
  CHECK(float_to_fp16(0.5f) == 0x3800);
  CHECK(float_to_fp16(from_bits(0x3F801000U)) == 0x3C00);  // 1 + 2^-11: tie, 0x3C00 even
  CHECK(float_to_fp16(from_bits(0x3F803000U)) == 0x3C02);  // 1 + 3*2^-11: tie, 0x3C02 even
  CHECK(float_to_fp16(65504.0f) == 0x7BFF);                // largest finite
  CHECK(float_to_fp16(65519.0f) == 0x7BFF);
  CHECK(float_to_fp16(65520.0f) == 0x7C00);  // tie between 65504 (odd) and 2^16: even is inf
  CHECK(float_to_fp16(1e6f) == 0x7C00);
  CHECK(float_to_fp16(-std::numeric_limits<float>::infinity()) == 0xFC00);
  CHECK(float_to_fp16(std::ldexp(1.0f, -14)) == 0x0400);  // smallest normal
  CHECK(float_to_fp16(std::ldexp(1.0f, -24)) == 0x0001);  // smallest subnormal
  CHECK(float_to_fp16(std::ldexp(1.0f, -25)) == 0x0000);  // tie between 0 and 2^-24: even 0
  CHECK(float_to_fp16(from_bits(0x33000001U)) == 0x0001);  // just above that tie
  CHECK(float_to_fp16(std::ldexp(3.0f, -25)) == 0x0002);  // 1.5 steps: tie, even 2
  CHECK(float_to_fp16(from_bits(0x387FE000U)) == 0x0400);  // 1023.5 steps: tie carries into the normals
  CHECK(float_to_fp16(-0.0f) == 0x8000);
  CHECK(float_to_fp16(from_bits(0x7F800001U)) == 0x7E00);  // NaN stays a (quiet) NaN
  CHECK(fp16_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(fp16_to_float(0x03FF) == 1023.0f * std::ldexp(1.0f, -24));
  CHECK(fp16_to_float(0x7BFF) == 65504.0f);
  CHECK(fp16_to_float(0xFC00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(fp16_to_float(0x7E00)));
  CHECK(bits(fp16_to_float(0x8000)) == 0x80000000U);
}

#if defined(__FLT16_MAX__)
TEST_CASE("fp16 conversions agree with the compiler's _Float16 on every half and on random floats", "[codec]") {
  for (std::uint32_t h = 0; h <= 0xFFFF; ++h) {
    const auto hh = static_cast<std::uint16_t>(h);
    const float ref = static_cast<float>(std::bit_cast<_Float16>(hh));
    const float got = fp16_to_float(hh);
    if (std::isnan(ref)) {
      REQUIRE(std::isnan(got));
    } else {
      REQUIRE(bits(got) == bits(ref));
      REQUIRE(float_to_fp16(got) == hh);  // every half survives the round trip
    }
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 2'000'000; ++i) {
    // Random bit patterns, biased toward the binary16 range (exponents 100..145).
    auto b = static_cast<std::uint32_t>(rng());
    if (i % 2 == 0) b = (b & 0x807FFFFFU) | ((100U + (b % 46U)) << 23);
    const float f = from_bits(b);
    const auto ref = std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
    const auto got = float_to_fp16(f);
    if (std::isnan(f)) {
      REQUIRE((got & 0x7C00U) == 0x7C00U);
      REQUIRE((got & 0x03FFU) != 0U);
    } else {
      REQUIRE(got == ref);
    }
  }
}
#endif

TEST_CASE("int8 quantises a hand-checked block with scale absmax/127 and ties to even", "[codec]") {
  const std::vector<float> x = {127.0f, -63.5f, 0.5f, -127.0f};
  const auto enc = ddiloco::encode(Codec::int8, x);
  // scale 1.0f = 0x3F800000 little-endian, then 127, -64 (tie -> even), 0 (tie -> even), -127.
  CHECK(enc == bytes_of({0x00, 0x00, 0x80, 0x3F, 0x7F, 0xC0, 0x00, 0x81}));
  std::vector<float> y(4);
  ddiloco::decode(Codec::int8, enc, y);
  CHECK(y == std::vector<float>{127.0f, -64.0f, 0.0f, -127.0f});
}

TEST_CASE("int4 packs two codes per byte, low nibble first, and zero-pads odd lengths", "[codec]") {
  // absmax 7 -> scale 1. Codes 7, -4 (-3.5 ties to even), 0, 1, -7.
  const std::vector<float> x = {7.0f, -3.5f, 0.2f, 1.0f, -7.0f};
  const auto enc = ddiloco::encode(Codec::int4, x);
  CHECK(enc == bytes_of({0x00, 0x00, 0x80, 0x3F, 0xC7, 0x10, 0x09}));
  std::vector<float> y(5);
  ddiloco::decode(Codec::int4, enc, y);
  CHECK(y == std::vector<float>{7.0f, -4.0f, 0.0f, 1.0f, -7.0f});
}

TEST_CASE("int4 round trips odd and block-straddling lengths within half a scale step", "[codec]") {
  for (std::size_t n : {1U, 3U, 63U, 64U, 65U, 127U, 129U, 1001U}) {
    const auto x = gaussian(n, 1.0, static_cast<unsigned>(n));
    const auto enc = ddiloco::encode(Codec::int4, x);
    REQUIRE(enc.size() == 4 * ((n + 63) / 64) + (n + 1) / 2);
    if (n % 2 == 1) CHECK((std::to_integer<unsigned>(enc.back()) >> 4) == 0U);
    std::vector<float> y(n);
    ddiloco::decode(Codec::int4, enc, y);
    const auto bound = element_bounds(Codec::int4, x);
    for (std::size_t i = 0; i < n; ++i) REQUIRE(std::fabs(static_cast<double>(x[i]) - y[i]) <= bound[i]);
  }
}

TEST_CASE("all-zero blocks get scale 0 and decode to exact zeros next to non-zero blocks", "[codec]") {
  for (Codec c : {Codec::int8, Codec::int4}) {
    std::vector<float> x(192, 0.0f);
    x[70] = 3.0f;  // only the second block is non-zero
    const auto enc = ddiloco::encode(c, x);
    for (std::size_t k = 0; k < 4; ++k) CHECK(enc[k] == std::byte{0});  // first scale is +0.0f
    const auto y = round_trip(c, x);
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(y[i] == x[i]);  // 3 = absmax: exact
  }
}

TEST_CASE("blocks whose largest magnitude is below ~1e-38 (1/scale overflows) are sent as codes 0", "[codec]") {
  // Before inverse_scale the codes were round(x * inf): an undefined float-to-int
  // conversion. Now they are 0; a block just above the limit still quantises.
  CHECK(ddiloco::detail::inverse_scale(0.0f) == 0.0f);
  CHECK(ddiloco::detail::inverse_scale(1e-40f) == 0.0f);
  CHECK(ddiloco::detail::inverse_scale(0.25f) == 4.0f);
  for (Codec c : {Codec::int8, Codec::int4}) {
    std::vector<float> x(128, 0.0f);
    x[3] = 1e-39f, x[4] = -5e-40f;   // first block: scale 1e-39 / q, below 2^-128
    x[70] = 1e-36f, x[71] = -1e-36f;  // second block: scale ~1e-37, inverse finite
    const auto y = round_trip(c, x);
    for (std::size_t i = 0; i < 64; ++i) CHECK(y[i] == 0.0f);
    CHECK(y[70] > 0.0f);
    CHECK(y[71] < 0.0f);
    CHECK(std::fabs(y[70] - 1e-36f) <= 1e-42f);
  }
}

TEST_CASE("every codec's measured error stays within the bound its format implies", "[codec]") {
  // Relative L2 errors measured here are listed at the top of this file.
  const std::size_t n = 100'000;
  const auto inputs = {gaussian(n, 1e-3, 7), heavy_tailed(n, 1e-3, 7)};
  for (const auto& x : inputs) {
    for (Codec c : ddiloco::all_codecs) {
      CAPTURE(ddiloco::to_string(c));
      const auto y = round_trip(c, x);
      const auto bound = element_bounds(c, x);
      double bound_sq = 0.0;
      double norm_sq = 0.0;
      for (std::size_t i = 0; i < n; ++i) {
        REQUIRE(std::fabs(static_cast<double>(x[i]) - y[i]) <= bound[i]);
        bound_sq += bound[i] * bound[i];
        norm_sq += static_cast<double>(x[i]) * x[i];
      }
      const double err = rel_l2(x, y);
      CHECK(err <= std::sqrt(bound_sq / norm_sq));
      // Uniform rounding error has RMS step/sqrt(12), well below the worst case step/2.
      if (c != Codec::fp32) CHECK(err <= 0.75 * std::sqrt(bound_sq / norm_sq));
      if (c == Codec::fp32) CHECK(err == 0.0);
      UNSCOPED_INFO(ddiloco::to_string(c) << " rel L2 " << err << " bytes/elem "
                                          << static_cast<double>(ddiloco::encoded_size(c, n)) / n);
    }
  }
  CHECK(static_cast<double>(ddiloco::encoded_size(Codec::int4, n)) / n < 0.57);
}

TEST_CASE("int codecs refuse non-finite inputs while float codecs carry them", "[codec]") {
  std::vector<float> x(100, 1.0f);
  x[80] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(ddiloco::encode(Codec::int8, x), ddiloco::InvalidArgument);
  x[80] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(ddiloco::encode(Codec::int4, x), ddiloco::InvalidArgument);
  CHECK(std::isinf(round_trip(Codec::bf16, x)[80]));
  CHECK(std::isinf(round_trip(Codec::fp16, x)[80]));
}

TEST_CASE("encode and decode reject buffers of the wrong size", "[codec]") {
  const std::vector<float> x(10, 1.0f);
  std::vector<std::byte> small(ddiloco::encoded_size(Codec::int8, 10) - 1);
  CHECK_THROWS_AS(ddiloco::encode(Codec::int8, x, small), ddiloco::ShapeMismatch);
  const auto enc = ddiloco::encode(Codec::bf16, x);
  std::vector<float> y(11);
  CHECK_THROWS_AS(ddiloco::decode(Codec::bf16, enc, y), ddiloco::ProtocolError);
  std::vector<float> z(10);
  CHECK_THROWS_AS(ddiloco::decode(Codec::fp32, enc, z), ddiloco::ProtocolError);
}

TEST_CASE("decode rejects scales and codes that no encoder writes", "[codec]") {
  const std::vector<float> x = {1.0f, -2.0f, 3.0f};
  std::vector<float> y(3);
  auto with_scale = [&](Codec c, std::uint32_t scale_bits) {
    auto enc = ddiloco::encode(c, x);
    for (int k = 0; k < 4; ++k) enc[static_cast<std::size_t>(k)] = static_cast<std::byte>((scale_bits >> (8 * k)) & 0xFFU);
    return enc;
  };
  for (Codec c : {Codec::int8, Codec::int4}) {
    CHECK_THROWS_AS(ddiloco::decode(c, with_scale(c, 0x7FC00000U), y), ddiloco::ProtocolError);  // NaN
    CHECK_THROWS_AS(ddiloco::decode(c, with_scale(c, 0x7F800000U), y), ddiloco::ProtocolError);  // inf
    CHECK_THROWS_AS(ddiloco::decode(c, with_scale(c, 0xBF800000U), y), ddiloco::ProtocolError);  // -1
    CHECK_NOTHROW(ddiloco::decode(c, with_scale(c, 0x3F800000U), y));                            // 1
  }
  auto i8 = ddiloco::encode(Codec::int8, x);
  i8[5] = std::byte{0x80};  // -128
  CHECK_THROWS_AS(ddiloco::decode(Codec::int8, i8, y), ddiloco::ProtocolError);
  auto i4 = ddiloco::encode(Codec::int4, x);
  auto i4_bad_code = i4;
  i4_bad_code[4] = (i4_bad_code[4] & std::byte{0xF0}) | std::byte{0x08};  // -8 in element 0
  CHECK_THROWS_AS(ddiloco::decode(Codec::int4, i4_bad_code, y), ddiloco::ProtocolError);
  auto i4_bad_pad = i4;
  i4_bad_pad[5] |= std::byte{0x10};  // padding nibble after element 2
  CHECK_THROWS_AS(ddiloco::decode(Codec::int4, i4_bad_pad, y), ddiloco::ProtocolError);
}

TEST_CASE("error feedback makes the sum of decoded int4 sends track the sum of true vectors", "[codec]") {
  // Outer gradients with a persistent direction plus noise, as in training.
  const std::size_t n = 1000;
  const int sends = 200;
  const auto mean = gaussian(n, 1e-3, 1);
  ddiloco::ErrorFeedbackEncoder ef(Codec::int4);
  std::vector<double> truth(n, 0.0), with_ef(n, 0.0), without_ef(n, 0.0);
  std::vector<float> dec(n);
  double err_at_10 = 0.0;
  auto rel = [&](const std::vector<double>& got) {
    double num = 0.0;
    double den = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      num += (got[i] - truth[i]) * (got[i] - truth[i]);
      den += truth[i] * truth[i];
    }
    return std::sqrt(num / den);
  };
  for (int t = 0; t < sends; ++t) {
    auto v = gaussian(n, 1e-3, static_cast<unsigned>(100 + t));
    for (std::size_t i = 0; i < n; ++i) v[i] += mean[i];
    std::vector<float> vprime = v;  // v' = v + r, computed here from the residual before the send
    const auto r_prev = ef.residual(3);
    for (std::size_t i = 0; i < r_prev.size(); ++i) vprime[i] += r_prev[i];
    ddiloco::decode(Codec::int4, ef.encode(3, v), dec);
    for (std::size_t i = 0; i < n; ++i) with_ef[i] += dec[i];
    const auto plain = round_trip(Codec::int4, v);
    for (std::size_t i = 0; i < n; ++i) {
      without_ef[i] += plain[i];
      truth[i] += v[i];
    }
    // Invariant: sum of sends = sum of inputs - current residual (up to fp32 sums).
    const auto r = ef.residual(3);
    REQUIRE(r.size() == n);
    double max_gap = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      max_gap = std::max(max_gap, std::fabs(with_ef[i] + r[i] - truth[i]));
    }
    REQUIRE(max_gap < 1e-6 * (t + 1));
    // The residual is one quantisation error of v' = v + r: at most half its block's step.
    const auto bound = element_bounds(Codec::int4, vprime);
    for (std::size_t i = 0; i < n; ++i) REQUIRE(std::fabs(static_cast<double>(r[i])) <= bound[i] + 1e-12);
    if (t == 9) err_at_10 = rel(with_ef);
  }
  const double err_ef = rel(with_ef);
  const double err_plain = rel(without_ef);
  CAPTURE(err_at_10, err_ef, err_plain);
  CHECK(err_ef < err_at_10 / 5.0);  // the residual stays bounded while the sum grows
  CHECK(err_ef < err_plain / 5.0);  // without feedback, the bias of each rounding accumulates
}

TEST_CASE("error feedback keeps one residual per fragment and checks lengths", "[codec]") {
  ddiloco::ErrorFeedbackEncoder ef(Codec::int8);
  CHECK(ef.codec() == Codec::int8);
  CHECK(ef.residual(0).empty());
  const auto a = gaussian(100, 1.0, 2);
  (void)ef.encode(0, a);
  (void)ef.encode(1, std::vector<float>(50, 0.25f));
  CHECK(ef.residual(0).size() == 100);
  CHECK(ef.residual(1).size() == 50);
  CHECK_THROWS_AS(ef.encode(0, std::vector<float>(99, 0.0f)), ddiloco::ShapeMismatch);
  std::vector<float> bad(100, 0.0f);
  bad[3] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> before(ef.residual(0).begin(), ef.residual(0).end());
  CHECK_THROWS_AS(ef.encode(0, bad), ddiloco::InvalidArgument);
  CHECK(std::equal(before.begin(), before.end(), ef.residual(0).begin()));  // untouched by the failure
  ef.reset(0);
  CHECK(ef.residual(0).empty());
  CHECK(ef.residual(1).size() == 50);
  ef.reset();
  CHECK(ef.residual(1).empty());

  ddiloco::ErrorFeedbackEncoder exact(Codec::fp32);
  (void)exact.encode(0, a);
  for (float r : exact.residual(0)) CHECK(r == 0.0f);
}
