"""Disaggregated prefill and decode, end to end: real `tandem serve --role prefill` and
`--role decode` processes exchanging KV over libfabric (tcp;ofi_rxm on loopback, or across a veth
pair between network namespaces).

The reference for every output is a colocated server (`--role both`) running the same greedy
requests: disaggregation must be invisible in the tokens and their log-probabilities. After
every scenario both page pools are back to baseline.

The nodes serve the default model cut to its first layers (lib.models: same tokenizer, weights
and code paths, a quarter of the work) unless a test names another model: what these tests
check is the transfer, which the log-probabilities compared bit for bit would show."""
import concurrent.futures as cf
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
import uuid

import pytest

from lib.models import SHORT_LAYERS, short_model_path
from lib.server import Server, build_dir, free_port
from lib.sanitize import SANITIZED, release_only

THREADS = ["--threads", "1"]
# Under sanitizers, tests that only add processes (not code paths) run in the Release pass only.
MORE_PROCESSES = release_only("more processes, same code paths as the single-pair tests")


# Under sanitizers three instrumented processes share two cores with the test runner: a peer's
# heartbeat can starve for seconds, and the default 2 s would declare it dead, or a queued remote
# prefill outlive the default 30 s deadline (the request is then prefilled locally: correct, but
# not what these tests count). Tests that exercise the timeouts pass their own values, which
# come later on the command line and win.
SLACK = ["--peer-timeout-ms", "30000"] if SANITIZED else []
DECODE_SLACK = SLACK + ["--remote-timeout-ms", "300000"] if SANITIZED else []


def prefill_node(extra=(), env=None, prefix=None, addr=None, model=None):
    """A prefill node of `model` (default: the short model) writing its address to a file."""
    if addr is None:
        addr = os.path.join(tempfile.mkdtemp(prefix="tandem-pf-"), "addr")
    s = Server(THREADS + ["--role", "prefill", "--xfer-addr-file", addr] + SLACK + list(extra),
               env=env, prefix=prefix, model=model or short_model_path())
    s.addr_file = addr
    return s


# A small remote chunk (4 pages) makes multi-chunk prefills out of short, cheap prompts.
CHUNK = 64


def decode_node(peers, extra=(), env=None, model=None):
    """A decode node of `model` (default: the short model) whose peers are these prefill nodes."""
    return decode_server(",".join("@" + p.addr_file for p in peers), extra, env, model)


def decode_server(peer_spec, extra=(), env=None, model=None):
    """A decode node of `model` (default: the short model) with --prefill-peers peer_spec."""
    return Server(THREADS + ["--role", "decode", "--prefill-peers", peer_spec,
                             "--remote-chunk", str(CHUNK)] + DECODE_SLACK + list(extra), env=env,
                  model=model or short_model_path())


def colocated_server(extra=(), model=None):
    """The reference: a colocated server of the nodes' model."""
    return Server(THREADS + list(extra), model=model or short_model_path())


def prompts(n, seed, lens):
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(lens[i % len(lens)])] for i in range(n)]


