// ddiloco/reference/data.hpp: data for the reference trainer.
//
// What it is: everything the reference character model (<ddiloco/reference/char_lm.hpp>)
// trains and is scored on:
//   - `Rng`: a small portable random generator (SplitMix64), so every seed gives the same
//     numbers on every platform and standard library;
//   - `CharVocab`: the character vocabulary (97 symbols, see below);
//   - `load_fortunes()`: real English text from the distribution's `fortunes` package, split
//     deterministically into train / validation;
//   - `MarkovChain`: a synthetic task whose optimal loss (the entropy rate) is known exactly;
//   - `BatchSampler`: seeded (context window, next character) batches from a disjoint shard of a
//     token stream, one shard per learner.
// What it is not: part of the ddiloco library proper. It exists so that training quality can be
// measured in tests, examples and demos; it reads files, so it is not pure like the core.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddiloco/error.hpp>

namespace ddiloco::reference {

/// One symbol of a token stream (an id in [0, vocabulary size)).
using Token = std::uint16_t;
/// A sequence of token ids.
using TokenStream = std::vector<Token>;

// ---- Random numbers ---------------------------------------------------------------------------

/// SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014):
/// x += 0x9E3779B97F4A7C15, then two xor-shift-multiply rounds. Chosen over <random>'s
/// distributions because those are implementation-defined; these numbers are the same everywhere.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}

  /// Next 64 uniformly distributed bits.
  std::uint64_t next_u64() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

  /// Uniform double in [0, 1): the top 53 bits times 2^-53.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

  /// Uniform integer in [0, n), n >= 1, by reduction modulo n; its bias is below n / 2^64, far
  /// below anything a test could see.
  std::size_t below(std::size_t n) { return static_cast<std::size_t>(next_u64() % n); }

  /// Standard normal sample (Box-Muller; the second value of the pair is discarded).
  double normal() {
    const double u1 = 1.0 - uniform();  // in (0, 1], so log(u1) is finite
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * 3.14159265358979323846 * u2);
  }

  /// Gamma(shape, 1) sample, shape > 0: Marsaglia and Tsang (2000) for shape >= 1, and for
  /// shape < 1 the boost Gamma(a) = Gamma(a + 1) * U^(1/a).
  double gamma(double shape) {
    if (shape < 1.0) {
      const double u = 1.0 - uniform();
      return gamma(shape + 1.0) * std::pow(u, 1.0 / shape);
    }
    const double d = shape - 1.0 / 3.0;
    const double c = 1.0 / std::sqrt(9.0 * d);
    for (;;) {
      double x = 0.0;
      double v = 0.0;
      do {
        x = normal();
        v = 1.0 + c * x;
      } while (v <= 0.0);
      v = v * v * v;
      const double u = 1.0 - uniform();
      if (std::log(u) < 0.5 * x * x + d - d * v + d * std::log(v)) return d * v;
    }
  }

 private:
  std::uint64_t state_;
};

/// Derives an independent seed for sub-stream `stream` of `seed` (one SplitMix64 output of a
/// mixed state), so that "learner 3 of seed 7" and "learner 4 of seed 7" do not overlap.
inline std::uint64_t mix_seed(std::uint64_t seed, std::uint64_t stream) {
  Rng r(seed ^ (0xD1B54A32D192ED03ULL * (stream + 1)));
  return r.next_u64();
}

// ---- Character vocabulary ---------------------------------------------------------------------

/// The character vocabulary of the fortunes corpus, 97 symbols:
///   id 0        '\n'
///   id 1 .. 95  the printable ASCII characters ' ' (32) .. '~' (126), in order
///   id 96       "unknown": every other byte (UTF-8 sequences, backspaces used for
///               overstriking, bells, ...); it decodes to ASCII SUB (0x1A), the control
///               character meant for "substitute".
/// A tab is read as a space (fortunes indent attributions with tabs; one symbol for white
/// space keeps the vocabulary small). So decode(encode(s)) == s for text made of printable
/// ASCII and newlines, and encode(decode(ids)) == ids for every id sequence.
struct CharVocab {
  static constexpr std::size_t kSize = 97;
  static constexpr Token kNewline = 0;
  static constexpr Token kUnknown = 96;
  static constexpr char kUnknownChar = '\x1a';

