#!/usr/bin/env bash
# scripts/wan/run_wan.sh: Decoupled DiLoCo and a synchronous baseline over an
# emulated multi-region WAN on one machine (docs/wan.md).
#
# What it is: builds a syncer network namespace and N "region" namespaces
# (default 4, one learner each). Each region reaches the syncer over its own
# link: a pair of TUN devices (one in the region, one in the syncer namespace)
# joined by a small relay process that holds every packet for RTT/2 in each
# direction, with a `tc tbf` rate limit on the egress of both TUN ends (the
# link's bandwidth per direction). Runs ddiloco_syncer / ddiloco_learner inside
# the namespaces with `ip netns exec` for a grid of (RTT, rate, mode), collects
# their logs and the syncer's status file, and writes one CSV row per run.
#
# Why a relay and not `tc netem`: the kernel this was written on has no
# sch_netem (only tbf, htb, pfifo); the relay gives the same delay semantics on
# real kernel TCP sockets (the end-to-end TCP connection sees the full RTT,
# slow start and window growth included). If netem is present the script still
# uses the relay, so results stay comparable across machines.
#
# What it is not: a packet-loss, jitter or congestion model, or a benchmark of
# ZeroMQ. All addresses are private (10.77.0.0/24) and exist only inside the
# namespaces it creates; nothing leaves the machine. Everything it creates is
# removed on EXIT/INT/TERM. Without root, network-namespace or TUN/tbf support
# it prints "wan: skipped: <why>" and exits 0.
#
# Usage: run_wan.sh --bin DIR [--out DIR] [--smoke] [--grid "RTT_MS:RATE ..."]
#        [--modes "decoupled-fp32 decoupled-int4 sync"] [--learners N]
#        [--steps-decoupled N] [--steps-sync N] [--repeats N]
#        [--send-merged-to contributors|alive] [--global-codec fp32|bf16|...]
#   --send-merged-to / --global-codec: the Decoupled syncer's down-link
#   (ddiloco_syncer flags of the same names; defaults contributors / fp32: each
#   merged fragment goes back only to the learners whose contributions it holds).
#   --repeats N runs the whole grid N times, one pass after the other (so slow
#   drifts of the machine's load spread over all grid points).
#   RATE is a tc rate (50mbit, 100mbit, 1gbit) or "none" (no limit); the grid
#   point "0:none" is the run without emulation (same namespaces, relay with no
#   delay and no rate limit).
# Join test: run_wan.sh --bin DIR --join-test --probe PATH [--join-mib N]
#   [--join-rate RATE] [--join-budget-mb N]: a learner joins a model of N MiB
#   (default 16) over a RATE link (default 4mbit, 20 ms RTT) while another
#   learner trains; the syncer's per-peer send budget is --join-budget-mb
#   (default 1: the state is 16 times the budget, as a 1 GiB model is to the
#   default 64 MiB). PATH is ddiloco_join_probe (tests/tools). Fails unless the
#   state arrives whole with no byte sent twice, within its derived time-out,
#   and the training learner's merges go on meanwhile; prints the join time and
#   its extrapolation to 1 GiB at 100 Mbit/s (docs/operations.md).
# Shard test: run_wan.sh --bin DIR --shard-test: a syncer sharded by fragment
#   (docs/sharding.md), each of its 2 shards in a namespace of its own, and 2
#   learners in their regions, each region with a 50 ms RTT, 100 Mbit/s link to
#   each shard. Shard 1 is killed with SIGKILL once it has checkpointed; fails
#   unless shard 0 keeps merging and every learner keeps training while it is
#   down, the restarted shard 1 resumes from its checkpoint and accepts
#   contributions again, no contribution is rejected as wrong_shard, and the
#   learners' validation loss ends below where it started.
set -u -o pipefail

