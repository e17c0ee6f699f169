"""Structured output through the server (issue 20): response_format json_schema and json_object,
vLLM's guided_* and structured_outputs fields, regex, GBNF grammars, with the real `openai`
client, n > 1 and streaming; and speculation under a grammar, chain and tree, which must give
exactly the tokens that decoding without speculation gives (the drafts are verified against the
masked target, so a draft the grammar refuses is a rejection, never an output), with a chain
drafter's rows masked too, so that its drafts are ones the target may accept.

Every output is checked by independent validators: `jsonschema` (formats included), Python's
`re`, Python's parser. The schemas come from tests/grammar/schemas/ (the suite that
tests/grammar/test_schema_suite.py validates over random walks); here the model chooses.
"""
import json
import pathlib
import re

import jsonschema
import pytest

from lib.heads import write_head
from lib.server import Server, default_model_path
from lib.sanitize import SANITIZED

SCHEMA_DIR = pathlib.Path(__file__).resolve().parent.parent / "grammar" / "schemas"
# schemas whose every string is bounded, so a sampled output always ends
BOUNDED = ["person", "enums", "one_of_tagged", "tuple", "array_bounds", "formats",
           "order_nested", "nullable_const", "numbers"]
if SANITIZED:
    BOUNDED = BOUNDED[:4]


def schema(name):
    return json.loads((SCHEMA_DIR / f"{name}.json").read_text())


def checker():
    import sys
    sys.path.insert(0, str(SCHEMA_DIR.parent))
    from test_schema_suite import format_checker
    return format_checker()


def validate(name, text):
    jsonschema.Draft202012Validator(schema(name), format_checker=checker()).validate(
        json.loads(text))


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                         max_retries=0, timeout=300)


def rf(name):
    return {"type": "json_schema",
            "json_schema": {"name": name, "strict": True, "schema": schema(name)}}


@pytest.mark.parametrize("name", BOUNDED)
def test_openai_client_json_schema(client, name):
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": f"Write a {name} as JSON."}],
        response_format=rf(name), temperature=0.8, seed=7, max_tokens=400)
    ch = r.choices[0]
    assert ch.finish_reason == "stop", ch
    validate(name, ch.message.content)


def test_n_choices_all_valid(client):
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "A person, please."}],
        response_format=rf("person"), temperature=1.0, seed=3, max_tokens=200, n=2)
    assert len(r.choices) == 2
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        validate("person", ch.message.content)


def test_streamed_json_schema(client):
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Some enums."}],
        response_format=rf("enums"), temperature=0.5, seed=1, max_tokens=200, stream=True)
    text, finish = "", None
    for ev in stream:
        for ch in ev.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert finish == "stop"
    validate("enums", text)


