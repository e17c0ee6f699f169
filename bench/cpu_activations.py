#!/usr/bin/env python3
"""Greedy agreement of the CPU's quantised activations with --exact-activations (issue 21).

The CPU backend multiplies Q8_0/Q4_0/Q4_1 matrices by activations quantised to int8 blocks
(src/backend/cpu/qdot.c) unless --exact-activations. This script measures what that costs in
greedy decoding, over 100 prompts of the default model (SmolLM2-135M-Instruct Q4_1): the 50 of
bench/prompts/chat50.jsonl in the chat template, and the same 50 as plain text to continue.

For each prompt, both paths generate N greedy tokens (`tandem generate --prompt-tokens
--print-token-ids`, EOS not stopping them), and two figures are counted:
  - teacher-forced agreement: on the exact path's own sequence, the share of its N tokens that
    the quantised path also ranks first (one `tandem serve` request with echo and logprobs 1 per
    prompt; the exact server is sent the same request as a control, which must agree with
    itself on every token). This is the per-token figure the default rests on: >= 99%.
  - free-running: the share of prompts whose N tokens are identical, and the mean number of
    tokens generated before the first difference (once two greedy runs part, their later
    tokens are not comparable).

Prints one line per prompt and a summary (with the command lines and the tokens' checksum).
Usage: bench/cpu_activations.py [--build build] [--n 32] [--threads 1] [--prompts 100]

With --speed R: instead, `tandem bench model` on the default model, exact and quantised
interleaved (exact first in even rounds, quantised first in odd ones), at --threads 1 and 2
(--speed-threads), R rounds; prints every run and the medians of prefill, batch-1 and batch-8 decode, with each run's
greedy-token checksum (the same in all runs of one path when the machine is the same).
"""
import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from lib.server import Server, default_model_path  # noqa: E402


def prompts(limit):
    texts = [json.loads(line) for line in open(ROOT / "bench/prompts/chat50.jsonl")]
    out = [("chat", t) for t in texts] + [("text", t) for t in texts]
    return out[:limit]


def generate(exe, model, ids, n, threads, exact):
    args = [str(exe), "generate", "--model", model, "--prompt-tokens", ",".join(map(str, ids)),
            "--max-tokens", str(n), "--temperature", "0", "--print-token-ids",
            "--threads", str(threads)] + (["--exact-activations"] if exact else [])
    cp = subprocess.run(args, capture_output=True, text=True, check=True)
    toks = [int(t) for t in cp.stdout.split()]
    assert len(toks) == n, cp.stdout
    return toks


