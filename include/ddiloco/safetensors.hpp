// ddiloco/safetensors.hpp: read and write model weights in the safetensors format.
//
// What it is: an optional integration (it needs nlohmann/json, Debian's
// nlohmann-json3-dev; the core headers need only the standard library) that
// reads a `.safetensors` file into tensor names, shapes and fp32 values, and
// writes fp32 tensors to one, atomically. It is how a model's initial weights
// go into `ddiloco_syncer --init model.safetensors` and how the trained global
// parameters come out (`ddiloco_export`), in the format PyTorch and Hugging
// Face users load. The user guide is docs/weights.md.
// What it is not: a general tensor library (only F32 and BF16 are read, only
// F32 is written) nor a memory-mapped reader (values are copied into vectors).
//
// # The format
//
//   8 bytes   N, the header length, unsigned 64-bit little-endian
//   N bytes   a UTF-8 JSON object (may end in spaces), one entry per tensor:
//               "name": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]}
//             and optionally "__metadata__": {"key": "value", ...} (strings only)
//   the rest  the data section: each tensor's bytes, row-major, little-endian,
//             at [begin, end) relative to the start of the data section
//
// # What the reader checks before it trusts anything
//
//   - the file holds at least 8 bytes, and N is at most 100 MB (the cap
//     Hugging Face's reader uses) and at most the bytes that follow;
//   - the header is well-formed JSON whose top level is an object, with no key
//     repeated in any object (a JSON parser would silently keep the last one);
//   - every entry has a string dtype, a shape of non-negative integers and two
//     integer data_offsets with begin <= end; "__metadata__" maps strings to strings;
//   - numel(shape) x dtype size == end - begin, with no overflow;
//   - the tensors, ordered by begin, tile the data section exactly: the first
//     starts at 0, each starts where the previous one ends (no overlap, no
//     gap), the last ends at the end of the file;
//   - dtype is F32 or BF16 (BF16 is widened to fp32 exactly: its 16 bits are
//     the high half of an fp32); any other dtype is refused, naming the tensor;
//   - every value is finite: NaN and +-Inf are refused, naming the tensor and
//     the element, unless SafetensorsReadOptions::allow_non_finite is set.
// Every failure throws a ddiloco::Error subclass (ProtocolError for a file that
// fails validation, InvalidArgument for a path that cannot be opened) whose
// message names the file, the tensor and the value.
//
// Tensors come back in the order of their data in the file (ascending
// data_offsets): the order in which write_safetensors stored them. Hugging
// Face's `safetensors.torch.save_file` stores them sorted by dtype, then name.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <ddiloco/error.hpp>
#include <ddiloco/fragmenter.hpp>

