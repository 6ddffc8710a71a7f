// Tests for <ddiloco/fast/merge.hpp>: fast::RadialDirectional against the
// readable reference ddiloco::RadialDirectional (<ddiloco/merge.hpp>) on random
// layouts and inputs, fp32 and encoded contributions, one and two threads, and
// its fused finish + Nesterov step against finish + NesterovSGD::step.
//
// Tolerances: the merged gradient within 1e-5 relative to the reference's
// output (max |diff| / max |ref|). The only differences are the summation order
// of the norms (fast: fp32 lanes of 16 terms, then double; ~1e-6 relative),
// which moves each tensor's scale factor by a few fp32 ulps. Encoded
// contributions are compared with the reference fed ddiloco::decode's output.
// DDILOCO_TEST_LABEL(threaded)
#include <ddiloco/fast/merge.hpp>

#include <ddiloco/codec.hpp>
#include <ddiloco/merge.hpp>
#include <ddiloco/outer_optimizer.hpp>
#include <ddiloco/testing.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace fast = ddiloco::fast;
using ddiloco::Codec;
using ddiloco::TensorSegment;
using Vec = std::vector<float>;

static_assert(ddiloco::MergeRule<fast::RadialDirectional>);

namespace {

double relative_diff(const Vec& got, const Vec& ref) {
  double d = 0.0, m = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    d = std::max(d, std::fabs(static_cast<double>(got[i]) - ref[i]));
    m = std::max(m, std::fabs(static_cast<double>(ref[i])));
  }
  return m == 0.0 ? d : d / m;
}

/// Layouts whose sizes straddle every block of the kernels: vector width (16),
/// norm block (256), quantisation block (64), decode chunk (4096), tensor group (2^18).
std::vector<std::vector<TensorSegment>> layouts() {
  auto make = [](std::vector<std::pair<std::size_t, bool>> sizes) {
    std::vector<TensorSegment> l;
    std::size_t off = 0;
    for (auto [n, emb] : sizes) {
      l.push_back({off, n, emb});
      off += n;
    }
    return l;
  };
  return {make({{1, false}}),
          make({{63, false}}),
          make({{64, false}}),
          make({{65, false}, {1000, true}, {4097, false}}),
          make({{3, false}, {17, false}, {255, true}, {257, false}, {4095, false}, {1, false}}),
          make({{(std::size_t{1} << 18) - 5, false}, {9, false}, {70000, true}, {(std::size_t{1} << 18) + 3, false}})};
}

std::vector<Vec> inputs_for(std::size_t n, std::size_t m, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<Vec> out(m, Vec(n));
  for (std::size_t k = 0; k < m; ++k) {
    const float scale = 0.5f + static_cast<float>(k);  // different norms per learner
    for (float& x : out[k]) x = dist(rng) * scale;
  }
  return out;
}

const double kWeights[] = {1.0, 2.5, 0.75, 4.0, 3.0};

}  // namespace

TEST_CASE("fast RDA merges fp32 contributions like the reference within 1e-5 relative, one and two threads",
          "[fast][merge]") {
  fast::Workers two(2);
  for (fast::Workers* workers : {static_cast<fast::Workers*>(nullptr), &two}) {
    for (const auto& layout : layouts()) {
      const std::size_t n = ddiloco::layout_size(layout);
      const auto inputs = inputs_for(n, 5, static_cast<std::uint32_t>(n));
      auto ref = ddiloco::RadialDirectional{}.make_accumulator(layout);
      auto got = fast::RadialDirectional{workers}.make_accumulator(layout);
      for (std::size_t k = 0; k < inputs.size(); ++k) {
        ref.add(inputs[k], kWeights[k]);
        got.add(inputs[k], kWeights[k]);
      }
      Vec out_ref(n), out_got(n);
      ref.finish(out_ref);
      got.finish(out_got);
      INFO("n = " << n << " threads = " << (workers ? workers->size() : 1));
      CHECK(relative_diff(out_got, out_ref) <= 1e-5);
      CHECK(got.count() == ref.count());
      CHECK(got.total_weight() == ref.total_weight());
    }
  }
}