def run(server, prompt, max_tokens=6):
    st, r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True, "logprobs": 0},
                        timeout=600 if SANITIZED else 120)
    assert st == 200, r
    lp = r["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def prefill_idle(p, timeout=30):
    """The prefill node's pool at baseline and no job left."""
    deadline = time.time() + timeout
    while True:
        m = p.metrics()
        if (m[("tandem_kv_pages_used", ())] == 0 and m[("tandem_kv_pages_in_flight", ())] == 0
                and m[("tandem_disagg_prefill_queue_depth", ())] == 0):
            return m
        assert time.time() < deadline, "prefill node not idle"
        time.sleep(0.05)


def decode_idle(d, timeout=30):
    deadline = time.time() + timeout
    while True:
        m = d.wait_idle(timeout)
        if m[("tandem_disagg_fenced_pages", ())] == 0:
            return m
        assert time.time() < deadline, "decode node still has fenced pages"
        time.sleep(0.05)


def assert_all_remote(d, m0, n):
    """The decoder, once idle, prefilled n more requests remotely since metrics m0, and none
    locally; returns its metrics."""
    m1 = decode_idle(d)
    assert m1[("tandem_disagg_remote_prefills_total", ())] - \
        m0[("tandem_disagg_remote_prefills_total", ())] == n
    assert m1[("tandem_disagg_local_fallbacks_total", ())] == 0
    return m1


@pytest.fixture(scope="module")
def colocated(default_model):
    s = colocated_server()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def pair(default_model):
    p = prefill_node()
    try:
        d = decode_node([p])
        try:
            yield p, d
        finally:
            d.stop()
    finally:
        p.stop()


# lengths: 1 and 2 tokens, page edges (16), chunk edges (64) and several chunks
LENS = [1, 2, 3, 5, 15, 16, 17, 31, 33, 63, 64, 65, 100, 129, 200]
if SANITIZED:  # unoptimised and instrumented: the same edges, fewer long prompts
    LENS = [1, 2, 3, 16, 17, 63, 65, 129]


def test_greedy_identical_to_colocated(colocated, pair):
    p, d = pair
    n = 8 if SANITIZED else 54
    ps = prompts(n, 11, LENS)
    want = [run(colocated, x) for x in ps]
    m0 = d.metrics()
    got = [run(d, x) for x in ps]
    for i, (w, g) in enumerate(zip(want, got)):
        assert w == g, f"prompt {i} ({len(ps[i])} tokens): disaggregated output differs"
    m1 = decode_idle(d)
    remote = sum(1 for x in ps if len(x) >= 2)
    assert m1[("tandem_disagg_remote_prefills_total", ())] - \
        m0[("tandem_disagg_remote_prefills_total", ())] == remote
    assert m1[("tandem_disagg_local_fallbacks_total", ())] == 0
    prefill_idle(p)


def test_concurrent_requests_identical(colocated, pair):
    p, d = pair
    ps = prompts(4 if SANITIZED else 24, 12, LENS)
    want = [run(colocated, x) for x in ps]
    with cf.ThreadPoolExecutor(len(ps)) as ex:
        got = list(ex.map(lambda x: run(d, x), ps))
    assert want == got
    decode_idle(d)
    prefill_idle(p)


def test_overlapping_decode_node_identical(colocated, default_model):
    """A decode node with --overlap on (each step planned and its forward pass run before the
    step before is committed; remote fills landing between steps) gives the colocated greedy
    tokens for concurrent requests, overlaps its steps, and ends with its pool at baseline."""
    p = prefill_node()
    try:
        d = decode_node([p], ["--overlap", "on"])
        try:
            ps = prompts(6 if SANITIZED else 16, 14, LENS)
            want = [run(colocated, x, 10) for x in ps]
            with cf.ThreadPoolExecutor(len(ps)) as ex:
                got = list(ex.map(lambda x: run(d, x, 10), ps))
            assert want == got
            m = decode_idle(d)
            assert m[("tandem_sched_overlapped_steps_total", ())] > 0
            assert m[("tandem_disagg_remote_prefills_total", ())] == \
                sum(1 for x in ps if len(x) >= 2)
            assert m[("tandem_disagg_local_fallbacks_total", ())] == 0
            prefill_idle(p)
        finally:
            d.stop()
    finally:
        p.stop()


def test_speculating_decode_node_identical(colocated, default_model):
    """A decode node that speculates (the self drafter over the KV the prefill node streamed,
    the model drafting for itself, so every draft is kept) gives the colocated greedy tokens."""
    p = prefill_node()
    try:
        d = decode_node([p], ["--spec", "self", "--spec-self-layers", str(SHORT_LAYERS),
                                 "--spec-k", "3"])
        try:
            ps = prompts(4 if SANITIZED else 12, 13, LENS)
            want = [run(colocated, x, 12) for x in ps]
            got = [run(d, x, 12) for x in ps]
            assert want == got
            m = decode_idle(d)
            assert m[("tandem_spec_drafted_tokens_total", ())] > 0
            assert m[("tandem_spec_accepted_tokens_total", ())] == \
                m[("tandem_spec_drafted_tokens_total", ())]
            assert m[("tandem_disagg_remote_prefills_total", ())] >= len(ps) - 1
            prefill_idle(p)
        finally:
            d.stop()
    finally:
        p.stop()


def test_chat_and_stream_through_disaggregation(colocated, pair):
    p, d = pair
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 20, "temperature": 0}
    st, a = colocated.post("/v1/chat/completions", body)
    st2, b = d.post("/v1/chat/completions", body)
    assert st == st2 == 200
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"] == b["usage"] and b["usage"]["completion_tokens"] > 0, (a, b)
    decode_idle(d)
    prefill_idle(p)


