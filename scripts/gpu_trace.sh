#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh with
# strata_kernel_trace among STRATA_GPU_EXTRA_TARGETS: runs a command with every kernel's GPU start
# and end recorded by the CUPTI tracer (bench/kernel_trace.cc), then summarises where its graph
# launches' time goes (scripts/kernel_trace_summary.py). Writes $LOGS/NAME.log (the command's
# output), $LOGS/NAME.summary.txt and $LOGS/NAME.tsv.xz (the trace).
#
# Usage: scripts/gpu_trace.sh NAME COMMAND [ARGS...]   (COMMAND may name a bundled binary: bin/X)
# Env: STRATA_GPU_BUNDLE (default .gpu), STRATA_TRACE_LAST (steps summarised, default 16),
#      STRATA_TRACE_ALL=1 (also write kernels outside graphs), STRATA_TRACE_TOP (rows, default 25),
#      STRATA_TRACE_API=1 (also copies and runtime API calls: bench/kernel_trace.cc),
#      STRATA_TRACE_PASSES=1 (each pass, i.e. each captured step's graphs, summarised apart).
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
name="$1"
shift
cmd="$(bundle_command "$1")"
shift
trace="$LOGS/$name.tsv"
skip=1
[ "${STRATA_TRACE_ALL:-0}" = 1 ] && skip=0
CUDA_INJECTION64_PATH="$BUNDLE/bin/libstrata_kernel_trace.so" STRATA_KERNEL_TRACE_OUT="$trace" \
  STRATA_KERNEL_TRACE_SKIP_NONGRAPH="$skip" STRATA_KERNEL_TRACE_API="${STRATA_TRACE_API:-0}" \
  "$cmd" "$@" > "$LOGS/$name.log" 2>&1
rc=$?
tail -n 30 "$LOGS/$name.log"
passes=()
[ "${STRATA_TRACE_PASSES:-0}" = 1 ] && passes=(--passes)
python3 "$ROOT/scripts/kernel_trace_summary.py" "$trace" --last "${STRATA_TRACE_LAST:-16}" \
  --top "${STRATA_TRACE_TOP:-25}" "${passes[@]}" | tee "$LOGS/$name.summary.txt"
xz -T4 -f "$trace"
exit "$rc"
