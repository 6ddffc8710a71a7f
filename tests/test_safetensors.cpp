// Tests for ddiloco/safetensors.hpp: round trips checked by a reader of the
// format written here from its specification (sharing no code with the
// header), BF16 widening, every validation the reader promises (truncation,
// lying lengths and offsets, overlap, gaps, dtypes, duplicate names,
// non-finite values), atomic writes that leave nothing on an error, the
// embedding rule, the export path from a checkpoint (plan_tensor_views,
// checkpoint_plan, check_checkpoint_plan), and files made and read by torch
// (tests/torch/safetensors_torch.py, run with /usr/bin/python3 when torch is
// installed).
#include <ddiloco/checkpoint.hpp>
#include <ddiloco/safetensors.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <sys/wait.h>

#include "temp_dir.hpp"

using namespace ddiloco;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

// Each TempDir is named after this file.
struct TempDir : test::TempDir {
  TempDir() : test::TempDir("safetensors") {}
};

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
std::span<const std::byte> as_bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xFFU);
  return s;
}
std::string f32_bytes(const std::vector<float>& v) {
  std::string s;
  for (float x : v) {
    const auto u = std::bit_cast<std::uint32_t>(x);
    for (int b = 0; b < 4; ++b) s.push_back(static_cast<char>((u >> (8 * b)) & 0xFFU));
  }
  return s;
}
std::string bf16_bytes(const std::vector<std::uint16_t>& v) {
  std::string s;
  for (auto u : v) {
    s.push_back(static_cast<char>(u & 0xFFU));
    s.push_back(static_cast<char>(u >> 8));
  }
  return s;
}
// A file from a header text and a data section, as a test writes it by hand.
std::string file_of(const std::string& json, const std::string& data) { return le64(json.size()) + json + data; }

// ---- An independent reader of the format, from its specification --------
// A minimal JSON reader for what a safetensors header holds: objects, arrays,
// strings (with the escapes \" \\ \/ \n \t) and non-negative integers.
struct Json {
  enum Kind { object, array, string, number } kind = number;
  std::map<std::string, Json> members;
  std::vector<std::string> order;  // keys in file order
  std::vector<Json> items;
  std::string text;
  std::uint64_t value = 0;
};

struct JsonReader {
  std::string_view s;
  std::size_t i = 0;
  void blank() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\t' || s[i] == '\r')) ++i;
  }
  char peek() {
    blank();
    REQUIRE(i < s.size());
    return s[i];
  }
  void expect(char c) {
    REQUIRE(peek() == c);
    ++i;
  }
  std::string str() {
    expect('"');
    std::string out;
    while (s.at(i) != '"') {
      if (s[i] == '\\') {
        ++i;
        const char e = s.at(i);
        out.push_back(e == 'n' ? '\n' : e == 't' ? '\t' : e);
      } else {
        out.push_back(s[i]);
      }
      ++i;
    }
    ++i;
    return out;
  }
  Json value() {
    Json j;
    const char c = peek();
    if (c == '{') {
      j.kind = Json::object;
      ++i;
      if (peek() == '}') {
        ++i;
        return j;
      }
      while (true) {
        std::string k = str();
        expect(':');
        j.order.push_back(k);
        j.members[k] = value();
        if (peek() == ',') {
          ++i;
          continue;
        }
        expect('}');
        return j;
      }
    }
    if (c == '[') {
      j.kind = Json::array;
      ++i;
      if (peek() == ']') {
        ++i;
        return j;
      }
      while (true) {
        j.items.push_back(value());
        if (peek() == ',') {
          ++i;
          continue;
        }
        expect(']');
        return j;
      }
    }
    if (c == '"') {
      j.kind = Json::string;
      j.text = str();
      return j;
    }
    REQUIRE((c >= '0' && c <= '9'));
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') j.value = j.value * 10 + static_cast<std::uint64_t>(s[i++] - '0');
    return j;
  }
};

struct IndependentTensor {
  std::string name, dtype;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0, end = 0;
  std::vector<float> values;  // F32 only
};
struct IndependentFile {
  std::uint64_t header_length = 0;
  std::map<std::string, std::string> metadata;
  std::vector<IndependentTensor> tensors;  // in header order
};

