#!/usr/bin/python3
"""Cost of ddiloco.Learner.step() from Python (compare: bench_syncer BM_LearnerStepNothingDue, BM_LearnerSendPath).

    PYTHONPATH=build/python /usr/bin/python3 bench/python_step.py

nothing due: P = 24 fragments of 24 tensors of 1024 floats, H = 24 * 2^16 (no
send for 2^16 steps), over a real Syncer on loopback ZeroMQ: the same setting as
the C++ BM_LearnerStepNothingDue. Prints the median per call over 15 batches.
due: one fragment of `--due-floats` floats (P = 1, H = 2, tau = 1): every
other step sends it (fp32, encoded into the ZeroMQ frame) and the steps between
apply the merged global if it has arrived (never waiting); the median per pair
of steps, with the sends and applies counted.
The C++ side of the send is bench_syncer's BM_LearnerSendPath (over an
in-process framing transport instead of ZeroMQ).
"""
import argparse
import statistics
import time

import torch

import ddiloco


def per_call(fn, calls, batches=15):
    times = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(times), min(times)


def nothing_due():
    params = [(f"t{i}", torch.zeros(1024)) for i in range(24)]
    with ddiloco.Syncer(params, plaintext=True, fragments=24) as s:
        with ddiloco.Learner(params, endpoint=s.endpoint, id=1, plaintext=True, fragments=24,
                             sync_every=24 << 16) as ln:
            med, best = per_call(lambda: ln.step(1), 4000)
            assert ln.status()["sends"] == 0
    return med, best


def due(n):
    params = [("w", torch.zeros(n))]
    with ddiloco.Syncer(params, plaintext=True, fragments=1, overlap=1) as s:
        with ddiloco.Learner(params, endpoint=s.endpoint, id=1, plaintext=True, fragments=1, sync_every=2,
                             overlap=1) as ln:
            def pair():
                ln.step(1)
                ln.step(1)
            med, best = per_call(pair, 10, batches=15)
            st = ln.status()
            assert st["sends"] > 0
    return med, best, st


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--due-floats", type=int, default=1 << 20)
    a = ap.parse_args()
    med, best = nothing_due()
    print(f"step() nothing due (24 fragments x 24 tensors): median {med / 1000:.3f} us, best batch {best / 1000:.3f} us")
    loop_med, _ = per_call(lambda: None, 4000)
    print(f"  (an empty Python lambda call: {loop_med / 1000:.3f} us)")
    med, best, st = due(a.due_floats)
    print(f"two steps, one sending a {a.due_floats}-float fragment, the other applying the global if it has "
          f"arrived: median {med / 1e6:.3f} ms, best batch {best / 1e6:.3f} ms "
          f"({st['sends']} sends, {st['applies'] - 1} applies)")


if __name__ == "__main__":
    main()
