// Tests for <ddiloco/wire.hpp> and <ddiloco/detail/checksum.hpp>: CRC-32C
// against the published check values, the header layout byte by byte, round
// trips of every message type under every codec, and hostile input: every
// WireError provoked by a crafted frame, truncation at every offset, every
// header byte and bit flipped, huge length fields and random garbage.
#include <ddiloco/wire.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

using ddiloco::Codec;
using ddiloco::DecodeLimits;
using ddiloco::Message;
using ddiloco::MessageType;
using ddiloco::WireError;
using Bytes = std::vector<std::byte>;

constexpr MessageType all_types[] = {MessageType::join,           MessageType::full_state,
                                     MessageType::contribution,   MessageType::global_fragment,
                                     MessageType::heartbeat,      MessageType::leave,
                                     MessageType::join_refused,   MessageType::observe,
                                     MessageType::rejoin,         MessageType::metadata,
                                     MessageType::pull};

bool carries_payload(MessageType t) {
  return t == MessageType::full_state || t == MessageType::contribution || t == MessageType::global_fragment;
}

Bytes bytes_of(std::string_view s) {
  Bytes b;
  for (char c : s) b.push_back(static_cast<std::byte>(c));
  return b;
}

/// Bit-at-a-time CRC-32C straight from the definition (reflected, poly 0x82F63B78).
std::uint32_t crc32c_reference(const Bytes& data) {
  std::uint32_t crc = 0xFFFFFFFFU;
  for (std::byte b : data) {
    crc ^= std::to_integer<std::uint32_t>(b);
    for (int k = 0; k < 8; ++k) crc = (crc & 1U) != 0 ? (crc >> 1) ^ 0x82F63B78U : crc >> 1;
  }
  return ~crc;
}

Message sample(MessageType t, std::size_t n, unsigned seed = 1) {
  Message m;
  m.type = t;
  m.fingerprint = 0x0123456789ABCDEFULL;
  m.learner = 0xA1B2C3D4U;
  m.fragment = t == MessageType::join_refused ? 2 : 17;  // a join_refused's fragment is its reason
  m.version = 1ULL << 40;
  m.sequence = 99;
  m.steps = 30;
  m.tokens = 123456789012LL;
  m.step = 4242;
  if (carries_payload(t) && n > 0) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 1e-2f);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    m.payload = ddiloco::make_payload(std::move(v));
  }
  return m;
}

// Little-endian field access for crafting frames by hand.
void put(Bytes& f, std::size_t off, std::uint64_t v, int width) {
  for (int i = 0; i < width; ++i) f[off + static_cast<std::size_t>(i)] = static_cast<std::byte>((v >> (8 * i)) & 0xFFU);
}
std::uint64_t get(const Bytes& f, std::size_t off, int width) {
  std::uint64_t v = 0;
  for (int i = 0; i < width; ++i) v |= std::to_integer<std::uint64_t>(f[off + static_cast<std::size_t>(i)]) << (8 * i);
  return v;
}

/// Recompute both checksums (with the reference CRC) so a crafted frame passes them.
void reseal(Bytes& f) {
  if (f.size() > ddiloco::kFrameHeaderSize) {
    put(f, 80, crc32c_reference(Bytes(f.begin() + 88, f.end())), 4);
  } else {
    put(f, 80, crc32c_reference({}), 4);
  }
  put(f, 84, crc32c_reference(Bytes(f.begin(), f.begin() + 84)), 4);
}

WireError error_of(const Bytes& f, DecodeLimits limits = {}) {
  const auto r = ddiloco::decode_frame(f, limits);
  REQUIRE_FALSE(r.ok());
  return r.error();
}

void require_same_header(const Message& a, const Message& b) {
  REQUIRE(a.type == b.type);
  REQUIRE(a.fingerprint == b.fingerprint);
  REQUIRE(a.learner == b.learner);
  REQUIRE(a.fragment == b.fragment);
  REQUIRE(a.version == b.version);
  REQUIRE(a.sequence == b.sequence);
  REQUIRE(a.steps == b.steps);
  REQUIRE(a.tokens == b.tokens);
  REQUIRE(a.step == b.step);
  REQUIRE(a.repeat == b.repeat);
}

}  // namespace

TEST_CASE("crc32c matches the published check values and a bit-at-a-time reference", "[wire][checksum]") {
  using ddiloco::detail::crc32c;
  CHECK(crc32c(bytes_of("123456789")) == 0xE3069283U);
  CHECK(crc32c({}) == 0x00000000U);
  // RFC 3720 appendix B.4.
  CHECK(crc32c(Bytes(32, std::byte{0x00})) == 0x8A9136AAU);
  CHECK(crc32c(Bytes(32, std::byte{0xFF})) == 0x62A8AB43U);
  Bytes up(32), down(32);
  for (std::size_t i = 0; i < 32; ++i) {
    up[i] = static_cast<std::byte>(i);
    down[i] = static_cast<std::byte>(31 - i);
  }
  CHECK(crc32c(up) == 0x46DD794EU);
  CHECK(crc32c(down) == 0x113FDB5CU);

  std::mt19937 rng(5);
  for (std::size_t len = 0; len < 300; ++len) {
    Bytes buf(len + 7);
    for (auto& b : buf) b = static_cast<std::byte>(rng() & 0xFFU);
    for (std::size_t shift = 0; shift < 7; shift += 3) {  // unaligned starts
      const Bytes sub(buf.begin() + static_cast<std::ptrdiff_t>(shift),
                      buf.begin() + static_cast<std::ptrdiff_t>(shift + len));
      const std::uint32_t ref = crc32c_reference(sub);
      REQUIRE(crc32c(std::span<const std::byte>(buf).subspan(shift, len)) == ref);
      REQUIRE((ddiloco::detail::crc32c_update_portable(0xFFFFFFFFU, sub) ^ 0xFFFFFFFFU) == ref);
      // Chunked updates equal one pass.
      const std::size_t cut = len / 3;
      std::uint32_t s = ddiloco::detail::crc32c_update(0xFFFFFFFFU, std::span<const std::byte>(sub).first(cut));
      s = ddiloco::detail::crc32c_update(s, std::span<const std::byte>(sub).subspan(cut));
      REQUIRE((s ^ 0xFFFFFFFFU) == ref);
    }
  }
  // Lengths around the hardware path's three-chain blocks (3 x 4096 bytes).
  for (const std::size_t len : {12287, 12288, 12289, 24576 + 5, 100000}) {
    Bytes buf(len);
    for (auto& b : buf) b = static_cast<std::byte>(rng() & 0xFFU);
    INFO("len = " << len);
    const std::uint32_t ref = crc32c_reference(buf);
    CHECK(crc32c(buf) == ref);
    CHECK((ddiloco::detail::crc32c_update_portable(0xFFFFFFFFU, buf) ^ 0xFFFFFFFFU) == ref);
  }
}

