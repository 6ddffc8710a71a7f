#!/usr/bin/env bash
# Multi-process test: crash restores and sequence spaces (docs/operations.md,
# "Crash and restore"). Plaintext, one learner per part, learners without a
# step limit (--steps 0): each runs until the test has seen what it waits for,
# then is killed. Every wait is on an event (a status value, a log line).
#
# Part A, a learner that joined after the newest checkpoint: syncer a2 resumes
# a checkpoint without learners (and writes its new epoch at once); learner 7
# joins and contributes; a2 is killed with SIGKILL and a3 resumes on the same
# endpoint from the same checkpoint, so it has no record of learner 7. a3 must
# ask it to rejoin (rejoin_requests), the learner must say so and rejoin, and
# its contributions must be accepted again, with no duplicates.
#
# Part B, "learner restart, syncer restore, learner restart": learner 8 is in
# the checkpoint b1 wrote on SIGTERM; b2 resumes it; learner 8 restarts (a new
# incarnation b2 numbers); b2 is killed, b3 resumes b2's checkpoint (the one
# written right after its restore: sequence epoch 1) and learner 8 goes on;
# then learner 8 restarts again. Before the sequence epoch, b3 handed the new
# incarnation the space b2 had given the previous one, and its first
# contributions were rejected as duplicates (809 in 5 s in the attack run).
# Here b3 must count 0 duplicates while it accepts the restarted learner's.
# Usage: restore_rejoin.sh SYNCER LEARNER KEYGEN
source "$(dirname "$0")/lib.sh"

COMMON=(--plaintext --checkpoint-every-ms 3600000)  # checkpoints only on SIGTERM and right after a restore
LEARN=(--plaintext --eval-every 100000)
accepted_more() { status_at_least accepted "$1" "$(($2 + $3))"; }
kill_now() {
  kill -9 "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

# ---- Part A ---------------------------------------------------------------
CK_A="$WORK/ck_a"
start_syncer a1 "${COMMON[@]}" --checkpoint-dir "$CK_A"
stop_syncer_with_sigterm  # a checkpoint without learners
start_syncer a2 "${COMMON[@]}" --checkpoint-dir "$CK_A"
log_has a2 "syncer: resumed from" || fail "a2 did not resume from a1's checkpoint"
wait_until 30 "a2 to report sequence epoch 1" status_at_least sequence_epoch a2 1
a2_pid=$SYNCER_PID
start_learner la 7 1 0 "${LEARN[@]}"
la_pid=$LEARNER_PID
wait_until 60 "a2 to accept 10 contributions of learner 7 (joined after the newest checkpoint)" \
  status_at_least accepted a2 10
kill_now "$a2_pid"
note "killed a2 after $(status accepted a2) accepted contributions"
start_syncer a3 "${COMMON[@]}" --checkpoint-dir "$CK_A" --bind "$ENDPOINT"
[ "$(status sequence_epoch a3)" -ge 2 ] || fail "a3 restored sequence epoch $(status sequence_epoch a3), expected >= 2"
a3_base=$(status accepted a3)
wait_until 60 "a3 to ask the unknown learner 7 to rejoin" status_at_least rejoin_requests a3 1
wait_until 60 "learner 7 to say it joins again" log_has la "learner 7: the syncer does not know this learner"
wait_until 60 "learner 7 to rejoin" log_has la "learner 7: rejoined"
wait_until 60 "a3 to accept 10 contributions of the rejoined learner" accepted_more a3 "$a3_base" 10
[ "$(status learners_known a3)" = 1 ] || fail "a3 knows $(status learners_known a3) learners, expected 1 (learner 7)"
[ "$(status rejected_duplicate a3)" = 0 ] || fail "a3 rejected $(status rejected_duplicate a3) duplicates"
note "part A: a3 rejoin requests $(status rejoin_requests a3) (limited $(status rejoin_requests_limited a3)), unknown_learner $(status rejected_unknown_learner a3), accepted $(status accepted a3), duplicates 0"
kill_now "$la_pid"
kill_now "$SYNCER_PID"

# ---- Part B ---------------------------------------------------------------
CK_B="$WORK/ck_b"
start_syncer b1 "${COMMON[@]}" --checkpoint-dir "$CK_B"
b_endpoint=$ENDPOINT
start_learner lb1 8 1 0 "${LEARN[@]}"
lb_pid=$LEARNER_PID
wait_until 60 "b1 to accept 10 contributions of learner 8" status_at_least accepted b1 10
stop_syncer_with_sigterm  # the checkpoint: learner 8 in its first incarnation
start_syncer b2 "${COMMON[@]}" --checkpoint-dir "$CK_B" --bind "$b_endpoint"
b2_pid=$SYNCER_PID
b2_base=$(status accepted b2)
wait_until 60 "b2 to accept learner 8 after its restore" accepted_more b2 "$b2_base" 5
kill_now "$lb_pid"  # learner restart: a new incarnation, numbered by b2
b2_joins=$(status joins b2)
start_learner lb2 8 1 0 "${LEARN[@]}"
lb_pid=$LEARNER_PID
wait_until 60 "b2 to take the restarted learner's join" status_at_least joins b2 "$((b2_joins + 1))"
b2_base=$(status accepted b2)
wait_until 60 "b2 to accept 10 contributions of the restarted learner" accepted_more b2 "$b2_base" 10
kill_now "$b2_pid"  # syncer crash: b3 resumes the checkpoint b2 wrote right after its restore
start_syncer b3 "${COMMON[@]}" --checkpoint-dir "$CK_B" --bind "$b_endpoint"
[ "$(status sequence_epoch b3)" -ge 2 ] || fail "b3 restored sequence epoch $(status sequence_epoch b3), expected >= 2"
b3_base=$(status accepted b3)
wait_until 60 "b3 to accept 10 contributions of the running learner" accepted_more b3 "$b3_base" 10
kill_now "$lb_pid"  # learner restart again
b3_joins=$(status joins b3)
start_learner lb3 8 1 0 "${LEARN[@]}"
wait_until 60 "b3 to take the restarted learner's join" status_at_least joins b3 "$((b3_joins + 1))"
b3_base=$(status accepted b3)
wait_until 60 "b3 to accept 20 contributions of the learner restarted again" accepted_more b3 "$b3_base" 20
for s in b2 b3; do
  [ "$(status rejected_duplicate "$s")" = 0 ] ||
    fail "$s rejected $(status rejected_duplicate "$s") honest contributions as duplicates"
done
note "part B: b3 accepted $(status accepted b3), duplicates 0 (b2 0), sequence epoch $(status sequence_epoch b3)"
note "PASS"
