"""Prefix caching with disaggregation (issue 19, item 1): `--prefix-caching` on a decode node
and on its prefill node.

- A decoder whose request reuses a cached prefix of c tokens asks its prefill node for the rest
  only (the PREFILL message carries c and the pages past it; chunks are counted from c).
- The prefill node reuses its own cache: a prefix it holds is not computed again, and the
  decoder's chunks that lie wholly inside it are sent from the cached pages.
- Every combination gives the colocated server's answer (no cache, no disaggregation), tokens
  and log-probabilities bit for bit: both caches on and warm, only the prefill node's warm,
  only the decoder's warm, a prompt cached but for its last token (prefilled on the decoder),
  host staging, and a decoder speculating with the shipped mtp head (the head's KV of a cached
  prefix is the decoder's own, the rest comes from the prefill node).
- The counters say what happened on each side, usage says cached_tokens, and once both caches
  are flushed both pools are back to baseline.
"""
import random
import time

import pytest

from lib.rawhttp import raw_http
from lib.sanitize import release_only
from test_disagg import (SANITIZED, colocated, colocated_server, decode_idle,  # noqa: F401
                         decode_node, prefill_idle, prefill_node, run)

PS = 16
CACHE = ["--prefix-caching"]


def flush(*servers):
    for s in servers:
        st, _, raw = raw_http(s.port, "POST", "/reset_prefix_cache", b"")
        assert st == 200, raw


def idle(p, d):
    flush(p, d)
    return prefill_idle(p), decode_idle(d)


def family(prefix_len, tails, seed):
    """Prompts (token lists) that share a random prefix of prefix_len tokens."""
    rng = random.Random(seed)
    head = [rng.randrange(100, 49000) for _ in range(prefix_len)]
    return [head + [rng.randrange(100, 49000) for _ in range(t)] for t in tails]


def quiet(s, timeout=30):
    """No job or request left and nothing in flight: every page in use is the cache's alone."""
    deadline = time.time() + timeout
    while True:
        m = s.metrics()
        if (m.get(("tandem_disagg_prefill_queue_depth", ()), 0) == 0
                and m[("tandem_requests_running", ())] == 0
                and m[("tandem_kv_pages_in_flight", ())] == 0
                and m[("tandem_kv_pages_used", ())] == m[("tandem_prefix_cache_evictable_pages", ())]):
            return m
        assert time.time() < deadline, "not quiet"
        time.sleep(0.05)


def delta(m1, m0, name):
    return m1.get((name, ()), 0) - m0.get((name, ()), 0)


def cached_tokens(server, prompt):
    st, r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                            "temperature": 0})
    assert st == 200, r
    return r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


@pytest.fixture(scope="module")
def cpair(default_model):
    p = prefill_node(CACHE)
    try:
        d = decode_node([p], CACHE)
        try:
            yield p, d
        finally:
            d.stop()
    finally:
        p.stop()


def test_both_caches_warm(colocated, cpair):
    p, d = cpair
    idle(p, d)
    # 150 shared tokens: 9 whole pages, two chunks and a part; tails across page and chunk edges
    ps = family(150, [1, 2, 5, 17, 40] if SANITIZED else [1, 2, 5, 10, 17, 40, 70, 130], 5)
    want = [run(colocated, x) for x in ps]
    mp0, md0 = p.metrics(), d.metrics()
    got = [run(d, x) for x in ps]
    for i, (w, g) in enumerate(zip(want, got)):
        assert w == g, f"prompt {i} ({len(ps[i])} tokens): output differs"
    mp1, md1 = quiet(p), quiet(d)
    # what changed in either node's disaggregation counters, for a failure's message
    seen = {(side,) + k: m1[k] - m0.get(k, 0) for side, m1, m0 in (("d", md1, md0), ("p", mp1, mp0))
            for k in m1 if k[0].startswith("tandem_disagg_") and m1[k] != m0.get(k, 0)}
    # every prompt after the first found the prefix in the decoder's cache
    assert delta(md1, md0, "tandem_disagg_cached_prefix_requests_total") == len(ps) - 1, seen
    assert delta(md1, md0, "tandem_disagg_cached_prefix_tokens_total") >= 144 * (len(ps) - 1)
    assert delta(mp1, mp0, "tandem_disagg_decoder_cached_prefills_total") == len(ps) - 1, seen
    assert delta(md1, md0, "tandem_disagg_remote_prefills_total") == len(ps), seen
    assert delta(md1, md0, "tandem_disagg_local_fallbacks_total") == 0, seen
    # the prefill node's own cache held the prefix too
    assert delta(mp1, mp0, "tandem_prefix_cache_hit_tokens_total") > 0
    # usage says what the decoder reused
    assert cached_tokens(d, ps[0]) == (len(ps[0]) - 1) // PS * PS
    mp, md = idle(p, d)
    assert mp[("tandem_prefix_cache_pages", ())] == 0 == md[("tandem_prefix_cache_pages", ())]