def answers_as_colocated(colocated, pair, body):
    """The decode node's answer to body is the colocated server's; returns the remote prefills
    it took."""
    p, d = pair
    st, a = colocated.post("/v1/completions", body)
    m0 = d.metrics()
    st2, b = d.post("/v1/completions", body)
    assert st == st2 == 200, b
    assert a["choices"] == b["choices"]
    m1 = decode_idle(d)
    prefill_idle(p)
    return m1[("tandem_disagg_remote_prefills_total", ())] - \
        m0[("tandem_disagg_remote_prefills_total", ())]


def test_echo_logprobs_prefill_on_the_decode_node(colocated, pair):
    """A request that scores its prompt (echo with logprobs) is prefilled on the decode node,
    where its prompt rows are sampled (no remote prefill is counted for it)."""
    body = {"prompt": prompts(1, 14, [40])[0], "echo": True, "logprobs": 3, "max_tokens": 4,
            "temperature": 0}
    assert answers_as_colocated(colocated, pair, body) == 0


def test_n_choices_through_disaggregation(colocated, pair):
    """n = 3 on a decode node: the prompt is prefilled remotely once (its first choice's), and
    the other choices take its KV on the decode node."""
    body = {"prompt": prompts(1, 15, [70])[0], "n": 3, "max_tokens": 6, "temperature": 1.0,
            "seed": 21, "logprobs": 0, "ignore_eos": True}
    assert answers_as_colocated(colocated, pair, body) == 1


def test_layer_streaming(pair):
    """A long prompt's first KV writes land while its forward pass is still computing later
    layers: the prefill node counts writes that completed before the forward call that produced
    them returned."""
    p, d = pair
    m0 = p.metrics()
    run(d, prompts(1, 13, [130 if SANITIZED else 600])[0], max_tokens=2)
    m1 = prefill_idle(p)
    during = m1[("tandem_disagg_writes_landed_during_forward_total", ())] - \
        m0[("tandem_disagg_writes_landed_during_forward_total", ())]
    total = m1[("tandem_disagg_writes_total", ())] - m0[("tandem_disagg_writes_total", ())]
    assert total > 0 and during >= 1, f"{during} of {total} writes landed during the forward"
    decode_idle(d)


def test_prefill_node_refuses_public_generation(pair):
    p, _ = pair
    st, r = p.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert st == 404 and "prefill node" in r["error"]["message"]


@MORE_PROCESSES
def test_one_prefill_node_serves_two_decoders(colocated, default_model):
    p = prefill_node()
    d1 = d2 = None
    try:
        d1, d2 = decode_node([p]), decode_node([p])
        ps = prompts(8, 14, [20, 40, 70, 10] if SANITIZED else [40, 90, 150, 20])
        want = [run(colocated, x) for x in ps]
        with cf.ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda ix: run(d1 if ix[0] % 2 else d2, ix[1]), enumerate(ps)))
        assert want == got
        for d in (d1, d2):
            assert decode_idle(d)[("tandem_disagg_remote_prefills_total", ())] == 4
        assert prefill_idle(p)[("tandem_disagg_prefills_total", ())] == 8
    finally:
        for s in (d1, d2, p):
            if s:
                s.stop()


