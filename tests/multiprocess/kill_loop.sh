#!/usr/bin/env bash
# Multi-process test: a seeded loop of SIGKILLs (docs/security.md, "Kill loop").
# Three learners (ids 0, 1, 2) and a syncer checkpointing every 2 s. KILLS
# times (default 6; scripts/kill_loop.sh --kills 100 for the long run) a
# victim drawn from SEED (bash's RANDOM, seeded: the same schedule every run)
# is killed with SIGKILL and restarted at once: a learner with the same id, or
# the syncer on the same endpoint from its newest checkpoint. A kill waits for
# events, never for time: every learner has had a contribution accepted by
# the syncer since the previous kill (and, before a syncer kill, a checkpoint
# newer than the syncer's start exists). Asserts:
#   - no hang: after every kill, every learner has a contribution accepted by
#     the (restarted) syncer within 3 heartbeat time-outs;
#   - no honest duplicate: no contribution of a learner is rejected as a
#     duplicate by any syncer incarnation;
#   - no double merge: per learner, the contributions accepted over all syncer
#     incarnations are at most those it sent over all its incarnations (each
#     prints its sends every step; one unprinted send per killed incarnation);
#   - the final checkpoint (written at SIGTERM) loads: a syncer restarted on it
#     says "resumed from" and serves the checkpointed versions.
# Prints the figures: kills of each kind, accepted, rejections (those under
# no reason named per learner are unknown_learner: learners told to rejoin),
# the longest re-synchronisation.
# Usage: kill_loop.sh SYNCER LEARNER KEYGEN [CHAOS_CLIENT ATTACKER]; KILLS, SEED in the environment.
source "$(dirname "$0")/lib.sh"

KILLS=${KILLS:-6}
SEED=${SEED:-1}
HEARTBEAT_MS=3000
RESYNC_S=$((3 * HEARTBEAT_MS / 1000))
CHECKPOINTS="$WORK/checkpoints"
LEARNERS=(0 1 2)

declare -a learner_pid incarnation
syncer_n=0
# launch_syncer: syncer incarnation s<N> (its own log and status file).
launch_syncer() {
  local bind=()
  [ "$syncer_n" -eq 0 ] || bind=(--bind "$ENDPOINT")
  start_syncer "s$syncer_n" --plaintext --checkpoint-dir "$CHECKPOINTS" --checkpoint-every-ms 2000 \
    --heartbeat-timeout-ms "$HEARTBEAT_MS" --tally-learners 0,1,2 --status-every-ms 100 "${bind[@]}"
  SYNCER_NAME="s$syncer_n"
  syncer_n=$((syncer_n + 1))
}
# launch_learner ID: learner ID's next incarnation, log l<ID>.<incarnation>.
launch_learner() {
  local id=$1
  incarnation[id]=$((${incarnation[id]:--1} + 1))
  start_learner "l$id.${incarnation[id]}" "$id" 3 100000000 --plaintext --eval-every 1 --eval-examples 1 \
    --join-timeout-ms 600000
  learner_pid[id]=$LEARNER_PID
}
accepted_now() { status "learner_$1_accepted" "$SYNCER_NAME"; }
# accepted_past ID MIN: learner ID's contributions accepted by the current syncer exceed MIN.
accepted_past() { [ "$(accepted_now "$1")" -gt "$2" ]; }
# accepted_quiet ID: learner ID's accepted count has stayed the same over 5
# polls of the status file (written every 100 ms).
accepted_quiet() {
  local now
  now=$(accepted_now "$1")
  if [ "$now" = "$QUIET_LAST" ]; then QUIET_SEEN=$((QUIET_SEEN + 1)); else QUIET_LAST=$now QUIET_SEEN=0; fi
  [ "$QUIET_SEEN" -ge 5 ]
}
# checkpoint_written: the current syncer has written a checkpoint.
checkpoint_written() { log_has "$SYNCER_NAME" "syncer: checkpoint "; }

launch_syncer
for id in "${LEARNERS[@]}"; do launch_learner "$id"; done
declare -a base
for id in "${LEARNERS[@]}"; do base[id]=0; done

