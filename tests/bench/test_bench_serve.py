"""`tandem bench serve` against a scripted fake OpenAI server (tests/bench/fake_openai.py).

References are hand-derived from the fake server's script: it streams exactly
ceil(max_tokens / tokens_per_chunk) token chunks, fails the k-th, 2k-th... request in the
scripted way, and logs every request body it receives. Counts are checked exactly; latencies only
against lower bounds that causality guarantees (the server sleeps before writing) and generous
upper bounds.
"""
import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from conftest import run_tandem

FAKE = pathlib.Path(__file__).resolve().parent / "fake_openai.py"


class FakeServer:
    def __init__(self, tmp_path, *args):
        self.log = tmp_path / f"fake-{os.getpid()}-{id(self)}.jsonl"
        self.proc = subprocess.Popen([sys.executable, str(FAKE), "--log", str(self.log), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"fake server did not start: {line!r} {self.proc.stderr.read()}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def requests(self):
        if not self.log.exists():
            return []
        return [json.loads(ln) for ln in self.log.read_text().splitlines() if ln.strip()]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def fake(tmp_path):
    servers = []

    def start(*args):
        s = FakeServer(tmp_path, *map(str, args))
        servers.append(s)
        return s

    try:
        yield start
    finally:
        for s in servers:
            s.stop()


def bench(tmp_path, url, *args, check=True, timeout=120):
    out = tmp_path / "summary.json"
    cp = run_tandem(["bench", "serve", "--url", url, "--json", out, "--no-progress", *args],
                    check=False, timeout=timeout)
    if check:
        assert cp.returncode == 0, cp.stderr
    summary = json.loads(out.read_text()) if out.exists() else None
    return cp, summary


def test_counts_and_latency_bounds(fake, tmp_path, tandem_bin):
    srv = fake("--ttft-ms", 100, "--itl-ms", 20)
    n, conc, out_len, in_len = 8, 4, 8, 32
    cp, s = bench(tmp_path, srv.url, "--num-prompts", n, "--concurrency", conc,
                  "--output-len", out_len, "--input-len", in_len)
    assert s["completed"] == n and s["failed"] == 0 and s["errors"] == {}
    assert s["model"] == "fake-model"  # discovered through GET /v1/models
    assert s["total_output_tokens"] == n * out_len
    assert s["total_input_tokens"] == n * in_len
    assert s["output_tokens_from_usage"] == n
    # one ITL sample per gap between chunks, one TPOT per request
    assert s["itl_ms"]["n"] == n * (out_len - 1)
    assert s["tpot_ms"]["n"] == n and s["ttft_ms"]["n"] == n and s["e2e_ms"]["n"] == n
    # The server sleeps 100 ms before the first chunk: no TTFT can be below it.
    assert s["ttft_ms"]["min"] >= 100.0
    assert s["ttft_ms"]["p50"] < 1000.0
    # 7 sleeps of 20 ms after the first chunk: e2e >= 100 + 140 ms; mean gap ~20 ms.
    assert s["e2e_ms"]["min"] >= 240.0
    assert 15.0 <= s["itl_ms"]["mean"] <= 200.0
    assert 15.0 <= s["tpot_ms"]["p50"] <= 200.0
    # percentiles are ordered, and TPOT is (e2e - ttft) / (n_out - 1) per request
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = s[k]
        assert st["min"] <= st["p50"] <= st["p90"] <= st["p99"] <= st["max"]
    for r in s["requests"]:
        assert r["error"] is None and r["output_tokens"] == out_len and r["chunks"] == out_len
    # never more than --concurrency in flight, as seen by the server
    assert max(r["in_flight"] for r in srv.requests()) <= conc
    assert s["peak_in_flight"] <= conc
    assert "TTFT" in cp.stdout and "ITL" in cp.stdout and "TPOT" in cp.stdout


def test_percentiles_match_numpy(fake, tmp_path, tandem_bin):
    np = pytest.importorskip("numpy")
    srv = fake("--ttft-ms", 5, "--itl-ms", 1)
    _, s = bench(tmp_path, srv.url, "--num-prompts", 20, "--concurrency", 5, "--output-len", 3,
                 "--input-len", 4)
    ttft = np.array([r["ttft_ms"] for r in s["requests"]])
    e2e = np.array([r["e2e_ms"] for r in s["requests"]])
    for q, key in ((50, "p50"), (90, "p90"), (99, "p99")):
        assert s["ttft_ms"][key] == pytest.approx(np.percentile(ttft, q), rel=1e-9, abs=1e-6)
        assert s["e2e_ms"][key] == pytest.approx(np.percentile(e2e, q), rel=1e-9, abs=1e-6)
    assert s["ttft_ms"]["mean"] == pytest.approx(ttft.mean(), rel=1e-9)
    tpot = (e2e - ttft) / (3 - 1)
    assert s["tpot_ms"]["mean"] == pytest.approx(tpot.mean(), rel=1e-6)


@pytest.mark.parametrize("usage", [True, False])
def test_output_tokens_usage_or_chunks(fake, tmp_path, tandem_bin, usage):
    srv = fake("--tokens-per-chunk", 4, *([] if usage else ["--no-usage"]))
    n, out_len = 5, 10  # 3 chunks (4 + 4 + 2 tokens)
    _, s = bench(tmp_path, srv.url, "--num-prompts", n, "--output-len", out_len,
                 "--input-len", 7)
    assert s["completed"] == n
    per_req = out_len if usage else math.ceil(out_len / 4)
    assert s["total_output_tokens"] == n * per_req
    assert s["output_tokens_from_usage"] == (n if usage else 0)
    assert all(r["chunks"] == 3 for r in s["requests"])
    assert s["itl_ms"]["n"] == n * 2
    # without usage the input count falls back to the planned prompt length (7 ids)
    assert s["total_input_tokens"] == n * 7


@pytest.mark.parametrize("script,kind", [("--fail-every", "http_500"),
                                         ("--cut-every", "truncated"),
                                         ("--error-event-every", "error_event"),
                                         ("--garbage-every", "protocol")])
def test_errors_by_kind(fake, tmp_path, tandem_bin, script, kind):
    srv = fake(script, 3, "--itl-ms", 1)
    cp, s = bench(tmp_path, srv.url, "--num-prompts", 9, "--concurrency", 3,
                  "--output-len", 4)
    assert s["failed"] == 3 and s["completed"] == 6
    assert s["errors"] == {kind: 3}
    assert sum(1 for r in s["requests"] if r["error"] == kind) == 3
    assert s["total_output_tokens"] == 6 * 4  # failed requests count no tokens
    assert s["ttft_ms"]["n"] == 6
    assert kind in cp.stdout
    if kind == "http_500":  # the server's error message is kept
        assert any("scripted failure" in (r["error_message"] or "") for r in s["requests"])


def test_no_done_is_truncated(fake, tmp_path, tandem_bin):
    srv = fake("--no-done")
    _, s = bench(tmp_path, srv.url, "--num-prompts", 4, "--output-len", 3, check=False)
    assert s["errors"] == {"truncated": 4} and s["completed"] == 0


def test_all_failed_exits_1(fake, tmp_path, tandem_bin):
    srv = fake("--fail-every", 1)
    cp, s = bench(tmp_path, srv.url, "--num-prompts", 3, check=False)
    assert cp.returncode == 1
    assert s["errors"] == {"http_500": 3}


def test_connection_refused(tmp_path, tandem_bin):
    import socket
    with socket.socket() as so:  # a port that was free a moment ago and has no listener
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    cp, s = bench(tmp_path, f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", 3,
                  check=False)
    assert cp.returncode == 1 and s["errors"] == {"connect": 3}
    # without --model the discovery request fails first, with a message
    cp = run_tandem(["bench", "serve", "--url", f"http://127.0.0.1:{port}"], check=False)
    assert cp.returncode == 1 and "/v1/models" in cp.stderr


def test_timeout(fake, tmp_path, tandem_bin):
    srv = fake("--ttft-ms", 3000)
    _, s = bench(tmp_path, srv.url, "--num-prompts", 2, "--timeout", 0.3, "--model", "m",
                 check=False)
    assert s["errors"] == {"timeout": 2}
    assert all(r["e2e_ms"] < 2500 for r in s["requests"])


@pytest.mark.parametrize("framing", ["--framing=close", "--ignore-stream"])
def test_other_framings(fake, tmp_path, tandem_bin, framing):
    srv = fake(framing, "--tokens-per-chunk", 1)
    _, s = bench(tmp_path, srv.url, "--num-prompts", 3, "--output-len", 6)
    assert s["completed"] == 3 and s["total_output_tokens"] == 18


def test_request_bodies(fake, tmp_path, tandem_bin):
    srv = fake("--api-key", "sekret")
    n, in_len, rng = 12, 40, 0.5
    _, s = bench(tmp_path, srv.url, "--num-prompts", n, "--input-len", in_len,
                 "--input-len-range", rng, "--output-len", 6, "--output-len-range", 0.5,
                 "--token-range", "1000:1010", "--api-key", "sekret", "--model", "my-model",
                 "--seed", 7)
    reqs = srv.requests()
    assert len(reqs) == n and s["completed"] == n
    lens = []
    for r in reqs:
        assert r["path"] == "/v1/completions" and r["authorization"] == "Bearer sekret"
        b = r["body"]
        assert b["model"] == "my-model" and b["stream"] is True
        assert b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["min_tokens"] == b["max_tokens"]
        assert 3 <= b["max_tokens"] <= 9
        assert all(isinstance(t, int) and 1000 <= t < 1010 for t in b["prompt"])
        assert 20 <= len(b["prompt"]) <= 60
        lens.append(len(b["prompt"]))
    assert len(set(lens)) > 1  # the range is used
    assert s["total_input_tokens"] == sum(lens)
    assert s["total_output_tokens"] == sum(r["body"]["max_tokens"] for r in reqs)
    # without the key the server answers 401
    _, s2 = bench(tmp_path, srv.url, "--num-prompts", 2, "--model", "m", check=False)
    assert s2["errors"] == {"http_401": 2}


def test_shared_prefix(fake, tmp_path, tandem_bin):
    """--prefix-len: every prompt starts with the same ids (words), then its own."""
    for endpoint, key in (("completions", "prompt"), ("chat", "messages")):
        srv = fake()
        _, s = bench(tmp_path, srv.url, "--endpoint", endpoint, "--num-prompts", 6,
                     "--prefix-len", 20, "--input-len", 8, "--seed", 5)
        reqs = srv.requests()
        toks = [r["body"][key] if key == "prompt" else r["body"][key][0]["content"].split()
                for r in reqs]
        assert all(len(t) == 28 for t in toks)
        assert len({tuple(t[:20]) for t in toks}) == 1  # one prefix
        assert len({tuple(t[20:]) for t in toks}) == 6  # each its own rest
        assert s["config"]["prefix_len"] == 20
        srv.stop()


def test_seed_determinism(fake, tmp_path, tandem_bin):
    bodies = []
    for seed in (3, 3, 4):
        srv = fake()
        bench(tmp_path, srv.url, "--num-prompts", 4, "--concurrency", 1, "--seed", seed,
              "--input-len", 16, "--input-len-range", 0.5)
        bodies.append([r["body"]["prompt"] for r in srv.requests()])
        srv.stop()
    assert bodies[0] == bodies[1] and bodies[0] != bodies[2]


def test_chat_words(fake, tmp_path, tandem_bin):
    srv = fake("--itl-ms", 1)
    _, s = bench(tmp_path, srv.url, "--endpoint", "chat", "--num-prompts", 3, "--input-len", 9,
                 "--output-len", 5, "--extra-body", '{"temperature": 0.5}')
    reqs = srv.requests()
    assert all(r["path"] == "/v1/chat/completions" for r in reqs)
    for r in reqs:
        msgs = r["body"]["messages"]
        assert msgs[0]["role"] == "user" and len(msgs[0]["content"].split()) == 9
        assert r["body"]["temperature"] == 0.5
    # the role-only first chunk (empty content) is not a token
    assert s["completed"] == 3 and all(r["chunks"] == 5 for r in s["requests"])
    assert s["total_output_tokens"] == 15 and s["itl_ms"]["n"] == 3 * 4


def test_jsonl_dataset(fake, tmp_path, tandem_bin):
    ds = tmp_path / "prompts.jsonl"
    ds.write_text('{"prompt": "hello there world"}\n'
                  '\n'
                  '{"prompt": [5, 6, 7, 8], "max_tokens": 2}\n'
                  '{"prompt": "one two", "max_tokens": 3}\n')
    srv = fake()
    _, s = bench(tmp_path, srv.url, "--dataset", ds, "--num-prompts", 6, "--concurrency", 1,
                 "--output-len", 4)
    got = [(r["body"]["prompt"], r["body"]["max_tokens"]) for r in srv.requests()]
    lines = [("hello there world", 4), ([5, 6, 7, 8], 2), ("one two", 3)]
    assert got == lines + lines
    assert s["total_output_tokens"] == 2 * (4 + 2 + 3)
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "system", "content": "be brief"},'
                    ' {"role": "user", "content": "a b c"}]}\n')
    srv2 = fake()
    _, s = bench(tmp_path, srv2.url, "--dataset", chat, "--endpoint", "chat", "--num-prompts", 2,
                 "--output-len", 2)
    assert [r["body"]["messages"][1]["content"] for r in srv2.requests()] == ["a b c"] * 2
    assert s["completed"] == 2


