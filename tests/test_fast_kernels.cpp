// Tests for <ddiloco/fast/kernels.hpp>: every optimised kernel against the
// readable reference (<ddiloco/detail/kernels.hpp>, <ddiloco/codec.hpp>, the
// NesterovSGD loop) on random inputs whose sizes straddle the vector width
// (kLanes = 16), the fp32 norm block (256), the quantisation block (64) and the
// decode chunk (4096).
//
// Tolerances: reductions (norms) within 2e-6 relative (the fast kernels sum 16
// fp32 terms per lane before switching to double: <= 16 * 2^-24 ~ 1e-6).
// Element-wise results are compared exactly: the same fp32 operations in the
// same order (our targets do not contract into FMA at baseline x86-64); where a
// platform might, the check uses 1 ulp-scale slack (1e-6 relative + 1e-30).
#include <ddiloco/fast/kernels.hpp>

#include <ddiloco/codec.hpp>
#include <ddiloco/detail/checksum.hpp>
#include <ddiloco/detail/kernels.hpp>
#include <ddiloco/layout.hpp>
#include <ddiloco/outer_optimizer.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <span>
#include <random>
#include <string>
#include <vector>

namespace fast = ddiloco::fast;
using ddiloco::Codec;

namespace {

const std::size_t kSizes[] = {0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000, 4095, 4096, 4097, 8192 + 65};

std::vector<float> random_vector(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

bool close(float a, float b) { return std::fabs(a - b) <= 1e-6f * std::fabs(b) + 1e-30f; }

}  // namespace

TEST_CASE("fast squared_norm matches the double-precision reference within 2e-6 relative", "[fast]") {
  for (const std::size_t n : kSizes) {
    const auto x = random_vector(n, static_cast<std::uint32_t>(n) + 1);
    const double ref = ddiloco::detail::squared_norm(x);
    const double got = fast::squared_norm(x.data(), n);
    INFO("n = " << n);
    CHECK(std::fabs(got - ref) <= 2e-6 * ref);
  }
}

TEST_CASE("fast squared_norm of a 2^20-element vector of ones is exactly 2^20", "[fast]") {
  const std::vector<float> x(std::size_t{1} << 20, 1.0f);
  CHECK(fast::squared_norm(x.data(), x.size()) == 1048576.0);
}

TEST_CASE("fast squared_norm of finite values near the float limit is finite and exact in double; of a non-finite "
          "value it is not finite",
          "[fast]") {
  // 3e38^2 = 9e76 overflows an fp32 lane; the sum must come back in double.
  for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{4096}, std::size_t{10001}}) {
    INFO("n = " << n);
    std::vector<float> x(n, 0.5f);
    x[n / 2] = 3.0e38f;
    const double expected = 9.0e76 + 0.25 * static_cast<double>(n - 1);
    const double got = fast::squared_norm(x.data(), n);
    CHECK(std::isfinite(got));
    CHECK(std::fabs(got - static_cast<double>(3.0e38f) * 3.0e38f) <= 1e-12 * expected);
    x[n / 2] = std::numeric_limits<float>::infinity();
    CHECK_FALSE(std::isfinite(fast::squared_norm(x.data(), n)));
    x[n / 2] = std::numeric_limits<float>::quiet_NaN();
    CHECK_FALSE(std::isfinite(fast::squared_norm(x.data(), n)));
  }
}

TEST_CASE("fast running_mean_update_sq updates the mean like the reference and returns the new mean's squared norm",
          "[fast]") {
  for (const std::size_t n : kSizes) {
    const auto x = random_vector(n, 7);
    const auto start = random_vector(n, 8);
    auto ref = start, got = start;
    ddiloco::detail::running_mean_update(0.3f, 1.7f, x, ref);
    const double sq = fast::running_mean_update_sq(0.3f, 1.7f, x.data(), got.data(), n);
    INFO("n = " << n);
    for (std::size_t i = 0; i < n; ++i) REQUIRE(close(got[i], ref[i]));
    const double ref_sq = ddiloco::detail::squared_norm(ref);
    CHECK(std::fabs(sq - ref_sq) <= 2e-6 * ref_sq);
  }
}

TEST_CASE("fast scale_copy_sq writes s * x and returns its squared norm", "[fast]") {
  for (const std::size_t n : kSizes) {
    const auto x = random_vector(n, 9);
    std::vector<float> ref(n), got(n, 123.0f);
    ddiloco::detail::scale_copy(0.25f, x, ref);
    const double sq = fast::scale_copy_sq(0.25f, x.data(), got.data(), n);
    INFO("n = " << n);
    CHECK(got == ref);  // multiplying by a power of two is exact in both
    const double ref_sq = ddiloco::detail::squared_norm(ref);
    CHECK(std::fabs(sq - ref_sq) <= 2e-6 * ref_sq);
  }
}

