#!/usr/bin/env bash
# Multi-process test: kill -9 of a learner mid-run. The syncer keeps merging
# while it is down; the learner restarts with the same id and key, rejoins (the
# syncer's joins counter grows) and contributes again (accepted grows while it
# is the only learner left). CURVE-secured, 4 learners. The learners have no
# step limit: learners 0, 2 and 3 stop when the test creates their stop file,
# once it has seen the rejoin (a step budget raced the test on a fast machine:
# they could finish before learner 1 was back).
# Usage: kill_learner.sh SYNCER LEARNER KEYGEN
source "$(dirname "$0")/lib.sh"

STOP="$WORK/stop-others"

make_keys syncer l0 l1 l2 l3
for i in 0 1 2 3; do echo "$i $(public_key l$i)"; done >"$WORK/keys/allow"
start_syncer syncer --keys "$WORK/keys/syncer.key" --allow "$WORK/keys/allow"
auth() { echo --keys "$WORK/keys/l$1.key" --server-key "$WORK/keys/syncer.pub"; }
declare -a LPID
for i in 0 1 2 3; do
  # shellcheck disable=SC2046
  start_learner "l$i" "$i" 4 0 --stop-file "$STOP" $(auth "$i")
  LPID[i]=$LEARNER_PID
done
wait_until 60 "learner 1 to train 100 steps" log_has l1 "learner 1: step 100 "
wait_until 30 "20 merges" status_at_least merges syncer 20

kill -9 "${LPID[1]}"
wait "${LPID[1]}" 2>/dev/null || true
merges=$(status merges syncer)
joins=$(status joins syncer)
note "killed learner 1 at merges $merges, joins $joins"
wait_until 60 "the syncer to merge 20 more times while learner 1 is down" \
  status_at_least merges syncer "$((merges + 20))"
note "merges $(status merges syncer) with learner 1 down"

# The restarted learner has no step limit and no stop file: it is the last one
# running; it is killed by the clean-up at the end.
# shellcheck disable=SC2046
start_learner l1-restarted 1 4 0 $(auth 1)
wait_until 30 "the restarted learner 1 to rejoin" log_has l1-restarted "learner 1: joined"
wait_until 10 "the syncer to count the rejoin" status_at_least joins syncer "$((joins + 1))"
note "learner 1 rejoined: joins $(status joins syncer)"

touch "$STOP"
for i in 0 2 3; do
  wait_until 120 "learner $i to finish" log_has "l$i" "learner $i: done"
done
# Their leave messages come after their last contributions on the same connection.
alive_is_one() { [ "$(status learners_alive syncer)" -eq 1 ]; }
wait_until 15 "the syncer to count only learner 1 alive" alive_is_one
accepted=$(status accepted syncer)
merges=$(status merges syncer)
wait_until 60 "contributions of the restarted learner 1 alone" status_at_least accepted syncer "$((accepted + 5))"
wait_until 30 "merges of the restarted learner 1 alone" status_at_least merges syncer "$((merges + 5))"
log_has l1-restarted "learner 1: done" && fail "the restarted learner 1 ended early"
note "accepted $accepted -> $(status accepted syncer) with only the restarted learner 1 alive"
[ "$(status rejected_unknown_learner syncer)" -eq 0 ] || fail "contributions of an unknown learner were rejected"
note "PASS"
