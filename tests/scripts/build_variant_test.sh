#!/usr/bin/env bash
# scripts/build_variant.sh on this machine's own build (no GPU): cuda_attention_bench with
# kernels/cuda/swiglu.cu replaced by a copy carrying a marker string. Checks that the variant
# binary holds the marker, that the build's own library and bench are left byte for byte as they
# were (and hold no marker), and that a source the target does not compile, a missing variant and
# an unknown target are refused with exit 2 and nothing written.
# Usage: build_variant_test.sh BUILD_DIR
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD="$(realpath "$1")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
lib="$BUILD/kernels/cuda/libstrata_kernels_cuda.a"
bench="$BUILD/bin/cuda_attention_bench"
if [ ! -f "$lib" ] || [ ! -x "$bench" ]; then fail "build $BUILD has no $lib or $bench"; fi
marker="strata-build-variant-marker-$$"
cp "$ROOT/kernels/cuda/swiglu.cu" "$tmp/swiglu_variant.cu"
echo "extern \"C\" const char kStrataBuildVariantMarker[] = \"$marker\";" >> "$tmp/swiglu_variant.cu"
before=$(md5sum "$lib" "$bench")
run() { (cd "$ROOT" && STRATA_GPU_BUILD_DIR="$BUILD" scripts/build_variant.sh "$@"); }

out=$(run "$tmp/v_bench" kernels/cuda/swiglu.cu "$tmp/swiglu_variant.cu" 2>&1)
rc=$?
[ "$rc" = 0 ] || fail "rc $rc: $out"
[ -x "$tmp/v_bench" ] || fail "no variant binary: $out"
grep -qF "$marker" "$tmp/v_bench" || fail "the variant binary lacks the variant's marker"
grep -qF "$marker" "$bench" && fail "the build's bench holds the marker"
[ "$(md5sum "$lib" "$bench")" = "$before" ] || fail "the build's library or bench changed"

refused() {
  local what=$1
  shift
  out=$(run "$tmp/refused" "$@" 2>&1)
  rc=$?
  [ "$rc" = 2 ] || fail "$what: rc $rc (want 2): $out"
  case "$out" in *build_variant:*) ;; *) fail "$what: no message: $out" ;; esac
  [ -e "$tmp/refused" ] && fail "$what: wrote an output"
  return 0
}
refused "a source the target does not compile" coordinator/admission.cc "$tmp/swiglu_variant.cu"
refused "a missing variant" kernels/cuda/swiglu.cu "$tmp/no_such_variant.cu"
refused "an unknown target" kernels/cuda/swiglu.cu "$tmp/swiglu_variant.cu" no_such_target
[ "$(md5sum "$lib" "$bench")" = "$before" ] || fail "the build's library or bench changed"
echo "PASS"
