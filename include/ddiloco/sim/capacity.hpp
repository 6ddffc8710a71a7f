// ddiloco/sim/capacity.hpp: size a deployment before training ("how many
// syncer shards, and what hosts").
//
// What it is: for a model (tensor list), M learners, their step time and
// link, and the codecs, it picks the fragment schedule (P, H, tau) with the
// planner of sim/planner.hpp, then the smallest number of syncer shards S
// whose every shard fits a host (NIC, cores, RAM, each filled at most to
// `headroom`), with the shard map of <ddiloco/shard_map.hpp>. Per shard s
// owning n_s elements (E(c, n) = encoded_size(c, n), R = H x step seconds,
// the time in which every learner sends every fragment once):
//   bytes in / s   = M E(codec, n_s) / R          (contributions)
//   bytes out / s  = M E(global_codec, n_s) / R   (each merge to every learner)
//   merge cores    = M n_s / R / fold_elements_per_s[codec] (plaintext: the
//                    payload CRC compared) or curve_fold_elements_per_s[codec]
//                    (CURVE: left to its MAC)
//                  + n_s / R / send_elements_per_s[global_codec]   (framing the globals:
//                    each merge encoded once, its payload shared by the M frames)
//   I/O cores      = (bytes in + bytes out) / s / io_bytes_per_s (plaintext)
//                    or curve_io_bytes_per_s (CURVE, ddiloco_syncer's default:
//                    the I/O thread encrypts and decrypts every byte)
//   I/O threads    k = ddiloco_syncer --io-threads: libzmq gives each learner's
//                    connection to the least loaded thread, so the busiest of
//                    k carries ceil(M / k) of the M connections, I/O cores x
//                    ceil(M / k) / M, which must stay <= headroom (k given, or
//                    the fewest that keep it there, at most M and cores - 1)
//   cores          = ceil(merge cores / headroom) + k
//   RAM steady     = 4 n_s (5 + anchor_versions) bytes: Theta, momentum, the
//                    accumulator's mean, the published global and its spare,
//                    the anchors of pull rounds; plus one merge in flight:
//                    M E(codec, f_s) + G E(global_codec, f_s) for the shard's
//                    largest fragment f_s (the received contributions; the
//                    global's payload: in plaintext one part that every
//                    learner's frame shares, G = 1; under CURVE ZeroMQ
//                    encrypts a copy for each learner, G = M)
//   RAM bound      = steady + 8 n_s (a checkpoint's snapshot) + the transport's
//                    buffer bounds over the shard's own fragments
//                    (transport/bounds.hpp: send budget, incoming queue twice
//                    (transport and merge queue), M peer receive budgets), which
//                    a shard never exceeds however its peers behave
// The per-core rates are measured (bench/bench_syncer_path.cpp fold rates at
// M = 8, bench/bench_transport.cpp BM_syncer_send_merged); SyncerCosts holds
// them and a user can put in their own host's. The predicted compute
// utilisation is the chosen schedule's decoupled utilisation (the learner
// link's throughput bound): a shard that fits never makes a learner wait.
// What it is not: a simulator of the syncer's queueing; it sizes for the
// average rate with headroom, and for the worst-case memory.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <ddiloco/codec.hpp>
#include <ddiloco/error.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/shard_map.hpp>
#include <ddiloco/sim/planner.hpp>
#include <ddiloco/transport/bounds.hpp>

