#!/usr/bin/env python3
"""The failure campaign (issue 15): real `tandem serve` processes attacked the ways that used to
hurt, each case repeated, every answer checked against a colocated server's greedy output.

    .venv/bin/python tests/campaign/campaign.py [--runs N] [--cases a,b] [--json FILE]

Cases:
  prefill-kill      SIGKILL the prefill node mid-transfer, then restart it at a new address (the
                    decode node reads the same @FILE again and uses it)
  prefill-stop      SIGSTOP the prefill node mid-transfer for 3 s, then SIGCONT (it must be
                    declared down, then used again)
  faults            every TANDEM_XFER_FAULTS mode, on the side it acts on
  decode-restart    restart the decode node behind the router while clients keep asking
  slowloris         N slow clients trickling headers while healthy clients are served
  stall             a scheduler step that never ends (TANDEM_SCHED_FAULTS): every request must
                    end with an error, then SIGTERM ends the process
  forged-imm        a peer that holds the fabric key floods the decode node with forged and
                    guessed immediates while requests are in flight: none may complete one
  unauth-peer       a peer without the key floods both nodes, and asks the prefill node for a
                    free prefill into its own memory: nothing of it may be read; then the same
                    prefill with the key is served (the check can fail)

For each case it prints: runs, requests, completed correctly, failed with an error, hung (no
answer within the deadline), wrong (an answer that differs from colocated), and pages leaked
(KV pages not back at baseline on either node once idle). The goal is 0 hung, 0 wrong, 0
leaked. Exit status 1 when any case misses it.
"""
import argparse
import concurrent.futures as cf
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for lib.*

from lib.sanitize import SANITIZED  # noqa: E402
from lib.server import Server, build_dir  # noqa: E402
from router.routerlib import Router as RouterProcess  # noqa: E402

DEADLINE_S = 600 if SANITIZED else 120
QUICK_PEER = ["--peer-timeout-ms", "8000" if SANITIZED else "1000"]


class Tally:
    def __init__(self, name):
        self.name, self.runs, self.requests = name, 0, 0
        self.correct = self.errors = self.hung = self.wrong = self.leaked = 0
        self.notes = []

    def ok(self):
        return not (self.hung or self.wrong or self.leaked)

    def row(self):
        return (f"| {self.name} | {self.runs} | {self.requests} | {self.correct} | {self.errors} "
                f"| {self.hung} | {self.wrong} | {self.leaked} |")


def prompts(n, seed, lens):
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(lens[i % len(lens)])] for i in range(n)]


def ask(server, prompt, max_tokens=6, timeout=DEADLINE_S):
    """('ok', tokens) | ('error', status) | ('hung', None)."""
    try:
        st, r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True,
                                                "logprobs": 0}, timeout=timeout)
    except (socket.timeout, TimeoutError):
        return "hung", None
    except (urllib.error.URLError, ConnectionError, OSError):
        return "error", None
    if st != 200:
        return "error", st
    return "ok", r["choices"][0]["logprobs"]["tokens"]


def count(t, want, got):
    t.requests += 1
    kind, toks = got
    if kind == "hung":
        t.hung += 1
    elif kind == "error":
        t.errors += 1
    elif toks == want:
        t.correct += 1
    else:
        t.wrong += 1


def pages_used(server):
    m = server.metrics()
    return m[("tandem_kv_pages_used", ())] + m[("tandem_kv_pages_in_flight", ())]


def settle(t, *servers, timeout=60):
    """Counts a leak for every node whose pages do not come back to 0 once idle."""
    for s in servers:
        deadline = time.time() + timeout
        while pages_used(s) and time.time() < deadline:
            time.sleep(0.1)
        if pages_used(s):
            t.leaked += 1
            t.notes.append(f"{s.command}: {pages_used(s)} pages still used")


def addr_file():
    return os.path.join(tempfile.mkdtemp(prefix="tandem-campaign-"), "addr")


def prefill(addr, extra=(), env=None):
    s = Server(["--threads", "1", "--role", "prefill", "--xfer-addr-file", addr] + QUICK_PEER
               + list(extra), env=env)
    deadline = time.time() + 30
    while not os.path.exists(addr):
        assert time.time() < deadline, "the prefill node wrote no address"
        time.sleep(0.05)
    return s