  static constexpr Token encode(char c) {
    const auto u = static_cast<unsigned char>(c);
    if (u == '\n') return kNewline;
    if (u == '\t') return 1;  // the id of ' '
    if (u >= 32 && u <= 126) return static_cast<Token>(u - 31);
    return kUnknown;
  }

  static constexpr char decode(Token t) {
    if (t == kNewline) return '\n';
    if (t >= 1 && t <= 95) return static_cast<char>(t + 31);
    return kUnknownChar;
  }

  static TokenStream encode(std::string_view text) {
    TokenStream out;
    out.reserve(text.size());
    for (char c : text) out.push_back(encode(c));
    return out;
  }

  static std::string decode(std::span<const Token> ids) {
    std::string out;
    out.reserve(ids.size());
    for (Token t : ids) out.push_back(decode(t));
    return out;
  }
};

// ---- Fortunes corpus --------------------------------------------------------------------------

/// Where Debian and Ubuntu's `fortunes` package puts its text files.
inline std::filesystem::path default_fortune_dir() { return "/usr/share/games/fortunes"; }

/// Splits the text of one fortune file into its fortunes: they are separated by lines that
/// contain only "%". Each fortune keeps its own trailing newline; empty fortunes are dropped.
inline std::vector<std::string> split_fortunes(std::string_view file_text) {
  std::vector<std::string> out;
  std::string current;
  std::size_t pos = 0;
  while (pos < file_text.size()) {
    std::size_t end = file_text.find('\n', pos);
    const bool has_newline = end != std::string_view::npos;
    if (!has_newline) end = file_text.size();
    std::string_view line = file_text.substr(pos, end - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line == "%") {
      if (!current.empty()) out.push_back(std::move(current));
      current.clear();
    } else {
      current.append(line);
      if (has_newline) current.push_back('\n');
    }
    pos = has_newline ? end + 1 : end;
  }
  if (!current.empty()) out.push_back(std::move(current));
  return out;
}

/// FNV-1a, 64 bit (Fowler, Noll, Vo): the hash that decides the split. Hashing the fortune's
/// text (not its index) puts a fortune that appears in two files on the same side of the split.
inline std::uint64_t fnv1a64(std::string_view text) {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  for (char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001B3ULL;
  }
  return h;
}

/// True if this fortune belongs to the validation split: (FNV-1a(text), mixed) mod 100 is below
/// `validation_percent`.
inline bool is_validation_fortune(std::string_view fortune, unsigned validation_percent) {
  return mix_seed(fnv1a64(fortune), 0) % 100 < validation_percent;
}

/// How `load_fortunes` reads the corpus.
struct FortuneOptions {
  std::filesystem::path dir = default_fortune_dir();
  /// Percentage of fortunes (by text hash) that go to validation; in [1, 99].
  unsigned validation_percent = 10;
};

/// The fortunes corpus, split by fortune. `train` and `validation` are the token streams: the
/// fortunes of the split concatenated in file order, each followed by the separator line "%\n",
/// so a stream reads like a fortune file and the model learns where a fortune ends.
struct FortuneCorpus {
  std::vector<std::string> files;  ///< file names read, sorted
  std::vector<std::string> train_fortunes;
  std::vector<std::string> validation_fortunes;
  TokenStream train;
  TokenStream validation;
};

