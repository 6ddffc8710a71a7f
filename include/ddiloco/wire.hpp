// ddiloco/wire.hpp: the byte form of a `Message` (message.hpp) between processes.
//
// What it is: a versioned, checksummed, little-endian frame: a fixed 88-byte
// header followed by the payload encoded with one of codec.hpp's codecs, the
// encoder, and a decoder that checks every field before it uses it and reports
// each failure as a typed, countable `WireError` instead of throwing.
// What it is not: a transport (no sockets, no framing of a byte stream: one
// frame is one transport message, in one part or in two, the header then the
// payload: encode_payload_into + frame_header, decode_frame_parts), nor a
// semantic check. Whether a fingerprint
// matches the plan, a version is current or a sequence is fresh is the syncer's
// business (syncer.hpp); the wire only guarantees that a decoded Message is
// exactly what some encoder wrote.
//
// # Frame layout, protocol version 1 (all integers little-endian)
//   offset size field
//        0    4 magic              "DDLF" (0x44 0x44 0x4C 0x46)
//        4    2 protocol version   1
//        6    1 message type       MessageType (1..11)
//        7    1 codec              Codec (0..4)
//        8    8 fingerprint        Message::fingerprint
//       16    4 learner            Message::learner
//       20    4 fragment           Message::fragment (a join's: its RoundMode in bits 0-7,
//                                  the syncer shard it addresses in bits 8-31, shard_map.hpp;
//                                  a pull's or a contribution's: the index in bits 0-30 and
//                                  Message::repeat in bit 31)
//       24    8 version            Message::version (base version of a contribution;
//                                  a join's declared tokens per inner step, 0: unstated)
//       32    8 sequence           Message::sequence
//       40    8 step               Message::step
//       48    8 steps              Message::steps  (int64, two's complement, >= 0)
//       56    8 tokens             Message::tokens (int64, two's complement, >= 0)
//       64    8 element count n    payload elements (0 = no payload)
//       72    8 payload bytes      must equal encoded_size(codec, n)
//       80    4 payload CRC-32C    over the payload bytes (detail/checksum.hpp)
//       84    4 header CRC-32C     over bytes [0, 84)
//       88      payload
// join, heartbeat, leave, join_refused, observe and rejoin carry no payload (n = 0). A
// null payload and an empty one are the same on the wire; both decode to a null
// `Message::payload`. A join_refused names its reason in the fragment field (a
// JoinRefusal, message.hpp); any other value is bad_reason.
//
// # Decoding order (the first failed check is the error reported)
//   too_short (fewer than 88 bytes) -> bad_magic -> bad_version ->
//   header_checksum -> bad_type -> bad_codec -> bad_counters -> unexpected_payload
//   -> bad_reason -> too_large (n > DecodeLimits::max_elements) -> length_mismatch (payload
//   bytes field != encoded_size(codec, n)) -> too_short (frame shorter than its
//   header says) / length_mismatch (trailing bytes) -> payload_checksum ->
//   bad_payload (decode_frame only: a scale or code no encoder writes).
// The payload is allocated only after its length has been checked against the
// limits and against the bytes actually received.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <ddiloco/codec.hpp>
#include <ddiloco/detail/checksum.hpp>
#include <ddiloco/detail/frame_pool.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/fast/kernels.hpp>
#include <ddiloco/message.hpp>