IndependentFile independent_read(const std::string& bytes) {
  IndependentFile f;
  REQUIRE(bytes.size() >= 8);
  for (int b = 0; b < 8; ++b)
    f.header_length |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[static_cast<std::size_t>(b)]))
                       << (8 * b);
  REQUIRE(8 + f.header_length <= bytes.size());
  JsonReader r{std::string_view(bytes).substr(8, f.header_length)};
  const Json root = r.value();
  r.blank();
  REQUIRE(r.i == f.header_length);  // only padding blanks after the object
  REQUIRE(root.kind == Json::object);
  const std::string data = bytes.substr(8 + f.header_length);
  for (const auto& name : root.order) {
    const Json& e = root.members.at(name);
    if (name == "__metadata__") {
      for (const auto& k : e.order) f.metadata[k] = e.members.at(k).text;
      continue;
    }
    IndependentTensor t;
    t.name = name;
    t.dtype = e.members.at("dtype").text;
    for (const auto& d : e.members.at("shape").items) t.shape.push_back(d.value);
    t.begin = e.members.at("data_offsets").items.at(0).value;
    t.end = e.members.at("data_offsets").items.at(1).value;
    REQUIRE(t.end <= data.size());
    REQUIRE(t.dtype == "F32");
    REQUIRE((t.end - t.begin) % 4 == 0);
    for (std::uint64_t o = t.begin; o < t.end; o += 4) {
      std::uint32_t u = 0;
      for (int b = 0; b < 4; ++b)
        u |= static_cast<std::uint32_t>(static_cast<unsigned char>(data[static_cast<std::size_t>(o) + static_cast<std::size_t>(b)]))
             << (8 * b);
      t.values.push_back(std::bit_cast<float>(u));
    }
    f.tensors.push_back(std::move(t));
  }
  return f;
}

// Expects `f` to throw a ddiloco::Error subclass E whose message contains every
// one of `parts`.
template <class E, class F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    FAIL("no exception; expected one containing '" << *parts.begin() << "'");
  } catch (const E& e) {
    const std::string what = e.what();
    for (const auto& p : parts) CHECK_THAT(what, Contains(p));
  }
}

// A valid two-tensor F32 file, by hand.
std::string valid_file() {
  return file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1,1],"data_offsets":[8,12]}})",
                 f32_bytes({1.0f, -2.0f, 3.5f}));
}

}  // namespace

TEST_CASE("Tensors written are read back exactly by an independent reader of the format", "[safetensors]") {
  TempDir dir;
  const std::vector<float> a{0.0f, -0.0f, 1.5f, -3.25f, 1e-30f, 3e38f, 7.0f, 8.0f, 9.0f, 10.0f, 11.0f, 12.0f};
  const std::vector<float> b{std::numeric_limits<float>::denorm_min(), 42.0f};
  const std::vector<float> scalar{0.125f};
  const std::vector<SafetensorsView> views{{"layers.0.wq.weight", {3, 4}, a}, {"norm", {2}, b}, {"scale", {}, scalar}};
  const fs::path path = dir.path / "model.safetensors";
  write_safetensors(path, std::span<const SafetensorsView>(views), {.metadata = {{"format", "pt"}, {"note", "a \"q\""}}});

  const std::string bytes = read_file(path);
  const IndependentFile f = independent_read(bytes);
  CHECK(f.header_length % 8 == 0);  // the data section starts 8-byte aligned
  CHECK(f.metadata == std::map<std::string, std::string>{{"format", "pt"}, {"note", "a \"q\""}});
  REQUIRE(f.tensors.size() == 3);
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(f.tensors[i].name == views[i].name);
    CHECK(f.tensors[i].shape == views[i].shape);
    CHECK(f.tensors[i].begin == offset);
    offset = f.tensors[i].end;
    REQUIRE(f.tensors[i].values.size() == views[i].values.size());
    for (std::size_t k = 0; k < views[i].values.size(); ++k)
      CHECK(std::bit_cast<std::uint32_t>(f.tensors[i].values[k]) == std::bit_cast<std::uint32_t>(views[i].values[k]));
  }
  CHECK(8 + f.header_length + offset == bytes.size());

  const SafetensorsFile back = read_safetensors(path);
  REQUIRE(back.tensors.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(back.tensors[i].name == views[i].name);
    CHECK(back.tensors[i].dtype == "F32");
    CHECK(back.tensors[i].shape == views[i].shape);
    CHECK(std::equal(back.tensors[i].values.begin(), back.tensors[i].values.end(), views[i].values.begin(),
                     views[i].values.end(), [](float x, float y) {
                       return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y);
                     }));
  }
  CHECK(back.metadata == std::vector<std::pair<std::string, std::string>>{{"format", "pt"}, {"note", "a \"q\""}});
  CHECK(parse_safetensors(as_bytes(bytes), "mem").tensors.size() == 3);
  CHECK(dir.entries() == 1);  // no temporary file left next to it
}

