"""Disaggregated serving of a multi-head latent attention model (DeepSeek-V3 shaped, issue 18):
the KV pages that cross hold one latent row per token (the H = 1, fully replicated case of
DESIGN.md section 5), and the decoder's answers are the colocated server's, token for token
with their log-probabilities, for f32 and bf16 pages; and with --spec mtp on the model's own
MTP layer, whose latent KV the prefill node computes and streams as one more layer. Both pools
return to baseline."""
import pytest

from disagg.test_disagg import (SANITIZED, THREADS, assert_all_remote, decode_node,
                                prefill_idle, prefill_node, run)
from lib.checkpoints import make_gguf_checkpoint
from lib.server import Server


@pytest.mark.parametrize("kv", ["f32", "bf16"])
def test_mla_greedy_identical_to_colocated(tmp_path, kv):
    model = make_gguf_checkpoint(tmp_path / "v3.gguf", "deepseek_v3", seed=80, tied=False,
                                 num_hidden_layers=3, kv_b_split=True)
    # f32 weights: --batch-invariant keeps OpenBLAS out, whose sums depend on how many rows a
    # product has (the prefill node runs the prompt in chunks of another size)
    args = ["--model", str(model), "--kv-dtype", kv, "--batch-invariant"]
    col = Server(THREADS + args)
    p = d = None
    try:
        p = prefill_node(args)
        d = decode_node([p], args)
        lens = [2, 17, 40, 65, 100] if not SANITIZED else [2, 65]
        ps = [[(7 * i + 13 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)]
        want = [run(col, x) for x in ps]
        m0 = d.metrics()
        got = [run(d, x) for x in ps]
        assert got == want, "MLA pages: disaggregated output differs from colocated"
        assert_all_remote(d, m0, len(ps))
        prefill_idle(p)
        # one latent row per token and no V half: 16 tokens x (32 + 8) elements a page
        page = 16 * 40 * (4 if kv == "f32" else 2)
        for s in (p, d):
            assert f", {kv}, {page} bytes a page and layer (latent rows);" in s.logs(), s.logs()
    finally:
        for s in (d, p, col):
            if s:
                s.stop()


def test_mla_speculation_across_disaggregation(tmp_path):
    """Both nodes run DeepSeek-V3's own MTP layer (--spec mtp, no --spec-draft): the decoder
    drafts from its first step on the head's latent KV that the prefill node sent, and its
    answers are the colocated speculating server's and the plain one's."""
    from lib.checkpoints import make_hf_checkpoint, write_hf_tokenizer
    model = make_hf_checkpoint(tmp_path / "v3", "deepseek_v3", seed=81, num_nextn_predict_layers=1)
    write_hf_tokenizer(model, 272)
    base = ["--model", str(model), "--batch-invariant"]
    mtp = ["--spec", "mtp", "--spec-k", "2"]
    plain, col = Server(THREADS + base), Server(THREADS + base + mtp)
    p = d = None
    try:
        p = prefill_node(base + mtp)
        d = decode_node([p], base + mtp)
        lens = [3, 40, 90] if not SANITIZED else [3, 40]
        ps = [[(11 * i + 5 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)]
        want = [run(plain, x) for x in ps]
        assert [run(col, x) for x in ps] == want
        m0 = d.metrics()
        assert [run(d, x) for x in ps] == want, "disaggregated --spec mtp differs"
        assert_all_remote(d, m0, len(ps))
        prefill_idle(p)
        assert "speculation head" in p.logs() and "speculation head" in d.logs()
    finally:
        for s in (d, p, col, plain):
            if s:
                s.stop()
