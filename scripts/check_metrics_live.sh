#!/usr/bin/env bash
# Starts the Strata server processes (strata kvstore, strata coordinator, and a strata worker with
# the tiny golden test model tests/fixtures/golden/llama, registered with that coordinator) on
# loopback with free ports, scrapes their /metrics and checks each scrape against the metric catalogue
# (docs/metrics.md) with deploy/tools/check_metrics.js --exposition: every strata_* family must be
# catalogued with the same type, and carry only catalogued labels and label values; and each
# scrape passes `promtool check metrics` (Prometheus' naming lint). Registered with ctest as
# deploy.metrics_live (label deploy).
#
#   scripts/check_metrics_live.sh STRATA_BINARY [--require-all]
#
# --require-all also fails when a metric the catalogue assigns to the process is missing
# (check_metrics.js --process); without it the missing ones are listed as a note.
# Needs node, curl and promtool (scripts/install_deps.sh); installs deploy/tools when missing.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${1:?usage: check_metrics_live.sh STRATA_BINARY [--require-all]}"
REQUIRE_ALL=0
[ "${2:-}" = "--require-all" ] && REQUIRE_ALL=1
CHECK="$REPO/deploy/tools/check_metrics.js"
command -v node >/dev/null || { echo "check_metrics_live: node not found" >&2; exit 1; }
command -v curl >/dev/null || { echo "check_metrics_live: curl not found" >&2; exit 1; }
command -v promtool >/dev/null || { echo "check_metrics_live: promtool not found" >&2; exit 1; }
"$REPO/deploy/tools/install.sh" >&2

WORK="$(mktemp -d "${TMPDIR:-/tmp}/strata-metrics-live.XXXXXX")"
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

# start NAME ARGS...: runs `strata NAME ARGS --port-file ...` and waits for its ports.
start() {
  local name="$1"
  shift
  "$BIN" "$name" "$@" --port-file "$WORK/$name.ports" >"$WORK/$name.log" 2>&1 &
  pids+=("$!")
  local i
  for i in $(seq 1 300); do
    [ -s "$WORK/$name.ports" ] && return 0
    if ! kill -0 "${pids[-1]}" 2>/dev/null; then
      cat "$WORK/$name.log" >&2
      echo "check_metrics_live: strata $name exited" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "check_metrics_live: strata $name did not write its ports in 30 s" >&2
  return 1
}

fails=0
check() {  # NAME: scrape and check
  local name="$1" metrics_port
  metrics_port="$(cut -d' ' -f2 "$WORK/$name.ports")"
  curl -fsS "http://127.0.0.1:$metrics_port/metrics" >"$WORK/$name.txt" \
    || { echo "FAIL scraping strata $name" >&2; fails=$((fails + 1)); return; }
  if ! node "$CHECK" --catalog "$REPO/docs/metrics.md" --exposition "$WORK/$name.txt"; then
    fails=$((fails + 1))
    return
  fi
  if ! promtool check metrics <"$WORK/$name.txt" >"$WORK/$name.lint" 2>&1; then
    cat "$WORK/$name.lint" >&2
    echo "FAIL promtool check metrics on strata $name's scrape" >&2
    fails=$((fails + 1))
  fi
  if ! node "$CHECK" --catalog "$REPO/docs/metrics.md" --exposition "$WORK/$name.txt" \
       --process "$name" >"$WORK/$name.missing" 2>&1; then
    if [ "$REQUIRE_ALL" = 1 ]; then
      cat "$WORK/$name.missing" >&2
      fails=$((fails + 1))
    else
      echo "note: strata $name does not export yet:" \
        "$(grep -o 'strata_[a-z_]* (exported by' "$WORK/$name.missing" | cut -d' ' -f1 | paste -sd' ')"
    fi
  fi
}

start kvstore --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data "$WORK/kvstore-data"
start coordinator --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data "$WORK/coordinator-data"
start worker --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  --coordinator "127.0.0.1:$(cut -d' ' -f1 "$WORK/coordinator.ports")" \
  --kvstore "127.0.0.1:$(cut -d' ' -f1 "$WORK/kvstore.ports")" \
  --model "$REPO/tests/fixtures/golden/llama"
check kvstore
check coordinator
check worker
[ "$fails" -eq 0 ] || { echo "check_metrics_live: $fails scrape(s) do not match docs/metrics.md" >&2; exit 1; }
echo "check_metrics_live: kvstore, coordinator and worker scrapes match docs/metrics.md"
