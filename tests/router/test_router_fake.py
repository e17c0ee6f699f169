"""`tandem router` against scripted fake backends (routerlib.FakeBackend): exact bytes both ways,
streaming without buffering, API keys, backend choice, health, retries, timeouts and the
router's own errors. No model is loaded, so these run fast, under sanitizers too.

Expectations are hand-derived from each fake's script: which backend must answer, what bytes it
sent, what the router must have sent to it."""
import json
import signal
import subprocess
import threading
import time

import pytest

from lib.rawhttp import assert_library_refusals_are_json, open_stream, raw_http
from lib.server import build_dir, http_request
from routerlib import (FakeBackend, Router, assert_openai_error, json_answer, proxy_errors, routed,
                       up)


@pytest.fixture
def start():
    """start(Router, ...) / start(FakeBackend, ...): stopped at the end, routers first, each
    router checked for a clean exit."""
    things = []

    def _start(kind, *a, **kw):
        obj = kind(*a, **kw)
        things.append(obj)
        return obj

    yield _start
    failures = []
    for t in reversed(things):
        if isinstance(t, Router):
            try:
                t.stop_clean()
            except AssertionError as e:
                failures.append(str(e))
        else:
            t.close()
    assert not failures, failures[0]


def echo(conn, req):
    """200 with what the backend received."""
    conn.sendall(json_answer(200, {"path": req["path"], "method": req["method"],
                                   "auth": req["headers"].get("authorization"),
                                   "body_hex": req["body"].hex()}))


def post(router, path="/v1/completions", body=None, headers=None):
    return http_request(router.url, "POST", path, body if body is not None else {"prompt": "x"},
                        headers)


def test_api_keys(start):
    fake = start(FakeBackend, echo)
    plain = start(Router, [fake.url])
    st, raw, _ = post(plain, headers={"Authorization": "Bearer client-key"})
    assert st == 200 and json.loads(raw)["auth"] == "Bearer client-key"  # passed through
    st, raw, _ = post(plain)
    assert st == 200 and json.loads(raw)["auth"] is None

    keyed = start(Router, [fake.url], ["--api-key", "K1", "--backend-api-key", "K2"])
    n = len(fake.requests)
    for hdr in ({}, {"Authorization": "Bearer K2"}, {"Authorization": "Bearer K1x"},
                {"Authorization": "K1"}):
        st, raw, _ = post(keyed, headers=hdr)
        assert st == 401, hdr
        assert assert_openai_error(raw)["type"] == "authentication_error"
    st, raw, _ = http_request(keyed.url, "GET", "/v1/models")
    assert st == 401
    assert len(fake.requests) == n  # none of them reached the backend
    st, raw, _ = post(keyed, headers={"Authorization": "Bearer K1"})
    assert st == 200 and json.loads(raw)["auth"] == "Bearer K2"
    assert http_request(keyed.url, "GET", "/health")[0] == 200  # no key needed
    assert http_request(keyed.url, "GET", "/metrics")[0] == 200

    own_only = start(Router, [fake.url], ["--api-key", "K1"])
    st, raw, _ = post(own_only, headers={"Authorization": "Bearer K1"})
    assert st == 200 and json.loads(raw)["auth"] is None  # the router's key is not forwarded


