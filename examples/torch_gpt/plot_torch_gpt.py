#!/usr/bin/python3
"""Plots torch_gpt's comparison: validation loss of the global parameters against tokens and
against (simulated) wall time, one line per method. Usage: plot_torch_gpt.py [DIR] (default
results/torch); reads DIR/curves.csv, writes DIR/loss.png. Needs matplotlib (/usr/bin/python3)."""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "results/torch"
    curves = defaultdict(list)
    with open(f"{out}/curves.csv", newline="") as f:
        for row in csv.DictReader(f):
            curves[row["method"]].append(
                (int(row["tokens"]), float(row["wall_time_s"]), float(row["val_loss"]))
            )
    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for method, points in curves.items():
        label = method + (" (failure tape)" if "Decoupled" in method else " (no failures)")
        by_tokens.plot([p[0] for p in points], [p[2] for p in points], marker="o", ms=3, label=label)
        by_time.plot([p[1] for p in points], [p[2] for p in points], marker="o", ms=3, label=label)
    by_tokens.set_xlabel("tokens processed by all learners")
    by_time.set_xlabel("wall time (s, simulated cluster time)")
    by_tokens.set_ylabel("validation loss of the global parameters (nats/char)")
    for ax in (by_tokens, by_time):
        ax.grid(alpha=0.3)
    by_tokens.legend()
    fig.suptitle("libtorch character GPT on fortunes: data-parallel vs Decoupled DiLoCo")
    fig.tight_layout()
    fig.savefig(f"{out}/loss.png", dpi=120)
    print(f"wrote {out}/loss.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
