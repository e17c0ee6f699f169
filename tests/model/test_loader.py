"""Model loader tests: tiny random checkpoints written with the Python gguf and safetensors
packages (the independent references), loaded by tandem through tests/tools/model_dump, and
compared with numpy.

model_dump prints the parsed config as JSON and writes chosen weights as float32 after
dequantising them with tdm_dequantize; the expected values come from numpy (float32 / float16
data) or from gguf.quants.dequantize (quantised data), never from tandem itself.
"""
import json
import struct
import subprocess

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants
from safetensors.numpy import save_file

from conftest import build_dir

# Sizes chosen so that every matrix has whole Q4/Q8 blocks (32) and, for d_model and d_ff
# inputs, whole K-quant super-blocks (256).
D, H, KV, HD, FF, V, L = 256, 4, 2, 64, 512, 300, 2
TOKENS = ["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(3, V - 3)] + [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
IM_END, ENDOFTEXT = V - 2, V - 1

# dump name -> (HF name pattern, GGUF name pattern)
LAYER_NAMES = {
    "attn_norm": ("model.layers.{}.input_layernorm.weight", "blk.{}.attn_norm.weight"),
    "wq": ("model.layers.{}.self_attn.q_proj.weight", "blk.{}.attn_q.weight"),
    "wk": ("model.layers.{}.self_attn.k_proj.weight", "blk.{}.attn_k.weight"),
    "wv": ("model.layers.{}.self_attn.v_proj.weight", "blk.{}.attn_v.weight"),
    "wo": ("model.layers.{}.self_attn.o_proj.weight", "blk.{}.attn_output.weight"),
    "bq": ("model.layers.{}.self_attn.q_proj.bias", "blk.{}.attn_q.bias"),
    "bk": ("model.layers.{}.self_attn.k_proj.bias", "blk.{}.attn_k.bias"),
    "bv": ("model.layers.{}.self_attn.v_proj.bias", "blk.{}.attn_v.bias"),
    "q_norm": ("model.layers.{}.self_attn.q_norm.weight", "blk.{}.attn_q_norm.weight"),
    "k_norm": ("model.layers.{}.self_attn.k_norm.weight", "blk.{}.attn_k_norm.weight"),
    "ffn_norm": ("model.layers.{}.post_attention_layernorm.weight", "blk.{}.ffn_norm.weight"),
    "w_gate": ("model.layers.{}.mlp.gate_proj.weight", "blk.{}.ffn_gate.weight"),
    "w_up": ("model.layers.{}.mlp.up_proj.weight", "blk.{}.ffn_up.weight"),
    "w_down": ("model.layers.{}.mlp.down_proj.weight", "blk.{}.ffn_down.weight"),
}
GLOBAL_NAMES = {
    "tok_embd": ("model.embed_tokens.weight", "token_embd.weight"),
    "output_norm": ("model.norm.weight", "output_norm.weight"),
    "output": ("lm_head.weight", "output.weight"),
}


def model_dump_bin():
    p = build_dir() / "tests" / "tools" / "model_dump"
    if not p.exists():
        pytest.fail(f"{p} not built")
    return p


def random_weights(arch, tied, head_dim=HD, seed=0):
    """dump name -> float32 array in PyTorch layout ([rows, cols] / [n])."""
    rng = np.random.default_rng(seed)
    q, kv = H * head_dim, KV * head_dim
    shapes = {"tok_embd": (V, D), "output_norm": (D,)}
    if not tied:
        shapes["output"] = (V, D)
    for i in range(L):
        shapes.update({f"layers.{i}.attn_norm": (D,), f"layers.{i}.wq": (q, D),
                       f"layers.{i}.wk": (kv, D), f"layers.{i}.wv": (kv, D),
                       f"layers.{i}.wo": (D, q), f"layers.{i}.ffn_norm": (D,),
                       f"layers.{i}.w_gate": (FF, D), f"layers.{i}.w_up": (FF, D),
                       f"layers.{i}.w_down": (D, FF)})
        if arch == "qwen2":
            shapes.update({f"layers.{i}.bq": (q,), f"layers.{i}.bk": (kv,),
                           f"layers.{i}.bv": (kv,)})
        if arch == "qwen3":
            shapes.update({f"layers.{i}.q_norm": (head_dim,), f"layers.{i}.k_norm": (head_dim,)})
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in shapes.items()}