TEST_CASE("fast scaled_nesterov equals scale, participation share and NesterovSGD::step done separately", "[fast]") {
  const ddiloco::NesterovSGD opt(0.7f, 0.9f);
  for (const std::size_t n : kSizes) {
    const auto mean = random_vector(n, 11);
    auto theta_ref = random_vector(n, 12), b_ref = random_vector(n, 13);
    auto theta = theta_ref, b = b_ref;
    std::vector<float> delta(n);
    ddiloco::detail::scale_copy(1.3f, mean, delta);
    for (float& d : delta) d *= 0.75f;
    opt.step(theta_ref, delta, b_ref);
    fast::scaled_nesterov(1.3f, 0.75f, mean.data(), 0.9f, 0.7f, theta.data(), b.data(), n);
    INFO("n = " << n);
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(close(theta[i], theta_ref[i]));
      REQUIRE(close(b[i], b_ref[i]));
    }
  }
}

TEST_CASE("fast scaled_nesterov matches a hand-computed first Nesterov step, Theta 1 -> 0.867", "[fast]") {
  // Hand computation (docs/algorithm.md, "Outer optimizer"): Theta = 1, Delta = 0.1, b = 0 -> b = 0.1,
  // Theta = 1 - 0.7 * (0.1 + 0.9 * 0.1) = 1 - 0.133 = 0.867. With c = 0.5 and
  // mean = 0.2 the fused kernel forms the same Delta = 0.1.
  float theta = 1.0f, b = 0.0f;
  const float mean = 0.2f;
  fast::scaled_nesterov(0.5f, 1.0f, &mean, 0.9f, 0.7f, &theta, &b, 1);
  CHECK(b == Approx(0.1f).epsilon(1e-6));
  CHECK(theta == Approx(0.867f).epsilon(1e-6));
}

TEST_CASE("fast decode_range decodes every codec like ddiloco::decode, chunk by chunk", "[fast][codec]") {
  for (const Codec codec : ddiloco::all_codecs) {
    for (const std::size_t n : kSizes) {
      const auto x = random_vector(n, 21, 3.0f);
      const auto bytes = ddiloco::encode(codec, x);
      std::vector<float> ref(n), got(n, -1.0f);
      ddiloco::decode(codec, bytes, ref);
      bool ok = true;
      for (std::size_t lo = 0; lo < n; lo += fast::kChunk) {
        const std::size_t len = std::min(fast::kChunk, n - lo);
        ok &= fast::decode_range(codec, bytes.data(), n, lo, len, got.data() + lo);
      }
      INFO(ddiloco::to_string(codec) << " n = " << n);
      CHECK(ok);
      CHECK(fast::valid_encoding(codec, bytes.data(), n));
      CHECK(got == ref);
    }
  }
}

TEST_CASE("fast fp16 decoding gives the reference's bits for all 65536 patterns, both builds", "[fast][codec][isa]") {
  std::vector<std::byte> bytes(2 * 65536);
  for (std::uint32_t h = 0; h < 65536; ++h) {
    bytes[2 * h] = static_cast<std::byte>(h & 0xFFU);
    bytes[2 * h + 1] = static_cast<std::byte>(h >> 8);
    INFO("h = " << h);
    REQUIRE(std::bit_cast<std::uint32_t>(fast::detail::fp16_to_float_select(h)) ==
            std::bit_cast<std::uint32_t>(ddiloco::detail::fp16_to_float(static_cast<std::uint16_t>(h))));
  }
  for (const bool baseline : {true, false}) {
    fast::use_baseline_kernels(baseline);
    std::vector<float> out(65536);
    for (std::size_t lo = 0; lo < 65536; lo += fast::kChunk)  // the merge's chunks
      REQUIRE(fast::decode_range(Codec::fp16, bytes.data(), 65536, lo, fast::kChunk, out.data() + lo));
    for (std::uint32_t h = 0; h < 65536; ++h) {
      INFO("h = " << h << (baseline ? " baseline" : " best"));
      REQUIRE(std::bit_cast<std::uint32_t>(out[h]) ==
              std::bit_cast<std::uint32_t>(ddiloco::detail::fp16_to_float(static_cast<std::uint16_t>(h))));
    }
  }
  fast::use_baseline_kernels(false);
}

