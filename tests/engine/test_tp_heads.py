"""Speculation heads sharded like their sharded target (`--tp N` with `--spec mtp` and `--spec
eagle`; issue 17 item 1; src/engine/engine.c, "A speculation head beside a sharded target").

Under --tp N the head's layer is split by its own KV heads like a target layer (its q/k/v rows,
o columns, MLP rows and columns, the two all-reduces), its KV is group 1 of each rank's pool
(replica sets when the ranks outnumber its KV heads), its LM head split by rows (a reduced
draft vocabulary by its draft rows), its input stage replicated on every rank.

The contract checked, with --exact-activations:
  - the greedy tokens are --tp 1's without speculation, bit for bit;
  - the speculation statistics (drafted, accepted, by position, the trees' other branches) are
    the --tp 1 head's on the same prompt: the same proposals, so the same acceptance. The
    heads are built so that acceptance depends on the whole layer: a "near-echo" head (the
    echo head's input and norms, lib.heads, with a random attention and MLP added at a tenth
    of their weight) is accepted on a repetition and only sometimes elsewhere, so a
    wrong shard (a KV head read from another rank's slice, a missing all-reduce) changes
    which drafts pass; and, on the tiny targets, with rejection acceptance sampled with a seed,
    the tokens and the statistics are the --tp 1 head's too (they follow its whole
    distribution). Not on the default model: there a near-echo head's q is nearly the
    target's p, and a rejected draft's residual max(0, p - q) is then made of differences at
    the all-reduce's rounding (measured: a 1-KV-head head's logits within 1e-6 of --tp 1's,
    and --tp 2 and 3 drawing the same tokens, --tp 1 others);
  - on tiny random targets: KV heads H in {1, 2, 4}, heads of 1, 2 or 4 KV heads, --tp 2 and 4
    (replica sets of the target, of the head, or both), each head layout the loader takes
    (tandem, EAGLE, DeepSeek-MTP) and a reduced draft vocabulary (d2t); and EAGLE-3 heads
    (random, their fused features from three target layers, their q/k/v's two column halves
    split by the same rows), whose rejection-sampled tokens follow the head's whole
    distribution: a wrong slice of either half changes them;
  - on the default model (3 KV heads: --tp 2 splits 2 + 1, --tp 3 one each) with heads of 3
    KV heads and of 1 (replica sets at --tp 2 and 3), and with the shipped, trained head
    (MODEL.mtp.safetensors, a draft vocabulary of 8192) where it is present;
  - what cannot be sharded is refused by name.
"""
import json

import numpy as np
import pytest

from conftest import default_model_path, run_tandem
from lib import reference as ref
from lib.checkpoints import make_hf_checkpoint
from lib.heads import write_eagle3_head, write_head
from lib.sanitize import release_only
from test_fidelity import tie_free_prompt

N_GEN = 24
SPECS = {"mtp": ["--spec", "mtp", "--spec-k", "3"],  # fixed k: drafts every step (no timing gate)
         "eagle": ["--spec", "eagle", "--spec-k", "3", "--spec-tree-budget", "8"]}
REPEAT = "!" * 24                   # the default model repeats one token
ALTERNATE = " ".join(["a b"] * 10)  # the default model alternates two tokens


def gen(model, prompt, tp, extra=(), n=N_GEN, temperature=0):
    """(token ids, the --spec-stats line or None) of a run (greedy, or sampled with a seed);
    prompt: token ids or text."""
    p = (["--prompt-tokens", ",".join(map(str, prompt))] if isinstance(prompt, list)
         else ["--prompt", prompt])
    args = ["generate", "--model", model, *p, "--max-tokens", n, "--temperature", temperature,
            "--seed", 5, "--print-token-ids", "--threads", 2, "--exact-activations", "--tp", tp,
            *extra]
    cp = run_tandem(args)
    stats = None
    if "--spec-stats" in extra:
        stats = json.loads(cp.stderr.strip().splitlines()[-1])
    return cp.stdout.split(), stats


def check_sharded(model, head, prompt, tps, what, n=N_GEN, want_accepted=False,
                  methods=tuple(SPECS), rejection=False):
    """Tokens of every --tp N with the head = plain --tp 1's; statistics = the --tp 1 head's;
    rejection: also sampled with rejection acceptance, tokens and statistics --tp 1's."""
    plain, _ = gen(model, prompt, 1, n=n)
    for method in methods:
        extra = SPECS[method] + ["--spec-draft", head, "--spec-stats"]
        ids1, st1 = gen(model, prompt, 1, extra, n)
        assert ids1 == plain, f"{what} --spec {method} --tp 1: {ids1}, plain {plain}"
        assert st1["drafted"] > 0, f"{what} --spec {method}: nothing drafted: {st1}"
        if want_accepted:
            assert st1["accepted"] > 0, f"{what} --spec {method}: nothing accepted: {st1}"
        for tp in tps:
            ids, st = gen(model, prompt, tp, extra, n)
            w = f"{what} --spec {method} --tp {tp}"
            assert ids == plain, f"{w}: tokens {ids}, plain --tp 1 {plain}"
            assert st == st1, f"{w}: statistics {st}, the --tp 1 head's {st1}"
        if not rejection:
            continue
        # rejection acceptance, sampled: each draft kept with probability min(1, p / q), the
        # rest drawn from the residual, so the tokens and statistics follow the head's whole
        # distribution q, not only its best guesses
        rej = extra + ["--spec-accept", "rejection"]
        ids1, st1 = gen(model, prompt, 1, rej, n, temperature=0.8)
        for tp in tps:
            ids, st = gen(model, prompt, tp, rej, n, temperature=0.8)
            w = f"{what} --spec {method} --spec-accept rejection --tp {tp}"
            assert (ids, st) == (ids1, st1), f"{w}: {ids} {st}, the --tp 1 head's {ids1} {st1}"