/// Reads every plain text file of the fortunes directory (not the `.dat` index files and not the
/// `.u8` links; sorted by name, so the result is deterministic) and splits it.
/// Throws InvalidArgument if the directory is missing or holds no fortune.
inline FortuneCorpus load_fortunes(const FortuneOptions& options = {}) {
  namespace fs = std::filesystem;
  if (options.validation_percent < 1 || options.validation_percent > 99) {
    throw InvalidArgument(detail::msg("load_fortunes: validation_percent = ", options.validation_percent,
                                      " must be in [1, 99] so that both splits are non-empty"));
  }
  std::error_code ec;
  if (!fs::is_directory(options.dir, ec)) {
    throw InvalidArgument(detail::msg("load_fortunes: the fortunes directory ", options.dir.string(),
                                      " does not exist; install the fortunes package "
                                      "(`apt-get install fortunes`) or pass FortuneOptions::dir"));
  }
  FortuneCorpus corpus;
  std::vector<fs::path> paths;
  for (const auto& entry : fs::directory_iterator(options.dir)) {
    const auto ext = entry.path().extension();
    if (ext == ".dat" || ext == ".u8") continue;
    if (!entry.is_regular_file()) continue;  // follows symlinks; skips sub-directories such as off/
    paths.push_back(entry.path());
  }
  std::sort(paths.begin(), paths.end());
  const TokenStream separator = CharVocab::encode("%\n");
  for (const auto& path : paths) {
    std::ifstream in(path, std::ios::binary);
    if (!in) continue;
    std::ostringstream text;
    text << in.rdbuf();
    corpus.files.push_back(path.filename().string());
    for (auto& fortune : split_fortunes(text.str())) {
      const bool val = is_validation_fortune(fortune, options.validation_percent);
      TokenStream& stream = val ? corpus.validation : corpus.train;
      const TokenStream ids = CharVocab::encode(fortune);
      stream.insert(stream.end(), ids.begin(), ids.end());
      stream.insert(stream.end(), separator.begin(), separator.end());
      (val ? corpus.validation_fortunes : corpus.train_fortunes).push_back(std::move(fortune));
    }
  }
  if (corpus.train_fortunes.empty() || corpus.validation_fortunes.empty()) {
    throw InvalidArgument(detail::msg("load_fortunes: found no fortunes in ", options.dir.string(),
                                      " (", paths.size(), " files); reinstall the fortunes package "
                                      "(`apt-get install fortunes`) or pass FortuneOptions::dir"));
  }
  return corpus;
}

// ---- Markov chain task ------------------------------------------------------------------------

/// A stationary Markov chain of order k over V symbols: the next symbol depends only on the last
/// k symbols. Its entropy rate is the best loss any model with a context of at least k can reach,
/// so "training reaches within x% of the entropy rate" is a test with an exact target.
///
/// States are the V^k histories, indexed as base-V numbers with the oldest symbol most
/// significant: s = x_{t-k} V^{k-1} + ... + x_{t-1}. After emitting symbol a the state becomes
/// (s V + a) mod V^k. Row s of the transition table holds P(a | s), a = 0..V-1.
class MarkovChain {
 public:
  /// `transition` is row-major, V^order rows of V probabilities each; every row must sum to 1.
  MarkovChain(std::size_t vocab, std::size_t order, std::vector<double> transition)
      : vocab_(vocab), order_(order), transition_(std::move(transition)) {
    if (vocab < 2 || vocab > std::numeric_limits<Token>::max()) {
      throw InvalidArgument(detail::msg("MarkovChain: vocab = ", vocab, " must be in [2, 65535]"));
    }
    if (order < 1) throw InvalidArgument("MarkovChain: order = 0; use order >= 1");
    states_ = 1;
    for (std::size_t i = 0; i < order; ++i) {
      if (states_ > (std::size_t{1} << 24) / vocab) {
        throw InvalidArgument(detail::msg("MarkovChain: vocab^order = ", vocab, "^", order,
                                          " states is too many; keep it below 2^24"));
      }
      states_ *= vocab;
    }
    if (transition_.size() != states_ * vocab_) {
      throw ShapeMismatch(detail::msg("MarkovChain: transition has ", transition_.size(),
                                      " entries, expected vocab^order * vocab = ", states_ * vocab_));
    }
    cumulative_.resize(transition_.size());
    for (std::size_t s = 0; s < states_; ++s) {
      double sum = 0.0;
      for (std::size_t a = 0; a < vocab_; ++a) {
        const double p = transition_[s * vocab_ + a];
        if (!(p >= 0.0)) {
          throw InvalidArgument(detail::msg("MarkovChain: P(", a, " | state ", s, ") = ", p,
                                            " is not a probability"));
        }
        sum += p;
        cumulative_[s * vocab_ + a] = sum;
      }
      if (std::abs(sum - 1.0) > 1e-9) {
        throw InvalidArgument(detail::msg("MarkovChain: row ", s, " sums to ", sum, "; normalise it to 1"));
      }
    }
  }