TEST_CASE("fast valid_encoding and decode_range reject what ddiloco::decode rejects", "[fast][codec]") {
  for (const Codec codec : {Codec::int8, Codec::int4}) {
    for (const std::size_t n : {std::size_t{1}, std::size_t{65}, std::size_t{4097}}) {
      const auto x = random_vector(n, 31);
      const auto good = ddiloco::encode(codec, x);
      const std::size_t nb = (n + 63) / 64;
      std::vector<std::vector<std::byte>> corrupt;
      auto negative_scale = good;
      negative_scale[4 * (nb - 1) + 3] |= std::byte{0x80};  // sign bit of the last scale
      corrupt.push_back(negative_scale);
      auto bad_code = good;
      bad_code[4 * nb] = codec == Codec::int8 ? std::byte{0x80} : std::byte{0x08};  // -128 / -8
      corrupt.push_back(bad_code);
      if (codec == Codec::int4 && n % 2 == 1) {
        auto padding = good;
        padding.back() |= std::byte{0x10};  // nonzero padding nibble
        corrupt.push_back(padding);
      }
      for (const auto& bytes : corrupt) {
        std::vector<float> out(n);
        INFO(ddiloco::to_string(codec) << " n = " << n);
        REQUIRE_THROWS_AS(ddiloco::decode(codec, bytes, out), ddiloco::ProtocolError);
        CHECK_FALSE(fast::valid_encoding(codec, bytes.data(), n));
        CHECK_FALSE(fast::decode_range(codec, bytes.data(), n, 0, n, out.data()));
      }
    }
  }
}

TEST_CASE("fast snapshot_outer_gradient copies the snapshot and encodes base - local exactly like the reference",
          "[fast][learner][isa]") {
  for (const bool baseline : {true, false}) {
    fast::use_baseline_kernels(baseline);
    for (const Codec codec : ddiloco::all_codecs) {
      for (const std::size_t n : kSizes) {
        const auto local = random_vector(n, 41);
        const auto base = random_vector(n, 42);
        std::vector<float> v(n);
        for (std::size_t i = 0; i < n; ++i) v[i] = base[i] - local[i];
        const auto ref = ddiloco::encode(codec, v);
        std::vector<float> new_base(n, 0.0f);
        std::vector<std::byte> got(ddiloco::encoded_size(codec, n), std::byte{0xAB});
        fast::snapshot_outer_gradient(codec, local, base, new_base, got);
        INFO(ddiloco::to_string(codec) << " n = " << n << " baseline = " << baseline);
        CHECK(new_base == local);
        CHECK(got == ref);
      }
    }
  }
  fast::use_baseline_kernels(false);
}

TEST_CASE("fast int8 and int4 whole-block encoders quantise exactly like ddiloco::encode, both builds",
          "[fast][learner][codec][isa]") {
  // Blocks built to hit every branch of the quantiser: exact ties x * inv =
  // k + 0.5 (round half to even: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2), the block's
  // largest magnitude negative or positive and at each lane, -0.0, an all-zero
  // block (scale 0, codes 0), magnitudes from 1e-44 (subnormal scales, whose
  // inverse overflows: codes 0) to 1e30, and random blocks.
  // The encoders see base - local with local = 0, so v is exactly the block.
  std::vector<std::vector<float>> blocks;
  for (const float q : {7.0f, 127.0f}) {
    // Largest magnitude q, so the scale is q / q_max = 1 for that codec; the
    // other 63 values are ties t +- 0.5 with |t| <= q - 1.
    const int qi = static_cast<int>(q);
    std::vector<float> ties(64, q);
    for (int j = 1; j < 64; ++j) {
      const int t = (3 * j) % (2 * qi - 1) - (qi - 1);
      ties[static_cast<std::size_t>(j)] = static_cast<float>(t) + (t >= 0 ? 0.5f : -0.5f);
    }
    blocks.push_back(ties);
  }
  for (std::size_t lane = 0; lane < 64; lane += 9) {
    for (const float sign : {1.0f, -1.0f}) {
      auto b = random_vector(64, static_cast<std::uint32_t>(lane) + 7);
      for (float& x : b) x = std::clamp(x, -2.0f, 2.0f);
      b[lane] = 3.0f * sign;
      blocks.push_back(b);
    }
  }
  blocks.push_back(std::vector<float>(64, 0.0f));
  std::vector<float> signed_zero(64, -0.0f);
  signed_zero[5] = 1e-3f;
  blocks.push_back(signed_zero);
  for (const float scale : {1e-30f, 1e-3f, 1.0f, 1e3f, 1e30f}) blocks.push_back(random_vector(64, 11, scale));
  for (const float tiny : {1e-37f, 1e-38f, 1e-39f, 1e-44f}) {  // scale near and below 2^-128 (inverse_scale)
    auto b = random_vector(64, 13, tiny / 3.0f);
    b[17] = tiny;
    blocks.push_back(b);
  }
  std::vector<float> v;
  for (const auto& b : blocks) v.insert(v.end(), b.begin(), b.end());
  const std::size_t n = v.size();
  const std::vector<float> zero(n, 0.0f);
  for (const Codec codec : {Codec::int8, Codec::int4}) {
    const auto ref = ddiloco::encode(codec, v);
    for (const bool baseline : {true, false}) {
      fast::use_baseline_kernels(baseline);
      std::vector<float> new_base(n);
      std::vector<std::byte> got(ref.size(), std::byte{0xAB});
      fast::snapshot_outer_gradient(codec, zero, v, new_base, got);  // v = v - 0
      std::size_t first_diff = n;
      for (std::size_t i = 0; i < got.size() && first_diff == n; ++i) first_diff = got[i] != ref[i] ? i : n;
      INFO(ddiloco::to_string(codec) << " baseline = " << baseline << " first differing byte " << first_diff);
      CHECK(got == ref);
    }
  }
  fast::use_baseline_kernels(false);
}

