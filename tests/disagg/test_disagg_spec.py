"""Speculation across disaggregation (issue 14, item 5): a decode node that drafts with an mtp
head (`--spec mtp`) gets the head's KV of the prompt from its prefill node, which runs the same
head (`tandem serve --role prefill --spec mtp --spec-draft HEAD`) over what it prefills and
streams the head's layer like the target's, with the feature of the last prefilled position in
the context; the request then drafts at its very first step (prompt[-1]).

- Greedy output (tokens and log-probabilities) is the colocated one, with and without `--spec
  mtp`, for 1- and 2-token prompts, page and chunk edges, and prompts of several remote chunks.
- The decoder drafts at its first step: with max_tokens 2 the one draft it may make is at that
  step (a colocated server never drafts there: its first token comes from the prefill).
- The head's KV is the one the decoder itself would make: a colocated server whose prompt's
  last token runs alone (--prefill-chunk 16, prompts of 16 m + 1 tokens) drafts at the same
  step from the same state, and drafts and keeps exactly as many tokens, request by request.
  The head used for this ("cycle", below) copies what its KV holds two rows back, so its first
  drafts are right only if the head's KV of the prompt crossed intact (an echo head, whose
  attention output is zero, could not tell).
- A prefill node with another head, or none, refuses the head with a message naming both; the
  decoder goes on prefilling there without the head (no local fallback), those requests decode
  without drafts, and tokens are unchanged.
- After every scenario both page pools are back to baseline.
"""
import json
import math
import re

import numpy as np
import pytest

from conftest import run_tandem
from lib.heads import write_head
import test_disagg
from lib.server import Server, default_model_path
from test_disagg import SANITIZED, THREADS, decode_idle, prefill_idle, prompts

INV = ["--batch-invariant"]  # the head's F32 weights: every node computes each row alike


# The full model on every node: the cycle head's drafts are kept only where the target
# continues a repeated pattern, which the short model of test_disagg's nodes does not do.
def prefill_node(extra=(), **kw):
    return test_disagg.prefill_node(extra, model=default_model_path(), **kw)


def decode_node(peers, extra=(), **kw):
    return test_disagg.decode_node(peers, extra, model=default_model_path(), **kw)


K = 3


def model_info(model):
    return json.loads(run_tandem(["info", "--model", model, "--json"]).stdout)


