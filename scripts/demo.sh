#!/usr/bin/env bash
# The main job on one machine: installs the dependencies, builds Strata, writes a random tiny
# Llama-family model and generates text from it with the CPU reference engine.
# Usage: scripts/demo.sh [--preset tiny|small] [--prompt TEXT] [--max-tokens N]
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=tiny
PROMPT="The quick brown fox"
MAX_TOKENS=48
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) PRESET="$2"; shift 2 ;;
    --prompt) PROMPT="$2"; shift 2 ;;
    --max-tokens) MAX_TOKENS="$2"; shift 2 ;;
    *) echo "demo.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
scripts/install_deps.sh
scripts/build.sh
BIN=build/bin/strata
MODEL_DIR="out/models/llama-$PRESET"
if [ ! -f "$MODEL_DIR/config.json" ]; then
  "$BIN" make-model --arch llama --preset "$PRESET" --out "$MODEL_DIR"
fi
echo "== strata generate --model $MODEL_DIR --prompt \"$PROMPT\" --max-tokens $MAX_TOKENS" >&2
"$BIN" generate --model "$MODEL_DIR" --prompt "$PROMPT" --max-tokens "$MAX_TOKENS" --seed 1 --temperature 0.8
echo
