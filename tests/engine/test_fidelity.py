"""Fidelity: tandem's forward pass against the independent numpy reference (tests/lib/reference.py).

Contract (DESIGN.md section 7): logits within 1e-4 relative, greedy output token for token.

"1e-4 relative" means, for the logits vector of one position (all vocab_size values):

    max_i |ours_i - ref_i| / max_i |ref_i|  <=  1e-4

that is, the worst absolute error measured against the largest reference logit, not an
elementwise relative error (which is meaningless for logits near zero). The reference computes in
float64 from the same stored weights (dequantised by the gguf package, or read by the safetensors
package), so the whole error is the engine's.

Greedy: prompts are chosen so that the reference's greedy run has no near tie (top-2 gap below
TIE = 1e-3 of max|logits| at some step, which a 1e-4 error could legitimately flip); the tests
assert that, then require identical sequences. Tandem's tokens are also checked step by step
against the reference run on tandem's own sequence (teacher forcing), so a failure names the
first step where tandem chose a token the reference does not rank first.

Logits come from `tandem generate --dump-logits FILE` (float32 logits of the last prompt
position); tokens from `--print-token-ids`. Tiny random checkpoints (tests/lib/checkpoints.py)
cover every loader path: HF safetensors in f32/bf16/f16, tied and sharded, every rope form;
GGUF F32/F16/Q8_0/Q4_0/Q4_1/Q6_K/Q4_K_M with llama.cpp's Q/K permutation; qwen2 biases and qwen3 q/k
norms. Prompt lengths 1, 2, 7, 40 and 53 (past three 16-token KV pages), then 12 decode steps.

The first tests check the reference and the checkpoint writers themselves (no tandem needed):
the same seed written as HF and as GGUF must give the same logits, incremental and full
evaluation must agree, and the comparison must be sensitive to the mistakes it exists to catch.
"""
import dataclasses
import functools
import pathlib

import numpy as np
import pytest

from conftest import run_tandem
from lib import reference as ref
from lib.checkpoints import (YARN_SCALING, f32_to_bf16_bits, make_gguf_checkpoint,
                             make_hf_checkpoint, quantize_q4_k, quantize_q6_k)

TOL = 1e-4  # max|ours - ref| / max|ref|
TIE = 1e-3  # top-2 gap below TIE * max|logits| is a near tie
N_GREEDY = 12
PROMPT_LENS = (1, 2, 7, 40, 53)

