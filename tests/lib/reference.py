"""Independent numpy reference forward pass for llama, qwen2 and qwen3 decoders.

Why: tandem's engine must match the model definitions (HF LlamaForCausalLM / Qwen2ForCausalLM /
Qwen3ForCausalLM, and llama.cpp's reading of the same models from GGUF) within 1e-4 relative on
logits. This module restates those definitions in plain numpy, written from the papers and
model cards, and reads weights only through the `gguf` package (GGUFReader +
gguf.quants.dequantize) or the `safetensors` package, never through tandem's C code, so that a
shared mistake cannot hide.

Precision: everything is computed in float64 (weights are dequantised/converted to float64 once
at load; rope angles, norms, softmax and accumulation are float64). The reference's own rounding
is then ~1e-15 relative, negligible against the 1e-4 bound the engine is held to, so a failure
measures the engine's error alone. The stored weights are exact (f32/f16/bf16 values, or the
dequantised blocks), so quantisation is part of the model, not of the error.

Model, one layer (x: [T, d_model], positions p):
    h = rmsnorm(x, attn_norm)                     rmsnorm(x, w) = x / sqrt(mean(x^2) + eps) * w
    q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)        (biases: qwen2)
    q, k = rmsnorm per head (q_norm, k_norm)                   (qwen3)
    q, k = rope(q, p), rope(k, p)
    a = softmax(q k^T / sqrt(head_dim) + causal mask) v        (GQA: head h reads kv head
                                                                h // (n_heads / n_kv_heads))
    x = x + a Wo^T
    h = rmsnorm(x, ffn_norm)
    x = x + (silu(h Wgate^T) * (h Wup^T)) Wdown^T
      or, in a mixture-of-experts layer (qwen3_moe, mixtral; GGUF qwen3moe, llama with experts):
    p = softmax(h Wr^T) over the experts; keep each row's k largest (renormalised to sum 1 when
    norm_topk_prob, always for mixtral, and in GGUF files but qwen2moe's unless they say
    expert_weights_norm); x = x + sum over kept e of p_e FFN_e(h)
    (+ sigmoid(h . score) FFN_shared(h) with qwen2_moe's shared expert)
then logits = rmsnorm(x, output_norm) Wout^T, Wout = token embedding when tied.

DeepSeek-V2/V3 (HF deepseek_v2/deepseek_v3, GGUF deepseek2), written from their modeling
files in the naive (not absorbed) form:
    q = h Wq^T, or (rmsnorm(h Wq_a^T, q_a_norm)) Wq_b^T;  per head [q_nope | q_rope]
    [c | k_rope] = h Wkv_a^T ; c = rmsnorm(c, kv_a_norm)  (one k_rope shared by every head)
    [k_nope | v] = c Wkv_b^T per head ; q_rope, k_rope rotated (interleaved pairs)
    a = softmax([q_nope|q_rope] . [k_nope|k_rope] * scale) v ; x += a Wo^T
  scale = 1/sqrt(nope + rope), times mscale(factor, mscale_all_dim)^2 under YaRN, whose
  frequencies blend f and f/factor along a linear ramp between two correction dimensions
  and whose cos and sin are multiplied by mscale(factor, mscale)/mscale(factor, mscale_all_dim),
  mscale(f, m) = 0.1 m ln f + 1. The cache keeps c and the rotated k_rope per position.
  Experts: scores softmax(z) or sigmoid(z); choice by score (+ e_score_correction_bias) among
  the topk_group best of n_group groups (a group's worth: its best, or for V3 the sum of its
  best two; llama.cpp: always the best two), the others excluded; weights = chosen scores,
  renormalised when norm_topk_prob, times routed_scaling_factor (V2's modeling: only when it
  does not renormalise); shared experts added unscaled. Layers before first_k_dense_replace
  (and those off moe_layer_freq) are dense.

Rope: inv_freq_i = theta^(-2i/head_dim), angle = p * inv_freq_i, with llama3 or linear scaling
from config.json, or divided by GGUF's rope_freqs.weight when present. HF checkpoints and
qwen2/qwen3 GGUF rotate pairs (i, i + head_dim/2) (rotate_half); llama GGUF rotates adjacent
pairs (2i, 2i+1), because llama.cpp's converter permuted the Q/K rows to match.

API: load(path) -> Model; forward(model, tokens) -> logits [T, vocab] float64;
greedy(model, prompt, n) -> list[int] (prefill, then one token at a time against a KV cache);
Session for incremental use. Not thread-safe per Session; a Model is read-only.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import pathlib

import numpy as np

ARCHS = ("llama", "qwen2", "qwen3")
HF_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "mixtral": "llama", "qwen3_moe": "qwen3", "qwen2_moe": "qwen2",
            "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3",
              "qwen2moe": "qwen2", "deepseek2": "deepseek2"}


def _limit_blas_threads(n: int) -> bool:
    """Sets numpy's bundled OpenBLAS to n threads. On the shared 2-core machines that run the
    suite, threaded OpenBLAS spin-waits against the other processes and runs the default model
    ~5x slower than one thread. Honours an explicit OPENBLAS_NUM_THREADS. False if not found."""
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        return False
    import ctypes

    libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for so in glob.glob(os.path.join(libdir, "libscipy_openblas*.so")):
        lib = ctypes.CDLL(so)  # the copy numpy already loaded: dlopen returns the same handle
        for sym in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                    "openblas_set_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                return True
    return False


_limit_blas_threads(int(os.environ.get("TANDEM_REF_THREADS", "1")))


@dataclasses.dataclass
class Layer:
    attn_norm: np.ndarray  # [d_model]
    wq: np.ndarray  # [n_heads*head_dim, d_model]
    wk: np.ndarray  # [n_kv_heads*head_dim, d_model]
    wv: np.ndarray  # [n_kv_heads*head_dim, d_model]
    wo: np.ndarray  # [d_model, n_heads*head_dim]
    ffn_norm: np.ndarray  # [d_model]
    w_gate: np.ndarray  # [d_ff, d_model]
    w_up: np.ndarray  # [d_ff, d_model]
    w_down: np.ndarray  # [d_model, d_ff]
    bq: np.ndarray | None = None  # qwen2
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # qwen3 [head_dim]
    k_norm: np.ndarray | None = None
    router: np.ndarray | None = None  # experts: [n_experts, d_model]; w_gate etc. None then
    experts: list | None = None  # [(gate [ff, d], up [ff, d], down [d, ff])] per expert
    shared: tuple | None = None  # (gate, up, down, score [d] or None) of the shared expert
    # MLA (DeepSeek): q_a / q_a_norm / q_b or wq; kv_a [lora + rope, d]; kv_a_norm; kv_b
    # [H (nope + v), lora]; router_bias [n_experts] (V3)
    wq_a: np.ndarray | None = None
    q_a_norm: np.ndarray | None = None
    wq_b: np.ndarray | None = None
    wkv_a: np.ndarray | None = None
    kv_a_norm: np.ndarray | None = None
    wkv_b: np.ndarray | None = None
    router_bias: np.ndarray | None = None


@dataclasses.dataclass
class Model:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    inv_freq: np.ndarray  # [head_dim/2] float64, scaling already applied
    rope_neox: bool  # True: pairs (i, i+hd/2); False: adjacent pairs (2i, 2i+1)
    embed: np.ndarray  # [vocab, d_model]
    layers: list
    out_norm: np.ndarray  # [d_model]
    lm_head: np.ndarray  # [vocab, d_model] (the embedding itself when tied)
    tied: bool
    bos_id: int | None = None
    eos_id: int | None = None
    source: str = ""
    experts_used: int = 0  # experts a token takes (mixture of experts)
    norm_topk: bool = False  # renormalise the kept probabilities to sum 1
    sigmoid: bool = False  # DeepSeek-V3's scores
    n_group: int = 0  # expert groups (0: none)
    topk_group: int = 0
    group_top2: bool = False  # a group's worth: its best two (else its best)
    routed_scale: float = 1.0
    mla: tuple | None = None  # (q_lora, kv_lora, nope, rope, v) of DeepSeek's attention
    rope_mscale: float = 1.0  # cos and sin times this (YaRN)
    attn_scale: float = 1.0  # the softmax scale's factor


# ---------------------------------------------------------------------------------------------
# rope frequencies


def rope_inv_freq(theta: float, head_dim: int, scaling: dict | None = None) -> np.ndarray:
    """inv_freq_i = theta^(-2i/hd), then HF's scaling rules (llama3, linear) if given."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "yarn":  # DeepSeek's yarn_find_correction_range and linear ramp
        factor = float(scaling["factor"])
        old = float(scaling["original_max_position_embeddings"])

        def dim_of(rot):
            return head_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))
        lo = max(math.floor(dim_of(float(scaling.get("beta_fast", 32)))), 0)
        hi = min(math.ceil(dim_of(float(scaling.get("beta_slow", 1)))), head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        keep = 1.0 - ramp
        return inv / factor * (1 - keep) + inv * keep
    if kind == "llama3":
        factor = float(scaling["factor"])
        lo = float(scaling["low_freq_factor"])
        hi = float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > old / lo, inv / factor, inv)  # long waves: slowed by factor
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return np.where(medium, blended, out)
    raise NotImplementedError(f"rope scaling {kind!r}")


