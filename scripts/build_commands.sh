# shellcheck shell=bash
# Sourced by the scripts that rerun a configured build's own commands with other inputs or
# outputs (cuda_kernel_sizes.sh, build_variant.sh). Defines:
#   build_commands BUILD_DIR [TARGET]  ninja's commands for TARGET (default: every target);
#                                      fails where ninja knows no such target
#   compile_command CMDS SOURCE        the command among CMDS that compiles SOURCE (a path of the
#                                      tree), without its dependency-file flags (-MD -MT x -MF y),
#                                      so that a rerun writes no .d file; nothing if none does
build_commands() {
  ninja -C "$1" -t commands ${2:+"$2"} 2>/dev/null
}
compile_command() {
  local abs
  abs="$(realpath "$2")"
  grep -F -- "-c $abs" <<< "$1" | head -1 | sed -E 's# -MD -MT [^ ]+ -MF [^ ]+##' || true
}
