#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# decode_e2e_bench among its targets and STRATA_GPU_AB_BASE set (bin/base/: decode_e2e_bench and
# libstrata_cuda.so of an earlier build): an A/B of the end-to-end decode in one call. The base
# and the new binaries run in turn, STRATA_AB_REPS times each (default 2), with the same flags
# (each process loads its own CUDA plugin), and the table rows of every run are printed tagged
# "base N" / "new N". Logs: $OUT/ab_base_N.log, $OUT/ab_new_N.log.
#
# Usage: scripts/gpu_ab_decode.sh [decode_e2e_bench flags]
# Env: STRATA_GPU_BUNDLE (default .gpu), STRATA_AB_REPS (default 2), STRATA_AB_TIMEOUT (seconds
#      per run, default 240).
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
if [ ! -x "$BUNDLE/bin/base/decode_e2e_bench" ] || [ ! -x "$BUNDLE/bin/decode_e2e_bench" ]; then
  echo "gpu_ab_decode: needs $BUNDLE/bin/decode_e2e_bench and $BUNDLE/bin/base/ (STRATA_GPU_AB_BASE)" >&2
  exit 2
fi
rc=0
for rep in $(seq "${STRATA_AB_REPS:-2}"); do
  for side in base new; do
    dir="$BUNDLE/bin"
    [ "$side" = base ] && dir="$BUNDLE/bin/base"
    log="$LOGS/ab_${side}_$rep.log"
    STRATA_CUDA_PLUGIN="$dir/libstrata_cuda.so" timeout "${STRATA_AB_TIMEOUT:-240}" \
      "$dir/decode_e2e_bench" "$@" > "$log" 2>&1 || rc=1
    grep '^| llama' "$log" | sed "s/^/$side $rep /"
  done
done
exit "$rc"