TEST_CASE("fast encode writes ddiloco::encode's bytes and throws its errors, both builds", "[fast][codec][isa]") {
  for (const bool baseline : {true, false}) {
    fast::use_baseline_kernels(baseline);
    for (const Codec codec : ddiloco::all_codecs) {
      for (const std::size_t n : kSizes) {
        const auto x = random_vector(n, static_cast<std::uint32_t>(n) + 5, 3.0f);
        std::vector<std::byte> got(ddiloco::encoded_size(codec, n), std::byte{0xCD});
        fast::encode(codec, x, got);
        INFO(ddiloco::to_string(codec) << " n = " << n << " baseline = " << baseline);
        CHECK(got == ddiloco::encode(codec, x));
      }
    }
    // A NaN in the third block of the second chunk: the reference's message, naming that block.
    auto x = random_vector(2 * fast::kChunk, 3);
    x[fast::kChunk + 130] = std::numeric_limits<float>::quiet_NaN();
    std::vector<std::byte> out(ddiloco::encoded_size(Codec::int4, x.size()));
    std::string ref_what, got_what;
    try {
      ddiloco::encode(Codec::int4, x, out);
    } catch (const ddiloco::InvalidArgument& e) {
      ref_what = e.what();
    }
    try {
      fast::encode(Codec::int4, x, out);
    } catch (const ddiloco::InvalidArgument& e) {
      got_what = e.what();
    }
    CHECK(got_what == ref_what);
    CHECK(got_what.find("block 66") != std::string::npos);
    std::vector<std::byte> short_out(out.size() - 1);
    CHECK_THROWS_AS(fast::encode(Codec::int4, x, short_out), ddiloco::ShapeMismatch);
  }
  fast::use_baseline_kernels(false);
}

TEST_CASE("fast OuterGradientEncoder fed tensor by tensor writes the snapshot and encode(base - theta), both builds",
          "[fast][learner][isa]") {
  // A fragment of tensors whose boundaries fall inside quantisation blocks and
  // across decode chunks (sizes 0, 1, 63, 4095, ...), some "staged" (theta
  // already copied into next, as OuterLoop does for device tensors).
  const std::size_t sizes[] = {0, 1, 63, 100, 4095, 2, 4097, 64, 0, 777};
  std::size_t n = 0;
  for (const std::size_t k : sizes) n += k;
  const auto theta = random_vector(n, 71), base = random_vector(n, 72);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = base[i] - theta[i];
  for (const bool baseline : {true, false}) {
    fast::use_baseline_kernels(baseline);
    for (const Codec codec : ddiloco::all_codecs) {
      std::vector<float> next(n, -1.0f);
      std::vector<std::byte> got(ddiloco::encoded_size(codec, n), std::byte{0xAB});
      fast::OuterGradientEncoder enc(codec, n, got);
      std::size_t off = 0, k = 0;
      for (const std::size_t len : sizes) {
        if (k++ % 2 == 1) {  // staged: the snapshot is in next already
          std::copy_n(theta.begin() + static_cast<std::ptrdiff_t>(off), len, next.begin() + static_cast<std::ptrdiff_t>(off));
          enc.add(next.data() + off, base.data() + off, next.data() + off, len);
        } else {
          enc.add(theta.data() + off, base.data() + off, next.data() + off, len);
        }
        off += len;
      }
      INFO(ddiloco::to_string(codec) << " baseline = " << baseline);
      CHECK(enc.done() == n);
      CHECK(next == theta);
      CHECK(got == ddiloco::encode(codec, v));
      CHECK_THROWS_AS(enc.add(theta.data(), base.data(), next.data(), 1), ddiloco::InvalidArgument);  // one too many
    }
  }
  fast::use_baseline_kernels(false);
  std::vector<std::byte> short_out(ddiloco::encoded_size(Codec::int4, n) - 1);
  CHECK_THROWS_AS(fast::OuterGradientEncoder(Codec::int4, n, short_out), ddiloco::ShapeMismatch);
}

