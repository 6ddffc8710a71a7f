"""The simulator's goodput and bandwidth models as plain functions."""
import math

import pytest

import ddiloco


def test_goodput_of_decoupled_diloco_beats_data_parallel_under_failures():
    dp = ddiloco.sim.simulate_goodput(system="data_parallel", chips=150_000, horizon_hours=24, seed=1)
    dd = ddiloco.sim.simulate_goodput(system="decoupled", chips=150_000, horizon_hours=24, seed=1, learners=8)
    assert 0 < dp["goodput"] < dd["goodput"] <= 1
    assert dd["merges"] > 0 and dp["failures"] > 0


def test_the_data_parallel_closed_form_matches_the_simulation_within_two_percent():
    sim = ddiloco.sim.simulate_goodput(system="data_parallel", chips=50_000, horizon_hours=72, seed=1,
                                       restart_s=74.0, step_s=2.0)["goodput"]
    closed = ddiloco.sim.data_parallel_goodput_closed_form(50_000, 24.0 * 365.0, 74.0, 2.0)
    assert abs(sim - closed) < 0.02


def test_utilisation_grows_with_bandwidth_and_the_inverse_agrees():
    u1 = ddiloco.sim.compute_utilisation("decoupled", 0.1, params=1e9)
    u2 = ddiloco.sim.compute_utilisation("decoupled", 10.0, params=1e9)
    assert 0 <= u1 <= u2 <= 1
    need = ddiloco.sim.bandwidth_for_utilisation("data_parallel", 0.9, params=1e9)
    assert math.isfinite(need)
    assert ddiloco.sim.compute_utilisation("data_parallel", need, params=1e9) == pytest.approx(0.9, abs=1e-6)
    link = ddiloco.sim.decoupled_link(1.0, decoupled_learners=4, decoupled_quorum=2)
    assert link["fanout"] == pytest.approx(2.0) and link["down_bits_per_s"] > 0


def test_bad_values_are_refused_with_the_headers_messages():
    with pytest.raises(ddiloco.InvalidArgument, match=r"method = 'ring' must be one of"):
        ddiloco.sim.compute_utilisation("ring", 1.0)
    with pytest.raises(ddiloco.InvalidArgument, match=r"BandwidthScenario::step_s = -1: must be > 0"):
        ddiloco.sim.compute_utilisation("diloco", 1.0, step_s=-1)


def test_spare_pool_is_a_keyword_and_without_it_an_elastic_job_loses_the_slices_in_repair():
    kw = dict(system="elastic", chips=150_000, horizon_hours=24, seed=1)
    with_pool = ddiloco.sim.simulate_goodput(**kw)["goodput"]
    without = ddiloco.sim.simulate_goodput(spare_fraction=0.0, **kw)["goodput"]
    assert without < with_pool - 0.03
    with pytest.raises(ValueError, match="spare_fraction = -1"):
        ddiloco.sim.simulate_goodput(spare_fraction=-1.0, **kw)
