"""One rank of a group learner for tests/python/test_group.py (run as a process, not collected by pytest).

    python3 group_worker.py --endpoint tcp://... --id 2 --rank 0 --world 2 --init /tmp/x/init --out /tmp/x/r

The ranks form a gloo group (file:// rendezvous, bounded timeout), train the test's linear model data
parallel (gradients all-reduced, as DDP does: the ranks' inner steps stay equal) and step a
ddiloco.GroupLearner after every optimizer step. Each rank writes <out>.<rank>.json at the end: its status,
its parameters' bytes (hex) and, on failure, the error; the leader also writes <out>.progress.json every
few steps (atomically). Exit status: 0 done, 3 a ddiloco or collective error (the group went down).
"""
import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ddiloco
from group_task import BATCH, batches, inner_step, model_of, task


def write_json(path, value):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--endpoint", required=True)
    a.add_argument("--id", type=int, required=True)
    a.add_argument("--rank", type=int, required=True)
    a.add_argument("--world", type=int, default=2)
    a.add_argument("--init", required=True, help="file:// rendezvous path (must not exist yet)")
    a.add_argument("--out", required=True, help="prefix of the result files")
    a.add_argument("--steps", type=int, default=0, help="inner steps (0: until stopped or --max-seconds)")
    a.add_argument("--min-applies", type=int, default=0,
                   help="after --steps, go on in blocks of --block steps until the leader has applied this many "
                        "globals (the leader broadcasts the decision; bounded by --max-seconds)")
    a.add_argument("--min-pulls", type=int, default=0,
                   help="and until the leader has been pulled and has sent this many times (pull rounds)")
    a.add_argument("--block", type=int, default=4, help="the steps of one block after --steps")
    a.add_argument("--max-seconds", type=float, default=90.0, help="give up after this long (no orphans)")
    a.add_argument("--alpha", type=float, default=0.0)
    a.add_argument("--lr", type=float, default=0.02)
    a.add_argument("--noise", type=float, default=0.01, help="the task's noise (group_task.task)")
    a.add_argument("--timeout", type=float, default=20.0, help="the group's collective timeout, seconds")
    a.add_argument("--overlap", type=int, default=1, help="tau (the syncer's must match)")
    a.add_argument("--lock-step", action="store_true", help="wait at send + tau for the global")
    a.add_argument("--round", default="push", help="push or pull (the syncer's must match)")
    a.add_argument("--apply-every", type=int, default=None, help="pull rounds: GroupLearner's apply_every")
    a.add_argument("--fold-floats", type=int, default=None,
                   help="the largest header + values broadcast in one (0: the header and each global apart)")
    args = a.parse_args()
    start = time.monotonic()
    dist.init_process_group("gloo", init_method="file://" + args.init, rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=args.timeout))
    model = model_of()
    x, y = task(1000 * args.id + args.rank, args.noise)
    g = batches(1000 * args.id + args.rank)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    result = {"rank": args.rank}
    code = 0
    learner = None
    try:
        learner = ddiloco.GroupLearner(model, endpoint=args.endpoint, id=args.id, plaintext=True, fragments=2,
                                       sync_every=8, overlap=args.overlap, lock_step=args.lock_step,
                                       alpha=args.alpha, join_timeout=15, round=args.round,
                                       **({} if args.apply_every is None else {"apply_every": args.apply_every}))
        if args.fold_floats is not None:
            learner._fold_floats = args.fold_floats  # the test of both ways a step's broadcasts go
        with learner:
            if learner.is_leader:
                write_json(args.out + ".progress.json", learner.status())
            i = 0
            while True:
                if args.steps != 0 and i >= args.steps and (i - args.steps) % args.block == 0:
                    if args.min_applies <= 0 and args.min_pulls <= 0:
                        break
                    # Train on until the events the test needs (applied globals, answered pulls), however fast
                    # the syncer merges next to these processes; every rank stops at the same step.
                    st = learner.status() if learner.is_leader else None
                    more = torch.tensor([int(st is not None and (st["applies"] < args.min_applies
                                                                 or min(st["pulls"], st["sends"]) < args.min_pulls))])
                    dist.broadcast(more, src=0)  # the leader is rank 0 (GroupLearner's default)
                    if not more.item():
                        break
                if time.monotonic() - start > args.max_seconds:
                    raise TimeoutError(f"rank {args.rank}: still running after {args.max_seconds} s")
                inner_step(model, opt, x, y, g, all_reduce=True)
                learner.step(BATCH)
                i += 1
                if learner.is_leader and i % 10 == 0:
                    write_json(args.out + ".progress.json", learner.status())
            result["status"] = learner.status()
    except (ddiloco.Error, RuntimeError) as e:  # the group went down (a rank died): say it and exit
        result["error"] = f"{type(e).__name__}: {e}"
        result["status"] = learner.status() if learner is not None else None
        code = 3
    result["params"] = [p.detach().numpy().tobytes().hex() for p in model.parameters()]
    write_json(f"{args.out}.{args.rank}.json", result)
    if code == 0:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(code)  # a group whose peer died may not shut down cleanly: do not wait for it


if __name__ == "__main__":
    main()