  /// A random chain: each row is a Dirichlet(concentration, ..., concentration) sample. A small
  /// concentration gives peaked rows, so the entropy rate is well below log V (for V = 32,
  /// concentration 0.1, E[row entropy] = psi(V c + 1) - psi(c + 1), about 1.7 nats, vs log 32 =
  /// 3.47). All entries are positive, so the chain is irreducible and aperiodic.
  static MarkovChain random(std::size_t vocab, std::size_t order, std::uint64_t seed,
                            double concentration = 0.1) {
    if (!(concentration > 0.0)) {
      throw InvalidArgument(detail::msg("MarkovChain::random: concentration = ", concentration, " must be > 0"));
    }
    std::size_t states = 1;
    for (std::size_t i = 0; i < order; ++i) states *= vocab;
    Rng rng(mix_seed(seed, 0x4D41524BULL));
    std::vector<double> t(states * vocab);
    for (std::size_t s = 0; s < states; ++s) {
      double sum = 0.0;
      for (std::size_t a = 0; a < vocab; ++a) {
        // Floor at the smallest normal double so no entry is exactly 0 (irreducibility).
        t[s * vocab + a] = std::max(rng.gamma(concentration), std::numeric_limits<double>::min());
        sum += t[s * vocab + a];
      }
      for (std::size_t a = 0; a < vocab; ++a) t[s * vocab + a] /= sum;
    }
    return MarkovChain(vocab, order, std::move(t));
  }

  [[nodiscard]] std::size_t vocab() const { return vocab_; }
  [[nodiscard]] std::size_t order() const { return order_; }
  [[nodiscard]] std::size_t states() const { return states_; }
  [[nodiscard]] double probability(std::size_t state, std::size_t next) const {
    return transition_[state * vocab_ + next];
  }

  /// The stationary distribution pi (pi = pi P) over the V^k states, by power iteration on the
  /// lazy chain (I + P) / 2, which has the same pi and converges also for periodic chains.
  /// Stops when the L1 change is below `tolerance`.
  [[nodiscard]] std::vector<double> stationary_distribution(double tolerance = 1e-14,
                                                            std::size_t max_iterations = 1000000) const {
    std::vector<double> pi(states_, 1.0 / static_cast<double>(states_));
    std::vector<double> next(states_);
    for (std::size_t it = 0; it < max_iterations; ++it) {
      std::fill(next.begin(), next.end(), 0.0);
      for (std::size_t s = 0; s < states_; ++s) {
        const double w = pi[s];
        const std::size_t base = (s * vocab_) % states_;
        for (std::size_t a = 0; a < vocab_; ++a) next[base + a] += w * transition_[s * vocab_ + a];
      }
      double change = 0.0;
      for (std::size_t s = 0; s < states_; ++s) {
        const double lazy = 0.5 * (pi[s] + next[s]);
        change += std::abs(lazy - pi[s]);
        pi[s] = lazy;
      }
      if (change < tolerance) break;
    }
    return pi;
  }

  /// Entropy rate in nats: H = -sum_s pi_s sum_a P(a|s) log P(a|s) (Cover and Thomas,
  /// Theorem 4.2.4, applied to the chain of k-histories).
  [[nodiscard]] double entropy_rate() const {
    const auto pi = stationary_distribution();
    double h = 0.0;
    for (std::size_t s = 0; s < states_; ++s) {
      double row = 0.0;
      for (std::size_t a = 0; a < vocab_; ++a) {
        const double p = transition_[s * vocab_ + a];
        if (p > 0.0) row -= p * std::log(p);
      }
      h += pi[s] * row;
    }
    return h;
  }

  /// n symbols of the chain, started in its stationary distribution (so every position has the
  /// same law and the mean loss estimates the entropy rate without a burn-in bias).
  [[nodiscard]] TokenStream sample(std::size_t n, std::uint64_t seed) const {
    Rng rng(seed);
    const auto pi = stationary_distribution();
    std::size_t state = pick(pi, rng.uniform());
    TokenStream out;
    out.reserve(n + order_);
    // Emit the digits of the initial state (oldest first), then run the chain.
    std::vector<Token> digits(order_);
    std::size_t s = state;
    for (std::size_t i = order_; i-- > 0;) {
      digits[i] = static_cast<Token>(s % vocab_);
      s /= vocab_;
    }
    out.insert(out.end(), digits.begin(), digits.end());
    while (out.size() < n) {
      const double u = rng.uniform();
      const auto first = cumulative_.begin() + static_cast<std::ptrdiff_t>(state * vocab_);
      auto it = std::upper_bound(first, first + static_cast<std::ptrdiff_t>(vocab_), u);
      std::size_t a = static_cast<std::size_t>(it - first);
      if (a >= vocab_) a = vocab_ - 1;  // u above a row sum rounded below 1
      out.push_back(static_cast<Token>(a));
      state = (state * vocab_ + a) % states_;
    }
    out.resize(n);
    return out;
  }

