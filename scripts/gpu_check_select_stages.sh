#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh (with
# cuda_cluster_latency_bench in STRATA_GPU_EXTRA_TARGETS): the fused selection op
# (Backend::SelectStages, kernels/cuda/selection.cu SelectStagesKernel) checked, then timed:
#   1. cuda_selection_test's SelectStages tests (the kernel against the CPU twin's ops), with the
#      defaults and once per variant of STRATA_CHECK_TEST_VARIANTS (as STRATA_AB_PIPES below);
#   2. cuda_attention_bench --pipelines-only --no-sweep at the contexts given (default 128K and
#      1M) once per variant of STRATA_AB_PIPES (space-separated; a variant is comma-joined
#      VAR=value settings, "-" for the defaults; default: fused, op by op, fused on 8-block
#      clusters; a setting BENCH=path runs that cuda_attention_bench instead of the bundle's, e.g.
#      an older build's for a baseline in the same call; STRATA_CHECK_PIPE_ARGS: more arguments
#      for each run, e.g. "--policy tokenselect"; STRATA_CHECK_PIPE_TIMEOUT seconds each, default
#      200; STRATA_CHECK_SKIP_PIPES=1 skips them);
#   2b. with STRATA_CHECK_PHASES (variants as STRATA_AB_PIPES) the selection kernel's phase
#      stamps per variant (cuda_attention_bench --stage-phases);
#   3. every bundled gpu test binary (STRATA_CHECK_SKIP_TESTS=1 skips it; STRATA_CHECK_TESTS
#      names the ones to run instead), compute-sanitizer memcheck on the SelectStages tests and
#      racecheck on each SelectStagesTest test in its own process (those that loop over pool
#      formats once per format, their cases with one KV head; AttendMatchesCpu and
#      PartitionedMatchesCpu also once per case, the latter's multi-part cases whole with one
#      KV head and every case in its check-only mode, two KV heads),
#      STRATA_CHECK_RACE_JOBS (default 6) at once (STRATA_CHECK_SKIP_SANITIZE=1 skips them, STRATA_CHECK_SKIP_MEMCHECK=1 the
#      memcheck; STRATA_CHECK_RACE_FILTER: a gtest filter for the racecheck runs, default
#      SelectStagesTest.*; STRATA_CHECK_SANITIZE_TIMEOUT seconds each,
#      default 420; PartitionedMatchesCpu took 344-369 s on the H200 in session 39), and with
#      STRATA_CHECK_LATENCY=1 cuda_cluster_latency_bench
#      (cluster barrier and shared-memory read latencies).
# Full logs in $LOGS (default $OUT, else /tmp/strata-gpu-out; the device tool brings back at most
# 8 files, so a full run sets LOGS to another folder and packs it into $OUT); test summaries and
# PIPE / GSTAGES lines printed.
# Usage: STRATA_GPU_BUNDLE=.gpu scripts/gpu_check_select_stages.sh [contexts...]
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
B="$BUNDLE/bin"
contexts "131072 1048576" "$@"
show_gpu

# The variant's settings in env_args, its bench binary in bench (BENCH=path, else the bundle's).
variant_args() {
  env_args=()
  bench="$B/cuda_attention_bench"
  [ "$1" = "-" ] && return
  local parts p
  IFS=, read -r -a parts <<< "$1"
  for p in "${parts[@]}"; do
    case "$p" in
      BENCH=*) bench="${p#BENCH=}" ;;
      *) env_args+=("$p") ;;
    esac
  done
}

echo "== SelectStages tests"
j=0
for variant in - ${STRATA_CHECK_TEST_VARIANTS:-}; do
  j=$((j + 1))
  variant_args "$variant"
  env "${env_args[@]}" "$B/cuda_selection_test" --gtest_filter='SelectStages*' \
    > "$LOGS/select_stages_$j.log" 2>&1
  echo "cuda_selection_test SelectStages* [$variant] rc=$? $(summary "$LOGS/select_stages_$j.log")"
  grep -E 'Failure|error|Expected|Which is|seed' "$LOGS/select_stages_$j.log" | head -30
done

