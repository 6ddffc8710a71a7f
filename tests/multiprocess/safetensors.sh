#!/usr/bin/env bash
# Multi-process test of the weights in safetensors (docs/weights.md):
#  1. a syncer serving the reference model checkpoints on SIGTERM; ddiloco_export
#     writes that checkpoint's global model to ref.safetensors;
#  2. a syncer started from ref.safetensors alone (--init, no tensor list),
#     stopped at once: its export equals ref.safetensors tensor for tensor, bit
#     for bit (names, shapes and order preserved);
#  3. the same with a reference learner training against it until merges
#     happen: the export holds the same names and shapes, finite values that
#     moved away from the initial ones, and the same bytes when the plan is
#     given again by --init instead of read from the checkpoint;
#  4. refusals: export with a tensor list that does not match the checkpoint's
#     plan (the error names the tensor, no file written), a syncer without
#     --init (all-zero parameters), a file with an unsupported dtype.
# The files are compared with a reader of the format written below (Python's
# standard library only). ddiloco_export is found next to the syncer.
# Usage: safetensors.sh SYNCER LEARNER KEYGEN
source "$(dirname "$0")/lib.sh"

EXPORT=$(dirname "$SYNCER")/ddiloco_export
[ -x "$EXPORT" ] || fail "ddiloco_export is not built next to $SYNCER"
PY=$(command -v python3) || fail "python3 is needed to compare safetensors files"

# compare A B MODE: MODE=same (every tensor bit for bit), moved (same names and
# shapes, all finite, some values differ).
compare() {
  "$PY" - "$@" <<'EOF'
import json, math, struct, sys
def read(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n]); header.pop("__metadata__", None)
    body = data[8 + n:]
    out = []
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        assert e["dtype"] == "F32", (name, e["dtype"])
        b, end = e["data_offsets"]
        out.append((name, e["shape"], body[b:end]))
    return out
a, b, mode = read(sys.argv[1]), read(sys.argv[2]), sys.argv[3]
if [(n, s) for n, s, _ in a] != [(n, s) for n, s, _ in b]:
    sys.exit(f"names/shapes differ: {[(n, s) for n, s, _ in a]} vs {[(n, s) for n, s, _ in b]}")
if mode == "same":
    for (n, _, x), (_, _, y) in zip(a, b):
        if x != y: sys.exit(f"tensor {n} differs")
    print(f"{len(a)} tensors identical")
else:
    moved = 0
    for (n, _, x), (_, _, y) in zip(a, b):
        vy = struct.unpack(f"<{len(y) // 4}f", y)
        if not all(math.isfinite(v) for v in vy): sys.exit(f"tensor {n} has non-finite values")
        moved += x != y
    if moved == 0: sys.exit("no tensor moved")
    print(f"{moved} of {len(a)} tensors moved")
EOF
}

# start_from NAME FLAGS...: a syncer serving what FLAGS give, checkpoints in $WORK/NAME.ck.
start_from() {
  local name=$1
  shift
  rm -f "$WORK/$name.ep"
  "$SYNCER" --plaintext --bind 'tcp://127.0.0.1:*' --endpoint-file "$WORK/$name.ep" \
    --status-file "$WORK/$name.status" --status-every-ms 200 --outer-momentum 0.5 \
    --checkpoint-dir "$WORK/$name.ck" "$@" >>"$WORK/$name.log" 2>&1 &
  SYNCER_PID=$!
  PIDS+=("$SYNCER_PID")
  wait_until 30 "syncer $name to write its endpoint" test -s "$WORK/$name.ep"
  ENDPOINT=$(cat "$WORK/$name.ep")
  wait_until 30 "syncer $name to write its status file" test -s "$WORK/$name.status"
}

# 1. The reference model's initial global, exported.
start_from ref --reference-model
stop_syncer_with_sigterm
"$EXPORT" --checkpoint "$WORK/ref.ck" --out "$WORK/ref.safetensors" >"$WORK/export-ref.log" 2>&1 ||
  fail "export of the reference checkpoint failed: $(cat "$WORK/export-ref.log")"
note "$(cat "$WORK/export-ref.log")"

# 2. A syncer from the file alone; stopped at once, its global is the file.
# The reference model marks embedding and output.weight (the unembedding) as
# embeddings; the default rule matches only the first: say so.
EMB=(--embedding-pattern '^(embedding|output\.weight)$')
start_from st --init "$WORK/ref.safetensors" "${EMB[@]}"
log_has st "syncer: 5 tensors (2 embeddings), 125817 parameters from $WORK/ref.safetensors" ||
  fail "the syncer did not take the plan from the file: $(head -n 3 "$WORK/st.log")"
stop_syncer_with_sigterm
"$EXPORT" --checkpoint "$WORK/st.ck" --out "$WORK/st.safetensors" >"$WORK/export-st.log" 2>&1 ||
  fail "export failed: $(cat "$WORK/export-st.log")"