namespace ddiloco {

inline constexpr std::uint16_t kWireProtocolVersion = 1;
inline constexpr std::size_t kFrameHeaderSize = 88;
inline constexpr std::array<std::byte, 4> kFrameMagic = {std::byte{0x44}, std::byte{0x44}, std::byte{0x4C},
                                                         std::byte{0x46}};

/// Why a frame was rejected. Stable numbering (used as counter indices).
enum class WireError : std::uint8_t {
  too_short = 0,       ///< shorter than the header, or than header + payload length
  bad_magic,           ///< not a ddiloco frame
  bad_version,         ///< another protocol version
  header_checksum,     ///< header bytes corrupted
  bad_type,            ///< message type outside 1..9
  bad_codec,           ///< codec outside 0..4
  bad_counters,        ///< negative steps or tokens
  unexpected_payload,  ///< join / heartbeat / leave / join_refused / observe / rejoin with elements
  too_large,           ///< element count above DecodeLimits::max_elements
  length_mismatch,     ///< payload length field inconsistent with codec and count, or trailing bytes
  payload_checksum,    ///< payload bytes corrupted
  bad_payload,         ///< checksum fine but not a valid encoding (bad scale or code)
  bad_reason,          ///< join_refused whose reason is not a JoinRefusal
};

inline constexpr std::size_t kWireErrorCount = static_cast<std::size_t>(WireError::bad_reason) + 1;

constexpr std::string_view to_string(WireError e) noexcept {
  switch (e) {
    case WireError::too_short: return "too_short";
    case WireError::bad_magic: return "bad_magic";
    case WireError::bad_version: return "bad_version";
    case WireError::header_checksum: return "header_checksum";
    case WireError::bad_type: return "bad_type";
    case WireError::bad_codec: return "bad_codec";
    case WireError::bad_counters: return "bad_counters";
    case WireError::unexpected_payload: return "unexpected_payload";
    case WireError::too_large: return "too_large";
    case WireError::length_mismatch: return "length_mismatch";
    case WireError::payload_checksum: return "payload_checksum";
    case WireError::bad_payload: return "bad_payload";
    case WireError::bad_reason: return "bad_reason";
  }
  return "unknown";
}

struct DecodeLimits {
  /// Largest payload accepted, in elements (default 2^28: 1 GiB of fp32).
  std::uint64_t max_elements = std::uint64_t{1} << 28;
};

/// Every header field, as decoded (validated) or to be encoded.
struct FrameHeader {
  MessageType type = MessageType::heartbeat;
  Codec codec = Codec::fp32;
  std::uint64_t fingerprint = 0;
  LearnerId learner = 0;
  std::uint32_t fragment = 0;
  std::uint64_t version = 0;
  std::uint64_t sequence = 0;
  std::uint64_t step = 0;
  std::int64_t steps = 0;
  std::int64_t tokens = 0;
  std::uint64_t elements = 0;
  std::uint64_t payload_bytes = 0;
  std::uint32_t payload_crc = 0;
};

/// A validated frame whose payload is still encoded: `payload` points into the
/// caller's buffer (checksum verified, contents not yet decoded).
struct FrameView {
  FrameHeader header;
  std::span<const std::byte> payload;
};

/// Either a value or the WireError that prevented it.
template <class T>
class WireResult {
 public:
  WireResult(T value) : v_(std::in_place_index<0>, std::move(value)) {}  // NOLINT: implicit by design
  WireResult(WireError e) : v_(std::in_place_index<1>, e) {}            // NOLINT: implicit by design

  [[nodiscard]] bool ok() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return ok(); }

  [[nodiscard]] WireError error() const {
    if (ok()) throw StateError("WireResult::error() on a successful decode; check ok() first");
    return std::get<1>(v_);
  }
  [[nodiscard]] T& value() & { return checked(); }
  [[nodiscard]] const T& value() const& { return const_cast<WireResult*>(this)->checked(); }
  [[nodiscard]] T&& value() && { return std::move(checked()); }

 private:
  T& checked() {
    if (!ok()) {
      throw StateError(detail::msg("WireResult::value() on a rejected frame (", to_string(std::get<1>(v_)),
                                   "); check ok() first"));
    }
    return std::get<0>(v_);
  }
  std::variant<T, WireError> v_;
};

using DecodeResult = WireResult<Message>;
using FrameViewResult = WireResult<FrameView>;

/// Frames accepted and rejected, by reason. Not thread-safe.
struct WireCounters {
  std::uint64_t accepted = 0;
  std::array<std::uint64_t, kWireErrorCount> rejected_by{};