def test_poisson_arrivals(fake, tmp_path, tandem_bin):
    rate, n = 200.0, 400
    srv = fake()
    _, s = bench(tmp_path, srv.url, "--rate", rate, "--num-prompts", n, "--output-len", 1,
                 "--input-len", 2, "--seed", 11)
    assert len(srv.requests()) == n and s["completed"] == n
    sched = [r["scheduled_s"] for r in s["requests"]]
    assert sched[0] == 0.0 and all(b > a for a, b in zip(sched, sched[1:]))
    gaps = [b - a for a, b in zip(sched, sched[1:])]
    mean = sum(gaps) / len(gaps)
    # exponential gaps with mean 1/rate: sd of the sample mean is 5%; fixed seed, so no flakes
    assert abs(mean * rate - 1.0) < 0.2
    # P(gap < ln2/rate) = 1/2 for an exponential
    below = sum(g < math.log(2) / rate for g in gaps) / len(gaps)
    assert 0.4 < below < 0.6
    # coefficient of variation is 1 for an exponential (0 for a uniform schedule)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert 0.8 < math.sqrt(var) / mean < 1.2
    # no request starts before its arrival time
    assert all(r["start_s"] >= r["scheduled_s"] for r in s["requests"])
    assert s["config"]["rate"] == rate


