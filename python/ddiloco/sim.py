"""The simulator's goodput and bandwidth models as plain functions (docs/simulator.md).

Every keyword is a field of the C++ configuration (sim/goodput.hpp,
sim/bandwidth.hpp) with the same name and default; results are dicts.
"""
from __future__ import annotations

import difflib

from . import _core

_sim = _core.sim


def _fields(obj) -> list:
    return [n for n in dir(obj) if not n.startswith("_")]


def _set(who: str, targets: list, kwargs: dict) -> None:
    known = [n for t in targets for n in _fields(t) if not isinstance(getattr(t, n), (_sim.FailureModel,
             _sim.SystemCosts, _sim.DecoupledConfig))]
    for name, value in kwargs.items():
        for t in targets:
            if name in _fields(t) and name not in ("failures", "costs", "decoupled"):
                setattr(t, name, value)
                break
        else:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"ddiloco.sim.{who}: unknown keyword argument {name!r}{hint} "
                            f"(the keywords are: {', '.join(sorted(known))})")


def goodput_config(**kwargs) -> "_sim.GoodputConfig":
    """A GoodputConfig: system ('data_parallel', 'elastic', 'decoupled'), chips, horizon_hours,
    step_s, seed, series_bin_s; failures (chip_mtbi_hours, slice_chips, speed_cv, spare_fraction,
    spare_swap_s, recovery_mean_s);
    costs (restart_s, reconfigure_s); decoupled (learners, fragments, sync_every, overlap,
    link_latency_s, sync_s, min_quorum, gamma, grace_cap_steps, deadline_steps)."""
    c = _sim.GoodputConfig()
    _set("simulate_goodput", [c, c.failures, c.costs, c.decoupled], kwargs)
    return c


def simulate_goodput(**kwargs) -> dict:
    """Goodput of a system under failures (the goodput_config keywords): goodput, uptime,
    global_downtime_hours, failures, reconfigurations, steps, merges, mean_merge_size, series."""
    return _sim.simulate_goodput(goodput_config(**kwargs))


def data_parallel_goodput_closed_form(chips: float, chip_mtbi_hours: float, restart_s: float, step_s: float) -> float:
    """The closed form of data-parallel goodput the simulation is checked against."""
    return _sim.data_parallel_goodput_closed_form(chips, chip_mtbi_hours, restart_s, step_s)


def bandwidth_scenario(**kwargs) -> "_sim.BandwidthScenario":
    """A BandwidthScenario: params, layers, step_s, backward_fraction, sync_every, fragments,
    overlap, bits, quantized_bits, workers, latency_s, gbit, decoupled_fragments,
    decoupled_sync_every, decoupled_overlap, decoupled_learners, decoupled_quorum,
    send_merged_to ('alive' or 'contributors'), global_bits."""
    s = _sim.BandwidthScenario()
    _set("bandwidth", [s], kwargs)
    return s


def compute_utilisation(method: str, gbps: float, **scenario) -> float:
    """Compute utilisation in [0, 1] of `method` ('data_parallel', 'diloco', 'streaming',
    'streaming_overlap', 'streaming_overlap_quantized', 'decoupled') on a link of `gbps`."""
    return _sim.compute_utilisation(method, bandwidth_scenario(**scenario), gbps)


def bandwidth_for_utilisation(method: str, target: float, **scenario) -> float:
    """The least Gbit/s at which `method` reaches `target` utilisation (inf if none does)."""
    return _sim.bandwidth_for_utilisation(method, bandwidth_scenario(**scenario), target)


def decoupled_link(gbps: float, **scenario) -> dict:
    """One Decoupled DiLoCo learner's link at `gbps`: fanout, up/down bits per second,
    fragment transfer times, round_trip_s, apply_delay_steps, utilisation."""
    return _sim.decoupled_link(bandwidth_scenario(**scenario), gbps)
