#!/usr/bin/env bash
# Builds the GPU test binaries here (no GPU needed) and bundles them, with every non-system shared
# library they need, into .gpu/ (gitignored) for the GPU machine, where scripts/gpu_remote.sh runs
# them from the repo root.
#
# Usage: scripts/gpu_run.sh [--with-cli]
#   --with-cli   also build the `strata` binary (otherwise it is bundled only if already built)
# Env: STRATA_GPU_BUILD_DIR (default build-cuda), STRATA_JOBS (default 2), STRATA_GPU_BUNDLE
#      (bundle folder, default .gpu; any .gpu* name is gitignored; carry it to the GPU machine and
#      run it there with STRATA_GPU_BUNDLE set to the same name),
#      STRATA_GPU_EXTRA_TARGETS (more targets to build and bundle, space-separated, e.g. a bench,
#      or strata_kernel_trace: the CUPTI kernel tracer, bundled as bin/libstrata_kernel_trace.so),
#      STRATA_GPU_ONLY_TARGETS (space-separated: build and bundle only these targets, test binaries
#      or programs, plus the plugin, instead of every gpu-labelled test: a small bundle for a
#      focused call, e.g. "decode_graph_test decode_e2e_bench" into STRATA_GPU_BUNDLE=.gpu-s),
#      STRATA_GPU_AB_BASE (a folder of baseline binaries of an earlier build, e.g. its
#      decode_e2e_bench and libstrata_cuda.so, bundled as bin/base/ for scripts/gpu_ab_decode.sh).
#
# What is bundled (.gpu/):
#   bin/            the test binaries with ctest label `gpu`, cuda_attention_bench, the CUDA plugin
#                   libstrata_cuda.so, strata (if built), stripped
#   bin.tar.xz      instead of bin/ when the binaries exceed 40 MiB (the device tool carries at
#                   most 64 MiB; scripts/gpu_remote.sh unpacks it)
#   libs.tar.xz     the shared libraries they link that the GPU machine lacks (Abseil, gRPC,
#                   RocksDB, prometheus-cpp, OpenBLAS, PCRE2, ...), xz-compressed (the device
#                   tool carries at most 64 MiB)
# Not bundled, because the GPU machine has them (Ubuntu 24.04, CUDA 13.0; see notes/GPU.md): glibc,
# libstdc++/libgcc_s, the CUDA driver and toolkit libraries (cudart, cuBLAS/cuBLASLt, NCCL), and
# libprotobuf.so.32.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${STRATA_GPU_BUILD_DIR:-build-cuda}"
JOBS="${STRATA_JOBS:-2}"
WITH_CLI=0
BUNDLE="${STRATA_GPU_BUNDLE:-.gpu}"
# shellcheck disable=SC2206
extra=(${STRATA_GPU_EXTRA_TARGETS:-})
[ "${1:-}" = "--with-cli" ] && WITH_CLI=1

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_BUILD_TESTS=ON \
    -DSTRATA_ENABLE_CUDA=ON
fi
# Every gpu-labelled test binary is built (a test binary left from an older build would be bundled
# stale: it may not match the plugin's structs), plus the bench, the plugin and extras. CMake
# writes their targets to gpu_test_targets.txt at configure time (ctest lists discovered tests
# only once their binaries exist, so a fresh build directory would bundle none).
cmake "$BUILD_DIR" > /dev/null  # refresh the list
mapfile -t gpu_test_targets < <(grep -v '^$' "$BUILD_DIR/gpu_test_targets.txt")
targets=("${gpu_test_targets[@]}" cuda_attention_bench strata_cuda "${extra[@]}")
# shellcheck disable=SC2206
only=(${STRATA_GPU_ONLY_TARGETS:-})
if [ "${#only[@]}" -gt 0 ]; then
  targets=("${only[@]}" strata_cuda)
fi
ninja -C "$BUILD_DIR" -j "$JOBS" "${targets[@]}"
if [ "$WITH_CLI" = 1 ]; then
  ninja -C "$BUILD_DIR" -j "$JOBS" strata