def test_high_concurrency(fake, tmp_path, tandem_bin):
    srv = fake("--ttft-ms", 200, "--itl-ms", 5, "--tokens-per-chunk", 2)
    n, conc = 512, 256
    _, s = bench(tmp_path, srv.url, "--num-prompts", n, "--concurrency", conc,
                 "--output-len", 4, "--input-len", 8, timeout=300)
    assert s["completed"] == n, s["errors"]
    assert s["total_output_tokens"] == n * 4
    assert s["peak_in_flight"] <= conc
    assert max(r["in_flight"] for r in srv.requests()) <= conc


def test_json_schema(fake, tmp_path, tandem_bin):
    srv = fake()
    _, s = bench(tmp_path, srv.url, "--num-prompts", 2, "--output-len", 2)
    top = {"tool": str, "version": str, "date": str, "url": str, "endpoint": str, "model": str,
           "config": dict, "duration_s": float, "num_requests": int, "completed": int,
           "failed": int, "errors": dict, "total_input_tokens": int, "total_output_tokens": int,
           "output_tokens_from_usage": int, "request_throughput": float,
           "input_token_throughput": float, "output_token_throughput": float,
           "total_token_throughput": float, "ttft_ms": dict, "tpot_ms": dict, "itl_ms": dict,
           "e2e_ms": dict, "peak_in_flight": int, "requests": list}
    assert set(s) == set(top)
    for k, t in top.items():
        assert isinstance(s[k], t), k
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[k]) == {"n", "mean", "p50", "p90", "p99", "min", "max"}
    assert set(s["config"]) == {"rate", "concurrency", "num_prompts", "dataset", "input_len",
                                "input_len_range", "output_len", "output_len_range", "seed",
                                "ignore_eos", "timeout_s", "prefix_len"}
    assert set(s["requests"][0]) == {"scheduled_s", "start_s", "ttft_ms", "e2e_ms",
                                     "input_tokens", "output_tokens", "chunks",
                                     "output_tokens_from_usage", "error", "error_message"}
    assert s["request_throughput"] == pytest.approx(s["completed"] / s["duration_s"])
    assert s["output_token_throughput"] == pytest.approx(
        s["total_output_tokens"] / s["duration_s"])


