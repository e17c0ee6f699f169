"""EAGLE-3 heads across disaggregation (docs/HEADS.md, "EAGLE-3"; disagg.h, "Speculation across
disaggregation"): a decode node drafting with an EAGLE-3 head gets from its prefill node, which
runs the same head, the head's KV of the prompt (made there from the target's fused features:
the residual streams entering the head's three target layers) and, in the context, the fused
feature of the last prefilled position (3 d_model floats: the width the request names).

Two heads with a known acceptance make each half observable (lib.heads.write_eagle3_head with
their weights set; the target's final norm and the LM-head rows of the first 8,192 tokens):
- "cycle" copies what its KV holds two rows back: fc passes the third feature (the residual
  entering the target's last layer) and a large constant in dimension 0 (fc.bias), which alone
  the queries and keys read, the keys rotated two positions ahead (RoPE); the values copy the
  feature, o_proj amplifies the copy over the row's own. It proposes for t(p+2) the logit lens
  of row p - 2, right on a text repeating with period 3, from its first step only if the
  head's KV of the prompt crossed intact (made from the right features on the prefill node).
- "alt" proposes the token of its own row: fc passes the third feature, which its config.json
  makes the residual entering layer 0 (the token's embedding; the target's embeddings are its
  LM head); right on an alternation, at the first step only if the context's fused feature of
  position P - 1 crossed whole (its last d_model floats are the ones read).

Checked, both pools back to baseline after each scenario:
- greedy output (tokens and log-probabilities) is a plain colocated server's, for random and
  repeating prompts of one to several remote chunks, every prompt of two or more tokens
  prefilled remotely with the head's KV;
- with max_tokens 2 the only step that may draft is the first, and the decoder drafts there and
  keeps the draft (a colocated server with whole-prompt prefill never drafts there);
- a colocated server whose prompt's last token runs alone (--prefill-chunk 16, prompts of
  16 m + 1 tokens) drafts at that step from the KV and feature it made itself: the decoder
  drafts and keeps exactly as many tokens at each draft position, request by request.
"""
import json
import math

import numpy as np
import pytest

from conftest import run_tandem
from lib import reference as ref
from lib.heads import write_eagle3_head
from test_disagg import SANITIZED, decode_idle, prefill_idle, prompts, run
from test_disagg_spec import (INV, check_remote_heads, decode_node, plain,  # noqa: F401
                              prefill_node, serve)  # nodes of the full model, as serve's

K = 3
HEAD_DIM, DRAFT_VOCAB = 64, 8192  # SmolLM2-135M; the draft vocabulary: ids 0 .. 8191


def write_head(path, target, n_layers, *, aux_layers, n_kv_heads, extra, gain=None):
    d, vocab = target.out_norm.shape[0], target.lm_head.shape[0]
    t = {"d2t": np.zeros(DRAFT_VOCAB, dtype=np.int64), "t2d": np.arange(vocab) < DRAFT_VOCAB,
         "norm.weight": target.out_norm, "lm_head.weight": target.lm_head[:DRAFT_VOCAB]}
    t.update(extra)
    path.parent.mkdir()
    write_eagle3_head(path, d=d, head_dim=HEAD_DIM, vocab=vocab, n_layers=n_layers,
                      n_heads=d // HEAD_DIM, n_kv_heads=n_kv_heads, d_ff=64, seed=7,
                      draft_vocab=DRAFT_VOCAB, aux_layers=aux_layers, extra=t)
    if gain is not None:  # the random attention and MLP at this fraction of their weight
        from safetensors.numpy import load_file, save_file
        w = load_file(str(path))
        for k in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
            w[k] = w[k] * np.float32(gain)
        save_file(w, str(path))
    return path


