#!/usr/bin/env bash
# scripts/restore_loss.sh: what a syncer crash loses, against the checkpoint
# interval (docs/operations.md, "Crash and restore"). A measurement, not a test.
#
# For each interval: a plaintext syncer checkpointing every INTERVAL ms and 2
# learners without a step limit; once a checkpoint line appears, the script
# waits FRACTION (default 0.4) of the interval, freezes the learners (SIGSTOP, so merges
# stop), reads the syncer's merges once its status file has been rewritten,
# kills the syncer with SIGKILL and restarts it on the same endpoint. The
# restarted syncer's restored merge count is the checkpoint's; the difference
# is the merges lost. Then the learners are thawed, and the restarted syncer
# must accept their contributions again with no duplicates.
#
# Usage: scripts/restore_loss.sh BUILD_DIR [INTERVALS_MS...]   (default 1000 3000 10000)
# Prints one line per interval: interval, time from the checkpoint to the
# crash, merges per second before it, merges lost, and the restarted syncer's
# duplicates and accepted contributions after the restart.
set -euo pipefail
BUILD=$1
shift
INTERVALS=("$@")
[ ${#INTERVALS[@]} -gt 0 ] || INTERVALS=(1000 3000 10000)
FRACTION=${FRACTION:-0.4}
source "$(dirname "$0")/../tests/multiprocess/lib.sh" "$BUILD/programs/ddiloco_syncer" \
  "$BUILD/programs/ddiloco_learner" "$BUILD/programs/ddiloco_keygen"

status_written_since() { [ "$WORK/$1.status" -nt "$2" ]; }
now() { date +%s.%N; }
printf '%-12s %-18s %-10s %-14s %-12s %-12s %s\n' interval_ms crash_after_ck_s merges/s merges_at_crash merges_lost \
  duplicates accepted_after
run=0
for interval in "${INTERVALS[@]}"; do
  run=$((run + 1))
  ck="$WORK/ck-$run"
  start_syncer "s$run" --plaintext --checkpoint-dir "$ck" --checkpoint-every-ms "$interval"
  pid=$SYNCER_PID
  lp=()
  for i in 0 1; do
    start_learner "l$run-$i" "$i" 2 0 --plaintext --eval-every 100000
    lp+=("$LEARNER_PID")
  done
  wait_until 120 "20 merges" status_at_least merges "s$run" 20
  t_start=$(now)
  m_start=$(status merges "s$run")
  seen=$(count_lines "s$run" "syncer: checkpoint")
  wait_until 120 "the next checkpoint" lines_at_least "s$run" "syncer: checkpoint" "$((seen + 1))"
  t_ck=$(now)
  sleep "$(awk -v i="$interval" -v f="$FRACTION" 'BEGIN {print i * f / 1000}')"
  for p in "${lp[@]}"; do kill -STOP "$p"; done
  t_crash=$(now)
  touch "$WORK/frozen"
  # Two rewrites of the status file after the freeze: the in-flight contributions are in.
  wait_until 10 "a status write after the freeze" status_written_since "s$run" "$WORK/frozen"
  touch "$WORK/frozen"
  wait_until 10 "a second status write after the freeze" status_written_since "s$run" "$WORK/frozen"
  m_crash=$(status merges "s$run")
  kill -9 "$pid"
  # A checkpoint written between the freeze and the kill holds every merge: say so.
  [ "$(count_lines "s$run" "syncer: checkpoint")" -eq "$((seen + 1))" ] ||
    echo "note: a checkpoint was written between the freeze and the kill (interval $interval): nothing is lost" >&2
  wait "$pid" 2>/dev/null || true
  start_syncer "r$run" --plaintext --checkpoint-dir "$ck" --checkpoint-every-ms "$interval" --bind "$ENDPOINT"
  m_restored=$(status merges "r$run")
  a_restored=$(status accepted "r$run")
  for p in "${lp[@]}"; do kill -CONT "$p"; done
  wait_until 60 "the restarted syncer to accept 20 contributions" status_at_least accepted "r$run" \
    "$((a_restored + 20))"
  rate=$(awk -v m0="$m_start" -v m1="$m_crash" -v t0="$t_start" -v t1="$t_crash" 'BEGIN {printf "%.1f", (m1 - m0) / (t1 - t0)}')
  after=$(awk -v a="$t_ck" -v b="$t_crash" 'BEGIN {printf "%.2f", b - a}')
  printf '%-12s %-18s %-10s %-14s %-12s %-12s %s\n' "$interval" "$after" "$rate" "$m_crash" "$((m_crash - m_restored))" \
    "$(status rejected_duplicate "r$run")" "$(($(status accepted "r$run") - a_restored))"
  for p in "${lp[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  kill -9 "$SYNCER_PID" 2>/dev/null || true
done
