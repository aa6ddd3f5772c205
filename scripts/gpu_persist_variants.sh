#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by `scripts/gpu_run.sh --with-cli`
# with lazy_mount_bench among STRATA_GPU_EXTRA_TARGETS: how long the worker takes to prefill and
# persist a document as one shard (what `strata serve` does with a document), per configuration.
# The model is written once (`strata make-model`, to tmpfs) and shared by the runs; the LocalStore
# goes to /dev/shm too (the GPU machine's 64 GiB disk cannot hold a long document's pages).
#
# Env: STRATA_GPU_BUNDLE (default .gpu); STRATA_PERSIST_MODEL ("preset dtype", default
#      "llama-3.1-8b bf16"); STRATA_PERSIST_RUNS: runs separated by ';', each
#      "tokens chunk policy precision [more lazy_mount_bench flags]" (default: 64K with the
#      serve defaults, then larger chunks, bf16 GEMMs and tokenselect prefill). Flags after the
#      four fields override the ones above (e.g. "--shard 262144 --modes resident --mount 1" to
#      ask questions after persisting; lazy_mount_bench takes the last value of a flag).
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
read -r preset dtype <<< "${STRATA_PERSIST_MODEL:-llama-3.1-8b bf16}"
model="/dev/shm/strata-model-$preset-$dtype"
t0=$(date +%s)
[ -f "$model/config.json" ] || "$BUNDLE/bin/strata" make-model --preset "$preset" --dtype "$dtype" --out "$model" 2>&1 | tail -1
echo "model $preset $dtype ready after $(( $(date +%s) - t0 )) s"
runs="${STRATA_PERSIST_RUNS:-65536 512 dense split;65536 4096 dense split;65536 4096 dense bf16;65536 4096 tokenselect bf16}"
rc=0
IFS=';' read -ra list <<< "$runs"
for run in "${list[@]}"; do
  read -r tokens chunk policy precision more <<< "$run"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  "$BUNDLE/bin/lazy_mount_bench" --backend cuda --model "$model" --doc "$tokens" --shard "$tokens" \
    --modes none --kv-page-dtype fp8 --dir /dev/shm --host-gib 40 --prefill-chunk "$chunk" \
    --prefill-policy "$policy" --matmul-precision "$precision" ${more:-} 2>&1 \
    | grep -E "persisted|prefilled|rror|^rep |^mounted|prepared for lazy|set up in|pinned up front" \
    | sed 's/^.*worker: document [0-9a-f]* //' | cut -c1-330
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "  wall $(( $(date +%s) - t0 )) s"
done
exit "$rc"
