#!/usr/bin/env python3
"""The soak (issue 15, item 7): many concurrent streaming clients, for a long time, through the
router to a prefill/decode pair on loopback, with the memory of every process sampled as it goes.

    .venv/bin/python tests/campaign/soak.py [--clients 1000] [--duration 600] [--json FILE]
        [--input-len 32] [--output-len 16]

Load: `tandem bench serve` keeps --clients streaming requests in flight through the router
(32-token prompts, 16 tokens out, greedy, unless --input-len/--output-len say otherwise), wave
after wave, as long as the next wave (expected to last as long as the last one) ends within
--duration; the first wave always runs. The load is bounded by the client count, never by an
arrival rate. Beside it, a probe asks the same greedy question every few seconds and compares
the answer with a colocated server's, so wrong text under load is caught, not only errors.

Printed at the end: requests completed and failed (by kind), probes right, wrong and failed,
the resident memory (RSS) and thread count of the prefill node, the decode node and the router
every --sample-s seconds, and the KV pages still used on both nodes once idle. Exit status 1 on
any failed request, any wrong probe, or any leaked page.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for lib.*

from campaign import Router, addr_file, ask, decode, pages_used, prefill  # noqa: E402
from lib.server import Server, build_dir  # noqa: E402

PROBE = [[1, 504, 3458, 282, 4649, 314]]  # token ids: a fixed prompt


def proc_status(pid):
    """(RSS in MiB, threads) of a process, from /proc."""
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, threads


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--input-len", type=int, default=32, help="prompt tokens a request")
    ap.add_argument("--output-len", type=int, default=16, help="tokens out a request")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))

    ref = Server(["--threads", "1"])
    addr = addr_file()
    p = prefill(addr)
    d = decode(addr, ["--max-waiting", str(2 * a.clients + 64)])
    r = Router([d.url], ["--max-connections", str(2 * a.clients + 256)])
    procs = {"prefill": p, "decode": d, "router": r}
    out = {"clients": a.clients, "duration_s": a.duration, "samples": [], "waves": [],
           "probes": {"right": 0, "wrong": 0, "failed": 0}, "errors": {}}
    stop = threading.Event()
    try:
        _, want = ask(ref, PROBE[0], max_tokens=8)
        ref.stop()
        t0 = time.time()

        def sample():
            while True:
                row = {"t_s": round(time.time() - t0, 1)}
                for name, s in procs.items():
                    rss, th = proc_status(s.proc.pid)
                    row[name] = {"rss_mib": round(rss, 1), "threads": th}
                out["samples"].append(row)
                if stop.wait(a.sample_s):
                    return

        def probe():
            while not stop.wait(3):
                kind, toks = ask(r, PROBE[0], max_tokens=8, timeout=900)  # queued behind a wave
                key = "failed" if kind != "ok" else "right" if toks == want else "wrong"
                out["probes"][key] += 1

        threads = [threading.Thread(target=sample), threading.Thread(target=probe)]
        for t in threads:
            t.start()
        wave = 0
        last_s = 0.0  # the last wave's length: no wave starts that would end past --duration
        while wave == 0 or time.time() - t0 + last_s <= a.duration:
            w0 = time.time()
            js = os.path.join(r.dir, f"wave{wave}.json")
            cp = subprocess.run([str(build_dir() / "tandem"), "bench", "serve", "--url", r.url,
                                 "--concurrency", str(a.clients), "--num-prompts",
                                 str(a.clients), "--input-len", str(a.input_len),
                                 "--output-len", str(a.output_len),
                                 "--seed", str(wave), "--timeout", "600", "--no-progress",
                                 "--json", js], capture_output=True, text=True, timeout=1800)
            if not os.path.exists(js):
                raise RuntimeError(f"bench serve exited {cp.returncode}:\n{cp.stderr[-3000:]}")
            res = json.load(open(js))
            out["waves"].append({"t_s": round(time.time() - t0, 1), "completed": res["completed"],
                                 "failed": res["failed"], "duration_s": res["duration_s"]})
            for k, v in (res.get("errors") or {}).items():
                out["errors"][k] = out["errors"].get(k, 0) + v
            wave += 1
            last_s = time.time() - w0
        stop.set()
        for t in threads:
            t.join()
        deadline = time.time() + 60
        while (pages_used(p) or pages_used(d)) and time.time() < deadline:
            time.sleep(0.2)
        out["pages_left"] = {"prefill": pages_used(p), "decode": pages_used(d)}
        out["router_errors"] = {dict(k[1])["kind"]: v for k, v in r.metrics().items()
                                if k[0] == "tandem_router_proxy_errors_total" and v}
    finally:
        stop.set()
        for s in (r, d, p, ref):
            s.stop()

    done = sum(w["completed"] for w in out["waves"])
    failed = sum(w["failed"] for w in out["waves"])
    print(f"soak: {a.clients} clients, {len(out['waves'])} waves in "
          f"{out['samples'][-1]['t_s']:.0f} s: {done} requests completed, {failed} failed "
          f"{out['errors'] or ''}")
    print(f"soak: probes {out['probes']}; pages left {out['pages_left']}; router errors "
          f"{out['router_errors'] or 'none'}")
    print("\n| t (s) | prefill RSS MiB (threads) | decode RSS MiB (threads) | router RSS MiB "
          "(threads) |\n|---|---|---|---|")
    for row in out["samples"]:
        print(f"| {row['t_s']:.0f} | " + " | ".join(
            f"{row[n]['rss_mib']:.0f} ({row[n]['threads']})" for n in procs) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    ok = (failed == 0 and out["probes"]["wrong"] == 0 and out["probes"]["failed"] == 0
          and not any(out["pages_left"].values()) and done > 0)
    print("soak: " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
