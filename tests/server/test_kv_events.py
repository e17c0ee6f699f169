"""KV cache events (`tandem serve --prefix-caching --kv-events ENDPOINT`, issue 19): the prefix
cache's stores and evictions, read by an independent subscriber (pyzmq, msgpack) as vLLM's
KVEventBatch: three frames (topic, an 8-byte big-endian sequence number, a msgpack payload
[ts, [events]]), each event a tagged array (BlockStored, BlockRemoved, AllBlocksCleared).

Checked: a prompt's whole pages come as BlockStored events carrying exactly its tokens, in
order, each page's parent the previous page's hash (the first's nil), block_size the page size,
medium "CPU"; a second request with the same prefix stores nothing new; POST /reset_prefix_cache
is AllBlocksCleared; a small pool's evictions are BlockRemoved events of hashes stored before;
sequence numbers count up from 0 without a gap; the metrics count what was sent; the flags are
refused without --prefix-caching.
"""
import json
import time

import msgpack
import pytest
import zmq

from conftest import run_tandem
from lib.rawhttp import raw_http
from lib.server import Server, free_port

PS = 16


class Subscriber:
    def __init__(self, port, topic=b""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.seqs, self.events = [], []
        time.sleep(0.5)  # ZMQ's slow joiner: the subscription must reach the publisher

    def drain(self, until, timeout=20):
        """Reads batches until until(events) holds."""
        deadline = time.time() + timeout
        while not until(self.events):
            assert time.time() < deadline, f"events so far: {self.events}"
            if not self.sock.poll(100):
                continue
            topic, seq, payload = self.sock.recv_multipart()
            self.topic = topic
            self.seqs.append(int.from_bytes(seq, "big"))
            ts, events = msgpack.unpackb(payload, raw=False)
            assert abs(ts - time.time()) < 60
            self.events += events

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def post(server, body, path="/v1/completions"):
    st, _, raw = raw_http(server.port, "POST", path, json.dumps(body).encode())
    assert st == 200, raw
    return json.loads(raw)


def stored(events):
    return [e for e in events if e[0] == "BlockStored"]


def test_events_follow_the_cache(default_model):
    port = free_port()
    s = Server(["--threads", "1", "--prefix-caching", "--kv-events", f"tcp://127.0.0.1:{port}",
                "--kv-events-topic", "kv@test", "--kv-memory", "24MiB"])
    sub = Subscriber(port)
    try:
        assert 'KV cache events on tcp://127.0.0.1:' in s.logs()
        prompt = [(37 * i) % 40000 + 100 for i in range(3 * PS + 5)]
        post(s, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
        sub.drain(lambda ev: len(stored(ev)) >= 3)
        assert sub.topic == b"kv@test"
        first = stored(sub.events)[:3]
        parent = None
        for i, e in enumerate(first):
            tag, hashes, par, tokens, block_size, lora, medium = e
            assert len(hashes) == 1 and hashes[0] > 0
            assert par == parent, (i, par, parent)
            assert tokens == prompt[i * PS:(i + 1) * PS]
            assert (block_size, lora, medium) == (PS, None, "CPU")
            parent = hashes[0]
        # the same prefix again: found, nothing new stored for those pages
        n_before = len(stored(sub.events))
        post(s, {"prompt": prompt[:3 * PS] + [7, 8, 9], "max_tokens": 1, "temperature": 0})
        time.sleep(0.3)
        sub.drain(lambda ev: True)
        assert all(e[3] != prompt[i * PS:(i + 1) * PS]
                   for e in stored(sub.events)[n_before:] for i in range(3))
        # a flush is one AllBlocksCleared
        st, _, raw = raw_http(s.port, "POST", "/reset_prefix_cache", b"")
        assert st == 200, raw
        sub.drain(lambda ev: ev and ev[-1] == ["AllBlocksCleared"])
        # a small pool (about 33 pages): distinct prompts evict what came before
        known = {e[1][0] for e in stored(sub.events)}
        for k in range(8):
            p = [(k * 7919 + 13 * i) % 40000 + 100 for i in range(8 * PS)]
            post(s, {"prompt": p, "max_tokens": 1, "temperature": 0})
        time.sleep(0.2)  # every request answered: its pages offered, the 10 ms batches sent
        m = s.metrics()
        n_stored = m[("tandem_kv_events_total", (("kind", "BlockStored"),))]
        sub.drain(lambda ev: len(stored(ev)) == n_stored)
        known |= {e[1][0] for e in stored(sub.events)}
        removed = [e for e in sub.events if e[0] == "BlockRemoved"]
        assert removed and len(removed) == m[("tandem_kv_events_total", (("kind", "BlockRemoved"),))]
        assert all(len(e[1]) == 1 and e[1][0] in known and e[2] == "CPU" for e in removed)
        assert sub.seqs == list(range(len(sub.seqs)))  # from 0, no gap
        assert m[("tandem_kv_events_total", (("kind", "AllBlocksCleared"),))] == 1
        assert m[("tandem_kv_events_dropped_total", ())] == 0
        assert m[("tandem_kv_events_batches_total", ())] == len(sub.seqs)
    finally:
        sub.close()
        s.stop()


@pytest.mark.parametrize("args,needle", [
    (["--kv-events", "tcp://127.0.0.1:5999"], "it needs --prefix-caching"),
    (["--prefix-caching", "--kv-events-topic", "x"], "--kv-events-topic goes with --kv-events"),
    (["--prefix-caching", "--kv-events", "bogus://x"], "--kv-events: kv events: cannot bind"),
])
def test_kv_events_flag_errors(default_model, args, needle):
    cp = run_tandem(["serve", "--port", "0"] + args, check=False, timeout=60)
    assert cp.returncode == 2 and needle in cp.stderr, cp.stderr