TEST_CASE("read_safetensors_specs gives the tensors' sizes and embedding flags from the header alone",
          "[safetensors]") {
  TempDir dir;
  const std::vector<float> emb(12, 1.0f), w(6, 2.0f), b(2, 3.0f);
  const std::vector<SafetensorsView> views{{"wte.weight", {3, 4}, emb}, {"h.0.w", {2, 3}, w}, {"h.0.b", {2}, b}};
  const fs::path path = dir.path / "m.safetensors";
  write_safetensors(path, std::span<const SafetensorsView>(views));
  const auto specs = read_safetensors_specs(path);
  REQUIRE(specs.size() == 3);
  CHECK(specs[0] == TensorSpec{"wte.weight", 12, true});  // the default pattern marks wte
  CHECK(specs[1] == TensorSpec{"h.0.w", 6, false});
  CHECK(specs[2] == TensorSpec{"h.0.b", 2, false});
  CHECK(read_safetensors_specs(path, EmbeddingRule(""))[0].embedding == false);
  // The same as reading the values and taking their specs.
  CHECK(specs == safetensors_specs(read_safetensors(path), EmbeddingRule{}, path.string()));
  // A truncated data section is refused from the header's offsets, without reading the values.
  const std::string bytes = read_file(path);
  {
    std::ofstream out(dir.path / "cut.safetensors", std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 4));
  }
  CHECK_THROWS_AS(read_safetensors_specs(dir.path / "cut.safetensors"), ProtocolError);
  CHECK_THROWS_WITH(read_safetensors_specs(dir.path / "none.safetensors"), Contains("cannot open"));
}

TEST_CASE("A file written by hand is read in data order, BF16 widened exactly, padding allowed", "[safetensors]") {
  // Keys out of data order; BF16 bit patterns: 1.0, -2.0, the smallest
  // subnormal, -0, the largest finite bf16, and pi rounded to bf16.
  const std::string json =
      R"({"z.bf16":{"dtype":"BF16","shape":[2,3],"data_offsets":[8,20]},"__metadata__":{"k":"v"},)"
      R"("a.f32":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}    )";
  const std::string data = f32_bytes({0.5f, -1.0f}) + bf16_bytes({0x3F80, 0xC000, 0x0001, 0x8000, 0x7F7F, 0x4049});
  const SafetensorsFile f = parse_safetensors(as_bytes(file_of(json, data)), "hand.safetensors");
  REQUIRE(f.tensors.size() == 2);
  CHECK(f.tensors[0].name == "a.f32");
  CHECK(f.tensors[0].values == std::vector<float>{0.5f, -1.0f});
  CHECK(f.tensors[1].name == "z.bf16");
  CHECK(f.tensors[1].dtype == "BF16");
  CHECK(f.tensors[1].shape == std::vector<std::uint64_t>{2, 3});
  const std::vector<std::uint32_t> want{0x3F800000U, 0xC0000000U, 0x00010000U, 0x80000000U, 0x7F7F0000U, 0x40490000U};
  for (std::size_t i = 0; i < 6; ++i) CHECK(std::bit_cast<std::uint32_t>(f.tensors[1].values[i]) == want[i]);
  CHECK(f.metadata == std::vector<std::pair<std::string, std::string>>{{"k", "v"}});
}

