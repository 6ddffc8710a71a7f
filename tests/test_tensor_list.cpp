// Tests for ddiloco/tensor_list.hpp and the shipped examples/models/*.txt.
#include <ddiloco/tensor_list.hpp>

#include <catch2/catch.hpp>
#include <cstddef>
#include <sstream>
#include <string>
#include <vector>

using ddiloco::TensorSpec;
using ddiloco::parse_tensor_list;

namespace {

std::vector<TensorSpec> parse(const std::string& text) {
  std::istringstream in(text);
  return parse_tensor_list(in, "model.txt");
}

template <class E>
std::string error_of(const std::string& text) {
  try {
    (void)parse(text);
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception for input:\n" << text);
  return {};
}

std::size_t total(const std::vector<TensorSpec>& ts) {
  std::size_t s = 0;
  for (const auto& t : ts) s += t.numel;
  return s;
}

std::size_t embedding_count(const std::vector<TensorSpec>& ts) {
  std::size_t c = 0;
  for (const auto& t : ts) c += t.embedding ? 1 : 0;
  return c;
}

std::string model_path(const char* file) { return std::string(DDILOCO_SOURCE_DIR) + "/examples/models/" + file; }

}  // namespace

TEST_CASE("A tensor list with counts, shapes, flags, comments and blank lines parses in order", "[tensor_list]") {
  const auto ts = parse(
      "# header comment\n"
      "\n"
      "tok_embeddings.weight 128256x2048 embedding\n"
      "   layers.0.attn.wq\t2048x2048   # trailing comment\n"
      "layers.0.norm 2048\r\n"
      "   \t  \n"
      "bias 7");  // no final newline
  REQUIRE(ts.size() == 4);
  CHECK(ts[0] == TensorSpec{"tok_embeddings.weight", 262668288, true});
  CHECK(ts[1] == TensorSpec{"layers.0.attn.wq", 4194304, false});
  CHECK(ts[2] == TensorSpec{"layers.0.norm", 2048, false});
  CHECK(ts[3] == TensorSpec{"bias", 7, false});
}

TEST_CASE("A shape multiplies all its dimensions", "[tensor_list]") {
  CHECK(parse("conv 64x3x7x7\n")[0].numel == 9408);  // 64 * 3 * 49
  CHECK(parse("scalar 1\n")[0].numel == 1);
  CHECK(parse("leading_zeros 007x02\n")[0].numel == 14);
}

TEST_CASE("Malformed lines are reported with file:line and the bad token", "[tensor_list][errors]") {
  using ddiloco::ProtocolError;
  CHECK_THAT(error_of<ProtocolError>("a 1\nlonely\n"), Catch::Contains("model.txt:2") && Catch::Contains("'lonely'"));
  CHECK_THAT(error_of<ProtocolError>("a 12ab\n"), Catch::Contains("model.txt:1") && Catch::Contains("'12ab'"));
  CHECK_THAT(error_of<ProtocolError>("a -3\n"), Catch::Contains("'-3'"));
  CHECK_THAT(error_of<ProtocolError>("a 2048x\n"), Catch::Contains("'2048x'"));
  CHECK_THAT(error_of<ProtocolError>("a x4\n"), Catch::Contains("'x4'"));
  CHECK_THAT(error_of<ProtocolError>("a 4 embeding\n"), Catch::Contains("'embeding'"));
  CHECK_THAT(error_of<ProtocolError>("\n\na 4 embedding extra\n"),
             Catch::Contains("model.txt:3") && Catch::Contains("'extra'"));
}

TEST_CASE("Zero sizes are rejected, as counts and as dimensions", "[tensor_list][errors]") {
  using ddiloco::ProtocolError;
  CHECK_THAT(error_of<ProtocolError>("ok 3\nz 0\n"), Catch::Contains("model.txt:2") && Catch::Contains("zero"));
  CHECK_THAT(error_of<ProtocolError>("z 16x0x4\n"), Catch::Contains("'16x0x4'") && Catch::Contains("zero"));
}

TEST_CASE("Sizes that overflow a 64-bit count are rejected", "[tensor_list][errors]") {
  using ddiloco::ProtocolError;
  // 2^64 = 18446744073709551616 is one past the largest 64-bit value.
  CHECK_THAT(error_of<ProtocolError>("a 18446744073709551616\n"), Catch::Contains("overflows"));
  CHECK(parse("a 18446744073709551615\n")[0].numel == 18446744073709551615ULL);
  // 2^32 x 2^32 = 2^64.
  CHECK_THAT(error_of<ProtocolError>("a 4294967296x4294967296\n"), Catch::Contains("'4294967296x4294967296'"));
  // Each tensor fits, the sum does not.
  CHECK_THAT(error_of<ProtocolError>("a 18446744073709551615\nb 1\n"),
             Catch::Contains("model.txt:2") && Catch::Contains("total"));
}

TEST_CASE("Duplicate names are reported with both lines", "[tensor_list][errors]") {
  CHECK_THAT(error_of<ddiloco::ProtocolError>("wq 4\nwk 4\nwq 8\n"),
             Catch::Contains("model.txt:3") && Catch::Contains("'wq'") && Catch::Contains("line 1"));
}

TEST_CASE("A list without tensors is an error", "[tensor_list][errors]") {
  CHECK_THAT(error_of<ddiloco::ProtocolError>(""), Catch::Contains("no tensors"));
  CHECK_THAT(error_of<ddiloco::ProtocolError>("# only\n\n# comments\n"), Catch::Contains("no tensors"));
}

TEST_CASE("Writing then parsing gives back the same tensors", "[tensor_list]") {
  const std::vector<TensorSpec> ts{{"emb", 96 * 32, true}, {"w1", 1024 * 512, false}, {"b1", 512, false},
                                   {"out", 1099511627776ULL, false}};  // 2^40
  std::ostringstream out;
  ddiloco::write_tensor_list(out, ts);
  CHECK(out.str() == "emb 3072 embedding\nw1 524288\nb1 512\nout 1099511627776\n");
  std::istringstream in(out.str());
  CHECK(parse_tensor_list(in, "roundtrip") == ts);
}

TEST_CASE("write_tensor_list refuses specs that would not read back", "[tensor_list][errors]") {
  auto message = [](std::vector<TensorSpec> ts) -> std::string {
    std::ostringstream out;
    try {
      ddiloco::write_tensor_list(out, ts);
    } catch (const ddiloco::InvalidArgument& e) {
      return e.what();
    }
    return "no exception";
  };
  CHECK_THAT(message({{"has space", 1, false}}), Catch::Contains("'has space'"));
  CHECK_THAT(message({{"a#b", 1, false}}), Catch::Contains("'a#b'"));
  CHECK_THAT(message({{"", 1, false}}), Catch::Contains("tensor 0"));
  CHECK_THAT(message({{"ok", 1, false}, {"empty", 0, false}}), Catch::Contains("'empty'"));
}

TEST_CASE("read_tensor_list_file names a file it cannot open", "[tensor_list][errors]") {
  try {
    (void)ddiloco::read_tensor_list_file(model_path("does-not-exist.txt"));
    FAIL("expected InvalidArgument");
  } catch (const ddiloco::InvalidArgument& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("does-not-exist.txt"));
  }
}