TEST_CASE("every CRC-32C implementation the CPU runs agrees with the portable one, from any state", "[wire][checksum]") {
  using namespace ddiloco::detail;
  std::mt19937 rng(11);
  Bytes buf(70000);
  for (auto& b : buf) b = static_cast<std::byte>(rng() & 0xFFU);
  // Lengths around the folding path's 256-byte strides, its 512-byte minimum,
  // its 64-byte tail folds, and the three-chain blocks; starts off alignment.
  std::vector<std::size_t> lengths = {0, 1, 4, 63, 64, 255, 256, 257, 511, 512, 513, 575, 576, 767, 768, 769,
                                      1023, 1024, 1088, 12288, 12289, 65536, 65536 + 77, 69990};
  for (int i = 0; i < 40; ++i) lengths.push_back(rng() % 69990);
  int runs = 0;
  for (const std::size_t len : lengths) {
    for (const std::size_t shift : {0, 1, 5}) {
      const auto sub = std::span<const std::byte>(buf).subspan(shift, len);
      for (const std::uint32_t s : {0xFFFFFFFFU, 0U, static_cast<std::uint32_t>(rng())}) {
        INFO("len = " << len << " shift = " << shift << " state = " << s);
        const std::uint32_t ref = crc32c_update_portable(s, sub);
        REQUIRE(crc32c_update(s, sub) == ref);
#ifdef DDILOCO_CRC32C_HW
        if (crc32c_hw_available()) REQUIRE(crc32c_update_hw(s, sub) == ref);
        if (crc32c_vpclmul_available()) REQUIRE(crc32c_update_vpclmul(s, sub) == ref);
#endif
        ++runs;
      }
    }
  }
  CHECK(runs == static_cast<int>(lengths.size()) * 9);
  // The folding constants are x^k mod P: x^(8n) agrees with crc32c_x8n.
  for (const std::size_t n : {0, 1, 16, 64, 256}) CHECK(crc32c_xpow(8 * n) == crc32c_x8n(n));
}

TEST_CASE("crc32c state shifts: update(s, A || zeros) is the product with x^(8n)", "[wire][checksum]") {
  using namespace ddiloco::detail;
  const Bytes zeros(1000, std::byte{0});
  for (const std::uint32_t s : {0x12345678U, 0xFFFFFFFFU, 1U}) {
    for (const std::size_t n : {0, 1, 7, 8, 999, 1000}) {
      INFO("s = " << s << " n = " << n);
      CHECK(crc32c_multiply(crc32c_x8n(n), s) == crc32c_update_portable(s, std::span<const std::byte>(zeros).first(n)));
    }
  }
  static_assert(crc32c_x8n(0) == 0x80000000U);  // x^0
}

TEST_CASE("the frame header follows the documented little-endian layout", "[wire]") {
  const Message m = sample(MessageType::contribution, 3);
  const Bytes f = ddiloco::encode_frame(m, Codec::int8);
  REQUIRE(f.size() == 88 + 4 + 3);
  CHECK(f[0] == std::byte{'D'});
  CHECK(f[1] == std::byte{'D'});
  CHECK(f[2] == std::byte{'L'});
  CHECK(f[3] == std::byte{'F'});
  CHECK(get(f, 4, 2) == 1);  // protocol version
  CHECK(get(f, 6, 1) == 3);  // contribution
  CHECK(get(f, 7, 1) == 3);  // int8
  CHECK(get(f, 8, 8) == 0x0123456789ABCDEFULL);
  CHECK(f[8] == std::byte{0xEF});  // least significant byte first
  CHECK(get(f, 16, 4) == 0xA1B2C3D4U);
  CHECK(get(f, 20, 4) == 17);
  CHECK(get(f, 24, 8) == (1ULL << 40));
  CHECK(get(f, 32, 8) == 99);
  CHECK(get(f, 40, 8) == 4242);
  CHECK(get(f, 48, 8) == 30);
  CHECK(get(f, 56, 8) == 123456789012ULL);
  CHECK(get(f, 64, 8) == 3);
  CHECK(get(f, 72, 8) == 7);
  CHECK(get(f, 80, 4) == crc32c_reference(Bytes(f.begin() + 88, f.end())));
  CHECK(get(f, 84, 4) == crc32c_reference(Bytes(f.begin(), f.begin() + 84)));
}

