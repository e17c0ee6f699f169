"""Helpers for the router tests: starting and stopping `tandem router`, a raw HTTP/1.1 exchange,
and a scriptable fake backend.

Every process is started on a free port (--port 0 --port-file) and always stopped by PID. The
router's exit code is checked at stop: under the ASan/UBSan build a leak or a sanitizer report
makes it non-zero.

The fake backend is a plain socket server in a thread (no HTTP library), so a test controls the
exact bytes, the framing and the timing of each answer, and sees what the router sent (method,
path, headers, body) and whether the router closed the connection.
"""
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

from lib.server import build_dir, parse_prometheus


class Router:
    def __init__(self, backends, args=(), env=None):
        self.dir = tempfile.mkdtemp(prefix="tandem-router-")
        self.port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "log")
        cmd = [str(build_dir() / "tandem"), "router", "--backends", ",".join(backends),
               "--port", "0", "--port-file", self.port_file, "--health-interval-ms", "200",
               "--drain-timeout", "5"] + [str(a) for a in args]
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self.port = None
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem router exited {self.proc.returncode}:\n{self.logs()}")
            if os.path.exists(self.port_file):
                self.port = int(open(self.port_file).read())
                break
            time.sleep(0.02)
        if self.port is None:
            self.stop()
            raise RuntimeError("tandem router did not start in 60 s:\n" + self.logs())
        self.url = f"http://127.0.0.1:{self.port}"

    def logs(self):
        self.log.flush()
        return open(self.log_path, errors="replace").read()[-6000:]

    def stop(self, timeout=30):
        """SIGTERM, then SIGKILL after timeout. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def stop_clean(self):
        """Stops and asserts a clean exit (no sanitizer report, no leak)."""
        rc = self.stop()
        log = open(self.log_path, errors="replace").read()
        assert rc == 0, f"tandem router exited {rc}:\n{log[-6000:]}"
        assert "runtime error" not in log and "AddressSanitizer" not in log, log[-6000:]

    def request(self, method, path, body=None, headers=None, timeout=120):
        return http_request(self.url, method, path, body, headers, timeout)

    def metrics(self):
        st, raw, _ = self.request("GET", "/metrics")
        assert st == 200
        return parse_prometheus(raw.decode())

    def settle(self):
        """Waits until no request is in flight to any backend."""
        return self.wait_for(lambda m: sum(v for k, v in m.items()
                                           if k[0] == "tandem_router_backend_in_flight") == 0,
                             "no request in flight")

    def wait_for(self, pred, what, timeout=20):
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if pred(m):
                return m
            if time.time() > deadline:
                raise AssertionError(f"router: {what} not reached in {timeout} s:\n{self.logs()}")
            time.sleep(0.05)


def http_request(base, method, path, body=None, headers=None, timeout=120):
    """(status, body bytes, headers) with urllib: independent of the code under test."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def up(m, url):
    return m[("tandem_router_backend_up", (("backend", url),))]


def routed(m, url, cls):
    return m[("tandem_router_requests_total", (("backend", url), ("class", cls)))]


def proxy_errors(m, kind):
    return m[("tandem_router_proxy_errors_total", (("kind", kind),))]


def raw_http(port, method, path, body: bytes, headers=None, timeout=60):
    """One HTTP/1.1 exchange over a socket; (status, head bytes, de-chunked body)."""
    hdr = {"Host": "127.0.0.1", "Content-Type": "application/json",
           "Content-Length": str(len(body)), "Connection": "close", **(headers or {})}
    hdr = {k: v for k, v in hdr.items() if v is not None}  # None: leave the header out
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdr.items())
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\n")
        try:
            s.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router may answer (413) and close before reading it all
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", payload
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        payload = out
    return status, head, payload


def open_stream(port, path, body):
    """Sends a POST and returns the socket, for reading a stream piece by piece."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


class FakeBackend:
    """Answers GET /health with 200 (unless healthy is False) and hands every other request to
    `behave(conn, req)`, where req is a dict (method, path, headers (lower-case keys), body).
    Every request is recorded in .requests."""

    def __init__(self, behave):
        self.behave = behave
        self.healthy = True
        self.requests = []
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.closing = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.closing:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            conn.settimeout(60)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for ln in lines[1:]:
                k, _, v = ln.partition(":")
                headers[k.strip().lower()] = v.strip()
            n = int(headers.get("content-length", "0"))
            while len(body) < n:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            req = {"method": method, "path": path, "headers": headers, "body": body}
            if path == "/health":
                if self.healthy:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 15\r\nConnection: close\r\n\r\n"
                                 b'{"status":"ok"}')
                else:
                    conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
                return
            with self.lock:
                self.requests.append(req)
            self.behave(conn, req)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.closing = True
        self.sock.close()


def json_answer(status, obj, extra_headers=b""):
    body = json.dumps(obj).encode()
    return (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n".encode() + extra_headers +
            b"\r\n" + body)


def assert_openai_error(raw, status=None):
    """The body is an OpenAI-style error object."""
    e = json.loads(raw)["error"]
    assert isinstance(e["message"], str) and e["message"]
    assert isinstance(e["type"], str) and e["type"]
    assert "param" in e and "code" in e
    return e
