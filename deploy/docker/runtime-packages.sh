#!/usr/bin/env bash
# Prints, one per line, the Debian packages that own the shared libraries a binary links (ldd +
# dpkg -S), so a runtime image can install exactly those without the -dev packages.
# Libraries no package owns (the CUDA driver stub, the dynamic loader) are skipped, and a line on
# stderr names each. Usage: runtime-packages.sh BINARY
set -euo pipefail
bin="${1:?usage: runtime-packages.sh BINARY}"
ldd "$bin" | awk '/=> \// { print $3 }' | while read -r lib; do
  real="$(readlink -f "$lib")"
  if pkg="$(dpkg -S "$lib" 2>/dev/null || dpkg -S "$real" 2>/dev/null)"; then
    echo "${pkg%%:*}"
  else
    echo "runtime-packages: no package owns $lib" >&2
  fi
done | sort -u