  void record(WireError e) noexcept { ++rejected_by[static_cast<std::size_t>(e)]; }
  template <class T>
  void record(const WireResult<T>& r) noexcept {
    if (r.ok()) {
      ++accepted;
    } else {
      record(r.error());
    }
  }
  [[nodiscard]] std::uint64_t operator[](WireError e) const noexcept {
    return rejected_by[static_cast<std::size_t>(e)];
  }
  [[nodiscard]] std::uint64_t rejected() const noexcept {
    std::uint64_t sum = 0;
    for (auto c : rejected_by) sum += c;
    return sum;
  }
};

namespace detail {

namespace frame_offset {
inline constexpr std::size_t magic = 0, protocol = 4, type = 6, codec = 7, fingerprint = 8, learner = 16,
                             fragment = 20, version = 24, sequence = 32, step = 40, steps = 48, tokens = 56,
                             elements = 64, payload_bytes = 72, payload_crc = 80, header_crc = 84;
}  // namespace frame_offset

constexpr bool is_valid_message_type(std::uint8_t raw) noexcept { return raw >= 1 && raw <= 11; }

constexpr bool carries_payload(MessageType t) noexcept {
  return t == MessageType::full_state || t == MessageType::contribution || t == MessageType::global_fragment;
}

/// Messages whose fragment field holds Message::repeat in its top bit.
constexpr bool may_repeat(MessageType t) noexcept {
  return t == MessageType::pull || t == MessageType::contribution;
}
inline constexpr std::uint32_t kRepeatBit = 0x8000'0000u;

/// Writes the header (computing the header CRC) into out[0, 88).
inline void write_frame_header(std::span<std::byte, kFrameHeaderSize> out, const FrameHeader& h) noexcept {
  namespace o = frame_offset;
  std::byte* p = out.data();
  std::memcpy(p + o::magic, kFrameMagic.data(), kFrameMagic.size());
  store_u16(p + o::protocol, kWireProtocolVersion);
  p[o::type] = static_cast<std::byte>(h.type);
  p[o::codec] = static_cast<std::byte>(h.codec);
  store_u64(p + o::fingerprint, h.fingerprint);
  store_u32(p + o::learner, h.learner);
  store_u32(p + o::fragment, h.fragment);
  store_u64(p + o::version, h.version);
  store_u64(p + o::sequence, h.sequence);
  store_u64(p + o::step, h.step);
  store_u64(p + o::steps, std::bit_cast<std::uint64_t>(h.steps));
  store_u64(p + o::tokens, std::bit_cast<std::uint64_t>(h.tokens));
  store_u64(p + o::elements, h.elements);
  store_u64(p + o::payload_bytes, h.payload_bytes);
  store_u32(p + o::payload_crc, h.payload_crc);
  store_u32(p + o::header_crc, crc32c(std::span<const std::byte>(p, o::header_crc)));
}

inline FrameHeader header_of(const Message& m, Codec codec, std::size_t elements) {
  if (!is_valid_message_type(static_cast<std::uint8_t>(m.type))) {
    throw InvalidArgument(msg("encode_frame: message type ", static_cast<int>(m.type),
                              " is not a MessageType enumerator"));
  }
  if (!is_valid_codec(static_cast<std::uint8_t>(codec))) {
    throw InvalidArgument(msg("encode_frame: codec ", static_cast<int>(codec), " is not a Codec enumerator"));
  }
  if (m.steps < 0 || m.tokens < 0) {
    throw InvalidArgument(msg("encode_frame: steps = ", m.steps, ", tokens = ", m.tokens,
                              "; counters must be >= 0"));
  }
  if (elements != 0 && !carries_payload(m.type)) {
    throw InvalidArgument(msg("encode_frame: a ", to_string(m.type), " message carries no payload but has ",
                              elements, " elements; drop the payload"));
  }
  if (m.type == MessageType::join_refused && !is_valid_join_refusal(m.fragment)) {
    throw InvalidArgument(msg("encode_frame: a join_refused message needs a JoinRefusal reason in `fragment`, got ",
                              m.fragment));
  }
  if (may_repeat(m.type) && (m.fragment & kRepeatBit) != 0) {
    throw InvalidArgument(msg("encode_frame: a ", to_string(m.type), " names fragment ", m.fragment,
                              "; fragment indices of pulls and contributions must be below 2^31"));
  }
  if (m.repeat && !may_repeat(m.type)) {
    throw InvalidArgument(msg("encode_frame: a ", to_string(m.type),
                              " message cannot be a repeat (only pulls and contributions); clear `repeat`"));
  }
  FrameHeader h;
  h.type = m.type;
  h.codec = codec;
  h.fingerprint = m.fingerprint;
  h.learner = m.learner;
  h.fragment = m.fragment | (m.repeat ? kRepeatBit : 0u);
  h.version = m.version;
  h.sequence = m.sequence;
  h.step = m.step;
  h.steps = m.steps;
  h.tokens = m.tokens;
  h.elements = elements;
  h.payload_bytes = encoded_size(codec, elements);
  return h;
}

}  // namespace detail