TEST_CASE("every message type round trips under every codec", "[wire]") {
  for (MessageType t : all_types) {
    for (Codec c : ddiloco::all_codecs) {
      CAPTURE(ddiloco::to_string(t), ddiloco::to_string(c));
      const Message m = sample(t, 129);
      const Bytes f = ddiloco::encode_frame(m, c);
      const auto r = ddiloco::decode_frame(f);
      REQUIRE(r.ok());
      const Message& d = r.value();
      require_same_header(m, d);
      REQUIRE(d.payload_size() == m.payload_size());
      if (m.payload_size() == 0) {
        REQUIRE(d.payload == nullptr);
        REQUIRE(f.size() == ddiloco::kFrameHeaderSize);
        continue;
      }
      // The payload is exactly what the codec alone makes of it (codec error bounds: test_codec).
      std::vector<float> expect(m.payload_size());
      ddiloco::decode(c, ddiloco::encode(c, std::span<const float>(*m.payload)), expect);
      REQUIRE(*d.payload == expect);
      if (c == Codec::fp32) REQUIRE(*d.payload == *m.payload);
    }
  }
}

TEST_CASE("a null and an empty payload are the same frame and decode to a null payload", "[wire]") {
  Message a = sample(MessageType::full_state, 0);
  Message b = a;
  b.payload = ddiloco::make_payload({});
  CHECK(ddiloco::encode_frame(a, Codec::fp32) == ddiloco::encode_frame(b, Codec::fp32));
  const auto r = ddiloco::decode_frame(ddiloco::encode_frame(b, Codec::int4));
  REQUIRE(r.ok());
  CHECK(r.value().payload == nullptr);
}

TEST_CASE("encode_frame refuses messages no decoder would accept", "[wire]") {
  Message m = sample(MessageType::heartbeat, 0);
  m.payload = ddiloco::make_payload({1.0f});
  CHECK_THROWS_AS(ddiloco::encode_frame(m, Codec::fp32), ddiloco::InvalidArgument);
  m = sample(MessageType::contribution, 4);
  m.steps = -1;
  CHECK_THROWS_AS(ddiloco::encode_frame(m, Codec::fp32), ddiloco::InvalidArgument);
  m = sample(MessageType::contribution, 4);
  m.type = static_cast<MessageType>(10);
  CHECK_THROWS_AS(ddiloco::encode_frame(m, Codec::fp32), ddiloco::InvalidArgument);
  m = sample(MessageType::contribution, 4);
  CHECK_THROWS_AS(ddiloco::encode_frame(m, static_cast<Codec>(7)), ddiloco::InvalidArgument);
  m = sample(MessageType::join_refused, 0);
  m.fragment = 0;  // not a JoinRefusal
  CHECK_THROWS_WITH(ddiloco::encode_frame(m, Codec::fp32), Catch::Contains("JoinRefusal"));
  m = sample(MessageType::observe, 0);
  m.payload = ddiloco::make_payload({1.0f});
  CHECK_THROWS_AS(ddiloco::encode_frame(m, Codec::fp32), ddiloco::InvalidArgument);
}

TEST_CASE("a join_refused carries its reason and the syncer's plan and schedule in documented fields", "[wire]") {
  Message m;
  m.type = MessageType::join_refused;
  m.fingerprint = 0x0123456789abcdefULL;
  m.learner = 3;
  m.fragment = static_cast<std::uint32_t>(ddiloco::JoinRefusal::schedule);
  m.version = 5;        // the syncer's fragment count
  m.step = 125817;      // its parameter count
  m.steps = 24;         // its H
  m.tokens = 2;         // its tau
  m.sequence = 0xfeed;  // the refused join's nonce
  const Bytes f = ddiloco::encode_frame(m, Codec::fp32);
  CHECK(f.size() == ddiloco::kFrameHeaderSize);
  CHECK(get(f, 6, 1) == 7);
  CHECK(get(f, 20, 4) == 2);
  const auto r = ddiloco::decode_frame(f);
  REQUIRE(r.ok());
  require_same_header(m, r.value());
  CHECK(ddiloco::to_string(ddiloco::JoinRefusal::identity) == "identity");
  CHECK(ddiloco::to_string(MessageType::observe) == "observe");
  CHECK(ddiloco::detail::hex16(0x00ab) == "00000000000000ab");
}

TEST_CASE("a rejoin request is framed without a payload as type 9 and a rejoin with elements is refused", "[wire]") {
  Message m = sample(MessageType::rejoin, 0);
  const Bytes f = ddiloco::encode_frame(m, Codec::fp32);
  CHECK(f.size() == ddiloco::kFrameHeaderSize);
  CHECK(get(f, 6, 1) == 9);
  const auto r = ddiloco::decode_frame(f);
  REQUIRE(r.ok());
  require_same_header(m, r.value());
  CHECK(ddiloco::to_string(MessageType::rejoin) == "rejoin");
  m.payload = ddiloco::make_payload({1.0f});
  CHECK_THROWS_AS(ddiloco::encode_frame(m, Codec::fp32), ddiloco::InvalidArgument);
}

TEST_CASE("pull rounds' metadata (type 10) and pull (type 11) are one header each and refuse a payload", "[wire]") {
  for (const auto& [type, raw] : {std::pair{MessageType::metadata, 10}, std::pair{MessageType::pull, 11}}) {
    Message m = sample(type, 0);
    const Bytes f = ddiloco::encode_frame(m, Codec::fp32);
    CHECK(f.size() == ddiloco::kFrameHeaderSize);
    CHECK(get(f, 6, 1) == static_cast<std::uint64_t>(raw));
    const auto r = ddiloco::decode_frame(f);
    REQUIRE(r.ok());
    require_same_header(m, r.value());
    m.payload = ddiloco::make_payload({1.0f});
    CHECK_THROWS_AS(ddiloco::encode_frame(m, Codec::fp32), ddiloco::InvalidArgument);
  }
  CHECK(ddiloco::to_string(MessageType::metadata) == "metadata");
  CHECK(ddiloco::to_string(MessageType::pull) == "pull");
}