BIN="" OUT="" SMOKE=0 LEARNERS=4 JOIN_TEST=0 PROBE="" JOIN_MIB=16 JOIN_RATE=4mbit JOIN_BUDGET_MB=1 SHARD_TEST=0
GRID="0:none 20:50mbit 20:100mbit 20:1gbit 50:100mbit 100:50mbit 100:100mbit 100:1gbit"
MODES="decoupled-fp32 decoupled-int4 sync"
STEPS_DEC=3000 STEPS_SYNC=100 REPEATS=1 SEND_TO=contributors GLOBAL_CODEC=fp32
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --grid) GRID="$2"; shift 2 ;;
    --modes) MODES="$2"; shift 2 ;;
    --learners) LEARNERS="$2"; shift 2 ;;
    --steps-decoupled) STEPS_DEC="$2"; shift 2 ;;
    --steps-sync) STEPS_SYNC="$2"; shift 2 ;;
    --repeats) REPEATS="$2"; shift 2 ;;
    --send-merged-to) SEND_TO="$2"; shift 2 ;;
    --global-codec) GLOBAL_CODEC="$2"; shift 2 ;;
    --join-test) JOIN_TEST=1; shift ;;
    --probe) PROBE="$2"; shift 2 ;;
    --join-mib) JOIN_MIB="$2"; shift 2 ;;
    --join-rate) JOIN_RATE="$2"; shift 2 ;;
    --join-budget-mb) JOIN_BUDGET_MB="$2"; shift 2 ;;
    --shard-test) SHARD_TEST=1; shift ;;
    -h|--help) sed -n '2,54p' "$0"; exit 0 ;;
    *) echo "run_wan.sh: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
if [ "$SMOKE" = 1 ]; then
  GRID="50:100mbit" MODES="decoupled-int4 sync" STEPS_DEC=150 STEPS_SYNC=15 LEARNERS=2
fi
[ -n "$BIN" ] || { echo "run_wan.sh: --bin DIR (holding ddiloco_syncer and ddiloco_learner) is required" >&2; exit 2; }
for p in ddiloco_syncer ddiloco_learner; do
  [ -x "$BIN/$p" ] || { echo "run_wan.sh: $BIN/$p not found; build it first" >&2; exit 2; }
done
if [ "$SHARD_TEST" = 1 ]; then
  LEARNERS=2
fi
if [ "$JOIN_TEST" = 1 ]; then
  [ -x "$PROBE" ] || { echo "run_wan.sh: --join-test needs --probe PATH (ddiloco_join_probe); build it first" >&2; exit 2; }
  LEARNERS=2
fi
OUT="${OUT:-$(pwd)/wan-out}"
mkdir -p "$OUT"

skip() { echo "wan: skipped: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces, TUN devices, tc)"
command -v ip >/dev/null || skip "iproute2 'ip' not found"
command -v tc >/dev/null || skip "iproute2 'tc' not found"
command -v python3 >/dev/null || skip "python3 not found (the delay relay)"
[ -c /dev/net/tun ] || skip "/dev/net/tun missing (no TUN support)"

TAG="wan$$"
NS_S="${TAG}s"
PIDS=()
NAMESPACES=()
WORK="$(mktemp -d /tmp/ddiloco-wan.XXXXXX)"

cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  PIDS=()
  local ns
  for ns in "${NAMESPACES[@]}"; do ip netns del "$ns" 2>/dev/null; done
  NAMESPACES=()
}
trap 'cleanup; rm -rf "$WORK"' EXIT
trap 'echo "run_wan.sh: interrupted, cleaning up" >&2; exit 130' INT TERM

ip netns add "${TAG}probe" 2>/dev/null || skip "cannot create a network namespace (ip netns add failed)"
NAMESPACES+=("${TAG}probe")
ip -n "${TAG}probe" tuntap add dev t0 mode tun 2>/dev/null || skip "cannot create a TUN device in a namespace"
ip -n "${TAG}probe" link set t0 up
ip netns exec "${TAG}probe" tc qdisc add dev t0 root tbf rate 100mbit burst 256kb limit 1mb 2>/dev/null ||
  skip "tc qdisc tbf is not available in this kernel"
cleanup

