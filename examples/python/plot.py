#!/usr/bin/python3
"""Plot validation loss vs training time and vs tokens for train_gpt.py runs (matplotlib, Agg).

    /usr/bin/python3 examples/python/plot.py results/python/ddiloco/results.json \\
        results/python/ddp/results.json --out results/python/loss.png

Each results.json holds the curve of process 0 (its own parameters, evaluation time left out of
the time axis; tokens are those of all processes at that step). A ddiloco run's final global
(the syncer's parameters, evaluated once every learner has finished) is drawn as a star at the
slowest process's training time.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="results.json files written by train_gpt.py")
    ap.add_argument("--out", default="loss.png", help="the PNG to write (default: %(default)s)")
    ap.add_argument("--table", metavar="FILE.md", help="also write the results table (Markdown) to this file")
    a = ap.parse_args(argv)
    runs = []
    for path in a.results:
        if not os.path.exists(path):
            ap.error(f"{path} does not exist; run examples/python/train_gpt.py --out DIR first (it writes "
                     "DIR/results.json)")
        with open(path) as f:
            r = json.load(f)
        if not r.get("curve"):
            ap.error(f"{path} has no validation curve; is it a train_gpt.py results.json?")
        runs.append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        label = r["mode"] if r["mode"] == "ddp" else (
            f"ddiloco (M = {r['config']['learners']}, H = {r['config']['sync_every']}, "
            f"P = {r['config']['fragments']}, one learner a {r['config']['group_ranks']}-rank group)")
        label += f", {r['processes']} processes"
        xs_t = [p["time_s"] for p in r["curve"]]
        xs_k = [p["tokens"] / 1e6 for p in r["curve"]]
        ys = [p["val_loss"] for p in r["curve"]]
        # The global is evaluated once every learner has finished: at the slowest process's training
        # time (r["train_s"]) and at the run's total tokens.
        for ax, xs, end in zip(axes, (xs_t, xs_k), (r["train_s"], r["tokens"] / 1e6)):
            line, = ax.plot(xs, ys, marker=".", label=label)
            if r.get("final_val_global") is not None:
                ax.plot([end], [r["final_val_global"]], marker="*", markersize=12, color=line.get_color(),
                        linestyle="none", label=f"{r['mode']}: syncer's global at the end")
    axes[0].set_xlabel("training time, s (evaluation excluded; curves: process 0; star: the last process)")
    axes[1].set_xlabel("tokens, millions (all processes)")
    for ax in axes:
        ax.set_ylabel("validation loss, nats / char")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("Character GPT on fortunes: Decoupled DiLoCo vs DDP at the same token budget")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"plot.py: wrote {a.out}")
    if a.table:
        with open(a.table, "w") as f:
            f.write(table(runs))
        print(f"plot.py: wrote {a.table}")
    return 0


def table(runs) -> str:
    """The README's table: one row per run."""
    rows = ["| mode | processes | tokens | val loss: start -> end (process 0) | syncer's global at the end | "
            "training time s (wall s) | MB sent per learner | time in ddiloco calls / step time, wall (CPU), "
            "worst process: single-process learners; group learner |",
            "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        g = r.get("final_val_global")
        over = "-"
        if r["mode"] == "ddiloco":
            parts = []
            for group in (False, True):
                ps = [p for p in r["processes_detail"] if (p["ranks"] > 1) == group]
                if ps:
                    parts.append(f"{max(p['ddiloco_overhead_pct'] for p in ps):.2f}% "
                                 f"({max(p['ddiloco_overhead_cpu_pct'] for p in ps):.2f}%)")
            over = "; ".join(parts)
        sent = f"{r['bytes_sent_per_learner'] / 1e6:,.1f}" + (" (estimate)" if r["mode"] == "ddp" else "")
        rows.append(f"| {r['mode']} | {r['processes']} | {r['tokens']:,} | {r['initial_val']:.4f} -> "
                    f"{r['final_val']:.4f} | {'-' if g is None else f'{g:.4f}'} | {r['train_s']:.1f} "
                    f"({r['wall_s']:.1f}) | {sent} | {over} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
