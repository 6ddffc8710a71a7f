# tests/multiprocess/attack_lib.sh: what the attack suite's tests share (sourced
# after lib.sh; docs/security.md describes the suite).
#
# A test runs phases. A phase is a fresh syncer (--tally-learners 0,1, so the
# status file counts the two honest learners' contributions one by one) and
# two honest learners (ids 0 and 1) that train until the test stops them.
# The clean phase measures the reference figures; an attack phase starts the
# attack once the honest learners have 2 x ATTACK_FROM steps together and
# measures, over the same window of honest steps (2 x ATTACK_FROM .. 2 x
# MEASURE_AT, summed over both learners) as the clean phase:
#   - merges per honest step (the status file's merges over the sum of the
#     honest learners' step counters, both read from the same status write,
#     so the ratio does not depend on how fast the machine is);
#   - the syncer's peak RSS (VmHWM);
#   - the validation loss of the global model at the window's end (an
#     observer's fetch, with the learners frozen);
#   - the honest learners' rejections, by reason.
# What it is not: a test (the scripts that source it are).
#
# Usage: source attack_lib.sh after lib.sh; the attacker is the 5th program.
ATTACKER=${5:-}
[ -x "$ATTACKER" ] || fail "attacker '$ATTACKER' is not executable; build ddiloco_attacker"

