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
        return _stored(a, dtype)

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


def _write_mixed(path, tensors: dict, dtype: str):
    """A safetensors file whose float tensors are stored as dtype and integer or boolean ones
    as they are (I64, BOOL)."""
    from safetensors import TensorSpec, serialize_file
    from lib.checkpoints import f32_to_bf16_bits

    keep, specs = [], {}
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.integer):
            buf, dt = np.ascontiguousarray(arr), {np.dtype(np.bool_): "bool"}.get(arr.dtype,
                                                                                   "int64")
            buf = buf.astype(np.int64) if dt == "int64" else buf
        elif dtype == "bfloat16":
            buf, dt = f32_to_bf16_bits(arr.astype(np.float32)), dtype
        else:
            buf, dt = np.ascontiguousarray(arr, dtype=np.dtype(dtype)), dtype
        keep.append(buf)
        specs[name] = TensorSpec(dtype=dt, shape=list(arr.shape), data_ptr=buf.ctypes.data,
                                 data_len=buf.nbytes)
    serialize_file(specs, str(path), metadata={"format": "pt"})


def _stored(a, dtype):
    """The values as a file of dtype holds them (float64), for the reference."""
    if a is None:
        return None
    if dtype == "bfloat16":
        from lib.checkpoints import f32_to_bf16_bits
        bits = f32_to_bf16_bits(np.asarray(a, dtype=np.float32)).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return np.asarray(a, dtype=np.dtype(dtype)).astype(np.float64)


def write_eagle3_head(path, *, d, head_dim, vocab, n_layers, n_heads=None, n_kv_heads=None,
                      d_ff=None, draft_vocab=None, seed=0, dtype="float32", fc_bias=False,
                      embed=False, t2d=True, aux_layers=None, drop=(), extra=None):
    """Writes an EAGLE-3 head (the EAGLE repository's / SpecForge's / vLLM's tensor names) for
    a target of width d, head size head_dim, vocabulary vocab and n_layers layers; returns its
    lib.reference.Eagle3Head. draft_vocab: the draft vocabulary (a random ascending subset of
    the target's, d2t and t2d written; None: the whole vocabulary, no maps). aux_layers: also
    written to a config.json beside the head (eagle_aux_hidden_state_layer_ids); None: none
    written, the default (2, L/2, L-3) applies. drop: tensor names left out; extra: tensors
    added or replaced (as given)."""
    from lib.reference import Eagle3Head

    rng = np.random.default_rng(seed)
    nh = n_heads or max(1, d // head_dim)
    nkv = n_kv_heads or nh
    ff = d_ff or 2 * d

    def mat(rows, cols, gain=1.0):
        return rng.standard_normal((rows, cols)) * (gain / math.sqrt(cols))

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    t = {"fc.weight": mat(d, 3 * d),
         "midlayer.input_layernorm.weight": norm(d),
         "midlayer.hidden_norm.weight": norm(d),
         "midlayer.self_attn.q_proj.weight": mat(nh * head_dim, 2 * d, 1.5),
         "midlayer.self_attn.k_proj.weight": mat(nkv * head_dim, 2 * d),
         "midlayer.self_attn.v_proj.weight": mat(nkv * head_dim, 2 * d),
         "midlayer.self_attn.o_proj.weight": mat(d, nh * head_dim),
         "midlayer.post_attention_layernorm.weight": norm(d),
         "midlayer.mlp.gate_proj.weight": mat(ff, d),
         "midlayer.mlp.up_proj.weight": mat(ff, d),
         "midlayer.mlp.down_proj.weight": mat(d, ff),
         "norm.weight": norm(d)}
    if fc_bias:
        t["fc.bias"] = 0.1 * rng.standard_normal(d)
    if embed:
        t["embed_tokens.weight"] = 0.5 * rng.standard_normal((vocab, d))
    d2t = None
    n = vocab
    if draft_vocab is not None:
        n = draft_vocab
        ids = np.sort(rng.choice(vocab, n, replace=False))
        d2t = (ids - np.arange(n)).astype(np.int64)
        t["d2t"] = d2t
        if t2d:
            mark = np.zeros(vocab, dtype=np.bool_)
            mark[ids] = True
            t["t2d"] = mark
    t["lm_head.weight"] = 0.5 * rng.standard_normal((n, d))
    for k in drop:
        t.pop(k, None)
    if extra:
        t.update(extra)
    path = pathlib.Path(path)
    _write_mixed(path, t, dtype)
    if aux_layers is not None:
        (path.parent / "config.json").write_text(
            '{"architectures": ["LlamaForCausalLMEagle3"], '
            f'"eagle_config": {{"eagle_aux_hidden_state_layer_ids": {list(aux_layers)}}}}}')
    layers = tuple(aux_layers) if aux_layers is not None else (2, n_layers // 2, n_layers - 3)
    s = lambda k: _stored(t.get(k), dtype)  # noqa: E731
    return Eagle3Head(fc=s("fc.weight"), input_norm=s("midlayer.input_layernorm.weight"),
                      hidden_norm=s("midlayer.hidden_norm.weight"),
                      wq=s("midlayer.self_attn.q_proj.weight"),
                      wk=s("midlayer.self_attn.k_proj.weight"),
                      wv=s("midlayer.self_attn.v_proj.weight"),
                      wo=s("midlayer.self_attn.o_proj.weight"),
                      post_norm=s("midlayer.post_attention_layernorm.weight"),
                      w_gate=s("midlayer.mlp.gate_proj.weight"),
                      w_up=s("midlayer.mlp.up_proj.weight"),
                      w_down=s("midlayer.mlp.down_proj.weight"), norm=s("norm.weight"),
                      lm_head=s("lm_head.weight"), aux_layers=layers, d2t=d2t,
                      fc_bias=s("fc.bias"), embed=s("embed_tokens.weight"))