def file_name(dump_name, hf):
    idx = 0 if hf else 1
    if dump_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[dump_name][idx]
    _, layer, field = dump_name.split(".")
    return LAYER_NAMES[field][idx].format(layer)


def n_params(weights):
    return sum(a.size for a in weights.values())


def run_dump(path, names, tmp_path, keep_k_blocks=False):
    """Loads `path`; returns (config dict, {name: float32 array})."""
    args = [str(model_dump_bin())] + (["--keep-k-blocks"] if keep_k_blocks else []) + [str(path)]
    for n in names:
        args += [n, str(tmp_path / f"{n}.f32")]
    cp = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    cfg = json.loads(cp.stdout)
    out = {}
    for n in names:
        w = cfg["weights"][n]
        out[n] = np.fromfile(tmp_path / f"{n}.f32", dtype=np.float32).reshape(w["rows"], w["cols"])
    return cfg, out


def dump_error(path):
    cp = subprocess.run([str(model_dump_bin()), str(path)], capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == 1, f"expected a load error, got rc {cp.returncode}: {cp.stdout[:500]}"
    assert "error:" in cp.stderr
    return cp.stderr


def check_values(got, want, exact=True):
    want = np.asarray(want, dtype=np.float32).reshape(got.shape)
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- HF checkpoints


def hf_config(arch, tied, **extra):
    cfg = {"model_type": arch, "hidden_size": D, "intermediate_size": FF,
           "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "vocab_size": V,
           "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
           "hidden_act": "silu", "rope_theta": 500000.0}
    cfg.update(extra)
    return cfg


def write_bf16_safetensors(path, tensors):
    """A safetensors file with BF16 data written by hand (numpy has no bfloat16); returns the
    values the BF16 bits stand for."""
    header, blobs, off, values = {}, [], 0, {}
    for name, a in tensors.items():
        bits = quants.quantize(a, QT.BF16).view(np.uint16).reshape(a.shape)
        values[name] = quants.dequantize(bits.view(np.uint8), QT.BF16).reshape(a.shape)
        raw = bits.astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return values


def test_hf_llama_f32_single(tmp_path):
    w = random_weights("llama", tied=False)
    save_file({file_name(k, True): v for k, v in w.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config(
        "llama", False, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, IM_END], "temperature": 0.6, "top_p": 0.9, "top_k": 20}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ hi }}"}))
    names = sorted(w)  # every weight
    cfg, got = run_dump(tmp_path, names, tmp_path)
    assert (cfg["arch"], cfg["n_layers"], cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"],
            cfg["head_dim"], cfg["d_ff"], cfg["vocab_size"], cfg["max_ctx"]) == \
        ("llama", L, D, H, KV, HD, FF, V, 4096)
    assert cfg["rope_neox"] is True and cfg["is_gguf"] is False
    assert cfg["rope_theta"] == 500000.0
    assert cfg["rope_scaling"] == "llama3" and cfg["rope_factor"] == 8.0
    assert (cfg["rope_low_freq_factor"], cfg["rope_high_freq_factor"],
            cfg["rope_original_max_ctx"]) == (1.0, 4.0, 8192)
    assert cfg["rms_eps"] == pytest.approx(1e-5, rel=1e-6)
    assert cfg["tied_embeddings"] is False and cfg["output_is_tok_embd"] is False
    assert cfg["bos_id"] == 1 and sorted(cfg["eos_ids"]) == [2, IM_END]
    assert cfg["gen_temperature"] == pytest.approx(0.6) and cfg["gen_top_p"] == pytest.approx(0.9)
    assert cfg["gen_top_k"] == 20
    assert cfg["chat_template"] == "{{ hi }}"
    assert cfg["n_params"] == n_params(w)
    assert cfg["weight_bytes"] == 4 * n_params(w)
    assert cfg["progress"][-1] == 1.0 and cfg["progress"] == sorted(cfg["progress"])
    for n in names:
        assert cfg["weights"][n]["dtype"] == "f32"
        check_values(got[n], w[n])


