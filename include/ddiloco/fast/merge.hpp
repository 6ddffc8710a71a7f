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
// # Passes over memory per contribution (algorithm.md 4.4)
// RDA needs ||v_t|| of each tensor t before phi(v_t) = v_t / ||v_t|| can be
// folded into the running mean, so each contribution is read twice:
//   pass 1  ||v_t||^2 (int8/int4: from the integer codes, s_b^2 sum_j q_j^2
//           per block, no float decode);
//   pass 2  mean += f (s_t v - mean), summing ||mean_t||^2 of the new mean on
//           the way, so finish() needs no norm pass of its own.
// An int8/int4 payload is first checked by a byte scan (valid_encoding: no
// float conversion, 0.56 bytes per element for int4), so a corrupt payload
// throws before the mean is touched. Tensors are processed in groups of whole tensors of about kGroup elements:
// both passes over one group before the next, so when a group fits in the cache
// pass 2 re-reads the contribution from cache, not memory. The accumulator holds
// one float per element plus three doubles per tensor, whatever M is.
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

/// Drop-in for ddiloco::RadialDirectional (same MergeRule, same maths, same edge
/// cases), built from the fused kernels of <ddiloco/fast/kernels.hpp>. `workers`
/// (optional, not owned, must outlive the accumulators) splits every pass.
struct RadialDirectional {
  static constexpr std::string_view name = "radial_directional";
  static constexpr double cancellation_threshold = ddiloco::RadialDirectional::cancellation_threshold;
  /// Target elements per tensor group (1 MiB of fp32 per contribution).
  static constexpr std::size_t kGroup = std::size_t{1} << 18;

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
          buffers_(parts_ * kChunk, 0.0f) {
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
      if (!fast::valid_encoding(codec, bytes.data(), size_)) {
        throw ProtocolError(ddiloco::detail::msg(name, "::add_encoded(", to_string(codec), "): ", size_,
                                                 " elements hold a negative/non-finite scale, a code outside "
                                                 "[-Q, Q] or a nonzero padding nibble; the payload is corrupt, "
                                                 "drop it (the accumulator is unchanged)"));
      }
      add_impl(EncodedSource{codec, bytes.data()}, weight);
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
             (weighted_norm_sum_.capacity() + mean_sq_.capacity() + partial_.capacity()) * sizeof(double) +
             (scale_.capacity() + buffers_.capacity()) * sizeof(float) + bookkeeping_bytes();
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
          decode_range(src.codec, src.bytes, size_, c, len, buf);  // validated by add_encoded
          for_each_piece(std::max(c, lo), std::min(c + len, hi), [&](std::size_t t, std::size_t a, std::size_t l) {
            f(t, a, l, buf + (a - c));
          });
        }
      }
    }

    template <class Source>
    void add_impl(const Source& src, double weight) {
      const std::size_t nt = layout_.size();
      const bool first = count_ == 0;
      const float f = record(weight);
      for (const Group& g : groups_) {
        // Pass 1: partial ||v_t||^2 per part.
        std::fill(partial_.begin(), partial_.end(), 0.0);
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
    std::vector<Group> groups_;
  };

  [[nodiscard]] Accumulator make_accumulator(std::span<const TensorSegment> layout) const {
    return Accumulator(layout, workers);
  }
};

}  // namespace ddiloco::fast
