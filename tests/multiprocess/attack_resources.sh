#!/usr/bin/env bash
# Attack suite (docs/security.md): attacks on the syncer's memory and time.
# A clean phase, then one phase per attack, each followed by its clean twin,
# each a fresh syncer with two honest learners; the attack starts at honest
# step ATTACK_FROM and runs until the learners pause at MEASURE_AT:
#   join_flood        joins with a fresh id each (100, 101, ...), 2000/s, plaintext;
#   join_flood_curve  a listed CURVE key (learner 100) re-joining as itself, 2000/s;
#   slow_reader       32 peers (ids 200..231) that join and never read;
#   huge_frame        one full_state frame of 512 MiB with a valid CRC.
# Each phase asserts what attack_lib.sh's check_phase does: the syncer's peak
# RSS under its bound (rss_bound: the memory bounds' formula for the phase's
# connections, watched all along: over it fails at once), merges per
# honest step >= 80% of the clean phases' mean, the global model's validation
# loss within 2% of the largest clean phase's,
# no honest contribution rejected, every rejection counted under a reason.
# Usage: attack_resources.sh SYNCER LEARNER KEYGEN CHAOS_CLIENT ATTACKER
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/attack_lib.sh"

clean_phase --plaintext

# attack_phase NAME CONNECTIONS WAIT_FOR ATTACKER_FLAGS...: a phase with the
# attacker started at ATTACK_FROM; CONNECTIONS the attacker's connections;
# WAIT_FOR a line of the attacker's log that shows the attack under way. The
# syncer's flags are SYNCER_FLAGS.
attack_phase() {
  local name=$1 wait_for=$3
  RSS_BOUND=$(rss_bound "$((2 + $2))")
  shift 3
  start_phase "$name" "${SYNCER_FLAGS[@]}"
  mark_window_start "$name" || return 0
  start_attacker "$name" "$@"
  wait_until 60 "the attacker of $name: '$wait_for'" log_has "$name-attacker" "$wait_for"
  end_phase "$name" || return 0
  reasons_add_up "$name"
  note "$name: $(tail -n 1 "$WORK/$name-attacker.log"); syncer rejected $(status rejected "$name"):" \
    "$(rejections "$name") decode_errors $(status decode_errors "$name") joins $(status joins "$name")" \
    "known $(status learners_known "$name")"
  check_phase "$name" "$RSS_BOUND"
  clean_phase "${SYNCER_FLAGS[@]}"  # its clean twin, at about the same load
}

SYNCER_FLAGS=(--plaintext)
# In plaintext, ids are unauthenticated, and a flood of fresh ids is answered
# within the join rate limits (64 a second) and counted alive until the
# heartbeat time-out. Neither pull nor push rounds wait for ids that never
# trained, and pull rounds send them no merges: the phase passes (pull: merges
# x0.95 of clean, x0.55 before the merge's fan-out skipped them; push: x0.96 to
# x1.07, docs/security.md, "Push rounds: ids that do not train").
attack_phase join_flood 1 "sent 1000 joins" --attack join-flood --fresh-ids --id 100 --rate 2000 --report-every 1000
attack_phase slow_reader 32 "never reading" --attack slow-reader --peers 32 --id 200
attack_phase huge_frame 1 "sent a full_state frame" --attack huge-frame --frame-bytes 536870912 --id 300

make_keys syncer l0 l1 l50 attacker
# Learner 50 is the observer that scores the global model.
{ for i in 0 1 50; do echo "$i $(public_key "l$i")"; done; echo "100 $(public_key attacker)"; } >"$WORK/keys/allow"
SYNCER_FLAGS=(--keys "$WORK/keys/syncer.key" --allow "$WORK/keys/allow")
learner_flags() { echo --keys "$WORK/keys/l$1.key" --server-key "$WORK/keys/syncer.pub"; }
attack_phase join_flood_curve 1 "sent 1000 joins" --attack join-flood --id 100 --rate 2000 --report-every 1000 \
  --keys "$WORK/keys/attacker.key" --server-key "$WORK/keys/syncer.pub"
finish_suite