/// Bytes of the frame encode_frame(m, codec) writes: the header and the payload
/// (m.payload encoded with `codec`, or m.encoded as it is).
inline std::size_t frame_size(const Message& m, Codec codec) {
  return kFrameHeaderSize + encoded_size(codec, m.payload_size());
}

/// The payload of m's frame alone, written into `out` (exactly
/// encoded_size(codec, m.payload_size()) bytes): m.payload encoded with `codec`
/// (the fast kernels: the same bytes as ddiloco::encode), or m.encoded copied
/// when the sender encoded it already (its codec must be `codec`; when its
/// bytes are already at `out`, they stay there). Returns the payload's
/// CRC-32C, taken on each 64 KiB piece right after it is written, while it is
/// in cache. With frame_header, the two parts of a frame sent as two messages
/// (ZmqSyncerTransport: one payload part shared by every receiver). Throws
/// ShapeMismatch for a wrong `out` size and InvalidArgument for an m.encoded
/// in another codec or of the wrong size.
inline std::uint32_t encode_payload_into(const Message& m, Codec codec, std::span<std::byte> out) {
  const std::size_t n = m.payload_size();
  const std::size_t bytes = encoded_size(codec, n);
  if (out.size() != bytes) {
    throw ShapeMismatch(detail::msg("encode_payload_into: ", n, " elements in ", to_string(codec), " take ", bytes,
                                    " bytes but the buffer has ", out.size()));
  }
  std::byte* payload = out.data();
  constexpr std::size_t kPiece = std::size_t{1} << 16;  // bytes copied or encoded, then checksummed
  std::uint32_t crc = 0xFFFFFFFFU;
  if (!m.payload && m.encoded) {
    const EncodedPayload& e = *m.encoded;
    if (e.codec != codec || e.bytes.size() != bytes) {
      throw InvalidArgument(detail::msg("encode_frame: the message's payload is already encoded in ",
                                        to_string(e.codec), " (", e.bytes.size(), " bytes for ", e.elements,
                                        " elements) but the frame is ", to_string(codec), " (", bytes,
                                        " bytes); encode it with the transport's codec"));
    }
    if (e.bytes.data() == payload) {  // written in place (a buffer the transport lent)
      crc = detail::crc32c_update(crc, std::span<const std::byte>(payload, e.bytes.size()));
    } else {
      for (std::size_t lo = 0; lo < e.bytes.size(); lo += kPiece) {
        const std::size_t len = std::min(kPiece, e.bytes.size() - lo);
        std::memcpy(payload + lo, e.bytes.data() + lo, len);
        crc = detail::crc32c_update(crc, std::span<const std::byte>(payload + lo, len));
      }
    }
  } else if (n != 0 && codec == Codec::fp32) {
    const float* x = m.payload->data();
    constexpr std::size_t kFloats = kPiece / 4;
    for (std::size_t lo = 0; lo < n; lo += kFloats) {
      const std::size_t len = std::min(kFloats, n - lo);
      fast::encode(codec, std::span<const float>(x + lo, len), std::span<std::byte>(payload + 4 * lo, 4 * len));
      crc = detail::crc32c_update(crc, std::span<const std::byte>(payload + 4 * lo, 4 * len));
    }
  } else if (n != 0) {  // bf16 .. int4: block scales ahead of the codes, so encode it all, then checksum
    fast::encode(codec, std::span<const float>(*m.payload), std::span<std::byte>(payload, bytes));
    crc = detail::crc32c_update(crc, std::span<const std::byte>(payload, bytes));
  }
  return crc ^ 0xFFFFFFFFU;
}

