"""Helpers for the router tests: starting and stopping `tandem router` (lib.server's
TandemProcess), reading its metrics, and a scriptable fake backend. Raw HTTP exchanges are
lib.rawhttp's; plain requests are lib.server.http_request.

Every process is started on a free port (--port 0 --port-file) and always stopped by PID. The
router's exit code is checked at stop: under the ASan/UBSan build a leak or a sanitizer report
makes it non-zero.

The fake backend is a plain socket server in a thread (no HTTP library), so a test controls the
exact bytes, the framing and the timing of each answer, and sees what the router sent (method,
path, headers, body) and whether the router closed the connection.
"""
import json
import socket
import threading
import time

from lib.server import TandemProcess


class Router(TandemProcess):
    """`tandem router` over `backends` (URLs), checking them every 200 ms."""
    start_timeout_s = 60
    start_poll_s = 0.02
    stop_timeout_s = 30
    request_timeout_s = 120

    def __init__(self, backends, args=(), env=None):
        super().__init__("router", ["--backends", ",".join(backends), "--health-interval-ms",
                                    "200", "--drain-timeout", "5"], args, env)

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


def up(m, url):
    return m[("tandem_router_backend_up", (("backend", url),))]


def routed(m, url, cls):
    return m[("tandem_router_requests_total", (("backend", url), ("class", cls)))]


def proxy_errors(m, kind):
    return m[("tandem_router_proxy_errors_total", (("kind", kind),))]


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
        self.sock.listen(2048)  # room for a thousand connects at once
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
