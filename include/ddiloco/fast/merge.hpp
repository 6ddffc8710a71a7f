// ddiloco/fast/merge.hpp: token-weighted Radial-Directional Averaging at memory
// bandwidth, with the decode of the wire codec and the Nesterov step fused in.
//
// What it is: `fast::RadialDirectional`, a MergeRule computing exactly what
// ddiloco::RadialDirectional (<ddiloco/merge.hpp>, the readable specification)
// computes, plus
//   - add_encoded(codec, bytes, w): decodes the payload chunk by chunk into an
//     L1-resident buffer inside the merge loops (no fp32 copy of the payload);
//   - finish_step(opt, share, theta, state): finish, participation scaling and
//     the NesterovSGD step in one pass;
//   - an optional split of every pass across a few threads (`Workers`), each
//     thread owning a contiguous range and its own partial norms.
// What it is not: a new merge rule, nor a syncer. Results equal the reference up
// to the summation order of the norms (tests/test_fast_merge.cpp states the
// tolerances).
//
// # Passes over memory per contribution (docs/algorithm.md, "Fast kernels")
// RDA needs ||v_t|| of each tensor t before phi(v_t) = v_t / ||v_t|| can be
// folded into the running mean, so each contribution is read twice:
//   pass 1  ||v_t||^2 (int8/int4: from the integer codes, s_b^2 sum_j q_j^2
//           per block, no float decode);
//   pass 2  mean += f (s_t v - mean), summing ||mean_t||^2 of the new mean on
//           the way, so finish() needs no norm pass of its own.
// An int8/int4 payload's pass 1 runs first over the whole fragment, in one
// scan of the codes that also validates them (checked_encoded_squared_norm: no
// float conversion, 0.56 bytes per element for int4), so a corrupt payload
// throws before the mean is touched. Pass 2 decodes a chunk of codes into L1
// while the chunk's mean is prefetched (decoding is compute only: without the
// prefetch the memory idles meanwhile). Tensors are processed in groups of
// whole tensors of about kGroup elements (fp32/fp16/bf16: both passes over one
// group before the next; int8/int4: pass 2), so when a group fits in the cache
// pass 2 re-reads the contribution from cache, not memory. The accumulator holds
// one float per element plus three doubles per tensor, whatever M is.
//
// # Batched: add_batch, one pass over the mean for B contributions
// The streaming add reads and writes the fp32 mean once per contribution
// (8 bytes per element each time). When B contributions of the fragment are in
// memory at once (learners in phase, a drained queue), add_batch folds them in
// one pass. Per tensor, with W the total weight before the batch, w_b the
// weights, s_b = 1 / ||v_b|| (0 when v_b = 0; 1 for embeddings) and
// W' = W + sum_b w_b, the streaming recurrence (docs/algorithm.md,
// "Radial-Directional Averaging": mean_k = mean_{k-1} + (w_k / W_k)(s_k v_k - mean_{k-1}), i.e.
// W_k mean_k = W_{k-1} mean_{k-1} + w_k s_k v_k) unrolled over the batch is
//     W' mean' = W mean + sum_b w_b s_b v_b
//     mean'    = (W / W') mean + sum_b (w_b s_b / W') v_b,
// the same weighted mean of directions, only summed in a different order; and
// sum_m w_m ||v_m|| gains sum_b w_b ||v_b||. For each group of whole tensors:
//   pass 1  ||v_{b,t}||^2 of every contribution (int8/int4: from the codes, for
//           the whole fragment up front, in the same scan that validates them);
//   pass 2  chunk by chunk (kBatchChunk elements, L1): acc = (W / W') mean,
//           acc += (w_b s_b / W') v_b for each b (decoded into an L1 buffer),
//           mean = acc, summing ||mean_t||^2 on the way.
// Bytes per element for a batch: the contributions twice (pass 2 re-reads them
// from cache when B contributions of a group fit in L2, else from memory) and
// the mean once each way: fp32 ~ 4B (+ 4B) + 8, int4 ~ 0.56B (+ 0.56B) + 8,
// against 4B + 8B for B streaming adds. Batches larger than kMaxBatch are
// folded kMaxBatch at a time (the hardware prefetchers track a bounded number
// of streams). No buffer per contribution: the contributions are the caller's.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include <ddiloco/codec.hpp>
#include <ddiloco/detail/thread_pool.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/fast/kernels.hpp>
#include <ddiloco/layout.hpp>
#include <ddiloco/merge.hpp>
#include <ddiloco/outer_optimizer.hpp>