@pytest.fixture(scope="module")
def heads(default_model, tmp_path_factory):
    info = json.loads(run_tandem(["info", "--model", default_model, "--json"]).stdout)
    target = ref.load(default_model)
    L, d, hd = info["n_layers"], info["d_model"], HEAD_DIM
    nh = d // hd
    root = tmp_path_factory.mktemp("disagg_eagle3")
    # cycle: the top of this file
    big = 1e4 * math.sqrt(d)  # dimension 0 of h; hidden_norm leaves it sqrt(d), the rest / big
    fc = np.zeros((d, 3 * d))
    fc[1:, 2 * d + 1:] = np.eye(d - 1)
    bias = np.zeros(d)
    bias[0] = big
    inv = info["rope_theta"] ** (-np.arange(0, hd, 2) / hd)
    q, k = np.zeros(hd), np.zeros(hd)
    for i, t in enumerate(inv):
        a, b = (i, i + hd // 2) if info["rope_neox"] else (2 * i, 2 * i + 1)
        q[a] = 1.0
        k[a], k[b] = math.cos(2 * t), math.sin(2 * t)
    wq, wk = np.zeros((nh * hd, 2 * d)), np.zeros((nh * hd, 2 * d))
    for h in range(nh):  # column d: the hidden half's dimension 0
        wq[h * hd:(h + 1) * hd, d] = q
        wk[h * hd:(h + 1) * hd, d] = k
    wv = np.zeros((d, 2 * d))
    wv[1:, d + 1:] = np.eye(d - 1)
    wo = (64.0 * big / math.sqrt(d)) * np.eye(d)
    wo[0, 0] = 0
    norm = np.array(target.out_norm, dtype=np.float64)
    norm[0] = 0
    cycle = write_head(root / "cycle" / "head.safetensors", target, L,
                       aux_layers=(0, L // 2, L - 1), n_kv_heads=nh,
                       extra={"fc.weight": fc, "fc.bias": bias,
                              "midlayer.input_layernorm.weight": np.ones(d),
                              "midlayer.hidden_norm.weight": np.ones(d),
                              "midlayer.self_attn.q_proj.weight": wq,
                              "midlayer.self_attn.k_proj.weight": wk,
                              "midlayer.self_attn.v_proj.weight": wv,
                              "midlayer.self_attn.o_proj.weight": wo,
                              "midlayer.mlp.down_proj.weight": np.zeros((d, 64)),
                              "norm.weight": norm})
    alt = write_head(root / "alt" / "head.safetensors", target, L,
                     aux_layers=(L // 2, L - 1, 0), n_kv_heads=3, gain=0.1,
                     extra={"fc.weight": np.concatenate([np.zeros((d, 2 * d)), np.eye(d)], 1),
                            "norm.weight": np.ones(d)})
    return {"cycle": cycle, "alt": alt}


def spec(head):
    return ["--spec", "mtp", "--spec-draft", str(head), "--spec-k", str(K)]


def started(head, chunked):
    """A prefill node and a decoder with the head, and with chunked a colocated server with it
    whose prompts' last token runs alone (chunks of 16)."""
    out = []
    try:
        out.append(prefill_node(INV + spec(head)))
        out.append(decode_node([out[0]], INV + spec(head)))
        if chunked:
            out.append(serve(spec(head) + ["--prefill-chunk", "16"]))
        return out
    except BaseException:
        for s in reversed(out):
            s.stop()
        raise


@pytest.fixture(scope="module")
def cycle_nodes(heads):
    nodes = started(heads["cycle"], True)
    yield nodes
    for s in reversed(nodes):
        s.stop_clean()  # exit 0, and no sanitizer report (under TANDEM_SANITIZED)


@pytest.fixture(scope="module")
def alt_nodes(heads):
    nodes = started(heads["alt"], True)
    yield nodes
    for s in reversed(nodes):
        s.stop_clean()


def counters(server):
    """Drafted and kept tokens by draft position."""
    m = server.metrics()
    return [(m.get(("tandem_spec_drafted_by_position_total", (("position", str(j)),)), 0),
             m.get(("tandem_spec_accepted_by_position_total", (("position", str(j)),)), 0))
            for j in range(K)]


def delta(a, b):
    return [(y[0] - x[0], y[1] - x[1]) for x, y in zip(a, b)]


def repeating(n, period, seed):
    """n tokens repeating ids the target goes on repeating, and on which each head is right at
    the first step (measured, for the lengths below; ids below 8192)."""
    t = {3: [(42, 4242, 777)], 2: [(777, 42), (284, 253), (260, 1230), (314, 288)]}[period]
    t = t[seed % len(t)]
    return [t[i % period] for i in range(n)]


def test_greedy_identical_to_colocated(plain, cycle_nodes):
    """Random and repeating prompts: the decoder's tokens and log-probabilities are the plain
    server's; every prompt of two or more tokens crossed with the head's KV; drafts were kept."""
    p, d, _ = cycle_nodes
    lens = [1, 2, 17, 65] if SANITIZED else [1, 2, 17, 65, 130]
    ps = prompts(len(lens), 43, lens) + [repeating(n, 3, i) for i, n in enumerate(lens)]
    n = 8
    m0 = d.metrics()
    for i, x in enumerate(ps):
        assert run(d, x, n) == run(plain, x, n), \
            f"prompt {i} ({len(x)} tokens): disaggregated EAGLE-3 differs from colocated"
    check_remote_heads(d, m0, ps)
    pm = prefill_idle(p)
    assert pm[("tandem_disagg_head_rows_total", ())] >= sum(max(len(x) - 2, 0) for x in ps)


@pytest.mark.parametrize("which,period", [("cycle", 3), ("alt", 2)])
def test_drafts_from_the_first_step_as_colocated(plain, cycle_nodes, alt_nodes, which, period):
    """Prompts of 16 m + 1 tokens (one and two remote chunks of 64): at max_tokens 2 the
    decoder drafts at its first step and keeps the draft; at max_tokens 2 and 8 it drafts and
    keeps as many tokens at each position as the chunk-16 colocated server, and its tokens are
    the plain server's."""
    p, d, chunked = cycle_nodes if which == "cycle" else alt_nodes
    lens = [17, 81] if SANITIZED else [17, 33, 81]
    for i, n in enumerate(lens):
        x = repeating(n, period, i)
        for max_tokens in (2, 8):
            c0, d0 = counters(chunked), counters(d)
            got = run(d, x, max_tokens)
            assert got == run(chunked, x, max_tokens) == run(plain, x, max_tokens)
            want, have = delta(c0, counters(chunked)), delta(d0, counters(d))
            assert have == want, f"{which}, {n}-token prompt, {max_tokens} tokens: drafted/" \
                f"kept by position {have}, colocated {want}"
            if max_tokens == 2:
                assert have == [(1, 1)] + [(0, 0)] * (K - 1), \
                    f"{which}, {n}-token prompt: drafted/kept {have} at the first step " \
                    "(want one, kept)"
    chunked.wait_idle()
    decode_idle(d)
    prefill_idle(p)
