#!/usr/bin/env bash
# Multi-process test: a learner whose schedule differs from the syncer's is
# refused at once, not left to time out.
#   - The syncer runs H = 24, tau = 2 (--sync-every, --overlap). A learner with
#     --sync-every 12, and one with --overlap 3, each get join_refused: each
#     exits non-zero well inside its join time-out (given as 120 s, so a
#     time-out cannot pass for a refusal), with a message naming both schedules
#     and the flags to change; the syncer logs both refused joins and counts
#     them (joins_refused = 2), and knows neither learner.
#   - A learner with the syncer's schedule then joins (the refusals changed
#     nothing), and leaves when the test creates its stop file.
# Every wait is on an event (an exit, a log line, a status value).
# Usage: schedule_refused.sh SYNCER LEARNER KEYGEN
source "$(dirname "$0")/lib.sh"

STOP="$WORK/stop-honest"
start_syncer syncer --plaintext --sync-every 24 --overlap 2

# refused LOG ID FLAGS...: starts a learner with FLAGS, waits for it to give up
# (20 s: far inside its 120 s join time-out) and checks it failed with the refusal.
refused() {
  local log=$1 id=$2 start=$SECONDS rc=0
  shift 2
  start_learner "$log" "$id" 1 100 --plaintext --join-timeout-ms 120000 "$@"
  local pid=$LEARNER_PID
  wait_until 20 "learner $id ($*) to give up" exited "$pid"
  wait "$pid" || rc=$?
  [ "$rc" -ne 0 ] || fail "learner $id ($*) exited with status 0"
  log_has "$log" "learner $id: joined" && fail "learner $id ($*) joined"
  log_has "$log" "the syncer refused learner $id: it runs H = 24 (sync every), tau = 2 (overlap)" ||
    fail "learner $id ($*) was not told the syncer's schedule"
  log_has "$log" "start the learner with the syncer's --sync-every and --overlap" ||
    fail "learner $id ($*) was not told which flags to change"
  note "learner $id ($*) refused in $((SECONDS - start)) s, exit status $rc"
  note "  $(grep 'ddiloco_learner:' "$WORK/$log.log")"
}

refused h12 3 --sync-every 12
log_has h12 "but this learner runs H = 12, tau = 2" || fail "learner 3 was not told its own schedule"
refused tau3 4 --overlap 3
log_has tau3 "but this learner runs H = 24, tau = 3" || fail "learner 4 was not told its own schedule"

wait_until 20 "the syncer to log the refused joins" \
  lines_at_least syncer "refused join from learner [34]: schedule H = " 2
log_has syncer "refused join from learner 3: schedule H = 12, tau = 2 differs from ours H = 24, tau = 2" ||
  fail "the syncer's log does not name both schedules of learner 3"
log_has syncer "refused join from learner 4: schedule H = 24, tau = 3 differs from ours H = 24, tau = 2" ||
  fail "the syncer's log does not name both schedules of learner 4"
wait_until 20 "the status file to count 2 refused joins" status_at_least joins_refused syncer 2
[ "$(status learners_known syncer)" -eq 0 ] || fail "the syncer knows $(status learners_known syncer) learners after refusing both"

start_learner ok 5 1 0 --plaintext --stop-file "$STOP"
ok_pid=$LEARNER_PID
wait_until 60 "the learner with the syncer's schedule to join" log_has ok "learner 5: joined"
touch "$STOP"
expect_clean_exit "the learner with the syncer's schedule" "$ok_pid"
[ "$(status joins_refused syncer)" -eq 2 ] || fail "joins_refused is $(status joins_refused syncer), not 2"
note "PASS"
