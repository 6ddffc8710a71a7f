#!/usr/bin/env bash
# The performance suite (docs/performance.md), one command:
#   scripts/bench.sh                 # 5 repetitions per benchmark, medians
#   REPS=3 BUILD=build-l scripts/bench.sh
# Builds bench_syncer and bench_fragmenter (Release), runs them with
# --benchmark_repetitions, runs the PyTorch peer (bench/peer_pytorch.py, fp32 and
# int4 payloads) with 1 and 2 threads, alternates peer and ddiloco runs for the
# pairwise ratios (syncer_vs_pytorch: fp32 peer / batched fp32 round;
# syncer_vs_pytorch_int4: int4 peer / batched int4 round;
# syncer_vs_pytorch_streaming: fp32 peer / streaming fp32 round), and writes results/perf/results.json, results/perf/results.md
# and the raw Google Benchmark JSON next to them. docs/performance.md explains
# the method.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${REPS:-5}
build=${BUILD:-build-bench}
out=results/perf
mkdir -p "$out"
launcher=()
if command -v ccache >/dev/null 2>&1; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
cmake --build "$build" --target bench_syncer bench_fragmenter

common=(--benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true --benchmark_format=console)
echo "== bench_syncer (triad, memcpy, merge rounds, learner steps, scaling)"
"$build/bench/bench_syncer" "${common[@]}" --benchmark_out="$out/bench_syncer.json" --benchmark_out_format=json
echo "== bench_fragmenter (10^6 tensors into 24 fragments)"
"$build/bench/bench_fragmenter" "${common[@]}" --benchmark_filter='/1000000' \
  --benchmark_out="$out/bench_fragmenter.json" --benchmark_out_format=json
echo "== PyTorch peer"
for t in 1 2; do
  /usr/bin/python3 bench/peer_pytorch.py --threads $t --repetitions "$reps" > "$out/peer_pytorch_$t.json"
  /usr/bin/python3 bench/peer_pytorch.py --threads $t --repetitions "$reps" --codec int4 > "$out/peer_pytorch_int4_$t.json"
done
cat "$out"/peer_pytorch_*.json

echo "== PyTorch peer and ddiloco alternately (pairwise ratio under the same load)"
pair_run() {  # $1: benchmark filter, $2: output file
  "$build/bench/bench_syncer" --benchmark_filter="$1" --benchmark_repetitions=3 \
    --benchmark_report_aggregates_only=true --benchmark_format=json > "$2"
}
for i in 1 2 3; do
  /usr/bin/python3 bench/peer_pytorch.py --threads 1 --repetitions 3 > "$out/pair_peer_$i.json"
  pair_run '^BM_FastBatchRound<Codec::fp32>/24/8/1/' "$out/pair_ddiloco_batch_$i.json"
  pair_run '^BM_FastRound<Codec::fp32>/24/8/1/' "$out/pair_ddiloco_$i.json"
  /usr/bin/python3 bench/peer_pytorch.py --threads 1 --repetitions 3 --codec int4 > "$out/pair_peer_int4_$i.json"
  pair_run '^BM_FastBatchRound<Codec::int4>/24/8/1/' "$out/pair_ddiloco_batch_int4_$i.json"
done

uptime > "$out/load.txt"
lscpu | grep -E 'Model name|^CPU\(s\)|L1d|L2|L3' >> "$out/load.txt"

/usr/bin/python3 - "$out" <<'EOF'
import json, sys, os
out = sys.argv[1]

def medians(path):
    data = json.load(open(path))
    res = {}
    for b in data["benchmarks"]:
        if b.get("aggregate_name") == "median":
            res[b["run_name"]] = b
    return data["context"], res

ctx, sy = medians(os.path.join(out, "bench_syncer.json"))
_, fr = medians(os.path.join(out, "bench_fragmenter.json"))
peer = {t: json.load(open(os.path.join(out, f"peer_pytorch_{t}.json"))) for t in (1, 2)}
peer_int4 = {t: json.load(open(os.path.join(out, f"peer_pytorch_int4_{t}.json"))) for t in (1, 2)}

