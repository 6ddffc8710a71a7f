#!/usr/bin/env bash
# Multi-process test: a syncer sharded by fragment (docs/sharding.md), CURVE.
# 1. A learner that lists the shards in the wrong order, or names only one of
#    them, is refused by a shard with a message naming both maps (exit 1, no
#    time-out).
# 2. A reference run: one unsharded syncer, 3 learners x STEPS.
# 3. The same run against 2 shards (--shard 0/2 and 1/2, one key pair, one
#    allow-list; shard 0 spreads its connections over 2 ZeroMQ I/O threads),
#    each checkpointing every 300 ms. Once every learner has
#    trained 200 steps, shard 1 is killed with SIGKILL: the learners keep
#    training (2 more progress lines each) and shard 0 keeps merging
#    (its merge count grows while shard 1 is down). Shard 1 restarts on the
#    same endpoint from its own checkpoint and accepts contributions again;
#    every learner finishes and applies globals of the restarted shard.
# Then: the mean final validation loss is within TOLERANCE of the unsharded
# run's, each shard merged only its own fragments (no wrong_shard rejection),
# and no contribution was merged twice: the shards' accepted contributions add
# up to at most the contributions the learners sent. ddiloco_export writes the
# whole global model from both shards' checkpoints, and refuses one alone.
# Usage: shards.sh SYNCER LEARNER KEYGEN
source "$(dirname "$0")/lib.sh"

STEPS=1200
TOLERANCE=0.15

make_keys syncer l0 l1 l2
for i in 0 1 2; do echo "$i $(public_key l$i)"; done >"$WORK/keys/allow"
SECURITY=(--keys "$WORK/keys/syncer.key" --allow "$WORK/keys/allow")
auth() { echo --keys "$WORK/keys/l$1.key" --server-key "$WORK/keys/syncer.pub"; }

# 1. Refused joins: wrong order, and a learner that names one syncer only.
start_syncer s0 "${SECURITY[@]}" --shard 0/2 --checkpoint-dir "$WORK/c0" --checkpoint-every-ms 300 --io-threads 2
s0_pid=$SYNCER_PID
EP0=$ENDPOINT
start_syncer s1 "${SECURITY[@]}" --shard 1/2 --checkpoint-dir "$WORK/c1" --checkpoint-every-ms 300
s1_pid=$SYNCER_PID
EP1=$ENDPOINT
log_has s0 "syncer: shard 0/2 (map " || fail "shard 0 did not print its fragments"
log_has s0 ", 2 I/O threads" || fail "shard 0 does not say it runs 2 I/O threads"
note "$(grep 'syncer: shard ' "$WORK/s0.log") / $(grep 'syncer: shard ' "$WORK/s1.log")"
refused_run() {  # LOG ENDPOINTS: a learner that must exit 1, refused
  local rc=0
  # shellcheck disable=SC2046
  "$LEARNER" --connect "$2" --id 0 --steps 10 $(auth 0) >"$WORK/$1.log" 2>&1 || rc=$?
  [ "$rc" -eq 1 ] || fail "learner with --connect $2 exited $rc, expected 1 (refused)"
}
refused_run swapped "$EP1,$EP0"
# Both shards refuse it; whichever answer is read first is the error.
grep -Eq "it is shard (1 of 2 \(shard map [0-9a-f]+\) but this learner addressed it as shard 0|0 of 2 \(shard map [0-9a-f]+\) but this learner addressed it as shard 1) of 2" "$WORK/swapped.log" ||
  fail "the swapped learner's error does not name both shard maps: $(cat "$WORK/swapped.log")"
refused_run alone "$EP0"
grep -q "it is shard 0 of 2 (shard map [0-9a-f]*) but this learner addressed it as shard 0 of 1" "$WORK/alone.log" ||
  fail "the one-endpoint learner's error does not name both shard maps: $(cat "$WORK/alone.log")"
note "refused: $(grep -o 'it is shard.*addressed it as shard [0-9]* of [0-9]*' "$WORK/swapped.log")"

# 2. The unsharded reference run.
start_syncer reference "${SECURITY[@]}"
reference_pid=$SYNCER_PID
# shellcheck disable=SC2046
for i in 0 1 2; do start_learner "ref$i" "$i" 3 "$STEPS" $(auth "$i"); done
for i in 0 1 2; do wait_until 120 "reference learner $i to finish" log_has "ref$i" "learner $i: done"; done
kill -9 "$reference_pid"
wait "$reference_pid" 2>/dev/null || true
reference_val=$(mean_final_val ref0 ref1 ref2)
note "unsharded run: mean final val $reference_val"

# 3. The sharded run, shard 1 killed and restarted.
ENDPOINT="$EP0,$EP1"
declare -a learner_pids before frozen
for i in 0 1 2; do
  # shellcheck disable=SC2046
  start_learner "l$i" "$i" 3 "$STEPS" $(auth "$i")
  learner_pids[i]=$LEARNER_PID
