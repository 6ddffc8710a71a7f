// ddiloco/schedule.hpp: the streaming schedule, which fragment a learner sends
// at which inner step and when the merged result is applied.
//
// What it is: a small immutable value (P fragments, every H inner steps, overlap
// tau) answering "is a fragment due at step t?" in O(1) from a precomputed slot
// table, plus the arithmetic of send and apply steps. Pure: no clock, no I/O.
// What it is not: the learner loop. It does not track what was sent or
// received; a result that arrives after its apply step is applied on arrival
// by the caller (docs/algorithm.md, "Round timeline", step 7: the learner never
// blocks).
//
// # The schedule (docs/algorithm.md, "Schedule"; from Streaming DiLoCo)
// Inner steps are counted from 1: step t is the call made after the t-th inner
// step of the learner (t = 0 is "before training" and never a send slot).
//
//     offset(p) = floor(p * H / P)                      p = 0 .. P-1
//     p is due at step t  <=>  t >= 1 and t mod H == offset(p)
//     apply_step(s) = s + tau
//
// Offsets are spread evenly over one period of H steps; with P = H (the paper
// defaults P = H = 24, tau = 2) exactly one fragment is due at every step.
// Because P <= H, offset(p+1) - offset(p) >= floor(H/P) >= 1, so no two
// fragments share a slot and each fragment is due exactly once in every H
// consecutive steps.
//
// Offset 0: fragment 0 is due at steps H, 2H, 3H, ... Its first send therefore
// comes after a full period of H inner steps, like a DiLoCo outer step, while
// fragment p > 0 first sends after offset(p) < H steps (the stagger only shifts
// the first round; from then on every fragment sends every H steps).
//
// Validity (each violation throws InvalidArgument naming the values):
//   1. P >= 1 and H >= 1.
//   2. P <= H: with P > H two fragments would share a send slot.
//   3. tau < H: a result must be applied (at s + tau) before the same
//      fragment's next send (at s + H), or that send would carry parameters
//      that never saw the previous merge.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include <ddiloco/error.hpp>

namespace ddiloco {

class Schedule {
 public:
  /// P = num_fragments, H = sync_every, tau = overlap (docs/algorithm.md, "Schedule").
  Schedule(std::size_t num_fragments, std::size_t sync_every, std::size_t overlap)
      : num_fragments_(num_fragments), sync_every_(sync_every), overlap_(overlap) {
    if (num_fragments == 0) {
      throw InvalidArgument(detail::msg("Schedule: num_fragments P = 0; a model has at least one "
                                        "fragment, pass P >= 1."));
    }
    if (sync_every == 0) {
      throw InvalidArgument(detail::msg("Schedule: sync_every H = 0; each fragment syncs every H "
                                        "inner steps, pass H >= 1."));
    }
    if (num_fragments > sync_every) {
      throw InvalidArgument(detail::msg("Schedule: num_fragments P = ", num_fragments,
                                        " > sync_every H = ", sync_every,
                                        "; two fragments would share a send slot. Use P <= H "
                                        "(fewer fragments or a longer period)."));
    }
    if (overlap >= sync_every) {
      throw InvalidArgument(detail::msg("Schedule: overlap tau = ", overlap, " >= sync_every H = ",
                                        sync_every,
                                        "; a merged result would be applied after the same "
                                        "fragment's next send. Use tau < H."));
    }
    // offset(p) = floor(p * H / P), computed as p * (H / P) + floor(p * (H % P) / P)
    // so that p * H cannot overflow for large H.
    const std::size_t q = sync_every / num_fragments;
    const std::size_t r = sync_every % num_fragments;
    // Lemire's fastmod constant M = floor((2^64 - 1) / H) + 1 (wraps to 0 for
    // H = 1, for which the formula below gives 0 = step mod 1, as it should).
    fastmod_m_ = std::numeric_limits<std::uint64_t>::max() / sync_every + 1;
    offsets_.resize(num_fragments);
    slots_.assign(sync_every, no_fragment_);
    for (std::size_t p = 0; p < num_fragments; ++p) {
      offsets_[p] = p * q + (p * r) / num_fragments;
      slots_[offsets_[p]] = p;
    }
  }

