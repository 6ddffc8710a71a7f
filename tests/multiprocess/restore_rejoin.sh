#!/usr/bin/env bash
# Multi-process test (attack suite, docs/security.md): syncer restores that
# once lost learners or reused their sequence numbers, as a fixed schedule.
#   1. A syncer stopped with SIGTERM writes a checkpoint; the next syncer
#      resumes from it and checkpoints no more (--checkpoint-every-ms 1 h), so
#      that checkpoint stays the newest. Learner 0 trains throughout.
#   2. Learner 1 joins after that checkpoint; the syncer is killed (SIGKILL)
#      and restarted from it, so learner 1 is unknown to it. Learner 1 must be
#      accepted again within 3 heartbeat time-outs (it once stayed
#      unknown_learner for ever).
#   3. Learner 0 (in the checkpoint) is restarted (a new incarnation after the
#      checkpoint), the syncer killed and restored again, and learner 0
#      restarted once more. No contribution may be rejected as a duplicate,
#      and learner 0 must be accepted again (its sequence numbers were once reused: hundreds of
#      honest contributions rejected as duplicates).
# Usage: restore_rejoin.sh SYNCER LEARNER KEYGEN [CHAOS_CLIENT ATTACKER]
source "$(dirname "$0")/lib.sh"

HEARTBEAT_MS=3000
RESYNC_S=$((3 * HEARTBEAT_MS / 1000))
CHECKPOINTS="$WORK/checkpoints"
n=0
launch_syncer() {
  local bind=()
  [ "$n" -eq 0 ] || bind=(--bind "$ENDPOINT")
  start_syncer "s$n" --plaintext --checkpoint-dir "$CHECKPOINTS" --checkpoint-every-ms "$1" \
    --heartbeat-timeout-ms "$HEARTBEAT_MS" --tally-learners 0,1 --status-every-ms 100 "${bind[@]}"
  S="s$n"
  n=$((n + 1))
}
declare -a pid inc
launch_learner() {
  inc[$1]=$((${inc[$1]:--1} + 1))
  start_learner "l$1.${inc[$1]}" "$1" 2 100000000 --plaintext --join-timeout-ms 600000
  pid[$1]=$LEARNER_PID
}
accepted_past() { [ "$(status "learner_$1_accepted" "$S")" -gt "$2" ]; }
restart_syncer() {
  kill -9 "$SYNCER_PID"
  wait "$SYNCER_PID" 2>/dev/null || true
  launch_syncer 3600000
  log_has "$S" "syncer: resumed from" || fail "$S did not resume from the checkpoint"
}
restart_learner() {
  kill -9 "${pid[$1]}"
  wait "${pid[$1]}" 2>/dev/null || true
  launch_learner "$1"
}

# 1. The checkpoint every later syncer resumes from.
launch_syncer 3600000
launch_learner 0
wait_until 60 "learner 0 to be accepted" accepted_past 0 20
stop_syncer_with_sigterm
launch_syncer 3600000
log_has "$S" "syncer: resumed from" || fail "$S did not resume from the checkpoint written at SIGTERM"
wait_until 60 "learner 0 to be accepted by $S" accepted_past 0 5

# 2. A learner joined after the newest checkpoint.
launch_learner 1
wait_until 60 "learner 1 to be accepted by $S" accepted_past 1 10
restart_syncer
wait_until "$RESYNC_S" "learner 1, joined after the checkpoint, to be accepted by the restored $S" accepted_past 1 0
wait_until "$RESYNC_S" "learner 0 to be accepted by the restored $S" accepted_past 0 0
note "$S: learner 1 (joined after the checkpoint) accepted again; unknown_learner" \
  "$(status learner_1_rejected_unknown_learner "$S") before"

# 3. Learner 0 (in the checkpoint) restarted after it, the syncer restored,
# learner 0 restarted again.
restart_learner 0
base=$(status learner_0_accepted "$S")
wait_until 60 "learner 0's second incarnation to be accepted by $S" accepted_past 0 "$base"
restart_syncer
wait_until "$RESYNC_S" "learner 0 to be accepted by the restored $S" accepted_past 0 0
restart_learner 0
base=$(status learner_0_accepted "$S")
wait_until 60 "learner 0's third incarnation to have 50 contributions accepted by $S" accepted_past 0 "$((base + 50))"
for id in 0 1; do
  dup=$(status "learner_${id}_rejected_duplicate" "$S")
  [ "$dup" -eq 0 ] || fail "$S rejected $dup contributions of learner $id as duplicates"
done
note "$S: learner 0's third incarnation accepted ($(status learner_0_accepted "$S") in all), duplicates 0;" \
  "learner 1 accepted $(status learner_1_accepted "$S")"
note "PASS"
