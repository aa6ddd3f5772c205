#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# decode_e2e_bench among its targets (and, for a "base" variant, STRATA_GPU_AB_BASE set: bin/base/
# holds decode_e2e_bench and libstrata_cuda.so of an earlier build): an A/B of the end-to-end
# decode in one call. The
# variants run in turn, STRATA_AB_REPS times each (default 2), with the same flags (each process
# loads its own CUDA plugin), and the table rows of every run are printed tagged with the variant
# and the rep. Logs: $OUT/ab_<variant index>_<rep>.log.
#
# Usage: scripts/gpu_ab_decode.sh [decode_e2e_bench flags]
# Env: STRATA_GPU_BUNDLE (default .gpu), STRATA_AB_REPS (default 2), STRATA_AB_TIMEOUT (seconds
#      per run, default 240), STRATA_AB_VARIANTS (space-separated, default "base new": "base" is
#      bin/base's binary, "new" the bundle's, "new:VAR=V,VAR2=V2" the bundle's with those
#      environment variables, e.g. an A/B switch such as STRATA_RESOLVE_PDL=0, and a variant
#      followed by "@--flag=v,--flag2=v2" runs with those decode_e2e_bench flags added, e.g.
#      "new@--weight_format=fp8").
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
read -r -a variants <<< "${STRATA_AB_VARIANTS:-base new}"
needs_base=0
for variant in "${variants[@]}"; do [ "${variant%%@*}" = base ] && needs_base=1; done
if [ ! -x "$BUNDLE/bin/decode_e2e_bench" ] ||
  { [ "$needs_base" = 1 ] && [ ! -x "$BUNDLE/bin/base/decode_e2e_bench" ]; }; then
  echo "gpu_ab_decode: needs $BUNDLE/bin/decode_e2e_bench and, for a base variant," \
    "$BUNDLE/bin/base/ (STRATA_GPU_AB_BASE)" >&2
  exit 2
fi
rc=0
for rep in $(seq "${STRATA_AB_REPS:-2}"); do
  i=0
  for variant in "${variants[@]}"; do
    i=$((i + 1))
    what="${variant%%@*}"
    extra=()
    if [[ "$variant" == *@* ]]; then IFS=',' read -r -a extra <<< "${variant#*@}"; fi
    dir="$BUNDLE/bin"
    [ "$what" = base ] && dir="$BUNDLE/bin/base"
    envs=()
    if [[ "$what" == new:* ]]; then IFS=',' read -r -a envs <<< "${what#new:}"; fi
    log="$LOGS/ab_${i}_$rep.log"
    env "${envs[@]}" STRATA_CUDA_PLUGIN="$dir/libstrata_cuda.so" \
      timeout "${STRATA_AB_TIMEOUT:-240}" "$dir/decode_e2e_bench" "$@" "${extra[@]}" > "$log" 2>&1 \
      || rc=1
    grep '^| llama' "$log" | sed "s/^/$variant $rep /"
  done
done
exit "$rc"
