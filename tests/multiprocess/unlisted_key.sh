#!/usr/bin/env bash
# Multi-process test: a learner whose CURVE key is not on the syncer's
# allow-list is refused. The ZAP handler denies it (auth_denied >= 1 in the
# status file), its join times out with its error message and a non-zero exit
# status, and the syncer never counts it, while two honest learners keep
# training (merges grow during and after the attempt) and finish.
# Usage: unlisted_key.sh SYNCER LEARNER KEYGEN
source "$(dirname "$0")/lib.sh"

STEPS=2500

make_keys syncer l0 l1 intruder
for i in 0 1; do echo "$i $(public_key l$i)"; done >"$WORK/keys/allow"
start_syncer syncer --keys "$WORK/keys/syncer.key" --allow "$WORK/keys/allow"
for i in 0 1; do
  start_learner "l$i" "$i" 2 "$STEPS" --keys "$WORK/keys/l$i.key" --server-key "$WORK/keys/syncer.pub"
done
wait_until 60 "10 merges" status_at_least merges syncer 10
merges=$(status merges syncer)

# The intruder claims a listed id (1) with its own, unlisted key.
start_learner intruder 1 2 100 --keys "$WORK/keys/intruder.key" --server-key "$WORK/keys/syncer.pub" \
  --join-timeout-ms 3000
intruder_pid=$LEARNER_PID
wait_until 30 "the syncer to deny the intruder's key" status_at_least auth_denied syncer 1
intruder_rc=0
wait "$intruder_pid" || intruder_rc=$?
[ "$intruder_rc" -ne 0 ] || fail "the learner with an unlisted key exited with status 0"
log_has intruder "OuterLoop::join: learner 1 received 0 of" ||
  fail "the refused learner did not report its join time-out"
log_has intruder "learner 1: joined" && fail "the learner with an unlisted key joined"
for i in 0 1; do
  log_has "l$i" "learner $i: done" && fail "learner $i finished before the intruder gave up; raise STEPS"
done
note "intruder refused: exit status $intruder_rc, auth_denied $(status auth_denied syncer)"
note "  $(grep 'ddiloco_learner:' "$WORK/intruder.log")"

wait_until 60 "the honest learners to keep merging" status_at_least merges syncer "$((merges + 20))"
for i in 0 1; do wait_until 120 "learner $i to finish" log_has "l$i" "learner $i: done"; done
[ "$(status learners_known syncer)" -eq 2 ] || fail "the syncer knows $(status learners_known syncer) learners, not 2"
[ "$(status impersonations syncer)" -eq 0 ] || fail "impersonations counted although the intruder never connected"
for i in 0 1; do
  val=$(final_val "l$i")
  less_than "$val" 3.2 || fail "honest learner $i ended at validation loss $val"
done
note "honest learners done: final val $(final_val l0), $(final_val l1); merges $(status merges syncer)"
note "PASS"
