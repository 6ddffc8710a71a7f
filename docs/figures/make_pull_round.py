#!/usr/bin/python3
"""Draws docs/figures/pull_round.png, the pull round of docs/algorithm.md ("Round timeline").

    /usr/bin/python3 docs/figures/make_pull_round.py [OUT.png]

One round of fragment p with M = 3 learners, learner 3 twice as slow, tau = 2, K = 1, drawn in
time (one fast inner step = 1 unit): every learner sends metadata after each step; the global
step reaches p's slot; the quorum forms and the grace window runs; the pull goes to every
learner with progress on p; each answers at its next step boundary; the syncer merges the
answers and sends the new global; each learner applies it tau of its steps after its answer.
All three learners have progress on p at the slot, so the round does not wait for a grace window
(it would, for at most Eq. 3's window, if an eligible learner had not reported yet).
Needs only matplotlib (Debian: python3-matplotlib).
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "pull_round.png"

TAU = 2
STEP = {1: 1.0, 2: 1.0, 3: 2.0}     # inner-step time of each learner
PHASE = {1: 0.0, 2: 0.3, 3: 0.6}    # when each learner's first drawn step ends
SLOT = 3.0                           # the metadata that reaches p's slot arrives here
PULL = SLOT + 0.05                   # every eligible learner has reported: the pull goes out at once
C_META, C_PULL, C_ANS, C_MERGE, C_APPLY = "#999999", "#8e44ad", "#2b7bba", "#2e9e44", "#e67e22"

fig, ax = plt.subplots(figsize=(10, 3.6))
rows = {1: 3, 2: 2, 3: 1, "syncer": 0}
for m in (1, 2, 3):
    y = rows[m]
    ax.axhline(y, color="#dddddd", lw=0.8, zorder=0)
    t, ends = PHASE[m], []
    while t < 9.5:
        ends.append(t)
        t += STEP[m]
    for e in ends:  # metadata after every step
        ax.plot([e], [y], marker="|", color=C_META, ms=10)
    answer = next(e for e in ends if e > PULL + 0.05)
    ax.annotate("", xy=(answer + 0.1, 0.08), xytext=(answer, y - 0.08),
                arrowprops=dict(arrowstyle="->", color=C_ANS, lw=1.6))
    later = [e for e in ends if e > answer]
    apply = later[TAU - 1]
    ax.plot([apply], [y], marker="o", color=C_APPLY, ms=8, zorder=3)
    ax.annotate("", xy=(answer - 0.02, y - 0.05), xytext=(PULL, 0.1),
                arrowprops=dict(arrowstyle="->", color=C_PULL, lw=1.0, ls="--"))
ax.axhline(0, color="#dddddd", lw=0.8, zorder=0)
ax.plot([SLOT], [0], marker="D", color="black", ms=7)
merge = max(next(e for e in [PHASE[m] + k * STEP[m] for k in range(20)] if e > PULL + 0.05) for m in (1, 2, 3)) + 0.1
ax.plot([merge], [0], marker="*", color=C_MERGE, ms=16, zorder=3)
for m in (1, 2, 3):
    ax.annotate("", xy=(merge + 0.15, rows[m] - 0.08), xytext=(merge, 0.08),
                arrowprops=dict(arrowstyle="->", color=C_MERGE, lw=1.0))
ax.set_yticks([0, 1, 2, 3])
ax.set_yticklabels(["syncer", "learner 3 (2x slow)", "learner 2", "learner 1"])
ax.set_xlabel("time (one fast inner step = 1)")
ax.set_xlim(-0.3, 10)
ax.set_ylim(-0.6, 3.6)
legend = [
    plt.Line2D([], [], color=C_META, marker="|", ls="", ms=10, label="metadata (every step)"),
    plt.Line2D([], [], color="black", marker="D", ls="", label="global step reaches p's slot"),
    plt.Line2D([], [], color=C_PULL, ls="--", label="pull"),
    plt.Line2D([], [], color=C_ANS, label="answer at the next step boundary"),
    plt.Line2D([], [], color=C_MERGE, marker="*", ls="", ms=12, label="merge, new global sent"),
    plt.Line2D([], [], color=C_APPLY, marker="o", ls="", label="apply, tau steps after the answer"),
]
ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
ax.set_title("One pull round of fragment p (M = 3, tau = 2, K = 1)")
fig.tight_layout()
fig.savefig(OUT, dpi=110)
print(f"wrote {OUT}")
