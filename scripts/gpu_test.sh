#!/usr/bin/env bash
# Builds (or takes prebuilt) and runs every GPU test and the GPU benchmark on a machine with an
# NVIDIA GPU (Hopper, sm_90a):
#   1. tests/backend/test_backend_ops     every op of every backend (CPU ISAs, CUDA) against references
#   2. tests/backend_cuda/test_cuda_engine  engine logits CUDA vs CPU, graphs vs op by op
#   2b. tests/backend_cuda/test_cuda_sample sampling on the GPU vs the host sampler
#   3. compute-sanitizer memcheck on the op test (on a second GPU when there is one, alongside)
#   4. tandem bench model --backend cuda    for the llama-3.1-8b and llama-3.2-1b shapes, then the
#      8B shape with Q4_K and Q8_0 blocks, with --verify 4, and with --batch-invariant
#   5. with TANDEM_GPU_TEST_MODEL=PATH: greedy `tandem generate` on CPU and GPU, 8 prompts, and
#      on the GPU with --tp 2 against --tp 1; then `bench model --backend cuda --tp 2`
#   6. with TANDEM_GPU_TEST_MODEL: `tandem serve --backend cuda --batch-invariant` with
#      --overlap off, then on, then on with a 40-page pool (it preempts): 24 concurrent requests
#      (greedy, seeded sampling, penalties, a JSON grammar, logprobs) answered with the same
#      bytes, steps overlapped, pages back at baseline
#   disagg: scripts/gpu_test.sh disagg [PREBUILT_DIR] [MODEL] runs only the disaggregation check
#   (bench/gpu_disagg_check.py): a prefill node on GPU 0 and a decode node on GPU 1 (both on GPU
#   0 when there is one), their answers against a colocated CUDA server's, then the failure cases.
#   MODEL: default $TANDEM_GPU_TEST_MODEL, else a tiny random GGUF made with the test tools.
# Usage: scripts/gpu_test.sh [PREBUILT_DIR]
#   PREBUILT_DIR holds bin/ (tandem, test_backend_ops, test_cuda_engine, test_cuda_sample) and lib/ (shared libraries
#   the binaries need that the GPU machine lacks), for machines without the build dependencies;
#   without it the script builds into build-gpu/ with CMake.
# TANDEM_GPU_TEST_NO_MEMCHECK=1 skips step 3 (on one GPU it runs first, for minutes), and
# TANDEM_GPU_TEST_NO_BENCH=1 step 4 (minutes; it says so in the summary).
# Logs go to $OUT (or ./gpu-test-logs); the summary is printed last. Exit status: 0 when all
# tests pass and the benchmark ran.
set -u -o pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-$PWD/gpu-test-logs}
mkdir -p "$LOGS"
MODE=all
if [ "${1:-}" = disagg ]; then
    MODE=disagg
    shift
