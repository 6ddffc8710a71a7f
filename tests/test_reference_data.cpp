// Tests for <ddiloco/reference/data.hpp>: random numbers, vocabulary, fortunes corpus, Markov
// chain task (entropy rate against closed forms), batches and shards.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <ddiloco/reference/data.hpp>

namespace ref = ddiloco::reference;

namespace {
double binary_entropy_part(double p) { return p > 0.0 ? -p * std::log(p) : 0.0; }
}  // namespace

TEST_CASE("The random generator repeats its sequence for a seed and has the right moments", "[reference][data]") {
  ref::Rng a(42);
  ref::Rng b(42);
  ref::Rng c(43);
  bool all_same = true;
  bool any_diff_c = false;
  for (int i = 0; i < 100; ++i) {
    const auto x = a.next_u64();
    all_same = all_same && x == b.next_u64();
    any_diff_c = any_diff_c || x != c.next_u64();
  }
  CHECK(all_same);
  CHECK(any_diff_c);

  // Moments over n samples; tolerances are 5 standard errors.
  constexpr int n = 200000;
  ref::Rng r(7);
  double su = 0.0;
  double sn = 0.0;
  double sn2 = 0.0;
  double sg = 0.0;
  for (int i = 0; i < n; ++i) {
    su += r.uniform();
    const double z = r.normal();
    sn += z;
    sn2 += z * z;
    sg += r.gamma(0.3);  // mean 0.3, variance 0.3
  }
  CHECK(su / n == Approx(0.5).margin(5 * std::sqrt(1.0 / 12.0 / n)));
  CHECK(sn / n == Approx(0.0).margin(5 * std::sqrt(1.0 / n)));
  CHECK(sn2 / n == Approx(1.0).margin(5 * std::sqrt(2.0 / n)));
  CHECK(sg / n == Approx(0.3).margin(5 * std::sqrt(0.3 / n)));
  ref::Rng g(8);
  double sg3 = 0.0;
  for (int i = 0; i < n; ++i) sg3 += g.gamma(3.0);  // mean 3, variance 3
  CHECK(sg3 / n == Approx(3.0).margin(5 * std::sqrt(3.0 / n)));
  for (int i = 0; i < 1000; ++i) CHECK(r.below(7) < 7);
}

TEST_CASE("The character vocabulary maps newline, printable ASCII and unknown bytes as documented",
          "[reference][data]") {
  STATIC_REQUIRE(ref::CharVocab::kSize == 97);
  CHECK(ref::CharVocab::encode('\n') == 0);
  CHECK(ref::CharVocab::encode(' ') == 1);
  CHECK(ref::CharVocab::encode('A') == 65 - 31);
  CHECK(ref::CharVocab::encode('~') == 95);
  CHECK(ref::CharVocab::encode('\t') == 1);
  CHECK(ref::CharVocab::encode('\b') == 96);
  CHECK(ref::CharVocab::encode(static_cast<char>(0xC3)) == 96);
  CHECK(ref::CharVocab::decode(96) == '\x1a');

  const std::string text = "Hello, world!\n  {braces} & ~tilde~ 0123456789\n";
  CHECK(ref::CharVocab::decode(ref::CharVocab::encode(text)) == text);

  ref::TokenStream all(ref::CharVocab::kSize);
  std::iota(all.begin(), all.end(), ref::Token{0});
  CHECK(ref::CharVocab::encode(ref::CharVocab::decode(all)) == all);
  CHECK(ref::CharVocab::decode(ref::CharVocab::encode("a\tb")) == "a b");
}

TEST_CASE("Fortune files are split on lines holding only a percent sign", "[reference][data]") {
  const auto f = ref::split_fortunes("First one.\n%\nSecond\n  -- someone\n%\n%%not a separator\n%\n\n%\n");
  REQUIRE(f.size() == 4);
  CHECK(f[0] == "First one.\n");
  CHECK(f[1] == "Second\n  -- someone\n");
  CHECK(f[2] == "%%not a separator\n");
  // "\n" alone is a fortune made of one empty line: kept (it is not empty text).
  CHECK(f[3] == "\n");
  const auto g = ref::split_fortunes("a\n%\nlast");
  REQUIRE(g.size() == 2);
  CHECK(g[1] == "last");
}