namespace ddiloco {

/// Largest JSON header the reader accepts, in bytes (Hugging Face's cap).
inline constexpr std::uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

/// One tensor read from a safetensors file.
struct SafetensorsTensor {
  std::string name;
  std::string dtype;                  ///< as stored in the file: "F32" or "BF16"
  std::vector<std::uint64_t> shape;   ///< row-major; [] is a scalar (one element)
  std::vector<float> values;          ///< numel(shape) values, widened to fp32
};

/// A whole safetensors file: its tensors in data order and its metadata.
struct SafetensorsFile {
  std::vector<SafetensorsTensor> tensors;                     ///< ascending data_offsets
  std::vector<std::pair<std::string, std::string>> metadata;  ///< "__metadata__", sorted by key
};

struct SafetensorsReadOptions {
  /// Accept NaN and +-Inf values (refused by default: they would poison a run).
  bool allow_non_finite = false;
};

/// One fp32 tensor to write: a view of the caller's values, not a copy.
struct SafetensorsView {
  std::string name;
  std::vector<std::uint64_t> shape;  ///< numel(shape) must equal values.size()
  std::span<const float> values;
};

struct SafetensorsWriteOptions {
  /// Written as "__metadata__" (string keys and values), for example {"format", "pt"}.
  std::vector<std::pair<std::string, std::string>> metadata;
  /// Write NaN and +-Inf values (refused by default).
  bool allow_non_finite = false;
};

/// The rule that marks embedding/unembedding tensors (merged with a plain
/// average, docs/algorithm.md) by name: a tensor is one if the ECMAScript
/// regular expression matches anywhere in its name (std::regex_search).
/// The default matches "embed" anywhere (embed_tokens, tok_embeddings,
/// word_embeddings) and the parts emb, wte, wpe, lm_head and head delimited
/// by '.', '_' or the ends of the name (GPT-2's transformer.wte.weight,
/// torch_gpt's tok_emb.weight and head.weight, the reference model's emb),
/// and not "heads", "header" or "member". An empty pattern marks no tensor.
inline constexpr std::string_view kDefaultEmbeddingPattern =
    "embed|(^|[._])(emb|wte|wpe|lm_head|head)([._]|$)";

class EmbeddingRule {
 public:
  /// Throws InvalidArgument naming the pattern if it is not a valid regex.
  explicit EmbeddingRule(std::string pattern = std::string(kDefaultEmbeddingPattern)) : pattern_(std::move(pattern)) {
    if (pattern_.empty()) return;
    try {
      re_ = std::regex(pattern_, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw InvalidArgument(detail::msg("embedding pattern '", pattern_, "' is not a valid ECMAScript regular "
                                        "expression (", e.what(), "); write for example 'embed|lm_head', or '' for none"));
    }
  }
  [[nodiscard]] bool operator()(std::string_view name) const {
    return !pattern_.empty() && std::regex_search(name.begin(), name.end(), re_);
  }
  [[nodiscard]] const std::string& pattern() const noexcept { return pattern_; }

 private:
  std::string pattern_;
  std::regex re_;
};

namespace detail {

/// One header entry, validated against the data section's size.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;
  std::vector<std::uint64_t> shape;
  std::uint64_t numel = 0;
  std::uint64_t begin = 0, end = 0;  // relative to the data section
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // ascending begin
  std::vector<std::pair<std::string, std::string>> metadata;
};

inline std::string shape_string(std::span<const std::uint64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// Parses and validates the JSON header (bytes after the 8-byte length) of a
/// file whose data section holds `data_bytes` bytes. `source` names the file.
inline SafetensorsHeader parse_safetensors_header(std::string_view text, std::uint64_t data_bytes,
                                                  std::string_view source) {
  using nlohmann::json;
  const std::size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos || text[first] != '{')
    throw ProtocolError(msg("safetensors '", source, "': the header does not start with a JSON object ('{'); "
                            "not a safetensors file, or its first 8 bytes are not the header length"));
  // nlohmann/json keeps the last of two equal keys; the callback sees every
  // key, one set of keys per open object, so a repeated one is caught.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  const auto watch = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == json::parse_event_t::key && !open_objects.empty()) {
      const std::string key = parsed.get<std::string>();
      if (!open_objects.back().insert(key).second && duplicate.empty())
        duplicate = depth == 1 ? msg("tensor name '", key, "'") : msg("key '", key, "' inside an entry");
    }
    return true;
  };
  json root;
  try {
    root = json::parse(text.begin(), text.end(), watch, /*allow_exceptions=*/true);
  } catch (const json::exception& e) {
    throw ProtocolError(msg("safetensors '", source, "': the header is not valid JSON (", e.what(),
                            "); the file is damaged or not a safetensors file"));
  }
  if (!duplicate.empty())
    throw ProtocolError(msg("safetensors '", source, "': the header repeats ", duplicate,
                            "; names must be unique, rewrite the file with one entry per tensor"));
  if (!root.is_object())
    throw ProtocolError(msg("safetensors '", source, "': the header is JSON but not an object"));