namespace ddiloco::fast {

/// Fork-join over `size()` parts: run(f) calls f(0) .. f(size() - 1), part 0 on
/// the calling thread and the others on size() - 1 pooled threads, and returns
/// when all have finished. f must not throw (pool threads swallow exceptions).
class Workers {
 public:
  /// Throws InvalidArgument unless threads >= 1.
  explicit Workers(std::size_t threads = 1) : threads_(threads) {
    if (threads == 0) {
      throw InvalidArgument("fast::Workers: threads = 0; use 1 to run on the calling thread only");
    }
    if (threads > 1) pool_ = std::make_unique<ddiloco::detail::ThreadPool>(threads - 1);
  }

  [[nodiscard]] std::size_t size() const noexcept { return threads_; }

  template <class F>
  void run(const F& f) {
    for (std::size_t p = 1; p < threads_; ++p) pool_->submit([&f, p] { f(p); });
    f(std::size_t{0});
    if (pool_) pool_->wait_idle();
  }

 private:
  std::size_t threads_;
  std::unique_ptr<ddiloco::detail::ThreadPool> pool_;
};

/// One contribution of a batch for RadialDirectional::Accumulator::add_batch:
/// fp32 floats in `values` (when `bytes` is empty, codec must be fp32), or a
/// payload in its wire encoding (<ddiloco/codec.hpp>) in `bytes`. Not owned:
/// the spans must stay valid for the add_batch call.
struct Contribution {
  Codec codec = Codec::fp32;
  std::span<const float> values;     // used when bytes is empty
  std::span<const std::byte> bytes;  // encoded payload
  double weight = 0.0;
  /// Optional: ||v_t||^2 of every tensor of the layout, when the caller already
  /// computed them while validating the payload (the syncer does). add_batch
  /// then skips its norm pass for this element and trusts the payload as
  /// checked (an int8/int4 payload is not scanned again).
  std::span<const double> tensor_sq;
  /// The contribution enters the merge as `scale` x v (finite, > 0; 1: as sent),
  /// with no pass of its own: under RDA phi(c v) = phi(v), so only its radial
  /// part changes (w c ||v_t|| instead of w ||v_t|| per tensor) and an
  /// embedding tensor's share of the average is scaled by c. The syncer clips
  /// an outsized contribution's norm this way (SyncerConfig::clip_factor).
  double scale = 1.0;
};

/// Drop-in for ddiloco::RadialDirectional (same MergeRule, same maths, same edge
/// cases), built from the fused kernels of <ddiloco/fast/kernels.hpp>. `workers`
/// (optional, not owned, must outlive the accumulators) splits every pass.
struct RadialDirectional {
  static constexpr std::string_view name = "radial_directional";
  static constexpr double cancellation_threshold = ddiloco::RadialDirectional::cancellation_threshold;
  /// Target elements per tensor group (1 MiB of fp32 per contribution).
  static constexpr std::size_t kGroup = std::size_t{1} << 18;
  /// add_batch: contributions folded per pass over the mean.
  static constexpr std::size_t kMaxBatch = 16;
  /// add_batch: elements per pass-2 chunk (16 KiB of fp32 accumulator + 16 KiB of
  /// decoded payload, L1; 2048 measured the same for fp32 and ~8% slower for int4).
  static constexpr std::size_t kBatchChunk = 4096;
  static_assert(kBatchChunk % kQuantBlock == 0 && kBatchChunk <= kChunk);

  Workers* workers = nullptr;

  class Accumulator : public ddiloco::detail::AccumulatorBookkeeping {
   public:
    explicit Accumulator(std::span<const TensorSegment> layout, Workers* workers = nullptr)
        : AccumulatorBookkeeping(name, layout),
          workers_(workers),
          parts_(workers ? workers->size() : 1),
          mean_(size_, 0.0f),
          weighted_norm_sum_(layout_.size(), 0.0),
          mean_sq_(layout_.size(), 0.0),
          scale_(layout_.size(), 0.0f),
          partial_(parts_ * layout_.size(), 0.0),
          buffers_(parts_ * kChunk, 0.0f),
          batch_acc_(parts_ * kBatchChunk, 0.0f),
          coded_sq_(layout_.size(), 0.0) {
      // Groups of whole tensors, each closed once it reaches kGroup elements.
      std::size_t start = 0, first = 0, count = 0;
      for (std::size_t t = 0; t < layout_.size(); ++t) {
        count += layout_[t].size;
        if (count >= kGroup || t + 1 == layout_.size()) {
          groups_.push_back({start, start + count, first, t + 1});
          start += count;
          first = t + 1;
          count = 0;
        }
      }
    }

