#!/usr/bin/env bash
# Multi-process test: hostile frames sent to a plaintext syncer while two honest
# learners train. ddiloco_chaos_client joins as learner 9 and sends 3 garbage
# messages, a truncated frame, a header claiming 2^40 elements and one claiming
# 2^62 payload bytes (decode_errors >= 6), a contribution under another plan
# fingerprint (rejected_foreign_plan >= 1) and a valid contribution followed by
# its replay (rejected_duplicate >= 1). The syncer keeps serving: merges keep
# growing, the honest learners finish and reach their usual validation loss.
# The honest learners have no step limit: they stop when the test creates
# their stop file, once it has counted everything and they have trained STEPS
# steps (a budget raced the chaos client on a fast machine).
# Usage: chaos_frames.sh SYNCER LEARNER KEYGEN CHAOS_CLIENT
source "$(dirname "$0")/lib.sh"
[ -x "$CHAOS" ] || fail "chaos client '$CHAOS' is not executable"

STEPS=2500
STOP="$WORK/stop-honest"

start_syncer syncer --plaintext
for i in 0 1; do start_learner "l$i" "$i" 2 0 --stop-file "$STOP" --plaintext; done
wait_until 60 "10 merges" status_at_least merges syncer 10
[ "$(status decode_errors syncer)" -eq 0 ] || fail "decode errors before any hostile frame"

"$CHAOS" --connect "$ENDPOINT" --id 9 --garbage 3 >"$WORK/chaos.log" 2>&1 || fail "the chaos client failed"
wait_until 30 "6 decode errors" status_at_least decode_errors syncer 6
wait_until 30 "a contribution under a foreign plan to be rejected" status_at_least rejected_foreign_plan syncer 1
wait_until 30 "the replayed contribution to be rejected" status_at_least rejected_duplicate syncer 1
merges=$(status merges syncer)
note "counted: decode_errors $(status decode_errors syncer) rejected_foreign_plan $(status rejected_foreign_plan syncer)" \
  "rejected_duplicate $(status rejected_duplicate syncer) at merges $merges"

wait_until 60 "the honest learners to keep merging" status_at_least merges syncer "$((merges + 20))"
for i in 0 1; do wait_until 120 "learner $i to train $STEPS steps" log_has "l$i" "learner $i: step $STEPS "; done
touch "$STOP"
for i in 0 1; do wait_until 60 "learner $i to finish" log_has "l$i" "learner $i: done"; done
for i in 0 1; do
  val=$(final_val "l$i")
  less_than "$val" 3.2 || fail "honest learner $i ended at validation loss $val"
done
[ "$(status decode_errors syncer)" -eq 6 ] || fail "decode_errors = $(status decode_errors syncer), expected exactly 6"
note "honest learners done: final val $(final_val l0), $(final_val l1); merges $(status merges syncer)"
note "PASS"