  [[nodiscard]] std::size_t num_fragments() const noexcept { return num_fragments_; }
  [[nodiscard]] std::size_t sync_every() const noexcept { return sync_every_; }
  [[nodiscard]] std::size_t overlap() const noexcept { return overlap_; }

  /// floor(p * H / P), in [0, H). Throws InvalidArgument if p >= P.
  [[nodiscard]] std::size_t offset(std::size_t fragment) const {
    check_fragment("offset", fragment);
    return offsets_[fragment];
  }

  /// The fragment whose send slot is inner step `step`, or nullopt (no fragment
  /// due, or step = 0, which is never a send slot). O(1): step mod H (by two
  /// multiplications while step and H fit in 32 bits) and one table load.
  [[nodiscard]] std::optional<std::size_t> due_at(std::uint64_t step) const noexcept {
    const std::size_t p = slots_[static_cast<std::size_t>(step_mod_h(step))];
    if (p == no_fragment_ || step == 0) return std::nullopt;
    return p;
  }

  /// The step at which the result of a send made at `send_step` is applied:
  /// send_step + tau (or on arrival, if later; that is the caller's business).
  [[nodiscard]] std::uint64_t apply_step(std::uint64_t send_step) const noexcept {
    return send_step + overlap_;
  }

  /// The first send step of `fragment` strictly after `after_step`: the least
  /// t > after_step with t mod H == offset(p) (t >= 1 follows from t > after_step).
  /// Throws InvalidArgument if fragment >= P.
  [[nodiscard]] std::uint64_t next_send(std::size_t fragment, std::uint64_t after_step) const {
    check_fragment("next_send", fragment);
    const std::uint64_t h = sync_every_;
    std::uint64_t t = after_step - after_step % h + offsets_[fragment];
    if (t <= after_step) t += h;
    return t;
  }

 private:
  static constexpr std::size_t no_fragment_ = std::numeric_limits<std::size_t>::max();

  static constexpr std::uint64_t max_u32_ = 0xFFFF'FFFFu;

  /// step mod H. A 64-bit division costs about 10 ns on the machines we measured,
  /// so for step, H < 2^32 we use Lemire, Kaser and Kurz's "fastmod"
  /// ("Faster Remainder by Direct Computation", 2019):
  ///     step mod H = floor( ((M * step) mod 2^64) * H / 2^64 ),  M = floor((2^64-1)/H) + 1,
  /// exact for all 32-bit step and H. The high half of the 64 x 32-bit product is
  /// assembled from two 32 x 32-bit products, so no 128-bit type is needed.
  [[nodiscard]] std::uint64_t step_mod_h(std::uint64_t step) const noexcept {
    if (step > max_u32_ || sync_every_ > max_u32_) return step % sync_every_;
    const std::uint64_t low = fastmod_m_ * step;  // (M * step) mod 2^64
    const std::uint64_t h = sync_every_;          // < 2^32
    const std::uint64_t hi_product = (low >> 32) * h;
    const std::uint64_t lo_product = (low & max_u32_) * h;
    return (hi_product + (lo_product >> 32)) >> 32;
  }

  void check_fragment(const char* where, std::size_t fragment) const {
    if (fragment >= num_fragments_) {
      throw InvalidArgument(detail::msg("Schedule::", where, ": fragment ", fragment,
                                        " is out of range; valid fragments are 0 .. ",
                                        num_fragments_ - 1, " (P = ", num_fragments_, ")."));
    }
  }

  std::size_t num_fragments_;
  std::size_t sync_every_;
  std::size_t overlap_;
  std::uint64_t fastmod_m_ = 0;        ///< Lemire's M (used only while H < 2^32)
  std::vector<std::size_t> offsets_;  ///< offsets_[p] = floor(p * H / P)
  std::vector<std::size_t> slots_;    ///< slots_[t mod H] = fragment due, or no_fragment_
};

}  // namespace ddiloco