  SafetensorsHeader h;
  for (const auto& [name, entry] : root.items()) {
    const std::string where = msg("safetensors '", source, "': tensor '", name, "'");
    if (name == "__metadata__") {
      if (!entry.is_object())
        throw ProtocolError(msg("safetensors '", source, "': __metadata__ is ", entry.type_name(),
                                ", expected an object of strings"));
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          throw ProtocolError(msg("safetensors '", source, "': __metadata__ key '", k, "' holds ", v.type_name(),
                                  " ", v.dump(), "; metadata values must be strings"));
        h.metadata.emplace_back(k, v.get<std::string>());
      }
      continue;
    }
    if (!entry.is_object())
      throw ProtocolError(msg(where, " is ", entry.type_name(), " ", entry.dump(),
                              "; expected {\"dtype\": ..., \"shape\": [...], \"data_offsets\": [begin, end]}"));
    SafetensorsEntry e;
    e.name = name;
    const auto dtype = entry.find("dtype");
    if (dtype == entry.end() || !dtype->is_string())
      throw ProtocolError(msg(where, ": \"dtype\" is missing or not a string"));
    e.dtype = dtype->get<std::string>();
    if (e.dtype != "F32" && e.dtype != "BF16")
      throw ProtocolError(msg(where, " has dtype ", e.dtype, ", which ddiloco does not read; it reads F32 and BF16: "
                              "convert the tensor before saving (in PyTorch: t.float() or t.bfloat16())"));
    const auto shape = entry.find("shape");
    if (shape == entry.end() || !shape->is_array())
      throw ProtocolError(msg(where, ": \"shape\" is missing or not an array"));
    e.numel = 1;
    bool overflow = false;
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned())
        throw ProtocolError(msg(where, ": shape ", shape->dump(), " holds ", d.dump(),
                                "; dimensions are non-negative integers"));
      const auto v = d.get<std::uint64_t>();
      e.shape.push_back(v);
      if (v != 0 && e.numel > std::numeric_limits<std::uint64_t>::max() / v) overflow = true;
      e.numel *= v;
    }
    if (overflow) throw ProtocolError(msg(where, ": shape ", shape->dump(), " has more than 2^64 elements"));
    const auto offsets = entry.find("data_offsets");
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned())
      throw ProtocolError(msg(where, ": \"data_offsets\" ",
                              offsets == entry.end() ? std::string("is missing") : "is " + offsets->dump(),
                              "; expected [begin, end], two non-negative integers"));
    e.begin = (*offsets)[0].get<std::uint64_t>();
    e.end = (*offsets)[1].get<std::uint64_t>();
    if (e.end < e.begin)
      throw ProtocolError(msg(where, ": data_offsets [", e.begin, ", ", e.end, "] end before they begin"));
    if (e.end > data_bytes)
      throw ProtocolError(msg(where, ": data_offsets [", e.begin, ", ", e.end, "] reach past the data section, which "
                              "holds ", data_bytes, " bytes (the file is truncated, or its header lies)"));
    const std::uint64_t size = e.dtype == "F32" ? 4 : 2;
    if (e.numel > std::numeric_limits<std::uint64_t>::max() / size || e.numel * size != e.end - e.begin)
      throw ProtocolError(msg(where, ": shape ", shape_string(e.shape), " of ", e.dtype, " needs ", e.numel, " x ",
                              size, " bytes, but data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin,
                              " (the header lies about the size)"));
    h.entries.push_back(std::move(e));
  }
  std::sort(h.metadata.begin(), h.metadata.end());
  std::sort(h.entries.begin(), h.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end != b.end ? a.end < b.end : a.name < b.name;
  });
  // The data section must be tiled exactly, as the format requires.
  std::uint64_t cursor = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const auto& e : h.entries) {
    if (e.begin < cursor)
      throw ProtocolError(msg("safetensors '", source, "': tensor '", e.name, "' at data_offsets [", e.begin, ", ",
                              e.end, "] overlaps tensor '", previous->name, "' at [", previous->begin, ", ",
                              previous->end, "]; the header lies about the offsets"));
    if (e.begin > cursor)
      throw ProtocolError(msg("safetensors '", source, "': ", e.begin - cursor, " bytes at [", cursor, ", ", e.begin,
                              ") before tensor '", e.name, "' belong to no tensor; the format requires the tensors to "
                              "be contiguous (the header lies about the offsets)"));
    cursor = e.end;
    previous = &e;
  }
  if (cursor != data_bytes)
    throw ProtocolError(msg("safetensors '", source, "': the tensors end at data byte ", cursor, " but the data section "
                            "holds ", data_bytes, " bytes; ", data_bytes - cursor,
                            " trailing bytes belong to no tensor (appended to, or the header lies)"));
  return h;
}