TEST_CASE("fast RDA merges encoded contributions of every codec like the reference on the decoded values",
          "[fast][merge][codec]") {
  fast::Workers two(2);
  for (fast::Workers* workers : {static_cast<fast::Workers*>(nullptr), &two}) {
    for (const Codec codec : ddiloco::all_codecs) {
      for (const auto& layout : layouts()) {
        const std::size_t n = ddiloco::layout_size(layout);
        const auto inputs = inputs_for(n, 3, 99);
        auto ref = ddiloco::RadialDirectional{}.make_accumulator(layout);
        auto got = fast::RadialDirectional{workers}.make_accumulator(layout);
        for (std::size_t k = 0; k < inputs.size(); ++k) {
          const auto bytes = ddiloco::encode(codec, inputs[k]);
          Vec decoded(n);
          ddiloco::decode(codec, bytes, decoded);
          ref.add(decoded, kWeights[k]);
          got.add_encoded(codec, bytes, kWeights[k]);
        }
        Vec out_ref(n), out_got(n);
        ref.finish(out_ref);
        got.finish(out_got);
        INFO(ddiloco::to_string(codec) << " n = " << n << " threads = " << (workers ? workers->size() : 1));
        CHECK(relative_diff(out_got, out_ref) <= 1e-5);
      }
    }
  }
}

TEST_CASE("fast RDA finish_step equals finish, participation share and NesterovSGD::step", "[fast][merge]") {
  const ddiloco::NesterovSGD opt(0.7f, 0.9f);
  fast::Workers two(2);
  for (fast::Workers* workers : {static_cast<fast::Workers*>(nullptr), &two}) {
    for (const auto& layout : layouts()) {
      const std::size_t n = ddiloco::layout_size(layout);
      const auto inputs = inputs_for(n, 4, 5);
      auto ref = ddiloco::RadialDirectional{}.make_accumulator(layout);
      auto got = fast::RadialDirectional{workers}.make_accumulator(layout);
      Vec theta_ref = inputs_for(n, 1, 6)[0], state_ref(n, 0.0f);
      Vec theta = theta_ref, state = state_ref;
      for (int round = 0; round < 2; ++round) {  // the second round has non-zero momentum
        ref.reset();
        got.reset();
        for (std::size_t k = 0; k < inputs.size(); ++k) {
          ref.add(inputs[k], kWeights[k]);
          got.add(inputs[k], kWeights[k]);
        }
        Vec delta(n);
        ref.finish(delta);
        for (float& d : delta) d *= 0.75f;  // 3 of 4 alive learners contributed
        opt.step(theta_ref, delta, state_ref);
        got.finish_step(opt, 0.75f, theta, state);
      }
      INFO("n = " << n);
      CHECK(relative_diff(theta, theta_ref) <= 1e-5);
      CHECK(relative_diff(state, state_ref) <= 1e-5);
    }
  }
}

TEST_CASE("fast RDA keeps the reference's edge cases: zero tensors, cancelling directions, embeddings",
          "[fast][merge]") {
  // Tensor 0 cancels (v and -v), tensor 1 is zero in the first input, tensor 2
  // is an embedding. Hand values: tensor 0 -> 0; tensor 1: mean norm
  // (1 * 0 + 1 * 5) / 2 = 2.5 along (3, 4) / 5 -> (1.5, 2); tensor 2: (1 + 3) / 2 = 2.
  const std::vector<TensorSegment> layout{{0, 2, false}, {2, 2, false}, {4, 1, true}};
  const Vec a{1.0f, 2.0f, 0.0f, 0.0f, 1.0f};
  const Vec b{-1.0f, -2.0f, 3.0f, 4.0f, 3.0f};
  auto acc = fast::RadialDirectional{}.make_accumulator(layout);
  acc.add(a, 1.0);
  acc.add(b, 1.0);
  Vec out(5);
  acc.finish(out);
  CHECK(out[0] == 0.0f);
  CHECK(out[1] == 0.0f);
  CHECK(out[2] == Approx(1.5f).epsilon(1e-6));
  CHECK(out[3] == Approx(2.0f).epsilon(1e-6));
  CHECK(out[4] == Approx(2.0f).epsilon(1e-6));
}

