# tests/multiprocess/attack_lib.sh: what the attack suite's tests share (sourced
# after lib.sh; docs/security.md describes the suite).
#
# A test runs phases. A phase is a fresh syncer (--tally-learners 0,1, so the
# status file counts the two honest learners' contributions one by one) and
# two honest learners (ids 0 and 1) that each train exactly MEASURE_AT
# inner steps and then pause, still joined (--pause-after-steps).
# Clean phases, one before the first attack phase and one after each,
# measure the reference figures (clean_phase); an attack phase
# starts the attack once the honest learners have 2 x ATTACK_FROM steps
# together and measures, over the same window of honest steps (2 x
# ATTACK_FROM .. 2 x MEASURE_AT, summed over both learners) as the clean
# phases:
#   - merges per honest step (the status file's merges over the sum of the
#     honest learners' step counters, both read from the same status write,
#     so the ratio does not depend on how fast the machine is);
#   - the syncer's peak RSS (VmHWM);
#   - the validation loss of the global model at the window's end (an
#     observer's fetch, with both learners paused at step MEASURE_AT);
#   - the honest learners' rejections, by reason.
# What it is not: a test (the scripts that source it are).
#
# Usage: source attack_lib.sh after lib.sh; the attacker is the 5th program.
ATTACKER=${5:-}
[ -x "$ATTACKER" ] || fail "attacker '$ATTACKER' is not executable; build ddiloco_attacker"

ATTACK_FROM=${ATTACK_FROM:-200}
MEASURE_AT=${MEASURE_AT:-2000}
# Bounds every phase is held to.
MERGE_RATE_MIN=0.80  # merges per honest step, against the clean phases' mean
LOSS_TOLERANCE=0.02  # global validation loss, relative to the largest clean phase's
STALE_MAX_PERCENT=5  # honest contributions answered as stale (a descheduled learner's burst)


# snapshot NAME: "merges honest_steps" from one read of syncer NAME's status file.
snapshot() {
  awk -F= '$1 == "merges" {m = $2} $1 == "learner_0_step" {a = $2} $1 == "learner_1_step" {b = $2}
           END {print m + 0, a + b}' "$WORK/$1.status"
}

# hwm_mib PID: the process's peak resident set (VmHWM), MiB.
hwm_mib() { awk '$1 == "VmHWM:" {printf "%.1f\n", $2 / 1024}' "/proc/$1/status"; }


# rss_bound CONNECTIONS: the syncer's memory bound, MiB, for a phase with that
# many open connections (docs/operations.md, "Memory bounds"; docs/security.md):
#   RSS <= R0 + send budget + 2 x (incoming bound + F) + C x (RCVHWM + 1) x F + membership
# with the budgets the syncer derives from the plan: send budget 64 peer
# budgets of 8 S, incoming bound 64 S, F <= S (S: a full state, the model in
# fp32), RCVHWM = 4, membership under 1 MiB. So
#   RSS <= R0 + 1 MiB + (642 + 5 C) x M,
# M the model's fp32 size and R0 the clean phases' largest peak (the syncer's own state).
rss_bound() {
  awk -v r="$CLEAN_HWM" -v m="$MODEL_MIB" -v c="$1" 'BEGIN {printf "%.1f\n", r + 1 + (642 + 5 * c) * m}'
}

# model_mib NAME: the model's fp32 size, MiB, from syncer NAME's first line.
model_mib() {
  grep -o '[0-9]* parameters' "$WORK/$1.log" | head -n 1 | awk '{printf "%.3f\n", $1 * 4 / 1048576}'
}

# learner_flags ID: the security flags of honest learner ID (a test under
# CURVE redefines it; the paths hold no spaces: mktemp under TMPDIR).
learner_flags() { echo --plaintext; }

