"""`tandem router` over two real `tandem serve` backends (default model, one thread each): the
same greedy output as asking a backend directly (the pinned `openai` client: completions and
chat, streaming and not), load spread over both, errors passed through or answered by the router,
and a client leaving mid-stream cancelling the request on its backend (pages back to baseline).

The reference for every output is a backend asked directly; the reference for where requests
went is the backends' own /metrics."""
import json
import threading

import openai
import pytest

from lib.rawhttp import open_stream, raw_http
from lib.server import Server
from routerlib import Router, assert_openai_error, proxy_errors, routed


@pytest.fixture(scope="module")
def cluster(default_model):
    backends, router = [], None
    try:
        for _ in range(2):
            backends.append(Server(["--threads", "1"]))
        router = Router([b.url for b in backends], ["--max-body", "65536"])
        yield router, backends
    finally:
        try:
            if router:
                router.stop_clean()
        finally:
            for b in backends:
                b.stop()


@pytest.fixture(autouse=True)
def backends_back_to_baseline(request):
    yield
    if "cluster" in request.fixturenames:
        _, backends = request.getfixturevalue("cluster")
        for b in backends:
            if b.proc.poll() is None:
                b.wait_idle()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def prompt_tokens(server):
    return server.metrics()[("tandem_prompt_tokens_total", ())]


def cancelled(server):
    return server.metrics()[("tandem_requests_finished_total", (("reason", "cancelled"),))]


def test_health_and_models(cluster):
    router, backends = cluster
    st, raw, _ = router.request("GET", "/health")
    assert st == 200 and json.loads(raw) == {"status": "ok", "backends_up": 2, "backends": 2}
    via = [m.id for m in client(router.url).models.list().data]
    direct = [m.id for m in client(backends[0].url).models.list().data]
    assert via == direct == ["smol"]


def test_model_tokenize_and_detokenize_routes_pass_through(cluster):
    """GET /v1/models/{id}, POST /tokenize and /detokenize reach a backend and come back as it
    answers them; a wrong method is the router's own 405."""
    router, backends = cluster
    assert client(router.url).models.retrieve("smol").id == "smol"
    with pytest.raises(openai.NotFoundError):
        client(router.url).models.retrieve("other")
    for path, body in (("/tokenize", {"prompt": "Hello world"}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/detokenize", {"tokens": [19556, 905]})):
        via = router.request("POST", path, body)
        direct = backends[0].request("POST", path, body)
        assert via[0] == direct[0] == 200 and json.loads(via[1]) == json.loads(direct[1]), path
    st, raw, _ = router.request("GET", "/tokenize")
    assert st == 405 and json.loads(raw)["error"]["message"] == "use POST /tokenize"


def test_same_greedy_output_as_direct(cluster):
    router, backends = cluster
    via, direct = client(router.url), client(backends[0].url)
    kw = dict(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0)
    a, b = via.completions.create(**kw), direct.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
    assert "Paris" in a.choices[0].text
    sa = list(via.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    sb = list(direct.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    # how tokens group into events depends on the backend's timing, so compare the text
    ta = "".join(c.choices[0].text for c in sa if c.choices)
    assert ta == "".join(c.choices[0].text for c in sb if c.choices) == a.choices[0].text
    assert finishes(sa) == finishes(sb) == ["length"]
    assert sa[-1].usage == sb[-1].usage == a.usage

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    kw = dict(model="smol", messages=msgs, max_tokens=8, temperature=0)
    a, b = via.chat.completions.create(**kw), direct.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage == b.usage
    sa = list(via.chat.completions.create(stream=True, **kw))
    sb = list(direct.chat.completions.create(stream=True, **kw))
    assert sa[0].choices[0].delta.role == sb[0].choices[0].delta.role == "assistant"
    ta = "".join(c.choices[0].delta.content or "" for c in sa)
    assert ta == "".join(c.choices[0].delta.content or "" for c in sb)
    assert ta == a.choices[0].message.content
    assert finishes(sa) == finishes(sb) == [a.choices[0].finish_reason]


def finishes(chunks):
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def test_load_spreads_over_both_backends(cluster):
    router, backends = cluster
    before = [prompt_tokens(b) for b in backends]
    m0 = router.metrics()
    usages, errors = [], []

    def one(i):
        try:
            st, raw, _ = router.request("POST", "/v1/completions",
                                        {"prompt": f"Count to {i}:", "max_tokens": 3,
                                         "temperature": 0})
            assert st == 200, raw
            usages.append(json.loads(raw)["usage"]["prompt_tokens"])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[0]
    grew = [prompt_tokens(b) - x for b, x in zip(backends, before)]
    assert all(g > 0 for g in grew), grew
    assert sum(grew) == sum(usages)  # every request ran on exactly one backend, once
    m1 = router.metrics()
    assert sum(routed(m1, b.url, "2xx") - routed(m0, b.url, "2xx") for b in backends) == 6


def test_bad_json_and_bad_fields_pass_through(cluster):
    router, backends = cluster
    for body in (b'{"prompt": "x", ', b'{"prompt": "x", "max_tokens": -1}',
                 b'{"prompt": "x", "frobnicate": 1}', b'\xff\xfe'):
        sv, _, bv = raw_http(router.port, "POST", "/v1/completions", body)
        sd, _, bd = raw_http(backends[0].port, "POST", "/v1/completions", body)
        assert sd == 400 and (sv, bv) == (sd, bd), body
        assert_openai_error(bv)
    m = router.metrics()
    assert sum(routed(m, b.url, "4xx") for b in backends) >= 4


def test_router_answers_its_own_errors(cluster):
    router, backends = cluster
    m0 = router.metrics()
    st, _, body = raw_http(router.port, "POST", "/v1/completions",
                           json.dumps({"prompt": "a" * 70000, "max_tokens": 1}).encode())
    assert st == 413  # the backends' cap is 4 MiB: only the router refuses this
    assert_openai_error(body)
    st, _, body = raw_http(router.port, "POST", "/v2/completions", b"{}")
    assert st == 404 and assert_openai_error(body)["type"] == "not_found_error"
    m1 = router.metrics()
    assert routed(m1, "none", "4xx") - routed(m0, "none", "4xx") == 2
    for b in backends:
        assert routed(m1, b.url, "4xx") == routed(m0, b.url, "4xx")


def test_client_leaving_mid_stream_cancels_on_the_backend(cluster):
    router, backends = cluster
    before = [b.wait_idle() for b in backends]
    s = open_stream(router.port, "/v1/completions",
                    {"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True,
                     "stream": True})
    try:
        got = b""
        while got.count(b"data: ") < 3:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        # the events came through while the request still runs on a backend (no buffering)
        used = [b.metrics()[("tandem_kv_pages_used", ())] for b in backends]
        assert sum(1 for u in used if u > 0) == 1, used
    finally:
        s.close()
    after = [b.wait_idle(timeout=20) for b in backends]
    for a in after:
        assert a[("tandem_kv_pages_used", ())] == 0 and a[("tandem_requests_running", ())] == 0
        assert a[("tandem_kv_pages_free", ())] == a[("tandem_kv_pages_total", ())]
    grew = [cancelled_of(a) - cancelled_of(b) for a, b in zip(after, before)]
    assert sorted(grew) == [0, 1]
    router.wait_for(lambda m: proxy_errors(m, "client_disconnect") >= 1, "disconnect counted")


def cancelled_of(m):
    return m[("tandem_requests_finished_total", (("reason", "cancelled"),))]