TEST_CASE("fast RDA passes the merge-rule property checks of ddiloco::testing", "[fast][merge]") {
  for (const std::uint64_t seed : {1u, 2u}) {
    for (const auto& r :
         ddiloco::testing::check_merge_rule(fast::RadialDirectional{}, ddiloco::testing::NormBehaviour::mean_of_norms, seed)) {
      INFO(ddiloco::testing::to_string(r));
      CHECK(r.passed);
    }
  }
}

TEST_CASE("fast RDA rejects a corrupt encoded payload with ProtocolError and leaves the accumulator unchanged",
          "[fast][merge][errors]") {
  const std::vector<TensorSegment> layout{{0, 100, false}, {100, 60, false}};
  const auto inputs = inputs_for(160, 2, 3);
  auto acc = fast::RadialDirectional{}.make_accumulator(layout);
  acc.add(inputs[0], 1.0);
  auto bytes = ddiloco::encode(Codec::int4, inputs[1]);
  bytes[4 * 3] = std::byte{0x88};  // two -8 codes
  CHECK_THROWS_AS(acc.add_encoded(Codec::int4, bytes, 2.0), ddiloco::ProtocolError);
  CHECK(acc.count() == 1);
  CHECK(acc.total_weight() == 1.0);
  Vec out(160), ref_out(160);
  acc.finish(out);
  auto ref = ddiloco::RadialDirectional{}.make_accumulator(layout);
  ref.add(inputs[0], 1.0);
  ref.finish(ref_out);
  CHECK(relative_diff(out, ref_out) <= 1e-5);
  CHECK_THROWS_AS(acc.add_encoded(Codec::int4, std::span<const std::byte>(bytes).first(10), 1.0),
                  ddiloco::ShapeMismatch);
  CHECK_THROWS_AS(acc.add_encoded(Codec::fp32, ddiloco::encode(Codec::fp32, inputs[1]), -1.0),
                  ddiloco::InvalidArgument);
}

