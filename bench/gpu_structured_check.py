#!/usr/bin/env python3
"""Structured output on the CUDA backend (bench/RESULTS.md, 2026-12-04): the device sampler
applies the grammar's masks, with and without speculation.

Starts three servers on one machine with the same model: `tandem serve --backend cuda`, the same
with `--spec draft` (the model drafting for itself, so drafts are verified on the device under
the masks), and `tandem serve` on the CPU. Each answers every schema of SCHEMA_DIR (greedy, and
sampled with two seeds) through response_format json_schema. Standard library only: the
answers are written to OUT/structured.json and validated where `jsonschema` is installed
(tests/grammar/check_structured.py), and greedy answers with and without speculation are
compared token for token here.

    bench/gpu_structured_check.py TANDEM_BINARY MODEL.gguf SCHEMA_DIR OUT_DIR [LD_LIBRARY_PATH]
"""
import json
import pathlib
import subprocess
import sys
import time
import urllib.request

BIN, MODEL, SCHEMAS, OUT = sys.argv[1:5]
LD = sys.argv[5] if len(sys.argv) > 5 else "/usr/local/cuda/lib64"
NAMES = ["person", "enums", "one_of_tagged", "tuple", "array_bounds", "formats",
         "order_nested", "nullable_const", "numbers"]


def start(port, extra):
    log = open(f"/tmp/g{port}.log", "w")
    p = subprocess.Popen([BIN, "serve", "--model", MODEL, "--port", str(port),
                          "--served-model-name", "tiny"] + extra, stdout=log,
                         stderr=subprocess.STDOUT, env={"LD_LIBRARY_PATH": LD, "PATH": "/usr/bin:/bin"})
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p
        except Exception:
            time.sleep(0.1)
    print(open(f"/tmp/g{port}.log").read())
    sys.exit(1)


def post(port, body):
    r = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(r, timeout=300))


servers = {"cuda": (18300, ["--backend", "cuda", "--gpu-memory-fraction", "0.4"]),
           # the plan counts the first server's memory as in use: this one's share is on top
           "cuda_spec": (18301, ["--backend", "cuda", "--gpu-memory-fraction", "0.85", "--spec",
                                 "draft", "--spec-draft", MODEL]),
           "cpu": (18302, ["--threads", "8"])}
procs = [start(port, extra) for port, extra in servers.values()]
out = {}
t0 = time.time()
for name in NAMES:
    schema = json.loads((pathlib.Path(SCHEMAS) / f"{name}.json").read_text())
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    out[name] = {}
    for srv, (port, _) in servers.items():
        answers = []
        for temp, seed in ((0, 0), (0.8, 1), (0.8, 2)):
            r = post(port, {"prompt": f"A {name} as JSON:", "response_format": rf,
                            "max_tokens": 400, "temperature": temp, "seed": seed})
            ch = r["choices"][0]
            answers.append({"text": ch["text"], "finish": ch["finish_reason"], "temperature": temp,
                            "seed": seed})
        out[name][srv] = answers
took = time.time() - t0
for p in procs:
    p.terminate()
    p.wait()
same = sum(out[n]["cuda"][0]["text"] == out[n]["cuda_spec"][0]["text"] for n in NAMES)
stops = sum(a["finish"] == "stop" for n in NAMES for s in out[n] for a in out[n][s])
total = sum(len(out[n][s]) for n in NAMES for s in out[n])
pathlib.Path(OUT).mkdir(parents=True, exist_ok=True)
(pathlib.Path(OUT) / "structured.json").write_text(json.dumps(out, indent=1))
print(f"{total} answers in {took:.1f} s, {stops} finished by the grammar; greedy with speculation "
      f"identical to without on the device: {same}/{len(NAMES)}")
