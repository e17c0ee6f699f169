"""What the benchmark scripts that start `tandem serve` nodes share: a free port, waiting for a
node's /health, and reading its /metrics. Standard library only (the scripts run on bare
machines)."""
import socket
import subprocess
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_up(url, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def metrics(url):
    """name{labels} -> value, and name -> the sum over its labels."""
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                out[k] = float(v)
                if "{" in k:
                    name = k.split("{", 1)[0]
                    out[name] = out.get(name, 0.0) + float(v)
    return out


def stop_all(procs):
    """Stops the processes (SIGTERM, then SIGKILL after 30 s), last started first."""
    for p in procs[::-1]:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
