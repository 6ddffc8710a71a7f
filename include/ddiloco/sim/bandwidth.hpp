// ddiloco/sim/bandwidth.hpp: compute utilisation against link bandwidth for
// data-parallel, DiLoCo, Streaming DiLoCo (with and without overlap and
// quantisation) and Decoupled DiLoCo, and the inverse (bandwidth needed for a
// target utilisation).
//
// What it is: a closed-form timeline of one period of training on one
// cross-datacentre link, after the model Streaming DiLoCo used for its
// bandwidth table (docs/algorithm.md, "Published figures"). Every assumption is a field below.
// What it is not: a network simulator (no congestion, no packet loss) and not
// a learning-quality model.
//
// # The timeline
// One inner step of length T: forward F = (1 - b) T, then backward B = b T
// (b = backward_fraction, 2/3 by default: backward costs twice the forward).
// The model has L equal layers; the backward pass finishes layer l (l = 1 is
// the input side) at F + B (L - l + 1) / L, so layer L's gradient is ready
// first. Whatever is sent for a layer leaves as soon as that layer is ready,
// in that order, on one link:
//     c     = bits_per_layer / bandwidth + latency         (one layer's transfer)
//     done  = fold over ready layers r_1 <= r_2 <= ...:  t <- max(t, r_i) + c
//     stall = max(0, done - T - window)
// A stall stops compute; utilisation = compute time / (compute + stalls).
//   data_parallel  : every step sends every layer's gradient, window 0.
//   diloco         : every H steps sends every layer's outer gradient, window 0.
//   streaming      : P fragments of strided layers ({p, p+P, ...}), one every
//                    H/P steps, each stalls with window 0.
//   streaming_overlap[_quantized]: the same with window tau * T (the result is
//                    needed tau steps later), optionally with quantised bits.
//   decoupled      : learners never stall; each direction of the link must
//                    carry its fragments per H steps, else the learners' work
//                    outruns what can be merged (see "Decoupled DiLoCo's two
//                    directions" below):
//                    utilisation = min(1, H T / (P c_up), H T / (P f c_down)).
// Bits per layer = params / L * bits * ring, with ring = 2 (W - 1) / W for a
// ring all-reduce among W workers (W = 2: 1). Decoupled learners talk to a
// syncer (a star, one link per learner), so ring = 1 there. 1 Gbit = `gbit`
// bits (1e9 by default).
//
// # Decoupled DiLoCo's two directions (docs/algorithm.md, "Round timeline")
// Each of the M learners sends each of its P fragments once per H steps
// (step 3 of the round), in `quantized_bits`. The syncer merges fragment p
// once K contributions are in (the minimum quorum, step 5) and sends the
// merged Theta_p back (step 6), in `global_bits`, to
//   alive        : every live learner (the default);
//   contributors : only the learners whose contributions the merge holds.
// Per fragment period (H steps) fragment p receives M contributions; every
// contribution is merged exactly once (docs/algorithm.md, "Decisions") and a merge holds at
// least K of them, so there are at most M / K merges. The fanout f = global
// fragments one learner receives per fragment it sends:
//   alive        : f = (M / K merges) * (M receivers) / (M senders) = M / K
//                  (K = 1, learners out of phase: every contribution is merged
//                  alone and broadcast to all M, so f = M; K = M: f = 1);
//   contributors : f = (M / K merges) * (K receivers) / M = 1.
// M / K is the upper bound: a grace window (4.5) or contributions arriving
// together make merges larger and f smaller for `alive` (the measured merges
// per contribution scale it). Per learner, at step time T:
//     up   bits/s = params * quantized_bits / (H T)
//     down bits/s = f * params * global_bits / (H T)
// One fragment's transfer each way, on that learner's own link (a star:
// up and down are the two directions, each `gbps`):
//     c_up   = params / P * quantized_bits / bandwidth + latency
//     c_down = params / P * global_bits    / bandwidth + latency
// Utilisation: per P fragments sent the up-link carries P transfers and the
// down-link P f, one after another (the latency counted per transfer, as
// for the up-link: pessimistic when fragments are in flight together):
//     utilisation = min(1, H T / (P c_up), H T / (P f c_down))
// The round trip of one fragment, send -> merge -> its own global back, is
// c_up + c_down (two latencies; the merge time is not modelled). Learners do
// not wait for it (docs/algorithm.md, "Round timeline", step 7: the global is applied tau steps
// after the send, or on arrival if later), so a round trip longer than the
// overlap window tau T costs staleness, not compute: decoupled_link() reports
// it as the apply delay max(tau, (c_up + c_down) / T) in steps.
// The defaults (M = K = 1, global_bits = 0 meaning "as quantized_bits") make
// the down-link the mirror of the up-link (f = 1, c_down = c_up), so every
// number computed before the down-link was modelled is unchanged.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string_view>
#include <vector>

