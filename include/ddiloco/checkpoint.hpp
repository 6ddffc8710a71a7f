// ddiloco/checkpoint.hpp: the syncer's checkpoint files (durability).
//
// What it is: a binary file format for a SyncerSnapshot, an atomic writer
// (temporary file, fsync, rename, fsync of the directory) that keeps the newest
// K files, and a loader that takes the newest file that passes every check and
// reports each one it skipped (truncated, corrupted, inconsistent) with a reason.
// What it is not: a scheduler (when to checkpoint is the syncer program's
// choice, on an interval and on SIGTERM/SIGINT), nor a general serialiser: it
// knows exactly one record, SyncerSnapshot (<ddiloco/syncer_snapshot.hpp>).
//
// # File format, version 1 (every integer little-endian, floats as IEEE-754
// binary32 bits, doubles as binary64 bits)
//
//   header, 32 bytes:
//     magic           8 bytes  "DDILOCKP"
//     format_version  u32      1
//     section_count   u32
//     serial          u64      the number in the file name
//     body_length     u64      bytes of sections that follow the header
//   body: section_count sections, each
//     tag             u32      1 = meta, 2 = fragment, 3 = members, 4 = tensors,
//                              5 = epoch
//     reserved        u32      0
//     length          u64      bytes of the section's content
//     content         length bytes
//   trailer:
//     checksum        u32      CRC-32C (detail/checksum.hpp) of header and body
//
//   meta (exactly one, first):  fingerprint u64, optimizer name (u64 length +
//     bytes), fragment count u64, joins, leaves, deaths, bytes_in, bytes_out
//     (u64 each), reject-reason count u64, that many u64 counters.
//   fragment (one per fragment, in order): index u64, version u64, norm_ema f64,
//     norm_samples u64, merges, last_quorum_size, contributions_merged,
//     grace_waits, deadline_merges, accepted, rejected_duplicate,
//     rejected_stale, rejected_future, rejected_norm (u64 each), quorum_sizes
//     (u64 count + u64 values), last_sequence (u64 count + pairs of u64 learner
//     id, u64 sequence), theta (u64 count + f32 values), state (u64 count + f32).
//   members (exactly one): u64 count, then per learner: id, incarnation,
//     first_sequence, join_nonce (u64 each).
//   tensors (optional, at most one; files written before it existed have
//     none): u64 count, then per tensor in plan order: name (u64 length +
//     bytes), flags u64 (bit 0: embedding; the other bits 0), rank u64, rank
//     u64 dimensions. It names the values in `theta`, so that a checkpoint can
//     be exported (ddiloco_export, docs/weights.md) without the tensor list it
//     was made with. A reader checks that the names are unique and non-empty,
//     that no tensor is empty and that the sizes add up to the fragments'.
//   epoch (optional, at most one; files written before it existed have none,
//     which reads as 0): sequence_epoch u64 (SyncerSnapshot::sequence_epoch,
//     the restores after a crash so far), below 2^16.
//   shard (optional, at most one; only a sharded syncer's files have it, which
//     reads as shard 0 of 1): shard_index u64, shard_count u64, shard map
//     fingerprint u64 (SyncerSnapshot). Such a file holds empty theta and
//     state for the fragments other shards serve, and no tensors section.
//   Sections with another tag are skipped (room for later additions), so the
//   format version stays 1: older readers skip the tensors and epoch sections
//   (and a syncer of theirs restoring such a file starts from epoch 0, as it
//   always did).
//
// A reader never trusts a length: the file size must equal 32 + body_length +
// 4 before anything else is read, every count is compared with the bytes left
// before memory is allocated, and each section must be consumed exactly.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <ddiloco/detail/checksum.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/syncer.hpp>

namespace ddiloco {

inline constexpr std::array<char, 8> kCheckpointMagic{'D', 'D', 'I', 'L', 'O', 'C', 'K', 'P'};
inline constexpr std::uint32_t kCheckpointFormatVersion = 1;

struct CheckpointOptions {
  /// Number of checkpoint files kept in the directory (the newest ones); >= 1.
  std::size_t keep = 3;
};

/// A tensor as a checkpoint records it (the optional tensors section): what
/// the values in its fragments' `theta` are called and how they are shaped.
struct CheckpointTensor {
  std::string name;
  std::vector<std::uint64_t> shape;  ///< row-major; its product is the tensor's numel
  bool embedding = false;

  friend bool operator==(const CheckpointTensor&, const CheckpointTensor&) = default;
};

/// A checkpoint read back from a file.
struct LoadedCheckpoint {
  std::filesystem::path path;
  std::uint64_t serial = 0;
  SyncerSnapshot snapshot;
  /// The plan's tensors in plan order, or empty if the file records none.
  std::vector<CheckpointTensor> tensors;
};

/// A checkpoint file that load_newest_valid() skipped, and why.
struct CheckpointProblem {
  std::filesystem::path path;
  std::string reason;
};

/// The file name of checkpoint `serial`: "checkpoint-<20 digits>.ddck", zero
/// padded so that names sort like serials.
inline std::string checkpoint_file_name(std::uint64_t serial) {
  std::string digits = std::to_string(serial);
  return "checkpoint-" + std::string(20 - digits.size(), '0') + digits + ".ddck";
}

/// The serial of a checkpoint file name, or nullopt if `name` is not one
/// (temporary files and anything else in the directory are not).
inline std::optional<std::uint64_t> checkpoint_serial(std::string_view name) {
  constexpr std::string_view prefix = "checkpoint-", suffix = ".ddck";
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) || !name.ends_with(suffix))
    return std::nullopt;
  const std::string_view digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > 20 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc{} || end != digits.data() + digits.size()) return std::nullopt;
  return v;
}

