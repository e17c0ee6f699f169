#!/usr/bin/env bash
# Cross-checks `tandem bench serve` against guidellm (a load tool we did not write) on the same
# server and the same workload, and prints both summaries side by side.
#
# Workload: N prompts of IN_WORDS random words (the same JSONL file for both tools), exactly OUT
# output tokens each (max_tokens + ignore_eos), C requests in flight, /v1/completions, streaming.
#
#   bench/crosscheck_guidellm.sh URL [N] [C] [IN_WORDS] [OUT]
#   e.g. bench/crosscheck_guidellm.sh http://127.0.0.1:8000 64 8 128 64
#
# Needs: build/tandem (or $TANDEM_BUILD/tandem), and guidellm in its own venv:
#   python3 -m venv .venv-guidellm && .venv-guidellm/bin/pip install guidellm==0.8.1
# Environment: TANDEM_BUILD (default build), GUIDELLM (default .venv-guidellm/bin/guidellm),
# MODEL (default: both tools ask GET /v1/models), OUT_DIR (default: a fresh temp folder).
#
# Metric names differ between the tools. Ours: TPOT = (e2e - ttft) / (n_out - 1) per request,
# ITL = every gap between streamed chunks. guidellm: "inter_token_latency" is our TPOT, and its
# "time_per_output_token" is e2e / n_out (TTFT included), which has no counterpart here.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
URL=${1:?usage: $0 URL [N] [C] [IN_WORDS] [OUT]}
N=${2:-64}
C=${3:-8}
IN_WORDS=${4:-128}
OUT=${5:-64}
TANDEM="$ROOT/${TANDEM_BUILD:-build}/tandem"
GUIDELLM=${GUIDELLM:-$ROOT/.venv-guidellm/bin/guidellm}
OUT_DIR=${OUT_DIR:-$(mktemp -d /tmp/crosscheck.XXXXXX)}
mkdir -p "$OUT_DIR"
[ -x "$TANDEM" ] || { echo "no tandem binary at $TANDEM" >&2; exit 2; }
[ -x "$GUIDELLM" ] || { echo "no guidellm at $GUIDELLM (see the header of $0)" >&2; exit 2; }

DATA="$OUT_DIR/prompts.jsonl"
python3 - "$DATA" "$N" "$IN_WORDS" "$OUT" <<'EOF'
import json, random, sys
path, n, words, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
vocab = ("time people water house world school number part place case week system group point "
         "fact river city light music story night paper table window garden market letter").split()
rng = random.Random(1234)
with open(path, "w") as f:
    for i in range(n):
        prompt = " ".join(rng.choice(vocab) for _ in range(words))
        # max_tokens is read by tandem, output_tokens_count by guidellm
        f.write(json.dumps({"prompt": prompt, "max_tokens": out, "output_tokens_count": out}) + "\n")
EOF

MODEL_ARGS=()
GL_MODEL=""
if [ -n "${MODEL:-}" ]; then
    MODEL_ARGS=(--model "$MODEL")
    GL_MODEL=",\"model\":\"$MODEL\""
fi

# Warm-up (discarded): the first requests to a fresh server pay one-off costs that would
# otherwise land on whichever tool runs first.
"$TANDEM" bench serve --url "$URL" "${MODEL_ARGS[@]}" --endpoint completions \
    --dataset "$DATA" --num-prompts "$((2 * C))" --concurrency "$C" --no-progress > /dev/null

echo "== tandem bench serve ($N requests, concurrency $C) ==" >&2
"$TANDEM" bench serve --url "$URL" "${MODEL_ARGS[@]}" --endpoint completions \
    --dataset "$DATA" --num-prompts "$N" --concurrency "$C" --rate inf \
    --json "$OUT_DIR/tandem.json" --no-progress > "$OUT_DIR/tandem.txt"

echo "== guidellm ($N requests, concurrency $C) ==" >&2
(cd "$OUT_DIR" && "$GUIDELLM" run \
    --backend "{\"kind\":\"openai_http\",\"target\":\"$URL\",\"request_format\":\"/v1/completions\"$GL_MODEL}" \
    --profile "kind=concurrent,streams=$C" \
    --constraint "kind=max_requests,count=$N" \
    --data "kind=json_file,path=$DATA" \
    --output "kind=json,path=$OUT_DIR/guidellm.json" \
    --disable-progress > "$OUT_DIR/guidellm.txt" 2>&1) || {
    echo "guidellm failed; its output is in $OUT_DIR/guidellm.txt" >&2
    tail -20 "$OUT_DIR/guidellm.txt" >&2
    exit 1
}

python3 - "$OUT_DIR/tandem.json" "$OUT_DIR/guidellm.json" <<'EOF'
import json, sys
t = json.load(open(sys.argv[1]))
g = json.load(open(sys.argv[2]))["benchmarks"][0]
gm = g["metrics"]

def gs(key, scale=1.0):
    s = gm[key]["successful"]
    p = s["percentiles"]
    return {"mean": s["mean"] * scale, "p50": p["p50"] * scale, "p90": p["p90"] * scale,
            "p99": p["p99"] * scale}

ok_g = gm["request_totals"]["successful"]
err_g = gm["request_totals"]["errored"] + gm["request_totals"]["incomplete"]
out_g = gm["output_token_count"]["successful"]["mean"] * ok_g
in_g = gm["prompt_token_count"]["successful"]["mean"] * ok_g
dur_g = g["duration"]
rows = [
    ("requests ok / failed", f"{t['completed']} / {t['failed']}", f"{ok_g} / {err_g}"),
    ("input tokens (usage)", f"{t['total_input_tokens']}", f"{in_g:.0f}"),
    ("output tokens", f"{t['total_output_tokens']}", f"{out_g:.0f}"),
    ("duration s", f"{t['duration_s']:.2f}", f"{dur_g:.2f}"),
    ("requests/s (ok / duration)", f"{t['request_throughput']:.2f}", f"{ok_g / dur_g:.2f}"),
    ("output tok/s (/ duration)", f"{t['output_token_throughput']:.1f}", f"{out_g / dur_g:.1f}"),
]
print(f"{'':28s} {'tandem bench serve':>22s} {'guidellm':>22s}")
for name, a, b in rows:
    print(f"{name:28s} {a:>22s} {b:>22s}")
pairs = [("TTFT ms", t["ttft_ms"], gs("time_to_first_token_ms")),
         ("TPOT ms (gl: inter_token)", t["tpot_ms"], gs("inter_token_latency_ms")),
         ("E2E ms (gl: request_lat.)", t["e2e_ms"], gs("request_latency", 1e3)),
         ("ITL ms (every gap)", t["itl_ms"], None)]
for name, a, b in pairs:
    for q in ("mean", "p50", "p90", "p99"):
        av = "-" if a.get(q) is None else f"{a[q]:.2f}"
        bv = "-" if b is None else f"{b[q]:.2f}"
        print(f"{name + ' ' + q:28s} {av:>22s} {bv:>22s}")
EOF
echo "outputs: $OUT_DIR" >&2