@MORE_PROCESSES
def test_decoder_spreads_over_two_prefill_nodes(colocated, default_model):
    p1, p2 = prefill_node(), prefill_node()
    d = None
    try:
        d = decode_node([p1, p2])
        ps = prompts(8, 15, [40, 30, 70, 20] if SANITIZED else [100, 80, 120, 90])
        want = [run(colocated, x) for x in ps]
        with cf.ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda x: run(d, x), ps))
        assert want == got
        decode_idle(d)
        n1 = prefill_idle(p1)[("tandem_disagg_prefills_total", ())]
        n2 = prefill_idle(p2)[("tandem_disagg_prefills_total", ())]
        assert n1 + n2 == 8 and n1 > 0 and n2 > 0, (n1, n2)
    finally:
        for s in (d, p1, p2):
            if s:
                s.stop()


def kill_mid_transfer(colocated, seed, extra=()):
    """Starts a pair (`extra` on both nodes), SIGKILLs the prefill node while it streams a long
    prompt's KV, and checks the client still gets the colocated answer. Returns the decoder,
    still running, and the prefill node, stopped; the caller stops both."""
    prompt = prompts(1, seed, [200 if SANITIZED else 600])[0]
    want = run(colocated, prompt, max_tokens=4)
    p = prefill_node(extra)
    d = None
    try:
        d = decode_node([p], list(extra) + ["--peer-timeout-ms", "1000", "--remote-timeout-ms",
                                            "60000"])
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(run, d, prompt, 4)
            deadline = time.time() + 120
            while p.metrics()[("tandem_disagg_writes_total", ())] < 3:  # mid-transfer
                assert time.time() < deadline and not fut.done()
                time.sleep(0.01)
            p.proc.kill()
            assert fut.result(timeout=300) == want
        return d, p
    except BaseException:
        if d:
            d.stop()
        p.stop()
        raise


def test_prefill_killed_mid_transfer(colocated, default_model):
    """SIGKILL the prefill node while it streams a long prompt's KV: the decoder notices (peer
    timeout), fences the pages, prefills locally, and the client gets the normal answer."""
    d, p = kill_mid_transfer(colocated, 16)
    try:
        m = decode_idle(d)
        errs = sum(v for (name, lab), v in m.items()
                   if name == "tandem_disagg_transfer_errors_total")
        assert errs >= 1 and m[("tandem_disagg_local_fallbacks_total", ())] >= 1
        assert m[("tandem_disagg_peer_up", (("peer", "0"),))] == 0
    finally:
        d.stop()
        p.stop()


FAULTS = [
    ("decode", "drop_imm=1.0,seed=1"),
    ("decode", "drop_imm=0.3,seed=2"),
    ("decode", "dup_imm=0.5,seed=3"),
    ("decode", "delay_imm_ms=50,seed=4"),
    ("decode", "reorder_imm=1.0,seed=5"),
    ("prefill", "fail_write=0.3,seed=6"),
    ("prefill", "fail_write=1.0,seed=7"),
]
if SANITIZED:  # the messenger's failure paths once: a timeout, and failed writes (NACK)
    FAULTS = [FAULTS[0], FAULTS[5]]



def faults_never_hang(colocated, side, spec, seed, extra=(), idle=None):
    """Four concurrent requests through a pair (`extra` on both nodes) with TANDEM_XFER_FAULTS
    `spec` on one side: every answer is the colocated one, within far less than the test's
    time, and then idle(p, d) holds (default: both pools at baseline)."""
    env = {"TANDEM_XFER_FAULTS": spec}
    ps = prompts(4, seed, [40, 70, 2, 20] if SANITIZED else [40, 70, 150, 2])
    want = [run(colocated, x) for x in ps]
    p = prefill_node(extra, env=env if side == "prefill" else None)
    d = None
    try:
        d = decode_node([p], list(extra) + ["--remote-timeout-ms", "3000"],
                        env=env if side == "decode" else None)
        t0 = time.time()
        with cf.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda x: run(d, x), ps))
        assert got == want
        assert time.time() - t0 < 240, "a fault made a request take far longer than its timeout"
        if idle:
            idle(p, d)
        else:
            decode_idle(d)
            prefill_idle(p)
    finally:
        if d:
            d.stop()
        p.stop()


