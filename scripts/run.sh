#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh: packages, build, default model) and runs the main job:
# disaggregated serving on localhost with the default model:
#   - a prefill node  (tandem serve --role prefill): computes prompt KV and streams it, layer by
#     layer, over libfabric (tcp;ofi_rxm) into pages the decode node reserved; it also runs the
#     shipped speculation head over the prompt and streams the head's KV as one more layer;
#   - a decode node   (tandem serve --role decode): the OpenAI API; it sends prompts to the
#     prefill node, waits for the KV to land, then decodes, speculating with the shipped head
#     (--spec mtp: the head beside the model, trained by scripts/train_head.sh) from its first
#     step; the controller chooses k, and keeps it at 0 where drafting does not pay;
#   - a router        (tandem router): the public entry point over the decode node(s).
# A sample chat request goes through the router with curl (streamed), then every process is
# stopped by PID. TANDEM_KEEP_SERVING=1 leaves them running until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

PROMPT=${1:-"What is the capital of France, and why is it famous? Answer in two sentences."}
RUN=$(mktemp -d /tmp/tandem-run.XXXXXX)
PIDS=()
stop_all() {
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_all EXIT

# wait_file FILE PID LOG: waits until FILE is written by the process, or fails with its log
wait_file() {
    for _ in $(seq 1 600); do
        [ -s "$1" ] && return 0
        kill -0 "$2" 2>/dev/null || { cat "$3"; echo "a tandem process failed to start" >&2; exit 1; }
        sleep 0.1
    done
    cat "$3"; echo "a tandem process did not start in 60 s" >&2; exit 1
}

build/tandem serve --role prefill --port 0 --port-file "$RUN/prefill.port" \
    --xfer-addr-file "$RUN/prefill.addr" --spec mtp >"$RUN/prefill.log" 2>&1 &
PIDS+=($!)
wait_file "$RUN/prefill.port" "${PIDS[-1]}" "$RUN/prefill.log"
echo "--- prefill node: $(grep -o 'fabric address .*' "$RUN/prefill.log")"

build/tandem serve --role decode --prefill-peers "@$RUN/prefill.addr" --port 0 \
    --port-file "$RUN/decode.port" --served-model-name smollm2 \
    --spec mtp >"$RUN/decode.log" 2>&1 &
PIDS+=($!)
wait_file "$RUN/decode.port" "${PIDS[-1]}" "$RUN/decode.log"
DECODE="http://127.0.0.1:$(cat "$RUN/decode.port")"
echo "--- decode node: $DECODE ($(grep -o 'speculation head .*' "$RUN/decode.log" | head -1))"

build/tandem router --backends "$DECODE" --port "${TANDEM_PORT:-0}" \
    --port-file "$RUN/router.port" >"$RUN/router.log" 2>&1 &
PIDS+=($!)
wait_file "$RUN/router.port" "${PIDS[-1]}" "$RUN/router.log"
URL="http://127.0.0.1:$(cat "$RUN/router.port")"
echo "--- router: $URL ($(curl -s "$URL/health"))"

BODY=$(python3 -c 'import json,sys; print(json.dumps({"model": "smollm2", "stream": True,
    "max_tokens": 128, "temperature": 0, "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": sys.argv[1]}]}))' "$PROMPT")
echo "--- curl $URL/v1/chat/completions  (user: $PROMPT)"
curl -sN "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d "$BODY" |
    python3 -c '
import json, sys
for line in sys.stdin:
    if not line.startswith("data: ") or line.startswith("data: [DONE]"):
        continue
    ev = json.loads(line[6:])
    if "error" in ev:
        sys.exit("error: " + ev["error"]["message"])
    for c in ev["choices"]:
        print(c["delta"].get("content") or "", end="", flush=True)
    if ev.get("usage"):
        u = ev["usage"]
        print("\n--- usage: %d prompt + %d completion tokens"
              % (u["prompt_tokens"], u["completion_tokens"]))
'
echo "--- the prompt's KV came from the prefill node:"
curl -s "$DECODE/metrics" | grep -E '^tandem_disagg_(remote_prefills_total|kv_landed_seconds_(sum|count))' || true
echo "--- speculation on the decode node:"
curl -s "$DECODE/metrics" | python3 -c '
import sys
m = {}
for line in sys.stdin:
    if line.startswith("tandem_spec_") and " " in line:
        k, v = line.rsplit(" ", 1)
        m[k] = float(v)
steps = m.get("tandem_spec_tokens_per_step_count", 0)
tau = m.get("tandem_spec_tokens_per_step_sum", 0) / steps if steps else 1.0
print("tau %.3f tokens per target step over %d decode steps; %d tokens drafted, %d kept"
      % (tau, steps, m.get("tandem_spec_drafted_tokens_total", 0),
         m.get("tandem_spec_accepted_tokens_total", 0)))
'
if [ "${TANDEM_KEEP_SERVING:-0}" = 1 ]; then
    echo "--- serving on $URL (Ctrl-C to stop)"
    wait
fi