TEST_CASE("The fortunes corpus loads into disjoint, non-empty train and validation splits", "[reference][data]") {
  if (!std::filesystem::is_directory(ref::default_fortune_dir())) {
    WARN("fortunes package not installed; skipping (apt-get install fortunes)");
    return;
  }
  const auto corpus = ref::load_fortunes();
  REQUIRE(!corpus.train_fortunes.empty());
  REQUIRE(!corpus.validation_fortunes.empty());
  CHECK(corpus.files.size() >= 10);
  for (const auto& name : corpus.files) {
    CHECK(name.find(".dat") == std::string::npos);
    CHECK(name.find(".u8") == std::string::npos);
  }

  // Disjoint by content: no text in both splits.
  const std::set<std::string> train(corpus.train_fortunes.begin(), corpus.train_fortunes.end());
  std::size_t shared = 0;
  for (const auto& f : corpus.validation_fortunes) shared += train.count(f);
  CHECK(shared == 0);

  // Roughly 10% validation (hash split over ~15k fortunes: 10% +- 1.5%).
  const double val_fraction = static_cast<double>(corpus.validation_fortunes.size()) /
                              static_cast<double>(corpus.validation_fortunes.size() + corpus.train_fortunes.size());
  CHECK(val_fraction == Approx(0.10).margin(0.015));

  // Streams: every fortune followed by "%\n", in order.
  std::size_t expected = 0;
  for (const auto& f : corpus.train_fortunes) expected += f.size() + 2;
  CHECK(corpus.train.size() == expected);
  const std::string head = ref::CharVocab::decode(
      std::span<const ref::Token>(corpus.train).first(corpus.train_fortunes[0].size() + 2));
  CHECK(head == std::string(ref::CharVocab::decode(ref::CharVocab::encode(corpus.train_fortunes[0]))) + "%\n");

  // Deterministic.
  const auto again = ref::load_fortunes();
  CHECK(again.train == corpus.train);
  CHECK(again.validation == corpus.validation);
}

TEST_CASE("Loading fortunes from a missing directory says how to install them", "[reference][data]") {
  ref::FortuneOptions options;
  options.dir = "/nonexistent/ddiloco/fortunes";
  try {
    (void)ref::load_fortunes(options);
    FAIL("expected an exception");
  } catch (const ddiloco::InvalidArgument& e) {
    CHECK_THAT(e.what(), Catch::Contains("apt-get install fortunes"));
  }
}

TEST_CASE("A fortunes directory of our own is read, indexes skipped, and split by text hash", "[reference][data]") {
  const auto dir = std::filesystem::temp_directory_path() / "ddiloco_test_reference_fortunes";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::string text;
  for (int i = 0; i < 200; ++i) text += "fortune number " + std::to_string(i) + "\n%\n";
  std::ofstream(dir / "numbers") << text;
  std::ofstream(dir / "numbers.dat") << "binary index, must be ignored";
  ref::FortuneOptions options;
  options.dir = dir;
  options.validation_percent = 30;
  const auto corpus = ref::load_fortunes(options);
  CHECK(corpus.files == std::vector<std::string>{"numbers"});
  CHECK(corpus.train_fortunes.size() + corpus.validation_fortunes.size() == 200);
  for (const auto& f : corpus.validation_fortunes) CHECK(ref::is_validation_fortune(f, 30));
  for (const auto& f : corpus.train_fortunes) CHECK(!ref::is_validation_fortune(f, 30));
  CHECK(corpus.validation_fortunes.size() > 30);  // 60 expected, sd about 6.5
  CHECK(corpus.validation_fortunes.size() < 90);
  std::filesystem::remove_all(dir);
}

TEST_CASE("The entropy rate of a two-state chain equals the closed form", "[reference][data]") {
  // P = [[1-a, a], [b, 1-b]]: pi = (b, a) / (a + b),
  // H = pi_0 h(a) + pi_1 h(b), h(p) = -p log p - (1-p) log(1-p).
  const double a = 0.1;
  const double b = 0.3;
  const ref::MarkovChain chain(2, 1, {1 - a, a, b, 1 - b});
  const auto pi = chain.stationary_distribution();
  CHECK(pi[0] == Approx(b / (a + b)).epsilon(1e-12));
  CHECK(pi[1] == Approx(a / (a + b)).epsilon(1e-12));
  const double h_a = binary_entropy_part(a) + binary_entropy_part(1 - a);
  const double h_b = binary_entropy_part(b) + binary_entropy_part(1 - b);
  const double expected = b / (a + b) * h_a + a / (a + b) * h_b;  // = 0.75 * 0.325083 + 0.25 * 0.610864
  CHECK(expected == Approx(0.396528).margin(1e-6));
  CHECK(chain.entropy_rate() == Approx(expected).epsilon(1e-12));
}

