#!/usr/bin/env python3
"""Prefix caching with disaggregation (issue 19), on this machine's CPU: a shared system prompt
through a prefill node and a decode node, with `--prefix-caching` on both and without, fresh
nodes each time, the same workload in the same run.

The workload is `tandem bench serve --prefix-len P --input-len I --output-len O --num-prompts N
--concurrency C` against the decode node (completions, random token ids: every prompt starts
with the same P ids), after --warmup requests of the same prefix that are not measured (a
system prompt the nodes have seen before). With the caches, the decode node asks the prefill node for what follows
its cached prefix only, and the prefill node computes only what its own cache lacks.

Printed: each run's bench summary (TTFT mean and p90, TPOT, duration, input tokens/s), the
ratios, and the nodes' counters (remote prefills, cached prefixes asked past, hit tokens).
Standard library only.

Usage: bench/disagg_prefix.py [--tandem build/tandem] [--model PATH] [--prefix-len 1024]
       [--input-len 32] [--output-len 16] [--num-prompts 16] [--concurrency 16] [--threads 1]
       [--warmup 1]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from nodes import free_port, metrics, stop_all, wait_up


def run(args, cache):
    log = tempfile.mkdtemp(prefix="tandem-disagg-prefix-")
    extra = ["--prefix-caching"] if cache else []
    model = ["--model", args.model] if args.model else []
    addr = f"{log}/addr"
    pport, dport = free_port(), free_port()
    procs = []
    try:
        procs.append(subprocess.Popen(
            [args.tandem, "serve", "--port", str(pport), "--threads", str(args.threads),
             "--role", "prefill", "--xfer-addr-file", addr] + model + extra,
            stdout=open(f"{log}/prefill.log", "w"), stderr=subprocess.STDOUT))
        wait_up(f"http://127.0.0.1:{pport}")
        procs.append(subprocess.Popen(
            [args.tandem, "serve", "--port", str(dport), "--threads", str(args.threads),
             "--role", "decode", "--prefill-peers", "@" + addr] + model + extra,
            stdout=open(f"{log}/decode.log", "w"), stderr=subprocess.STDOUT))
        decode = f"http://127.0.0.1:{dport}"
        wait_up(decode)
        out = f"{log}/bench.json"
        common = [args.tandem, "bench", "serve", "--url", decode, "--prefix-len",
                  str(args.prefix_len), "--input-len", str(args.input_len), "--output-len",
                  str(args.output_len), "--seed", "7"]
        if args.warmup:  # the shared prefix once, unmeasured (in the caches when they are on)
            subprocess.run(common + ["--num-prompts", str(args.warmup), "--concurrency", "1"],
                           check=True, stdout=subprocess.DEVNULL)
        subprocess.run(common + ["--num-prompts", str(args.num_prompts), "--concurrency",
                                 str(args.concurrency), "--json", out],
                       check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            summary = json.load(f)
        md, mp = metrics(decode), metrics(f"http://127.0.0.1:{pport}")
        return summary, {
            "remote_prefills": md.get("tandem_disagg_remote_prefills_total"),
            "decoder_cached_prefix_requests": md.get("tandem_disagg_cached_prefix_requests_total"),
            "decoder_cached_prefix_tokens": md.get("tandem_disagg_cached_prefix_tokens_total"),
            "decoder_hit_tokens": md.get("tandem_prefix_cache_hit_tokens_total"),
            "prefill_hit_tokens": mp.get("tandem_prefix_cache_hit_tokens_total"),
            "prefill_bytes_sent": mp.get("tandem_disagg_write_bytes_total")}
    finally:
        stop_all(procs)


def pick(s):
    """The headline numbers of bench serve's JSON summary."""
    return {"completed": s["completed"], "duration_s": s["duration_s"],
            "input_tok_per_s": s["input_token_throughput"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "ttft_p90_ms": s["ttft_ms"]["p90"],
            "tpot_mean_ms": s["tpot_ms"]["mean"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", default=os.path.join(os.path.dirname(__file__), "..", "build",
                                                     "tandem"))
    ap.add_argument("--model")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    print(f"disagg_prefix: prefix {args.prefix_len} + {args.input_len} tokens, "
          f"{args.output_len} out, {args.num_prompts} prompts at {args.concurrency}, "
          f"{args.threads} thread(s) a node", flush=True)
    res = {}
    for cache in (False, True):
        summary, counters = run(args, cache)
        res[cache] = pick(summary)
        print(json.dumps({"prefix_caching": cache, **res[cache], **counters}), flush=True)
    off, on = res[False], res[True]
    ratios = {k: off[k] / on[k] for k in off if k != "completed" and off[k] and on[k]}
    print(json.dumps({"off_over_on": ratios}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