def test_bytes_pass_through_both_ways(start):
    payload = bytes(range(256)) * 400  # 102400 bytes, every byte value

    def behave(conn, req):
        if req["path"] == "/v1/completions":  # Content-Length framing, an odd status
            conn.sendall(b"HTTP/1.1 429 Too Many\r\nContent-Type: application/x-test\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(payload) +
                         payload)
        else:  # chunked framing, uneven chunks
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            pos = 0
            for size in (1, 7, 4096, 33333, len(payload)):
                part = payload[pos:pos + size]
                pos += len(part)
                if part:
                    conn.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
            conn.sendall(b"0\r\n\r\n")

    fake = start(FakeBackend, behave)
    router = start(Router, [fake.url])
    body = b'\xff\xfe{"not": json' + bytes(range(256))
    st, head, got = raw_http(router.port, "POST", "/v1/completions", body)
    assert st == 429 and got == payload
    assert b"content-type: application/x-test" in head.lower()
    assert fake.requests[-1]["body"] == body and fake.requests[-1]["method"] == "POST"
    st, head, got = raw_http(router.port, "POST", "/v1/chat/completions", body)
    assert st == 200 and got == payload
    assert fake.requests[-1]["path"] == "/v1/chat/completions"
    st, _, got = raw_http(router.port, "GET", "/v1/models", b"")
    assert fake.requests[-1]["method"] == "GET" and fake.requests[-1]["path"] == "/v1/models"
    m = router.metrics()
    assert st == 200 and got == payload
    assert routed(m, fake.url, "4xx") == 1 and routed(m, fake.url, "2xx") == 2


def test_stream_flows_before_the_backend_finishes(start):
    go = threading.Event()

    def behave(conn, req):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        ev = b"data: one\n\n"
        conn.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
        go.wait(60)  # the second event only once the client has seen the first
        ev = b"data: two\n\ndata: [DONE]\n\n"
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(ev), ev))

    fake = start(FakeBackend, behave)
    router = start(Router, [fake.url])
    s = open_stream(router.port, "/v1/completions", {"prompt": "x", "stream": True})
    try:
        s.settimeout(30)  # a router that buffered to the end would never deliver "one"
        got = b""
        while b"data: one" not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        assert b"two" not in got
        assert b"text/event-stream" in got and b"cache-control: no-cache" in got.lower()
        go.set()
        while b"[DONE]" not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        assert b"data: two" in got
    finally:
        go.set()
        s.close()


def test_client_leaving_closes_the_backend_connection(start):
    closed = threading.Event()

    def behave(conn, req):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for _ in range(2000):  # up to ~100 s of events, until the router hangs up
            ev = b"data: tick\n\n"
            try:
                conn.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
            except OSError:
                closed.set()
                return
            threading.Event().wait(0.05)

    fake = start(FakeBackend, behave)
    router = start(Router, [fake.url])
    s = open_stream(router.port, "/v1/completions", {"prompt": "x", "stream": True})
    got = b""
    while got.count(b"data: tick") < 2:
        got += s.recv(4096)
    s.close()
    assert closed.wait(30), "the router kept the backend connection after its client left"
    m = router.wait_for(lambda m: proxy_errors(m, "client_disconnect") == 1, "disconnect counted")
    m = router.wait_for(
        lambda m: m[("tandem_router_backend_in_flight", (("backend", fake.url),))] == 0,
        "in-flight back to 0")
    assert up(m, fake.url) == 1  # a client leaving is not the backend's fault


def test_client_closing_on_done_is_not_a_disconnect(start):
    """bench serve and most clients close on `data: [DONE]`, before the backend's chunked
    terminator arrives: the router must not count that as a client leaving. The backend holds
    its terminator for a second so the client's close always comes first; a client that leaves
    before [DONE] is still counted (the control)."""
    def behave(conn, req):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        done = json.loads(req["body"]).get("prompt") == "done"
        for ev in [b"data: one\n\n", b"data: two\n\n"] + ([b"data: [DONE]\n\n"] if done else []):
            conn.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
        threading.Event().wait(1.5)
        try:
            conn.sendall(b"0\r\n\r\n")
        except OSError:
            pass

    fake = start(FakeBackend, behave)
    router = start(Router, [fake.url])
    for prompt, want in (("done", b"data: [DONE]"), ("cut", b"data: two")):
        s = open_stream(router.port, "/v1/completions", {"prompt": prompt, "stream": True})
        got = b""
        while want not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        s.close()
    m = router.wait_for(lambda m: proxy_errors(m, "client_disconnect") == 1,
                        "the early close counted, once")
    time.sleep(2)  # both backends' terminators have come and gone
    assert proxy_errors(router.metrics(), "client_disconnect") == 1


def read_until(s, marker):
    got = b""
    while marker not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    return got