TEST_CASE("A truncated file is refused at every length, naming the file", "[safetensors]") {
  const std::string good = valid_file();
  REQUIRE(parse_safetensors(as_bytes(good), "good").tensors.size() == 2);
  for (std::size_t n = 0; n < good.size(); ++n) {
    INFO("cut to " << n << " bytes");
    expect_error<ProtocolError>([&] { (void)parse_safetensors(as_bytes(good.substr(0, n)), "cut.safetensors"); },
                                {"safetensors 'cut.safetensors'"});
  }
  expect_error<ProtocolError>([&] { (void)parse_safetensors(as_bytes(good.substr(0, 5)), "cut"); },
                              {"5 bytes, shorter than the 8-byte header length", "truncated"});
  expect_error<ProtocolError>([&] { (void)parse_safetensors(as_bytes(good.substr(0, good.size() - 1)), "cut"); },
                              {"tensor 'b'", "[8, 12]", "reach past the data section", "11 bytes", "truncated"});
  TempDir dir;
  write_file(dir.path / "cut.safetensors", good.substr(0, 40));
  expect_error<ProtocolError>([&] { (void)read_safetensors(dir.path / "cut.safetensors"); },
                              {(dir.path / "cut.safetensors").string(), "only 32 bytes follow it", "truncated"});
  expect_error<InvalidArgument>([&] { (void)read_safetensors(dir.path / "missing.safetensors"); },
                                {"cannot open", "missing.safetensors"});
}