namespace detail {

enum class CheckpointSection : std::uint32_t { meta = 1, fragment = 2, members = 3, tensors = 4, epoch = 5, shard = 6 };
inline constexpr std::size_t kCheckpointHeaderBytes = 32;
inline constexpr std::size_t kCheckpointTrailerBytes = 4;
inline constexpr std::size_t kCheckpointSectionHeaderBytes = 16;

/// CRC-32C: detects every burst of up to 32 corrupted bits, and runs at memory
/// speed with SSE4.2, which matters for checkpoints of gigabytes.
inline std::uint32_t checkpoint_checksum(std::span<const std::byte> bytes) { return crc32c(bytes); }

/// Appends little-endian values to a byte buffer.
class ByteWriter {
 public:
  void u32(std::uint32_t v) { put_le(v, 4); }
  void u64(std::uint64_t v) { put_le(v, 8); }
  void f64(double v) { u64(std::bit_cast<std::uint64_t>(v)); }
  void str(std::string_view s) {
    u64(s.size());
    const auto* b = reinterpret_cast<const std::byte*>(s.data());
    buf_.insert(buf_.end(), b, b + s.size());
  }
  void floats(std::span<const float> v) {
    u64(v.size());
    if constexpr (std::endian::native == std::endian::little) {
      const auto* b = reinterpret_cast<const std::byte*>(v.data());
      buf_.insert(buf_.end(), b, b + v.size_bytes());
    } else {
      for (float x : v) u32(std::bit_cast<std::uint32_t>(x));
    }
  }
  /// Overwrites 8 bytes at `at` (a length reserved earlier).
  void patch_u64(std::size_t at, std::uint64_t v) {
    for (std::size_t i = 0; i < 8; ++i) buf_[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFU);
  }
  [[nodiscard]] std::size_t size() const noexcept { return buf_.size(); }
  [[nodiscard]] std::vector<std::byte>& bytes() noexcept { return buf_; }

 private:
  void put_le(std::uint64_t v, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) buf_.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xFFU));
  }
  std::vector<std::byte> buf_;
};

/// Reads little-endian values from a byte range; every read checks the bytes
/// left first. A failed read sets `error` (the first one wins) and returns 0.
class ByteReader {
 public:
  explicit ByteReader(std::span<const std::byte> b) : b_(b) {}

  [[nodiscard]] std::size_t left() const noexcept { return b_.size() - pos_; }
  [[nodiscard]] bool ok() const noexcept { return error.empty(); }

  std::uint32_t u32(std::string_view what) { return static_cast<std::uint32_t>(get_le(4, what)); }
  std::uint64_t u64(std::string_view what) { return get_le(8, what); }
  double f64(std::string_view what) { return std::bit_cast<double>(u64(what)); }