fi

gpu_tests=()
for t in "${gpu_test_targets[@]}"; do gpu_tests+=("$BUILD_DIR/tests/$t"); done
binaries=("${gpu_tests[@]}" "$BUILD_DIR/bin/cuda_attention_bench" "$BUILD_DIR/bin/libstrata_cuda.so")
for t in "${extra[@]}"; do
  [ -x "$BUILD_DIR/bin/$t" ] && binaries+=("$BUILD_DIR/bin/$t")
  # A shared-library extra (strata_kernel_trace: bench/kernel_trace.cc) is bundled into bin/ too.
  [ -f "$BUILD_DIR/lib/lib$t.so" ] && binaries+=("$BUILD_DIR/lib/lib$t.so")
done
[ -x "$BUILD_DIR/bin/strata" ] && binaries+=("$BUILD_DIR/bin/strata")
if [ "${#only[@]}" -gt 0 ]; then
  binaries=("$BUILD_DIR/bin/libstrata_cuda.so")
  for t in "${only[@]}"; do
    if [ -x "$BUILD_DIR/tests/$t" ]; then binaries+=("$BUILD_DIR/tests/$t")
    elif [ -x "$BUILD_DIR/bin/$t" ]; then binaries+=("$BUILD_DIR/bin/$t")
    elif [ -f "$BUILD_DIR/lib/lib$t.so" ]; then binaries+=("$BUILD_DIR/lib/lib$t.so")
    else echo "no binary for target $t" >&2; exit 1
    fi
  done
fi

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
# The tree the binaries were built from (the GPU machine's copy of .git may be older).
{ git rev-parse --short HEAD; git status --porcelain --untracked-files=no | grep -q . && echo "(with uncommitted changes)"; } \
  2>/dev/null | tr '\n' ' ' > "$BUNDLE/commit.txt" || true
for b in "${binaries[@]}"; do
  strip --strip-unneeded -o "$BUNDLE/bin/$(basename "$b")" "$b"
done
if [ -n "${STRATA_GPU_AB_BASE:-}" ]; then
  mkdir -p "$BUNDLE/bin/base"
  for b in "$STRATA_GPU_AB_BASE"/*; do
    strip --strip-unneeded -o "$BUNDLE/bin/base/$(basename "$b")" "$b"
  done
fi
# Libraries present on the GPU machine (or that must come from its driver) are left out.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libstdc\+\+|libgcc_s|libcuda\.so|libcudart|libcublas|libcublasLt|libnvidia|libnccl|libprotobuf\.so\.32)'
for b in "${binaries[@]}"; do
  ldd "$b" | awk '/=>/ && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ "$name" =~ $skip ]]; then continue; fi
  cp -L "$path" "$BUNDLE/lib/$name"
  strip --strip-unneeded "$BUNDLE/lib/$name" 2>/dev/null || true
done
XZ_OPT=-6T2 tar -C "$BUNDLE" -cJf "$BUNDLE/libs.tar.xz" lib
rm -rf "$BUNDLE/lib"
# Test binaries link the CUDA kernels statically (~15 MiB each, mostly the same device code):
# pack them when they are many, in one xz stream with a dictionary larger than the binaries
# together so the copies compress to one (the full bundle's binaries: 48 -> 10 MB; single-threaded,
# ~75 s; ~2 GB of memory).
if [ "$(du -sm "$BUNDLE/bin" | cut -f1)" -gt 40 ]; then
  tar -C "$BUNDLE" -cf - bin | xz -T1 --lzma2=preset=6,dict=192MiB > "$BUNDLE/bin.tar.xz"
  rm -rf "$BUNDLE/bin"
fi
cp scripts/gpu_remote.sh "$BUNDLE/"
echo "bundled into $BUNDLE/:"
if [ -d "$BUNDLE/bin" ]; then ls -la "$BUNDLE/bin"; else tar -tJvf "$BUNDLE/bin.tar.xz"; fi
du -sh "$BUNDLE" "$BUNDLE/libs.tar.xz"
