#!/usr/bin/env bash
# ddiloco_sim size on the command line: a deployment that fits (exit 0, the
# schedule and shard table printed and written), one that does not (exit 3,
# said so), and bad flags (exit 1, the value named).
# Usage: sim_size_cli.sh PATH/TO/ddiloco_sim MODELS_DIR OUT_DIR
set -euo pipefail
sim=$1 models=$2 out=$3
rm -rf "$out" && mkdir -p "$out"
fail() { echo "FAIL: $*" >&2; exit 1; }

"$sim" size "$models/llama-1b.txt" --learners 8 --step 0.5 --gbps 1 --global-codec int8 --out "$out" > "$out/fits.txt" ||
  fail "a deployment that fits exited $?"
grep -q "Schedule: P = " "$out/fits.txt" || fail "no schedule line"
grep -Eq "Syncer: [0-9]+ shards? \(" "$out/fits.txt" || fail "no syncer line"
grep -q "^| 0 | " "$out/fits.txt" || fail "no shard table"
cmp -s "$out/fits.txt" "$out/size_llama-1b.md" || fail "the file differs from what was printed"
# A fixed schedule is taken as given.
"$sim" size "$models/llama-1b.txt" --fragments 12 --sync-every 48 --overlap 2 --out "$out" | grep -q "P = 12, H = 48, tau = 2" ||
  fail "--fragments/--sync-every/--overlap not taken"

set +e
"$sim" size "$models/llama-1b.txt" --ram-gib 0.01 --out "$out" > "$out/nofit.txt"
rc=$?
set -e
[ "$rc" -eq 3 ] || fail "a deployment that cannot fit exited $rc, not 3"
grep -q "DOES NOT FIT" "$out/nofit.txt" || fail "no DOES NOT FIT"

# CURVE (the default) moves fewer bytes per I/O thread than plaintext: the same
# shards' I/O thread is busier under it.
io_of() { grep "^| 0 | " "$1" | awk -F'|' '{print $8}'; }
two=(size "$models/llama-1b.txt" --learners 8 --step 0.5 --global-codec int8 --shards 2 --out "$out")
"$sim" "${two[@]}" > "$out/curve2.txt" || true  # exit 3 when the two shards do not fit: compared all the same
"$sim" "${two[@]}" --security plaintext > "$out/plain2.txt" || true
grep -q "CURVE links" "$out/curve2.txt" || fail "the default is not said to be CURVE"
grep -q "plaintext links" "$out/plain2.txt" || fail "--security plaintext not said"
c=$(io_of "$out/curve2.txt") p=$(io_of "$out/plain2.txt")
[ -n "$c" ] && [ -n "$p" ] || fail "no shard table for the CURVE / plaintext comparison"
awk -v c="$c" -v p="$p" 'BEGIN { exit !(c > p) }' || fail "the I/O thread under CURVE ($c) is not busier than in plaintext ($p)"
# Under CURVE the I/O threads are chosen per shard; held to one, the same model needs more shards.
"$sim" size "$models/llama-1b.txt" --learners 8 --step 0.5 --global-codec int8 --out "$out" --io-threads 1 \
  > "$out/one_io.txt" || fail "a deployment on one I/O thread exited $?"
grep -q "(io threads)" "$out/one_io.txt" || fail "one I/O thread is not what limits: $(grep Syncer: "$out/one_io.txt")"
grep -q -- "--io-threads 1)" "$out/one_io.txt" || fail "--io-threads 1 not taken"
shards_of() { grep -o "Syncer: [0-9]*" "$1" | grep -o "[0-9]*$"; }
[ "$(shards_of "$out/one_io.txt")" -gt "$(shards_of "$out/fits.txt")" ] ||
  fail "one I/O thread does not need more shards than the chosen threads"
for bad in "--learners 0:learners = 0" "--headroom 2:headroom = 2" "--codec int3:int3" "--cores 1.5:--cores 1.5" \
           "--security tls:--security tls" "--io-threads 16:io_threads = 16 leaves no core"; do
  flag=${bad%%:*} want=${bad#*:}
  set +e
  # shellcheck disable=SC2086
  msg=$("$sim" size "$models/llama-1b.txt" $flag --out "$out" 2>&1 >/dev/null)
  rc=$?
  set -e
  [ "$rc" -eq 1 ] || fail "$flag exited $rc, not 1"
  grep -qF -- "$want" <<< "$msg" || fail "$flag: message '$msg' does not name '$want'"
done
"$sim" size 2>/dev/null && fail "size without a model succeeded"
echo "sim_size_cli: ok"