// Hand-computed parameter counts of the shipped models (shapes in each file's header).
TEST_CASE("The shipped Llama-3.2-1B-like list has 1,235,814,400 parameters", "[tensor_list][models]") {
  const auto ts = ddiloco::read_tensor_list_file(model_path("llama-1b.txt"));
  // Per layer: wq, wo 2 * 2048^2 = 8,388,608; wk, wv 2 * 512 * 2048 = 2,097,152;
  // w1, w2, w3 3 * 8192 * 2048 = 50,331,648; two norms 4,096; sum 60,821,504.
  // 16 layers 973,144,064 + embedding 128,256 * 2,048 = 262,668,288 + final norm 2,048.
  CHECK(total(ts) == 973144064ULL + 262668288ULL + 2048ULL);
  CHECK(total(ts) == 1235814400ULL);  // the published Llama 3.2 1B count
  CHECK(ts.size() == 1 + 16 * 9 + 1);
  CHECK(embedding_count(ts) == 1);
  CHECK(ts.front() == TensorSpec{"tok_embeddings.weight", 262668288, true});
}

TEST_CASE("The shipped Gemma-2B-like list has 2,506,172,416 parameters", "[tensor_list][models]") {
  const auto ts = ddiloco::read_tensor_list_file(model_path("gemma-2b.txt"));
  // Per layer: q, o 2 * 2048^2 = 8,388,608; k, v 2 * 256 * 2048 = 1,048,576;
  // gate, up, down 3 * 16384 * 2048 = 100,663,296; two norms 4,096; sum 110,104,576.
  // 18 layers 1,981,882,368 + embedding 256,000 * 2,048 = 524,288,000 + final norm 2,048.
  CHECK(total(ts) == 1981882368ULL + 524288000ULL + 2048ULL);
  CHECK(total(ts) == 2506172416ULL);
  CHECK(ts.size() == 1 + 18 * 9 + 1);
  CHECK(embedding_count(ts) == 1);
}