TEST_CASE("a second ask (pull) and its answer (contribution) carry `repeat` in bit 31 of the fragment field, and "
          "no other message can",
          "[wire]") {
  for (const MessageType type : {MessageType::pull, MessageType::contribution}) {
    for (const bool repeat : {false, true}) {
      Message m = sample(type, type == MessageType::contribution ? 8 : 0);
      m.repeat = repeat;
      const Bytes f = ddiloco::encode_frame(m, Codec::fp32);
      CHECK(get(f, 20, 4) == (repeat ? 0x8000'0000ULL : 0ULL) + 17);
      const auto r = ddiloco::decode_frame(f);
      REQUIRE(r.ok());
      require_same_header(m, r.value());
      const auto kept = ddiloco::decode_frame_keep_encoded(f, {}, nullptr);
      REQUIRE(kept.ok());
      require_same_header(m, kept.value());
    }
    // An index that would collide with the bit is refused, naming the bound.
    Message big = sample(type, type == MessageType::contribution ? 8 : 0);
    big.fragment = 0x8000'0000U;
    CHECK_THROWS_WITH(ddiloco::encode_frame(big, Codec::fp32), Catch::Contains("below 2^31"));
  }
  // Elsewhere the field is the message's own (a join's shard bits stay as sent), and `repeat` is refused.
  Message join = sample(MessageType::join, 0);
  join.fragment = 0xFFFF'FF02U;
  const auto r = ddiloco::decode_frame(ddiloco::encode_frame(join, Codec::fp32));
  REQUIRE(r.ok());
  CHECK(r.value().fragment == 0xFFFF'FF02U);
  CHECK_FALSE(r.value().repeat);
  for (const MessageType type : all_types) {
    if (type == MessageType::pull || type == MessageType::contribution) continue;
    Message m = sample(type, 0);
    m.repeat = true;
    CHECK_THROWS_WITH(ddiloco::encode_frame(m, Codec::fp32), Catch::Contains("cannot be a repeat"));
  }
}

TEST_CASE("an error-feedback payload is framed as is and decodes to its dequantised values", "[wire]") {
  const Message m = sample(MessageType::contribution, 200);
  ddiloco::ErrorFeedbackEncoder ef(Codec::int4);
  const auto bytes = ef.encode(m.fragment, *m.payload);
  const Bytes f = ddiloco::encode_frame_with_payload(m, Codec::int4, 200, bytes);
  CHECK(Bytes(f.begin() + 88, f.end()) == bytes);
  const auto r = ddiloco::decode_frame(f);
  REQUIRE(r.ok());
  std::vector<float> expect(200);
  ddiloco::decode(Codec::int4, bytes, expect);
  CHECK(*r.value().payload == expect);
  CHECK_THROWS_AS(ddiloco::encode_frame_with_payload(m, Codec::int4, 201, bytes), ddiloco::ShapeMismatch);
}

TEST_CASE("encode_frame_into writes encode_frame's bytes, from an fp32 payload or one the sender encoded", "[wire]") {
  // Payload sizes around the 64 KiB checksum piece (16384 fp32 elements).
  for (const Codec codec : ddiloco::all_codecs) {
    for (const std::size_t n : {std::size_t{0}, std::size_t{5}, std::size_t{16384}, std::size_t{16385}, std::size_t{40000}}) {
      const Message m = sample(MessageType::contribution, n, static_cast<unsigned>(n) + 3);
      const Bytes ref = ddiloco::encode_frame(m, codec);
      INFO(ddiloco::to_string(codec) << " n = " << n);
      REQUIRE(ddiloco::frame_size(m, codec) == ref.size());
      Bytes into(ref.size(), std::byte{0xEE});
      ddiloco::encode_frame_into(m, codec, into);
      CHECK(into == ref);
      // The same contribution handed over encoded (OuterLoop with a contribution codec).
      Message e = m;
      const auto bytes = n == 0 ? Bytes{} : ddiloco::encode(codec, *m.payload);
      e.payload.reset();
      e.encoded = ddiloco::EncodedPayload{codec, n, bytes, nullptr};
      CHECK(ddiloco::frame_size(e, codec) == ref.size());
      Bytes from_encoded(ref.size());
      ddiloco::encode_frame_into(e, codec, from_encoded);
      CHECK(from_encoded == ref);
      const auto r = ddiloco::decode_frame(from_encoded);
      REQUIRE(r.ok());
    }
  }
  const Message m = sample(MessageType::contribution, 100);
  Bytes small(ddiloco::frame_size(m, Codec::int4) - 1);
  CHECK_THROWS_AS(ddiloco::encode_frame_into(m, Codec::int4, small), ddiloco::ShapeMismatch);
  Message e = m;
  const auto int8 = ddiloco::encode(Codec::int8, *m.payload);
  e.payload.reset();
  e.encoded = ddiloco::EncodedPayload{Codec::int8, 100, int8, nullptr};
  CHECK_THROWS_AS(ddiloco::encode_frame(e, Codec::int4), ddiloco::InvalidArgument);  // encoded in another codec
}

TEST_CASE("decode_frame_view validates without decoding and points into the caller's buffer", "[wire]") {
  const Message m = sample(MessageType::global_fragment, 70);
  const Bytes f = ddiloco::encode_frame(m, Codec::bf16);
  const auto v = ddiloco::decode_frame_view(f);
  REQUIRE(v.ok());
  CHECK(v.value().payload.data() == f.data() + 88);
  CHECK(v.value().payload.size() == 140);
  CHECK(v.value().header.elements == 70);
  CHECK(v.value().header.codec == Codec::bf16);
  CHECK(v.value().header.type == MessageType::global_fragment);
  CHECK(v.value().header.learner == m.learner);
  CHECK_THROWS_AS(v.error(), ddiloco::StateError);
  const auto bad = ddiloco::decode_frame_view(Bytes(f.begin(), f.end() - 1));
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error() == WireError::too_short);
  CHECK_THROWS_AS(bad.value(), ddiloco::StateError);
}

TEST_CASE("decode_frame_keep_encoded leaves a contribution's payload encoded in the caller's buffer", "[wire]") {
  for (const Codec codec : {Codec::fp32, Codec::bf16, Codec::fp16, Codec::int8, Codec::int4}) {
    CAPTURE(ddiloco::to_string(codec));
    const Message m = sample(MessageType::contribution, 301);
    const auto frame = std::make_shared<const Bytes>(ddiloco::encode_frame(m, codec));
    const auto kept = ddiloco::decode_frame_keep_encoded(*frame, DecodeLimits{}, frame);
    REQUIRE(kept.ok());
    const Message& k = kept.value();
    require_same_header(k, m);
    CHECK(k.payload == nullptr);
    REQUIRE(k.encoded.has_value());
    CHECK(k.encoded->codec == codec);
    CHECK(k.encoded->elements == 301);
    CHECK(k.payload_size() == 301);
    CHECK(k.encoded->bytes.data() == frame->data() + ddiloco::kFrameHeaderSize);  // no copy
    CHECK(k.encoded->bytes.size() == ddiloco::encoded_size(codec, 301));
    CHECK(k.payload_bytes() == k.encoded->bytes.size());
    CHECK(k.encoded->owner.get() == frame.get());
    // Decoding the kept bytes gives what decode_frame gives.
    std::vector<float> values(301);
    ddiloco::decode(codec, k.encoded->bytes, values);
    const auto full = ddiloco::decode_frame(*frame);
    REQUIRE(full.ok());
    CHECK(values == *full.value().payload);
  }
  // Other message types are decoded to fp32 as decode_frame does.
  const Bytes g = ddiloco::encode_frame(sample(MessageType::global_fragment, 40), Codec::bf16);
  const auto r = ddiloco::decode_frame_keep_encoded(g, DecodeLimits{}, nullptr);
  REQUIRE(r.ok());
  CHECK_FALSE(r.value().encoded.has_value());
  REQUIRE(r.value().payload != nullptr);
  CHECK(r.value().payload->size() == 40);
}

TEST_CASE("decode_frame_keep_encoded with deferred payload checks hands the frame's checksum on, with "
          "authenticated compares and hands on none, and either way still checks the header",
          "[wire]") {
  for (const Codec codec : ddiloco::all_codecs) {
    CAPTURE(ddiloco::to_string(codec));
    const Message m = sample(MessageType::contribution, 301);
    auto frame = std::make_shared<Bytes>(ddiloco::encode_frame(m, codec));
    const std::uint32_t crc = ddiloco::detail::crc32c(std::span<const std::byte>(*frame).subspan(ddiloco::kFrameHeaderSize));
    // A payload bit flipped: the default (now) refuses the frame, deferred
    // passes it on with the checksum the sender wrote, for the syncer to compare.
    (*frame)[ddiloco::kFrameHeaderSize + 5] ^= std::byte{0x10};
    const auto now = ddiloco::decode_frame_keep_encoded(*frame, DecodeLimits{}, frame);
    REQUIRE_FALSE(now.ok());
    CHECK(now.error() == WireError::payload_checksum);
    const auto later = ddiloco::decode_frame_keep_encoded(*frame, DecodeLimits{}, frame, ddiloco::PayloadChecks::deferred);
    REQUIRE(later.ok());
    REQUIRE(later.value().encoded.has_value());
    CHECK(later.value().encoded->unchecked_crc == crc);
    CHECK(ddiloco::detail::crc32c(later.value().encoded->bytes) != crc);
    // The checked path leaves nothing to check.
    (*frame)[ddiloco::kFrameHeaderSize + 5] ^= std::byte{0x10};
    const auto intact = ddiloco::decode_frame_keep_encoded(*frame, DecodeLimits{}, frame);
    REQUIRE(intact.ok());
    CHECK_FALSE(intact.value().encoded->unchecked_crc.has_value());
    // The header is still checked: a flipped header bit is refused either way.
    (*frame)[ddiloco::detail::frame_offset::learner] ^= std::byte{0x01};
    const auto bad_header =
        ddiloco::decode_frame_keep_encoded(*frame, DecodeLimits{}, frame, ddiloco::PayloadChecks::deferred);
    REQUIRE_FALSE(bad_header.ok());
    CHECK(bad_header.error() == WireError::header_checksum);
    CHECK(ddiloco::decode_frame_keep_encoded(*frame, DecodeLimits{}, frame, ddiloco::PayloadChecks::authenticated)
              .error() == WireError::header_checksum);

    // Under CURVE (authenticated): the frame's payload CRC field made wrong,
    // the header's own checksum rewritten to match; now refuses the frame,
    // authenticated does not look, and leaves nothing for the syncer to compare.
    frame = std::make_shared<Bytes>(ddiloco::encode_frame(m, codec));
    namespace o = ddiloco::detail::frame_offset;
    std::byte* p = frame->data();
    ddiloco::detail::store_u32(p + o::payload_crc, ddiloco::detail::load_u32(p + o::payload_crc) ^ 0x1234U);
    ddiloco::detail::store_u32(p + o::header_crc,
                               ddiloco::detail::crc32c(std::span<const std::byte>(p, o::header_crc)));
    const auto refused = ddiloco::decode_frame_keep_encoded(*frame, DecodeLimits{}, frame);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.error() == WireError::payload_checksum);
    const auto mac =
        ddiloco::decode_frame_keep_encoded(*frame, DecodeLimits{}, frame, ddiloco::PayloadChecks::authenticated);
    REQUIRE(mac.ok());
    REQUIRE(mac.value().encoded.has_value());
    CHECK_FALSE(mac.value().encoded->unchecked_crc.has_value());
    CHECK(mac.value().encoded->bytes.data() == frame->data() + ddiloco::kFrameHeaderSize);
  }
}

TEST_CASE("a frame truncated at any byte offset is rejected, never decoded", "[wire]") {
  for (Codec c : ddiloco::all_codecs) {
    const Bytes f = ddiloco::encode_frame(sample(MessageType::contribution, 67), c);
    for (std::size_t len = 0; len < f.size(); ++len) {
      CAPTURE(ddiloco::to_string(c), len);
      REQUIRE(error_of(Bytes(f.begin(), f.begin() + static_cast<std::ptrdiff_t>(len))) == WireError::too_short);
    }
  }
}

TEST_CASE("flipping any header byte or bit is caught by magic, version or header checksum", "[wire]") {
  const Bytes f = ddiloco::encode_frame(sample(MessageType::full_state, 33), Codec::fp16);
  auto expected = [](std::size_t i) {
    return i < 4 ? WireError::bad_magic : i < 6 ? WireError::bad_version : WireError::header_checksum;
  };
  for (std::size_t i = 0; i < ddiloco::kFrameHeaderSize; ++i) {
    for (unsigned mask = 1; mask <= 0xFF; mask = mask == 0x80 ? 0x100 : mask << 1) {
      for (unsigned m : {mask, 0xFFU}) {
        Bytes g = f;
        g[i] ^= static_cast<std::byte>(m);
        CAPTURE(i, m);
        REQUIRE(error_of(g) == expected(i));
      }
    }
  }
}

TEST_CASE("flipping any payload byte is caught by the payload checksum", "[wire]") {
  const Bytes f = ddiloco::encode_frame(sample(MessageType::contribution, 40), Codec::int4);
  for (std::size_t i = ddiloco::kFrameHeaderSize; i < f.size(); ++i) {
    Bytes g = f;
    g[i] ^= std::byte{0x01};
    REQUIRE(error_of(g) == WireError::payload_checksum);
  }
}

TEST_CASE("each WireError is provoked by a crafted frame and counted once", "[wire]") {
  const Bytes good = ddiloco::encode_frame(sample(MessageType::contribution, 10), Codec::int8);
  REQUIRE(ddiloco::decode_frame(good).ok());
  auto crafted = [&](auto edit) {
    Bytes f = good;
    edit(f);
    reseal(f);
    return f;
  };
  std::vector<std::pair<WireError, Bytes>> cases;
  cases.emplace_back(WireError::too_short, Bytes(good.begin(), good.begin() + 87));
  cases.emplace_back(WireError::bad_magic, crafted([](Bytes& f) { f[3] = std::byte{'X'}; }));
  cases.emplace_back(WireError::bad_version, crafted([](Bytes& f) { put(f, 4, 2, 2); }));
  {
    Bytes f = good;
    f[20] ^= std::byte{0x04};  // fragment id changed without resealing
    cases.emplace_back(WireError::header_checksum, f);
  }
  cases.emplace_back(WireError::bad_type, crafted([](Bytes& f) { put(f, 6, 0, 1); }));
  cases.emplace_back(WireError::bad_type, crafted([](Bytes& f) { put(f, 6, 12, 1); }));  // the last is pull = 11
  cases.emplace_back(WireError::bad_codec, crafted([](Bytes& f) { put(f, 7, 5, 1); }));
  cases.emplace_back(WireError::bad_codec, crafted([](Bytes& f) { put(f, 7, 255, 1); }));
  cases.emplace_back(WireError::bad_counters, crafted([](Bytes& f) { put(f, 48, ~0ULL, 8); }));  // steps = -1
  cases.emplace_back(WireError::bad_counters, crafted([](Bytes& f) { put(f, 56, 1ULL << 63, 8); }));  // tokens < 0
  cases.emplace_back(WireError::unexpected_payload, crafted([](Bytes& f) { put(f, 6, 5, 1); }));  // heartbeat
  cases.emplace_back(WireError::too_large, crafted([](Bytes& f) { put(f, 64, 1ULL << 40, 8); }));
  cases.emplace_back(WireError::too_large, crafted([](Bytes& f) { put(f, 64, ~0ULL, 8); }));
  cases.emplace_back(WireError::length_mismatch, crafted([](Bytes& f) { put(f, 72, 15, 8); }));
  cases.emplace_back(WireError::length_mismatch, crafted([](Bytes& f) { put(f, 72, ~0ULL, 8); }));
  cases.emplace_back(WireError::length_mismatch, crafted([](Bytes& f) { put(f, 64, 11, 8); }));  // 11 needs 15 bytes
  cases.emplace_back(WireError::length_mismatch, crafted([](Bytes& f) { f.push_back(std::byte{0}); }));
  cases.emplace_back(WireError::too_short, crafted([](Bytes& f) {
                       f.pop_back();  // the header still promises 14 payload bytes
                     }));
  {
    Bytes f = good;
    f.back() ^= std::byte{0x01};
    cases.emplace_back(WireError::payload_checksum, f);
  }
  cases.emplace_back(WireError::bad_payload, crafted([](Bytes& f) { put(f, 88, 0x7FC00000U, 4); }));  // NaN scale
  cases.emplace_back(WireError::bad_payload, crafted([](Bytes& f) { f[92] = std::byte{0x80}; }));  // code -128
  {
    Bytes f = ddiloco::encode_frame(sample(MessageType::join_refused, 0), Codec::fp32);
    put(f, 20, 0, 4);  // reason 0 is no JoinRefusal
    reseal(f);
    cases.emplace_back(WireError::bad_reason, f);
    put(f, 20, 8, 4);  // nor is 8 (the last is JoinRefusal::shard_map = 7)
    reseal(f);
    cases.emplace_back(WireError::bad_reason, f);
  }

  ddiloco::WireCounters counters;
  std::set<WireError> seen;
  for (const auto& [want, frame] : cases) {
    CAPTURE(ddiloco::to_string(want));
    const auto r = ddiloco::decode_frame(frame, DecodeLimits{}, counters);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error() == want);
    seen.insert(want);
    // The receiver that keeps contributions encoded rejects the same frames for the same reason.
    const auto kept = ddiloco::decode_frame_keep_encoded(frame, DecodeLimits{}, nullptr);
    REQUIRE_FALSE(kept.ok());
    CHECK(kept.error() == want);
  }
  CHECK(seen.size() == ddiloco::kWireErrorCount);  // every kind provoked
  (void)ddiloco::decode_frame(good, DecodeLimits{}, counters);
  CHECK(counters.accepted == 1);
  CHECK(counters.rejected() == cases.size());
  CHECK(counters[WireError::bad_type] == 2);
  CHECK(counters[WireError::header_checksum] == 1);
  std::set<std::string_view> names;
  for (std::size_t k = 0; k < ddiloco::kWireErrorCount; ++k) {
    names.insert(ddiloco::to_string(static_cast<WireError>(k)));
  }
  CHECK(names.size() == ddiloco::kWireErrorCount);
  CHECK(names.count("unknown") == 0);
}

