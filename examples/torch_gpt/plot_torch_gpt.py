#!/usr/bin/python3
"""Plots torch_gpt's comparison: validation loss of the global parameters against tokens and
against (simulated) wall time, one line per method. Usage: plot_torch_gpt.py [DIR] (default
results/torch); reads DIR/curves.csv, writes DIR/loss.png. Needs matplotlib (/usr/bin/python3).

plot_torch_gpt.py DIR --merge PART [PART...]: first joins the outputs of runs of one method each
(`torch_gpt --methods data-parallel --out PART1`, `--methods decoupled --out PART2`, run in
parallel) into DIR/results.csv, DIR/curves.csv and DIR/results.md (the first part's header
paragraph, then every part's table rows), then plots DIR."""
import csv
import os
import sys
from collections import defaultdict


def merge(out: str, parts: list) -> None:
    os.makedirs(out, exist_ok=True)
    for name in ("results.csv", "curves.csv"):
        header, rows = None, []
        for part in parts:
            with open(f"{part}/{name}", newline="") as f:
                records = [r for r in csv.reader(f) if r]
            if header is not None and records[0] != header:
                raise SystemExit(f"{part}/{name}: header differs from {parts[0]}/{name}")
            header = records[0]
            for r in records[1:]:
                # torch_gpt before 2026-11-30 wrote the failures column
                # ("kill+restart, 3x slow, 1% loss") unquoted: join the surplus back into it.
                extra = len(r) - len(header)
                if extra > 0:
                    r = r[:1] + [",".join(r[1 : 2 + extra])] + r[2 + extra :]
                rows.append(r)
        with open(f"{out}/{name}", "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows([header] + rows)
    intro, table_head, table_rows = [], [], []
    for i, part in enumerate(parts):
        with open(f"{part}/results.md") as f:
            lines = f.read().splitlines()
        table = [line for line in lines if line.startswith("|")]
        if i == 0:
            intro = [line for line in lines if not line.startswith("|")]
            table_head = table[:2]
        table_rows += table[2:]
    with open(f"{out}/results.md", "w") as f:
        f.write("\n".join(intro + table_head + table_rows) + "\n")
    print(f"merged {', '.join(parts)} into {out}/{{results.csv,curves.csv,results.md}}")

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "results/torch"
    if len(sys.argv) > 2:
        if sys.argv[2] != "--merge" or len(sys.argv) < 4:
            raise SystemExit("usage: plot_torch_gpt.py [DIR [--merge PART PART...]]")
        merge(out, sys.argv[3:])
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