# ---------------------------------------------------------------------------------------------
# loading


def _f64(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float64))


def _read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of one file as float64, parsed by the safetensors package. numpy has no
    bfloat16, so BF16 comes back as raw bytes and is widened here (bits << 16)."""
    from safetensors import deserialize

    out = {}
    for name, t in deserialize(path.read_bytes()):
        dt, shape, raw = t["dtype"], t["shape"], bytes(t["data"])
        if dt == "F32":
            a = np.frombuffer(raw, dtype="<f4")
        elif dt == "F16":
            a = np.frombuffer(raw, dtype="<f2")
        elif dt == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise NotImplementedError(f"{path}: tensor {name} dtype {dt}")
        out[name] = _f64(a.reshape(shape))
    return out


def _load_hf(folder: pathlib.Path) -> Model:
    cfg = json.loads((folder / "config.json").read_text())
    model_type = cfg.get("model_type")
    if model_type not in HF_TYPES:
        raise NotImplementedError(f"model_type {model_type!r}")
    arch = HF_TYPES[model_type]
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    w: dict[str, np.ndarray] = {}
    for f in files:
        w.update(_read_safetensors(folder / f))

    if arch == "deepseek2":
        return _load_hf_deepseek(folder, cfg, w)
    d = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim") or d // nh
    rp = cfg.get("rope_parameters")
    if rp is not None:
        theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = rp
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
    tied = bool(cfg.get("tie_word_embeddings", False))
    n_experts = cfg.get("num_local_experts" if model_type == "mixtral" else "num_experts", 0)
    used = cfg.get("num_experts_per_tok", 0)
    norm_topk = model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False))
    step = cfg.get("decoder_sparse_step", 1)
    only = set(cfg.get("mlp_only_layers") or [])

    def ffn(p, i):
        """(w_gate, w_up, w_down, router, experts) of layer i (HF modeling files' rule for
        which layers are sparse)."""
        if not n_experts or i in only or (i + 1) % step:
            return (w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                    w[p + "mlp.down_proj.weight"], None, None)
        q = p + ("block_sparse_moe." if model_type == "mixtral" else "mlp.")
        if q + "experts.gate_up_proj" in w:  # transformers' fused [n, 2 ff, d] and [n, d, ff]
            gu, dn = w[q + "experts.gate_up_proj"], w[q + "experts.down_proj"]
            ff = gu.shape[1] // 2
            return (None, None, None, w[q + "gate.weight"],
                    [(gu[e, :ff], gu[e, ff:], dn[e]) for e in range(n_experts)])
        if model_type == "mixtral":
            q = p + "block_sparse_moe."
            return (None, None, None, w[q + "gate.weight"],
                    [(w[f"{q}experts.{e}.w1.weight"], w[f"{q}experts.{e}.w3.weight"],
                      w[f"{q}experts.{e}.w2.weight"]) for e in range(n_experts)])
        q = p + "mlp."
        return (None, None, None, w[q + "gate.weight"],
                [(w[f"{q}experts.{e}.gate_proj.weight"], w[f"{q}experts.{e}.up_proj.weight"],
                  w[f"{q}experts.{e}.down_proj.weight"]) for e in range(n_experts)])

    def shared(p, experts):
        q = p + "mlp.shared_expert"
        if experts is None or q + ".gate_proj.weight" not in w:
            return None
        return (w[q + ".gate_proj.weight"], w[q + ".up_proj.weight"], w[q + ".down_proj.weight"],
                w[q + "_gate.weight"].reshape(-1))

    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        g, u, dn, router, experts = ffn(p, i)
        layers.append(Layer(
            attn_norm=w[p + "input_layernorm.weight"],
            wq=w[p + "self_attn.q_proj.weight"], wk=w[p + "self_attn.k_proj.weight"],
            wv=w[p + "self_attn.v_proj.weight"], wo=w[p + "self_attn.o_proj.weight"],
            ffn_norm=w[p + "post_attention_layernorm.weight"],
            w_gate=g, w_up=u, w_down=dn, router=router, experts=experts,
            shared=shared(p, experts),
            bq=w.get(p + "self_attn.q_proj.bias"), bk=w.get(p + "self_attn.k_proj.bias"),
            bv=w.get(p + "self_attn.v_proj.bias"),
            q_norm=w.get(p + "self_attn.q_norm.weight"),
            k_norm=w.get(p + "self_attn.k_norm.weight")))
        if arch == "qwen2" and layers[-1].bq is None:
            raise ValueError("qwen2 checkpoint without q/k/v biases")
        if arch == "qwen3" and layers[-1].q_norm is None:
            raise ValueError("qwen3 checkpoint without q_norm/k_norm")
    embed = w["model.embed_tokens.weight"]
    lm_head = embed if tied else w["lm_head.weight"]
    eos = cfg.get("eos_token_id")
    return Model(arch=arch, n_layers=len(layers), d_model=d, n_heads=nh, n_kv_heads=nkv,
                 head_dim=hd, d_ff=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                 rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                 inv_freq=rope_inv_freq(theta, hd, scaling), rope_neox=True, embed=embed,
                 layers=layers, out_norm=w["model.norm.weight"], lm_head=lm_head, tied=tied,
                 bos_id=cfg.get("bos_token_id"),
                 eos_id=eos[0] if isinstance(eos, list) else eos, source=str(folder),
                 experts_used=used if n_experts else 0, norm_topk=norm_topk)


def _yarn_mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _deepseek_layer(w, cfg, i, n_experts) -> Layer:
    """Layer i of a DeepSeek folder (a model layer, or an MTP layer after them)."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    q = p + "mlp."
    sparse = (n_experts and i >= cfg.get("first_k_dense_replace", 0)
              and i % cfg.get("moe_layer_freq", 1) == 0)
    L = Layer(attn_norm=w[p + "input_layernorm.weight"], wq=w.get(a + "q_proj.weight"),
              wk=None, wv=None, wo=w[a + "o_proj.weight"],
              ffn_norm=w[p + "post_attention_layernorm.weight"], w_gate=None, w_up=None,
              w_down=None, wq_a=w.get(a + "q_a_proj.weight"),
              q_a_norm=w.get(a + "q_a_layernorm.weight"), wq_b=w.get(a + "q_b_proj.weight"),
              wkv_a=w[a + "kv_a_proj_with_mqa.weight"],
              kv_a_norm=w[a + "kv_a_layernorm.weight"], wkv_b=w[a + "kv_b_proj.weight"])
    if not sparse:
        L.w_gate, L.w_up, L.w_down = (w[q + "gate_proj.weight"], w[q + "up_proj.weight"],
                                      w[q + "down_proj.weight"])
        return L
    L.router = w[q + "gate.weight"]
    L.router_bias = w.get(q + "gate.e_score_correction_bias")
    L.experts = [(w[f"{q}experts.{e}.gate_proj.weight"], w[f"{q}experts.{e}.up_proj.weight"],
                  w[f"{q}experts.{e}.down_proj.weight"]) for e in range(n_experts)]
    if q + "shared_experts.gate_proj.weight" in w:
        L.shared = tuple(w[f"{q}shared_experts.{k}_proj.weight"]
                         for k in ("gate", "up", "down")) + (None,)
    return L