def test_hf_qwen2_f16_sharded_tied(tmp_path):
    w = random_weights("qwen2", tied=True, seed=1)
    hf = {file_name(k, True): v.astype(np.float16) for k, v in w.items()}
    names_sorted = sorted(hf)
    shards = {"model-00001-of-00002.safetensors": names_sorted[::2],
              "model-00002-of-00002.safetensors": names_sorted[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: hf[k] for k in keys}, str(tmp_path / fname))
        weight_map.update({k: fname for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(
        "qwen2", True, rope_theta=1000000.0, eos_token_id=[2, ENDOFTEXT], bos_token_id=None)))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    names = ["tok_embd", "output", "layers.0.bq", "layers.1.bk", "layers.1.bv", "layers.0.wv",
             "layers.1.ffn_norm", "output_norm"]
    cfg, got = run_dump(tmp_path, names, tmp_path)
    assert cfg["arch"] == "qwen2" and cfg["qkv_bias"] is True and cfg["qk_norm"] is False
    assert cfg["tied_embeddings"] is True and cfg["output_is_tok_embd"] is True
    assert cfg["rope_theta"] == 1000000.0 and cfg["rope_scaling"] == "none"
    assert cfg["bos_id"] == -1 and sorted(cfg["eos_ids"]) == [2, ENDOFTEXT]
    assert cfg["chat_template"] == "D"
    assert cfg["n_params"] == n_params(w)  # tied: the embedding counts once
    assert cfg["weight_bytes"] == 4 * n_params(w)  # F16 is widened to F32 at load
    for n in names:
        assert cfg["weights"][n]["dtype"] == "f32"  # F16 is not run directly
        src = w["tok_embd" if n == "output" else n]
        check_values(got[n], src.astype(np.float16).astype(np.float32))


def test_hf_qwen3_bf16(tmp_path):
    hd = 32  # explicit head_dim, not hidden_size / heads
    w = random_weights("qwen3", tied=False, head_dim=hd, seed=2)
    vals = write_bf16_safetensors(tmp_path / "model.safetensors",
                                  {file_name(k, True): v for k, v in w.items()})
    (tmp_path / "config.json").write_text(json.dumps(hf_config(
        "qwen3", False, head_dim=hd, rope_theta=None,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})))
    (tmp_path / "chat_template.jinja").write_text("J{{ x }}")
    names = sorted(w)
    cfg, got = run_dump(tmp_path, names, tmp_path)
    assert cfg["arch"] == "qwen3" and cfg["qk_norm"] is True and cfg["qkv_bias"] is False
    assert cfg["head_dim"] == hd and cfg["rope_theta"] == 1000000.0
    assert cfg["chat_template"] == "J{{ x }}"
    vectors = sum(a.size for a in w.values() if a.ndim == 1)
    assert cfg["n_params"] == n_params(w)
    assert cfg["weight_bytes"] == 2 * (n_params(w) - vectors) + 4 * vectors
    for n in names:
        is_vec = w[n].ndim == 1
        assert cfg["weights"][n]["dtype"] == ("f32" if is_vec else "bf16")
        check_values(got[n], vals[file_name(n, True)])


def test_hf_errors(tmp_path):
    def folder(name, mutate=None, cfg_extra=None):
        d = tmp_path / name
        d.mkdir()
        w = random_weights("llama", tied=True, seed=3)
        hf = {file_name(k, True): v for k, v in w.items()}
        if mutate:
            mutate(hf)
        save_file(hf, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(hf_config("llama", True, **(cfg_extra or {}))))
        return d

    def bad_shape(hf):
        hf["model.layers.1.self_attn.q_proj.weight"] = np.zeros((D, 128), np.float32)

    err = dump_error(folder("shape", bad_shape))
    assert f"model.layers.1.self_attn.q_proj.weight: expected [{H * HD}, {D}], got [{D}, 128]" in err

    err = dump_error(folder("missing", lambda hf: hf.pop("model.layers.1.mlp.up_proj.weight")))
    assert "model.layers.1.mlp.up_proj.weight" in err and "missing" in err

    def int8(hf):
        hf["model.norm.weight"] = np.zeros(D, np.int8)

    err = dump_error(folder("int8", int8))
    assert "model.norm.weight: dtype I8 is not supported" in err

    def extra_bias(hf):
        hf["model.layers.0.self_attn.q_proj.bias"] = np.zeros(H * HD, np.float32)

    assert "q_proj.bias" in dump_error(folder("bias", extra_bias))
    assert "lm_head.weight" in dump_error(folder("untied", cfg_extra={"tie_word_embeddings": False}))
    assert "gemma" in dump_error(folder("arch", cfg_extra={"model_type": "gemma"}))
    assert "n_kv_heads" in dump_error(folder("kv", cfg_extra={"num_key_value_heads": 3}))

    # a sharded index may not reach outside its folder
    d = folder("escape")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "../escape/model.safetensors"}}))
    assert "not a plain file name" in dump_error(d)
    # not a model at all
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world")
    assert "not a GGUF file" in dump_error(junk)
    assert "No such file" in dump_error(tmp_path / "nope.gguf")