    /// MergeRule requirement 3, on a decoded fp32 contribution.
    void add(std::span<const float> v, double weight) {
      if (!check_add(v, weight)) return;
      add_impl(FloatSource{v.data()}, weight);
    }

    /// Adds a contribution still in its wire encoding (<ddiloco/codec.hpp>),
    /// decoding it inside the merge passes. Throws ShapeMismatch unless
    /// bytes.size() == encoded_size(codec, size()), InvalidArgument for a bad
    /// weight (as add), and ProtocolError, leaving the accumulator unchanged,
    /// when the bytes are not a valid encoding. A weight of 0 is ignored
    /// without reading the bytes, as in add().
    void add_encoded(Codec codec, std::span<const std::byte> bytes, double weight) {
      const std::size_t need = encoded_size(codec, size_);
      if (bytes.size() != need) {
        throw ShapeMismatch(ddiloco::detail::msg(name, "::add_encoded(", to_string(codec), "): ", bytes.size(),
                                                 " bytes but a fragment of ", size_, " elements needs ", need,
                                                 "; pass the whole fragment's payload"));
      }
      if (!(std::isfinite(weight) && weight >= 0.0)) {
        throw InvalidArgument(ddiloco::detail::msg(name, "::add_encoded: weight = ", weight,
                                                   " must be finite and >= 0 (use 0 for an absent learner)"));
      }
      if (weight == 0.0) return;
      // int8/int4: one scan of the codes validates the payload and gives every
      // tensor's ||v_t||^2 (pass 1 done up front, before the mean is touched).
      const bool coded = codec == Codec::int8 || codec == Codec::int4;
      if (coded) std::fill(coded_sq_.begin(), coded_sq_.end(), 0.0);
      const bool valid = coded ? coded_norms(codec, bytes.data(), coded_sq_.data())
                               : fast::valid_encoding(codec, bytes.data(), size_);
      if (!valid) {
        throw ProtocolError(ddiloco::detail::msg(name, "::add_encoded(", to_string(codec), "): ", size_,
                                                 " elements hold a negative/non-finite scale, a code outside "
                                                 "[-Q, Q] or a nonzero padding nibble; the payload is corrupt, "
                                                 "drop it (the accumulator is unchanged)"));
      }
      add_impl(EncodedSource{codec, bytes.data()}, weight, coded ? coded_sq_.data() : nullptr);
    }