def top1_on(server, ids, start):
    """For each position i >= start of ids: whether the server ranks ids[i] first given ids[:i]
    (echo + logprobs 1: top_logprobs[i] holds position i's best token)."""
    st, raw, _ = server.request("POST", "/v1/completions", {
        "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0})
    assert st == 200, raw
    lp = json.loads(raw)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids), (len(lp["tokens"]), len(ids))
    out = []
    for i in range(start, len(ids)):
        top = lp["top_logprobs"][i]
        best = max(top, key=top.get)
        out.append(best == lp["tokens"][i])
    return out


def bench_model(exe, threads, exact, extra):
    args = [str(exe), "bench", "model", "--threads", str(threads)] + extra + (
        ["--exact-activations"] if exact else [])
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    fig = {}
    for line in out.splitlines():
        w = line.split()
        if line.strip().startswith("prefill:"):
            fig["prefill"] = float(w[-2])
        elif w[:1] == ["batch"]:
            fig[f"b{w[1]}"] = float(w[2])
        elif "checksum" in line:
            fig["checksum"] = w[-1]
    return fig


def speed(exe, rounds, extra, thread_counts):
    import statistics
    print(f"tandem bench model {' '.join(extra)} [--exact-activations], {rounds} rounds, "
          "interleaved")
    runs = {}
    for r in range(rounds):
        for threads in thread_counts:
            order = (True, False) if r % 2 == 0 else (False, True)
            for exact in order:
                f = bench_model(exe, threads, exact, extra)
                runs.setdefault((threads, exact), []).append(f)
                print(f"round {r} threads {threads} {'exact' if exact else 'quant'}: {f}",
                      flush=True)
    print("\n| threads | figure | exact (median) | quantised (median) | quantised / exact |")
    print("|---|---|---|---|---|")
    for threads in thread_counts:
        for key, name in (("prefill", "prefill"), ("b1", "decode, batch 1"),
                          ("b8", "decode, batch 8")):
            e = statistics.median(f[key] for f in runs[(threads, True)])
            q = statistics.median(f[key] for f in runs[(threads, False)])
            print(f"| {threads} | {name} | {e:.1f} tok/s | {q:.1f} tok/s | {q / e:.2f}x |")
    for k, v in sorted(runs.items()):
        print(f"checksums threads {k[0]} {'exact' if k[1] else 'quant'}: "
              f"{sorted(set(f['checksum'] for f in v))}")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.environ.get("TANDEM_BUILD", "build"))
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--speed", type=int, default=0, metavar="ROUNDS")
    ap.add_argument("--bench-args", default="", help="more `bench model` options (--speed)")
    ap.add_argument("--speed-threads", default="1,2", help="thread counts (--speed)")
    a = ap.parse_args()
    os.environ["TANDEM_BUILD"] = a.build
    exe = (ROOT / a.build / "tandem").resolve()
    if a.speed:
        return speed(exe, a.speed, a.bench_args.split(),
                     [int(t) for t in a.speed_threads.split(",")])
    model = str(default_model_path())
    common = ["--threads", str(a.threads), "--max-seqs", "1"]
    exact_srv = Server(common + ["--exact-activations"])
    quant_srv = Server(common)
    tf_agree = tf_total = ctrl_agree = same_runs = 0
    first_diff = []
    h = hashlib.sha256()
    try:
        for k, (kind, text) in enumerate(prompts(a.prompts)):
            body = ({"messages": [{"role": "user", "content": text}]} if kind == "chat"
                    else {"prompt": text})
            st, raw, _ = quant_srv.request("POST", "/tokenize", body)
            assert st == 200, raw
            ids = json.loads(raw)["tokens"]
            ex = generate(exe, model, ids, a.n, a.threads, exact=True)
            qu = generate(exe, model, ids, a.n, a.threads, exact=False)
            h.update(json.dumps([ex, qu]).encode())
            tf = top1_on(quant_srv, ids + ex, len(ids))
            ctrl = top1_on(exact_srv, ids + ex, len(ids))
            tf_agree += sum(tf)
            tf_total += len(tf)
            ctrl_agree += sum(ctrl)
            diff = next((i for i in range(a.n) if ex[i] != qu[i]), a.n)
            first_diff.append(diff)
            same_runs += diff == a.n
            print(f"{k:3d} {kind:4s} prompt {len(ids):3d} tok: teacher-forced {sum(tf):2d}/{len(tf)}"
                  f" (control {sum(ctrl)}/{len(ctrl)}), free-running identical for {diff} tokens",
                  flush=True)
    finally:
        exact_srv.stop()
        quant_srv.stop()
    n_p = len(first_diff)
    print(f"\nprompts {n_p}, {a.n} greedy tokens each, --threads {a.threads}, model {model}")
    print(f"teacher-forced agreement (quantised ranks the exact path's token first): "
          f"{tf_agree}/{tf_total} = {100.0 * tf_agree / tf_total:.2f}%")
    print(f"control (exact against itself): {ctrl_agree}/{tf_total}")
    print(f"free-running: {same_runs}/{n_p} prompts identical for all {a.n} tokens; mean "
          f"{sum(first_diff) / n_p:.1f} tokens before the first difference")
    print(f"checksum of both paths' tokens: {h.hexdigest()[:16]}")
    return 0 if ctrl_agree == tf_total else 1


if __name__ == "__main__":
    sys.exit(main())