# name -> (format, arch, options). Seeds differ so each variant is its own model.
VARIANTS = {
    "hf-llama-f32": ("hf", "llama", dict(seed=1, num_hidden_layers=3)),
    "hf-llama-bf16-tied-sharded": ("hf", "llama", dict(seed=2, dtype="bfloat16", tied=True,
                                                        sharded=True)),
    "hf-llama-rope-llama3": ("hf", "llama", dict(seed=3, rope="llama3")),
    "hf-llama-rope-llama3-parameters": ("hf", "llama", dict(seed=4, rope="llama3_parameters")),
    "hf-llama-rope-parameters": ("hf", "llama", dict(seed=5, rope="parameters",
                                                      rope_theta=54321.0)),
    "hf-llama-rope-linear": ("hf", "llama", dict(seed=6, rope="linear")),
    "hf-qwen2-f32": ("hf", "qwen2", dict(seed=7, num_hidden_layers=3)),
    "hf-qwen2-f16": ("hf", "qwen2", dict(seed=8, dtype="float16", tied=True)),
    "hf-qwen3-f32": ("hf", "qwen3", dict(seed=9)),
    "hf-qwen3-bf16": ("hf", "qwen3", dict(seed=10, dtype="bfloat16", sharded=True)),
    "gguf-llama-F32": ("gguf", "llama", dict(seed=11, wtype="F32", num_hidden_layers=3)),
    "gguf-llama-F16-untied": ("gguf", "llama", dict(seed=12, wtype="F16", tied=False)),
    "gguf-llama-Q8_0": ("gguf", "llama", dict(seed=13, wtype="Q8_0")),
    "gguf-llama-Q4_0": ("gguf", "llama", dict(seed=14, wtype="Q4_0", tied=False)),
    "gguf-llama-Q4_1": ("gguf", "llama", dict(seed=15, wtype="Q4_1")),
    "gguf-llama-Q6_K": ("gguf", "llama", dict(seed=16, wtype="Q6_K", hidden_size=256,
                                              intermediate_size=512, num_attention_heads=4,
                                              num_key_value_heads=2)),
    # llama.cpp's Q4_K_M mix: Q4_K matrices, the tied embedding / LM head and ffn_down Q6_K
    "gguf-llama-Q4_K_M": ("gguf", "llama", dict(seed=20, wtype="Q4_K_M", hidden_size=256,
                                                intermediate_size=512, num_attention_heads=4,
                                                num_key_value_heads=2)),
    "gguf-llama-rope-freqs": ("gguf", "llama", dict(seed=17, wtype="F32", rope_freqs=True)),
    "gguf-qwen2-Q8_0": ("gguf", "qwen2", dict(seed=18, wtype="Q8_0", tied=False)),
    "gguf-qwen3-F32": ("gguf", "qwen3", dict(seed=19, wtype="F32")),
    # mixture of experts: a dense layer among sparse ones, probabilities kept as they are
    # (norm_topk_prob false), and llama.cpp's stacked experts, quantised
    "hf-qwen3moe-f32": ("hf", "qwen3_moe", dict(seed=40, num_hidden_layers=3,
                                                mlp_only_layers=(1,), norm_topk_prob=False)),
    "hf-qwen3moe-bf16-sharded": ("hf", "qwen3_moe", dict(seed=41, dtype="bfloat16",
                                                         sharded=True, num_experts=6,
                                                         num_experts_per_tok=3)),
    "hf-mixtral-f32": ("hf", "mixtral", dict(seed=42)),
    # transformers' fused 3-D expert tensors
    "hf-qwen3moe-fused-bf16": ("hf", "qwen3_moe", dict(seed=49, dtype="bfloat16",
                                                       fused_experts=True)),
    "hf-mixtral-fused-f32": ("hf", "mixtral", dict(seed=50, fused_experts=True, sharded=True)),
    "gguf-qwen3moe-F32": ("gguf", "qwen3_moe", dict(seed=43, wtype="F32")),
    "gguf-qwen3moe-Q8_0": ("gguf", "qwen3_moe", dict(seed=44, wtype="Q8_0",
                                                     moe_intermediate_size=64)),
    "gguf-mixtral-Q4_0": ("gguf", "mixtral", dict(seed=45, wtype="Q4_0", tied=False)),
    # a gated shared expert beside the routed ones (and qwen2's q/k/v biases)
    "hf-qwen2moe-f32": ("hf", "qwen2_moe", dict(seed=47, norm_topk_prob=True)),
    "gguf-qwen2moe-Q8_0": ("gguf", "qwen2_moe", dict(seed=48, wtype="Q8_0",
                                                     moe_intermediate_size=64,
                                                     shared_expert_intermediate_size=64)),
    # DeepSeek: MLA (q direct for V2, through its LoRA for V3), a dense first layer, shared
    # experts; V2's softmax router (greedy, then group-limited), V3's sigmoid with its bias and
    # groups scored by their best two; YaRN past its original context; llama.cpp's deepseek2
    # with kv_b whole or split into k_b / v_b, quantised
    "hf-deepseek-v2-f32": ("hf", "deepseek_v2", dict(seed=60, num_hidden_layers=3)),
    "hf-deepseek-v2-groups-yarn-bf16": ("hf", "deepseek_v2", dict(
        seed=61, dtype="bfloat16", num_experts=8, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", rope_scaling=dict(YARN_SCALING, factor=8.0,
                                                              mscale=1.0, mscale_all_dim=0.5))),
    "hf-deepseek-v3-f32": ("hf", "deepseek_v3", dict(seed=62, num_hidden_layers=3,
                                                     rope_scaling=YARN_SCALING)),
    "gguf-deepseek-v3-F32-split": ("gguf", "deepseek_v3", dict(seed=63, wtype="F32",
                                                               tied=False, kv_b_split=True)),
    # softmax scores with groups worth their best two (a deepseek2 GGUF with expert groups):
    # the sum of two probabilities, not of two logits
    "gguf-deepseek-v2-softmax-groups-F32": ("gguf", "deepseek_v2", dict(
        seed=66, wtype="F32", tied=False, num_experts=8, n_group=4, topk_group=2,
        topk_method="noaux_tc")),
    "gguf-deepseek-v2-Q8_0": ("gguf", "deepseek_v2", dict(
        seed=64, wtype="Q8_0", tied=False, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32, moe_intermediate_size=64,
        rope_scaling=YARN_SCALING)),
}


