# tests/multiprocess/attack_lib.sh: what the attack suite's tests share (sourced
# after lib.sh; docs/security.md describes the suite).
#
# A test runs phases. A phase is a fresh syncer (--tally-learners 0,1, so the
# status file counts the two honest learners' contributions one by one) and
# two honest learners (ids 0 and 1) that train until the test stops them.
# The clean phase measures the reference figures; an attack phase starts the
# attack at honest step ATTACK_FROM and measures, over the same window of
# honest steps (ATTACK_FROM .. MEASURE_AT) as the clean phase:
#   - merges per honest step (the status file's merges over the sum of the
#     honest learners' step counters, both read from the same status write,
#     so the ratio does not depend on how fast the machine is);
#   - the syncer's peak RSS (VmHWM);
#   - the honest learners' mean validation loss at step MEASURE_AT;
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

# learners_at STEP NAME: both honest learners' step counters, as syncer NAME last saw them, >= STEP.
learners_at() { status_at_least learner_0_step "$2" "$1" && status_at_least learner_1_step "$2" "$1"; }

# snapshot NAME: "merges honest_steps" from one read of syncer NAME's status file.
snapshot() {
  awk -F= '$1 == "merges" {m = $2} $1 == "learner_0_step" {a = $2} $1 == "learner_1_step" {b = $2}
           END {print m + 0, a + b}' "$WORK/$1.status"
}

# hwm_mib PID: the process's peak resident set (VmHWM), MiB.
hwm_mib() { awk '$1 == "VmHWM:" {printf "%.1f\n", $2 / 1024}' "/proc/$1/status"; }

# val_at LOG STEP: the validation loss on the learner's progress line of STEP.
val_at() { grep -o "step $2 train [0-9.]* val [0-9.e+]*" "$WORK/$1.log" | head -n 1 | awk '{print $6}'; }

# model_mib NAME: the model's fp32 size, MiB, from syncer NAME's first line.
model_mib() {
  grep -o '[0-9]* parameters' "$WORK/$1.log" | head -n 1 | awk '{printf "%.3f\n", $1 * 4 / 1048576}'
}

# learner_flags ID: the security flags of honest learner ID (a test under
# CURVE redefines it; the paths hold no spaces: mktemp under TMPDIR).
learner_flags() { echo --plaintext; }

# start_phase NAME [SYNCER FLAGS...]: a syncer and honest learners 0 and 1,
# which train until the test stops them.
declare -a PHASE_LEARNERS
start_phase() {
  local name=$1 i
  shift
  start_syncer "$name" --tally-learners 0,1 --status-every-ms 100 "$@"
  PHASE_LEARNERS=()
  for i in 0 1; do
    # shellcheck disable=SC2046
    start_learner "$name-l$i" "$i" 2 100000000 $(learner_flags "$i")
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

# end_phase NAME: waits until both learners printed step MEASURE_AT, stops
# them and the syncer, and sets RATE (merges per honest step over the window),
# HWM (MiB), VAL (mean validation loss at MEASURE_AT), HONEST_REJECTED and
# HONEST_REASONS (non-zero reasons), from the window's snapshots
# WINDOW_START / WINDOW_END ("merges steps").
# RSS_BOUND (MiB), when set, is also watched while the phase runs: a syncer
# over it fails the test at once (before the host runs out of memory).
rss_guard() {
  [ -z "${RSS_BOUND:-}" ] || less_than "$(hwm_mib "$SYNCER_PID")" "$RSS_BOUND" ||
    fail "$1: the syncer's peak RSS $(hwm_mib "$SYNCER_PID") MiB is over its bound $RSS_BOUND MiB" \
      "(rejected: $(rejections "$1"))"
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
      fail "$1: honest learner $i is at validation loss $v (clean phase: $CLEAN_VAL at step $MEASURE_AT)" \
        "(rejected: $(rejections "$1"))"
  done
}
reached_or_guard() {
  rss_guard "$2"
  loss_guard "$2"
  learners_at "$1" "$2"
}
end_phase() {
  local name=$1 i pid
  wait_until 240 "the honest learners of $name to reach step $MEASURE_AT" reached_or_guard "$MEASURE_AT" "$name"
  WINDOW_END=$(snapshot "$name")
  for i in 0 1; do
    wait_until 60 "learner $i of $name to print step $MEASURE_AT" \
      lines_at_least "$name-l$i" "learner $i: step $MEASURE_AT " 1
  done
  HWM=$(hwm_mib "$SYNCER_PID")
  if [ -n "${ATTACK_PID:-}" ]; then
    kill -TERM "$ATTACK_PID" 2>/dev/null || true
    wait_until 30 "the attacker to stop" exited "$ATTACK_PID"
    ATTACK_PID=
  fi
  # The learners are frozen (they send nothing more) and the syncer has
  # handled what they sent once its counts stay the same over 5 status writes.
  for pid in "${PHASE_LEARNERS[@]}"; do kill -STOP "$pid" 2>/dev/null || true; done
  QUIET_LAST="" QUIET_SEEN=0
  wait_until 30 "the syncer of $name to handle what the learners sent" quiet "$name"
  for pid in "${PHASE_LEARNERS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
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
  VAL=$(for i in 0 1; do val_at "$name-l$i" "$MEASURE_AT"; done | awk '{s += $1; n++} END {printf "%.4f\n", s / n}')
}

# quiet NAME: true once syncer NAME's accepted and rejected counts have been
# the same in 5 successive polls of its status file (written every 100 ms).
quiet() {
  local now
  now="$(status accepted "$1") $(status rejected "$1")"
  if [ "$now" = "$QUIET_LAST" ]; then QUIET_SEEN=$((QUIET_SEEN + 1)); else QUIET_LAST=$now QUIET_SEEN=0; fi
  [ "$QUIET_SEEN" -ge 5 ]
}

# mark_window_start NAME: waits for honest step ATTACK_FROM and takes WINDOW_START.
mark_window_start() {
  wait_until 120 "the honest learners of $1 to reach step $ATTACK_FROM" learners_at "$ATTACK_FROM" "$1"
  WINDOW_START=$(snapshot "$1")
}

# clean_phase: the reference figures CLEAN_RATE, CLEAN_HWM, CLEAN_VAL.
clean_phase() {
  start_phase clean "$@"
  mark_window_start clean
  end_phase clean
  [ "$HONEST_REJECTED" -eq 0 ] || fail "honest contributions rejected without any attack: $HONEST_REASONS"
  CLEAN_RATE=$RATE CLEAN_HWM=$HWM CLEAN_VAL=$VAL
  MODEL_MIB=$(model_mib clean)
  note "clean: $RATE merges per honest step, peak RSS $HWM MiB, val $VAL at step $MEASURE_AT (model $MODEL_MIB MiB)"
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
  [ "${#failures[@]}" -eq 0 ] || fail "$name: $(printf '%s; ' "${failures[@]}")"
}

# reasons_add_up NAME: the per-reason rejections of syncer NAME's status file sum to its total.
reasons_add_up() {
  awk -F= '$1 == "rejected" {t = $2} $1 ~ /^rejected_/ {s += $2} END {exit !(s == t)}' "$WORK/$1.status" ||
    fail "$1: rejections by reason do not add up to the total"
}