    /// Adds every contribution of `batch` in one pass over the mean per group
    /// of kMaxBatch (see "Batched" at the top of this file). The result equals
    /// add / add_encoded of each element in order, up to float summation order.
    /// Every element is checked first, as add (values) / add_encoded (bytes)
    /// check it; if any throws (ShapeMismatch, InvalidArgument, ProtocolError)
    /// the accumulator is unchanged. Weight-0 elements are skipped unread.
    void add_batch(std::span<const Contribution> batch) {
      std::vector<Item> items;
      items.reserve(batch.size());
      for (std::size_t k = 0; k < batch.size(); ++k) {
        const Contribution& c = batch[k];
        const bool floats = c.bytes.empty() && c.codec == Codec::fp32;
        if (floats) {
          if (c.values.size() != size_) {
            throw ShapeMismatch(ddiloco::detail::msg(name, "::add_batch: element ", k, " has ", c.values.size(),
                                                     " values but the fragment layout has ", size_,
                                                     " elements; pass the whole fragment's flat buffer"));
          }
        } else {
          const std::size_t need = encoded_size(c.codec, size_);
          if (c.bytes.size() != need) {
            throw ShapeMismatch(ddiloco::detail::msg(name, "::add_batch: element ", k, " (", to_string(c.codec),
                                                     ") has ", c.bytes.size(), " bytes but a fragment of ", size_,
                                                     " elements needs ", need, "; pass the whole fragment's payload"));
          }
        }
        if (!(std::isfinite(c.weight) && c.weight >= 0.0)) {
          throw InvalidArgument(ddiloco::detail::msg(name, "::add_batch: element ", k, " has weight = ", c.weight,
                                                     "; it must be finite and >= 0 (use 0 for an absent learner)"));
        }
        if (!c.tensor_sq.empty() && c.tensor_sq.size() != layout_.size()) {
          throw ShapeMismatch(ddiloco::detail::msg(name, "::add_batch: element ", k, " has ", c.tensor_sq.size(),
                                                   " tensor norms but the layout has ", layout_.size(),
                                                   " tensors; pass one squared norm per tensor, or none"));
        }
        if (!(std::isfinite(c.scale) && c.scale > 0.0)) {
          throw InvalidArgument(ddiloco::detail::msg(name, "::add_batch: element ", k, " has scale = ", c.scale,
                                                     "; it must be finite and > 0 (1: the contribution as sent)"));
        }
        if (c.weight == 0.0) continue;
        // fp32 bytes (a received frame) are read as floats where they lie, when aligned.
        const float* values = floats ? c.values.data() : fp32_in_place(c.codec, c.bytes.data());
        items.push_back({values, values ? nullptr : c.bytes.data(), c.codec, c.weight,
                         c.tensor_sq.empty() ? nullptr : c.tensor_sq.data(), k, c.scale});
      }
      if (items.empty()) return;
      const std::size_t nt = layout_.size();
      // int8/int4: one scan of the codes both validates the payload and gives
      // every tensor's ||v_t||^2 (pass 1 done up front, before anything changes).
      std::vector<std::size_t> coded;
      for (std::size_t b = 0; b < items.size(); ++b) {
        if (!items[b].values && !items[b].sq && (items[b].codec == Codec::int8 || items[b].codec == Codec::int4))
          coded.push_back(b);
      }
      std::vector<double> coded_sq(coded.size() * nt, 0.0);
      for (std::size_t i = 0; i < coded.size(); ++i) {
        Item& it = items[coded[i]];
        if (!coded_norms(it.codec, it.bytes, coded_sq.data() + i * nt)) {
          throw ProtocolError(ddiloco::detail::msg(
              name, "::add_batch: element ", it.index, " (", to_string(it.codec), "): ", size_,
              " elements hold a negative/non-finite scale, a code outside [-Q, Q] or a nonzero padding "
              "nibble; the payload is corrupt, drop it (the accumulator is unchanged)"));
        }
        it.sq = coded_sq.data() + i * nt;
      }
      const std::size_t sub = std::min(items.size(), kMaxBatch);
      std::vector<float> alpha(sub * nt);            // per item and tensor: w_b s_b / W'
      std::vector<double> partial(parts_ * sub * nt);  // per part, item and tensor
      for (std::size_t first_item = 0; first_item < items.size(); first_item += kMaxBatch) {
        const std::size_t b_end = std::min(items.size(), first_item + kMaxBatch);
        add_sub_batch(std::span<const Item>(items.data() + first_item, b_end - first_item), alpha, partial);
      }
    }

    /// MergeRule requirement 5 (the reference's finish, without a norm pass).
    void finish(std::span<float> out) const {
      check_finish(out);
      compute_scales();
      for_each_part([&](std::size_t /*part*/, std::size_t lo, std::size_t hi) {
        for_each_piece(lo, hi, [&](std::size_t t, std::size_t a, std::size_t len) {
          fast::scale(scale_[t], mean_.data() + a, out.data() + a, len);
        });
      });
    }

    /// finish() into delta, delta *= share (the syncer's participation scaling),
    /// then opt.step(theta, delta, state), in one pass with no delta buffer.
    /// Throws as finish() and NesterovSGD::step would, and InvalidArgument
    /// unless 0 < share <= 1.
    void finish_step(const NesterovSGD& opt, float share, std::span<float> theta, std::span<float> state) {
      check_finish(theta);
      ddiloco::detail::check_step_shapes("fast::RadialDirectional::finish_step", theta.size(), size_,
                                         state.size(), opt.state_size(size_));
      if (!(share > 0.0f && share <= 1.0f)) {
        throw InvalidArgument(ddiloco::detail::msg(name, "::finish_step: share = ", share,
                                                   " must be in (0, 1] (contributors / alive learners)"));
      }
      compute_scales();
      const float mu = opt.momentum(), eta = opt.lr();
      for_each_part([&](std::size_t /*part*/, std::size_t lo, std::size_t hi) {
        for_each_piece(lo, hi, [&](std::size_t t, std::size_t a, std::size_t len) {
          fast::scaled_nesterov(scale_[t], share, mean_.data() + a, mu, eta, theta.data() + a,
                                state.data() + a, len);
        });
      });
    }