# The relay: one process per link. Attaches to the region's TUN (in the region
# namespace) and the syncer-side TUN, forwards each IP packet after `delay`
# seconds, in FIFO order per direction (a constant delay keeps FIFO = due order).
cat >"$WORK/relay.py" <<'PY'
import ctypes, fcntl, os, select, struct, sys, time
from collections import deque
CLONE_NEWNET, TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x40000000, 0x400454CA, 0x0001, 0x1000
libc = ctypes.CDLL(None, use_errno=True)
def tun_in(ns, name):
    fd_ns = os.open("/var/run/netns/" + ns, os.O_RDONLY)
    if libc.setns(fd_ns, CLONE_NEWNET) != 0:
        sys.exit("relay: setns %s: errno %d" % (ns, ctypes.get_errno()))
    os.close(fd_ns)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd
ns_a, dev_a, ns_b, dev_b, delay = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
a, b = tun_in(ns_a, dev_a), tun_in(ns_b, dev_b)
queues = {a: deque(), b: deque()}   # packets read from fd, waiting to be written to the other
other = {a: b, b: a}
sys.stdout.write("ready\n"); sys.stdout.flush()
while True:
    now = time.monotonic()
    for src, q in queues.items():
        while q and q[0][0] <= now:
            try:
                os.write(other[src], q.popleft()[1])
            except OSError:
                pass  # the stack refused the packet: like a drop, TCP resends
    due = [q[0][0] for q in queues.values() if q]
    timeout = max(0.0, min(due) - time.monotonic()) if due else 1.0
    ready, _, _ = select.select([a, b], [], [], timeout)
    now = time.monotonic()
    for fd in ready:
        while True:
            try:
                pkt = os.read(fd, 70000)
            except BlockingIOError:
                break
            queues[fd].append((now + delay, pkt))
PY

# Large MTU: the relay is Python, and fewer, larger packets keep its CPU use
# (which competes with the learners on a small machine) low.
MTU=65000