TEST_CASE("Entropy rates of periodic, memoryless and higher-order chains match hand computation",
          "[reference][data]") {
  // Periodic 0 -> 1 -> 0: deterministic, entropy 0, pi uniform (plain power iteration would oscillate).
  const ref::MarkovChain flip(2, 1, {0, 1, 1, 0});
  CHECK(flip.stationary_distribution()[0] == Approx(0.5).epsilon(1e-12));
  CHECK(flip.entropy_rate() == Approx(0.0).margin(1e-15));

  // Every row the same distribution q: i.i.d., so H = entropy of q.
  const std::vector<double> q{0.5, 0.25, 0.125, 0.125};  // entropy 1.75 bits
  std::vector<double> rows;
  for (int s = 0; s < 4; ++s) rows.insert(rows.end(), q.begin(), q.end());
  CHECK(ref::MarkovChain(4, 1, rows).entropy_rate() == Approx(1.75 * std::log(2.0)).epsilon(1e-12));

  // An order-2 chain whose rows depend only on the last symbol is the order-1 chain in disguise.
  const double a = 0.2;
  const double b = 0.4;
  std::vector<double> order2;
  for (int s = 0; s < 4; ++s) {
    const int last = s % 2;
    if (last == 0) order2.insert(order2.end(), {1 - a, a});
    else order2.insert(order2.end(), {b, 1 - b});
  }
  const double h_a = binary_entropy_part(a) + binary_entropy_part(1 - a);
  const double h_b = binary_entropy_part(b) + binary_entropy_part(1 - b);
  CHECK(ref::MarkovChain(2, 2, order2).entropy_rate() == Approx(b / (a + b) * h_a + a / (a + b) * h_b).epsilon(1e-12));
}

TEST_CASE("A sampled Markov stream has the stationary frequencies and mean loss of the entropy rate",
          "[reference][data]") {
  const auto chain = ref::MarkovChain::random(8, 1, 3, 0.3);
  const auto stream = chain.sample(200000, 11);
  REQUIRE(stream.size() == 200000);
  const auto pi = chain.stationary_distribution();
  std::vector<double> freq(8, 0.0);
  for (auto t : stream) freq[t] += 1.0 / static_cast<double>(stream.size());
  for (std::size_t s = 0; s < 8; ++s) CHECK(freq[s] == Approx(pi[s]).margin(0.01));

  std::vector<std::size_t> positions(stream.size() - 1);
  std::iota(positions.begin(), positions.end(), std::size_t{1});
  CHECK(chain.mean_log_loss(stream, positions) == Approx(chain.entropy_rate()).epsilon(0.02));
  CHECK(chain.sample(1000, 11) == ref::TokenStream(stream.begin(), stream.begin() + 1000));
  CHECK(chain.sample(1000, 12) != ref::TokenStream(stream.begin(), stream.begin() + 1000));
}

TEST_CASE("Random chains are seeded, normalised and far below the uniform entropy", "[reference][data]") {
  const auto chain = ref::MarkovChain::random(32, 1, 5);
  for (std::size_t s = 0; s < chain.states(); ++s) {
    double sum = 0.0;
    for (std::size_t a = 0; a < chain.vocab(); ++a) {
      CHECK(chain.probability(s, a) > 0.0);
      sum += chain.probability(s, a);
    }
    CHECK(sum == Approx(1.0).epsilon(1e-12));
  }
  // Dirichlet(0.1) rows over 32 symbols: expected row entropy psi(4.2) - psi(1.1), about 1.73 nats.
  CHECK(chain.entropy_rate() < 0.7 * std::log(32.0));
  CHECK(chain.entropy_rate() > 0.5);
  CHECK(ref::MarkovChain::random(32, 1, 5).entropy_rate() == chain.entropy_rate());
  CHECK(ref::MarkovChain::random(32, 1, 6).entropy_rate() != chain.entropy_rate());
  CHECK(ref::MarkovChain::random(4, 3, 1).states() == 64);
}