    void reset() noexcept {
      reset_bookkeeping();  // the first add overwrites mean_ and mean_sq_
      std::fill(weighted_norm_sum_.begin(), weighted_norm_sum_.end(), 0.0);
    }

    /// Bytes held (buffers only); constant after construction, independent of M.
    [[nodiscard]] std::size_t memory_bytes() const noexcept {
      return mean_.capacity() * sizeof(float) +
             (weighted_norm_sum_.capacity() + mean_sq_.capacity() + partial_.capacity() + coded_sq_.capacity()) *
                 sizeof(double) +
             (scale_.capacity() + buffers_.capacity() + batch_acc_.capacity()) * sizeof(float) +
             bookkeeping_bytes();
    }

   private:
    struct Group {
      std::size_t lo, hi;          // element range
      std::size_t first, last;     // tensor range [first, last)
    };
    struct FloatSource {
      const float* v;
      static constexpr bool chunked = false;
    };
    struct EncodedSource {
      Codec codec;
      const std::byte* bytes;
      static constexpr bool chunked = true;
    };

    /// Calls f(part, lo, hi) for each worker's share of [glo, ghi); interior
    /// boundaries are multiples of kQuantBlock so encoded blocks are never split.
    template <class F>
    void for_range(std::size_t glo, std::size_t ghi, const F& f) const {
      if (parts_ == 1) {
        f(std::size_t{0}, glo, ghi);
        return;
      }
      const std::size_t span_len = ghi - glo;
      auto bound = [&](std::size_t k) {
        if (k == 0) return glo;
        if (k == parts_) return ghi;
        const std::size_t b = (glo + span_len * k / parts_) / kQuantBlock * kQuantBlock;
        return std::clamp(b, glo, ghi);
      };
      workers_->run([&](std::size_t k) { f(k, bound(k), bound(k + 1)); });
    }
    template <class F>
    void for_each_part(const F& f) const {
      for_range(0, size_, f);
    }

    /// Calls f(t, a, len) for each maximal piece [a, a + len) of [lo, hi) inside tensor t.
    template <class F>
    void for_each_piece(std::size_t lo, std::size_t hi, const F& f) const {
      if (lo >= hi) return;
      // First tensor whose end is beyond lo.
      auto it = std::upper_bound(layout_.begin(), layout_.end(), lo,
                                 [](std::size_t x, const TensorSegment& s) { return x < s.offset + s.size; });
      for (auto t = static_cast<std::size_t>(it - layout_.begin()); t < layout_.size() && layout_[t].offset < hi; ++t) {
        const std::size_t a = std::max(lo, layout_[t].offset);
        const std::size_t b = std::min(hi, layout_[t].offset + layout_[t].size);
        if (b > a) f(t, a, b - a);
      }
    }

    /// Runs f(t, a, len, x) over [lo, hi) with x pointing at the contribution's
    /// elements a..a+len (decoded chunk by chunk for an encoded source).
    template <class Source, class F>
    void for_each_chunk(const Source& src, std::size_t part, std::size_t lo, std::size_t hi, const F& f) const {
      if constexpr (!Source::chunked) {
        for_each_piece(lo, hi, [&](std::size_t t, std::size_t a, std::size_t len) { f(t, a, len, src.v + a); });
      } else {
        float* buf = buffers_.data() + part * kChunk;
        const std::size_t end = std::min(size_, (hi + kQuantBlock - 1) / kQuantBlock * kQuantBlock);
        for (std::size_t c = lo / kQuantBlock * kQuantBlock; c < hi; c += kChunk) {
          const std::size_t len = std::min(kChunk, end - c);
#if defined(__GNUC__) || defined(__clang__)
          // Start loading the chunk's mean while the codes decode (compute
          // only): the update below then finds it in cache or on its way.
          for (std::size_t i = c; i < c + len; i += 64 / sizeof(float)) __builtin_prefetch(mean_.data() + i, 1, 3);
#endif
          decode_range(src.codec, src.bytes, size_, c, len, buf);  // validated by add_encoded
          for_each_piece(std::max(c, lo), std::min(c + len, hi), [&](std::size_t t, std::size_t a, std::size_t l) {
            f(t, a, l, buf + (a - c));
          });
        }
      }
    }