# net_up RTT_MS RATE [SYNCER_NAMESPACES]: syncer namespace(s) + LEARNERS
# regions, one link (relay) per region and syncer namespace. Syncer namespace j
# (default: NS_S alone) is 10.77.0.(1 + j); region i reaches it on its device wanj.
net_up() {
  local rtt_ms="$1" rate="$2" i j ns sns delay
  local -a syncers=(${3:-$NS_S})
  delay="$(python3 -c "print($rtt_ms / 2000.0)")"
  for sns in "${syncers[@]}"; do
    ip netns add "$sns" && NAMESPACES+=("$sns") || return 1
    ip -n "$sns" link set lo up
  done
  for ((i = 0; i < LEARNERS; i++)); do
    ns="${TAG}r$i"
    ip netns add "$ns" && NAMESPACES+=("$ns") || return 1
    ip -n "$ns" link set lo up
  done
  local links=0
  for ((j = 0; j < ${#syncers[@]}; j++)); do
  sns="${syncers[$j]}"
  for ((i = 0; i < LEARNERS; i++)); do
    ns="${TAG}r$i"
    local wan="wan$j"
    ip -n "$ns" tuntap add dev "$wan" mode tun || return 1
    ip -n "$sns" tuntap add dev "r$i" mode tun || return 1
    ip -n "$ns" link set "$wan" mtu "$MTU" up
    ip -n "$sns" link set "r$i" mtu "$MTU" up
    ip -n "$ns" addr add "10.77.0.$((10 + i))/32" dev "$wan" 2>/dev/null
    ip -n "$ns" route add "10.77.0.$((1 + j))/32" dev "$wan"
    ip -n "$sns" addr add "10.77.0.$((1 + j))/32" dev "r$i" 2>/dev/null
    ip -n "$sns" route add "10.77.0.$((10 + i))/32" dev "r$i"
    if [ "$rate" != none ]; then
      # burst: 2 ms at the rate, at least one packet (tbf drops packets larger
      # than the bucket); a bigger bucket would let an idle lock-step learner
      # send its first burst at line speed. Queue: 2 bandwidth-delay products + 1 MB.
      local bps burst limit
      bps="$(python3 -c "
import re; m = re.fullmatch(r'(\d+)(k|m|g)bit', '$rate'); print(int(m[1]) * {'k': 1e3, 'm': 1e6, 'g': 1e9}[m[2]])")"
      burst="$(python3 -c "print(max(int($bps / 8 * 0.002), $MTU + 1000))")"
      limit="$(python3 -c "print(int(2 * $bps / 8 * max($rtt_ms, 1) / 1000 + 1e6))")"
      ip netns exec "$ns" tc qdisc add dev "$wan" root tbf rate "$rate" burst "$burst" limit "$limit" || return 1
      ip netns exec "$sns" tc qdisc add dev "r$i" root tbf rate "$rate" burst "$burst" limit "$limit" || return 1
    fi
    python3 "$WORK/relay.py" "$ns" "$wan" "$sns" "r$i" "$delay" >"$WORK/relay$links.log" 2>&1 &
    PIDS+=($!)
    links=$((links + 1))
  done
  done
  for ((i = 0; i < links; i++)); do
    for _ in $(seq 100); do grep -q ready "$WORK/relay$i.log" 2>/dev/null && break; sleep 0.05; done
    grep -q ready "$WORK/relay$i.log" || { echo "run_wan.sh: relay $i failed: $(cat "$WORK/relay$i.log")" >&2; return 1; }
  done
}

# run_mode MODE RTT RATE: one syncer + LEARNERS learners; appends a CSV row.
run_mode() {
  local mode="$1" rtt="$2" rate="$3" i
  local dir="$OUT/logs/${mode}_rtt${rtt}_${rate}_rep$REP"
  rm -rf "$dir"; mkdir -p "$dir"
  local sflags lflags steps codec=fp32 send_to=alive gcodec=fp32
  case "$mode" in
    decoupled-*)
      codec="${mode#decoupled-}"
      steps="$STEPS_DEC"
      send_to="$SEND_TO" gcodec="$GLOBAL_CODEC"
      sflags="--fragments 5 --sync-every 24 --overlap 2 --quorum 1 --outer-momentum 0.5 --send-merged-to $send_to --global-codec $gcodec"
      lflags="--fragments 5 --sync-every 24 --overlap 2 --codec $codec" ;;
    sync)
      # Synchronous baseline: every step exchanges the full model delta; the
      # syncer averages all learners' deltas (K = all) and returns the average.
      steps="$STEPS_SYNC"
      # Push rounds: each learner sends at every step and waits for the average
      # (lock-step); a pull round per step would cost a pull round trip each.
      sflags="--round push --fragments 1 --sync-every 1 --overlap 0 --quorum $LEARNERS --merge average --outer-optimizer average --grace-gamma 0"
      lflags="--round push --fragments 1 --sync-every 1 --overlap 0 --codec fp32 --lock-step --lock-step-timeout-ms 20000" ;;
    *) echo "run_wan.sh: unknown mode '$mode'" >&2; return 1 ;;
  esac
  # shellcheck disable=SC2086
  ip netns exec "$NS_S" "$BIN/ddiloco_syncer" --reference-model --plaintext --bind tcp://10.77.0.1:5555 \
    $sflags --status-file "$dir/status" --status-every-ms 1000 >"$dir/syncer.log" 2>&1 &
  local spid=$!
  PIDS+=("$spid")
  # No wait for the syncer: a learner's join is retried until --join-timeout-ms.
  local t0 t1 lpids=()
  t0="$(date +%s.%N)"
  for ((i = 0; i < LEARNERS; i++)); do
    # shellcheck disable=SC2086
    ip netns exec "${TAG}r$i" "$BIN/ddiloco_learner" --connect tcp://10.77.0.1:5555 --plaintext --id "$i" \
      --shard "$i" --shards "$LEARNERS" --steps "$steps" $lflags --eval-every "$((steps / 5))" --eval-examples 64 \
      --join-timeout-ms 30000 >"$dir/learner$i.log" 2>&1 &
    lpids+=($!)
    PIDS+=($!)
  done
  local ok=1
  for i in "${!lpids[@]}"; do wait "${lpids[$i]}" || ok=0; done
  t1="$(date +%s.%N)"
  kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
  PIDS=("${PIDS[@]:0:${#PIDS[@]}-$((LEARNERS + 1))}")
  # tokens/s of each learner (its last progress line); steps/s = tokens/s / batch (32).
  local tps
  tps="$(for ((i = 0; i < LEARNERS; i++)); do
    grep -o 'tokens/s [0-9.]*' "$dir/learner$i.log" | tail -1 | awk '{print $2}'; done | paste -sd' ')"
  # Steady-state steps/s of each learner: between its first and last progress
  # line (a line at step s with cumulative tokens/s r was printed s * 32 / r
  # seconds after its join), so the joins and the first round are excluded.
  local steady
  steady="$(for ((i = 0; i < LEARNERS; i++)); do
    awk '/ step [0-9]+ train / { for (k = 1; k <= NF; ++k) { if ($k == "step") s = $(k + 1); if ($k == "tokens/s") r = $(k + 1) }
           t = s * 32 / r; if (n++ == 0) { s0 = s; t0 = t } else { s1 = s; t1 = t } }
         END { if (n > 1) printf "%.2f\n", (s1 - s0) / (t1 - t0); else print 0 }' "$dir/learner$i.log"; done | paste -sd';')"
  local sends applies
  sends="$(for f in "$dir"/learner*.log; do grep -o ' sends [0-9]*' "$f" | tail -1; done | awk '{n += $2} END {print n + 0}')"
  applies="$(for f in "$dir"/learner*.log; do grep -o ' applies [0-9]*' "$f" | tail -1; done | awk '{n += $2} END {print n + 0}')"
  local val accepted
  val="$(for f in "$dir"/learner*.log; do grep -o ' val [0-9.]*' "$f" | tail -1; done | awk '{v += $2; n++} END {if (n) printf "%.4f", v / n}')"
  accepted="$(sed -n 's/^accepted=//p' "$dir/status" 2>/dev/null)"
  local params
  params="$(grep -o '[0-9]* parameters' "$dir/learner0.log" | head -1 | awk '{print $1}')"
  local bin bout merges
  bin="$(sed -n 's/^bytes_in=//p' "$dir/status" 2>/dev/null)"
  bout="$(sed -n 's/^bytes_out=//p' "$dir/status" 2>/dev/null)"
  merges="$(sed -n 's/^merges=//p' "$dir/status" 2>/dev/null)"
  local stale
  stale="$(sed -n 's/^rejected_stale=//p' "$dir/status" 2>/dev/null)"
  echo "$mode,$rtt,$rate,$LEARNERS,$steps,$codec,${params:-0},$(echo "$tps" | tr ' ' ';'),$(python3 -c "print(f'{$t1 - $t0:.3f}')"),${bin:-0},${bout:-0},${merges:-0},$ok,$steady,$sends,$applies,${stale:-0},${accepted:-0},${val:-nan},$REP,$send_to,$gcodec" >>"$OUT/wan.csv"
  echo "wan: rep $REP $mode rtt=${rtt}ms rate=$rate tokens/s per learner: $tps steady steps/s: $steady merges=${merges:-?} accepted=${accepted:-?} stale=${stale:-?} val=${val:-?} bytes_in=${bin:-?} bytes_out=${bout:-?} ok=$ok"
  [ "$ok" = 1 ] && [ "${merges:-0}" -gt 0 ]
}