def make_variant(name: str, base: pathlib.Path) -> pathlib.Path:
    fmt, arch, opts = VARIANTS[name]
    if fmt == "hf":
        return make_hf_checkpoint(base / name, arch, **opts)
    return make_gguf_checkpoint(base / f"{name}.gguf", arch, **opts)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(variant) -> path, written once per session."""
    base = tmp_path_factory.mktemp("tiny-checkpoints")
    made = {}

    def get(name):
        if name not in made:
            made[name] = make_variant(name, base)
        return made[name]

    return get


@functools.lru_cache(maxsize=None)
def ref_model(path: str) -> ref.Model:
    return ref.load(path)


def prompt_for(model: ref.Model, length: int, salt: int = 0) -> list:
    rng = np.random.default_rng(1000 * length + salt)
    return [int(t) for t in rng.integers(0, model.vocab_size, size=length)]


def tie_free_prompt(model: ref.Model, length: int, n: int, kv_dtype: str | None = None) -> list:
    """The first random prompt of `length` whose reference greedy run of n tokens (with its cache
    rounded to kv_dtype) has no near tie, so that the greedy sequences must be identical."""
    for salt in range(50):
        prompt = prompt_for(model, length, salt)
        if min(ref.greedy(model, prompt, n, return_margins=True, kv_dtype=kv_dtype)[1]) >= TIE:
            return prompt
    raise AssertionError(f"no tie-free prompt of length {length}")


def tandem_generate(model_path, prompt, n, tmp_path, threads=None, tag="logits", kv_dtype=None,
                    exact=True):
    """(generated token ids, float32 logits of the last prompt position). exact: with
    --exact-activations, the path the 1e-4 contract is for (the CPU's default multiplies
    Q8_0/Q4_0/Q4_1 matrices by int8-quantised activations: test_quantised_activations)."""
    dump = tmp_path / f"{tag}.f32"
    args = ["generate", "--model", model_path, "--prompt-tokens", ",".join(map(str, prompt)),
            "--max-tokens", n, "--temperature", 0, "--print-token-ids", "--dump-logits", dump]
    if exact:
        args += ["--exact-activations"]
    if threads is not None:
        args += ["--threads", threads]
    if kv_dtype is not None:
        args += ["--kv-dtype", kv_dtype]
    cp = run_tandem(args)
    tokens = [int(t) for t in cp.stdout.split()]
    assert len(tokens) == n, f"expected {n} token ids on stdout, got: {cp.stdout!r}"
    logits = np.fromfile(dump, dtype="<f4")
    return tokens, logits


def check_logits(ours: np.ndarray, ref_logits: np.ndarray, what: str, tol: float = TOL):
    assert ours.shape == ref_logits.shape, f"{what}: {ours.shape} logits, want {ref_logits.shape}"
    assert np.all(np.isfinite(ours)), f"{what}: non-finite logits"
    err = ref.rel_err(ours, ref_logits)
    worst = int(np.argmax(np.abs(ours - ref_logits)))
    assert err <= tol, (f"{what}: logits differ by {err:.3g} relative (max|ref| "
                        f"{np.max(np.abs(ref_logits)):.4g}; worst id {worst}: ours "
                        f"{ours[worst]:.6g} ref {ref_logits[worst]:.6g})")


def check_fidelity(model: ref.Model, prompt: list, ours_logits: np.ndarray, ours: list,
                   what: str, kv_dtype: str | None = None, tol: float = TOL):
    """Logits of the last prompt position within tol; tandem's greedy tokens checked step by
    step on tandem's own sequence (teacher forcing), then identical to the reference's own
    greedy run, which must have no near tie (else the prompt is a bad choice). kv_dtype: the
    reference stores its KV cache rounded as tandem's --kv-dtype does."""
    n = len(ours)
    logits = ref.forward(model, list(prompt) + list(ours[:-1]), kv_dtype)[len(prompt) - 1:]
    check_logits(ours_logits, logits[0], what, tol)
    for i, tok in enumerate(ours):
        row = logits[i]
        best = int(np.argmax(row))
        slack = TIE * np.max(np.abs(row))
        assert 0 <= tok < model.vocab_size, f"{what}: step {i}: token {tok} out of range"
        assert row[tok] >= row[best] - slack, (
            f"{what}: step {i}: tandem chose {tok} (ref logit {row[tok]:.6g}) but the reference "
            f"argmax is {best} ({row[best]:.6g}); tandem's tokens {ours}")
    want, margins = ref.greedy(model, prompt, n, return_margins=True, kv_dtype=kv_dtype)
    assert min(margins) >= TIE, (f"{what}: the reference has a near tie (relative top-2 gaps "
                                 f"{np.round(margins, 5).tolist()}); choose another prompt")
    assert ours == want, f"{what}: greedy tokens {ours}, reference {want}"


