#!/usr/bin/env bash
# Builds Strata with a sanitizer in its own build directory and runs the tests with the given
# ctest labels.
#
#   scripts/test_sanitize.sh thread concurrency          # TSan, tests labelled "concurrency"
#   scripts/test_sanitize.sh address,undefined kvstore   # ASan + UBSan, tests labelled "kvstore"
#
# Env: STRATA_BUILD_DIR (default build-tsan / build-asan), STRATA_JOBS (default: cores),
# STRATA_TARGETS (space-separated targets to build; default: everything).
# Exit status: non-zero when the build fails, a test fails, or the sanitizer reports anything.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: $0 thread|address,undefined [ctest labels...]" >&2
  exit 2
fi
SANITIZE="$1"
shift
case "$SANITIZE" in
  thread) DEFAULT_DIR=build-tsan ;;
  address,undefined|address|undefined) DEFAULT_DIR=build-asan ;;
  *) echo "$0: unknown sanitizer '$SANITIZE'" >&2; exit 2 ;;
esac
BUILD_DIR="${STRATA_BUILD_DIR:-$DEFAULT_DIR}"
JOBS="${STRATA_JOBS:-$(nproc)}"

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_BUILD_TESTS=ON \
  -DSTRATA_ENABLE_CUDA=OFF -DSTRATA_SANITIZE="$SANITIZE"
# shellcheck disable=SC2086
cmake --build "$BUILD_DIR" -j "$JOBS" ${STRATA_TARGETS:+--target $STRATA_TARGETS}

# Reports fail the run: TSan/ASan exit with 66 / 1 at exit when they found something, UBSan
# aborts on the first report. gRPC, protobuf, Abseil and RocksDB come from Debian uninstrumented:
# TSan ignores interceptor calls made from uninstrumented modules (ignore_noninstrumented_modules)
# and scripts/tsan.supp suppresses reports with their frames; Strata's own code stays checked.
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=0 exitcode=66 second_deadlock_stack=1 ignore_noninstrumented_modules=1 suppressions=$PWD/scripts/tsan.supp}"
# allocator_may_return_null: an allocation too large for the machine returns null, as malloc does
# outside the sanitizer (the backends answer RESOURCE_EXHAUSTED), instead of aborting the test.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1 abort_on_error=0 allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1 halt_on_error=1}"
LABEL_ARGS=()
for label in "$@"; do LABEL_ARGS+=(-L "$label"); done
ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error --timeout 600 "${LABEL_ARGS[@]}"
