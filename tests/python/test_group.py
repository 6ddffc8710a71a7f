"""Learners that are groups: a 2-rank gloo group learner (two processes, group_worker.py) next to single-process
learners (threads) against an in-process syncer; and a rank of the group killed with SIGKILL."""
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import ddiloco
from group_task import BATCH, batches, inner_step, model_of, mse, task

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 300        # inner steps per learner (and per rank of the group)
LR = 0.02
GROUP_ID = 2
WAIT_S = 60        # the bound of every wait for an event below
MIN_APPLIES = 22   # globals the group's leader applies before it stops (after at least STEPS steps)
MIN_PULLS = 20     # and, in pull rounds, pulls it answers (a merge may close without the group's answer)
LEARNER_MIN_APPLIES = 10  # and each single learner next to it
# The workers import the ddiloco this test imported, wherever PYTHONPATH pointed (relative paths included).
WORKER_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [os.path.dirname(os.path.dirname(os.path.abspath(ddiloco.__file__)))] +
    [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
# Push rounds unless a test says otherwise (test_..._in_pull_rounds_... runs the whole run in pull rounds).
SYNCER = dict(fragments=2, sync_every=8, overlap=1, outer_lr=0.7, outer_momentum=0.5, round="push")
# The kill test runs its single learner long after the model has converged: random batches on a noisy task
# keep every learner's per-step progress of one size, which the syncer's norm-outlier check compares.
KILL_NOISE = 0.3
LEARNER = dict(plaintext=True, fragments=2, sync_every=8, overlap=1, join_timeout=30, round="push")


def start_group(endpoint, directory, tag, steps, alpha=0.0, max_seconds=90, noise=0.01, fold_floats=None,
                extra=()):
    """The two ranks of group learner GROUP_ID as processes; results under directory/tag.*
    alpha: one value for both ranks, or a pair (one per rank)."""
    init = os.path.join(directory, tag + ".init")
    out = os.path.join(directory, tag)
    procs = []
    alphas = alpha if isinstance(alpha, (list, tuple)) else (alpha, alpha)
    for rank in range(2):
        log = open(os.path.join(directory, f"{tag}.{rank}.log"), "w")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "group_worker.py"), "--endpoint", endpoint, "--id", str(GROUP_ID),
             "--rank", str(rank), "--world", "2", "--init", init, "--out", out, "--steps", str(steps),
             "--alpha", str(alphas[rank]), "--lr", str(LR), "--max-seconds", str(max_seconds), "--noise", str(noise)]
            + ([] if fold_floats is None else ["--fold-floats", str(fold_floats)]) + list(extra),
            stdout=log, stderr=subprocess.STDOUT, cwd=HERE, env=WORKER_ENV))
        log.close()
    return procs, out


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def log_of(directory, tag, rank):
    with open(os.path.join(directory, f"{tag}.{rank}.log")) as f:
        return f.read()[-3000:]


