#!/usr/bin/env bash
# Installs the dependencies, builds Strata with its tests and runs the whole suite with ctest.
# This is the README's test command and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh -DSTRATA_BUILD_TESTS=ON
# The pinned npm tools of the deploy tests, installed once before ctest starts them in parallel.
deploy/tools/install.sh
BUILD_DIR="${STRATA_BUILD_DIR:-build}"
# GPU tests (label gpu) report themselves skipped when no GPU is present.
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" --timeout 600 "$@"
