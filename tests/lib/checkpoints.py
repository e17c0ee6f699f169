"""Tiny random checkpoints for tests: HF folders (config.json + safetensors) and GGUF files.

Why: the engine is checked against an independent numpy reference (tests/lib/reference.py) on
models small enough to run in milliseconds, yet shaped like the real ones (GQA, several
layers, every weight kind of llama, qwen2 and qwen3), and written the way the real converters
write them, so that the loaders see the same names, layouts and metadata as in the wild.

Both writers draw the same weights from a seed (`random_weights`, HF names and layout,
float64): an HF checkpoint and a GGUF file made with the same seed and shape hold the same model,
up to the storage type. For GGUF llama, Q and K are stored with the row permutation of
llama.cpp's converter, so that GGUF llama runs adjacent-pair rope where HF runs rotate_half;
qwen2/qwen3 GGUF keep HF's order and rope.

Scaling: projections draw N(0, 1/in_features) so activations stay O(1); norm weights are
1 + N(0, 0.1^2); q is drawn a little larger so attention is selective, which makes position
mistakes (rope, masks, cache) show in the logits.

Writers only: nothing here reads a checkpoint back. bf16 safetensors are written through
safetensors' own serializer with a uint16 buffer labelled "bfloat16" (numpy has no bf16), the
float32 values rounded to nearest even. Q6_K and Q4_K have no quantizer in the gguf package, so
`quantize_q6_k` and `quantize_q4_k` pack them here; their layouts are checked by
gguf.quants.dequantize in the tests.
"""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v2",
         "deepseek_v3")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
# mixture-of-experts arches: their attention is their base's
BASE = {"qwen3_moe": "qwen3", "mixtral": "llama", "qwen2_moe": "qwen2"}
# their experts (overridable like any shape key; ignored by dense arches)
MOE_SHAPE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                 decoder_sparse_step=1, mlp_only_layers=(), norm_topk_prob=None,
                 shared_expert_intermediate_size=40)

# DeepSeek-V2/V3 (MLA, and experts from layer first_k_dense_replace on); None: the arch's own
# default (resolve_shape). rope_scaling: None, or the keys of a yarn rope_scaling.
DEEPSEEK_SHAPE = dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16, n_shared_experts=1, first_k_dense_replace=1,
                      moe_layer_freq=1, n_group=None, topk_group=None, topk_method=None,
                      routed_scaling_factor=None, scoring_func=None, rope_scaling=None,
                      num_nextn_predict_layers=0)
YARN_SCALING = dict(type="yarn", factor=4.0, original_max_position_embeddings=64,
                    beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)

# Default shapes; any of these can be overridden through **shape.
DEFAULT_SHAPE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # qwen3 default: 32 (differs from hidden / heads)
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=272,  # 256 byte tokens + merges + <bos> + <eos> (see gguf_vocab)
    max_position_embeddings=512,
    # Larger than real models' (1e-5/1e-6) so that a misread epsilon moves the logits by more
    # than the 1e-4 tolerance; distinct per arch (see resolve_shape).
    rms_norm_eps=1e-3,
    rope_theta=12345.0,  # not 10000, so a loader that ignores it is caught
)

# llama3 rope scaling used for rope="llama3": with head_dim 16 and theta 12345 the wavelengths
# (6.3 .. ~2e4 positions) fall in all three regimes (kept, smoothed, divided by factor).
LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=256)
LINEAR_FACTOR = 2.0


