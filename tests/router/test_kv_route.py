"""`tandem router --route kv` (issue 19): routing by what each backend's prefix cache holds, as
its KV cache events tell (vLLM's KVEventBatch over ZMQ PUB/SUB).

With fake backends and publishers written here (pyzmq and msgpack: an independent encoder, in
vLLM's own shapes: byte-string hashes, several blocks to an event, a data-parallel rank after
the events), prompts given as token lists (so the tokens are known without a tokenizer):
- a prompt goes to the backend whose events say it holds the prompt's leading blocks, and the
  longer match wins; BlockRemoved and AllBlocksCleared take blocks away again;
- a publisher that starts its sequence again (a restarted backend) is forgotten; a block whose
  parent the router never saw is not indexed (an orphan); a malformed batch is counted, and the
  router goes on;
- the metrics show each backend's blocks and batches.
With real backends (`tandem serve --prefix-caching --kv-events`): chat requests sharing a system
prompt go to the backend that cached it, which then reports the hits, and the router's index
matches the blocks.
"""
import json
import subprocess
import threading
import time

import msgpack
import pytest
import zmq

from lib.server import Server, build_dir, free_port
from routerlib import FakeBackend, Router
from test_router_fake import echo, post, start  # noqa: F401

BS = 16


class Publisher:
    """A backend's KV events: a PUB socket on a free port, batches in vLLM's shape."""

    def __init__(self, ctx):
        self.port = free_port()
        self.sock = ctx.socket(zmq.PUB)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.seq = 0

    def send(self, events, raw=None):
        payload = raw if raw is not None else msgpack.packb([time.time(), events, 0])
        self.sock.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


def h(name):
    return (name * 32)[:32].encode()  # a 32-byte hash, as vLLM's sha256 block hashes


def stored(tokens, hashes, parent=None):
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU"]


def metric(m, name, url):
    return m.get((name, (("backend", url),)), 0)


@pytest.fixture
def kv_setup(start):
    ctx = zmq.Context()
    pubs = [Publisher(ctx), Publisher(ctx)]
    fakes = [start(FakeBackend, echo) for _ in range(2)]
    r = start(Router, [f.url for f in fakes],
              ["--route", "kv", "--kv-events", ",".join(p.endpoint for p in pubs)])
    yield r, pubs, fakes
    for p in pubs:
        p.sock.close(0)
    ctx.term()


def joined(r, pubs, fakes):
    """Sends a marker block from each publisher until the router has indexed it (ZMQ's slow
    joiner), then takes the markers away."""
    deadline = time.time() + 20
    while True:
        for i, p in enumerate(pubs):
            p.send([stored([1000 + i] * BS, [h(f"marker{i}")])])
        time.sleep(0.1)
        m = r.metrics()
        if all(metric(m, "tandem_router_kv_blocks", f.url) >= 1 for f in fakes):
            break
        assert time.time() < deadline, "the router never indexed the publishers' blocks"
    for i, p in enumerate(pubs):
        p.send([["BlockRemoved", [h(f"marker{i}")], "GPU"]])
    r.wait_for(lambda m: all(metric(m, "tandem_router_kv_blocks", f.url) == 0 for f in fakes),
               "markers removed")


def where(r, fakes, prompt, rid):
    st, raw, _ = post(r, body={"id": rid, "prompt": prompt, "max_tokens": 1})
    assert st == 200, raw
    for i, f in enumerate(fakes):
        if any(json.loads(q["body"]).get("id") == rid for q in f.requests):
            return i
    raise AssertionError("no backend got the request")


