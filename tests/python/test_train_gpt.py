"""examples/python/train_gpt.py end to end in tiny mode: both modes run, write results.json, and learn.

ctest runs this file as `python_train_gpt` (label python) with the programs' paths in the
environment: DDILOCO_SYNCER (ddiloco_syncer), DDILOCO_EXPORT (ddiloco_export) and DDILOCO_SGEMM
(libonednn_sgemm.so, optional). Without DDILOCO_SYNCER (the plain pytest run of tests/python)
it is skipped.
"""
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "python", "train_gpt.py")
SYNCER = os.environ.get("DDILOCO_SYNCER")
STEPS = 30

pytestmark = pytest.mark.skipif(not SYNCER, reason="needs DDILOCO_SYNCER=path/to/ddiloco_syncer "
                                                   "(ctest --test-dir build -R python_train_gpt sets it)")


def run(out, *extra):
    cmd = [sys.executable, SCRIPT, "--tiny", "--steps", str(STEPS), "--out", str(out), "--timeout", "240",
           "--sgemm", os.environ.get("DDILOCO_SGEMM", "off"), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    path = out / "results.json"
    assert path.exists(), f"no {path}; output:\n{r.stdout[-2000:]}"
    with open(path) as f:
        return json.load(f), r.stdout


def check_learned(res):
    cfg = res["config"]
    assert res["tokens"] == res["processes"] * STEPS * cfg["batch"] * cfg["context"]
    first, last = res["curve"][0], res["curve"][-1]
    assert first["step"] == 0 and last["step"] == STEPS
    assert math.isfinite(last["val_loss"]) and last["val_loss"] < first["val_loss"] - 0.3, res["curve"]
    assert math.isfinite(res["final_train_loss"]) and res["final_train_loss"] < res["first_train_loss"]
    assert res["train_s"] > 0 and res["wall_s"] >= res["train_s"]


def test_ddiloco_mode_learns_with_a_group_learner_and_reports_its_overhead(tmp_path):
    extra = ["--export", os.environ["DDILOCO_EXPORT"]] if os.environ.get("DDILOCO_EXPORT") else []
    res, out = run(tmp_path / "ddiloco", "--mode", "ddiloco", "--start-syncer", SYNCER, "--learners", "2",
                   "--group-ranks", "2", *extra)
    check_learned(res)
    assert "ddiloco" in out and "time in ddiloco calls" in out  # progress and the overhead line
    leaders = [p for p in res["processes_detail"] if p["rank"] == 0]
    assert len(leaders) == res["config"]["learners"] == 2 and res["processes"] == 3
    assert [p["ranks"] for p in res["processes_detail"]] == [1, 2, 2]  # learner 1 is a 2-rank group
    for p in leaders:  # every learner took part: sent fragments and applied merged ones
        assert p["sends"] > 0 and p["applies"] > 0 and p["bytes_sent"] > 0, p
    for p in res["processes_detail"]:
        assert 0 <= p["ddiloco_overhead_pct"] < 100 and 0 <= p["ddiloco_overhead_cpu_pct"] < 100, p
    if extra:  # the syncer's global, exported from its SIGTERM checkpoint, learned too
        g = res["final_val_global"]
        assert g is not None and math.isfinite(g) and g < res["initial_val"] - 0.3, res


def test_ddp_mode_learns_at_the_same_token_budget(tmp_path):
    res, _ = run(tmp_path / "ddp", "--mode", "ddp", "--learners", "1", "--group-ranks", "2")
    check_learned(res)
    assert res["processes"] == 2 and res["bytes_sent_per_learner"] > 0
