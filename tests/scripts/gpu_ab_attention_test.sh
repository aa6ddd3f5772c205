#!/usr/bin/env bash
# scripts/gpu_ab_attention.sh on this machine, no GPU: a stand-in bench (prints the PIPE lines of
# cuda_attention_bench, its graph figure taken from STRATA_TEST_GRAPH_US) over a bundle with no
# libraries. Checks that each variant's "@VAR=V,..." settings reach that variant's runs only, that
# STRATA_AB_ENV reaches every run, and that a setting that is not VAR=value is refused (exit 2,
# a message, no run) both in a variant and in STRATA_AB_ENV.
set -uo pipefail
SCRIPT="$(cd "$(dirname "$0")/../.." && pwd)/scripts/gpu_ab_attention.sh"
tmp=$(mktemp -d)
name="ab-test-$$"
trap 'rm -rf "$tmp" "/tmp/strata-gpu-$name"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

mkdir -p "$tmp/$name/lib" "$tmp/logs"
tar -C "$tmp/$name" -cJf "$tmp/$name/libs.tar.xz" lib
cat > "$tmp/bench" <<'BENCH'
#!/usr/bin/env bash
echo "run" >> "$STRATA_TEST_RUNS"
echo "PIPE 131072 tokenselect/p16 1.0 ${STRATA_TEST_GRAPH_US:-20.0} ${STRATA_TEST_BASE:-unset}"
BENCH
chmod +x "$tmp/bench"
run() {
  (cd "$tmp" && BUNDLE="$tmp/$name" LOGS="$tmp/logs" STRATA_TEST_RUNS="$tmp/runs" \
    STRATA_AB_ROUNDS=2 "$SCRIPT" "$@")
}

# Per-variant settings: a at 25.5, b at the stand-in's default 20.0; STRATA_AB_ENV for both.
out=$(STRATA_AB_ENV=STRATA_TEST_BASE=1 run "a=$tmp/bench@STRATA_TEST_GRAPH_US=25.5" "b=$tmp/bench")
rc=$?
[ "$rc" = 0 ] || fail "rc $rc: $out"
echo "$out" | grep -Eq '^a 131072 tokenselect/p16 +mean +25\.50: 25\.5 25\.5$' || fail "a's row: $out"
echo "$out" | grep -Eq '^b 131072 tokenselect/p16 +mean +20\.00: 20\.0 20\.0$' || fail "b's row: $out"
[ "$(wc -l < "$tmp/runs")" = 4 ] || fail "expected 4 runs, got $(wc -l < "$tmp/runs")"
for log in "$tmp"/logs/ab_*_*.log; do
  grep -q 'PIPE .* 1$' "$log" || fail "STRATA_AB_ENV did not reach $log"
done

# Refused: a variant's setting without '=', and one in STRATA_AB_ENV; nothing runs.
rm -f "$tmp/runs"
err=$(run "a=$tmp/bench@NOT_A_SETTING" 2>&1)
rc=$?
[ "$rc" = 2 ] || fail "malformed variant setting: rc $rc ($err)"
echo "$err" | grep -q 'not a VAR=value setting: "NOT_A_SETTING"' || fail "message: $err"
err=$(STRATA_AB_ENV="X=1,rm" run "a=$tmp/bench" 2>&1)
rc=$?
[ "$rc" = 2 ] || fail "malformed STRATA_AB_ENV: rc $rc ($err)"
echo "$err" | grep -q 'not a VAR=value setting: "rm"' || fail "message: $err"
[ ! -e "$tmp/runs" ] || fail "a refused call ran the bench"
echo "PASS"
