# Sourced (not run) by the scripts that run ON the GPU machine over a bundle made by
# scripts/gpu_run.sh (scripts/gpu_bench_prefill.sh, scripts/gpu_bench_decode.sh): sets ROOT, BUNDLE
# (unless set: $ROOT/$STRATA_GPU_BUNDLE, default .gpu) and LOGS (unless set: $OUT, else
# /tmp/strata-gpu-out), unpacks bin.tar.xz and the bundled libraries, and exports
# LD_LIBRARY_PATH and STRATA_CUDA_PLUGIN; defines summary (a log's test and sanitizer summary lines),
# bundle_command (a bundled binary's path), env_settings (VAR=value,... as `env` arguments),
# for_each_variant (A/B runs under env settings),
# contexts (a script's context list), show_gpu (CUDA tools on PATH, the GPU printed) and
# sharded_test (worker_gpu_test's sharded case at the 8B shape).
ROOT="$(pwd)"
BUNDLE="${BUNDLE:-$ROOT/${STRATA_GPU_BUNDLE:-.gpu}}"
LOGS="${LOGS:-${OUT:-/tmp/strata-gpu-out}}"
mkdir -p "$LOGS"
if [ -f "$BUNDLE/bin.tar.xz" ] && [ ! -d "$BUNDLE/bin" ]; then
  tar -C "$BUNDLE" -xJf "$BUNDLE/bin.tar.xz"
fi
WORK="/tmp/strata-gpu-$(basename "$BUNDLE")"
mkdir -p "$WORK" && tar -C "$WORK" -xJf "$BUNDLE/libs.tar.xz"
export LD_LIBRARY_PATH="$WORK/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export STRATA_CUDA_PLUGIN="$BUNDLE/bin/libstrata_cuda.so"
# A command path: $BUNDLE/$1 when the bundle has that executable (e.g. bin/decode_e2e_bench), else $1.
bundle_command() { if [ -x "$BUNDLE/$1" ]; then echo "$BUNDLE/$1"; else echo "$1"; fi; }
# The gtest and compute-sanitizer summary lines of a log, on one line.
summary() { grep -E '^\[  (PASSED|FAILED)  \]|ERROR SUMMARY|RACECHECK SUMMARY' "$1" | tr '\n' ' '; echo; }
# Splits the settings $2 (VAR=value settings joined by commas; "" or "-" for none) into the
# array named $1, as arguments for `env`. An entry that is not VAR=value stops the script with
# exit 2 (`env` would run it as a command).
env_settings() {
  local -n _settings=$1
  _settings=()
  if [ -n "$2" ] && [ "$2" != - ]; then IFS=, read -r -a _settings <<< "$2"; fi
  local setting
  for setting in "${_settings[@]}"; do
    [[ "$setting" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || {
      echo "not a VAR=value setting: \"$setting\" (in \"$2\")" >&2
      exit 2
    }
  done
}
# Runs `$2 <log> <env args...>` once per variant of the list $1 (space-separated variants, each
# space-free VAR=value settings joined by commas, "-" for the defaults), printing "-- variant"
# first; the logs are $LOGS/$3_<n>.log.
for_each_variant() {
  local i=0 variant env_args
  for variant in $1; do
    i=$((i + 1))
    echo "-- ${variant}"
    env_settings env_args "$variant"
    "$2" "$LOGS/$3_$i.log" "${env_args[@]}"
  done
}
# Sets CTX to the contexts given after $1 (separate or space-joined words), else to the
# space-separated default list $1.
contexts() {
  local default=$1
  shift
  # shellcheck disable=SC2034  # CTX is for the calling script
  read -r -a CTX <<< "${*:-$default}"
}
# Puts the CUDA tools (compute-sanitizer, ncu) on PATH and prints the GPU's name, driver and
# highest SM clock.
show_gpu() {
  export PATH="/usr/local/cuda/bin:$PATH"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
}
# Runs worker_gpu_test's sharded case into log $1 with test binary $2 and env settings $3...:
# by default the 8B shape (STRATA_SHARDED_GPU_PRESET), a 131072-token document
# (STRATA_SHARDED_GPU_DOC_TOKENS) over two in-process workers (STRATA_SHARDED_GPU_WORKERS), GPU
# figures only. Returns the test's status.
sharded_test() {
  local log=$1 test=$2
  shift 2
  env STRATA_SHARDED_GPU_PRESET="${STRATA_SHARDED_GPU_PRESET:-llama-3.1-8b}" \
    STRATA_SHARDED_GPU_WORKERS="${STRATA_SHARDED_GPU_WORKERS:-2}" STRATA_SHARDED_GPU_SKIP_CPU=1 \
    STRATA_SHARDED_GPU_DOC_TOKENS="${STRATA_SHARDED_GPU_DOC_TOKENS:-131072}" "$@" \
    timeout 400 "$test" --gtest_filter='*Sharded*' > "$log" 2>&1
}