BAD_ARGS = [
    (["--rate", "0"], "--rate"),
    (["--rate", "fast"], "--rate"),
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "5000"], "--concurrency"),
    (["--num-prompts", "-1"], "--num-prompts"),
    (["--input-len", "0"], "--input-len"),
    (["--output-len-range", "1.5"], "--output-len-range"),
    (["--endpoint", "embeddings"], "--endpoint"),
    (["--url", "ftp://x"], "--url"),
    (["--url", "https://example.com"], "https"),
    (["--url", "http://127.0.0.1:99999"], "port"),
    (["--token-range", "5:5"], "--token-range"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--dataset", "/nonexistent/file.jsonl"], "--dataset"),
    (["--dataset", "random-ids", "--endpoint", "chat"], "random-ids"),
    (["--timeout", "0"], "--timeout"),
    (["--bogus"], "unknown"),
    (["positional"], "unexpected"),
]


@pytest.mark.parametrize("args,needle", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_args_exit_2(tandem_bin, args, needle):
    cp = run_tandem(["bench", "serve", "--model", "m", *args], check=False, timeout=30)
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert needle in cp.stderr


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": ""}\n', "line 1"),
    ('not json\n', "line 1"),
    ('{"prompt": "ok"}\n{"prompt": [1, -2]}\n', "line 2"),
    ('{"prompt": "ok", "max_tokens": 0}\n', "max_tokens"),
    ('{"messages": [{"role": "user", "content": "x"}]}\n', "--endpoint chat"),
    ('\n\n', "no prompts"),
])
def test_bad_dataset_exit_2(tmp_path, tandem_bin, content, needle):
    ds = tmp_path / "bad.jsonl"
    ds.write_text(content)
    cp = run_tandem(["bench", "serve", "--model", "m", "--dataset", ds], check=False, timeout=30)
    assert cp.returncode == 2 and needle in cp.stderr, cp.stderr


