#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh: where one
# selection + attention pipeline of cuda_attention_bench spends its time, per kernel and per
# instruction.
#   1. the pipeline's timing (PIPE / STAGES / GSTAGES lines);
#   2. Nsight Compute (--set full, source counters) on its kernels: per kernel the duration,
#      instructions, issue rate and warp stall summary (printed), and the instructions with the
#      most stall samples with their source lines (scripts/ncu_source_top.py).
# Env: STRATA_PROFILE_CONTEXT (default 131072), STRATA_PROFILE_POLICY (quest|tokenselect,
#      default quest), STRATA_PROFILE_KERNELS (ncu kernel regex, default
#      FastScore|PagedKeyScore|Vote|Selected), STRATA_PROFILE_TOP (instructions listed, default 25),
#      STRATA_PROFILE_ENV (space-separated VAR=value settings for the profiled runs),
#      STRATA_PROFILE_ROWS (the bench's --rows, e.g. miss: only those pipeline rows, so that
#      ncu's launch counts are that row's), STRATA_PROFILE_BENCH (the cuda_attention_bench to run,
#      default the bundle's), STRATA_PROFILE_NCU_ARGS (more ncu arguments, e.g. "--cache-control
#      none --warp-sampling-interval 0"), STRATA_PROFILE_SKIP_PIPE=1 (no timing run first),
#      STRATA_PROFILE_TAG (a suffix for the logs' names, e.g. the build profiled).
# The source page's CSV is kept gzipped ($LOGS/sass_<tag>.csv.gz) for scripts/ncu_source_top.py.
# Usage: STRATA_GPU_BUNDLE=.gpu-mine scripts/gpu_profile_selection.sh
set -uo pipefail
source "$(dirname "$0")/gpu_bundle_env.sh"
B="$BUNDLE/bin"
CTX="${STRATA_PROFILE_CONTEXT:-131072}"
POLICY="${STRATA_PROFILE_POLICY:-quest}"
KERNELS="${STRATA_PROFILE_KERNELS:-FastScore|PagedKeyScore|Vote|Selected}"
TOP="${STRATA_PROFILE_TOP:-25}"
# shellcheck disable=SC2206
EXTRA_ENV=(${STRATA_PROFILE_ENV:-})
BENCH="${STRATA_PROFILE_BENCH:-$B/cuda_attention_bench}"
# shellcheck disable=SC2206
NCU_ARGS=(${STRATA_PROFILE_NCU_ARGS:-})
ROWS=()
[ -n "${STRATA_PROFILE_ROWS:-}" ] && ROWS=(--rows "$STRATA_PROFILE_ROWS")
export PATH="/usr/local/cuda/bin:$PATH"
tag="${POLICY}_${CTX}${STRATA_PROFILE_ROWS:+_${STRATA_PROFILE_ROWS//,/_}}${STRATA_PROFILE_TAG:+_$STRATA_PROFILE_TAG}"
if [ "${STRATA_PROFILE_SKIP_PIPE:-0}" != 1 ]; then
  echo "== pipeline ${POLICY} ${CTX} ${EXTRA_ENV[*]:-}"
  env "${EXTRA_ENV[@]}" "$BENCH" --pipelines-only --no-sweep --policy "$POLICY" "${ROWS[@]}" \
    "$CTX" > "$LOGS/pipe_$tag.log" 2>&1
  grep -E "^(PIPE|STAGES|GSTAGES)" "$LOGS/pipe_$tag.log" | grep -v "+miss"
fi
echo "== ncu ${KERNELS} ${tag}"
env "${EXTRA_ENV[@]}" timeout 300 ncu --clock-control none --set full --import-source yes \
  "${NCU_ARGS[@]}" -k "regex:${KERNELS}" --launch-skip 4 --launch-count 4 -f \
  -o "$LOGS/prof_$tag" "$BENCH" --pipelines-only --no-sweep --policy "$POLICY" "${ROWS[@]}" \
  "$CTX" > "$LOGS/ncu_run_$tag.log" 2>&1
echo "ncu rc=$?"
ncu -i "$LOGS/prof_$tag.ncu-rep" --page details > "$LOGS/details_$tag.txt" 2>&1
grep -E "^  [A-Za-z_].*\(|Duration|Executed Instructions  |Issued Ipc Active|Achieved Occupancy|Registers Per Thread|Block Size|Grid Size|No Eligible|Warp Cycles Per Issued Instruction|Eligible Warps Per Scheduler|Active Warps Per Scheduler|Static Shared|Dynamic Shared|Memory Throughput|L2 Hit Rate  " \
  "$LOGS/details_$tag.txt" | sed 's/(strata::kernels::cuda_internal::[^)]*)//' | cut -c1-140
ncu -i "$LOGS/prof_$tag.ncu-rep" --page source --csv --print-source sass \
  > "$LOGS/sass_$tag.csv" 2> "$LOGS/sass_$tag.err"
echo "source page rc=$? ($(wc -l < "$LOGS/sass_$tag.csv") lines)"
python3 "$(dirname "$0")/ncu_source_top.py" "$LOGS/sass_$tag.csv" "$TOP" || head -c 2000 "$LOGS/sass_$tag.err"
gzip -f "$LOGS/sass_$tag.csv"
