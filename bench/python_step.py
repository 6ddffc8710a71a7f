#!/usr/bin/python3
"""Cost of ddiloco.Learner.step() from Python against the C++ OuterLoop::step it drives.

    PYTHONPATH=build/python /usr/bin/python3 bench/python_step.py --cpp build/bench/bench_transport

With --cpp, the C++ twin BM_LearnerStepNothingDueZmq (bench_transport: the same
OuterLoop, tensors and ZeroMQ syncer on loopback, 15 repetitions) runs first and
the ratio of the two medians is printed (target: Python within 10% of C++); after
the due case, its twin BM_LearnerStepFragmentDueZmq (the same fragment, P, H,
tau, codec and syncer, 15 repetitions of 10 pairs of steps) runs and that ratio
is printed too.
bench_syncer's BM_LearnerStepNothingDue is the same step over the in-process
transport (no ZeroMQ drain).

nothing due: P = 24 fragments of 24 tensors of 1024 floats, H = 24 * 2^16 (no
send for 2^16 steps), over a real Syncer on loopback ZeroMQ: the same setting as
the C++ BM_LearnerStepNothingDue. Prints the median per call over 15 batches.
The same in pull rounds (the default): nothing is pulled, each step hands the
learner's metadata (step counter and tokens) to the transport, which coalesces
them (at most one frame a millisecond); then with every step's sent.
due: one fragment of `--due-floats` floats (P = 1, H = 2, tau = 1): every
other step sends it (fp32, encoded into the ZeroMQ frame) and the steps between
apply the merged global if it has arrived (never waiting); the median per pair
of steps, with the sends and applies counted.
The C++ side of the send is bench_syncer's BM_LearnerSendPath (over an
in-process framing transport instead of ZeroMQ); over ZeroMQ it is
bench_transport's BM_LearnerStepFragmentDueZmq.
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch

import ddiloco


def per_call(fn, calls, batches=15, cpu=None):
    """Median and minimum wall ns per call over `batches` batches of `calls` calls; with a list
    `cpu`, the median of this thread's CPU ns per call is appended to it (Google Benchmark's
    CPU time is the benchmark thread's too, so the two compare on a loaded machine)."""
    times, cpus = [], []
    for _ in range(batches):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - t0) / calls)
        cpus.append((time.thread_time_ns() - c0) / calls)
    if cpu is not None:
        cpu.append(statistics.median(cpus))
    return statistics.median(times), min(times)


def nothing_due(cpu=None, round="push", metadata_interval=0.001):
    """push: nothing is due for 2^16 steps. pull: nothing is pulled (the first round of each
    fragment opens only after 2^16 global steps), and every step hands its metadata to the
    transport, which sends at most one per `metadata_interval` seconds (0: every step's)."""
    params = [(f"t{i}", torch.zeros(1024)) for i in range(24)]
    with ddiloco.Syncer(params, plaintext=True, fragments=24, round=round,
                        sync_every=0 if round == "push" else 24 << 16) as s:
        with ddiloco.Learner(params, endpoint=s.endpoint, id=1, plaintext=True, fragments=24,
                             sync_every=24 << 16, round=round, metadata_interval=metadata_interval) as ln:
            med, best = per_call(lambda: ln.step(1), 4000, cpu=cpu)
            st = ln.status()
            assert st["sends"] == 0, st
            if round == "pull":
                assert st["metadata_sent"] >= 15 * 4000, st
    return med, best


_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