  /// The true conditional log-loss -log P(stream[i] | stream[i-k .. i-1]) averaged over
  /// `positions` (each >= order): what a perfect model would score on exactly those examples.
  [[nodiscard]] double mean_log_loss(std::span<const Token> stream, std::span<const std::size_t> positions) const {
    if (positions.empty()) return 0.0;
    double total = 0.0;
    for (std::size_t i : positions) {
      if (i < order_ || i >= stream.size()) {
        throw InvalidArgument(detail::msg("MarkovChain::mean_log_loss: position ", i, " needs ", order_,
                                          " symbols of history inside a stream of ", stream.size()));
      }
      std::size_t state = 0;
      for (std::size_t j = i - order_; j < i; ++j) state = state * vocab_ + stream[j];
      total -= std::log(transition_[state * vocab_ + stream[i]]);
    }
    return total / static_cast<double>(positions.size());
  }

 private:
  static std::size_t pick(const std::vector<double>& p, double u) {
    double acc = 0.0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      acc += p[i];
      if (u < acc) return i;
    }
    return p.size() - 1;
  }

  std::size_t vocab_;
  std::size_t order_;
  std::size_t states_ = 1;
  std::vector<double> transition_;
  std::vector<double> cumulative_;
};

// ---- Batches and shards -----------------------------------------------------------------------

/// `size` examples, each a context window of `context` tokens and the token that follows it.
/// contexts[b * context + c] is token c (oldest first) of example b; targets[b] is what follows.
struct Batch {
  std::size_t size = 0;
  std::size_t context = 0;
  std::vector<Token> contexts;
  std::vector<Token> targets;
};

/// Learner `index` of `count`. `block` = 0: the shards are contiguous ranges of the stream (a
/// learner sees only the documents of its range: for a corpus concatenated by topic, its own
/// topics). `block` > 0: the stream is cut into blocks of `block` target positions and block j
/// belongs to learner j mod count, so every shard is drawn from the whole corpus (disjoint, the
/// same distribution: the usual data-parallel split).
struct Shard {
  std::size_t index = 0;
  std::size_t count = 1;
  std::size_t block = 0;
};

/// Fills `out` with the examples whose targets are at `positions` (each >= context).
inline void fill_batch(std::span<const Token> stream, std::span<const std::size_t> positions,
                       std::size_t context, Batch& out) {
  out.size = positions.size();
  out.context = context;
  out.contexts.resize(positions.size() * context);
  out.targets.resize(positions.size());
  for (std::size_t b = 0; b < positions.size(); ++b) {
    const std::size_t i = positions[b];
    if (i < context || i >= stream.size()) {
      throw InvalidArgument(detail::msg("fill_batch: position ", i, " needs ", context,
                                        " tokens of context inside a stream of ", stream.size()));
    }
    std::copy(stream.begin() + static_cast<std::ptrdiff_t>(i - context),
              stream.begin() + static_cast<std::ptrdiff_t>(i),
              out.contexts.begin() + static_cast<std::ptrdiff_t>(b * context));
    out.targets[b] = stream[i];
  }
}

/// At most `max_examples` target positions spread evenly over [context, stream_size): the fixed,
/// deterministic evaluation set of a stream (positions context + j * stride).
inline std::vector<std::size_t> evaluation_positions(std::size_t stream_size, std::size_t context,
                                                     std::size_t max_examples) {
  std::vector<std::size_t> out;
  if (stream_size <= context || max_examples == 0) return out;
  const std::size_t available = stream_size - context;
  const std::size_t n = std::min(available, max_examples);
  out.reserve(n);
  for (std::size_t j = 0; j < n; ++j) {
    // floor(j * available / n) in exact integer arithmetic, without overflow.
    const std::size_t q = available / n;
    const std::size_t r = available % n;
    out.push_back(context + j * q + (j * r) / n);
  }
  return out;
}