def write_cycle_head(path, info, lag=2, c=64.0, seed=3):
    """A head whose row p attends to row p - lag alone and copies the target's feature there:
    it proposes for t(p+2) what the target proposed at p - lag, which is right when the text
    repeats with period lag + 1. The attention is positional: x = (B, h[1:]) with a constant B
    in dimension 0 (fc.bias) that queries and keys alone read, the keys rotated by lag
    positions ahead of the queries (RoPE, in the target's pairing), so the score peaks at
    p - j = lag; the values copy h, and o_proj amplifies the copy (c) over the row's own h."""
    d, hd = info["d_model"], info["head_dim"]
    nh = d // hd
    fc = np.zeros((d, 2 * d))
    fc[1:, d + 1:] = np.eye(d - 1)
    bias = np.zeros(d)
    bias[0] = math.sqrt(d)
    inv = info["rope_theta"] ** (-np.arange(0, hd, 2) / hd)
    q, k = np.zeros(hd), np.zeros(hd)
    for i, t in enumerate(inv):
        a, b = (i, i + hd // 2) if info["rope_neox"] else (2 * i, 2 * i + 1)
        q[a] = 1.0
        k[a], k[b] = math.cos(lag * t), math.sin(lag * t)
    wq, wk = np.zeros((nh * hd, d)), np.zeros((nh * hd, d))
    for h in range(nh):
        wq[h * hd:(h + 1) * hd, 0] = q
        wk[h * hd:(h + 1) * hd, 0] = k
    wv = np.eye(d)
    wv[0, 0] = 0
    wo = c * np.eye(d)
    wo[0, 0] = 0
    write_head(path, d=d, head_dim=hd, vocab=info["vocab_size"], n_heads=nh, n_kv_heads=nh,
               d_ff=64, kind="echo", seed=seed,
               extra={"fc.weight": fc, "fc.bias": bias,
                      "layers.0.self_attn.q_proj.weight": wq,
                      "layers.0.self_attn.k_proj.weight": wk,
                      "layers.0.self_attn.v_proj.weight": wv,
                      "layers.0.self_attn.o_proj.weight": wo})


@pytest.fixture(scope="module")
def heads(default_model, tmp_path_factory):
    info = model_info(default_model)
    root = tmp_path_factory.mktemp("disagg_heads")
    out = {"cycle": root / "cycle.safetensors", "other": root / "other.safetensors"}
    write_cycle_head(out["cycle"], info)
    write_head(out["other"], d=info["d_model"], head_dim=info["head_dim"],
               vocab=info["vocab_size"], n_heads=9, n_kv_heads=3, d_ff=256, kind="random",
               seed=5)
    return out


def spec(head, k=K):
    return ["--spec", "mtp", "--spec-draft", str(head), "--spec-k", str(k)]


def serve(extra):
    return Server(THREADS + INV + list(extra))


@pytest.fixture(scope="module")
def plain(default_model):
    s = serve([])
    try:
        yield s
    finally:
        s.stop_clean()


@pytest.fixture(scope="module")
def colocated_mtp(heads):
    s = serve(spec(heads["cycle"]))
    try:
        yield s
    finally:
        s.stop_clean()


@pytest.fixture(scope="module")
def pair(heads):
    p = prefill_node(INV + spec(heads["cycle"]))
    try:
        d = decode_node([p], INV + spec(heads["cycle"]))
        try:
            yield p, d
        finally:
            d.stop_clean()  # exit 0, and no sanitizer report (under TANDEM_SANITIZED)
    finally:
        p.stop_clean()


def check_remote_heads(d, m0, ps):
    """The decoder's counters since m0, once idle, after the prompts ps: every prompt of two or
    more tokens was prefilled remotely and brought the head's KV, none fell back to a local
    prefill, and drafts were kept. Returns the number of remote prefills."""
    m1 = decode_idle(d)
    remote = sum(1 for x in ps if len(x) >= 2)
    for name in ("tandem_disagg_remote_prefills_total", "tandem_disagg_head_kv_landed_total"):
        assert m1[(name, ())] - m0[(name, ())] == remote, name
    assert m1[("tandem_disagg_local_fallbacks_total", ())] == 0
    assert m1[("tandem_spec_accepted_tokens_total", ())] > \
        m0[("tandem_spec_accepted_tokens_total", ())]
    return remote


def complete(server, prompt, max_tokens, **extra):
    st, r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                            **extra}, timeout=600 if SANITIZED else 120)
    assert st == 200, r
    lp = r["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def counters(server):
    """Drafted and kept tokens, in all and by draft position."""
    m = server.metrics()
    pos = [m.get(("tandem_spec_drafted_by_position_total", (("position", str(j)),)), 0)
           for j in range(K)]
    kept = [m.get(("tandem_spec_accepted_by_position_total", (("position", str(j)),)), 0)
            for j in range(K)]
    return (m[("tandem_spec_drafted_tokens_total", ())],
            m[("tandem_spec_accepted_tokens_total", ())], pos, kept)


def delta(a, b):
    return (b[0] - a[0], b[1] - a[1], [y - x for x, y in zip(a[2], b[2])],
            [y - x for x, y in zip(a[3], b[3])])


def cycle_prompt(n, seed):
    """n tokens repeating three ids, of triples the target goes on repeating (checked for
    lengths 17 to 161; not every triple is: the model breaks some cycles after a while)."""
    triples = [(1523, 9021, 3307), (42, 4242, 777), (4242, 777, 42)]
    t = triples[seed % len(triples)]
    return [t[i % 3] for i in range(n)]


LENS = [1, 2, 3, 16, 17, 33, 63, 65, 129, 200]
if SANITIZED:
    LENS = [1, 2, 17, 65]


def test_greedy_identical_to_colocated(plain, colocated_mtp, pair):
    """Random and repeating prompts: the disaggregated speculating decoder's tokens and
    log-probabilities are the colocated ones, with --spec mtp and without; every prompt of two
    or more tokens was prefilled remotely with the head's KV."""
    p, d = pair
    ps = prompts(len(LENS), 41, LENS) + [cycle_prompt(n, i) for i, n in enumerate(LENS)]
    n = 8 if SANITIZED else 16
    want = [complete(plain, x, n) for x in ps]
    assert [complete(colocated_mtp, x, n) for x in ps] == want
    m0 = d.metrics()
    got = [complete(d, x, n) for x in ps]
    for i, (w, g) in enumerate(zip(want, got)):
        assert w == g, f"prompt {i} ({len(ps[i])} tokens): disaggregated --spec mtp differs"
    remote = check_remote_heads(d, m0, ps)
    pm = prefill_idle(p)
    assert pm[("tandem_disagg_head_kv_prefills_total", ())] >= remote
    # the head ran P - 1 rows of each P-token prefill (P = len - 1)
    assert pm[("tandem_disagg_head_rows_total", ())] >= sum(max(len(x) - 2, 0) for x in ps)


def test_drafts_at_the_first_step(colocated_mtp, pair):
    """max_tokens 2: the only step that may draft (one token) is the first, prompt[-1]. The
    decoder drafts there and keeps the draft (the cycle head copies the prompt's pattern from
    the head's KV that came from the prefill node); a colocated server drafts nothing."""
    p, d = pair
    ps = [cycle_prompt(n, i) for i, n in enumerate([20, 47, 70] if SANITIZED
                                                   else [20, 31, 47, 70, 130])]
    for x in ps:
        c0, d0 = counters(colocated_mtp), counters(d)
        assert complete(d, x, 2) == complete(colocated_mtp, x, 2)
        c1, d1 = counters(colocated_mtp), counters(d)
        assert delta(c0, c1)[0] == 0, "a colocated server drafted at the prompt's end"
        dd = delta(d0, d1)
        assert dd[0] == 1 and dd[1] == 1, \
            f"{len(x)}-token prompt: drafted {dd[0]}, kept {dd[1]} at the first step (want 1, 1)"
    decode_idle(d)
    prefill_idle(p)


def test_head_kv_is_the_colocated_one(heads, pair):
    """A colocated server whose prompt's last token runs alone (chunks of 16, prompts of 16 m + 1
    tokens) drafts at that step from the head's KV it made itself: the disaggregated decoder,
    whose head KV came from the prefill node (in chunks of 64, several for the longer prompts),
    drafts and keeps exactly as many tokens at each draft position, request by request, and
    most of them are kept."""
    p, d = pair
    ref = serve(spec(heads["cycle"]) + ["--prefill-chunk", "16"])
    try:
        lens = [17, 33, 81] if SANITIZED else [17, 33, 49, 65, 81, 129, 161]
        kept = 0
        for i, n in enumerate(lens):
            x = cycle_prompt(n, i)
            r0, d0 = counters(ref), counters(d)
            assert complete(d, x, 12) == complete(ref, x, 12)
            r1, d1 = counters(ref), counters(d)
            want, got = delta(r0, r1), delta(d0, d1)
            assert got == want, f"{n}-token prompt: drafted/kept {got}, colocated {want}"
            kept += got[1]
        assert kept >= len(lens) * 8, f"the cycle head kept {kept} drafts: it no longer works"
        ref.wait_idle()
        decode_idle(d)
        prefill_idle(p)
    finally:
        ref.stop_clean()


def fingerprint(server):
    m = re.search(r"speculation head ([0-9a-f]{16})", server.logs())
    assert m, server.logs()
    return m.group(1)


@pytest.mark.parametrize("prefill_head", ["other", None])
def test_refused_head(plain, heads, prefill_head):
    """A prefill node with another head (or none) refuses the head's KV: NACK naming both heads;
    the decoder says so once, goes on prefilling there without the head (no local fallback),
    those requests decode without drafts, and the tokens are the colocated ones."""
    p = prefill_node(INV + (spec(heads[prefill_head]) if prefill_head else []))
    try:
        d = decode_node([p], INV + spec(heads["cycle"]))
        try:
            ps = [cycle_prompt(n, i) for i, n in enumerate([9, 40, 70])]
            want = [complete(plain, x, 6) for x in ps]
            assert [complete(d, x, 6) for x in ps] == want
            m = decode_idle(d)
            assert m[("tandem_disagg_remote_prefills_total", ())] == len(ps)
            assert m[("tandem_disagg_head_kv_landed_total", ())] == 0
            assert m[("tandem_disagg_local_fallbacks_total", ())] == 0
            assert m[("tandem_disagg_transfer_errors_total", (("kind", "head"),))] == 1
            assert m[("tandem_disagg_peer_head", (("peer", "0"),))] == 0
            assert m[("tandem_spec_drafted_tokens_total", ())] == 0
            log = d.logs()
            mine = fingerprint(d)
            if prefill_head:
                theirs = fingerprint(p)
                assert theirs != mine
                assert re.search(f"speculation heads differ: decoder {mine} .*prefill node "
                                 f"{theirs}", log), log
            else:
                assert f"no speculation head on this prefill node (the decoder's: {mine}" in log
            assert log.count("cannot make the speculation head's KV") == 1, log
            prefill_idle(p)
        finally:
            d.stop_clean()
    finally:
        p.stop_clean()


def test_prefill_node_takes_mtp_only(default_model):
    cp = run_tandem(["serve", "--role", "prefill", "--spec", "self", "--port", "0"], check=False)
    assert cp.returncode == 2 and "--spec mtp" in cp.stderr, cp.stderr


def test_head_kv_through_host_staging(heads, plain):
    """Both nodes with --kv-staging always: the head's KV layer crosses through the staging
    ring and the landing pages like the target's (its own layer group, copied in after the
    target's). The decoder drafts and keeps exactly what a colocated server that made the head's
    KV itself does, and its tokens are the plain server's."""
    stage = ["--kv-staging", "always"]
    p = prefill_node(INV + spec(heads["cycle"]) + stage)
    d = ref = None
    try:
        d = decode_node([p], INV + spec(heads["cycle"]) + stage)
        ref = serve(spec(heads["cycle"]) + ["--prefill-chunk", "16"])
        for i, n in enumerate([17, 81] if SANITIZED else [17, 33, 81, 129]):
            x = cycle_prompt(n, 100 + i)
            r0, d0 = counters(ref), counters(d)
            got = complete(d, x, 12)
            assert got == complete(ref, x, 12) == complete(plain, x, 12)
            assert delta(d0, counters(d)) == delta(r0, counters(ref)), f"{n}-token prompt"
        m = decode_idle(d)
        assert m[("tandem_disagg_staged_prefills_total", ())] == \
            m[("tandem_disagg_head_kv_landed_total", ())] > 0
        assert m[("tandem_disagg_landing_pages_used", ())] == 0
        pm = prefill_idle(p)
        assert pm[("tandem_disagg_staging_ring_used_bytes", ())] == 0
    finally:
        for s in (ref, d, p):
            if s:
                s.stop_clean()
