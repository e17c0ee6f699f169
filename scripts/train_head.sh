#!/usr/bin/env bash
# The recipe of the shipped head (heads/SmolLM2-135M-Instruct.Q4_1.mtp.safetensors): trains a
# speculation head for the default model with `tandem train-mtp` on the built-in prompt set
# (data/mtp_prompts.jsonl, from scripts/make_mtp_prompts.py) and a fixed seed. docs/HEADS.md
# has the numbers it gave; bench/RESULTS.md its tau. With 2 threads the run repeats the shipped
# head's steps exactly (the sums are split by thread count).
#
#   scripts/train_head.sh OUT.safetensors [extra train-mtp options...]
#
# TANDEM (default build/tandem) and TANDEM_MODEL (default: the default model) choose the binary
# and the target. With a GPU, add `--backend cuda`: the target's continuations and features
# are then made on the GPU (the training itself runs on the CPU's cores).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/train_head.sh OUT.safetensors [options]}
shift
exec "${TANDEM:-build/tandem}" train-mtp --out "$OUT" \
    --gen-temperature 0 --gen-tokens 256 --gen-batch 64 --top-k-targets 32 \
    --draft-vocab 8192 --unroll 2 --unroll-decay 0.7 --reg-weight 0.5 \
    --epochs 4 --batch-rows 1024 --lr 2e-3 --min-lr-frac 0.05 --warmup 50 \
    --val-prompts 48 --val-tokens 128 --seed 1 "$@"