/// Random batches from one shard of a token stream.
///
/// Sharding: the target positions [context, n) are cut into `shard.count` contiguous, equal,
/// disjoint ranges; learner m only ever predicts targets of range m (its context window may reach
/// back into the previous range). With `shard.block` > 0 they are cut into blocks of that many
/// positions instead, dealt round-robin (block j to learner j mod count; the last incomplete
/// round of blocks is left out). Positions are drawn uniformly with replacement from the shard,
/// by an Rng seeded with mix_seed(seed, shard.index), so the batches are a deterministic function
/// of (stream, context, batch size, seed, shard).
///
/// A view: the stream must outlive the sampler (several samplers may share one stream).
class BatchSampler {
 public:
  BatchSampler(std::span<const Token> stream, std::size_t context, std::size_t batch_size,
               std::uint64_t seed, Shard shard = {})
      : stream_(stream), context_(context), batch_size_(batch_size), rng_(mix_seed(seed, shard.index)) {
    if (context == 0) throw InvalidArgument("BatchSampler: context = 0; use a context window of at least 1");
    if (batch_size == 0) throw InvalidArgument("BatchSampler: batch_size = 0; use at least 1");
    if (shard.count == 0 || shard.index >= shard.count) {
      throw InvalidArgument(detail::msg("BatchSampler: shard ", shard.index, " of ", shard.count,
                                        " is not a shard; use 0 <= index < count"));
    }
    const std::size_t available = stream.size() > context ? stream.size() - context : 0;
    const std::size_t unit = shard.block == 0 ? 1 : shard.block;  // positions per dealt unit
    const std::size_t per_shard = shard.block == 0 ? available / shard.count
                                                   : available / unit / shard.count * unit;
    if (per_shard == 0) {
      const std::string blocks = shard.block == 0 ? std::string() : detail::msg(" of blocks of ", shard.block);
      throw InvalidArgument(detail::msg("BatchSampler: a stream of ", stream.size(), " tokens with context ",
                                        context, " has no examples for ", shard.count, " shards", blocks,
                                        "; use more data, fewer shards or smaller blocks"));
    }
    shard_ = shard;
    span_ = per_shard;
    if (shard.block == 0) {
      begin_ = context + shard.index * per_shard;
      end_ = begin_ + per_shard;
    } else {
      begin_ = position(0);
      end_ = position(per_shard - 1) + 1;
    }
  }

  /// First and one-past-last target position of this shard (with blocks, the shard's positions
  /// lie in this range but are not all of it: owns()).
  [[nodiscard]] std::size_t begin_position() const { return begin_; }
  [[nodiscard]] std::size_t end_position() const { return end_; }
  /// True if target position `i` belongs to this shard.
  [[nodiscard]] bool owns(std::size_t i) const {
    if (i < begin_ || i >= end_) return false;
    if (shard_.block == 0) return true;
    return ((i - context_) / shard_.block) % shard_.count == shard_.index;
  }
  [[nodiscard]] std::size_t batch_size() const { return batch_size_; }
  [[nodiscard]] std::size_t context() const { return context_; }

  /// Draws the next batch into `out` (reusing its storage).
  void next(Batch& out) {
    positions_.resize(batch_size_);
    for (auto& p : positions_) p = position(rng_.below(span_));
    fill_batch(stream_, positions_, context_, out);
  }

  Batch next() {
    Batch b;
    next(b);
    return b;
  }

 private:
  std::span<const Token> stream_;
  std::size_t context_;
  std::size_t batch_size_;
  Rng rng_;
  Shard shard_{};
  std::size_t span_ = 0;  ///< positions in the shard
  std::size_t begin_ = 0;
  std::size_t end_ = 0;
  std::vector<std::size_t> positions_;

  /// The shard's u-th target position, u < span_.
  [[nodiscard]] std::size_t position(std::size_t u) const {
    if (shard_.block == 0) return begin_ + u;
    const std::size_t b = shard_.block;
    return context_ + ((u / b) * shard_.count + shard_.index) * b + u % b;
  }
};

}  // namespace ddiloco::reference
