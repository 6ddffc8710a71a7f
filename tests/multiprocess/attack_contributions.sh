#!/usr/bin/env bash
# Attack suite (docs/security.md): hostile contributions. A clean phase, then
# one phase per attack, each followed by its clean twin, each a fresh syncer
# with two honest learners; the attack starts at honest step ATTACK_FROM and
# runs until the learners pause at MEASURE_AT:
#   poison             learner 100 sends contributions of 10 per element (about
#                      1000x an honest outer gradient) with steps = tokens = 2^62,
#                      20/s, plaintext;
#   contribution_flood 200/s of the same, every second one half NaN;
#   poison_curve       the poison from a listed CURVE key (learner 100 on the allow-list);
#   stealth_poison     payloads of 0.2 per element (about 20x honest) with claims
#                      within an advancing step counter, 20/s, plaintext (only
#                      with ATTACK_STEALTH_POISON=1: an open gap, see below).
# Each phase asserts (attack_lib.sh, check_phase): the syncer's peak RSS under
# its bound; merges per honest step >= 80% of the clean phases' mean; the
# global model's validation loss at MEASURE_AT within 2% of the largest clean phase's;
# no honest contribution rejected; every rejection counted under a reason.
# Usage: attack_contributions.sh SYNCER LEARNER KEYGEN CHAOS_CLIENT ATTACKER
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/attack_lib.sh"

clean_phase --plaintext

# attack_phase NAME ATTACKER_FLAGS...: a phase with the attacker (learner 100)
# started at ATTACK_FROM; the syncer's flags are SYNCER_FLAGS.
attack_phase() {
  local name=$1
  shift
  RSS_BOUND=$(rss_bound 3)  # two honest learners and the attacker
  start_phase "$name" "${SYNCER_FLAGS[@]}"
  mark_window_start "$name" || return 0
  # shellcheck disable=SC2046
  start_attacker "$name" --id 100 --report-every 10 $(attacker_round_flags) "$@"
  wait_until 60 "the attacker of $name to send 20 contributions" \
    log_has "$name-attacker" "sent 20 contributions"
  end_phase "$name" || return 0
  reasons_add_up "$name"
  note "$name: $(grep 'done' "$WORK/$name-attacker.log"); syncer rejected $(status rejected "$name"): $(rejections "$name")"
  check_phase "$name" "$RSS_BOUND"
  clean_phase "${SYNCER_FLAGS[@]}"  # its clean twin, at about the same load
}

SYNCER_FLAGS=(--plaintext)
attack_phase poison --attack poison --rate 20
# Open: a poisoner whose claims are within its own advancing step counter
# (16 steps = 16 tokens) and whose norm, about 20x an honest one, is within
# the norm-outlier factor (50x) is accepted, and clipping (4x the robust
# reference) leaves the global loss about 7% above clean (with clipping and the
# weight cap off: x3). Not run by default (it fails its loss bound);
# ATTACK_STEALTH_POISON=1 runs it. In pull rounds its damage comes from its
# step counter (16 steps a message, 320 a second, faster than the honest
# learners): it leads the global step by up to max_lead (64 rounds), so
# rounds come early (the same counter with an empty payload: merges x1.35,
# loss +4%; with a payload its step counter does not lead: x0.99). With
# --max-lead 96 (4 rounds) on the syncer the phase passes, but two honest
# learners 20% apart then lose 1.1% on average (docs/security.md).
if [ "${ATTACK_STEALTH_POISON:-0}" = 1 ]; then
  attack_phase stealth_poison --attack poison --rate 20 --advance-step --counter-log2 4 --magnitude 0.2
fi
attack_phase contribution_flood --attack contribution-flood --rate 200 --nan-every 2

make_keys syncer l0 l1 l50 attacker
# Learner 50 is the observer that scores the global model.
{ for i in 0 1 50; do echo "$i $(public_key "l$i")"; done; echo "100 $(public_key attacker)"; } >"$WORK/keys/allow"
SYNCER_FLAGS=(--keys "$WORK/keys/syncer.key" --allow "$WORK/keys/allow")
learner_flags() { echo --keys "$WORK/keys/l$1.key" --server-key "$WORK/keys/syncer.pub"; }
attack_phase poison_curve --attack poison --rate 20 --keys "$WORK/keys/attacker.key" --server-key "$WORK/keys/syncer.pub"
finish_suite