  /// A count of items of `item_bytes` each that must fit in the bytes left.
  std::size_t count(std::size_t item_bytes, std::string_view what) {
    const std::uint64_t n = u64(what);
    if (!ok()) return 0;
    if (n > left() / item_bytes) {
      fail(msg(what, " = ", n, " items of ", item_bytes, " bytes, but only ", left(), " bytes are left"));
      return 0;
    }
    return static_cast<std::size_t>(n);
  }
  std::string str(std::string_view what) {
    const std::size_t n = count(1, what);
    if (!ok()) return {};
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  std::vector<float> floats(std::string_view what) {
    const std::size_t n = count(4, what);
    if (!ok()) return {};
    std::vector<float> v(n);
    if constexpr (std::endian::native == std::endian::little) {
      if (n > 0) std::memcpy(v.data(), b_.data() + pos_, n * 4);
      pos_ += n * 4;
    } else {
      for (auto& x : v) x = std::bit_cast<float>(u32(what));
    }
    return v;
  }
  std::span<const std::byte> take(std::size_t n, std::string_view what) {
    if (n > left()) {
      fail(msg(what, " needs ", n, " bytes but only ", left(), " are left"));
      return {};
    }
    auto s = b_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  void fail(std::string reason) {
    if (error.empty()) error = std::move(reason);
  }

  std::string error;

 private:
  std::uint64_t get_le(std::size_t n, std::string_view what) {
    if (!ok()) return 0;
    if (left() < n) {
      fail(msg(what, " needs ", n, " bytes but only ", left(), " are left"));
      return 0;
    }
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) v |= std::to_integer<std::uint64_t>(b_[pos_ + i]) << (8 * i);
    pos_ += n;
    return v;
  }

  std::span<const std::byte> b_;
  std::size_t pos_ = 0;
};

inline void write_section(ByteWriter& w, CheckpointSection tag, auto&& content) {
  w.u32(static_cast<std::uint32_t>(tag));
  w.u32(0);
  const std::size_t length_at = w.size();
  w.u64(0);
  const std::size_t start = w.size();
  content(w);
  w.patch_u64(length_at, w.size() - start);
}

inline std::string parse_meta(ByteReader& r, SyncerSnapshot& s, std::uint64_t& fragment_count) {
  s.fingerprint = r.u64("meta.fingerprint");
  s.optimizer = r.str("meta.optimizer length");
  fragment_count = r.u64("meta.fragment_count");
  s.joins = r.u64("meta.joins");
  s.leaves = r.u64("meta.leaves");
  s.deaths = r.u64("meta.deaths");
  s.bytes_in = r.u64("meta.bytes_in");
  s.bytes_out = r.u64("meta.bytes_out");
  const std::size_t reasons = r.count(8, "meta.reject_reason_count");
  if (r.ok() && reasons > kRejectReasons)
    return msg("meta: ", reasons, " reject reasons but this build knows ", kRejectReasons,
               " (written by a newer version?)");
  for (std::size_t i = 0; i < reasons && r.ok(); ++i) s.rejected[i] = r.u64("meta.rejected");
  return r.error;
}

inline std::string parse_fragment(ByteReader& r, FragmentSnapshot& f, std::uint64_t& index) {
  index = r.u64("fragment.index");
  f.version = r.u64("fragment.version");
  f.norm_ema = r.f64("fragment.norm_ema");
  f.norm_samples = r.u64("fragment.norm_samples");
  f.status.merges = r.u64("fragment.merges");
  const std::uint64_t last_quorum = r.u64("fragment.last_quorum_size");
  f.status.contributions_merged = r.u64("fragment.contributions_merged");
  f.status.grace_waits = r.u64("fragment.grace_waits");
  f.status.deadline_merges = r.u64("fragment.deadline_merges");
  f.accepted = r.u64("fragment.accepted");
  f.rejected_duplicate = r.u64("fragment.rejected_duplicate");
  f.rejected_stale = r.u64("fragment.rejected_stale");
  f.rejected_future = r.u64("fragment.rejected_future");
  f.rejected_norm = r.u64("fragment.rejected_norm");
  f.status.version = f.version;
  const std::size_t nq = r.count(8, "fragment.quorum_sizes count");
  f.quorum_sizes.reserve(nq);
  for (std::size_t k = 0; k < nq && r.ok(); ++k) f.quorum_sizes.push_back(r.u64("fragment.quorum_sizes"));
  const std::size_t ns = r.count(16, "fragment.last_sequence count");
  for (std::size_t k = 0; k < ns && r.ok(); ++k) {
    const std::uint64_t id = r.u64("fragment.last_sequence id");
    const std::uint64_t seq = r.u64("fragment.last_sequence value");
    if (!r.ok()) break;
    if (id > 0xFFFFFFFFULL) return msg("fragment ", index, ": learner id ", id, " does not fit in 32 bits");
    if (!f.last_sequence.emplace(static_cast<LearnerId>(id), seq).second)
      return msg("fragment ", index, ": learner id ", id, " appears twice in last_sequence");
  }
  f.theta = r.floats("fragment.theta count");
  f.state = r.floats("fragment.state count");
  if (r.ok()) {
    if (last_quorum > 0xFFFFFFFFULL) return msg("fragment ", index, ": last_quorum_size ", last_quorum, " is absurd");
    f.status.last_quorum_size = static_cast<std::size_t>(last_quorum);
  }
  return r.error;
}

inline std::string parse_members(ByteReader& r, SyncerSnapshot& s) {
  const std::size_t n = r.count(32, "members count");
  s.learners.reserve(n);
  for (std::size_t k = 0; k < n && r.ok(); ++k) {
    const std::uint64_t id = r.u64("member.id");
    LearnerSnapshot l;
    l.incarnation = r.u64("member.incarnation");
    l.first_sequence = r.u64("member.first_sequence");
    l.join_nonce = r.u64("member.join_nonce");
    if (!r.ok()) break;
    if (id > 0xFFFFFFFFULL) return msg("members: learner id ", id, " does not fit in 32 bits");
    l.id = static_cast<LearnerId>(id);
    if (!s.learners.empty() && l.id <= s.learners.back().id)
      return msg("members: learner id ", l.id, " follows ", s.learners.back().id, " (ids must be sorted, distinct)");
    s.learners.push_back(l);
  }
  return r.error;
}

inline std::string parse_tensors(ByteReader& r, std::vector<CheckpointTensor>& out) {
  const std::size_t n = r.count(24, "tensors count");
  out.reserve(n);
  std::set<std::string> names;
  for (std::size_t k = 0; k < n && r.ok(); ++k) {
    CheckpointTensor t;
    t.name = r.str("tensor name length");
    const std::uint64_t flags = r.u64("tensor flags");
    const std::size_t rank = r.count(8, "tensor rank");
    std::uint64_t numel = 1;
    for (std::size_t d = 0; d < rank && r.ok(); ++d) {
      t.shape.push_back(r.u64("tensor dimension"));
      if (t.shape.back() == 0 || numel > UINT64_MAX / t.shape.back())
        return msg("tensors: tensor ", k, " ('", t.name, "') has dimension ", t.shape.back(),
                   " (zero, or the shape overflows 64 bits)");
      numel *= t.shape.back();
    }
    if (!r.ok()) break;
    if (t.name.empty()) return msg("tensors: tensor ", k, " has an empty name");
    if ((flags & ~std::uint64_t{1}) != 0) return msg("tensors: tensor '", t.name, "' has unknown flags ", flags);
    if (!names.insert(t.name).second) return msg("tensors: the name '", t.name, "' appears twice");
    t.embedding = (flags & 1U) != 0;
    out.push_back(std::move(t));
  }
  return r.error;
}

inline std::uint64_t tensor_numel(const CheckpointTensor& t) noexcept {
  std::uint64_t n = 1;
  for (auto d : t.shape) n *= d;
  return n;
}

/// Parses a whole checkpoint file's bytes into `out`. Returns "" on success,
/// else the reason the file is not a valid checkpoint.
inline std::string parse_checkpoint(std::span<const std::byte> file, LoadedCheckpoint& out) {
  if (file.size() < kCheckpointHeaderBytes + kCheckpointTrailerBytes)
    return msg("short file: ", file.size(), " bytes, a checkpoint has at least ",
               kCheckpointHeaderBytes + kCheckpointTrailerBytes);
  if (!std::equal(kCheckpointMagic.begin(), kCheckpointMagic.end(), file.begin(),
                  [](char a, std::byte b) { return static_cast<std::byte>(a) == b; }))
    return "bad magic: not a ddiloco checkpoint";
  ByteReader h(file.subspan(8, kCheckpointHeaderBytes - 8));
  const std::uint32_t version = h.u32("format_version");
  const std::uint32_t sections = h.u32("section_count");
  const std::uint64_t serial = h.u64("serial");
  const std::uint64_t body = h.u64("body_length");
  if (version != kCheckpointFormatVersion)
    return msg("format version ", version, ", this build reads version ", kCheckpointFormatVersion);
  const std::size_t payload = file.size() - kCheckpointHeaderBytes - kCheckpointTrailerBytes;
  if (body != payload)
    return msg("length mismatch: header says the body has ", body, " bytes, the file holds ", payload,
               " (truncated or appended to)");
  ByteReader t(file.subspan(file.size() - kCheckpointTrailerBytes));
  const std::uint32_t stored = t.u32("checksum");
  const std::uint32_t computed = checkpoint_checksum(file.first(file.size() - kCheckpointTrailerBytes));
  if (stored != computed) return msg("checksum mismatch: stored ", stored, ", computed ", computed);

  out.serial = serial;
  SyncerSnapshot& s = out.snapshot;
  ByteReader r(file.subspan(kCheckpointHeaderBytes, payload));
  bool have_meta = false, have_members = false, have_tensors = false, have_epoch = false, have_shard = false;
  std::uint64_t fragment_count = 0;
  for (std::uint32_t k = 0; k < sections; ++k) {
    const std::uint32_t tag = r.u32("section tag");
    r.u32("section reserved");
    const std::uint64_t length = r.u64("section length");
    if (!r.ok()) return msg("section ", k, ": ", r.error);
    if (length > r.left())
      return msg("section ", k, ": length ", length, " exceeds the ", r.left(), " bytes left in the body");
    ByteReader c(r.take(static_cast<std::size_t>(length), "section"));
    std::string err;
    switch (static_cast<CheckpointSection>(tag)) {
      case CheckpointSection::meta:
        if (have_meta) return "a second meta section";
        if (k != 0) return "the meta section is not the first";
        have_meta = true;
        err = parse_meta(c, s, fragment_count);
        break;
      case CheckpointSection::fragment: {
        if (!have_meta) return "a fragment section before the meta section";
        FragmentSnapshot f;
        std::uint64_t index = 0;
        err = parse_fragment(c, f, index);
        if (err.empty() && index != s.fragments.size())
          err = msg("fragment section with index ", index, " where ", s.fragments.size(), " was expected");
        if (err.empty() && s.fragments.size() >= fragment_count)
          err = msg("more fragment sections than the ", fragment_count, " announced");
        if (err.empty()) s.fragments.push_back(std::move(f));
        break;
      }
      case CheckpointSection::members:
        if (have_members) return "a second members section";
        have_members = true;
        err = parse_members(c, s);
        break;
      case CheckpointSection::tensors:
        if (have_tensors) return "a second tensors section";
        have_tensors = true;
        err = parse_tensors(c, out.tensors);
        break;
      case CheckpointSection::epoch:
        if (have_epoch) return "a second epoch section";
        have_epoch = true;
        s.sequence_epoch = c.u64("epoch.sequence_epoch");
        if (c.ok() && s.sequence_epoch >= (std::uint64_t{1} << (64 - kSequenceEpochShift)))
          err = msg("epoch: sequence epoch ", s.sequence_epoch, " does not fit in ", 64 - kSequenceEpochShift, " bits");
        else
          err = c.error;
        break;
      case CheckpointSection::shard:
        if (have_shard) return "a second shard section";
        have_shard = true;
        s.shard_index = c.u64("shard.index");
        s.shard_count = c.u64("shard.count");
        s.shard_map = c.u64("shard.map");
        if (c.ok() && (s.shard_count < 2 || s.shard_count > kMaxShards || s.shard_index >= s.shard_count))
          err = msg("shard: shard ", s.shard_index, " of ", s.shard_count, " does not exist (count in [2, ", kMaxShards,
                    "], index below it)");
        else
          err = c.error;
        break;
      default: continue;  // unknown section: skipped
    }
    if (!err.empty()) return msg("section ", k, " (tag ", tag, "): ", err);
    if (c.left() != 0)
      return msg("section ", k, " (tag ", tag, "): ", c.left(), " bytes left over after its content");
  }
  if (r.left() != 0) return msg(r.left(), " bytes after the ", sections, " sections announced");
  if (!have_meta) return "no meta section";
  if (!have_members) return "no members section";
  if (s.fragments.size() != fragment_count)
    return msg(s.fragments.size(), " fragment sections but meta announces ", fragment_count);
  if (have_tensors && have_shard) return "a shard's checkpoint with a tensors section (it holds only some fragments)";
  if (have_tensors) {
    std::uint64_t recorded = 0, held = 0;
    for (const auto& rec : out.tensors) recorded += tensor_numel(rec);
    for (const auto& f : s.fragments) held += f.theta.size();
    if (recorded != held)
      return msg("the tensors section names ", recorded, " elements but the fragments hold ", held);
  }
  return {};
}

/// Throws StateError naming the path and errno.
[[noreturn]] inline void throw_io(std::string_view what, const std::filesystem::path& path, int err) {
  throw StateError(msg("checkpoint: ", what, " '", path.string(), "' failed: ", std::generic_category().message(err),
                       "; check that the checkpoint directory exists, is writable and has space"));
}

/// Closes a POSIX file descriptor on scope exit.
struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

inline void write_all_and_sync(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  FdGuard f{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (f.fd < 0) throw_io("creating", path, errno);
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ::ssize_t n = ::write(f.fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_io("writing", path, errno);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(f.fd) != 0) throw_io("fsync of", path, errno);
  const int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) throw_io("closing", path, errno);
}

inline void sync_directory(const std::filesystem::path& dir) {
  FdGuard d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (d.fd < 0) throw_io("opening directory", dir, errno);
  if (::fsync(d.fd) != 0) throw_io("fsync of directory", dir, errno);
}

/// Checkpoint files in `dir` as (serial, path), newest first.
inline std::vector<std::pair<std::uint64_t, std::filesystem::path>> list_checkpoints(
    const std::filesystem::path& dir) {
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (!e.is_regular_file(ec)) continue;
    if (auto serial = checkpoint_serial(e.path().filename().string())) files.emplace_back(*serial, e.path());
  }
  std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return files;
}

}  // namespace detail

