#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# decode_e2e_bench among STRATA_GPU_EXTRA_TARGETS: the whole-model prefill timing of
# bench/decode_e2e_bench.cc (random bf16 weights, N random tokens from position 0, one timed
# Transformer::Forward; see its file comment). Log: $OUT/prefill.log.
#
# Usage: scripts/gpu_bench_prefill.sh [extra decode_e2e_bench flags]
# Env: STRATA_GPU_BUNDLE (default .gpu), STRATA_PREFILL_SHAPE (default llama-3.1-8b),
#      STRATA_PREFILL_CONTEXTS (default 524288), STRATA_PREFILL_POLICY (default tokenselect),
#      STRATA_PREFILL_PRECISION (default bf16,split).
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
  | tee "$LOGS/prefill.log"
"$BUNDLE/bin/decode_e2e_bench" --shapes="${STRATA_PREFILL_SHAPE:-llama-3.1-8b}" \
  --no_document_pass=2 --contexts=32768 --tokens=1 --warmup=0 \
  --prefill_contexts="${STRATA_PREFILL_CONTEXTS:-524288}" \
  --prefill_policy="${STRATA_PREFILL_POLICY:-tokenselect}" \
  --matmul_precision="${STRATA_PREFILL_PRECISION:-bf16,split}" "$@" 2>&1 | tee -a "$LOGS/prefill.log"
exit "${PIPESTATUS[0]}"
