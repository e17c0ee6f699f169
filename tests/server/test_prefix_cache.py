"""Automatic prefix caching (`tandem serve --prefix-caching`, issue 19): a request reuses the KV
of whole pages of an earlier request's tokens that its prompt starts with.

Checked: the answer (greedy tokens and their log-probabilities) is the same bit for bit as the
same server's without the cache (the CPU path is batch invariant), alone, in a multi-turn chat
and among concurrent requests sharing a system prompt; usage.prompt_tokens_details.cached_tokens
says how many prompt tokens were reused, and the forward pass ran that many fewer
(tandem_batch_tokens' sum, counted exactly); the hit and store counters move; POST
/reset_prefix_cache gives every page back; the mtp and eagle drafters reuse the head's KV of a
cached prefix (tests/disagg/test_disagg_prefix.py has the cache with disaggregation).
"""
import concurrent.futures as cf
import json

import pytest

from conftest import run_tandem
from lib.rawhttp import raw_http
from lib.server import Server, histogram

SYSTEM = ("You are a careful assistant for a lighthouse museum. Answer in one short sentence, "
          "mention the keeper when it helps, and never invent dates. Visitors ask about the lamp, "
          "the stairs, the fog horn and the storms of the old days.")
PS = 16


@pytest.fixture(scope="module")
def cached(default_model):
    s = Server(["--threads", "2", "--prefix-caching"])
    try:
        yield s
    finally:
        s.stop()


def post(server, body, path="/v1/completions"):
    st, _, raw = raw_http(server.port, "POST", path, json.dumps(body).encode())
    assert st == 200, raw
    return json.loads(raw)


def flush(server):
    st, _, raw = raw_http(server.port, "POST", "/reset_prefix_cache", b"")
    assert st == 200, raw
    return server.wait_idle()  # pages used back to 0


def ran(m0, m1):
    return histogram(m1, "tandem_batch_tokens")[1] - histogram(m0, "tandem_batch_tokens")[1]


def test_reuse_is_exact_and_counted(cached, server):
    flush(cached)
    body = {"prompt": SYSTEM + " Question: what did the keeper do at dusk?", "max_tokens": 8,
            "temperature": 0, "logprobs": 2, "ignore_eos": True}
    want = post(server, body)  # the same server without the cache
    n = want["usage"]["prompt_tokens"]
    m0 = cached.metrics()
    first = post(cached, body)
    m1 = cached.metrics()
    second = post(cached, body)
    m2 = cached.metrics()
    for r in (first, second):
        assert r["choices"] == want["choices"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    hit = (n - 1) // PS * PS  # whole pages, the last token left to run
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}
    assert ran(m0, m1) == n + 7 and ran(m1, m2) == n - hit + 7
    hits = m2[("tandem_prefix_cache_hit_tokens_total", ())] - \
        m1[("tandem_prefix_cache_hit_tokens_total", ())]
    assert hits == hit and m2[("tandem_prefix_cache_stored_pages_total", ())] > 0
    # idle: every used page is the cache's alone, so the endpoint picker's usage is 0
    assert m2[("tandem_prefix_cache_evictable_pages", ())] == m2[("tandem_kv_pages_used", ())] > 0
    assert m2[("vllm:kv_cache_usage_perc", ())] == 0
    assert "prompt_tokens_details" not in want["usage"]  # a server without the cache
    m = flush(cached)
    assert m[("tandem_prefix_cache_pages", ())] == 0


def test_multi_turn_chat_reuses_its_history(cached, server):
    flush(cached)
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Why was the fog horn needed?"}]
    body = {"max_tokens": 12, "temperature": 0}
    a = post(cached, {**body, "messages": msgs}, "/v1/chat/completions")
    msgs2 = msgs + [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And the stairs?"}]
    b = post(cached, {**body, "messages": msgs2}, "/v1/chat/completions")
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        (a["usage"]["prompt_tokens"] - 1) // PS * PS
    ref = post(server, {**body, "messages": msgs2}, "/v1/chat/completions")
    assert b["choices"][0]["message"] == ref["choices"][0]["message"]
    flush(cached)


def test_concurrent_requests_sharing_a_system_prompt(cached, server):
    flush(cached)
    questions = [f" Question {i}: tell me about the {w}." for i, w in
                 enumerate(["lamp", "stairs", "fog horn", "storms", "keeper", "lens", "bell",
                            "door", "window", "boat", "map", "clock"])]
    bodies = [{"prompt": SYSTEM + q, "max_tokens": 6, "temperature": 0, "logprobs": 0,
               "ignore_eos": True} for q in questions]
    want = [post(server, b)["choices"] for b in bodies]
    post(cached, bodies[0])  # the system prompt's pages in the cache
    with cf.ThreadPoolExecutor(len(bodies)) as ex:
        got = list(ex.map(lambda b: post(cached, b), bodies))
    assert [g["choices"] for g in got] == want
    assert all(g["usage"]["prompt_tokens_details"]["cached_tokens"] >= PS for g in got)
    flush(cached)


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_feature_drafters_reuse_the_heads_kv(server, method):
    """A drafter fed with the target's features (the shipped head) under the cache: a page is
    offered once the head's KV covers it, and a request that reuses it takes that KV as its
    own. The answers are the plain server's, and the drafts are those of the same drafter
    without the cache, draft for draft (the same count drafted and kept over the run): the
    head's KV of a cached prefix is what the request would have made itself."""
    questions = ["What did the keeper do at dusk?", "Why the fog horn?", "How many stairs?"]
    bodies = [{"messages": [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": q}],
               "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 1}
              for q in questions] * 2
    want = [post(server, b, "/v1/chat/completions")["choices"] for b in bodies]
    counts = []
    for extra in ([], ["--prefix-caching"]):
        s = Server(["--threads", "2", "--spec", method, "--spec-k", "3", *extra])
        try:
            got = [post(s, b, "/v1/chat/completions") for b in bodies]
            assert [g["choices"] for g in got] == want
            m = s.metrics()
            counts.append((m[("tandem_spec_drafted_tokens_total", ())],
                           m[("tandem_spec_accepted_tokens_total", ())]))
            if extra:
                assert all(g["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * PS
                           for g in got[1:])
                assert flush(s)[("tandem_prefix_cache_pages", ())] == 0
        finally:
            s.stop()
    assert counts[0] == counts[1] and counts[0][1] > 0, counts