def test_json_object(server):
    st, body = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Describe a cat as a JSON object."}],
        "response_format": {"type": "json_object"}, "max_tokens": 300, "temperature": 0})
    assert st == 200, body
    text = body["choices"][0]["message"]["content"]
    assert text.startswith("{")
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("field,value,check", [
    ("regex", r" [0-9]{3}-[0-9]{4}\.", lambda t: re.fullmatch(r" [0-9]{3}-[0-9]{4}\.", t)),
    ("guided_regex", r"(Yes|No), because [a-z ]{3,30}\.",
     lambda t: re.fullmatch(r"(Yes|No), because [a-z ]{3,30}\.", t)),
    ("guided_choice", [" Paris", " London", " Rome"], lambda t: t in (" Paris", " London", " Rome")),
    ("structured_outputs", {"choice": [" red", " blue"]}, lambda t: t in (" red", " blue")),
    ("grammar", 'root ::= " " num (" + " num){1,3}\nnum ::= "0" | [1-9] [0-9]{0,2}',
     lambda t: re.fullmatch(r" (0|[1-9][0-9]{0,2})( \+ (0|[1-9][0-9]{0,2})){1,3}", t)),
    ("guided_json", {"type": "object", "properties": {"ok": {"type": "boolean"}},
                     "required": ["ok"]}, lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_extension_fields(server, field, value, check):
    st, body = server.post("/v1/completions", {
        "prompt": "The answer is", field: value, "max_tokens": 60, "temperature": 0.7,
        "seed": 11})
    assert st == 200, body
    ch = body["choices"][0]
    assert ch["finish_reason"] == "stop", ch
    assert check(ch["text"]), ch["text"]


def test_grammar_with_logprobs_and_bias(server):
    """logit_bias and logprobs live alongside the mask: a biased token the grammar refuses is
    still refused, and the log-probabilities are the raw model's"""
    st, body = server.post("/v1/completions", {
        "prompt": "Pick:", "guided_choice": [" yes", " no"], "max_tokens": 5,
        "temperature": 0, "logprobs": 2, "logit_bias": {"13": 100}})
    assert st == 200, body
    ch = body["choices"][0]
    assert ch["text"] in (" yes", " no")
    lp = ch["logprobs"]["token_logprobs"]
    assert all(x <= 0 for x in lp)


def grammar_counters(server):
    from lib.rawhttp import raw_http
    st, _, raw = raw_http(server.port, "GET", "/metrics", b"")
    assert st == 200
    got = {}
    for ln in raw.decode().splitlines():
        for k in ("tandem_grammar_cache_hits_total", "tandem_grammar_cache_misses_total"):
            if ln.startswith(k + "{"):
                got[k] = float(ln.rsplit(" ", 1)[1])
    return got


def test_pool_and_cache_after_many(server):
    """the same schema many times compiles once (the cache: one miss, then hits), and nothing
    leaks (the fixture checks the pool is back at baseline after each test)"""
    before = grammar_counters(server)
    n = 3 if SANITIZED else 6
    for i in range(n):
        st, body = server.post("/v1/completions", {
            "prompt": f"Item {i}:", "response_format": rf("tuple"), "max_tokens": 60,
            "temperature": 1.0, "seed": i})
        assert st == 200, body
        validate("tuple", body["choices"][0]["text"])
    after = grammar_counters(server)
    hits = after["tandem_grammar_cache_hits_total"] - before["tandem_grammar_cache_hits_total"]
    misses = after["tandem_grammar_cache_misses_total"] - before["tandem_grammar_cache_misses_total"]
    assert hits + misses == n and misses <= 1  # compiled at most once (an earlier test may have)


# ---- speculation under a grammar: the same tokens as without it ----
SPEC_SCHEMAS = ["person", "enums", "one_of_tagged"] if not SANITIZED else ["enums"]


def greedy(srv, name, prompt):
    st, body = srv.post("/v1/completions", {
        "prompt": prompt, "response_format": rf(name), "max_tokens": 160, "temperature": 0})
    assert st == 200, body
    return body["choices"][0]


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory):
    p = tmp_path_factory.mktemp("structured_heads") / "echo.safetensors"
    write_head(p, d=576, head_dim=64, vocab=49152, n_heads=9, n_kv_heads=3, d_ff=1536,
               kind="echo", seed=11)
    return p


@pytest.mark.parametrize("spec", ["draft", "mtp", "eagle"])
def test_speculation_is_lossless_under_a_grammar(server, spec, eagle_head):
    flags = {"draft": ["--spec", "draft", "--spec-draft", str(default_model_path()), "--spec-k",
                       "4"],
             "mtp": ["--spec", "mtp"],
             "eagle": ["--spec", "eagle", "--spec-draft", str(eagle_head)]}[spec]
    s = Server(["--threads", "2"] + flags)
    try:
        for name in SPEC_SCHEMAS:
            prompt = f"Here is one {name} in JSON:"
            want, got = greedy(server, name, prompt), greedy(s, name, prompt)
            assert got["text"] == want["text"], (spec, name)
            assert got["finish_reason"] == want["finish_reason"] == "stop"
            validate(name, got["text"])
        if spec == "draft":
            # the model drafting for itself, its draft rows masked as the target's will be: the
            # drafts agree with the target nearly always (unmasked drafts: about a third)
            from lib.rawhttp import raw_http
            _, _, raw = raw_http(s.port, "GET", "/metrics", b"")
            m = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in raw.decode().splitlines()
                 if ln.startswith(("tandem_spec_drafted_tokens_total ",
                                   "tandem_spec_accepted_tokens_total "))}
            drafted, kept = m["tandem_spec_drafted_tokens_total"], m["tandem_spec_accepted_tokens_total"]
            assert drafted > 0 and kept / drafted > 0.8, (kept, drafted)
        s.wait_idle()
    finally:
        s.stop()
