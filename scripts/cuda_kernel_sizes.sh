#!/usr/bin/env bash
# Prints the SASS size (bytes of each kernel's .text section), registers and spills of the
# kernels of one .cu file, compiled here for sm_90a exactly as the build compiles it (no GPU
# needed). SelectStagesKernel's time moves with its code size and layout (bench/RESULTS.md,
# sessions 27-28: 11-15 KB of code that never runs cost 0.7-2.5 us per decode step), so a change
# to it should say what it does to these figures before it goes to the GPU machine.
#
# Usage: scripts/cuda_kernel_sizes.sh [source.cu] [name filter]
#   default source kernels/cuda/selection.cu, filter SelectStagesKernel (a grep -E pattern on the
#   mangled name). Env: STRATA_GPU_BUILD_DIR (default build-cuda, configured with CUDA on),
#   STRATA_KEEP_PTXAS (a path: keep ptxas's full report there).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="${1:-kernels/cuda/selection.cu}"
FILTER="${2:-SelectStagesKernel}"
BUILD_DIR="${STRATA_GPU_BUILD_DIR:-build-cuda}"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  echo "no $BUILD_DIR/build.ninja: configure a CUDA build first (scripts/gpu_run.sh does)" >&2
  exit 2
fi
# shellcheck source=scripts/build_commands.sh
source scripts/build_commands.sh
cmd=$(compile_command "$(build_commands "$BUILD_DIR")" "$SRC")
if [ -z "$cmd" ]; then
  echo "no compile command for $SRC in $BUILD_DIR" >&2
  exit 2
fi
out=$(mktemp -d)
trap '[ -n "${STRATA_KEEP_PTXAS:-}" ] && cp "$out/ptxas.txt" "$STRATA_KEEP_PTXAS"; rm -rf "$out"' EXIT
# The object's command with a cubin for sm_90a as output and ptxas's resource report.
cubin_cmd=$(echo "$cmd" | sed -E "s# -o [^ ]+# -o $out/k.cubin#;
  s#--generate-code=arch=compute_90a,code=\[compute_90a,sm_90a\]#-arch=sm_90a#;
  s# -c # -cubin -Xptxas -v #")
(cd "$BUILD_DIR" && eval "$cubin_cmd") > "$out/ptxas.txt" 2>&1 || {
  cat "$out/ptxas.txt" >&2
  exit 1
}
# ptxas: "Compiling entry function 'NAME'" then the spill line, then "Used N registers".
declare -A regs spills
name=""
while IFS= read -r line; do
  case "$line" in
    *"Compiling entry function '"*)
      name="${line#*\'}"
      name="${name%%\'*}"
      ;;
    *"Function properties for "*)
      # The spill line that follows is this function's: after an entry's report ptxas may
      # report a device function it did not inline (attributing that one's spills to the entry
      # hid the entry's own).
      name="${line##*Function properties for }"
      ;;
    "ptxas warning"*) ;;  # -warn-spills' summary lines: the per-function lines say it
    *"bytes spill stores"*)
      [ -n "$name" ] && spills[$name]=$(echo "$line" | sed -E 's/.* ([0-9]+) bytes spill stores.*/\1/')
      ;;
    *"Used "*" registers"*)
      [ -n "$name" ] && regs[$name]=$(echo "$line" | sed -E 's/.*Used ([0-9]+) registers.*/\1/')
      ;;
  esac
done < "$out/ptxas.txt"
printf '%-10s %-6s %-7s %s\n' bytes regs spills kernel
readelf -SW "$out/k.cubin" 2>/dev/null | awk '$2 ~ /^\.text\./ {print $2, $6}' |
  while read -r section size_hex; do
    kname="${section#.text.}"
    echo "$kname" | grep -Eq -- "$FILTER" || continue
    printf '%-10d %-6s %-7s %s\n' "$((16#$size_hex))" "${regs[$kname]:-?}" \
      "${spills[$kname]:-?}" "$kname"
  done