@pytest.mark.parametrize("side,spec", FAULTS, ids=[f"{a}-{b.split(',')[0]}" for a, b in FAULTS])
def test_fault_injection_never_hangs(colocated, default_model, side, spec):
    """Every fault mode ends in a completed request (remote, or local after the remote attempt
    failed) within the timeout, with the colocated output; pools back to baseline."""
    faults_never_hang(colocated, side, spec, 17)


# ---- across a real network stack: two namespaces joined by a veth pair ----

def _sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def netns():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2 (ip); not available here")
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"tdm{tag}", f"tdmh{tag}", f"tdmn{tag}"
    r = _sh("ip", "netns", "add", ns)
    if r.returncode:
        pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
    try:
        cmds = [["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
                ["ip", "link", "set", ns_if, "netns", ns],
                ["ip", "addr", "add", "10.231.0.1/24", "dev", host_if],
                ["ip", "link", "set", host_if, "up"],
                ["ip", "netns", "exec", ns, "ip", "addr", "add", "10.231.0.2/24", "dev", ns_if],
                ["ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
                ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
        for c in cmds:
            r = _sh(*c)
            if r.returncode:
                pytest.skip(f"cannot set up a veth pair here ({' '.join(c)}): {r.stderr.strip()}")
        yield ns
    finally:
        _sh("ip", "link", "del", host_if)
        _sh("ip", "netns", "del", ns)


@MORE_PROCESSES
def test_prefill_and_decode_in_separate_namespaces(colocated, default_model, netns):
    p = prefill_node(["--xfer-node", "10.231.0.2", "--host", "10.231.0.2"],
                     prefix=["ip", "netns", "exec", netns])
    d = None
    try:
        d = decode_node([p], ["--xfer-node", "10.231.0.1"])
        ps = prompts(6, 18, [2, 17, 40, 70] if SANITIZED else [2, 17, 70, 150])
        want = [run(colocated, x) for x in ps]
        assert [run(d, x) for x in ps] == want
        m = decode_idle(d)
        assert m[("tandem_disagg_remote_prefills_total", ())] == 6
        assert m[("tandem_disagg_local_fallbacks_total", ())] == 0
        prefill_idle(p)
    finally:
        if d:
            d.stop()
        p.stop()


def key_file(text):
    d = tempfile.mkdtemp(prefix="tandem-key-")
    path = os.path.join(d, "key")
    with open(path, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)
    return path


@MORE_PROCESSES  # the handshake's code paths run under the sanitizers in test_xfer
def test_fabric_key(colocated, default_model):
    """With --fabric-key the pair proves the cluster key and serves as before; a decode node
    with another key is never taken as a peer by the prefill node (it prefills locally, with
    the same tokens), and a key that is too short is refused at start."""
    key, other = key_file("k" * 32), key_file("o" * 32)
    p = prefill_node(["--fabric-key", key])
    try:
        d = decode_node([p], ["--fabric-key", key])
        try:
            ps = prompts(3, 21, [5, 40, 70])
            assert [run(d, x) for x in ps] == [run(colocated, x) for x in ps]
            m = decode_idle(d)
            assert m[("tandem_disagg_remote_prefills_total", ())] >= len(ps)
            assert m[("tandem_fabric_auth_total", (("result", "ok"),))] >= 1
        finally:
            d.stop()
        bad = decode_node([p], ["--fabric-key", other, "--remote-timeout-ms", "3000"])
        try:
            ps = prompts(2, 22, [5, 40])
            assert [run(bad, x) for x in ps] == [run(colocated, x) for x in ps]
            m = decode_idle(bad)
            assert m[("tandem_disagg_remote_prefills_total", ())] == 0
            # the refused handshake runs beside the requests (they prefill here while no peer
            # is up): on a loaded machine it may land after them
            deadline = time.time() + 30
            while p.metrics()[("tandem_fabric_auth_total", (("result", "failed"),))] < 1:
                assert time.time() < deadline, "the prefill node saw no refused handshake"
                time.sleep(0.05)
            prefill_idle(p)
        finally:
            bad.stop()
    finally:
        p.stop()
    with pytest.raises(RuntimeError, match="16 to 256 bytes"):
        prefill_node(["--fabric-key", key_file("short")])


def peer_up(d):
    return d.metrics()[("tandem_disagg_peer_up", (("peer", "0"),))]


def wait_peer(d, up, timeout):
    deadline = time.time() + timeout
    while peer_up(d) != up:
        assert time.time() < deadline, f"the prefill peer did not go {'up' if up else 'down'}"
        time.sleep(0.1)


# a short liveness limit, so that a stop is noticed quickly (longer under the sanitizers; a
# second or less lets a loaded machine's late heartbeats take a healthy peer down)
QUICK = ["--peer-timeout-ms", "8000" if SANITIZED else "3000"]


def test_stopped_prefill_node_comes_back(colocated, default_model):
    """SIGSTOP: the prefill node's kernel still takes bytes, but it sends no heartbeat, so the
    decode node declares it down and prefills locally; after SIGCONT the decode node's retries
    make a fresh handshake and it is used again. Tokens stay the colocated ones throughout."""
    p = prefill_node(QUICK)
    try:
        # long enough for a remote prefill on a loaded machine: no request is in flight when
        # the node stops (the decoder prefills here once it has seen the peer go down)
        d = decode_node([p], QUICK + ["--remote-timeout-ms", "60000" if SANITIZED else "20000"])
        try:
            ps = prompts(3, 31, [20, 40, 70])
            want = [run(colocated, x) for x in ps]
            wait_peer(d, 1, 60)
            assert run(d, ps[0]) == want[0]
            remote = d.metrics()[("tandem_disagg_remote_prefills_total", ())]
            assert remote >= 1
            os.kill(p.proc.pid, 19)  # SIGSTOP
            try:
                wait_peer(d, 0, 60)
                assert run(d, ps[1]) == want[1]  # prefilled here
            finally:
                os.kill(p.proc.pid, 18)  # SIGCONT
            wait_peer(d, 1, 60)
            assert run(d, ps[2]) == want[2]
            m = decode_idle(d)
            assert m[("tandem_disagg_remote_prefills_total", ())] > remote
            prefill_idle(p)
        finally:
            d.stop()
    finally:
        p.stop()


def test_restarted_prefill_node_is_picked_up(colocated, default_model):
    """A prefill node restarted at a new address (a new port, written to the same
    --prefill-peers @FILE) is found by the decode node, which was not restarted."""
    addr = os.path.join(tempfile.mkdtemp(prefix="tandem-pf-"), "addr")
    p = prefill_node(QUICK, addr=addr)
    d = None
    try:
        d = decode_node([p], QUICK)
        ps = prompts(2, 32, [30, 50])
        want = [run(colocated, x) for x in ps]
        assert run(d, ps[0]) == want[0]
        old = open(addr).read()
        p.stop()
        os.unlink(addr)
        wait_peer(d, 0, 30)
        p = prefill_node(QUICK, addr=addr)
        deadline = time.time() + 30
        while not os.path.exists(addr):
            assert time.time() < deadline
            time.sleep(0.05)
        assert open(addr).read() != old
        remote = d.metrics()[("tandem_disagg_remote_prefills_total", ())]
        wait_peer(d, 1, 60)
        assert run(d, ps[1]) == want[1]
        m = decode_idle(d)
        assert m[("tandem_disagg_remote_prefills_total", ())] == remote + 1
        prefill_idle(p)
    finally:
        if d:
            d.stop()
        p.stop()


def test_prefill_peer_by_http_address(colocated, default_model):
    """--prefill-peers http://HOST:PORT (how a Kubernetes Service names a prefill pod): the
    decoder asks the node for its fabric address at GET /disagg/address. A decoder started
    before its prefill node waits for it, finds it when it comes up, and prefills there; the
    route answers the node's role and address, and 404 on a node without a fabric."""
    port = free_port()
    d = decode_server(f"http://127.0.0.1:{port}")
    p = None
    try:
        assert "does not answer yet" in d.logs()
        assert peer_up(d) == 0
        p = prefill_node(["--port", str(port)])
        st, raw, _ = p.request("GET", "/disagg/address")
        assert st == 200, raw
        info = json.loads(raw)
        assert info["role"] == "prefill"
        assert info["fabric_address"] == open(p.addr_file).read().strip()
        wait_peer(d, 1, 60)
        assert "found: http://127.0.0.1" in d.logs(), d.logs()
        ps = prompts(3, 23, [5, 40, 70])
        assert [run(d, x) for x in ps] == [run(colocated, x) for x in ps]
        m = decode_idle(d)
        assert m[("tandem_disagg_remote_prefills_total", ())] == len(ps)
        st, raw, _ = d.request("GET", "/disagg/address")
        assert st == 200 and json.loads(raw)["role"] == "decode"
        st, raw, _ = colocated.request("GET", "/disagg/address")
        assert st == 404, raw
        prefill_idle(p)
    finally:
        d.stop()
        if p:
            p.stop()


def run_named(server, prompt, name):
    st, r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                            "ignore_eos": True, "logprobs": 0},
                        headers={"x-prefiller-host-port": name},
                        timeout=600 if SANITIZED else 120)
    assert st == 200, r
    return r["choices"][0]["logprobs"]["tokens"], r["choices"][0]["logprobs"]["token_logprobs"]


def named(d, result):
    return d.metrics()[("tandem_disagg_named_prefill_total", (("result", result),))]


def served(p):
    return p.metrics()[("tandem_disagg_prefills_total", ())]


def wait_peers_up(d, n, timeout=60):
    deadline = time.time() + timeout
    while sum(v for (k, _), v in d.metrics().items() if k == "tandem_disagg_peer_up") < n:
        assert time.time() < deadline, f"{n} prefill peers did not come up"
        time.sleep(0.1)


def test_request_names_its_prefill_node(colocated, default_model):
    """llm-d's P/D sidecar names each request's prefill node in x-prefiller-host-port (its HTTP
    HOST:PORT). A decoder with both nodes as http:// peers sends every named request to the
    one named, with the colocated answers; a name that is no peer is served the usual way (and
    counted), a malformed one is a 400; with --add-named-prefill-peers a new name becomes a
    peer (connected in the background) and later requests naming it go there."""
    p1, p2 = prefill_node(), prefill_node()
    d = d2 = None
    try:
        n1, n2 = f"127.0.0.1:{p1.port}", f"127.0.0.1:{p2.port}"
        d = decode_server(f"http://{n1},http://{n2}")
        wait_peers_up(d, 2)
        ps = prompts(4, 31, [5, 40, 70, 17])
        want = [run(colocated, x) for x in ps]
        assert [run_named(d, x, n2) for x in ps] == want
        decode_idle(d)
        assert (served(p1), served(p2)) == (0, len(ps))
        assert named(d, "used") == len(ps)
        # a name that is no peer: the usual choice
        assert run_named(d, ps[0], "127.0.0.1:9") == want[0]
        assert named(d, "unknown") == 1
        assert served(p1) + served(p2) == len(ps) + 1
        for bad in ("evil/../path", "host:abc", "host:123456", ":80"):
            st, r = d.post("/v1/completions", {"prompt": "hi", "max_tokens": 1},
                           headers={"x-prefiller-host-port": bad})
            assert st == 400 and "x-prefiller-host-port" in r["error"]["message"], (bad, r)
        # a decoder that knows only p1 adds p2 when a request names it
        d2 = decode_server(f"http://{n1}", ["--add-named-prefill-peers"])
        wait_peers_up(d2, 1)
        before = served(p2)
        assert run_named(d2, ps[1], n2) == want[1]  # goes to p1 while p2 connects
        assert named(d2, "added") == 1
        wait_peers_up(d2, 2)
        assert run_named(d2, ps[2], n2) == want[2]
        decode_idle(d2)
        assert served(p2) == before + 1 and named(d2, "used") == 1
        prefill_idle(p1)
        prefill_idle(p2)
    finally:
        for s in (d2, d, p2, p1):
            if s:
                s.stop()


def test_two_byte_kv_pages(default_model):
    """--kv-dtype bf16 on both nodes: the pages that cross are bf16, and the answers are the
    colocated bf16 server's token for token (log-probabilities included). A prefill node whose
    pool is f32 refuses a bf16 decoder's request, naming both types; the decoder prefills it
    itself, with the same answer."""
    bf16 = ["--kv-dtype", "bf16"]
    col = colocated_server(bf16)
    p = p32 = d = None
    try:
        p = prefill_node(bf16)
        d = decode_node([p], bf16)
        ps = prompts(4 if SANITIZED else 10, 21, [2, 17, 33, 65, 100])
        want = [run(col, x) for x in ps]
        m0 = d.metrics()
        got = [run(d, x) for x in ps]
        assert got == want, "bf16 pages: disaggregated output differs from colocated bf16"
        assert_all_remote(d, m0, len(ps))
        prefill_idle(p)
        assert "tokens, bf16, " in p.logs() and "tokens, bf16, " in d.logs()
        # which transport each decoder peer gets, said once
        assert p.logs().count("KV pages by libfabric, from host memory here to host memory "
                              "there") == 1, p.logs()
        d.stop()
        d = None
        # an f32 prefill node: refused, and served locally
        p32 = prefill_node()
        d = decode_node([p32], bf16 + ["--remote-attempts", "1"])
        assert run(d, ps[1]) == want[1]
        m = decode_idle(d)
        assert m[("tandem_disagg_local_fallbacks_total", ())] >= 1
        assert m[("tandem_disagg_remote_prefills_total", ())] == 0
        log = d.logs()
        assert "KV element types differ (decoder: bf16, 2 bytes; here: f32, 4 bytes" in log, log
        prefill_idle(p32)
    finally:
        for s in (d, p, p32, col):
            if s:
                s.stop()


def test_gpu_pages_refused_by_a_host_pool(default_model):
    """A decoder whose PREFILL says its KV pool is GPU memory, sent to a prefill node whose pool
    is in host memory, is refused, naming both sides, and nothing is written into its region;
    the same request describing host memory is served (the control: the check can fail)."""
    p = prefill_node()
    try:
        addr = open(p.addr_file).read().strip()
        tool = os.path.join(str(build_dir()), "tests", "tools", "xfer_peer")
        res = {}
        for kind in ("cuda", "host"):
            cp = subprocess.run([tool, "--role", "flood", "--peer", addr, "--flood-ms", "100",
                                 "--linger-ms", "3000" if not SANITIZED else "15000",
                                 "--prefill-geometry", f"{SHORT_LAYERS},3,64,16,576,49152",
                                 "--prefill-kv-kind", kind],
                                capture_output=True, text=True, timeout=120)
            line = [x for x in cp.stdout.splitlines() if x.startswith("FLOOD ")]
            assert line, cp.stdout + cp.stderr
            res[kind] = {k: int(v) for k, v in (f.split("=") for f in line[0].split()[1:])}
        assert res["cuda"]["written"] == 0, res
        assert res["host"]["written"] > 0, res
        log = open(p.log_path, errors="replace").read()  # whole: the flood's junk fills the tail
        assert "KV pages: the decoder's in GPU memory, ours in host memory" in log, log[-3000:]
        prefill_idle(p)
    finally:
        p.stop()
