"""EAGLE-3 heads (docs/HEADS.md, "EAGLE-3"): loading, the forward pass against numpy, refusals,
and lossless drafting with --spec mtp and --spec eagle.

- tests/tools/head_dump gives the target's fused features (the residual stream entering the
  head's three target layers, concatenated) and the head's draft logits and pre-norm states
  over rows p = 0 .. P-2 (token p + 1, the target's fused feature p), in two runs (the second
  reading the first's KV), then one more row fed the head's own state (a deeper draft). Each
  is checked against lib.reference's EAGLE-3 forward (eagle3_forward), fed the reference
  target's own layer inputs (Session.layer_inputs), never tandem's: an independent chain.
  Cases: a reduced draft vocabulary with d2t/t2d and the target's embeddings; bf16 with GQA,
  fc.bias, its own embed_tokens and a companion config.json naming the target layers; a qwen2
  target; the whole vocabulary without maps.
- The comparison is sensitive to the layers: features taken one layer off do not match.
- Heads that do not fit are refused with a message naming the problem.
- `tandem generate --spec mtp|eagle --spec-draft EAGLE3` prints the token ids of no
  speculation, greedy and sampled, on the default model, also beside a sharded target
  (--tp 2, 3: the --tp 1 head's statistics).
"""
import json
import zlib

import numpy as np
import pytest

from conftest import run_tandem
from lib import reference as ref
from lib.checkpoints import make_hf_checkpoint
from lib.heads import write_eagle3_head
from lib.sanitize import SANITIZED, SLOW
from test_mtp import head_dump

TOL = 1e-4
N_LAYERS = 8  # the default target layers: 2, 4, 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_targets")
    out = {}
    for name, arch, seed in (("llama", "llama", 41), ("qwen2", "qwen2", 42)):
        path = make_hf_checkpoint(root / name, arch, seed=seed, num_hidden_layers=N_LAYERS)
        out[name] = (path, ref.load(path))
    return out


CASES = {
    # name: (target, write_eagle3_head options)
    "draft-vocab": ("llama", dict(draft_vocab=40)),
    "bf16-gqa-bias-embed-config": ("llama", dict(dtype="bfloat16", n_heads=4, n_kv_heads=2,
                                                 d_ff=96, fc_bias=True, embed=True,
                                                 draft_vocab=50, aux_layers=(0, 3, 7))),
    "qwen2": ("qwen2", dict(draft_vocab=64)),
    "whole-vocab": ("llama", dict()),
}


def dump(tmp_path, model, path, head, tokens):
    cp = head_dump(path, tmp_path / "e3" / "head.safetensors", tmp_path / "out", tokens)
    assert cp.returncode == 0, cp.stderr
    info = json.loads(cp.stdout)
    d, V, P = model.d_model, model.vocab_size, len(tokens)
    rd = lambda ext, *shape: np.fromfile(tmp_path / f"out.{ext}",  # noqa: E731
                                         dtype=np.float32).reshape(*shape)
    return info, rd("feat", P, 3 * d), rd("logits", P - 1, V), rd("hfeat", P - 1, d), \
        rd("own_logits", V), rd("own_hfeat", d)


def check_logits(ours, want, what):
    """Draft columns within the contract; every other column -inf, as the reference's."""
    off = np.isneginf(want)
    assert (np.isneginf(ours) == off).all(), f"{what}: -inf outside the draft vocabulary"
    assert ref.rel_err(ours[~off], want[~off]) <= TOL, what


