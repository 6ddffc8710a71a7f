#!/usr/bin/python3
"""Plots for ddiloco_sim's CSV output (docs/simulator.md).

Usage: /usr/bin/python3 examples/plot_sim.py [DIR]   (default results/sim)

Reads DIR/goodput.csv, DIR/bandwidth_curves.csv, DIR/bandwidth_1b.csv and
DIR/timeseries.csv; writes goodput.png, bandwidth.png and timeseries.png to DIR.
Needs only the distribution's python3-matplotlib (and the csv module).
"""
import csv
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot_goodput(d):
    rows = read(d / "goodput.csv")
    series = defaultdict(list)
    paper = defaultdict(list)
    for r in rows:
        series[r["system"]].append((float(r["chips"]), float(r["goodput"])))
        if r["paper_goodput"]:
            paper[r["system"]].append((float(r["chips"]), float(r["paper_goodput"])))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (name, pts) in enumerate(series.items()):
        xs, ys = zip(*pts)
        line, = ax.plot(xs, [100 * y for y in ys], marker="o", label=name)
        if name in paper:
            px, py = zip(*paper[name])
            ax.scatter(px, [100 * y for y in py], marker="x", s=70, color=line.get_color(), zorder=3)
    ax.set_xscale("log")
    ax.set_xticks([150e3, 300e3, 600e3, 1.2e6, 2.4e6])
    ax.set_xticklabels(["150k", "300k", "600k", "1.2M", "2.4M"])
    ax.set_xlabel("chips (one interruption per chip per year)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.set_title("Goodput against chip count (lines: simulator, x: paper)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(d / "goodput.png", dpi=110)
    plt.close(fig)


def plot_bandwidth(d):
    rows = read(d / "bandwidth_curves.csv")
    cells = read(d / "bandwidth_1b.csv")
    models = ["1B", "10B", "100B"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), sharey=True)
    for ax, model in zip(axes, models):
        curves = defaultdict(list)
        for r in rows:
            if r["model"] == model:
                curves[r["method"]].append((float(r["gbps"]), float(r["utilisation"])))
        colours = {}
        for name, pts in curves.items():
            xs, ys = zip(*pts)
            line, = ax.plot(xs, [100 * y for y in ys], label=name)
            colours[name] = line.get_color()
        if model == "1B":
            for c in cells:
                ax.scatter(float(c["paper_gbps"]), 100 * float(c["utilisation"]), marker="x",
                           color=colours.get(c["method"], "k"), zorder=3)
        ax.set_xscale("log")
        ax.set_xlim(0.05, 2000)
        ax.set_xlabel("bandwidth (Gbit/s)")
        ax.set_title(model + (" (x: Streaming DiLoCo paper)" if model == "1B" else ""))
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("compute utilisation (%)")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(d / "bandwidth.png", dpi=110)
    plt.close(fig)


def plot_timeseries(d):
    rows = read(d / "timeseries.csv")
    series = defaultdict(list)
    for r in rows:
        series[r["system"]].append((float(r["t_hours"]), float(r["goodput"]), int(r["failures"])))
    fig, (ax, axf) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, pts in series.items():
        t, g, _ = zip(*pts)
        ax.step(t, [100 * x for x in g], where="post", label=name)
    # Failures as the elastic run sees them (every slice failure); the
    # data-parallel run counts only those that hit it while running.
    name = "elastic data-parallel" if "elastic data-parallel" in series else next(iter(series))
    t, _, f = zip(*series[name])
    width = t[1] - t[0] if len(t) > 1 else 1
    axf.bar(t, f, width=width, align="edge", color="grey")
    ax.set_ylabel("goodput per bin (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("One run at 1.2M chips: goodput over time")
    axf.set_ylabel("slice failures")
    axf.set_xlabel("time (hours)")
    fig.tight_layout()
    fig.savefig(d / "timeseries.png", dpi=110)
    plt.close(fig)


def main():
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "results/sim")
    plot_goodput(d)
    plot_bandwidth(d)
    plot_timeseries(d)
    print("wrote", ", ".join(str(d / n) for n in ("goodput.png", "bandwidth.png", "timeseries.png")))


if __name__ == "__main__":
    main()