def one_side_warm(colocated, cpair, cold, prefix_len, tails, seed):
    """The family's answers through the pair with `cold`'s cache flushed before each request,
    against the colocated ones; returns the prefill node's counters before and after."""
    p, d = cpair
    idle(p, d)
    ps = family(prefix_len, tails, seed)
    want = [run(colocated, x) for x in ps]
    mp0 = p.metrics()
    for i, x in enumerate(ps):
        flush(cold)
        quiet(cold)
        assert run(d, x) == want[i], f"prompt {i} ({len(x)} tokens): output differs"
    mp1 = quiet(p)
    idle(p, d)
    return len(ps), mp0, mp1


def test_prefill_nodes_cache_only(colocated, cpair):
    """The decoder's cache flushed before each request: it asks for everything, and the prefill
    node sends the chunks inside its own cached prefix from the cache, computing the rest."""
    # 200 shared tokens: three 64-token chunks inside
    n, mp0, mp1 = one_side_warm(colocated, cpair, cpair[1], 200, [3, 30, 90], 6)
    assert delta(mp1, mp0, "tandem_disagg_reused_chunks_total") >= 3 * (n - 1)
    assert delta(mp1, mp0, "tandem_disagg_decoder_cached_prefills_total") == 0


def test_decoders_cache_only(colocated, cpair):
    """The prefill node's cache flushed before each request: it computes from the start and
    sends only what lies past the decoder's cached prefix."""
    n, mp0, mp1 = one_side_warm(colocated, cpair, cpair[0], 100, [2, 20, 64], 7)
    assert delta(mp1, mp0, "tandem_disagg_decoder_cached_prefills_total") == n - 1
    assert delta(mp1, mp0, "tandem_prefix_cache_hit_tokens_total") == 0


def test_prompt_cached_but_its_last_token(colocated, cpair):
    """prompt[:-1] wholly in the decoder's cache: nothing to ask for, the decoder runs the last
    token itself."""
    p, d = cpair
    idle(p, d)
    x = family(2 * PS + 1, [0], 8)[0]
    want = run(colocated, x)
    assert run(d, x) == want
    m0 = d.metrics()
    assert run(d, x) == want
    m1 = d.metrics()
    assert delta(m1, m0, "tandem_disagg_remote_prefills_total") == 0
    assert delta(m1, m0, "tandem_prefix_cache_hit_tokens_total") == 2 * PS
    idle(p, d)


@release_only("the staged path's code is the same")
def test_staged_pages_with_caches(colocated, default_model):
    stage = ["--kv-staging", "always"]
    p = prefill_node(CACHE + stage)
    try:
        d = decode_node([p], CACHE + stage)
        try:
            ps = family(130, [1, 9, 70], 9)
            want = [run(colocated, x) for x in ps]
            assert [run(d, x) for x in ps] == want
            md = quiet(d)
            assert md[("tandem_disagg_cached_prefix_requests_total", ())] == len(ps) - 1
            idle(p, d)
        finally:
            d.stop()
    finally:
        p.stop()


def test_speculating_decoder_with_caches(default_model):
    """Both nodes run the shipped mtp head and cache prefixes: the decoder's cached pages hold
    the head's KV of their positions, the prefill node streams the head's KV past them (and
    does not reuse its own cache for such requests), and the answers are the colocated ones.
    The full model: its head drafts what it was trained to (the short model's would not)."""
    spec = ["--spec", "mtp", "--spec-k", "3"]
    colocated = colocated_server(model=default_model)
    procs = [colocated]
    try:
        p = prefill_node(CACHE + ["--spec", "mtp"], model=default_model)
        procs.append(p)
        d = decode_node([p], CACHE + spec, model=default_model)
        procs.append(d)
        ps = family(120, [2, 25, 66] if SANITIZED else [2, 7, 25, 40, 66], 10)
        want = [run(colocated, x, 10) for x in ps]
        mp0, md0 = p.metrics(), d.metrics()
        assert [run(d, x, 10) for x in ps] == want
        mp1, md1 = quiet(p), quiet(d)
        assert delta(md1, md0, "tandem_disagg_cached_prefix_requests_total") == len(ps) - 1
        assert delta(md1, md0, "tandem_disagg_head_kv_landed_total") == len(ps)
        assert delta(mp1, mp0, "tandem_prefix_cache_hit_tokens_total") == 0
        assert delta(md1, md0, "tandem_spec_drafted_tokens_total") > 0
        assert delta(md1, md0, "tandem_spec_accepted_tokens_total") > 0
        idle(p, d)
    finally:
        for s in reversed(procs):
            s.stop()