@pytest.mark.parametrize("case", sorted(CASES))
def test_eagle3_forward_matches_reference(tiny, tmp_path, case):
    target, opts = CASES[case]
    path, model = tiny[target]
    (tmp_path / "e3").mkdir()
    head = write_eagle3_head(tmp_path / "e3" / "head.safetensors", d=model.d_model,
                             head_dim=model.head_dim, vocab=model.vocab_size,
                             n_layers=N_LAYERS, seed=zlib.crc32(case.encode()) % 1000, **opts)
    tokens = np.random.default_rng(7).integers(0, model.vocab_size, 29).tolist()
    info, feat, logits, hfeat, own_logits, own_hfeat = dump(tmp_path, model, path, head, tokens)
    assert info["layout"] == "eagle3" and info["feature_width"] == 3 * model.d_model
    assert tuple(info["aux_layers"]) == head.aux_layers
    assert info["n_draft"] == (0 if head.d2t is None else len(head.d2t))
    s = ref.Session(model)
    s.step(tokens)
    want_feat = ref.eagle3_features(s, head.aux_layers)
    assert ref.rel_err(feat, want_feat) <= TOL, "the target's fused features"
    # the head on the reference's features, then one row on its own state
    want, want_h, cache = ref.eagle3_forward(model, head, tokens[1:], want_feat[:-1], own=False)
    for p in range(len(tokens) - 1):
        check_logits(logits[p], want[p], f"head logits, row {p}")
    assert ref.rel_err(hfeat, want_h) <= TOL, "the head's pre-norm states"
    want_o, want_oh, _ = ref.eagle3_forward(model, head, tokens[1:2], want_h[-1:], own=True,
                                            cache=cache)
    check_logits(own_logits, want_o[0], "the own-fed row's logits")
    assert ref.rel_err(own_hfeat, want_oh[0]) <= TOL, "the own-fed row's state"


def test_the_comparison_catches_the_layers(tiny, tmp_path):
    """Features from the layers one off (the outputs of 2, L/2, L-3 instead of their inputs)
    must not match: the check is sensitive to which residual the head reads."""
    path, model = tiny["llama"]
    (tmp_path / "e3").mkdir()
    head = write_eagle3_head(tmp_path / "e3" / "head.safetensors", d=model.d_model,
                             head_dim=model.head_dim, vocab=model.vocab_size, n_layers=N_LAYERS,
                             seed=3, draft_vocab=40)
    tokens = list(range(3, 30))
    _, feat, logits, _, _, _ = dump(tmp_path, model, path, head, tokens)
    s = ref.Session(model)
    s.step(tokens)
    wrong = ref.eagle3_features(s, [i + 1 for i in head.aux_layers])
    assert ref.rel_err(feat, wrong) > 100 * TOL
    want, _, _ = ref.eagle3_forward(model, head, tokens[1:], wrong[:-1], own=False)
    keep = ~np.isneginf(want)
    assert ref.rel_err(logits[keep], want[keep]) > 100 * TOL


def refused(tiny, tmp_path, **opts):
    path, model = tiny["llama"]
    (tmp_path / "e3").mkdir(exist_ok=True)
    kw = dict(d=model.d_model, head_dim=model.head_dim, vocab=model.vocab_size,
              n_layers=N_LAYERS, draft_vocab=40)
    kw.update(opts)
    write_eagle3_head(tmp_path / "e3" / "bad.safetensors", **kw)
    cp = head_dump(path, tmp_path / "e3" / "bad.safetensors", tmp_path / "out", [1, 2, 3])
    assert cp.returncode == 1 and cp.stderr.startswith("error: "), cp.stderr
    return cp.stderr