def resolve_shape(arch: str, shape: dict) -> dict:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}")
    s = dict(DEFAULT_SHAPE, **MOE_SHAPE, **DEEPSEEK_SHAPE)
    moe, arch = arch, BASE.get(arch, arch)
    if moe in DEEPSEEK:
        v3 = moe == "deepseek_v3"
        s.update(num_key_value_heads=s["num_attention_heads"], rms_norm_eps=1.5e-3,
                 q_lora_rank=48 if v3 else None, n_group=4 if v3 else 1,
                 topk_group=2 if v3 else 1, topk_method="noaux_tc" if v3 else "greedy",
                 routed_scaling_factor=2.5 if v3 else 1.5,
                 scoring_func="sigmoid" if v3 else "softmax", num_experts=8 if v3 else 4)
    if arch == "qwen3":
        s["head_dim"] = 32
        s["rms_norm_eps"] = 5e-4
    if arch == "qwen2":
        s["rms_norm_eps"] = 2e-3
    unknown = set(shape) - set(DEFAULT_SHAPE) - set(MOE_SHAPE) - set(DEEPSEEK_SHAPE)
    if unknown:
        raise ValueError(f"unknown shape keys {sorted(unknown)}")
    s.update(shape)
    if s["norm_topk_prob"] is None:  # the released configs': qwen2_moe's are not renormalised
        s["norm_topk_prob"] = moe not in ("qwen2_moe", "deepseek_v2")
    if arch in ("llama", "qwen2") and "head_dim" not in shape:
        s["head_dim"] = s["hidden_size"] // s["num_attention_heads"]
    if s["num_attention_heads"] % s["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    return s


def sparse_layer(arch: str, s: dict, i: int) -> bool:
    """Whether layer i has experts (transformers' rule for qwen3_moe; every layer of mixtral)."""
    if arch == "mixtral":
        return True
    if arch in DEEPSEEK:
        return i >= s["first_k_dense_replace"] and i % s["moe_layer_freq"] == 0
    return (arch in ("qwen3_moe", "qwen2_moe") and i not in s["mlp_only_layers"]
            and (i + 1) % s["decoder_sparse_step"] == 0)


def expert_width(arch: str, s: dict) -> int:
    return s["intermediate_size"] if arch == "mixtral" else s["moe_intermediate_size"]


def random_weights(arch: str, seed: int, s: dict, tied: bool) -> dict[str, np.ndarray]:
    """HF-named float64 weights, [out_features, in_features] for matrices; fixed draw order."""
    rng = np.random.default_rng(seed)
    moe_arch, arch = arch, BASE.get(arch, arch)
    d, hd, ff, v = s["hidden_size"], s["head_dim"], s["intermediate_size"], s["vocab_size"]
    nq, nkv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd

    def mat(rows, cols, gain=1.0):
        return rng.standard_normal((rows, cols)) * (gain / math.sqrt(cols))

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    w = {"model.embed_tokens.weight": 0.4 * rng.standard_normal((v, d))}
    if moe_arch in DEEPSEEK:
        return _deepseek_weights(moe_arch, s, tied, w, mat, norm, rng)
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = mat(nq, d, 1.5)
        w[p + "self_attn.k_proj.weight"] = mat(nkv, d)
        w[p + "self_attn.v_proj.weight"] = mat(nkv, d)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = 0.2 * rng.standard_normal(nq)
            w[p + "self_attn.k_proj.bias"] = 0.2 * rng.standard_normal(nkv)
            w[p + "self_attn.v_proj.bias"] = 0.2 * rng.standard_normal(nkv)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "self_attn.o_proj.weight"] = mat(d, nq)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        if not sparse_layer(moe_arch, s, i):
            w[p + "mlp.gate_proj.weight"] = mat(ff, d)
            w[p + "mlp.up_proj.weight"] = mat(ff, d)
            w[p + "mlp.down_proj.weight"] = mat(d, ff)
            continue
        fe, n = expert_width(moe_arch, s), s["num_experts"]
        q = p + ("block_sparse_moe." if moe_arch == "mixtral" else "mlp.")
        names = ("w1", "w3", "w2") if moe_arch == "mixtral" else ("gate_proj", "up_proj",
                                                                    "down_proj")
        w[q + "gate.weight"] = mat(n, d, 3.0)  # spread logits: no near-tied routing
        for e in range(n):
            w[f"{q}experts.{e}.{names[0]}.weight"] = mat(fe, d)
            w[f"{q}experts.{e}.{names[1]}.weight"] = mat(fe, d)
            w[f"{q}experts.{e}.{names[2]}.weight"] = mat(d, fe, 1.5)
        if moe_arch == "qwen2_moe":
            fs = s["shared_expert_intermediate_size"]
            w[q + "shared_expert.gate_proj.weight"] = mat(fs, d)
            w[q + "shared_expert.up_proj.weight"] = mat(fs, d)
            w[q + "shared_expert.down_proj.weight"] = mat(d, fs, 1.5)
            w[q + "shared_expert_gate.weight"] = mat(1, d, 2.0)
    w["model.norm.weight"] = norm(d)
    if not tied:
        w["lm_head.weight"] = mat(v, d, 2.0)
    return w


def fuse_experts(w: dict, n: int) -> dict:
    """Per-expert tensors (mlp.experts.N.{gate,up,down}_proj.weight, or mixtral's
    block_sparse_moe.experts.N.w1/w3/w2) to transformers' fused 3-D pair per layer."""
    out, done = {}, set()
    for name in w:
        for pre, (g, u, dn) in (("mlp.experts.", ("gate_proj", "up_proj", "down_proj")),
                                ("block_sparse_moe.experts.", ("w1", "w3", "w2"))):
            at = name.find(pre)
            if at < 0 or not name.endswith(".weight"):
                continue
            base = name[:at + len(pre)]
            if base not in done:
                done.add(base)
                out[base + "gate_up_proj"] = np.stack([np.concatenate(
                    [w[f"{base}{e}.{g}.weight"], w[f"{base}{e}.{u}.weight"]]) for e in range(n)])
                out[base + "down_proj"] = np.stack([w[f"{base}{e}.{dn}.weight"]
                                                    for e in range(n)])
            break
        else:
            out[name] = w[name]
    return out


