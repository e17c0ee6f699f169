"""Starting and stopping `tandem serve` (and, through TandemProcess, `tandem router`) for tests,
plain HTTP requests to them, and reading their /metrics.

Every process is started on a free port (--port 0 --port-file) and always stopped by PID: the
fixture sends SIGTERM, waits, and SIGKILLs if the process is still there.
"""
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def build_dir():  # as tests/conftest.py reads it (that module's name is taken by fixtures here)
    return (ROOT / os.environ.get("TANDEM_BUILD", "build")).resolve()


def default_model_path():
    if os.environ.get("TANDEM_MODEL"):
        return pathlib.Path(os.environ["TANDEM_MODEL"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "tandem" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


class TandemProcess:
    """A `tandem <command>` child process on a free port (--port 0 --port-file), always stopped
    by PID: SIGTERM, a wait, then SIGKILL if it is still there. `args` come last, so that they
    override the defaults."""
    start_timeout_s = 120
    start_poll_s = 0.05
    stop_timeout_s = 60
    request_timeout_s = 300

    def __init__(self, command, defaults, args=(), env=None, prefix=None):
        self.command = command
        self.dir = tempfile.mkdtemp(prefix=f"tandem-{command}-")
        self.port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "log")
        args = [str(a) for a in args]
        cmd = list(prefix or []) + [str(build_dir() / "tandem"), command, "--port", "0",
                                    "--port-file", self.port_file] + list(defaults) + args
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self.port = None
        deadline = time.time() + self.start_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem {command} exited {self.proc.returncode}:\n"
                                   f"{self.logs()}")
            if os.path.exists(self.port_file):
                self.port = int(open(self.port_file).read())
                break
            time.sleep(self.start_poll_s)
        if self.port is None:
            self.stop()
            raise RuntimeError(f"tandem {command} did not start in {self.start_timeout_s} s:\n"
                               + self.logs())
        host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
        self.url = f"http://{host}:{self.port}"

    def logs(self):
        self.log.flush()
        return open(self.log_path, errors="replace").read()[-6000:]

    def stop(self, timeout=None):
        """SIGTERM, then SIGKILL after timeout. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def stop_clean(self):
        """Stops and asserts a clean exit (no sanitizer report, no leak)."""
        rc = self.stop()
        log = open(self.log_path, errors="replace").read()
        assert rc == 0, f"tandem {self.command} exited {rc}:\n{log[-6000:]}"
        assert "runtime error" not in log and "AddressSanitizer" not in log, log[-6000:]

    def request(self, method, path, body=None, headers=None, timeout=None):
        return http_request(self.url, method, path, body, headers,
                            self.request_timeout_s if timeout is None else timeout)

    def metrics(self):
        st, raw, _ = self.request("GET", "/metrics")
        assert st == 200
        return parse_prometheus(raw.decode())


def http_request(base, method, path, body=None, headers=None, timeout=120):
    """(status, body bytes, headers) with urllib: independent of the code under test. A body
    that is not bytes (or None) is sent as JSON."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


class Server(TandemProcess):
    """`tandem serve` of the default model (or `model`), served as "smol"."""

    def __init__(self, args=(), env=None, model=None, prefix=None):
        super().__init__("serve", ["--model", str(model or default_model_path()),
                                   "--served-model-name", "smol", "--drain-timeout", "20"],
                         args, env, prefix)

    def post(self, path, body, **kw):
        st, raw, _ = self.request("POST", path, body, **kw)
        return st, json.loads(raw) if raw else None

    def wait_idle(self, timeout=30):
        """Waits until no request runs or waits and every KV page is free; returns metrics."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if (m[("tandem_requests_running", ())] == 0 and m[("tandem_requests_waiting", ())] == 0
                    and m[("tandem_kv_pages_used", ())] == 0
                    and m[("tandem_kv_pages_in_flight", ())] == 0):
                return m
            if time.time() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: running "
                                     f"{m[('tandem_requests_running', ())]}, pages used "
                                     f"{m[('tandem_kv_pages_used', ())]}")
            time.sleep(0.05)


_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')


def parse_prometheus(text):
    """A strict parser of the Prometheus text format (0.0.4): returns {(name, labels): value}
    with labels as a sorted tuple of (key, value) pairs, the `model` label dropped. Raises on
    any malformed line, and checks that every sample's family has # TYPE before it."""
    out, types = {}, {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ")
            assert typ in ("counter", "gauge", "histogram", "summary", "untyped"), line
            types[name] = typ
            continue
        assert not line.startswith("#"), line
        m = _LINE.match(line)
        assert m, f"malformed metrics line: {line!r}"
        name, labels_s, value = m.group(1), m.group(3) or "", m.group(4)
        labels, pos = [], 0
        while pos < len(labels_s):
            lm = _LABEL.match(labels_s, pos)
            assert lm, f"malformed labels: {line!r}"
            labels.append((lm.group(1), lm.group(2)))
            pos = lm.end()
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or family in types, f"no # TYPE for {name}"
        key = (name, tuple(sorted(kv for kv in labels if kv[0] != "model")))
        assert key not in out, f"duplicate sample {key}"
        out[key] = float(value)
    return out


def histogram(m, name):
    """(buckets [(le, cumulative count)], sum, count) of a histogram family."""
    b = sorted(((float("inf") if dict(k[1])["le"] == "+Inf" else float(dict(k[1])["le"])), v)
               for k, v in m.items() if k[0] == name + "_bucket")
    return b, m[(name + "_sum", ())], m[(name + "_count", ())]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
