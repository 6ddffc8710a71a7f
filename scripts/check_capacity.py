#!/usr/bin/python3
"""Checks the capacity planner (ddiloco_sim size, sim/capacity.hpp) against a running syncer.

Starts ddiloco_syncer on loopback with a synthetic model (--tensors T of 2^log2n
elements, zeros), and M learner processes (ddiloco.Learner over the same
tensors; each inner step adds a fixed small delta to every parameter and sleeps
--step-ms, so the step time is set and no real training runs). Once every
learner has joined and the syncer has merged every fragment twice, it samples
the syncer process over --window seconds: wire bytes in and out (the status
file), CPU seconds (/proc/PID/stat) and resident memory (/proc/PID/status,
minus that of the same syncer serving a 64-element model), of each shard. It then runs
`ddiloco_sim size` with the same model, M, schedule, codecs and the learners'
measured step time, and prints the predicted and measured per-shard figures
side by side for every shard. With --shards 1,2 it runs the same workload on
one syncer and then on two shards (--shard i/S, each learner given both
endpoints) and adds the busiest shard's figures as ratios of the unsharded
syncer's. Writes results/sim/capacity_check.{json,md} (--shards 1) or
results/sim/capacity_check_shards.{json,md}.

    /usr/bin/python3 scripts/check_capacity.py [--build build] [--learners 3] [--log2n 20] [--shards 1,2]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

LEARNER = r"""
import sys, time, torch, ddiloco
endpoint, lid, tensors, n, steps, step_s, codec, h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), sys.argv[7], int(sys.argv[8])
params = [("t%d" % i, torch.zeros(n)) for i in range(tensors)]
delta = torch.full((n,), 1e-4 * (1 + lid))
with ddiloco.Learner(params, endpoint=endpoint, id=lid, plaintext=True, fragments=tensors, sync_every=h,
                     overlap=1, codec=codec, round="pull", join_timeout=120) as learner:
    t0 = time.monotonic()
    for step in range(steps):
        with torch.no_grad():
            for _, p in params:
                p.add_(delta)
        time.sleep(step_s)
        learner.step(tokens=1024)
    elapsed = time.monotonic() - t0
