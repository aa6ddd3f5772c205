#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# cuda_backend_test and cuda_gemv_weight_bench among its targets: an A/B of the one-token GEMVs by
# environment switches in one call. For each variant (a comma list of VAR=V, or "-" for none) it
# runs the fp8 and MatMul cases of cuda_backend_test (the CUDA GEMVs against the CPU backend) and
# then cuda_gemv_weight_bench, and prints the tests' summary and the bench's table rows tagged
# with the variant. Logs: $OUT/gemv_<variant index>_{test,bench}.log.
#
# Usage: scripts/gpu_ab_gemv.sh [bench reps, default 30]
# Env: STRATA_GPU_BUNDLE (default .gpu), STRATA_AB_VARIANTS (space-separated, default "-"),
#      STRATA_AB_TEST_FILTER (gtest filter, default '*Fp8*:*MatMul*'; "-" skips the tests).
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
reps="${1:-30}"
read -r -a variants <<< "${STRATA_AB_VARIANTS:--}"
filter="${STRATA_AB_TEST_FILTER:-*Fp8*:*MatMul*}"
test_bin="$(bundle_command bin/cuda_backend_test)"
bench_bin="$(bundle_command bin/cuda_gemv_weight_bench)"
rc=0
i=0
for variant in "${variants[@]}"; do
  i=$((i + 1))
  envs=()
  [ "$variant" != - ] && IFS=',' read -r -a envs <<< "$variant"
  if [ "$filter" != - ]; then
    env "${envs[@]}" timeout 300 "$test_bin" --gtest_filter="$filter" \
      > "$LOGS/gemv_${i}_test.log" 2>&1 || rc=1
    echo "$variant tests: $(summary "$LOGS/gemv_${i}_test.log")"
  fi
  env "${envs[@]}" timeout 300 "$bench_bin" "$reps" > "$LOGS/gemv_${i}_bench.log" 2>&1 || rc=1
  grep -E '^(variant|fp8 production|check)' "$LOGS/gemv_${i}_bench.log" | sed "s/^/$variant: /"
done
exit "$rc"