def near_echo(path, *, d, head_dim, vocab, n_heads, n_kv_heads, d_ff, layout="tandem",
              seed=0, gain=0.1, draft_vocab=None, lm_head=None):
    """The echo head's input stage and norms with a random head's attention and MLP at `gain`
    of their weight (see the top of this file); draft_vocab: a reduced draft vocabulary of
    that many ids (d2t, EAGLE-3's offsets), spread over the target's; lm_head: the target's,
    for a layout with an LM head of its own (DeepSeek-MTP's shared_head)."""
    from safetensors.numpy import load_file, save_file
    kw = dict(d=d, head_dim=head_dim, vocab=vocab, n_heads=n_heads, n_kv_heads=n_kv_heads,
              d_ff=d_ff, layout=layout, seed=seed)
    write_head(path, kind="random", **kw)
    rnd = load_file(str(path))
    write_head(path, kind="echo", **kw)
    t = load_file(str(path))
    for k, v in rnd.items():
        if any(s in k for s in ("self_attn.", "mlp.")):
            t[k] = v * np.float32(gain) if ("o_proj" in k or "down_proj" in k) else v
    for k in t:
        if lm_head is not None and k.endswith("shared_head.head.weight"):
            t[k] = np.asarray(lm_head, dtype=np.float32)
    if draft_vocab:
        ids = np.unique(np.random.default_rng(seed).choice(vocab, draft_vocab, replace=False))
        t["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
    save_file(t, str(path))
    return path


# (target KV heads, head KV heads, head layout, draft vocabulary): --tp 2 and 4 of each
TINY = [(2, 2, "tandem", None),        # --tp 4: replica sets of both
        (4, 2, "eagle", None),         # --tp 4: the head's replica sets, the target's split
        (1, 4, "deepseek-mtp", None),  # the target's replica sets, the head's split
        (2, 1, "tandem", 96)]          # one head KV head; a reduced draft vocabulary


@pytest.mark.parametrize("kv,head_kv,layout,draft_vocab", TINY)
def test_tiny_targets(kv, head_kv, layout, draft_vocab, tandem_bin, tmp_path):
    path = make_hf_checkpoint(tmp_path / "target", "llama", seed=90 + kv, hidden_size=128,
                              num_attention_heads=8, num_key_value_heads=kv, head_dim=16,
                              intermediate_size=256, num_hidden_layers=2)
    m = ref.load(path)
    head = near_echo(tmp_path / "head.safetensors", d=128, head_dim=16, vocab=m.vocab_size,
                     n_heads=8, n_kv_heads=head_kv, d_ff=256, layout=layout, seed=kv * 10 + head_kv,
                     draft_vocab=draft_vocab, lm_head=m.lm_head)
    prompt = tie_free_prompt(m, 20, N_GEN)
    check_sharded(path, head, prompt, (2, 4), f"H={kv}, head H={head_kv} ({layout})",
                  rejection=True)


# (target KV heads, EAGLE-3 head KV heads): --tp 2 and 4 of each
TINY_EAGLE3 = [(2, 2),  # --tp 4: replica sets of both
               (4, 1)]  # the target split, the head's replica sets


@pytest.mark.parametrize("kv,head_kv", TINY_EAGLE3)
def test_tiny_targets_eagle3(kv, head_kv, tandem_bin, tmp_path):
    """An EAGLE-3 head (its own LM head over a reduced draft vocabulary, its fused features
    from target layers 0, 2 and 3, named in its config.json) beside a sharded 4-layer target:
    greedy tokens and statistics are --tp 1's, and so are the tokens sampled with rejection
    acceptance (which read the head's whole distribution, its attention's included)."""
    path = make_hf_checkpoint(tmp_path / "target", "llama", seed=90 + kv, hidden_size=128,
                              num_attention_heads=8, num_key_value_heads=kv, head_dim=16,
                              intermediate_size=256, num_hidden_layers=4)
    m = ref.load(path)
    head = tmp_path / "eagle3" / "head.safetensors"
    head.parent.mkdir()
    write_eagle3_head(head, d=128, head_dim=16, vocab=m.vocab_size, n_layers=4, n_heads=8,
                      n_kv_heads=head_kv, d_ff=256, draft_vocab=96, seed=kv * 10 + head_kv,
                      aux_layers=(0, 2, 3))
    prompt = tie_free_prompt(m, 20, N_GEN)
    check_sharded(path, str(head), prompt, (2, 4), f"H={kv}, EAGLE-3 head H={head_kv}",
                  rejection=True)


D_MODEL, HEAD_DIM, VOCAB = 576, 64, 49152  # SmolLM2-135M


@release_only("the tiny targets run the same sharded heads and replica sets (test_tiny_targets)")
@pytest.mark.parametrize("head_kv,n_heads", [(3, 9), (1, 6)])
def test_default_model_near_echo(head_kv, n_heads, default_model, tandem_bin, tmp_path):
    """Heads of 3 KV heads (split like the target's) and of 1 (replica sets at --tp 2 and 3),
    on a repetition (some drafts kept, some not: measured, the chain keeps about a fifth) and
    an alternation (the trees keep their second children; the chain keeps nothing there)."""
    head = near_echo(tmp_path / "h.safetensors", d=D_MODEL, head_dim=HEAD_DIM, vocab=VOCAB,
                     n_heads=n_heads, n_kv_heads=head_kv, d_ff=1536, seed=head_kv)
    check_sharded(default_model, head, REPEAT, (2, 3), f"head H={head_kv} repeat",
                  want_accepted=True)
    check_sharded(default_model, head, ALTERNATE, (2, 3), f"head H={head_kv} alternate",
                  want_accepted=True, methods=("eagle",))


def test_shipped_head(default_model, tandem_bin):
    """The trained head beside the default model (its draft vocabulary: 8192 rows, split over
    the ranks), on prose, where it is accepted for real."""
    head = default_model_path().with_suffix(".mtp.safetensors")
    if not head.exists():
        pytest.skip(f"no shipped head at {head}")
    prompt = "The capital of France is Paris. The capital of Germany is Berlin. The capital of"
    check_sharded(default_model, head, prompt, (2, 3), "shipped head", n=32, want_accepted=True)


def test_refusals(default_model, tandem_bin, tmp_path):
    """A head whose KV heads the ranks cannot split, and the head across sharded
    disaggregation, are refused by name; the old blanket refusal is gone."""
    head = write_head(tmp_path / "kv2.safetensors", d=D_MODEL, head_dim=HEAD_DIM, vocab=VOCAB,
                      n_heads=8, n_kv_heads=2, d_ff=1536, seed=3)
    del head
    cp = run_tandem(["generate", "--model", default_model, "--prompt-tokens", "1,2,3",
                     "--max-tokens", 2, "--threads", 2, "--tp", 3, "--spec", "mtp",
                     "--spec-draft", tmp_path / "kv2.safetensors"], check=False)
    assert cp.returncode != 0, cp.stderr
    for w in ("--tp 3", "speculation head", "2 KV heads"):
        assert w in cp.stderr, f"{w!r} not in {cp.stderr!r}"
    assert "is not sharded; it runs whole" not in cp.stderr
    for role in ("prefill", "decode"):
        peers = ["--prefill-peers", "http://127.0.0.1:9"] if role == "decode" else []
        cp = run_tandem(["serve", "--model", default_model, "--tp", 2, "--role", role,
                         "--spec", "mtp", *peers], check=False)
        assert cp.returncode == 2, cp.stderr
        for w in ("--tp 2", f"--role {role}", "sharded like the target",
                  "carry the target's layers only"):
            assert w in cp.stderr, f"{w!r} not in {cp.stderr!r}"


def test_serve(default_model, tandem_bin, tmp_path):
    """`tandem serve --tp 2 --spec mtp` and `--spec eagle` with a sharded head: concurrent
    requests (batched head passes and verifications) get the greedy text of `tandem serve
    --tp 1` without speculation, the head drafts, and every KV page (each rank's share of the
    target's and the head's) is back at the end."""
    import concurrent.futures as cf
    from lib.server import Server
    head = near_echo(tmp_path / "h.safetensors", d=D_MODEL, head_dim=HEAD_DIM, vocab=VOCAB,
                     n_heads=9, n_kv_heads=3, d_ff=1536, seed=3)
    bodies = [{"model": "smol", "prompt": p, "max_tokens": 16, "temperature": 0}
              for p in (REPEAT, ALTERNATE, "The three primary colours are", "1, 2, 3, 4,")]

    def answers(args):
        s = Server(["--threads", 2, "--exact-activations", *args])
        try:
            with cf.ThreadPoolExecutor(len(bodies)) as ex:
                out = list(ex.map(lambda b: s.post("/v1/completions", b), bodies))
            assert all(st == 200 for st, _ in out), out
            m = s.wait_idle()
            assert m[("tandem_kv_pages_used", ())] == 0
            return [r["choices"][0]["text"] for _, r in out], m
        finally:
            s.stop()

    want, _ = answers(["--tp", 1])
    for method in ("mtp", "eagle"):
        got, m = answers(["--tp", 2, *SPECS[method], "--spec-draft", head])
        assert got == want, f"--tp 2 --spec {method}: {got}, --tp 1 without: {want}"
        assert m[("tandem_spec_drafted_tokens_total", ())] > 0, f"--spec {method}: no drafts"