def test_refusals(tiny, tmp_path):
    _, m = tiny["llama"]
    d, V = m.d_model, m.vocab_size
    cases = [
        # a head of another width: fc [2d, 6d]
        (dict(d=2 * d), [f"[{2 * d}, {6 * d}]", f"{d} wide"]),
        # fc of the right rows but not 3 features wide
        (dict(extra={"fc.weight": np.zeros((d, 2 * d))}), [f"[{d}, {2 * d}]", "fc.weight"]),
        # q/k/v reading d columns, not [embedding; feature]
        (dict(extra={"midlayer.self_attn.q_proj.weight": np.zeros((d, d))}),
         ["q_proj", f"2 x {d}"]),
        # d2t of another length than lm_head's rows
        (dict(extra={"lm_head.weight": np.zeros((41, d))}), ["d2t maps 40", "41 rows"]),
        # d2t taking ids out of the target's vocabulary
        (dict(extra={"d2t": np.full(40, V, dtype=np.int64)}), ["d2t maps draft token 0",
                                                               f"vocabulary of {V}"]),
        # t2d of another vocabulary
        (dict(extra={"t2d": np.ones(V + 3, dtype=np.bool_)}), ["t2d", str(V)]),
        # t2d marking other tokens than d2t
        (dict(extra={"t2d": np.ones(V, dtype=np.bool_)}), ["t2d marks", "do not describe"]),
        # no d2t and a reduced LM head
        (dict(drop=("d2t", "t2d")), ["40 rows and there is no d2t"]),
        # no fc
        (dict(drop=("fc.weight",)), ["fc.weight is missing"]),
        # target layers out of range (the companion config.json)
        (dict(aux_layers=(1, 4, N_LAYERS)), [f"layers 1, 4 and {N_LAYERS}", "config.json",
                                             f"has {N_LAYERS} layers"]),
    ]
    for opts, needles in cases:
        cfg = tmp_path / "e3" / "config.json"
        if cfg.exists():
            cfg.unlink()
        err = refused(tiny, tmp_path, **opts)
        for n in needles:
            assert n in err, (opts.keys(), err)


def test_default_layers_need_a_deep_enough_target(tmp_path):
    """vLLM's default layers (2, L/2, L-3) of a 2-layer target are out of range: refused."""
    path = make_hf_checkpoint(tmp_path / "t2", "llama", seed=5, num_hidden_layers=2)
    model = ref.load(path)
    (tmp_path / "e3").mkdir()
    write_eagle3_head(tmp_path / "e3" / "h.safetensors", d=model.d_model,
                      head_dim=model.head_dim, vocab=model.vocab_size, n_layers=2)
    cp = head_dump(path, tmp_path / "e3" / "h.safetensors", tmp_path / "out", [1, 2, 3])
    assert cp.returncode == 1 and "vLLM's default" in cp.stderr and "2 layers" in cp.stderr


# ---- drafting on the default model ----

D_MODEL, HEAD_DIM, VOCAB, LAYERS = 576, 64, 49152, 30  # SmolLM2-135M
N_GEN = 16 if SANITIZED else 32


@pytest.fixture(scope="module")
def head3(tmp_path_factory):
    p = tmp_path_factory.mktemp("eagle3_head") / "eagle3.safetensors"
    write_eagle3_head(p, d=D_MODEL, head_dim=HEAD_DIM, vocab=VOCAB, n_layers=LAYERS, n_heads=9,
                      n_kv_heads=3, d_ff=1536, draft_vocab=4096, seed=13, dtype="bfloat16")
    return p


def gen(model, extra, prompt, n=N_GEN):
    args = ["generate", "--model", model, "--prompt", prompt, "--max-tokens", str(n), "--chat",
            "--print-token-ids", *extra]
    cp = run_tandem(args, timeout=300 * SLOW)
    return cp.stdout.split(), cp.stderr


@pytest.mark.parametrize("setting", [["--temperature", "0"],
                                     ["--temperature", "0.8", "--seed", "3"]])
def test_generate_with_eagle3_is_bit_identical(default_model, head3, setting):
    prompt = "Tell me about the moon."
    base, _ = gen(default_model, setting, prompt)
    assert len(base) == N_GEN
    for spec in (["--spec", "mtp", "--spec-k", "3"],
                 ["--spec", "eagle", "--spec-tree-budget", "8"]):
        ids, err = gen(default_model, setting + spec + ["--spec-draft", str(head3),
                                                        "--spec-stats"], prompt)
        assert ids == base, f"{spec} with an EAGLE-3 head changed the output"
        assert "eagle3 layout" in err, err
        st = json.loads(err.strip().splitlines()[-1])
        assert st["drafted"] > 0, st


REPEAT = "!" * 24  # the target goes on with one token (id 32) forever