def test_st_listing_matches_safetensors(tmp_path):
    """tdm_st_open on a sharded folder: names, dtypes, reversed shapes and bytes."""
    rng = np.random.default_rng(4)
    a = {"x.f32": rng.standard_normal((3, 5, 7)).astype(np.float32),
         "x.f16": rng.standard_normal((2, 3, 4, 5)).astype(np.float16),
         "x.i8": rng.integers(-100, 100, (6, 2)).astype(np.int8),
         "x.f64": rng.standard_normal(9),
         "x.scalar": np.array(3.5, np.float32),
         "x.empty": np.zeros((0, 4), np.float32)}
    save_file({k: a[k] for k in ["x.f32", "x.i8", "x.scalar"]}, str(tmp_path / "s1.safetensors"))
    save_file({k: a[k] for k in ["x.f16", "x.f64", "x.empty"]}, str(tmp_path / "s2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "x.f32": "s1.safetensors", "x.i8": "s1.safetensors", "x.scalar": "s1.safetensors",
        "x.f16": "s2.safetensors", "x.f64": "s2.safetensors", "x.empty": "s2.safetensors"}}))
    args = [str(model_dump_bin()), "--st", str(tmp_path)]
    for k in a:
        args += [k, str(tmp_path / (k + ".bin"))]
    cp = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    listing = {t["name"]: t for t in json.loads(cp.stdout)}
    assert set(listing) == set(a)
    want_dtype = {"x.f32": "f32", "x.f16": "f16", "x.i8": "unsupported", "x.f64": "unsupported",
                  "x.scalar": "f32", "x.empty": "f32"}
    for k, v in a.items():
        assert listing[k]["dtype"] == want_dtype[k]
        assert listing[k]["ne"] == list(reversed(v.shape))
        assert listing[k]["nbytes"] == v.nbytes
        assert (tmp_path / (k + ".bin")).read_bytes() == v.tobytes()

    # the index names a shard that does not hold the tensor
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "x.f32": "s2.safetensors", "x.f16": "s2.safetensors"}}))
    cp = subprocess.run([str(model_dump_bin()), "--st", str(tmp_path)], capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 1 and "x.f32" in cp.stderr
    # a missing shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "x.f32": "s3.safetensors"}}))
    cp = subprocess.run([str(model_dump_bin()), "--st", str(tmp_path)], capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 1 and "s3.safetensors" in cp.stderr


# ---------------------------------------------------------------- GGUF


def random_q6_k(rows, cols, rng):
    """Random but finite Q6_K bytes (gguf-py has no Q6_K quantiser): random quants and scales,
    a small fp16 super-scale."""
    nb = rows * cols // 256
    blocks = rng.integers(0, 256, (nb, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return blocks.reshape(rows, cols // 256 * 210)


def write_gguf(path, arch, w, types, *, head_dim=HD, rope_freqs=None, kv=None, kv_count=True):
    """Writes `w` (dump name -> float32 array) with per-weight GGML types; returns the values a
    reader should see (after quantisation), from gguf.quants.dequantize."""
    rng = np.random.default_rng(5)
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(L)
    wr.add_context_length(2048)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(FF)
    wr.add_head_count(H)
    if kv_count:
        wr.add_head_count_kv(KV)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_rope_freq_base(100000.0)
    if head_dim != D // H:
        wr.add_key_length(head_dim)
        wr.add_value_length(head_dim)
    wr.add_token_list(TOKENS)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_chat_template("{{ gguf }}")
    if kv:
        kv(wr)
    expect = {}
    for name, a in w.items():
        t = types.get(name, QT.F32)
        fname = file_name(name, False)
        if t == QT.F32:
            wr.add_tensor(fname, a)
            expect[name] = a
        elif t == QT.F16:
            wr.add_tensor(fname, a.astype(np.float16))
            expect[name] = a.astype(np.float16).astype(np.float32)
        else:
            q = random_q6_k(*a.shape, rng) if t == QT.Q6_K else quants.quantize(a, t)
            wr.add_tensor(fname, q, raw_dtype=t)
            expect[name] = quants.dequantize(q, t).reshape(a.shape)
    if rope_freqs is not None:
        wr.add_tensor("rope_freqs.weight", rope_freqs)
        expect["rope_freqs"] = rope_freqs
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return expect


def test_gguf_llama_quant_types(tmp_path):
    w = random_weights("llama", tied=False, seed=6)
    types = {"tok_embd": QT.Q8_0, "output": QT.Q6_K, "layers.0.wq": QT.Q4_0,
             "layers.0.wk": QT.Q4_1, "layers.0.wv": QT.F16, "layers.0.wo": QT.BF16,
             "layers.0.w_gate": QT.Q6_K, "layers.0.w_up": QT.Q8_0, "layers.0.w_down": QT.Q6_K,
             "layers.1.wq": QT.Q4_1, "layers.1.w_down": QT.Q4_0}
    freqs = np.linspace(1.0, 8.0, HD // 2).astype(np.float32)
    path = tmp_path / "tiny-llama.gguf"
    expect = write_gguf(path, "llama", w, types, rope_freqs=freqs)
    names = sorted(w) + ["rope_freqs"]
    cfg, got = run_dump(path, names, tmp_path)
    assert (cfg["arch"], cfg["n_layers"], cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"],
            cfg["head_dim"], cfg["d_ff"], cfg["vocab_size"], cfg["max_ctx"]) == \
        ("llama", L, D, H, KV, HD, FF, V, 2048)
    assert cfg["is_gguf"] is True and cfg["rope_neox"] is False
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_eps"] == pytest.approx(1e-6, rel=1e-6)
    assert cfg["tied_embeddings"] is False and cfg["has_rope_freqs"] is True
    assert cfg["bos_id"] == 1 and sorted(cfg["eos_ids"]) == [2, IM_END, ENDOFTEXT]
    assert cfg["chat_template"] == "{{ gguf }}"
    assert cfg["n_params"] == n_params(w)
    held = {QT.Q8_0: "q8_0", QT.Q4_0: "q4_0", QT.Q4_1: "q4_1", QT.BF16: "bf16", QT.F32: "f32",
            QT.F16: "f32", QT.Q6_K: "f32"}
    for n in names:
        assert cfg["weights"][n]["dtype"] == held[types.get(n, QT.F32)], n
        check_values(got[n], expect[n], exact=False)
    # bytes held: quantised types at their block size, everything else as f32
    size = {QT.Q8_0: 34 / 32, QT.Q4_0: 18 / 32, QT.Q4_1: 20 / 32, QT.BF16: 2}
    want_bytes = sum(a.size * size.get(types.get(n, QT.F32), 4) for n, a in w.items())
    assert cfg["weight_bytes"] == int(want_bytes) + 4 * freqs.size
    # for the CUDA backend the K-quants stay in their blocks, with the same values
    cfg, got = run_dump(path, names, tmp_path, keep_k_blocks=True)
    held[QT.Q6_K] = "q6_K"
    for n in names:
        assert cfg["weights"][n]["dtype"] == held[types.get(n, QT.F32)], n
        check_values(got[n], expect[n], exact=False)
    size[QT.Q6_K] = 210 / 256
    want_bytes = sum(a.size * size.get(types.get(n, QT.F32), 4) for n, a in w.items())
    assert cfg["weight_bytes"] == int(want_bytes) + 4 * freqs.size


def test_gguf_qwen2_tied_bias(tmp_path):
    w = random_weights("qwen2", tied=True, seed=7)
    types = {n: QT.Q8_0 for n, a in w.items() if a.ndim == 2}
    path = tmp_path / "tiny-qwen2.gguf"
    expect = write_gguf(path, "qwen2", w, types)
    names = ["tok_embd", "output", "layers.1.bq", "layers.0.bk", "layers.0.bv", "layers.1.wq"]
    cfg, got = run_dump(path, names, tmp_path)
    assert cfg["arch"] == "qwen2" and cfg["qkv_bias"] is True and cfg["rope_neox"] is True
    assert cfg["tied_embeddings"] is True and cfg["output_is_tok_embd"] is True
    assert cfg["n_params"] == n_params(w)
    for n in names:
        check_values(got[n], expect["tok_embd" if n == "output" else n], exact=False)


def test_gguf_qwen3_qk_norm(tmp_path):
    hd = 32
    w = random_weights("qwen3", tied=False, head_dim=hd, seed=8)
    path = tmp_path / "tiny-qwen3.gguf"
    expect = write_gguf(path, "qwen3", w, {"layers.0.wq": QT.Q4_0}, head_dim=hd)
    names = ["layers.0.q_norm", "layers.1.k_norm", "layers.0.wq", "layers.1.wo"]
    cfg, got = run_dump(path, names, tmp_path)
    assert cfg["arch"] == "qwen3" and cfg["qk_norm"] is True and cfg["head_dim"] == hd
    assert cfg["rope_neox"] is True and cfg["qkv_bias"] is False
    for n in names:
        check_values(got[n], expect[n], exact=False)


def test_gguf_errors(tmp_path):
    w = random_weights("llama", tied=True, seed=9)
    bad = dict(w)
    bad["layers.1.wk"] = np.zeros((HD, D), np.float32)  # one kv head instead of two
    path = tmp_path / "bad-shape.gguf"
    write_gguf(path, "llama", bad, {})
    assert f"blk.1.attn_k.weight: expected [{KV * HD}, {D}], got [{HD}, {D}]" in dump_error(path)

    path = tmp_path / "missing.gguf"
    write_gguf(path, "llama", {k: v for k, v in w.items() if k != "layers.0.ffn_norm"}, {})
    assert "blk.0.ffn_norm.weight" in dump_error(path)

    path = tmp_path / "arch.gguf"
    write_gguf(path, "gemma", w, {})
    err = dump_error(path)
    assert "gemma" in err and "not supported" in err


def test_gguf_config_variants(tmp_path):
    w = random_weights("llama", tied=True, seed=10)
    # no head_count_kv: as many kv heads as heads (so wk/wv are square here)
    full = dict(w)
    for i in range(L):
        full[f"layers.{i}.wk"] = np.zeros((H * HD, D), np.float32)
        full[f"layers.{i}.wv"] = np.zeros((H * HD, D), np.float32)
    path = tmp_path / "mha.gguf"

    def linear(wr):
        wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        wr.add_rope_scaling_factor(4.0)
        wr.add_eot_token_id(5)
        wr.add_uint32("general.sampling.top_k", 40)
        wr.add_float32("general.sampling.temp", 0.7)

    write_gguf(path, "llama", full, {}, kv=linear, kv_count=False)
    cfg, _ = run_dump(path, [], tmp_path)
    assert cfg["n_kv_heads"] == H and cfg["vocab_size"] == len(TOKENS)
    assert cfg["rope_scaling"] == "linear" and cfg["rope_factor"] == 4.0
    assert sorted(cfg["eos_ids"]) == [2, 5, IM_END, ENDOFTEXT]
    assert cfg["gen_top_k"] == 40 and cfg["gen_temperature"] == pytest.approx(0.7)
    assert cfg["gen_top_p"] is None

    cases = {
        "moe": (lambda wr: wr.add_expert_count(8), "expert"),
        "yarn": (lambda wr: wr.add_rope_scaling_type(gguf.RopeScalingType.YARN), "yarn"),
        "partial-rope": (lambda wr: wr.add_rope_dimension_count(HD // 2), "partial rotary"),
        "big-eos": (lambda wr: wr.add_uint32("tokenizer.ggml.eot_token_id", 10 ** 6), "eos"),
        "kv-type": (lambda wr: wr.add_string("llama.attention.head_count_kv", "2"), "head_count_kv"),
    }
    for name, (kv, msg) in cases.items():
        path = tmp_path / f"{name}.gguf"
        write_gguf(path, "llama", w, {}, kv=kv, kv_count=name != "kv-type")
        assert msg in dump_error(path), name


# ---------------------------------------------------------------- the default model


def test_default_model(default_model, tmp_path):
    cfg, got = run_dump(default_model, ["output_norm"], tmp_path)
    assert cfg["arch"] == "llama"
    assert (cfg["n_layers"], cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"],
            cfg["d_ff"], cfg["vocab_size"]) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg["tied_embeddings"] is True and cfg["output_is_tok_embd"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_neox"] is False
    assert cfg["n_params"] == pytest.approx(134.5e6, rel=2e-3)
    assert 2 in cfg["eos_ids"] and cfg["bos_id"] == 1
    assert "<|im_start|>" in cfg["chat_template"]
    # independent read of the same tensor with the gguf package
    r = gguf.GGUFReader(str(default_model))
    t = next(t for t in r.tensors if t.name == "output_norm.weight")
    check_values(got["output_norm"], np.asarray(t.data, dtype=np.float32))
