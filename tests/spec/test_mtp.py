"""Speculation heads (--spec mtp): loading, the forward pass against numpy, and lossless drafting.

- The head's forward pass (tests/tools/head_dump: the target's features, then the head over
  them in two runs, the second reading the first's KV) matches lib.reference.head_forward
  within the fidelity contract's 1e-4, for each layout tandem loads (tandem, EAGLE,
  DeepSeek-V3's MTP names), with a different layer geometry (GQA, qwen2 biases, qwen3 q/k
  norms), and in bf16; the target's features match the reference's final-normed states.
- A head that does not fit its target (MLA or expert layers for a target without), an
  EAGLE-3 head without its fused-feature projection (test_eagle3.py has the rest), and files
  that are not heads are refused with a message naming the problem.
- DeepSeek-V3's own MTP layer (latent attention and experts, in the model's folder) is a head
  that matches the reference, and `--spec mtp` / `--spec eagle` take it when no --spec-draft is
  given, lossless.
- `tandem generate --spec mtp --spec-draft HEAD` prints the same token ids as without
  speculation (exact acceptance), greedy and sampled, with a random head and with an echo head
  (lib.heads) that is accepted on a repetitive continuation (so the accepted path, the rewind
  and the head's catch-up over accepted spans all run), at k 1 and 4, with a prompt long
  enough for the head's eager catch-up over prefill chunks; rejection acceptance runs too.
"""
import json
import pathlib
import subprocess
import zlib

import numpy as np
import pytest

from conftest import build_dir, run_tandem
from lib import reference as ref
from lib.checkpoints import make_hf_checkpoint
from lib.heads import DEEPSEEK_LAYER, write_head
from lib.sanitize import SANITIZED, SLOW, release_only
from test_eagle import D_MODEL, HEAD_DIM, LONG, LONG_CHUNKS, REPEAT, VOCAB

TOL = 1e-4


def head_dump(model, head, out, tokens):
    tool = build_dir() / "tests" / "tools" / "head_dump"
    return subprocess.run([str(tool), str(model), str(head), str(out), *map(str, tokens)],
                          capture_output=True, text=True, timeout=120 * SLOW)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (checkpoint folder, reference model)."""
    root = tmp_path_factory.mktemp("mtp_targets")
    out = {}
    for name, arch, opts in (("llama", "llama", dict(seed=21, num_hidden_layers=2)),
                             ("qwen2", "qwen2", dict(seed=22, num_hidden_layers=2)),
                             ("qwen3", "qwen3", dict(seed=23, num_hidden_layers=2))):
        path = make_hf_checkpoint(root / name, arch, **opts)
        out[name] = (path, ref.load(path))
    return out


CASES = {
    # name: (target, write_head options)
    "tandem": ("llama", dict(layout="tandem")),
    "tandem-gqa-wide-ff": ("llama", dict(layout="tandem", n_heads=4, n_kv_heads=2, d_ff=96)),
    "tandem-bf16": ("llama", dict(layout="tandem", dtype="bfloat16")),
    "eagle": ("llama", dict(layout="eagle")),
    "deepseek-mtp": ("llama", dict(layout="deepseek-mtp")),
    "tandem-qwen2-biases": ("qwen2", dict(layout="tandem", qkv_bias=True)),
    "tandem-qwen3-qk-norm": ("qwen3", dict(layout="tandem", qk_norm=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_head_forward_matches_reference(tiny, tmp_path, case):
    target, opts = CASES[case]
    path, model = tiny[target]
    head = write_head(tmp_path / "head.safetensors", d=model.d_model, head_dim=model.head_dim,
                      vocab=model.vocab_size, seed=zlib.crc32(case.encode()) % 1000, **opts)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, model.vocab_size, 37).tolist()
    cp = head_dump(path, tmp_path / "head.safetensors", tmp_path / "out", tokens)
    assert cp.returncode == 0, cp.stderr
    info = json.loads(cp.stdout)
    assert info["layout"] == opts["layout"]
    d, V, P = model.d_model, model.vocab_size, len(tokens)
    feat = np.fromfile(tmp_path / "out.feat", dtype=np.float32).reshape(P, d)
    s = ref.Session(model)
    s.step(tokens)
    assert ref.rel_err(feat, s.features) <= TOL, "the target's features"
    logits = np.fromfile(tmp_path / "out.logits", dtype=np.float32).reshape(P - 1, V)
    hfeat = np.fromfile(tmp_path / "out.hfeat", dtype=np.float32).reshape(P - 1, d)
    # the head reads the reference's features, not tandem's: an independent chain
    want_logits, want_feat = ref.head_forward(model, head, tokens[1:], s.features[:-1])
    for p in range(P - 1):
        assert ref.rel_err(logits[p], want_logits[p]) <= TOL, f"head logits, row {p}"
    assert ref.rel_err(hfeat, want_feat) <= TOL, "the head's features"


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory):
    """A DeepSeek-V3 folder with its own MTP layer (MLA and experts) after its layers."""
    path = make_hf_checkpoint(tmp_path_factory.mktemp("v3") / "v3", "deepseek_v3", seed=31,
                              num_nextn_predict_layers=1)
    return path, ref.load(path), ref.load_mtp_head(path)


def test_deepseek_v3_own_mtp_layer_matches_reference(v3_mtp, tmp_path):
    """DeepSeek-V3's MTP layer, read from the model's own folder, is a head whose layer has the
    target's latent attention and experts (its own KV group of latent rows)."""
    path, model, head = v3_mtp
    tokens = np.random.default_rng(6).integers(0, model.vocab_size, 41).tolist()
    cp = head_dump(path, path, tmp_path / "out", tokens)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["layout"] == "deepseek-mtp"
    P, V, d = len(tokens), model.vocab_size, model.d_model
    s = ref.Session(model)
    s.step(tokens)
    feat = np.fromfile(tmp_path / "out.feat", dtype=np.float32).reshape(P, d)
    assert ref.rel_err(feat, s.features) <= TOL, "the target's features"
    logits = np.fromfile(tmp_path / "out.logits", dtype=np.float32).reshape(P - 1, V)
    want, want_feat = ref.head_forward(model, head, tokens[1:], s.features[:-1])
    for p in range(P - 1):
        assert ref.rel_err(logits[p], want[p]) <= TOL, f"head logits, row {p}"
    hfeat = np.fromfile(tmp_path / "out.hfeat", dtype=np.float32).reshape(P - 1, d)
    assert ref.rel_err(hfeat, want_feat) <= TOL, "the head's features"