/// Converts one entry's bytes (little-endian) to fp32 values, checking the
/// dtype and, unless allowed, finiteness.
inline std::vector<float> safetensors_values(const SafetensorsEntry& e, std::span<const std::byte> bytes,
                                             std::string_view source, const SafetensorsReadOptions& options) {
  std::vector<float> out(static_cast<std::size_t>(e.numel));
  if (e.dtype == "F32") {
    if constexpr (std::endian::native == std::endian::little) {
      if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
    } else {
      for (std::size_t i = 0; i < out.size(); ++i) {
        std::uint32_t u = 0;
        for (std::size_t b = 0; b < 4; ++b) u |= std::to_integer<std::uint32_t>(bytes[4 * i + b]) << (8 * b);
        out[i] = std::bit_cast<float>(u);
      }
    }
  } else if (e.dtype == "BF16") {
    // bfloat16 is the high 16 bits of an fp32: widening is exact.
    for (std::size_t i = 0; i < out.size(); ++i) {
      const std::uint32_t u = std::to_integer<std::uint32_t>(bytes[2 * i]) |
                              (std::to_integer<std::uint32_t>(bytes[2 * i + 1]) << 8);
      out[i] = std::bit_cast<float>(u << 16);
    }
  } else {
    throw ProtocolError(msg("safetensors '", source, "': tensor '", e.name, "' has dtype ", e.dtype,
                            ", which ddiloco does not read; it reads F32 and BF16: convert the tensor first (in "
                            "PyTorch: t.float() or t.bfloat16() before saving)"));
  }
  if (!options.allow_non_finite) {
    for (std::size_t i = 0; i < out.size(); ++i)
      if (!std::isfinite(out[i]))
        throw ProtocolError(msg("safetensors '", source, "': tensor '", e.name, "' element ", i, " is ", out[i],
                                "; initial values must be finite (fix the model, or allow non-finite values "
                                "explicitly)"));
  }
  return out;
}

inline std::uint64_t read_u64_le(std::span<const std::byte, 8> b) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < 8; ++i) v |= std::to_integer<std::uint64_t>(b[i]) << (8 * i);
  return v;
}

/// Checks the 8-byte length against the file size; returns the header length.
inline std::uint64_t safetensors_header_length(std::uint64_t stored, std::uint64_t file_size, std::string_view source) {
  if (stored > kSafetensorsMaxHeaderBytes)
    throw ProtocolError(msg("safetensors '", source, "': header length ", stored, " exceeds the ",
                            kSafetensorsMaxHeaderBytes, "-byte cap; not a safetensors file, or a damaged one"));
  if (stored > file_size - 8)
    throw ProtocolError(msg("safetensors '", source, "': header length ", stored, " but only ", file_size - 8,
                            " bytes follow it (the file is truncated)"));
  return stored;
}

[[noreturn]] inline void throw_safetensors_io(std::string_view what, const std::filesystem::path& path, int err) {
  throw StateError(msg("safetensors: ", what, " '", path.string(), "' failed: ", std::generic_category().message(err),
                       "; check that the directory exists, is writable and has space"));
}

struct SafetensorsFd {
  int fd = -1;
  ~SafetensorsFd() {
    if (fd >= 0) ::close(fd);
  }
};

inline void write_fd_all(int fd, const void* data, std::size_t n, const std::filesystem::path& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ::ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_safetensors_io("writing", path, errno);
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

}  // namespace detail

