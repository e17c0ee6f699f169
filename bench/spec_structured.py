#!/usr/bin/env python3
"""Speculative decoding under structured output (bench/RESULTS.md, 2026-12-04): tau and
acceptance with a JSON Schema against the same prompts without one, in the same run, on one
server.

    bench/spec_structured.py TANDEM_BINARY MODEL.gguf [serve flags...]
    e.g. bench/spec_structured.py build/tandem ~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
             --spec draft --spec-draft ~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf

For each schema of tests/grammar/schemas/ whose strings are bounded, one greedy request with
response_format json_schema and one without (the same prompt, the same max_tokens), one at a
time; the server's own counters (tandem_spec_* in /metrics) are read before and after each
group. tau: tokens per verified step; acceptance: accepted drafts / drafted. Standard library
only.
"""
import json
import pathlib
import subprocess
import sys
import time
import urllib.request

BIN, MODEL, FLAGS = sys.argv[1], sys.argv[2], sys.argv[3:]
ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = ["person", "enums", "one_of_tagged", "tuple", "array_bounds", "formats",
         "order_nested", "nullable_const", "numbers"]
PORT = 18411


def post(body):
    r = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(r, timeout=600))


def counters():
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=30).read().decode()
    got = {}
    for ln in text.splitlines():
        for k in ("tandem_spec_drafted_tokens_total", "tandem_spec_accepted_tokens_total",
                  "tandem_spec_tokens_per_step_sum", "tandem_spec_tokens_per_step_count"):
            if ln.startswith(k + "{") or ln.startswith(k + " "):
                got[k] = float(ln.rsplit(" ", 1)[1])
    return got


proc = subprocess.Popen([BIN, "serve", "--model", MODEL, "--port", str(PORT)] + FLAGS,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
            break
        except Exception:
            time.sleep(0.1)
    rows = {}
    for constrained in (True, False):
        before, t0, n_tok = counters(), time.time(), 0
        for name in NAMES:
            schema = json.loads((ROOT / "tests" / "grammar" / "schemas" / f"{name}.json").read_text())
            body = {"prompt": f"Here is one {name} as JSON:", "max_tokens": 120, "temperature": 0}
            if constrained:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": name, "schema": schema}}
            n_tok += post(body)["usage"]["completion_tokens"]
        after, took = counters(), time.time() - t0
        d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        tau = d["tandem_spec_tokens_per_step_sum"] / max(d["tandem_spec_tokens_per_step_count"], 1)
        acc = d["tandem_spec_accepted_tokens_total"] / max(d["tandem_spec_drafted_tokens_total"], 1)
        rows[constrained] = (tau, acc, n_tok, took)
    print(f"serve flags: {' '.join(FLAGS)}")
    print("| | tau | acceptance | tokens | tok/s |")
    print("|---|---|---|---|---|")
    for constrained, label in ((True, "json_schema"), (False, "no constraint (reference)")):
        tau, acc, n, took = rows[constrained]
        print(f"| {label} | {tau:.2f} | {acc:.1%} | {n} | {n / took:.1f} |")
    print(f"tau ratio (schema / reference): {rows[True][0] / rows[False][0]:.2f}")
finally:
    proc.terminate()
    proc.wait()