if [ "${STRATA_CHECK_SKIP_PIPES:-0}" != 1 ]; then
  echo "== pipelines"
  i=0
  for variant in ${STRATA_AB_PIPES:-- STRATA_BENCH_FUSED=0 STRATA_SELECT_STAGES_CLUSTER=8}; do
    i=$((i + 1))
    echo "-- ${variant}"
    variant_args "$variant"
    # shellcheck disable=SC2086  # STRATA_CHECK_PIPE_ARGS is a list of words
    env "${env_args[@]}" timeout "${STRATA_CHECK_PIPE_TIMEOUT:-200}" "$bench" --pipelines-only \
      --no-sweep ${STRATA_CHECK_PIPE_ARGS:-} "${CTX[@]}" > "$LOGS/pipelines_$i.log" 2>&1
    # The bench's column legend once (PIPE: eager_us first, then graph_us, then cold_us).
    [ "$i" = 1 ] && grep -m1 '^pipeline rows' "$LOGS/pipelines_$i.log"
    grep -E '^PIPE|^GSTAGES|^selection' "$LOGS/pipelines_$i.log" | grep -v -- '+miss'
  done
fi

if [ -n "${STRATA_CHECK_PHASES:-}" ]; then
  echo "== selection kernel phases"
  for variant in ${STRATA_CHECK_PHASES}; do
    echo "-- ${variant}"
    variant_args "$variant"
    env "${env_args[@]}" timeout 200 "$bench" --pipelines-only --no-sweep \
      --stage-phases "${CTX[@]}" 2>&1 | grep -E '^PHASES' | grep -v 'not run'
  done
fi

