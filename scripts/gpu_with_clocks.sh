#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, over a bundle made by scripts/gpu_run.sh: runs a
# command while nvidia-smi samples the GPU's SM and memory clocks, power and clock event reasons
# every STRATA_CLOCK_MS (default 100) ms. Writes $LOGS/NAME.log (the command's output, each line
# prefixed with the wall time, to match the samples) and $LOGS/NAME.clocks.csv; prints, per
# phase between two output lines with at least 3 samples in it, the samples' median (and least)
# SM clock, memory clock, power and the clock event reasons seen (nvidia-smi's bit masks).
#
# Usage: scripts/gpu_with_clocks.sh NAME COMMAND [ARGS...]   (COMMAND may name a bundled binary:
#        bin/X)
set -uo pipefail
# shellcheck source=scripts/gpu_bundle_env.sh
source "$(dirname "$0")/gpu_bundle_env.sh"
name="$1"
shift
cmd="$(bundle_command "$1")"
shift
csv="$LOGS/$name.clocks.csv"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader,nounits -lms "${STRATA_CLOCK_MS:-100}" > "$csv" 2>&1 &
smi=$!
"$cmd" "$@" 2>&1 | while IFS= read -r line; do
  printf '%s %s\n' "$(date +%Y/%m/%d\ %H:%M:%S.%3N)" "$line"
done > "$LOGS/$name.log"
rc=${PIPESTATUS[0]}
kill "$smi" 2>/dev/null
wait "$smi" 2>/dev/null
tail -n 20 "$LOGS/$name.log"
python3 - "$LOGS/$name.log" "$csv" <<'PY'
import datetime, statistics, sys
def ts(s):
    return datetime.datetime.strptime(s[:23], "%Y/%m/%d %H:%M:%S.%f")
lines = []
for l in open(sys.argv[1]):
    try:
        lines.append((ts(l), l[24:].rstrip()))
    except ValueError:
        pass
samples = []
for l in open(sys.argv[2]):
    f = [x.strip() for x in l.split(",")]
    try:
        samples.append((ts(f[0]), float(f[1]), float(f[2]), float(f[3]), f[5]))
    except (ValueError, IndexError):
        pass
print("phase (ends at the output line) | samples | SM MHz median (min) | mem MHz | W median | reasons")
prev = lines[0][0] if lines else None
for t, text in lines:
    win = [s for s in samples if prev <= s[0] < t]
    prev = t
    if len(win) < 3:
        continue
    sm = [s[1] for s in win]
    reasons = sorted(set(s[4] for s in win))
    print(f"{text[:70]:70s} | {len(win):4d} | {statistics.median(sm):6.0f} ({min(sm):4.0f}) | "
          f"{statistics.median(s[2] for s in win):5.0f} | {statistics.median(s[3] for s in win):5.0f} | "
          f"{' '.join(reasons)}")
PY
exit "$rc"