TEST_CASE("fast snapshot_outer_gradient rejects wrong sizes and non-finite values for quantised codecs",
          "[fast][learner]") {
  std::vector<float> local(100, 1.0f), base(100, 2.0f), new_base(100);
  std::vector<std::byte> out(ddiloco::encoded_size(Codec::int4, 100));
  std::vector<std::byte> short_out(out.size() - 1);
  CHECK_THROWS_AS(fast::snapshot_outer_gradient(Codec::int4, local, base, new_base, short_out), ddiloco::ShapeMismatch);
  std::vector<float> short_base(99);
  CHECK_THROWS_AS(fast::snapshot_outer_gradient(Codec::int4, local, short_base, new_base, out), ddiloco::ShapeMismatch);
  local[70] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(fast::snapshot_outer_gradient(Codec::int4, local, base, new_base, out), ddiloco::InvalidArgument);
}

TEST_CASE("fast encoded_squared_norm of any element range matches the squared norm of the decoded values",
          "[fast][codec]") {
  // Tolerance 2e-6 relative: the integer path skips the fp32 rounding of q * s
  // (~6e-8 per element) and sums in a different order.
  for (const Codec codec : ddiloco::all_codecs) {
    const std::size_t n = 4097 + 64;
    const auto x = random_vector(n, 51, 2.0f);
    const auto bytes = ddiloco::encode(codec, x);
    std::vector<float> decoded(n);
    ddiloco::decode(codec, bytes, decoded);
    const std::pair<std::size_t, std::size_t> ranges[] = {{0, n}, {0, 1}, {1, 63}, {63, 2}, {64, 64}, {65, 1000},
                                                          {100, 4000}, {n - 1, 1}, {n - 65, 65}, {5, 0}};
    for (const auto& [lo, len] : ranges) {
      const double ref = ddiloco::detail::squared_norm(std::span<const float>(decoded).subspan(lo, len));
      const double got = fast::encoded_squared_norm(codec, bytes.data(), n, lo, len);
      INFO(ddiloco::to_string(codec) << " lo = " << lo << " len = " << len);
      CHECK(std::fabs(got - ref) <= 2e-6 * ref);
    }
  }
}

TEST_CASE("fast kernels give bit-identical results with the baseline and the AVX2 builds", "[fast][isa]") {
  // Same operations in the same order, no FMA in either build: exact equality.
  // On a CPU without AVX2 both runs use the baseline build and trivially agree.
  for (const std::size_t n : kSizes) {
    const auto x = random_vector(n, 61), start = random_vector(n, 62);
    const auto bytes = ddiloco::encode(Codec::int4, x);
    struct Out {
      double sq, upd_sq, copy_sq;
      std::vector<float> mean, copy, theta, b, decoded;
    };
    auto run = [&](bool baseline) {
      fast::use_baseline_kernels(baseline);
      Out o{0, 0, 0, start, std::vector<float>(n), start, x, std::vector<float>(n)};
      o.sq = fast::squared_norm(x.data(), n);
      o.upd_sq = fast::running_mean_update_sq(0.3f, 1.7f, x.data(), o.mean.data(), n);
      o.copy_sq = fast::scale_copy_sq(0.3f, x.data(), o.copy.data(), n);
      fast::scaled_nesterov(1.1f, 0.5f, x.data(), 0.9f, 0.7f, o.theta.data(), o.b.data(), n);
      for (std::size_t lo = 0; lo < n; lo += fast::kChunk) {
        fast::decode_range(Codec::int4, bytes.data(), n, lo, std::min(fast::kChunk, n - lo), o.decoded.data() + lo);
      }
      return o;
    };
    const Out base = run(true), best = run(false);
    INFO("n = " << n);
    CHECK(base.sq == best.sq);
    CHECK(base.upd_sq == best.upd_sq);
    CHECK(base.copy_sq == best.copy_sq);
    CHECK(base.mean == best.mean);
    CHECK(base.copy == best.copy);
    CHECK(base.theta == best.theta);
    CHECK(base.b == best.b);
    CHECK(base.decoded == best.decoded);
  }
}

