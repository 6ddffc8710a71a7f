#!/usr/bin/python3
"""Checks the capacity planner (ddiloco_sim size, sim/capacity.hpp) against a running syncer.

Starts ddiloco_syncer on loopback with a synthetic model (--tensors T of 2^log2n
elements, zeros), and M learner processes (ddiloco.Learner over the same
tensors; each inner step adds a fixed small delta to every parameter and sleeps
--step-ms, so the step time is set and no real training runs). Once every
learner has joined and the syncer has merged every fragment twice, it samples
the syncer process over --window seconds: wire bytes in and out (the status
file), CPU seconds (/proc/PID/stat) and resident memory (/proc/PID/status,
minus that of the same syncer serving a 64-element model). It then runs
`ddiloco_sim size` with the same model, M, schedule, codecs and the learners'
measured step time, and prints the predicted and measured per-shard figures
side by side (one shard: the syncer is not sharded yet). Writes
results/sim/capacity_check.{json,md}.

    /usr/bin/python3 scripts/check_capacity.py [--build build] [--learners 3] [--log2n 20]
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


def start_syncer(build, tmp, name, tensor_lines, fragments, h):
    model = os.path.join(tmp, name + ".txt")
    with open(model, "w") as f:
        f.write("\n".join(tensor_lines) + "\n")
    ep, st = os.path.join(tmp, name + ".ep"), os.path.join(tmp, name + ".status")
    cmd = [os.path.join(build, "programs", "ddiloco_syncer"), "--tensors", model, "--allow-zero-init",
           "--fragments", str(fragments), "--sync-every", str(h), "--overlap", "1", "--round", "pull",
           "--plaintext", "--bind", "tcp://127.0.0.1:*", "--endpoint-file", ep, "--status-file", st,
           "--status-every-ms", "200", "--heartbeat-timeout-ms", "60000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, name + ".err"), "w"))
    endpoint = wait_for("the syncer's endpoint file", lambda: os.path.exists(ep) and open(ep).read().strip(), 60)
    return proc, endpoint, st, model


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
    ap.add_argument("--out", default="results/sim")
    a = ap.parse_args()
    n = 1 << a.log2n
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(a.build), "python"), PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory() as tmp:
        tiny, _, _, _ = start_syncer(a.build, tmp, "tiny", ["t0 64"], 1, a.sync_every)
        time.sleep(1.0)
        baseline_rss = proc_rss_bytes(tiny.pid)
        tiny.terminate()
        tiny.wait(30)

        lines = ["t%d %d" % (i, n) for i in range(a.tensors)]
        syncer, endpoint, status, model = start_syncer(a.build, tmp, "model", lines, a.tensors, a.sync_every)
        learners = [subprocess.Popen([sys.executable, "-c", LEARNER, endpoint, str(i), str(a.tensors), str(n),
                                      str(a.steps), str(a.step_ms / 1000.0), a.codec, str(a.sync_every)],
                                     env=env, stdout=subprocess.PIPE, text=True) for i in range(a.learners)]
        try:
            wait_for("every learner to join and two merges per fragment",
                     lambda: int(read_status(status).get("learners_alive", 0)) == a.learners and
                     int(read_status(status).get("merges", 0)) >= 2 * a.tensors, 300)
            s0, c0, t0 = read_status(status), proc_cpu_seconds(syncer.pid), time.monotonic()
            time.sleep(a.window)
            s1, c1, t1 = read_status(status), proc_cpu_seconds(syncer.pid), time.monotonic()
            rss = proc_rss_bytes(syncer.pid)
            if any(p.poll() is not None for p in learners):
                raise SystemExit("check_capacity: a learner ended inside the window; raise --steps")
            outputs = [p.communicate(timeout=600)[0] for p in learners]
        finally:
            for p in learners:
                if p.poll() is None:
                    p.kill()
            syncer.terminate()
            syncer.wait(30)
        step_s = []
        for out in outputs:
            m = re.search(r"steps (\d+) seconds ([0-9.]+)", out)
            if not m:
                raise SystemExit("check_capacity: a learner printed no timing: %r" % out)
            step_s.append(float(m.group(2)) / int(m.group(1)))
        step = sum(step_s) / len(step_s)
        elapsed = t1 - t0
        measured = {
            "in_mb_per_s": (int(s1["bytes_in"]) - int(s0["bytes_in"])) / elapsed / 1e6,
            "out_mb_per_s": (int(s1["bytes_out"]) - int(s0["bytes_out"])) / elapsed / 1e6,
            "cores": (c1 - c0) / elapsed,
            "rss_gib_above_baseline": (rss - baseline_rss) / 2**30,
        }
        sim = subprocess.run([os.path.join(a.build, "programs", "ddiloco_sim"), "size", model,
                              "--learners", str(a.learners), "--step", "%.6f" % step, "--codec", a.codec,
                              "--global-codec", "fp32", "--fragments", str(a.tensors), "--sync-every",
                              str(a.sync_every), "--overlap", "1", "--out", tmp],
                             capture_output=True, text=True)
        if sim.returncode not in (0, 3):
            raise SystemExit("check_capacity: ddiloco_sim size failed: " + sim.stderr)
        row = [l for l in sim.stdout.splitlines() if l.startswith("| 0 |")][0].strip("|").split("|")
        cells = [c.strip() for c in row]
        predicted = {"in_mb_per_s": float(cells[3]), "out_mb_per_s": float(cells[4]),
                     "cores": float(cells[5]) + float(cells[6]), "rss_gib_above_baseline": float(cells[7])}
    result = {"learners": a.learners, "tensors": a.tensors, "elements_per_tensor": n, "sync_every": a.sync_every,
              "codec": a.codec, "step_seconds": step, "window_seconds": elapsed, "baseline_rss_bytes": baseline_rss,
              "predicted": predicted, "measured": measured,
              "ratio": {k: measured[k] / predicted[k] for k in predicted if predicted[k] > 0}}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "capacity_check.json"), "w") as f:
        json.dump(result, f, indent=2)
    md = ["### Planner against a running syncer (%d learners, %d x 2^%d values, %s contributions, H = %d, step %.1f ms)\n"
          % (a.learners, a.tensors, a.log2n, a.codec, a.sync_every, step * 1e3),
          "| per shard | predicted | measured | measured / predicted |", "|---|---|---|---|"]
    names = {"in_mb_per_s": "bytes in, MB/s", "out_mb_per_s": "bytes out, MB/s",
             "cores": "CPU, cores (merge + I/O)", "rss_gib_above_baseline": "RSS above an empty syncer, GiB (steady)"}
    for k, label in names.items():
        md.append("| %s | %.3f | %.3f | %.2f |" % (label, predicted[k], measured[k], result["ratio"].get(k, 0)))
    text = "\n".join(md) + "\n"
    with open(os.path.join(a.out, "capacity_check.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
