// python/src/sim.cpp: the simulator's goodput and bandwidth models (sim/goodput.hpp,
// sim/bandwidth.hpp) for ddiloco.sim.
//
// What it is: the configuration structs with their C++ defaults as attribute
// bags, and the model functions returning plain dicts. The Python layer turns
// keyword arguments into these structs.
// What it is not: the models themselves (the headers), nor the planner.
#include <pybind11/stl.h>

#include <string>

#include <ddiloco/sim/bandwidth.hpp>
#include <ddiloco/sim/goodput.hpp>

#include "common.hpp"

namespace ddiloco::python {

namespace {

sim::System system_of(const std::string& s) {
  if (s == "data_parallel") return sim::System::data_parallel;
  if (s == "elastic") return sim::System::elastic;
  if (s == "decoupled") return sim::System::decoupled;
  throw InvalidArgument("ddiloco.sim: system = '" + s + "' must be 'data_parallel', 'elastic' or 'decoupled'");
}

sim::Method method_of(const std::string& s) {
  if (s == "data_parallel") return sim::Method::data_parallel;
  if (s == "diloco") return sim::Method::diloco;
  if (s == "streaming") return sim::Method::streaming;
  if (s == "streaming_overlap") return sim::Method::streaming_overlap;
  if (s == "streaming_overlap_quantized") return sim::Method::streaming_overlap_quantized;
  if (s == "decoupled") return sim::Method::decoupled;
  throw InvalidArgument("ddiloco.sim: method = '" + s +
                        "' must be one of data_parallel, diloco, streaming, streaming_overlap, "
                        "streaming_overlap_quantized, decoupled");
}

py::dict goodput_dict(const sim::GoodputResult& r) {
  py::dict d;
  d["goodput"] = r.goodput;
  d["uptime"] = r.uptime;
  d["global_downtime_hours"] = r.global_downtime_hours;
  d["horizon_hours"] = r.horizon_hours;
  d["failures"] = r.failures;
  d["reconfigurations"] = r.reconfigurations;
  d["steps"] = r.steps;
  d["merges"] = r.merges;
  d["mean_merge_size"] = r.mean_merge_size;
  d["blocked_sends"] = r.blocked_sends;
  py::list series;
  for (const auto& p : r.series) {
    py::dict s;
    s["t_hours"] = p.t_hours;
    s["goodput"] = p.goodput;
    s["failures"] = p.failures;
    series.append(s);
  }
  d["series"] = series;
  return d;
}

}  // namespace

void bind_sim(py::module_& m) {
  py::module_ s = m.def_submodule("sim", "the simulator's models (see ddiloco.sim)");

  py::class_<sim::FailureModel>(s, "FailureModel")
      .def(py::init<>())
      .def_readwrite("chip_mtbi_hours", &sim::FailureModel::chip_mtbi_hours)
      .def_readwrite("slice_chips", &sim::FailureModel::slice_chips)
      .def_readwrite("speed_cv", &sim::FailureModel::speed_cv)
      .def_readwrite("spare_fraction", &sim::FailureModel::spare_fraction)
      .def_readwrite("spare_swap_s", &sim::FailureModel::spare_swap_s)
      .def_property(
          "recovery_mean_s", [](const sim::FailureModel& f) { return f.recovery.mean(); },
          [](sim::FailureModel& f, double mean) { f.recovery = f.recovery.with_mean(mean); });
  py::class_<sim::SystemCosts>(s, "SystemCosts")
      .def(py::init<>())
      .def_readwrite("restart_s", &sim::SystemCosts::restart_s)
      .def_readwrite("reconfigure_s", &sim::SystemCosts::reconfigure_s);
  py::class_<sim::DecoupledConfig>(s, "DecoupledConfig")
      .def(py::init<>())
      .def_readwrite("learners", &sim::DecoupledConfig::learners)
      .def_readwrite("fragments", &sim::DecoupledConfig::fragments)
      .def_readwrite("sync_every", &sim::DecoupledConfig::sync_every)
      .def_readwrite("overlap", &sim::DecoupledConfig::overlap)
      .def_readwrite("link_latency_s", &sim::DecoupledConfig::link_latency_s)
      .def_readwrite("sync_s", &sim::DecoupledConfig::sync_s)
      .def_readwrite("min_quorum", &sim::DecoupledConfig::min_quorum)
      .def_readwrite("gamma", &sim::DecoupledConfig::gamma)
      .def_readwrite("grace_cap_steps", &sim::DecoupledConfig::grace_cap_steps)
      .def_readwrite("deadline_steps", &sim::DecoupledConfig::deadline_steps);
  py::class_<sim::GoodputConfig>(s, "GoodputConfig")
      .def(py::init<>())
      .def_property(
          "system", [](const sim::GoodputConfig& c) { return std::string(c.system == sim::System::data_parallel ? "data_parallel" : c.system == sim::System::elastic ? "elastic" : "decoupled"); },
          [](sim::GoodputConfig& c, const std::string& v) { c.system = system_of(v); })
      .def_readwrite("chips", &sim::GoodputConfig::chips)
      .def_readwrite("horizon_hours", &sim::GoodputConfig::horizon_hours)
      .def_readwrite("step_s", &sim::GoodputConfig::step_s)
      .def_readwrite("seed", &sim::GoodputConfig::seed)
      .def_readwrite("series_bin_s", &sim::GoodputConfig::series_bin_s)
      .def_readwrite("failures", &sim::GoodputConfig::failures)
      .def_readwrite("costs", &sim::GoodputConfig::costs)
      .def_readwrite("decoupled", &sim::GoodputConfig::decoupled);

  py::class_<sim::BandwidthScenario>(s, "BandwidthScenario")
      .def(py::init<>())
      .def_readwrite("params", &sim::BandwidthScenario::params)
      .def_readwrite("layers", &sim::BandwidthScenario::layers)
      .def_readwrite("step_s", &sim::BandwidthScenario::step_s)
      .def_readwrite("backward_fraction", &sim::BandwidthScenario::backward_fraction)
      .def_readwrite("sync_every", &sim::BandwidthScenario::sync_every)
      .def_readwrite("fragments", &sim::BandwidthScenario::fragments)
      .def_readwrite("overlap", &sim::BandwidthScenario::overlap)
      .def_readwrite("bits", &sim::BandwidthScenario::bits)
      .def_readwrite("quantized_bits", &sim::BandwidthScenario::quantized_bits)
      .def_readwrite("workers", &sim::BandwidthScenario::workers)
      .def_readwrite("latency_s", &sim::BandwidthScenario::latency_s)
      .def_readwrite("gbit", &sim::BandwidthScenario::gbit)
      .def_readwrite("decoupled_fragments", &sim::BandwidthScenario::decoupled_fragments)
      .def_readwrite("decoupled_sync_every", &sim::BandwidthScenario::decoupled_sync_every)
      .def_readwrite("decoupled_overlap", &sim::BandwidthScenario::decoupled_overlap)
      .def_readwrite("decoupled_learners", &sim::BandwidthScenario::decoupled_learners)
      .def_readwrite("decoupled_quorum", &sim::BandwidthScenario::decoupled_quorum)
      .def_property(
          "send_merged_to",
          [](const sim::BandwidthScenario& b) {
            return std::string(b.send_merged_to == sim::SendMerged::alive ? "alive" : "contributors");
          },
          [](sim::BandwidthScenario& b, const std::string& v) {
            if (v == "alive") {
              b.send_merged_to = sim::SendMerged::alive;
            } else if (v == "contributors") {
              b.send_merged_to = sim::SendMerged::contributors;
            } else {
              throw InvalidArgument("ddiloco.sim: send_merged_to = '" + v + "' must be 'alive' or 'contributors'");
            }
          })
      .def_readwrite("global_bits", &sim::BandwidthScenario::global_bits);

  s.def(
      "simulate_goodput",
      [](const sim::GoodputConfig& c) {
        sim::GoodputResult r;
        {
          py::gil_scoped_release release;  // a long simulation must not stop other Python threads
          r = sim::simulate_goodput(c);
        }
        return goodput_dict(r);
      },
      py::arg("config"));
  s.def("data_parallel_goodput_closed_form", &sim::data_parallel_goodput_closed_form, py::arg("chips"),
        py::arg("chip_mtbi_hours"), py::arg("restart_s"), py::arg("step_s"));
  s.def(
      "compute_utilisation",
      [](const std::string& method, const sim::BandwidthScenario& b, double gbps) {
        return sim::compute_utilisation(method_of(method), b, gbps);
      },
      py::arg("method"), py::arg("scenario"), py::arg("gbps"));
  s.def(
      "bandwidth_for_utilisation",
      [](const std::string& method, const sim::BandwidthScenario& b, double target) {
        return sim::bandwidth_for_utilisation(method_of(method), b, target);
      },
      py::arg("method"), py::arg("scenario"), py::arg("target"));
  s.def(
      "decoupled_link",
      [](const sim::BandwidthScenario& b, double gbps) {
        const sim::DecoupledLink k = sim::decoupled_link(b, gbps);
        py::dict d;
        d["fanout"] = k.fanout;
        d["up_bits_per_s"] = k.up_bits_per_s;
        d["down_bits_per_s"] = k.down_bits_per_s;
        d["up_fragment_s"] = k.up_fragment_s;
        d["down_fragment_s"] = k.down_fragment_s;
        d["round_trip_s"] = k.round_trip_s;
        d["apply_delay_steps"] = k.apply_delay_steps;
        d["utilisation"] = k.utilisation;
        return d;
      },
      py::arg("scenario"), py::arg("gbps"));
}

}  // namespace ddiloco::python
