#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle holding decode_graph_test,
# worker_gpu_test, decode_batch_bench and lazy_mount_bench (scripts/gpu_run.sh with those among
# STRATA_GPU_EXTRA_TARGETS, or a smaller bundle named by STRATA_GPU_BUNDLE): the batched decode
# steps replayed as one graph (Transformer::ForwardBatch with decode_graph) checked against the
# normal path, then concurrent jobs' decode rate with batched graphs on and off
# (STRATA_DECODE_GRAPH_BATCH=1|0), and a lone job's rate (graph steps of one row, for comparison
# with earlier runs). Log: $OUT/batch_graph.log (or $LOGS/...).
#
# Usage: scripts/gpu_check_batch_graph.sh
# Env: STRATA_BATCH_PRESETS (default "llama-3.2-1b llama-3.1-8b"), STRATA_BATCH_JOBS (default 8),
#      STRATA_BATCH_SKIP_TESTS=1 (benchmarks only).
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
log="$LOGS/batch_graph.log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$log"
rc=0
if [ "${STRATA_BATCH_SKIP_TESTS:-0}" != 1 ]; then
  for t in decode_graph_test worker_gpu_test; do
    echo "== $t" | tee -a "$log"
    "$BUNDLE/bin/$t" > "$LOGS/$t.log" 2>&1 || rc=1
    grep -E '^\[  (PASSED|FAILED)  \]|^\[       OK|^\[  FAILED|batched graph|max_decode_batch|Failure' \
      "$LOGS/$t.log" | tee -a "$log"
  done
fi
for preset in ${STRATA_BATCH_PRESETS:-llama-3.2-1b llama-3.1-8b}; do
  tokens=64
  [ "$preset" = llama-3.1-8b ] && tokens=32
  for g in 1 0; do
    flags="--backend cuda --preset $preset --jobs ${STRATA_BATCH_JOBS:-8} --tokens $tokens --doc 1024"
    flags+=" --device-sampling 1 --batch-wait-us 1000"
    echo "== STRATA_DECODE_GRAPH_BATCH=$g decode_batch_bench $flags" | tee -a "$log"
    # shellcheck disable=SC2086
    STRATA_DECODE_GRAPH_BATCH=$g "$BUNDLE/bin/decode_batch_bench" $flags 2>&1 | grep -E "^[^IW]" | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
done
exit "$rc"