ATTACK_FROM=${ATTACK_FROM:-200}
MEASURE_AT=${MEASURE_AT:-2000}
# Bounds every phase is held to.
MERGE_RATE_MIN=0.80  # merges per honest step, against the clean phase
LOSS_TOLERANCE=0.02  # honest validation loss, relative to the clean phase


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
# M the model's fp32 size and R0 the clean phase's peak (the syncer's own state).
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
# which train until the test stops them. The suite runs push rounds
# (ATTACK_ROUND, default push): its figures and bounds were measured there, and
# the attacker sends push rounds' unsolicited contributions. In pull rounds
# (ATTACK_ROUND=pull) the attacker's contributions are refused first as
# steps_beyond_schedule, and the poison_curve phase has refused honest ones (5
# of learner 1's, under no per-learner reason, in 1 run): not yet measured.
ATTACK_ROUND=${ATTACK_ROUND:-push}
declare -a PHASE_LEARNERS
start_phase() {
  local name=$1 i
  shift
  start_syncer "$name" --tally-learners 0,1 --status-every-ms 100 --round "$ATTACK_ROUND" "$@"
  PHASE_LEARNERS=()
  for i in 0 1; do
    # shellcheck disable=SC2046
    start_learner "$name-l$i" "$i" 2 100000000 $(learner_flags "$i") --round "$ATTACK_ROUND"
    PHASE_LEARNERS+=("$LEARNER_PID")
  done
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
# validation loss is over 10x the clean phase's end has been wrecked: fail at
# once (a wrecked model also trains many times slower).
loss_guard() {
  [ -n "${CLEAN_VAL:-}" ] || return 0
  local i v
  for i in 0 1; do
    v=$(grep -o ' val [^ ]*' "$WORK/$1-l$i.log" 2>/dev/null | tail -n 1 | awk '{print $2}')
    [ -z "$v" ] && continue
    { [[ $v =~ ^[0-9.]+$ ]] && less_than "$v" "$(awk -v c="$CLEAN_VAL" 'BEGIN {print 10 * c}')"; } ||
      PHASE_ABORT="honest learner $i is at validation loss $v (clean phase's global model: $CLEAN_VAL)"
  done
}
# honest_steps NAME: the sum of the honest learners' step counters as syncer NAME last saw them.
honest_steps() { echo $(($(status learner_0_step "$1") + $(status learner_1_step "$1"))); }
honest_steps_at_least() { [ "$(honest_steps "$1")" -ge "$2" ]; }
# freeze_at NAME: freezes (SIGSTOP) each honest learner of phase NAME once it
# has printed its progress line of step MEASURE_AT, so both end the phase at
# about the same step (how the steps split between them moves the global
# model's loss by several percent); true when both are frozen.
declare -a FROZEN
freeze_at() {
  local i all=0
  rss_guard "$1"
  loss_guard "$1"
  [ -z "$PHASE_ABORT" ] || return 0
  for i in 0 1; do
    if [ -z "${FROZEN[i]:-}" ] && log_has "$1-l$i" "learner $i: step $MEASURE_AT "; then
      kill -STOP "${PHASE_LEARNERS[i]}"
      FROZEN[i]=1
    fi
    [ -z "${FROZEN[i]:-}" ] || all=$((all + 1))
  done
  [ "$all" = 2 ]
}
# end_phase NAME: freezes each honest learner at step MEASURE_AT (freeze_at), stops the attacker, waits for a quiet
# syncer, has an observer (id 50) score the global model, then stops
# everything. Sets RATE (merges per honest step from WINDOW_START to
# WINDOW_END, snapshots "merges steps"), HWM (MiB), VAL (the global model's
# validation loss, 2048 examples), HONEST_ACCEPTED, HONEST_STALE,
# HONEST_REJECTED and HONEST_REASONS (the non-zero reasons).
end_phase() {
  local name=$1 pid
  FROZEN=() PHASE_ABORT=""
  wait_until 240 "the honest learners of $name to reach step $MEASURE_AT" freeze_at "$name"
  if [ -n "$PHASE_ABORT" ]; then
    SUITE_FAILURES+=("$name: $PHASE_ABORT (rejected: $(rejections "$name"))")
    note "$name: FAILED: $PHASE_ABORT; $(tail -n 1 "$WORK/$name-attacker.log" 2>/dev/null)"
    echo "$name aborted: $PHASE_ABORT" >>"${ATTACK_FIGURES:-/dev/null}"
    for pid in "${PHASE_LEARNERS[@]}" "${ATTACK_PID:-}" "$SYNCER_PID"; do [ -z "$pid" ] || kill -9 "$pid" 2>/dev/null || true; done
    ATTACK_PID=
    return 1
  fi
  # Frozen, they send nothing more. The syncer has handled what they sent once
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
  # rebases: a learner far slower than the other (a loaded machine) has one
  # now and then in a clean run too. So stale ones may be up to 1% of the
  # honest contributions; every other reason is an honest rejection.
  HONEST_ACCEPTED=$(($(status learner_0_accepted "$name") + $(status learner_1_accepted "$name")))
  HONEST_STALE=$(($(status learner_0_rejected_stale "$name") + $(status learner_1_rejected_stale "$name")))
  HONEST_REJECTED=$(($(status learner_0_rejected "$name") + $(status learner_1_rejected "$name") - HONEST_STALE))
  [ "$((HONEST_STALE * 100))" -le "$HONEST_ACCEPTED" ] || HONEST_REJECTED=$((HONEST_REJECTED + HONEST_STALE))
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

# clean_phase: the reference figures CLEAN_RATE, CLEAN_HWM, CLEAN_VAL.
clean_phase() {
  start_phase clean "$@"
  mark_window_start clean || fail "the clean phase could not start: $(printf "%s; " "${SUITE_FAILURES[@]}")"
  end_phase clean
  [ "$HONEST_REJECTED" -eq 0 ] || fail "honest contributions rejected without any attack: $HONEST_REASONS"
  CLEAN_RATE=$RATE CLEAN_HWM=$HWM CLEAN_VAL=$VAL
  MODEL_MIB=$(model_mib clean)
  note "clean: $RATE merges per honest step, peak RSS $HWM MiB, global val $VAL at $((2 * MEASURE_AT)) honest steps" \
    "(model $MODEL_MIB MiB)"
}

# check_phase NAME RSS_BOUND_MIB: the attack phase's figures against the bounds.
# Every rejection the syncer made is counted under a reason (the status
# file's per-reason lines add up to its total).
check_phase() {
  local name=$1 bound=$2 ratio loss_ratio
  ratio=$(awk -v a="$RATE" -v b="$CLEAN_RATE" 'BEGIN {printf "%.3f\n", a / b}')
  loss_ratio=$(awk -v a="$VAL" -v b="$CLEAN_VAL" 'BEGIN {printf "%.4f\n", a / b}')
  note "$name: merge rate $RATE (x$ratio of clean), peak RSS $HWM MiB (bound $bound), val $VAL (x$loss_ratio)," \
    "honest accepted $HONEST_ACCEPTED, rejected $HONEST_REJECTED (stale $HONEST_STALE) ${HONEST_REASONS}"
  echo "$name merge_ratio=$ratio rss_mib=$HWM loss_ratio=$loss_ratio honest_rejected=$HONEST_REJECTED" \
    >>"${ATTACK_FIGURES:-/dev/null}"
  local failures=()
  less_than "$HWM" "$bound" || failures+=("syncer peak RSS $HWM MiB is over its bound $bound MiB")
  less_than "$MERGE_RATE_MIN" "$ratio" || failures+=("honest merges at x$ratio of the clean rate (< $MERGE_RATE_MIN)")
  less_than "$loss_ratio" "$(awk -v t="$LOSS_TOLERANCE" 'BEGIN {print 1 + t}')" ||
    failures+=("honest validation loss $VAL is over $LOSS_TOLERANCE above the clean $CLEAN_VAL")
  [ "$HONEST_REJECTED" -eq 0 ] || failures+=("honest contributions rejected: $HONEST_REASONS")
  [ "${#failures[@]}" -eq 0 ] || SUITE_FAILURES+=("$name: $(printf '%s; ' "${failures[@]}")")
}

# finish_suite: fails with every phase's failures, if any; else PASS.
SUITE_FAILURES=()
finish_suite() {
  [ "${#SUITE_FAILURES[@]}" -eq 0 ] || fail "$(printf '\n  %s' "${SUITE_FAILURES[@]}")"
  note "PASS"
}

# reasons_add_up NAME: the per-reason rejections of syncer NAME's status file sum to its total.
reasons_add_up() {
  awk -F= '$1 == "rejected" {t = $2} $1 ~ /^rejected_/ {s += $2} END {exit !(s == t)}' "$WORK/$1.status" ||
    fail "$1: rejections by reason do not add up to the total"
}