def get(name):
    for k, v in sy.items():
        if k == name:
            return v
    raise KeyError(name)

def seconds(b):  # real time of one iteration in seconds
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
    return b["real_time"] * scale

def cpu_seconds(b):
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
    return b["cpu_time"] * scale

triad = {t: get(f"BM_Triad/25/{t}/real_time")["bytes_per_second"] for t in (1, 2)}
triad_cpu1 = get("BM_Triad/25/1/real_time")["bytes_per_second"] * seconds(get("BM_Triad/25/1/real_time")) / cpu_seconds(get("BM_Triad/25/1/real_time"))
memcpy = get("BM_Memcpy/24/real_time")["bytes_per_second"]

rows = []
results = {"machine": {"cpus": ctx.get("num_cpus"), "mhz": ctx.get("mhz_per_cpu"),
                       "caches": ctx.get("caches"), "load_avg": ctx.get("load_avg")},
           "repetitions": None, "triad_bytes_per_second": {"1": triad[1], "2": triad[2]},
           "memcpy_bytes_per_second": memcpy}

def row(label, b, reference_bw, note=""):
    bw = b["bytes_per_second"]
    ratio = bw / reference_bw if reference_bw else None
    if "2 threads" not in label:
        note = (note + "; " if note else "") + f"CPU-time rate {bw * seconds(b) / cpu_seconds(b) / 1e9:.2f} GB/s"
    rows.append((label, f"{seconds(b) * 1e3:.1f} ms", f"{bw / 1e9:.2f}", f"{ratio:.2f}" if ratio else "", note))
    results.setdefault("kernels", {})[label] = {"seconds": seconds(b), "cpu_seconds": cpu_seconds(b),
                                               "bytes_per_second": bw, "ratio": ratio,
                                               "repetitions": b.get("repetitions")}
    results["repetitions"] = b.get("repetitions")
    return ratio

rows.append(("STREAM triad, 1 thread", f'{seconds(get("BM_Triad/25/1/real_time")) * 1e3:.1f} ms', f"{triad[1] / 1e9:.2f}", "1.00", "3 x 128 MiB"))
rows.append(("STREAM triad, 2 threads", f'{seconds(get("BM_Triad/25/2/real_time")) * 1e3:.1f} ms', f"{triad[2] / 1e9:.2f}", f"{triad[2] / triad[1]:.2f}", "vs 1-thread triad"))
rows.append(("memcpy 64 MiB", f'{seconds(get("BM_Memcpy/24/real_time")) * 1e3:.1f} ms', f"{memcpy / 1e9:.2f}", f"{memcpy / triad[1]:.2f}", "vs 1-thread triad"))
r_fp32_1 = row("RDA merge fp32 + Nesterov, M=8, 2^24, 1 thread", get("BM_FastRound<Codec::fp32>/24/8/1/real_time"), triad[1], "roofline ratio vs 1-thread triad")
r_fp32_2 = row("RDA merge fp32 + Nesterov, M=8, 2^24, 2 threads", get("BM_FastRound<Codec::fp32>/24/8/2/real_time"), triad[2], "vs 2-thread triad")
r_int4_1 = row("RDA merge int4 + Nesterov, M=8, 2^24, 1 thread", get("BM_FastRound<Codec::int4>/24/8/1/real_time"), triad[1], "roofline ratio vs 1-thread triad")
r_int4_2 = row("RDA merge int4 + Nesterov, M=8, 2^24, 2 threads", get("BM_FastRound<Codec::int4>/24/8/2/real_time"), triad[2], "vs 2-thread triad")
b_fp32_1 = row("batched RDA merge fp32 (add_batch of 8) + Nesterov, 2^24, 1 thread", get("BM_FastBatchRound<Codec::fp32>/24/8/1/real_time"), triad[1], "vs 1-thread triad; min bytes 8 x 4n + 4n + 20n")
b_fp32_2 = row("batched RDA merge fp32 (add_batch of 8) + Nesterov, 2^24, 2 threads", get("BM_FastBatchRound<Codec::fp32>/24/8/2/real_time"), triad[2], "vs 2-thread triad")
b_int4_1 = row("batched RDA merge int4 (add_batch of 8) + Nesterov, 2^24, 1 thread", get("BM_FastBatchRound<Codec::int4>/24/8/1/real_time"), triad[1], "vs 1-thread triad")
b_int4_2 = row("batched RDA merge int4 (add_batch of 8) + Nesterov, 2^24, 2 threads", get("BM_FastBatchRound<Codec::int4>/24/8/2/real_time"), triad[2], "vs 2-thread triad")
row("reference RDA fp32 + Nesterov, 1 thread", get("BM_ReferenceRound<Codec::fp32>/24/8/1/real_time"), triad[1], "merge.hpp + outer_optimizer.hpp")
row("reference RDA int4 (decode, add) + Nesterov", get("BM_ReferenceRound<Codec::int4>/24/8/1/real_time"), triad[1], "")
pair = {}
for c in ("fp32", "int4"):
    for t, base in ((1, 0), (2, 0), (1, 1)):
        b = get(f"BM_RooflinePair<Codec::{c}>/24/8/{t}/{base}/real_time")
        pair[(c, t, base)] = b
        isa = "SSE2 baseline build" if base else "AVX2 build"
        rows.append((f"pairwise roofline, RDA {c} + Nesterov, {t} thread(s), {isa}", f'{b["round_s"] * 1e3:.1f} ms',
                     f'{b["round_Bps"] / 1e9:.2f}', f'{b["ratio"]:.2f}', f'triad measured alternately: {b["triad_Bps"] / 1e9:.2f} GB/s'))
