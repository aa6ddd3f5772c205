#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# STRATA_GPU_ONLY_TARGETS="cuda_backend_test decode_graph_test cuda_selected_attention_bench
# shard_answer_bench shard_rtt_bench": the dense split-K decode kernel's builds against the CPU
# reference and their timing, then the shard transport's fan-out.
#   1. cuda_backend_test (all), its SelectedAttention tests with the group-specialised builds off
#      (STRATA_SELECTED_GROUP_KERNELS=0) and with the split-K path forced, decode_graph_test, and
#      compute-sanitizer memcheck on the SelectedAttention tests with the split-K path forced;
#   2. cuda_selected_attention_bench --only dense (every context token attended) at the contexts
#      given (default 32K 128K 512K 1M), group builds on and off;
#   3. shard_answer_bench --policy dense (a 64K 8B-shape shard), group builds on and off;
#   4. shard_rtt_bench: one layer's fan-out to 1, 2 and 3 peers (direct and async), and the
#      holder on gRPC's callback API against the synchronous one.
# STRATA_DENSE_SKIP_TESTS=1 skips 1. Logs in $OUT (else /tmp/strata-gpu-out).
# Usage: STRATA_GPU_BUNDLE=.gpu-s scripts/gpu_check_dense_decode.sh [contexts...]
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
B="$BUNDLE/bin"
CTX=("${@:-32768 131072 524288 1048576}")
# shellcheck disable=SC2206
CTX=(${CTX[*]})
export PATH="/usr/local/cuda/bin:$PATH"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader

if [ "${STRATA_DENSE_SKIP_TESTS:-0}" != 1 ]; then
  echo "== tests"
  "$B/cuda_backend_test" > "$LOGS/backend.log" 2>&1
  echo "cuda_backend_test rc=$? $(summary "$LOGS/backend.log")"
  STRATA_SELECTED_GROUP_KERNELS=0 "$B/cuda_backend_test" --gtest_filter='*Selected*' \
    > "$LOGS/backend_nogroup.log" 2>&1
  echo "Selected, group builds off rc=$? $(summary "$LOGS/backend_nogroup.log")"
  STRATA_SELECTED_ATTENTION=split "$B/cuda_backend_test" --gtest_filter='*Selected*' \
    > "$LOGS/backend_split.log" 2>&1
  echo "Selected, split-K forced rc=$? $(summary "$LOGS/backend_split.log")"
  "$B/decode_graph_test" > "$LOGS/decode_graph.log" 2>&1
  echo "decode_graph_test rc=$? $(summary "$LOGS/decode_graph.log")"
  STRATA_SELECTED_ATTENTION=split timeout 200 compute-sanitizer --tool memcheck \
    "$B/cuda_backend_test" --gtest_filter='*SelectedAttention*' > "$LOGS/memcheck_split.log" 2>&1
  echo "memcheck SelectedAttention (split) rc=$? $(summary "$LOGS/memcheck_split.log")"
fi

echo "== dense SelectedAttention alone"
for g in 1 0; do
  echo "-- STRATA_SELECTED_GROUP_KERNELS=$g"
  STRATA_SELECTED_GROUP_KERNELS=$g timeout 200 "$B/cuda_selected_attention_bench" --only dense \
    "${CTX[@]}" > "$LOGS/dense_$g.log" 2>&1
  grep -E '^\| [0-9]+K' "$LOGS/dense_$g.log"
done

echo "== dense shard answers (64K, 8B shape)"
for round in 1 2; do
  for g in 1 0; do
    STRATA_SELECTED_GROUP_KERNELS=$g timeout 120 "$B/shard_answer_bench" --tokens 65536 --layers 4 \
      --rounds 1000 --policy dense > "$LOGS/answer_${g}_$round.log" 2>&1
    echo "group builds $g: $(grep '^ANSWER' "$LOGS/answer_${g}_$round.log")"
  done
done

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