print("learner %d steps %d seconds %.3f" % (lid, steps, elapsed), flush=True)
"""


def read_status(path):
    try:
        with open(path) as f:
            return dict(line.strip().split("=", 1) for line in f if "=" in line)
    except FileNotFoundError:
        return {}


def proc_cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def proc_rss_bytes(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS for pid %d" % pid)


def wait_for(what, predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit("check_capacity: timed out after %d s waiting for %s" % (timeout_s, what))


def start_syncer(build, tmp, name, tensor_lines, fragments, h, shard=(0, 1)):
    model = os.path.join(tmp, "model.txt")
    with open(model, "w") as f:
        f.write("\n".join(tensor_lines) + "\n")
    ep, st = os.path.join(tmp, name + ".ep"), os.path.join(tmp, name + ".status")
    cmd = [os.path.join(build, "programs", "ddiloco_syncer"), "--tensors", model, "--allow-zero-init",
           "--fragments", str(fragments), "--sync-every", str(h), "--overlap", "1", "--round", "pull",
           "--plaintext", "--bind", "tcp://127.0.0.1:*", "--endpoint-file", ep, "--status-file", st,
           "--status-every-ms", "200", "--heartbeat-timeout-ms", "60000", "--shard", "%d/%d" % shard]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, name + ".err"), "w"))
    endpoint = wait_for("the syncer's endpoint file", lambda: os.path.exists(ep) and open(ep).read().strip(), 60)
    return proc, endpoint, st, model


def run(a, shards, baseline_rss):
    """One run with `shards` syncer shards: the measured and predicted figures of each shard."""
    n = 1 << a.log2n
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(a.build), "python"), PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory() as tmp:
        lines = ["t%d %d" % (i, n) for i in range(a.tensors)]
        syncers = [start_syncer(a.build, tmp, "shard%d" % i, lines, a.tensors, a.sync_every, (i, shards))
                   for i in range(shards)]
        model = syncers[0][3]
        endpoints = ",".join(s[1] for s in syncers)  # every shard, in shard order
        learners = [subprocess.Popen([sys.executable, "-c", LEARNER, endpoints, str(i), str(a.tensors), str(n),
                                      str(a.steps), str(a.step_ms / 1000.0), a.codec, str(a.sync_every)],
                                     env=env, stdout=subprocess.PIPE, text=True) for i in range(a.learners)]
        try:
            def ready():
                for _, _, status, _ in syncers:
                    st = read_status(status)
                    served = a.tensors // shards  # equal tensors: each shard serves as many
                    if int(st.get("learners_alive", 0)) != a.learners or int(st.get("merges", 0)) < 2 * served:
                        return False
                return True
            wait_for("every learner to join every shard and two merges per fragment", ready, 300)
            s0 = [read_status(s[2]) for s in syncers]
            c0 = [proc_cpu_seconds(s[0].pid) for s in syncers]
            t0 = time.monotonic()
            time.sleep(a.window)
            s1 = [read_status(s[2]) for s in syncers]
            c1 = [proc_cpu_seconds(s[0].pid) for s in syncers]
            t1 = time.monotonic()
            rss = [proc_rss_bytes(s[0].pid) for s in syncers]
            if any(p.poll() is not None for p in learners):
                raise SystemExit("check_capacity: a learner ended inside the window; raise --steps")
            outputs = [p.communicate(timeout=600)[0] for p in learners]
        finally:
            for p in learners:
                if p.poll() is None:
                    p.kill()
            for proc, _, _, _ in syncers:
                proc.terminate()
                proc.wait(30)
        step_s = []
        for out in outputs:
            m = re.search(r"steps (\d+) seconds ([0-9.]+)", out)
            if not m:
                raise SystemExit("check_capacity: a learner printed no timing: %r" % out)
            step_s.append(float(m.group(2)) / int(m.group(1)))
        step = sum(step_s) / len(step_s)
        elapsed = t1 - t0
        measured = [{
            "in_mb_per_s": (int(b["bytes_in"]) - int(e["bytes_in"])) / elapsed / 1e6,
            "out_mb_per_s": (int(b["bytes_out"]) - int(e["bytes_out"])) / elapsed / 1e6,
            "cores": (cb - ce) / elapsed,
            "rss_gib_above_baseline": (r - baseline_rss) / 2**30,
        } for e, b, ce, cb, r in zip(s0, s1, c0, c1, rss)]
        sim = subprocess.run([os.path.join(a.build, "programs", "ddiloco_sim"), "size", model,
                              "--learners", str(a.learners), "--step", "%.6f" % step, "--codec", a.codec,
                              "--global-codec", "fp32", "--fragments", str(a.tensors), "--sync-every",
                              str(a.sync_every), "--overlap", "1", "--shards", str(shards), "--io-threads", "1",
                              "--security", "plaintext",
                              "--out", tmp],
                             capture_output=True, text=True)
        if sim.returncode not in (0, 3):
            raise SystemExit("check_capacity: ddiloco_sim size failed: " + sim.stderr)
        predicted = []
        for i in range(shards):
            row = [l for l in sim.stdout.splitlines() if l.startswith("| %d |" % i)][0].strip("|").split("|")
            cells = [c.strip() for c in row]
            predicted.append({"in_mb_per_s": float(cells[3]), "out_mb_per_s": float(cells[4]),
                              "cores": float(cells[5]) + float(cells[6]), "rss_gib_above_baseline": float(cells[9])})
    return {"shards": shards, "step_seconds": step, "window_seconds": elapsed, "predicted": predicted,
            "measured": measured,
            "ratio": [{k: m[k] / p[k] for k in p if p[k] > 0} for m, p in zip(measured, predicted)]}


NAMES = {"in_mb_per_s": "bytes in, MB/s", "out_mb_per_s": "bytes out, MB/s", "cores": "CPU, cores (merge + I/O)",
         "rss_gib_above_baseline": "RSS above an empty syncer, GiB (steady)"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--learners", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--log2n", type=int, default=20)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=50)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--window", type=float, default=8.0)
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--shards", default="1",
                    help="syncer shard counts to run, comma-separated (e.g. 1,2: the same workload on one "
                         "syncer, then on two shards); each must divide --tensors")
    ap.add_argument("--out", default="results/sim")
    a = ap.parse_args()
    counts = [int(v) for v in a.shards.split(",")]
    if any(c < 1 or a.tensors % c for c in counts):
        raise SystemExit("check_capacity: --shards %s: each count must be >= 1 and divide --tensors %d (equal "
                         "shards)" % (a.shards, a.tensors))
    with tempfile.TemporaryDirectory() as tmp:
        tiny, _, _, _ = start_syncer(a.build, tmp, "tiny", ["t0 64"], 1, a.sync_every)
        time.sleep(1.0)
        baseline_rss = proc_rss_bytes(tiny.pid)
        tiny.terminate()
        tiny.wait(30)
    runs = [run(a, c, baseline_rss) for c in counts]
    result = {"learners": a.learners, "tensors": a.tensors, "elements_per_tensor": 1 << a.log2n,
              "sync_every": a.sync_every, "codec": a.codec, "baseline_rss_bytes": baseline_rss, "runs": runs}
    md = []
    for r in runs:
        md += ["### Planner against a running syncer, %d shard%s (%d learners, %d x 2^%d values, %s contributions, "
               "H = %d, step %.1f ms)\n" % (r["shards"], "" if r["shards"] == 1 else "s", a.learners, a.tensors,
                                             a.log2n, a.codec, a.sync_every, r["step_seconds"] * 1e3),
               "| shard | per shard | predicted | measured | measured / predicted |", "|---|---|---|---|---|"]
        for i, (p, m, q) in enumerate(zip(r["predicted"], r["measured"], r["ratio"])):
            for k, label in NAMES.items():
                md.append("| %d | %s | %.3f | %.3f | %.2f |" % (i, label, p[k], m[k], q.get(k, 0)))
        md.append("")
    if len(runs) > 1:
        one = runs[0]
        md += ["### The same workload on %s shards, measured in one run of this script\n" % a.shards,
               "| shards | busiest shard's bytes in, MB/s | its RSS above empty, GiB | its CPU, cores | "
               "learner step, ms |", "|---|---|---|---|---|"]
        for r in runs:
            busiest = max(r["measured"], key=lambda m: m["in_mb_per_s"])
            md.append("| %d | %.1f (%.2f of S = %d) | %.3f (%.2f) | %.3f (%.2f) | %.1f (%.2f) |" % (
                r["shards"], busiest["in_mb_per_s"], busiest["in_mb_per_s"] / one["measured"][0]["in_mb_per_s"],
                one["shards"], busiest["rss_gib_above_baseline"],
                busiest["rss_gib_above_baseline"] / one["measured"][0]["rss_gib_above_baseline"],
                busiest["cores"], busiest["cores"] / one["measured"][0]["cores"], r["step_seconds"] * 1e3,
                r["step_seconds"] / one["step_seconds"]))
        md.append("")
    text = "\n".join(md)
    os.makedirs(a.out, exist_ok=True)
    stem = "capacity_check" if counts == [1] else "capacity_check_shards"
    with open(os.path.join(a.out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(a.out, stem + ".md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
