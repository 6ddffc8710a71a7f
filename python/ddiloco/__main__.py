"""python -m ddiloco: ddiloco's console commands.

  python -m ddiloco syncer --tensors tensors.txt --init init.f32 --plaintext ...
  python -m ddiloco syncer --model mypackage.models:build --sync-every 8 --plaintext ...

`syncer` serves a Decoupled DiLoCo run from this interpreter: the same Syncer,
SyncerRuntime and ZeroMQ transport as the ddiloco_syncer program (through
ddiloco.Syncer), with the program's flag names. It prints the program's ready
line ("syncer: serving ... on ENDPOINT") and a status line on an interval,
checkpoints on an interval and on SIGTERM/SIGINT, and exits 0 after a signal,
2 for a bad argument (naming it and the fix), 1 for any other failure.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import sys
import time
from typing import List, Optional

PROG = "python -m ddiloco"
CODECS = ("fp32", "bf16", "fp16", "int8", "int4")


class _Usage(Exception):
    """A bad argument found after parsing (exit code 2, like argparse's own)."""


def _shard(text: str):
    index, slash, count = text.partition("/")
    if slash and index.isdigit() and count.isdigit() and int(count) >= 1 and int(index) < int(count):
        return int(index), int(count)
    raise argparse.ArgumentTypeError(f"'{text}' is not I/S with 0 <= I < S; e.g. 0/2 and 1/2 for two shards")


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer; give a whole number >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}; give a whole number >= {minimum}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def _number(low: float, high: Optional[float] = None, low_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
        bad = value != value or (value <= low if low_open else value < low) or (high is not None and value >= high)
        if bad:
            span = ("> " if low_open else ">= ") + f"{low:g}" + (f" and < {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{value:g} is out of range; give a number {span}")
        return value
    parse.__name__ = "number"
    return parse


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Names a flag's default when it has one worth naming (not None, not False, not already said)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False) or "(default" in text or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def syncer_parser(sub=None) -> argparse.ArgumentParser:
    description = (
        "The Decoupled DiLoCo syncer, served from Python: learners (ddiloco.Learner, ddiloco.GroupLearner or "
        "ddiloco_learner) join it, stream fragments of their parameters, and get the merged ones back. The same "
        "C++ Syncer, runtime and ZeroMQ transport as the ddiloco_syncer program, whose flag names these are.")
    epilog = (
        "Output: 'syncer: serving N tensors in P fragments (fingerprint F) on ENDPOINT, ...' once it listens (the "
        "ready line), 'status: ...' every --status-every-ms, 'syncer: checkpoint PATH' for each checkpoint. "
        "SIGTERM or SIGINT: stop serving, write a last checkpoint (with --checkpoint-dir) and the final status, "
        "exit 0. Exit 2: a bad argument; 1: another failure (a port in use, an unreadable file). "
        "Started again with the same --checkpoint-dir it resumes from the newest valid checkpoint there "
        "(ddiloco_export reads them). Not here (use the ddiloco_syncer program): Prometheus metrics, the "
        "admission bounds (--max-tokens-per-step, clipping, ...), --reference-model and safetensors --init. "
        "docs/python.md, 'The syncer from the console'.")
    usage = ("%(prog)s (--model MODULE:CALLABLE | --tensors FILE --init FILE.f32) (--plaintext | --keys FILE "
             "--allow FILE) [--bind ENDPOINT] [--fragments P] [--sync-every H] [--overlap TAU] [--checkpoint-dir DIR] "
             "[options]")
    kw = dict(description=description, epilog=epilog, usage=usage,
              formatter_class=_Formatter)
    p = sub.add_parser("syncer", help="serve a run (the ddiloco_syncer program's flags)", **kw) if sub else \
        argparse.ArgumentParser(prog=f"{PROG} syncer", **kw)
    m = p.add_argument_group("the model (one of --model or --tensors)")
    m.add_argument("--model", metavar="MODULE:CALLABLE",
                   help="a callable that returns the torch.nn.Module (or (name, tensor) pairs) the learners train, "
                        "in an importable module (pkg.models:build) or a file (path/models.py:build); its "
                        "parameters are the plan and the initial global, and the embeddings follow "
                        "ddiloco.default_embedding_rule unless --embedding names them")
    m.add_argument("--model-kwargs", metavar="JSON", default="{}",
                   help="keyword arguments of the --model callable, a JSON object")
    m.add_argument("--seed", metavar="N", type=int, default=None,
                   help="torch.manual_seed before calling the --model callable (default: not seeded)")
    m.add_argument("--embedding", metavar="NAMES", default=None,
                   help="--model: the parameters averaged plainly (comma-separated names), instead of the "
                        "default rule")
    m.add_argument("--tensors", metavar="FILE",
                   help="the model's tensor list (`name numel [embedding]` per line, model order), as "
                        "ddiloco_syncer reads it; with --init")
    m.add_argument("--init", metavar="FILE",
                   help="--tensors: the initial parameters, raw little-endian fp32 in list order")
    s = p.add_argument_group("serving")
    s.add_argument("--bind", "--endpoint", dest="bind", default="tcp://127.0.0.1:5555", metavar="ENDPOINT",
                   help="ZeroMQ endpoint to bind (tcp://0.0.0.0:PORT to serve other hosts; port * picks a free one)")
    s.add_argument("--endpoint-file", metavar="PATH", help="write the bound endpoint here (useful with port *)")
    s.add_argument("--plaintext", action="store_true",
                   help="run WITHOUT encryption or authentication (explicit choice, trusted networks only)")
    s.add_argument("--keys", metavar="FILE", help="the syncer's key file (ddiloco_keygen): CURVE security")
    s.add_argument("--allow", metavar="FILE", help="allow-list file: `<learner-id> <public-key>` per line")
    s.add_argument("--payload-crc", action="store_true",
                   help="under CURVE, compare each contribution's payload CRC-32C too (by default CURVE's MAC, "
                        "which covers every byte, is relied on)")
    s.add_argument("--workers", metavar="N", type=_count(1), default=2, help="merge worker threads")
    s.add_argument("--io-threads", metavar="N", type=_count(1), default=1,
                   help="ZeroMQ I/O threads the learners' connections are spread over (under CURVE each encrypts "
                        "about 0.65 GB/s; `ddiloco_sim size` says how many)")
    s.add_argument("--shard", metavar="I/S", type=_shard, default=(0, 1),
                   help="serve only shard I of S (from 0) of the fragments; run one syncer per shard and give "
                        "learners every shard's endpoint in shard order (default 0/1: not sharded)")
    a = p.add_argument_group("the algorithm (learners must match --fragments, --sync-every and --overlap)")
    a.add_argument("--fragments", metavar="P", type=_count(1), default=None,
                   help="P: number of fragments (whole tensors each; <= tensors) (default: min(4, tensors), as "
                        "ddiloco.Learner's; ddiloco_syncer's is 5)")
    a.add_argument("--sync-every", metavar="H", type=_count(1), default=24,
                   help="H: inner steps between two syncs of a fragment (a join with another H or tau is refused)")
    a.add_argument("--round", choices=("pull", "push"), default="pull",
                   help="pull: the paper's round, the syncer pulls each fragment at its slot (default); push: "
                        "learners send at their own slots (learners must use the same --round)")
    a.add_argument("--pull-timeout-ms", metavar="MS", type=_count(0), default=0,
                   help="pull rounds: longest wait for a round's answers, milliseconds (0: twice the larger of (tau + 1) measured steps and the pull-to-answer time)")
    a.add_argument("--reask-after-steps", metavar="N", type=_count(0), default=3,
                   help="pull rounds: ask a pulled learner once more when it has reported N steps past the pull with no "
                        "answer in (its pull or answer was likely lost; one of its two answers is merged); 0: never")
    a.add_argument("--overlap", metavar="TAU", type=_count(0), default=2, help="tau: steps from a send to the application of its "
                                                                 "result (< --sync-every)")
    a.add_argument("--quorum", metavar="K", type=_count(1), default=1, help="K: minimum distinct contributions before a merge")
    a.add_argument("--grace-gamma", metavar="X", type=_number(0.0), default=0.3,
                   help="gamma: safety factor of the adaptive grace window (0 disables the window)")
    a.add_argument("--grace-cap-ms", metavar="MS", type=_count(0), default=1000, help="cap of the grace window, milliseconds")
    a.add_argument("--deadline-ms", metavar="MS", type=_count(1), default=60000, help="hard bound of a round, milliseconds")
    a.add_argument("--max-staleness", metavar="N", type=_count(0), default=8,
                   help="versions a contribution's base may lag before it is rejected and answered")
    a.add_argument("--heartbeat-timeout-ms", metavar="MS", type=_count(1), default=10000,
                   help="a learner silent this long is declared dead")
    a.add_argument("--send-merged-to", choices=("alive", "contributors"), default="alive",
                   help="who gets a merged fragment: every live learner, or the merge's contributors")
    a.add_argument("--merge", choices=("rda", "average"), default="rda",
                   help="merge rule: token-weighted RDA (embeddings averaged) or a plain weighted average")
    a.add_argument("--outer-optimizer", choices=("nesterov", "sgd", "average"), default="nesterov",
                   help="the outer step")
    a.add_argument("--outer-lr", metavar="X", type=_number(0.0, low_open=True), default=0.7, help="outer learning rate")
    a.add_argument("--outer-momentum", metavar="X", type=_number(0.0, 1.0), default=0.9, help="outer Nesterov momentum")
    a.add_argument("--global-codec", choices=CODECS, default="fp32", help="codec of the fragments sent to learners")
    o = p.add_argument_group("state and output")
    o.add_argument("--checkpoint-dir", metavar="DIR",
                   help="resume from the newest valid checkpoint here and write checkpoints into it (default: none)")
    o.add_argument("--checkpoint-every-ms", metavar="MS", type=_count(1), default=30000,
                   help="checkpoint interval, milliseconds (also on SIGTERM/SIGINT)")
    o.add_argument("--status-every-ms", metavar="MS", type=_count(1), default=5000, help="status line interval, milliseconds")
    o.add_argument("--status-file", metavar="PATH",
                   help="also write the latest status as key=value lines to this file (atomically), as "
                        "ddiloco_syncer does")
    return p


def main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="ddiloco's console commands (Decoupled DiLoCo for PyTorch).",
        epilog=f"`{PROG} COMMAND --help` lists a command's flags. docs/python.md has the whole Python API.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    syncer_parser(sub)
    return p


# ---- the model ----------------------------------------------------------------------------------

def _load_callable(spec: str):
    if ":" not in spec:
        raise _Usage(f"--model '{spec}' names no callable; give MODULE:CALLABLE (pkg.models:build) or "
                     "FILE.py:CALLABLE")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise _Usage(f"--model '{spec}': file '{where}' does not exist; check the path")
        module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))  # its own imports, as `python FILE` would
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise _Usage(f"--model '{spec}': cannot import '{where}' ({e}); put it on PYTHONPATH or give "
                         "path/to/file.py:CALLABLE") from None
    target = module
    for part in name.split("."):
        if not hasattr(target, part):
            raise _Usage(f"--model '{spec}': '{where}' has no '{name}'; name a function or class in it")
        target = getattr(target, part)
    if not callable(target):
        raise _Usage(f"--model '{spec}': '{name}' is not callable; name a function or class that returns the model")
    return target


