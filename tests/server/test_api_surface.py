"""The parts of the OpenAI and vLLM surface that tools call (issue 20, item 1): GET
/v1/models/{id} (the `openai` client's models.retrieve), `max_completion_tokens` on
/v1/completions (guidellm sends it), OpenAI's `error.code` values,
`stream_options.continuous_usage_stats`, and vLLM's /tokenize and /detokenize.

Tokens are checked against the independent reference: an HF `tokenizers` tokenizer built from
the GGUF (lib.smol_hf), and the chat template rendered by jinja2; never against tandem itself.
"""
import json

import openai
import pytest

from conftest import run_tandem
from lib.checkpoints import make_gguf_checkpoint
from lib.rawhttp import exchange_bytes, raw_http
from lib.server import Server
from lib.smol_hf import smol_hf_tokenizer, smol_metadata


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def post(server, path, body):
    st, _, raw = raw_http(server.port, "POST", path, json.dumps(body).encode())
    return st, json.loads(raw)


def test_models_retrieve(server):
    m = client(server).models.retrieve("smol")
    assert m.id == "smol" and m.object == "model" and m.owned_by == "tandem"
    assert m.model_dump()["max_model_len"] == 8192
    with pytest.raises(openai.NotFoundError) as e:
        client(server).models.retrieve("gpt-4")
    assert e.value.code == "model_not_found"
    st, _, raw = raw_http(server.port, "POST", "/v1/models/smol", b"{}")
    assert st == 405, raw


def test_max_completion_tokens_on_completions(server):
    """guidellm's body: both names; and the newer one alone."""
    for body in ({"prompt": "Hi", "max_tokens": 4, "max_completion_tokens": 4},
                 {"prompt": "Hi", "max_completion_tokens": 5}):
        st, r = post(server, "/v1/completions", {**body, "temperature": 0, "ignore_eos": True})
        assert st == 200, r
        assert r["usage"]["completion_tokens"] == body.get("max_tokens", 5)
    st, r = post(server, "/v1/completions", {"prompt": "Hi", "max_completion_tokens": 0})
    assert st == 400 and r["error"]["param"] == "max_completion_tokens", r


