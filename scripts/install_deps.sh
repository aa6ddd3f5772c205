#!/usr/bin/env bash
# Installs every build and test dependency of Strata from Debian 12 packages.
# Idempotent and non-interactive; run as root (or with sudo available).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git curl
  xz-utils  # scripts/gpu_run.sh packs the GPU bundle with xz
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev librocksdb-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
  libopenblas-dev libpcre2-dev libxxhash-dev libutf8proc-dev
  python3 python3-grpcio python3-protobuf
  prometheus  # promtool (scripts/check_deploy.sh); the server binary for ctest deploy.prometheus_live (no service is started)
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
# Node.js + npm for the offline Kubernetes manifest checks (deploy/tools). Only when absent: a
# NodeSource nodejs (which bundles npm) conflicts with Debian's npm package.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install_deps: done"
