#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle holding cuda_backend_test,
# decode_graph_test, worker_gpu_test and decode_batch_bench (scripts/gpu_run.sh with those among
# STRATA_GPU_EXTRA_TARGETS, or a smaller bundle named by STRATA_GPU_BUNDLE): batched decode
# steps (Transformer::ForwardBatch replayed as one graph under decode_graph; the GEMVs of 2..8
# tokens on tensor cores) checked against the CPU and the normal path, then concurrent jobs'
# decode rate under each A/B setting. Log: $OUT/batch_graph.log (or $LOGS/...).
#
# Usage: scripts/gpu_check_batch_graph.sh
# Env: STRATA_BATCH_PRESETS (default "llama-3.2-1b llama-3.1-8b"), STRATA_BATCH_JOBS (default 8),
#      STRATA_BATCH_TOKENS (tokens per job; default 64 for 1B, 32 for 8B),
#      STRATA_BATCH_AB (space-separated settings, each VAR=VALUE[,VAR=VALUE...], one run each;
#      default "STRATA_DECODE_GRAPH_BATCH=1 STRATA_DECODE_GRAPH_BATCH=0"),
#      STRATA_BATCH_SKIP_TESTS=1 (benchmarks only), STRATA_BATCH_FLAGS (more decode_batch_bench
#      flags, e.g. "--weight-format fp8" for fp8 projections: the 2-16 token GemvFp8Kernel).
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
log="$LOGS/batch_graph.log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$log"
rc=0
if [ "${STRATA_BATCH_SKIP_TESTS:-0}" != 1 ]; then
  for t in "cuda_backend_test --gtest_filter=*MatMul*" decode_graph_test worker_gpu_test; do
    echo "== $t" | tee -a "$log"
    name="${t%% *}"
    # shellcheck disable=SC2086
    "$BUNDLE/bin/$name" ${t#"$name"} > "$LOGS/$name.log" 2>&1 || rc=1
    grep -E '^\[  (PASSED|FAILED)  \]|^\[  FAILED|batched graph|max_decode_batch|Failure' \
      "$LOGS/$name.log" | head -40 | tee -a "$log"
  done
fi
for preset in ${STRATA_BATCH_PRESETS:-llama-3.2-1b llama-3.1-8b}; do
  tokens=64
  [ "$preset" = llama-3.1-8b ] && tokens=32
  tokens="${STRATA_BATCH_TOKENS:-$tokens}"
  for setting in ${STRATA_BATCH_AB:-STRATA_DECODE_GRAPH_BATCH=1 STRATA_DECODE_GRAPH_BATCH=0}; do
    flags="--backend cuda --preset $preset --jobs ${STRATA_BATCH_JOBS:-8} --tokens $tokens --doc 1024"
    flags+=" --device-sampling 1 --batch-wait-us 1000 ${STRATA_BATCH_FLAGS:-}"
    echo "== ${setting//,/ } decode_batch_bench $flags" | tee -a "$log"
    # shellcheck disable=SC2086,SC2046
    env ${setting//,/ } "$BUNDLE/bin/decode_batch_bench" $flags 2>&1 | grep -E "^[^IW]" | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
done
exit "$rc"