/// The records of `plan`'s tensors, in plan order, for the tensors section:
/// shape `shapes[i]` for tensor i, or [numel] when `shapes` is empty. Throws
/// ShapeMismatch naming the tensor if a shape's product is not its numel.
inline std::vector<CheckpointTensor> checkpoint_tensors(const Plan& plan,
                                                        std::span<const std::vector<std::uint64_t>> shapes = {}) {
  if (!shapes.empty() && shapes.size() != plan.num_tensors())
    throw ShapeMismatch(detail::msg("checkpoint_tensors: ", shapes.size(), " shapes for the plan's ",
                                    plan.num_tensors(), " tensors; give one shape per tensor, or none"));
  std::vector<CheckpointTensor> out;
  out.reserve(plan.num_tensors());
  for (std::size_t i = 0; i < plan.num_tensors(); ++i) {
    const auto& t = plan.tensors()[i];
    CheckpointTensor c{t.name, shapes.empty() ? std::vector<std::uint64_t>{t.numel} : shapes[i], t.embedding};
    if (detail::tensor_numel(c) != t.numel)
      throw ShapeMismatch(detail::msg("checkpoint_tensors: tensor '", t.name, "' has ", t.numel,
                                      " elements but its shape holds ", detail::tensor_numel(c)));
    out.push_back(std::move(c));
  }
  return out;
}