TEST_CASE("fast RDA finish_step checks shapes and the participation share", "[fast][merge][errors]") {
  const std::vector<TensorSegment> layout{{0, 8, false}};
  auto acc = fast::RadialDirectional{}.make_accumulator(layout);
  const ddiloco::NesterovSGD opt;
  Vec theta(8), state(8), short_state(7);
  CHECK_THROWS_AS(acc.finish_step(opt, 1.0f, theta, state), ddiloco::StateError);  // nothing added
  acc.add(Vec(8, 1.0f), 1.0);
  CHECK_THROWS_AS(acc.finish_step(opt, 1.0f, theta, short_state), ddiloco::ShapeMismatch);
  CHECK_THROWS_AS(acc.finish_step(opt, 0.0f, theta, state), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(acc.finish_step(opt, 1.5f, theta, state), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(fast::Workers(0), ddiloco::InvalidArgument);
}

TEST_CASE("fast RDA memory does not grow with the number of contributions", "[fast][merge]") {
  const std::vector<TensorSegment> layout{{0, 5000, false}, {5000, 77, true}};
  auto acc = fast::RadialDirectional{}.make_accumulator(layout);
  const std::size_t before = acc.memory_bytes();
  for (const auto& v : inputs_for(5077, 20, 4)) acc.add(v, 1.0);
  CHECK(acc.memory_bytes() == before);
}

// ---- add_batch ------------------------------------------------------------------
// Tolerances: the batch sums sum_b (w_b s_b / W') v_b in fp32 in batch order
// where the reference runs the recurrence mean += f (s v - mean); both are
// within a few fp32 ulps per term of the exact mean, so the merged gradients
// agree within 1e-5 relative of max |ref| (2e-5 for B = 64: up to 64 terms).

namespace {

/// How the elements of a test batch are encoded: all one codec, fp32 floats in
/// `values`, or codecs cycling over every codec (mixed).
struct BatchMode {
  const char* label;
  bool floats;
  bool mixed;
  Codec codec;
  bool odd_address = false;  // payload bytes one byte past an aligned address
};
// fp32 payload bytes are read as floats in place when aligned (fast::fp32_in_place),
// decoded chunk by chunk otherwise: both are checked.
const BatchMode kModes[] = {{"fp32 values", true, false, Codec::fp32},
                            {"fp32 bytes, read in place", false, false, Codec::fp32},
                            {"fp32 bytes at an odd address, decoded", false, false, Codec::fp32, true},
                            {"bf16", false, false, Codec::bf16},
                            {"int8", false, false, Codec::int8},
                            {"int4", false, false, Codec::int4},
                            {"mixed codecs", false, true, Codec::fp32}};

/// A batch plus everything needed to check it: the payloads it points into,
/// their decoded values (what the reference is fed) and the weights.
struct TestBatch {
  std::vector<Vec> values;                   // fp32 floats (floats mode)
  std::vector<std::vector<std::byte>> bytes;  // payloads (encoded modes)
  std::vector<Codec> codecs;
  std::vector<Vec> decoded;
  std::vector<double> weights;
  std::vector<fast::Contribution> batch;
};

TestBatch make_batch(const BatchMode& mode, std::size_t n, std::size_t b, std::uint32_t seed) {
  TestBatch tb;
  tb.values = inputs_for(n, b, seed);
  std::mt19937 rng(seed + 7);
  std::uniform_real_distribution<double> wdist(0.1, 5.0);
  for (std::size_t k = 0; k < b; ++k) {
    tb.weights.push_back(k % 5 == 3 ? 0.0 : wdist(rng));  // every fifth is an absent learner
    const Codec c = mode.mixed ? ddiloco::all_codecs[k % std::size(ddiloco::all_codecs)] : mode.codec;
    tb.codecs.push_back(c);
    if (mode.floats) {
      tb.bytes.emplace_back();
      tb.decoded.push_back(tb.values[k]);
    } else {
      const auto encoded = ddiloco::encode(c, tb.values[k]);
      tb.bytes.emplace_back(mode.odd_address ? 1 : 0, std::byte{0x5A});
      tb.bytes.back().insert(tb.bytes.back().end(), encoded.begin(), encoded.end());
      Vec d(n);
      ddiloco::decode(c, encoded, d);
      tb.decoded.push_back(std::move(d));
    }
  }
  for (std::size_t k = 0; k < b; ++k) {
    fast::Contribution c;
    c.weight = tb.weights[k];
    if (mode.floats) {
      c.values = tb.values[k];
    } else {
      c.codec = tb.codecs[k];
      c.bytes = std::span<const std::byte>(tb.bytes[k]).subspan(mode.odd_address ? 1 : 0);
    }
    tb.batch.push_back(c);
  }
  return tb;
}

/// The same elements added one by one with add / add_encoded.
void add_one_by_one(fast::RadialDirectional::Accumulator& acc, const TestBatch& tb, bool floats) {
  for (std::size_t k = 0; k < tb.weights.size(); ++k) {
    if (floats) {
      acc.add(tb.values[k], tb.weights[k]);
    } else {
      acc.add_encoded(tb.codecs[k], tb.batch[k].bytes, tb.weights[k]);
    }
  }
}

}  // namespace

TEST_CASE("fast RDA add_batch equals the reference and one-by-one adds for every codec, mixed codecs, "
          "batch sizes 1, 2, 7 and 64, one and two threads",
          "[fast][merge][batch]") {
  fast::Workers two(2);
  for (fast::Workers* workers : {static_cast<fast::Workers*>(nullptr), &two}) {
    for (const auto& layout : layouts()) {
      const std::size_t n = ddiloco::layout_size(layout);
      for (const std::size_t b : {std::size_t{1}, std::size_t{2}, std::size_t{7}, std::size_t{64}}) {
        if (b == 64 && n > 10000) continue;  // 64 contributions of the big layouts: too slow to be worth it
        const double tol = b == 64 ? 2e-5 : 1e-5;
        for (const BatchMode& mode : kModes) {
          // Two batches into the same accumulators: the first starts the mean,
          // the second folds into an existing one (W / W' != 0).
          const TestBatch first = make_batch(mode, n, b, static_cast<std::uint32_t>(n + b));
          const TestBatch second = make_batch(mode, n, b, static_cast<std::uint32_t>(3 * n + b + 1));
          auto ref = ddiloco::RadialDirectional{}.make_accumulator(layout);
          auto one = fast::RadialDirectional{workers}.make_accumulator(layout);
          auto got = fast::RadialDirectional{workers}.make_accumulator(layout);
          for (const TestBatch* tb : {&first, &second}) {
            for (std::size_t k = 0; k < b; ++k) ref.add(tb->decoded[k], tb->weights[k]);
            add_one_by_one(one, *tb, mode.floats);
            got.add_batch(tb->batch);
            INFO(mode.label << " n = " << n << " B = " << b << " threads = " << (workers ? workers->size() : 1)
                            << (tb == &first ? " first batch" : " second batch"));
            REQUIRE(got.count() == ref.count());
            CHECK(got.total_weight() == ref.total_weight());
            if (ref.total_weight() == 0.0) continue;  // B = 1 whose only element has weight 0
            Vec out_ref(n), out_one(n), out_got(n);
            ref.finish(out_ref);
            one.finish(out_one);
            got.finish(out_got);
            CHECK(relative_diff(out_got, out_ref) <= tol);
            CHECK(relative_diff(out_got, out_one) <= tol);
          }
        }
      }
    }
  }
}

TEST_CASE("fast RDA add_batch keeps the hand-computed edge cases: cancelling directions, a zero tensor, an embedding",
          "[fast][merge][batch]") {
  // Same inputs and hand values as the streaming edge-case test above.
  const std::vector<TensorSegment> layout{{0, 2, false}, {2, 2, false}, {4, 1, true}};
  const Vec a{1.0f, 2.0f, 0.0f, 0.0f, 1.0f};
  const Vec b{-1.0f, -2.0f, 3.0f, 4.0f, 3.0f};
  fast::Workers two(2);
  for (fast::Workers* workers : {static_cast<fast::Workers*>(nullptr), &two}) {
    auto acc = fast::RadialDirectional{workers}.make_accumulator(layout);
    const fast::Contribution batch[] = {{Codec::fp32, a, {}, 1.0, {}}, {Codec::fp32, b, {}, 1.0, {}}};
    acc.add_batch(batch);
    Vec out(5);
    acc.finish(out);
    CHECK(out[0] == 0.0f);
    CHECK(out[1] == 0.0f);
    CHECK(out[2] == Approx(1.5f).epsilon(1e-6));
    CHECK(out[3] == Approx(2.0f).epsilon(1e-6));
    CHECK(out[4] == Approx(2.0f).epsilon(1e-6));
  }
}

TEST_CASE("fast RDA add_batch skips zero weights without reading them and counts only the others",
          "[fast][merge][batch]") {
  const std::vector<TensorSegment> layout{{0, 100, false}, {100, 30, true}};
  const auto inputs = inputs_for(130, 2, 8);
  auto corrupt = ddiloco::encode(Codec::int8, inputs[1]);
  corrupt[4 * 2 + 5] = std::byte{0x80};  // a -128 code: invalid, but its weight is 0
  auto acc = fast::RadialDirectional{}.make_accumulator(layout);
  const fast::Contribution zeros[] = {{Codec::fp32, inputs[0], {}, 0.0, {}}, {Codec::int8, {}, corrupt, 0.0, {}}};
  acc.add_batch(zeros);
  CHECK(acc.count() == 0);
  CHECK(acc.total_weight() == 0.0);
  Vec out(130);
  CHECK_THROWS_AS(acc.finish(out), ddiloco::StateError);
  const fast::Contribution some[] = {{Codec::fp32, inputs[0], {}, 2.0, {}}, {Codec::int8, {}, corrupt, 0.0, {}}};
  acc.add_batch(some);
  CHECK(acc.count() == 1);
  CHECK(acc.total_weight() == 2.0);
  acc.finish(out);
  // One contribution: RDA returns it (norm * direction), the embedding as is.
  CHECK(relative_diff(out, inputs[0]) <= 1e-6);
  acc.add_batch({});  // an empty batch changes nothing
  CHECK(acc.count() == 1);
}

TEST_CASE("fast RDA add_batch with one bad element throws and leaves the accumulator unchanged",
          "[fast][merge][batch][errors]") {
  const std::vector<TensorSegment> layout{{0, 100, false}, {100, 60, false}};
  const auto inputs = inputs_for(160, 3, 3);
  auto good = ddiloco::encode(Codec::int4, inputs[1]);
  auto bad = good;
  bad[4 * 3 + 7] = std::byte{0x88};  // two -8 codes
  const Vec short_values(159, 1.0f);
  auto acc = fast::RadialDirectional{}.make_accumulator(layout);
  acc.add(inputs[0], 1.0);
  Vec before(160);
  acc.finish(before);

  auto unchanged = [&] {
    CHECK(acc.count() == 1);
    CHECK(acc.total_weight() == 1.0);
    Vec out(160);
    acc.finish(out);
    CHECK(out == before);  // bit for bit: the mean was not touched
  };
  // The bad element is last, so the good ones before it were validated already.
  const fast::Contribution corrupt[] = {{Codec::fp32, inputs[2], {}, 1.0, {}}, {Codec::int4, {}, good, 2.0, {}},
                                        {Codec::int4, {}, bad, 1.0, {}}};
  CHECK_THROWS_AS(acc.add_batch(corrupt), ddiloco::ProtocolError);
  unchanged();
  const fast::Contribution wrong_size[] = {{Codec::int4, {}, good, 2.0, {}}, {Codec::fp32, short_values, {}, 1.0, {}}};
  CHECK_THROWS_AS(acc.add_batch(wrong_size), ddiloco::ShapeMismatch);
  unchanged();
  const fast::Contribution short_bytes[] = {
      {Codec::int4, {}, std::span<const std::byte>(good).first(good.size() - 1), 1.0, {}}};
  CHECK_THROWS_AS(acc.add_batch(short_bytes), ddiloco::ShapeMismatch);
  unchanged();
  // An int codec needs bytes: values alone are not an int4 payload.
  const fast::Contribution values_as_int4[] = {{Codec::int4, inputs[2], {}, 1.0, {}}};
  CHECK_THROWS_AS(acc.add_batch(values_as_int4), ddiloco::ShapeMismatch);
  unchanged();
  for (const double w : {-1.0, std::nan(""), HUGE_VAL}) {
    const fast::Contribution bad_weight[] = {{Codec::fp32, inputs[2], {}, 1.0, {}}, {Codec::int4, {}, good, w, {}}};
    CHECK_THROWS_AS(acc.add_batch(bad_weight), ddiloco::InvalidArgument);
    unchanged();
  }
}

TEST_CASE("fast RDA memory does not grow with the batch size", "[fast][merge][batch]") {
  const std::vector<TensorSegment> layout{{0, 5000, false}, {5000, 77, true}};
  auto acc = fast::RadialDirectional{}.make_accumulator(layout);
  const std::size_t before = acc.memory_bytes();
  const auto inputs = inputs_for(5077, 40, 4);
  std::vector<fast::Contribution> batch;
  for (const auto& v : inputs) batch.push_back({Codec::fp32, v, {}, 1.0, {}});
  acc.add_batch(batch);
  CHECK(acc.count() == 40);
  CHECK(acc.memory_bytes() == before);
}

TEST_CASE("fast RDA merges int8 and int4 payloads with the baseline kernels like the AVX2 ones and the reference, "
          "streaming and batched",
          "[fast][merge][codec][isa]") {
  // The two kernel builds do the same fp32 operations in the same order:
  // bit-identical merges (on a CPU without AVX2 both runs use the baseline).
  // Each also within 1e-5 relative of the reference fed ddiloco::decode's output.
  for (const Codec codec : {Codec::int8, Codec::int4}) {
    for (const auto& layout : layouts()) {
      const std::size_t n = ddiloco::layout_size(layout);
      const auto inputs = inputs_for(n, 3, 131);
      std::vector<std::vector<std::byte>> payloads;
      auto ref = ddiloco::RadialDirectional{}.make_accumulator(layout);
      for (std::size_t k = 0; k < inputs.size(); ++k) {
        payloads.push_back(ddiloco::encode(codec, inputs[k]));
        Vec decoded(n);
        ddiloco::decode(codec, payloads.back(), decoded);
        ref.add(decoded, kWeights[k]);
      }
      Vec out_ref(n);
      ref.finish(out_ref);
      std::vector<fast::Contribution> batch;
      for (std::size_t k = 0; k < payloads.size(); ++k) batch.push_back({codec, {}, payloads[k], kWeights[k], {}});
      Vec streamed[2], batched[2];
      for (const bool baseline : {true, false}) {
        fast::use_baseline_kernels(baseline);
        auto one = fast::RadialDirectional{}.make_accumulator(layout);
        for (std::size_t k = 0; k < payloads.size(); ++k) one.add_encoded(codec, payloads[k], kWeights[k]);
        auto all = fast::RadialDirectional{}.make_accumulator(layout);
        all.add_batch(batch);
        Vec& s = streamed[baseline ? 0 : 1];
        Vec& b = batched[baseline ? 0 : 1];
        s.resize(n);
        b.resize(n);
        one.finish(s);
        all.finish(b);
      }
      fast::use_baseline_kernels(false);
      INFO(ddiloco::to_string(codec) << " n = " << n);
      CHECK(streamed[0] == streamed[1]);
      CHECK(batched[0] == batched[1]);
      CHECK(relative_diff(streamed[0], out_ref) <= 1e-5);
      CHECK(relative_diff(batched[0], out_ref) <= 1e-5);
    }
  }
}

TEST_CASE("fast RDA add_batch with caller-computed tensor norms merges as computing them itself", "[fast][merge][batch]") {
  // The syncer hands over the ||v_t||^2 it took while validating; add_batch
  // then skips its norm pass. Same norms (summed in double here, in fp32 lanes
  // there): within 1e-5 relative, as add_batch against the reference.
  const std::vector<TensorSegment> layout{{0, 5000, false}, {5000, 77, true}, {5077, 300, false}};
  const auto inputs = inputs_for(5377, 6, 9);
  std::vector<std::vector<double>> norms(inputs.size());
  std::vector<fast::Contribution> computed, given;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    for (const auto& seg : layout) {
      double sq = 0.0;
      for (std::size_t i = seg.offset; i < seg.offset + seg.size; ++i)
        sq += static_cast<double>(inputs[k][i]) * static_cast<double>(inputs[k][i]);
      norms[k].push_back(sq);
    }
    const double w = 1.0 + static_cast<double>(k);
    computed.push_back({Codec::fp32, inputs[k], {}, w, {}});
    given.push_back({Codec::fp32, inputs[k], {}, w, norms[k]});
  }
  auto a = fast::RadialDirectional{}.make_accumulator(layout);
  auto b = fast::RadialDirectional{}.make_accumulator(layout);
  a.add_batch(computed);
  b.add_batch(given);
  Vec out_a(5377), out_b(5377);
  a.finish(out_a);
  b.finish(out_b);
  CHECK(relative_diff(out_b, out_a) <= 1e-5);

  // The given norms are the ones used: norms of another contribution (the
  // next one's) give another merge.
  std::vector<fast::Contribution> swapped = given;
  for (std::size_t k = 0; k < swapped.size(); ++k) swapped[k].tensor_sq = norms[(k + 1) % norms.size()];
  auto d = fast::RadialDirectional{}.make_accumulator(layout);
  d.add_batch(swapped);
  Vec out_d(5377);
  d.finish(out_d);
  CHECK(relative_diff(out_d, out_a) > 1e-3);

  auto c = fast::RadialDirectional{}.make_accumulator(layout);
  const std::vector<double> two_norms{1.0, 2.0};
  const fast::Contribution wrong[] = {{Codec::fp32, inputs[0], {}, 1.0, two_norms}};
  CHECK_THROWS_AS(c.add_batch(wrong), ddiloco::ShapeMismatch);
  CHECK(c.count() == 0);
}