TEST_CASE("A header that lies about lengths, sizes or offsets is refused with the value", "[safetensors]") {
  const auto parse = [](const std::string& bytes) { (void)parse_safetensors(as_bytes(bytes), "lies.safetensors"); };
  const std::string data = f32_bytes({1.0f, 2.0f, 3.0f});
  SECTION("header length beyond the file") {
    expect_error<ProtocolError>([&] { parse(le64(1000) + "{}"); }, {"header length 1000", "only 2 bytes follow"});
  }
  SECTION("header length beyond the cap") {
    expect_error<ProtocolError>([&] { parse(le64(std::uint64_t{1} << 40) + "{}"); },
                                {"header length 1099511627776", "100000000-byte cap"});
  }
  SECTION("shape and offsets disagree") {
    expect_error<ProtocolError>(
        [&] { parse(file_of(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", data)); },
        {"tensor 'w'", "shape [2, 2] of F32 needs 4 x 4 bytes", "[0, 12] hold 12", "lies about the size"});
  }
  SECTION("offsets past the data section") {
    expect_error<ProtocolError>(
        [&] { parse(file_of(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data)); },
        {"tensor 'w'", "[0, 16]", "holds 12 bytes"});
  }
  SECTION("offsets that end before they begin") {
    expect_error<ProtocolError>(
        [&] { parse(file_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", data)); },
        {"tensor 'w'", "[8, 4] end before they begin"});
  }
  SECTION("overlapping tensors") {
    expect_error<ProtocolError>(
        [&] {
          parse(file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                        data));
        },
        {"tensor 'b'", "[4, 12] overlaps tensor 'a' at [0, 8]"});
  }
  SECTION("a gap between tensors") {
    expect_error<ProtocolError>(
        [&] {
          parse(file_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                        R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                        data));
        },
        {"4 bytes at [4, 8) before tensor 'b' belong to no tensor", "contiguous"});
  }
  SECTION("bytes after the last tensor") {
    expect_error<ProtocolError>(
        [&] { parse(file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data)); },
        {"end at data byte 8", "holds 12 bytes", "4 trailing bytes"});
  }
  SECTION("malformed JSON, a non-object, bad fields") {
    expect_error<ProtocolError>([&] { parse(file_of(R"({"a":{"dtype":"F32",)", "")); }, {"not valid JSON"});
    expect_error<ProtocolError>([&] { parse(file_of("[1, 2]", "")); }, {"does not start with a JSON object"});
    expect_error<ProtocolError>(
        [&] { parse(file_of(R"({"w":{"dtype":"F32","shape":[-3],"data_offsets":[0,12]}})", data)); },
        {"tensor 'w'", "holds -3", "non-negative integers"});
    expect_error<ProtocolError>([&] { parse(file_of(R"({"w":{"shape":[3],"data_offsets":[0,12]}})", data)); },
                                {"tensor 'w'", "\"dtype\" is missing"});
    expect_error<ProtocolError>([&] { parse(file_of(R"({"w":{"dtype":"F32","shape":[3]}})", data)); },
                                {"tensor 'w'", "\"data_offsets\" is missing"});
    expect_error<ProtocolError>([&] { parse(file_of(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0]}})", data)); },
                                {"tensor 'w'", "\"data_offsets\" is [0]"});
    expect_error<ProtocolError>([&] { parse(file_of(R"({"__metadata__":{"n":3}})", "")); },
                                {"__metadata__ key 'n'", "must be strings"});
    expect_error<ProtocolError>([&] { parse(file_of(R"({"w":7})", "")); }, {"tensor 'w' is number 7"});
  }
}

TEST_CASE("A dtype other than F32 and BF16 is refused, naming the tensor, the dtype and the fix", "[safetensors]") {
  for (const std::string dtype : {"I64", "F16", "F64", "U8", "NOPE"}) {
    INFO(dtype);
    expect_error<ProtocolError>(
        [&] {
          (void)parse_safetensors(
              as_bytes(file_of(R"({"step":{"dtype":")" + dtype + R"(","shape":[1],"data_offsets":[0,8]}})",
                               std::string(8, '\0'))),
              "opt.safetensors");
        },
        {"'opt.safetensors'", "tensor 'step' has dtype " + dtype, "reads F32 and BF16", "t.float()"});
  }
}

TEST_CASE("Duplicate names are refused when read and when written, and nothing is written", "[safetensors]") {
  expect_error<ProtocolError>(
      [&] {
        (void)parse_safetensors(as_bytes(file_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                                 R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                                 f32_bytes({1.0f, 2.0f}))),
                                "dup.safetensors");
      },
      {"'dup.safetensors'", "repeats tensor name 'w'", "unique"});
  expect_error<ProtocolError>(
      [&] {
        (void)parse_safetensors(
            as_bytes(file_of(R"({"w":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                             f32_bytes({1.0f}))),
            "dup.safetensors");
      },
      {"repeats key 'dtype' inside an entry"});

  TempDir dir;
  const std::vector<float> v{1.0f};
  const std::vector<SafetensorsView> views{{"w", {1}, v}, {"w", {1}, v}};
  expect_error<InvalidArgument>([&] { write_safetensors(dir.path / "d.safetensors", std::span<const SafetensorsView>(views)); },
                                {"tensor name 'w' appears twice"});
  CHECK(dir.entries() == 0);
}

TEST_CASE("Non-finite values are refused unless allowed, naming the tensor and the element", "[safetensors]") {
  const std::string bytes =
      file_of(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})",
              f32_bytes({1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}));
  expect_error<ProtocolError>([&] { (void)parse_safetensors(as_bytes(bytes), "nan.safetensors"); },
                              {"'nan.safetensors'", "tensor 'w' element 1 is nan", "must be finite"});
  const auto f = parse_safetensors(as_bytes(bytes), "nan.safetensors", {.allow_non_finite = true});
  CHECK(std::isnan(f.tensors[0].values[1]));
  CHECK(std::isinf(f.tensors[0].values[2]));
  // BF16 infinity (0x7F80) too.
  expect_error<ProtocolError>(
      [&] {
        (void)parse_safetensors(
            as_bytes(file_of(R"({"b":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}})", bf16_bytes({0x7F80}))), "x");
      },
      {"tensor 'b' element 0 is inf"});

  TempDir dir;
  const fs::path path = dir.path / "keep.safetensors";
  write_file(path, "previous contents");
  const std::vector<float> bad{0.0f, -std::numeric_limits<float>::infinity()};
  const std::vector<SafetensorsView> views{{"w", {2}, bad}};
  expect_error<InvalidArgument>([&] { write_safetensors(path, std::span<const SafetensorsView>(views)); },
                                {"tensor 'w' element 1 is -inf", "non-finite"});
  CHECK(read_file(path) == "previous contents");  // untouched
  CHECK(dir.entries() == 1);
  SafetensorsWriteOptions allow;
  allow.allow_non_finite = true;
  write_safetensors(path, std::span<const SafetensorsView>(views), allow);
  CHECK(std::isinf(read_safetensors(path, {.allow_non_finite = true}).tensors[0].values[1]));
}