RANDOM=$SEED
syncer_kills=0 learner_kills=0 longest=0
for k in $(seq 1 "$KILLS"); do
  # Every learner has been accepted since the last kill (and restart).
  for id in "${LEARNERS[@]}"; do
    wait_until 120 "learner $id to have a contribution accepted before kill $k" accepted_past "$id" "${base[id]}"
  done
  victim=$((RANDOM % 4))
  if [ "$victim" -eq 3 ]; then
    wait_until 60 "a checkpoint of $SYNCER_NAME before kill $k" checkpoint_written
    # Read through one open descriptor: the live syncer replaces its status file
    # (write and rename) every 200 ms, and cp refuses a file replaced while it
    # copies ("skipping file ..., as it was replaced while being copied"), which
    # failed this test once in a run beside stress-ng. The opened file is a
    # whole earlier status.
    cat "$WORK/$SYNCER_NAME.status" > "$WORK/$SYNCER_NAME.final"
    kill -9 "$SYNCER_PID"
    wait "$SYNCER_PID" 2>/dev/null || true
    launch_syncer
    log_has "$SYNCER_NAME" "syncer: resumed from" || fail "kill $k: the restarted syncer did not resume from a checkpoint"
    for id in "${LEARNERS[@]}"; do base[id]=0; done
    syncer_kills=$((syncer_kills + 1))
    what="syncer"
  else
    kill -9 "${learner_pid[victim]}"
    wait "${learner_pid[victim]}" 2>/dev/null || true
    # What the killed incarnation had sent is handled before the count is
    # taken, so only the new incarnation's contributions can exceed it.
    QUIET_LAST="" QUIET_SEEN=0
    wait_until 30 "the syncer to handle what learner $victim sent before its kill" accepted_quiet "$victim"
    base[victim]=$(accepted_now "$victim")
    launch_learner "$victim"
    learner_kills=$((learner_kills + 1))
    what="learner $victim"
  fi
  started=$SECONDS
  for id in "${LEARNERS[@]}"; do
    wait_until "$RESYNC_S" "learner $id to be accepted again within 3 heartbeat time-outs after kill $k ($what)" \
      accepted_past "$id" "${base[id]}"
  done
  took=$((SECONDS - started))
  [ "$took" -le "$longest" ] || longest=$took
  for id in "${LEARNERS[@]}"; do base[id]=$(accepted_now "$id"); done
  note "kill $k: $what; every learner accepted again within ${took} s"
done

# Clean stop: the learners leave, the syncer checkpoints at SIGTERM.
for id in "${LEARNERS[@]}"; do kill -TERM "${learner_pid[id]}"; done
for id in "${LEARNERS[@]}"; do expect_clean_exit "learner $id" "${learner_pid[id]}"; done
stop_syncer_with_sigterm
cat "$WORK/$SYNCER_NAME.status" > "$WORK/$SYNCER_NAME.final"
final_versions=$(grep -c 'syncer: checkpoint' "$WORK/$SYNCER_NAME.log")

# The accounting over every syncer incarnation and every learner incarnation.
sum_key() { cat "$WORK"/s*.final | awk -F= -v k="$1" '$1 == k {s += $2} END {print s + 0}'; }
sent_total() {
  local id=$1 log n total=0
  for log in "$WORK"/l"$id".*.log; do
    n=$(grep -o ' sends [0-9]*' "$log" | tail -n 1 | awk '{print $2}')
    total=$((total + ${n:-0} + 1))
  done
  echo "$total"
}
failures=()
accepted_all=0 unknown_all=0
for id in "${LEARNERS[@]}"; do
  dup=$(sum_key "learner_${id}_rejected_duplicate")
  acc=$(sum_key "learner_${id}_accepted")
  unknown=$(sum_key "learner_${id}_rejected_other")
  sent=$(sent_total "$id")
  accepted_all=$((accepted_all + acc)) unknown_all=$((unknown_all + unknown))
  note "learner $id: ${incarnation[id]} restarts, sent <= $sent, accepted $acc, duplicates $dup, rejected $(sum_key \
    "learner_${id}_rejected") ($(cat "$WORK"/s*.final | awk -F= -v p="learner_${id}_rejected_" 'index($1, p) == 1 && $2 > 0 {
      s[substr($1, length(p) + 1)] += $2} END {for (r in s) printf "%s %d ", r, s[r]}'))"
  [ "$dup" -eq 0 ] || failures+=("learner $id had $dup contributions rejected as duplicates")
  [ "$acc" -le "$sent" ] || failures+=("learner $id: $acc contributions accepted but at most $sent sent (merged twice)")
done
[ "${#failures[@]}" -eq 0 ] || fail "$(printf '%s; ' "${failures[@]}")"

# The final checkpoint loads.
launch_syncer
log_has "$SYNCER_NAME" "syncer: resumed from" || fail "a syncer started on the final checkpoint did not resume from it"
stop_syncer_with_sigterm
note "kills $KILLS (syncer $syncer_kills, learners $learner_kills, seed $SEED): accepted $accepted_all," \
  "duplicates 0, rejected under no named reason (unknown_learner: told to rejoin) $unknown_all, longest re-synchronisation ${longest} s (bound ${RESYNC_S} s)," \
  "final checkpoint loads ($final_versions checkpoints by the last syncer)"
note "PASS"
