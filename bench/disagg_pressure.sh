#!/usr/bin/env bash
# The pressure phase of bench/disagg_cpu.sh alone, for A/B runs of two builds: one prefill node
# and one decode node (one thread each) over tcp;ofi_rxm on loopback, and 6 prompts of 1,024
# tokens at 0.5 req/s into the decode node. Prints the total duration, each prompt's TTFT (s),
# and how many remote prefills passed the decoder's deadline.
#
# Usage: bench/disagg_pressure.sh [TANDEM_BINARY] [OUT_DIR]   (default build/tandem, a temp dir)
set -u
cd "$(dirname "$0")/.."
T=${1:-build/tandem}
OUT=${2:-$(mktemp -d /tmp/tandem-pressure.XXXXXX)}
mkdir -p "$OUT"
rm -f "$OUT"/*.port "$OUT"/*.addr
PIDS=""
cleanup() { [ -n "$PIDS" ] && kill -TERM $PIDS 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
wait_file() { for _ in $(seq 1 600); do [ -s "$1" ] && return 0; sleep 0.1; done; echo "timeout: $1" >&2; exit 1; }
"$T" serve --port 0 --port-file "$OUT/prefill.port" --role prefill --threads 1 \
    --xfer-addr-file "$OUT/prefill.addr" >"$OUT/prefill.log" 2>&1 &
PIDS="$PIDS $!"
wait_file "$OUT/prefill.addr"
"$T" serve --port 0 --port-file "$OUT/decode.port" --role decode --threads 1 \
    --prefill-peers "@$OUT/prefill.addr" >"$OUT/decode.log" 2>&1 &
PIDS="$PIDS $!"
wait_file "$OUT/decode.port"
"$T" bench serve --url "http://127.0.0.1:$(cat "$OUT/decode.port")" --no-progress \
    --json "$OUT/pressure.json" --token-range 100:30000 --num-prompts 6 --rate 0.5 \
    --input-len 1024 --output-len 1 >/dev/null 2>&1
cleanup
PIDS=""
python3 - "$OUT/pressure.json" "$T" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
ttft = " ".join("%.1f" % (r["ttft_ms"] / 1000) for r in j["requests"])
print(f"{sys.argv[2]}: duration {j['duration_s']:.1f} s; TTFT (s) {ttft}")
PY
echo "remote prefills past the deadline: $(grep -c 'timed out' "$OUT/decode.log")"