/// The bytes of checkpoint `serial` holding `s` (format above), with a tensors
/// section when `tensors` is not empty (from checkpoint_tensors(plan)).
inline std::vector<std::byte> encode_checkpoint(const SyncerSnapshot& s, std::uint64_t serial,
                                                std::span<const CheckpointTensor> tensors = {}) {
  detail::ByteWriter w;
  for (char c : kCheckpointMagic) w.bytes().push_back(static_cast<std::byte>(c));
  w.u32(kCheckpointFormatVersion);
  const bool sharded = s.shard_count > 1;
  if (sharded && !tensors.empty())
    throw InvalidArgument("encode_checkpoint: a shard's checkpoint holds only its own fragments and takes no tensors "
                          "section (pass none)");
  w.u32(static_cast<std::uint32_t>(3 + s.fragments.size() + (tensors.empty() ? 0 : 1) + (sharded ? 1 : 0)));
  w.u64(serial);
  w.u64(0);  // body length, patched below
  using detail::CheckpointSection;
  detail::write_section(w, CheckpointSection::meta, [&](detail::ByteWriter& o) {
    o.u64(s.fingerprint);
    o.str(s.optimizer);
    o.u64(s.fragments.size());
    for (auto v : {s.joins, s.leaves, s.deaths, s.bytes_in, s.bytes_out}) o.u64(v);
    o.u64(s.rejected.size());
    for (auto v : s.rejected) o.u64(v);
  });
  for (std::size_t p = 0; p < s.fragments.size(); ++p) {
    const auto& f = s.fragments[p];
    detail::write_section(w, CheckpointSection::fragment, [&](detail::ByteWriter& o) {
      o.u64(p);
      o.u64(f.version);
      o.f64(f.norm_ema);
      o.u64(f.norm_samples);
      for (std::uint64_t v : {f.status.merges, static_cast<std::uint64_t>(f.status.last_quorum_size),
                              f.status.contributions_merged, f.status.grace_waits, f.status.deadline_merges,
                              f.accepted, f.rejected_duplicate, f.rejected_stale, f.rejected_future,
                              f.rejected_norm})
        o.u64(v);
      o.u64(f.quorum_sizes.size());
      for (auto v : f.quorum_sizes) o.u64(v);
      o.u64(f.last_sequence.size());
      for (const auto& [id, seq] : f.last_sequence) {
        o.u64(id);
        o.u64(seq);
      }
      o.floats(f.theta);
      o.floats(f.state);
    });
  }
  detail::write_section(w, CheckpointSection::members, [&](detail::ByteWriter& o) {
    o.u64(s.learners.size());
    for (const auto& l : s.learners)
      for (auto v : {static_cast<std::uint64_t>(l.id), l.incarnation, l.first_sequence, l.join_nonce}) o.u64(v);
  });
  detail::write_section(w, CheckpointSection::epoch, [&](detail::ByteWriter& o) { o.u64(s.sequence_epoch); });
  if (sharded) {
    detail::write_section(w, CheckpointSection::shard, [&](detail::ByteWriter& o) {
      o.u64(s.shard_index);
      o.u64(s.shard_count);
      o.u64(s.shard_map);
    });
  }
  if (!tensors.empty()) {
    detail::write_section(w, CheckpointSection::tensors, [&](detail::ByteWriter& o) {
      o.u64(tensors.size());
      for (const auto& t : tensors) {
        o.str(t.name);
        o.u64(t.embedding ? 1 : 0);
        o.u64(t.shape.size());
        for (auto d : t.shape) o.u64(d);
      }
    });
  }
  w.patch_u64(24, w.size() - detail::kCheckpointHeaderBytes);
  w.u32(detail::checkpoint_checksum(w.bytes()));
  return std::move(w.bytes());
}

