#!/usr/bin/env bash
# Builds one target of a configured build with one source file of the tree replaced by a variant
# of it, without touching the build or the tree: the variant is compiled with the build's own
# command for that source (so with the same flags; nvcc's ptxas spill warnings are printed), its
# object put into a copy of the static library that holds the original, and the target relinked
# with that copy into a work folder; the result is stripped to OUT. Made for the GPU A/B runs
# (scripts/gpu_ab_attention.sh NAME=OUT ...): several variants of a kernel file, each a bench
# binary carried beside the bundle, measured against the tree's build in one call.
#
# Usage: scripts/build_variant.sh OUT SOURCE VARIANT [TARGET]
#   SOURCE  a file of the tree compiled into a static library of the build (e.g.
#           kernels/cuda/selection.cu); VARIANT the file to compile in its place (any path; its
#           quoted includes resolve as from SOURCE's folder too); TARGET the executable to
#           relink (default cuda_attention_bench), already built.
# Env: STRATA_GPU_BUILD_DIR (default build-cuda), STRATA_KEEP_VARIANT_WORK=1 (keep the work folder
#      and print its path).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$#" -lt 3 ] || [ "$#" -gt 4 ]; then
  echo "usage: $0 OUT SOURCE VARIANT [TARGET]" >&2
  exit 2
fi
out="$1" source="$2" variant="$3" target="${4:-cuda_attention_bench}"
build="${STRATA_GPU_BUILD_DIR:-build-cuda}"
die() {
  echo "build_variant: $*" >&2
  exit 2
}
[ -f "$build/build.ninja" ] || die "no $build/build.ninja: configure a build first"
[ -f "$source" ] || die "no source $source"
[ -f "$variant" ] || die "no variant $variant"
src_abs="$(realpath "$source")"
var_abs="$(realpath "$variant")"
out_abs="$(realpath -m "$out")"
build_abs="$(realpath "$build")"
# shellcheck source=scripts/build_commands.sh
source scripts/build_commands.sh
cmds=$(build_commands "$build" "$target") || die "ninja knows no target $target"
compile=$(compile_command "$cmds" "$source")
[ -n "$compile" ] || die "$target does not compile $source"
obj=$(sed -E 's/.* -o ([^ ]+).*/\1/' <<< "$compile")
member="$(basename "$obj")"
# The archive command that takes the object, and the library it writes.
archive=$(grep -E "(^|[ /])ar (qc|rc|cr) " <<< "$cmds" | grep -F -- " $obj" | head -1 || true)
[ -n "$archive" ] || die "$obj is in no static library of $target"
lib=$(sed -E 's/.*ar (qc|rc|cr) ([^ ]+) .*/\2/' <<< "$archive")
link=$(grep -E -- "-o ([^ ]*/)?$target( |$)" <<< "$cmds" | tail -1 || true)
[ -n "$link" ] || die "no link command for $target"
[ -f "$build/$lib" ] || die "$build/$lib is not built: build $target first"
[ "$(ar t "$build/$lib" | grep -cxF "$member")" = 1 ] ||
  die "$lib holds $member more than once (or not at all): cannot swap it"

work=$(mktemp -d)
if [ "${STRATA_KEEP_VARIANT_WORK:-0}" = 1 ]; then
  echo "build_variant: work folder $work"
else
  trap 'rm -rf "$work"' EXIT
fi
# The variant's object: the same command (no dependency file), another input and output.
vcompile="${compile/" -c $src_abs"/" -I$(dirname "$src_abs") -c $var_abs"}"
vcompile="${vcompile/" -o $obj"/" -o $work/$member"}"
(cd "$build_abs" && eval "$vcompile")
cp "$build/$lib" "$work/lib.a"
(cd "$work" && ar r lib.a "$member")
vlink="${link//" $lib "/" $work/lib.a "}"
vlink=$(sed -E "s#-o ([^ ]*/)?$target( |\$)#-o $work/$target\\2#" <<< "$vlink")
[ "$vlink" != "$link" ] || die "could not rewrite the link command"
(cd "$build_abs" && eval "$vlink")
mkdir -p "$(dirname "$out_abs")"
strip -o "$out_abs" "$work/$target"
echo "build_variant: $out ($target with $variant as $source)"