def test_routes_by_the_backends_events(kv_setup):
    r, pubs, fakes = kv_setup
    joined(r, pubs, fakes)
    a = list(range(100, 100 + 4 * BS)) + [7, 8, 9]  # four whole blocks and a tail
    b = list(range(500, 500 + 3 * BS)) + [7]
    # backend 1 holds a's first two blocks (one event, two hashes); backend 0 all four of a's,
    # stored as a chain of two events (the second's parent the first's last hash)
    pubs[1].send([stored(a[:2 * BS], [h("1a0"), h("1a1")])])
    pubs[0].send([stored(a[:BS], [h("0a0")]),
                  stored(a[BS:4 * BS], [h("0a1"), h("0a2"), h("0a3")], parent=h("0a0"))])
    pubs[1].send([stored(b[:3 * BS], [h("1b0"), h("1b1"), h("1b2")])])
    r.wait_for(lambda m: metric(m, "tandem_router_kv_blocks", fakes[0].url) == 4 and
               metric(m, "tandem_router_kv_blocks", fakes[1].url) == 5, "blocks indexed")
    for k in range(3):  # one at a time: nothing in flight, the match decides
        assert where(r, fakes, a + [k], f"a{k}") == 0
        assert where(r, fakes, b + [k], f"b{k}") == 1
    m = r.metrics()
    assert m[("tandem_router_prefix_blocks_total", (("result", "matched"),))] == 3 * (4 + 3)
    # a prompt that only shares a's first block with both: the longer match decides no more
    # (both hold it), so both are fine; one that differs in block 0 matches nothing
    assert where(r, fakes, [1] * (4 * BS), "none") in (0, 1)
    # backend 0 evicts a's first block: a's chain is broken there, and the pick's matched
    # blocks say so (none held where it went: it still goes to 0, where a was sent before and
    # counts half, as much as backend 1's two held blocks, and 0 holds less)
    pubs[0].send([["BlockRemoved", [h("0a0")], "GPU"]])
    r.wait_for(lambda m: metric(m, "tandem_router_kv_blocks", fakes[0].url) == 3, "removed")
    m0 = r.metrics()
    assert where(r, fakes, a + [9], "a-after") == 0
    m1 = r.settle()
    key = ("tandem_router_prefix_blocks_total", (("result", "missed"),))
    assert m1[key] - m0[key] == 4
    # a prompt never sent, held by backend 1 alone, then evicted there: it goes by load
    c = list(range(2000, 2000 + 2 * BS)) + [5]
    pubs[1].send([stored(c[:2 * BS], [h("1c0"), h("1c1")])])
    r.wait_for(lambda m: metric(m, "tandem_router_kv_blocks", fakes[1].url) == 7, "c stored")
    assert where(r, fakes, c, "c1") == 1
    # backend 1 clears its cache: nothing holds b or c now, and its count is 0
    pubs[1].send([["AllBlocksCleared"]])
    r.wait_for(lambda m: metric(m, "tandem_router_kv_blocks", fakes[1].url) == 0, "cleared")
    m = r.metrics()
    assert metric(m, "tandem_router_kv_event_batches_total", fakes[0].url) >= 3


def test_requests_in_flight_count_as_held(start):
    """Two requests of a prefix no backend has cached, the second sent while the first is in
    flight: the first's blocks count as held where it went (it is computing them), so the
    second follows it although the other backend is idle; once both end, their blocks count
    as held there a while yet (their events may lag), so a third follows too."""
    release = threading.Event()

    def slow(conn, req):
        if json.loads(req["body"]).get("hold"):
            release.wait(30)
        echo(conn, req)

    ctx = zmq.Context()
    pubs = [Publisher(ctx), Publisher(ctx)]
    fakes = [start(FakeBackend, slow) for _ in range(2)]
    r = start(Router, [f.url for f in fakes],
              ["--route", "kv", "--kv-events", ",".join(p.endpoint for p in pubs)])
    try:
        joined(r, pubs, fakes)
        prompt = list(range(900, 900 + 3 * BS))
        t = threading.Thread(target=post, args=(r,), kwargs={
            "body": {"id": "first", "prompt": prompt + [1], "hold": True}})
        t.start()
        r.wait_for(lambda m: sum(v for k, v in m.items()
                                 if k[0] == "tandem_router_backend_in_flight") == 1, "in flight")
        deadline = time.time() + 20
        while not any(f.requests for f in fakes):
            assert time.time() < deadline, "the held request never reached a backend"
            time.sleep(0.02)
        home = next(i for i, f in enumerate(fakes) if f.requests)
        assert where(r, fakes, prompt + [2], "second") == home
        release.set()
        t.join()
        # nothing in flight, and no event told of the blocks: they have landed where the two
        # went, and count as held there while their events may still be on the way, so a
        # third request matches all 3 (the second's 3 before it, the first's none)
        m = r.settle()
        assert m[("tandem_router_prefix_blocks_total", (("result", "matched"),))] == 3
        assert where(r, fakes, prompt + [3], "third") == home
        m = r.settle()
        assert m[("tandem_router_prefix_blocks_total", (("result", "matched"),))] == 6
    finally:
        for p in pubs:
            p.sock.close(0)
        ctx.term()


