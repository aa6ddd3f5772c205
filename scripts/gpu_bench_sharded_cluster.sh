#!/usr/bin/env bash
# Sharded decoding with every process on its own, as deployed: scripts/local_cluster.sh runs the
# kvstore, the coordinator and STRATA_CLUSTER_WORKERS (default 2) `strata worker`s on loopback,
# once with the workers' selection links (the default) and once without (`--selection-link-listen
# off`: the leader's per-layer queries go over the gRPC ShardSelection stream), each in a data
# directory of its own where the document is uploaded and prefilled anew, so that both runs start
# from a fresh placement. Each run asks `strata ask` the same question per policy
# (STRATA_CLUSTER_POLICIES, default "tokenselect dense") twice (the first mounts the peers'
# shards) and prints, per ask, the leader's decode rate from the workers' /metrics (the
# inter-token latency histogram's sum and count over the ask), the shard attention's seconds per
# layer (local, peers), the holders' answer seconds per answer (queue, wait, send) and their
# selection streams by transport.
#
# Runs ON the GPU machine over a bundle with the `strata` binary (scripts/gpu_run.sh --with-cli,
# STRATA_GPU_ONLY_TARGETS="strata"), or here on the CPU with STRATA=build/bin/strata (use a small
# STRATA_CLUSTER_PRESET and STRATA_CLUSTER_ENTRIES there).
# Env: STRATA_CLUSTER_PRESET (default llama-3.1-8b), STRATA_CLUSTER_ENTRIES (sample document
# entries, default 3000: about 128K tokens with the 8B tokenizer), STRATA_CLUSTER_MAX_TOKENS
# (default 32; bf16 weights, bf16 pages), STRATA_CLUSTER_SHARD_TOKENS (the coordinator's target shard size, default 65536),
# STRATA_CLUSTER_GPUS (one GPU per worker: local_cluster.sh --gpus; default 0: all on the first),
# STRATA_CLUSTER_TRANSPORTS (default "link grpc"; "link" alone halves the call: each transport
# uploads and prefills the document anew), STRATA_CLUSTER_DIR (default /tmp/strata-cluster; wiped
# first). Logs in $OUT (else
# /tmp/strata-gpu-out).
# Usage: STRATA_GPU_BUNDLE=.gpu-s scripts/gpu_bench_sharded_cluster.sh
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
if [ -z "${STRATA:-}" ]; then
  # shellcheck source=scripts/gpu_bundle_env.sh
  source "$REPO/scripts/gpu_bundle_env.sh"
  STRATA="$BUNDLE/bin/strata"
fi
LOGS="${LOGS:-${OUT:-/tmp/strata-gpu-out}}"
mkdir -p "$LOGS"
PRESET="${STRATA_CLUSTER_PRESET:-llama-3.1-8b}"
ENTRIES="${STRATA_CLUSTER_ENTRIES:-3000}"
MAX_TOKENS="${STRATA_CLUSTER_MAX_TOKENS:-32}"
WORKERS="${STRATA_CLUSTER_WORKERS:-2}"
POLICIES="${STRATA_CLUSTER_POLICIES:-tokenselect dense}"
TRANSPORTS="${STRATA_CLUSTER_TRANSPORTS:-link grpc}"
SHARD_TOKENS="${STRATA_CLUSTER_SHARD_TOKENS:-65536}"
GPUS="${STRATA_CLUSTER_GPUS:-0}"
DIR="${STRATA_CLUSTER_DIR:-/tmp/strata-cluster}"
rm -rf "$DIR" && mkdir -p "$DIR"

start=$(date +%s)
"$STRATA" make-model --preset "$PRESET" --dtype bf16 --out "$DIR/model" > "$LOGS/make-model.log" 2>&1 \
  || { tail -5 "$LOGS/make-model.log"; exit 1; }
python3 "$REPO/scripts/make_sample_document.py" "$DIR/doc.txt" --entries "$ENTRIES" > /dev/null
echo "model $PRESET and document ($(wc -c < "$DIR/doc.txt") bytes) made in $(( $(date +%s) - start )) s"

# The series below, each summed over every worker's /metrics (one scrape per worker), on one line.
SERIES=(strata_inter_token_latency_seconds_sum strata_inter_token_latency_seconds_count
  strata_shard_attention_layers_total 'strata_shard_attention_seconds_total{part="local"}'
  'strata_shard_attention_seconds_total{part="peers"}' strata_shard_answers_total
  'strata_shard_answer_seconds_total{part="queue"}' 'strata_shard_answer_seconds_total{part="wait"}'
  'strata_shard_answer_seconds_total{part="send"}' 'strata_shard_selection_streams_total{transport="link"}'
  'strata_shard_selection_streams_total{transport="grpc"}')
