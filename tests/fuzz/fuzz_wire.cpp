// libFuzzer target for the frame decoder of <ddiloco/wire.hpp>.
//
// What it is: every input is decoded twice: as received (the checksums stop
// almost every mutation at the header, which is what a syncer sees), and once
// more after its two CRC-32C fields have been recomputed, so the fuzzer also
// explores the field checks and the payload decoders behind them. Any
// disagreement between decode_frame, decode_frame_view and
// decode_frame_keep_encoded, or a decoded
// message that does not survive a lossless re-encoding unchanged, traps.
// What it is not: a test of the codecs' numerical error (tests/test_codec.cpp).
//
// Build and run by hand (tests/fuzz/CMakeLists.txt does the same):
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -I include \
//     tests/fuzz/fuzz_wire.cpp -o fuzz_wire
//   ./fuzz_wire -max_total_time=60 work_corpus tests/fuzz/corpus
#include <ddiloco/wire.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace {

const ddiloco::DecodeLimits kLimits{std::uint64_t{1} << 16};

void check(bool ok) {
  if (!ok) __builtin_trap();
}

void decode_and_check(std::span<const std::byte> frame) {
  const auto view = ddiloco::decode_frame_view(frame, kLimits);
  const auto r = ddiloco::decode_frame(frame, kLimits);
  // The syncer's encoded path accepts and rejects exactly the same frames, and
  // a kept contribution's bytes decode to decode_frame's payload.
  const auto kept = ddiloco::decode_frame_keep_encoded(frame, kLimits, nullptr);
  check(kept.ok() == r.ok());
  if (!kept.ok()) check(kept.error() == r.error());
  if (kept.ok() && kept.value().encoded) {
    const auto& e = *kept.value().encoded;
    check(e.elements == r.value().payload_size() && e.bytes.data() == frame.data() + ddiloco::kFrameHeaderSize);
    std::vector<float> values(e.elements);
    check(ddiloco::detail::try_decode(e.codec, e.bytes, values));
    check(std::memcmp(values.data(), r.value().payload->data(), r.value().payload_bytes()) == 0);
  }
  // The same bytes as two message parts (header, payload): the same verdict.
  if (frame.size() >= ddiloco::kFrameHeaderSize) {
    const auto parts = ddiloco::decode_frame_parts(frame.first(ddiloco::kFrameHeaderSize),
                                                   frame.subspan(ddiloco::kFrameHeaderSize), kLimits);
    check(parts.ok() == r.ok());
    if (!parts.ok()) check(parts.error() == r.error());
    if (parts.ok()) check(parts.value().payload_size() == r.value().payload_size());
  }
  // Under CURVE (PayloadChecks::authenticated) the payload is not checked
  // here: every frame the checked path takes is taken, any other is refused
  // for the checked path's own reason, and no checksum is left to compare.
  const auto mac = ddiloco::decode_frame_keep_encoded(frame, kLimits, nullptr, ddiloco::PayloadChecks::authenticated);
  if (kept.ok()) check(mac.ok());
  if (!mac.ok()) check(!kept.ok() && kept.error() == mac.error());
  if (mac.ok() && mac.value().encoded) {
    const auto& e = *mac.value().encoded;
    check(!e.unchecked_crc.has_value() && e.bytes.data() == frame.data() + ddiloco::kFrameHeaderSize);
  }
  if (!r.ok()) {
    // Only payload contents are checked beyond what the view checks.
    check(r.error() == ddiloco::WireError::bad_payload ? view.ok() : (!view.ok() && view.error() == r.error()));
    return;
  }
  check(view.ok());
  const ddiloco::Message& m = r.value();
  const ddiloco::FrameHeader& h = view.value().header;
  check(m.payload_size() == h.elements);
  check(frame.size() == ddiloco::kFrameHeaderSize + ddiloco::encoded_size(h.codec, m.payload_size()));
  check(m.steps >= 0 && m.tokens >= 0);

  const auto again = ddiloco::decode_frame(ddiloco::encode_frame(m, ddiloco::Codec::fp32), kLimits);
  check(again.ok());
  const ddiloco::Message& a = again.value();
  check(a.type == m.type && a.fingerprint == m.fingerprint && a.learner == m.learner && a.fragment == m.fragment &&
        a.version == m.version && a.sequence == m.sequence && a.steps == m.steps && a.tokens == m.tokens &&
        a.step == m.step && a.payload_size() == m.payload_size());
  if (m.payload_size() != 0) {
    check(std::memcmp(a.payload->data(), m.payload->data(), m.payload_bytes()) == 0);  // bitwise, NaNs too
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> raw(reinterpret_cast<const std::byte*>(data), size);
  decode_and_check(raw);
  if (size >= ddiloco::kFrameHeaderSize) {
    std::vector<std::byte> sealed(raw.begin(), raw.end());
    const auto payload = std::span<const std::byte>(sealed).subspan(ddiloco::kFrameHeaderSize);
    ddiloco::detail::store_u32(sealed.data() + 80, ddiloco::detail::crc32c(payload));
    ddiloco::detail::store_u32(sealed.data() + 84,
                               ddiloco::detail::crc32c(std::span<const std::byte>(sealed).first(84)));
    decode_and_check(sealed);
  }
  return 0;
}