TEST_CASE("A write that fails leaves nothing behind and names the problem", "[safetensors]") {
  TempDir dir;
  const std::vector<float> v{1.0f, 2.0f, 3.0f};
  const std::vector<SafetensorsView> wrong_shape{{"w", {2, 2}, v}};
  expect_error<ShapeMismatch>(
      [&] { write_safetensors(dir.path / "a.safetensors", std::span<const SafetensorsView>(wrong_shape)); },
      {"tensor 'w' has shape [2, 2] (4 elements) but 3 values"});
  const std::vector<SafetensorsView> unnamed{{"", {3}, v}};
  expect_error<InvalidArgument>(
      [&] { write_safetensors(dir.path / "a.safetensors", std::span<const SafetensorsView>(unnamed)); },
      {"tensor 0 is named ''"});
  CHECK(dir.entries() == 0);
  const std::vector<SafetensorsView> ok{{"w", {3}, v}};
  expect_error<StateError>(
      [&] { write_safetensors(dir.path / "no" / "such" / "dir.safetensors", std::span<const SafetensorsView>(ok)); },
      {"creating", "no/such", "No such file or directory"});
  CHECK(dir.entries() == 0);
  // The target is a directory: the rename fails, and the temporary file goes.
  fs::create_directories(dir.path / "taken.safetensors" / "x");
  expect_error<StateError>(
      [&] { write_safetensors(dir.path / "taken.safetensors", std::span<const SafetensorsView>(ok)); },
      {"renaming to", "taken.safetensors"});
  CHECK(dir.entries() == 1);
}

TEST_CASE("The default embedding rule marks embedding and head tensors and nothing else", "[safetensors]") {
  const EmbeddingRule rule;
  for (const char* yes : {"model.embed_tokens.weight", "tok_embeddings.weight", "transformer.wte.weight",
                          "transformer.wpe.weight", "lm_head.weight", "tok_emb.weight", "pos_emb.weight",
                          "head.weight", "bert.embeddings.word_embeddings.weight", "emb"}) {
    INFO(yes);
    CHECK(rule(yes));
  }
  for (const char* no : {"layers.0.attention.wq.weight", "model.norm.weight", "blocks.0.heads.weight",
                         "header.weight", "h.0.attn.c_attn.weight", "ahead.bias", "member.w", "w_embx"}) {
    INFO(no);
    CHECK_FALSE(rule(no));
  }
  CHECK_FALSE(EmbeddingRule("")("embed"));
  CHECK(EmbeddingRule("^out$")("out"));
  expect_error<InvalidArgument>([] { EmbeddingRule bad("(embed"); }, {"embedding pattern '(embed'", "not a valid"});

  const std::string bytes = file_of(R"({"emb":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                    R"("empty":{"dtype":"F32","shape":[0, 3],"data_offsets":[4,4]}})",
                                    f32_bytes({1.0f}));
  const auto f = parse_safetensors(as_bytes(bytes), "e.safetensors");
  REQUIRE(f.tensors.size() == 2);
  expect_error<InvalidArgument>([&] { (void)safetensors_specs(f, rule, "e.safetensors"); },
                                {"tensor 'empty' has shape [0, 3] and no elements"});
}

