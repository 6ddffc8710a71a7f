#!/usr/bin/env bash
# Multi-process test: the Prometheus metrics of ddiloco_syncer and ddiloco_learner
# (--metrics, docs/metrics.md), scraped by a real Prometheus server.
#
# A plaintext syncer (checkpointing every second) and two learners serve their
# metrics on loopback ports they pick themselves (--metrics 127.0.0.1:0,
# --metrics-file). First a direct scrape of each /metrics: the metric families
# exposed (name, type, labels) must be exactly the rows of docs/metrics.md's
# tables. Then the distribution's prometheus (/usr/bin/prometheus) is started
# on a free loopback port, storage in the test's temporary directory, scraping
# the syncer and learner 0 every second, and its HTTP API (/api/v1/query) is
# polled until the series that must move have moved: the syncer's merges grow
# between two samples, accepted contributions and checkpoints are counted, two
# learners are alive, learner 0's steps grow and its staleness histogram has
# observations. Every wait is bounded; the learners have a step budget far
# beyond the test and are stopped with SIGTERM (clean exit 0), then the syncer
# and Prometheus. Without prometheus the names are still checked, then the
# test reports "SKIP:" (ctest: skipped) for the part it could not run.
# Usage: metrics.sh SYNCER LEARNER KEYGEN [CHAOS_CLIENT]
source "$(dirname "$0")/lib.sh"

# DDILOCO_PROMETHEUS: the server to use (set but empty: behave as if absent).
if [ -n "${DDILOCO_PROMETHEUS+set}" ]; then
  PROMETHEUS=$DDILOCO_PROMETHEUS
else
  PROMETHEUS=$(command -v prometheus || true)
fi
[ -n "$PROMETHEUS" ] && [ -x "$PROMETHEUS" ] || PROMETHEUS=""
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3
DOC="$(cd "$(dirname "$0")/../.." && pwd)/docs/metrics.md"
[ -f "$DOC" ] || fail "the metrics documentation $DOC is missing"

# ---- the programs, metrics on ports they pick --------------------------------
start_syncer syncer --plaintext --quorum 1 --metrics 127.0.0.1:0 --metrics-file "$WORK/syncer.metrics" \
  --checkpoint-dir "$WORK/ckpt" --checkpoint-every-ms 1000
wait_until 30 "the syncer's metrics address" test -s "$WORK/syncer.metrics"
SYNCER_METRICS=$(cat "$WORK/syncer.metrics")
note "syncer at $ENDPOINT, metrics at $SYNCER_METRICS"
declare -a LPID LMETRICS
for i in 0 1; do
  start_learner "l$i" "$i" 2 1000000 --plaintext --metrics 127.0.0.1:0 --metrics-file "$WORK/l$i.metrics"
  LPID[i]=$LEARNER_PID
done
for i in 0 1; do
  wait_until 60 "learner $i's metrics address" test -s "$WORK/l$i.metrics"
  LMETRICS[i]=$(cat "$WORK/l$i.metrics")
  wait_until 60 "learner $i to join" log_has "l$i" "learner $i: joined"
done
note "learner metrics at ${LMETRICS[*]}"

# ---- direct scrape: exposed families == documented rows ------------------------
"$PY" - "$DOC" "http://$SYNCER_METRICS/metrics" "http://${LMETRICS[0]}/metrics" <<'EOF' || fail "metric names differ from docs/metrics.md (see above)"
import re, sys, urllib.request

def documented(path):
    """Rows `| `name` | type | labels | meaning |` of the doc's tables."""
    rows = {}
    for line in open(path, encoding="utf-8"):
        m = re.match(r"^\|\s*`(ddiloco_[a-z0-9_]+)`\s*\|\s*([a-z]+)\s*\|([^|]*)\|", line)
        if m:
            labels = sorted(x.strip(" `") for x in m.group(3).split(",") if x.strip(" `-"))
            rows[m.group(1)] = (m.group(2), labels)
    return rows