def build_syncer(args, ddiloco):
    """The ddiloco.Syncer the parsed flags describe, not yet started, and a line naming the model."""
    import numpy as np
    common = dict(bind=args.bind, plaintext=args.plaintext, keys=args.keys, allow=args.allow,
                  payload_crc=args.payload_crc,
                  fragments=args.fragments, overlap=args.overlap, quorum=args.quorum, grace_gamma=args.grace_gamma,
                  grace_cap=args.grace_cap_ms / 1e3, deadline=args.deadline_ms / 1e3,
                  max_staleness=args.max_staleness, heartbeat_timeout=args.heartbeat_timeout_ms / 1e3,
                  send_merged_to=args.send_merged_to, merge=args.merge, outer_optimizer=args.outer_optimizer,
                  outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, global_codec=args.global_codec,
                  workers=args.workers, io_threads=args.io_threads, sync_every=args.sync_every, round=args.round,
                  pull_timeout=args.pull_timeout_ms / 1e3, reask_after_steps=args.reask_after_steps,
                  checkpoint_dir=args.checkpoint_dir, shard=args.shard,
                  start=False)
    if args.model:
        try:
            kwargs = json.loads(args.model_kwargs)
        except ValueError as e:
            raise _Usage(f"--model-kwargs '{args.model_kwargs}' is not JSON ({e}); give an object such as "
                         "'{\"width\": 64}'") from None
        if not isinstance(kwargs, dict):
            raise _Usage(f"--model-kwargs '{args.model_kwargs}' is not a JSON object; give one such as "
                         "'{\"width\": 64}'")
        factory = _load_callable(args.model)
        import torch
        if args.seed is not None:
            torch.manual_seed(args.seed)
        model = factory(**kwargs)
        embedding = None if args.embedding is None else [n for n in args.embedding.split(",") if n]
        syncer = ddiloco.Syncer(model, embedding=embedding, **common)
        return syncer, f"--model {args.model}"
    path = args.tensors
    specs = ddiloco._core.read_tensor_list(path)
    total = sum(s[1] for s in specs)
    size = os.path.getsize(args.init) if os.path.isfile(args.init) else -1
    if size < 0:
        raise _Usage(f"--init '{args.init}' does not exist; give the raw fp32 file of the initial parameters")
    if size != 4 * total:
        raise _Usage(f"--init '{args.init}' holds {size} bytes but --tensors '{path}' lists {total} parameters "
                     f"({4 * total} bytes of little-endian fp32); give the values of this tensor list, in its order")
    init = np.fromfile(args.init, dtype="<f4").astype(np.float32, copy=False)
    if not np.any(init):
        raise _Usage(f"--init '{args.init}' holds only zeros: a model trained from zeros keeps its symmetric units "
                     "identical; give the model's real initial weights")
    return ddiloco.Syncer.from_tensor_list(path, init=init, **common), f"--tensors {path}"