def _deepseek_weights(arch, s, tied, w, mat, norm, rng):
    """DeepSeek-V2/V3's HF names: MLA (q directly or through its LoRA, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj), dense layers before first_k_dense_replace, then experts with
    shared ones (and V3's e_score_correction_bias). V3's num_nextn_predict_layers MTP layers
    follow the model's: a decoder layer each, with enorm, hnorm, eh_proj [d, 2d],
    shared_head.norm, and copies of the embedding and the LM head (embed_tokens,
    shared_head.head), as DeepSeek ships them."""
    d, v, H = s["hidden_size"], s["vocab_size"], s["num_attention_heads"]
    nope, rope, lora = s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["kv_lora_rank"]
    vd, ql = s["v_head_dim"], s["q_lora_rank"]
    n_main = s["num_hidden_layers"]
    for i in range(n_main + s["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = norm(d)
        if ql:
            w[a + "q_a_proj.weight"] = mat(ql, d)
            w[a + "q_a_layernorm.weight"] = norm(ql)
            w[a + "q_b_proj.weight"] = mat(H * (nope + rope), ql, 1.5)
        else:
            w[a + "q_proj.weight"] = mat(H * (nope + rope), d, 1.5)
        w[a + "kv_a_proj_with_mqa.weight"] = mat(lora + rope, d)
        w[a + "kv_a_layernorm.weight"] = norm(lora)
        w[a + "kv_b_proj.weight"] = mat(H * (nope + vd), lora)
        w[a + "o_proj.weight"] = mat(d, H * vd)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        q = p + "mlp."
        if not sparse_layer(arch, s, i):
            ff = s["intermediate_size"]
            w[q + "gate_proj.weight"] = mat(ff, d)
            w[q + "up_proj.weight"] = mat(ff, d)
            w[q + "down_proj.weight"] = mat(d, ff)
            continue
        fe, n = s["moe_intermediate_size"], s["num_experts"]
        w[q + "gate.weight"] = mat(n, d, 3.0)
        if arch == "deepseek_v3":
            w[q + "gate.e_score_correction_bias"] = 0.05 * rng.standard_normal(n)
        for e in range(n):
            w[f"{q}experts.{e}.gate_proj.weight"] = mat(fe, d)
            w[f"{q}experts.{e}.up_proj.weight"] = mat(fe, d)
            w[f"{q}experts.{e}.down_proj.weight"] = mat(d, fe, 1.5)
        if s["n_shared_experts"]:
            fs = fe * s["n_shared_experts"]
            w[q + "shared_experts.gate_proj.weight"] = mat(fs, d)
            w[q + "shared_experts.up_proj.weight"] = mat(fs, d)
            w[q + "shared_experts.down_proj.weight"] = mat(d, fs, 1.5)
    w["model.norm.weight"] = norm(d)
    if not tied:
        w["lm_head.weight"] = mat(v, d, 2.0)
    for i in range(n_main, n_main + s["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        w[p + "enorm.weight"] = norm(d)
        w[p + "hnorm.weight"] = norm(d)
        w[p + "eh_proj.weight"] = mat(d, 2 * d)
        w[p + "shared_head.norm.weight"] = norm(d)
        w[p + "embed_tokens.weight"] = w["model.embed_tokens.weight"]
        w[p + "shared_head.head.weight"] = w["model.embed_tokens.weight" if tied
                                             else "lm_head.weight"]
    return w


def _deepseek_config(arch: str, s: dict) -> dict:
    return dict(
        moe_intermediate_size=s["moe_intermediate_size"], n_shared_experts=s["n_shared_experts"],
        n_routed_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
        routed_scaling_factor=s["routed_scaling_factor"], topk_method=s["topk_method"],
        n_group=s["n_group"], topk_group=s["topk_group"], scoring_func=s["scoring_func"],
        norm_topk_prob=s["norm_topk_prob"], first_k_dense_replace=s["first_k_dense_replace"],
        moe_layer_freq=s["moe_layer_freq"], q_lora_rank=s["q_lora_rank"],
        kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"], v_head_dim=s["v_head_dim"],
        attention_bias=False, attention_dropout=0.0, aux_loss_alpha=0.001, ep_size=1,
        seq_aux=True,
        num_nextn_predict_layers=s["num_nextn_predict_layers"] if arch == "deepseek_v3" else None,
        rope_scaling=s["rope_scaling"])


# ---------------------------------------------------------------------------------------------
# HF checkpoints


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even (inputs are finite)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def _write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray], dtype: str) -> int:
    """Writes one safetensors file; returns the bytes of tensor data."""
    from safetensors import TensorSpec, serialize_file

    keep = []
    specs = {}
    total = 0
    for name, arr in tensors.items():
        if dtype == "bfloat16":
            buf = f32_to_bf16_bits(arr.astype(np.float32))
        else:
            buf = np.ascontiguousarray(arr, dtype=np.dtype(dtype))
        keep.append(buf)
        specs[name] = TensorSpec(dtype=dtype, shape=list(arr.shape), data_ptr=buf.ctypes.data,
                                 data_len=buf.nbytes)
        total += buf.nbytes
    serialize_file(specs, str(path), metadata={"format": "pt"})
    del keep
    return total


def _hf_rope_config(rope: str, theta: float) -> dict:
    if rope == "theta":
        return {"rope_theta": theta}
    if rope == "parameters":
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    if rope == "llama3":
        return {"rope_theta": theta, "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}}
    if rope == "llama3_parameters":
        return {"rope_parameters": {"rope_type": "llama3", "rope_theta": theta, **LLAMA3_SCALING}}
    if rope == "linear":
        return {"rope_theta": theta,
                "rope_scaling": {"rope_type": "linear", "factor": LINEAR_FACTOR}}
    raise ValueError(f"unknown rope form {rope!r}")


def make_hf_checkpoint(dir, arch: str, *, dtype: str = "float32", tied: bool = False,
                       sharded: bool = False, seed: int = 0, rope: str = "theta",
                       fused_experts: bool = False, **shape) -> pathlib.Path:
    """Writes a tiny random HF checkpoint folder and returns its path.

    dtype: float32 | bfloat16 | float16. rope: theta (top-level rope_theta) | parameters
    (rope_parameters, default type) | llama3 (rope_theta + rope_scaling llama3) |
    llama3_parameters (rope_parameters with llama3) | linear. sharded: three shards plus
    model.safetensors.index.json. fused_experts: transformers' fused 3-D expert tensors,
    experts.gate_up_proj [n, 2 ff, d] (gate rows, then up) and experts.down_proj [n, d, ff], in
    place of one tensor per expert. No tokenizer files are written.
    """
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unknown dtype {dtype!r}")
    out = pathlib.Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    s = resolve_shape(arch, shape)
    w = random_weights(arch, seed, s, tied)
    if fused_experts:
        w = fuse_experts(w, s["num_experts"])
    v = s["vocab_size"]
    bos, eos = v - 2, v - 1

    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                           "mixtral": "MixtralForCausalLM",
                           "qwen2_moe": "Qwen2MoeForCausalLM",
                           "deepseek_v2": "DeepseekV2ForCausalLM",
                           "deepseek_v3": "DeepseekV3ForCausalLM"}[arch]],
        "model_type": arch,
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"],
        "max_position_embeddings": s["max_position_embeddings"],
        "rms_norm_eps": s["rms_norm_eps"],
        "vocab_size": v,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, head_dim=s["head_dim"],
                   pretraining_tp=1)
    if arch == "mixtral":
        cfg.update(num_local_experts=s["num_experts"],
                   num_experts_per_tok=s["num_experts_per_tok"], sliding_window=None,
                   router_aux_loss_coef=0.02, output_router_logits=False)
    base = BASE.get(arch, arch)  # qwen MoE configs: their base's fields, then the experts'
    if base == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=s["max_position_embeddings"],
                   max_window_layers=s["num_hidden_layers"], attention_dropout=0.0)
    if base == "qwen3":
        cfg.update(head_dim=s["head_dim"], attention_bias=False, use_sliding_window=False,
                   sliding_window=None, max_window_layers=s["num_hidden_layers"],
                   attention_dropout=0.0)
    if arch in ("qwen2_moe", "qwen3_moe"):
        cfg.update(num_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
                   moe_intermediate_size=s["moe_intermediate_size"],
                   norm_topk_prob=s["norm_topk_prob"],
                   decoder_sparse_step=s["decoder_sparse_step"],
                   mlp_only_layers=list(s["mlp_only_layers"]), router_aux_loss_coef=0.001)
    if arch == "qwen2_moe":
        cfg.update(shared_expert_intermediate_size=s["shared_expert_intermediate_size"])
    cfg.update(_hf_rope_config(rope, s["rope_theta"]))
    if arch in DEEPSEEK:
        cfg.update(_deepseek_config(arch, s))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos, "do_sample": True, "temperature": 0.7,
         "top_p": 0.9}, indent=2) + "\n")

    # Clean any files from a previous call so a folder never mixes layouts.
    for old in list(out.glob("model*.safetensors")) + list(out.glob("*.index.json")):
        old.unlink()
    if not sharded:
        _write_safetensors(out / "model.safetensors", w, dtype)
        return out
    names = list(w)
    n_shards = 3
    parts = [names[i::n_shards] for i in range(n_shards)]  # interleaved: layers span shards
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        total += _write_safetensors(out / fname, {n: w[n] for n in part}, dtype)
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------------------------
# GGUF