# ---------------------------------------------------------------------------------------------
# The reference and the checkpoint writers check themselves (no tandem).

TOKS = [5, 17, 3, 100, 200, 7, 9, 250, 1, 0, 44, 31, 31, 31, 2, 128]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral",
                                  "qwen2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v3-split"])
def test_reference_hf_and_gguf_agree(arch, tmp_path):
    """One seed written both ways is one model: catches wrong tensor names, a wrong llama Q/K
    permutation, or rope pairing that does not match it (DeepSeek: kv_b whole or split, YaRN
    from config.json or from the GGUF keys)."""
    arch, split = arch.split("-")[0], arch.endswith("-split")
    extra = dict(rope_scaling=YARN_SCALING) if arch.startswith("deepseek") else {}
    hf = ref.load(make_hf_checkpoint(tmp_path / "hf", arch, seed=21, **extra))
    gg = ref.load(make_gguf_checkpoint(tmp_path / "m.gguf", arch, seed=21, tied=False,
                                       kv_b_split=split, **extra))
    deepseek = arch.startswith("deepseek")
    assert hf.rope_neox != deepseek and gg.rope_neox == (arch not in ("llama", "mixtral")
                                                         and not deepseek)
    # float64 throughout: what is left is BLAS's rounding (~1e-16 an op), which a random model's
    # gains amplify to ~1e-9; a wrong name or permutation is off by O(1)
    assert ref.rel_err(ref.forward(gg, TOKS), ref.forward(hf, TOKS)) < 1e-8


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_reference_fused_experts_are_the_same_model(arch, tmp_path):
    """transformers' fused expert tensors hold the per-expert ones (gate rows before up)."""
    one = ref.load(make_hf_checkpoint(tmp_path / "a", arch, seed=26))
    fused = ref.load(make_hf_checkpoint(tmp_path / "b", arch, seed=26, fused_experts=True))
    assert ref.rel_err(ref.forward(fused, TOKS), ref.forward(one, TOKS)) == 0.0


