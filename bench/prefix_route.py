#!/usr/bin/env python3
"""Prefix-aware routing against least-loaded routing (issue 19), on this machine's CPU.

Two `tandem serve --prefix-caching` nodes behind `tandem router`, once with `--route
least-loaded`, once with `--route prefix` (the router's guess from the text it sent where), and
once with `--route kv` (the nodes' KV cache events, `--kv-events`), each time fresh. The workload: P distinct system
prompts of about L tokens each (chat), R requests a prompt with a short question of their own,
in a shuffled order (seeded), C clients at a time. Each node's KV pool is cut (--kv-memory) so
that it holds about half of the prefixes: least-loaded routing sends every prefix to both nodes
and they evict each other's prefixes; prefix routing keeps each prefix on one node.

Measured (same run, both modes): the backends' prefix-cache hit rate (hit tokens over queried
tokens, from their /metrics), mean and p90 time to first token (streamed), total wall time, and
the router's matched-block share. Standard library only.

Usage: bench/prefix_route.py [--tandem build/tandem] [--model PATH] [--prefixes 8]
       [--prefix-tokens 400] [--requests-per-prefix 6] [--clients 4] [--kv-memory 96MiB]
       [--threads 1] [--seed 1] [--routes least-loaded,prefix,kv]
"""
import argparse
import concurrent.futures as cf
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request

from nodes import free_port, metrics, stop_all, wait_up


def ttft(url, body):
    """Seconds to the first streamed content token."""
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.time()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: ") and first is None and b'"content"' in line:
                first = time.time() - t0
    return first if first is not None else time.time() - t0


def run(args, route, prompts):
    procs, log = [], tempfile.mkdtemp(prefix="tandem-prefix-route-")
    try:
        backends, events = [], []
        for i in range(2):
            port = free_port()
            cmd = [args.tandem, "serve", "--port", str(port), "--prefix-caching", "--threads",
                   str(args.threads), "--kv-memory", args.kv_memory]
            if route == "kv":
                events.append(f"tcp://127.0.0.1:{free_port()}")
                cmd += ["--kv-events", events[-1]]
            if args.model:
                cmd += ["--model", args.model]
            procs.append(subprocess.Popen(cmd, stdout=open(f"{log}/serve{i}.log", "w"),
                                          stderr=subprocess.STDOUT))
            backends.append(f"http://127.0.0.1:{port}")
        for b in backends:
            wait_up(b)
        rport = free_port()
        rcmd = [args.tandem, "router", "--port", str(rport), "--backends", ",".join(backends),
                "--route", route]
        if route == "kv":
            rcmd += ["--kv-events", ",".join(events)] + (["--model", args.model] if args.model
                                                         else [])
        procs.append(subprocess.Popen(rcmd, stdout=open(f"{log}/router.log", "w"),
                                      stderr=subprocess.STDOUT))
        router = f"http://127.0.0.1:{rport}"
        wait_up(router)
        time.sleep(0.5 if route == "kv" else 0)  # the subscriptions reach the publishers
        t0 = time.time()
        with cf.ThreadPoolExecutor(args.clients) as ex:
            ttfts = list(ex.map(lambda b: ttft(router, b), prompts))
        wall = time.time() - t0
        hit = queried = evicted = 0.0
        for b in backends:
            m = metrics(b)
            hit += m.get("tandem_prefix_cache_hit_tokens_total", 0)
            queried += m.get("tandem_prefix_cache_queried_tokens_total", 0)
            evicted += m.get("tandem_prefix_cache_evicted_pages_total", 0)
        rm = metrics(router)
        matched = rm.get('tandem_router_prefix_blocks_total{result="matched"}')
        missed = rm.get('tandem_router_prefix_blocks_total{result="missed"}')
        ttfts.sort()
        return {"route": route, "hit_rate": hit / queried if queried else 0.0,
                "evicted_pages": evicted,
                "ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_p90_s": ttfts[int(0.9 * len(ttfts))],
                "wall_s": wall, "router_matched_share":
                    matched / (matched + missed) if matched is not None and matched + missed
                    else None}
    finally:
        stop_all(procs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", default=os.path.join(os.path.dirname(__file__), "..", "build",
                                                     "tandem"))
    ap.add_argument("--model")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--requests-per-prefix", type=int, default=6)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--kv-memory", default="96MiB")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--routes", default="least-loaded,prefix,kv")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
             "juliet", "kilo", "lima", "mike", "november", "oscar", "papa"]
    systems = []
    for p in range(args.prefixes):  # about one token a word
        systems.append(f"You are assistant number {p}. " +
                       " ".join(rng.choice(words) for _ in range(args.prefix_tokens)))
    prompts = [{"messages": [{"role": "system", "content": systems[p]},
                             {"role": "user", "content": f"Question {k} for {p}: say hello."}],
                "max_tokens": 4, "temperature": 0, "stream": True}
               for p in range(args.prefixes) for k in range(args.requests_per_prefix)]
    rng.shuffle(prompts)
    print(f"prefix_route: {args.prefixes} prefixes of ~{args.prefix_tokens} tokens, "
          f"{len(prompts)} requests, {args.clients} clients, 2 nodes of --kv-memory "
          f"{args.kv_memory}, {args.threads} thread(s) each", flush=True)
    for route in args.routes.split(","):
        r = run(args, route, prompts)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    sys.exit(main())