for k in list(pair):
    if k[2] == 0:
        pair[k[:2]] = pair[k]
bpair = {}
for c in ("fp32", "int4"):
    for t in (1, 2):
        b = get(f"BM_RooflinePairBatch<{c}>/24/8/{t}/0/real_time")
        bpair[(c, t)] = b
        rows.append((f"pairwise roofline, batched RDA {c} + Nesterov, {t} thread(s)", f'{b["round_s"] * 1e3:.1f} ms',
                     f'{b["round_Bps"] / 1e9:.2f}', f'{b["ratio"]:.2f}', f'triad measured alternately: {b["triad_Bps"] / 1e9:.2f} GB/s'))
fast1 = seconds(get("BM_FastRound<Codec::fp32>/24/8/1/real_time"))
fast2 = seconds(get("BM_FastRound<Codec::fp32>/24/8/2/real_time"))
int41 = seconds(get("BM_FastRound<Codec::int4>/24/8/1/real_time"))
int42 = seconds(get("BM_FastRound<Codec::int4>/24/8/2/real_time"))
speedup_2t = {"fp32": fast1 / fast2, "int4": int41 / int42}
for t in (1, 2):
    p = peer[t]
    rows.append((f"PyTorch peer: average + SGD(nesterov), {t} thread(s)", f'{p["median_seconds"] * 1e3:.1f} ms',
                 f'{p["bytes_per_second"] / 1e9:.2f}', f'{p["bytes_per_second"] / triad[t]:.2f}', f'torch {p["torch_version"]}, plain average (less work than RDA)'))
for t in (1, 2):
    p = peer_int4[t]
    rows.append((f"PyTorch peer int4: dequantise + average + SGD(nesterov), {t} thread(s)", f'{p["median_seconds"] * 1e3:.1f} ms',
                 f'{p["bytes_per_second"] / 1e9:.2f}', f'{p["bytes_per_second"] / triad[t]:.2f}', "int8 codes + fp32 scales per 64-block"))