def test_reference_llama3_rope_freqs_equals_hf_llama3(tmp_path):
    hf = ref.load(make_hf_checkpoint(tmp_path / "hf", "llama", seed=22, rope="llama3"))
    hf2 = ref.load(make_hf_checkpoint(tmp_path / "hf2", "llama", seed=22,
                                      rope="llama3_parameters"))
    gg = ref.load(make_gguf_checkpoint(tmp_path / "m.gguf", "llama", seed=22, tied=False,
                                       rope_freqs=True))
    want = ref.forward(hf, TOKS)
    assert ref.rel_err(ref.forward(hf2, TOKS), want) == 0.0
    assert ref.rel_err(ref.forward(gg, TOKS), want) < 1e-6  # rope_freqs is stored as f32
    # all three llama3 regimes are exercised: kept, smoothed, divided by the factor
    base = ref.rope_inv_freq(hf.rope_theta, hf.head_dim)
    ratio = base / hf.inv_freq
    assert np.any(ratio == 1.0) and np.any(np.isclose(ratio, 8.0))
    assert np.any((ratio > 1.001) & (ratio < 7.999))


def test_reference_incremental_matches_full(tmp_path):
    m = ref.load(make_hf_checkpoint(tmp_path / "hf", "qwen3", seed=23))
    full = ref.forward(m, TOKS)
    s = ref.Session(m)
    parts = [s.step(TOKS[:5]), s.step(TOKS[5:6]), s.step(TOKS[6:])]
    assert ref.rel_err(np.concatenate(parts), full) < 1e-12
    toks = ref.greedy(m, TOKS, 4)
    assert toks[0] == int(np.argmax(full[-1]))


def test_reference_is_sensitive(tmp_path):
    """The 1e-4 comparison must fail for the mistakes it exists to catch."""
    m = ref.load(make_hf_checkpoint(tmp_path / "hf", "llama", seed=24))
    want = ref.forward(m, TOKS[:7])
    mutants = {
        "rope pairing": dataclasses.replace(m, rope_neox=False),
        "theta 10000": dataclasses.replace(m, inv_freq=ref.rope_inv_freq(10000.0, m.head_dim)),
        "rms eps 1e-5": dataclasses.replace(m, rms_eps=1e-5),
        "untied/tied": dataclasses.replace(m, lm_head=m.embed),
    }
    for what, mut in mutants.items():
        assert ref.rel_err(ref.forward(mut, TOKS[:7]), want) > 10 * TOL, what


def test_reference_moe_routing_is_sensitive(tmp_path):
    """The experts' routing shows in the logits: one expert a token instead of two, or the
    kept probabilities renormalised or not, moves them far past the tolerance; so a fidelity
    check of a mixture-of-experts model cannot pass with the routing wrong."""
    m = ref.load(make_hf_checkpoint(tmp_path / "hf", "qwen3_moe", seed=46, norm_topk_prob=False))
    base = ref.forward(m, TOKS)
    for change in (dict(experts_used=1), dict(norm_topk=True)):
        other = ref.forward(dataclasses.replace(m, **change), TOKS)
        assert ref.rel_err(other, base) > 100 * TOL, change


def test_reference_deepseek_is_sensitive(tmp_path):
    """DeepSeek's own parts show in the logits: its routing (the bias, the groups, the scaling
    factor, sigmoid or softmax) and YaRN's frequencies, magnitude and softmax scale."""
    m = ref.load(make_hf_checkpoint(tmp_path / "v3", "deepseek_v3", seed=65,
                                    rope_scaling=dict(YARN_SCALING, mscale=1.0)))
    toks = [(7 * i) % 250 + 3 for i in range(80)]  # past yarn's original 64 positions
    base = ref.forward(m, toks)
    L = m.layers[1]
    mutants = {
        "no correction bias": dataclasses.replace(
            m, layers=[m.layers[0], dataclasses.replace(L, router_bias=None)]),
        "no groups": dataclasses.replace(m, n_group=0, topk_group=0),
        "group by its best": dataclasses.replace(m, group_top2=False),
        "no routed scale": dataclasses.replace(m, routed_scale=1.0),
        "softmax scores": dataclasses.replace(m, sigmoid=False),
        "yarn off": dataclasses.replace(m, inv_freq=ref.rope_inv_freq(m.rope_theta, 8)),
        "no rope magnitude": dataclasses.replace(m, rope_mscale=1.0),
        "no attention scale": dataclasses.replace(m, attn_scale=1.0),
    }
    assert m.rope_mscale != 1.0 and m.attn_scale != 1.0
    for what, mut in mutants.items():
        assert ref.rel_err(ref.forward(mut, toks), base) > 10 * TOL, what


