#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh (with
# cuda_selected_attention_bench in STRATA_GPU_EXTRA_TARGETS): the decode-attention kernels'
# correctness and timing, each A/B switch in the same run:
#   1. cuda_backend_test (all; then the SelectedAttention tests again with the group-specialised
#      cluster kernels off) and cuda_selection_test;
#      and with each forced SelectedAttention path (STRATA_SELECTED_ATTENTION);
#   2. compute-sanitizer on the SelectedAttention tests: memcheck (automatic path and forced
#      16-block clusters), racecheck (automatic path);
#   3. cuda_selected_attention_bench --phases (per-phase stamps of the cluster kernel) under each
#      variant of STRATA_AB_PHASES (as STRATA_AB_PIPES; default "- STRATA_SELECTED_GROUP_KERNELS=0");
#   4. cuda_attention_bench --pipelines-only at 128K and 1M under each variant of STRATA_AB_PIPES
#      (space-separated; a variant is comma-joined VAR=value settings, "-" for the defaults;
#      default "- STRATA_SELECTED_GROUP_KERNELS=0").
# STRATA_AB_SKIP_TESTS=1 skips 1 and 2.
# Full logs in $OUT (else /tmp/strata-gpu-out); the PIPE / PHASES / table lines and test summaries
# are printed.
# Usage: STRATA_GPU_BUNDLE=.gpu-mine scripts/gpu_bench_attention.sh [contexts...]
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
B="$BUNDLE/bin"
contexts "131072 1048576" "$@"
show_gpu

if [ "${STRATA_AB_SKIP_TESTS:-0}" != 1 ]; then
echo "== tests"
"$B/cuda_backend_test" > "$LOGS/backend.log" 2>&1; echo "cuda_backend_test rc=$? $(summary "$LOGS/backend.log")"
STRATA_SELECTED_GROUP_KERNELS=0 "$B/cuda_backend_test" --gtest_filter='*Selected*' \
  > "$LOGS/backend_nogroup.log" 2>&1
echo "cuda_backend_test Selected, group kernels off rc=$? $(summary "$LOGS/backend_nogroup.log")"
for path in cluster cluster8 cluster16 split; do
  STRATA_SELECTED_ATTENTION=$path "$B/cuda_backend_test" --gtest_filter='*Selected*' \
    > "$LOGS/backend_$path.log" 2>&1
  echo "cuda_backend_test Selected, STRATA_SELECTED_ATTENTION=$path rc=$? $(summary "$LOGS/backend_$path.log")"
done
"$B/cuda_selection_test" > "$LOGS/selection.log" 2>&1; echo "cuda_selection_test rc=$? $(summary "$LOGS/selection.log")"
# (racecheck with forced 16-block clusters ran past 240 s on the H100: not in this script)
for run in memcheck:auto memcheck:cluster16 racecheck:auto; do
  tool=${run%%:*} path=${run##*:}
  STRATA_SELECTED_ATTENTION=$path timeout 240 compute-sanitizer --tool "$tool" \
    "$B/cuda_backend_test" --gtest_filter='*SelectedAttention*' > "$LOGS/${tool}_$path.log" 2>&1
  echo "$tool SelectedAttention ($path) rc=$? $(summary "$LOGS/${tool}_$path.log")"
done

fi

phases() {
  local log=$1
  shift
  env "$@" timeout 200 "$B/cuda_selected_attention_bench" --phases --only sparse "${CTX[@]}" > "$log" 2>&1
  env "$@" timeout 200 "$B/cuda_selected_attention_bench" --phases --only sinks --pool bf16 "${CTX[@]}" \
    >> "$log" 2>&1
  grep -E '^\| [0-9]+K|^PHASES' "$log"
}
pipelines() {
  local log=$1
  shift
  env "$@" timeout 200 "$B/cuda_attention_bench" --pipelines-only --no-sweep "${CTX[@]}" > "$log" 2>&1
  grep -E '^PIPE|^GSTAGES' "$log" | grep -v -- '+miss'
}

echo "== SelectedAttention alone (bf16 and fp8 pools), phases"
for_each_variant "${STRATA_AB_PHASES:-- STRATA_SELECTED_GROUP_KERNELS=0}" phases selected
echo "== pipelines"
for_each_variant "${STRATA_AB_PIPES:-- STRATA_SELECTED_GROUP_KERNELS=0}" pipelines pipelines