def check_args(args) -> None:
    """What argparse cannot check one flag at a time."""
    if bool(args.model) == bool(args.tensors):
        raise _Usage("give the model with exactly one of --model MODULE:CALLABLE or --tensors FILE (with --init "
                     "FILE.f32)" + (", not both" if args.model else ""))
    if args.tensors and not args.init:
        raise _Usage("--tensors needs --init FILE.f32 (the initial parameters, raw little-endian fp32 in list order)")
    if args.model and args.init:
        raise _Usage("--init goes with --tensors; --model's parameters are the initial values: drop --init")
    if not args.model and (args.embedding is not None or args.seed is not None or args.model_kwargs != "{}"):
        raise _Usage("--embedding, --seed and --model-kwargs go with --model (a tensor list marks its own "
                     "embeddings)")
    if args.overlap >= args.sync_every:
        raise _Usage(f"--overlap {args.overlap} must be below --sync-every {args.sync_every} (tau < H)")
    if args.plaintext and (args.keys or args.allow):
        raise _Usage("--plaintext turns security off; drop --keys/--allow, or drop --plaintext to use CURVE")
    if not args.plaintext and not (args.keys and args.allow):
        raise _Usage("CURVE security needs --keys (the syncer's key file) and --allow (the learners' allow-list, "
                     "ddiloco_keygen makes both); pass --plaintext to run unencrypted on a trusted network")
    if not args.bind.startswith(("tcp://", "ipc://", "inproc://")):
        raise _Usage(f"--bind '{args.bind}' is not a ZeroMQ endpoint; give tcp://HOST:PORT (port * for a free one)")