def test_q6_k_packing_decodes_with_gguf():
    import gguf

    x = np.random.default_rng(25).standard_normal((4, 512)).astype(np.float32)
    y = gguf.quants.dequantize(quantize_q6_k(x), gguf.GGMLQuantizationType.Q6_K)
    # each value within half a quantisation step (step <= max|sub-block| / 31, plus scale rounding)
    assert y.shape == x.shape
    assert np.max(np.abs(y - x)) < np.max(np.abs(x)) / 31
    assert np.corrcoef(x.ravel(), y.ravel())[0, 1] > 0.999


def test_q4_k_packing_decodes_with_gguf():
    import gguf

    x = np.random.default_rng(26).standard_normal((4, 512)).astype(np.float32)
    x[0, :32] = np.abs(x[0, :32]) + 0.5  # a sub-block with no negative value (minimum 0)
    y = gguf.quants.dequantize(quantize_q4_k(x), gguf.GGMLQuantizationType.Q4_K)
    # each value within a quantisation step (range / 15, plus the 6-bit scale's rounding)
    assert y.shape == x.shape
    sub = x.reshape(-1, 32)
    step = (sub.max(axis=1) - np.minimum(sub.min(axis=1), 0)) / 15
    assert np.all(np.abs(y - x).reshape(-1, 32).max(axis=1) <= 1.5 * step)
    assert np.corrcoef(x.ravel(), y.ravel())[0, 1] > 0.99


def test_bf16_rounding():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 3.0e38], dtype=np.float32)
    assert f32_to_bf16_bits(x).tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F62]
    import gguf

    y = np.random.default_rng(27).standard_normal(1000).astype(np.float32)
    theirs = gguf.quants.quantize(y, gguf.GGMLQuantizationType.BF16).view(np.uint16)
    assert np.array_equal(f32_to_bf16_bits(y), theirs)


# ---------------------------------------------------------------------------------------------
# tandem against the reference: tiny checkpoints