TEST_CASE("fast scale_into, axpy and axpy_store_sq build acc = a0 x0 + a1 x1 + a2 x2 like the loop written out",
          "[fast][batch]") {
  // Element-wise: exactly the fp32 operations written here, in the same order
  // (compared with close(): 1e-6 relative slack in case of FMA contraction).
  // The returned squared norm within 2e-6 relative of a double sum.
  for (const std::size_t n : kSizes) {
    const auto x0 = random_vector(n, 71), x1 = random_vector(n, 72), x2 = random_vector(n, 73);
    const float a0 = 0.25f, a1 = -1.5f, a2 = 3.0f;
    std::vector<float> acc(n), mean(n, -7.0f);
    fast::scale_into(a0, x0.data(), acc.data(), n);
    fast::axpy(a1, x1.data(), acc.data(), n);
    const double sq = fast::axpy_store_sq(a2, x2.data(), acc.data(), mean.data(), n);
    double ref_sq = 0.0;
    bool all_close = true;
    for (std::size_t i = 0; i < n; ++i) {
      float r = a0 * x0[i];
      r += a1 * x1[i];
      r = r + a2 * x2[i];
      all_close &= close(mean[i], r);
      ref_sq += static_cast<double>(r) * static_cast<double>(r);
    }
    INFO("n = " << n);
    CHECK(all_close);
    CHECK(std::fabs(sq - ref_sq) <= 2e-6 * ref_sq);
  }
}

TEST_CASE("fast checked_encoded_squared_norm gives encoded_squared_norm and flags exactly the corrupt payloads",
          "[fast][codec][batch]") {
  for (const Codec codec : ddiloco::all_codecs) {
    for (const std::size_t n : {std::size_t{1}, std::size_t{63}, std::size_t{65}, std::size_t{4097}, std::size_t{8257}}) {
      const auto x = random_vector(n, 81, 2.0f);
      const auto bytes = ddiloco::encode(codec, x);
      // Covering [0, n) with uneven pieces, as the merge does per tensor.
      bool valid = true;
      double sum = 0.0;
      for (std::size_t lo = 0; lo < n; lo += 37) {
        const std::size_t len = std::min<std::size_t>(37, n - lo);
        sum += fast::checked_encoded_squared_norm(codec, bytes.data(), n, lo, len, valid);
      }
      const double ref = fast::encoded_squared_norm(codec, bytes.data(), n, 0, n);
      INFO(ddiloco::to_string(codec) << " n = " << n);
      CHECK(valid);
      CHECK(std::fabs(sum - ref) <= 2e-6 * ref);
      if (codec != Codec::int8 && codec != Codec::int4) continue;
      const std::size_t nb = ddiloco::detail::quant_blocks(n);
      // A corrupt code in the last element and a negative scale in the last block.
      auto bad_code = bytes;
      if (codec == Codec::int8) {
        bad_code[4 * nb + n - 1] = std::byte{0x80};
      } else {
        bad_code[4 * nb + (n - 1) / 2] = (n - 1) % 2 == 0 ? std::byte{0x08} : std::byte{0x80};
      }
      auto bad_scale = bytes;
      bad_scale[4 * (nb - 1) + 3] = std::byte{0x80};  // sign bit of the last scale (little-endian)
      if (std::bit_cast<float>(ddiloco::detail::load_u32(bad_scale.data() + 4 * (nb - 1))) == 0.0f) continue;
      for (const auto* corrupt : {&bad_code, &bad_scale}) {
        REQUIRE_FALSE(fast::valid_encoding(codec, corrupt->data(), n));
        bool ok = true;
        for (std::size_t lo = 0; lo < n; lo += 37) {
          (void)fast::checked_encoded_squared_norm(codec, corrupt->data(), n, lo, std::min<std::size_t>(37, n - lo), ok);
        }
        CHECK_FALSE(ok);
      }
    }
  }
}