/// Parses checkpoint bytes; throws ProtocolError with the reason if they are
/// not a valid checkpoint.
inline LoadedCheckpoint decode_checkpoint(std::span<const std::byte> bytes) {
  LoadedCheckpoint c;
  if (std::string err = detail::parse_checkpoint(bytes, c); !err.empty())
    throw ProtocolError(detail::msg("checkpoint: ", err));
  return c;
}

/// Writes checkpoint `serial` into `dir` (created if missing) atomically: the
/// bytes go to a temporary file in `dir`, which is fsync'ed and renamed to
/// checkpoint_file_name(serial), then `dir` is fsync'ed; a crash at any point
/// leaves either the previous files or the complete new one. Then only the
/// newest `options.keep` checkpoint files are kept (the one just written is
/// never deleted) and temporary files left by earlier crashes are removed.
/// Serials should grow from one call to the next (resume at loaded serial + 1).
/// `tensors` (from checkpoint_tensors(plan)) names the values, for export.
/// Returns the new file's path. Throws InvalidArgument if options.keep == 0,
/// StateError if the file system refuses.
inline std::filesystem::path write_checkpoint(const std::filesystem::path& dir, const SyncerSnapshot& s,
                                              std::uint64_t serial, CheckpointOptions options = {},
                                              std::span<const CheckpointTensor> tensors = {}) {
  if (options.keep == 0)
    throw InvalidArgument("write_checkpoint: CheckpointOptions::keep = 0 would delete every checkpoint; use >= 1 "
                          "(default 3)");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) detail::throw_io("creating directory", dir, ec.value());
  const std::string name = checkpoint_file_name(serial);
  const std::filesystem::path final_path = dir / name;
  const std::filesystem::path tmp_path = dir / ("." + name + ".tmp-" + std::to_string(::getpid()));
  const std::vector<std::byte> bytes = encode_checkpoint(s, serial, tensors);
  try {
    detail::write_all_and_sync(tmp_path, bytes);
  } catch (...) {
    std::filesystem::remove(tmp_path, ec);
    throw;
  }
  if (::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    const int err = errno;
    std::filesystem::remove(tmp_path, ec);
    detail::throw_io("renaming to", final_path, err);
  }
  detail::sync_directory(dir);

  // Retention: the newest `keep` by serial, always including the new file.
  std::size_t kept = 1;
  for (const auto& [file_serial, path] : detail::list_checkpoints(dir)) {
    (void)file_serial;
    if (path.filename() == name) continue;
    if (kept < options.keep) {
      ++kept;
      continue;
    }
    std::filesystem::remove(path, ec);
  }
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string();
    if (f.starts_with(".checkpoint-") && f.find(".ddck.tmp-") != std::string::npos) std::filesystem::remove(e.path(), ec);
  }
  return final_path;
}

