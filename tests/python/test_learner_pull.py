"""Pull rounds from Python (the default of ddiloco.Learner and ddiloco.Syncer, as of the programs):
learners send one 88-byte metadata frame after every step and answer the syncer's pulls; the syncer
keeps the global step and merges each fragment once per sync_every global steps. A learner with the
other round mode is refused at its join, naming both modes."""
import threading
import time

import pytest
import torch

import ddiloco
from conftest import Tiny, train_step

H, TAU, P = 6, 1, 3
HEADER_BYTES = 88  # the frame header (ddiloco/wire.hpp); a metadata frame has no payload
TIME_BOUND_S = 60


def learner_of(model, endpoint, learner_id, **kw):
    return ddiloco.Learner(model, endpoint=endpoint, id=learner_id, plaintext=True, fragments=P, sync_every=H,
                           overlap=TAU, join_timeout=30, **kw)


def wait_for(what, condition, seconds=TIME_BOUND_S):
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"timed out after {seconds} s waiting for {what}"
        time.sleep(0.01)


def test_the_defaults_are_pull_rounds_and_a_metadata_frame_is_88_bytes_on_the_wire(syncer_of):
    model = Tiny(seed=1)
    s = syncer_of(model, fragments=P, sync_every=H, overlap=TAU)
    assert s.status()["round"] == "pull"
    ln = learner_of(model, s.endpoint, 0, metadata_interval=0).join()  # every step's metadata on the wire
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    quiet = 0  # steps that sent only their metadata (no pulled fragment, no heartbeat)
    for step in range(1, 4 * H + 1):
        before = ln.status()
        train_step(model, opt, step)
        ln.step(tokens=7)
        after = ln.status()
        assert after["round"] == "pull" and after["metadata_sent"] == step
        if after["sends"] == before["sends"] and after["heartbeats"] == before["heartbeats"]:
            assert after["bytes_out"] - before["bytes_out"] == HEADER_BYTES, (before, after)
            assert after["frames_out"] - before["frames_out"] == 1
            quiet += 1
    assert quiet >= 2 * H, quiet
    # The syncer's global step follows the learner's metadata (one learner, joined at global step 0).
    wait_for("the global step to reach the learner's steps", lambda: s.status()["global_step"] >= 4 * H)
    assert ln.status()["metadata_coalesced"] == 0
    ln.close()


def test_metadata_is_coalesced_within_metadata_interval_and_the_newest_still_reaches_the_syncer(syncer_of):
    model = Tiny(seed=1)
    s = syncer_of(model, fragments=P, sync_every=H, overlap=TAU)
    # An hour: after the first, no metadata frame goes out by itself.
    ln = learner_of(model, s.endpoint, 0, metadata_interval=3600.0).join()
    steps = 4 * H
    for _ in range(steps):
        ln.step(tokens=7)
    st = ln.status()
    assert st["metadata_sent"] == steps  # the learner sent each step's ...
    # ... the transport sent the first and holds the newest; the rest were replaced before they went out,
    # apart from any that went out ahead of a contribution (an answer to a pull) or a heartbeat.
    assert st["metadata_coalesced"] >= steps - 2 - st["sends"] - st["heartbeats"], st
    assert st["metadata_coalesced"] <= steps - 2, st
    # Leaving sends the held one first: the syncer's global step reaches the learner's last step.
    ln.close()
    wait_for("the global step to reach the learner's last step", lambda: s.status()["global_step"] >= steps)


def test_metadata_interval_must_be_a_finite_number_of_seconds_at_least_0(tiny):
    with pytest.raises(ddiloco.InvalidArgument, match=r"metadata_interval = -1 s must be a finite number of seconds "
                                                      r">= 0 \(0: send every step's metadata\)"):
        learner_of(tiny, "tcp://127.0.0.1:1", 0, metadata_interval=-1.0)