TEST_CASE("fast checked_norms_and_checksum takes every tensor's norm and the payload CRC in one scan and names what "
          "is wrong",
          "[fast][codec][batch]") {
  using fast::PayloadCheck;
  for (const Codec codec : ddiloco::all_codecs) {
    // Sizes around the piece (kCheckPiece elements), odd ones, and a layout
    // whose tensors start and end inside pieces.
    for (const std::size_t n : {std::size_t{1}, std::size_t{65}, fast::kCheckPiece - 1, fast::kCheckPiece + 1,
                                3 * fast::kCheckPiece + 777}) {
      const auto x = random_vector(n, 91, 1.5f);
      const auto bytes = ddiloco::encode(codec, x);
      const std::uint32_t crc = ddiloco::detail::crc32c(bytes);
      std::vector<ddiloco::TensorSegment> segs;
      for (std::size_t lo = 0, k = 0; lo < n; ++k) {
        const std::size_t len = std::min(n - lo, 1 + (k * 7919 + 3) % (fast::kCheckPiece + 500));
        segs.push_back({lo, len, false});
        lo += len;
      }
      INFO(ddiloco::to_string(codec) << " n = " << n << ", " << segs.size() << " tensors");
      std::vector<double> sq(segs.size(), -1.0);
      REQUIRE(fast::checked_norms_and_checksum(codec, std::span<const std::byte>(bytes), n, segs, sq, crc) ==
              PayloadCheck::ok);
      for (std::size_t t = 0; t < segs.size(); ++t) {
        const double ref = fast::encoded_squared_norm(codec, bytes.data(), n, segs[t].offset, segs[t].size);
        CHECK(std::fabs(sq[t] - ref) <= 2e-6 * ref);  // the kernels sum blocks of floats in float (as above)
      }
      // Without a checksum to compare: the same norms, no CRC check.
      std::vector<double> sq2(segs.size(), -1.0);
      CHECK(fast::checked_norms_and_checksum(codec, std::span<const std::byte>(bytes), n, segs, sq2, std::nullopt) ==
            PayloadCheck::ok);
      CHECK(sq2 == sq);
      // One bit flipped anywhere (first byte: a scale for int8/int4; middle; last) fails the checksum.
      for (const std::size_t at : {std::size_t{0}, bytes.size() / 2, bytes.size() - 1}) {
        auto flipped = bytes;
        flipped[at] ^= std::byte{0x02};
        CHECK(fast::checked_norms_and_checksum(codec, std::span<const std::byte>(flipped), n, segs, sq, crc) ==
              PayloadCheck::bad_checksum);
        CHECK(fast::checked_norms_and_checksum(codec, std::span<const std::byte>(flipped), n, segs, sq,
                                               ddiloco::detail::crc32c(flipped)) != PayloadCheck::bad_checksum);
      }
      if (codec != Codec::int8 && codec != Codec::int4) continue;
      // An invalid code with a checksum that matches it: bad_encoding, wherever it is.
      const std::size_t nb = ddiloco::detail::quant_blocks(n);
      auto bad = bytes;
      bad[4 * nb + (n - 1) / (codec == Codec::int8 ? 1 : 2)] = codec == Codec::int8 || (n - 1) % 2 == 1
                                                                    ? std::byte{0x80}
                                                                    : std::byte{0x08};
      REQUIRE_FALSE(fast::valid_encoding(codec, bad.data(), n));
      CHECK(fast::checked_norms_and_checksum(codec, std::span<const std::byte>(bad), n, segs, sq,
                                             ddiloco::detail::crc32c(bad)) == PayloadCheck::bad_encoding);
      CHECK(fast::checked_norms_and_checksum(codec, std::span<const std::byte>(bad), n, segs, sq, std::nullopt) ==
            PayloadCheck::bad_encoding);
    }
  }
}

TEST_CASE("fast int8 and int4 whole-block kernels decode and take norms like the reference, baseline and AVX2 builds",
          "[fast][codec][isa]") {
  // Sizes with whole blocks, a partial last block and odd lengths; values up
  // to 3 sigma so every code from -Q to Q occurs. Decode exactly equal to
  // ddiloco::decode; norms within 2e-6 relative of the double sum of the decoded
  // values, and bit-identical between the two builds (integer sums of q^2).
  const std::size_t sizes[] = {64, 65, 127, 128, 129, 1000, 4096, 4096 + 64 + 1, 8192 + 63};
  for (const Codec codec : {Codec::int8, Codec::int4}) {
    for (const std::size_t n : sizes) {
      const auto x = random_vector(n, static_cast<std::uint32_t>(n) + 91, 1.0f);
      const auto bytes = ddiloco::encode(codec, x);
      std::vector<float> ref(n);
      ddiloco::decode(codec, bytes, ref);
      const double ref_sq = ddiloco::detail::squared_norm(ref);
      double sq[2] = {0.0, 0.0};
      for (const bool baseline : {true, false}) {
        fast::use_baseline_kernels(baseline);
        std::vector<float> got(n, -1.0f);
        bool ok = true;
        for (std::size_t lo = 0; lo < n; lo += fast::kChunk) {
          ok &= fast::decode_range(codec, bytes.data(), n, lo, std::min(fast::kChunk, n - lo), got.data() + lo);
        }
        bool valid = true;
        const double checked = fast::checked_encoded_squared_norm(codec, bytes.data(), n, 0, n, valid);
        sq[baseline ? 0 : 1] = fast::encoded_squared_norm(codec, bytes.data(), n, 0, n);
        INFO(ddiloco::to_string(codec) << " n = " << n << " baseline = " << baseline);
        CHECK(ok);
        CHECK(valid);
        CHECK(got == ref);
        CHECK(checked == sq[baseline ? 0 : 1]);
        CHECK(std::fabs(sq[baseline ? 0 : 1] - ref_sq) <= 2e-6 * ref_sq);
      }
      fast::use_baseline_kernels(false);
      CHECK(sq[0] == sq[1]);
    }
  }
}