batch_s = {(c, t): seconds(get(f"BM_FastBatchRound<Codec::{c}>/24/8/{t}/real_time")) for c in ("fp32", "int4") for t in (1, 2)}
vs_torch = {1: peer[1]["median_seconds"] / fast1, 2: peer[2]["median_seconds"] / fast2}
vs_torch_batch = {t: peer[t]["median_seconds"] / batch_s[("fp32", t)] for t in (1, 2)}
vs_torch_batch_int4 = {t: peer_int4[t]["median_seconds"] / batch_s[("int4", t)] for t in (1, 2)}
vs_torch_streaming_int4 = {1: peer_int4[1]["median_seconds"] / int41, 2: peer_int4[2]["median_seconds"] / int42}

def pairwise(peer_file, ddiloco_file):
    ratios = []
    for i in (1, 2, 3):
        pp = json.load(open(os.path.join(out, peer_file.format(i))))
        dd = [b for b in json.load(open(os.path.join(out, ddiloco_file.format(i))))["benchmarks"] if b.get("aggregate_name") == "median"][0]
        ratios.append(pp["median_seconds"] / seconds(dd))
    return sorted(ratios)

pair_ratios = pairwise("pair_peer_{}.json", "pair_ddiloco_batch_{}.json")
pair_ratios_streaming = pairwise("pair_peer_{}.json", "pair_ddiloco_{}.json")
pair_ratios_int4 = pairwise("pair_peer_int4_{}.json", "pair_ddiloco_batch_int4_{}.json")
for label, r in (("PyTorch fp32 peer / ddiloco batched fp32", pair_ratios),
                 ("PyTorch int4 peer / ddiloco batched int4", pair_ratios_int4),
                 ("PyTorch fp32 peer / ddiloco streaming fp32", pair_ratios_streaming)):
    rows.append((f"{label}, run alternately 3 times, 1 thread", "", "", f"{r[1]:.2f}", "median of 3 pairwise time ratios: " + ", ".join(f"{x:.2f}" for x in r)))
due = {}
for c in ("fp32", "int4"):
    for base, build_name in ((0, "AVX2 build"), (1, "SSE2 baseline build")):
        b = get(f"BM_LearnerDueFast<Codec::{c}>/24/{base}/real_time")
        due[(c, base)] = b["vs_memcpy"]
        rows.append((f"learner due step {c} (copy + outer gradient + encode), fused, {build_name}", f'{b["due_s"] * 1e3:.1f} ms',
                     f'{b["due_Bps"] / 1e9:.2f}', f'{b["vs_memcpy"]:.2f}', f'vs memcpy timed alternately: {b["memcpy_Bps"] / 1e9:.2f} GB/s'))
due_fp32, due_int4 = due[("fp32", 0)], due[("int4", 0)]
send_path = {}
for c in ("fp32", "int4"):
    for enc, what in ((1, "OuterLoop::step encoding into the lent frame + header/CRC (ZeroMQ learner path, no socket)"),
                      (0, "OuterLoop::step with fp32 payload, encoded when framed (transport without a contribution codec)")):
        b = get(f"BM_LearnerSendPath<Codec::{c}>/24/{enc}/real_time")
        send_path[(c, enc)] = b["vs_memcpy"]
        rows.append((f"learner send path {c}: {what}", f'{b["due_s"] * 1e3:.1f} ms',
                     f'{b["due_Bps"] / 1e9:.2f}', f'{b["vs_memcpy"]:.2f}', f'vs memcpy timed alternately: {b["memcpy_Bps"] / 1e9:.2f} GB/s'))
row("learner due step fp32, reference (copy, subtract, encode)", get("BM_LearnerDueReference<Codec::fp32>/24/real_time"), memcpy, "vs memcpy")
row("learner due step int4, reference", get("BM_LearnerDueReference<Codec::int4>/24/real_time"), memcpy, "vs memcpy")
nodue = get("BM_LearnerStepNothingDue/iterations:60000")
nodue_s = seconds(nodue)
rows.append(("learner step, nothing due, P=24", f"{nodue_s * 1e9:.0f} ns", "", "", f'cpu {cpu_seconds(nodue) * 1e9:.0f} ns; sends during the run: {int(nodue.get("sent", 0))}'))
frag = [v for k, v in fr.items() if "BalancedGreedy" in k]
frag_s = seconds(frag[0]) if frag else None
if frag:
    rows.append(("fragmenter: 10^6 tensors into 24 fragments (BalancedGreedy)", f"{frag_s * 1e3:.0f} ms", "", "", ""))