@pytest.mark.parametrize("spec", [["--spec", "mtp", "--spec-k", "3"],
                                  ["--spec", "eagle", "--spec-tree-budget", "8"]])
@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_deepseek_v3_speculates_with_its_own_layer(v3_mtp, spec, temp):
    """--spec mtp and eagle with no --spec-draft take the model's own MTP layer, and give the
    tokens of no speculation (exact acceptance), greedy and sampled."""
    path = v3_mtp[0]
    base = ["generate", "--model", str(path), "--prompt-tokens",
            ",".join(str(t) for t in range(3, 60)), "--max-tokens", "20", "--temperature", temp,
            "--seed", "11", "--print-token-ids", "--threads", "2"]
    plain = run_tandem(base).stdout.split()
    cp = run_tandem(base + spec + ["--spec-stats"])
    assert cp.stdout.split() == plain
    assert "deepseek-mtp layout" in cp.stderr, cp.stderr
    stats = json.loads(cp.stderr.strip().splitlines()[-1])
    assert stats["drafted"] > 0


def test_the_comparison_catches_a_shift(tiny, tmp_path):
    """The reference with the tokens not shifted (t(p) with h(p)) must not match: the check is
    sensitive to the one-token shift it exists to guard."""
    path, model = tiny["llama"]
    head = write_head(tmp_path / "h.safetensors", d=model.d_model, head_dim=model.head_dim,
                      vocab=model.vocab_size, seed=4)
    tokens = list(range(3, 40))
    cp = head_dump(path, tmp_path / "h.safetensors", tmp_path / "out", tokens)
    assert cp.returncode == 0, cp.stderr
    logits = np.fromfile(tmp_path / "out.logits", dtype=np.float32).reshape(len(tokens) - 1, -1)
    s = ref.Session(model)
    s.step(tokens)
    wrong, _ = ref.head_forward(model, head, tokens[:-1], s.features[:-1])
    assert ref.rel_err(logits, wrong) > 100 * TOL


def refused(tiny, tmp_path, **opts):
    path, model = tiny["llama"]
    kw = dict(d=model.d_model, head_dim=model.head_dim, vocab=model.vocab_size)
    kw.update(opts)
    write_head(tmp_path / "bad.safetensors", **kw)
    cp = head_dump(path, tmp_path / "bad.safetensors", tmp_path / "out", [1, 2, 3])
    assert cp.returncode == 1 and cp.stderr.startswith("error: "), cp.stderr
    return cp.stderr