# ---- serving ------------------------------------------------------------------------------------

def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def status_lines(st: dict, extra: dict) -> str:
    """key=value lines, with ddiloco_syncer's status file's names where they exist."""
    rows = {"learners_alive": st["learners_alive"], "learners_known": st["learners_known"], "joins": st["joins"],
            "leaves": st["leaves"], "deaths": st["deaths"], "merges": st["merges"],
            "accepted": st["contributions_accepted"], "rejected": st["rejected_total"],
            "rejoin_requests": st["rejoin_requests"]}
    rows.update({f"rejected_{k}": v for k, v in st["rejected"].items()})
    rows.update({k: st[k] for k in ("decode_errors", "auth_denied", "impersonations", "bytes_in", "bytes_out",
                                    "frames_in", "frames_out", "global_step", "pull_rounds", "pulls_sent",
                                    "pull_timeouts", "pull_rounds_empty", "pulls_repeated", "answers_redundant")})
    for i, f in enumerate(st["fragments"]):
        rows[f"fragment_{i}_version"] = f["version"]
        rows[f"fragment_{i}_merges"] = f["merges"]
    rows.update(extra)
    return "".join(f"{k}={v}\n" for k, v in rows.items())


def serve(args) -> int:
    import ddiloco  # imported here: `--help` and argument errors need neither torch nor the compiled core

    stop = {"signal": 0}

    def on_signal(sig, frame):
        stop["signal"] = sig

    try:
        syncer, source = build_syncer(args, ddiloco)
    except (ddiloco.InvalidArgument, ddiloco.ShapeMismatch, TypeError, ValueError) as e:
        raise _Usage(str(e)) from None
    try:
        names = syncer.names
        fragments = len(syncer.status()["fragments"])
        for problem in syncer.skipped_checkpoints:
            print(f"syncer: skipped damaged checkpoint {problem}", flush=True)
        numel = sum(syncer.numels)
        print(f"syncer: {len(names)} tensors, {numel} parameters from {source}", flush=True)
        if syncer.resumed_from:
            print(f"syncer: resumed from {syncer.resumed_from}", flush=True)
        elif args.checkpoint_dir:
            print(f"syncer: no valid checkpoint in {args.checkpoint_dir}, starting fresh", flush=True)
        # Handlers before serving: a signal from here on stops cleanly (with a checkpoint).
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        print("syncer: contribution payloads: " + (
            "codes and norms checked, CRC-32C not compared (CURVE authenticates every byte; --payload-crc to "
            "compare it too)" if syncer.status()["payload_checks"] == "authenticated"
            else "codes, norms and CRC-32C checked"), flush=True)
        syncer.start()
        if args.endpoint_file:
            _write_atomic(args.endpoint_file, syncer.endpoint + "\n")
        print(f"syncer: serving {len(names)} tensors in {fragments} fragments (fingerprint {syncer.fingerprint:016x}) "
              f"on {syncer.endpoint}, K = {args.quorum}, merged fragments to {args.send_merged_to}", flush=True)
        if args.shard[1] > 1:
            served = [str(p) for p, f in enumerate(syncer.status()["fragments"]) if f["served"]]
            print(f"syncer: shard {args.shard[0]}/{args.shard[1]}: fragments {','.join(served)}", flush=True)
        checkpoints = 0

        def checkpoint() -> None:
            nonlocal checkpoints
            if args.checkpoint_dir:
                print(f"syncer: checkpoint {syncer.checkpoint()}", flush=True)
                checkpoints += 1

        def report() -> None:
            st = syncer.status()
            print(f"status: {st['line']} decode-errors {st['decode_errors']} auth-denied {st['auth_denied']} "
                  f"rejoin-requests {st['rejoin_requests']}", flush=True)
            if args.status_file:
                _write_atomic(args.status_file, status_lines(st, {"checkpoints": checkpoints}))

        now = time.monotonic()
        next_status = now + args.status_every_ms / 1e3
        next_checkpoint = now + args.checkpoint_every_ms / 1e3
        report()
        while stop["signal"] == 0:
            time.sleep(0.05)  # wakes to notice a signal; the status and checkpoints follow their intervals
            now = time.monotonic()
            if now >= next_checkpoint:
                checkpoint()
                next_checkpoint = time.monotonic() + args.checkpoint_every_ms / 1e3
            if now >= next_status:
                report()
                next_status = now + args.status_every_ms / 1e3
        print(f"syncer: signal {stop['signal']}: stopping", flush=True)
        syncer.stop()
        checkpoint()
        report()
        return 0
    finally:
        syncer.close()


def main(argv: Optional[List[str]] = None) -> int:
    parser = main_parser()
    args = parser.parse_args(argv)
    sub = syncer_parser()  # for its `prog` in messages
    try:
        check_args(args)
        return serve(args)
    except _Usage as e:
        sub.error(str(e))  # prints the usage and the message, exits 2
    except Exception as e:  # noqa: BLE001: a failure the user must read, not a traceback
        print(f"{PROG} syncer: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