def test_idle_streams_cost_no_threads(start):
    """1,000 streams held open through the router, each waiting on a backend that has sent one
    event: the router's thread count stays that of its event loop (not one per connection), a
    healthy request is answered meanwhile, and every stream gets the next event when it comes."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    go = threading.Event()

    def behave(conn, req):
        if json.loads(req["body"]).get("prompt") == "quick":
            conn.sendall(json_answer(200, {"ok": True}))
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for ev in (b"data: one\n\n", None, b"data: two\n\n", b"data: [DONE]\n\n"):
            if ev is None:
                go.wait(120)
                continue
            conn.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
        conn.sendall(b"0\r\n\r\n")

    fake = start(FakeBackend, behave)
    # The fake backend answers /health from a new Python thread among the thousand it holds; on a
    # loaded two-core machine under ASan that took longer than the default one-second check, the
    # router marked it down, and the healthy request got a 503. The probe's limit is not what is
    # tested here.
    router = start(Router, [fake.url], ("--health-timeout-ms", "15000"))
    n = 1000
    socks = []
    try:
        for _ in range(n):
            socks.append(open_stream(router.port, "/v1/completions", {"prompt": "x", "stream": True}))
        for s in socks:
            read_until(s, b"data: one")
        with open(f"/proc/{router.proc.pid}/status") as f:
            threads = int(next(ln for ln in f if ln.startswith("Threads:")).split()[1])
        assert threads < 40, f"{threads} router threads for {n} open streams"
        st, raw, _ = post(router, body={"prompt": "quick"})
        assert st == 200 and json.loads(raw) == {"ok": True}
        go.set()
        for s in socks:
            assert b"data: two" in read_until(s, b"data: [DONE]")
        m = router.metrics()
        assert proxy_errors(m, "client_disconnect") == 0
        print(f"{n} streams through the router on {threads} threads")
    finally:
        go.set()
        for s in socks:
            s.close()


def test_connection_error_before_the_head_retries_on_another_backend(start):
    def hang_up(conn, req):
        pass  # closes without answering

    bad = start(FakeBackend, hang_up)
    good = start(FakeBackend, echo)
    router = start(Router, [bad.url, good.url])
    for i in range(4):
        st, raw, _ = post(router, body={"prompt": f"p{i}"})
        assert st == 200, raw
        sent = bytes.fromhex(json.loads(raw)["body_hex"])
        assert sent == json.dumps({"prompt": f"p{i}"}).encode()
    # the first pick is the first backend (all idle, round robin from the start): it failed
    assert len(bad.requests) >= 1 and len(good.requests) == 4
    m = router.metrics()
    assert m[("tandem_router_retries_total", ())] == len(bad.requests)
    assert proxy_errors(m, "truncated") == len(bad.requests)
    assert routed(m, good.url, "2xx") == 4
    assert "is down" in router.logs()


def test_no_backend_could_answer_is_502(start):
    def garbage(conn, req):
        conn.sendall(b"garbage\r\n\r\n")

    fake = start(FakeBackend, garbage)
    router = start(Router, [fake.url])
    st, raw, _ = post(router)
    assert st == 502
    assert "no backend could answer" in assert_openai_error(raw)["message"]
    m = router.metrics()
    assert proxy_errors(m, "protocol") == 1
    assert routed(m, "none", "5xx") == 1


def test_silent_backend_is_504_and_stays_up(start):
    release = threading.Event()

    def silent(conn, req):
        release.wait(60)

    fake = start(FakeBackend, silent)
    router = start(Router, [fake.url], ["--timeout", "1"])
    try:
        st, raw, _ = post(router)
        assert st == 504
        assert_openai_error(raw)
        m = router.metrics()
        assert proxy_errors(m, "timeout") == 1 and up(m, fake.url) == 1
    finally:
        release.set()


def test_health_decides_who_is_picked(start):
    a = start(FakeBackend, echo)
    b = start(FakeBackend, echo)
    a.healthy = False
    router = start(Router, [a.url, b.url])
    m = router.metrics()
    assert up(m, a.url) == 0 and up(m, b.url) == 1
    for _ in range(4):
        assert post(router)[0] == 200
        router.settle()
    assert len(a.requests) == 0 and len(b.requests) == 4
    a.healthy = True
    router.wait_for(lambda m: up(m, a.url) == 1, "a back up")
    for _ in range(4):  # all idle: round robin
        assert post(router)[0] == 200
        router.settle()
    assert len(a.requests) == 2 and len(b.requests) == 6
    a.healthy = b.healthy = False
    router.wait_for(lambda m: up(m, a.url) == 0 and up(m, b.url) == 0, "both down")
    st, raw, _ = http_request(router.url, "GET", "/health")
    assert st == 503 and json.loads(raw)["backends_up"] == 0
    st, raw, _ = post(router)
    assert st == 503
    assert "no healthy backend" in assert_openai_error(raw)["message"]
    assert len(a.requests) == 2 and len(b.requests) == 6
    m = router.metrics()
    assert proxy_errors(m, "no_healthy_backend") == 1
    assert m[("tandem_router_health_checks_total", (("backend", a.url), ("result", "fail")))] >= 2


def test_least_loaded_goes_around_a_busy_backend(start):
    release = threading.Event()

    def behave(conn, req):
        if json.loads(req["body"]).get("prompt") == "slow":
            release.wait(60)
        echo(conn, req)

    a = start(FakeBackend, behave)
    b = start(FakeBackend, behave)
    router = start(Router, [a.url, b.url])
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", post(router, body={"prompt": "slow"})))
    t.start()
    try:
        m = router.wait_for(lambda m: sum(m[k] for k in m
                                          if k[0] == "tandem_router_backend_in_flight") == 1,
                            "one request in flight")
        busy = a if m[("tandem_router_backend_in_flight", (("backend", a.url),))] else b
        idle = b if busy is a else a
        for _ in range(3):
            assert post(router)[0] == 200
            router.wait_for(lambda m: m[("tandem_router_backend_in_flight",
                                         (("backend", idle.url),))] == 0, "idle settles")
        assert len(busy.requests) == 1 and len(idle.requests) == 3
    finally:
        release.set()
        t.join(60)
    assert out["r"][0] == 200


def test_router_own_errors(start):
    fake = start(FakeBackend, echo)
    router = start(Router, [fake.url], ["--max-body", "2048"])
    st, _, body = raw_http(router.port, "POST", "/v1/completions", b"{" + b" " * 3000 + b"}")
    assert st == 413
    assert "2048" in assert_openai_error(body)["message"]
    # chunked upload without a Content-Length: the cap holds on the bytes received
    st, _, body = raw_http(router.port, "POST", "/v1/completions",
                           b"bb8\r\n" + b" " * 3000 + b"\r\n0\r\n\r\n",
                           headers={"Transfer-Encoding": "chunked", "Content-Length": None})
    assert st == 413
    st, _, body = raw_http(router.port, "GET", "/v1/nothing", b"")
    assert st == 404 and assert_openai_error(body)["type"] == "not_found_error"
    st, head, body = raw_http(router.port, "GET", "/v1/completions", b"")
    assert st == 405 and b"allow: post" in head.lower()
    assert_openai_error(body)
    st, head, body = raw_http(router.port, "POST", "/v1/models", b"{}")
    assert st == 405 and b"allow: get" in head.lower()
    st, _, body = raw_http(router.port, "POST", "/health", b"")
    assert st == 405
    assert fake.requests == []  # all answered by the router
    assert routed(router.metrics(), "none", "4xx") == 6


def test_library_refusals_are_json(start):
    """What libmicrohttpd refuses before the router's handler runs is answered in JSON too;
    none of it reaches the backend."""
    fake = start(FakeBackend, echo)
    router = start(Router, [fake.url])
    assert_library_refusals_are_json(router.port)
    assert [r["path"] for r in fake.requests] == ["/v1/models"]  # the check's own request


def test_cors_on_the_router(start):
    """--allowed-origins on the router: it answers preflights itself, and its relayed and own
    answers carry Access-Control-Allow-Origin for a listed origin only."""
    fake = start(FakeBackend, echo)
    router = start(Router, [fake.url], ["--allowed-origins", "https://app.example.com"])
    ok = {"Origin": "https://app.example.com"}
    st, head, _ = raw_http(router.port, "OPTIONS", "/v1/completions", b"",
                           headers={**ok, "Access-Control-Request-Method": "POST",
                                    "Content-Length": None, "Content-Type": None})
    assert st == 204 and b"access-control-allow-origin: https://app.example.com" in head.lower()
    assert fake.requests == []
    st, head, _ = raw_http(router.port, "POST", "/v1/completions", b"{}", headers=ok)
    assert st == 200 and b"access-control-allow-origin: https://app.example.com" in head.lower()
    st, head, _ = raw_http(router.port, "GET", "/v1/nothing", b"", headers=ok)
    assert st == 404 and b"access-control-allow-origin" in head.lower()
    st, head, _ = raw_http(router.port, "POST", "/v1/completions", b"{}",
                           headers={"Origin": "https://other.example.com"})
    assert st == 200 and b"access-control-allow-origin" not in head.lower()


def test_cli_refuses_bad_arguments():
    exe = str(build_dir() / "tandem")
    for args in ([], ["--backends", ""], ["--backends", "http://127.0.0.1:1,"],
                 ["--backends", "https://127.0.0.1:1", "--backend-ca", "/nonexistent.pem"],
                 ["--backends", "ftp://x"],
                 ["--backends", "http://127.0.0.1:99999"], ["--backends", "http://127.0.0.1:1",
                                                            "--timeout", "0"],
                 ["--backends", "http://127.0.0.1:1", "--bogus"]):
        cp = subprocess.run([exe, "router", "--port", "0"] + args, capture_output=True, text=True,
                            timeout=30)
        assert cp.returncode == 2, (args, cp.stderr)
        assert "tandem" in cp.stderr
    cp = subprocess.run([exe, "router", "--help"], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0 and "--backends" in cp.stdout


def test_sigterm_drains_then_exits(start):
    go = threading.Event()

    def behave(conn, req):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        ev = b"data: one\n\n"
        conn.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
        go.wait(60)
        ev = b"data: [DONE]\n\n"
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(ev), ev))

    fake = start(FakeBackend, behave)
    router = start(Router, [fake.url])
    s = open_stream(router.port, "/v1/completions", {"prompt": "x", "stream": True})
    try:
        got = b""
        while b"data: one" not in got:
            got += s.recv(4096)
        router.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 20
        while http_request(router.url, "GET", "/health")[0] != 503:  # draining
            assert time.time() < deadline
            time.sleep(0.02)
        st, raw, _ = post(router)
        assert st == 503 and "shutting down" in assert_openai_error(raw)["message"]
        assert router.proc.poll() is None  # still relaying the first stream
        go.set()
        while b"[DONE]" not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
    finally:
        go.set()
        s.close()
    assert router.proc.wait(20) == 0


def which(fakes):
    """Indices of the fakes that got each request, in arrival order of the bodies."""
    got = {}
    for i, f in enumerate(fakes):
        for r in f.requests:
            got[json.loads(r["body"])["id"]] = i
    return got


@pytest.mark.parametrize("api", ["chat", "completions", "tokens", "batch"])
def test_prefix_route_follows_the_prompt_prefix(start, api):
    """--route prefix: requests sent one at a time (nothing in flight, so load never decides)
    that share a long prefix go to the backend its first request went to; three prefixes spread
    over both backends (their first requests go by load: round robin when all are idle). The
    router counts the blocks of its picks that matched. Least-loaded routing of the same
    sequence alternates instead (three prefixes over two backends in turn)."""
    fakes = [start(FakeBackend, echo) for _ in range(2)]
    prefixed = start(Router, [f.url for f in fakes], ["--route", "prefix"])
    plain = start(Router, [f.url for f in fakes])

    def body(p, k):
        text = f"system prompt {p} " * 40  # ~700 bytes: five 128-byte blocks
        if api == "chat":
            return {"id": f"{p}-{k}", "messages": [{"role": "system", "content": text},
                                                    {"role": "user", "content": f"question {k}"}]}
        if api == "tokens":
            return {"id": f"{p}-{k}", "prompt": [[ord(c) for c in text] + [k]]}
        if api == "batch":  # a list of prompts: keyed by the first
            return {"id": f"{p}-{k}", "prompt": [text + f"question {k}", "another"]}
        return {"id": f"{p}-{k}", "prompt": text + f"question {k}"}

    order = [(p, k) for k in range(5) for p in range(3)]
    for p, k in order:
        st, raw, _ = post(prefixed, "/v1/chat/completions" if api == "chat" else
                          "/v1/completions", body(p, k))
        assert st == 200, raw
    got = which(fakes)
    homes = {p: got[f"{p}-0"] for p in range(3)}
    for p, k in order:
        assert got[f"{p}-{k}"] == homes[p], (p, k, got)
    assert set(homes.values()) == {0, 1}  # the first requests went by load: both used
    m = prefixed.metrics()
    matched = m[("tandem_router_prefix_blocks_total", (("result", "matched"),))]
    missed = m[("tandem_router_prefix_blocks_total", (("result", "missed"),))]
    assert matched >= 12 * 5 and missed >= 3 * 5, (matched, missed)  # 12 repeats, 3 first sends
    for f in fakes:
        f.requests.clear()
    for p, k in order:
        assert post(plain, body=body(p, k))[0] == 200
    got = which(fakes)
    # no affinity: repeats leave their prefix's backend (a strict alternation moves 6 of the 15;
    # a loaded machine's health checks and late in-flight counts can bend it, so ask for half)
    assert sum(got[f"{p}-{k}"] != homes[p] for p, k in order) >= 3
    assert ("tandem_router_prefix_blocks_total", (("result", "matched"),)) not in plain.metrics()


def test_prefix_route_yields_to_load(start):
    """A prefix's backend busier by about --prefix-weight requests loses the request. With
    weight 3 and every block held by the home backend (share 1): costs at home are in flight +
    1.5, elsewhere 3, so home takes two held requests (1.5, 2.5) and loses the third (3.5)."""
    release = threading.Event()

    def slow(conn, req):
        if json.loads(req["body"]).get("hold"):
            release.wait(30)
        echo(conn, req)

    fakes = [start(FakeBackend, slow) for _ in range(2)]
    r = start(Router, [f.url for f in fakes], ["--route", "prefix", "--prefix-weight", "3"])
    text = "shared prefix " * 60
    assert post(r, body={"id": "a", "prompt": text + "x"})[0] == 200
    home = which(fakes)["a"]
    # "a" stopped being in flight when its backend's answer had all come, before the client
    # had it (were it still counted, h0 would see home busier and go elsewhere)
    assert sum(v for k, v in r.metrics().items() if k[0] == "tandem_router_backend_in_flight") == 0
    threads = [threading.Thread(target=post, args=(r,), kwargs={
        "body": {"id": f"h{i}", "prompt": text + f"h{i}", "hold": True}}) for i in range(2)]
    for t in threads:
        t.start()
        r.wait_for(lambda m, n=threads.index(t) + 1: sum(
            v for k, v in m.items() if k[0] == "tandem_router_backend_in_flight") == n, "held")
    assert post(r, body={"id": "b", "prompt": text + "y"})[0] == 200
    release.set()
    for t in threads:
        t.join()
    got = which(fakes)
    assert got["h0"] == home and got["h1"] == home and got["b"] != home, got


def test_route_flag_errors(start):
    fake = start(FakeBackend, echo)
    cp = subprocess.run([str(build_dir() / "tandem"), "router", "--backends", fake.url,
                         "--route", "nearest"], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 2 and "--route: 'nearest' is not least-loaded, prefix or kv" in cp.stderr