TEST_CASE("The shipped small MoE list has 791,233,536 parameters", "[tensor_list][models]") {
  const auto ts = ddiloco::read_tensor_list_file(model_path("moe-small.txt"));
  // Per layer: wq, wo 2 * 1024^2 = 2,097,152; wk, wv 2 * 256 * 1024 = 524,288;
  // router 8 * 1024 = 8,192; 8 experts * 3 * 3584 * 1024 = 88,080,384; two norms 2,048;
  // sum 90,712,064. 8 layers 725,696,512 + embedding and output 2 * 32,000 * 1,024
  // = 65,536,000 + final norm 1,024.
  CHECK(total(ts) == 725696512ULL + 65536000ULL + 1024ULL);
  CHECK(ts.size() == 1 + 8 * (7 + 8 * 3) + 2);
  CHECK(embedding_count(ts) == 2);
}

TEST_CASE("The shipped Streaming-DiLoCo-1B-like list has 1,273,595,904 parameters", "[tensor_list][models]") {
  const auto ts = ddiloco::read_tensor_list_file(model_path("streaming-1b.txt"));
  // Per layer: wq, wk, wv, wo 4 * 2048^2 = 16,777,216; MLP 2 * 8192 * 2048 = 33,554,432;
  // two norms 4,096; sum 50,335,744 (= 12 d^2 + 2 d). 24 layers 1,208,057,856 +
  // embedding 32,000 * 2,048 = 65,536,000 + final norm 2,048.
  CHECK(total(ts) == 1208057856ULL + 65536000ULL + 2048ULL);
  CHECK(ts.size() == 1 + 24 * 8 + 1);
  CHECK(embedding_count(ts) == 1);
}

TEST_CASE("The shipped character LM list has 577,120 parameters", "[tensor_list][models]") {
  const auto ts = ddiloco::read_tensor_list_file(model_path("charlm.txt"));
  // emb 96 * 32 = 3,072; w1 (32 * 32) * 512 = 524,288; b1 512; w2 512 * 96 = 49,152; b2 96.
  CHECK(total(ts) == 3072 + 524288 + 512 + 49152 + 96);
  REQUIRE(ts.size() == 5);
  CHECK(ts[0] == TensorSpec{"emb", 3072, true});
  CHECK(ts[4] == TensorSpec{"b2", 96, false});
}

TEST_CASE("Every shipped model splits into fragments and round-trips through the writer", "[tensor_list][models]") {
  for (const char* file : {"llama-1b.txt", "gemma-2b.txt", "moe-small.txt", "streaming-1b.txt", "charlm.txt"}) {
    INFO(file);
    const auto ts = ddiloco::read_tensor_list_file(model_path(file));
    const std::size_t p = ts.size() >= 24 ? 24 : ts.size();
    const auto plan = ddiloco::make_plan(ts, p);
    CHECK(plan.num_fragments() == p);
    CHECK(plan.total_numel() == total(ts));
    std::ostringstream out;
    ddiloco::write_tensor_list(out, ts);
    std::istringstream in(out.str());
    CHECK(parse_tensor_list(in, file) == ts);
  }
}
