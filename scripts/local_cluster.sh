#!/usr/bin/env bash
# The Kubernetes-free path to the multi-process topology of deploy/ on one machine: runs
# `strata kvstore`, `strata coordinator` and N `strata worker`s (default 2) as separate processes
# on 127.0.0.1, each on free ports (port 0, read back from --port-file), with their data under DATA_DIR.
#
#   scripts/local_cluster.sh [start] DATA_DIR [--model DIR] [--binary PATH] [--threads N] [--workers N]
#                            [--target-shard-tokens N] [--default-prefill-mode anchor|exact]
#                            [--scrape-interval 5s] [--drain-timeout-seconds N] [--worker-arg ARG]... [--gpus N]
#   scripts/local_cluster.sh stop DATA_DIR
#
# start (the default) runs in the foreground until Ctrl-C / SIGTERM (or `stop`), then stops the
# workers, the coordinator and the kvstore with SIGTERM (each drains) and waits for them. When a
# process exits by itself the rest are stopped too and the script fails. Without --model it makes a
# tiny random model (`strata make-model --preset tiny`) in DATA_DIR/model once.
# The strata binary: --binary, else $STRATA, else `strata` on PATH, else build/bin/strata.
#
# --target-shard-tokens and --default-prefill-mode are passed to the coordinator (a small shard
# size spreads a document over several workers; docs/api.md, "Sharded documents"); each
# --worker-arg to every worker, one argument each (e.g. --worker-arg --selection-link-listen
# --worker-arg off). --gpus N gives worker w the GPU w % N alone (CUDA_VISIBLE_DEVICES), as on
# machines with one GPU per worker; without it every worker sees every GPU and uses the first.
#
# Once every process serves (the kvstore and coordinator have written their ports, every worker
# has registered with the coordinator, every /metrics answers), it writes and prints:
#   DATA_DIR/endpoints.env   shell-sourceable COORDINATOR=127.0.0.1:P, COORDINATOR_METRICS=...,
#                            KVSTORE=..., KVSTORE_METRICS=..., WORKER0=..., WORKER0_METRICS=...,
#                            WORKER1=..., WORKER1_METRICS=..., (one pair per worker), MODEL=DIR
#   DATA_DIR/prometheus.yml  a Prometheus configuration scraping the four /metrics endpoints every
#                            --scrape-interval (labels component=coordinator|worker|kvstore, as in
#                            deploy/prometheus/prometheus.yml) and loading deploy/prometheus/rules/
# DATA_DIR/cluster.pid holds the script's pid (what `stop` signals), DATA_DIR/pids "NAME PID" of
# each process while it runs (each runs in its own session: if the script itself is killed with
# SIGKILL, stop them from that list); logs are DATA_DIR/*.log.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
usage() {
  sed -n '6,9p' "$0" | sed 's/^# *//' >&2
  exit 2
}

verb=start
case "${1:-}" in
  start | stop) verb="$1"; shift ;;
  "" | -h | --help) usage ;;
esac
DATA="${1:-}"
[ -n "$DATA" ] || usage
shift

if [ "$verb" = stop ]; then
  [ -f "$DATA/cluster.pid" ] || { echo "local_cluster: no $DATA/cluster.pid" >&2; exit 1; }
  pid="$(cat "$DATA/cluster.pid")"
  kill -0 "$pid" 2>/dev/null || { echo "local_cluster: pid $pid is not running" >&2; rm -f "$DATA/cluster.pid"; exit 1; }
  kill -TERM "$pid"
  for _ in $(seq 1 600); do
    kill -0 "$pid" 2>/dev/null || { echo "local_cluster: stopped"; exit 0; }
    sleep 0.1
  done
  echo "local_cluster: pid $pid still running after 60 s" >&2
  exit 1
fi

MODEL=""
BIN="${STRATA:-}"
THREADS=1
SCRAPE_INTERVAL=5s
DRAIN=10
WORKERS=2
COORDINATOR_EXTRA=()
WORKER_EXTRA=()
GPUS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --binary) BIN="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --scrape-interval) SCRAPE_INTERVAL="$2"; shift 2 ;;
    --drain-timeout-seconds) DRAIN="$2"; shift 2 ;;
    --workers) WORKERS="$2"; shift 2 ;;
    --target-shard-tokens | --default-prefill-mode) COORDINATOR_EXTRA+=("$1" "$2"); shift 2 ;;
    --worker-arg) WORKER_EXTRA+=("$2"); shift 2 ;;
    --gpus) GPUS="$2"; shift 2 ;;
    *) echo "local_cluster: unknown argument $1" >&2; usage ;;
  esac
