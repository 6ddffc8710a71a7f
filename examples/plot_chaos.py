#!/usr/bin/python3
"""Plot for chaos_demo's CSV output (docs/chaos_demo.md).

Usage: /usr/bin/python3 examples/plot_chaos.py [DIR]   (default results/chaos)

Reads DIR/curves.csv (validation loss of the global parameters against simulated cluster time,
one series per method, round mode, M and tape) and writes DIR/loss_vs_time.png: one colour per
method, round mode and M, solid without failures, dashed under the failure tape, dotted under the
straggler-only tape, dash-dotted under the M = 16 stragglers tape.
Needs only the distribution's python3-matplotlib.
"""
import csv
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"none": "-", "chaos": "--", "straggler": ":", "stragglers": "-."}
TAPE = {"none": "no failures", "chaos": "failure tape", "straggler": "straggler only",
        "stragglers": "4 of 16 2x slower"}


def name(r):
    """The series' method name: the label, then the round mode of the Decoupled rows and M if not 4."""
    label = r["label"]
    if "Decoupled" in label and r.get("round"):
        label += f", {r['round']}"
    if r.get("learners") and r["learners"] != "4":
        label += f", M={r['learners']}"
    return label


def main():
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "results/chaos")
    with open(d / "curves.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    series = defaultdict(list)
    for r in rows:
        series[(name(r), r["tape"])].append((float(r["sim_time_s"]), float(r["val_loss"])))
    labels = sorted({label for label, _ in series})
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    colours = {label: cmap(i % cmap.N) for i, label in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(9, 5.4))
    finals = [pts[-1][1] for pts in series.values() if pts]
    for (label, tape), pts in sorted(series.items()):
        pts.sort()
        xs, ys = zip(*pts)
        ax.plot(xs, ys, STYLE.get(tape, "-"), color=colours[label], label=f"{label}, {TAPE.get(tape, tape)}")
    ax.set_xscale("log")
    if finals:
        lo = min(finals)
        ax.set_ylim(lo - 0.1, min(lo + 1.6, max(y for pts in series.values() for _, y in pts)))
    ax.set_xlabel("simulated cluster time (s, log scale)")
    ax.set_ylabel("validation loss of the global parameters (nats/char)")
    ax.set_title("equal inner steps per learner: failure tape dashed, straggler dotted")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = d / "loss_vs_time.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