/// Number of elements of a shape ([] is a scalar: 1).
inline std::uint64_t safetensors_numel(std::span<const std::uint64_t> shape) noexcept {
  std::uint64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

/// Parses a whole safetensors file held in memory. `source` names it in errors.
inline SafetensorsFile parse_safetensors(std::span<const std::byte> bytes, std::string_view source,
                                         const SafetensorsReadOptions& options = {}) {
  if (bytes.size() < 8)
    throw ProtocolError(detail::msg("safetensors '", source, "': ", bytes.size(),
                                    " bytes, shorter than the 8-byte header length (the file is truncated)"));
  const std::uint64_t n =
      detail::safetensors_header_length(detail::read_u64_le(bytes.first<8>()), bytes.size(), source);
  const std::string_view json(reinterpret_cast<const char*>(bytes.data() + 8), static_cast<std::size_t>(n));
  const auto data = bytes.subspan(8 + static_cast<std::size_t>(n));
  auto header = detail::parse_safetensors_header(json, data.size(), source);
  SafetensorsFile out;
  out.metadata = std::move(header.metadata);
  for (auto& e : header.entries) {
    auto values = detail::safetensors_values(
        e, data.subspan(static_cast<std::size_t>(e.begin), static_cast<std::size_t>(e.end - e.begin)), source, options);
    out.tensors.push_back({std::move(e.name), std::move(e.dtype), std::move(e.shape), std::move(values)});
  }
  return out;
}

namespace detail {
/// An open file positioned after its header, the header parsed (and checked
/// against the file's size), and the header's length.
struct OpenedSafetensors {
  std::ifstream in;
  SafetensorsHeader header;
  std::uint64_t header_bytes = 0;
};

inline OpenedSafetensors open_safetensors(const std::filesystem::path& path) {
  const std::string source = path.string();
  OpenedSafetensors f;
  std::ifstream& in = f.in;
  in.open(path, std::ios::binary | std::ios::ate);
  if (!in)
    throw InvalidArgument(msg("safetensors: cannot open '", source, "' (", std::generic_category().message(errno),
                              "); check the path"));
  const std::streamoff end = in.tellg();
  if (end < 0) throw InvalidArgument(msg("safetensors: cannot size '", source, "'; is it a regular file?"));
  const auto file_size = static_cast<std::uint64_t>(end);
  if (file_size < 8)
    throw ProtocolError(msg("safetensors '", source, "': ", file_size,
                            " bytes, shorter than the 8-byte header length (the file is truncated)"));
  in.seekg(0);
  std::array<std::byte, 8> len{};
  in.read(reinterpret_cast<char*>(len.data()), 8);
  const std::uint64_t n = safetensors_header_length(read_u64_le(len), file_size, source);
  std::string json(static_cast<std::size_t>(n), '\0');
  in.read(json.data(), static_cast<std::streamsize>(n));
  if (!in) throw ProtocolError(msg("safetensors '", source, "': read error in the header"));
  f.header = parse_safetensors_header(json, file_size - 8 - n, source);
  f.header_bytes = n;
  return f;
}
}  // namespace detail

/// Reads a safetensors file; validates the header before reading any tensor,
/// and reads one tensor at a time (memory: the values plus one tensor's bytes).
/// Throws InvalidArgument if the file cannot be opened, ProtocolError naming
/// the file, the tensor and the value if it fails validation.
inline SafetensorsFile read_safetensors(const std::filesystem::path& path, const SafetensorsReadOptions& options = {}) {
  const std::string source = path.string();
  auto [in, header, n] = detail::open_safetensors(path);
  SafetensorsFile out;
  out.metadata = std::move(header.metadata);
  std::vector<std::byte> buffer;
  for (auto& e : header.entries) {
    buffer.resize(static_cast<std::size_t>(e.end - e.begin));
    in.seekg(static_cast<std::streamoff>(8 + n + e.begin));
    in.read(reinterpret_cast<char*>(buffer.data()), static_cast<std::streamsize>(buffer.size()));
    if (!in)
      throw ProtocolError(detail::msg("safetensors '", source, "': tensor '", e.name,
                                      "': read error (did the file change while it was read?)"));
    auto values = detail::safetensors_values(e, buffer, source, options);
    out.tensors.push_back({std::move(e.name), std::move(e.dtype), std::move(e.shape), std::move(values)});
  }
  return out;
}

/// The tensors of a file as a plan's TensorSpecs, in the file's order, with
/// `embedding` set by `rule`. Throws InvalidArgument naming the file and the
/// tensor for a tensor without elements (a plan needs at least one each).
inline std::vector<TensorSpec> safetensors_specs(const SafetensorsFile& file, const EmbeddingRule& rule,
                                                 std::string_view source) {
  std::vector<TensorSpec> specs;
  specs.reserve(file.tensors.size());
  for (const auto& t : file.tensors) {
    if (t.values.empty())
      throw InvalidArgument(detail::msg("safetensors '", source, "': tensor '", t.name, "' has shape ",
                                        detail::shape_string(t.shape), " and no elements; ddiloco syncs tensors of at "
                                        "least one element, drop it from the file"));
    specs.push_back({t.name, t.values.size(), rule(t.name)});
  }
  return specs;
}

/// The tensors of a file as TensorSpecs (file order, `embedding` by `rule`)
/// from its header alone: no tensor data is read, so sizing a 12B-parameter
/// model (ddiloco_sim size) takes the header's bytes of memory. The header is
/// validated as read_safetensors validates it; a tensor without elements is
/// refused as safetensors_specs refuses it.
inline std::vector<TensorSpec> read_safetensors_specs(const std::filesystem::path& path,
                                                      const EmbeddingRule& rule = EmbeddingRule{}) {
  const auto f = detail::open_safetensors(path);
  std::vector<TensorSpec> specs;
  specs.reserve(f.header.entries.size());
  for (const auto& e : f.header.entries) {
    if (e.numel == 0)
      throw InvalidArgument(detail::msg("safetensors '", path.string(), "': tensor '", e.name, "' has shape ",
                                        detail::shape_string(e.shape), " and no elements; ddiloco syncs tensors of at "
                                        "least one element, drop it from the file"));
    specs.push_back({e.name, static_cast<std::size_t>(e.numel), rule(e.name)});
  }
  return specs;
}

/// Views of `plan`'s tensors, in plan order, inside its fragments' flat
/// buffers (`fragments[p]` holds fragment p laid out as Plan::layout says, as
/// a SyncerSnapshot's theta does), tensor i with shape `shapes[i]`, or [numel]
/// when `shapes` is empty: what write_safetensors takes to export a global
/// model. Throws ShapeMismatch naming the fragment or tensor whose size differs.
inline std::vector<SafetensorsView> plan_tensor_views(const Plan& plan,
                                                      std::span<const std::span<const float>> fragments,
                                                      std::span<const std::vector<std::uint64_t>> shapes = {}) {
  if (fragments.size() != plan.num_fragments())
    throw ShapeMismatch(detail::msg("plan_tensor_views: ", fragments.size(), " fragment buffers for a plan of ",
                                    plan.num_fragments(), " fragments"));
  for (std::size_t p = 0; p < fragments.size(); ++p)
    if (fragments[p].size() != plan.fragments()[p].numel)
      throw ShapeMismatch(detail::msg("plan_tensor_views: fragment ", p, " holds ", fragments[p].size(),
                                      " values but the plan's fragment ", p, " has ", plan.fragments()[p].numel,
                                      " elements"));
  if (!shapes.empty() && shapes.size() != plan.num_tensors())
    throw ShapeMismatch(detail::msg("plan_tensor_views: ", shapes.size(), " shapes for the plan's ", plan.num_tensors(),
                                    " tensors; give one per tensor, or none"));
  std::vector<SafetensorsView> out;
  out.reserve(plan.num_tensors());
  for (std::size_t i = 0; i < plan.num_tensors(); ++i) {
    const auto& t = plan.tensors()[i];
    std::vector<std::uint64_t> shape = shapes.empty() ? std::vector<std::uint64_t>{t.numel} : shapes[i];
    if (safetensors_numel(shape) != t.numel)
      throw ShapeMismatch(detail::msg("plan_tensor_views: tensor '", t.name, "' has ", t.numel,
                                      " elements but shape ", detail::shape_string(shape)));
    out.push_back({t.name, std::move(shape),
                   fragments[plan.fragment_of(i)].subspan(plan.offset_in_fragment(i), t.numel)});
  }
  return out;
}

/// The bytes of the safetensors header (8-byte length + JSON padded with
/// spaces to a multiple of 8, so the data section starts aligned) for
/// `tensors` stored as F32 in the given order. Validates as write_safetensors.
inline std::vector<std::byte> encode_safetensors_header(std::span<const SafetensorsView> tensors,
                                                        const SafetensorsWriteOptions& options = {}) {
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  if (!options.metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : options.metadata) {
      if (meta.contains(k))
        throw InvalidArgument(detail::msg("write_safetensors: metadata key '", k, "' given twice; keys must be unique"));
      meta[k] = v;
    }
    root["__metadata__"] = std::move(meta);
  }
  std::set<std::string_view> names;
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.name.empty() || t.name == "__metadata__")
      throw InvalidArgument(detail::msg("write_safetensors: tensor ", i, " is named '", t.name,
                                        "'; give it a non-empty name other than __metadata__"));
    if (!names.insert(t.name).second)
      throw InvalidArgument(detail::msg("write_safetensors: tensor name '", t.name,
                                        "' appears twice; names must be unique"));
    if (safetensors_numel(t.shape) != t.values.size())
      throw ShapeMismatch(detail::msg("write_safetensors: tensor '", t.name, "' has shape ",
                                      detail::shape_string(t.shape), " (", safetensors_numel(t.shape),
                                      " elements) but ", t.values.size(), " values; make them agree"));
    if (!options.allow_non_finite) {
      for (std::size_t k = 0; k < t.values.size(); ++k)
        if (!std::isfinite(t.values[k]))
          throw InvalidArgument(detail::msg("write_safetensors: tensor '", t.name, "' element ", k, " is ",
                                            t.values[k], "; refusing to write a non-finite value (allow it "
                                            "explicitly to write a diverged model for inspection)"));
    }
    const std::uint64_t end = offset + 4 * t.values.size();
    root[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string json = root.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::vector<std::byte> out(8 + json.size());
  for (std::size_t b = 0; b < 8; ++b) out[b] = static_cast<std::byte>((json.size() >> (8 * b)) & 0xFFU);
  std::memcpy(out.data() + 8, json.data(), json.size());
  return out;
}