# start_phase NAME [SYNCER FLAGS...]: a syncer and honest learners 0 and 1,
# which train MEASURE_AT inner steps each and pause (SIGSTOP themselves). The
# suite runs the programs' default, pull rounds (ATTACK_ROUND=push runs the
# push rounds kept for comparison). In pull rounds a contribution attacker also
# acts as a pull-round learner (attacker_round_flags: --pull): it sends
# metadata with its step counter and answers every pull it gets with poison,
# besides its unasked contributions (refused there as unsolicited).
ATTACK_ROUND=${ATTACK_ROUND:-pull}
attacker_round_flags() { [ "$ATTACK_ROUND" != pull ] || echo --pull; }
declare -a PHASE_LEARNERS
start_phase() {
  local name=$1 i
  shift
  start_syncer "$name" --tally-learners 0,1 --status-every-ms 100 --round "$ATTACK_ROUND" "$@"
  PHASE_LEARNERS=()
  for i in 0 1; do
    # shellcheck disable=SC2046
    start_learner "$name-l$i" "$i" 2 100000000 --pause-after-steps "$MEASURE_AT" $(learner_flags "$i") --round "$ATTACK_ROUND" \
      --start-file "$WORK/$name.go"
    PHASE_LEARNERS+=("$LEARNER_PID")
  done
  # Both train from the same moment, however long each join took: a learner
  # that trained alone first (a join that waited out its 1 s retry) moved the
  # phase's loss by up to 3%, as much as the tolerance.
  wait_until 120 "the honest learners of $name to join" both_joined "$name"
  touch "$WORK/$name.go"
}
both_joined() {
  local i
  for i in 0 1; do log_has "$1-l$i" "waiting for" || exited "${PHASE_LEARNERS[i]}" || return 1; done
}

# start_attacker NAME FLAGS...: the attacker against phase NAME's syncer (ATTACK_PID).
start_attacker() {
  local name=$1
  shift
  "$ATTACKER" --connect "$ENDPOINT" "$@" >>"$WORK/$name-attacker.log" 2>&1 &
  ATTACK_PID=$!
  PIDS+=("$ATTACK_PID")
}

# rejections NAME: the syncer's non-zero rejection reasons, on one line.
rejections() { grep -E '^rejected_[a-z_]+=[1-9]' "$WORK/$1.status" | tr '\n' ' ' || true; }

