#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# STRATA_GPU_ONLY_TARGETS="cuda_backend_test cuda_selection_test decode_graph_test
# cuda_selected_attention_bench shard_answer_bench shard_rtt_bench": the split-K decode kernels (CUDA-core and tensor-core
# forms, group builds) against the CPU reference and their timing, then the shard transport.
#   1. cuda_backend_test (all), its SelectedAttention tests with the tensor-core split-K kernel
#      off (STRATA_SELECTED_DECODE_MMA=0), with the group-specialised builds off
#      (STRATA_SELECTED_GROUP_KERNELS=0) and with the split-K path forced for every list,
#      cuda_selection_test's SelectedAttention and device-length cases with it forced too,
#      decode_graph_test, compute-sanitizer memcheck and racecheck on the SelectedAttention tests
#      with the split-K path forced;
#   2. cuda_selected_attention_bench --only dense (every context token attended) at the contexts
#      given (default 32K 128K 512K 1M) under each variant of STRATA_AB_DENSE (space-separated;
#      a variant is comma-joined VAR=value settings, "-" for the defaults; default
#      "- STRATA_SELECTED_DECODE_MMA=0");
#   3. shard_answer_bench --policy dense (a 64K 8B-shape shard) under the same variants;
#   4. with STRATA_DENSE_RTT=1: shard_rtt_bench, one layer's fan-out to 1, 2 and 3 peers (direct
#      and async), and the holder on gRPC's callback API against the synchronous one.
# STRATA_DENSE_SKIP_TESTS=1 skips 1. Logs in $OUT (else /tmp/strata-gpu-out).
# Usage: STRATA_GPU_BUNDLE=.gpu-s scripts/gpu_check_dense_decode.sh [contexts...]
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
B="$BUNDLE/bin"
contexts "32768 131072 524288 1048576" "$@"
show_gpu

if [ "${STRATA_DENSE_SKIP_TESTS:-0}" != 1 ]; then
  echo "== tests"
  "$B/cuda_backend_test" > "$LOGS/backend.log" 2>&1
  echo "cuda_backend_test rc=$? $(summary "$LOGS/backend.log")"
  for variant in STRATA_SELECTED_DECODE_MMA=0 STRATA_SELECTED_GROUP_KERNELS=0 \
                 STRATA_SELECTED_ATTENTION=split; do
    env "$variant" "$B/cuda_backend_test" --gtest_filter='*Selected*' \
      > "$LOGS/backend_$variant.log" 2>&1
    echo "Selected, $variant rc=$? $(summary "$LOGS/backend_$variant.log")"
  done
  STRATA_SELECTED_ATTENTION="split" "$B/cuda_selection_test" \
    --gtest_filter='*SelectedAttention*:*DeviceLength*' > "$LOGS/selection_split.log" 2>&1
  echo "cuda_selection_test SelectedAttention/DeviceLength, split forced rc=$? $(summary "$LOGS/selection_split.log")"
  "$B/decode_graph_test" > "$LOGS/decode_graph.log" 2>&1
  echo "decode_graph_test rc=$? $(summary "$LOGS/decode_graph.log")"
  for tool in memcheck racecheck; do
    STRATA_SELECTED_ATTENTION="split" timeout 240 compute-sanitizer --tool "$tool" \
      "$B/cuda_backend_test" --gtest_filter='*SelectedAttention*' > "$LOGS/${tool}_split.log" 2>&1
    echo "$tool SelectedAttention (split) rc=$? $(summary "$LOGS/${tool}_split.log")"
  done
fi

VARIANTS="${STRATA_AB_DENSE:-- STRATA_SELECTED_DECODE_MMA=0}"
dense_alone() {
  local log=$1
  shift
  env "$@" timeout 200 "$B/cuda_selected_attention_bench" --only dense "${CTX[@]}" > "$log" 2>&1
  grep -E '^\| [0-9]+K' "$log"
}
dense_answers() {
  local log=$1
  shift
  env "$@" timeout 120 "$B/shard_answer_bench" --tokens 65536 --layers 4 --rounds 1000 \
    --policy dense > "$log" 2>&1
  grep '^ANSWER' "$log"
}
echo "== dense SelectedAttention alone"
for_each_variant "$VARIANTS" dense_alone dense
echo "== dense shard answers (64K, 8B shape)"
for_each_variant "$VARIANTS" dense_answers answer

[ "${STRATA_DENSE_RTT:-0}" = 1 ] || exit 0
echo "== shard transport"
for peers in 1 2 3; do
  timeout 120 "$B/shard_rtt_bench" --rounds 3000 --peers "$peers" --modes direct,async \
    > "$LOGS/rtt_$peers.log" 2>&1
  grep '^RTT' "$LOGS/rtt_$peers.log"
done
for peer in sync callback; do
  timeout 120 "$B/shard_rtt_bench" --rounds 3000 --peer "$peer" --modes direct,async \
    > "$LOGS/rtt_$peer.log" 2>&1
  echo "-- peer $peer"; grep '^RTT' "$LOGS/rtt_$peer.log"
done