same=$(compare "$WORK/ref.safetensors" "$WORK/st.safetensors" same) ||
  fail "the exported initial model differs from the file the syncer started from: $same"
note "initial vs exported: $same"

# 3. Trained: a learner (whose plan is the reference model's, so the file's
#    plan must be the same, embedding flag included) until 5 merges; it has
#    no step limit (it exits only if it fails) and is stopped after them.
start_from tr --init "$WORK/ref.safetensors" "${EMB[@]}"
start_learner l0 0 1 0 --plaintext
merged_or_gone() { status_at_least merges tr 5 || exited "$LEARNER_PID"; }
wait_until 120 "5 merges" merged_or_gone
status_at_least merges tr 5 || fail "the learner exited before 5 merges"
stop_syncer_with_sigterm
kill -TERM "$LEARNER_PID" 2>/dev/null || true
"$EXPORT" --checkpoint "$WORK/tr.ck" --out "$WORK/tr.safetensors" >"$WORK/export-tr.log" 2>&1 ||
  fail "export failed: $(cat "$WORK/export-tr.log")"
note "$(cat "$WORK/export-tr.log")"
moved=$(compare "$WORK/ref.safetensors" "$WORK/tr.safetensors" moved) ||
  fail "the trained export does not hold moved, finite values under the same names: $moved"
note "initial vs trained: $moved"
"$EXPORT" --checkpoint "$WORK/tr.ck" --init "$WORK/ref.safetensors" "${EMB[@]}" --out "$WORK/tr2.safetensors" \
  >"$WORK/export-tr2.log" 2>&1 || fail "export with --init failed: $(cat "$WORK/export-tr2.log")"
compare "$WORK/tr.safetensors" "$WORK/tr2.safetensors" same >/dev/null ||
  fail "the export with the plan from --init differs from the one with the plan from the checkpoint"

# The plan as a tensor list (from the file: name numel [embedding]) works too.
"$PY" - "$WORK/ref.safetensors" >"$WORK/right.txt" <<'EOF'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", data[:8])
h = json.loads(data[8:8 + n]); h.pop("__metadata__", None)
for name, e in sorted(h.items(), key=lambda kv: kv[1]["data_offsets"][0]):
    numel = 1
    for d in e["shape"]: numel *= d
    print(name, numel, "embedding" if name in ("embedding", "output.weight") else "")
EOF
"$EXPORT" --checkpoint "$WORK/tr.ck" --tensors "$WORK/right.txt" --out "$WORK/tr3.safetensors" \
  >"$WORK/export-tr3.log" 2>&1 || fail "export with --tensors failed: $(cat "$WORK/export-tr3.log")"
compare "$WORK/tr.safetensors" "$WORK/tr3.safetensors" same >/dev/null ||
  fail "the export with the plan from --tensors differs from the one with the plan from the checkpoint"

# 4. Refusals, each with a message naming the problem, nothing written.
sed 's/^hidden0.weight /hidden0.w /' "$WORK/right.txt" >"$WORK/wrong.txt"
if "$EXPORT" --checkpoint "$WORK/tr.ck" --tensors "$WORK/wrong.txt" --out "$WORK/bad.safetensors" \
  >"$WORK/export-bad.log" 2>&1; then
  fail "export with a mismatching tensor list succeeded"
fi
grep -q "differ at tensor 1: 'hidden0.w' in --tensors $WORK/wrong.txt, 'hidden0.weight' in the checkpoint" \
  "$WORK/export-bad.log" ||
  fail "the mismatch message does not name the tensor: $(cat "$WORK/export-bad.log")"
[ ! -e "$WORK/bad.safetensors" ] || fail "a mismatching export wrote a file"
[ -z "$(find "$WORK" -maxdepth 1 -name '.bad.safetensors.tmp-*')" ] || fail "a temporary file was left behind"
if "$SYNCER" --plaintext --tensors "$WORK/right.txt" >"$WORK/zero.log" 2>&1; then
  fail "a syncer without --init started from zeros"
fi
grep -q "all-zero parameters.*--allow-zero-init" "$WORK/zero.log" || fail "no clear zero-init refusal: $(cat "$WORK/zero.log")"
"$PY" - "$WORK/i64.safetensors" <<'EOF'
import json, struct, sys
h = json.dumps({"step": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<q", 7))
EOF
if "$SYNCER" --plaintext --init "$WORK/i64.safetensors" >"$WORK/i64.log" 2>&1; then
  fail "a syncer started from an I64 tensor"
fi
grep -q "tensor 'step' has dtype I64, which ddiloco does not read" "$WORK/i64.log" ||
  fail "no clear dtype refusal: $(cat "$WORK/i64.log")"
note "PASS"