def cpp_bench(binary, name):
    """Median and minimum real ns per iteration, and median CPU ns, of bench_transport's `name`
    over its repetitions, with the last repetition's counters."""
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"--cpp {binary} is not an executable; build it: cmake --build build --target bench_transport")
    r = subprocess.run([binary, f"--benchmark_filter=^{name}(/|$)", "--benchmark_format=json"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{binary} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    runs = [b for b in json.loads(r.stdout)["benchmarks"] if b.get("run_type") == "iteration"]
    if not runs:
        raise SystemExit(f"{binary} ran no {name}; is it bench_transport built from this tree?")
    real = [b["real_time"] * _NS[b.get("time_unit", "ns")] for b in runs]
    cpu = [b["cpu_time"] * _NS[b.get("time_unit", "ns")] for b in runs]
    return statistics.median(real), min(real), statistics.median(cpu), runs[-1]


def cpp_nothing_due(binary):
    """Median and minimum ns per step of BM_LearnerStepNothingDueZmq over its repetitions."""
    return cpp_bench(binary, "BM_LearnerStepNothingDueZmq")[:3]


def cpp_fragment_due(binary):
    """Median and minimum ns per pair of steps of BM_LearnerStepFragmentDueZmq (2^20 floats,
    P = 1, H = 2, tau = 1: the `due` setting below) over its repetitions, and its counters."""
    return cpp_bench(binary, "BM_LearnerStepFragmentDueZmq")


def binding_call(ln):
    """One trivial call into the compiled module (a property read), for the share of the binding itself."""
    core = ln._core
    med, _ = per_call(lambda: core.joined, 4000)
    return med


def due(n, cpu=None):
    params = [("w", torch.zeros(n))]
    with ddiloco.Syncer(params, plaintext=True, fragments=1, overlap=1, round="push", sync_every=2) as s:
        with ddiloco.Learner(params, endpoint=s.endpoint, id=1, plaintext=True, fragments=1, sync_every=2,
                             overlap=1, round="push") as ln:
            def pair():
                ln.step(1)
                ln.step(1)
            med, best = per_call(pair, 10, batches=15, cpu=cpu)
            st = ln.status()
            assert st["sends"] > 0
    return med, best, st


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--due-floats", type=int, default=1 << 20)
    ap.add_argument("--cpp", metavar="BENCH_TRANSPORT", help="build/bench/bench_transport: compare with its C++ twin")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to this JSON file")
    a = ap.parse_args()
    if a.due_floats < 1:
        ap.error(f"--due-floats = {a.due_floats} must be >= 1")
    figures = {}
    if a.cpp:
        c_med, c_best, c_cpu = cpp_nothing_due(a.cpp)
        figures.update(cpp_median_ns=c_med, cpp_best_ns=c_best, cpp_cpu_median_ns=c_cpu)
        print(f"C++ OuterLoop::step nothing due over ZeroMQ (BM_LearnerStepNothingDueZmq): median {c_med:.0f} ns, "
              f"best repetition {c_best:.0f} ns, CPU {c_cpu:.0f} ns")
    cpu = []
    med, best = nothing_due(cpu)
    figures.update(python_median_ns=med, python_best_ns=best, python_cpu_median_ns=cpu[0])
    print(f"step() nothing due (24 fragments x 24 tensors): median {med / 1000:.3f} us, "
          f"best batch {best / 1000:.3f} us, CPU {cpu[0]:.0f} ns")
    pull_cpu = []
    pull_med, pull_best = nothing_due(pull_cpu, round="pull")
    figures.update(python_pull_median_ns=pull_med, python_pull_best_ns=pull_best, python_pull_cpu_median_ns=pull_cpu[0])
    print(f"step() in pull rounds, nothing pulled (the same tensors; metadata coalesced, the default 1 ms): "
          f"median {pull_med / 1000:.3f} us, best batch {pull_best / 1000:.3f} us, CPU {pull_cpu[0]:.0f} ns")
    every_cpu = []
    every_med, every_best = nothing_due(every_cpu, round="pull", metadata_interval=0)
    figures.update(python_pull_every_median_ns=every_med, python_pull_every_cpu_median_ns=every_cpu[0])
    print(f"step() in pull rounds, nothing pulled, every step's metadata sent (metadata_interval=0): median "
          f"{every_med / 1000:.3f} us, best batch {every_best / 1000:.3f} us, CPU {every_cpu[0]:.0f} ns")
    loop_med, _ = per_call(lambda: None, 4000)
    print(f"  (an empty Python lambda call: {loop_med / 1000:.3f} us)")
    params = [("w", torch.zeros(8))]
    with ddiloco.Syncer(params, plaintext=True, fragments=1) as s:
        with ddiloco.Learner(params, endpoint=s.endpoint, id=1, plaintext=True, fragments=1) as ln:
            call = binding_call(ln)
    figures.update(empty_lambda_ns=loop_med, binding_call_ns=call)
    print(f"  (a property read through the binding, Learner._core.joined: {call / 1000:.3f} us)")
    if a.cpp:
        figures.update(ratio_python_over_cpp=med / c_med, ratio_cpu=cpu[0] / c_cpu)
        print(f"Python / C++: wall median {med / c_med:.2f}, CPU median {cpu[0] / c_cpu:.2f} (target <= 1.10); "
              f"difference {(med - c_med):.0f} ns wall, {(cpu[0] - c_cpu):.0f} ns CPU per step")
    due_cpu = []
    med, best, st = due(a.due_floats, due_cpu)
    print(f"two steps, one sending a {a.due_floats}-float fragment, the other applying the global if it has "
          f"arrived: median {med / 1e6:.3f} ms, best batch {best / 1e6:.3f} ms, CPU {due_cpu[0] / 1e6:.3f} ms "
          f"({st['sends']} sends, {st['applies'] - 1} applies)")
    figures.update(due_pair_median_ns=med, due_pair_best_ns=best, due_pair_cpu_median_ns=due_cpu[0],
                   due_floats=a.due_floats)
    if a.cpp:
        if a.due_floats != 1 << 20:
            print(f"(C++ fragment-due twin not compared: it runs 2^20 floats, not {a.due_floats})")
        else:
            d_med, d_best, d_cpu, last = cpp_fragment_due(a.cpp)
            figures.update(cpp_due_pair_median_ns=d_med, cpp_due_pair_best_ns=d_best, cpp_due_pair_cpu_ns=d_cpu,
                           ratio_due_python_over_cpp=med / d_med, ratio_due_cpu=due_cpu[0] / d_cpu)
            print(f"C++ OuterLoop::step pair, same fragment (BM_LearnerStepFragmentDueZmq): median {d_med / 1e6:.3f} ms, "
                  f"best repetition {d_best / 1e6:.3f} ms, CPU {d_cpu / 1e6:.3f} ms "
                  f"(last repetition: {last.get('sent', 0):.0f} sends, {last.get('applied', 0):.0f} applies)")
            print(f"Python / C++ fragment due: wall median {med / d_med:.2f}, CPU median {due_cpu[0] / d_cpu:.2f} "
                  f"(target <= 1.10); difference {(med - d_med) / 1e3:.0f} us wall, "
                  f"{(due_cpu[0] - d_cpu) / 1e3:.0f} us CPU per pair")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
