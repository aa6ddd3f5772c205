#!/usr/bin/env bash
# The main job on one machine (the embedded single-machine default, no GPU needed):
#   1. installs the dependencies and builds Strata;
#   2. writes a random tiny Llama-family model (`strata make-model`) and a sample long document
#      (a synthetic station log of about 34K tokens);
#   3. runs `strata serve` (coordinator + worker + KV store in one process);
#   4. asks a question about the document twice with `strata ask` (sparse attention: the
#      tokenselect policy with a 2048-token budget): the first time the document is
#      uploaded and prefilled (progress bar), the second time it is served from persisted KV;
#   5. prints the per-tier KV hit ratios read from the server's /metrics, then stops the server.
# The model has random weights, so its answers are noise: the demo shows the service path.
# Usage: scripts/demo.sh [--preset tiny|small] [--entries N] [--max-tokens N]
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=tiny
ENTRIES=700
MAX_TOKENS=32
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) PRESET="$2"; shift 2 ;;
    --entries) ENTRIES="$2"; shift 2 ;;
    --max-tokens) MAX_TOKENS="$2"; shift 2 ;;
    *) echo "demo.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
scripts/install_deps.sh
scripts/build.sh
BIN=build/bin/strata
MODEL_DIR="out/models/llama-$PRESET"
DEMO_DIR="out/demo"
mkdir -p "$DEMO_DIR"
if [ ! -f "$MODEL_DIR/config.json" ]; then
  "$BIN" make-model --arch llama --preset "$PRESET" --out "$MODEL_DIR"
fi
DOC="$DEMO_DIR/station_log.txt"
/usr/bin/env python3 scripts/make_sample_document.py "$DOC" --entries "$ENTRIES"

# A fresh data directory each run, so the first question really prefills.
rm -rf "$DEMO_DIR/data" "$DEMO_DIR/ports"
"$BIN" serve --model "$MODEL_DIR" --data "$DEMO_DIR/data" --listen 127.0.0.1:0 \
  --metrics-listen 127.0.0.1:0 --port-file "$DEMO_DIR/ports" 2>"$DEMO_DIR/serve.log" &
SERVE_PID=$!
stop_server() {
  if kill -0 "$SERVE_PID" 2>/dev/null; then
    kill -TERM "$SERVE_PID" 2>/dev/null || true
    wait "$SERVE_PID" 2>/dev/null || true
  fi
}
trap stop_server EXIT
for _ in $(seq 1 600); do
  [ -s "$DEMO_DIR/ports" ] && break
  kill -0 "$SERVE_PID" 2>/dev/null || { echo "strata serve exited; see $DEMO_DIR/serve.log" >&2; exit 1; }
  sleep 0.1
done
read -r GRPC_PORT METRICS_PORT < "$DEMO_DIR/ports"
echo "== strata serve on 127.0.0.1:$GRPC_PORT (metrics on :$METRICS_PORT, log $DEMO_DIR/serve.log)" >&2

QUESTION="What is the vault code, and who may use it?"
for attempt in first second; do
  echo "== $attempt question: strata ask --doc $DOC \"$QUESTION\"" >&2
  start=$(date +%s.%N)
  "$BIN" ask --server "127.0.0.1:$GRPC_PORT" --doc "$DOC" --max-tokens "$MAX_TOKENS" \
    --temperature 0.8 --seed 1 --policy tokenselect --budget 2048 "$QUESTION"
  end=$(date +%s.%N)
  echo "== $attempt question answered in $(awk "BEGIN {printf \"%.2f\", $end - $start}") s" >&2
done

echo "== KV hit ratio per tier (hits / lookups, from /metrics)" >&2
curl -s "http://127.0.0.1:$METRICS_PORT/metrics" | awk '
  /^strata_kv_(lookups|hits)_total\{/ {
    match($0, /tier="[a-z]+"/); tier = substr($0, RSTART + 6, RLENGTH - 7)
    if ($0 ~ /^strata_kv_lookups_total/) lookups[tier] += $NF; else hits[tier] += $NF
  }
  END {
    for (t in lookups) printf "  %-7s lookups %8d  hits %8d  ratio %s\n", t, lookups[t], hits[t],
      (lookups[t] > 0 ? sprintf("%.3f", hits[t] / lookups[t]) : "n/a")
  }' >&2