TEST_CASE("the element limit is the caller's, and a frame at the limit is accepted", "[wire]") {
  const Bytes f = ddiloco::encode_frame(sample(MessageType::global_fragment, 100), Codec::fp32);
  CHECK(ddiloco::decode_frame(f, DecodeLimits{100}).ok());
  CHECK(error_of(f, DecodeLimits{99}) == WireError::too_large);
  CHECK(ddiloco::decode_frame_view(f, DecodeLimits{99}).error() == WireError::too_large);
}

TEST_CASE("random garbage and random resealed headers never decode into an inconsistent message", "[wire]") {
  std::mt19937_64 rng(2024);
  std::size_t accepted = 0;
  for (int iter = 0; iter < 100'000; ++iter) {
    Bytes f(static_cast<std::size_t>(rng() % 200));
    for (auto& b : f) b = static_cast<std::byte>(rng() & 0xFFU);
    if (iter % 2 == 1 && f.size() >= 88) {
      // A header that passes magic, version and checksums, with fields drawn near the valid ranges.
      f[0] = std::byte{'D'}; f[1] = std::byte{'D'}; f[2] = std::byte{'L'}; f[3] = std::byte{'F'};
      put(f, 4, 1, 2);
      put(f, 6, rng() % 8, 1);
      put(f, 7, rng() % 6, 1);
      if (rng() % 2 == 0) put(f, 48, rng() >> 1, 8);
      if (rng() % 2 == 0) put(f, 56, rng() >> 1, 8);
      const std::uint64_t payload = f.size() - 88;
      put(f, 64, rng() % 4 == 0 ? rng() : payload / (1 + rng() % 4), 8);
      put(f, 72, rng() % 4 == 0 ? rng() : payload, 8);
      reseal(f);
    }
    const auto r = ddiloco::decode_frame(f);
    const auto v = ddiloco::decode_frame_view(f);
    if (!r.ok()) {
      if (r.error() != WireError::bad_payload) REQUIRE((!v.ok() && v.error() == r.error()));
      continue;
    }
    ++accepted;
    REQUIRE(v.ok());
    const Message& m = r.value();
    REQUIRE(m.payload_size() == get(f, 64, 8));
    REQUIRE(f.size() == 88 + ddiloco::encoded_size(v.value().header.codec, m.payload_size()));
    REQUIRE(m.steps >= 0);
    REQUIRE(m.tokens >= 0);
    // The decoded message survives a lossless re-encoding unchanged.
    const auto again = ddiloco::decode_frame(ddiloco::encode_frame(m, Codec::fp32));
    REQUIRE(again.ok());
    require_same_header(m, again.value());
    REQUIRE(again.value().payload_size() == m.payload_size());
  }
  CHECK(accepted > 100);  // the generator does reach the accepting paths
}

