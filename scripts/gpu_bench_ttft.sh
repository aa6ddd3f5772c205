#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# lazy_mount_bench among STRATA_GPU_EXTRA_TARGETS: time to first token of questions on a persisted
# document (worker/lazy_mount_bench.cc; see its file comment), the worker on the CUDA backend,
# once per configuration. Log: $OUT/ttft.log (or $LOGS/ttft.log as scripts/gpu_remote.sh's
# STRATA_GPU_AFTER).
#
# Usage: scripts/gpu_bench_ttft.sh
# Env: STRATA_GPU_BUNDLE (default .gpu); STRATA_TTFT_RUNS: runs separated by ';', each the
#      lazy_mount_bench flags after "--backend cuda" (default: the 8B shape at 32K, resident and
#      host-managed, 32 tokens per question, decode graph on).
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
  | tee -a "$LOGS/ttft.log"
runs="${STRATA_TTFT_RUNS:---preset llama-3.1-8b --doc 32768 --shard 4096 --reps 2 --tokens 32 --modes resident,lazy-dev --decode-graph on}"
rc=0
IFS=';' read -ra list <<< "$runs"
for flags in "${list[@]}"; do
  echo "== lazy_mount_bench --backend cuda $flags" | tee -a "$LOGS/ttft.log"
  # shellcheck disable=SC2086
  "$BUNDLE/bin/lazy_mount_bench" --backend cuda $flags 2>&1 \
    | grep -E "^[^IW]|first token after|prefilled|device-managed page cache|device-managed cache for" | tee -a "$LOGS/ttft.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
exit "$rc"