def test_error_codes(server, default_model):
    cases = [
        ({"prompt": "Hi", "max_tokens": 9000}, 400, "context_length_exceeded"),
        ({"prompt": [5] * 8192, "max_tokens": 1}, 400, "context_length_exceeded"),
        ({"prompt": "word " * 100000, "max_tokens": 1}, 400, "context_length_exceeded"),
        ({"prompt": "Hi", "model": "gpt-4"}, 404, "model_not_found"),
        ({"prompt": "Hi", "temperature": 7}, 400, None),  # OpenAI gives no code for a range
    ]
    for body, status, code in cases:
        st, r = post(server, "/v1/completions", body)
        assert st == status and r["error"]["code"] == code, (body if len(str(body)) < 200
                                                             else "long", r)
    st, r = post(server, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "x " * 9000}]})
    assert st == 400 and r["error"]["code"] == "context_length_exceeded", r
    s = Server(["--threads", "1", "--api-key", "k3y"])
    try:
        st, _, raw = raw_http(s.port, "POST", "/v1/completions", b'{"prompt":"Hi"}')
        assert st == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key", raw
    finally:
        s.stop()


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats(server, chat):
    """Through the `openai` client: every chunk carries the usage so far; the text and the
    final counts are those of the same request without streaming."""
    cl = client(server)
    kw = dict(model="smol", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    if chat:
        make, kw["messages"] = cl.chat.completions.create, [{"role": "user", "content": "Hi"}]
    else:
        make, kw["prompt"] = cl.completions.create, "Once upon a time"
    full = make(**kw)
    chunks = list(make(**kw, stream=True, stream_options={"continuous_usage_stats": True,
                                                           "include_usage": True}))
    body, last = [c for c in chunks if c.choices], chunks[-1]
    assert not last.choices and last.usage == full.usage  # include_usage's own chunk
    counts = [c.usage.completion_tokens for c in body]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1, counts
    for c in body:
        assert c.usage.prompt_tokens == full.usage.prompt_tokens
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    if chat:
        text = "".join(c.choices[0].delta.content or "" for c in body)
        assert text == full.choices[0].message.content
    else:
        assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    # without the option, the chunks carry no usage
    assert all(c.usage is None for c in make(**kw, stream=True))


TEXTS = ["Hello world", "  leading spaces and 12345 digits", "Ünïcödé ✓ 你好 👨‍👩‍👧",
         "<|im_start|>user\nspecial tokens are parsed<|im_end|>", ""]


def test_tokenize_matches_hf(server):
    hf = smol_hf_tokenizer()
    for text in TEXTS:
        st, r = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
        assert st == 200, r
        want = hf.encode(text, add_special_tokens=False).ids
        assert r["tokens"] == want and r["count"] == len(want), text
        assert r["max_model_len"] == 8192 and len(r["token_strs"]) == len(want)
        st, r2 = post(server, "/tokenize", {"prompt": text, "model": "smol"})
        assert st == 200 and r2["tokens"] == want and r2["token_strs"] is None


def jinja(messages, add_generation_prompt):
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(smol_metadata()["chat_template"]).render(
        messages=messages, add_generation_prompt=add_generation_prompt)


def test_tokenize_messages_is_the_chat_prompt(server):
    """The chat template (jinja2) then HF's tokenizer; with the generation prompt it is the
    prompt that /v1/chat/completions counts."""
    hf = smol_hf_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for gen in (True, False):
        st, r = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": gen})
        assert st == 200, r
        assert r["tokens"] == hf.encode(jinja(msgs, gen), add_special_tokens=False).ids, gen
    st, r = post(server, "/tokenize", {"messages": msgs})
    st2, c = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert st == st2 == 200 and r["count"] == c["usage"]["prompt_tokens"]


def test_detokenize_matches_hf(server):
    hf = smol_hf_tokenizer()
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False).ids
        st, r = post(server, "/detokenize", {"tokens": ids})
        assert st == 200 and r["prompt"] == hf.decode(ids, skip_special_tokens=False), (text, r)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [0] * 8193}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenize_bad_input(server, path, body, param):
    st, r = post(server, path, body)
    assert st in (400, 404) and r["error"]["param"] == param and r["error"]["message"], r
    st, _, raw = raw_http(server.port, "POST", path, b"{not json")
    assert st == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_completion_top_logprobs_hold_the_sampled_token(server):
    """OpenAI's and vLLM's shape: the `logprobs` most likely tokens, and the sampled one beside
    them when it is not among them, so `logprobs: 0` gives the sampled token alone."""
    cl = client(server)
    r = cl.completions.create(model="smol", prompt="The sky is", max_tokens=6, temperature=0,
                              logprobs=0)
    lp = r.choices[0].logprobs
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {tok: pytest.approx(l, abs=1e-6)}
    r = cl.completions.create(model="smol", prompt="The sky is", max_tokens=24, temperature=1.5,
                              seed=7, logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    sizes = set()
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == pytest.approx(l, abs=1e-6) and len(top) in (1, 2)
        assert max(top.values()) >= l - 1e-6
        sizes.add(len(top))
    assert sizes == {1, 2}, "at T 1.5 some draws are not the most likely token"


def cors_exchange(port, method, path, headers, body=b""):
    """(status, lower-cased response headers) of one raw request."""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    data = exchange_bytes(port, head.encode() + b"\r\n", body, 60)
    lines = data.partition(b"\r\n\r\n")[0].decode("latin1").split("\r\n")
    hdrs = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), hdrs


