#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root: an A/B of cuda_attention_bench builds (the decode
# step's selection and attention of one layer) in one call. Each round runs every variant once,
# the order rotated by one each round (the machine drifts by ~0.2 us between and within calls, so
# a variant is never always first), and prints one line per variant, context and row with the
# graph-replay figure (PIPE's graph_us column), then a table of each variant's figures over the
# rounds.
#
# Usage: scripts/gpu_ab_attention.sh NAME=path[@VAR=V,...] [NAME=path[@VAR=V,...] ...]
#   each variant a bench binary (e.g. an older build's, stripped, carried beside the bundle); a
#   path "-" is the bundle's bin/cuda_attention_bench; "@VAR=V,..." sets environment variables
#   for that variant's runs only (e.g. one binary under two settings: a=-@STRATA_X=0 b=-).
# Env: STRATA_GPU_BUNDLE (default .gpu: its libraries), STRATA_AB_ROUNDS (default 3),
#      STRATA_AB_CONTEXTS (default "131072"), STRATA_AB_ARGS (default "--policy tokenselect"),
#      STRATA_AB_ROWS (bench --rows, default "plain,miss"), STRATA_AB_ENV (VAR=V,... for every run),
#      STRATA_AB_PHASES=1 (the first round with --stage-phases: PHASES lines in the logs).
# Logs: $LOGS/ab_<round>_<variant>.log.
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
[ "$#" -ge 1 ] || { echo "usage: $0 NAME=path[@VAR=V,...] [NAME=path[@VAR=V,...] ...]" >&2; exit 2; }
names=() paths=() venvs=() venv=() envs=()  # venv, envs: set by env_settings
for a in "$@"; do
  names+=("${a%%=*}")
  p="${a#*=}"
  ve=""
  case "$p" in *@*) ve="${p#*@}"; p="${p%%@*}" ;; esac
  env_settings venv "$ve"  # refused here, before any run
  [ "$p" = - ] && p="$BUNDLE/bin/cuda_attention_bench"
  [ -x "$p" ] || { echo "not an executable: $p" >&2; exit 2; }
  paths+=("$p")
  venvs+=("$ve")
done
rounds="${STRATA_AB_ROUNDS:-3}"
read -r -a ctx <<< "${STRATA_AB_CONTEXTS:-131072}"
read -r -a args <<< "${STRATA_AB_ARGS:---policy tokenselect}"
env_settings envs "${STRATA_AB_ENV:-}"
n="${#names[@]}"
rc=0
table="$LOGS/ab_table.txt"
: > "$table"
for ((r = 0; r < rounds; r++)); do
  for ((k = 0; k < n; k++)); do
    v=$(((k + r) % n))
    log="$LOGS/ab_${r}_${names[$v]}.log"
    extra=()
    [ "$r" = 0 ] && [ "${STRATA_AB_PHASES:-0}" = 1 ] && extra=(--stage-phases)
    env_settings venv "${venvs[$v]}"
    env "${envs[@]}" "${venv[@]}" timeout 300 "${paths[$v]}" --pipelines-only --no-sweep "${args[@]}" \
      --rows "${STRATA_AB_ROWS:-plain,miss}" "${extra[@]}" "${ctx[@]}" > "$log" 2>&1 || {
      echo "round $r ${names[$v]}: rc=$? (log $log)"
      tail -5 "$log"
      rc=1
    }
    # PIPE context label eager graph ...: one line per row.
    awk -v vn="${names[$v]}" -v r="$r" '$1 == "PIPE" { print r, vn, $2, $3, $5 }' "$log" \
      | tee -a "$table"
  done
done
echo "== graph_us per variant, context and row over $rounds rounds"
sort -k2,2 -k3,3n -k4,4 -s "$table" | awk '
  { key = $2 " " $3 " " $4; v[key] = v[key] " " $5; s[key] += $5; c[key]++ }
  END { for (k in v) printf "%-40s mean %6.2f:%s\n", k, s[k] / c[k], v[k] }' | sort
exit "$rc"