    /// One scan of an int8/int4 payload's codes: sq[t] = ||v_t||^2 of every
    /// tensor (split across the workers) and whether every block is valid (the
    /// checks of valid_encoding). sq has layout_.size() zeroed entries.
    bool coded_norms(Codec codec, const std::byte* bytes, double* sq) const {
      const std::size_t nt = layout_.size();
      std::vector<double> part_sq(parts_ * nt, 0.0);
      std::vector<char> part_ok(parts_, 1);
      for_each_part([&](std::size_t part, std::size_t lo, std::size_t hi) {
        double* psq = part_sq.data() + part * nt;
        bool ok = true;
        for_each_piece(lo, hi, [&](std::size_t t, std::size_t a, std::size_t len) {
          psq[t] += fast::checked_encoded_squared_norm(codec, bytes, size_, a, len, ok);
        });
        part_ok[part] = ok ? 1 : 0;
      });
      bool ok = true;
      for (std::size_t p = 0; p < parts_; ++p) {
        ok &= part_ok[p] != 0;
        for (std::size_t t = 0; t < nt; ++t) sq[t] += part_sq[p * nt + t];
      }
      return ok;
    }

    /// known_sq: per tensor ||v_t||^2 when computed up front (pass 1 skipped), else nullptr.
    template <class Source>
    void add_impl(const Source& src, double weight, const double* known_sq = nullptr) {
      const std::size_t nt = layout_.size();
      const bool first = count_ == 0;
      const float f = record(weight);
      for (const Group& g : groups_) {
        // Pass 1: partial ||v_t||^2 per part (unless known).
        std::fill(partial_.begin(), partial_.end(), 0.0);
        if (known_sq) {
          std::copy(known_sq + g.first, known_sq + g.last, partial_.data() + g.first);  // as part 0's
        } else {
          for_range(g.lo, g.hi, [&](std::size_t part, std::size_t lo, std::size_t hi) {
            double* sq = partial_.data() + part * nt;
            for_each_piece(lo, hi, [&](std::size_t t, std::size_t a, std::size_t len) {
              if (layout_[t].embedding) return;
              if constexpr (Source::chunked) {
                sq[t] += fast::encoded_squared_norm(src.codec, src.bytes, size_, a, len);
              } else {
                sq[t] += fast::squared_norm(src.v + a, len);
              }
            });
          });
        }
        for (std::size_t t = g.first; t < g.last; ++t) {
          float s = 1.0f;  // embedding: running mean of v itself
          if (!layout_[t].embedding) {
            double sq = 0.0;
            for (std::size_t p = 0; p < parts_; ++p) sq += partial_[p * nt + t];
            const double norm = std::sqrt(sq);
            weighted_norm_sum_[t] += weight * norm;                       // sum w ||v||
            s = norm >= FLT_MIN ? static_cast<float>(1.0 / norm) : 0.0f;  // phi(0) = 0
          }
          scale_[t] = s;
        }
        // Pass 2: mean += f (s v - mean), partial ||mean_t||^2 per part.
        std::fill(partial_.begin(), partial_.end(), 0.0);
        for_range(g.lo, g.hi, [&](std::size_t part, std::size_t lo, std::size_t hi) {
          double* sq = partial_.data() + part * nt;
          for_each_chunk(src, part, lo, hi, [&](std::size_t t, std::size_t a, std::size_t len, const float* x) {
            sq[t] += first ? fast::scale_copy_sq(scale_[t], x, mean_.data() + a, len)
                           : fast::running_mean_update_sq(f, scale_[t], x, mean_.data() + a, len);
          });
        });
        for (std::size_t t = g.first; t < g.last; ++t) {
          double sq = 0.0;
          for (std::size_t p = 0; p < parts_; ++p) sq += partial_[p * nt + t];
          mean_sq_[t] = sq;
        }
      }
    }

