"""Speculation heads written with the safetensors package, in each layout tandem loads
(docs/HEADS.md), and their numpy reference (lib.reference.Head).

kind "random": every tensor drawn from a seeded generator (the forward-pass comparison).
kind "echo": a head that proposes the target's last token again: fc passes the hidden state
through (fc = [0 | I]), the layer's attention and MLP outputs are zero (o_proj, down_proj = 0)
and the norms are ones, so the head's feature is the target's own feature renormalised and its
logits pick the token the target just chose; deeper drafts repeat it. On a target that repeats
itself, its drafts are accepted: a head with a known acceptance, without training.
"""
import math
import pathlib

import numpy as np

from lib.reference import Head, Layer

LAYOUTS = ("tandem", "eagle", "deepseek-mtp")
DEEPSEEK_LAYER = 3  # the MTP layer's index in DeepSeek's names (the target's layer count there)


def _layer_tensors(rng, d, hd, nh, nkv, ff, *, qkv_bias, qk_norm, attn_norm, echo):
    def mat(rows, cols, gain=1.0):
        return rng.standard_normal((rows, cols)) * (gain / math.sqrt(cols))

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    t = {}
    if attn_norm:
        t["input_layernorm.weight"] = np.ones(d) if echo else norm(d)
    t["self_attn.q_proj.weight"] = mat(nh * hd, d, 1.5)
    t["self_attn.k_proj.weight"] = mat(nkv * hd, d)
    t["self_attn.v_proj.weight"] = mat(nkv * hd, d)
    if qkv_bias:
        t["self_attn.q_proj.bias"] = 0.2 * rng.standard_normal(nh * hd)
        t["self_attn.k_proj.bias"] = 0.2 * rng.standard_normal(nkv * hd)
        t["self_attn.v_proj.bias"] = 0.2 * rng.standard_normal(nkv * hd)
    if qk_norm:
        t["self_attn.q_norm.weight"] = norm(hd)
        t["self_attn.k_norm.weight"] = norm(hd)
    t["self_attn.o_proj.weight"] = np.zeros((d, nh * hd)) if echo else mat(d, nh * hd)
    t["post_attention_layernorm.weight"] = np.ones(d) if echo else norm(d)
    t["mlp.gate_proj.weight"] = mat(ff, d)
    t["mlp.up_proj.weight"] = mat(ff, d)
    t["mlp.down_proj.weight"] = np.zeros((d, ff)) if echo else mat(d, ff)
    return t


def write_head(path, *, d, head_dim, vocab, n_heads=None, n_kv_heads=None, d_ff=None,
               layout="tandem", kind="random", seed=0, qkv_bias=False, qk_norm=False,
               dtype="float32", extra=None) -> Head:
    """Writes a head for a target of width d (and head size head_dim, vocabulary vocab) to
    path (a .safetensors file); returns its reference, built from the stored values."""
    from lib.checkpoints import _write_safetensors

    assert layout in LAYOUTS and kind in ("random", "echo")
    rng = np.random.default_rng(seed)
    nh = n_heads or max(1, d // head_dim)
    nkv = n_kv_heads or nh
    ff = d_ff or 2 * d
    echo = kind == "echo"
    eagle = layout == "eagle"
    layer = _layer_tensors(rng, d, head_dim, nh, nkv, ff, qkv_bias=qkv_bias, qk_norm=qk_norm,
                           attn_norm=not eagle, echo=echo)
    if echo:
        fc = np.concatenate([np.zeros((d, d)), np.eye(d)], axis=1)
    else:
        fc = rng.standard_normal((d, 2 * d)) / math.sqrt(2 * d)
    enorm = None if eagle else (np.ones(d) if echo else 1.0 + 0.1 * rng.standard_normal(d))
    hnorm = None if eagle else (np.ones(d) if echo else 1.0 + 0.1 * rng.standard_normal(d))
    norm = None if eagle else (np.ones(d) if echo else 1.0 + 0.1 * rng.standard_normal(d))
    fc_bias = 0.1 * rng.standard_normal(d) if eagle and not echo else None

    t = {}
    if layout == "deepseek-mtp":
        p = f"model.layers.{DEEPSEEK_LAYER}."
        t[p + "enorm.weight"] = enorm
        t[p + "hnorm.weight"] = hnorm
        t[p + "eh_proj.weight"] = fc
        for k, v in layer.items():
            t[p + k] = v
        t[p + "shared_head.norm.weight"] = norm
        t[p + "shared_head.head.weight"] = 0.1 * rng.standard_normal((vocab, d))
    else:
        if not eagle:
            t["enorm.weight"] = enorm
            t["hnorm.weight"] = hnorm
            t["norm.weight"] = norm
        t["fc.weight"] = fc
        if fc_bias is not None:
            t["fc.bias"] = fc_bias
        for k, v in layer.items():
            t["layers.0." + k] = v
    if extra:
        t.update(extra)
    _write_safetensors(pathlib.Path(path), t, dtype)

    def stored(a):  # the values as the file holds them, for the reference
        if a is None:
            return None
        if dtype == "bfloat16":
            from lib.checkpoints import f32_to_bf16_bits
            bits = f32_to_bf16_bits(np.asarray(a, dtype=np.float32)).astype(np.uint32) << 16
            return bits.view(np.float32).astype(np.float64)
        return np.asarray(a, dtype=np.dtype(dtype)).astype(np.float64)

    L = Layer(attn_norm=stored(layer.get("input_layernorm.weight")),
              wq=stored(layer["self_attn.q_proj.weight"]),
              wk=stored(layer["self_attn.k_proj.weight"]),
              wv=stored(layer["self_attn.v_proj.weight"]),
              wo=stored(layer["self_attn.o_proj.weight"]),
              ffn_norm=stored(layer["post_attention_layernorm.weight"]),
              w_gate=stored(layer["mlp.gate_proj.weight"]),
              w_up=stored(layer["mlp.up_proj.weight"]),
              w_down=stored(layer["mlp.down_proj.weight"]),
              bq=stored(layer.get("self_attn.q_proj.bias")),
              bk=stored(layer.get("self_attn.k_proj.bias")),
              bv=stored(layer.get("self_attn.v_proj.bias")),
              q_norm=stored(layer.get("self_attn.q_norm.weight")),
              k_norm=stored(layer.get("self_attn.k_norm.weight")))
    return Head(fc=stored(fc), layer=L, enorm=stored(enorm), hnorm=stored(hnorm),
                fc_bias=stored(fc_bias), norm=stored(norm))
