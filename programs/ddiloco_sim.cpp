// ddiloco_sim: plan a run before training. Goodput under failures, bandwidth
// against compute utilisation, and fragment schedules for a real model, as
// markdown on the terminal and CSV files for examples/plot_sim.py.
//
//   ddiloco_sim goodput    [--hours H] [--seed S] [--out DIR]   5 chip counts x 6 systems
//   ddiloco_sim calibrate  [--hours H] [--seed S] [--out DIR]   fit the baseline constants
//   ddiloco_sim timeseries [--hours H] [--seed S] [--chips N] [--bin SECONDS] [--out DIR]
//   ddiloco_sim bandwidth  [--out DIR]                          1B/10B/100B tables and the headline
//   ddiloco_sim plan MODEL.txt [--gbps G] [--latency S] [--step S] [--bits B] [--out DIR]
//   ddiloco_sim size MODEL [--learners M] [--step S] [--gbps G] [--latency S] [--codec C]
//                    [--global-codec C] [--nic-gbps G] [--cores N] [--ram-gib G] [--headroom F]
//                    [--fragments P --sync-every H --overlap T (fix the schedule)]
//                    [--shards S (fix the shard count)] [--io-threads K (fix the I/O threads)] [--out DIR]
//                                                               syncer shards and their hosts
//                                                               (MODEL: a tensor list or, with
//                                                               nlohmann-json, a .safetensors file)
//   ddiloco_sim all        [--out DIR] [--models DIR]           everything above (results/sim)
//   ddiloco_sim --version
//
// `all` plans the model lists llama-1b, gemma-2b and moe-small: from --models DIR
// if given, else from share/ddiloco/models next to the program's bin/ (where
// `cmake --install` puts examples/models, and where the build tree keeps a copy).
//
// docs/simulator.md explains the models and every assumption.
#include <ddiloco/sim/bandwidth.hpp>
#include <ddiloco/sim/calibrate.hpp>
#include <ddiloco/sim/capacity.hpp>
#include <ddiloco/sim/goodput.hpp>
#include <ddiloco/sim/planner.hpp>
#include <ddiloco/tensor_list.hpp>
#include <ddiloco/version.hpp>
#ifdef DDILOCO_SIM_SAFETENSORS
#include <ddiloco/safetensors.hpp>
#endif

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace ddiloco::sim;

namespace {

struct Args {
  std::string command;
  std::vector<std::string> positional;
  std::map<std::string, std::string> options;

  [[nodiscard]] double number(const std::string& key, double fallback) const {
    const auto it = options.find(key);
    if (it == options.end()) return fallback;
    char* end = nullptr;
    const double v = std::strtod(it->second.c_str(), &end);
    if (end == it->second.c_str() || *end != '\0') {
      throw ddiloco::InvalidArgument("--" + key + " " + it->second + ": expected a number");
    }
    return v;
  }
  [[nodiscard]] std::string text(const std::string& key, const std::string& fallback) const {
    const auto it = options.find(key);
    return it == options.end() ? fallback : it->second;
  }
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s.rfind("--", 0) == 0) {
      if (i + 1 >= argc) throw ddiloco::InvalidArgument(s + " needs a value");
      a.options[s.substr(2)] = argv[++i];
    } else if (a.command.empty()) {
      a.command = s;
    } else {
      a.positional.push_back(s);
    }
  }
  return a;
}

std::string fixed(double v, int digits) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}
std::string pct(double v) { return fixed(100.0 * v, 1) + "%"; }
std::string chips_label(double n) { return n >= 1e6 ? fixed(n / 1e6, 1) + "M" : fixed(n / 1e3, 0) + "k"; }

std::ofstream open_out(const fs::path& dir, const std::string& name) {
  fs::create_directories(dir);
  std::ofstream f(dir / name);
  if (!f) throw ddiloco::InvalidArgument("cannot write " + (dir / name).string() + "; check --out");
  return f;
}

/// Writes `text` to stdout and to DIR/NAME.
void emit(const fs::path& dir, const std::string& name, const std::string& text) {
  std::cout << text << std::flush;
  open_out(dir, name) << text;
}