namespace ddiloco::sim {

/// Measured per-core rates (2 vCPU AMD EPYC KVM guest with AVX-512 and
/// VPCLMULQDQ, 2026-12-07, load about 1; docs/simulator.md, "Sizing a
/// deployment", says how to measure your host's and gives the figures).
struct SyncerCosts {
  /// Contribution elements folded per second by one merge thread, by codec
  /// (index: Codec), M = 8, the smaller of the 2^22- and 2^24-element rates of
  /// bench_syncer_path BM_SyncerRoundFromFrames<codec>/encoded (payload CRC-32C
  /// compared, norm scan, add_batch, outer step, publication): the plaintext path.
  double fold_elements_per_s[5] = {1.39e9, 1.23e9, 0.720e9, 1.71e9, 2.22e9};
  /// The same under CURVE (BM_SyncerRoundFromFrames<codec>/authenticated: the
  /// payload CRC left to CURVE's MAC), measured in the same run.
  double curve_fold_elements_per_s[5] = {1.66e9, 1.32e9, 0.829e9, 1.97e9, 2.19e9};
  /// Global elements framed per second by the merging thread, by the global
  /// codec: the merged fragment's payload encoded and checksummed once, then a
  /// header for each receiver, every receiver's frame sharing the payload
  /// (bench_transport BM_syncer_send_merged, 2^24 elements to 8 learners, items
  /// per second: the lowest median of three runs, 2026-12-07).
  double send_elements_per_s[5] = {2.27e9, 2.49e9, 0.658e9, 3.70e9, 3.76e9};
  /// Wire bytes one ZeroMQ I/O thread moves per second (bench_transport
  /// BM_zmq_plaintext_zero_copy, 16 MiB frames on loopback; the lowest median
  /// of twelve runs that day: 2.91 GiB/s, the highest 4.06).
  double io_bytes_per_s = 3.12e9;
  /// The same under CURVE, where the I/O thread also encrypts and decrypts
  /// (bench_transport BM_zmq_curve, 16 MiB frames; the lower of two runs'
  /// medians: 618 and 649 MiB/s).
  double curve_io_bytes_per_s = 0.648e9;
};

struct DeploymentSpec {
  std::size_t learners = 8;       ///< M
  double step_s = 1.0;            ///< a learner's inner-step time
  double link_gbps = 1.0;         ///< each learner's link to the syncers, per direction
  double latency_s = 0.05;        ///< added to every fragment transfer
  Codec codec = Codec::int4;      ///< contributions (learner -> syncer)
  Codec global_codec = Codec::fp32;  ///< globals (syncer -> learners; ddiloco_syncer --global-codec)
  double nic_gbps = 25.0;         ///< a shard host's NIC, per direction
  std::size_t host_cores = 16;    ///< a shard host's cores
  double host_ram_gib = 128.0;    ///< a shard host's memory
  double headroom = 0.7;          ///< fraction of NIC, cores and RAM a shard may plan to use
  /// The syncer's links use CURVE (ddiloco_syncer's default; false: --plaintext),
  /// which sets the I/O thread's rate (SyncerCosts::curve_io_bytes_per_s).
  bool curve = true;
  /// ZeroMQ I/O threads per shard (ddiloco_syncer --io-threads). 0: the fewest
  /// whose busiest thread stays within the headroom (at most M, since each
  /// connection lives on one thread); else exactly this many.
  std::size_t io_threads = 0;
  std::size_t anchor_versions = 1;  ///< SyncerConfig::anchor_versions (pull rounds)
  /// The smallest H (then tau, then imbalance) whose decoupled utilisation
  /// reaches this is chosen; when none does, the highest utilisation.
  double target_utilisation = 0.99;
  std::vector<std::size_t> fragment_counts{8, 12, 16, 24, 32, 48};
  std::vector<std::size_t> sync_every{24, 48, 100};
  std::vector<std::size_t> overlaps{1, 2, 4};
  /// 0: the fewest shards whose busiest one fits a host; else exactly this
  /// many (what a running sharded syncer was started with; `fits` says whether).
  std::size_t shards = 0;
  SyncerCosts costs{};
};

struct ShardSizing {
  std::size_t fragments = 0, elements = 0;
  double bytes_in_per_s = 0, bytes_out_per_s = 0;
  double merge_cores = 0;            ///< cores busy merging and framing (average)
  double io_cores = 0;               ///< the ZeroMQ I/O threads' work, in cores (all threads together)
  std::size_t io_threads = 1;        ///< ZeroMQ I/O threads (DeploymentSpec::io_threads, or chosen)
  double io_busiest = 0;             ///< the busiest I/O thread's share of a core
  std::size_t cores = 0;             ///< ceil(merge_cores / headroom) + io_threads
  double ram_steady_bytes = 0, ram_bound_bytes = 0;
};

struct DeploymentPlan {
  PlanRow schedule;                    ///< the chosen (strategy balanced-greedy, P, H, tau) and its link figures
  std::size_t shards = 0;              ///< S
  std::size_t cores_per_shard = 0;     ///< for the largest shard: merge cores + io_threads_per_shard
  std::size_t io_threads_per_shard = 0;  ///< the most any shard needs (ddiloco_syncer --io-threads)
  double nic_gbps_per_shard = 0;       ///< max(in, out) of the busiest shard
  double ram_gib_per_shard = 0;        ///< the largest shard's RAM bound
  double predicted_utilisation = 0;    ///< compute utilisation of the learners
  bool fits = false;                   ///< false: even S = P leaves a shard over a host's limit
  std::string limited_by;              ///< what set S ("nic", "cores", "ram", "io threads", "one shard is enough", or "given")
  std::vector<ShardSizing> per_shard;
};

namespace detail {
inline void check_spec(const DeploymentSpec& d) {
  const auto bad = [](auto... parts) { throw InvalidArgument(ddiloco::detail::msg("size_deployment: ", parts...)); };
  if (d.learners == 0) bad("learners = 0; give the number of learners M (>= 1)");
  if (!(d.step_s > 0) || !std::isfinite(d.step_s)) bad("step_s = ", d.step_s, " must be > 0 seconds");
  if (!(d.link_gbps > 0) || !std::isfinite(d.link_gbps)) bad("link_gbps = ", d.link_gbps, " must be > 0");
  if (!(d.latency_s >= 0) || !std::isfinite(d.latency_s)) bad("latency_s = ", d.latency_s, " must be >= 0");
  if (!(d.nic_gbps > 0) || !std::isfinite(d.nic_gbps)) bad("nic_gbps = ", d.nic_gbps, " must be > 0");
  if (d.host_cores < 2) bad("host_cores = ", d.host_cores, ": a shard needs a receive thread and a merge thread (>= 2)");
  if (!(d.host_ram_gib > 0) || !std::isfinite(d.host_ram_gib)) bad("host_ram_gib = ", d.host_ram_gib, " must be > 0");
  if (!(d.headroom > 0 && d.headroom <= 1)) bad("headroom = ", d.headroom, " must be in (0, 1]");
  if (!(d.target_utilisation > 0 && d.target_utilisation <= 1))
    bad("target_utilisation = ", d.target_utilisation, " must be in (0, 1]");
  for (const double r : d.costs.fold_elements_per_s)
    if (!(r > 0) || !std::isfinite(r)) bad("costs.fold_elements_per_s has ", r, "; every rate must be > 0");
  for (const double r : d.costs.curve_fold_elements_per_s)
    if (!(r > 0) || !std::isfinite(r)) bad("costs.curve_fold_elements_per_s has ", r, "; every rate must be > 0");
  for (const double r : d.costs.send_elements_per_s)
    if (!(r > 0) || !std::isfinite(r)) bad("costs.send_elements_per_s has ", r, "; every rate must be > 0");
  if (!(d.costs.io_bytes_per_s > 0)) bad("costs.io_bytes_per_s = ", d.costs.io_bytes_per_s, " must be > 0");
  if (!(d.costs.curve_io_bytes_per_s > 0))
    bad("costs.curve_io_bytes_per_s = ", d.costs.curve_io_bytes_per_s, " must be > 0");
  if (d.io_threads >= d.host_cores)
    bad("io_threads = ", d.io_threads, " leaves no core of ", d.host_cores, " to merge on; give fewer (0: chosen)");
}

/// The busiest of k I/O threads' share of a core when M equal connections carry
/// `io_cores` in all: libzmq hands each connection to the least loaded thread.
inline double busiest_io_thread(double io_cores, std::size_t m, std::size_t k) {
  return io_cores * static_cast<double>((m + k - 1) / k) / static_cast<double>(m);
}

inline double bits_per_value(Codec c) {
  // Exact for the codecs' sizes per element at large n (int8 / int4 add one fp32 scale per 64).
  return static_cast<double>(encoded_size(c, kQuantBlock * 1024)) * 8.0 / static_cast<double>(kQuantBlock * 1024);
}
}  // namespace detail

/// The shard figures of `plan` cut into `shards` shards for `spec` (R = H x step).
inline std::vector<ShardSizing> size_shards(const Plan& plan, std::size_t shards, std::size_t sync_every,
                                            const DeploymentSpec& spec) {
  detail::check_spec(spec);
  if (sync_every == 0) throw InvalidArgument("size_shards: sync_every = 0; give H >= 1");
  const ShardMap map(plan, shards);
  const double m = static_cast<double>(spec.learners);
  const double period = static_cast<double>(sync_every) * spec.step_s;
  std::vector<ShardSizing> out;
  for (std::size_t s = 0; s < shards; ++s) {
    // A shard's transport is sized by the fragments it serves (size_for_shard).
    const SyncerBufferBounds b = syncer_buffer_bounds(plan, map, s);
    const double buffers = static_cast<double>(b.send_budget) + 2.0 * static_cast<double>(b.incoming_max_bytes) +
                           m * static_cast<double>(b.peer_receive_budget);
    ShardSizing z;
    z.fragments = map.fragments_of(s).size();
    z.elements = map.elements_of(s);
    double in = 0, down = 0;
    std::size_t largest = 0;
    for (const std::size_t f : map.fragments_of(s)) {
      in += static_cast<double>(encoded_size(spec.codec, plan.fragments()[f].numel));
      down += static_cast<double>(encoded_size(spec.global_codec, plan.fragments()[f].numel));
      largest = std::max(largest, plan.fragments()[f].numel);
    }
    z.bytes_in_per_s = m * in / period;
    z.bytes_out_per_s = m * down / period;
    const double elems = m * static_cast<double>(z.elements) / period;
    const auto& fold = spec.curve ? spec.costs.curve_fold_elements_per_s : spec.costs.fold_elements_per_s;
    z.merge_cores = elems / fold[static_cast<std::size_t>(spec.codec)] +
                    elems / m / spec.costs.send_elements_per_s[static_cast<std::size_t>(spec.global_codec)];
    z.io_cores = (z.bytes_in_per_s + z.bytes_out_per_s) /
                 (spec.curve ? spec.costs.curve_io_bytes_per_s : spec.costs.io_bytes_per_s);
    z.io_threads = spec.io_threads;
    if (z.io_threads == 0) {  // the fewest that carry it; beyond M threads none carries less
      const std::size_t most = std::min(spec.learners, spec.host_cores - 1);
      z.io_threads = 1;
      while (z.io_threads < most && detail::busiest_io_thread(z.io_cores, spec.learners, z.io_threads) > spec.headroom)
        ++z.io_threads;
    }
    z.io_busiest = detail::busiest_io_thread(z.io_cores, spec.learners, z.io_threads);
    z.cores = static_cast<std::size_t>(std::ceil(z.merge_cores / spec.headroom)) + z.io_threads;
    const double n = static_cast<double>(z.elements);
    const double global_copies = spec.curve ? m : 1.0;  // see "RAM steady" above
    z.ram_steady_bytes = 4.0 * n * (5.0 + static_cast<double>(spec.anchor_versions)) +
                         m * static_cast<double>(encoded_size(spec.codec, largest)) +
                         global_copies * static_cast<double>(encoded_size(spec.global_codec, largest));
    z.ram_bound_bytes = z.ram_steady_bytes + 8.0 * n + buffers;
    out.push_back(z);
  }
  return out;
}

/// Picks the schedule, then the smallest S that fits (see the header comment).
/// Throws InvalidArgument for an empty model or a bad spec (naming the field).
inline DeploymentPlan size_deployment(const std::vector<TensorSpec>& tensors, const DeploymentSpec& spec) {
  detail::check_spec(spec);
  if (tensors.empty()) throw InvalidArgument("size_deployment: the tensor list is empty; read a model file first");
  LinkSpec link;
  link.gbps = spec.link_gbps;
  link.latency_s = spec.latency_s;
  link.step_s = spec.step_s;
  link.bits = detail::bits_per_value(spec.codec);
  std::vector<PlanRow> rows;
  ddiloco::sim::detail::add_rows<BalancedGreedy>(rows, tensors, spec.fragment_counts, spec.sync_every,
                                                 spec.overlaps, link);
  if (rows.empty()) {
    throw InvalidArgument(ddiloco::detail::msg("size_deployment: no (P, H, tau) of the candidates is valid for ",
                                               tensors.size(), " tensors (need P <= tensors, P <= H, 1 <= tau < H)"));
  }
  const auto reaches = [&](const PlanRow& r) { return r.decoupled_utilisation >= spec.target_utilisation; };
  const auto better = [&](const PlanRow& a, const PlanRow& b) {  // a preferred to b
    if (reaches(a) != reaches(b)) return reaches(a);
    if (!reaches(a) && a.decoupled_utilisation != b.decoupled_utilisation)
      return a.decoupled_utilisation > b.decoupled_utilisation;
    if (a.sync_every != b.sync_every) return a.sync_every < b.sync_every;
    if (a.overlap != b.overlap) return a.overlap < b.overlap;
    if (a.imbalance != b.imbalance) return a.imbalance < b.imbalance;
    return a.fragments > b.fragments;  // more fragments: smaller bursts, more ways to shard
  };
  const PlanRow chosen = *std::min_element(rows.begin(), rows.end(), better);
  const Plan plan = make_plan(tensors, chosen.fragments, BalancedGreedy{});

  DeploymentPlan d;
  d.schedule = chosen;
  d.predicted_utilisation = chosen.decoupled_utilisation;
  const double nic = spec.nic_gbps * 1e9 / 8.0 * spec.headroom;
  const double ram = spec.host_ram_gib * static_cast<double>(std::size_t{1} << 30) * spec.headroom;
  // Merge cores a shard may use: what its I/O threads leave of the host, filled to the headroom.
  const auto merge_room = [&](const ShardSizing& z) {
    return static_cast<double>(spec.host_cores - z.io_threads) * spec.headroom;
  };
  if (spec.shards > plan.num_fragments())
    throw InvalidArgument(ddiloco::detail::msg("size_deployment: shards = ", spec.shards, " but the plan has ",
                                               plan.num_fragments(), " fragments (each shard serves at least one)"));
  const std::size_t first = spec.shards != 0 ? spec.shards : 1;
  for (std::size_t s = first; s <= plan.num_fragments(); ++s) {
    auto shards = size_shards(plan, s, chosen.sync_every, spec);
    double worst_nic = 0, worst_ram = 0, worst_cores = 0, worst_io = 0;
    std::size_t most_cores = 0, most_io_threads = 0;
    for (const auto& z : shards) {
      worst_nic = std::max({worst_nic, z.bytes_in_per_s, z.bytes_out_per_s});
      worst_ram = std::max(worst_ram, z.ram_bound_bytes);
      worst_cores = std::max(worst_cores, z.merge_cores / merge_room(z));
      worst_io = std::max(worst_io, z.io_busiest);
      most_cores = std::max(most_cores, z.cores);
      most_io_threads = std::max(most_io_threads, z.io_threads);
    }
    const bool fits = worst_nic <= nic && worst_ram <= ram && worst_cores <= 1 && worst_io <= spec.headroom;
    if (fits || s == plan.num_fragments() || spec.shards != 0) {
      d.shards = s;
      d.fits = fits;
      d.per_shard = std::move(shards);
      d.nic_gbps_per_shard = worst_nic * 8.0 / 1e9;
      d.ram_gib_per_shard = worst_ram / static_cast<double>(std::size_t{1} << 30);
      d.cores_per_shard = most_cores;
      d.io_threads_per_shard = most_io_threads;
      break;
    }
  }
  // What made S > 1: the limit the one-shard deployment broke first (by how far over).
  const auto one = size_shards(plan, 1, chosen.sync_every, spec).front();
  const double over_nic = std::max(one.bytes_in_per_s, one.bytes_out_per_s) / nic;
  const double over_ram = one.ram_bound_bytes / ram, over_cores = one.merge_cores / merge_room(one);
  const double over_io = one.io_busiest / spec.headroom;
  const double worst = std::max({over_nic, over_ram, over_cores, over_io});
  if (spec.shards != 0) {
    d.limited_by = "given";  // DeploymentSpec::shards
  } else if (worst <= 1) {
    d.limited_by = "one shard is enough";
  } else {
    d.limited_by = worst == over_nic ? "nic" : worst == over_ram ? "ram" : worst == over_cores ? "cores" : "io threads";
  }
  return d;
}

}  // namespace ddiloco::sim
