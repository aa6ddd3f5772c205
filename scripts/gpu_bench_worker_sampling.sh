#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# lazy_mount_bench and decode_batch_bench among STRATA_GPU_EXTRA_TARGETS: the worker's decode rate
# with its tokens drawn on the backend (WorkerOptions::device_sampling) and on the host, greedy and
# at temperature > 0, for a lone job (lazy_mount_bench, resident mode: the device-managed page
# cache and decode graph) and for concurrent jobs (decode_batch_bench: batched steps).
# Log: $OUT/worker_sampling.log (or $LOGS/... as scripts/gpu_remote.sh's STRATA_GPU_AFTER).
#
# Usage: scripts/gpu_bench_worker_sampling.sh
# Env: STRATA_GPU_BUNDLE (default .gpu); STRATA_SAMPLING_PRESETS (default
#      "llama-3.2-1b llama-3.1-8b"); STRATA_SAMPLING_TEMPERATURES (default "0.8");
#      STRATA_SAMPLING_BATCH_PRESET (decode_batch_bench's model, default llama-3.2-1b).
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
log="$LOGS/worker_sampling.log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$log"
rc=0
for preset in ${STRATA_SAMPLING_PRESETS:-llama-3.2-1b llama-3.1-8b}; do
  for t in ${STRATA_SAMPLING_TEMPERATURES:-0.8}; do
    for ds in 1 0; do
      flags="--preset $preset --doc 32768 --shard 32768 --kv-page-dtype fp8 --modes resident --reps 3"
      flags+=" --tokens 128 --dir /dev/shm --host-gib 4 --device-sampling $ds --temperature $t --top-p 0.9"
      echo "== lazy_mount_bench --backend cuda $flags" | tee -a "$log"
      # shellcheck disable=SC2086
      "$BUNDLE/bin/lazy_mount_bench" --backend cuda $flags 2>&1 | grep -E "^[^IW]" | tee -a "$log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    done
  done
done
batch_preset="${STRATA_SAMPLING_BATCH_PRESET:-llama-3.2-1b}"
for t in 0 ${STRATA_SAMPLING_TEMPERATURES:-0.8}; do
  flags="--backend cuda --preset $batch_preset --jobs 8 --tokens 64 --doc 1024 --device-sampling 1,0"
  flags+=" --temperature $t --top-p 0.9"
  echo "== decode_batch_bench $flags" | tee -a "$log"
  # shellcheck disable=SC2086
  "$BUNDLE/bin/decode_batch_bench" $flags 2>&1 | grep -E "^[^IW]" | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
exit "$rc"