/// Reads one checkpoint file. Throws ProtocolError naming the file and the
/// reason if it is not a valid checkpoint, StateError if it cannot be read.
inline LoadedCheckpoint read_checkpoint(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) detail::throw_io("opening", path, errno);
  const std::streamoff size = in.tellg();
  if (size < 0) detail::throw_io("sizing", path, errno);
  std::vector<std::byte> bytes(static_cast<std::size_t>(size));
  in.seekg(0);
  if (!in.read(reinterpret_cast<char*>(bytes.data()), size)) detail::throw_io("reading", path, errno);
  LoadedCheckpoint c;
  if (std::string err = detail::parse_checkpoint(bytes, c); !err.empty())
    throw ProtocolError(detail::msg("checkpoint '", path.string(), "': ", err,
                                    "; use an older checkpoint (load_newest_valid does this)"));
  if (const auto named = checkpoint_serial(path.filename().string()); named && *named != c.serial)
    throw ProtocolError(detail::msg("checkpoint '", path.string(), "': file name says serial ", *named,
                                    " but the header says ", c.serial, " (renamed or copied over?)"));
  c.path = path;
  return c;
}

/// The newest checkpoint in `dir` that passes every check, or nullopt if there
/// is none (or `dir` does not exist). Files are tried newest serial first; each
/// one that is truncated, corrupted or inconsistent is appended to `skipped`
/// with the reason, and the next older one is tried. Temporary files and other
/// names are not checkpoints and are ignored.
inline std::optional<LoadedCheckpoint> load_newest_valid(const std::filesystem::path& dir,
                                                         std::vector<CheckpointProblem>& skipped) {
  for (const auto& [serial, path] : detail::list_checkpoints(dir)) {
    try {
      return read_checkpoint(path);
    } catch (const Error& e) {
      skipped.push_back({path, e.what()});
    }
  }
  return std::nullopt;
}

/// The plan checkpoint `c` was written with, rebuilt from its tensors section
/// with make_plan's default strategy and its fragment count, and checked
/// against its plan fingerprint. Throws StateError if the file records no
/// tensors (written without them: rebuild the plan from the syncer's own
/// tensor list and compare with check_checkpoint_plan), ProtocolError if the
/// rebuilt plan's fingerprint differs (another fragmentation strategy).
inline Plan checkpoint_plan(const LoadedCheckpoint& c) {
  if (c.tensors.empty())
    throw StateError(detail::msg("checkpoint '", c.path.string(), "' records no tensor names (written by an older "
                                 "version or without them); rebuild the plan from the tensor list the syncer ran "
                                 "with (the same --init/--tensors and --fragments)"));
  std::vector<TensorSpec> specs;
  specs.reserve(c.tensors.size());
  for (const auto& t : c.tensors)
    specs.push_back({t.name, static_cast<std::size_t>(detail::tensor_numel(t)), t.embedding});
  Plan plan = make_plan(specs, c.snapshot.fragments.size());
  if (plan.fingerprint() != c.snapshot.fingerprint)
    throw ProtocolError(detail::msg("checkpoint '", c.path.string(), "': its ", c.tensors.size(), " tensors in ",
                                    c.snapshot.fragments.size(), " fragments make a plan with fingerprint 0x", std::hex,
                                    plan.fingerprint(), " but the checkpoint's is 0x", c.snapshot.fingerprint,
                                    std::dec, "; it was written with another fragmentation strategy"));
  return plan;
}