TEST_CASE("the fuzzer's seed corpus holds valid frames that decode and broken ones that do not", "[wire]") {
  const std::filesystem::path dir = std::filesystem::path(DDILOCO_SOURCE_DIR) / "tests" / "fuzz" / "corpus";
  REQUIRE(std::filesystem::is_directory(dir));
  std::size_t valid = 0;
  std::size_t broken = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const Bytes f = bytes_of(raw);
    const auto name = entry.path().filename().string();
    CAPTURE(name);
    if (name.rfind("valid_", 0) == 0) {
      CHECK(ddiloco::decode_frame(f).ok());
      ++valid;
    } else {
      CHECK_FALSE(ddiloco::decode_frame(f).ok());
      ++broken;
    }
  }
  CHECK(valid >= 6);
  CHECK(broken >= 1);
}

TEST_CASE("A frame in two parts (header, then payload) encodes and decodes as the same frame in one", "[wire]") {
  for (const Codec codec : ddiloco::all_codecs) {
    for (const std::size_t n : {std::size_t{0}, std::size_t{7}, std::size_t{16385}}) {
      INFO(ddiloco::to_string(codec) << " n = " << n);
      const Message m = sample(MessageType::global_fragment, n, static_cast<unsigned>(n) + 11);
      const Bytes whole = ddiloco::encode_frame(m, codec);
      Bytes payload(ddiloco::encoded_size(codec, n), std::byte{0xEE});
      const std::uint32_t crc = ddiloco::encode_payload_into(m, codec, payload);
      const auto head = ddiloco::frame_header(m, codec, crc);
      Bytes glued(head.size() + payload.size());
      std::memcpy(glued.data(), head.data(), head.size());
      if (!payload.empty()) std::memcpy(glued.data() + head.size(), payload.data(), payload.size());
      CHECK(glued == whole);
      CHECK(crc == ddiloco::frame_payload_crc(whole));
      const auto parts = ddiloco::decode_frame_parts(head, payload);
      const auto one = ddiloco::decode_frame(whole);
      REQUIRE(parts.ok());
      REQUIRE(one.ok());
      CHECK(parts.value().learner == m.learner);
      CHECK(parts.value().version == m.version);
      CHECK(static_cast<bool>(parts.value().payload) == static_cast<bool>(one.value().payload));
      if (one.value().payload) CHECK(*parts.value().payload == *one.value().payload);
    }
  }
  // The checks, in decode_frame's order, on each part.
  const Message m = sample(MessageType::global_fragment, 64);
  const Bytes whole = ddiloco::encode_frame(m, Codec::fp32);
  const std::span<const std::byte> head(whole.data(), ddiloco::kFrameHeaderSize);
  const std::span<const std::byte> payload(whole.data() + ddiloco::kFrameHeaderSize,
                                           whole.size() - ddiloco::kFrameHeaderSize);
  const auto error_of = [](const ddiloco::DecodeResult& r) { return r.ok() ? std::optional<WireError>{} : r.error(); };
  CHECK(error_of(ddiloco::decode_frame_parts(head.first(87), payload)) == WireError::too_short);
  CHECK(error_of(ddiloco::decode_frame_parts(std::span<const std::byte>(whole.data(), 89), payload)) ==
        WireError::length_mismatch);
  CHECK(error_of(ddiloco::decode_frame_parts(head, payload.first(payload.size() - 1))) == WireError::too_short);
  CHECK(error_of(ddiloco::decode_frame_parts(head, std::span<const std::byte>(whole).subspan(87))) ==
        WireError::length_mismatch);
  Bytes flipped(payload.begin(), payload.end());
  flipped[5] ^= std::byte{0x10};
  CHECK(error_of(ddiloco::decode_frame_parts(head, flipped)) == WireError::payload_checksum);
  Bytes bad_head(head.begin(), head.end());
  bad_head[30] ^= std::byte{1};
  CHECK(error_of(ddiloco::decode_frame_parts(bad_head, payload)) == WireError::header_checksum);
  // A payload buffer of the wrong size is the caller's error.
  Bytes short_out(4 * 64 - 1);
  CHECK_THROWS_AS(ddiloco::encode_payload_into(m, Codec::fp32, short_out), ddiloco::ShapeMismatch);
}