    struct Item {
      const float* values;     // fp32 floats, or nullptr
      const std::byte* bytes;  // encoded payload when values is nullptr
      Codec codec;
      double weight;
      const double* sq;   // per tensor ||v_t||^2 when computed up front, else nullptr
      std::size_t index;  // position in the caller's batch (for messages)
      double scale;       // Contribution::scale
    };

    /// Bytes per element of an item in memory.
    double item_bytes_per_element(const Item& it) const noexcept {
      if (it.values) return 4.0;
      return static_cast<double>(encoded_size(it.codec, size_)) / static_cast<double>(size_);
    }

    /// One pass over the mean for items (at most kMaxBatch, weights > 0, all
    /// validated). alpha and partial are scratch of sub * nt and parts * sub * nt.
    void add_sub_batch(std::span<const Item> items, std::vector<float>& alpha, std::vector<double>& partial) {
      const std::size_t nt = layout_.size();
      const bool first = count_ == 0;
      const double w_before = total_weight_;
      for (const Item& it : items) (void)record(it.weight);
      const double w_after = total_weight_;
      const auto keep = static_cast<float>(w_before / w_after);  // W / W'
      // Groups of whole tensors holding about 1 MiB of the items together, so
      // pass 2 finds them in L2 (a tensor larger than that is a group alone).
      double bytes_per_element = 0.0;
      for (const Item& it : items) bytes_per_element += item_bytes_per_element(it);
      const auto target = static_cast<std::size_t>(static_cast<double>(kGroup) * 4.0 / bytes_per_element);
      std::size_t glo = 0, gfirst = 0;
      for (std::size_t t = 0; t < nt; ++t) {
        const std::size_t ghi = layout_[t].offset + layout_[t].size;
        if (ghi - glo < target && t + 1 < nt) continue;
        fold_group({glo, ghi, gfirst, t + 1}, items, first, keep, w_after, alpha, partial);
        glo = ghi;
        gfirst = t + 1;
      }
    }