TEST_CASE("A checkpoint's global parameters export under its tensors' names; other names are refused",
          "[safetensors]") {
  // A plan of three tensors in two fragments, values = a recognisable ramp.
  const std::vector<TensorSpec> specs{{"tok_emb.weight", 6, true}, {"w1", 4, false}, {"b1", 2, false}};
  const Plan plan = make_plan(specs, 2);
  const std::vector<std::vector<std::uint64_t>> shapes{{3, 2}, {2, 2}, {2}};
  SyncerSnapshot snap;
  snap.fingerprint = plan.fingerprint();
  snap.optimizer = "nesterov";
  std::vector<float> flat(plan.total_numel());
  for (std::size_t i = 0; i < flat.size(); ++i) flat[i] = 0.5f * static_cast<float>(i) - 1.0f;
  for (std::size_t p = 0; p < plan.num_fragments(); ++p) {
    FragmentSnapshot f;
    for (std::size_t t : plan.fragments()[p].tensors) {
      std::size_t start = 0;
      for (std::size_t k = 0; k < t; ++k) start += specs[k].numel;
      f.theta.insert(f.theta.end(), flat.begin() + static_cast<std::ptrdiff_t>(start),
                     flat.begin() + static_cast<std::ptrdiff_t>(start + specs[t].numel));
    }
    snap.fragments.push_back(std::move(f));
  }
  const auto records = checkpoint_tensors(plan, shapes);
  const LoadedCheckpoint ck = decode_checkpoint(encode_checkpoint(snap, 7, records));
  REQUIRE(ck.tensors == records);
  const Plan rebuilt = checkpoint_plan(ck);
  CHECK(rebuilt == plan);

  std::vector<std::span<const float>> frags;
  for (const auto& f : ck.snapshot.fragments) frags.emplace_back(f.theta);
  const auto views = plan_tensor_views(rebuilt, frags, shapes);
  TempDir dir;
  write_safetensors(dir.path / "global.safetensors", std::span<const SafetensorsView>(views));
  const IndependentFile out = independent_read(read_file(dir.path / "global.safetensors"));
  REQUIRE(out.tensors.size() == 3);
  std::vector<float> got;
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(out.tensors[i].name == specs[i].name);
    CHECK(out.tensors[i].shape == shapes[i]);
    got.insert(got.end(), out.tensors[i].values.begin(), out.tensors[i].values.end());
  }
  CHECK(got == flat);  // plan order, each tensor's values where the fragments keep them

  // Names, sizes, flags or P that do not match the checkpoint's plan: an error naming it.
  const auto check = [&](std::vector<TensorSpec> s, std::size_t p) {
    check_checkpoint_plan(ck, make_plan(s, p), "model.safetensors");
  };
  expect_error<ShapeMismatch>([&] { check({{"tok_emb.weight", 6, true}, {"w2", 4, false}, {"b1", 2, false}}, 2); },
                              {"model.safetensors", "differ at tensor 1: 'w2' in model.safetensors, 'w1' in the checkpoint"});
  expect_error<ShapeMismatch>([&] { check({{"tok_emb.weight", 6, true}, {"w1", 5, false}, {"b1", 2, false}}, 2); },
                              {"tensor 'w1': 5 elements in model.safetensors, 4 in the checkpoint"});
  expect_error<ShapeMismatch>([&] { check({{"tok_emb.weight", 6, false}, {"w1", 4, false}, {"b1", 2, false}}, 2); },
                              {"tensor 'tok_emb.weight': embedding no in model.safetensors, yes in the checkpoint"});
  expect_error<ShapeMismatch>([&] { check({{"tok_emb.weight", 6, true}, {"w1", 4, false}}, 2); },
                              {"the checkpoint has tensor 'b1' (number 2) that model.safetensors lacks"});
  expect_error<ShapeMismatch>([&] { check(specs, 3); }, {"3 fragments in model.safetensors, 2 in the checkpoint"});
  CHECK_NOTHROW(check(specs, 2));
  // Without the tensors section only the fingerprint can tell.
  LoadedCheckpoint bare = decode_checkpoint(encode_checkpoint(snap, 7));
  CHECK(bare.tensors.empty());
  expect_error<StateError>([&] { (void)checkpoint_plan(bare); }, {"records no tensor names"});
  expect_error<ShapeMismatch>(
      [&] { check_checkpoint_plan(bare, make_plan({{"x", 6, true}, {"w1", 4, false}, {"b1", 2, false}}, 2), "list.txt"); },
      {"plan fingerprint 0x", "from list.txt", "in the checkpoint"});
  CHECK_NOTHROW(check_checkpoint_plan(bare, plan, "list.txt"));
  expect_error<ShapeMismatch>([&] { (void)plan_tensor_views(plan, std::span(frags).first(1)); },
                              {"1 fragment buffers for a plan of 2 fragments"});
}

