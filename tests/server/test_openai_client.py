"""The official `openai` Python client against `tandem serve`: completions and chat, streaming
and not, usage, logprobs, stop strings, seeds; prompts checked against HF `tokenizers`."""
import openai
import pytest

from lib.smol_hf import smol_hf_tokenizer


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smol"]


def test_completion_text_matches_token_id_prompt_from_hf(client):
    prompt = "The capital of France is"
    r1 = client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0)
    ids = smol_hf_tokenizer().encode(prompt).ids
    r2 = client.completions.create(model="smol", prompt=ids, max_tokens=12, temperature=0)
    assert r1.usage.prompt_tokens == len(ids)
    assert r1.choices[0].text == r2.choices[0].text
    assert "Paris" in r1.choices[0].text
    assert r1.usage.completion_tokens == 12 and r1.choices[0].finish_reason == "length"
    assert r1.usage.total_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="smol", prompt="Once upon a time", max_tokens=24, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_equals_non_stream(client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model="smol", messages=msgs, max_tokens=40,
                                          temperature=0)
    assert "Paris" in full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "stop"  # ends with <|im_end|>
    chunks = list(client.chat.completions.create(model="smol", messages=msgs, max_tokens=40,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_prompt_tokens_match_hf_on_rendered_template(client):
    # SmolLM2's template with its default system prompt, tokenized by HF with special tokens
    msgs = [{"role": "user", "content": "Hi there"}]
    r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=1, temperature=0)
    rendered = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert r.usage.prompt_tokens == len(smol_hf_tokenizer().encode(rendered).ids)


def test_stop_string_cuts_the_text(client):
    kw = dict(model="smol", prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    assert " 8," in free
    r = client.completions.create(stop=[" 8"], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[:free.index(" 8")]
    s = client.completions.create(stop=[" 8"], stream=True, **kw)
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text


def test_stop_string_ends_the_request_and_returns_its_pages(client, server):
    # the reader (on the HTTP thread) matches the stop string and stops the request; the
    # response counts the outputs up to the token that completed the match, and comes only once
    # the scheduler has finished the request, so its pages are already back
    kw = dict(model="smol", prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0)
    toks = client.completions.create(logprobs=0, **kw).choices[0].logprobs.tokens
    n = next(i + 1 for i in range(len(toks)) if " 8" in "".join(toks[:i + 1]))
    assert n < 30
    key = lambda m: sum(v for (name, labels), v in m.items()
                        if name == "tandem_requests_finished_total" and ("reason", "stop") in labels)
    stops = key(server.metrics())
    r = client.completions.create(stop=[" 8"], **kw)
    m = server.metrics()
    assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "stop"
    assert m[("tandem_kv_pages_used", ())] == 0 and m[("tandem_requests_running", ())] == 0
    assert key(m) == stops + 1


def test_tiny_temperature_is_greedy_and_the_server_lives(client, server):
    # a temperature of 1e-40 made 1/T infinite: NaN probabilities, an out-of-bounds read, or an
    # endless loop on the scheduler thread with top_k/top_p. Below the floor it is greedy.
    kw = dict(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    greedy = client.chat.completions.create(temperature=0, **kw)
    for extra in ({"top_k": 5}, {}, {"top_p": 0.5}):
        r = client.chat.completions.create(temperature=1e-40, extra_body=extra, **kw)
        assert r.choices[0].message.content == greedy.choices[0].message.content
    st, _, _ = server.request("GET", "/health")
    assert st == 200


def test_logprobs_completions(client):
    r = client.completions.create(model="smol", prompt="The sky is", max_tokens=6,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6 and len(lp.token_logprobs) == 6 and len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and l <= 0
        # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(l, abs=1e-5)
        assert top[tok] == pytest.approx(l, abs=1e-5)


def test_logprobs_chat(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for c in content:
        assert len(c.top_logprobs) == 2 and c.logprob <= 0
        assert bytes(c.bytes).decode("utf-8", "replace") is not None


def test_seed_reproducible_and_sampling_params(client):
    kw = dict(model="smol", prompt="My favourite colour is", max_tokens=16, temperature=1.0,
              top_p=0.9, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    others = {client.completions.create(**dict(kw, seed=s)).choices[0].text for s in range(5)}
    assert len(others) > 1  # different seeds sample differently
    r = client.completions.create(model="smol", prompt="Hello", max_tokens=8, temperature=0.7,
                                  extra_body={"top_k": 5, "min_p": 0.05, "ignore_eos": True,
                                              "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 8


def test_api_errors_surface_as_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="x", max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_api_key_enforced(default_model):
    from lib.server import Server
    s = Server(["--threads", "1", "--api-key", "s3cret"])
    try:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        st, body = s.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert st == 401 and body["error"]["type"] == "authentication_error"
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="smol", prompt="Hi", max_tokens=2).usage
        st, _, _ = s.request("GET", "/health")  # health needs no key
        assert st == 200
    finally:
        assert s.stop() == 0
