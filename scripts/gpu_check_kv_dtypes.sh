#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by `scripts/gpu_run.sh --with-cli`:
# `strata generate` over each KV cache dtype (bf16, fp8) and policy (dense, quest, tokenselect) on
# the CUDA backend against the CPU backend, on a random `small` model (bf16 weights) and a prompt
# of STRATA_KV_CHECK_WORDS random words (default 2000, about 6K tokens; 8192 words made 24.7K
# tokens, whose dense CPU prefill took 220 s on 16 cores); greedy, 32 tokens, EOS ignored. The
# CPU runs only for the dtypes in STRATA_KV_CHECK_CPU_DTYPES (default "fp8"). Prints, per case,
# whether the CUDA text equals the CPU text (else the first differing byte), each run's wall time
# and its stderr statistics (prefill and decode rates, the policy's counters). The sparse policies
# run with --device-selection (on the CPU backend the CPU twins of the device ops), which an fp8
# cache requires.
# Usage: STRATA_GPU_BUNDLE=.gpu scripts/gpu_check_kv_dtypes.sh
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
S="$BUNDLE/bin/strata"
WORDS="${STRATA_KV_CHECK_WORDS:-2000}"
CPU_DTYPES=" ${STRATA_KV_CHECK_CPU_DTYPES:-fp8} "
M="$WORK/model-small"
[ -d "$M" ] || "$S" make-model --preset small --dtype bf16 --seed 7 --out "$M" > "$LOGS/make_model.log" 2>&1 \
  || { echo "make-model failed"; tail "$LOGS/make_model.log"; exit 1; }
# WORDS random words, seeded.
python3 - "$WORDS" > "$WORK/prompt.txt" <<'EOF'
import random, sys
words = ("alpha beta gamma delta river stone cloud paper seven north market garden silver "
         "window orange table forest engine letter summer").split()
r = random.Random(11)
print(" ".join(r.choice(words) for _ in range(int(sys.argv[1]))))
EOF
run() {  # backend policy dtype -> text in $LOGS/gen_<backend>_<policy>_<dtype>.txt
  local be=$1 pol=$2 dt=$3 extra=()
  [ "$pol" != dense ] && extra+=(--device-selection)
  local t0 t1
  t0=$(date +%s.%N)
  "$S" generate --model "$M" --prompt-file "$WORK/prompt.txt" --max-tokens 32 --ignore-eos \
    --backend "$be" --policy "$pol" --kv-dtype "$dt" --chunk-size 2048 "${extra[@]}" \
    > "$LOGS/gen_${be}_${pol}_${dt}.txt" 2> "$LOGS/gen_${be}_${pol}_${dt}.err"
  local rc=$?
  t1=$(date +%s.%N)
  printf '%-5s %-12s %-5s rc=%d %6.1f s  %s\n' "$be" "$pol" "$dt" "$rc" \
    "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')" \
    "$(grep -E 'decode=|candidate_tokens' "$LOGS/gen_${be}_${pol}_${dt}.err" | tr '\n' ' ' | cut -c1-160)"
}
first_diff() {  # two files -> "equal" or the first differing byte
  if cmp -s "$1" "$2"; then echo "equal"; else echo "differ: $(cmp "$1" "$2" 2>&1 | head -1)"; fi
}
for pol in dense quest tokenselect; do
  for dt in bf16 fp8; do
    run cuda "$pol" "$dt"
    [[ "$CPU_DTYPES" == *" $dt "* ]] || continue
    run cpu "$pol" "$dt"
    echo "   cuda vs cpu [$pol $dt]: $(first_diff "$LOGS/gen_cuda_${pol}_${dt}.txt" "$LOGS/gen_cpu_${pol}_${dt}.txt")"
  done
  echo "   cuda bf16 vs fp8 [$pol]: $(first_diff "$LOGS/gen_cuda_${pol}_bf16.txt" "$LOGS/gen_cuda_${pol}_fp8.txt")"
done