TEST_CASE("Decoded into a PayloadPool, a released payload's vector is reused, a held one never, and a failed "
          "decode leaves the vector to the next",
          "[wire][pool]") {
  ddiloco::PayloadPool pool(2);
  const Message big = sample(MessageType::global_fragment, 5000, 3);
  const Message small = sample(MessageType::global_fragment, 1000, 4);
  const Bytes big_frame = ddiloco::encode_frame(big, Codec::fp32), small_frame = ddiloco::encode_frame(small, Codec::fp32);
  auto first = ddiloco::decode_frame(big_frame, {}, &pool);
  REQUIRE(first.ok());
  CHECK(*first.value().payload == *big.payload);
  CHECK(pool.allocated() == 1);
  const float* storage = first.value().payload->data();
  // Held: the next decode cannot have it.
  auto second = ddiloco::decode_frame(big_frame, {}, &pool);
  REQUIRE(second.ok());
  CHECK(second.value().payload->data() != storage);
  CHECK(pool.allocated() == 2);
  CHECK(*first.value().payload == *big.payload);
  // Released (every copy gone): the next decode of at most its size writes into it.
  ddiloco::Payload copy = first.value().payload;
  first.value().payload.reset();
  CHECK(pool.idle() == 0);
  copy.reset();
  CHECK(pool.idle() == 1);
  auto third = ddiloco::decode_frame(small_frame, {}, &pool);
  REQUIRE(third.ok());
  CHECK(third.value().payload->data() == storage);
  CHECK(*third.value().payload == *small.payload);  // sized to the frame, not to the vector's last use
  CHECK(pool.reused() == 1);
  // A payload larger than every idle vector gets a fresh one; the idle ones stay.
  third.value().payload.reset();
  second.value().payload.reset();
  CHECK(pool.idle() == 2);
  const Message larger = sample(MessageType::global_fragment, 6000, 5);
  auto fourth = ddiloco::decode_frame(ddiloco::encode_frame(larger, Codec::fp32), {}, &pool);
  REQUIRE(fourth.ok());
  CHECK(pool.allocated() == 3);
  CHECK(pool.idle() == 2);
  // At most max_idle wait, the largest kept: the 6000 replaces one of 5000.
  fourth.value().payload.reset();
  CHECK(pool.idle() == 2);
  auto fifth = ddiloco::decode_frame(ddiloco::encode_frame(larger, Codec::fp32), {}, &pool);
  REQUIRE(fifth.ok());
  CHECK(pool.reused() == 2);
  CHECK(*fifth.value().payload == *larger.payload);
  // A payload that fails to decode (a NaN int8 scale, checksums resealed) is bad_payload, and
  // the vector it took waits for the next decode.
  Bytes bad = ddiloco::encode_frame(sample(MessageType::global_fragment, 100, 6), Codec::int8);
  put(bad, 88, 0x7FC00000U, 4);
  reseal(bad);
  const std::size_t idle = pool.idle();
  const auto refused = ddiloco::decode_frame(bad, {}, &pool);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error() == WireError::bad_payload);
  CHECK(pool.idle() == idle);
  // A payload outliving its pool is freed (ASan: no leak, no use after free).
  ddiloco::Payload survivor;
  {
    ddiloco::PayloadPool gone(1);
    survivor = ddiloco::decode_frame(small_frame, {}, &gone).value().payload;
  }
  CHECK(*survivor == *small.payload);
  survivor.reset();
  // max_idle 0 keeps nothing: every decode is fresh.
  ddiloco::PayloadPool none(0);
  ddiloco::decode_frame(small_frame, {}, &none).value().payload.reset();
  CHECK(none.idle() == 0);
  CHECK(ddiloco::decode_frame(small_frame, {}, &none).ok());
  CHECK(none.reused() == 0);
}
