#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh: packages, build, default model) and runs the main job:
# the default model answers a sample chat prompt, streamed to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PROMPT=${1:-"What is the capital of France, and why is it famous? Answer in two sentences."}
echo "--- tandem chat --prompt \"$PROMPT\""
exec build/tandem chat --prompt "$PROMPT" --max-tokens 128 --stats