/// encode_frame into `out` (exactly frame_size(m, codec) bytes, e.g. a buffer
/// the transport owns, so the frame is written once and never zero-filled):
/// the header, then the payload as encode_payload_into writes it. Throws as
/// encode_frame does, ShapeMismatch for a wrong `out` size, and
/// InvalidArgument as encode_payload_into does.
inline void encode_frame_into(const Message& m, Codec codec, std::span<std::byte> out) {
  FrameHeader h = detail::header_of(m, codec, m.payload_size());
  if (out.size() != kFrameHeaderSize + h.payload_bytes) {
    throw ShapeMismatch(detail::msg("encode_frame_into: the frame takes ", kFrameHeaderSize + h.payload_bytes,
                                    " bytes but the buffer has ", out.size(), "; size it with frame_size()"));
  }
  h.payload_crc = encode_payload_into(m, codec, out.subspan(kFrameHeaderSize));
  detail::write_frame_header(std::span<std::byte, kFrameHeaderSize>(out.data(), kFrameHeaderSize), h);
}

/// The header of m's frame for a payload whose CRC-32C is `payload_crc`
/// (encode_payload_into's result): the same global fragment framed again for
/// the next learner costs 88 bytes, not another encode and checksum. Throws as
/// encode_frame does.
inline std::array<std::byte, kFrameHeaderSize> frame_header(const Message& m, Codec codec,
                                                            std::uint32_t payload_crc) {
  FrameHeader h = detail::header_of(m, codec, m.payload_size());
  h.payload_crc = payload_crc;
  std::array<std::byte, kFrameHeaderSize> out{};
  detail::write_frame_header(out, h);
  return out;
}

/// The header of m's frame for a payload already at its place in `out` (which
/// holds frame_size(m, codec) bytes) whose CRC32C is `payload_crc`. Throws as
/// encode_frame_into does.
inline void finish_frame(const Message& m, Codec codec, std::uint32_t payload_crc, std::span<std::byte> out) {
  const std::size_t size = frame_size(m, codec);
  if (out.size() != size) {
    throw ShapeMismatch(detail::msg("finish_frame: the frame takes ", size, " bytes but the buffer has ",
                                    out.size(), "; size it with frame_size()"));
  }
  const auto head = frame_header(m, codec, payload_crc);
  std::memcpy(out.data(), head.data(), head.size());
}

/// The payload CRC32C recorded in a frame's header (written by encode_frame_into).
inline std::uint32_t frame_payload_crc(std::span<const std::byte> frame) {
  if (frame.size() < kFrameHeaderSize) {
    throw ShapeMismatch(detail::msg("frame_payload_crc: ", frame.size(), " bytes are shorter than a frame header"));
  }
  return detail::load_u32(frame.data() + detail::frame_offset::payload_crc);
}

/// Frame of `m` with its payload encoded by `codec` (or m.encoded, already in
/// `codec`). Throws InvalidArgument for a message no decoder would accept
/// (negative counters, payload on a control message, non-finite values under
/// int8/int4).
inline std::vector<std::byte> encode_frame(const Message& m, Codec codec) {
  std::vector<std::byte> out(frame_size(m, codec));
  encode_frame_into(m, codec, out);
  return out;
}