def test_restart_orphans_and_bad_bytes(kv_setup):
    r, pubs, fakes = kv_setup
    joined(r, pubs, fakes)
    a = list(range(300, 300 + 2 * BS))
    pubs[0].send([stored(a, [h("x0"), h("x1")])])
    r.wait_for(lambda m: metric(m, "tandem_router_kv_blocks", fakes[0].url) == 2, "stored")
    # a block under a parent the router never saw: not indexed
    pubs[0].send([stored(list(range(BS)), [h("orphan")], parent=h("never-seen"))])
    # bytes that are no batch, and a batch whose token count does not fit its blocks
    pubs[0].send(None, raw=b"\xc1garbage")
    pubs[0].send(None, raw=msgpack.packb([0.0, [["BlockStored", [h("y")], None, [1, 2, 3],
                                                 BS, None, "GPU"]]]))
    m = r.wait_for(lambda m: m.get(("tandem_router_kv_event_errors_total",
                                    (("kind", "malformed"),)), 0) >= 2, "malformed counted")
    assert m[("tandem_router_kv_event_errors_total", (("kind", "orphan"),))] == 1
    assert metric(m, "tandem_router_kv_blocks", fakes[0].url) == 2
    assert where(r, fakes, a + [1], "still") == 0  # the router routes on
    # the publisher starts again (a restarted backend: an empty cache): its blocks are gone
    pubs[0].seq = 0
    pubs[0].send([stored(list(range(700, 700 + BS)), [h("new")])])
    m = r.wait_for(lambda m: m.get(("tandem_router_kv_event_errors_total",
                                    (("kind", "restart"),)), 0) == 1, "restart seen")
    r.wait_for(lambda m: metric(m, "tandem_router_kv_blocks", fakes[0].url) == 1, "forgotten")


def test_flag_errors(start):
    fake = start(FakeBackend, echo)
    tandem = str(build_dir() / "tandem")
    for extra, words in ((["--route", "kv"], "--kv-events"),
                         (["--route", "kv", "--kv-events", "tcp://127.0.0.1:1,tcp://127.0.0.1:2"],
                          "one endpoint for each"),
                         (["--kv-events", "tcp://127.0.0.1:1"], "go with --route kv"),
                         (["--route", "kv", "--kv-events", "tcp://127.0.0.1:1", "--model",
                           "/nonexistent.gguf"], "--model")):
        cp = subprocess.run([tandem, "router", "--backends", fake.url, *extra],
                            capture_output=True, text=True, timeout=30)
        assert cp.returncode == 2 and words in cp.stderr, (extra, cp.stderr)


def test_real_backends(start, default_model):
    """Two `tandem serve --prefix-caching --kv-events` nodes: chat requests that share a system
    prompt go where it was cached, so one node reports every hit and the router's index matches
    the prompts' blocks."""
    ports = [free_port(), free_port()]
    nodes = [Server(["--threads", "1", "--prefix-caching", "--kv-events",
                     f"tcp://127.0.0.1:{p}"]) for p in ports]
    try:
        # a health check slow under a loaded suite must not mark a node down: the requests
        # would then go to the other for the wrong reason
        r = start(Router, [n.url for n in nodes],
                  ["--route", "kv", "--health-timeout-ms", "10000", "--kv-events",
                   ",".join(f"tcp://127.0.0.1:{p}" for p in ports)])
        time.sleep(1.0)  # the subscriptions reach the publishers
        system = ("You are the guide of a small railway museum. Answer briefly and kindly, and "
                  "name the engine when you can. " * 3)
        bodies = [{"messages": [{"role": "system", "content": system},
                                {"role": "user", "content": q}], "max_tokens": 2,
                   "temperature": 0}
                  for q in ("Which engine is oldest?", "Where is the signal box?",
                            "Can I ride the tender?", "When does the shop open?")]
        st, raw, _ = post(r, "/v1/chat/completions", bodies[0])
        assert st == 200, raw
        # the first request's pages reach the router's index
        r.wait_for(lambda m: sum(metric(m, "tandem_router_kv_blocks", n.url) for n in nodes) > 0,
                   "blocks indexed")
        for b in bodies[1:] * 2:
            st, raw, _ = post(r, "/v1/chat/completions", b)
            assert st == 200, raw
        m = r.metrics()
        assert all(m[("tandem_router_backend_up", (("backend", n.url),))] == 1 for n in nodes)
        hits = [n.metrics()[("tandem_prefix_cache_hit_tokens_total", ())] for n in nodes]
        assert sorted(hits)[0] == 0 and sorted(hits)[1] > 0, hits  # one node had them all
        m = r.metrics()
        assert m[("tandem_router_prefix_blocks_total", (("result", "matched"),))] >= 6 * 3
    finally:
        for n in nodes:
            n.stop()
