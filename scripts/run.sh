#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh: packages, build, default model) and runs the main job:
# starts `tandem serve` with the default model on localhost, sends a sample chat request with
# curl (streamed), prints the answer and the server's metrics summary, and stops the server.
# Set TANDEM_KEEP_SERVING=1 to leave the server running in the foreground afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

PROMPT=${1:-"What is the capital of France, and why is it famous? Answer in two sentences."}
PORT=${TANDEM_PORT:-8000}
LOG=$(mktemp /tmp/tandem-serve.XXXXXX.log)
PORT_FILE=$(mktemp -u /tmp/tandem-port.XXXXXX)

build/tandem serve --port "$PORT" --port-file "$PORT_FILE" --served-model-name smollm2 \
    >"$LOG" 2>&1 &
SERVER_PID=$!
stop_server() { kill -TERM "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null || true; }
trap stop_server EXIT

for _ in $(seq 1 600); do
    [ -s "$PORT_FILE" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$LOG"; echo "tandem serve failed" >&2; exit 1; }
    sleep 0.1
done
[ -s "$PORT_FILE" ] || { cat "$LOG"; echo "tandem serve did not start" >&2; exit 1; }
PORT=$(cat "$PORT_FILE")
URL="http://127.0.0.1:$PORT"
echo "--- tandem serve is listening on $URL ($(curl -s "$URL/health"))"

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
curl -s "$URL/metrics" | grep -E '^tandem_(time_to_first_token_seconds|inter_token_latency_seconds)_(sum|count)' || true
if [ "${TANDEM_KEEP_SERVING:-0}" = 1 ]; then
    echo "--- serving on $URL (Ctrl-C to stop)"
    trap - EXIT
    wait "$SERVER_PID"
fi