/// Frame of `m` (its own payload ignored) around an already encoded payload of
/// `elements` elements, e.g. from ErrorFeedbackEncoder. Throws ShapeMismatch if
/// `encoded.size() != encoded_size(codec, elements)`.
inline std::vector<std::byte> encode_frame_with_payload(const Message& m, Codec codec, std::size_t elements,
                                                        std::span<const std::byte> encoded) {
  FrameHeader h = detail::header_of(m, codec, elements);
  if (encoded.size() != h.payload_bytes) {
    throw ShapeMismatch(detail::msg("encode_frame_with_payload: ", elements, " elements in ", to_string(codec),
                                    " take ", h.payload_bytes, " bytes but ", encoded.size(),
                                    " were given; encode them with encode(codec, ...)"));
  }
  Message e = m;  // the header fields; the payload is `encoded`
  e.payload.reset();
  e.encoded = EncodedPayload{codec, elements, encoded, nullptr};
  return encode_frame(e, codec);
}

/// Who checks a kept-encoded contribution's payload (decode_frame_keep_encoded).
enum class PayloadChecks : std::uint8_t {
  now,       ///< the decoder: checksum and codes, before it returns
  deferred,  ///< the receiver (the syncer), in its own scan: EncodedPayload::unchecked_crc
  /// The transport authenticated every byte of the frame (CurveZMQ: each
  /// message carries a Poly1305 MAC, and a message that fails it is never
  /// delivered), so the payload CRC-32C adds nothing and is not compared; the
  /// receiver (the syncer) still checks the codes in its own scan, as with
  /// `deferred`. The header's own checksum is still compared.
  authenticated
};

constexpr std::string_view to_string(PayloadChecks c) noexcept {
  switch (c) {
    case PayloadChecks::now: return "now";
    case PayloadChecks::deferred: return "deferred";
    case PayloadChecks::authenticated: return "authenticated";
  }
  return "unknown";
}

namespace detail {
/// decode_frame_view, the payload checksum compared only when `check_payload`
/// (decode_frame_keep_encoded with PayloadChecks::deferred leaves it to the syncer).
/// The frame as two spans, `head` holding the header (at least 88 bytes are
/// needed; a contiguous frame passes its first 88 bytes) and `payload` what
/// follows it: one check for a frame in one buffer and one received as two
/// message parts (decode_frame_parts).
inline FrameViewResult decode_frame_view(std::span<const std::byte> head, std::span<const std::byte> payload,
                                         const DecodeLimits& limits, bool check_payload) noexcept {
  namespace o = detail::frame_offset;
  if (head.size() < kFrameHeaderSize) return WireError::too_short;
  if (head.size() > kFrameHeaderSize) return WireError::length_mismatch;
  const std::byte* p = head.data();
  if (std::memcmp(p + o::magic, kFrameMagic.data(), kFrameMagic.size()) != 0) return WireError::bad_magic;
  if (detail::load_u16(p + o::protocol) != kWireProtocolVersion) return WireError::bad_version;
  if (detail::crc32c(head.first(o::header_crc)) != detail::load_u32(p + o::header_crc)) {
    return WireError::header_checksum;
  }
  const auto type_raw = std::to_integer<std::uint8_t>(p[o::type]);
  if (!detail::is_valid_message_type(type_raw)) return WireError::bad_type;
  const auto codec_raw = std::to_integer<std::uint8_t>(p[o::codec]);
  if (!is_valid_codec(codec_raw)) return WireError::bad_codec;

  FrameHeader h;
  h.type = static_cast<MessageType>(type_raw);
  h.codec = static_cast<Codec>(codec_raw);
  h.fingerprint = detail::load_u64(p + o::fingerprint);
  h.learner = detail::load_u32(p + o::learner);
  h.fragment = detail::load_u32(p + o::fragment);
  h.version = detail::load_u64(p + o::version);
  h.sequence = detail::load_u64(p + o::sequence);
  h.step = detail::load_u64(p + o::step);
  h.steps = std::bit_cast<std::int64_t>(detail::load_u64(p + o::steps));
  h.tokens = std::bit_cast<std::int64_t>(detail::load_u64(p + o::tokens));
  h.elements = detail::load_u64(p + o::elements);
  h.payload_bytes = detail::load_u64(p + o::payload_bytes);
  h.payload_crc = detail::load_u32(p + o::payload_crc);

  if (h.steps < 0 || h.tokens < 0) return WireError::bad_counters;
  if (h.elements != 0 && !detail::carries_payload(h.type)) return WireError::unexpected_payload;
  if (h.type == MessageType::join_refused && !is_valid_join_refusal(h.fragment)) return WireError::bad_reason;
  if (h.elements > limits.max_elements || h.elements > detail::kMaxCodecElements) return WireError::too_large;
  bool size_ok = true;
  const std::uint64_t need = detail::encoded_size_unchecked(h.codec, h.elements, size_ok);
  if (!size_ok || h.payload_bytes != need) return WireError::length_mismatch;
  const std::uint64_t have = payload.size();
  if (have < h.payload_bytes) return WireError::too_short;
  if (have > h.payload_bytes) return WireError::length_mismatch;
  if (check_payload && detail::crc32c(payload) != h.payload_crc) return WireError::payload_checksum;
  return FrameView{h, payload};
}

inline FrameViewResult decode_frame_view(std::span<const std::byte> frame, const DecodeLimits& limits,
                                         bool check_payload) noexcept {
  if (frame.size() < kFrameHeaderSize) return WireError::too_short;
  return decode_frame_view(frame.first(kFrameHeaderSize), frame.subspan(kFrameHeaderSize), limits, check_payload);
}
}  // namespace detail