def test_two_pull_learners_are_pulled_once_per_round_and_the_syncer_merges_their_answers(syncer_of):
    model = Tiny(seed=2)
    s = syncer_of(model, fragments=P, sync_every=H, overlap=TAU, heartbeat_timeout=30)
    stop, errors, results, live = threading.Event(), [], {}, {}
    # Each learner trains until the test has seen what it waits for (20000 steps: a failure guard).

    def run(learner_id):
        try:
            m = Tiny(seed=2)
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            with learner_of(m, s.endpoint, learner_id) as ln:
                n = 0
                while not stop.is_set() and n < 20000:
                    n += 1
                    train_step(m, opt, 1000 * learner_id + n)
                    ln.step(tokens=7)
                    if n % 10 == 0:
                        live[learner_id] = ln.status()  # what the main thread waits for
                    time.sleep(0.001)  # two threads of one process: let the other one run
                results[learner_id] = ln.status()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        # The first learner may merge alone for a while before the other has joined: wait for a merge
        # of both learners' answers (a round pulls every learner with progress), and 12 merges.
        # Each learner must also have answered and applied 4 pulls: the second may join late.
        def both_merged():
            st = s.status()
            each = all(r.get("pulls", 0) >= 4 and r.get("sends", 0) >= 4 and r.get("applies", 0) >= 4
                       for r in (live.get(0, {}), live.get(1, {})))
            return errors or (each and st["merges"] >= 12 and len(st["quorum_sizes"]) > 2
                              and st["quorum_sizes"][2] >= 1)

        wait_for("12 merges, one of them of both learners' answers, 4 pulls answered and applied by each",
                 both_merged)
    finally:
        stop.set()
        for t in threads:
            t.join(TIME_BOUND_S)
    assert not any(t.is_alive() for t in threads), "learners did not stop in time"
    assert not errors, errors
    st = s.status()
    assert st["round"] == "pull" and st["merges"] >= 12, st
    assert st["rejected_total"] == 0, st["line"]
    # A pull round merges at most once, after pulling every learner with progress on its fragment
    # (K = 1, then the grace window): each merge had a pull, and some merged both learners' answers.
    assert st["pull_rounds"] >= st["merges"] >= 12, st
    assert st["pulls_sent"] >= st["merges"], st
    assert len(st["quorum_sizes"]) > 2 and st["quorum_sizes"][2] >= 1, st["line"]
    # Each fragment merges once per H global steps (its first round at its slot of the first period).
    assert st["global_step"] >= H * (st["merges"] // P - 1), st
    for learner_id, r in results.items():
        assert r["round"] == "pull" and r["metadata_sent"] == r["step"], r
        # A send answers a pull, or a second ask of one whose answer may be lost (pulls_repeated: answered
        # once more, from the same base).
        assert r["pulls"] >= 4 and r["sends"] >= 4 and r["sends"] <= r["pulls"] + r["pulls_repeated"], r
        assert r["applies"] >= 4, r


@pytest.mark.parametrize("syncer_round, learner_round", [("push", "pull"), ("pull", "push")])
def test_a_learner_with_the_other_round_mode_is_refused_naming_both(syncer_of, syncer_round, learner_round):
    model = Tiny(seed=3)
    s = syncer_of(model, fragments=P, sync_every=H, overlap=TAU, round=syncer_round)
    ln = learner_of(model, s.endpoint, 0, round=learner_round)
    started = time.monotonic()
    with pytest.raises(ddiloco.ProtocolError, match=rf"it runs {syncer_round} rounds but this learner runs "
                                                    rf"{learner_round} rounds"):
        ln.join()
    assert time.monotonic() - started < 10  # the refusal is the answer: no waiting out the 30 s join time-out
    assert s.status()["joins"] == 0
    ln.close()


def test_round_values_are_checked_naming_the_value_and_pull_needs_sync_every(tiny):
    with pytest.raises(ddiloco.InvalidArgument, match=r"round = 'pul' must be 'pull'.*or 'push'"):
        learner_of(tiny, "tcp://127.0.0.1:1", 0, round="pul")
    with pytest.raises(ddiloco.InvalidArgument, match=r"round = 'PUSH' must be 'pull'"):
        ddiloco.Syncer(tiny, plaintext=True, round="PUSH", start=False)
    with pytest.raises(ddiloco.InvalidArgument, match=r"round = 'pull' needs sync_every > 0.*round='push'"):
        ddiloco.Syncer(tiny, plaintext=True, sync_every=0, start=False)
    s = ddiloco.Syncer(tiny, plaintext=True, sync_every=0, round="push", start=False)  # push: H not checked
    assert s.status()["round"] == "push"
    s.close()