const std::vector<double> kChips = {150e3, 300e3, 600e3, 1.2e6, 2.4e6};
const std::vector<std::size_t> kLearners = {2, 4, 8, 16};

GoodputConfig base_config(const Args& a) {
  GoodputConfig c;
  c.horizon_hours = a.number("hours", 72.0);
  c.seed = static_cast<std::uint64_t>(a.number("seed", 1));
  c.failures.spare_fraction = a.number("spare-fraction", c.failures.spare_fraction);
  return c;
}

// ---- goodput ----
int cmd_goodput(const Args& a, const fs::path& out) {
  const auto t0 = std::chrono::steady_clock::now();
  const GoodputConfig base = base_config(a);
  const auto dp_t = paper_data_parallel_targets();
  const auto el_t = paper_elastic_targets();
  struct Row {
    std::string name;
    System system;
    std::size_t m;
  };
  std::vector<Row> rows = {{"data-parallel", System::data_parallel, 1}, {"elastic data-parallel", System::elastic, 1}};
  for (auto m : kLearners) rows.push_back({"Decoupled DiLoCo, M = " + std::to_string(m), System::decoupled, m});

  auto csv = open_out(out, "goodput.csv");
  csv << "system,learners,chips,goodput,uptime,global_downtime_hours,failures,reconfigurations,merges,mean_merge_size,"
         "blocked_sends,paper_goodput\n";
  std::ostringstream md, md_up;
  md << "### Goodput (model; paper value and difference in points where published)\n\n| system |";
  md_up << "### Uptime (fraction of time at least one learner trains)\n\n| system |";
  for (double n : kChips) md << ' ' << chips_label(n) << " |", md_up << ' ' << chips_label(n) << " |";
  md << "\n|---|";
  md_up << "\n|---|";
  for (std::size_t i = 0; i < kChips.size(); ++i) md << "---|", md_up << "---|";
  md << '\n';
  md_up << '\n';
  for (const auto& row : rows) {
    md << "| " << row.name << " |";
    md_up << "| " << row.name << " |";
    for (std::size_t i = 0; i < kChips.size(); ++i) {
      GoodputConfig c = base;
      c.system = row.system;
      c.chips = kChips[i];
      c.decoupled.learners = row.m;
      const GoodputResult r = simulate_goodput(c);
      double paper = -1;
      if (row.system == System::data_parallel) paper = dp_t[i].goodput;
      if (row.system == System::elastic) paper = el_t[i].goodput;
      if (row.system == System::decoupled && row.m == 8 && kChips[i] == 1.2e6) paper = 0.88;
      md << ' ' << pct(r.goodput);
      if (paper > 0) md << " (paper " << fixed(100 * paper, 0) << "%, " << (r.goodput >= paper ? "+" : "")
                        << fixed(100 * (r.goodput - paper), 1) << ")";
      md << " |";
      md_up << ' ' << pct(r.uptime) << " |";
      csv << '"' << row.name << "\"," << row.m << ',' << kChips[i] << ',' << r.goodput << ',' << r.uptime << ','
          << r.global_downtime_hours << ',' << r.failures << ',' << r.reconfigurations << ',' << r.merges << ','
          << r.mean_merge_size << ',' << r.blocked_sends << ',' << (paper > 0 ? std::to_string(paper) : "") << '\n';
    }
    md << '\n';
    md_up << '\n';
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ostringstream all;
  all << md.str() << '\n' << md_up.str() << "\nSimulated " << base.horizon_hours << " h per cell, seed " << base.seed
      << "; " << fixed(secs, 1) << " s for the table.\n\n";
  emit(out, "goodput.md", all.str());
  return 0;
}

// ---- calibrate ----
int cmd_calibrate(const Args& a, const fs::path& out) {
  const GoodputConfig base = base_config(a);
  const auto dp = paper_data_parallel_targets();
  const auto el = paper_elastic_targets();
  const BaselineFit fit = calibrate_baselines(base, dp, el);
  std::ostringstream md;
  md << "### Baseline calibration (seed " << base.seed << ", " << base.horizon_hours << " h per cell)\n\n"
     << "- data-parallel restart: " << fixed(fit.restart_s, 2) << " s (RMSE " << fixed(100 * fit.data_parallel_rmse, 2)
     << " points)\n"
     << "- elastic reconfiguration (each shrink or grow): " << fixed(fit.reconfigure_s, 2) << " s (RMSE "
     << fixed(100 * fit.elastic_rmse, 2) << " points)\n"
     << "- not fitted: the mean slice recovery delay (" << fixed(base.failures.recovery.mean() / 3600.0, 2)
     << " h) and the spare pool (" << fixed(100 * base.failures.spare_fraction, 0)
     << "% of the slices); the baselines do not move with them while the pool covers the slices in repair\n\n"
     << "| system | chips | paper | model | difference (points) |\n|---|---|---|---|---|\n";
  auto csv = open_out(out, "calibration.csv");
  csv << "system,chips,paper,model\n";
  for (const auto& [name, cells] : {std::pair{"data-parallel", &fit.data_parallel}, std::pair{"elastic data-parallel", &fit.elastic}}) {
    for (const auto& c : *cells) {
      md << "| " << name << " | " << chips_label(c.chips) << " | " << pct(c.target) << " | " << pct(c.model) << " | "
         << (c.model >= c.target ? "+" : "") << fixed(100 * (c.model - c.target), 1) << " |\n";
      csv << '"' << name << "\"," << c.chips << ',' << c.target << ',' << c.model << '\n';
    }
  }
  md << "\nThe library defaults (sim/goodput.hpp) are these values rounded: restart 74 s, reconfiguration 17.7 s.\n\n";
  emit(out, "calibration.md", md.str());
  return 0;
}

// ---- time series ----
int cmd_timeseries(const Args& a, const fs::path& out) {
  GoodputConfig base = base_config(a);
  if (!a.options.count("hours")) base.horizon_hours = 12.0;
  base.chips = a.number("chips", 1.2e6);
  base.series_bin_s = a.number("bin", 300.0);
  auto csv = open_out(out, "timeseries.csv");
  csv << "system,t_hours,goodput,failures\n";
  std::ostringstream md;
  md << "### One run at " << chips_label(base.chips) << " chips, " << base.horizon_hours << " h, bins of "
     << base.series_bin_s << " s\n\n| system | goodput | min bin | max bin |\n|---|---|---|---|\n";
  for (const auto& [name, sys, m] : {std::tuple{"data-parallel", System::data_parallel, std::size_t{1}},
                                    std::tuple{"elastic data-parallel", System::elastic, std::size_t{1}},
                                    std::tuple{"Decoupled DiLoCo, M = 8", System::decoupled, std::size_t{8}}}) {
    GoodputConfig c = base;
    c.system = sys;
    c.decoupled.learners = m;
    const auto r = simulate_goodput(c);
    double lo = 1, hi = 0;
    for (const auto& p : r.series) {
      csv << '"' << name << "\"," << p.t_hours << ',' << p.goodput << ',' << p.failures << '\n';
      lo = std::min(lo, p.goodput);
      hi = std::max(hi, p.goodput);
    }
    md << "| " << name << " | " << pct(r.goodput) << " | " << pct(lo) << " | " << pct(hi) << " |\n";
  }
  md << '\n';
  emit(out, "timeseries.md", md.str());
  return 0;
}

// ---- bandwidth ----
std::string bandwidth_table(const BandwidthScenario& s, const std::string& title, bool with_reference) {
  std::ostringstream md;
  md << "### " << title << " (Gbit/s needed for a compute utilisation)\n\n| method |";
  for (double t : streaming_1b_targets) md << ' ' << fixed(100 * t, 0) << "% |";
  md << "\n|---|---|---|---|---|---|\n";
  for (std::size_t r = 0; r < std::size(all_methods); ++r) {
    md << "| " << method_name(all_methods[r]) << " |";
    for (std::size_t c = 0; c < 5; ++c) {
      const double v = bandwidth_for_utilisation(all_methods[r], s, streaming_1b_targets[c]);
      md << ' ' << (v < 10 ? fixed(v, 2) : fixed(v, 1));
      if (with_reference && r < 5) {
        const double ref = streaming_1b_table[r][c];
        md << " (paper " << ref << ", " << (v >= ref ? "+" : "") << fixed(100 * (v / ref - 1), 0) << "%)";
      }
      md << " |";
    }
    md << '\n';
  }
  return md.str();
}

int cmd_bandwidth(const Args&, const fs::path& out) {
  const double payload = fit_streaming_1b_payload();
  const auto s1 = streaming_diloco_1b(payload);
  const auto s10 = streaming_diloco_10b(payload);
  const auto s100 = streaming_diloco_100b(payload);
  std::ostringstream md;
  md << "Fitted payload of the \"1B\" model: " << fixed(payload / 1e9, 4) << "e9 values (the only fitted constant; "
     << "worst cell error " << fixed(100 * streaming_1b_worst_error(s1), 1) << "%). 10B and 100B use 10x and 100x.\n\n";
  md << bandwidth_table(s1, "1B: 24 layers, 0.1 s step, H = 100, P = 8, tau = 1", true) << '\n';
  md << bandwidth_table(s10, "10B: 48 layers, 0.8 s step, H = 100, P = 16, tau = 1", false) << '\n';
  md << bandwidth_table(s100, "100B: 108 layers, 4.9 s step, H = 100, P = 36, tau = 1", false) << '\n';
  const Headline h = eight_datacentre_headline();
  md << "### Headline: eight datacentres, 90% compute utilisation\n\n"
     << "12B parameters, 48 layers, step time fitted to " << fixed(h.scenario.step_s, 3)
     << " s so that data-parallel (bf16 ring all-reduce over 8) needs 198 Gbit/s.\n\n"
     << "| | model | paper |\n|---|---|---|\n"
     << "| data-parallel | " << fixed(h.data_parallel_gbps, 1) << " Gbit/s (fitted) | 198 Gbit/s |\n"
     << "| Decoupled DiLoCo (int4, P = H = 24) | " << fixed(h.decoupled_gbps, 3) << " Gbit/s | 0.84 Gbit/s |\n"
     << "| ratio | " << fixed(h.data_parallel_gbps / h.decoupled_gbps, 0) << "x | "
     << fixed(198.0 / 0.84, 0) << "x |\n\n";
  emit(out, "bandwidth.md", md.str());

  auto csv = open_out(out, "bandwidth_curves.csv");
  csv << "model,method,gbps,utilisation\n";
  for (const auto& [name, s] : {std::pair{"1B", s1}, std::pair{"10B", s10}, std::pair{"100B", s100}}) {
    for (const Method m : all_methods) {
      for (double g = 0.01; g <= 10000.0; g *= 1.1) {
        csv << name << ",\"" << method_name(m) << "\"," << g << ',' << compute_utilisation(m, s, g) << '\n';
      }
    }
  }
  auto cells = open_out(out, "bandwidth_1b.csv");
  cells << "method,utilisation,model_gbps,paper_gbps\n";
  for (std::size_t r = 0; r < 5; ++r) {
    for (std::size_t c = 0; c < 5; ++c) {
      cells << '"' << method_name(all_methods[r]) << "\"," << streaming_1b_targets[c] << ','
            << bandwidth_for_utilisation(all_methods[r], s1, streaming_1b_targets[c]) << ',' << streaming_1b_table[r][c]
            << '\n';
    }
  }
  return 0;
}

// ---- plan ----
int cmd_plan(const Args& a, const fs::path& out) {
  if (a.positional.empty()) throw ddiloco::InvalidArgument("plan needs a tensor list: ddiloco_sim plan examples/models/llama-1b.txt");
  LinkSpec link;
  link.gbps = a.number("gbps", 1.0);
  link.latency_s = a.number("latency", 0.05);
  link.step_s = a.number("step", 1.0);
  link.bits = a.number("bits", 4.0);
  for (const auto& path : a.positional) {
    const auto tensors = ddiloco::read_tensor_list_file(path);
    double total = 0;
    for (const auto& t : tensors) total += static_cast<double>(t.numel);
    const std::vector<std::size_t> ps = {8, 12, 24, 48};
    const std::vector<std::size_t> hs = {24, 48, 100};
    const std::vector<std::size_t> taus = {1, 2, 4};
    const auto rows = compare_fragment_plans(tensors, ps, hs, taus, link);
    std::ostringstream md;
    const std::string stem = fs::path(path).stem().string();
    md << "### Fragment plans for " << stem << " (" << tensors.size() << " tensors, " << fixed(total / 1e9, 3)
       << "e9 values; link " << link.gbps << " Gbit/s, latency " << link.latency_s << " s, step " << link.step_s
       << " s, " << link.bits << " bits)\n\n"
       << "| strategy | P | H | tau | imbalance | max fragment MB | mean fragment MB | peak Gbit/s | mean Gbit/s | "
          "on time | Decoupled util. | Streaming util. |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    auto csv = open_out(out, "plan_" + stem + ".csv");
    csv << "strategy,P,H,tau,imbalance,max_fragment_bytes,mean_fragment_bytes,peak_gbps,mean_gbps,on_time_fraction,"
           "decoupled_utilisation,streaming_utilisation\n";
    for (const auto& r : rows) {
      csv << r.strategy << ',' << r.fragments << ',' << r.sync_every << ',' << r.overlap << ',' << r.imbalance << ','
          << r.max_fragment_bytes << ',' << r.mean_fragment_bytes << ',' << r.peak_gbps << ',' << r.mean_gbps << ','
          << r.on_time_fraction << ',' << r.decoupled_utilisation << ',' << r.streaming_utilisation << '\n';
      if (r.overlap != 2) continue;  // the markdown keeps tau = 2 (the paper's); the CSV has every row
      md << "| " << r.strategy << " | " << r.fragments << " | " << r.sync_every << " | " << r.overlap << " | "
         << fixed(r.imbalance, 3) << " | " << fixed(r.max_fragment_bytes / 1e6, 1) << " | "
         << fixed(r.mean_fragment_bytes / 1e6, 1) << " | " << fixed(r.peak_gbps, 3) << " | " << fixed(r.mean_gbps, 3)
         << " | " << pct(r.on_time_fraction) << " | " << pct(r.decoupled_utilisation) << " | "
         << pct(r.streaming_utilisation) << " |\n";
    }
    md << "\n(Rows with tau = 2; all " << rows.size() << " rows in plan_" << stem << ".csv.)\n\n";
    emit(out, "plan_" + stem + ".md", md.str());
  }
  return 0;
}

/// A model's tensors: a tensor list, or a .safetensors file's header.
std::vector<ddiloco::TensorSpec> read_model(const std::string& path) {
  if (path.size() >= 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0) {
#ifdef DDILOCO_SIM_SAFETENSORS
    return ddiloco::read_safetensors_specs(path);
#else
    throw ddiloco::InvalidArgument(path + ": this ddiloco_sim was built without nlohmann-json (apt-get install "
                                   "nlohmann-json3-dev, then rebuild) and cannot read safetensors; give a tensor list");
#endif
  }
  return ddiloco::read_tensor_list_file(path);
}

std::size_t count_option(const Args& a, const std::string& key, double fallback) {
  const double v = a.number(key, fallback);
  if (!(v >= 0) || v != std::floor(v) || v > 1e9)
    throw ddiloco::InvalidArgument("--" + key + " " + a.text(key, "") + ": expected a whole number");
  return static_cast<std::size_t>(v);
}

// ---- size: syncer shards and hosts (sim/capacity.hpp) ----
int cmd_size(const Args& a, const fs::path& out) {
  if (a.positional.size() != 1)
    throw ddiloco::InvalidArgument("size needs one model: ddiloco_sim size examples/models/llama-1b.txt --learners 8");
  const std::string path = a.positional[0];
  const auto tensors = read_model(path);
  DeploymentSpec d;
  d.learners = count_option(a, "learners", 8);
  d.step_s = a.number("step", 1.0);
  d.link_gbps = a.number("gbps", 1.0);
  d.latency_s = a.number("latency", 0.05);
  d.codec = ddiloco::parse_codec(a.text("codec", "int4"));
  d.global_codec = ddiloco::parse_codec(a.text("global-codec", "fp32"));
  d.nic_gbps = a.number("nic-gbps", 25.0);
  d.host_cores = count_option(a, "cores", 16);
  d.host_ram_gib = a.number("ram-gib", 128.0);
  d.headroom = a.number("headroom", 0.7);
  const std::string security = a.text("security", "curve");
  if (security != "curve" && security != "plaintext")
    throw ddiloco::InvalidArgument("--security " + security +
                                   ": expected curve (ddiloco_syncer's default) or plaintext (--plaintext)");
  d.curve = security == "curve";
  // A fixed schedule instead of the candidates (what a running syncer was started with).
  if (a.options.count("fragments")) d.fragment_counts = {count_option(a, "fragments", 0)};
  if (a.options.count("sync-every")) d.sync_every = {count_option(a, "sync-every", 0)};
  if (a.options.count("overlap")) d.overlaps = {count_option(a, "overlap", 0)};
  d.shards = count_option(a, "shards", 0);  // 0: the fewest that fit
  d.io_threads = count_option(a, "io-threads", 0);  // 0: the fewest that carry each shard's traffic
  const DeploymentPlan plan = size_deployment(tensors, d);
  double total = 0;
  for (const auto& t : tensors) total += static_cast<double>(t.numel);
  const auto& r = plan.schedule;
  std::ostringstream md;
  const std::string stem = fs::path(path).stem().string();
  md << "### Deployment for " << stem << " (" << tensors.size() << " tensors, " << fixed(total / 1e9, 3)
     << "e9 values), M = " << d.learners << ", step " << d.step_s << " s, learner link " << d.link_gbps
     << " Gbit/s + " << d.latency_s << " s, " << ddiloco::to_string(d.codec) << " up, "
     << ddiloco::to_string(d.global_codec) << " down, " << (d.curve ? "CURVE" : "plaintext") << " links\n\n"
     << "Schedule: P = " << r.fragments << ", H = " << r.sync_every << ", tau = " << r.overlap
     << " (balanced-greedy, imbalance " << fixed(r.imbalance, 3) << "); peak link " << fixed(r.peak_gbps, 3)
     << " Gbit/s, mean " << fixed(r.mean_gbps, 3) << " Gbit/s; predicted compute utilisation "
     << pct(plan.predicted_utilisation) << ".\n\n"
     << "Syncer: " << plan.shards << (plan.shards == 1 ? " shard" : " shards") << " (" << plan.limited_by << ")"
     << (plan.fits ? ""
         : d.shards != 0 ? "; DOES NOT FIT: the busiest of these shards exceeds a host"
                         : "; DOES NOT FIT: even one fragment per shard exceeds a host")
     << ", each host "
     << plan.cores_per_shard << " cores (" << plan.cores_per_shard - plan.io_threads_per_shard << " merging, "
     << plan.io_threads_per_shard << " ZeroMQ I/O: ddiloco_syncer --io-threads " << plan.io_threads_per_shard
     << "), " << fixed(plan.ram_gib_per_shard, 2) << " GiB RAM (bound), NIC "
     << fixed(plan.nic_gbps_per_shard, 3) << " Gbit/s per direction (hosts of " << d.host_cores << " cores, "
     << d.host_ram_gib << " GiB, " << d.nic_gbps << " Gbit/s, filled to " << pct(d.headroom) << ").\n\n"
     << "| shard | fragments | elements | in MB/s | out MB/s | merge cores | I/O cores | I/O threads | busiest I/O "
        "thread | RAM steady GiB | RAM bound GiB |\n"
     << "|---|---|---|---|---|---|---|---|---|---|---|\n";
  const double gib = static_cast<double>(std::size_t{1} << 30);
  for (std::size_t s = 0; s < plan.per_shard.size(); ++s) {
    const auto& z = plan.per_shard[s];
    md << "| " << s << " | " << z.fragments << " | " << z.elements << " | " << fixed(z.bytes_in_per_s / 1e6, 2)
       << " | " << fixed(z.bytes_out_per_s / 1e6, 2) << " | " << fixed(z.merge_cores, 3) << " | "
       << fixed(z.io_cores, 3) << " | " << z.io_threads << " | " << fixed(z.io_busiest, 3) << " | "
       << fixed(z.ram_steady_bytes / gib, 3) << " | " << fixed(z.ram_bound_bytes / gib, 3) << " |\n";
  }
  md << "\n";
  emit(out, "size_" + stem + ".md", md.str());
  return plan.fits ? 0 : 3;
}

int usage(std::ostream& os = std::cerr) {
  os << "usage: ddiloco_sim goodput|calibrate|timeseries|bandwidth|all [--out DIR] [--hours H] [--seed S]\n"
               "                        [--spare-fraction F]   (spare slices per slice, default 0.1; 0: none)\n"
               "       ddiloco_sim plan MODEL.txt... [--gbps G] [--latency S] [--step S] [--bits B] [--out DIR]\n"
               "       ddiloco_sim size MODEL [--learners M] [--step S] [--gbps G] [--latency S] [--codec C]\n"
               "                        [--global-codec C] [--nic-gbps G] [--cores N] [--ram-gib G] [--headroom F]\n"
               "                        [--fragments P] [--sync-every H] [--overlap T] [--shards S] [--io-threads K]\n"
               "                        [--security curve|plaintext] [--out DIR]\n"
               "       ddiloco_sim all [--out DIR] [--models DIR]    (DIR holds llama-1b.txt, gemma-2b.txt, moe-small.txt)\n"
               "       ddiloco_sim --version\n";
  return 2;
}

/// Where `all` reads its model lists: --models DIR, else DDILOCO_MODELS_FROM_BIN
/// (share/ddiloco/models relative to bin/) from this executable's directory.
fs::path models_dir(const Args& a) {
  static constexpr const char* kProbe = "llama-1b.txt";
  if (const auto it = a.options.find("models"); it != a.options.end()) {
    const fs::path dir = it->second;
    if (!fs::exists(dir / kProbe)) {
      throw ddiloco::InvalidArgument("--models " + it->second + ": no " + kProbe +
                                     " there; give the folder with the model lists (examples/models in the "
                                     "source tree, share/ddiloco/models in an install)");
    }
    return dir;
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  const fs::path dir = ec ? fs::path(DDILOCO_MODELS_FROM_BIN) : exe.parent_path() / DDILOCO_MODELS_FROM_BIN;
  if (!fs::exists(dir / kProbe)) {
    throw ddiloco::InvalidArgument("cannot find the model lists (" + std::string(kProbe) + ", ...) in " +
                                   dir.lexically_normal().string() +
                                   ", where an install puts them; pass --models DIR (examples/models in the "
                                   "source tree)");
  }
  return dir;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--version") {
    std::cout << "ddiloco_sim " << DDILOCO_VERSION_STRING << '\n';
    return 0;
  }
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    usage(std::cout);
    return 0;
  }
  try {
    const Args a = parse(argc, argv);
    const fs::path out = a.text("out", "results/sim");
    if (a.command == "goodput") return cmd_goodput(a, out);
    if (a.command == "calibrate") return cmd_calibrate(a, out);
    if (a.command == "timeseries") return cmd_timeseries(a, out);
    if (a.command == "bandwidth") return cmd_bandwidth(a, out);
    if (a.command == "plan") return cmd_plan(a, out);
    if (a.command == "size") return cmd_size(a, out);
    if (a.command == "all") {
      const fs::path models = models_dir(a);  // before the long runs: a missing folder fails now
      cmd_calibrate(a, out);
      cmd_goodput(a, out);
      cmd_timeseries(a, out);
      cmd_bandwidth(a, out);
      Args p = a;
      if (!p.options.count("gbps")) p.options["gbps"] = "0.25";  // a thin cross-region link share
      if (!p.options.count("step")) p.options["step"] = "0.5";
      for (const char* m : {"llama-1b.txt", "gemma-2b.txt", "moe-small.txt"}) p.positional.push_back((models / m).string());
      return cmd_plan(p, out);
    }
    return usage();
  } catch (const std::exception& e) {
    std::cerr << "ddiloco_sim: " << e.what() << '\n';
    return 1;
  }
}