def byte_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100...."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
            + list(range(ord("\xae"), ord("\xff") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def gguf_vocab(vocab_size: int, extra=()):
    """tokens, token types, merges, bos, eos for a byte-level BPE vocab of vocab_size tokens:
    ids 0..255 are the bytes, then merges of two bytes, then the control tokens of `extra`,
    then <|bos|> and <|eos|>."""
    if vocab_size < 259 + len(extra):
        raise ValueError("gguf vocab needs at least 259 tokens (256 bytes, 1 merge, bos, eos)")
    b2u = byte_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    letters = "etaoinshrdlucmfwyp"
    pairs = [(b2u[ord(" ")], c) for c in letters] + [(a, c) for a in letters for c in letters]
    n_merges = vocab_size - 258 - len(extra)
    if n_merges > len(pairs):
        raise ValueError(f"vocab_size {vocab_size} too large for the tiny gguf vocab")
    merges = [f"{a} {c}" for a, c in pairs[:n_merges]]
    tokens += [a + c for a, c in pairs[:n_merges]]
    tokens += list(extra) + ["<|bos|>", "<|eos|>"]
    types = [1] * (256 + n_merges) + [3] * (len(extra) + 2)  # NORMAL, CONTROL
    return tokens, types, merges, vocab_size - 2, vocab_size - 1


def write_hf_tokenizer(folder, vocab_size: int) -> pathlib.Path:
    """tokenizer.json for a tiny HF checkpoint: gguf_vocab's byte-level BPE, built and saved by
    HF `tokenizers` (so serving a folder has a tokenizer, as a real checkpoint does)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, types, merges, _, _ = gguf_vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens) if types[i] == 1},
                               merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for i, t in enumerate(tokens) if types[i] == 3])
    out = pathlib.Path(folder) / "tokenizer.json"
    tok.save(str(out))
    return out


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows: within each head, rows (j, j + hd/2) of HF's
    rotate_half layout become adjacent rows (2j, 2j+1). Works for weights [rows, cols] and
    biases [rows]."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Packs float rows (a multiple of 256 wide) into Q6_K blocks of 210 bytes:
    ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, one per 16 values), d (f16).
    Element i of a block: h = i // 128, r = i % 128; low nibble of ql[h*64 + r%64] (upper
    nibble when r >= 64); bits 2*(r//32) of qh[h*32 + r%32]; value d * scale[i//16] * (q - 32)."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % 256:
        raise ValueError("Q6_K rows must be a multiple of 256 wide")
    rows = x.reshape(-1, x.shape[-1])
    blocks = rows.reshape(-1, 256).astype(np.float64)
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, 16, 16)
    # per-sub-block scale so that the largest magnitude maps to q = -32 or 31
    amax_idx = np.abs(sub).argmax(axis=-1)
    signed_max = np.take_along_axis(sub, amax_idx[..., None], axis=-1)[..., 0]
    sub_scale = signed_max / -32.0
    max_scale = np.abs(sub_scale).max(axis=-1)
    d = (max_scale / 127.0).astype(np.float16)
    d64 = d.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d64[:, None] > 0, np.round(sub_scale / d64[:, None]), 0.0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    step = d64[:, None] * sc.astype(np.float64)  # [nb, 16]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] != 0, np.round(sub / step[..., None]), 0.0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, 256)

    ql = np.zeros((nb, 128), np.uint8)
    qh = np.zeros((nb, 64), np.uint8)
    i = np.arange(256)
    h, r = i // 128, i % 128
    ql_idx = h * 64 + r % 64
    ql_shift = np.where(r >= 64, 4, 0).astype(np.uint8)
    qh_idx = h * 32 + r % 32
    qh_shift = (2 * (r // 32)).astype(np.uint8)
    for k in range(256):
        ql[:, ql_idx[k]] |= (q[:, k] & 0x0F) << ql_shift[k]
        qh[:, qh_idx[k]] |= (q[:, k] >> 4) << qh_shift[k]
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(nb, 1).view(np.uint8)], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 256 * 210)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Packs float rows (a multiple of 256 wide) into Q4_K blocks of 144 bytes: d, dmin (f16),
    scales[12] (eight 6-bit scales and eight 6-bit mins: for j < 4 scale j in the low 6 bits of
    byte j and min j in byte j + 4; for j >= 4 their low 4 bits in byte j + 4 (scale low
    nibble, min high nibble) and their top 2 bits in the top bits of bytes j - 4 and j), qs[128]
    (element 64c + l is the low nibble of qs[32c + l], element 64c + 32 + l its high nibble);
    value d * sc[i // 32] * q - dmin * m[i // 32]."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % 256:
        raise ValueError("Q4_K rows must be a multiple of 256 wide")
    blocks = x.reshape(-1, 256).astype(np.float64)
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # [nb, 8]: the sub-block's minimum, <= 0
    scale = (sub.max(axis=-1) - lo) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(axis=-1) / 63.0).astype(np.float16)
    d64, dmin64 = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d64 > 0, np.round(scale / d64), 0.0)
        mn = np.where(dmin64 > 0, np.round(-lo / dmin64), 0.0)
    sc = np.clip(sc, 0, 63).astype(np.uint8)
    mn = np.clip(mn, 0, 63).astype(np.uint8)
    step = d64 * sc  # [nb, 8]
    off = dmin64 * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.round((sub + off[..., None]) / step[..., None]), 0.0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(nb, 4, 2, 32)
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(nb, 128)
    scales = np.zeros((nb, 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4]
    scales[:, 4:8] = mn[:, 0:4]
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    scales[:, 0:4] |= (sc[:, 4:8] >> 4) << 6
    scales[:, 4:8] |= (mn[:, 4:8] >> 4) << 6
    out = np.concatenate([d.reshape(nb, 1).view(np.uint8), dmin.reshape(nb, 1).view(np.uint8),
                          scales, qs], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 256 * 144)


# "Q4_K_M": llama.cpp's mix, Q4_K matrices with the embedding / LM head and ffn_down in Q6_K
GGUF_WTYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q6_K", "Q4_K", "Q4_K_M")


def _gguf_matrix(arr: np.ndarray, wtype: str):
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    import gguf

    a32 = np.ascontiguousarray(arr, dtype=np.float32)
    if wtype == "F32":
        return a32, None
    if wtype == "F16":
        return a32.astype(np.float16), None
    qt = gguf.GGMLQuantizationType[wtype]
    if wtype == "Q6_K":
        return quantize_q6_k(a32), qt
    if wtype == "Q4_K":
        return quantize_q4_k(a32), qt
    return gguf.quants.quantize(a32, qt), qt


def make_gguf_checkpoint(path, arch: str, *, wtype: str = "F32", seed: int = 0, tied: bool = True,
                         rope_freqs: bool = False, extra_tokens=(), kv_b_split: bool = False,
                         **shape) -> pathlib.Path:
    """Writes a tiny random GGUF model (llama.cpp conventions) and returns its path.

    2-D matrices (embedding included) are stored as `wtype`; norms and biases F32. llama's Q/K
    are permuted as llama.cpp's converter does. rope_freqs=True adds a llama3-style
    rope_freqs.weight tensor (per-frequency divisors, see LLAMA3_SCALING). extra_tokens: control
    tokens added to the vocabulary before bos and eos (gguf_vocab). Q6_K, Q4_K and Q4_K_M
    need hidden_size and intermediate_size multiples of 256.
    """
    import gguf

    if wtype not in GGUF_WTYPES:
        raise ValueError(f"unknown wtype {wtype!r}")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    s = resolve_shape(arch, shape)
    w = random_weights(arch, seed, s, tied)
    nh, nkv, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    moe_arch = arch
    if arch in ("qwen3_moe", "qwen2_moe") and (s["mlp_only_layers"] or
                                               s["decoder_sparse_step"] != 1 or
                                               s["norm_topk_prob"] != (arch == "qwen3_moe")):
        raise ValueError("llama.cpp's qwen3moe and qwen2moe have experts in every layer, "
                         "renormalised for qwen3moe, not for qwen2moe")
    garch = {"qwen3_moe": "qwen3moe", "mixtral": "llama",
             "qwen2_moe": "qwen2moe", "deepseek_v2": "deepseek2",
             "deepseek_v3": "deepseek2"}.get(arch, arch)
    arch = BASE.get(arch, arch)

    wr = gguf.GGUFWriter(str(path), garch)
    if moe_arch in DEEPSEEK:
        if s["topk_method"] == "group_limited_greedy":
            raise ValueError("llama.cpp scores expert groups by their best two (V3's rule)")
        _gguf_deepseek_keys(wr, s, kv_b_split)
    wr.add_name(f"tiny-{arch}-{wtype}")
    wr.add_block_count(s["num_hidden_layers"])
    wr.add_context_length(s["max_position_embeddings"])
    wr.add_embedding_length(s["hidden_size"])
    wr.add_feed_forward_length(s["intermediate_size"])
    wr.add_head_count(nh)
    if moe_arch not in DEEPSEEK:
        wr.add_head_count_kv(nkv)
    if moe_arch in DEEPSEEK:
        pass
    elif arch == "qwen3" or hd != s["hidden_size"] // nh:
        wr.add_key_length(hd)
        wr.add_value_length(hd)
    wr.add_layer_norm_rms_eps(s["rms_norm_eps"])
    wr.add_rope_freq_base(s["rope_theta"])
    if moe_arch not in DEEPSEEK:
        wr.add_rope_dimension_count(hd)
    wr.add_vocab_size(s["vocab_size"])
    if moe_arch in BASE and moe_arch not in DEEPSEEK:
        wr.add_expert_count(s["num_experts"])
        wr.add_expert_used_count(s["num_experts_per_tok"])
        if moe_arch in ("qwen3_moe", "qwen2_moe"):
            wr.add_expert_feed_forward_length(s["moe_intermediate_size"])
        if moe_arch == "qwen2_moe":
            wr.add_expert_shared_feed_forward_length(s["shared_expert_intermediate_size"])
    wr.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q6_K": 18,
                      "Q4_K": 14, "Q4_K_M": 15}[wtype])
    wr.add_quantization_version(2)
    tokens, types, merges, bos, eos = gguf_vocab(s["vocab_size"], extra_tokens)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(bos)
    wr.add_eos_token_id(eos)
    wr.add_add_bos_token(False)

    def mat(name, arr):
        t = wtype
        if wtype == "Q4_K_M":
            t = "Q6_K" if name in ("token_embd.weight", "output.weight") or "ffn_down" in name \
                else "Q4_K"
        data, raw = _gguf_matrix(arr, t)
        wr.add_tensor(name, data, raw_dtype=raw)

    def vec(name, arr):
        wr.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))

    mat("token_embd.weight", w["model.embed_tokens.weight"])
    if moe_arch in DEEPSEEK:
        _gguf_deepseek_tensors(s, w, moe_arch, mat, vec, kv_b_split)
    if rope_freqs:
        vec("rope_freqs.weight", llama3_rope_factors(s["rope_theta"], hd))
    for i in range(0 if moe_arch in DEEPSEEK else s["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q = w[p + "self_attn.q_proj.weight"]
        k = w[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = llama_permute(q, nh), llama_permute(k, nkv)
        vec(b + "attn_norm.weight", w[p + "input_layernorm.weight"])
        mat(b + "attn_q.weight", q)
        mat(b + "attn_k.weight", k)
        mat(b + "attn_v.weight", w[p + "self_attn.v_proj.weight"])
        if arch == "qwen2":
            vec(b + "attn_q.bias", w[p + "self_attn.q_proj.bias"])
            vec(b + "attn_k.bias", w[p + "self_attn.k_proj.bias"])
            vec(b + "attn_v.bias", w[p + "self_attn.v_proj.bias"])
        if arch == "qwen3":
            vec(b + "attn_q_norm.weight", w[p + "self_attn.q_norm.weight"])
            vec(b + "attn_k_norm.weight", w[p + "self_attn.k_norm.weight"])
        mat(b + "attn_output.weight", w[p + "self_attn.o_proj.weight"])
        vec(b + "ffn_norm.weight", w[p + "post_attention_layernorm.weight"])
        if sparse_layer(moe_arch, s, i):  # llama.cpp's stacked [n_experts, rows, cols]
            q = p + ("block_sparse_moe." if moe_arch == "mixtral" else "mlp.")
            names = (("w1", "w3", "w2") if moe_arch == "mixtral"
                     else ("gate_proj", "up_proj", "down_proj"))
            mat(b + "ffn_gate_inp.weight", w[q + "gate.weight"])
            for k, name in zip(("gate", "up", "down"), names):
                mat(f"{b}ffn_{k}_exps.weight", np.stack(
                    [w[f"{q}experts.{e}.{name}.weight"] for e in range(s["num_experts"])]))
            if moe_arch == "qwen2_moe":
                for k in ("gate", "up", "down"):
                    mat(f"{b}ffn_{k}_shexp.weight", w[f"{q}shared_expert.{k}_proj.weight"])
                vec(b + "ffn_gate_inp_shexp.weight", w[q + "shared_expert_gate.weight"][0])
            continue
        mat(b + "ffn_gate.weight", w[p + "mlp.gate_proj.weight"])
        mat(b + "ffn_up.weight", w[p + "mlp.up_proj.weight"])
        mat(b + "ffn_down.weight", w[p + "mlp.down_proj.weight"])
    vec("output_norm.weight", w["model.norm.weight"])
    if not tied:
        mat("output.weight", w["lm_head.weight"])

    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def _gguf_deepseek_keys(wr, s, kv_b_split):
    """llama.cpp's deepseek2 metadata for a DeepSeek shape."""
    import gguf

    nope, rope, lora, vd = (s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["kv_lora_rank"],
                            s["v_head_dim"])
    if s["q_lora_rank"]:
        wr.add_q_lora_rank(s["q_lora_rank"])
    wr.add_kv_lora_rank(lora)
    if kv_b_split:  # the latent is the one head; the heads' widths in the _mla keys
        wr.add_head_count_kv(1)
        wr.add_key_length(lora + rope)
        wr.add_value_length(lora)
        wr.add_key_length_mla(nope + rope)
        wr.add_value_length_mla(vd)
    else:
        wr.add_head_count_kv(s["num_attention_heads"])
        wr.add_key_length(nope + rope)
        wr.add_value_length(vd)
    wr.add_rope_dimension_count(rope)
    wr.add_leading_dense_block_count(s["first_k_dense_replace"])
    wr.add_expert_count(s["num_experts"])
    wr.add_expert_used_count(s["num_experts_per_tok"])
    wr.add_expert_feed_forward_length(s["moe_intermediate_size"])
    wr.add_expert_shared_count(s["n_shared_experts"])
    wr.add_expert_weights_scale(float(s["routed_scaling_factor"]))
    wr.add_expert_weights_norm(bool(s["norm_topk_prob"]))
    wr.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if s["scoring_func"] == "sigmoid"
                              else gguf.ExpertGatingFuncType.SOFTMAX)
    if s["topk_method"] == "noaux_tc":
        wr.add_expert_group_count(s["n_group"])
        wr.add_expert_group_used_count(s["topk_group"])
    y = s["rope_scaling"]
    if y:
        if y["mscale"] != y["mscale_all_dim"]:
            raise ValueError("llama.cpp's deepseek2 has no yarn rotation magnitude")
        wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        wr.add_rope_scaling_factor(y["factor"])
        wr.add_rope_scaling_orig_ctx_len(y["original_max_position_embeddings"])
        wr.add_rope_scaling_yarn_log_mul(0.1 * y["mscale_all_dim"])


def _gguf_deepseek_tensors(s, w, arch, mat, vec, kv_b_split):
    """deepseek2's tensors (llama.cpp's names; no Q/K permutation: its rope is interleaved)."""
    H, nope, vd, lora = (s["num_attention_heads"], s["qk_nope_head_dim"], s["v_head_dim"],
                         s["kv_lora_rank"])
    for i in range(s["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        a = p + "self_attn."
        vec(b + "attn_norm.weight", w[p + "input_layernorm.weight"])
        if s["q_lora_rank"]:
            mat(b + "attn_q_a.weight", w[a + "q_a_proj.weight"])
            vec(b + "attn_q_a_norm.weight", w[a + "q_a_layernorm.weight"])
            mat(b + "attn_q_b.weight", w[a + "q_b_proj.weight"])
        else:
            mat(b + "attn_q.weight", w[a + "q_proj.weight"])
        mat(b + "attn_kv_a_mqa.weight", w[a + "kv_a_proj_with_mqa.weight"])
        vec(b + "attn_kv_a_norm.weight", w[a + "kv_a_layernorm.weight"])
        kvb = w[a + "kv_b_proj.weight"]
        if kv_b_split:  # convert_hf_to_gguf: k_b [H, lora, nope] (transposed), v_b [H, v, lora]
            kvb3 = kvb.reshape(H, nope + vd, lora)
            mat(b + "attn_k_b.weight", np.ascontiguousarray(kvb3[:, :nope, :].transpose(0, 2, 1)))
            mat(b + "attn_v_b.weight", np.ascontiguousarray(kvb3[:, nope:, :]))
        else:
            mat(b + "attn_kv_b.weight", kvb)
        mat(b + "attn_output.weight", w[a + "o_proj.weight"])
        vec(b + "ffn_norm.weight", w[p + "post_attention_layernorm.weight"])
        q = p + "mlp."
        if not sparse_layer(arch, s, i):
            for k in ("gate", "up", "down"):
                mat(f"{b}ffn_{k}.weight", w[f"{q}{k}_proj.weight"])
            continue
        mat(b + "ffn_gate_inp.weight", w[q + "gate.weight"])
        if q + "gate.e_score_correction_bias" in w:
            vec(b + "exp_probs_b.bias", w[q + "gate.e_score_correction_bias"])
        for k in ("gate", "up", "down"):
            mat(f"{b}ffn_{k}_exps.weight", np.stack(
                [w[f"{q}experts.{e}.{k}_proj.weight"] for e in range(s["num_experts"])]))
            if s["n_shared_experts"]:
                mat(f"{b}ffn_{k}_shexp.weight", w[f"{q}shared_experts.{k}_proj.weight"])


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict = LLAMA3_SCALING) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for llama3 scaling: the divisor of each frequency."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old = scaling["original_max_position_embeddings"]
    lo, hi, f = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    wavelen = 2 * math.pi / inv
    out = np.ones_like(inv)
    for i, wl in enumerate(wavelen):
        if wl < old / hi:
            out[i] = 1.0
        elif wl > old / lo:
            out[i] = f
        else:
            smooth = (old / wl - lo) / (hi - lo)
            out[i] = 1.0 / ((1 - smooth) / f + smooth)
    return out.astype(np.float32)


__all__ = ["write_hf_tokenizer", "fuse_experts", "make_hf_checkpoint", "make_gguf_checkpoint", "random_weights", "resolve_shape",
           "llama_permute", "quantize_q6_k", "gguf_vocab", "byte_to_unicode", "f32_to_bf16_bits",
           "llama3_rope_factors", "LLAMA3_SCALING", "LINEAR_FACTOR", "GGUF_WTYPES", "ARCHS"]