def test_cors(default_model):
    """--allowed-origins: preflights from a listed origin are answered without the API key,
    every answer to a listed origin (errors and streams too) carries its
    Access-Control-Allow-Origin; other origins, and a server without the flag, get none."""
    ok, other = "https://app.example.com", "https://evil.example.com"
    s = Server(["--threads", "1", "--api-key", "k3y", "--allowed-origins",
                f"http://localhost:3000,{ok}"])
    plain = Server(["--threads", "1"])
    try:
        pre = {"Origin": ok, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
        st, h = cors_exchange(s.port, "OPTIONS", "/v1/chat/completions", pre)
        assert st == 204 and h["access-control-allow-origin"] == ok, (st, h)
        assert h["access-control-allow-headers"] == pre["Access-Control-Request-Headers"]
        assert "POST" in h["access-control-allow-methods"] and h["vary"] == "Origin"
        # a header list that is not plain names is not echoed
        st, h = cors_exchange(s.port, "OPTIONS", "/v1/models",
                              {**pre, "Access-Control-Request-Headers": "x-a; evil=1"})
        assert st == 204 and h["access-control-allow-headers"] == "Authorization, Content-Type"
        st, h = cors_exchange(s.port, "OPTIONS", "/v1/chat/completions", {**pre, "Origin": other})
        assert st == 401 and "access-control-allow-origin" not in h  # not a preflight: routed
        body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
        auth = {"Authorization": "Bearer k3y"}
        for origin, want in ((ok, ok), ("http://localhost:3000", "http://localhost:3000"),
                             (other, None)):
            st, h = cors_exchange(s.port, "POST", "/v1/completions", {**auth, "Origin": origin},
                                  body)
            assert st == 200 and h.get("access-control-allow-origin") == want, (origin, h)
        st, h = cors_exchange(s.port, "POST", "/v1/completions", {"Origin": ok}, body)
        assert st == 401 and h["access-control-allow-origin"] == ok  # errors are readable too
        stream = json.dumps({"prompt": "Hi", "max_tokens": 2, "stream": True}).encode()
        st, h = cors_exchange(s.port, "POST", "/v1/completions", {**auth, "Origin": ok}, stream)
        assert st == 200 and h["access-control-allow-origin"] == ok
        st, h = cors_exchange(plain.port, "POST", "/v1/completions", {"Origin": ok}, body)
        assert st == 200 and "access-control-allow-origin" not in h
        st, h = cors_exchange(plain.port, "OPTIONS", "/v1/completions", pre)
        assert st == 405 and "access-control-allow-origin" not in h
    finally:
        s.stop()
        plain.stop()
    s = Server(["--threads", "1", "--allowed-origins", "*"])
    try:
        st, h = cors_exchange(s.port, "GET", "/v1/models", {"Origin": other})
        assert st == 200 and h["access-control-allow-origin"] == "*" and "vary" not in h
    finally:
        s.stop()


@pytest.mark.parametrize("value", ["app.example.com", "https://a.example, https://b.example",
                                   "https://a.example,,https://b.example", ""])
def test_bad_allowed_origins_are_refused(default_model, value):
    cp = run_tandem(["serve", "--model", default_model, "--port", "0", "--allowed-origins", value],
                    check=False, timeout=60)
    assert cp.returncode != 0 and "--allowed-origins" in cp.stderr, cp.stderr


def test_logit_bias(server):
    """+100 on a token makes every greedy output that token; -100 on the greedy tokens bans
    them; the log-probabilities stay those of the raw logits (the same token has the same
    logprob with and without a bias that does not change the choice); chat takes it too."""
    base = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    st, plain = post(server, "/v1/completions", base)
    assert st == 200, plain
    plain_toks = plain["choices"][0]["logprobs"]["tokens"]
    hf = smol_hf_tokenizer()
    forced = hf.encode(" banana", add_special_tokens=False).ids[0]
    st, r = post(server, "/v1/completions", {**base, "logit_bias": {str(forced): 100}})
    assert st == 200, r
    assert r["choices"][0]["text"] == hf.decode([forced] * 6), r["choices"][0]["text"]
    # ban the first greedy token: the first output changes, and is never the banned one
    st, t = post(server, "/tokenize", {"prompt": plain["choices"][0]["text"]})
    first = t["tokens"][0]
    st, r = post(server, "/v1/completions", {**base, "logit_bias": {str(first): -100}})
    assert st == 200 and first not in post(server, "/tokenize", {
        "prompt": r["choices"][0]["text"]})[1]["tokens"], r
    # a bias that changes nothing leaves tokens and logprobs as they were (raw logprobs)
    st, r = post(server, "/v1/completions", {**base, "logit_bias": {str(forced): -5}})
    assert r["choices"][0]["logprobs"] == plain["choices"][0]["logprobs"]
    assert r["choices"][0]["logprobs"]["tokens"] == plain_toks
    st, r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
        "ignore_eos": True, "logit_bias": {str(forced): 100}})
    assert st == 200 and r["choices"][0]["message"]["content"] == hf.decode([forced] * 3), r


