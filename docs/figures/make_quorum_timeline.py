#!/usr/bin/python3
"""Draws docs/figures/quorum_timeline.png, the figure of docs/quorum.md.

    /usr/bin/python3 docs/figures/make_quorum_timeline.py [OUT.png]

Three rounds of one fragment, drawn to scale from the rules of include/ddiloco/quorum.hpp and the
syncer's defaults (gamma 0.3, cap 1 s, deadline 60 s, heartbeat time-out 10 s, max staleness 8):
  A. the quorum forms, the grace window runs, a late contribution goes to the next round;
  B. the quorum never forms: a dead learner is dropped after the heartbeat time-out and the
     round merges at its deadline with what it has;
  C. a contribution whose base is more than 8 versions behind is rejected as stale and answered.
Needs only matplotlib (Debian: python3-matplotlib).
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "quorum_timeline.png"

# Panel A's numbers (docs/quorum.md works them out): tau = 2, inner step 0.5 s, averages of earlier
# rounds xi_quorum = 0.1 s, xi_sync = 0.2 s: slack = 2 x 0.5 - 0.3 = 0.7 s, grace = 0.3 x 0.7 = 0.21 s.
TAU, STEP, XI_Q, XI_S, GAMMA, CAP = 2, 0.5, 0.10, 0.20, 0.3, 1.0
GRACE = min(max(GAMMA * (TAU * STEP - (XI_Q + XI_S)), 0.0), CAP)

C_IN, C_LATE, C_GRACE, C_MERGE, C_DEAD, C_STALE = "#2b7bba", "#999999", "#f4c542", "#2e9e44", "#c0392b", "#8e44ad"


def learner_axis(ax, names, xmax, xlabel):
    ax.set_ylim(-0.75, len(names) - 0.3)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlim(-0.03 * xmax, xmax)
    ax.set_xlabel(xlabel)
    for s in ("top", "right"):
        ax.spines[s].set_visible(False)
    for y in range(len(names)):
        ax.axhline(y, color="#e5e5e5", lw=0.8, zorder=0)


def arrival(ax, x, y, color, text, dx=0.0, ha="left"):
    ax.plot([x], [y], marker="v", ms=10, color=color, zorder=3)
    if text:
        ax.annotate(text, (x, y), xytext=(x + dx, y - 0.32), fontsize=8.5, ha=ha, color=color)


def panel_a(ax):
    start, l1, l2, l3 = 0.0, 0.12, 0.25, 0.45
    quorum_at = l1
    merge_at = quorum_at + GRACE
    names = ["learner 0", "learner 1", "learner 2", "learner 3"]
    learner_axis(ax, names, 1.1, "seconds since the round started (the first contribution)")
    ax.axvspan(quorum_at, merge_at, color=C_GRACE, alpha=0.35, zorder=1)
    ax.axvspan(merge_at, merge_at + XI_S, color=C_MERGE, alpha=0.18, zorder=1)
    arrival(ax, start, 0, C_IN, "opens the round")
    arrival(ax, l1, 1, C_IN, "2nd: quorum K = 2 reached")
    arrival(ax, l2, 2, C_IN, "in the grace window: merged")
    arrival(ax, l3, 3, C_LATE, "after the merge began: opens the next round")
    ax.axvline(merge_at, color=C_MERGE, lw=2)
    ax.text(merge_at + 0.006, 0.55, f"merge decided\nat {merge_at:.2f} s", color=C_MERGE, fontsize=8.5, va="center")
    ax.text((quorum_at + merge_at) / 2, 3.52, f"grace {GRACE:.2f} s", ha="center", fontsize=8.5)
    ax.text(merge_at + XI_S / 2, 3.52, "merge +\nsend", ha="center", fontsize=8, va="center")
    # Learner 0's budget: its answer is due tau steps after it sent.
    due = start + TAU * STEP
    ax.annotate("", xy=(due, -0.55), xytext=(start, -0.55),
                arrowprops=dict(arrowstyle="<->", color="#555555", lw=1))
    ax.text(due - 0.005, -0.45, "learner 0 applies the answer\nafter tau x step = 1.0 s", fontsize=8, ha="right",
            va="top", color="#555555")
    ax.axvline(due, color="#555555", lw=1, ls=":")
    ax.set_title("A. Quorum, then the grace window (--quorum 2, 4 alive learners; "
                 "grace = 0.3 x (2 x 0.5 - 0.1 - 0.2) s)", fontsize=10, loc="left")


def panel_b(ax):
    names = ["learner 0", "learner 1", "learner 2"]
    learner_axis(ax, names, 66, "seconds since the round started")
    arrival(ax, 0, 0, C_IN, "opens the round (1 of K = 2)", dx=0.8)
    ax.plot([1], [1], marker="X", ms=10, color=C_DEAD, zorder=3)
    ax.annotate("last heard", (1, 1), xytext=(1.8, 0.7), fontsize=8.5, color=C_DEAD)
    ax.plot([1, 11], [1, 1], color=C_DEAD, lw=2, ls="--")
    ax.plot([11], [1], marker="|", ms=14, color=C_DEAD)
    ax.annotate("declared dead after the heartbeat\ntime-out (10 s): 2 alive, still below K",
                (11, 1), xytext=(12.5, 1.38), fontsize=8.5, color=C_DEAD)
    for t in range(0, 61, 1):
        ax.plot([t], [2], marker="|", ms=5, color="#bbbbbb")
    ax.annotate("alive (heartbeats every 1 s) but stalled: sends nothing for this fragment",
                (20, 2), xytext=(14, 2.4), fontsize=8.5, color="#777777")
    ax.axvline(60, color=C_MERGE, lw=2)
    ax.text(59.5, -0.62, "deadline: merge with 1 contribution\n(counted as a deadline merge)", color=C_MERGE,
            fontsize=8.5, ha="right", va="top")
    ax.set_title("B. Below the quorum: the deadline (60 s) bounds the round", fontsize=10, loc="left")


def panel_c(ax):
    ax.set_xlim(-0.5, 11.5)
    ax.set_ylim(-1.3, 1.9)
    ax.set_yticks([])
    for s in ("top", "right", "left", "bottom"):
        ax.spines[s].set_visible(False)
    ax.set_xlabel("merges of this fragment (its version grows by one per merge)")
    versions = list(range(100, 112))
    ax.plot(range(len(versions)), [0] * len(versions), color="#444444", lw=1)
    for i, v in enumerate(versions):
        ax.plot([i], [0], marker="o", ms=6, color=C_MERGE)
        ax.text(i, 0.18, f"v{v}", ha="center", fontsize=8)
    ax.set_xticks([])
    ok, stale = 6, 10
    ax.annotate("", xy=(ok, -0.05), xytext=(1, -0.05),
                arrowprops=dict(arrowstyle="<-", color=C_IN, lw=1.5, connectionstyle="arc3,rad=0.22"))
    ax.text(3.5, -1.1, "base v101 at v106: 5 behind <= 8: accepted", color=C_IN, fontsize=8.5, ha="center")
    ax.annotate("", xy=(stale, 0.05), xytext=(1, 0.05),
                arrowprops=dict(arrowstyle="<-", color=C_STALE, lw=1.5, connectionstyle="arc3,rad=-0.12"))
    ax.text(5.5, 1.2, "base v101 at v110: 9 behind > 8: rejected (stale) and answered with v110;\n"
            "the learner applies it and its next contribution counts again", color=C_STALE, fontsize=8.5,
            ha="center")
    ax.set_title("C. Staleness is counted in versions (--max-staleness 8)", fontsize=10, loc="left")


def main():
    fig, axes = plt.subplots(3, 1, figsize=(10, 9.2), gridspec_kw=dict(height_ratios=[1.35, 1.0, 0.8]))
    panel_a(axes[0])
    panel_b(axes[1])
    panel_c(axes[2])
    fig.tight_layout(h_pad=1.6)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