def exposed(url):
    """Families of a /metrics scrape: name -> (type, sorted label names without le)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    types, labels = {}, {}
    for line in text.splitlines():
        m = re.match(r"^# TYPE (\S+) (\S+)$", line)
        if m:
            types[m.group(1)] = m.group(2)
            labels.setdefault(m.group(1), set())
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? ", line)
        if not m or line.startswith("#"):
            continue
        name = m.group(1)
        family = name if name in types else re.sub(r"_(bucket|sum|count)$", "", name)
        keys = {kv.split("=")[0] for kv in re.findall(r'[a-zA-Z_]+="[^"]*"', m.group(3) or "")}
        labels.setdefault(family, set()).update(keys - {"le"})
    return {n: (t, sorted(labels[n])) for n, t in types.items() if n.startswith("ddiloco_")}

doc = documented(sys.argv[1])
got = {}
for url in sys.argv[2:]:
    got.update(exposed(url))
ok = True
for name in sorted(set(doc) | set(got)):
    if name not in got:
        print(f"documented but not exposed: {name}"); ok = False
    elif name not in doc:
        print(f"exposed but not documented: {name} {got[name]}"); ok = False
    elif doc[name] != got[name]:
        print(f"{name}: documented {doc[name]}, exposed {got[name]}"); ok = False
print(f"{len(got)} metric families exposed, {len(doc)} documented")
sys.exit(0 if ok else 1)
EOF
note "direct scrape matches docs/metrics.md"

# stop_programs: SIGTERM to the learners, then the syncer; each must exit 0.
stop_programs() {
  for i in 0 1; do kill -TERM "${LPID[i]}"; done
  for i in 0 1; do
    expect_clean_exit "learner $i (after SIGTERM)" "${LPID[i]}"
    log_has "l$i" "learner $i: signal 15: stopping" || fail "learner $i did not report the signal"
    log_has "l$i" "learner $i: done" || fail "learner $i did not leave"
  done
  stop_syncer_with_sigterm
}
if [ -z "$PROMETHEUS" ]; then
  stop_programs
  echo "SKIP: prometheus not installed (apt-get install prometheus): the names were checked, the scrape by a real server was not"
  exit 0
fi

# ---- a real Prometheus server, with the documented alerting rules ----------------
# The rules block of docs/metrics.md (the one starting "# ddiloco-alerts.yml").
awk '/^# ddiloco-alerts.yml$/ {on = 1} on && /^```/ {exit} on {print}' "$DOC" >"$WORK/ddiloco-alerts.yml"
grep -q 'alert: DdilocoNoMerges' "$WORK/ddiloco-alerts.yml" || fail "no alerting rules block found in $DOC"
PROMTOOL=$(dirname "$PROMETHEUS")/promtool
if [ -x "$PROMTOOL" ]; then
  "$PROMTOOL" check rules "$WORK/ddiloco-alerts.yml" >"$WORK/promtool.log" 2>&1 ||
    { cat "$WORK/promtool.log"; fail "promtool rejects the alerting rules of docs/metrics.md"; }
fi
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
cat >"$WORK/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: ['$WORK/ddiloco-alerts.yml']
scrape_configs:
  - job_name: ddiloco_syncer
    static_configs:
      - targets: ['$SYNCER_METRICS']
  - job_name: ddiloco_learner
    static_configs:
      - targets: ['${LMETRICS[0]}']
EOF
prometheus_ready() { curl -sf "http://127.0.0.1:$PROM_PORT/-/ready" >/dev/null 2>&1; }
# The port is free when picked; should another process take it first,
# Prometheus exits ("address already in use") and the next attempt picks again.
for attempt in 1 2 3; do
  PROM_PORT=$(free_port)
  "$PROMETHEUS" --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
    --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn >>"$WORK/prometheus.log" 2>&1 &
  PROM_PID=$!
  PIDS+=("$PROM_PID")
  ready_or_gone() { prometheus_ready || exited "$PROM_PID"; }
  wait_until 60 "prometheus to be ready on 127.0.0.1:$PROM_PORT" ready_or_gone
  prometheus_ready && break
  [ "$attempt" -lt 3 ] || fail "prometheus did not start (see prometheus.log)"
done
note "prometheus on 127.0.0.1:$PROM_PORT"

# query EXPR: the value of the first sample of an instant query ("" if none).
query() {
  "$PY" - "http://127.0.0.1:$PROM_PORT/api/v1/query" "$1" <<'EOF'
import json, sys, urllib.parse, urllib.request
url = sys.argv[1] + "?" + urllib.parse.urlencode({"query": sys.argv[2]})
try:
    r = json.load(urllib.request.urlopen(url, timeout=5))
except Exception:
    sys.exit(0)
res = r.get("data", {}).get("result", [])
if r.get("status") == "success" and res:
    print(res[0]["value"][1])
EOF
}
# query_above EXPR MIN: the query has a sample > MIN.
query_above() {
  local v
  v=$(query "$1")
  [ -n "$v" ] && awk -v a="$v" -v b="$2" 'BEGIN {exit !(a > b)}'
}

wait_until 60 "prometheus to scrape the syncer" query_above 'up{job="ddiloco_syncer"}' 0
wait_until 60 "prometheus to scrape learner 0" query_above 'up{job="ddiloco_learner"}' 0
wait_until 120 "a merge in prometheus" query_above ddiloco_syncer_merges_total 0
merges1=$(query ddiloco_syncer_merges_total)
wait_until 120 "ddiloco_syncer_merges_total to grow past $merges1" query_above ddiloco_syncer_merges_total "$merges1"
note "merges $merges1 -> $(query ddiloco_syncer_merges_total)"
wait_until 60 "accepted contributions" query_above ddiloco_syncer_contributions_accepted_total 0
wait_until 60 "round latencies" query_above ddiloco_syncer_round_seconds_count 0
wait_until 60 "two learners alive" query_above ddiloco_syncer_learners_alive 1
wait_until 60 "a checkpoint" query_above ddiloco_syncer_checkpoints_total 0
wait_until 60 "wire bytes received" query_above ddiloco_syncer_received_bytes_total 0
wait_until 60 "merged globals encoded for sending" query_above ddiloco_syncer_globals_encoded_total 0
steps1=$(query 'ddiloco_learner_steps_total{learner="0"}')
[ -n "$steps1" ] || fail "no ddiloco_learner_steps_total for learner 0 in prometheus"
wait_until 60 "learner 0's steps to grow past $steps1" query_above 'ddiloco_learner_steps_total{learner="0"}' "$steps1"
wait_until 60 "learner 0's staleness observations" query_above 'ddiloco_learner_staleness_versions_count{learner="0"}' 0
wait_until 60 "learner 0's applies" query_above 'ddiloco_learner_applies_total{learner="0"}' 0
# Pull rounds (the programs' default): the round mode, the global step and the pull counters.
wait_until 60 "the syncer's round mode pull" query_above 'ddiloco_syncer_round_mode{mode="pull"}' 0
wait_until 60 "pull rounds" query_above ddiloco_syncer_pull_rounds_total 0
wait_until 60 "pulls sent" query_above ddiloco_syncer_pulls_sent_total 0
wait_until 60 "a global step" query_above ddiloco_syncer_global_step 0
wait_until 60 "learner 0's metadata" query_above 'ddiloco_learner_metadata_sent_total{learner="0"}' 0
wait_until 60 "learner 0's pulls" query_above 'ddiloco_learner_pulls_total{learner="0"}' 0
# The documented rules were loaded and are evaluated (health "ok", none failing).
rules_ok() {
  "$PY" - "http://127.0.0.1:$PROM_PORT/api/v1/rules" <<'EOF'
import json, sys, urllib.request
try:
    r = json.load(urllib.request.urlopen(sys.argv[1], timeout=5))
except Exception:
    sys.exit(1)
rules = [x for g in r["data"]["groups"] for x in g["rules"]]
sys.exit(0 if len(rules) >= 6 and all(x.get("health") == "ok" for x in rules) else 1)
EOF
}
wait_until 60 "prometheus to evaluate the documented alerting rules" rules_ok
# A PromQL expression over a histogram, as a dashboard or an alert would use it.
wait_until 60 "a median round time" query_above \
  'histogram_quantile(0.5, sum(rate(ddiloco_syncer_round_seconds_bucket[30s])) by (le))' 0
rejected=$(query 'sum(ddiloco_syncer_contributions_rejected_total)')
note "accepted $(query ddiloco_syncer_contributions_accepted_total) rejected $rejected," \
  "learner 0 steps $steps1 -> $(query 'ddiloco_learner_steps_total{learner="0"}')," \
  "median round $(query 'histogram_quantile(0.5, sum(rate(ddiloco_syncer_round_seconds_bucket[30s])) by (le))') s"

# ---- clean stops -------------------------------------------------------------------
stop_programs
kill -TERM "$PROM_PID"
expect_clean_exit "prometheus (after SIGTERM)" "$PROM_PID"
note "PASS"