@pytest.mark.parametrize("names", [("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                                   ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")],
                         ids=["starcoder", "qwen"])
def test_suffix_is_fill_in_the_middle(tmp_path, names):
    """On a model whose vocabulary has FIM tokens, `suffix` builds the prefix-suffix-middle
    prompt: the same tokens, logprobs and count as that prompt written out with the special
    tokens' text; an empty prefix works; the default model (no FIM tokens) refuses it."""
    model = make_gguf_checkpoint(tmp_path / "fim.gguf", "llama", extra_tokens=names, seed=5)
    s = Server(["--threads", "1"], model=model)
    try:
        for prompt, suffix in (("def add(a, b):", "\n    return c\n"), ("", "tail")):
            body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2}
            st, fim = s.post("/v1/completions", {**body, "prompt": prompt, "suffix": suffix})
            assert st == 200, fim
            written = f"{names[0]}{prompt}{names[1]}{suffix}{names[2]}"
            st, plain = s.post("/v1/completions", {**body, "prompt": written})
            assert st == 200, plain
            assert fim["usage"] == plain["usage"] and fim["choices"] == plain["choices"]
            st, t = s.post("/tokenize", {"prompt": written, "return_token_strs": True})
            assert t["token_strs"][0] == names[0] and names[2] == t["token_strs"][-1], t
            assert t["count"] == fim["usage"]["prompt_tokens"]
        st, r = s.post("/v1/completions", {"prompt": "x", "suffix": 5})
        assert st == 400 and r["error"]["param"] == "suffix"
    finally:
        s.stop()


def test_suffix_without_fim_tokens_is_refused(server):
    st, r = post(server, "/v1/completions", {"prompt": "def f(", "suffix": ")\n"})
    assert st == 400 and r["error"]["param"] == "suffix", r
    assert "fill-in-the-middle" in r["error"]["message"], r


def test_kubernetes_probes_and_endpoint_picker_metrics(server):
    """/live and /ready (Kubernetes probes; the stalled case is test_watchdog's), and the
    queue and KV-usage gauges under the names the Gateway API Inference Extension's endpoint
    picker reads (vLLM's), equal to tandem's own."""
    for route, status in (("/live", "live"), ("/ready", "ready")):
        st, _, raw = raw_http(server.port, "GET", route, b"")
        assert st == 200 and json.loads(raw) == {"status": status}, raw
        st, _, raw = raw_http(server.port, "POST", route, b"{}")
        assert st == 405, raw
    m = server.metrics()
    assert m[("vllm:num_requests_waiting", ())] == m[("tandem_requests_waiting", ())]
    assert m[("vllm:num_requests_running", ())] == m[("tandem_requests_running", ())]
    use = m[("tandem_kv_pages_used", ())] / m[("tandem_kv_pages_total", ())]
    assert m[("vllm:kv_cache_usage_perc", ())] == pytest.approx(use)
    assert m[("vllm:gpu_cache_usage_perc", ())] == m[("vllm:kv_cache_usage_perc", ())]
