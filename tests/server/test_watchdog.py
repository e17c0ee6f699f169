"""The scheduler watchdog (issue 15): a step that makes no progress fails its requests with an
error, turns /health to 503, refuses new requests, and SIGTERM still ends the process within
its drain deadline. The stuck step is made by the scheduler's fault injection
(TANDEM_SCHED_FAULTS=stall:STEP:MS), which sleeps before the step runs."""
import json
import time

from lib.rawhttp import open_stream
from lib.server import Server
from lib.sanitize import SANITIZED

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True}
# Under the sanitizers an ordinary step takes far longer: the limit and the stall scale with it.
# The limit is far above an ordinary step (tens of ms; a loaded 2-core machine or the sanitizers
# make a prefill step take up to seconds), and the injected stall far above the limit.
WATCHDOG_MS, STALL_MS = (6000, 15000) if SANITIZED else (1500, 5000)
SCALE = 4 if SANITIZED else 1


def health(s):
    st, body, _ = s.request("GET", "/health", timeout=10)
    return st, json.loads(body)


def test_stalled_step_fails_its_requests_then_recovers(default_model):
    # step 3 (the second decode) sleeps STALL_MS; the watchdog's limit is WATCHDOG_MS
    s = Server(["--threads", "2", "--watchdog-ms", str(WATCHDOG_MS)],
               env={"TANDEM_SCHED_FAULTS": f"stall:3:{STALL_MS}"})
    try:
        sock = open_stream(s.port, "/v1/chat/completions", {**CHAT, "stream": True})
        t0 = time.time()
        st, r = s.post("/v1/chat/completions", CHAT, timeout=30)
        waited = time.time() - t0
        assert st == 503, r
        assert "stalled" in r["error"]["message"]
        limit = (STALL_MS - 500) / 1000
        assert waited < limit, f"the error took {waited:.1f} s (the stuck step lasts {STALL_MS} ms)"
        # the streaming client gets an error event, not a hang
        data = b""
        while b"[DONE]" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        sock.close()
        assert b"stalled" in data and b'"error"' in data
        # while stalled: /health and new requests say so
        st, h = health(s)
        if st == 503:  # the stall may just have ended on a slow machine
            assert h["status"] == "stalled" and h["stalled_ms"] >= WATCHDOG_MS
            assert "stalled" in s.logs() and "step 3 sleeps" in s.logs()
            st2, r2 = s.post("/v1/chat/completions", CHAT, timeout=30)
            assert st2 == 503 and "stalled" in r2["error"]["message"]
            # the Kubernetes probes: not live (restart it), not ready
            for route in ("/live", "/ready"):
                st3, b3, _ = s.request("GET", route, timeout=10)
                assert st3 == 503 and json.loads(b3)["status"] == "stalled", (route, b3)
        # the step comes back: healthy again, pages at baseline, requests served
        deadline = time.time() + 30 * SCALE
        while health(s)[0] != 200:
            assert time.time() < deadline
            time.sleep(0.1)
        m = s.wait_idle()
        assert m[("tandem_sched_stalls_total", ())] == 1
        assert m[("tandem_sched_watchdog_failed_total", ())] >= 2
        assert m[("tandem_kv_pages_used", ())] == 0
        st, r = s.post("/v1/chat/completions", CHAT, timeout=60)
        assert st == 200 and r["usage"]["completion_tokens"] == 8
        s.stop_clean()
    finally:
        s.stop()


def test_sigterm_ends_a_stalled_server(default_model):
    # step 2 never ends
    s = Server(["--threads", "2", "--watchdog-ms", str(WATCHDOG_MS), "--drain-timeout", "1"],
               env={"TANDEM_SCHED_FAULTS": "stall:2:-1"})
    try:
        st, r = s.post("/v1/chat/completions", CHAT, timeout=30)
        assert st == 503 and "stalled" in r["error"]["message"]
        assert health(s)[0] == 503
        t0 = time.time()
        s.proc.send_signal(15)
        rc = s.proc.wait(timeout=15)
        took = time.time() - t0
        assert "step 2 sleeps" in s.logs()  # the injected stall, not a slow ordinary step
        assert rc == 3, s.logs()
        assert took < 6 * SCALE, f"SIGTERM took {took:.1f} s with a 1 s drain deadline"
        assert "stalled in a step" in s.logs()
    finally:
        s.stop()


def test_bad_fault_spec_is_refused(default_model):
    try:
        Server(["--threads", "1"], env={"TANDEM_SCHED_FAULTS": "stall:x"})
    except RuntimeError as e:
        assert "TANDEM_SCHED_FAULTS" in str(e)
    else:
        raise AssertionError("a bad TANDEM_SCHED_FAULTS was accepted")
