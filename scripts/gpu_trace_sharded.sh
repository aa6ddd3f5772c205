#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# STRATA_GPU_ONLY_TARGETS="worker_gpu_test shard_answer_bench strata_kernel_trace": where a sharded
# decode step's time goes, on the leader and on the shard's holder, from kernel traces with the
# runtime API calls (bench/kernel_trace.cc, STRATA_KERNEL_TRACE_API=1; an API record's stream
# column is its thread).
#   1. shard_answer_bench (tokenselect, 8B head shape, 64K shard) at --gap-us 0 and 200, then
#      traced at 200: the holder's host part of an answer (queue) alone;
#   2. worker_gpu_test's sharded case (STRATA_SHARDED_GPU_* as gpu_bench_sharded.sh: 8B shape,
#      128K document, two in-process workers, tokenselect over the selection links), untraced and
#      traced.
# Prints trace_tail.py's table of each trace's last part and leaves those parts in
# $LOGS/answer_tail.tsv.xz and $LOGS/sharded_tail.tsv.xz.
# Usage: STRATA_GPU_BUNDLE=.gpu-s scripts/gpu_trace_sharded.sh
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
B="$BUNDLE/bin"
TMP="$(mktemp -d)"
show_gpu
traced() {  # traced TRACE COMMAND...
  local trace=$1
  shift
  (
    export CUDA_INJECTION64_PATH="$B/libstrata_kernel_trace.so" STRATA_KERNEL_TRACE_OUT="$trace" \
      STRATA_KERNEL_TRACE_API=1
    "$@"
  )
}
answer() {
  timeout 120 "$B/shard_answer_bench" --tokens 65536 --layers 4 --policy tokenselect --rounds 600 "$@" 2>&1 |
    grep -v '^I' | tail -n 4
}
echo "== shard_answer_bench, gap 0 / 200 us, then traced at 200"
answer --gap-us 0
answer --gap-us 200
traced "$TMP/answer.tsv" answer --gap-us 200
python3 "$ROOT/scripts/trace_tail.py" "$TMP/answer.tsv" --ms 60 --out "$LOGS/answer_tail.tsv" --top 30
xz -T4 -f "$LOGS/answer_tail.tsv"

sharded() {
  sharded_test "$TMP/sharded.log" "$B/worker_gpu_test" \
    STRATA_SHARDED_GPU_MAX_TOKENS="${STRATA_SHARDED_GPU_MAX_TOKENS:-32}" \
    STRATA_SHARDED_GPU_POLICIES="${STRATA_SHARDED_GPU_POLICIES:-tokenselect}" STRATA_SHARDED_GPU_GRPC=0
  echo "rc=$? $(summary "$TMP/sharded.log")"
  grep -E '^(dense|tokenselect) |answers|layer queries|kernel_trace' "$TMP/sharded.log" | cut -c1-400
}
echo "== sharded decode, untraced"
sharded
echo "== sharded decode, traced"
traced "$TMP/sharded.tsv" sharded
python3 "$ROOT/scripts/trace_tail.py" "$TMP/sharded.tsv" --ms "${STRATA_TRACE_TAIL_MS:-300}" \
  --out "$LOGS/sharded_tail.tsv" --top 60
xz -T4 -f "$LOGS/sharded_tail.tsv"
ls -la "$LOGS"
