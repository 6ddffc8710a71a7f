#!/usr/bin/python3
"""Train a small character GPT (examples/python/gpt.py) on the fortunes corpus in plain PyTorch,
either with Decoupled DiLoCo or with torch DDP, at the same token budget and process count.

  --mode ddiloco   M learners as processes against a ddiloco_syncer: M - 1 single-process learners
                   and, with --group-ranks R > 1, one learner that is an R-rank torch.distributed
                   (gloo) group. Each learner runs AdamW on its own data shard and calls
                   ddiloco's Learner.step() after every optimizer step.
  --mode ddp       the same number of processes as one torch DDP (gloo) data-parallel job: every
                   step all-reduces the gradients.

Every process trains --steps steps on --batch windows of --context characters, so both modes see
(processes x steps x batch x context) tokens. Process 0 evaluates its parameters on a fixed
validation set every --eval-every steps (its evaluation time is left out of the time axis); in
ddiloco mode the syncer's global parameters are evaluated at the end as well (the syncer's
checkpoint, written on SIGTERM, exported by ddiloco_export). Writes OUT/results.json; plot with
examples/python/plot.py. Examples (from the repository root, after building ddiloco_python,
ddiloco_syncer, ddiloco_export and onednn_sgemm):

  PYTHONPATH=build/python /usr/bin/python3 examples/python/train_gpt.py --mode ddiloco \\
      --start-syncer build/programs/ddiloco_syncer --out results/python/ddiloco
  PYTHONPATH=build/python /usr/bin/python3 examples/python/train_gpt.py --mode ddp --out results/python/ddp

A syncer started by hand: `--write-model DIR` writes the tensor list and initial values and prints
the ddiloco_syncer command that serves them; then pass its address with --syncer tcp://HOST:PORT.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_SGEMM = os.path.join(REPO, "build", "examples", "python", "libonednn_sgemm.so")

TINY = dict(width=32, layers=1, heads=2, context=32, batch=8, eval_batches=4, eval_every=10, sync_every=6,
            log_every=10)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["ddiloco", "ddp"], default="ddiloco", help="(default: %(default)s)")
    ap.add_argument("--out", default="results/python/run", help="output folder (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=1000, help="inner steps per process (default: %(default)s)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model and schedule for smoke tests: " + ", ".join(f"{k}={v}" for k, v in TINY.items()))
    ap.add_argument("--learners", type=int, default=3, help="ddiloco: M learners (default: %(default)s)")
    ap.add_argument("--group-ranks", type=int, default=2,
                    help="ranks of the last learner (a torch.distributed group); 1: every learner is one process "
                         "(default: %(default)s)")
    g = ap.add_argument_group("model and data")
    g.add_argument("--width", type=int, default=64, help="(default: %(default)s)")
    g.add_argument("--layers", type=int, default=2, help="(default: %(default)s)")
    g.add_argument("--heads", type=int, default=4, help="(default: %(default)s)")
    g.add_argument("--context", type=int, default=32, help="characters per window (default: %(default)s)")
    g.add_argument("--batch", type=int, default=16, help="windows per process and step (default: %(default)s)")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)")
    g.add_argument("--warmup", type=int, default=20, help="linear warm-up steps (default: %(default)s)")
    g.add_argument("--seed", type=int, default=1, help="initial parameters and data order (default: %(default)s)")
    g.add_argument("--fortunes", default="/usr/share/games/fortunes", help="corpus folder (default: %(default)s)")
    g.add_argument("--eval-every", type=int, default=50,
                   help="process 0 evaluates every N steps (default: %(default)s)")
    g.add_argument("--eval-batches", type=int, default=16, help="validation batches (default: %(default)s)")
    d = ap.add_argument_group("ddiloco")
    d.add_argument("--start-syncer", metavar="PATH", help="start this ddiloco_syncer program for the run")
    d.add_argument("--syncer", metavar="ENDPOINT", help="use a running syncer (see --write-model)")
    d.add_argument("--export", metavar="PATH",
                   help="ddiloco_export program, to evaluate the final global (default: next to --start-syncer)")
    d.add_argument("--write-model", metavar="DIR",
                   help="write DIR/tensors.txt and DIR/init.f32, print the ddiloco_syncer command, and exit")
    d.add_argument("--fragments", type=int, default=4, help="P (default: %(default)s)")
    d.add_argument("--sync-every", type=int, default=24, help="H (default: %(default)s)")
    d.add_argument("--overlap", type=int, default=2, help="tau (default: %(default)s)")
    d.add_argument("--round", choices=["pull", "push"], default="pull",
                   help="round mode of the syncer and every learner (default: %(default)s)")
    d.add_argument("--outer-lr", type=float, default=0.7, help="(default: %(default)s)")
    d.add_argument("--outer-momentum", type=float, default=0.5, help="(default: %(default)s)")
    o = ap.add_argument_group("running")
    o.add_argument("--log-every", type=int, default=50, help="progress line every N steps (default: %(default)s)")
    o.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds the whole run may take before it is stopped (default: %(default)s)")
    o.add_argument("--sgemm", default=DEFAULT_SGEMM,
                   help="libonednn_sgemm.so (float32 GEMMs on oneDNN instead of Debian's reference BLAS; "
                        "'off': the system BLAS) (default: %(default)s)")
    o.add_argument("--sched", choices=["batch", "normal"], default="batch",
                   help="Linux scheduling policy of the training processes: batch (SCHED_BATCH: a thread that "
                        "wakes, such as ZeroMQ's or gloo's I/O thread, does not preempt the training thread, "
                        "which matters when processes outnumber cores) or normal (default: %(default)s)")
    o.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    o.add_argument("--process", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return a
    explicit = {k.lstrip("-").replace("-", "_") for k in (argv if argv is not None else sys.argv[1:])
                if k.startswith("--")}
    if a.tiny:
        for k, v in TINY.items():
            if k not in explicit:
                setattr(a, k, v)
    for name in ("steps", "learners", "group_ranks", "width", "layers", "heads", "context", "batch", "warmup",
                 "eval_every", "eval_batches", "fragments", "sync_every", "log_every"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} = {getattr(a, name)} must be >= 1")
    for name in ("lr", "outer_lr", "timeout"):
        if not getattr(a, name) > 0:
            ap.error(f"--{name.replace('_', '-')} = {getattr(a, name)} must be > 0")
    if not 0 <= a.outer_momentum < 1:
        ap.error(f"--outer-momentum = {a.outer_momentum} must be in [0, 1)")
    if not 0 <= a.overlap < a.sync_every:
        ap.error(f"--overlap = {a.overlap} must be in [0, --sync-every = {a.sync_every})")
    if a.mode == "ddiloco" and not a.write_model:
        if bool(a.start_syncer) == bool(a.syncer):
            ap.error("--mode ddiloco needs exactly one of --start-syncer PATH (the ddiloco_syncer program) or "
                     "--syncer tcp://HOST:PORT (a running one, see --write-model)")
        if a.start_syncer and not os.access(a.start_syncer, os.X_OK):
            ap.error(f"--start-syncer {a.start_syncer} is not an executable; build it with "
                     "`cmake --build build --target ddiloco_syncer` (build/programs/ddiloco_syncer)")
        if a.syncer and not a.syncer.startswith(("tcp://", "ipc://")):
            ap.error(f"--syncer {a.syncer} is not a ZeroMQ endpoint; give tcp://HOST:PORT")
    if a.mode == "ddp" and (a.start_syncer or a.syncer):
        ap.error("--mode ddp uses no syncer; drop --start-syncer / --syncer")
    return a


def load_sgemm(path: str) -> bool:
    """Interposes oneDNN's sgemm for torch's float32 GEMMs; must run before `import torch`."""
    if path == "off":
        return False
    if not os.path.exists(path):
        print(f"note: {path} not found (build it: cmake --build build --target onednn_sgemm); torch's float32 "
              "GEMMs use the system BLAS, which on Debian is the slow reference BLAS", file=sys.stderr)
        return False
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return True


# ---- shared by launcher and workers ------------------------------------------------------------

def layout(cfg: dict):
    """(learner id, rank in the learner, ranks of the learner) for every process."""
    if cfg["mode"] == "ddp":
        return [(0, p, cfg["processes"]) for p in range(cfg["processes"])]
    singles = cfg["learners"] - (1 if cfg["group_ranks"] > 1 else 0)
    out = [(i, 0, 1) for i in range(singles)]
    if cfg["group_ranks"] > 1:
        out += [(singles, r, cfg["group_ranks"]) for r in range(cfg["group_ranks"])]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- worker ------------------------------------------------------------------------------------

def worker(config_path: str, process: int) -> int:
    with open(config_path) as f:
        cfg = json.load(f)
    sgemm = load_sgemm(cfg["sgemm"])
    if cfg["sched"] == "batch" and hasattr(os, "SCHED_BATCH"):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # threads made from here on inherit it
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    import gpt

    torch.set_num_threads(1)
    learner_id, rank, ranks = layout(cfg)[process]
    tag = f"[{cfg['mode']} p{process}" + (f" L{learner_id}" if cfg["mode"] == "ddiloco" else "") + \
          (f" r{rank}/{ranks}" if ranks > 1 else "") + "]"
    corpus = {k: v.long() for k, v in torch.load(os.path.join(cfg["out"], "corpus.pt")).items()}
    mc = gpt.GptConfig(context=cfg["context"], width=cfg["width"], heads=cfg["heads"], layers=cfg["layers"])
    model = gpt.Gpt(mc, seed=cfg["seed"])
    sampler = gpt.Sampler(corpus["train"], cfg["context"], cfg["batch"], seed=cfg["seed"] * 1000 + process,
                          index=process, count=cfg["processes"])
    val = gpt.validation_batches(gpt.Corpus(corpus["train"], corpus["validation"], 0, 0, 0), cfg["context"],
                                 cfg["batch"], cfg["eval_batches"]) if process == 0 else []
    tokens_per_step = cfg["batch"] * cfg["context"]

    group = None
    if ranks > 1 or cfg["mode"] == "ddp":
        port = cfg["ddp_port"] if cfg["mode"] == "ddp" else cfg["group_port"]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                                timeout=datetime.timedelta(seconds=300))  # above join_timeout
        group = dist.group.WORLD
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.01)

    # Training time: the wall (and this thread's CPU) seconds since the first step, less the
    # evaluations. The ddiloco calls: the same clocks around each call. On an oversubscribed machine
    # the wall time of a call also counts the time slices the thread lost inside it (to other
    # processes, or waiting for the other ranks of a group); the CPU time does not.
    curve, eval_s, eval_cpu, ddiloco_s, ddiloco_cpu, last_loss = [], 0.0, 0.0, 0.0, 0.0, float("nan")
    t_start = c_start = None
    by_kind = {k: [0, 0.0, 0.0] for k in ("sent", "applied", "nothing")}  # steps, wall s, CPU s of the calls
    losses = []

    def train_time() -> float:
        return 0.0 if t_start is None else time.perf_counter() - t_start - eval_s

    def record(step: int) -> None:
        nonlocal eval_s, eval_cpu
        at = train_time()
        c, t = time.thread_time(), time.perf_counter()
        v = gpt.evaluate(model, val)
        eval_s += time.perf_counter() - t
        eval_cpu += time.thread_time() - c
        curve.append({"step": step, "time_s": at, "tokens": step * tokens_per_step * cfg["processes"],
                      "val_loss": v})
        print(f"{tag} step {step} val {v:.4f} ({at:.1f} s)", flush=True)

    if process == 0:
        record(0)  # the initial parameters: the syncer's initial global in ddiloco mode
    learner, join_s = None, 0.0
    if cfg["mode"] == "ddiloco":
        import ddiloco
        t = time.perf_counter()
        kw = dict(endpoint=cfg["endpoint"], id=learner_id, plaintext=True, fragments=cfg["fragments"],
                  sync_every=cfg["sync_every"], overlap=cfg["overlap"], embedding=list(gpt.Gpt.EMBEDDING),
                  join_timeout=120.0, round=cfg["round"])
        if ranks > 1:
            learner = make_group_learner(ddiloco, model, group, rank, kw)
        else:
            learner = ddiloco.Learner(model, **kw).join()
        join_s = time.perf_counter() - t
    # DDP: the data-parallel job, or the data parallelism inside a group learner (made after the join,
    # so its initial broadcast from rank 0 carries the joined values).
    net = torch.nn.parallel.DistributedDataParallel(model) if group is not None else model

    eval_s = eval_cpu = 0.0  # the step-0 evaluation came before the first step: not in the training time
    c_start = time.thread_time()
    t_start = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        for group_ in opt.param_groups:
            group_["lr"] = cfg["lr"] * min(1.0, step / cfg["warmup"])
        x, y = sampler.next()
        opt.zero_grad(set_to_none=True)
        loss = gpt.loss_of(net, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # The CPU clock is read outside the wall window: reading it makes the kernel account the
        # thread's run time, and under load that is where it takes the core away (measured: an empty
        # window around one thread_time() call averaged 17 ms at load 18, one around getppid() 11 us).
        c1 = time.thread_time()
        t1 = time.perf_counter()
        report = None
        if learner is not None:
            report = learner.step(tokens_per_step * ranks)  # a group learner: the group's tokens (its leader's)
        t2 = time.perf_counter()
        c2 = time.thread_time()
        if report is not None:
            kind = by_kind["sent" if report.sent is not None else "applied" if report.applied else "nothing"]
            kind[0] += 1
            kind[1] += t2 - t1
            kind[2] += c2 - c1
        ddiloco_s += t2 - t1
        ddiloco_cpu += c2 - c1
        last_loss = loss.item()
        losses.append(last_loss)
        if process == 0 and (step % cfg["eval_every"] == 0 or step == cfg["steps"]):
            record(step)
        if rank == 0 and (step % cfg["log_every"] == 0 or step == cfg["steps"]):
            extra, train_s, train_cpu = "", train_time(), time.thread_time() - c_start - eval_cpu
            if learner is not None:
                st = learner.status()
                extra = f" | ddiloco {100 * ddiloco_s / train_s:.2f}% of step time " \
                        f"({100 * ddiloco_cpu / max(train_cpu, 1e-9):.2f}% of CPU), sends {st['sends']} " \
                        f"applies {st['applies']}"
            print(f"{tag} step {step}/{cfg['steps']} loss {last_loss:.4f} | "
                  f"{step * tokens_per_step * ranks / train_s:.0f} tok/s{extra}", flush=True)
    wall_s = time.perf_counter() - t_start
    train_s, train_cpu = train_time(), time.thread_time() - c_start - eval_cpu

    result = {"process": process, "learner": learner_id, "rank": rank, "ranks": ranks, "steps": cfg["steps"],
              "tokens": cfg["steps"] * tokens_per_step, "train_s": train_s, "eval_s": eval_s, "loop_wall_s": wall_s,
              "step_ms": 1e3 * train_s / cfg["steps"], "first_loss": losses[0], "last_loss": last_loss,
              "mean_last_loss": sum(losses[-20:]) / len(losses[-20:]), "curve": curve, "sgemm_onednn": sgemm}
    if learner is not None:
        st = learner.status() if rank == 0 else {}
        result.update({"ddiloco_s": ddiloco_s, "ddiloco_overhead_pct": 100.0 * ddiloco_s / train_s, "join_s": join_s,
                       "train_cpu_s": train_cpu, "ddiloco_cpu_s": ddiloco_cpu,
                       "ddiloco_overhead_cpu_pct": 100.0 * ddiloco_cpu / max(train_cpu, 1e-9),
                       "ddiloco_calls": {k: {"steps": v[0], "wall_s": v[1], "cpu_s": v[2]} for k, v in by_kind.items()},
                       "sends": st.get("sends", 0), "applies": st.get("applies", 0),
                       "late_applies": st.get("late_applies", 0), "bytes_sent": st.get("bytes_out", 0),
                       "bytes_received": st.get("bytes_in", 0)})
        learner.close()
    elif cfg["mode"] == "ddp":
        # Gloo does not count bytes: a ring all-reduce sends 2 (N - 1) / N of the gradient per rank and step.
        n, numel = cfg["processes"], sum(p.numel() for p in model.parameters())
        result["bytes_sent"] = int(cfg["steps"] * 2 * (n - 1) / n * 4 * numel)
        result["bytes_sent_is_estimate"] = True
    if group is not None:
        dist.destroy_process_group()
    with open(os.path.join(cfg["out"], f"process-{process}.json"), "w") as f:
        json.dump(result, f)
    # Everything is written and the learner has left: skip the interpreter's teardown, where torch
    # 1.13 can deadlock destroying DDP's gloo process group (its destructor joins a thread that
    # waits for the GIL the destroying thread holds).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_group_learner(ddiloco, model, group, rank, kw):
    """The learner of an R-rank group: ddiloco's group API (rank 0 talks to the syncer and broadcasts
    the fragments it applies; every rank applies them at the same inner step)."""
    # token_count="leader": the leader passes the group's tokens, which saves an all-reduce per step.
    return ddiloco.GroupLearner(model, group=group, leader=0, token_count="leader", **kw).join()


# ---- launcher ----------------------------------------------------------------------------------

def write_model(args, model, directory: str, embedding) -> tuple:
    """DIR/tensors.txt (name numel [embedding], model order) and DIR/init.f32 (raw little-endian fp32)."""
    import torch
    os.makedirs(directory, exist_ok=True)
    tensors, init = os.path.join(directory, "tensors.txt"), os.path.join(directory, "init.f32")
    with open(tensors, "w") as f:
        f.write("# examples/python/gpt.py: name numel [embedding], in model order\n")
        for name, p in model.named_parameters():
            f.write(f"{name} {p.numel()}{' embedding' if name in embedding else ''}\n")
    with torch.no_grad():
        torch.cat([p.reshape(-1) for p in model.parameters()]).numpy().astype("<f4").tofile(init)
    return tensors, init


def syncer_command(path: str, args, tensors: str, init: str, bind: str, out: str) -> list:
    return [path, "--bind", bind, "--tensors", tensors, "--init", init, "--fragments", str(args.fragments),
            "--sync-every", str(args.sync_every), "--overlap", str(args.overlap), "--round",
            args.round, "--outer-lr", str(args.outer_lr),
            "--outer-momentum", str(args.outer_momentum), "--plaintext", "--endpoint-file",
            os.path.join(out, "endpoint.txt"), "--checkpoint-dir", os.path.join(out, "checkpoints"),
            "--checkpoint-every-ms", "600000", "--status-every-ms", "10000",
            "--status-file", os.path.join(out, "syncer-status.txt")]


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launcher(args) -> int:
    sgemm = load_sgemm(args.sgemm)
    import torch

    sys.path.insert(0, HERE)
    import gpt

    out = os.path.abspath(args.out)
    mc = gpt.GptConfig(context=args.context, width=args.width, heads=args.heads, layers=args.layers)
    try:
        mc.check()
    except ValueError as e:
        raise SystemExit(f"train_gpt.py: {e}")
    model = gpt.Gpt(mc, seed=args.seed)
    numel = sum(p.numel() for p in model.parameters())
    if args.write_model:
        tensors, init = write_model(args, model, args.write_model, gpt.Gpt.EMBEDDING)
        cmd = syncer_command("ddiloco_syncer", args, tensors, init, "tcp://127.0.0.1:5555", args.write_model)
        print("serve this model with:\n  " + " ".join(cmd) + "\nthen run train_gpt.py with the same model, "
              "--fragments, --sync-every and --overlap flags and --syncer tcp://127.0.0.1:5555")
        return 0
    if args.mode == "ddiloco" and args.fragments > len(list(model.parameters())):
        raise SystemExit(f"train_gpt.py: --fragments = {args.fragments} exceeds the model's "
                         f"{len(list(model.parameters()))} tensors; use fewer fragments")
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name.startswith("process-") and name.endswith(".json"):
            os.remove(os.path.join(out, name))
    corpus = gpt.load_fortunes(args.fortunes)
    # Tokenised once for every process (ids < 97: one byte each on disk).
    torch.save({"train": corpus.train.to(torch.uint8), "validation": corpus.validation.to(torch.uint8)},
               os.path.join(out, "corpus.pt"))
    processes = args.learners - 1 + args.group_ranks  # the same count in both modes
    cfg = {k: getattr(args, k) for k in ("mode", "steps", "learners", "group_ranks", "width", "layers", "heads",
                                         "context", "batch", "lr", "warmup", "seed", "eval_every", "eval_batches",
                                         "fragments", "sync_every", "overlap", "round", "outer_lr", "outer_momentum",
                                         "log_every", "sgemm", "sched")}
    cfg.update(out=out, processes=processes, ddp_port=free_port(), group_port=free_port(), numel=numel)
    print(f"train_gpt: {args.mode}, {processes} processes, {numel} parameters, {args.steps} steps x {args.batch} x "
          f"{args.context} tokens per process = {processes * args.steps * args.batch * args.context} tokens; "
          f"float32 GEMMs on {'oneDNN' if sgemm else 'the system BLAS'}", flush=True)

    syncer = None
    t_run = time.perf_counter()
    try:
        if args.mode == "ddiloco":
            if args.start_syncer:
                tensors, init = write_model(args, model, out, gpt.Gpt.EMBEDDING)
                endpoint_file = os.path.join(out, "endpoint.txt")
                if os.path.exists(endpoint_file):
                    os.remove(endpoint_file)
                ck = os.path.join(out, "checkpoints")
                if os.path.isdir(ck):  # a fresh run: the syncer would resume from an old checkpoint
                    for name in os.listdir(ck):
                        os.remove(os.path.join(ck, name))
                log = open(os.path.join(out, "syncer.log"), "w")
                syncer = subprocess.Popen(syncer_command(args.start_syncer, args, tensors, init, "tcp://127.0.0.1:*",
                                                         out), stdout=log, stderr=subprocess.STDOUT)
                deadline = time.monotonic() + 60
                while not os.path.exists(endpoint_file):
                    if syncer.poll() is not None:
                        raise SystemExit(f"train_gpt.py: ddiloco_syncer exited with {syncer.returncode}; see "
                                         f"{out}/syncer.log")
                    if time.monotonic() > deadline:
                        raise SystemExit("train_gpt.py: ddiloco_syncer wrote no endpoint within 60 s; see "
                                         f"{out}/syncer.log")
                    time.sleep(0.05)
                with open(endpoint_file) as f:
                    cfg["endpoint"] = f.read().strip()
                print(f"train_gpt: ddiloco_syncer pid {syncer.pid} on {cfg['endpoint']} (log {out}/syncer.log)",
                      flush=True)
            else:
                cfg["endpoint"] = args.syncer
        config_path = os.path.join(out, "config.json")
        with open(config_path, "w") as f:
            json.dump(cfg, f, indent=1)
        workers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", config_path, "--process",
                                     str(p)]) for p in range(processes)]
        deadline = time.monotonic() + args.timeout
        done_at = None  # when every process had written its results
        try:
            while any(w.poll() is None for w in workers):
                if done_at is None and all(os.path.exists(os.path.join(out, f"process-{p}.json"))
                                           for p in range(processes)):
                    done_at = time.monotonic()
                if done_at is not None and time.monotonic() > done_at + 30:
                    late = [i for i, w in enumerate(workers) if w.poll() is None]
                    print(f"note: processes {late} wrote their results but did not exit within 30 s; stopping them",
                          file=sys.stderr)
                    stop([workers[i] for i in late])
                    break
                failed = [i for i, w in enumerate(workers) if w.poll() not in (None, 0)]
                if failed:
                    raise SystemExit(f"train_gpt.py: process {failed[0]} exited with "
                                     f"{workers[failed[0]].returncode}; stopping the run")
                if syncer is not None and syncer.poll() is not None:
                    raise SystemExit(f"train_gpt.py: ddiloco_syncer exited with {syncer.returncode} during the run; "
                                     f"see {out}/syncer.log")
                if time.monotonic() > deadline:
                    raise SystemExit(f"train_gpt.py: the run took longer than --timeout {args.timeout} s; stopped")
                time.sleep(0.2)
            failed = [i for i, w in enumerate(workers)
                      if w.returncode != 0 and not os.path.exists(os.path.join(out, f"process-{i}.json"))]
            if failed:
                raise SystemExit(f"train_gpt.py: process {failed[0]} exited with {workers[failed[0]].returncode}")
        finally:
            stop(workers)
        wall_s = time.perf_counter() - t_run
        results = collect(args, cfg, out, wall_s)
        if syncer is not None:
            syncer.send_signal(signal.SIGTERM)
            syncer.wait(timeout=60)
            syncer = None
            results["final_val_global"] = evaluate_global(args, model, out, gpt)
    finally:
        if syncer is not None:
            stop([syncer])
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    summary(results, out)
    return 0


def collect(args, cfg: dict, out: str, wall_s: float) -> dict:
    procs = []
    for p in range(cfg["processes"]):
        with open(os.path.join(out, f"process-{p}.json")) as f:
            procs.append(json.load(f))
    curve = procs[0]["curve"]
    res = {"mode": args.mode, "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
           "config": {k: v for k, v in cfg.items() if k not in ("ddp_port", "group_port")},
           "processes": cfg["processes"], "tokens": sum(p["tokens"] for p in procs), "wall_s": wall_s,
           "train_s": max(p["train_s"] for p in procs), "initial_val": curve[0]["val_loss"],
           "final_val": curve[-1]["val_loss"], "curve": curve,
           "first_train_loss": procs[0]["first_loss"], "final_train_loss": procs[0]["mean_last_loss"],
           "processes_detail": [{k: v for k, v in p.items() if k != "curve"} for p in procs]}
    learners = {}
    for p in procs:
        if p["rank"] == 0:
            learners[p["learner"]] = p
    res["bytes_sent_per_learner"] = (sum(p["bytes_sent"] for p in learners.values()) / len(learners)
                                     if args.mode == "ddiloco" else procs[0]["bytes_sent"])
    if args.mode == "ddiloco":
        res["ddiloco_overhead_pct"] = {str(p["process"]): p["ddiloco_overhead_pct"] for p in procs}
        res["ddiloco_overhead_pct_max"] = max(p["ddiloco_overhead_pct"] for p in procs)
        res["ddiloco_overhead_cpu_pct"] = {str(p["process"]): p["ddiloco_overhead_cpu_pct"] for p in procs}
        res["ddiloco_overhead_cpu_pct_max"] = max(p["ddiloco_overhead_cpu_pct"] for p in procs)
        status = os.path.join(out, "syncer-status.txt")
        if os.path.exists(status):
            with open(status) as f:
                res["syncer_status"] = dict(line.strip().split("=", 1) for line in f if "=" in line)
    return res


def evaluate_global(args, model, out: str, gpt):
    """Validation loss of the syncer's final global parameters (its SIGTERM checkpoint, exported), or None."""
    import torch
    export = args.export or os.path.join(os.path.dirname(os.path.abspath(args.start_syncer)), "ddiloco_export")
    if not os.access(export, os.X_OK):
        print(f"note: {export} not found (cmake --build build --target ddiloco_export): the final global is not "
              "evaluated", file=sys.stderr)
        return None
    path = os.path.join(out, "global.safetensors")
    r = subprocess.run([export, "--checkpoint", os.path.join(out, "checkpoints"), "--out", path],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        print(f"note: ddiloco_export failed ({r.returncode}): {r.stderr.strip()}", file=sys.stderr)
        return None
    values = gpt.read_safetensors(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(values[name].copy()).view(p.shape))
    corpus = {k: v.long() for k, v in torch.load(os.path.join(out, "corpus.pt")).items()}
    val = gpt.validation_batches(gpt.Corpus(corpus["train"], corpus["validation"], 0, 0, 0), args.context,
                                 args.batch, args.eval_batches)
    return gpt.evaluate(model, val)


def summary(r: dict, out: str) -> None:
    print(f"train_gpt: {r['mode']}: val loss {r['initial_val']:.4f} -> {r['final_val']:.4f} (process 0's parameters)"
          + (f", global {r['final_val_global']:.4f}" if r.get("final_val_global") is not None else "")
          + f"; {r['tokens']} tokens in {r['train_s']:.1f} s of training ({r['wall_s']:.1f} s wall); "
          f"{r['bytes_sent_per_learner'] / 1e6:.1f} MB sent per learner", flush=True)
    if r["mode"] == "ddiloco":
        print("train_gpt: time in ddiloco calls / step time, wall (CPU): " +
              ", ".join(f"process {k} {v:.2f}% ({r['ddiloco_overhead_cpu_pct'][k]:.2f}%)"
                        for k, v in r["ddiloco_overhead_pct"].items()), flush=True)
    print(f"train_gpt: wrote {out}/results.json", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.process)
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())