scaling_n, scaling_m = [], []
for k, v in sy.items():
    if k.startswith("BM_FastRound<fp32>/size/"):
        log2n = int(k.split("/")[2])
        scaling_n.append((log2n, seconds(v), v["bytes_per_second"], cpu_seconds(v)))
    if k.startswith("BM_FastRound<fp32>/learners/"):
        m = int(k.split("/")[3])
        scaling_m.append((m, seconds(v), v["bytes_per_second"], cpu_seconds(v)))
scaling_n.sort(); scaling_m.sort()

results.update({
    "syncer_roofline_ratio": pair[("fp32", 1)]["ratio"],
    "syncer_roofline_ratio_int4": pair[("int4", 1)]["ratio"],
    "syncer_roofline_ratio_two_threads": {"fp32": pair[("fp32", 2)]["ratio"], "int4": pair[("int4", 2)]["ratio"]},
    "syncer_roofline_ratio_separate_runs": {"fp32": r_fp32_1, "int4": r_int4_1},
    "syncer_roofline_ratio_sse2_baseline": {"fp32": pair[("fp32", 1, 1)]["ratio"], "int4": pair[("int4", 1, 1)]["ratio"]},
    "syncer_two_thread_speedup_pairwise": {c: pair[(c, 2)]["round_Bps"] / pair[(c, 1)]["round_Bps"] for c in ("fp32", "int4")},
    "syncer_vs_pytorch_cpu_time": peer[1]["median_cpu_seconds"] / cpu_seconds(get("BM_FastRound<Codec::fp32>/24/8/1/real_time")),
    "syncer_roofline_ratio_cpu_time": get("BM_FastRound<Codec::fp32>/24/8/1/real_time")["bytes_per_second"] * fast1 / cpu_seconds(get("BM_FastRound<Codec::fp32>/24/8/1/real_time")) / triad_cpu1,
    "syncer_two_thread_speedup": speedup_2t,
    "syncer_roofline_ratio_batched": bpair[("fp32", 1)]["ratio"],
    "syncer_roofline_ratio_batched_int4": bpair[("int4", 1)]["ratio"],
    "syncer_roofline_ratio_batched_two_threads": {"fp32": bpair[("fp32", 2)]["ratio"], "int4": bpair[("int4", 2)]["ratio"]},
    "syncer_batched_vs_streaming": {"fp32": fast1 / batch_s[("fp32", 1)], "int4": int41 / batch_s[("int4", 1)]},
    "syncer_batched_two_thread_speedup": {c: batch_s[(c, 1)] / batch_s[(c, 2)] for c in ("fp32", "int4")},
    "syncer_vs_pytorch": pair_ratios[1],
    "syncer_vs_pytorch_pairwise_runs": pair_ratios,
    "syncer_vs_pytorch_separate_runs": vs_torch_batch[1],
    "syncer_vs_pytorch_two_threads": vs_torch_batch[2],
    "syncer_vs_pytorch_int4": pair_ratios_int4[1],
    "syncer_vs_pytorch_int4_pairwise_runs": pair_ratios_int4,
    "syncer_vs_pytorch_int4_separate_runs": vs_torch_batch_int4[1],
    "syncer_vs_pytorch_int4_two_threads": vs_torch_batch_int4[2],
    "syncer_vs_pytorch_streaming": pair_ratios_streaming[1],
    "syncer_vs_pytorch_streaming_pairwise_runs": pair_ratios_streaming,
    "syncer_vs_pytorch_streaming_separate_runs": vs_torch[1],
    "syncer_vs_pytorch_streaming_two_threads": vs_torch[2],
    "syncer_vs_pytorch_streaming_int4_separate_runs": vs_torch_streaming_int4[1],
    "syncer_vs_pytorch_streaming_int4_two_threads": vs_torch_streaming_int4[2],
    "learner_no_due_step_seconds": nodue_s,
    "learner_no_due_step_cpu_seconds": cpu_seconds(nodue),
    "learner_due_step_vs_memcpy": {"fp32": due_fp32, "int4": due_int4},
    "learner_due_step_vs_memcpy_baseline_build": {"fp32": due[("fp32", 1)], "int4": due[("int4", 1)]},
    "learner_send_path_vs_memcpy": {"fp32": send_path[("fp32", 1)], "int4": send_path[("int4", 1)]},
    "learner_send_path_vs_memcpy_fp32_payload": {"fp32": send_path[("fp32", 0)], "int4": send_path[("int4", 0)]},
    "fragmenter_1e6_tensors_seconds": frag_s,
    "scaling_fragment_size": [{"log2n": a, "seconds": b, "bytes_per_second": c, "cpu_seconds": d} for a, b, c, d in scaling_n],
    "scaling_learners": [{"M": a, "seconds": b, "bytes_per_second": c, "cpu_seconds": d} for a, b, c, d in scaling_m],
    "peer_pytorch": peer,
    "peer_pytorch_int4": peer_int4,
})
json.dump(results, open(os.path.join(out, "results.json"), "w"), indent=2)