    void fold_group(const Group& g, std::span<const Item> items, bool first, float keep, double w_after,
                    std::vector<float>& alpha, std::vector<double>& partial) {
      const std::size_t nt = layout_.size(), nb = items.size();
      // Pass 1: partial ||v_{b,t}||^2 per part, item and tensor of the group.
      for (std::size_t p = 0; p < parts_; ++p) {
        for (std::size_t b = 0; b < nb; ++b) {
          std::fill_n(partial.data() + (p * nb + b) * nt + g.first, g.last - g.first, 0.0);
        }
      }
      for_range(g.lo, g.hi, [&](std::size_t part, std::size_t lo, std::size_t hi) {
        for (std::size_t b = 0; b < nb; ++b) {
          const Item& it = items[b];
          if (it.sq) continue;  // norms known already
          double* sq = partial.data() + (part * nb + b) * nt;
          for_each_piece(lo, hi, [&](std::size_t t, std::size_t a, std::size_t len) {
            if (layout_[t].embedding) return;
            sq[t] += it.values ? fast::squared_norm(it.values + a, len)
                               : fast::encoded_squared_norm(it.codec, it.bytes, size_, a, len);
          });
        }
      });
      for (std::size_t b = 0; b < nb; ++b) {
        for (std::size_t t = g.first; t < g.last; ++t) {
          double s = items[b].scale;  // embedding: running mean of (scale v) itself
          if (!layout_[t].embedding) {
            double sq = 0.0;
            if (items[b].sq) {
              sq = items[b].sq[t];
            } else {
              for (std::size_t p = 0; p < parts_; ++p) sq += partial[(p * nb + b) * nt + t];
            }
            const double norm = std::sqrt(sq);
            weighted_norm_sum_[t] += items[b].weight * (items[b].scale * norm);  // sum w ||scale v||
            s = norm >= FLT_MIN ? static_cast<double>(static_cast<float>(1.0 / norm)) : 0.0;  // phi(0) = 0
          }
          alpha[b * nt + t] = static_cast<float>(items[b].weight * s / w_after);
        }
      }
      // Pass 2: mean = keep * mean + sum_b alpha_{b,t} v_b, chunk by chunk;
      // partial ||mean_t||^2 per part (reusing the item-0 slots).
      for (std::size_t p = 0; p < parts_; ++p) std::fill_n(partial.data() + p * nb * nt + g.first, g.last - g.first, 0.0);
      for_range(g.lo, g.hi, [&](std::size_t part, std::size_t lo, std::size_t hi) {
        float* acc = batch_acc_.data() + part * kBatchChunk;
        float* dec = buffers_.data() + part * kChunk;
        double* sq = partial.data() + part * nb * nt;
        const std::size_t end = std::min(size_, (hi + kQuantBlock - 1) / kQuantBlock * kQuantBlock);
        for (std::size_t c = lo / kQuantBlock * kQuantBlock; c < hi; c += kBatchChunk) {
          const std::size_t clen = std::min(kBatchChunk, end - c);
          const std::size_t a0 = std::max(c, lo), a1 = std::min(c + clen, hi);
          if (a1 <= a0) continue;
#if defined(__GNUC__) || defined(__clang__)
          // Start loading the next chunk's mean: its memory traffic then
          // overlaps this chunk's decoding (compute only, L1).
          for (std::size_t i = a1, nx = std::min(hi, a1 + kBatchChunk); i < nx; i += 64 / sizeof(float)) {
            __builtin_prefetch(mean_.data() + i, 1, 3);
          }
#endif
          if (first) {
            std::fill_n(acc, a1 - a0, 0.0f);
          } else {
            fast::scale_into(keep, mean_.data() + a0, acc, a1 - a0);
          }
          for (std::size_t b = 0; b < nb; ++b) {
            const Item& it = items[b];
            const float* x = nullptr;  // element a0 of item b
            if (it.values) {
              x = it.values + a0;
            } else {
              decode_range(it.codec, it.bytes, size_, c, clen, dec);  // validated by add_batch
              x = dec + (a0 - c);
            }
            const float* ab = alpha.data() + b * nt;
            const bool last = b + 1 == nb;
            for_each_piece(a0, a1, [&](std::size_t t, std::size_t a, std::size_t len) {
              if (last) {
                sq[t] += fast::axpy_store_sq(ab[t], x + (a - a0), acc + (a - a0), mean_.data() + a, len);
              } else {
                fast::axpy(ab[t], x + (a - a0), acc + (a - a0), len);
              }
            });
          }
        }
      });
      for (std::size_t t = g.first; t < g.last; ++t) {
        double sq = 0.0;
        for (std::size_t p = 0; p < parts_; ++p) sq += partial[p * nb * nt + t];
        mean_sq_[t] = sq;
      }
    }

    /// Per tensor: the factor turning the mean (of directions) into the merged
    /// gradient: ||mean norm|| / ||mean direction||, 0 when the directions cancel,
    /// 1 for embeddings (their mean is already the weighted average).
    void compute_scales() const {
      for (std::size_t t = 0; t < layout_.size(); ++t) {
        if (layout_[t].embedding) {
          scale_[t] = 1.0f;
          continue;
        }
        const double mean_norm = weighted_norm_sum_[t] / total_weight_;
        const double direction_norm = std::sqrt(mean_sq_[t]);
        scale_[t] = direction_norm < cancellation_threshold ? 0.0f
                                                            : static_cast<float>(mean_norm / direction_norm);
      }
    }

    Workers* workers_;
    std::size_t parts_;
    std::vector<float> mean_;                // per tensor: running mean of phi(v) (embedding: of v)
    std::vector<double> weighted_norm_sum_;  // per tensor: sum_m w_m ||v_m||
    std::vector<double> mean_sq_;            // per tensor: ||mean_t||^2 of the current mean
    mutable std::vector<float> scale_;       // per tensor: s_t while adding, finish factor while finishing
    std::vector<double> partial_;            // per part and tensor: partial sums of squares
    mutable std::vector<float> buffers_;     // per part: one decoded chunk
    std::vector<float> batch_acc_;           // per part: add_batch's pass-2 accumulator chunk
    std::vector<Group> groups_;
    std::vector<double> coded_sq_;           // add_encoded: per tensor ||v_t||^2 from the codes
  };

  [[nodiscard]] Accumulator make_accumulator(std::span<const TensorSegment> layout) const {
    return Accumulator(layout, workers);
  }
};

}  // namespace ddiloco::fast