# join_test: learner 0 (region 0) joins and trains a JOIN_MIB model at one
# synthetic step per 200 ms; learner 1 (region 1) joins while it does. Both
# links run JOIN_RATE with 20 ms RTT.
join_test() {
  local dir="$OUT/logs/join_${JOIN_MIB}mib_${JOIN_RATE}" tensors=16 mbit
  rm -rf "$dir"; mkdir -p "$dir"
  mbit="$(python3 -c "
import re; m = re.fullmatch(r'(\d+)(k|m|g)bit', '$JOIN_RATE'); print(int(m[1]) * {'k': 1e-3, 'm': 1, 'g': 1e3}[m[2]])")"
  # 16 tensors of JOIN_MIB / 16 MiB each, one fragment each.
  local numel=$((JOIN_MIB * 1024 * 1024 / 4 / tensors)) i
  for ((i = 0; i < tensors; i++)); do echo "t$i $numel"; done >"$dir/tensors.txt"
  # H = 480 at a step per 200 ms: learner 0 sends one 1 MiB fragment per 6 s (1.4 Mbit/s of its link).
  local model="--tensors $dir/tensors.txt --fragments $tensors --sync-every 480 --overlap 2"
  local ep=tcp://10.77.0.1:5555
  # shellcheck disable=SC2086
  ip netns exec "$NS_S" "$BIN/ddiloco_syncer" $model --allow-zero-init --plaintext --bind "$ep" --quorum 1 \
    --outer-momentum 0.5 --peer-send-budget-mb "$JOIN_BUDGET_MB" --status-file "$dir/status" --status-every-ms 500 \
    >"$dir/syncer.log" 2>&1 &
  local spid=$! p0 p1
  PIDS+=("$spid")
  # shellcheck disable=SC2086
  ip netns exec "${TAG}r0" "$PROBE" --plaintext --connect "$ep" --id 0 $model --join-link-mbit "$mbit" \
    --step-ms 200 --report-every 5 --stop-file "$dir/stop" >"$dir/learner0.log" 2>&1 &
  p0=$!
  PIDS+=("$p0")
  local limit=$((SECONDS + 600))
  until grep -q "probe 0: joined" "$dir/learner0.log" 2>/dev/null; do
    kill -0 "$p0" 2>/dev/null && [ "$SECONDS" -lt "$limit" ] || { echo "join: learner 0 did not join"; tail -n 5 "$dir"/*.log; return 1; }
    sleep 0.2
  done
  # Learner 0 trains: wait for its first applied merge, then learner 1 joins.
  until [ "$(grep -o 'applies [0-9]*' "$dir/learner0.log" | tail -n 1 | awk '{print $2}')" -gt "$tensors" ] 2>/dev/null; do
    kill -0 "$p0" 2>/dev/null && [ "$SECONDS" -lt "$limit" ] || { echo "join: learner 0 applied no merge"; tail -n 5 "$dir"/*.log; return 1; }
    sleep 0.2
  done
  local applies_before
  applies_before="$(grep -o 'applies [0-9]*' "$dir/learner0.log" | tail -n 1 | awk '{print $2}')"
  # shellcheck disable=SC2086
  ip netns exec "${TAG}r1" "$PROBE" --plaintext --connect "$ep" --id 1 $model --join-link-mbit "$mbit" \
    --steps 5 --step-ms 200 --report-every 5 >"$dir/learner1.log" 2>&1 &
  p1=$!
  PIDS+=("$p1")
  local rc=0
  wait "$p1" || rc=$?
  local applies_after
  applies_after="$(grep -o 'applies [0-9]*' "$dir/learner0.log" | tail -n 1 | awk '{print $2}')"
  touch "$dir/stop"
  wait "$p0"
  kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
  PIDS=("${PIDS[@]:0:${#PIDS[@]}-3}")  # the relays stay for cleanup
  local line
  line="$(grep 'probe 1: joined' "$dir/learner1.log")"
  if [ "$rc" -ne 0 ] || [ -z "$line" ]; then
    echo "join: FAIL: learner 1 did not join (exit status $rc): $(tail -n 2 "$dir/learner1.log")"; return 1
  fi
  echo "join: learner 1: ${line#probe 1: }"
  local secs state received requests timeout
  read -r secs state received requests timeout < <(echo "$line" |
    sed -E 's/.*joined in ([0-9.]+) s: ([0-9.]+) MiB of state, ([0-9.]+) MiB received, ([0-9]+) join requests, time-out ([0-9.]+) s/\1 \2 \3 \4 \5/')
  echo "join: syncer: $(grep -E '^(state_frames_streamed|state_duplicates|streams_abandoned|send_over_budget|slow_peer_frames)=' "$dir/status" | paste -sd' ')"
  echo "join: learner 0 applied $((applies_after - applies_before)) merged fragments while learner 1 joined"
  python3 - "$secs" "$state" "$received" "$mbit" "$timeout" <<'PY'
import sys
secs, state, received, mbit, timeout = map(float, sys.argv[1:])
wire = state * 8 * 1048576 / (mbit * 1e6)
print(f"join: {state:.1f} MiB in {secs:.1f} s over {mbit:g} Mbit/s: {state * 8 * 1048576 / secs / 1e6:.2f} Mbit/s of state, "
      f"{100 * wire / secs:.0f}% of the link; received {received / state:.3f} x the state; time-out {timeout:.1f} s")
print(f"join: extrapolated: 1 GiB at 100 Mbit/s in {secs * (1024 / state) * (mbit / 100):.0f} s "
      f"(derived time-out {30 + 2 * 1024 * 8 * 1048576 / 100e6:.0f} s)")
PY
  local dups over
  dups="$(sed -n 's/^state_duplicates=//p' "$dir/status")"
  over="$(sed -n 's/^send_over_budget=//p' "$dir/status")"
  awk -v r="$received" -v s="$state" 'BEGIN {exit !(r < s * 1.01)}' ||
    { echo "join: FAIL: learner 1 received $received MiB for a $state MiB state (bytes sent twice)"; return 1; }
  awk -v t="$secs" -v l="$timeout" 'BEGIN {exit !(t < l)}' || { echo "join: FAIL: the join took longer than its time-out"; return 1; }
  [ "$((applies_after - applies_before))" -gt 0 ] ||
    { echo "join: FAIL: learner 0 applied no merge while learner 1 joined (starved)"; return 1; }
  echo "join: PASS (state_duplicates=${dups:-?} send_over_budget=${over:-?})"
}

# shard_test: 2 syncer shards in namespaces of their own, 2 learners; shard 1
# killed (SIGKILL) and restarted from its checkpoint while everything else goes on.
shard_test() {
  local dir="$OUT/logs/shards" j i
  rm -rf "$dir"; mkdir -p "$dir"
  local sflags="--reference-model --plaintext --fragments 5 --sync-every 24 --overlap 2 --quorum 1 --outer-momentum 0.5"
  sflags="$sflags --checkpoint-every-ms 500 --status-every-ms 500"
  local endpoints="tcp://10.77.0.1:5555,tcp://10.77.0.2:5555"
  local -a spids lpids
  start_shard() {  # J LOG
    # shellcheck disable=SC2086
    ip netns exec "${TAG}s$1" "$BIN/ddiloco_syncer" $sflags --shard "$1/2" --bind "tcp://10.77.0.$((1 + $1)):5555" \
      --checkpoint-dir "$dir/c$1" --status-file "$dir/$2.status" >>"$dir/$2.log" 2>&1 &
    spids[$1]=$!
    PIDS+=($!)
  }
  value() { sed -n "s/^$2=//p" "$dir/$1.status" 2>/dev/null | tail -n 1; }
  at_least() { [ "$(value "$1" "$2")" -ge "$3" ] 2>/dev/null; }
  lines() { grep -c "learner $1: step " "$dir/learner$1.log" 2>/dev/null || true; }
  until_true() {  # SECONDS WHAT COMMAND...: polls every 0.2 s; fails after SECONDS
    local limit=$((SECONDS + $1)) what="$2"
    shift 2
    until "$@"; do
      [ "$SECONDS" -lt "$limit" ] || { echo "shards: FAIL: timed out waiting for $what"; tail -n 5 "$dir"/*.log; return 1; }
      sleep 0.2
    done
  }
  start_shard 0 shard0
  start_shard 1 shard1
  for ((i = 0; i < LEARNERS; i++)); do
    ip netns exec "${TAG}r$i" "$BIN/ddiloco_learner" --connect "$endpoints" --plaintext --id "$i" --shard "$i" \
      --shards "$LEARNERS" --steps 0 --stop-file "$dir/stop" --fragments 5 --sync-every 24 --overlap 2 --codec int4 \
      --eval-every 100 --eval-examples 64 --join-timeout-ms 60000 >"$dir/learner$i.log" 2>&1 &
    lpids[$i]=$!
    PIDS+=($!)
  done
  until_true 120 "both shards to merge 3 times" eval 'at_least shard0 merges 3 && at_least shard1 merges 3' || return 1
  until_true 60 "a checkpoint of shard 1" grep -q "syncer: checkpoint" "$dir/shard1.log" || return 1
  kill -9 "${spids[1]}"
  wait "${spids[1]}" 2>/dev/null
  local m0 before=()
  m0="$(value shard0 merges)"
  for ((i = 0; i < LEARNERS; i++)); do before[$i]="$(lines "$i")"; done
  echo "shards: killed shard 1 ($(grep -c 'syncer: checkpoint' "$dir/shard1.log") checkpoints); shard 0 had merged $m0"
  until_true 120 "shard 0 to merge 3 more times with shard 1 down" at_least shard0 merges "$((m0 + 3))" || return 1
  for ((i = 0; i < LEARNERS; i++)); do
    until_true 120 "learner $i to train 2 more progress lines with shard 1 down" \
      eval "[ \"\$(lines $i)\" -ge $((before[i] + 2)) ]" || return 1
  done
  echo "shards: shard 1 down: shard 0 merges $m0 -> $(value shard0 merges), learners' progress lines ${before[*]} -> $(lines 0) $(lines 1)"
  start_shard 1 shard1b
  until_true 60 "the restarted shard 1 to resume" grep -q "syncer: resumed from" "$dir/shard1b.log" || return 1
  until_true 60 "the restarted shard 1's status" test -s "$dir/shard1b.status" || return 1
  local restored
  restored="$(value shard1b accepted)"
  until_true 120 "the restarted shard 1 to accept 10 contributions" at_least shard1b accepted "$((restored + 10))" || return 1
  touch "$dir/stop"
  local ok=1
  for ((i = 0; i < LEARNERS; i++)); do wait "${lpids[$i]}" || ok=0; done
  kill -TERM "${spids[0]}" "${spids[1]}" 2>/dev/null
  wait "${spids[0]}" "${spids[1]}" 2>/dev/null
  [ "$ok" = 1 ] || { echo "shards: FAIL: a learner exited with an error"; tail -n 5 "$dir"/learner*.log; return 1; }
  local s wrong
  for s in shard0 shard1b; do
    wrong="$(value "$s" rejected_wrong_shard)"
    [ "${wrong:-0}" = 0 ] || { echo "shards: FAIL: $s rejected $wrong contributions as wrong_shard"; return 1; }
  done
  local first last
  first="$(grep -o ' val [0-9.]*' "$dir/learner0.log" | head -n 1 | awk '{print $2}')"
  last="$(grep -o ' val [0-9.]*' "$dir/learner0.log" | tail -n 1 | awk '{print $2}')"
  awk -v a="$last" -v b="$first" 'BEGIN {exit !(a < b)}' ||
    { echo "shards: FAIL: learner 0's validation loss went from $first to $last"; return 1; }
  echo "shards: restarted shard 1: $(grep 'resumed from' "$dir/shard1b.log"); accepted $restored -> $(value shard1b accepted)"
  echo "shards: shard 0 merges $(value shard0 merges), shard 1 merges $(value shard1b merges); learner 0 val $first -> $last"
  echo "shards: PASS"
}

if [ "$SHARD_TEST" = 1 ]; then
  net_up 50 100mbit "${TAG}s0 ${TAG}s1" || { echo "run_wan.sh: network setup failed" >&2; exit 1; }
  shard_test
  status=$?
  cleanup
  exit "$status"
fi

if [ "$JOIN_TEST" = 1 ]; then
  net_up 20 "$JOIN_RATE" || { echo "run_wan.sh: network setup failed" >&2; exit 1; }
  join_test
  status=$?
  cleanup
  exit "$status"
fi

echo "mode,rtt_ms,rate,learners,steps,codec,params,tokens_per_s,wall_s,bytes_in,bytes_out,merges,ok,steady_steps_per_s,sends,applies,rejected_stale,accepted,val_loss,rep,send_merged_to,global_codec" >"$OUT/wan.csv"
status=0
for ((REP = 1; REP <= REPEATS; REP++)); do
  for point in $GRID; do
    rtt="${point%%:*}" rate="${point#*:}"
    net_up "$rtt" "$rate" || { echo "run_wan.sh: network setup failed for $point" >&2; status=1; cleanup; continue; }
    for mode in $MODES; do run_mode "$mode" "$rtt" "$rate" || status=1; done
    cleanup
  done
done
echo "wan: results in $OUT/wan.csv"
exit "$status"