# ---- the HTTP client against hand-written raw responses ----

def _sse_body():
    events = [{"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def _one_byte_chunks(body: bytes) -> bytes:
    return b"".join(b"1;ext=x\r\n" + body[i:i + 1] + b"\r\n" for i in range(len(body))) + \
        b"0\r\nTrailer: y\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
RAW_CASES = {
    "not_http": (b"garbage\r\n\r\n", "protocol"),
    "bad_status": (b"HTTP/1.1 2x0 OK\r\n\r\n", "protocol"),
    "huge_head": (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n", "protocol"),
    "bad_chunk_size": (SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "protocol"),
    "conflicting_length": (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
                           "protocol"),
    "short_body": (SSE_HEAD + b"Content-Length: 1000\r\n\r\n" + _sse_body().encode()[:40],
                   "truncated"),
    "closed_before_head": (b"", "truncated"),
    "no_reply": (None, "timeout"),
    "one_byte_chunks_after_100": (b"HTTP/1.1 100 Continue\r\n\r\n" + SSE_HEAD +
                                  b"Transfer-Encoding: chunked\r\n\r\n" +
                                  _one_byte_chunks(_sse_body().encode()), None),
    "content_length_crlf_events": (SSE_HEAD + b"Content-Length: %d\r\n\r\n" %
                                   len(_sse_body().replace("\n", "\r\n")) +
                                   _sse_body().replace("\n", "\r\n").encode(), None),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_raw_responses(tmp_path, tandem_bin, case):
    import socket
    import threading
    reply, kind = RAW_CASES[case]
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()
    held = []

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            c.settimeout(2)
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += c.recv(65536)
                if reply is None:
                    held.append(c)  # answer nothing; keep the connection open
                    continue
                c.sendall(reply)
            except OSError:
                pass
            c.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        cp, s = bench(tmp_path, url, "--model", "m", "--num-prompts", 2, "--concurrency", 1,
                      "--timeout", 1, check=False)
        if kind is None:
            assert cp.returncode == 0, cp.stderr
            assert s["completed"] == 2 and s["total_output_tokens"] == 4
            assert all(r["chunks"] == 2 for r in s["requests"])
        else:
            assert cp.returncode == 1
            assert s["errors"] == {kind: 2}, s["errors"]
    finally:
        stop.set()
        th.join()
        for c in held:
            c.close()
        srv.close()
