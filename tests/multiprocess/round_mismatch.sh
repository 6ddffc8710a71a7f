#!/usr/bin/env bash
# Multi-process test: a learner with another round mode than the syncer's is
# refused at its join (JoinRefusal::round_mode) and exits non-zero at once
# (well before its join time-out), with a message naming both modes and the
# fix; the syncer logs the refusal, counts it (joins_refused) and keeps
# serving: a learner with the matching mode then joins and is accepted.
# Both directions: a push syncer with a pull learner (the programs' default)
# and a pull syncer (the default) with a push learner. Also the flag errors:
# an unknown --round value, and --round pull with --sync-every 0.
# Usage: round_mismatch.sh SYNCER LEARNER KEYGEN
source "$(dirname "$0")/lib.sh"

# A refused learner must not wait out its join time-out (60 s here).
JOIN_TIMEOUT=(--join-timeout-ms 60000)

# expect_refused LOG PID SYNCER_MODE LEARNER_MODE: the learner exits non-zero
# within 20 s and its error names both modes and the syncer's --round.
expect_refused() {
  local log=$1 pid=$2 theirs=$3 ours=$4 rc=0
  wait_until 20 "the $ours learner to be refused by the $theirs syncer and exit" exited "$pid"
  wait "$pid" || rc=$?
  [ "$rc" -ne 0 ] || fail "the $ours learner exited 0 after a refused join"
  log_has "$log" "it runs $theirs rounds but this learner runs $ours rounds" ||
    fail "the $ours learner's error does not name both round modes"
  log_has "$log" "syncer's --round ($theirs)" || fail "the $ours learner's error does not name the fix"
  log_has "$log" "learner [0-9]*: joined" && fail "the $ours learner said it joined"
  return 0
}

for pair in "push pull" "pull push"; do
  read -r theirs ours <<<"$pair"
  start_syncer "s-$theirs" --plaintext --round "$theirs"
  log_has "s-$theirs" "$theirs rounds" || fail "the syncer does not say it runs $theirs rounds"
  [ "$(status round "s-$theirs")" = "$theirs" ] || fail "status file round=$(status round "s-$theirs")"
  if [ "$ours" = pull ]; then
    start_learner "refused-$ours" 1 1 0 --plaintext "${JOIN_TIMEOUT[@]}"  # the programs' default: pull
  else
    start_learner "refused-$ours" 1 1 0 --plaintext "${JOIN_TIMEOUT[@]}" --round "$ours"
  fi
  expect_refused "refused-$ours" "$LEARNER_PID" "$theirs" "$ours"
  wait_until 10 "the $theirs syncer to count the refused join" status_at_least joins_refused "s-$theirs" 1
  wait_until 10 "the $theirs syncer to log the refusal" \
    log_has "s-$theirs" "round mode $ours differs from ours $theirs (--round)"
  note "$theirs syncer refused a $ours learner: $(grep -m 1 'ddiloco_learner:' "$WORK/refused-$ours.log")"
  # The syncer keeps serving: a learner with its mode joins and contributes.
  start_learner "matching-$theirs" 2 1 0 --plaintext "${JOIN_TIMEOUT[@]}" --round "$theirs"
  MATCHING_PID=$LEARNER_PID
  wait_until 30 "the $theirs learner to join" log_has "matching-$theirs" "learner 2: joined"
  wait_until 60 "a contribution of the $theirs learner to be accepted" status_at_least accepted "s-$theirs" 1
  kill -TERM "$MATCHING_PID"
  expect_clean_exit "the $theirs learner (after SIGTERM)" "$MATCHING_PID"
  stop_syncer_with_sigterm
done

# Flag errors name the value and the fix, before anything starts.
rc=0
"$LEARNER" --plaintext --round pul >"$WORK/bad-round.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "--round pul was accepted"
log_has bad-round "--round 'pul': expected pull" || fail "the --round error does not name the value"
rc=0
"$SYNCER" --reference-model --plaintext --round pull --sync-every 0 >"$WORK/no-h.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "--round pull --sync-every 0 was accepted"
log_has no-h "--round pull needs --sync-every" || fail "the --sync-every error does not name the flag"
note "PASS"