snapshot() {
  local w port
  for w in $(seq 0 $((WORKERS - 1))); do
    port="WORKER${w}_METRICS"
    curl -fsS "http://${!port}/metrics" 2>/dev/null
  done | awk -v series="${SERIES[*]}" '
    BEGIN { n = split(series, names, " ") }
    { for (i = 1; i <= n; i++) if (index($0, names[i] " ") == 1) sum[i] += $NF }
    END { for (i = 1; i <= n; i++) printf "%s ", sum[i] + 0 }'
}
# Prints the rates of an ask from the snapshots before ($1) and after ($2) it.
report() {
  awk -v a="$1" -v b="$2" -v label="$3" 'BEGIN {
    n = split(a, x, " "); split(b, y, " ");
    for (i = 1; i <= n; i++) d[i] = y[i] - x[i];
    tps = d[2] > 0 ? d[2] / d[1] : 0;
    lay = d[3] > 0 ? 1e6 / d[3] : 0; ans = d[6] > 0 ? 1e6 / d[6] : 0;
    printf "%-34s decode %6.1f tok/s | per layer: local %6.1f us, peers %6.1f us | per answer: queue %5.1f, wait %6.1f, send %5.1f us | streams link %d grpc %d\n",
      label, tps, d[4] * lay, d[5] * lay, d[7] * ans, d[8] * ans, d[9] * ans, d[10], d[11];
  }'
}

for transport in $TRANSPORTS; do
  case "$transport" in link|grpc) ;; *) echo "STRATA_CLUSTER_TRANSPORTS: link or grpc, not $transport"; exit 2 ;; esac
  args=()
  [ "$transport" = grpc ] && args=(--worker-arg --selection-link-listen --worker-arg off)
  data="$DIR/data-$transport"
  "$REPO/scripts/local_cluster.sh" start "$data" --model "$DIR/model" --binary "$STRATA" \
    --workers "$WORKERS" --target-shard-tokens "$SHARD_TOKENS" --gpus "$GPUS" --default-prefill-mode exact ${args[@]+"${args[@]}"} > "$LOGS/cluster_$transport.log" 2>&1 &
  cluster=$!
  for _ in $(seq 1 1200); do
    [ -f "$data/endpoints.env" ] && break
    kill -0 "$cluster" 2>/dev/null || break
    sleep 0.5
  done
  if [ ! -f "$data/endpoints.env" ]; then
    echo "cluster ($transport) did not start"; tail -20 "$LOGS/cluster_$transport.log"; exit 1
  fi
  # shellcheck disable=SC1091
  source "$data/endpoints.env"
  grep -h "selection_link=" "$data"/worker*.log | sed 's/.*worker /worker /; s/ metrics_port.*//'
  for policy in $POLICIES; do
    for run in 1 2; do
      before=$(snapshot)
      t0=$(date +%s.%N)
      "$STRATA" ask --server "$COORDINATOR" --doc "$DIR/doc.txt" --policy "$policy" --max-tokens "$MAX_TOKENS" \
        --ignore-eos --print-token-ids --stream-timeout-seconds 900 "What is the vault code?" \
        > "$LOGS/ask_${transport}_${policy}_$run.out" 2> "$LOGS/ask_${transport}_${policy}_$run.err"
      rc=$?
      t1=$(date +%s.%N)
      grep -h "^document" "$LOGS/ask_${transport}_${policy}_$run.err" | head -1
      sleep 1  # the holders count a stream's answers when it ends, just after the job
      report "$before" "$(snapshot)" "$transport $policy run $run (rc $rc, $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s)"
      grep -h "output_token_ids" "$LOGS/ask_${transport}_${policy}_$run.err" | cut -c1-120
    done
  done
  "$REPO/scripts/local_cluster.sh" stop "$data" > /dev/null 2>&1
  wait "$cluster"
  cp "$data"/*.log "$LOGS/" 2>/dev/null
  for f in "$data"/worker*.log; do mv "$LOGS/$(basename "$f")" "$LOGS/${transport}_$(basename "$f")"; done
  rm -rf "$data"  # the document's pages: room for the next run's
done
echo "done in $(( $(date +%s) - start )) s"