/// Validates every header field, the lengths and the payload checksum; does not
/// decode the payload (its scales and codes are checked only by decode_frame).
inline FrameViewResult decode_frame_view(std::span<const std::byte> frame, const DecodeLimits& limits = {}) noexcept {
  return detail::decode_frame_view(frame, limits, true);
}

namespace detail {
/// The Message fields a frame header carries (everything but the payload).
inline Message message_from_header(const FrameHeader& h) {
  Message m;
  m.type = h.type;
  m.fingerprint = h.fingerprint;
  m.learner = h.learner;
  m.fragment = h.fragment;
  if (may_repeat(h.type)) {
    m.repeat = (h.fragment & kRepeatBit) != 0;
    m.fragment = h.fragment & ~kRepeatBit;
  }
  m.version = h.version;
  m.sequence = h.sequence;
  m.steps = h.steps;
  m.tokens = h.tokens;
  m.step = h.step;
  return m;
}
}  // namespace detail

namespace detail {
/// The Message of a checked frame view, its payload decoded to fp32: into a
/// fresh vector, or into one of `pool`'s when given.
inline DecodeResult message_of(FrameViewResult view, PayloadPool* pool = nullptr) {
  if (!view) return view.error();
  const FrameHeader& h = view.value().header;
  Message m = detail::message_from_header(h);
  if (h.elements != 0) {
    const auto n = static_cast<std::size_t>(h.elements);
    const auto decode = [&](std::span<float> out) { return detail::try_decode(h.codec, view.value().payload, out); };
    if (pool != nullptr) {
      m.payload = pool->make(n, decode);
      if (!m.payload) return WireError::bad_payload;
    } else {
      std::vector<float> values(n);
      if (!decode(values)) return WireError::bad_payload;
      m.payload = make_payload(std::move(values));
    }
  }
  return m;
}
}  // namespace detail

/// Decodes a whole frame into a Message (payload decoded to fp32). Never throws
/// on bad input; may throw std::bad_alloc for a payload within the limits.
/// With `pool`, the payload is decoded into one of its vectors (PayloadPool).
inline DecodeResult decode_frame(std::span<const std::byte> frame, const DecodeLimits& limits = {},
                                 PayloadPool* pool = nullptr) {
  return detail::message_of(decode_frame_view(frame, limits), pool);
}

/// decode_frame for a frame that arrived as two parts: `head`, exactly the
/// 88-byte header, and `payload`, exactly the payload bytes the header
/// announces (ZmqSyncerTransport sends a global this way, the payload part
/// shared by every receiver). The same checks in the same order; a `head` of
/// another length is too_short or length_mismatch.
inline DecodeResult decode_frame_parts(std::span<const std::byte> head, std::span<const std::byte> payload,
                                       const DecodeLimits& limits = {}, PayloadPool* pool = nullptr) {
  return detail::message_of(detail::decode_frame_view(head, payload, limits, true), pool);
}

