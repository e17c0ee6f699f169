#!/usr/bin/env bash
# Speculative decoding on this machine's CPU, on the default model, with `tandem bench spec`:
# the self drafter at N = 4, 8, 12 layers and the model drafting for itself (N = 30, the upper
# bound of acceptance), at T = 0 and T = 0.8, in both acceptance modes, at batch 1, 4 and 16,
# adaptive k against fixed k = 1 and 2; then rejection with the one-hot q (vLLM's default)
# against the full q. Each output line is one `bench spec --json` object.
# Usage: bench/spec_cpu.sh [OUT.jsonl]   (TANDEM_BIN, LIMIT, MAX_TOKENS, LAYERS override)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TANDEM_BIN:-build/tandem}
OUT=${1:-/dev/stdout}
LIMIT=${LIMIT:-16}
MAXT=${MAX_TOKENS:-48}
run() {
    "$BIN" bench spec --prompts bench/prompts/chat50.jsonl --limit "$LIMIT" --max-tokens "$MAXT" \
        --seed 1 --spec self "$@" --json
}
{
    for N in ${LAYERS:-30 12 8 4}; do
        for T in 0 0.8; do
            for A in exact rejection; do
                run --batch 1,4,16 --temperature "$T" --spec-self-layers "$N" --spec-accept "$A" \
                    --spec-k auto,1,2
            done
        done
    done
    for N in 30 28; do
        run --batch 1 --temperature 0.8 --spec-self-layers "$N" --spec-accept rejection --spec-k 2
        run --batch 1 --temperature 0.8 --spec-self-layers "$N" --spec-accept rejection --spec-k 2 \
            --q-one-hot
    done
} > "$OUT"