md = ["| kernel | median time | GB/s (min bytes) | ratio | note |", "|---|---|---|---|---|"]
md += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
md += ["", f"Headline (M = 8, 2^24 elements, one thread): syncer_roofline_ratio = {results['syncer_roofline_ratio']:.2f} "
       f"(int4: {results['syncer_roofline_ratio_int4']:.2f}; pairwise with the triad; separate runs: {r_fp32_1:.2f} / {r_int4_1:.2f}); "
       f"two threads / one thread = {speedup_2t['fp32']:.2f}x (int4 {speedup_2t['int4']:.2f}x); "
       f"syncer_vs_pytorch = {pair_ratios[1]:.2f}x (batched fp32, pairwise; separate runs {vs_torch_batch[1]:.2f}x, two threads {vs_torch_batch[2]:.2f}x); "
       f"syncer_vs_pytorch_int4 = {pair_ratios_int4[1]:.2f}x (batched int4 vs the int4 peer, pairwise; separate runs {vs_torch_batch_int4[1]:.2f}x, two threads {vs_torch_batch_int4[2]:.2f}x); "
       f"syncer_vs_pytorch_streaming = {pair_ratios_streaming[1]:.2f}x (pairwise; separate runs {vs_torch[1]:.2f}x wall clock, {results['syncer_vs_pytorch_cpu_time']:.2f}x CPU time; two threads {vs_torch[2]:.2f}x); "
       f"syncer_roofline_ratio_batched = {results['syncer_roofline_ratio_batched']:.2f} (int4 {results['syncer_roofline_ratio_batched_int4']:.2f}); "
       f"learner due step = {due_fp32:.2f}x memcpy (int4 {due_int4:.2f}x), the whole send path through OuterLoop and the frame = "
       f"{send_path[('fp32', 1)]:.2f}x (int4 {send_path[('int4', 1)]:.2f}x).", ""]
md += ["| log2 n (M = 8, 1 thread) | median time | CPU time | GB/s | GB/s by CPU time |", "|---|---|---|---|---|"]
md += [f"| {a} | {b * 1e3:.2f} ms | {d * 1e3:.2f} ms | {c / 1e9:.2f} | {c * b / d / 1e9:.2f} |" for a, b, c, d in scaling_n]
md += ["", "| M (n = 2^20, 1 thread) | median time | CPU time | CPU time / M | GB/s by CPU time |", "|---|---|---|---|---|"]
md += [f"| {a} | {b * 1e3:.2f} ms | {d * 1e3:.2f} ms | {d * 1e3 / a:.3f} ms | {c * b / d / 1e9:.2f} |" for a, b, c, d in scaling_m]
md += ["", f"Load average during the run: {ctx.get('load_avg')} on {ctx.get('num_cpus')} CPUs."]
open(os.path.join(out, "results.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
EOF
