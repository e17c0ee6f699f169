#!/usr/bin/env bash
# Speculative decoding on an NVIDIA GPU (the CUDA backend), end to end with a real checkpoint:
#   1. exact acceptance against no speculation: `tandem generate --print-token-ids` over eight
#      prompts and four sampling settings (greedy; T 0.8 seed 3; T 0.8 with top-k, top-p and
#      penalties; T 1.2 with min-p), for --spec self and --spec draft, counting the prompts whose
#      token ids are identical. The CUDA backend is not batch-invariant (cuBLASLt chooses its
#      algorithm by shape, and a verify pass has k + 1 rows), so a row's logits may move in the
#      last bits and a draw near a boundary may differ; the count says how often;
#   2. rejection acceptance runs (its drafts' distributions stay on the device) and reports τ;
#   3. the memory plan of `--spec draft` (the draft's weights and scratch held back before the
#      KV pool is sized);
#   4. `tandem bench spec --backend cuda` for self-draft and the draft model, at batch 1, 4, 16.
# Usage: scripts/gpu_spec.sh TANDEM MODEL DRAFT   (logs to $OUT, or ./gpu-spec-logs)
# Exit status: 0 when every command ran (identity counts are reported, not asserted: see 1).
set -u -o pipefail
TANDEM=$1
MODEL=$2
DRAFT=$3
LOGS=${OUT:-$PWD/gpu-spec-logs}
mkdir -p "$LOGS"
cd "$(dirname "$0")/.."
status=0
summary=""
gen() { # prints the token ids of one generation (the last line), stats to $LOGS/last.err
    CUDA_VISIBLE_DEVICES=0 timeout 120 "$TANDEM" generate --backend cuda --model "$MODEL" \
        --max-tokens 48 --print-token-ids "$@" 2>"$LOGS/last.err" | tail -1
}
PROMPTS=("The capital of France is" "def fibonacci(n):" "Once upon a time, in a small village,"
    "The three primary colours are" "Explain why the sky is blue." "SELECT name FROM users WHERE"
    "1, 2, 3, 5, 8, 13," "Translate to French: good morning")
SETTINGS=("--temperature 0" "--temperature 0.8 --seed 3"
    "--temperature 0.8 --seed 5 --top-k 40 --top-p 0.9 --repetition-penalty 1.2 --presence-penalty 0.4 --frequency-penalty 0.3"
    "--temperature 1.2 --seed 7 --min-p 0.05")
for spec in "--spec self --spec-self-layers 3" "--spec draft --spec-draft $DRAFT"; do
    for set in "${SETTINGS[@]}"; do
        same=0
        total=0
        for p in "${PROMPTS[@]}"; do
            # shellcheck disable=SC2086
            a=$(gen --prompt "$p" $set)
            # shellcheck disable=SC2086
            b=$(gen --prompt "$p" $set $spec --spec-accept exact --spec-stats)
            rc=$?
            [ $rc -ne 0 ] && status=1
            tail -1 "$LOGS/last.err" >>"$LOGS/stats.jsonl"
            total=$((total + 1))
            if [ -n "$a" ] && [ "$a" = "$b" ]; then same=$((same + 1)); else
                printf '%s | %s | %s\n  none: %s\n  spec: %s\n' "$spec" "$set" "$p" "$a" "$b" \
                    >>"$LOGS/differs.log"
            fi
        done
        summary+="exact, $spec, $set: $same/$total prompts identical to no speculation"$'\n'
    done
    # shellcheck disable=SC2086
    gen --prompt "Explain why the sky is blue." --temperature 0.8 --seed 3 $spec \
        --spec-accept rejection --spec-stats >/dev/null
    rc=$?
    [ $rc -ne 0 ] && status=1
    summary+="rejection, $spec, T 0.8: rc=$rc $(tail -1 "$LOGS/last.err")"$'\n'
done
# the memory plan with a draft model
CUDA_VISIBLE_DEVICES=0 timeout 120 "$TANDEM" generate --backend cuda --model "$MODEL" \
    --prompt "hi" --max-tokens 4 --spec draft --spec-draft "$DRAFT" --spec-accept rejection \
    >/dev/null 2>"$LOGS/plan.err"
summary+="memory plan: $(grep -o 'cuda memory plan.*' "$LOGS/plan.err" | head -1)"$'\n'
for spec in "--spec self --spec-self-layers 3" "--spec draft --spec-draft $DRAFT"; do
    for T in 0 0.8; do
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=0 timeout 300 "$TANDEM" bench spec --backend cuda --model "$MODEL" \
            --prompts bench/prompts/chat50.jsonl --limit 16 --max-tokens 64 --seed 1 \
            --batch 1,4,16 --temperature $T $spec --spec-k auto,2 --json \
            >>"$LOGS/bench_spec.jsonl" 2>>"$LOGS/bench_spec.err"
        rc=$?
        [ $rc -ne 0 ] && status=1
        summary+="bench spec $spec T=$T: rc=$rc"$'\n'
    done
done
echo "==== summary"
printf '%s' "$summary"
exit $status