/// decode_frame for a receiver that folds contributions in their encoding (the
/// syncer, see ZmqSyncerConfig::keep_contributions_encoded): a contribution's
/// payload is not decoded; Message::encoded points into `frame`, which `owner`
/// must keep alive and unchanged. The frame gets every check decode_frame makes
/// except the float conversion: the codes are checked by a byte scan
/// (fast::valid_encoding: WireError::bad_payload as decode_frame reports it).
/// Finite values are the syncer's check (it sums the squared norm anyway).
/// With PayloadChecks::deferred a contribution's payload checksum and codes
/// are not read here either: the message carries the frame's checksum in
/// EncodedPayload::unchecked_crc and the syncer compares it, and checks the
/// codes, in the scan that takes the norms (RejectReason::bad_checksum,
/// bad_encoding), so the payload is read once there instead of three times.
/// With PayloadChecks::authenticated unchecked_crc stays empty: only the
/// codes are left to the syncer's scan (docs/security.md says why that is
/// safe under CURVE, docs/performance.md what it saves).
/// Other message types decode exactly as decode_frame does.
inline DecodeResult decode_frame_keep_encoded(std::span<const std::byte> frame, const DecodeLimits& limits,
                                              std::shared_ptr<const void> owner,
                                              PayloadChecks checks = PayloadChecks::now) {
  auto view = detail::decode_frame_view(frame, limits, checks == PayloadChecks::now);
  if (!view) return view.error();
  const FrameHeader& h = view.value().header;
  if (h.type != MessageType::contribution || h.elements == 0) return decode_frame(frame, limits);
  const std::span<const std::byte> payload = view.value().payload;
  const auto n = static_cast<std::size_t>(h.elements);
  Message m = detail::message_from_header(h);
  m.encoded = EncodedPayload{h.codec, n, payload, std::move(owner)};
  if (checks == PayloadChecks::deferred) {
    m.encoded->unchecked_crc = h.payload_crc;
  } else if (checks == PayloadChecks::now && !fast::valid_encoding(h.codec, payload.data(), n)) {
    return WireError::bad_payload;
  }
  return m;
}

/// decode_frame, recording the outcome in `counters`.
inline DecodeResult decode_frame(std::span<const std::byte> frame, const DecodeLimits& limits,
                                 WireCounters& counters) {
  auto r = decode_frame(frame, limits);
  counters.record(r);
  return r;
}

namespace detail {
/// A learner's frames in pooled buffers, with the payload part of the next
/// contribution's frame lent out (ContributionBufferTransport): lend() hands
/// OuterLoop that part to encode into, frame() writes the header and checksum
/// around it when the message's encoded bytes are those, else writes the whole
/// frame into another pooled buffer. Used from one thread.
class LendingFramer {
 public:
  [[nodiscard]] OutgoingPayload lend(std::size_t bytes) {
    auto block = pool_->acquire(kFrameHeaderSize + bytes);
    lent_ = block;
    return OutgoingPayload{std::span<std::byte>(block->data.get() + kFrameHeaderSize, bytes), std::move(block)};
  }

  /// m's frame in `codec` (encode_frame_into: every byte written, never zero-filled).
  [[nodiscard]] std::shared_ptr<FrameBlock> frame(const Message& m, Codec codec) {
    const std::size_t size = frame_size(m, codec);
    std::shared_ptr<FrameBlock> block = lent_.lock();
    lent_.reset();
    if (!block || !m.encoded || m.encoded->bytes.data() != block->data.get() + kFrameHeaderSize ||
        block->size != size) {
      block = pool_->acquire(size);
    }
    encode_frame_into(m, codec, std::span<std::byte>(block->data.get(), size));
    return block;
  }

  [[nodiscard]] const FramePool& pool() const noexcept { return *pool_; }

 private:
  std::shared_ptr<FramePool> pool_ = std::make_shared<FramePool>();
  std::weak_ptr<FrameBlock> lent_;  ///< the buffer of lend(), until frame()
};
}  // namespace detail

}  // namespace ddiloco
