#!/usr/bin/env python3
"""scripts/wan/plot_wan.py: table, plot and bandwidth-model comparison of run_wan.sh results.

What it is: reads the CSV written by scripts/wan/run_wan.sh and writes
  <out>/wan.md   the throughput table (steps/s per learner, relative to the
                 no-emulation run of the same mode, Decoupled / synchronous
                 speedup) and the measured-vs-model bandwidth table;
  <out>/wan.svg, <out>/wan.png  a plot of relative throughput per link (the
                 PNG is drawn here with a built-in 5x7 font: no plotting package).
What it is not: a statistics tool. Each grid point is one run; the machine is
shared, so read differences below ~10 % as noise.

The bandwidth model is include/ddiloco/sim/bandwidth.hpp, Method::decoupled and
decoupled_link(), mirrored here (keep the two in step): per learner, both
directions of its own link,
    f      = M / K with --send-merged-to alive, 1 with contributors
             (global fragments a learner receives per fragment it sends)
    c_up   = params / P * bits        / bandwidth + latency
    c_down = params / P * global_bits / bandwidth + latency
    utilisation = min(1, H T / (P c_up), H T / (P f c_down))
    up bits/s = params * bits / (H T), down bits/s = f * params * global_bits / (H T)
for a learner that never stalls. bits / global_bits come from the CSV's codec /
global_codec columns, the fanout from send_merged_to; rows written before those
columns existed ran with alive / fp32. Standard library only (no numpy / matplotlib).
"""
import csv
import statistics
import struct
import sys
import zlib
from pathlib import Path

BATCH = 32  # tokens per inner step of the reference trainer (TrainerConfig::batch_size)
H, P, K = 24, 5, 1  # Decoupled runs of run_wan.sh (--sync-every, --fragments, --quorum)
BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4}
RATE_BPS = {"none": None, "50mbit": 50e6, "100mbit": 100e6, "1gbit": 1e9}


def fanout(send_merged_to, learners):
    """bandwidth.hpp, decoupled_fanout(): M / K to every alive learner, 1 to the contributors."""
    return 1.0 if send_merged_to == "contributors" else learners / K


def model_utilisation(params, bits, global_bits, f, step_s, bps, latency_s):
    """bandwidth.hpp, compute_utilisation(Method::decoupled, ...) with P, H, K as run."""
    if bps is None:
        return 1.0
    c_up = params / P * bits / bps + latency_s
    c_down = params / P * global_bits / bps + latency_s
    return min(1.0, H * step_s / (P * c_up), H * step_s / (P * f * c_down))


def sync_estimate(params, step0_s, rtt_ms, bps):
    """Steps/s of the lock-step baseline, idealised. It exchanges the full fp32
    model every second step (docs/wan.md): the step after a send computes while
    the exchange is in flight, then waits for it, so two steps take one step of
    compute (step0_s: the Decoupled fp32 step time without emulation) plus one
    exchange: the round trip and S bytes up, then S bytes down, at the link rate.
    Ignores the merge, TCP ramp-up and the relay (so it is optimistic at 1 Gbit/s).
    """
    added = rtt_ms / 1000 + (0 if bps is None else 2 * params * 32 / bps)
    return 2 / (step0_s + added)


def load(path):
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            tps = [float(x) for x in r["tokens_per_s"].split(";") if x]
            steady = [float(x) for x in r["steady_steps_per_s"].split(";") if x]
            # steady state: between each learner's first and last progress line
            r["steps_per_s"] = sum(steady) / len(steady) if steady else 0.0
            n, steps, params = int(r["learners"]), int(r["steps"]), int(r["params"])
            # training time of the slowest learner (its tokens/s counts from its join)
            r["train_s"] = max(steps * BATCH / t for t in tps) if tps else float("nan")
            join_bytes = n * params * 4  # one fp32 full state per learner
            r["in_Bps"] = int(r["bytes_in"]) / r["train_s"]
            r["out_Bps"] = max(0, int(r["bytes_out"]) - join_bytes) / r["train_s"]
            r["rtt_ms"] = int(r["rtt_ms"])
            # down-link settings; rows from before these columns ran with alive / fp32
            r["send_merged_to"] = r.get("send_merged_to") or "alive"
            r["global_codec"] = r.get("global_codec") or "fp32"
            rows.append(r)
    # Several down-link settings in one CSV: keep them apart in the tables.
    settings = {(r["send_merged_to"], r["global_codec"]) for r in rows if r["mode"].startswith("decoupled")}
    if len(settings) > 1:
        for r in rows:
            if r["mode"].startswith("decoupled"):
                r["mode"] += f' ({r["send_merged_to"]}/{r["global_codec"]})'
    return aggregate(rows)