def decode(addr, extra=(), env=None):
    return Server(["--threads", "1", "--role", "decode", "--prefill-peers", "@" + addr,
                   "--remote-chunk", "64", "--remote-timeout-ms", "5000"] + QUICK_PEER
                  + list(extra), env=env)


def wait_metric(server, key, pred, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if pred(server.metrics().get(key, 0)):
                return True
        except (urllib.error.URLError, ConnectionError, OSError, AssertionError):
            pass
        time.sleep(0.1)
    return False


def mid_transfer(p, before):
    return wait_metric(p, ("tandem_disagg_writes_total", ()), lambda v: v >= before + 3, 60)


# ---- cases ----

def disrupt_mid_transfer(t, ref, seed, act, after=None):
    """Runs of: a long prompt sent to the decode node, act(prefill) once its KV is mid-way, the
    answer counted; then after(prefill) (it may return a new prefill node), the prefill peer
    must be up again and serve the same prompt; pages back at baseline on both nodes."""
    addr = addr_file()
    p = prefill(addr)
    d = decode(addr)
    try:
        for i in range(t.runs_wanted):
            t.runs += 1
            x = prompts(1, seed + i, [900])[0]
            want = ask(ref, x)[1]
            with cf.ThreadPoolExecutor(1) as ex:
                fut = ex.submit(ask, d, x)
                w = p.metrics()[("tandem_disagg_writes_total", ())]
                if mid_transfer(p, w):
                    act(p)
                count(t, want, fut.result())
            if after:
                p = after(p, addr)
            if not wait_metric(d, ("tandem_disagg_peer_up", (("peer", "0"),)), lambda v: v == 1,
                               60):
                t.notes.append("the prefill node was not used again")
                t.hung += 1
            count(t, want, ask(d, x))
            settle(t, d, p)
    finally:
        d.stop()
        p.stop()
    return t


def case_prefill_kill(ref, runs):
    t = Tally("prefill SIGKILL mid-transfer, restart elsewhere")
    t.runs_wanted = runs

    def restart(p, addr):
        p.proc.wait()
        p.stop()
        os.unlink(addr)
        return prefill(addr)  # a new process, a new port, the same @FILE

    return disrupt_mid_transfer(t, ref, 100, lambda p: p.proc.kill(), restart)


def case_prefill_stop(ref, runs):
    t = Tally("prefill SIGSTOP 3 s mid-transfer, SIGCONT")
    t.runs_wanted = runs

    def stop_cont(p):
        os.kill(p.proc.pid, signal.SIGSTOP)
        time.sleep(3)
        os.kill(p.proc.pid, signal.SIGCONT)

    return disrupt_mid_transfer(t, ref, 200, stop_cont)


FAULTS = [("decode", "drop_imm=1.0"), ("decode", "drop_imm=0.3"), ("decode", "dup_imm=0.5"),
          ("decode", "delay_imm_ms=50"), ("decode", "reorder_imm=1.0"),
          ("prefill", "fail_write=0.3"), ("prefill", "fail_write=1.0")]


def case_faults(ref, runs):
    t = Tally("every TANDEM_XFER_FAULTS mode")
    ps = prompts(3, 300, [40, 150, 2])
    want = [ask(ref, x)[1] for x in ps]
    for side, spec in FAULTS:
        env = {"TANDEM_XFER_FAULTS": f"{spec},seed={len(spec)}"}
        addr = addr_file()
        p = prefill(addr, env=env if side == "prefill" else None)
        d = decode(addr, env=env if side == "decode" else None)
        try:
            for _ in range(runs):
                t.runs += 1
                with cf.ThreadPoolExecutor(3) as ex:
                    for w, got in zip(want, ex.map(lambda x: ask(d, x), ps)):
                        count(t, w, got)
            settle(t, d, p)
        finally:
            d.stop()
            p.stop()
    return t


class Router(RouterProcess):
    def post(self, path, body, **kw):
        st, raw, _ = self.request("POST", path, body, **kw)
        return st, json.loads(raw) if raw else None


def case_decode_restart(ref, runs):
    t = Tally("decode node restarted behind the router")
    addr = addr_file()
    p = prefill(addr)
    d = decode(addr)
    port = d.port
    r = Router([d.url])
    ps = prompts(4, 400, [30, 60])
    want = [ask(ref, x)[1] for x in ps]
    try:
        for i in range(runs):
            t.runs += 1
            d.stop()  # SIGTERM: it drains; requests meanwhile get errors, never hangs
            for x, w in zip(ps[:2], want[:2]):
                count(t, w, ask(r, x, timeout=60))
            d = decode(addr, ["--port", str(port)])  # the same port: the router's backend
            deadline = time.time() + 60
            while ask(r, ps[0], timeout=60)[0] != "ok" and time.time() < deadline:
                time.sleep(0.2)
            for x, w in zip(ps, want):
                count(t, w, ask(r, x))
            settle(t, d, p)
    finally:
        r.stop()
        d.stop()
        p.stop()
    return t


def case_slowloris(ref, runs):
    t = Tally("slowloris: 2,000 slow clients, healthy ones served")
    s = Server(["--threads", "1", "--header-timeout-ms", "600000"])
    x = prompts(1, 500, [20])[0]
    want = ask(ref, x)[1]
    socks = []
    try:
        for _ in range(2000):
            k = socket.create_connection(("127.0.0.1", s.port), timeout=30)
            k.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n")
            socks.append(k)
        for _ in range(runs):
            t.runs += 1
            for k in socks:
                k.sendall(b"X")
            count(t, want, ask(s, x, timeout=60))
        settle(t, s)
    finally:
        for k in socks:
            k.close()
        s.stop()
    return t


def case_stall(ref, runs):
    t = Tally("a scheduler step that never ends")
    x = prompts(1, 600, [20])[0]
    for _ in range(runs):
        t.runs += 1
        s = Server(["--threads", "1", "--watchdog-ms", "6000" if SANITIZED else "1500",
                    "--drain-timeout", "1"], env={"TANDEM_SCHED_FAULTS": "stall:2:-1"})
        try:
            got = ask(s, x, timeout=60)
            count(t, None, got)
            s.proc.send_signal(signal.SIGTERM)
            try:
                if s.proc.wait(timeout=30) != 3:
                    t.notes.append(f"exit status {s.proc.returncode}, not 3")
                    t.wrong += 1
            except Exception:
                t.hung += 1
                t.notes.append("SIGTERM did not end a stalled server")
        finally:
            s.stop()
    return t


def fabric_key():
    path = os.path.join(tempfile.mkdtemp(prefix="tandem-campaign-key-"), "key")
    with open(path, "w") as f:
        f.write(os.urandom(24).hex())
    os.chmod(path, 0o600)
    return path


def flood(addr, key=None, ms=3000, geometry=None, no_wait=False, seed=1):
    """A hostile fabric peer (tests/tools/xfer_peer --role flood), started in the background."""
    tool = os.path.join(str(build_dir()), "tests", "tools", "xfer_peer")
    cmd = [tool, "--role", "flood", "--peer", addr, "--flood-ms", str(ms), "--linger-ms", "1500",
           "--seed", str(seed)]
    if key:
        cmd += ["--fabric-key", key]
    if geometry:
        cmd += ["--prefill-geometry", geometry]
    if no_wait:
        cmd += ["--no-wait"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def flood_result(proc):
    """The FLOOD line's fields, as ints ({} when the tool printed none)."""
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    for line in out.splitlines():
        if line.startswith("FLOOD "):
            return {k: int(v) for k, v in (f.split("=") for f in line.split()[1:])}
    return {}


# the default model's KV geometry: layers, KV heads, head_dim, page size, d_model, vocab
GEOMETRY = "30,3,64,16,576,49152"


def requests_under(t, d, ps, want, attack):
    """Asks the decode node for every prompt in ps (three at a time) while attack() runs."""
    with cf.ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(ask, d, x) for x in ps]
        res = attack()
        for w, f in zip(want, futs):
            count(t, w, f.result())
    return res


def keyed_pair(ref, seed):
    """A prefill and a decode node sharing a fresh fabric key, their fabric addresses, and three
    prompts with colocated answers."""
    key = fabric_key()
    addr = addr_file()
    p = prefill(addr, ["--fabric-key", key])
    d, daddr = decode_keyed(addr, key)
    with open(addr) as f:
        paddr = f.read().strip()
    ps = prompts(3, seed, [300, 120, 40])
    return key, p, paddr, d, daddr, ps, [ask(ref, x)[1] for x in ps]


def ignored_imms(before, after):
    return sum(after.get(("tandem_fabric_immediates_total", (("kind", k),)), 0)
               - before.get(("tandem_fabric_immediates_total", (("kind", k),)), 0)
               for k in ("stale", "invalid", "wrong_peer", "duplicate"))


def case_forged_imm(ref, runs):
    t = Tally("forged and guessed immediates from a peer with the key")
    key, p, _, d, daddr, ps, want = keyed_pair(ref, 700)
    sent = counted = 0
    try:
        for i in range(runs):
            t.runs += 1
            before = d.metrics()
            r = requests_under(t, d, ps, want,
                               lambda: flood_result(flood(daddr, key, 3000, seed=i + 1)))
            if not r.get("up") or r.get("imm", 0) < 100:
                t.notes.append(f"run {i}: the attacker did not get through its flood: {r}")
                t.wrong += 1
            sent += r.get("imm", 0)
            counted += ignored_imms(before, d.metrics())
            settle(t, d, p)
        t.notes.append(f"{sent} forged immediates sent, {counted:.0f} counted as stale, invalid, "
                       "duplicate or from the wrong peer, none completed a request")
    finally:
        d.stop()
        p.stop()
    return t


def case_unauth_peer(ref, runs):
    t = Tally("a peer without the key: flood and a free prefill")
    key, p, paddr, d, daddr, ps, want = keyed_pair(ref, 800)
    imms = msgs = 0
    try:
        for i in range(runs):
            t.runs += 1

            def attack():
                a = flood(paddr, None, 3000, GEOMETRY, no_wait=True, seed=i + 1)
                b = flood(daddr, None, 3000, no_wait=True, seed=i + 101)
                return flood_result(a), flood_result(b)

            for name, r in zip(("prefill", "decode"), requests_under(t, d, ps, want, attack)):
                if r.get("up") or r.get("got") or r.get("written"):
                    t.wrong += 1
                    t.notes.append(f"run {i}: the {name} node answered a peer without the key: {r}")
                imms += r.get("imm", 0)
                msgs += r.get("msg", 0)
            settle(t, d, p)
        dropped = (p.metrics()[("tandem_fabric_unauthenticated_dropped_total", ())]
                   + d.metrics()[("tandem_fabric_unauthenticated_dropped_total", ())])
        t.notes.append(f"sent without the key: {imms} immediates and {msgs} messages (a prefill "
                       f"request among them each run); {dropped:.0f} dropped unread by the nodes")
        # the control: with the key the same request is served, so the check above can fail
        r = flood_result(flood(paddr, key, 200, GEOMETRY))
        if not (r.get("up") and r.get("written", 0) > 0):
            t.wrong += 1
            t.notes.append(f"control: a prefill asked with the key was not served: {r}")
        else:
            t.notes.append(f"control: with the key the same prefill wrote {r['written']} bytes")
        settle(t, d, p)
    finally:
        d.stop()
        p.stop()
    return t


def decode_keyed(addr, key):
    """A decode node with the fabric key, and its fabric address (its --xfer-addr-file)."""
    daddr = addr_file()
    d = decode(addr, ["--fabric-key", key, "--xfer-addr-file", daddr])
    deadline = time.time() + 30
    while not os.path.exists(daddr):
        assert time.time() < deadline, "the decode node wrote no address"
        time.sleep(0.05)
    with open(daddr) as f:
        return d, f.read().strip()


CASES = {"prefill-kill": case_prefill_kill, "prefill-stop": case_prefill_stop,
         "faults": case_faults, "decode-restart": case_decode_restart,
         "slowloris": case_slowloris, "stall": case_stall, "forged-imm": case_forged_imm,
         "unauth-peer": case_unauth_peer}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    names = [c for c in a.cases.split(",") if c]
    bad = [c for c in names if c not in CASES]
    if bad:
        ap.error(f"unknown case {bad[0]}; cases: {', '.join(CASES)}")
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    ref = Server(["--threads", "1"])
    tallies = []
    try:
        for name in names:
            t0 = time.time()
            t = CASES[name](ref, a.runs)
            t.notes.append(f"{time.time() - t0:.0f} s")
            tallies.append(t)
            print(f"campaign: {name}: {t.row()}", flush=True)
    finally:
        ref.stop()
    print("\n| case | runs | requests | correct | failed with an error | hung | wrong | "
          "pages leaked |\n|---|---|---|---|---|---|---|---|")
    for t in tallies:
        print(t.row())
    for t in tallies:
        for n in t.notes:
            print(f"  {t.name}: {n}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([vars(t) for t in tallies], f, indent=1)
    return 0 if all(t.ok() for t in tallies) else 1


if __name__ == "__main__":
    sys.exit(main())
