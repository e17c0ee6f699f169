#!/usr/bin/env bash
# Colocated against disaggregated serving on the CPU, with the default model, on this machine.
#
#   1. TTFT by prompt length (one request at a time): colocated (`--role both`, all cores) against
#      1 prefill + 1 decode process (half the cores each). For the disaggregated run it also
#      prints the decoder's send-to-landed time per request, and the mean layer lag: the time
#      from a layer finishing on the prefill node to its pages landing on the decoder, i.e. one
#      layer's transfer, which is all of the transfer that layer streaming leaves exposed.
#   2. ITL under a mixed workload: 4 streams decode 128 tokens each while 1,024-token prompts
#      arrive at 0.5 req/s; ITL p50/p99 of the decoding streams, colocated against 1P + 1D, and
#      idle ITL (no long prompts) for reference.
#
# Usage: bench/disagg_cpu.sh [OUT_DIR]   (needs build/tandem; scripts/setup.sh builds it)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d /tmp/tandem-disagg-bench.XXXXXX)}
mkdir -p "$OUT"
T=${TANDEM_BIN:-build/tandem}
CORES=$(nproc)
HALF=$(( CORES / 2 > 0 ? CORES / 2 : 1 ))
# Server PIDs go to a file: start() runs inside $(...), a subshell, so an array would lose them
# (and the servers would outlive the script, loading the machine for every later run).
PIDFILE="$OUT/pids"
: >"$PIDFILE"
cleanup() {
    while read -r p; do kill -TERM "$p" 2>/dev/null || true; done <"$PIDFILE"
    while read -r p; do
        for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null || true
    done <"$PIDFILE"
    : >"$PIDFILE"
}
trap cleanup EXIT

wait_file() { for _ in $(seq 1 600); do [ -s "$1" ] && return 0; sleep 0.1; done; echo "timeout: $1" >&2; exit 1; }
start() { # name args...
    local name=$1; shift
    "$T" serve --port 0 --port-file "$OUT/$name.port" "$@" >"$OUT/$name.log" 2>&1 &
    echo $! >>"$PIDFILE"
    wait_file "$OUT/$name.port"
    echo "http://127.0.0.1:$(cat "$OUT/$name.port")"
}
stop_all() { cleanup; rm -f "$OUT"/*.port "$OUT"/*.addr; }
metric() { curl -s "$1/metrics" | awk -v m="$2" '$1 == m {print $2}'; }
bench() { # url json args...
    local url=$1 json=$2; shift 2
    "$T" bench serve --url "$url" --no-progress --json "$json" --token-range 100:30000 "$@" >/dev/null
}
stat() { python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print('%.1f' % s[sys.argv[2]][sys.argv[3]])" "$@"; }

LENS="64 256 1024"
echo "# TTFT by prompt length (ms, p50 of 5 requests, 1 output token)" | tee "$OUT/summary.txt"

COLO=$(start colo --threads "$CORES")
for L in $LENS; do
    bench "$COLO" "$OUT/colo_ttft_$L.json" --num-prompts 5 --concurrency 1 --input-len "$L" --output-len 2
done
stop_all

start prefill --role prefill --threads "$HALF" --xfer-addr-file "$OUT/prefill.addr" >/dev/null
wait_file "$OUT/prefill.addr"
PREFILL="http://127.0.0.1:$(cat "$OUT/prefill.port")"
DEC=$(start decode --role decode --threads "$HALF" --prefill-peers "@$OUT/prefill.addr")
for L in $LENS; do
    l0=$(metric "$DEC" tandem_disagg_kv_landed_seconds_sum)
    bench "$DEC" "$OUT/dis_ttft_$L.json" --num-prompts 5 --concurrency 1 --input-len "$L" --output-len 2
    l1=$(metric "$DEC" tandem_disagg_kv_landed_seconds_sum)
    echo "$L $(python3 -c "print(($l1 - $l0) / 5 * 1000)")" >>"$OUT/landed_ms.txt"
done
{
    printf "%-8s %12s %14s %16s\n" "prompt" "colocated" "disaggregated" "send->landed"
    for L in $LENS; do
        printf "%-8s %12s %14s %16s\n" "$L" "$(stat "$OUT/colo_ttft_$L.json" ttft_ms p50)" \
            "$(stat "$OUT/dis_ttft_$L.json" ttft_ms p50)" \
            "$(awk -v l="$L" '$1 == l {printf "%.1f", $2}' "$OUT/landed_ms.txt")"
    done
    echo
    echo "prefill node: $(metric "$PREFILL" tandem_disagg_writes_total) writes," \
         "$(metric "$PREFILL" tandem_disagg_write_bytes_total) bytes," \
         "$(metric "$PREFILL" tandem_disagg_writes_landed_during_forward_total) landed during the forward;" \
         "one layer's transfer (layer lag) mean $(python3 -c "print('%.2f ms' % (1000 * $(metric "$PREFILL" tandem_disagg_layer_lag_seconds_sum) / max(1, $(metric "$PREFILL" tandem_disagg_layer_lag_seconds_count))))")"
} | tee -a "$OUT/summary.txt"

mixed() { # url tag
    bench "$1" "$OUT/$2_idle.json" --num-prompts 4 --concurrency 4 --input-len 32 --output-len 128
    bench "$1" "$OUT/$2_pressure.json" --num-prompts 6 --rate 0.5 --input-len 1024 --output-len 1 \
        --seed 7 &
    local bg=$!
    bench "$1" "$OUT/$2_mixed.json" --num-prompts 8 --concurrency 4 --input-len 32 --output-len 128 \
        --seed 3
    wait $bg
}
mixed "$DEC" dis
stop_all
COLO=$(start colo --threads "$CORES")
mixed "$COLO" colo
stop_all

{
    echo
    echo "# ITL of 4 decoding streams (ms): idle, and with 1,024-token prompts arriving at 0.5 req/s"
    printf "%-14s %9s %9s %11s %11s\n" "" "idle p50" "idle p99" "mixed p50" "mixed p99"
    for tag in colo dis; do
        printf "%-14s %9s %9s %11s %11s\n" "$([ $tag = colo ] && echo colocated || echo '1P + 1D')" \
            "$(stat "$OUT/${tag}_idle.json" itl_ms p50)" "$(stat "$OUT/${tag}_idle.json" itl_ms p99)" \
            "$(stat "$OUT/${tag}_mixed.json" itl_ms p50)" "$(stat "$OUT/${tag}_mixed.json" itl_ms p99)"
    done
    echo "(cores: $CORES; colocated uses $CORES threads, prefill and decode $HALF each)"
} | tee -a "$OUT/summary.txt"
echo "results in $OUT"
