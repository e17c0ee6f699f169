"""HTTPS (issue 15, item 9): `tandem serve` and `tandem router` speak TLS with --tls-cert and
--tls-key, and the router verifies https:// backends (--backend-ca) by CA and by host. The
certificates are made here, with the openssl command line: a CA, a server certificate that it
signs for IP 127.0.0.1 only, and a second CA that signs nothing the servers use.

The clients are independent of the code under test: Python's ssl module (through urllib and
raw sockets), and the official `openai` client (httpx) for a streamed completion."""
import json
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import httpx2 as httpx
import openai
import pytest

from conftest import run_tandem
from lib.server import Server
from router.routerlib import Router


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                "-subj", f"/CN=tandem test {ca}", cwd=d)
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=tandem test server",
            cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n"
                               "extendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.ext", cwd=d)
    for k in ("ca.key", "other-ca.key", "server.key"):
        os.chmod(d / k, 0o600)
    return d

@pytest.fixture(scope="module")
def tls_server(pki, default_model):
    s = Server(["--threads", "2", "--tls-cert", pki / "server.pem", "--tls-key",
                pki / "server.key", "--header-timeout-ms", "1500"])
    s.url = f"https://127.0.0.1:{s.port}"
    try:
        yield s
    finally:
        assert s.stop() == 0, s.logs()

def context(pki, ca="ca.pem"):
    return ssl.create_default_context(cafile=str(pki / ca))

def get(url, path, ctx, body=None, timeout=60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())

GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}

def test_serve_answers_over_https(tls_server, pki):
    st, body = get(tls_server.url, "/v1/models", context(pki))
    assert st == 200 and body["data"][0]["id"] == "smol"
    st, body = get(tls_server.url, "/v1/completions", context(pki), GREEDY)
    assert st == 200 and "Paris" in body["choices"][0]["text"], body
    # errors are OpenAI JSON over TLS too
    st, body = get(tls_server.url, "/v1/completions", context(pki), {"prompt": 5})
    assert st == 400 and body["error"]["message"]

def test_openai_client_streams_over_https(tls_server, pki):
    with httpx.Client(verify=context(pki), timeout=120) as hc:
        client = openai.OpenAI(base_url=tls_server.url + "/v1", api_key="unused",
                               max_retries=0, http_client=hc)
        chunks = list(client.completions.create(model="smol", stream=True, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    _, full = get(tls_server.url, "/v1/completions", context(pki), GREEDY)
    assert text == full["choices"][0]["text"] and "Paris" in text

def test_plain_http_and_untrusted_clients_get_nothing(tls_server, pki):
    # plain HTTP to the TLS port: no HTTP answer
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    assert not got.startswith(b"HTTP/"), got[:80]
    # a client that trusts another CA refuses the server's certificate
    with pytest.raises(urllib.error.URLError) as e:
        get(tls_server.url, "/v1/models", context(pki, "other-ca.pem"))
    assert "CERTIFICATE_VERIFY_FAILED" in str(e.value)
    # the server still serves
    assert get(tls_server.url, "/v1/models", context(pki))[0] == 200

def test_a_client_that_never_handshakes_is_closed(tls_server):
    t0 = time.time()
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=30) as s:
        assert s.recv(1) == b""  # closed by the header deadline (1.5 s), not the idle timeout
    assert time.time() - t0 < 20

def test_router_speaks_tls_both_ways(tls_server, pki):
    backend = tls_server.url
    r = Router([backend], ["--backend-ca", pki / "ca.pem", "--tls-cert", pki / "server.pem",
                           "--tls-key", pki / "server.key"])
    try:
        url = f"https://127.0.0.1:{r.port}"
        deadline = time.time() + 30
        while True:  # the first health check may race the listener
            st, body = get(url, "/v1/completions", context(pki), GREEDY)
            if st == 200 or time.time() > deadline:
                break
            time.sleep(0.2)
        assert st == 200, body
        _, direct = get(backend, "/v1/completions", context(pki), GREEDY)
        assert body["choices"][0]["text"] == direct["choices"][0]["text"]
        # a streamed answer is relayed as it comes, through both TLS hops
        with httpx.Client(verify=context(pki), timeout=120) as hc:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                   http_client=hc)
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="smol", stream=True, **GREEDY) if c.choices)
        assert text == direct["choices"][0]["text"]
    finally:
        assert r.stop() == 0, r.logs()

@pytest.mark.parametrize("case", ["wrong-ca", "wrong-host"])
def test_router_refuses_a_backend_it_cannot_verify(tls_server, pki, case):
    if case == "wrong-ca":
        backend, ca, why = tls_server.url, "other-ca.pem", "issuer is unknown"
    else:  # the certificate names IP 127.0.0.1 only
        backend, ca, why = f"https://localhost:{tls_server.port}", "ca.pem", "does not match"
    r = Router([backend], ["--backend-ca", pki / ca])
    try:
        st, raw, _ = r.request("POST", "/v1/completions", GREEDY)
        assert st in (502, 503), raw
        assert json.loads(raw)["error"]["message"]
        m = r.metrics()
        assert m[("tandem_router_backend_up", (("backend", backend),))] == 0
        log = r.logs()
        assert "certificate is refused" in log and why in log, log
    finally:
        assert r.stop() == 0, r.logs()

def test_bench_serve_over_https(tls_server, pki, tmp_path):
    out = tmp_path / "bench.json"
    run_tandem(["bench", "serve", "--url", tls_server.url, "--ca", pki / "ca.pem",
                "--num-prompts", "3", "--concurrency", "3", "--input-len", "8",
                "--output-len", "4", "--no-progress", "--json", out])
    summary = json.loads(out.read_text())
    assert summary["completed"] == 3 and summary["failed"] == 0, summary

@pytest.mark.parametrize("args,words", [
    (["--tls-cert", "{d}/server.pem"], "go together"),
    (["--tls-key", "{d}/server.key"], "go together"),
    (["--tls-cert", "{d}/san.ext", "--tls-key", "{d}/server.key"], "not a PEM"),
    (["--tls-cert", "{d}/missing.pem", "--tls-key", "{d}/server.key"], "No such file"),
    (["--tls-cert", "{d}/ca.pem", "--tls-key", "{d}/server.key"], "TLS"),
])
def test_bad_tls_options_are_refused(pki, default_model, args, words):
    args = [a.format(d=pki) for a in args]
    for cmd in (["serve", "--model", str(default_model)],
                ["router", "--backends", "http://127.0.0.1:9"]):
        p = run_tandem(cmd + ["--port", "0"] + args, check=False, timeout=120)
        assert p.returncode == 2, (cmd, p.returncode, p.stderr)
        assert words in p.stderr, p.stderr
