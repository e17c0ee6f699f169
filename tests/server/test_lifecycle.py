"""Disconnects cancel requests and return their pages; /metrics is well-formed and counts what
was served; SIGTERM drains in-flight requests."""
import json
import re
import threading
import time

from lib.rawhttp import open_stream
from lib.server import Server, histogram


def finished(m, reason):
    return m[("tandem_requests_finished_total", (("reason", reason),))]


def test_disconnect_mid_stream_cancels(server):
    before = server.wait_idle()
    s = open_stream(server.port, "/v1/completions",
                    {"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True,
                     "stream": True})
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    assert server.metrics()[("tandem_kv_pages_used", ())] > 0
    s.close()
    after = server.wait_idle(timeout=10)
    assert finished(after, "cancelled") == finished(before, "cancelled") + 1
    assert after[("tandem_kv_pages_free", ())] == after[("tandem_kv_pages_total", ())]


def test_disconnect_while_waiting_non_stream_cancels(server):
    before = server.wait_idle()
    s = open_stream(server.port, "/v1/completions",
                    {"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True})
    deadline = time.time() + 30
    while server.metrics()[("tandem_generation_tokens_total", ())] < \
            before[("tandem_generation_tokens_total", ())] + 3:
        assert time.time() < deadline
        time.sleep(0.02)
    s.close()
    after = server.wait_idle(timeout=10)
    assert finished(after, "cancelled") == finished(before, "cancelled") + 1


def test_metrics_parse_and_count(server):
    m0 = server.wait_idle()
    usages = []
    for i in range(3):
        st, r = server.post("/v1/completions", {"prompt": [10 + i] * (5 + i), "max_tokens": 4 + i,
                                                "ignore_eos": True})
        assert st == 200
        usages.append(r["usage"])
    m1 = server.wait_idle()

    def d(name, labels=()):
        return m1[(name, labels)] - m0[(name, labels)]

    assert d("tandem_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert d("tandem_generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert d("tandem_time_to_first_token_seconds_count") == 3
    assert d("tandem_e2e_request_latency_seconds_count") == 3
    assert d("tandem_inter_token_latency_seconds_count") == sum(
        u["completion_tokens"] - 1 for u in usages)
    assert d("tandem_requests_finished_total", (("reason", "length"),)) == 3
    for fam in ("tandem_time_to_first_token_seconds", "tandem_inter_token_latency_seconds",
                "tandem_e2e_request_latency_seconds", "tandem_batch_tokens",
                "tandem_batch_sequences"):
        buckets, total, count = histogram(m1, fam)
        counts = [c for _, c in buckets]
        assert counts == sorted(counts), f"{fam}: buckets not cumulative"
        assert buckets[-1][0] == float("inf") and buckets[-1][1] == count
        assert total >= 0
    assert m1[("tandem_kv_pages_total", ())] > 0
    assert m1[("tandem_kv_pages_used", ())] == 0 and m1[("tandem_kv_pages_in_flight", ())] == 0
    assert m1[("tandem_requests_running", ())] == 0 and m1[("tandem_requests_waiting", ())] == 0


def test_health(server):
    st, body, _ = server.request("GET", "/health")
    assert st == 200 and json.loads(body) == {"status": "ok"}


def test_sigterm_drains_in_flight_requests(default_model):
    s = Server(["--threads", "2"])
    result = {}
    try:
        def stream():
            sock = open_stream(s.port, "/v1/completions",
                               {"prompt": "Count to fifty.", "max_tokens": 48, "ignore_eos": True,
                                "stream": True})
            data = b""
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
                if b"data: [DONE]" in data:
                    break
                if "first" not in result and data.count(b"data: ") >= 2:
                    result["first"] = time.time()
            sock.close()
            result["data"] = data

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.time() + 60
        while "first" not in result:
            assert time.time() < deadline and t.is_alive()
            time.sleep(0.01)
        s.proc.send_signal(15)
        t.join(60)
        assert not t.is_alive()
        events = re.findall(rb"data: (\{.*?\})\n\n", result["data"])
        last = json.loads(events[-1])
        assert last["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(timeout=30) == 0
    finally:
        s.stop()