def load_mtp_head(folder) -> "Head":
    """DeepSeek-V3's first MTP layer, stored after the model's layers in its folder, as a Head
    over the model (model = load(folder)): eh_proj over [enorm(embed), hnorm(h)], the layer,
    shared_head.norm; the LM head is the model's."""
    folder = pathlib.Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    w: dict[str, np.ndarray] = {}
    for f in files:
        w.update(_read_safetensors(folder / f))
    i = cfg["num_hidden_layers"]
    p = f"model.layers.{i}."
    return Head(fc=w[p + "eh_proj.weight"],
                layer=_deepseek_layer(w, cfg, i, cfg.get("n_routed_experts") or 0),
                enorm=w[p + "enorm.weight"], hnorm=w[p + "hnorm.weight"],
                norm=w[p + "shared_head.norm.weight"])


def _load_hf_deepseek(folder, cfg, w) -> Model:
    d, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    v3 = cfg["model_type"] == "deepseek_v3"
    mla = (cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
           cfg["qk_rope_head_dim"], cfg["v_head_dim"])
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    mscale, attn = 1.0, 1.0
    if scaling and scaling.get("type", scaling.get("rope_type")) == "yarn":
        f = float(scaling["factor"])
        m_all = float(scaling.get("mscale_all_dim", 0) or 0)
        mscale = _yarn_mscale(f, float(scaling.get("mscale", 1))) / _yarn_mscale(f, m_all)
        if m_all:
            attn = _yarn_mscale(f, m_all) ** 2
    n_experts = cfg.get("n_routed_experts") or 0
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    norm_topk = bool(cfg.get("norm_topk_prob", False))
    scale = float(cfg.get("routed_scaling_factor", 1.0))
    if not v3 and norm_topk:
        scale = 1.0
    layers = [_deepseek_layer(w, cfg, i, n_experts) for i in range(cfg["num_hidden_layers"])]
    embed = w["model.embed_tokens.weight"]
    tied = bool(cfg.get("tie_word_embeddings", False))
    eos = cfg.get("eos_token_id")
    groups = method != "greedy" and (cfg.get("n_group") or 1) > 1
    return Model(arch="deepseek2", n_layers=len(layers), d_model=d, n_heads=nh, n_kv_heads=1,
                 head_dim=mla[1] + mla[3], d_ff=cfg["intermediate_size"],
                 vocab_size=cfg["vocab_size"], rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                 rope_theta=theta, inv_freq=rope_inv_freq(theta, mla[3], scaling),
                 rope_neox=False, embed=embed, layers=layers, out_norm=w["model.norm.weight"],
                 lm_head=embed if tied else w["lm_head.weight"], tied=tied,
                 bos_id=cfg.get("bos_token_id"), eos_id=eos[0] if isinstance(eos, list) else eos,
                 source=str(folder), experts_used=cfg.get("num_experts_per_tok", 0) if n_experts
                 else 0, norm_topk=norm_topk, sigmoid=cfg.get("scoring_func", "sigmoid" if v3
                                                               else "softmax") == "sigmoid",
                 n_group=cfg["n_group"] if groups else 0,
                 topk_group=cfg["topk_group"] if groups else 0,
                 group_top2=method == "noaux_tc", routed_scale=scale, mla=mla,
                 rope_mscale=mscale, attn_scale=attn)


