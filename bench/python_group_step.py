#!/usr/bin/python3
"""Cost of ddiloco.GroupLearner.step() on each rank of a 2-rank gloo group (compare: bench/python_step.py).

    PYTHONPATH=build/python /usr/bin/python3 bench/python_group_step.py

Starts an in-process Syncer and two ranks (this script with --rank, a file:// rendezvous on the CPU).
nothing due: P = 24 fragments of 24 tensors of 1024 floats, H = 24 * 2^16 (no send, no apply, no
collective): the median per call over 15 batches, with token_count "sum" and "leader"; next to them, a
bare gloo broadcast of the step header, the floor of a step at which a global may be applied (a
follower waits for it; the leader posts it and goes on).
due: one fragment of `--due-floats` floats (P = 1, H = 2, tau = 1): every other step sends it and the
steps between apply the global when it has arrived (on every rank: the leader broadcasts it, after the
header when it is over 2^18 floats, in the same broadcast otherwise); the median per pair of steps.
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ddiloco


def per_call(fn, calls, batches=15):
    times = []
    for _ in range(batches):
        dist.barrier()  # both ranks start a batch together
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(times), min(times)


def rank_main(a):
    dist.init_process_group("gloo", init_method="file://" + a.init, rank=a.rank, world_size=2,
                            timeout=timedelta(seconds=60))
    out = {}
    params = [(f"t{i}", torch.zeros(1024)) for i in range(24)]
    for count in ("sum", "leader"):
        with ddiloco.GroupLearner(params, endpoint=a.endpoint, id=1 if count == "sum" else 2, plaintext=True,
                                  fragments=24, sync_every=24 << 16, token_count=count) as g:
            out[f"nothing_{count}"] = per_call(lambda: g.step(1), a.calls)
            assert g.status()["applies"] == (24 if g.is_leader else 0)  # the join's only
    header = torch.zeros(3 + 3 * 24, dtype=torch.int64)  # the step header of P = 24 (group.py)
    out["broadcast"] = per_call(lambda: dist.broadcast(header, src=0), a.calls)
    params = [("w", torch.zeros(a.due_floats))]
    with ddiloco.GroupLearner(params, endpoint=a.due_endpoint, id=3, plaintext=True, fragments=1, sync_every=2,
                              overlap=1) as g:
        def pair():
            g.step(1)
            g.step(1)
        out["due"] = per_call(pair, 10)
        out["due_applies"] = g.status()["applies"]
    out["due_sha256"] = hashlib.sha256(params[0][1].numpy().tobytes()).hexdigest()
    with open(f"{a.out}.{a.rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--due-floats", type=int, default=1 << 20)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--due-endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank >= 0:
        return rank_main(a)
    params = [(f"t{i}", torch.zeros(1024)) for i in range(24)]
    with tempfile.TemporaryDirectory() as d, \
            ddiloco.Syncer(params, plaintext=True, fragments=24, round="push", sync_every=0) as s, \
            ddiloco.Syncer([("w", torch.zeros(a.due_floats))], plaintext=True, fragments=1, overlap=1, round="push",
                           sync_every=2) as due:
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), "--endpoint",
                                   s.endpoint, "--due-endpoint", due.endpoint, "--init", os.path.join(d, "init"),
                                   "--out", os.path.join(d, "r"), "--due-floats", str(a.due_floats),
                                   "--calls", str(a.calls)]) for r in range(2)]
        for p in procs:
            if p.wait(600) != 0:
                raise SystemExit(f"rank failed with status {p.returncode}")
        results = [json.load(open(os.path.join(d, f"r.{r}.json"))) for r in range(2)]
    for r, role in ((0, "leader"), (1, "follower")):
        x = results[r]
        print(f"rank {r} ({role}):")
        for k in ("nothing_sum", "nothing_leader", "broadcast"):
            med, best = x[k]
            what = {"nothing_sum": "step() nothing due, token_count='sum'",
                    "nothing_leader": "step() nothing due, token_count='leader'",
                    "broadcast": "a bare gloo broadcast of the 75-integer step header"}[k]
            print(f"  {what}: median {med / 1000:.1f} us, best batch {best / 1000:.1f} us")
        med, best = x["due"]
        print(f"  two steps, one sending a {a.due_floats}-float fragment, the other applying the global on every "
              f"rank when it has arrived: median {med / 1e6:.2f} ms, best batch {best / 1e6:.2f} ms "
              f"({x['due_applies']} applies counted)")
    same = results[0]["due_sha256"] == results[1]["due_sha256"]
    print(f"parameters after the due run: {'bit-identical' if same else 'DIFFERENT'} on both ranks "
          f"(sha256 {results[0]['due_sha256'][:16]}...)")


if __name__ == "__main__":
    main()