#include <ddiloco/error.hpp>

namespace ddiloco::sim {

enum class Method { data_parallel, diloco, streaming, streaming_overlap, streaming_overlap_quantized, decoupled };

inline constexpr Method all_methods[] = {Method::data_parallel,     Method::diloco,
                                          Method::streaming,         Method::streaming_overlap,
                                          Method::streaming_overlap_quantized, Method::decoupled};

inline std::string_view method_name(Method m) noexcept {
  switch (m) {
    case Method::data_parallel: return "data-parallel";
    case Method::diloco: return "DiLoCo";
    case Method::streaming: return "Streaming DiLoCo";
    case Method::streaming_overlap: return "+ overlapped communication";
    case Method::streaming_overlap_quantized: return "+ overlapped FP4 communication";
    case Method::decoupled: return "Decoupled DiLoCo (int4)";
  }
  return "?";
}

/// To whom the syncer sends a merged fragment (the syncer's `--send-merged-to`).
enum class SendMerged { alive, contributors };

struct BandwidthScenario {
  double params = 1e9;                ///< parameters exchanged (the whole model)
  std::size_t layers = 24;            ///< L
  double step_s = 0.1;                ///< inner-step time T
  double backward_fraction = 2.0 / 3.0;
  std::size_t sync_every = 100;       ///< H for DiLoCo and Streaming DiLoCo
  std::size_t fragments = 8;          ///< P for Streaming DiLoCo
  std::size_t overlap = 1;            ///< tau (steps) for the overlapped variants
  double bits = 16;                   ///< bits per value on the wire (bf16)
  double quantized_bits = 4;          ///< FP4 / int4
  std::size_t workers = 2;            ///< W, for the ring all-reduce factor
  double latency_s = 0;               ///< added to every layer / fragment transfer
  double gbit = 1e9;                  ///< bits in one "Gbit"
  // Decoupled DiLoCo (the paper's defaults)
  std::size_t decoupled_fragments = 24;
  std::size_t decoupled_sync_every = 24;
  std::size_t decoupled_overlap = 2;   ///< tau: a merged fragment is applied tau steps after the send
  // Decoupled DiLoCo's down-link (see the header comment); the defaults mirror the up-link.
  std::size_t decoupled_learners = 1;  ///< M: live learners connected to the syncer
  std::size_t decoupled_quorum = 1;    ///< K: contributions per merge (the minimum quorum)
  SendMerged send_merged_to = SendMerged::alive;
  double global_bits = 0;              ///< bits per value of the merged fragments sent back; 0: quantized_bits