done
if [ -z "$BIN" ]; then
  if command -v strata >/dev/null; then BIN="$(command -v strata)"; else BIN="$REPO/build/bin/strata"; fi
fi
[ -x "$BIN" ] || { echo "local_cluster: strata binary $BIN not found (--binary PATH)" >&2; exit 1; }
command -v curl >/dev/null || { echo "local_cluster: curl not found" >&2; exit 1; }
[[ "$WORKERS" =~ ^[1-9][0-9]?$ ]] || { echo "local_cluster: --workers must be 1..99" >&2; exit 2; }
[[ "$GPUS" =~ ^[0-9]+$ ]] || { echo "local_cluster: --gpus must be a count" >&2; exit 2; }

mkdir -p "$DATA"
DATA="$(cd "$DATA" && pwd)"
if [ -f "$DATA/cluster.pid" ] && kill -0 "$(cat "$DATA/cluster.pid")" 2>/dev/null; then
  echo "local_cluster: already running in $DATA (pid $(cat "$DATA/cluster.pid"))" >&2
  exit 1
fi
echo $$ >"$DATA/cluster.pid"
rm -f "$DATA"/*.ports "$DATA/endpoints.env" "$DATA/pids"

names=()
pids=()
stopping=0
stop_all() {
  stopping=1
  local i rc
  # The workers first (together: they drain and deregister), then the coordinator, then the kvstore.
  for i in "${!pids[@]}"; do
    [[ "${names[$i]}" == worker* ]] && kill -TERM "${pids[$i]}" 2>/dev/null || true
  done
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    # Exactly one SIGTERM each: a second one during a drain kills the process (exit 143).
    [[ "${names[$i]}" == worker* ]] || kill -TERM "${pids[$i]}" 2>/dev/null || true
    rc=0
    wait "${pids[$i]}" 2>/dev/null || rc=$?
    echo "local_cluster: ${names[$i]} (pid ${pids[$i]}) exited $rc" >&2
  done
  pids=()
  rm -f "$DATA/cluster.pid" "$DATA/pids"
}
on_signal() {
  echo "local_cluster: stopping" >&2
  stop_all
  exit 0
}
trap on_signal INT TERM
trap 'stop_all' EXIT

fail() {
  echo "local_cluster: $*" >&2
  exit 1
}

# start NAME SUBCOMMAND ARGS...: runs `strata SUBCOMMAND ARGS --port-file DATA/NAME.ports`, waits for
# the port file.
start() {
  local name="$1" sub="$2"
  shift 2
  # Own session: a Ctrl-C on the terminal reaches only this script, which then sends each process
  # exactly one SIGTERM, in order (a second stop signal during a drain is not waited for).
  setsid "$BIN" "$sub" "$@" --port-file "$DATA/$name.ports" >"$DATA/$name.log" 2>&1 &
  pids+=("$!")
  names+=("$name")
  echo "$name ${pids[-1]}" >>"$DATA/pids"
  local i
  for i in $(seq 1 600); do
    [ -s "$DATA/$name.ports" ] && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || { tail -20 "$DATA/$name.log" >&2; fail "strata $sub ($name) exited"; }
    sleep 0.1
  done
  fail "strata $sub ($name) did not write its ports in 60 s (log: $DATA/$name.log)"
}
grpc_port() { cut -d' ' -f1 "$DATA/$1.ports"; }
metrics_port() { cut -d' ' -f2 "$DATA/$1.ports"; }

if [ -z "$MODEL" ]; then
  MODEL="$DATA/model"
  if [ ! -f "$MODEL/config.json" ]; then
    "$BIN" make-model --preset tiny --out "$MODEL" >"$DATA/make-model.log" 2>&1 \
      || { cat "$DATA/make-model.log" >&2; fail "strata make-model failed"; }
  fi
fi
MODEL="$(cd "$MODEL" && pwd)"

start kvstore kvstore --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data "$DATA/kvstore"
start coordinator coordinator --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data "$DATA/coordinator" \
  --model "$MODEL" --drain-timeout-seconds "$DRAIN" ${COORDINATOR_EXTRA[@]+"${COORDINATOR_EXTRA[@]}"}
WORKER_IDS=$(seq 0 $((WORKERS - 1)))
for w in $WORKER_IDS; do
  if [ "$GPUS" -gt 0 ]; then export CUDA_VISIBLE_DEVICES=$((w % GPUS)); fi
  start "worker$w" worker --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --worker-id "local-worker-$w" \
    --coordinator "127.0.0.1:$(grpc_port coordinator)" --kvstore "127.0.0.1:$(grpc_port kvstore)" \
    --model "$MODEL" --threads "$THREADS" --drain-timeout-seconds "$DRAIN" ${WORKER_EXTRA[@]+"${WORKER_EXTRA[@]}"}
done

if [ "$GPUS" -gt 0 ]; then unset CUDA_VISIBLE_DEVICES; fi
# Health: every worker registered, every /metrics endpoint answers.
for w in $WORKER_IDS; do
  for i in $(seq 1 300); do
    grep -q "registered with" "$DATA/worker$w.log" && break
    [ "$i" = 300 ] && fail "worker$w did not register with the coordinator in 30 s (log: $DATA/worker$w.log)"
    sleep 0.1
  done
done
for name in kvstore coordinator $(for w in $WORKER_IDS; do echo "worker$w"; done); do
  curl -fsS -o /dev/null "http://127.0.0.1:$(metrics_port "$name")/metrics" || fail "/metrics of $name does not answer"
done

{
  echo "COORDINATOR=127.0.0.1:$(grpc_port coordinator)"
  echo "COORDINATOR_METRICS=127.0.0.1:$(metrics_port coordinator)"
  echo "KVSTORE=127.0.0.1:$(grpc_port kvstore)"
  echo "KVSTORE_METRICS=127.0.0.1:$(metrics_port kvstore)"
  for w in $WORKER_IDS; do
    echo "WORKER$w=127.0.0.1:$(grpc_port "worker$w")"
    echo "WORKER${w}_METRICS=127.0.0.1:$(metrics_port "worker$w")"
  done
  echo "MODEL=$MODEL"
} >"$DATA/endpoints.env.tmp"
cat >"$DATA/prometheus.yml" <<EOF
# Written by scripts/local_cluster.sh for the cluster in $DATA.
global:
  scrape_interval: $SCRAPE_INTERVAL
  evaluation_interval: $SCRAPE_INTERVAL
  external_labels:
    deployment: strata-local
rule_files:
  - $REPO/deploy/prometheus/rules/strata-recording.yml
  - $REPO/deploy/prometheus/rules/strata-alerts.yml
scrape_configs:
  - job_name: strata-coordinator
    static_configs:
      - targets: ["127.0.0.1:$(metrics_port coordinator)"]
        labels: {component: coordinator}
  - job_name: strata-worker
    static_configs:
      - targets: [$(for w in $WORKER_IDS; do printf '%s"127.0.0.1:%s"' "$([ "$w" = 0 ] || echo ', ')" "$(metrics_port "worker$w")"; done)]
        labels: {component: worker}
  - job_name: strata-kvstore
    static_configs:
      - targets: ["127.0.0.1:$(metrics_port kvstore)"]
        labels: {component: kvstore}
EOF
mv "$DATA/endpoints.env.tmp" "$DATA/endpoints.env"
echo "local_cluster: serving (pid $$; stop with Ctrl-C or: $0 stop $DATA)"
sed 's/^/  /' "$DATA/endpoints.env"
echo "  client:     $BIN ask --server 127.0.0.1:$(grpc_port coordinator) --doc FILE \"question\""
echo "  prometheus: prometheus --config.file=$DATA/prometheus.yml --storage.tsdb.path=$DATA/prometheus"

# Run until a signal; a process that exits by itself stops the rest.
while true; do
  sleep 1 &
  wait $! || true
  for i in "${!pids[@]}"; do
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      [ "$stopping" = 1 ] && exit 0
      tail -20 "$DATA/${names[$i]}.log" >&2
      fail "${names[$i]} exited (log: $DATA/${names[$i]}.log); stopping the others"
    fi
  done
done