@pytest.fixture(scope="module")
def echo3(tmp_path_factory, default_model):
    """An EAGLE-3 head with a known acceptance: fc selects the third feature, which its
    config.json makes the residual entering the target's last layer; attention and MLP add
    nothing (o_proj, down_proj = 0); its final norm and LM head are the target's (the rows of
    the first 4,096 tokens). It proposes the target's last-layer logit lens, and deeper drafts
    repeat it: on a target that repeats itself, its drafts are kept."""
    target = ref.load(default_model)
    d, n = D_MODEL, 4096
    fc = np.concatenate([np.zeros((d, 2 * d)), np.eye(d)], axis=1)
    mark = np.zeros(VOCAB, dtype=np.bool_)
    mark[:n] = True
    p = tmp_path_factory.mktemp("eagle3_echo") / "echo.safetensors"
    write_eagle3_head(p, d=d, head_dim=HEAD_DIM, vocab=VOCAB, n_layers=LAYERS, n_heads=9,
                      n_kv_heads=3, d_ff=64, draft_vocab=n, seed=2, dtype="float32",
                      aux_layers=(0, 1, LAYERS - 1),
                      extra={"fc.weight": fc, "d2t": np.zeros(n, dtype=np.int64), "t2d": mark,
                             "midlayer.self_attn.o_proj.weight": np.zeros((d, 9 * HEAD_DIM)),
                             "midlayer.mlp.down_proj.weight": np.zeros((d, 64)),
                             "norm.weight": target.out_norm, "lm_head.weight": target.lm_head[:n]})
    return p


def test_echo_eagle3_is_accepted_and_lossless(default_model, echo3):
    """Drafts are kept (the accepted path, the rewind and the catch-up on fused features all
    run), and the output is the output without speculation, as a chain and as trees."""
    args = ["generate", "--model", default_model, "--prompt", REPEAT, "--max-tokens",
            str(N_GEN), "--print-token-ids", "--temperature", "0"]
    base = run_tandem(args, timeout=300 * SLOW).stdout.split()
    assert len(set(base[4:])) == 1, "the target no longer repeats itself on this prompt"
    # a fixed k: the adaptive gate would turn trees off on a loaded machine, by its timings
    for spec in (["--spec", "mtp", "--spec-k", "4"], ["--spec", "eagle", "--spec-k", "4"]):
        cp = run_tandem(args + spec + ["--spec-draft", str(echo3), "--spec-stats"],
                        timeout=300 * SLOW)
        assert cp.stdout.split() == base, spec
        st = json.loads(cp.stderr.strip().splitlines()[-1])
        assert st["tau"] > 2.0, (spec, st)


def test_eagle3_beside_a_sharded_target(default_model, echo3):
    """--tp N shards the head like its target (engine.c; its q/k/v's two column halves by the
    rank's rows, fc and the norms replicated on every rank from the leader's fused features):
    greedy tokens at --tp 2 (KV heads 2 + 1) and --tp 3 (one each) are --tp 1's without
    speculation, and the speculation statistics are the --tp 1 head's (the same drafts kept),
    as a chain and as trees. The sharded layer itself is checked against --tp 1 on tiny targets
    with rejection sampling (tests/engine/test_tp_heads.py, test_tiny_targets_eagle3)."""
    def run(tp, spec=()):
        cp = run_tandem(["generate", "--model", default_model, "--prompt", REPEAT, "--max-tokens",
                         "24", "--temperature", "0", "--print-token-ids", "--threads", "2",
                         "--exact-activations", "--tp", str(tp), *spec], timeout=300 * SLOW)
        st = json.loads(cp.stderr.strip().splitlines()[-1]) if spec else None
        return cp.stdout.split(), st

    plain, _ = run(1)
    for spec in (["--spec", "mtp", "--spec-k", "3"],
                 ["--spec", "eagle", "--spec-k", "3", "--spec-tree-budget", "8"]):
        spec = spec + ["--spec-draft", str(echo3), "--spec-stats"]
        ids1, st1 = run(1, spec)
        assert ids1 == plain, spec
        assert st1["drafted"] > 0 and st1["accepted"] > 0, (spec, st1)
        for tp in (2, 3):
            ids, st = run(tp, spec)
            assert ids == plain, f"{spec} --tp {tp}: {ids}, plain --tp 1 {plain}"
            assert st == st1, f"{spec} --tp {tp}: statistics {st}, --tp 1's {st1}"