TEST_CASE("Malformed chains are rejected with a message", "[reference][data]") {
  CHECK_THROWS_AS(ref::MarkovChain(2, 1, {0.5, 0.5, 0.5}), ddiloco::ShapeMismatch);
  CHECK_THROWS_AS(ref::MarkovChain(2, 1, {0.5, 0.6, 0.5, 0.5}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(ref::MarkovChain(2, 1, {1.5, -0.5, 0.5, 0.5}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(ref::MarkovChain(1, 1, {1.0}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(ref::MarkovChain(2, 0, {1.0, 0.0}), ddiloco::InvalidArgument);
}

TEST_CASE("Batches hold the context window before each target and stay inside the learner's shard",
          "[reference][data]") {
  // stream[i] = i, so a token names its own position.
  ref::TokenStream stream(10000);
  std::iota(stream.begin(), stream.end(), ref::Token{0});
  constexpr std::size_t C = 5;
  constexpr std::size_t M = 4;
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  for (std::size_t m = 0; m < M; ++m) {
    ref::BatchSampler sampler(stream, C, 64, 9, {m, M});
    ranges.emplace_back(sampler.begin_position(), sampler.end_position());
    for (int k = 0; k < 20; ++k) {
      const auto batch = sampler.next();
      REQUIRE(batch.size == 64);
      REQUIRE(batch.contexts.size() == 64 * C);
      for (std::size_t b = 0; b < batch.size; ++b) {
        const std::size_t target = batch.targets[b];
        CHECK(target >= sampler.begin_position());
        CHECK(target < sampler.end_position());
        for (std::size_t c = 0; c < C; ++c) CHECK(batch.contexts[b * C + c] == target - C + c);
      }
    }
  }
  // Shards are disjoint, contiguous and cover all but the remainder of the target positions.
  CHECK(ranges[0].first == C);
  for (std::size_t m = 1; m < M; ++m) CHECK(ranges[m].first == ranges[m - 1].second);
  CHECK(ranges[M - 1].second > stream.size() - M);
  CHECK(ranges[M - 1].second <= stream.size());
}

TEST_CASE("Interleaved shards deal blocks round-robin: disjoint, together covering the stream", "[reference][data]") {
  constexpr std::size_t C = 3, M = 3, B = 7;
  ref::TokenStream stream(C + 10 * M * B + 5);  // 10 rounds of blocks plus an incomplete one
  std::iota(stream.begin(), stream.end(), ref::Token{0});
  std::vector<ref::BatchSampler> samplers;
  for (std::size_t m = 0; m < M; ++m) samplers.emplace_back(stream, C, 256, 9, ref::Shard{m, M, B});
  // Every target position of the 10 full rounds belongs to exactly one shard, the one that owns its block.
  for (std::size_t i = C; i < C + 10 * M * B; ++i) {
    std::size_t owners = 0;
    for (std::size_t m = 0; m < M; ++m) owners += samplers[m].owns(i) ? 1 : 0;
    CHECK(owners == 1);
    CHECK(samplers[((i - C) / B) % M].owns(i));
  }
  for (std::size_t i = C + 10 * M * B; i < stream.size(); ++i)  // the incomplete round is left out
    for (const auto& s : samplers) CHECK_FALSE(s.owns(i));
  // Draws stay in the shard and reach every one of its blocks (the whole corpus, not one range).
  for (std::size_t m = 0; m < M; ++m) {
    std::set<std::size_t> blocks;
    for (int round = 0; round < 8; ++round) {
      const auto batch = samplers[m].next();
      for (std::size_t b = 0; b < batch.size; ++b) {
        const std::size_t target = batch.targets[b];
        REQUIRE(samplers[m].owns(target));
        for (std::size_t c = 0; c < C; ++c) CHECK(batch.contexts[b * C + c] == target - C + c);
        blocks.insert((target - C) / B);
      }
    }
    CHECK(blocks.size() == 10);
  }
  CHECK_THROWS_WITH(ref::BatchSampler(stream, C, 16, 1, ref::Shard{0, M, 1000}),
                    Catch::Contains("of blocks of 1000"));
}

TEST_CASE("Batch sampling is a function of the seed and the shard", "[reference][data]") {
  ref::TokenStream stream(5000);
  std::iota(stream.begin(), stream.end(), ref::Token{0});
  ref::BatchSampler a(stream, 3, 16, 1, {0, 1});
  ref::BatchSampler b(stream, 3, 16, 1, {0, 1});
  ref::BatchSampler c(stream, 3, 16, 2, {0, 1});
  const auto ba = a.next();
  CHECK(ba.targets == b.next().targets);
  CHECK(ba.targets != c.next().targets);
  CHECK_THROWS_AS(ref::BatchSampler(stream, 3, 16, 1, {2, 2}), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(ref::BatchSampler(stream, 0, 16, 1), ddiloco::InvalidArgument);
  CHECK_THROWS_AS(ref::BatchSampler(ref::TokenStream(3), 3, 16, 1), ddiloco::InvalidArgument);
}

TEST_CASE("Evaluation positions are spread evenly over the stream", "[reference][data]") {
  const auto p = ref::evaluation_positions(105, 5, 10);
  REQUIRE(p.size() == 10);
  CHECK(p.front() == 5);
  for (std::size_t j = 0; j < p.size(); ++j) CHECK(p[j] == 5 + 10 * j);
  const auto all = ref::evaluation_positions(20, 5, 1000);
  REQUIRE(all.size() == 15);
  CHECK(all.back() == 19);
  CHECK(ref::evaluation_positions(5, 5, 10).empty());
}