/// Checks that `plan` (for example built from the --init or --tensors a
/// syncer was started with) is the plan checkpoint `c` was written with.
/// Throws ShapeMismatch naming the first tensor name, size or embedding flag
/// that differs from the checkpoint's records (when it has them), else the
/// fragment count or the fingerprints. `source` names where `plan` came from.
inline void check_checkpoint_plan(const LoadedCheckpoint& c, const Plan& plan, std::string_view source) {
  const std::string where = detail::msg("checkpoint '", c.path.string(), "' and ", source);
  const auto& specs = plan.tensors();
  for (std::size_t i = 0; !c.tensors.empty() && i < std::max(specs.size(), c.tensors.size()); ++i) {
    if (i >= specs.size())
      throw ShapeMismatch(detail::msg(where, " differ: the checkpoint has tensor '", c.tensors[i].name, "' (number ",
                                      i, ") that ", source, " lacks"));
    if (i >= c.tensors.size())
      throw ShapeMismatch(detail::msg(where, " differ: ", source, " has tensor '", specs[i].name, "' (number ", i,
                                      ") that the checkpoint lacks"));
    const auto& t = c.tensors[i];
    if (t.name != specs[i].name)
      throw ShapeMismatch(detail::msg(where, " differ at tensor ", i, ": '", specs[i].name, "' in ", source, ", '",
                                      t.name, "' in the checkpoint; use the tensor list the syncer ran with"));
    if (detail::tensor_numel(t) != specs[i].numel)
      throw ShapeMismatch(detail::msg(where, " differ at tensor '", t.name, "': ", specs[i].numel, " elements in ",
                                      source, ", ", detail::tensor_numel(t), " in the checkpoint"));
    if (t.embedding != specs[i].embedding)
      throw ShapeMismatch(detail::msg(where, " differ at tensor '", t.name, "': embedding ",
                                      specs[i].embedding ? "yes" : "no", " in ", source, ", ",
                                      t.embedding ? "yes" : "no", " in the checkpoint (check the embedding rule)"));
  }
  if (plan.num_fragments() != c.snapshot.fragments.size())
    throw ShapeMismatch(detail::msg(where, " differ: ", plan.num_fragments(), " fragments in ", source, ", ",
                                    c.snapshot.fragments.size(),
                                    " in the checkpoint; pass the --fragments the syncer ran with"));
  if (plan.fingerprint() != c.snapshot.fingerprint)
    throw ShapeMismatch(detail::msg(where, " differ: plan fingerprint 0x", std::hex, plan.fingerprint(), " from ",
                                    source, ", 0x", c.snapshot.fingerprint, " in the checkpoint", std::dec,
                                    "; use the tensor list, sizes, embedding flags and --fragments the syncer ran "
                                    "with"));
}

/// The global model of a sharded run from one checkpoint of each of its S
/// shards (in any order): fragment p's values from the shard that serves it.
/// For export (ddiloco_export): the result is unsharded (shard 0 of 1) and
/// holds the fragments and the plan fingerprint; membership and counters are
/// the shards' own business and are left empty. Throws ProtocolError naming
/// the file when the checkpoints are not exactly one per shard of one map of
/// one plan, or a fragment is held by no shard or by two.
inline LoadedCheckpoint combine_shards(std::span<const LoadedCheckpoint> shards) {
  if (shards.empty()) throw InvalidArgument("combine_shards: no checkpoint; give one per syncer shard");
  const SyncerSnapshot& first = shards[0].snapshot;
  const std::uint64_t s_count = first.shard_count;
  if (shards.size() != s_count)
    throw ProtocolError(detail::msg("combine_shards: '", shards[0].path.string(), "' is of shard ", first.shard_index,
                                    "/", s_count, ", so the run has ", s_count, " shards, but ", shards.size(),
                                    " checkpoints were given; give one of each shard"));
  std::vector<bool> seen(s_count, false);
  LoadedCheckpoint out;
  out.snapshot.fingerprint = first.fingerprint;
  out.snapshot.optimizer = first.optimizer;
  out.snapshot.fragments.resize(first.fragments.size());
  std::vector<bool> held(first.fragments.size(), false);
  for (const auto& c : shards) {
    const auto& s = c.snapshot;
    const std::string file = c.path.string();
    if (s.fingerprint != first.fingerprint || s.shard_count != s_count || s.shard_map != first.shard_map ||
        s.fragments.size() != first.fragments.size())
      throw ProtocolError(detail::msg("combine_shards: '", file, "' (plan ", detail::hex16(s.fingerprint), ", shard ",
                                      s.shard_index, "/", s.shard_count, ", map ", detail::hex16(s.shard_map),
                                      ") is not of the run of '", shards[0].path.string(), "' (plan ",
                                      detail::hex16(first.fingerprint), ", ", s_count, " shards, map ",
                                      detail::hex16(first.shard_map), ")"));
    if (seen[s.shard_index])
      throw ProtocolError(detail::msg("combine_shards: two checkpoints of shard ", s.shard_index, "/", s_count,
                                      " (the second is '", file, "'); give one of each shard"));
    seen[s.shard_index] = true;
    out.serial = std::max(out.serial, c.serial);
    for (std::size_t p = 0; p < s.fragments.size(); ++p) {
      if (s.fragments[p].theta.empty()) continue;
      if (held[p])
        throw ProtocolError(detail::msg("combine_shards: fragment ", p, " is held by two shards (again in '", file,
                                        "')"));
      held[p] = true;
      out.snapshot.fragments[p] = s.fragments[p];
    }
  }
  for (std::size_t p = 0; p < held.size(); ++p)
    if (!held[p]) throw ProtocolError(detail::msg("combine_shards: no shard's checkpoint holds fragment ", p));
  out.path = shards[0].path;
  return out;
}

/// As above, discarding the list of skipped files.
inline std::optional<LoadedCheckpoint> load_newest_valid(const std::filesystem::path& dir) {
  std::vector<CheckpointProblem> skipped;
  return load_newest_valid(dir, skipped);
}

}  // namespace ddiloco
