#!/usr/bin/env bash
# Multi-process test of torch_gpt's ZeroMQ mode: ddiloco_syncer serving the libtorch GPT's tensor
# list and initial parameters (from `torch_gpt --export`), and 2 `torch_gpt --connect` learner
# processes (preset smoke: width 32, 1 block, P = 2, H = 10), on loopback, plaintext (the
# learner's --connect mode has no CURVE flags). Passes when both learners finish their step
# budget and exit cleanly, the validation loss of each learner's final parameters is below
# TARGET_RATIO of the loss of the initial parameters (measured 4.58 -> 2.7-2.9 at 150 steps
# each), and the syncer's status file shows both learners joined and
# more contributions accepted than either learner sent alone (so both contributed to merges).
# Waits poll a log line or the status file against a deadline (lib.sh); the cleanup trap kills
# every process on exit. Usage: torch_gpt_multiprocess.sh SYNCER TORCH_GPT KEYGEN
source "$(dirname "$0")/../multiprocess/lib.sh"

STEPS=150
TARGET_RATIO=0.85
TORCH_GPT=$LEARNER
PRESET=(--preset smoke --fragments 2 --H 10 --steps "$STEPS" --eval-batches 8)

"$TORCH_GPT" "${PRESET[@]}" --export "$WORK/model" >"$WORK/export.log" 2>&1 || fail "torch_gpt --export failed"
[ -s "$WORK/model/tensors.txt" ] && [ -s "$WORK/model/init.f32" ] || fail "torch_gpt --export wrote no tensor list or init"

# The syncer of lib.sh's start_syncer serves the reference model; this one serves the GPT's tensors.
"$SYNCER" --plaintext --bind 'tcp://127.0.0.1:*' --endpoint-file "$WORK/syncer.ep" \
  --status-file "$WORK/syncer.status" --status-every-ms 200 \
  --tensors "$WORK/model/tensors.txt" --init "$WORK/model/init.f32" --fragments 2 --sync-every 10 \
  --outer-momentum 0.5 >>"$WORK/syncer.log" 2>&1 &
SYNCER_PID=$!
PIDS+=("$SYNCER_PID")
wait_until 30 "the syncer to write its endpoint" test -s "$WORK/syncer.ep"
wait_until 30 "the syncer to write its status file" test -s "$WORK/syncer.status"
ENDPOINT=$(cat "$WORK/syncer.ep")
note "syncer at $ENDPOINT"

declare -a LPID
for i in 0 1; do
  "$TORCH_GPT" "${PRESET[@]}" --connect "$ENDPOINT" --id "$i" --shards 2 >>"$WORK/l$i.log" 2>&1 &
  LPID[i]=$!
  PIDS+=("${LPID[i]}")
done
for i in 0 1; do
  wait_until 120 "learner $i to finish $STEPS steps" log_has "l$i" "learner $i: done"
done
for i in 0 1; do
  expect_clean_exit "learner $i" "${LPID[i]}"
done

# The loss went down. Each learner prints the validation loss of the global state it received at
# join; the first one to join received the initial parameters (a merge needs a contribution), so
# the highest of the two is the initial loss. (A learner whose libtorch loads slowly may join after
# the other has trained for a while: it then starts from the merged state, which is fine.)
join_loss() { grep -o "learner $1 joined .*validation loss [0-9.]*" "$WORK/l$1.log" | awk '{print $NF}'; }
initial=$(printf '%s\n%s\n' "$(join_loss 0)" "$(join_loss 1)" | sort -g | tail -n 1)
[ -n "$initial" ] || fail "no learner printed its validation loss at join"
note "validation loss of the initial parameters: $initial (at join: $(join_loss 0), $(join_loss 1))"
max_sends=0
for i in 0 1; do
  final=$(grep -o "learner $i: done.*validation loss [0-9.]*" "$WORK/l$i.log" | awk '{print $NF}')
  sends=$(grep -o "learner $i: done.* sends [0-9]*" "$WORK/l$i.log" | awk '{print $NF}')
  applies=$(grep -o "learner $i: done.* applies [0-9]*" "$WORK/l$i.log" | awk '{print $NF}')
  note "learner $i: final validation loss $final, sends $sends, applies $applies"
  [ -n "$final" ] || fail "learner $i printed no final validation loss"
  less_than "$final" "$(awk -v a="$initial" -v r="$TARGET_RATIO" 'BEGIN {print a * r}')" ||
    fail "learner $i: validation loss $initial -> $final did not fall below $TARGET_RATIO of the initial"
  [ "${sends:-0}" -gt 0 ] || fail "learner $i sent no fragment"
  [ "${applies:-0}" -gt 0 ] || fail "learner $i applied no global fragment"
  [ "$sends" -gt "$max_sends" ] && max_sends=$sends
done

# Both learners contributed: the syncer saw two learners join and accepted more contributions than
# either learner sent on its own. The status file is rewritten every 200 ms: poll for the count.
wait_until 10 "the syncer to accept more than $max_sends contributions" \
  status_at_least accepted syncer "$((max_sends + 1))"
note "syncer: joins $(status joins syncer) known $(status learners_known syncer) accepted $(status accepted syncer)" \
  "rejected $(status rejected syncer) merges $(status merges syncer)"
[ "$(status learners_known syncer)" -ge 2 ] || fail "the syncer knows $(status learners_known syncer) learners, not 2"
[ "$(status joins syncer)" -ge 2 ] || fail "the syncer saw $(status joins syncer) joins, not 2"
[ "$(status merges syncer)" -ge 5 ] || fail "only $(status merges syncer) merges for 2 x $STEPS steps"

stop_syncer_with_sigterm
note "PASS"
