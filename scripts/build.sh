#!/usr/bin/env bash
# Configures and builds Strata into build/ (Release, Ninja, ccache when present).
# Usage: scripts/build.sh [extra cmake -D options...]   Env: STRATA_BUILD_DIR (default build),
# STRATA_JOBS (default: number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${STRATA_BUILD_DIR:-build}"
JOBS="${STRATA_JOBS:-$(nproc)}"
if [ ! -f "$BUILD_DIR/build.ninja" ] || [ $# -gt 0 ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
