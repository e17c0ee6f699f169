"""HTTP hardening (issue 15, item 4): framing that libmicrohttpd lets through is refused in
OpenAI JSON (a NUL in the request target, two Content-Length headers), and so is framing that
libmicrohttpd refuses itself before any handler runs (its bodies are HTML pages compiled into
the library: front.c turns them into JSON), on the server and the router; a prompt far over the
context is refused before the tokenizer runs, and slow clients neither hold a thread each nor
lock anyone out: a healthy client is served while 2,000 slow ones hang on, and connections that
miss the header deadline are closed."""
import json
import resource
import socket
import time

import pytest

from lib.rawhttp import assert_library_refusals_are_json, exchange_bytes, raw_http
from lib.server import Server


def exchange(port, raw, timeout=30):
    head, _, body = exchange_bytes(port, raw, b"", timeout).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def expect_json_400(port, raw, words):
    st, body = exchange(port, raw)
    assert st == 400, body
    msg = json.loads(body)["error"]["message"]
    assert words in msg, msg


def test_nul_in_the_request_target_is_refused(server):
    expect_json_400(server.port, b"GET /v1/models\x00/x HTTP/1.1\r\nHost: a\r\n"
                    b"Connection: close\r\n\r\n", "NUL")
    expect_json_400(server.port, b"GET /v1/models%00/x HTTP/1.1\r\nHost: a\r\n"
                    b"Connection: close\r\n\r\n", "NUL")
    # what is fine stays fine: a query, an escape that decodes to a route
    for target in (b"/v1/models?a=b&c=%41", b"/v1/mo%64els"):
        st, body = exchange(server.port, b"GET " + target + b" HTTP/1.1\r\nHost: a\r\n"
                            b"Connection: close\r\n\r\n")
        assert st == 200 and json.loads(body)["object"] == "list"


def test_two_content_lengths_are_refused(server):
    body = b'{"prompt":"hi","max_tokens":1}'
    expect_json_400(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (len(body), len(body))
                    + body, "Content-Length")


def test_library_refusals_are_json(server):
    assert_library_refusals_are_json(server.port)


def test_prompt_far_over_the_context_is_refused_before_tokenizing(server):
    prompt = "word " * (800 * 1024)  # 4 MB
    st, _, body = raw_http(server.port, "POST", "/v1/completions",
                           json.dumps({"prompt": prompt, "max_tokens": 1}).encode())
    assert st == 400
    msg = json.loads(body)["error"]["message"]
    # the bound or the tokenizer stopped at the context, not the full count of 819,201 tokens
    assert "at least" in msg or "more than" in msg, msg
    st, _, body = raw_http(server.port, "POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}).encode())
    msg = json.loads(body)["error"]["message"]
    assert st == 400 and ("at least" in msg or "more than" in msg), msg


def slow_sockets(port, n):
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n")
        socks.append(s)
    return socks


def test_a_healthy_client_is_served_while_2000_slow_ones_hang_on(default_model):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2600:
        pytest.skip(f"the descriptor limit ({hard}) is below 2,600")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2600), hard))
    s = Server(["--threads", "2", "--header-timeout-ms", "600000"])
    socks = []
    try:
        socks = slow_sockets(s.port, 2000)
        for _ in range(3):  # they keep trickling header bytes
            for k in socks:
                k.sendall(b"X")
            st, r = s.post("/v1/completions", {"prompt": "The capital of France is",
                                               "max_tokens": 4, "temperature": 0}, timeout=30)
            assert st == 200 and r["usage"]["completion_tokens"] == 4
            st, body, _ = s.request("GET", "/health", timeout=10)
            assert st == 200
        # they cost no thread each: the server's thread count stays small
        threads = int(open(f"/proc/{s.proc.pid}/status").read().split("Threads:")[1].split()[0])
        assert threads < 100, f"{threads} threads for 2,000 connections"
    finally:
        for k in socks:
            k.close()
        s.stop()


def test_connections_past_the_header_deadline_are_closed(default_model):
    s = Server(["--threads", "1", "--header-timeout-ms", "1000", "--max-connections", "40"])
    try:
        socks = slow_sockets(s.port, 40)
        # the connection limit is full: a new client cannot get in ...
        t0 = time.time()
        closed = 0
        while closed < len(socks) and time.time() - t0 < 15:
            for k in socks:
                try:
                    k.sendall(b"X")  # trickling: the idle timeout alone would never fire
                except OSError:
                    pass
            time.sleep(0.3)
            closed = 0
            for k in socks:
                k.settimeout(0.001)
                try:
                    closed += k.recv(1) == b""
                except socket.timeout:
                    pass
                except OSError:
                    closed += 1
        assert closed == len(socks), f"{closed} of {len(socks)} closed"
        # ... and once the slow ones are gone, it can
        st, body, _ = s.request("GET", "/health", timeout=10)
        assert st == 200
        for k in socks:
            k.close()
        s.stop_clean()
    finally:
        s.stop()