done
# As in kill_syncer.sh: a learner runs 1200 steps in under 2 s when alone on a
# core, so each is frozen (SIGSTOP) at the next milestone and all are thawed
# together for the next phase (freeze_after, thaw: lib.sh); no phase depends on
# relative speeds.
for i in 0 1 2; do before[i]=0; done
wait_until 60 "every learner to train 200 steps (4 progress lines)" freeze_after 4
wait_until 30 "both shards to merge" status_at_least merges s1 1
wait_until 30 "a checkpoint of shard 1" log_has s1 "syncer: checkpoint"
kill -9 "$s1_pid"
wait "$s1_pid" 2>/dev/null || true
merges_s0=$(status merges s0)
note "killed shard 1 at $(grep -c 'syncer: checkpoint' "$WORK/s1.log") checkpoints; shard 0 had merged $merges_s0"

for i in 0 1 2; do before[i]=$(count_lines "l$i" "learner $i: step "); done
thaw
wait_until 60 "every learner to train 2 progress lines with shard 1 down" freeze_after 2
for i in 0 1 2; do log_has "l$i" "learner $i: done" && fail "learner $i finished while shard 1 was down; raise STEPS"; done
wait_until 30 "shard 0 to merge while shard 1 is down" status_at_least merges s0 "$((merges_s0 + 3))"
note "shard 1 down: learners trained 2 more progress lines, shard 0 merges $merges_s0 -> $(status merges s0)"

start_syncer s1b "${SECURITY[@]}" --shard 1/2 --checkpoint-dir "$WORK/c1" --checkpoint-every-ms 300 --bind "$EP1"
log_has s1b "syncer: resumed from" || fail "the restarted shard 1 did not resume from its checkpoint"
restored=$(status accepted s1b)
last_value() { grep -o " $2 [0-9]*" "$WORK/$1.log" | tail -n 1 | awk '{print $2}'; }
declare -a applies
for i in 0 1 2; do applies[i]=$(last_value "l$i" applies); done
thaw
wait_until 60 "the restarted shard 1 to accept contributions again" status_at_least accepted s1b "$((restored + 20))"
for i in 0 1 2; do wait_until 120 "learner $i to finish" log_has "l$i" "learner $i: done"; done
for i in 0 1 2; do
  [ "$(last_value "l$i" applies)" -ge "$((applies[i] + 5))" ] ||
    fail "learner $i applied $(last_value "l$i" applies) globals in all, ${applies[i]} before the restart: not re-synchronised"
done
sleep 0.5  # the last status lines (every 200 ms) count the learners' last contributions
sharded_val=$(mean_final_val l0 l1 l2)
sent=0
for i in 0 1 2; do sent=$((sent + $(last_value "l$i" sends))); done
accepted=$(($(status accepted s0) + $(status accepted s1b)))
note "sharded run: mean final val $sharded_val (unsharded $reference_val, tolerance $TOLERANCE)"
note "shard 0: merges $(status merges s0) accepted $(status accepted s0); restarted shard 1: merges $(status merges s1b) accepted $(status accepted s1b) duplicates $(status rejected_duplicate s1b); learners sent $sent"
for s in s0 s1b; do
  [ "$(status rejected_wrong_shard "$s")" = 0 ] || fail "$s rejected $(status rejected_wrong_shard "$s") contributions as wrong_shard"
done
[ "$accepted" -le "$sent" ] || fail "the shards accepted $accepted contributions but the learners sent only $sent"
# The global model of the sharded run: one checkpoint per shard, combined by ddiloco_export.
EXPORT=$(dirname "$SYNCER")/ddiloco_export
[ -x "$EXPORT" ] || fail "ddiloco_export is not built next to $SYNCER"
SYNCER_PID=$s0_pid stop_syncer_with_sigterm
"$EXPORT" --checkpoint "$WORK/c0,$WORK/c1" --reference-model --out "$WORK/global.safetensors" >"$WORK/export.log" 2>&1 ||
  fail "ddiloco_export of both shards failed: $(cat "$WORK/export.log")"
grep -q "125817 parameters" "$WORK/export.log" || fail "the export does not hold the whole model: $(cat "$WORK/export.log")"
if "$EXPORT" --checkpoint "$WORK/c1" --reference-model --out "$WORK/part.safetensors" >"$WORK/export1.log" 2>&1; then
  fail "ddiloco_export of one shard's checkpoint alone succeeded"
fi
grep -q "is of syncer shard 1/2" "$WORK/export1.log" || fail "one shard's export was not refused by name: $(cat "$WORK/export1.log")"
note "exported both shards: $(cat "$WORK/export.log")"
within() { awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN {d = a - b; if (d < 0) d = -d; exit !(d <= t)}'; }
within "$sharded_val" "$reference_val" "$TOLERANCE" ||
  fail "mean final val $sharded_val of the sharded run is not within $TOLERANCE of the unsharded $reference_val"
note "PASS"
