#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a full bundle made by scripts/gpu_run.sh with
# STRATA_GPU_EXTRA_TARGETS="shard_answer_bench" (and, for the sharded A/B, a baseline
# worker_gpu_test through STRATA_GPU_AB_BASE): checks and times CudaBackend's small copies as
# kernels (STRATA_KERNEL_COPIES; kernels/cuda/internal/page_copy.h LaunchCopyBytes) and the
# leader's staged merge of external partials (engine/transformer.h MergeExternal).
#   1. the gpu-labelled tests whose code copies through CopyToDeviceAsync / CopyToHostAsync
#      (STRATA_COPIES_TESTS, default below), each time-boxed;
#   2. shard_answer_bench (tokenselect, 8B head shape, 64K shard) at --gap-us 0 and 200 with
#      STRATA_KERNEL_COPIES=0 and =1: the holder's answer alone;
# (STRATA_COPIES_SKIP_TESTS=1 and STRATA_COPIES_SKIP_ANSWER=1 skip steps 1 and 2)
#   3. scripts/gpu_bench_sharded.sh's sharded decode under STRATA_SHARDED_VARIANTS (default: the
#      baseline binary with copy-engine copies, the new binary with copy-engine copies, the new
#      binary with kernel copies), tokenselect and dense over the selection links.
# Usage: STRATA_GPU_BUNDLE=.gpu scripts/gpu_check_small_copies.sh
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
B="$BUNDLE/bin"
show_gpu
TESTS="${STRATA_COPIES_TESTS:-cuda_backend_test cuda_page_copy_test cuda_page_cache_test cuda_sampling_test decode_graph_test device_policy_gpu_test golden_gpu_test cuda_selection_test worker_gpu_test}"
if [ "${STRATA_COPIES_SKIP_TESTS:-0}" != 1 ]; then
  echo "== tests"
  for t in $TESTS; do
    timeout 300 "$B/$t" > "$LOGS/$t.log" 2>&1
    echo "$t rc=$? $(summary "$LOGS/$t.log")"
  done
  grep -E 'agree' "$LOGS/worker_gpu_test.log" | head -12
fi
if [ "${STRATA_COPIES_SKIP_ANSWER:-0}" != 1 ]; then
  echo "== shard_answer_bench (queue / wait means; answer p50 / p90)"
  for copies in 0 1; do
    for gap in 0 200; do
      printf 'kernel copies %s, gap %3s us: ' "$copies" "$gap"
      STRATA_KERNEL_COPIES=$copies timeout 120 "$B/shard_answer_bench" --tokens 65536 --layers 4 \
        --policy tokenselect --rounds 2000 --gap-us "$gap" 2>&1 | grep '^ANSWER'
    done
  done
fi
echo "== sharded decode"
STRATA_SHARDED_SKIP_RTT=1 STRATA_SHARDED_SKIP_TESTS=1 STRATA_SHARDED_GPU_GRPC=0 \
  STRATA_SHARDED_GPU_MAX_TOKENS="${STRATA_SHARDED_GPU_MAX_TOKENS:-32}" \
  STRATA_SHARDED_GPU_POLICIES="${STRATA_SHARDED_GPU_POLICIES:-tokenselect,dense}" \
  STRATA_SHARDED_VARIANTS="${STRATA_SHARDED_VARIANTS:-STRATA_SHARDED_BASE=1,STRATA_KERNEL_COPIES=0 STRATA_KERNEL_COPIES=0 -}" \
  "$ROOT/scripts/gpu_bench_sharded.sh"
