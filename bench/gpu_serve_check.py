#!/usr/bin/env python3
"""Serving paths on the CUDA backend against the CPU backend, end to end (bench/RESULTS.md,
2026-12-04): echo scoring, n choices sharing the prompt's KV, and prefix caching.

Starts `tandem serve --backend cuda --prefix-caching` and `tandem serve` (CPU) on one machine with
the same model, and compares every token log-probability the CUDA server reports with the CPU
server's echo score of the very same token ids (teacher forcing). Standard library only, so it
runs on a GPU machine that has nothing but the built binary and the model.

    bench/gpu_serve_check.py TANDEM_BINARY MODEL.gguf [LD_LIBRARY_PATH]

A tiny random model is enough (tests/lib/checkpoints.py make_gguf_checkpoint with head_dim 64):
it is peaked, so sampled choices often agree; their log-probabilities are what is compared.
"""
import json
import subprocess
import sys
import time
import urllib.request

BIN, MODEL = sys.argv[1], sys.argv[2]
LD = sys.argv[3] if len(sys.argv) > 3 else "/usr/local/cuda/lib64"
def start(port, extra):
    p = subprocess.Popen([BIN, "serve", "--model", MODEL, "--port", str(port),
                          "--served-model-name", "tiny"] + extra, stdout=open(f"/tmp/s{port}.log", "w"),
                         stderr=subprocess.STDOUT, env={"LD_LIBRARY_PATH": LD, "PATH": "/usr/bin:/bin"})
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1); return p
        except Exception: time.sleep(0.1)
    print(open(f"/tmp/s{port}.log").read()); sys.exit(1)
def post(port, body, path="/v1/completions"):
    r = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(r, timeout=120))
def tok(port, text):
    return post(port, {"prompt": text, "add_special_tokens": False}, "/tokenize")["tokens"]
cuda = start(18200, ["--backend", "cuda", "--prefix-caching"])
cpu = start(18201, ["--threads", "8", "--exact-activations"])
worst = 0.0
def score(ids):  # CPU teacher forcing: each token's log-probability given the ones before
    r = post(18201, {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
    return r["choices"][0]["logprobs"]["token_logprobs"]
text = "The old lighthouse keeper climbed the spiral stairs every evening and lit the lamp " * 3
ids = tok(18200, text)
body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True}
def gen_ids(lp):  # each generated token's id, from its piece (None when a piece is not one token)
    out = []
    for piece in lp["tokens"]:
        t = tok(18200, piece)
        if len(t) != 1: return None
        out.append(t[0])
    return out
for attempt in range(2):
    r = post(18200, body)
    c = r["choices"][0]
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"cuda run {attempt}: cached_tokens {cached}")
g = gen_ids(c["logprobs"])
if g is not None:
    ref = score(ids + g)
    worst = max(abs(a - b) for a, b in zip(c["logprobs"]["token_logprobs"], ref[len(ids):]))
    print(f"prefix-cached greedy run: {len(g)} tokens, cuda vs cpu logprob worst {worst:.3g}")
else:
    print("prefix-cached greedy run: a piece is not one token; not compared")
# echo scores: cuda vs cpu
ce = post(18200, {"prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 1})["choices"][0]["logprobs"]["token_logprobs"]
pe = score(ids)
w2 = max(abs(a - b) for a, b in zip(ce[1:len(ids)], pe[1:]))
print(f"echo: {len(ids)} prompt positions, cuda vs cpu worst {w2:.3g}")
# n = 4 sampled choices sharing the prompt's KV on cuda; each choice's tokens scored on cpu
r = post(18200, {"prompt": ids, "n": 4, "max_tokens": 8, "temperature": 1.0, "seed": 5, "logprobs": 0, "ignore_eos": True})
w3, compared = 0.0, 0
for ch in r["choices"]:
    g = gen_ids(ch["logprobs"])
    if g is None: continue
    ref = score(ids + g)
    w3 = max([w3] + [abs(a - b) for a, b in zip(ch["logprobs"]["token_logprobs"], ref[len(ids):])])
    compared += 1
print(f"compared {compared} of 4")
print(f"n=4 choices: cuda vs cpu worst {w3:.3g}; texts distinct {len({c['text'] for c in r['choices']})}")
m = urllib.request.urlopen("http://127.0.0.1:18200/metrics").read().decode()
print("\n".join(l for l in m.splitlines() if l.startswith("tandem_prefix_cache") or l.startswith("tandem_kv_pages_used")))
post(18200, {}, "/reset_prefix_cache")
time.sleep(0.5)
m = urllib.request.urlopen("http://127.0.0.1:18200/metrics").read().decode()
print([l for l in m.splitlines() if l.startswith("tandem_kv_pages_used")])
cuda.terminate(); cpu.terminate(); cuda.wait(); cpu.wait()
print("cuda server exit", cuda.returncode, "cpu", cpu.returncode)
print(open("/tmp/s18200.log").read()[-1500:])