@pytest.mark.parametrize("length", PROMPT_LENS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_fidelity(variant, length, checkpoint, tandem_bin, tmp_path):
    path = checkpoint(variant)
    m = ref_model(str(path))
    prompt = tie_free_prompt(m, length, N_GREEDY)
    ours_tokens, ours_logits = tandem_generate(path, prompt, N_GREEDY, tmp_path)
    check_fidelity(m, prompt, ours_logits, ours_tokens, f"{variant} prompt[{length}]")


# 2-byte KV caches (--kv-dtype bf16, f16): the reference rounds each K and V value it stores to
# float32 and then to the type, as tandem stores its float32 K and V. Most runs then agree as
# closely as fp32 caches do (median 3e-7 over 36 prompts of these variants), but the two sides
# compute K and V in different precisions (float32 against float64), so a value next to a
# rounding boundary can land on the neighbouring 2-byte value, one unit of the type away
# (2^-7 relative for bf16, 2^-10 for f16): the worst of the 36 was 2.2e-4 for bf16 and 6.2e-5
# for f16. The tolerances leave twice that. Against the reference without the rounding, bf16
# KV is off by 1.2e-3 to 6e-3, so for bf16 the check is sensitive to a cache that does not
# round, or rounds another way (f16's own rounding, 1.6e-4 and up, is too close to tell).
KV_TOL = {"bf16": 5e-4, "f16": 1.5e-4}
# And against tandem's own f32 cache: the 2-byte cache's logits stay within a few units of the
# type's rounding (2^-8 = 3.9e-3 for bf16, 2^-11 = 4.9e-4 for f16) of the f32 ones: measured up
# to 6.3e-3 and 5.4e-4 over the 36 prompts; the tolerances leave three times that.
KV_VS_F32 = {"bf16": 2e-2, "f16": 2e-3}
KV_VARIANTS = ["hf-llama-f32", "hf-qwen3-f32", "gguf-llama-Q4_1", "hf-deepseek-v3-f32"]


@pytest.mark.parametrize("kv_dtype", ["bf16", "f16"])
@pytest.mark.parametrize("length", [7, 53])
@pytest.mark.parametrize("variant", KV_VARIANTS)
def test_kv_dtype_fidelity(variant, length, kv_dtype, checkpoint, tandem_bin, tmp_path):
    path = checkpoint(variant)
    m = ref_model(str(path))
    prompt = tie_free_prompt(m, length, N_GREEDY, kv_dtype)
    tokens, logits = tandem_generate(path, prompt, N_GREEDY, tmp_path, kv_dtype=kv_dtype)
    what = f"{variant} --kv-dtype {kv_dtype} prompt[{length}]"
    check_fidelity(m, prompt, logits, tokens, what, kv_dtype=kv_dtype, tol=KV_TOL[kv_dtype])
    if kv_dtype == "bf16":  # the rounding is what the check measures
        plain = ref.forward(m, prompt)[-1]
        assert ref.rel_err(logits, plain) > KV_TOL["bf16"], f"{what}: no different from fp32 KV"
    _, logits32 = tandem_generate(path, prompt, 1, tmp_path, tag="f32", kv_dtype="f32")
    err = ref.rel_err(logits, logits32)
    assert err <= KV_VS_F32[kv_dtype], f"{what}: {err:.3g} relative from the f32 cache's logits"


def test_threads_give_identical_output(tandem_bin, tmp_path):
    """Work split over 1 or 2 threads gives the same tokens (wide enough to split)."""
    path = make_hf_checkpoint(tmp_path / "wide", "llama", seed=26, hidden_size=256,
                              num_attention_heads=8, num_key_value_heads=2,
                              intermediate_size=768, vocab_size=4096)
    m = ref.load(path)
    prompt = tie_free_prompt(m, 53, N_GREEDY)
    t1, l1 = tandem_generate(path, prompt, N_GREEDY, tmp_path, threads=1, tag="t1")
    t2, l2 = tandem_generate(path, prompt, N_GREEDY, tmp_path, threads=2, tag="t2")
    assert t1 == t2, f"--threads 1 gave {t1}, --threads 2 gave {t2}"
    check_fidelity(m, prompt, l1, t1, "threads=1")
    check_fidelity(m, prompt, l2, t2, "threads=2")


# ---------------------------------------------------------------------------------------------
# The CPU's default for Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices: activations quantised per block of 32
# to 16-bit integers held in two int8 planes (src/backend/cpu/qdot.c), integer dot products. Each
# activation is rounded to 1/65000 or so of its block's largest, which puts the logits a little
# further from the float64 reference than --exact-activations: measured (2026-12-05) 4.5e-5 to
# 9.5e-5 on these tiny variants (the Q4_K_M mix, added later: 4.2e-5 and 4.6e-5) and 1.3e-4 to
# 1.9e-4 on the default model's four prompts (--exact-activations: within 1e-4 on both). The
# tolerances leave 2.5 times the worst. One int8 plane (llama.cpp's Q8 activations) was off by
# far more and is what these would catch, like any kernel that drops or misweights a plane. The
# check is also sensitive the other way: the same prompt with --exact-activations must be within
# TOL, and the quantised logits must differ from those (the option must change the path).
# Greedy agreement with the exact path over 100 prompts of the default model is
# bench/cpu_activations.py's (bench/RESULTS.md).
QUANT_MEASURED = {"tiny": 9.5e-5, "default": 1.92e-4}
QUANT_TOL = {k: 2.5 * v for k, v in QUANT_MEASURED.items()}
QUANT_VARIANTS = ["gguf-llama-Q8_0", "gguf-llama-Q4_0", "gguf-llama-Q4_1", "gguf-qwen2-Q8_0",
                  "gguf-llama-Q4_K_M"]


@pytest.mark.parametrize("length", [7, 53])
@pytest.mark.parametrize("variant", QUANT_VARIANTS)
def test_quantised_activations(variant, length, checkpoint, tandem_bin, tmp_path):
    path = checkpoint(variant)
    m = ref_model(str(path))
    prompt = tie_free_prompt(m, length, 1)
    _, quant = tandem_generate(path, prompt, 1, tmp_path, tag="quant", exact=False)
    _, exact = tandem_generate(path, prompt, 1, tmp_path, tag="exact")
    want = ref.forward(m, prompt)[-1]
    what = f"{variant} prompt[{length}] quantised activations"
    check_logits(exact, want, f"{variant} prompt[{length}] --exact-activations")
    err = ref.rel_err(quant, want)
    print(f"{what}: {err:.3g} from the reference")
    assert err <= QUANT_TOL["tiny"], f"{what}: {err:.3g} relative from the reference"
    assert ref.rel_err(quant, exact) > 0, f"{what}: the same logits as --exact-activations"


# The K-quants on the quantised path (Q4_K and Q6_K stay in their blocks and run the integer
# tiles; with --exact-activations they are widened to F32 at load): greedy decoding of the
# Q4_K_M mix gives the reference's tokens, at 1 and 2 threads, and the same tokens and bits at
# both (each row's value is independent of the thread split).
def test_kquant_greedy(checkpoint, tandem_bin, tmp_path):
    path = checkpoint("gguf-llama-Q4_K_M")
    m = ref_model(str(path))
    prompt = tie_free_prompt(m, 40, N_GREEDY)
    t1, l1 = tandem_generate(path, prompt, N_GREEDY, tmp_path, threads=1, tag="k1", exact=False)
    t2, l2 = tandem_generate(path, prompt, N_GREEDY, tmp_path, threads=2, tag="k2", exact=False)
    assert t1 == t2 and np.array_equal(l1.view(np.uint32), l2.view(np.uint32)), \
        "quantised K-quants: --threads 1 and 2 differ"
    want = ref.greedy(m, prompt, N_GREEDY)
    assert t1 == want, f"quantised K-quants: {t1}, the reference {want}"
    err = ref.rel_err(l1, ref.forward(m, prompt)[-1])
    assert err <= QUANT_TOL["tiny"], f"quantised K-quants: {err:.3g} from the reference"


# ---------------------------------------------------------------------------------------------
# tandem against the reference: the default model (SmolLM2-135M-Instruct, Q4_1)

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
]
N_DEFAULT = 16