if [ "${STRATA_CHECK_SKIP_TESTS:-0}" != 1 ]; then
  echo "== every gpu test"
  tests=("$B"/*_test)
  if [ -n "${STRATA_CHECK_TESTS:-}" ]; then
    tests=()
    for t in ${STRATA_CHECK_TESTS}; do tests+=("$B/$t"); done
  fi
  for bin in "${tests[@]}"; do
    [ -x "$bin" ] || continue
    name=$(basename "$bin")
    timeout 400 "$bin" --gtest_brief=1 > "$LOGS/$name.log" 2>&1
    echo "$name rc=$? $(summary "$LOGS/$name.log")"
    grep -E '^\[  FAILED  \]' "$LOGS/$name.log" | head -10
  done
fi
if [ "${STRATA_CHECK_SKIP_SANITIZE:-0}" != 1 ]; then
  echo "== compute-sanitizer"
  if [ "${STRATA_CHECK_SKIP_MEMCHECK:-0}" != 1 ]; then
    timeout "${STRATA_CHECK_SANITIZE_TIMEOUT:-420}" compute-sanitizer --tool memcheck \
      --error-exitcode 99 --print-limit 20 "$B/cuda_selection_test" --gtest_brief=1 \
      --gtest_filter='SelectStages*' > "$LOGS/memcheck_select_stages.log" 2>&1
    echo "memcheck SelectStages* rc=$? $(summary "$LOGS/memcheck_select_stages.log")"
  fi
  # racecheck instruments every shared-memory access and takes minutes for the whole filter, so
  # each SelectStagesTest test (the others are host logic: no kernel to check) runs under it in
  # its own process (STRATA_CHECK_RACE_JOBS at once, below), and those that loop over pool formats once
  # per format (STRATA_SELECT_STAGES_TEST_POOL), their cases with one KV head
  # (STRATA_SELECT_STAGES_TEST_ONE_KV_HEAD; with all eight, PartitionedMatchesCpu and
  # AttendMatchesCpu ran past 420 s under racecheck in session 39), AttendMatchesCpu also once per
  # case (STRATA_SELECT_STAGES_TEST_CASE; it ran past 480 s with one KV head in session 43).
  attend_cases=("quest 128K" "tokenselect 128K" "quest two-level" "three stages" "group 1 tiny"
    "group 2 k 0")  # AttendMatchesCpu's cases (kernels/cuda/selection_test.cc)
  part_cases=("tokenselect 128K" "tokenselect two-level" "three stages" "group 1" "k above n"
    "parts below the group" "one part, quest" "one part, tokenselect")  # PartitionedMatchesCpu's
  mapfile -t race_tests < <("$B/cuda_selection_test" --gtest_list_tests \
    --gtest_filter="${STRATA_CHECK_RACE_FILTER:-SelectStagesTest.*}" | awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}')
  runs=()
  for t in "${race_tests[@]}"; do
    case "$t" in
      *.AttendMatchesCpu)
        for c in "${attend_cases[@]}"; do runs+=("$t:bf16:$c" "$t:fp8_e4m3:$c"); done ;;
      *.MatchesCpuOps) runs+=("$t:bf16:" "$t:fp8_e4m3:") ;;
      # Each case in check-only mode (STRATA_SELECT_STAGES_TEST_CHECK_ONLY: the kernels'
      # instances with the selection cache's check, two KV heads, one reusing: the cluster
      # kernel's in the one-part cases, the part kernel's in the others; seven such runs at once
      # took 112 s on the H200 in session 52), and the multi-part cases whole with one KV head
      # (the whole test in one process did not finish in 300 s with seven runs sharing the GPU;
      # "tokenselect 128K" took 345-350 s with six at once, the smaller cases 150-170 s; the
      # one-part cases ran past 400 s, and AttendMatchesCpu covers the cluster kernel's paths
      # without the check).
      *.PartitionedMatchesCpu)
        for c in "${part_cases[@]}"; do
          case "$c" in "one part"*) ;; *) runs+=("$t:bf16:$c" "$t:fp8_e4m3:$c") ;; esac
          runs+=("$t:bf16:$c:check-only" "$t:fp8_e4m3:$c:check-only")
        done ;;
      *) runs+=("$t::") ;;
    esac
  done
  # A run "test:pool:case[:check-only]" logs to
  # racecheck_<test>_<pool>_<case[:check-only], spaces and commas as _>.log.
  race_log() {
    local t="${1%%:*}" rest="${1#*:}"
    echo "$LOGS/racecheck_${t}_${rest%%:*}_$(echo "${rest#*:}" | tr ' ,:' ___).log"
  }
  # At most STRATA_CHECK_RACE_JOBS runs at once (default 6): the GPU is shared, and session 44
  # saw 14 at once leave four AttendMatchesCpu runs and one PartitionedMatchesCpu run unfinished
  # after 420 s, where 5 at once finished in 172-209 s. Each run's exit status goes to its
  # log's .rc file.
  for r in "${runs[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "${STRATA_CHECK_RACE_JOBS:-6}" ]; do wait -n; done
    rest="${r#*:}"
    log="$(race_log "$r")"
    case_name="${rest#*:}" one_head=1 check_only=0
    if [ "${case_name%:check-only}" != "$case_name" ]; then
      case_name="${case_name%:check-only}" one_head=0 check_only=1
    fi
    (
      STRATA_SELECT_STAGES_TEST_ONE_KV_HEAD=$one_head STRATA_SELECT_STAGES_TEST_POOL="${rest%%:*}" \
        STRATA_SELECT_STAGES_TEST_CASE="$case_name" \
        STRATA_SELECT_STAGES_TEST_CHECK_ONLY=$check_only \
        timeout "${STRATA_CHECK_SANITIZE_TIMEOUT:-420}" \
        compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 20 \
        "$B/cuda_selection_test" --gtest_brief=1 --gtest_filter="${r%%:*}" > "$log" 2>&1
      echo $? > "$log.rc"
    ) &
  done
  wait
  for r in "${runs[@]}"; do
    log="$(race_log "$r")"
    rc=$(cat "$log.rc" 2>/dev/null || echo "?")
    echo "racecheck $r rc=$rc $(summary "$log")"
    [ "$rc" != 0 ] && tail -4 "$log"
  done
fi
if [ "${STRATA_CHECK_LATENCY:-0}" = 1 ] && [ -x "$B/cuda_cluster_latency_bench" ]; then
  echo "== cluster latencies"
  "$B/cuda_cluster_latency_bench" 256 > "$LOGS/cluster_latency.txt" 2>&1
  cat "$LOGS/cluster_latency.txt"
fi