# RSS_BOUND (MiB), when set, is also watched while the phase runs: a syncer
# over it fails the test at once (before the host runs out of memory).
# A guard that trips sets PHASE_ABORT (the phase is then cut short, counted
# as failed, and the next phase runs: a run reports every attack).
rss_guard() {
  [ -z "${RSS_BOUND:-}" ] || less_than "$(hwm_mib "$SYNCER_PID")" "$RSS_BOUND" ||
    PHASE_ABORT="the syncer's peak RSS $(hwm_mib "$SYNCER_PID") MiB is over its bound $RSS_BOUND MiB"
}
# loss_guard NAME: with CLEAN_VAL known, an honest learner whose latest
# validation loss is over 10x the clean phases' mean has been wrecked: fail at
# once (a wrecked model also trains many times slower).
loss_guard() {
  [ -n "${CLEAN_VAL:-}" ] || return 0
  local i v
  for i in 0 1; do
    v=$(grep -o ' val [^ ]*' "$WORK/$1-l$i.log" 2>/dev/null | tail -n 1 | awk '{print $2}')
    [ -z "$v" ] && continue
    { [[ $v =~ ^[0-9.]+$ ]] && less_than "$v" "$(awk -v c="$CLEAN_VAL" 'BEGIN {print 10 * c}')"; } ||
      PHASE_ABORT="honest learner $i is at validation loss $v (clean phases' global model: $CLEAN_VAL)"
  done
}
# honest_steps NAME: the sum of the honest learners' step counters as syncer NAME last saw them.
honest_steps() { echo $(($(status learner_0_step "$1") + $(status learner_1_step "$1"))); }
honest_steps_at_least() { [ "$(honest_steps "$1")" -ge "$2" ]; }
# paused PID: true once the process has stopped itself (state T: SIGSTOP).
paused() { [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" = T ]; }
# both_paused NAME: true once both honest learners of phase NAME have paused
# after exactly MEASURE_AT inner steps (--pause-after-steps: still joined, so
# the syncer merges their last contributions as any other), or once a guard
# has tripped. A learner that exits instead fails the phase.
both_paused() {
  local i
  rss_guard "$1"
  loss_guard "$1"
  for i in 0 1; do
    ! exited "${PHASE_LEARNERS[i]}" ||
      PHASE_ABORT="honest learner $i exited before its step $MEASURE_AT: $(tail -n 1 "$WORK/$1-l$i.log")"
  done
  [ -n "$PHASE_ABORT" ] || { paused "${PHASE_LEARNERS[0]}" && paused "${PHASE_LEARNERS[1]}"; }
}
# end_phase NAME: waits for both honest learners to pause after step
# MEASURE_AT (both_paused), stops the attacker, waits for a quiet
# syncer, has an observer (id 50) score the global model, then stops
# everything. Sets RATE (merges per honest step from WINDOW_START to
# WINDOW_END, snapshots "merges steps"), HWM (MiB), VAL (the global model's
# validation loss, 2048 examples), HONEST_ACCEPTED, HONEST_STALE,
# HONEST_REJECTED and HONEST_REASONS (the non-zero reasons).
end_phase() {
  local name=$1 pid
  PHASE_ABORT=""
  wait_until 240 "the honest learners of $name to pause after step $MEASURE_AT" both_paused "$name"
  if [ -n "$PHASE_ABORT" ]; then
    SUITE_FAILURES+=("$name: $PHASE_ABORT (rejected: $(rejections "$name"))")
    note "$name: FAILED: $PHASE_ABORT; $(tail -n 1 "$WORK/$name-attacker.log" 2>/dev/null)"
    echo "$name aborted: $PHASE_ABORT" >>"${ATTACK_FIGURES:-/dev/null}"
    for pid in "${PHASE_LEARNERS[@]}" "${ATTACK_PID:-}" "$SYNCER_PID"; do [ -z "$pid" ] || kill -9 "$pid" 2>/dev/null || true; done
    ATTACK_PID=
    return 1
  fi
  # Paused, they send nothing more. The syncer has handled what they sent once
  # its counts stay the same over 5 status writes.
  if [ -n "${ATTACK_PID:-}" ]; then
    kill -TERM "$ATTACK_PID" 2>/dev/null || true
    wait_until 30 "the attacker to stop" exited "$ATTACK_PID"
    ATTACK_PID=
  fi
  QUIET_LAST="" QUIET_SEEN=0
  wait_until 30 "the syncer of $name to handle what the learners sent" quiet "$name"
  WINDOW_END=$(snapshot "$name")
  # The global model as the syncer holds it, scored by an observer.
  # shellcheck disable=SC2046
  "$LEARNER" --observe --observe-count 1 --connect "$ENDPOINT" --id 50 --eval-examples 2048 \
    $(learner_flags 50) >>"$WORK/$name-observer.log" 2>&1 &
  pid=$!
  PIDS+=("$pid")
  expect_clean_exit "the observer of $name" "$pid"
  VAL=$(grep -o 'val-global [0-9.]*' "$WORK/$name-observer.log" | tail -n 1 | awk '{print $2}')
  [ -n "$VAL" ] || fail "the observer of $name printed no val-global"
  for pid in "${PHASE_LEARNERS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  HWM=$(hwm_mib "$SYNCER_PID")
  # A stale contribution is answered with the current fragment and its learner
  # rebases: a learner descheduled for a while (a loaded machine) has a burst
  # of them in a clean phase too (up to 1.2% of its contributions measured,
  # on one learner). So stale ones may be up to STALE_MAX_PERCENT of the
  # honest contributions; every other reason is an honest rejection. (A
  # stale contribution is not merged: an attack that makes many stale also
  # shows in the merge rate and the loss.)
  HONEST_ACCEPTED=$(($(status learner_0_accepted "$name") + $(status learner_1_accepted "$name")))
  HONEST_STALE=$(($(status learner_0_rejected_stale "$name") + $(status learner_1_rejected_stale "$name")))
  HONEST_REJECTED=$(($(status learner_0_rejected "$name") + $(status learner_1_rejected "$name") - HONEST_STALE))
  [ "$((HONEST_STALE * 100))" -le "$((HONEST_ACCEPTED * STALE_MAX_PERCENT))" ] ||
    HONEST_REJECTED=$((HONEST_REJECTED + HONEST_STALE))
  HONEST_REASONS=$(grep -E '^learner_[01]_rejected_[a-z_]+=[1-9]' "$WORK/$name.status" | tr '\n' ' ' || true)
  kill -9 "$SYNCER_PID"
  wait "$SYNCER_PID" 2>/dev/null || true
  RATE=$(echo "$WINDOW_START $WINDOW_END" | awk '{printf "%.4f\n", ($3 - $1) / ($4 - $2)}')
}

# quiet NAME: true once syncer NAME's accepted and rejected counts have been
# the same in 5 successive polls of its status file (written every 100 ms).
quiet() {
  local now
  now="$(status accepted "$1") $(status rejected "$1")"
  if [ "$now" = "$QUIET_LAST" ]; then QUIET_SEEN=$((QUIET_SEEN + 1)); else QUIET_LAST=$now QUIET_SEEN=0; fi
  [ "$QUIET_SEEN" -ge 5 ]
}

# mark_window_start NAME: waits for 2 x ATTACK_FROM honest steps and takes
# WINDOW_START. A learner that exits first (it could not join) aborts the
# phase: returns 1 with the failure recorded.
window_open() { honest_steps_at_least "$1" "$((2 * ATTACK_FROM))" || ! all_running; }
all_running() {
  local pid
  for pid in "${PHASE_LEARNERS[@]}"; do exited "$pid" && return 1; done
  return 0
}
mark_window_start() {
  wait_until 120 "the honest learners of $1 to reach $((2 * ATTACK_FROM)) steps together" window_open "$1"
  if ! all_running; then
    SUITE_FAILURES+=("$1: an honest learner exited before training: $(grep -h 'ddiloco_learner:' "$WORK/$1"-l*.log | head -n 1)")
    note "$1: FAILED: an honest learner exited before training"
    echo "$1 aborted: an honest learner exited before training" >>"${ATTACK_FIGURES:-/dev/null}"
    local pid
    for pid in "${PHASE_LEARNERS[@]}" "$SYNCER_PID"; do kill -9 "$pid" 2>/dev/null || true; done
    return 1
  fi
  WINDOW_START=$(snapshot "$1")
}

# mean_of / max_of / min_of NUMBERS...: over the numbers, 4 decimals.
mean_of() { printf '%s\n' "$@" | awk '{s += $1; n++} END {printf "%.4f\n", s / n}'; }
max_of() { printf '%s\n' "$@" | awk 'NR == 1 || $1 > m {m = $1} END {printf "%.4f\n", m}'; }
min_of() { printf '%s\n' "$@" | awk 'NR == 1 || $1 < m {m = $1} END {printf "%.4f\n", m}'; }

# Clean phases and the reference figures. Even with both learners paused at
# the same step, which merge each contribution lands in is the scheduler's,
# and a run that falls behind stays behind: one clean run's global loss is a
# sample of a spread, wider when the machine is loaded (0.3% to 0.7%
# standard deviation on the shared 2-core machine). So there is a clean phase
# before the first attack phase and one after each (clean_phase, with the
# attack phase's syncer flags: its twin but for the attacker, at about the
# same load), and each attack phase's loss is held, once all have run
# (finish_suite), against the largest clean loss (the honest spread) plus
# LOSS_TOLERANCE, its merge rate against the clean phases' mean.
CLEAN_VALS=() CLEAN_RATES=() CLEAN_HWMS=()
# clean_phase [SYNCER FLAGS...]: one more clean phase (clean1, clean2, ...);
# sets CLEAN_RATE and CLEAN_VAL (the clean phases' means so far), CLEAN_HWM
# (their largest peak: R0 of rss_bound) and MODEL_MIB.
clean_phase() {
  local name=clean$((${#CLEAN_VALS[@]} + 1))
  start_phase "$name" "$@"
  mark_window_start "$name" || fail "the clean phase $name could not start: $(printf "%s; " "${SUITE_FAILURES[@]}")"
  end_phase "$name" || fail "the clean phase $name failed: $(printf "%s; " "${SUITE_FAILURES[@]}")"
  [ "$HONEST_REJECTED" -eq 0 ] || fail "honest contributions rejected without any attack ($name): $HONEST_REASONS"
  CLEAN_VALS+=("$VAL") CLEAN_RATES+=("$RATE") CLEAN_HWMS+=("$HWM")
  CLEAN_RATE=$(mean_of "${CLEAN_RATES[@]}") CLEAN_HWM=$(max_of "${CLEAN_HWMS[@]}") CLEAN_VAL=$(mean_of "${CLEAN_VALS[@]}")
  [ -n "${MODEL_MIB:-}" ] || MODEL_MIB=$(model_mib clean1)
  note "$name: $RATE merges per honest step, peak RSS $HWM MiB, global val $VAL at $((2 * MEASURE_AT)) honest steps," \
    "honest accepted $HONEST_ACCEPTED (stale $HONEST_STALE) (model $MODEL_MIB MiB)"
  echo "$name merge_rate=$RATE rss_mib=$HWM val=$VAL stale=$HONEST_STALE accepted=$HONEST_ACCEPTED" \
    "steps_beyond_lead=$(status steps_beyond_lead "$name")" \
    >>"${ATTACK_FIGURES:-/dev/null}"
}

# check_phase NAME RSS_BOUND_MIB: the attack phase's memory and honest
# rejections against their bounds now; its merge rate and loss are kept for
# finish_suite. Every rejection the syncer made is counted under a reason
# (the status file's per-reason lines add up to its total).
PHASE_NAMES=() PHASE_RATES=() PHASE_VALS=()
check_phase() {
  local name=$1 bound=$2
  note "$name: merge rate $RATE, peak RSS $HWM MiB (bound $bound), val $VAL," \
    "honest accepted $HONEST_ACCEPTED, rejected $HONEST_REJECTED (stale $HONEST_STALE) ${HONEST_REASONS}"
  echo "$name rss_mib=$HWM bound_mib=$bound honest_rejected=$HONEST_REJECTED stale=$HONEST_STALE accepted=$HONEST_ACCEPTED" \
    "steps_beyond_lead=$(status steps_beyond_lead "$name")" \
    >>"${ATTACK_FIGURES:-/dev/null}"
  PHASE_NAMES+=("$name") PHASE_RATES+=("$RATE") PHASE_VALS+=("$VAL")
  local failures=()
  less_than "$HWM" "$bound" || failures+=("syncer peak RSS $HWM MiB is over its bound $bound MiB")
  [ "$HONEST_REJECTED" -eq 0 ] || failures+=("honest contributions rejected: $HONEST_REASONS")
  [ "${#failures[@]}" -eq 0 ] || SUITE_FAILURES+=("$name: $(printf '%s; ' "${failures[@]}")")
}

# finish_suite: each attack phase's merge rate (against the clean phases'
# mean) and global loss (against the largest clean loss); then fails with
# every phase's failures, if any; else PASS.
SUITE_FAILURES=()
finish_suite() {
  local i name ratio loss_ratio over_max val_max spread
  val_max=$(max_of "${CLEAN_VALS[@]}")
  spread=$(awk -v a="$val_max" -v b="$(min_of "${CLEAN_VALS[@]}")" 'BEGIN {printf "%.4f\n", a / b - 1}')
  note "clean (${#CLEAN_VALS[@]} phases): mean $CLEAN_RATE merges per honest step, peak RSS $CLEAN_HWM MiB, global val" \
    "${CLEAN_VALS[*]} (mean $CLEAN_VAL, largest $val_max, spread $spread)"
  echo "clean phases=${#CLEAN_VALS[@]} merge_rate=$CLEAN_RATE rss_mib=$CLEAN_HWM val=$CLEAN_VAL val_max=$val_max" \
    "spread=$spread vals=${CLEAN_VALS[*]}" >>"${ATTACK_FIGURES:-/dev/null}"
  less_than "$spread" "$LOSS_TOLERANCE" ||
    note "WARNING: the clean phases' losses spread by $spread, as wide as the loss tolerance $LOSS_TOLERANCE" \
      "(a loaded machine): an attack's damage must be that much larger to show"
  for i in "${!PHASE_NAMES[@]}"; do
    name=${PHASE_NAMES[i]}
    ratio=$(awk -v a="${PHASE_RATES[i]}" -v b="$CLEAN_RATE" 'BEGIN {printf "%.3f\n", a / b}')
    loss_ratio=$(awk -v a="${PHASE_VALS[i]}" -v b="$CLEAN_VAL" 'BEGIN {printf "%.4f\n", a / b}')
    over_max=$(awk -v a="${PHASE_VALS[i]}" -v b="$val_max" 'BEGIN {printf "%.4f\n", a / b}')
    note "$name: merges x$ratio of clean, val ${PHASE_VALS[i]} (x$loss_ratio of the clean mean, x$over_max of the largest)"
    echo "$name merge_ratio=$ratio val=${PHASE_VALS[i]} loss_ratio=$loss_ratio over_max=$over_max" \
      >>"${ATTACK_FIGURES:-/dev/null}"
    less_than "$MERGE_RATE_MIN" "$ratio" ||
      SUITE_FAILURES+=("$name: honest merges at x$ratio of the clean rate (< $MERGE_RATE_MIN)")
    less_than "$over_max" "$(awk -v t="$LOSS_TOLERANCE" 'BEGIN {print 1 + t}')" ||
      SUITE_FAILURES+=("$name: global validation loss ${PHASE_VALS[i]} is over $LOSS_TOLERANCE above the largest clean one, $val_max")
  done
  [ "${#SUITE_FAILURES[@]}" -eq 0 ] || fail "$(printf '\n  %s' "${SUITE_FAILURES[@]}")"
  note "PASS"
}

# reasons_add_up NAME: the per-reason rejections of syncer NAME's status file sum to its total.
reasons_add_up() {
  awk -F= '$1 == "rejected" {t = $2} $1 ~ /^rejected_/ {s += $2} END {exit !(s == t)}' "$WORK/$1.status" ||
    fail "$1: rejections by reason do not add up to the total"
}
