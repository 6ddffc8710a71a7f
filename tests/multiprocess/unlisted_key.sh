#!/usr/bin/env bash
# Multi-process test: refused learners are told why, the syncer logs whom it
# refused, and an observer reads the global model without being a learner.
#   - A learner whose CURVE key is not on the syncer's allow-list is refused by
#     the ZAP handler (auth_denied >= 1); its join fails at once (well inside a
#     60 s join time-out) with a message naming its key and the allow-list, and
#     the syncer's log names the refused key.
#   - A learner with another plan (--fragments 4) is answered with a refusal
#     naming both plans; the syncer logs the refused join.
#   - An observer (--observe, its own allow-list line) fetches the global model
#     twice and prints its validation loss; the syncer never counts it.
# Two honest learners keep training meanwhile and finish, reporting the
# validation loss of the global model next to their own (val-global).
# Every wait is on an event (a status value, a log line, an exit). The honest
# learners have no step limit: they stop when the test creates their stop file,
# after it has seen everything and they have trained STEPS steps (a budget of
# STEPS raced the test: on a fast machine they finished before the refusals
# and the observer were done, and "keep merging" then timed out).
# Usage: unlisted_key.sh SYNCER LEARNER KEYGEN
source "$(dirname "$0")/lib.sh"

STEPS=2000
STOP="$WORK/stop-honest"
# log_has with a fixed string: Z85 keys hold characters grep would read as a pattern ([ . * $).
log_has_text() { grep -qF -- "$2" "$WORK/$1.log" 2>/dev/null; }

make_keys syncer l0 l1 intruder foreign observer
for i in 0 1; do echo "$i $(public_key l$i)"; done >"$WORK/keys/allow"
echo "50 $(public_key observer)" >>"$WORK/keys/allow"
echo "51 $(public_key foreign)" >>"$WORK/keys/allow"
start_syncer syncer --keys "$WORK/keys/syncer.key" --allow "$WORK/keys/allow"
for i in 0 1; do
  start_learner "l$i" "$i" 2 0 --stop-file "$STOP" --keys "$WORK/keys/l$i.key" --server-key "$WORK/keys/syncer.pub"
done
wait_until 60 "10 merges" status_at_least merges syncer 10
merges=$(status merges syncer)

# The intruder claims a listed id (1) with its own, unlisted key.
start_learner intruder 1 2 100 --keys "$WORK/keys/intruder.key" --server-key "$WORK/keys/syncer.pub" \
  --join-timeout-ms 60000
intruder_pid=$LEARNER_PID
wait_until 30 "the syncer to deny the intruder's key" status_at_least auth_denied syncer 1
wait_until 20 "the intruder to give up (well inside its 60 s join time-out)" exited "$intruder_pid"
intruder_rc=0
wait "$intruder_pid" || intruder_rc=$?
[ "$intruder_rc" -ne 0 ] || fail "the learner with an unlisted key exited with status 0"
log_has intruder "refused this learner's CURVE key" || fail "the refused learner did not say its key was refused"
log_has_text intruder "$(public_key intruder) is not on its allow-list" || fail "the refused learner did not name its key"
log_has intruder "learner 1: joined" && fail "the learner with an unlisted key joined"
wait_until 20 "the syncer to log the refused key" \
  log_has_text syncer "public key $(public_key intruder) is not on the allow-list"
note "intruder refused: exit status $intruder_rc"
note "  $(grep 'ddiloco_learner:' "$WORK/intruder.log")"
note "  $(grep 'refused connection' "$WORK/syncer.log" | head -n 1)"

# A listed learner with another plan: refused with both plans named, at once.
start_learner foreign 51 2 100 --keys "$WORK/keys/foreign.key" --server-key "$WORK/keys/syncer.pub" \
  --fragments 4 --join-timeout-ms 60000
foreign_pid=$LEARNER_PID
wait_until 20 "the learner with another plan to give up" exited "$foreign_pid"
foreign_rc=0
wait "$foreign_pid" || foreign_rc=$?
[ "$foreign_rc" -ne 0 ] || fail "the learner with another plan exited with status 0"
log_has foreign "the syncer refused learner 51: its plan" || fail "the learner with another plan was not told why"
wait_until 20 "the syncer to log the refused join" log_has syncer "refused join from learner 51: plan fingerprint"
note "  $(grep 'ddiloco_learner:' "$WORK/foreign.log")"

# An observer with its own listed id reads the global model twice.
"$LEARNER" --observe --observe-count 2 --observe-every-ms 1500 --connect "$ENDPOINT" --id 50 \
  --keys "$WORK/keys/observer.key" --server-key "$WORK/keys/syncer.pub" --eval-examples 256 \
  >>"$WORK/observer.log" 2>&1 &
observer_pid=$!
PIDS+=("$observer_pid")
expect_clean_exit "the observer" "$observer_pid"
[ "$(count_lines observer 'val-global')" -eq 2 ] || fail "the observer did not print two global validation losses"
wait_until 20 "the observer's fetches in the status file" status_at_least observes syncer 2
note "  $(grep 'fetch 2' "$WORK/observer.log")"

wait_until 60 "the honest learners to keep merging" status_at_least merges syncer "$((merges + 20))"
for i in 0 1; do wait_until 120 "learner $i to train $STEPS steps" log_has "l$i" "learner $i: step $STEPS "; done
touch "$STOP"
for i in 0 1; do wait_until 60 "learner $i to finish" log_has "l$i" "learner $i: done"; done
[ "$(status learners_known syncer)" -eq 2 ] ||
  fail "the syncer knows $(status learners_known syncer) learners, not 2 (refused learners and the observer do not count)"
[ "$(status impersonations syncer)" -eq 0 ] || fail "impersonations counted although the intruder never connected"
for i in 0 1; do
  val=$(final_val "l$i")
  less_than "$val" 3.2 || fail "honest learner $i ended at validation loss $val"
  global=$(grep -o ' val-global [0-9.]*' "$WORK/l$i.log" | tail -n 1 | awk '{print $2}')
  [ -n "$global" ] || fail "learner $i printed no val-global"
  less_than "$global" 3.5 || fail "learner $i's view of the global model ended at validation loss $global"
done
note "honest learners done: final val $(final_val l0), $(final_val l1); merges $(status merges syncer)"
note "PASS"
