#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by `scripts/gpu_run.sh --with-cli`:
# starts `strata serve` on the CUDA backend with a tiny random model and a host tier of
# STRATA_PIN_GIB GiB (default 8), waits for the host tier's pinning thread to log its result
# (at most 120 s), stops the server with SIGTERM and prints the relevant log lines.
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
gib="${STRATA_PIN_GIB:-8}"
work=$(mktemp -d /dev/shm/strata-pin-XXXXXX)
trap 'rm -rf "$work"' EXIT
"$BUNDLE/bin/strata" make-model --preset tiny --out "$work/model" > /dev/null 2>&1 || { echo "make-model failed"; exit 1; }
"$BUNDLE/bin/strata" serve --model "$work/model" --data "$work/data" --listen 127.0.0.1:0 \
  --port-file "$work/ports" --host-cache-bytes $(( gib << 30 )) > "$work/serve.log" 2>&1 &
pid=$!
rc=1
for _ in $(seq 1 240); do
  if grep -q "host tier:" "$work/serve.log"; then rc=0; break; fi
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.5
done
[ -s "$work/ports" ] && echo "serving on ports $(cat "$work/ports") while pinning"
kill -TERM "$pid" 2>/dev/null
wait "$pid"
echo "strata serve exited with $?"
grep -E "host tier:|backend=|rror" "$work/serve.log" | cut -c1-240
exit "$rc"
