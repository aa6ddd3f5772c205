#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over the bundle that scripts/gpu_run.sh made in .gpu/:
# unpacks the libraries, runs every bundled gpu-labelled test binary, the decode-attention timing,
# and compute-sanitizer memcheck on the CUDA backend test (time-boxed, last; API errors are not
# reported because the test provokes an allocation failure on purpose); prints a short table.
# Full logs go to $OUT (the device tool's result folder) when set, else /tmp/strata-gpu-out.
#
# Usage: scripts/gpu_remote.sh
# Env: STRATA_GPU_BUNDLE (bundle folder under the repo root, default .gpu),
#      STRATA_GPU_SANITIZER_FILTER (gtest filter for the memcheck run; default all tests),
#      STRATA_GPU_SANITIZER_TIMEOUT (seconds, default 170), STRATA_GPU_BENCH_ARGS (contexts for
#      cuda_attention_bench; default 32768 131072), STRATA_GPU_SKIP_BENCH=1, STRATA_GPU_BENCH_TIMEOUT (seconds,
#      default 120), STRATA_GPU_SKIP_NCU=1,
#      STRATA_GPU_SANITIZE (more compute-sanitizer runs, space-separated BIN:TOOL:FILTER items, e.g.
#      "cuda_page_cache_test:racecheck:*"; each time-boxed like the memcheck run),
#      STRATA_GPU_AFTER (a command run last, in the same environment: e.g. a benchmark).
set -uo pipefail
ROOT="$(pwd)"
BUNDLE="$ROOT/${STRATA_GPU_BUNDLE:-.gpu}"
LOGS="${OUT:-/tmp/strata-gpu-out}"
mkdir -p "$LOGS"
WORK="/tmp/strata-gpu-$(basename "$BUNDLE")"
# Binaries packed by scripts/gpu_run.sh (bin.tar.xz) are unpacked into the bundle first.
if [ -f "$BUNDLE/bin.tar.xz" ] && [ ! -d "$BUNDLE/bin" ]; then
  tar -C "$BUNDLE" -xJf "$BUNDLE/bin.tar.xz"