  void validate() const {
    const auto bad = [](const char* what, double v, const char* fix) {
      throw InvalidArgument(ddiloco::detail::msg("BandwidthScenario::", what, " = ", v, ": ", fix));
    };
    if (!(params > 0)) bad("params", params, "must be > 0");
    if (layers < 1) bad("layers", 0, "must be >= 1");
    if (!(step_s > 0)) bad("step_s", step_s, "must be > 0");
    if (!(backward_fraction >= 0 && backward_fraction <= 1)) bad("backward_fraction", backward_fraction, "must be in [0, 1]");
    if (sync_every < 1) bad("sync_every", 0, "H must be >= 1");
    if (fragments < 1 || fragments > sync_every) {
      bad("fragments", static_cast<double>(fragments), "P must be in [1, H]");
    }
    if (!(bits > 0) || !(quantized_bits > 0)) bad("bits", bits, "bits per value must be > 0");
    if (workers < 1) bad("workers", 0, "must be >= 1");
    if (!(latency_s >= 0)) bad("latency_s", latency_s, "must be >= 0");
    if (!(gbit > 0)) bad("gbit", gbit, "must be > 0");
    if (decoupled_fragments < 1 || decoupled_sync_every < 1) bad("decoupled_fragments", 0, "P and H must be >= 1");
    if (decoupled_learners < 1) bad("decoupled_learners", 0, "M must be >= 1");
    if (decoupled_quorum < 1 || decoupled_quorum > decoupled_learners) {
      bad("decoupled_quorum", static_cast<double>(decoupled_quorum), "K must be in [1, decoupled_learners]");
    }
    if (!(global_bits >= 0)) bad("global_bits", global_bits, "must be > 0, or 0 for quantized_bits");
  }
};

namespace detail {

inline double ring_factor(std::size_t w) {
  return w <= 1 ? 0.0 : 2.0 * static_cast<double>(w - 1) / static_cast<double>(w);
}

/// Stall of one transfer of the given layers (1-based, ascending from the
/// input side) sent as each becomes ready in the backward pass.
inline double transfer_stall(const BandwidthScenario& s, const std::vector<std::size_t>& layers, double per_layer_s,
                             double window_s) {
  const double T = s.step_s;
  const double F = (1.0 - s.backward_fraction) * T;
  const double B = s.backward_fraction * T;
  const double L = static_cast<double>(s.layers);
  double t = 0;
  for (auto it = layers.rbegin(); it != layers.rend(); ++it) {  // top layer first
    const double ready = F + B * (L - static_cast<double>(*it) + 1.0) / L;
    t = std::max(t, ready) + per_layer_s;
  }
  return std::max(0.0, t - T - window_s);
}

inline std::vector<std::size_t> all_layers(std::size_t n) {
  std::vector<std::size_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = i + 1;
  return v;
}

inline double global_bits(const BandwidthScenario& s) { return s.global_bits > 0 ? s.global_bits : s.quantized_bits; }

/// f without validation (compute_utilisation validates once).
inline double decoupled_fanout(const BandwidthScenario& s) {
  if (s.send_merged_to == SendMerged::contributors) return 1.0;
  return static_cast<double>(s.decoupled_learners) / static_cast<double>(s.decoupled_quorum);
}

}  // namespace detail

/// Global fragments one Decoupled learner receives per fragment it sends:
/// M / K when merges go to every alive learner, 1 when only to their
/// contributors (header comment).
inline double decoupled_fanout(const BandwidthScenario& s) {
  s.validate();
  return detail::decoupled_fanout(s);
}

/// Compute utilisation in [0, 1] of `m` on a link of `gbps` (per direction).
inline double compute_utilisation(Method m, const BandwidthScenario& s, double gbps) {
  s.validate();
  if (!(gbps > 0)) return 0.0;
  const double bw = gbps * s.gbit;  // bits per second
  const double T = s.step_s;
  const double L = static_cast<double>(s.layers);
  const double ring = detail::ring_factor(s.workers);
  const double H = static_cast<double>(s.sync_every);
  const auto per_layer = [&](double bits) { return s.params / L * bits * ring / bw + s.latency_s; };
  switch (m) {
    case Method::data_parallel: {
      if (ring == 0) return 1.0;
      const double st = detail::transfer_stall(s, detail::all_layers(s.layers), per_layer(s.bits), 0.0);
      return T / (T + st);
    }
    case Method::diloco: {
      if (ring == 0) return 1.0;
      const double st = detail::transfer_stall(s, detail::all_layers(s.layers), per_layer(s.bits), 0.0);
      return H * T / (H * T + st);
    }
    case Method::streaming:
    case Method::streaming_overlap:
    case Method::streaming_overlap_quantized: {
      if (ring == 0) return 1.0;
      const double bits = m == Method::streaming_overlap_quantized ? s.quantized_bits : s.bits;
      const double window = m == Method::streaming ? 0.0 : static_cast<double>(s.overlap) * T;
      double stalls = 0;
      const std::size_t P = std::min(s.fragments, s.layers);
      // P > L: each layer splits into P / L pieces; modelled as P/L transfers of one layer's size / (P/L).
      const double pieces = static_cast<double>(s.fragments) / static_cast<double>(P);
      for (std::size_t p = 0; p < P; ++p) {
        std::vector<std::size_t> ls;
        for (std::size_t l = p + 1; l <= s.layers; l += P) ls.push_back(l);
        const double c = (per_layer(bits) - s.latency_s) / pieces + s.latency_s;
        stalls += pieces * detail::transfer_stall(s, ls, c, window);
      }
      return H * T / (H * T + stalls);
    }
    case Method::decoupled: {
      // Both directions of the learner's link (header comment, "Decoupled DiLoCo's two directions").
      const double P = static_cast<double>(s.decoupled_fragments);
      const double period = static_cast<double>(s.decoupled_sync_every) * T;
      const double c_up = s.params / P * s.quantized_bits / bw + s.latency_s;
      const double c_down = s.params / P * detail::global_bits(s) / bw + s.latency_s;
      return std::min({1.0, period / (P * c_up), period / (P * detail::decoupled_fanout(s) * c_down)});
    }
  }
  return 0.0;
}

/// One Decoupled DiLoCo learner's link, both directions, at `gbps` per
/// direction (header comment, "Decoupled DiLoCo's two directions"). Rates are
/// the load a learner offers at step time T (it never stalls), per learner.
struct DecoupledLink {
  double fanout = 1;             ///< f: global fragments received per fragment sent
  double up_bits_per_s = 0;      ///< params * quantized_bits / (H T)
  double down_bits_per_s = 0;    ///< f * params * global_bits / (H T)
  double up_fragment_s = 0;      ///< c_up, latency included (+inf at 0 Gbit/s)
  double down_fragment_s = 0;    ///< c_down, latency included (+inf at 0 Gbit/s)
  double round_trip_s = 0;       ///< c_up + c_down: send -> merged -> own global back
  double apply_delay_steps = 0;  ///< max(tau, round_trip / T): steps from a send to its apply
  double utilisation = 0;        ///< compute_utilisation(Method::decoupled, s, gbps)
};

inline DecoupledLink decoupled_link(const BandwidthScenario& s, double gbps) {
  s.validate();
  DecoupledLink k;
  const double T = s.step_s;
  const double P = static_cast<double>(s.decoupled_fragments);
  const double period = static_cast<double>(s.decoupled_sync_every) * T;
  k.fanout = detail::decoupled_fanout(s);
  k.up_bits_per_s = s.params * s.quantized_bits / period;
  k.down_bits_per_s = k.fanout * s.params * detail::global_bits(s) / period;
  if (gbps > 0) {
    const double bw = gbps * s.gbit;
    k.up_fragment_s = s.params / P * s.quantized_bits / bw + s.latency_s;
    k.down_fragment_s = s.params / P * detail::global_bits(s) / bw + s.latency_s;
  } else {
    k.up_fragment_s = k.down_fragment_s = std::numeric_limits<double>::infinity();
  }
  k.round_trip_s = k.up_fragment_s + k.down_fragment_s;
  k.apply_delay_steps = std::max(static_cast<double>(s.decoupled_overlap), k.round_trip_s / T);
  k.utilisation = compute_utilisation(Method::decoupled, s, gbps);
  return k;
}

/// The least bandwidth (Gbit/s) at which `m` reaches `target` utilisation, by
/// bisection on a log scale (relative precision 1e-9); +infinity if even 1e9
/// Gbit/s does not reach it (for example because latency alone stalls).
inline double bandwidth_for_utilisation(Method m, const BandwidthScenario& s, double target) {
  if (!(target > 0 && target <= 1)) {
    throw InvalidArgument(ddiloco::detail::msg("bandwidth_for_utilisation: target = ", target, " must be in (0, 1]"));
  }
  double lo = 1e-9, hi = 1e9;
  if (compute_utilisation(m, s, hi) < target) return std::numeric_limits<double>::infinity();
  for (int i = 0; i < 200 && hi / lo > 1 + 1e-9; ++i) {
    const double mid = std::sqrt(lo * hi);
    (compute_utilisation(m, s, mid) >= target ? hi : lo) = mid;
  }
  return hi;
}

/// Streaming DiLoCo's 1B setting (docs/algorithm.md, "Published figures"): 24 layers, 0.1 s step,
/// H = 100, 3 layers per fragment (P = 8), tau = 1, bf16 / FP4, 2 workers.
/// `params` is the payload in values; the published table leaves it open
/// (a "1B" model; Gbit may be 10^9 or 2^30 bits), so fit_streaming_1b_payload()
/// fits it once; the 10B and 100B scenarios scale it by 10 and 100.
inline BandwidthScenario streaming_diloco_1b(double params = 1e9) {
  BandwidthScenario s;
  s.params = params;
  s.layers = 24;
  s.step_s = 0.1;
  s.sync_every = 100;
  s.fragments = 8;
  s.overlap = 1;
  return s;
}

/// The same assumptions for 10B (48 layers, 0.8 s step) and 100B (108 layers,
/// 4.9 s), 3 layers per fragment; `params_1b` is the fitted 1B payload.
inline BandwidthScenario streaming_diloco_10b(double params_1b = 1e9) {
  BandwidthScenario s = streaming_diloco_1b(10 * params_1b);
  s.layers = 48;
  s.step_s = 0.8;
  s.fragments = 16;
  return s;
}
inline BandwidthScenario streaming_diloco_100b(double params_1b = 1e9) {
  BandwidthScenario s = streaming_diloco_1b(100 * params_1b);
  s.layers = 108;
  s.step_s = 4.9;
  s.fragments = 36;
  return s;
}

/// The published 1B table (Gbit/s), rows in all_methods order (without
/// decoupled), columns for utilisation 50, 80, 90, 95, 99 %.
inline constexpr double streaming_1b_targets[] = {0.50, 0.80, 0.90, 0.95, 0.99};
inline constexpr double streaming_1b_table[5][5] = {
    {86.8, 152.6, 184.2, 222.3, 569.0}, {1.4, 6.2, 13.3, 23.3, 86.8}, {1.4, 5.2, 9.1, 16.0, 28.1},
    {1.4, 4.3, 6.2, 9.1, 11.0},         {0.4, 0.9, 1.7, 2.0, 3.0}};

/// Worst relative error |model / published - 1| over the 25 cells of the 1B table.
inline double streaming_1b_worst_error(const BandwidthScenario& s) {
  double worst = 0;
  for (std::size_t r = 0; r < 5; ++r) {
    for (std::size_t c = 0; c < 5; ++c) {
      const double v = bandwidth_for_utilisation(all_methods[r], s, streaming_1b_targets[c]);
      worst = std::max(worst, std::fabs(v / streaming_1b_table[r][c] - 1.0));
    }
  }
  return worst;
}

/// The payload (values) that minimises the worst cell error of the 1B table,
/// searched in [0.5e9, 2e9] (a scan at 0.5 % steps, then refined by halving).
inline double fit_streaming_1b_payload() {
  double best = 1e9, best_err = streaming_1b_worst_error(streaming_diloco_1b(best));
  for (double p = 0.5e9; p <= 2e9; p *= 1.005) {
    const double e = streaming_1b_worst_error(streaming_diloco_1b(p));
    if (e < best_err) best_err = e, best = p;
  }
  for (double step = best * 0.0025; step > best * 1e-6; step /= 2) {
    for (const double p : {best - step, best + step}) {
      const double e = streaming_1b_worst_error(streaming_diloco_1b(p));
      if (e < best_err) best_err = e, best = p;
    }
  }
  return best;
}

/// The "198 Gbit/s vs 0.84 Gbit/s across eight datacentres" setting: W = 8
/// datacentres, data-parallel ring all-reduce of bf16 gradients, Decoupled
/// DiLoCo with int4 fragments (P = H = 24), both at `target` utilisation.
/// The paper names neither model nor step time; we take its 12B model with 48
/// layers and choose the step time so that data-parallel needs `dp_gbps`: the
/// Decoupled figure and the ratio are then predictions.
struct Headline {
  BandwidthScenario scenario;
  double data_parallel_gbps = 0;
  double decoupled_gbps = 0;
};
inline Headline eight_datacentre_headline(double target = 0.9, double dp_gbps = 198.0) {
  BandwidthScenario s;
  s.params = 12e9;
  s.layers = 48;
  s.workers = 8;
  double lo = 1e-3, hi = 1e4;  // step time; the DP need falls as the step grows
  for (int i = 0; i < 200; ++i) {
    s.step_s = std::sqrt(lo * hi);
    (bandwidth_for_utilisation(Method::data_parallel, s, target) > dp_gbps ? lo : hi) = s.step_s;
  }
  s.step_s = hi;
  return {s, bandwidth_for_utilisation(Method::data_parallel, s, target),
          bandwidth_for_utilisation(Method::decoupled, s, target)};
}

}  // namespace ddiloco::sim