TEST_CASE("fast int8 and int4 whole-block kernels flag an invalid code at every position of a block, both builds",
          "[fast][codec][isa]") {
  // Two whole blocks (n = 128): the invalid code (-128 / nibble 8) is put at
  // each element of the second block in turn; decode_range and the checked
  // norm must both report it, and the untouched payload must pass.
  const std::size_t n = 128;
  for (const Codec codec : {Codec::int8, Codec::int4}) {
    const auto x = random_vector(n, 97);
    const auto good = ddiloco::encode(codec, x);
    const std::size_t codes = 4 * ddiloco::detail::quant_blocks(n);
    for (const bool baseline : {true, false}) {
      fast::use_baseline_kernels(baseline);
      std::vector<float> out(n);
      bool valid = true;
      (void)fast::checked_encoded_squared_norm(codec, good.data(), n, 0, n, valid);
      CHECK(valid);
      CHECK(fast::decode_range(codec, good.data(), n, 0, n, out.data()));
      std::size_t missed_decode = 0, missed_norm = 0;
      for (std::size_t e = 64; e < n; ++e) {
        auto bad = good;
        if (codec == Codec::int8) {
          bad[codes + e] = std::byte{0x80};
        } else {
          const auto byte = std::to_integer<unsigned>(bad[codes + e / 2]);
          const unsigned patched = e % 2 == 0 ? (byte & 0xF0U) | 0x08U : (byte & 0x0FU) | 0x80U;  // nibble 8 = -8
          bad[codes + e / 2] = std::byte(static_cast<unsigned char>(patched));
        }
        missed_decode += fast::decode_range(codec, bad.data(), n, 0, n, out.data()) ? 1 : 0;
        bool ok = true;
        (void)fast::checked_encoded_squared_norm(codec, bad.data(), n, 64, 64, ok);
        missed_norm += ok ? 1 : 0;
      }
      INFO(ddiloco::to_string(codec) << " baseline = " << baseline);
      CHECK(missed_decode == 0);
      CHECK(missed_norm == 0);
    }
    fast::use_baseline_kernels(false);
  }
}

TEST_CASE("fast fp32 payloads are read in place when aligned and decoded otherwise, with the same norms",
          "[fast][codec]") {
  const auto x = random_vector(5000, 17);
  const auto bytes = ddiloco::encode(Codec::fp32, x);
  std::vector<std::byte> shifted(bytes.size() + 1);
  std::copy(bytes.begin(), bytes.end(), shifted.begin() + 1);
  const std::byte* odd = shifted.data() + 1;
  CHECK(fast::fp32_in_place(Codec::fp32, bytes.data()) == reinterpret_cast<const float*>(bytes.data()));
  CHECK(fast::fp32_in_place(Codec::fp32, odd) == nullptr);
  CHECK(fast::fp32_in_place(Codec::bf16, bytes.data()) == nullptr);
  for (const auto& [lo, len] : {std::pair<std::size_t, std::size_t>{0, 5000}, {64, 4096}, {4096, 904}}) {
    const double ref = ddiloco::detail::squared_norm(std::span<const float>(x).subspan(lo, len));
    const double aligned = fast::encoded_squared_norm(Codec::fp32, bytes.data(), x.size(), lo, len);
    const double unaligned = fast::encoded_squared_norm(Codec::fp32, odd, x.size(), lo, len);
    INFO("lo = " << lo << " len = " << len);
    CHECK(std::fabs(aligned - ref) <= 2e-6 * ref);
    CHECK(std::fabs(aligned - unaligned) <= 1e-12 * aligned);  // the same fp32 blocks, added in another order
  }
}