fi
rm -rf "$WORK" && mkdir -p "$WORK"
tar -C "$WORK" -xJf "$BUNDLE/libs.tar.xz"
export LD_LIBRARY_PATH="$WORK/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
export PATH="/usr/local/cuda/bin:$PATH"
# The CUDA backend plugin that kernels::MakeBackend loads (golden_gpu_test, strata).
export STRATA_CUDA_PLUGIN="$BUNDLE/bin/libstrata_cuda.so"
# The CUDA toolkit libraries (cudart, cuBLAS) come from the machine; if the default places lack
# them, look for them (CUDA install or the nvidia-* Python wheels) and add their folders.
for bin in "$BUNDLE"/bin/*; do
  [ -x "$bin" ] || continue
  if ldd "$bin" | grep -q "not found"; then
    for lib in $(ldd "$bin" | awk '/not found/ {print $1}'); do
      dir=$(find /usr /opt -name "$lib" -print -quit 2>/dev/null | xargs -r dirname)
      [ -n "$dir" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$dir"
    done
    ldd "$bin" | grep "not found" && echo "WARNING: $(basename "$bin") still misses libraries"
  fi
done

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader \
  2>&1 | tee "$LOGS/nvidia-smi.txt"
if [ -f "$BUNDLE/commit.txt" ]; then
  echo "binaries built from: $(cat "$BUNDLE/commit.txt")"
else
  git -C "$ROOT" rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /' || true
fi

declare -a rows
summarize() {  # name log rc seconds
  local passed failed skipped
  passed=$(grep -oE '^\[  PASSED  \] [0-9]+' "$2" | grep -oE '[0-9]+$' | tail -1)
  failed=$(grep -oE '^\[  FAILED  \] [0-9]+ test' "$2" | grep -oE '[0-9]+' | tail -1)
  skipped=$(grep -oE '^\[  SKIPPED \] [0-9]+ test' "$2" | grep -oE '[0-9]+' | tail -1)
  rows+=("$(printf '%-34s rc=%-3s passed=%-5s failed=%-4s skipped=%-4s %5ss' "$1" "$3" \
    "${passed:-0}" "${failed:-0}" "${skipped:-0}" "$4")")
}

for bin in "$BUNDLE"/bin/*_test; do
  [ -x "$bin" ] || continue
  name=$(basename "$bin")
  start=$(date +%s)
  "$bin" --gtest_brief=1 --gtest_output="xml:$LOGS/$name.xml" >"$LOGS/$name.log" 2>&1
  rc=$?
  summarize "$name" "$LOGS/$name.log" "$rc" "$(( $(date +%s) - start ))"
  grep -E '^\[  FAILED  \]|Failure|error' "$LOGS/$name.log" | head -20
done

if [ -x "$BUNDLE/bin/cuda_attention_bench" ] && [ "${STRATA_GPU_SKIP_BENCH:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  timeout "${STRATA_GPU_BENCH_TIMEOUT:-120}" stdbuf -oL \
    "$BUNDLE/bin/cuda_attention_bench" ${STRATA_GPU_BENCH_ARGS:-32768 131072} 2>&1 | tee "$LOGS/bench.txt"
fi

if [ -x "$BUNDLE/bin/cuda_backend_test" ] && command -v compute-sanitizer >/dev/null; then
  start=$(date +%s)
  timeout "${STRATA_GPU_SANITIZER_TIMEOUT:-170}" compute-sanitizer --tool memcheck --report-api-errors no \
    --error-exitcode 99 --print-limit 20 "$BUNDLE/bin/cuda_backend_test" --gtest_brief=1 \
    --gtest_filter="${STRATA_GPU_SANITIZER_FILTER:-*}" >"$LOGS/memcheck.log" 2>&1
  rc=$?
  summarize "memcheck cuda_backend_test" "$LOGS/memcheck.log" "$rc" "$(( $(date +%s) - start ))"
  grep -E 'ERROR SUMMARY|Invalid|========= [A-Z]' "$LOGS/memcheck.log" | head -20
fi

for item in ${STRATA_GPU_SANITIZE:-}; do
  IFS=: read -r sbin stool sfilter <<<"$item"
  [ -x "$BUNDLE/bin/$sbin" ] || { echo "no $sbin in the bundle"; continue; }
  start=$(date +%s)
  timeout "${STRATA_GPU_SANITIZER_TIMEOUT:-170}" compute-sanitizer --tool "$stool" \
    --error-exitcode 99 --print-limit 20 "$BUNDLE/bin/$sbin" --gtest_brief=1 \
    --gtest_filter="${sfilter:-*}" >"$LOGS/${stool}_${sbin}.log" 2>&1
  rc=$?
  summarize "$stool $sbin" "$LOGS/${stool}_${sbin}.log" "$rc" "$(( $(date +%s) - start ))"
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|Invalid|========= [A-Z]' "$LOGS/${stool}_${sbin}.log" | head -10
done

# Per-kernel device time of the decode path at 128K context (Nsight Compute; dense calls first,
# then budget calls: 5 calls x 2 kernels each in --ncu mode).
if [ -x "$BUNDLE/bin/cuda_attention_bench" ] && command -v ncu >/dev/null && \
   [ "${STRATA_GPU_SKIP_NCU:-0}" != 1 ]; then
  for mode in "dense:0" "budget:10"; do
    ncu --clock-control none -k regex:PagedAttention --launch-skip "${mode#*:}" --launch-count 10 \
      --metrics gpu__time_duration.sum --print-summary per-kernel \
      "$BUNDLE/bin/cuda_attention_bench" --ncu 131072 >"$LOGS/ncu_${mode%%:*}.txt" 2>&1
    echo "ncu ${mode%%:*} 131072:"
    grep -E "PagedAttention|gpu__time_duration" "$LOGS/ncu_${mode%%:*}.txt" | sed 's/(strata::kernels[^)]*)//' | cut -c1-150 | head -8
  done
fi

if [ -n "${STRATA_GPU_AFTER:-}" ]; then
  echo "==== after: $STRATA_GPU_AFTER ===="
  BUNDLE="$BUNDLE" LOGS="$LOGS" bash -c "$STRATA_GPU_AFTER"
fi

echo "==== summary ===="
printf '%s\n' "${rows[@]}"
