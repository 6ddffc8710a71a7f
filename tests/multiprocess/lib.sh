# tests/multiprocess/lib.sh: shared helpers of the multi-process tests (sourced).
#
# What it is: start the ddiloco programs in the background on loopback (port *,
# the bound endpoint read back from --endpoint-file), remember every process id,
# wait for events by polling a condition against a deadline (the deadline is
# only a failure guard), and kill every started process on exit, also on
# failure, then print the tail of every log. What it is not: a test.
#
# Usage: source lib.sh SYNCER LEARNER KEYGEN [CHAOS_CLIENT]   (paths of the programs)
set -euo pipefail

SYNCER=$1
LEARNER=$2
KEYGEN=$3
CHAOS=${4:-}
for program in "$SYNCER" "$LEARNER" "$KEYGEN"; do
  [ -x "$program" ] || { echo "FAIL: program '$program' is not executable; build it first" >&2; exit 1; }
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ddiloco-mp.XXXXXX")
PIDS=()

cleanup() {
  local rc=$?
  trap - EXIT
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ "$rc" -ne 0 ]; then
    for log in "$WORK"/*.log "$WORK"/*.status; do
      [ -f "$log" ] || continue
      echo "---- $(basename "$log") (last 15 lines)"
      tail -n 15 "$log"
    done
  fi
  [ -n "${KEEP_WORK:-}" ] || rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP PIPE

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

note() { echo "[$(date +%T)] $*"; }

# wait_until SECONDS DESCRIPTION COMMAND...: polls COMMAND every 0.1 s until it
# succeeds; fails the test after SECONDS times $DDILOCO_MP_TIME_SCALE (default
# 1; sanitizer builds train several times slower: use 6 and ctest --timeout).
wait_until() {
  local secs=$(($1 * ${DDILOCO_MP_TIME_SCALE:-1})) what=$2
  shift 2
  local end=$((SECONDS + secs))
  until "$@"; do
    [ "$SECONDS" -lt "$end" ] || fail "timed out after ${secs} s waiting for: $what"
    sleep 0.1
  done
}

# status KEY NAME: the value of KEY in syncer NAME's status file (0 before the first write).
status() {
  local v
  v=$(grep "^$1=" "$WORK/$2.status" 2>/dev/null | tail -n 1 | cut -d= -f2)
  echo "${v:-0}"
}

# status_at_least KEY NAME MIN
status_at_least() { [ "$(status "$1" "$2")" -ge "$3" ]; }

# start_syncer NAME [FLAGS...]: starts a syncer serving the reference model,
# sets SYNCER_PID and ENDPOINT (waits for the endpoint file). Default bind is
# tcp://127.0.0.1:*; a later --bind on the command line wins.
start_syncer() {
  local name=$1
  shift
  rm -f "$WORK/$name.ep"
  "$SYNCER" --reference-model --bind 'tcp://127.0.0.1:*' --endpoint-file "$WORK/$name.ep" \
    --status-file "$WORK/$name.status" --status-every-ms 200 --outer-momentum 0.5 "$@" \
    >>"$WORK/$name.log" 2>&1 &
  SYNCER_PID=$!
  PIDS+=("$SYNCER_PID")
  wait_until 30 "syncer $name to write its endpoint" test -s "$WORK/$name.ep"
  ENDPOINT=$(cat "$WORK/$name.ep")
  # The status file of a fresh syncer comes with its first status line.
  wait_until 30 "syncer $name to write its status file" test -s "$WORK/$name.status"
}

# exited PID: true once the process is gone.
exited() { ! kill -0 "$1" 2>/dev/null; }

# expect_clean_exit WHAT PID: fails unless the process exits within 30 s with
# status 0 (a sanitizer report would make it non-zero).
expect_clean_exit() {
  wait_until 30 "$1 to exit" exited "$2"
  local rc=0
  wait "$2" || rc=$?
  [ "$rc" -eq 0 ] || fail "$1 exited with status $rc"
}

# stop_syncer_with_sigterm: SIGTERM to SYNCER_PID, which must then exit cleanly
# (it checkpoints, if configured, and stops).
stop_syncer_with_sigterm() {
  kill -TERM "$SYNCER_PID"
  expect_clean_exit "the syncer (after SIGTERM)" "$SYNCER_PID"
}

# start_learner LOGNAME ID SHARDS STEPS [FLAGS...]: sets LEARNER_PID.
start_learner() {
  local log=$1 id=$2 shards=$3 steps=$4
  shift 4
  "$LEARNER" --connect "$ENDPOINT" --id "$id" --shard "$((id % shards))" --shards "$shards" --steps "$steps" \
    --eval-every 50 --eval-examples 512 "$@" >>"$WORK/$log.log" 2>&1 &
  LEARNER_PID=$!
  PIDS+=("$LEARNER_PID")
}

# Lines of a log matching a pattern (0 if none).
count_lines() {
  local n
  n=$(grep -c -- "$2" "$WORK/$1.log" 2>/dev/null || true)
  echo "${n:-0}"
}
log_has() { grep -q -- "$2" "$WORK/$1.log" 2>/dev/null; }
lines_at_least() { [ "$(count_lines "$1" "$2")" -ge "$3" ]; }

# final_val LOGNAME: validation loss on the learner's last progress line.
final_val() { grep -o ' val [0-9.]*' "$WORK/$1.log" | tail -n 1 | awk '{print $2}'; }

# mean_final_val LOGNAME...: mean of final_val over the logs.
mean_final_val() {
  local log
  for log in "$@"; do final_val "$log"; done | awk '{s += $1; n++} END {printf "%.4f\n", s / n}'
}

# less_than A B: A < B as real numbers.
less_than() { awk -v a="$1" -v b="$2" 'BEGIN {exit !(a < b)}'; }

# make_keys NAME...: CURVE key pairs NAME.key / NAME.pub in $WORK/keys.
make_keys() {
  mkdir -p "$WORK/keys"
  local name
  for name in "$@"; do "$KEYGEN" "$WORK/keys/$name" >/dev/null; done
}
public_key() { awk '$1 == "public" {print $2}' "$WORK/keys/$1.pub"; }

# Milestones without races (kill_syncer.sh, shards.sh): learner i (a key of the
# caller's array learner_pids, whose log is l<i>) is frozen with SIGSTOP once it
# has printed N progress lines more than before[i]; all are thawed together
# for the next phase, so no phase depends on the learners' relative speeds.
# freeze_after N: true when every learner is frozen. thaw: SIGCONT to all.
freeze_after() {
  local i all=0
  for i in "${!learner_pids[@]}"; do
    if [ -z "${frozen[i]:-}" ] && lines_at_least "l$i" "learner $i: step " "$((before[i] + $1))"; then
      kill -STOP "${learner_pids[i]}"
      frozen[i]=1
    fi
    [ -n "${frozen[i]:-}" ] && all=$((all + 1))
  done
  [ "$all" = "${#learner_pids[@]}" ]
}
thaw() {
  local i
  for i in "${!learner_pids[@]}"; do kill -CONT "${learner_pids[i]}"; done
  frozen=()
}