/// Writes `tensors` as F32, in the given order, to `path` atomically: every
/// tensor is validated first (names non-empty and unique, numel(shape) ==
/// values.size(), values finite unless allowed), then the bytes go to a
/// temporary file next to `path`, which is fsync'ed and renamed over `path`,
/// and the directory is fsync'ed. On any error nothing is left behind (an
/// existing `path` is untouched). Throws InvalidArgument / ShapeMismatch for
/// bad tensors, StateError (naming the path and errno) if the file system refuses.
inline void write_safetensors(const std::filesystem::path& path, std::span<const SafetensorsView> tensors,
                              const SafetensorsWriteOptions& options = {}) {
  const std::vector<std::byte> header = encode_safetensors_header(tensors, options);
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  const std::filesystem::path tmp = dir / ("." + path.filename().string() + ".tmp-" + std::to_string(::getpid()));
  try {
    detail::SafetensorsFd f{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
    if (f.fd < 0) detail::throw_safetensors_io("creating", tmp, errno);
    detail::write_fd_all(f.fd, header.data(), header.size(), tmp);
    std::vector<std::byte> le;
    for (const auto& t : tensors) {
      if constexpr (std::endian::native == std::endian::little) {
        detail::write_fd_all(f.fd, t.values.data(), t.values.size_bytes(), tmp);
      } else {
        le.resize(t.values.size_bytes());
        for (std::size_t i = 0; i < t.values.size(); ++i) {
          const auto u = std::bit_cast<std::uint32_t>(t.values[i]);
          for (std::size_t b = 0; b < 4; ++b) le[4 * i + b] = static_cast<std::byte>((u >> (8 * b)) & 0xFFU);
        }
        detail::write_fd_all(f.fd, le.data(), le.size(), tmp);
      }
    }
    if (::fsync(f.fd) != 0) detail::throw_safetensors_io("fsync of", tmp, errno);
    const int fd = f.fd;
    f.fd = -1;
    if (::close(fd) != 0) detail::throw_safetensors_io("closing", tmp, errno);
    if (::rename(tmp.c_str(), path.c_str()) != 0) detail::throw_safetensors_io("renaming to", path, errno);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw;
  }
  detail::SafetensorsFd d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (d.fd >= 0) ::fsync(d.fd);
}

/// As above, for tensors read back (or built) as SafetensorsTensor.
inline void write_safetensors(const std::filesystem::path& path, std::span<const SafetensorsTensor> tensors,
                              const SafetensorsWriteOptions& options = {}) {
  std::vector<SafetensorsView> views;
  views.reserve(tensors.size());
  for (const auto& t : tensors) views.push_back({t.name, t.shape, t.values});
  write_safetensors(path, std::span<const SafetensorsView>(views), options);
}

}  // namespace ddiloco
