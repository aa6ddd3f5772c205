#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# STRATA_GPU_ONLY_TARGETS="worker_gpu_test shard_rtt_bench": sharded decoding's per-layer exchange.
#   1. shard_rtt_bench (a peer that answers at once, 16 KiB each way on loopback): the gRPC
#      stream as the leader reads it (direct), a plain socket (tcp) and the selection link (link),
#      under each variant of STRATA_SHARDED_VARIANTS;
#   2. worker_gpu_test's sharded case on a document of STRATA_SHARDED_GPU_DOC_TOKENS (default
#      131072) tokens of the STRATA_SHARDED_GPU_PRESET (default llama-3.1-8b) shape over
#      STRATA_SHARDED_GPU_WORKERS (default 2) in-process workers on the one GPU, without the CPU
#      cluster: dense and tokenselect decode tokens/s over the selection links and over gRPC,
#      under each variant;
#   3. unless STRATA_SHARDED_SKIP_TESTS=1: worker_gpu_test with its defaults (CUDA workers against
#      CPU workers, the sharded case included).
# A variant is comma-joined VAR=value settings, "-" for the defaults (gpu_bundle_env.sh
# for_each_variant); default "- STRATA_SELECTION_LINK_SPIN_US=0"; a variant with
# STRATA_SHARDED_BASE=1 runs bin/base/worker_gpu_test (a baseline build bundled through
# STRATA_GPU_AB_BASE) in step 2; STRATA_SHARDED_SKIP_RTT=1 skips step 1. Logs in $OUT (else
# /tmp/strata-gpu-out).
# Usage: STRATA_GPU_BUNDLE=.gpu-s scripts/gpu_bench_sharded.sh
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
B="$BUNDLE/bin"
VARIANTS="${STRATA_SHARDED_VARIANTS:-- STRATA_SELECTION_LINK_SPIN_US=0}"
show_gpu
nproc

rtt() {
  local log=$1
  shift
  env "$@" timeout 120 "$B/shard_rtt_bench" --rounds 3000 --modes direct,tcp,link > "$log" 2>&1
  grep '^RTT' "$log"
}
sharded() {
  local log=$1 test="$B/worker_gpu_test" a
  shift
  for a in "$@"; do [ "$a" = STRATA_SHARDED_BASE=1 ] && test="$B/base/worker_gpu_test"; done
  sharded_test "$log" "$test" "$@"
  echo "rc=$? $(summary "$log")"
  grep -E '^(dense|tokenselect) ' "$log"
  grep -E 'selection stream \((link|grpc)\) answered' "$log" | sed 's/.*job //' | head -12
}
if [ "${STRATA_SHARDED_SKIP_RTT:-0}" != 1 ]; then
  echo "== transport alone"
  for_each_variant "$VARIANTS" rtt rtt
fi
echo "== sharded decode"
for_each_variant "$VARIANTS" sharded sharded

[ "${STRATA_SHARDED_SKIP_TESTS:-0}" = 1 ] && exit 0
echo "== worker_gpu_test (defaults)"
timeout 300 "$B/worker_gpu_test" > "$LOGS/worker_gpu_test.log" 2>&1
echo "worker_gpu_test rc=$? $(summary "$LOGS/worker_gpu_test.log")"
grep -E 'agree' "$LOGS/worker_gpu_test.log" | head -20