fi
if [ $# -ge 1 ]; then
    BIN=$1/bin
    export LD_LIBRARY_PATH="$(cd "$1" && pwd)/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    TANDEM=$BIN/tandem
    OPS=$BIN/test_backend_ops
    ENG=$BIN/test_cuda_engine
    SMP=$BIN/test_cuda_sample
else
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -G Ninja >"$LOGS/cmake.log" 2>&1 &&
        cmake --build build-gpu >>"$LOGS/cmake.log" 2>&1 || {
        tail -30 "$LOGS/cmake.log"
        exit 1
    }
    TANDEM=build-gpu/tandem
    OPS=build-gpu/tests/test_backend_ops
    ENG=build-gpu/tests/test_cuda_engine
    SMP=build-gpu/tests/test_cuda_sample
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    >"$LOGS/gpus.txt" 2>&1
cat "$LOGS/gpus.txt"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
status=0
summary=""

if [ "$MODE" = disagg ]; then
    MODEL=${2:-${TANDEM_GPU_TEST_MODEL:-}}
    if [ -z "$MODEL" ]; then # a small random llama; needs the test tools' Python packages
        MODEL=$LOGS/disagg.gguf
        (cd tests && ../.venv/bin/python -c "
from lib.checkpoints import make_gguf_checkpoint
make_gguf_checkpoint('$MODEL', 'llama', wtype='F16', seed=31, hidden_size=256,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     intermediate_size=512, num_hidden_layers=4, max_position_embeddings=4096)
") || { echo "cannot make the test model: give MODEL or TANDEM_GPU_TEST_MODEL"; exit 1; }
    fi
    DEC=0
    [ "$NGPU" -ge 2 ] && DEC=1
    python3 bench/gpu_disagg_check.py "$TANDEM" "$MODEL" --prefill-gpu 0 --decode-gpu "$DEC" \
        2>&1 | tee "$LOGS/disagg.log"
    exit "${PIPESTATUS[0]}"
fi

# memcheck runs on the last GPU, in the background, when there are two or more
SAN_PID=""
if [ "${TANDEM_GPU_TEST_NO_MEMCHECK:-0}" = 1 ]; then
    echo "memcheck skipped (TANDEM_GPU_TEST_NO_MEMCHECK=1)" >"$LOGS/memcheck.log"
elif command -v compute-sanitizer >/dev/null; then
    SAN_DEV=0
    [ "$NGPU" -ge 2 ] && SAN_DEV=$((NGPU - 1))
    (CUDA_VISIBLE_DEVICES=$SAN_DEV timeout 300 compute-sanitizer --tool memcheck --leak-check full \
        --error-exitcode 9 "$OPS" >"$LOGS/memcheck.log" 2>&1; echo $? >"$LOGS/memcheck.rc") &
    SAN_PID=$!
    [ "$NGPU" -ge 2 ] || wait $SAN_PID
else
    echo "compute-sanitizer not found" >"$LOGS/memcheck.log"
    echo 127 >"$LOGS/memcheck.rc"
fi

for t in "$OPS" "$ENG" "$SMP"; do
    name=$(basename "$t")
    CUDA_VISIBLE_DEVICES=0 timeout 400 "$t" >"$LOGS/$name.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    summary+="$name: rc=$rc $(grep -E 'PASSED|FAILED' "$LOGS/$name.log" | tr '\n' ' ')"$'\n'
    grep -E "^cpu vs|^cuda op|^gpu vs|^sampling time|SKIP" "$LOGS/$name.log" | head -30
done

if [ "${TANDEM_GPU_TEST_NO_BENCH:-0}" = 1 ]; then
    summary+="bench model skipped (TANDEM_GPU_TEST_NO_BENCH=1)"$'\n'
else
    for shape in llama-3.1-8b llama-3.2-1b; do
        CUDA_VISIBLE_DEVICES=0 timeout 300 "$TANDEM" bench model --backend cuda --shape $shape \
            >"$LOGS/bench-$shape.log" 2>&1
        rc=$?
        [ $rc -ne 0 ] && status=1
        cat "$LOGS/bench-$shape.log"
    done
    # GGUF blocks on the device, the cost of verifying 5 tokens, and --batch-invariant
    for extra in "--weights q4_k" "--weights q8_0" "--verify 4" "--batch-invariant --verify 4"; do
        name=$(echo "$extra" | tr -d ' -')
        CUDA_VISIBLE_DEVICES=0 timeout 300 "$TANDEM" bench model --backend cuda --shape llama-3.1-8b \
            --batches 1,8,64 $extra >"$LOGS/bench-8b-$name.log" 2>&1
        rc=$?
        [ $rc -ne 0 ] && status=1
        cat "$LOGS/bench-8b-$name.log"
    done
fi

# a real checkpoint end to end (tokenizer, quantised weights dequantised at load, sampler):
# greedy tokens from `tandem generate` on the CPU and on the GPU, prompt by prompt
if [ -n "${TANDEM_GPU_TEST_MODEL:-}" ]; then
    same=0
    total=0
    same_tp=0
    while IFS= read -r prompt; do
        a=$("$TANDEM" generate --model "$TANDEM_GPU_TEST_MODEL" --prompt "$prompt" --max-tokens 32 \
            --temperature 0 --print-token-ids --exact-activations 2>/dev/null | tail -1)
        b=$(CUDA_VISIBLE_DEVICES=0 "$TANDEM" generate --backend cuda --model "$TANDEM_GPU_TEST_MODEL" \
            --prompt "$prompt" --max-tokens 32 --temperature 0 --print-token-ids 2>/dev/null | tail -1)
        # tensor parallelism: two ranks (a GPU each over NCCL, or sharing GPU 0) against one
        c=$("$TANDEM" generate --backend cuda --tp 2 --model "$TANDEM_GPU_TEST_MODEL" \
            --prompt "$prompt" --max-tokens 32 --temperature 0 --print-token-ids 2>>"$LOGS/tp.log" |
            tail -1)
        total=$((total + 1))
        if [ -n "$a" ] && [ "$a" = "$b" ]; then same=$((same + 1)); else
            printf 'differs: %s\n  cpu:  %s\n  cuda: %s\n' "$prompt" "$a" "$b" >>"$LOGS/generate.log"
        fi
        if [ -n "$b" ] && [ "$b" = "$c" ]; then same_tp=$((same_tp + 1)); else
            printf 'differs: %s\n  --tp 1: %s\n  --tp 2: %s\n' "$prompt" "$b" "$c" >>"$LOGS/tp.log"
        fi
    done <<'EOF_PROMPTS'
The capital of France is
def fibonacci(n):
Once upon a time, in a small village,
The three primary colours are
Explain why the sky is blue.
SELECT name FROM users WHERE
1, 2, 3, 5, 8, 13,
Translate to French: good morning
EOF_PROMPTS
    summary+="generate cpu vs cuda (greedy, 32 tokens): $same/$total prompts identical"$'\n'
    summary+="generate cuda --tp 1 vs --tp 2 (greedy, 32 tokens): $same_tp/$total prompts identical"
    summary+=" ($(grep -m1 -o 'ranks on GPUs.*' "$LOGS/tp.log"))"$'\n'
    [ $((2 * same_tp)) -ge "$total" ] || status=1 # greedy near-ties may flip a few
    "$TANDEM" bench model --backend cuda --model "$TANDEM_GPU_TEST_MODEL" --tp 2 --batches 1,64 \
        --prompt-len 1024 --gen 32 >"$LOGS/bench-tp2.log" 2>&1 || status=1
    summary+="bench --tp 2: $(grep -E '^  decode +1 ' "$LOGS/bench-tp2.log" | head -1)"$'\n'
fi

# 6. the overlap scheduler changes nothing in the output (batch-invariant, so the batches that
# concurrent requests fall into do not matter either)
overlap_round() { # name, serve's flags: writes $LOGS/overlap_NAME_I.json and overlap_NAME.metrics
    local name=$1 port_file=$LOGS/overlap.port pid i pids=()
    shift
    rm -f "$port_file"
    CUDA_VISIBLE_DEVICES=0 "$TANDEM" serve --backend cuda --model "$TANDEM_GPU_TEST_MODEL" \
        --batch-invariant "$@" --port 0 --port-file "$port_file" \
        >"$LOGS/overlap_$name.log" 2>&1 &
    pid=$!
    for i in $(seq 1 240); do [ -s "$port_file" ] && break; sleep 0.5; done
    local url=http://127.0.0.1:$(cat "$port_file" 2>/dev/null)
    for i in $(seq 1 24); do
        local t=0 x=""
        [ $((i % 3)) -eq 0 ] && t=0.8
        [ $((i % 4)) -eq 1 ] && x=',"frequency_penalty":0.5,"presence_penalty":0.3'
        [ $((i % 4)) -eq 3 ] && x=',"response_format":{"type":"json_object"}'
        curl -s -m 120 "$url/v1/completions" -H 'content-type: application/json' -d \
            "{\"prompt\":[$((100 + i)),$((200 + 3 * i)),$((300 + 7 * i)),42,43],\"max_tokens\":$((24 + 2 * i)),\"temperature\":$t,\"seed\":$i,\"ignore_eos\":true,\"logprobs\":1$x}" |
            sed -E 's/"id":"[^"]*"//; s/"created":[0-9]+//' >"$LOGS/overlap_${name}_$i.json" &
        pids+=($!)
    done
    wait "${pids[@]}"
    sleep 0.5
    curl -s "$url/metrics" >"$LOGS/overlap_$name.metrics"
    kill -TERM $pid
    for i in $(seq 1 40); do kill -0 $pid 2>/dev/null || break; sleep 0.25; done
    kill -KILL $pid 2>/dev/null && echo "serve ($name) did not stop on SIGTERM" >>"$LOGS/overlap_$name.log"
    wait $pid
}
if [ -n "${TANDEM_GPU_TEST_MODEL:-}" ]; then
    overlap_round off --overlap off
    overlap_round on --overlap on
    # a pool too small for the 24 at once (about 5 pages each): preemption with steps in flight
    overlap_round small --overlap on --kv-pages 40
    for name in on small; do
        differ=0
        for i in $(seq 1 24); do
            [ -s "$LOGS/overlap_${name}_$i.json" ] &&
                cmp -s "$LOGS/overlap_off_$i.json" "$LOGS/overlap_${name}_$i.json" ||
                differ=$((differ + 1))
        done
        metric() { grep -E "^$1[{ ]" "$LOGS/overlap_$name.metrics" | awk '{print $2}'; }
        ov=$(metric tandem_sched_overlapped_steps_total)
        used=$(metric tandem_kv_pages_used)
        held=$(metric tandem_kv_pages_in_flight)
        pre=$(metric tandem_preemptions_total)
        summary+="serve --overlap on$([ $name = small ] && echo ' --kv-pages 40') vs off "
        summary+="(--batch-invariant, 24 requests): $differ differ; overlapped steps ${ov:-?}; "
        summary+="preemptions ${pre:-?}; pages used ${used:-?}, in flight ${held:-?}"$'\n'
        if [ "$differ" != 0 ] || [ "${ov:-0}" = 0 ] || [ "${used:-1}" != 0 ] ||
            [ "${held:-1}" != 0 ] || { [ $name = small ] && [ "${pre:-0}" = 0 ]; }; then
            status=1
        fi
    done
fi

if [ -n "$SAN_PID" ]; then
    wait $SAN_PID
    src=$(cat "$LOGS/memcheck.rc" 2>/dev/null || echo "?")
    summary+="memcheck test_backend_ops: rc=$src $(grep -E 'ERROR SUMMARY' "$LOGS/memcheck.log")"$'\n'
    [ "$src" = 0 ] || status=1
fi
echo "==== summary"
printf '%s' "$summary"
exit $status
