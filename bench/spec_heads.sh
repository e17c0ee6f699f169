#!/usr/bin/env bash
# The speculation head on this machine's CPU, on the default model, with `tandem bench spec`
# on the 50 chat prompts of bench/prompts/chat50.jsonl (none of them in the head's training
# set: scripts/make_mtp_prompts.py leaves their topics out): the chain (--spec mtp) at
# k = 1..5 and the tree (--spec eagle) at budgets 8, 16 and 32, at T = 0 and T = 0.8, in both
# acceptance modes, at batch 1 and 4. Each output line is one `bench spec --json` object.
# Usage: bench/spec_heads.sh [OUT.jsonl]   (TANDEM_BIN, HEAD, LIMIT, MAX_TOKENS override;
# HEAD defaults to the shipped head beside the default model)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TANDEM_BIN:-build/tandem}
OUT=${1:-/dev/stdout}
LIMIT=${LIMIT:-50}
MAXT=${MAX_TOKENS:-64}
HEAD_ARGS=()
[ -n "${HEAD:-}" ] && HEAD_ARGS=(--spec-draft "$HEAD")
run() {
    "$BIN" bench spec --prompts bench/prompts/chat50.jsonl --limit "$LIMIT" --max-tokens "$MAXT" \
        --seed 1 "${HEAD_ARGS[@]}" "$@" --json
}
{
    for T in 0 0.8; do
        for A in exact rejection; do
            [ "$T" = 0 ] && [ "$A" = rejection ] && continue # greedy: rejection is exact
            run --batch 1,4 --temperature "$T" --spec mtp --spec-accept "$A" --spec-k 1,2,3,4,5
            run --batch 1,4 --temperature "$T" --spec eagle --spec-accept "$A" --spec-k 4 \
                --spec-tree-budget 8,16,32
        done
    done
} >"$OUT"