namespace {
// Runs tests/torch/safetensors_torch.py; false (after a WARN) if torch is missing.
bool run_torch_script(const std::string& args) {
  const std::string script = std::string(DDILOCO_SOURCE_DIR) + "/tests/torch/safetensors_torch.py";
  if (!fs::exists("/usr/bin/python3")) {
    WARN("no /usr/bin/python3: the torch round trip is not run");
    return false;
  }
  const int rc = std::system(("/usr/bin/python3 '" + script + "' " + args).c_str());
  REQUIRE(rc != -1);
  if (WIFEXITED(rc) && WEXITSTATUS(rc) == 77) {
    WARN("python3 has no torch (apt-get install python3-torch): the torch round trip is not run");
    return false;
  }
  REQUIRE((WIFEXITED(rc) && WEXITSTATUS(rc) == 0));
  return true;
}
}  // namespace

TEST_CASE("A file made by torch (F32 and BF16) is read with the values torch holds", "[safetensors][torch]") {
  TempDir dir;
  if (!run_torch_script("make '" + dir.path.string() + "'")) return;
  const SafetensorsFile f = read_safetensors(dir.path / "torch.safetensors");
  const std::string expected = read_file(dir.path / "expected.f32");
  std::vector<float> want(expected.size() / 4);
  std::memcpy(want.data(), expected.data(), expected.size());
  const std::vector<std::string> names{"tok_embeddings.weight", "layers.0.norm.weight", "layers.0.attention.wq.weight",
                                       "scale", "lm_head.weight"};
  const std::vector<std::string> dtypes{"F32", "BF16", "F32", "F32", "BF16"};
  REQUIRE(f.tensors.size() == names.size());
  std::vector<float> got;
  for (std::size_t i = 0; i < names.size(); ++i) {
    CHECK(f.tensors[i].name == names[i]);
    CHECK(f.tensors[i].dtype == dtypes[i]);
    got.insert(got.end(), f.tensors[i].values.begin(), f.tensors[i].values.end());
  }
  CHECK(f.tensors[3].shape.empty());
  CHECK(f.tensors[2].shape == std::vector<std::uint64_t>{2, 3, 4});
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(std::bit_cast<std::uint32_t>(got[i]) == std::bit_cast<std::uint32_t>(want[i]));
  CHECK(f.metadata.at(0) == std::pair<std::string, std::string>{"format", "pt"});
  const auto specs = safetensors_specs(f, EmbeddingRule(), "torch.safetensors");
  CHECK(specs[0].embedding);
  CHECK_FALSE(specs[1].embedding);
  CHECK(specs[4].embedding);
}

TEST_CASE("A file we write is read by torch with the same names, shapes and values", "[safetensors][torch]") {
  TempDir dir;
  std::vector<float> a(24), b{-0.0f, 1e-38f, 65504.0f}, c{3.0f};
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = std::sin(static_cast<float>(i)) * 100.0f;
  const std::vector<SafetensorsView> views{{"embed.weight", {4, 6}, a}, {"layers.0.b", {3}, b}, {"s", {}, c}};
  write_safetensors(dir.path / "ours.safetensors", std::span<const SafetensorsView>(views),
                    {.metadata = {{"format", "pt"}}});
  std::vector<float> all(a);
  all.insert(all.end(), b.begin(), b.end());
  all.insert(all.end(), c.begin(), c.end());
  write_file(dir.path / "expected.f32", f32_bytes(all));
  run_torch_script("check '" + (dir.path / "ours.safetensors").string() + "' '" + (dir.path / "expected.f32").string() +
                   "' '[[\"embed.weight\", [4, 6]], [\"layers.0.b\", [3]], [\"s\", []]]'");
}