@functools.lru_cache(maxsize=None)
def smollm_tokenizer(path: str):
    """A byte-level BPE tokenizer built from the GGUF vocab and merges (tokenizers package);
    it only needs to produce valid, realistic ids."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    r = GGUFReader(path)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(mg.split(" ", 1)) for mg in r.fields["tokenizer.ggml.merges"].contents()]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == 3])
    return tk


@pytest.fixture(scope="module")
def default_ref(default_model):
    return ref.load(default_model)


@pytest.mark.parametrize("text", DEFAULT_PROMPTS, ids=[f"prompt{i}" for i in
                                                      range(len(DEFAULT_PROMPTS))])
def test_default_model_fidelity(text, default_model, default_ref, tandem_bin, tmp_path):
    prompt = smollm_tokenizer(str(default_model)).encode(text).ids
    assert 4 <= len(prompt) <= 64
    ours_tokens, ours_logits = tandem_generate(default_model, prompt, N_DEFAULT, tmp_path)
    check_fidelity(default_ref, prompt, ours_logits, ours_tokens,
                   f"default model, {text[:24]!r}")
    # the CPU's default path (quantised activations; see test_quantised_activations)
    _, quant = tandem_generate(default_model, prompt, 1, tmp_path, tag="quant", exact=False)
    err = ref.rel_err(quant, ref.forward(default_ref, prompt)[-1])
    print(f"default model {text[:24]!r} quantised activations: {err:.3g} from the reference")
    assert err <= QUANT_TOL["default"], f"default model, quantised activations: {err:.3g}"
    assert ref.rel_err(quant, ours_logits) > 0, "quantised: the same logits as exact ones"