def wait_for(what, condition, timeout=WAIT_S):
    """Polls condition() (an event: a status value) until true, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def single_learner(learner_id, endpoint, steps, results, errors, stop=None, progress=None, noise=0.01,
                   round="push", min_applies=0):
    """A single-process learner in a thread: `steps` inner steps, or until `stop` is set; then on until it has
    applied `min_applies` globals (within WAIT_S)."""
    try:
        model = model_of()
        x, y = task(100 + learner_id, noise)
        g = batches(100 + learner_id)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        with ddiloco.Learner(model, endpoint=endpoint, id=learner_id, **dict(LEARNER, round=round)) as learner:
            i = 0
            while (stop is None and i < steps) or (stop is not None and not stop.is_set() and i < steps):
                inner_step(model, opt, x, y, g)
                learner.step(tokens=BATCH)
                i += 1
                if progress is not None:
                    progress[learner_id] = (i, learner.status()["sends"])
                    time.sleep(0.002)  # pacing only: leaves the 2 cores to the group's processes
            deadline = time.monotonic() + WAIT_S
            while learner.status()["applies"] < min_applies:  # how many merges fit in `steps` depends on load
                if time.monotonic() > deadline:
                    raise TimeoutError(f"learner {learner_id}: {learner.status()['applies']} of {min_applies} "
                                       f"globals applied after {i} steps")
                inner_step(model, opt, x, y, g)
                learner.step(tokens=BATCH)
                i += 1
            results[learner_id] = learner.status()
    except BaseException as e:  # reported by the main thread
        errors.append(e)


def lone_sgd_loss(steps, x_eval, y_eval):
    """The loss a learner alone (plain SGD, no ddiloco) reaches on the evaluation data after `steps` steps."""
    model = model_of()
    x, y = task(100)
    g = batches(100)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        inner_step(model, opt, x, y, g)
    return mse(model, x_eval, y_eval)


def global_model(s):
    g = s.global_parameters()
    model = model_of()
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(g[:4]).view(1, 4))
        model.bias.copy_(torch.from_numpy(g[4:5]))
    return model


def train_group_and_two_learners(s, directory, tag, round="push", fold_floats=None):
    """Group learner GROUP_ID (two processes) and two single learners (threads) train STEPS steps against
    syncer `s`; the group then trains on, 4 steps at a time, until its leader has applied MIN_APPLIES globals
    (and in pull rounds answered MIN_PULLS pulls), and each single learner until it has applied
    LEARNER_MIN_APPLIES (how many merges fit in STEPS steps depends on how fast the syncer runs next to the
    learners). Returns
    (leader's status, follower's status, the single learners' statuses) once all ended; asserts the two
    ranks' parameters are bit-identical."""
    procs, out = start_group(s.endpoint, directory, tag, STEPS, alpha=0.25, fold_floats=fold_floats,
                             extra=["--round", round, "--min-applies", str(MIN_APPLIES), "--block", "4"]
                             + (["--min-pulls", str(MIN_PULLS)] if round == "pull" else []))
    try:
        results, errors = {}, []
        threads = [threading.Thread(target=single_learner, args=(i, s.endpoint, STEPS, results, errors),
                                    kwargs=dict(round=round, min_applies=LEARNER_MIN_APPLIES)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads), "the single learners did not finish in time"
        assert not errors, errors
        for rank, p in enumerate(procs):
            assert p.wait(WAIT_S) == 0, log_of(directory, tag, rank)
    finally:
        kill_all(procs)
    ranks = [read_json(f"{out}.{r}.json") for r in range(2)]
    # Bit-identical: every parameter's bytes, after STEPS steps with alpha = 0.25 mixing.
    assert ranks[0]["params"] == ranks[1]["params"]
    return ranks[0]["status"], ranks[1]["status"], results


@pytest.mark.parametrize("fold_floats", [None, 0], ids=["one-broadcast", "header-then-values"])
def test_two_learners_and_a_two_rank_group_train_the_global_model_and_the_ranks_end_bit_identical(syncer_of,
                                                                                                 tmp_path,
                                                                                                 fold_floats):
    start = time.monotonic()
    x_eval, y_eval = task(7)
    initial = mse(model_of(), x_eval, y_eval)
    # The bound: what a learner alone reaches with a quarter of the steps. Four streams of STEPS inner steps
    # (two learners, the group's two ranks) merged by the syncer must do at least that well.
    bound = lone_sgd_loss(STEPS // 4, x_eval, y_eval)
    s = syncer_of(model_of(), heartbeat_timeout=60, **SYNCER)
    # fold_floats: a step's header and globals in one broadcast (the default at this size), or apart.
    leader, follower, results = train_group_and_two_learners(s, str(tmp_path), "train", fold_floats=fold_floats)
    assert leader["role"] == "leader" and follower["role"] == "follower"
    # The follower applied every global the leader applied after its join (the join wrote the state whole).
    assert follower["applies"] == leader["applies"] - 2 and leader["applies"] >= MIN_APPLIES, (leader, follower)
    assert follower["base_versions"] == leader["base_versions"]
    n = leader["step"]  # STEPS, or a few blocks of 4 more until MIN_APPLIES
    assert n >= STEPS and (n - STEPS) % 4 == 0, leader
    # The leader's counters account for the group's tokens (token_count="sum"): its own BATCH per step, and
    # the follower's up to the last step at which a fragment was due (every send is at one): H / P = 4 steps
    # apart, so one of the last 4.
    assert n == follower["group_step"] and follower["own_tokens"] == BATCH * n
    assert leader["synced_step"] == follower["synced_step"] and leader["synced_steps"] == follower["synced_steps"]
    assert leader["tokens_step"] == follower["tokens_step"] and n - 4 < follower["tokens_step"] <= n
    assert leader["tokens"] == BATCH * n + BATCH * follower["tokens_step"], (leader, follower)
    # The ranks communicate only where a global may be applied: from a send + tau until it is (at least one
    # step per send; the leader's sends after the join are a fragment every H / P = 4 steps).
    assert n - 8 < follower["synced_step"] <= n
    assert leader["sends"] - 2 <= follower["synced_steps"] < n, (leader, follower)
    st = s.status()
    others = st["rejected_total"] - st["rejected"]["stale"]  # stale: see test_training.py
    assert st["joins"] >= 3 and others == 0 and st["merges"] >= 20, st["line"]
    assert all(r["applies"] >= LEARNER_MIN_APPLIES for r in results.values()), results
    final = mse(global_model(s), x_eval, y_eval)
    assert final < bound < initial, (initial, bound, final, st["line"])
    print(f"group training test: {time.monotonic() - start:.1f} s; loss {initial:.3g} -> {final:.3g} "
          f"(bound {bound:.3g}); {follower['applies']} applies followed; the ranks communicated at "
          f"{follower['synced_steps']} of {n} steps")


@pytest.mark.parametrize("fold_floats", [None, 0], ids=["one-broadcast", "header-then-values"])
def test_a_group_in_pull_rounds_answers_pulls_applies_every_h_over_p_steps_and_its_ranks_end_bit_identical(
        syncer_of, tmp_path, fold_floats):
    """Pull rounds: the leader answers pulls and sends metadata alone; globals are applied only at the multiples
    of apply_every (default H / P = 4), where the ranks communicate: once every 4 steps, whatever arrives when.
    Each apply is announced at the previous such step (the others never wait for the leader's step), with its
    values (one broadcast) or with the values following at the apply step (header then values)."""
    x_eval, y_eval = task(7)
    initial = mse(model_of(), x_eval, y_eval)
    bound = lone_sgd_loss(STEPS // 4, x_eval, y_eval)  # as in the push test above
    s = syncer_of(model_of(), heartbeat_timeout=60, **dict(SYNCER, round="pull"))
    leader, follower, results = train_group_and_two_learners(s, str(tmp_path), "pull", round="pull",
                                                             fold_floats=fold_floats)
    # The follower applied every global the leader applied after its join (which applied both fragments).
    assert follower["applies"] == leader["applies"] - 2 and leader["applies"] >= MIN_APPLIES, (leader, follower)
    assert follower["base_versions"] == leader["base_versions"]
    n = leader["step"]  # STEPS, or a few blocks of 4 more until MIN_APPLIES
    assert n >= STEPS and (n - STEPS) % 4 == 0, leader
    # The ranks communicated at every 4th step and only there; the group's tokens were summed there.
    assert follower["synced_steps"] == leader["synced_steps"] == n // 4, (leader, follower)
    assert follower["synced_step"] == n == follower["tokens_step"]
    assert leader["tokens"] == 2 * BATCH * n, leader
    # The group answered pulls (its contributions were merged) and sent metadata every step.
    assert leader["pulls"] >= MIN_PULLS and leader["sends"] >= MIN_PULLS and leader["metadata_sent"] >= STEPS, leader
    st = s.status()
    others = st["rejected_total"] - st["rejected"]["stale"]
    assert st["joins"] >= 3 and others == 0 and st["merges"] >= 20, st["line"]
    assert all(r["applies"] >= LEARNER_MIN_APPLIES for r in results.values()), results
    final = mse(global_model(s), x_eval, y_eval)
    assert final < bound < initial, (initial, bound, final, st["line"])
    print(f"group pull test: {leader['applies']} applies and {leader['pulls']} pulls by the leader in {n} steps; "
          f"{st['merges']} merges")


def test_a_lock_step_group_with_tau_0_applies_each_global_at_its_send_step_on_both_ranks(syncer_of, tmp_path):
    """tau = 0, lock-step: a fragment's global is applied at the step that sent it, so a due step is one that
    may apply and must communicate; the ranks stay bit-identical and communicate exactly once per send."""
    s = syncer_of(model_of(), heartbeat_timeout=60, **dict(SYNCER, overlap=0))
    procs, out = start_group(s.endpoint, str(tmp_path), "tau0", 80, alpha=0.25, extra=["--overlap", "0", "--lock-step"])
    try:
        for rank, p in enumerate(procs):
            assert p.wait(WAIT_S) == 0, log_of(str(tmp_path), "tau0", rank)
    finally:
        kill_all(procs)
    ranks = [read_json(f"{out}.{r}.json") for r in range(2)]
    leader, follower = ranks[0]["status"], ranks[1]["status"]
    assert ranks[0]["params"] == ranks[1]["params"]
    # 80 steps, a fragment due every H / P = 4: 20 sends, each applied at its own step (lock-step waits).
    assert leader["sends"] == 20 and follower["applies"] == 20 == leader["applies"] - 2, (leader, follower)
    assert follower["synced_steps"] == 20 == leader["synced_steps"], (leader, follower)


@pytest.mark.parametrize("round_mode", ["push", "pull"])
def test_a_killed_rank_takes_the_group_learner_down_the_rest_runs_on_and_the_restarted_group_rejoins(
        syncer_of, tmp_path, round_mode):
    """SIGKILL of the follower rank of a running group, then of the leader rank of its restarted
    incarnation; each time the other rank fails with a clear error (no hang), the syncer sees the
    group's learner go (a leave, then a death) and keeps merging the single learner's work, and the
    group restarted as a whole rejoins with contributions the syncer accepts. In pull rounds a rank
    may die with an announcement in flight."""
    start = time.monotonic()
    d = str(tmp_path)
    s = syncer_of(model_of(), heartbeat_timeout=3, **dict(SYNCER, round=round_mode))
    stop, results, errors, progress = threading.Event(), {}, [], {}
    single = threading.Thread(target=single_learner,
                              args=(0, s.endpoint, 10**9, results, errors, stop, progress, KILL_NOISE),
                              kwargs=dict(round=round_mode))
    single.start()
    procs = []

    def single_steps():
        return progress.get(0, (0, 0))[0]

    def single_sends():
        return progress.get(0, (0, 0))[1]

    def run_until_accepted(tag):
        """Starts the group (until killed); returns once the syncer has accepted >= 10 of its contributions."""
        nonlocal procs
        before, sends_before = s.status(), single_sends()
        procs, out = start_group(s.endpoint, d, tag, steps=0, max_seconds=60, noise=KILL_NOISE,
                                 extra=["--round", round_mode])

        def accepted_from_group():
            # All contributions accepted since the start, less all the single learner sent: the group's, at least.
            n = (s.status()["contributions_accepted"] - before["contributions_accepted"]) - (single_sends() -
                                                                                             sends_before)
            return n if n >= 10 else None

        n = wait_for(f"the syncer to accept contributions of group {tag}", accepted_from_group)
        assert s.status()["joins"] == before["joins"] + 1  # one join: the leader's, for the whole group
        return out, n

    def kill(rank, out, tag):
        """SIGKILL of `rank`; the other rank must fail at once, and the syncer see the learner go."""
        before, steps_before = s.status(), single_steps()
        assert before["learners_alive"] == 2, before["line"]
        survivor = 1 - rank
        os.kill(procs[rank].pid, signal.SIGKILL)
        assert procs[rank].wait(WAIT_S) == -signal.SIGKILL
        assert procs[survivor].wait(WAIT_S) == 3, log_of(d, tag, survivor)
        error = read_json(f"{out}.{survivor}.json")["error"]
        assert "collective" in error or "Connection" in error, error
        if survivor == 0:  # the leader saw it in its own step: it says the group's learner is down
            assert "the group's learner is down" in error or "Connection" in error, error

        def gone():
            st = s.status()
            return st if st["learners_alive"] == 1 and st["leaves"] + st["deaths"] > before["leaves"] + before[
                "deaths"] else None

        after = wait_for("the syncer to see the group's learner go", gone)
        # The syncer and the single learner never stopped.
        wait_for("merges without the group", lambda: s.status()["merges"] >= after["merges"] + 5)
        assert single_steps() > steps_before and single.is_alive() and not errors, errors
        return after

    try:
        wait_for("the single learner to step", lambda: single_steps() > 0)
        out, first = run_until_accepted("first")
        after = kill(1, out, "first")           # the follower: the leader leaves the run
        assert after["leaves"] >= 1, after["line"]
        out, second = run_until_accepted("second")  # restarted as a whole: rejoins
        after = kill(0, out, "second")          # the leader: the syncer declares it dead
        assert after["deaths"] >= 1, after["line"]
        out, third = run_until_accepted("third")
        end = s.status()
        assert end["rejected_total"] - end["rejected"]["stale"] == 0, end["line"]  # stale: see test_training.py
        assert end["joins"] == 1 + 3 and single.is_alive() and not errors, (end["line"], errors)
    finally:
        stop.set()
        single.join(WAIT_S)
        kill_all(procs)
    assert not single.is_alive() and not errors, errors
    print(f"group kill test ({round_mode}): {time.monotonic() - start:.1f} s; contributions of the three incarnations accepted: "
          f">= {first}, {second}, {third}; syncer: {end['line']}")


# ---- the cores' contracts, without torch.distributed --------------------------------------------------------

def follower_of(model, **kw):
    from ddiloco.learner import _copy_in, _copy_out
    o = ddiloco._core.LearnerOptions()
    o.fragments = kw.get("fragments", 2)
    o.alpha = kw.get("alpha", 0.0)
    o.staging = kw.get("staging", "auto")
    o.sync_every, o.overlap = 8, 1
    names = [n for n, _ in model.named_parameters()]
    tensors = [p for _, p in model.named_parameters()]
    return ddiloco._core.FollowerCore(o, names, tensors, [False] * len(names), torch.float32, _copy_out, _copy_in)


def test_a_follower_applies_a_global_with_the_learner_arithmetic_and_refuses_bad_input_naming_it():
    model = model_of()  # weight (4), bias (1): two fragments
    f = follower_of(model, alpha=0.5)
    plan = f.plan()
    assert plan["fragment_numel"] == [4, 1] and plan["fragments"] == [["weight"], ["bias"]]
    before = model.weight.detach().clone()
    g = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    f.apply(0, 7, g)
    expected = 0.5 * before.reshape(-1).numpy() + 0.5 * g
    assert np.array_equal(model.weight.detach().reshape(-1).numpy(), expected.astype(np.float32))
    assert f.status() == {"applies": 1, "base_versions": [7, 0]}
    with pytest.raises(ddiloco.InvalidArgument, match=r"fragment 2 does not exist: the plan has 2 fragments"):
        f.apply(2, 1, g)
    with pytest.raises(ddiloco.ShapeMismatch, match=r"fragment 1 has 4 elements but the fragment has 1"):
        f.apply(1, 1, g)
    with pytest.raises(ddiloco.InvalidArgument, match=r"format 'd'.*pass a float32 array"):
        f.apply(0, 1, g.astype(np.float64))
    with pytest.raises(ddiloco.InvalidArgument, match=r"not contiguous"):
        f.apply(0, 1, np.arange(8, dtype=np.float32)[::2])
    with pytest.raises(ddiloco.ShapeMismatch, match=r"3 versions for 2 fragments"):
        f.set_versions([1, 2, 3])
    with pytest.raises(ddiloco.InvalidArgument, match=r"alpha = 1.*\[0, 1\)"):
        follower_of(model, alpha=1.0)


def test_a_group_learner_needs_torch_distributed_and_copy_applied_names_what_the_last_step_applied(syncer_of):
    import torch.distributed as dist
    if not dist.is_initialized():
        with pytest.raises(ddiloco.StateError, match=r"torch.distributed is not initialised.*init_process_group"):
            ddiloco.GroupLearner(model_of(), endpoint="tcp://127.0.0.1:1", id=0, plaintext=True)
    model = model_of()
    s = syncer_of(model_of(), **SYNCER)
    # Lock-step: the global of a fragment sent at step t is applied at t + tau, whatever the machine's load.
    with ddiloco.Learner(model, endpoint=s.endpoint, id=0, lock_step=True, **LEARNER) as learner:
        r = learner.step(1)
        assert r.applied == [] and r.versions == []
        with pytest.raises(ddiloco.StateError, match=r"fragment 0 was not applied at the last step \(applied: \[\]\)"):
            learner._core.copy_applied(0, np.zeros(4, dtype=np.float32))
        for _ in range(2 * 8):  # within H steps a fragment is sent, and applied tau = 1 step later
            r = learner.step(1)
            if r.applied:
                break
        assert r.applied and len(r.versions) == len(r.applied), r
        fragment = r.applied[0]
        n = learner.plan["fragment_numel"][fragment]
        out = np.zeros(n, dtype=np.float32)
        assert learner._core.copy_applied(fragment, out) == r.versions[0] == learner.status()["base_versions"][fragment]
        # The values applied with alpha = 0 are the parameters now (plan order: weight is fragment 0, bias 1).
        tensor = [model.weight, model.bias][fragment]
        assert np.array_equal(out, tensor.detach().reshape(-1).numpy())
        with pytest.raises(ddiloco.ShapeMismatch, match=rf"has {n + 1} elements but the fragment has {n}"):
            learner._core.copy_applied(fragment, np.zeros(n + 1, dtype=np.float32))


def test_announce_applies_announces_a_global_and_applies_exactly_it_at_the_next_step_that_may_apply(syncer_of):
    """What a pull-round group's leader runs with: a step that may apply announces the globals whose time has
    come (their values through copy_announced) and the next one, apply_every steps later, applies them."""
    model = model_of()
    s = syncer_of(model_of(), **dict(SYNCER, round="pull"))
    with pytest.raises(ddiloco.InvalidArgument, match=r"announce_applies needs pull rounds"):
        ddiloco.Learner(model_of(), endpoint=s.endpoint, id=1, **dict(LEARNER, announce_applies=True))
    with ddiloco.Learner(model, endpoint=s.endpoint, id=0,
                         **dict(LEARNER, round="pull", apply_every=2, announce_applies=True)) as learner:
        x, y, g = *task(3), batches(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        held, step, deadline = None, 0, time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # until one announcement has been applied (an event, bounded)
            inner_step(model, opt, x, y, g)
            r = learner.step(BATCH)
            step += 1
            if held is not None:
                if step % 2 != 0:
                    assert r.applied == [] and r.announced == [], (step, r)
                    continue
                assert r.applied == [f for f, _ in held] and r.versions == [v for _, (v, _) in held], (r, held)
                for fragment, (_, values) in held:  # alpha = 0: the announced values are the parameters now
                    tensor = [model.weight, model.bias][fragment]
                    assert np.array_equal(values, tensor.detach().reshape(-1).numpy())
                break
            if r.announced:
                assert step % 2 == 0 and r.applied == [], (step, r)
                held = []
                for fragment, version in zip(r.announced, r.announced_versions):
                    out = np.zeros(learner.plan["fragment_numel"][fragment], dtype=np.float32)
                    assert learner._core.copy_announced(fragment, out) == version
                    held.append((fragment, (version, out)))
                missing = next(f for f in range(2) if f not in r.announced) if len(r.announced) < 2 else None
                if missing is not None:
                    with pytest.raises(ddiloco.StateError, match=rf"fragment {missing} was not announced"):
                        learner._core.copy_announced(missing, np.zeros(8, dtype=np.float32))
        assert held is not None and r.applied, f"no announcement applied within {WAIT_S} s ({step} steps)"


def test_ranks_created_with_different_alphas_both_refuse_naming_the_difference(syncer_of, tmp_path):
    s = syncer_of(model_of(), **SYNCER)
    procs, out = start_group(s.endpoint, str(tmp_path), "mismatch", steps=10, alpha=(0.0, 0.5))
    try:
        for rank, p in enumerate(procs):
            assert p.wait(WAIT_S) == 3, log_of(str(tmp_path), "mismatch", rank)
    finally:
        kill_all(procs)
    for rank in range(2):
        error = read_json(f"{out}.{rank}.json")["error"]
        assert error.startswith("InvalidArgument: [ddiloco.invalid_argument] ddiloco.GroupLearner: rank 1 built a "
                                "different learner from the leader's (rank 0)"), error
        assert f"alpha bits {struct.unpack('<i', struct.pack('<f', 0.5))[0]} vs 0" in error, error
    assert s.status()["joins"] == 0  # refused before anyone joined


def test_a_staged_follower_as_on_a_device_writes_the_same_bytes_as_one_in_place():
    in_place, staged = model_of(), model_of()
    a, b = follower_of(in_place, alpha=0.3), follower_of(staged, alpha=0.3, staging="always")
    assert not a.staged and b.staged
    g = torch.Generator().manual_seed(5)
    for step in range(20):
        for fragment, n in enumerate(a.plan()["fragment_numel"]):
            values = torch.randn(n, generator=g).numpy()
            a.apply(fragment, step + 1, values)
            b.apply(fragment, step + 1, values)
    for p, q in zip(in_place.parameters(), staged.parameters()):
        assert p.detach().numpy().tobytes() == q.detach().numpy().tobytes()
    assert a.status() == b.status() == {"applies": 40, "base_versions": [20, 20]}
    # A parameter resized after creation is named, as ddiloco.Learner names it.
    with torch.no_grad():
        staged.bias.data = torch.zeros(2)
    with pytest.raises(ddiloco.ShapeMismatch, match=r"ddiloco.GroupLearner: parameter 'bias' has 2 elements.*"
                                                    r"when the GroupLearner was created"):
        b.apply(1, 21, np.zeros(1, dtype=np.float32))
