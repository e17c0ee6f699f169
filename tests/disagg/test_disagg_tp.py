"""Sharded KV transfers between a prefill node of TP = p and a decode node of TP = d (issue 17,
item 2; DESIGN.md section 5): every (p, d) in {1, 2, 4}^2 over KV heads H in {1, 2, 4, 8}, end
to end, on the CPU.

For each H (a tiny random llama GGUF with num_key_value_heads = H), one prefill node of each p
and one decode node of each d, every decoder with all three prefill nodes as http:// peers; a
request names its prefill node (x-prefiller-host-port), so the nine (p, d) pairs of an H share
six processes. Every answer (greedy, --exact-activations) must be the colocated TP = 1
server's: the same tokens, and log-probabilities within LP_TOL. The decoder learns each peer's sharding from its first request
(a SCHEME answer: asked again, not counted as an attempt) and expects, per chunk and layer, one
write per slice whose pages are both whole and two where K and V lie apart; the prefill nodes'
write counts must be exactly that (`writes_per_layer`, the plan's arithmetic restated here).
Replica sets (p > H): the source set is drawn per request, and several ranks must send.
Afterwards every pool is back at its baseline and no page is fenced.

tests/disagg/test_disagg_shard.c checks the slice arithmetic for (p, d) in {1, 2, 3, 4}^2 and
H in {1, 2, 3, 4, 8} byte for byte; this file is the end-to-end half.
"""
import time

import pytest

from lib.checkpoints import make_gguf_checkpoint
from lib.server import Server
from test_disagg import (DECODE_SLACK, SLACK, decode_idle, prefill_idle, prompts, run,
                         run_named, wait_peers_up)

TPS = (1, 2, 4)
CHUNK = 32  # two pages: the prompts below take one to three chunks
LAYERS = 2
EXACT = ["--exact-activations", "--threads", "1"]
# Greedy tokens must be TP 1's exactly; log-probabilities come within float rounding: the
# ranks' all-reduce sums in another order (tests/engine/test_tp.py), and on these F32 models
# even p = d = 1 differs from the colocated run by ~1e-6 (the prompt prefilled in chunks, its
# last token run as a decode step).
LP_TOL = 1e-4


def split_even(n, part, parts):
    per, extra = divmod(n, parts)
    b = part * per + min(part, extra)
    return b, b + per + (1 if part < extra else 0)


def kv_range(H, tp, rank):
    s = min(tp, H)
    return split_even(H, rank % s, s)


def writes_per_layer(H, p, d):
    """Writes a layer of a chunk takes from p ranks to d ranks (any draw: source set 0)."""
    n = 0
    for dr in range(d):
        a, b = kv_range(H, d, dr)
        for sr in range(min(p, H)):
            c, e = kv_range(H, p, sr)
            lo, hi = max(a, c), min(b, e)
            if lo < hi:
                n += 1 if (lo, hi) == (a, b) == (c, e) else 2
    return n


