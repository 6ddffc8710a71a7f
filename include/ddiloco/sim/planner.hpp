// ddiloco/sim/planner.hpp: compare fragment schedules for a real model before
// training ("benchmarking fragment schedules").
//
// What it is: for a tensor list (ddiloco/tensor_list.hpp), every fragmentation
// strategy of ddiloco/fragmenter.hpp and every (P, H, tau) asked for, the
// traffic one learner puts on its link to the syncer and what that link does
// to compute utilisation:
//   bytes per sync slot   = fragment numel * bits / 8 (largest and mean)
//   peak bandwidth        = largest fragment bits / (tau * step): what a link
//                           needs so every result lands tau steps after its send
//   mean bandwidth        = model bits / (H * step): the average load
//   on-time fraction      = fragments whose transfer (bits / bw + latency)
//                           fits in tau steps, at the given link
//   decoupled utilisation = min(1, H * step / sum_p transfer_p): learners never
//                           wait, but the link must carry every fragment per period
//   streaming utilisation = min(H * step / (H * step + sum_p max(0, transfer_p - tau * step)),
//                               decoupled utilisation):
//                           a Streaming-DiLoCo learner waits for a late fragment,
//                           and no schedule beats the link's throughput
// What it is not: a training run; it knows sizes and links, not learning.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <ddiloco/error.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/schedule.hpp>

namespace ddiloco::sim {

struct LinkSpec {
  double gbps = 1.0;       ///< per direction, 1 Gbit = 1e9 bits
  double latency_s = 0.05;  ///< added to every fragment transfer
  double step_s = 1.0;      ///< inner-step time
  double bits = 4;          ///< bits per value on the wire (int4 by default)
};

struct PlanRow {
  std::string strategy;
  std::size_t fragments = 0, sync_every = 0, overlap = 0;
  double imbalance = 0;                 ///< largest / mean fragment
  double max_fragment_bytes = 0;
  double mean_fragment_bytes = 0;
  double peak_gbps = 0;
  double mean_gbps = 0;
  double on_time_fraction = 0;
  double decoupled_utilisation = 0;
  double streaming_utilisation = 0;
};

namespace detail {
template <class S>
void add_rows(std::vector<PlanRow>& out, const std::vector<TensorSpec>& tensors, std::span<const std::size_t> ps,
              std::span<const std::size_t> hs, std::span<const std::size_t> taus, const LinkSpec& link) {
  const double bw = link.gbps * 1e9;
  for (const std::size_t p : ps) {
    if (p == 0 || p > tensors.size()) continue;  // make_plan would reject it; the table skips it
    const Plan plan = make_plan(tensors, p, S{});
    double max_bits = 0, total_bits = 0;
    std::vector<double> transfer;
    for (const auto& f : plan.fragments()) {
      const double b = static_cast<double>(f.numel) * link.bits;
      max_bits = std::max(max_bits, b);
      total_bits += b;
      transfer.push_back(b / bw + link.latency_s);
    }
    for (const std::size_t h : hs) {
      for (const std::size_t tau : taus) {
        if (p > h || tau >= h || tau == 0) continue;  // Schedule's validity rules (and tau >= 1 for a window)
        const Schedule schedule(p, h, tau);           // checks the combination once more
        PlanRow r;
        r.strategy = std::string(S::name);
        r.fragments = schedule.num_fragments();
        r.sync_every = schedule.sync_every();
        r.overlap = schedule.overlap();
        r.imbalance = plan.imbalance();
        r.max_fragment_bytes = max_bits / 8;
        r.mean_fragment_bytes = total_bits / 8 / static_cast<double>(p);
        const double window = static_cast<double>(tau) * link.step_s;
        const double period = static_cast<double>(h) * link.step_s;
        r.peak_gbps = max_bits / window / 1e9;
        r.mean_gbps = total_bits / period / 1e9;
        double busy = 0, late = 0;
        std::size_t on_time = 0;
        for (const double t : transfer) {
          busy += t;
          late += std::max(0.0, t - window);
          on_time += t <= window ? 1 : 0;
        }
        r.on_time_fraction = static_cast<double>(on_time) / static_cast<double>(p);
        r.decoupled_utilisation = std::min(1.0, period / busy);
        r.streaming_utilisation = std::min(period / (period + late), r.decoupled_utilisation);
        out.push_back(std::move(r));
      }
    }
  }
}
}  // namespace detail

/// One row per (strategy, P, H, tau) with P <= H, 1 <= tau < H and P <= the
/// number of tensors; strategies in the order balanced-greedy, layer-contiguous,
/// per-tensor. Throws InvalidArgument for an empty tensor list or a link
/// without bandwidth, bits or step time.
inline std::vector<PlanRow> compare_fragment_plans(const std::vector<TensorSpec>& tensors,
                                                   std::span<const std::size_t> fragment_counts,
                                                   std::span<const std::size_t> sync_every,
                                                   std::span<const std::size_t> overlaps, const LinkSpec& link) {
  if (tensors.empty()) throw InvalidArgument("compare_fragment_plans: the tensor list is empty; read a model file first");
  if (!(link.gbps > 0) || !(link.bits > 0) || !(link.step_s > 0) || !(link.latency_s >= 0)) {
    throw InvalidArgument(ddiloco::detail::msg("compare_fragment_plans: link (gbps = ", link.gbps, ", bits = ", link.bits,
                                               ", step_s = ", link.step_s, ", latency_s = ", link.latency_s,
                                               ") needs gbps, bits, step_s > 0 and latency_s >= 0"));
  }
  std::vector<PlanRow> out;
  detail::add_rows<BalancedGreedy>(out, tensors, fragment_counts, sync_every, overlaps, link);
  detail::add_rows<LayerContiguous>(out, tensors, fragment_counts, sync_every, overlaps, link);
  detail::add_rows<PerTensor>(out, tensors, fragment_counts, sync_every, overlaps, link);
  return out;
}

}  // namespace ddiloco::sim