def aggregate(rows):
    """One row per (mode, link): medians over repeats (run_wan.sh --repeats)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["mode"], r["rtt_ms"], r["rate"]), []).append(r)
    out = []
    for g in groups.values():
        a = dict(g[0])
        for k in ("steps_per_s", "in_Bps", "out_Bps"):
            a[k] = statistics.median(x[k] for x in g)
        a["all_steps_per_s"] = [x["steps_per_s"] for x in g]
        for k in ("sends", "applies", "rejected_stale", "accepted", "merges"):
            a[k] = sum(int(x.get(k) or 0) for x in g)
        vals = [float(x["val_loss"]) for x in g if x.get("val_loss") not in (None, "", "nan")]
        a["val_loss"] = statistics.mean(vals) if vals else float("nan")
        a["ok"] = "1" if all(x["ok"] == "1" for x in g) else "0"
        out.append(a)
    return out


def link_name(r):
    return "none" if r["rate"] == "none" else f'{r["rtt_ms"]} ms / {r["rate"]}'


def tables(rows):
    modes = sorted({r["mode"] for r in rows}, key=lambda m: (m == "sync", m))
    links = []
    for r in rows:
        key = (r["rtt_ms"], r["rate"])
        if key not in links:
            links.append(key)
    by = {(r["mode"], r["rtt_ms"], r["rate"]): r for r in rows}
    base = {m: by.get((m, 0, "none")) for m in modes}
    dec_modes = [m for m in modes if m.startswith("decoupled")]
    out = ["| link (RTT / rate) | " + " | ".join(f"{m} steps/s (rel.)" for m in modes)
           + "".join(f' | speedup {m.removeprefix("decoupled-")} / sync' for m in dec_modes)
           + " | sync estimate steps/s |",
           "|---" * (len(modes) + len(dec_modes) + 2) + "|"]
    plot = []
    for rtt, rate in links:
        cells = []
        for m in modes:
            r = by.get((m, rtt, rate))
            if r is None:
                cells.append("-")
                continue
            rel = r["steps_per_s"] / base[m]["steps_per_s"] if base[m] else float("nan")
            reps = "/".join(f"{v:.0f}" for v in r["all_steps_per_s"])
            cells.append(f'{r["steps_per_s"]:.1f} ({rel:.0%}; runs {reps}) val {r["val_loss"]:.2f}'
                         + ("" if r["ok"] == "1" else " FAILED"))
            if rel == rel:  # not NaN (no baseline run in the CSV)
                plot.append((m, f"{rtt} ms / {rate}" if rate != "none" else "none", rel))
        s = by.get(("sync", rtt, rate))
        sp = []
        for m in dec_modes:
            d = by.get((m, rtt, rate))
            sp.append(f'{d["steps_per_s"] / s["steps_per_s"]:.1f}x' if d and s and s["steps_per_s"] else "-")
        est = "-"
        if s and base.get("decoupled-fp32") and rate != "none":
            est = f'{sync_estimate(int(s["params"]), 1 / base["decoupled-fp32"]["steps_per_s"], rtt, RATE_BPS[rate]):.1f}'
        out.append(f'| {"none" if rate == "none" else f"{rtt} ms / {rate}"} | ' + " | ".join(cells)
                   + " | " + " | ".join(sp) + f" | {est} |")

    # Bandwidth: measured vs bandwidth.hpp.
    bw = ["| mode | down-link (to / codec) | link | steps/s | up MB/s (all learners) | model up MB/s | "
          "up meas. / model | down MB/s | model down MB/s | down meas. / model | merges / accepted | "
          "model util. (latency per fragment) | model util. (no latency) | measured rel. | applies / sends | "
          "accepted / sends |",
          "|---" * 16 + "|"]
    for r in rows:
        if not r["mode"].startswith("decoupled"):
            continue
        n, params, bits = int(r["learners"]), int(r["params"]), BITS[r["codec"]]
        gbits, f = BITS[r["global_codec"]], fanout(r["send_merged_to"], n)
        b = base.get(r["mode"])
        t0 = 1.0 / b["steps_per_s"] if b else float("nan")  # step time without emulation
        t = 1.0 / r["steps_per_s"]
        # bytes/s of all learners at the measured step rate
        model_up = n * params * bits / 8 / (H * t)
        model_down = n * f * params * gbits / 8 / (H * t)
        bps = RATE_BPS[r["rate"]]
        u_lat = model_utilisation(params, bits, gbits, f, t0, bps, r["rtt_ms"] / 2000)
        u_bw = model_utilisation(params, bits, gbits, f, t0, bps, 0.0)
        rel = r["steps_per_s"] / b["steps_per_s"] if b else float("nan")
        merges = r["merges"]
        bw.append(f'| {r["mode"]} | {r["send_merged_to"]} / {r["global_codec"]} | {link_name(r)} | '
                  f'{r["steps_per_s"]:.1f} | {r["in_Bps"] / 1e6:.2f} | {model_up / 1e6:.2f} | '
                  f'{r["in_Bps"] / model_up:.2f} | '
                  f'{r["out_Bps"] / 1e6:.2f} | {model_down / 1e6:.2f} | {r["out_Bps"] / model_down:.2f} | '
                  f'{merges / max(1, r["accepted"]):.2f} | {u_lat:.2f} | {u_bw:.2f} | {rel:.2f} | '
                  f'{r["applies"] / max(1, r["sends"]):.2f} | {r["accepted"] / max(1, r["sends"]):.2f} |')
    return out, bw, plot, modes


def svg(plot, modes, path):
    links = []
    for _, l, _ in plot:
        if l not in links:
            links.append(l)
    colors = {"decoupled-fp32": "#1f77b4", "decoupled-int4": "#2ca02c", "sync": "#d62728"}
    W, Hh, left, bottom, top = 900, 420, 60, 90, 30
    gw = (W - left - 20) / max(1, len(links))
    bwid = gw * 0.8 / max(1, len(modes))
    ymax = max(1.2, max((v for _, _, v in plot), default=1.0) * 1.05)
    y = lambda v: top + (Hh - top - bottom) * (1 - v / ymax)
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{Hh}" font-family="sans-serif" '
         f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
         f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13">Learner steps/s relative to the run '
         f'without emulation (4 learners, one per region)</text>']
    for k in range(0, int(ymax * 10) + 1, 2):
        v = k / 10
        s.append(f'<line x1="{left}" x2="{W - 20}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                 f'<text x="{left - 5}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>')
    s.append(f'<line x1="{left}" x2="{W - 20}" y1="{y(0.9):.1f}" y2="{y(0.9):.1f}" stroke="#888" '
             f'stroke-dasharray="4 3"/><text x="{W - 22}" y="{y(0.9) - 3:.1f}" text-anchor="end">90 %</text>')
    for i, l in enumerate(links):
        x0 = left + i * gw + gw * 0.1
        for j, m in enumerate(modes):
            v = next((v for mm, ll, v in plot if mm == m and ll == l), None)
            if v is None:
                continue
            x = x0 + j * bwid
            s.append(f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bwid - 2:.1f}" height="{y(0) - y(v):.1f}" '
                     f'fill="{colors.get(m, "#999")}"/>')
        s.append(f'<text x="{left + i * gw + gw / 2:.1f}" y="{Hh - bottom + 16}" text-anchor="middle">{l}</text>')
    for j, m in enumerate(modes):
        s.append(f'<rect x="{left + j * 160}" y="{Hh - 40}" width="12" height="12" fill="{colors.get(m, "#999")}"/>'
                 f'<text x="{left + j * 160 + 16}" y="{Hh - 30}">{m}</text>')
    s.append("</svg>")
    path.write_text("\n".join(s) + "\n")


# --- PNG without third-party packages: a bar chart drawn into an RGB buffer
# with a 5x7 bitmap font (lower case, digits, a little punctuation).
# 5x7 glyphs, rows top to bottom, '#' = ink
GLYPHS = {
'a':[".....",".....",".###.","....#",".####","#...#",".####"],
'b':["#....","#....","####.","#...#","#...#","#...#","####."],
'c':[".....",".....",".###.","#....","#....","#...#",".###."],
'd':["....#","....#",".####","#...#","#...#","#...#",".####"],
'e':[".....",".....",".###.","#...#","#####","#....",".###."],
'f':["..##.",".#..#",".#...","###..",".#...",".#...",".#..."],
'g':[".....",".####","#...#","#...#",".####","....#",".###."],
'h':["#....","#....","#.##.","##..#","#...#","#...#","#...#"],
'i':["..#..",".....",".##..","..#..","..#..","..#..",".###."],
'j':["...#.",".....","..##.","...#.","...#.","#..#.",".##.."],
'k':["#....","#....","#..#.","#.#..","##...","#.#..","#..#."],
'l':[".##..","..#..","..#..","..#..","..#..","..#..",".###."],
'm':[".....",".....","##.#.","#.#.#","#.#.#","#...#","#...#"],
'n':[".....",".....","#.##.","##..#","#...#","#...#","#...#"],
'o':[".....",".....",".###.","#...#","#...#","#...#",".###."],
'p':[".....",".....","####.","#...#","####.","#....","#...."],
'q':[".....",".....",".####","#...#",".####","....#","....#"],
'r':[".....",".....","#.##.","##..#","#....","#....","#...."],
's':[".....",".....",".####","#....",".###.","....#","####."],
't':[".#...",".#...","###..",".#...",".#...",".#..#","..##."],
'u':[".....",".....","#...#","#...#","#...#","#..##",".##.#"],
'v':[".....",".....","#...#","#...#","#...#",".#.#.","..#.."],
'w':[".....",".....","#...#","#...#","#.#.#","#.#.#",".#.#."],
'x':[".....",".....","#...#",".#.#.","..#..",".#.#.","#...#"],
'y':[".....",".....","#...#","#...#",".####","....#",".###."],
'z':[".....",".....","#####","...#.","..#..",".#...","#####"],
'0':[".###.","#...#","#..##","#.#.#","##..#","#...#",".###."],
'1':["..#..",".##..","..#..","..#..","..#..","..#..",".###."],
'2':[".###.","#...#","....#","...#.","..#..",".#...","#####"],
'3':["#####","...#.","..#..","...#.","....#","#...#",".###."],
'4':["...#.","..##.",".#.#.","#..#.","#####","...#.","...#."],
'5':["#####","#....","####.","....#","....#","#...#",".###."],
'6':["..##.",".#...","#....","####.","#...#","#...#",".###."],
'7':["#####","....#","...#.","..#..",".#...",".#...",".#..."],
'8':[".###.","#...#","#...#",".###.","#...#","#...#",".###."],
'9':[".###.","#...#","#...#",".####","....#","...#.",".##.."],
' ':["....."]*7,
'.':[".....",".....",".....",".....",".....",".##..",".##.."],
'/':[".....","....#","...#.","..#..",".#...","#....","....."],
'%':["##...","##..#","...#.","..#..",".#...","#..##","...##"],
'-':[".....",".....",".....","#####",".....",".....","....."],
'(':["...#.","..#..",".#...",".#...",".#...","..#..","...#."],
')':[".#...","..#..","...#.","...#.","...#.","..#..",".#..."],
',':[".....",".....",".....",".....",".##..","..#..",".#..."],
':':[".....",".##..",".##..",".....",".##..",".##..","....."],
'x':[".....",".....","#...#",".#.#.","..#..",".#.#.","#...#"],
}


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def rect(self, x0, y0, x1, y1, rgb):
        x0, x1 = max(0, int(min(x0, x1))), min(self.w, int(max(x0, x1)))
        y0, y1 = max(0, int(min(y0, y1))), min(self.h, int(max(y0, y1)))
        row = bytes(rgb) * (x1 - x0)
        for y in range(y0, y1):
            o = (y * self.w + x0) * 3
            self.px[o:o + len(row)] = row

    def text(self, x, y, s, rgb=(0, 0, 0), scale=2, anchor="left"):
        width = len(s) * 6 * scale
        if anchor == "middle":
            x -= width / 2
        elif anchor == "end":
            x -= width
        for i, ch in enumerate(s.lower()):
            g = GLYPHS.get(ch, GLYPHS[" "])
            for r, line in enumerate(g):
                for c, v in enumerate(line):
                    if v == "#":
                        gx, gy = x + (i * 6 + c) * scale, y + r * scale
                        self.rect(gx, gy, gx + scale, gy + scale, rgb)

    def png(self, path):
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))
        chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
        Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                               + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def png(plot, modes, path):
    links = []
    for _, l, _ in plot:
        if l not in links:
            links.append(l)
    colors = {"decoupled-fp32": (31, 119, 180), "decoupled-int4": (44, 160, 44), "sync": (214, 39, 40)}
    W, Hh, left, bottom, top = 1200, 560, 80, 120, 50
    cv = Canvas(W, Hh)
    gw = (W - left - 20) / max(1, len(links))
    bwid = gw * 0.8 / max(1, len(modes))
    ymax = max(1.2, max((v for _, _, v in plot), default=1.0) * 1.05)
    y = lambda v: top + (Hh - top - bottom) * (1 - v / ymax)
    cv.text(W / 2, 12, "learner steps/s relative to the run without emulation", anchor="middle")
    for k in range(0, int(ymax * 10) + 1, 2):
        v = k / 10
        cv.rect(left, y(v), W - 20, y(v) + 1, (221, 221, 221))
        cv.text(left - 8, y(v) - 7, f"{v:.1f}", anchor="end")
    for x in range(left, W - 20, 10):
        cv.rect(x, y(0.9), x + 5, y(0.9) + 2, (100, 100, 100))
    cv.text(W - 22, y(0.9) - 18, "90%", anchor="end")
    for i, l in enumerate(links):
        x0 = left + i * gw + gw * 0.1
        for j, m in enumerate(modes):
            v = next((v for mm, ll, v in plot if mm == m and ll == l), None)
            if v is not None:
                cv.rect(x0 + j * bwid, y(v), x0 + (j + 1) * bwid - 2, y(0), colors.get(m, (150, 150, 150)))
        parts = l.split(" / ")
        for k, part in enumerate(parts):
            cv.text(left + i * gw + gw / 2, Hh - bottom + 8 + k * 18, part, anchor="middle")
    for j, m in enumerate(modes):
        cv.rect(left + j * 260, Hh - 40, left + j * 260 + 16, Hh - 24, colors.get(m, (150, 150, 150)))
        cv.text(left + j * 260 + 24, Hh - 39, m)
    cv.png(path)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_wan.py WAN_CSV OUT_DIR")
    rows = load(sys.argv[1])
    out_dir = Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    thr, bw, plot, modes = tables(rows)
    (out_dir / "wan.md").write_text("## Throughput\n\n" + "\n".join(thr) + "\n\n## Bandwidth: measured vs "
                                    "include/ddiloco/sim/bandwidth.hpp\n\n" + "\n".join(bw) + "\n")
    svg(plot, modes, out_dir / "wan.svg")
    png(plot, modes, out_dir / "wan.png")
    print((out_dir / "wan.md").read_text())


if __name__ == "__main__":
    main()