def expected_writes(H, p, d, n_prompt):
    """Immediates of one request: every chunk's layers' slices, then the context."""
    chunks = -(-(n_prompt - 1) // CHUNK)
    return chunks * LAYERS * writes_per_layer(H, p, d) + 1


def metric(server, name, labels=()):
    return server.metrics().get((name, tuple(labels)), 0)


@pytest.mark.parametrize("H", [1, 2, 4, 8])
def test_sharded_transfers_match_tp1(H, tmp_path):
    model = make_gguf_checkpoint(tmp_path / f"kv{H}.gguf", "llama", seed=170 + H,
                                 hidden_size=128, num_attention_heads=8,
                                 num_key_value_heads=H, head_dim=16, intermediate_size=256,
                                 num_hidden_layers=LAYERS)
    procs = []
    t0 = time.time()
    worst = 0.0
    try:
        colocated = Server(EXACT, model=model)
        procs.append(colocated)
        pf = {}
        for p in TPS:
            pf[p] = Server(EXACT + ["--role", "prefill", "--tp", p] + SLACK, model=model)
            procs.append(pf[p])
        peers = ",".join(f"http://127.0.0.1:{pf[p].port}" for p in TPS)
        dec = {}
        for d in TPS:
            dec[d] = Server(EXACT + ["--role", "decode", "--tp", d, "--prefill-peers", peers,
                                     "--remote-chunk", CHUNK] + DECODE_SLACK, model=model)
            procs.append(dec[d])
        for d in TPS:
            wait_peers_up(dec[d], len(TPS))
        ps = prompts(3, 40 + H, [5, 40, 70])
        ps = [[t % 250 + 3 for t in x] for x in ps]  # the tiny vocabulary's ids
        want = [run(colocated, x) for x in ps]
        for d in TPS:
            for p in TPS:
                got = [run_named(dec[d], x, f"127.0.0.1:{pf[p].port}") for x in ps]
                for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
                    assert tokens == want_tokens, f"H={H} p={p} d={d}: not TP 1's tokens"
                    diff = max(abs(a - b) for a, b in zip(lps, want_lps))
                    worst = max(worst, diff)
                    assert diff < LP_TOL, \
                        f"H={H} p={p} d={d}: log-probabilities {lps}, TP 1's {want_lps}"
        for d in TPS:
            m = decode_idle(dec[d])
            assert m[("tandem_disagg_remote_prefills_total", ())] == len(TPS) * len(ps)
            assert m[("tandem_disagg_local_fallbacks_total", ())] == 0
            # one SCHEME answer per peer of another sharding than the assumed TP 1
            assert m[("tandem_disagg_transfer_errors_total", (("kind", "scheme"),))] == \
                sum(1 for p in TPS if p != 1)
            for kind in ("timeout", "peer", "nack", "send", "other"):
                assert m[("tandem_disagg_transfer_errors_total", (("kind", kind),))] == 0, kind
        for p in TPS:
            m = prefill_idle(pf[p])
            want_writes = sum(expected_writes(H, p, d, len(x)) for d in TPS for x in ps)
            assert m[("tandem_disagg_writes_total", ())] == want_writes, \
                f"H={H} p={p}: {m[('tandem_disagg_writes_total', ())]} writes, {want_writes} planned"
            sent = [m[("tandem_disagg_rank_writes_total", (("rank", str(r)),))] for r in range(p)]
            assert sum(sent) == want_writes - len(TPS) * len(ps)  # less the contexts
            assert sum(1 for n in sent if n) >= min(p, H), f"H={H} p={p}: ranks sent {sent}"
            sets = p // min(p, H)
            draws = len(ps) * sum(d // min(d, H) for d in TPS)  # destination sets drawing
            if sets > 1 and sets ** (draws - 1) > 1e9:  # a single set every time: < 1e-9
                assert sum(1 for n in sent if n) > min(p, H), \
                    f"H={H} p={p}: one replica set sent every time: {sent}"
    finally:
        for s in reversed(procs):
            s.stop()
    print(f"H={H}: 9 (p, d) pairs in {time.time() - t0:.1f} s, log-probabilities within "
          f"{worst:.2g} of TP 1's")


def test_refusals(tmp_path):
    """A speculation head with a sharded disaggregated node, and --kv-staging always with one,
    are refused at start with a message; a sharding the model's KV heads do not allow too."""
    model = make_gguf_checkpoint(tmp_path / "kv2.gguf", "llama", seed=172, hidden_size=128,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                 intermediate_size=256, num_hidden_layers=LAYERS)
    for args, words in (
            (["--role", "prefill", "--tp", "2", "--kv-staging", "always"], "staging"),
            (["--role", "decode", "--tp", "2", "--spec", "mtp", "--prefill-peers", "x1:00"],
             "speculation head"),
            (["--role", "prefill", "--tp", "3"], "KV heads")):
        with pytest.raises(RuntimeError) as e:
            Server(EXACT + args, model=model)
        assert words in str(e.value), str(e.value)


def test_sharded_transfers_with_prefix_caching(tmp_path):
    """--prefix-caching on a prefill node of TP 4 and a decoder of TP 2 (H = 4: each decode
    rank's page rebuilt from two prefill ranks' slices): a decoder that holds a cached prefix
    asks for the rest only, a prefill node that holds one sends the decoder's chunks inside it
    from its cache, and every answer is still the colocated TP 1 server's; once both caches
    are flushed both pools are back at their baseline."""
    from test_disagg_prefix import delta, family, flush, quiet

    H = 4
    model = make_gguf_checkpoint(tmp_path / f"kv{H}.gguf", "llama", seed=180, hidden_size=128,
                                 num_attention_heads=8, num_key_value_heads=H, head_dim=16,
                                 intermediate_size=256, num_hidden_layers=LAYERS)
    procs = []
    try:
        colocated = Server(EXACT, model=model)
        procs.append(colocated)
        p = Server(EXACT + ["--role", "prefill", "--tp", 4, "--prefix-caching"] + SLACK,
                   model=model)
        procs.append(p)
        d = Server(EXACT + ["--role", "decode", "--tp", 2, "--prefill-peers",
                            f"http://127.0.0.1:{p.port}", "--remote-chunk", CHUNK,
                            "--prefix-caching"] + DECODE_SLACK, model=model)
        procs.append(d)
        wait_peers_up(d, 1)
        ps = [[t % 250 + 3 for t in x] for x in family(80, [7, 30, 50, 12], 7)]
        want = [run(colocated, x) for x in ps]
        m0 = quiet(d)
        for x, w in zip(ps, want):
            tokens, lps = run(d, x)
            assert tokens == w[0]
            assert max(abs(a - b) for a, b in zip(lps, w[1])) < LP_TOL
        m1 = quiet(d)
        assert delta(m1, m0, "tandem_disagg_remote_prefills_total") == len(ps)
        assert delta(m1, m0, "tandem_disagg_cached_prefix_requests_total") >= len(ps) - 1
        assert m1[("tandem_disagg_local_fallbacks_total", ())] == 0
        # a new decoder (cold cache) for the same prompts: the prefill node's warm cache sends
        # the chunks inside its prefix without computing them
        d2 = Server(EXACT + ["--role", "decode", "--tp", 2, "--prefill-peers",
                             f"http://127.0.0.1:{p.port}", "--remote-chunk", CHUNK]
                    + DECODE_SLACK, model=model)
        procs.append(d2)
        wait_peers_up(d2, 1)
        r0 = quiet(p)
        for x, w in zip(ps, want):
            tokens, lps = run(d2, x)
            assert tokens == w[0]
            assert max(abs(a - b) for a, b in zip(lps, w[1])) < LP_TOL
        r1 = quiet(p)
        assert delta(r1, r0, "tandem_disagg_reused_chunks_total") > 0
        flush(p, d)
        prefill_idle(p)
        decode_idle(d)
        decode_idle(d2)
    finally:
        for s in reversed(procs):
            s.stop()
