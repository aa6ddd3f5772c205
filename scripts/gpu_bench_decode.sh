#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# decode_e2e_bench among STRATA_GPU_EXTRA_TARGETS: end-to-end decode of a document whose KV lives
# in the pinned host tier, through the GPU page cache (bench/decode_e2e_bench.cc; see its file
# comment), once per hook and cache fraction. Log: $OUT/decode.log (or $LOGS/decode.log when run
# as scripts/gpu_remote.sh's STRATA_GPU_AFTER).
#
# Usage: scripts/gpu_bench_decode.sh [extra decode_e2e_bench flags]
# Env: STRATA_GPU_BUNDLE (default .gpu), STRATA_DECODE_SHAPES (default llama-3.1-8b,llama-3.2-1b),
#      STRATA_DECODE_CONTEXTS (default 524288), STRATA_DECODE_HOOKS (default
#      device,managed,managed-graph), STRATA_DECODE_FRACTIONS (GPU cache fractions, one run each,
#      default 0.05).
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
  | tee -a "$LOGS/decode.log"
rc=0
for fraction in ${STRATA_DECODE_FRACTIONS:-0.05}; do
  echo "== cache_fraction $fraction" | tee -a "$LOGS/decode.log"
  "$BUNDLE/bin/decode_e2e_bench" --shapes="${STRATA_DECODE_SHAPES:-llama-3.1-8b,llama-3.2-1b}" \
    --contexts="${STRATA_DECODE_CONTEXTS:-524288}" --host_chooser_max_context=0 \
    --hooks="${STRATA_DECODE_HOOKS:-device,managed,managed-graph}" --hold_source_pages=1 \
    --cache_fraction="$fraction" "$@" 2>&1 | tee -a "$LOGS/decode.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
exit "$rc"