def _load_gguf_deepseek(path, r, kv, tensors) -> Model:
    g = "deepseek2"
    d, nh = int(kv(f"{g}.embedding_length")), int(kv(f"{g}.attention.head_count"))
    rope = int(kv(f"{g}.rope.dimension_count"))
    lora = int(kv(f"{g}.attention.kv_lora_rank"))
    qk = int(kv(f"{g}.attention.key_length_mla", kv(f"{g}.attention.key_length")))
    vd = int(kv(f"{g}.attention.value_length_mla", kv(f"{g}.attention.value_length")))
    nope = qk - rope
    mla = (int(kv(f"{g}.attention.q_lora_rank", 0)), lora, nope, rope, vd)
    theta = float(kv(f"{g}.rope.freq_base", 10000.0))
    scaling, attn = None, 1.0
    if kv(f"{g}.rope.scaling.type") == "yarn":
        f = float(kv(f"{g}.rope.scaling.factor"))
        scaling = {"type": "yarn", "factor": f,
                   "original_max_position_embeddings": kv(f"{g}.rope.scaling.original_context_length"),
                   "beta_fast": kv(f"{g}.rope.scaling.yarn_beta_fast", 32.0),
                   "beta_slow": kv(f"{g}.rope.scaling.yarn_beta_slow", 1.0)}
        lm = float(kv(f"{g}.rope.scaling.yarn_log_multiplier", 0.0))
        attn = (1.0 + lm * math.log(f)) ** 2 if f > 1 else 1.0
    n_experts = int(kv(f"{g}.expert_count", 0))
    dense = int(kv(f"{g}.leading_dense_block_count", 0))
    layers = []
    for i in range(int(kv(f"{g}.block_count"))):
        b = f"blk.{i}."
        kvb = tensors.get(b + "attn_kv_b.weight")
        if kvb is None:  # k_b [H, lora, nope] and v_b [H, v, lora] back to kv_b's rows
            kb, vb = tensors[b + "attn_k_b.weight"], tensors[b + "attn_v_b.weight"]
            kvb = np.concatenate([kb.transpose(0, 2, 1), vb], axis=1).reshape(-1, lora)
        L = Layer(attn_norm=tensors[b + "attn_norm.weight"], wq=tensors.get(b + "attn_q.weight"),
                  wk=None, wv=None, wo=tensors[b + "attn_output.weight"],
                  ffn_norm=tensors[b + "ffn_norm.weight"], w_gate=tensors.get(b + "ffn_gate.weight"),
                  w_up=tensors.get(b + "ffn_up.weight"), w_down=tensors.get(b + "ffn_down.weight"),
                  wq_a=tensors.get(b + "attn_q_a.weight"),
                  q_a_norm=tensors.get(b + "attn_q_a_norm.weight"),
                  wq_b=tensors.get(b + "attn_q_b.weight"), wkv_a=tensors[b + "attn_kv_a_mqa.weight"],
                  kv_a_norm=tensors[b + "attn_kv_a_norm.weight"], wkv_b=kvb)
        if n_experts and i >= dense:
            gt, ut, dt = (tensors[b + f"ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
            L.router = tensors[b + "ffn_gate_inp.weight"]
            L.router_bias = tensors.get(b + "exp_probs_b.bias")
            L.experts = [(gt[e], ut[e], dt[e]) for e in range(n_experts)]
            if b + "ffn_gate_shexp.weight" in tensors:
                L.shared = tuple(tensors[b + f"ffn_{k}_shexp.weight"]
                                 for k in ("gate", "up", "down")) + (None,)
        layers.append(L)
    embed = tensors["token_embd.weight"]
    tied = "output.weight" not in tensors
    bos, eos = kv("tokenizer.ggml.bos_token_id"), kv("tokenizer.ggml.eos_token_id")
    ng = int(kv(f"{g}.expert_group_count", 0))
    return Model(arch="deepseek2", n_layers=len(layers), d_model=d, n_heads=nh, n_kv_heads=1,
                 head_dim=lora + rope, d_ff=int(kv(f"{g}.feed_forward_length")),
                 vocab_size=embed.shape[0],
                 rms_eps=float(kv(f"{g}.attention.layer_norm_rms_epsilon", 1e-5)),
                 rope_theta=theta, inv_freq=rope_inv_freq(theta, rope, scaling), rope_neox=False,
                 embed=embed, layers=layers, out_norm=tensors["output_norm.weight"],
                 lm_head=embed if tied else tensors["output.weight"], tied=tied,
                 bos_id=None if bos is None else int(bos), eos_id=None if eos is None else int(eos),
                 source=str(path), experts_used=int(kv(f"{g}.expert_used_count", 0)),
                 norm_topk=bool(kv(f"{g}.expert_weights_norm", False)),
                 sigmoid=int(kv(f"{g}.expert_gating_func", 1)) == 2,
                 n_group=ng if ng > 1 else 0,
                 topk_group=int(kv(f"{g}.expert_group_used_count", 0)) if ng > 1 else 0,
                 group_top2=True, routed_scale=float(kv(f"{g}.expert_weights_scale", 1.0)),
                 mla=mla, attn_scale=attn)


def _load_gguf(path: pathlib.Path) -> Model:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(str(path))

    def kv(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    garch = kv("general.architecture")
    if garch not in GGUF_ARCHS:
        raise NotImplementedError(f"architecture {garch!r}")
    arch = GGUF_ARCHS[garch]
    tensors = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type)
        # GGUF ne is fastest-first; numpy shape is the reverse (rows, cols).
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        tensors[t.name] = _f64(a.reshape(shape))

    if garch == "deepseek2":
        return _load_gguf_deepseek(path, r, kv, tensors)
    d = int(kv(f"{garch}.embedding_length"))
    nh = int(kv(f"{garch}.attention.head_count"))
    nkv = int(kv(f"{garch}.attention.head_count_kv", nh))
    hd = int(kv(f"{garch}.attention.key_length", d // nh))
    n_rot = int(kv(f"{garch}.rope.dimension_count", hd))
    if n_rot != hd:
        raise NotImplementedError("partial rope")
    theta = float(kv(f"{garch}.rope.freq_base", 10000.0))
    scaling = None
    if kv(f"{garch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": kv(f"{garch}.rope.scaling.factor")}
    inv_freq = rope_inv_freq(theta, hd, scaling)
    if "rope_freqs.weight" in tensors:
        inv_freq = inv_freq / tensors["rope_freqs.weight"].reshape(-1)
    n_layers = int(kv(f"{garch}.block_count"))
    n_experts = int(kv(f"{garch}.expert_count", 0))
    layers = []
    for i in range(n_layers):
        b = f"blk.{i}."
        dense = b + "ffn_gate.weight" in tensors
        experts = None
        if not dense:  # stacked [n_experts, rows, cols]: llama.cpp's ffn_*_exps
            g, u, dn = (tensors[b + f"ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
            experts = [(g[e], u[e], dn[e]) for e in range(n_experts)]
        layers.append(Layer(
            attn_norm=tensors[b + "attn_norm.weight"],
            wq=tensors[b + "attn_q.weight"], wk=tensors[b + "attn_k.weight"],
            wv=tensors[b + "attn_v.weight"], wo=tensors[b + "attn_output.weight"],
            ffn_norm=tensors[b + "ffn_norm.weight"],
            w_gate=tensors.get(b + "ffn_gate.weight"), w_up=tensors.get(b + "ffn_up.weight"),
            w_down=tensors.get(b + "ffn_down.weight"),
            router=None if dense else tensors[b + "ffn_gate_inp.weight"], experts=experts,
            shared=None if b + "ffn_gate_shexp.weight" not in tensors else tuple(
                tensors[b + f"ffn_{k}.weight"].reshape(-1) if k == "gate_inp_shexp" else
                tensors[b + f"ffn_{k}.weight"]
                for k in ("gate_shexp", "up_shexp", "down_shexp", "gate_inp_shexp")),
            bq=tensors.get(b + "attn_q.bias"), bk=tensors.get(b + "attn_k.bias"),
            bv=tensors.get(b + "attn_v.bias"),
            q_norm=tensors.get(b + "attn_q_norm.weight"),
            k_norm=tensors.get(b + "attn_k_norm.weight")))
    embed = tensors["token_embd.weight"]
    tied = "output.weight" not in tensors
    vocab = embed.shape[0]
    bos, eos = kv("tokenizer.ggml.bos_token_id"), kv("tokenizer.ggml.eos_token_id")
    ff = kv(f"{garch}.feed_forward_length", kv(f"{garch}.expert_feed_forward_length"))
    return Model(arch=arch, n_layers=n_layers, d_model=d, n_heads=nh, n_kv_heads=nkv,
                 head_dim=hd, d_ff=int(ff), vocab_size=vocab,
                 rms_eps=float(kv(f"{garch}.attention.layer_norm_rms_epsilon", 1e-5)),
                 rope_theta=theta, inv_freq=inv_freq, rope_neox=(arch != "llama"),
                 embed=embed, layers=layers, out_norm=tensors["output_norm.weight"],
                 lm_head=embed if tied else tensors["output.weight"], tied=tied,
                 bos_id=None if bos is None else int(bos), eos_id=None if eos is None else int(eos),
                 source=str(path), experts_used=int(kv(f"{garch}.expert_used_count", 0)),
                 norm_topk=bool(kv(f"{garch}.expert_weights_norm", garch != "qwen2moe")))


def load(path) -> Model:
    """A .gguf file, or a HF folder (config.json + model.safetensors or a sharded index)."""
    p = pathlib.Path(path)
    if p.is_dir():
        return _load_hf(p)
    if p.suffix == ".gguf":
        return _load_gguf(p)
    raise ValueError(f"{p}: neither a folder nor a .gguf file")


# ---------------------------------------------------------------------------------------------
# forward


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def apply_rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, neox: bool,
               mscale: float = 1.0) -> np.ndarray:
    """x [T, heads, hd] rotated by angle pos[t] * inv_freq[i] on pair i (cos and sin times
    mscale: YaRN's magnitude)."""
    ang = pos.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]
    c, s = np.cos(ang)[:, None, :] * mscale, np.sin(ang)[:, None, :] * mscale
    if neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def kv_rounding(kv_dtype: str | None):
    """What a KV cache of element type kv_dtype does to the values stored in it: None or
    "f32" keeps float64 (the reference's own precision); "bf16" and "f16" round each value to
    float32 and then to that type, to nearest even (numpy's float16 cast; bf16 by its bits),
    as an engine that computes K and V in float32 and stores them narrowed does."""
    if kv_dtype in (None, "f32"):
        return None
    if kv_dtype == "f16":
        return lambda a: np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float64)
    if kv_dtype == "bf16":
        def bf16(a):
            u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
            r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)
            return r.view(np.float32).astype(np.float64)
        return bf16
    raise ValueError(f"unknown KV element type {kv_dtype!r}")


def mla_attention(m: Model, L: Layer, h: np.ndarray, pos: np.ndarray, mask: np.ndarray,
                  K: np.ndarray, kv_round=None):
    """DeepSeek's attention of h [T, d] (naive form); K [S, 1, lora + rope] caches each
    position's normed latent and rotated rope key. Returns (output [T, d], K)."""
    ql, lora, nope, rope, vd = m.mla
    T, nh = h.shape[0], m.n_heads
    if L.wq_a is not None:
        q = rmsnorm(h @ L.wq_a.T, L.q_a_norm, m.rms_eps) @ L.wq_b.T
    else:
        q = h @ L.wq.T
    q = q.reshape(T, nh, nope + rope)
    q_nope = q[..., :nope]
    q_pe = apply_rope(q[..., nope:], pos, m.inv_freq, False, m.rope_mscale)
    kva = h @ L.wkv_a.T
    c = rmsnorm(kva[:, :lora], L.kv_a_norm, m.rms_eps)
    k_pe = apply_rope(kva[:, None, lora:], pos, m.inv_freq, False, m.rope_mscale)[:, 0]
    row = np.concatenate([c, k_pe], axis=-1)
    if kv_round is not None:
        row = kv_round(row)
    K = np.concatenate([K, row[:, None, :]], axis=0)
    kv = (K[:, 0, :lora] @ L.wkv_b.T).reshape(K.shape[0], nh, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    scale = m.attn_scale / math.sqrt(nope + rope)
    scores = (np.einsum("thd,shd->hts", q_nope, k_nope)
              + np.einsum("thd,sd->hts", q_pe, K[:, 0, lora:])) * scale
    scores = np.where(mask[None], -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    a = np.einsum("hts,shd->thd", p, v).reshape(T, nh * vd)
    return a @ L.wo.T, K


def route(m: Model, L: Layer, z: np.ndarray):
    """(experts, weights) of one row's router logits z [n_experts] (the module docstring)."""
    if m.sigmoid:
        sc = 1.0 / (1.0 + np.exp(-z))
    else:
        sc = np.exp(z - z.max())
        sc /= sc.sum()
    choice = sc + (L.router_bias if L.router_bias is not None else 0.0)
    E = z.size
    if m.n_group:
        gs = E // m.n_group
        g = choice.reshape(m.n_group, gs)
        worth = np.sort(g, axis=1)[:, -2:].sum(axis=1) if m.group_top2 else g.max(axis=1)
        allowed = np.zeros(E, dtype=bool)
        for k in np.argsort(-worth, kind="stable")[:m.topk_group]:
            allowed[k * gs:(k + 1) * gs] = True
        choice = np.where(allowed, choice, -np.inf)
    kept = np.argsort(-choice, kind="stable")[:m.experts_used]
    w = sc[kept]
    if m.norm_topk:
        w = w / w.sum()
    return kept, w * m.routed_scale


def layer_step(m: Model, L: Layer, x: np.ndarray, pos: np.ndarray, mask: np.ndarray,
               K: np.ndarray, V: np.ndarray, kv_round=None):
    """One decoder layer over x [T, d] at positions pos, appending to the layer's cache K, V
    [S, nkv, hd]; mask [T, S + T] is True where a query must not look. A layer without an
    input norm (an EAGLE head's) projects x itself. kv_round (kv_rounding's): what storing k
    and v in the cache does to them. Returns (x, K, V)."""
    T, hd = x.shape[0], m.head_dim
    h = rmsnorm(x, L.attn_norm, m.rms_eps) if L.attn_norm is not None else x
    if m.mla is not None:
        o, K = mla_attention(m, L, h, pos, mask, K, kv_round)
        return ffn_step(m, L, x + o), K, V
    nh, nkv = L.wq.shape[0] // hd, L.wk.shape[0] // hd  # a head's layer may differ
    group = nh // nkv
    scale = 1.0 / math.sqrt(hd)
    q = h @ L.wq.T
    k = h @ L.wk.T
    v = h @ L.wv.T
    if L.bq is not None:
        q, k, v = q + L.bq, k + L.bk, v + L.bv
    q = q.reshape(T, nh, hd)
    k = k.reshape(T, nkv, hd)
    v = v.reshape(T, nkv, hd)
    if L.q_norm is not None:
        q = rmsnorm(q, L.q_norm, m.rms_eps)
        k = rmsnorm(k, L.k_norm, m.rms_eps)
    q = apply_rope(q, pos, m.inv_freq, m.rope_neox)
    k = apply_rope(k, pos, m.inv_freq, m.rope_neox)
    if kv_round is not None:
        k, v = kv_round(k), kv_round(v)
    K = np.concatenate([K, k], axis=0)  # [S, nkv, hd]
    V = np.concatenate([V, v], axis=0)
    qg = q.reshape(T, nkv, group, hd)
    scores = np.einsum("tkgd,skd->kgts", qg, K) * scale  # [nkv, group, T, S]
    scores = np.where(mask, -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    a = np.einsum("kgts,skd->tkgd", p, V).reshape(T, nh * hd)
    return ffn_step(m, L, x + a @ L.wo.T), K, V


def ffn_step(m: Model, L: Layer, x: np.ndarray) -> np.ndarray:
    """x plus the layer's FFN (dense, or experts) of rmsnorm(x, ffn_norm)."""
    h = rmsnorm(x, L.ffn_norm, m.rms_eps)
    if L.router is None:
        return x + (silu(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T
    z = h @ L.router.T  # [T, n_experts]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, we in zip(*route(m, L, z[t])):
            g, u, dn = L.experts[e]
            out[t] += we * ((silu(h[t] @ g.T) * (h[t] @ u.T)) @ dn.T)
    if L.shared is not None:
        g, u, dn, score = L.shared
        y = (silu(h @ g.T) * (h @ u.T)) @ dn.T
        if score is not None:  # qwen2_moe's gate
            y = (1.0 / (1.0 + np.exp(-(h @ score))))[:, None] * y
        out += y
    return x + out


class Session:
    """Incremental evaluation: step(tokens) appends tokens at the next positions and returns
    their logits [T, vocab], attending to everything before through a per-layer KV cache."""

    def __init__(self, model: Model, kv_dtype: str | None = None):
        self.m = model
        self.kv_round = kv_rounding(kv_dtype)
        self.n_past = 0
        self.k = [np.zeros((0, model.n_kv_heads, model.head_dim)) for _ in model.layers]
        self.v = [np.zeros((0, model.n_kv_heads, model.head_dim)) for _ in model.layers]

    def step(self, tokens) -> np.ndarray:
        m = self.m
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("no tokens")
        if tokens.min() < 0 or tokens.max() >= m.vocab_size:
            raise ValueError("token id out of range")
        T, p0 = tokens.size, self.n_past
        pos = np.arange(p0, p0 + T)
        # causal mask over [past + new]: query t (position p0+t) sees keys at s <= p0+t
        mask = np.arange(p0 + T)[None, :] > pos[:, None]  # [T, S]

        x = m.embed[tokens]  # [T, d]
        self.layer_inputs = []  # [n_layers] the residual stream entering each layer [T, d]
        for li, L in enumerate(m.layers):
            self.layer_inputs.append(x)
            x, self.k[li], self.v[li] = layer_step(m, L, x, pos, mask, self.k[li], self.v[li],
                                                   self.kv_round)
        self.n_past += T
        self.features = rmsnorm(x, m.out_norm, m.rms_eps)  # [T, d]: what the LM head reads
        return self.features @ m.lm_head.T


def forward(model: Model, tokens, kv_dtype: str | None = None) -> np.ndarray:
    """Logits [T, vocab] (float64) for every position of `tokens`, from an empty cache (of
    element type kv_dtype: see kv_rounding)."""
    return Session(model, kv_dtype).step(tokens)


@dataclasses.dataclass
class Head:
    """A speculation head (tandem's docs/HEADS.md): x = fc [enorm(embed(t)), hnorm(h)] (+ bias),
    one decoder layer, a final norm, the target's LM head. None: that norm is absent."""
    fc: np.ndarray  # [d, 2d]
    layer: Layer
    enorm: np.ndarray | None = None
    hnorm: np.ndarray | None = None
    fc_bias: np.ndarray | None = None
    norm: np.ndarray | None = None


def head_forward(model: Model, head: Head, tokens, feats) -> tuple[np.ndarray, np.ndarray]:
    """The head over rows p = 0 .. T-1 from an empty cache: row p reads tokens[p] (the target's
    t(p+1)) and feats[p] (the target's feature h(p)) at position p. Returns (logits [T, vocab],
    features [T, d]: the head's own final-normed states)."""
    m = model
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    feats = np.asarray(feats, dtype=np.float64)
    T = tokens.size
    e = m.embed[tokens]
    if head.enorm is not None:
        e = rmsnorm(e, head.enorm, m.rms_eps)
    h = rmsnorm(feats, head.hnorm, m.rms_eps) if head.hnorm is not None else feats
    x = np.concatenate([e, h], axis=-1) @ head.fc.T
    if head.fc_bias is not None:
        x = x + head.fc_bias
    pos = np.arange(T)
    mask = np.arange(T)[None, :] > pos[:, None]
    hd = m.head_dim
    nkv = 1 if m.mla is not None else head.layer.wk.shape[0] // hd
    empty = np.zeros((0, nkv, hd))
    x, _, _ = layer_step(m, head.layer, x, pos, mask, empty, empty)
    f = rmsnorm(x, head.norm, m.rms_eps) if head.norm is not None else x
    return f @ m.lm_head.T, f


@dataclasses.dataclass
class Eagle3Head:
    """An EAGLE-3 head (docs/HEADS.md): fc [d, 3d] over the fused target feature (the residual
    entering target layers aux_layers, concatenated), a layer whose q/k/v read
    [input_norm(embed(t)) ; hidden_norm(h)] [2d] with the residual h, a final norm and its own
    LM head over the draft vocabulary (target id of draft row i: i + d2t[i]; None: the whole
    vocabulary)."""
    fc: np.ndarray  # [d, 3d]
    input_norm: np.ndarray  # [d]
    hidden_norm: np.ndarray  # [d]
    wq: np.ndarray  # [nh * hd, 2d]
    wk: np.ndarray  # [nkv * hd, 2d]
    wv: np.ndarray  # [nkv * hd, 2d]
    wo: np.ndarray  # [d, nh * hd]
    post_norm: np.ndarray  # [d]
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    norm: np.ndarray  # [d]
    lm_head: np.ndarray  # [n, d]
    aux_layers: tuple
    d2t: np.ndarray | None = None  # [n] int64
    fc_bias: np.ndarray | None = None
    embed: np.ndarray | None = None  # [vocab, d]; None: the target's


def eagle3_features(session: "Session", layers) -> np.ndarray:
    """The fused target feature [T, 3d] of a Session's last step: the residual stream entering
    each of `layers`, concatenated in that order."""
    return np.concatenate([session.layer_inputs[i] for i in layers], axis=-1)


def eagle3_forward(model: Model, head: Eagle3Head, tokens, hidden, own: bool, cache=None):
    """EAGLE-3 rows at the positions after `cache` (None: from 0): row t reads tokens[t] and
    hidden[t], the fused target feature [3d] (fc applies) or, with own, the head's own state of
    the row before [d]. Returns (logits [T, vocab] with -inf off the draft vocabulary,
    prenorm states [T, d], cache)."""
    m, hd = model, model.head_dim
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    hidden = np.asarray(hidden, dtype=np.float64)
    T = tokens.size
    nh, nkv = head.wq.shape[0] // hd, head.wk.shape[0] // hd
    K, V = cache if cache is not None else (np.zeros((0, nkv, hd)), np.zeros((0, nkv, hd)))
    p0 = K.shape[0]
    h = hidden if own else hidden @ head.fc.T + (0 if head.fc_bias is None else head.fc_bias)
    emb = (head.embed if head.embed is not None else m.embed)[tokens]
    a = np.concatenate([rmsnorm(emb, head.input_norm, m.rms_eps),
                        rmsnorm(h, head.hidden_norm, m.rms_eps)], axis=-1)
    pos = np.arange(p0, p0 + T)
    q = apply_rope((a @ head.wq.T).reshape(T, nh, hd), pos, m.inv_freq, m.rope_neox)
    k = apply_rope((a @ head.wk.T).reshape(T, nkv, hd), pos, m.inv_freq, m.rope_neox)
    v = (a @ head.wv.T).reshape(T, nkv, hd)
    K, V = np.concatenate([K, k]), np.concatenate([V, v])
    att = np.zeros((T, nh, hd))
    for t in range(T):
        for j in range(nh):
            kv = j // (nh // nkv)
            sc = K[: p0 + t + 1, kv] @ q[t, j] / math.sqrt(hd)
            w = np.exp(sc - sc.max())
            att[t, j] = (w / w.sum()) @ V[: p0 + t + 1, kv]
    x = h + att.reshape(T, nh * hd) @ head.wo.T
    f = rmsnorm(x, head.post_norm, m.rms_eps)
    x = x + (silu(f @ head.w_gate.T) * (f @ head.w_up.T)) @ head.w_down.T
    z = rmsnorm(x, head.norm, m.rms_eps) @ head.lm_head.T
    if head.d2t is None:
        return z, x, (K, V)
    logits = np.full((T, m.vocab_size), -np.inf)
    logits[:, np.arange(z.shape[1]) + head.d2t] = z
    return logits, x, (K, V)


def top2_margin(logits: np.ndarray) -> float:
    """top-1 minus top-2 logit of one row."""
    part = np.partition(np.asarray(logits).reshape(-1), -2)
    return float(part[-1] - part[-2])


def greedy(model: Model, prompt, n: int, return_margins: bool = False,
           kv_dtype: str | None = None):
    """n tokens by argmax (ties to the lowest id), no stop at EOS. With return_margins, also
    each step's top-1 minus top-2 logit gap divided by max|logits| (small: a near tie)."""
    s = Session(model, kv_dtype)
    logits = s.step(prompt)[-1]
    out, margins = [], []
    for i in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        margins.append(top2_margin(logits) / float(np.max(np.abs(logits))))
        if i + 1 < n:
            logits = s.step([tok])[-1]
    return (out, margins) if return_margins else out


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """max|ours - ref| / max|ref|: the "relative" error of the fidelity contract."""
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


__all__ = ["Model", "Layer", "Head", "Session", "load", "kv_rounding", "layer_step", "head_forward", "forward", "greedy", "rel_err", "top2_margin",
           "rope_inv_freq", "apply_rope", "rmsnorm", "silu", "route", "mla_attention",
           "load_mtp_head", "Eagle3Head", "eagle3_features", "eagle3_forward"]