def test_head_of_another_width_is_refused(tiny, tmp_path):
    _, model = tiny["llama"]
    err = refused(tiny, tmp_path, d=model.d_model * 2)
    assert f"{model.d_model * 2} wide" in err and f"{model.d_model} wide" in err


def test_head_with_bad_layer_heads_is_refused(tiny, tmp_path):
    _, model = tiny["llama"]
    err = refused(tiny, tmp_path, head_dim=model.head_dim * 3 // 2, n_heads=1, n_kv_heads=1)
    assert "heads" in err


def test_deepseek_head_for_another_vocabulary_is_refused(tiny, tmp_path):
    _, model = tiny["llama"]
    p = f"model.layers.{DEEPSEEK_LAYER}."
    err = refused(tiny, tmp_path, layout="deepseek-mtp",
                  extra={p + "shared_head.head.weight": np.zeros((model.vocab_size + 5,
                                                                  model.d_model))})
    assert "vocabulary" in err and str(model.vocab_size + 5) in err


@pytest.mark.parametrize("what,extra,needle", [
    ("mla", {"model.layers.3.self_attn.kv_a_proj_with_mqa.weight": np.zeros((4, 4))},
     "uses MLA attention and its target"),
    ("moe", {"model.layers.3.mlp.experts.0.gate_proj.weight": np.zeros((4, 4))},
     "is a mixture of experts and its target"),
])
def test_deepseek_layers_unlike_the_target_are_refused(tiny, tmp_path, what, extra, needle):
    assert needle in refused(tiny, tmp_path, layout="deepseek-mtp", extra=extra)


def test_broken_eagle3_and_non_heads_are_refused(tiny, tmp_path):
    from lib.checkpoints import _write_safetensors
    path, _ = tiny["llama"]
    for tensors, needle in (({"d2t": np.zeros(4), "midlayer.self_attn.q_proj.weight":
                              np.zeros((4, 4))}, "an EAGLE-3 head's fc.weight is missing"),
                            ({"something.weight": np.zeros((4, 4))}, "not a speculation head")):
        _write_safetensors(tmp_path / "x.safetensors", tensors, "float32")
        cp = head_dump(path, tmp_path / "x.safetensors", tmp_path / "out", [1, 2])
        assert cp.returncode == 1 and needle in cp.stderr, cp.stderr
    cp = head_dump(path, tmp_path / "missing.safetensors", tmp_path / "out", [1, 2])
    assert cp.returncode == 1 and "missing.safetensors" in cp.stderr


# ---- drafting on the default model ----

N_GEN = 16 if SANITIZED else 40


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_heads")
    out = {}
    for kind in ("random", "echo"):
        p = root / f"{kind}.safetensors"
        write_head(p, d=D_MODEL, head_dim=HEAD_DIM, vocab=VOCAB, n_heads=9, n_kv_heads=3,
                   d_ff=1536, kind=kind, seed=11)
        out[kind] = p
    return out


def gen(model, extra, prompt, chat=True, n=N_GEN):
    args = ["generate", "--model", model, "--prompt", prompt, "--max-tokens", str(n),
            "--print-token-ids", *extra]
    if chat:
        args.append("--chat")
    cp = run_tandem(args, timeout=300 * SLOW)
    return cp.stdout.split(), cp.stderr



# The sanitized pass runs the three cases that together hold both heads, both samplers, the
# penalties and the long prompt; the two short greedy ones run in the Release pass.
_RELEASE_ONLY = release_only("the paths of the other cases")


@pytest.mark.parametrize("kind,prompt,chat,setting", [
    pytest.param("random", "Tell me about the moon.", True, ["--temperature", "0"],
                 marks=_RELEASE_ONLY),
    ("random", "Tell me about the moon.", True, ["--temperature", "0.8", "--seed", "3"]),
    pytest.param("echo", REPEAT, False, ["--temperature", "0"], marks=_RELEASE_ONLY),
    ("echo", REPEAT, False, ["--temperature", "0.8", "--seed", "5", "--repetition-penalty",
                             "1.1"]),
    ("echo", LONG, False, ["--temperature", "0"] + LONG_CHUNKS),
])
def test_generate_mtp_is_bit_identical(default_model, heads, kind, prompt, chat, setting):
    base, _ = gen(default_model, setting, prompt, chat)
    assert len(base) == N_GEN
    for k in ("1", "4"):
        ids, err = gen(default_model, setting + ["--spec", "mtp", "--spec-draft",
                                                 str(heads[kind]), "--spec-k", k,
                                                 "--spec-stats"], prompt, chat)
        assert ids == base, f"--spec mtp ({kind} head, k {k}) changed the output"
        st = json.loads(err.strip().splitlines()[-1])
        assert st["drafted"] > 0, st
        assert "mtp head (tandem layout)" in err


def test_echo_head_is_accepted_on_repetition(default_model, heads):
    """The target continues the repetition; the echo head proposes the last token again, so
    most drafts are kept: tau well above 1 (a random head stays near 1)."""
    base, _ = gen(default_model, ["--temperature", "0"], REPEAT, chat=False)
    assert len(set(base[4:])) == 1, "the target no longer repeats itself on this prompt"
    _, err = gen(default_model, ["--temperature", "0", "--spec", "mtp", "--spec-draft",
                                 str(heads["echo"]), "--spec-k", "4", "--spec-stats"],
                 REPEAT, chat=False)
    st = json.loads(err.strip().splitlines()[-1])
    assert st["tau"] > 2.5, st
    _, err = gen(default_model, ["--temperature", "0", "--spec", "mtp", "--spec-draft",
                                 str(heads["random"]), "--spec-k", "4", "--spec-stats"],
                 REPEAT, chat=False)
    assert json.loads(err.strip().splitlines()[-1])["tau"] < 1.5


def test_gate_shut_drops_the_heads_rows(default_model, heads):
    """--spec-k auto with a head that is never right: the gate measures drafting losing and
    shuts it; a decoding request's head then stops running over each step's rows (they are
    parked, then dropped with its head state, and counted) rather than costing every step a
    head layer. The output stays that of no speculation."""
    n = 200 if SANITIZED else 300
    base, _ = gen(default_model, ["--temperature", "0", "--ignore-eos"], "Tell me about the moon.",
                  n=n)
    assert len(base) == n
    ids, err = gen(default_model, ["--temperature", "0", "--ignore-eos", "--spec", "mtp",
                                   "--spec-draft", str(heads["random"]), "--spec-k", "auto",
                                   "--spec-stats"], "Tell me about the moon.", n=n)
    assert ids == base
    st = json.loads(err.strip().splitlines()[-1])
    assert st.get("head_dropped", 0) >= 1, st
    assert st["head_rows_skipped"] >= 64, st
    # drafting stopped: far fewer drafts than steps (warm-up and the gate's explorations)
    assert st["drafted"] < n // 4, st


def test_rejection_acceptance_runs(default_model, heads):
    ids, err = gen(default_model, ["--temperature", "0.8", "--seed", "2", "--spec", "mtp",
                                   "--spec-draft", str(heads["echo"]), "--spec-k", "3",
                                   "--spec-accept", "rejection", "--spec-stats"], REPEAT,
                   chat=False)
    assert len(ids) == N_GEN
    st = json.loads(err.strip().splitlines()[-1])
    assert st["drafted"] > 0 and st["accepted"] > 0, st


def test_missing_default_head_is_a_clear_error(default_model, tmp_path):
    model = tmp_path / "lonely.gguf"  # the default model with no head beside it
    model.symlink_to(default_model)
    cp = run_tandem(["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2",
                     "--spec", "mtp"], check=False)
    head = tmp_path / "lonely.mtp.safetensors"
    assert cp.returncode != 0 and "train-mtp" in cp.stderr and str(head) in cp.stderr


def test_shipped_head_is_found_and_lossless(default_model):
    """setup puts the shipped head beside the default model; --spec mtp and eagle use it."""
    head = pathlib.Path(str(default_model)[:-len(".gguf")] + ".mtp.safetensors")
    assert head.exists(), f"{head}: scripts/fetch_model.sh installs the shipped head"
    prompt = "Tell me about the moon."
    base, _ = gen(default_model, [], prompt)
    for method in ("mtp", "eagle"):
        ids, err = gen(default_model, ["--spec", method, "--spec-k", "3", "--spec-stats"], prompt)
        assert ids == base, method
        st = json.loads(err.strip().splitlines()[-1])
        assert st["accepted"] > 0, (method, st)
