"""`tandem checkpoint`: random-weight HF checkpoints.

Independent references: the files are read back with the `safetensors` package (its own parser)
and `json`; the expected tensor names and shapes are spelled out here from the HF Llama / Qwen2 /
Qwen3 module layout (model.layers.N.self_attn.q_proj.weight is [heads*head_dim, hidden], ...), and
the named shapes' sizes from the published checkpoints (Llama-3.1-8B: 8,030,261,248 parameters,
index total_size 16,060,522,496 bytes in 4 shards; Llama-3.2-1B: 1,235,814,400 parameters;
SmolLM2-135M: 134,515,008 parameters). Then tandem's own loader, `info` and `generate` must accept
what was written.
"""
import hashlib
import json

import numpy as np
import pytest
import safetensors

from conftest import run_tandem

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "vocab_size": 300, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu"}


def expected_tensors(cfg):
    """HF names and shapes for a llama / qwen2 / qwen3 config, written out from the module
    layout (nn.Linear weights are [out_features, in_features])."""
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim", h // heads)
    ff, V = cfg["intermediate_size"], cfg["vocab_size"]
    mt = cfg["model_type"]
    out = {"model.embed_tokens.weight": [V, h], "model.norm.weight": [h]}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = [V, h]
    for i in range(L):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [heads * hd, h],
            p + "self_attn.k_proj.weight": [kvh * hd, h],
            p + "self_attn.v_proj.weight": [kvh * hd, h],
            p + "self_attn.o_proj.weight": [h, heads * hd],
            p + "mlp.gate_proj.weight": [ff, h],
            p + "mlp.up_proj.weight": [ff, h],
            p + "mlp.down_proj.weight": [h, ff],
        })
        if mt == "qwen2":
            out.update({p + "self_attn.q_proj.bias": [heads * hd],
                        p + "self_attn.k_proj.bias": [kvh * hd],
                        p + "self_attn.v_proj.bias": [kvh * hd]})
        if mt == "qwen3":
            out.update({p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]})
    return out


def read_tensors(folder):
    """{name: (dtype, shape, float32 array)} over every safetensors file in the folder."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in safetensors.deserialize(f.read_bytes()):
            raw = bytes(t["data"])
            if t["dtype"] == "BF16":
                a = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif t["dtype"] == "F16":
                a = np.frombuffer(raw, np.float16).astype(np.float32)
            else:
                a = np.frombuffer(raw, np.float32)
            assert name not in out, f"{name} in two files"
            out[name] = (t["dtype"], list(t["shape"]), a.reshape(t["shape"]))
    return out


def write(tmp_path, cfg, *args, name="ck"):
    cfg_path = tmp_path / f"{name}-config.json"
    cfg_path.write_text(json.dumps(cfg))
    out = tmp_path / name
    run_tandem(["checkpoint", "--config", cfg_path, "--out", out, *args])
    return out


def sha(folder):
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("dtype,st_dtype,torch", [("bf16", "BF16", "bfloat16"),
                                                  ("f16", "F16", "float16"),
                                                  ("f32", "F32", "float32")])
def test_names_shapes_dtypes_values(tmp_path, tandem_bin, dtype, st_dtype, torch):
    out = write(tmp_path, TINY, "--dtype", dtype, "--seed", "5")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == torch
    assert {k: v for k, v in cfg.items() if k != "torch_dtype"} == TINY
    assert (out / "model.safetensors").exists()
    assert not (out / "model.safetensors.index.json").exists()
    got = read_tensors(out)
    want = expected_tensors(TINY)
    assert {k: v[1] for k, v in got.items()} == want
    assert all(v[0] == st_dtype for v in got.values())
    for name, (_, _, a) in got.items():
        if name.endswith("norm.weight"):
            assert np.all(a == 1.0), name
        else:  # N(0, 0.02^2)-like, bounded by the Irwin-Hall support (3.46 std)
            assert abs(float(a.mean())) < 0.004, name
            assert 0.017 < float(a.std()) < 0.023, name
            assert float(np.abs(a).max()) <= 0.02 * 3.47, name
    # every matrix is different (streams keyed by tensor)
    mats = [a for n, (_, _, a) in got.items() if not n.endswith("norm.weight")]
    assert len({m.tobytes()[:64] for m in mats}) == len(mats)


def test_std_and_initializer_range(tmp_path, tandem_bin):
    cfg = dict(TINY, initializer_range=0.05)
    a = read_tensors(write(tmp_path, cfg, "--dtype", "f32", name="ir"))
    assert 0.045 < a["model.embed_tokens.weight"][2].std() < 0.055
    b = read_tensors(write(tmp_path, TINY, "--dtype", "f32", "--std", "0.1", name="std"))
    assert 0.09 < b["lm_head.weight"][2].std() < 0.11


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_archs_names_and_loader(tmp_path, tandem_bin, arch):
    cfg = dict(TINY, model_type=arch)
    if arch == "qwen3":
        cfg["head_dim"] = 32  # differs from hidden / heads = 16, as in real Qwen3
    out = write(tmp_path, cfg)
    got = read_tensors(out)
    assert {k: v[1] for k, v in got.items()} == expected_tensors(cfg)
    for name, (_, _, a) in got.items():
        if name.endswith(".bias"):
            assert np.all(a == 0.0)
    info = json.loads(run_tandem(["info", "--model", out, "--json"]).stdout)
    assert info["arch"] == arch and info["head_dim"] == cfg.get("head_dim", 16)
    assert info["qkv_bias"] == (arch == "qwen2") and info["qk_norm"] == (arch == "qwen3")


def test_loader_info_and_generate(tmp_path, tandem_bin):
    out = write(tmp_path, TINY, "--seed", "1")
    info = json.loads(run_tandem(["info", "--model", out, "--json"]).stdout)
    assert info["format"] == "safetensors" and info["arch"] == "llama"
    assert (info["n_layers"], info["d_model"], info["n_heads"], info["n_kv_heads"],
            info["d_ff"], info["vocab_size"]) == (2, 64, 4, 2, 96, 300)
    assert info["tied_embeddings"] is False
    n_params = sum(int(np.prod(s)) for s in expected_tensors(TINY).values())
    assert info["n_params"] == n_params
    assert info["tensor_types"] == {"bf16": len(expected_tensors(TINY))}
    logits = tmp_path / "logits.f32"
    cp = run_tandem(["generate", "--model", out, "--prompt-tokens", "1,2,3", "--max-tokens", "4",
                     "--temperature", "0", "--print-token-ids", "--dump-logits", logits])
    ids = [int(x) for x in cp.stdout.split()]
    assert len(ids) == 4 and all(0 <= i < 300 for i in ids)
    lg = np.fromfile(logits, np.float32)
    assert lg.size > 0 and np.all(np.isfinite(lg))  # the random model stays numerically sane
    assert 0 < lg.std() < 100


def test_sharding_and_index(tmp_path, tandem_bin):
    # bf16: embed/lm_head 300*64*2 = 38400 bytes; with a 40000-byte cap they sit alone
    out = write(tmp_path, TINY, "--max-shard-bytes", "40000", "--seed", "2")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for f in files:
        assert (out / f).stat().st_size <= 40000 + 8 + 4096  # data + header
    got = read_tensors(out)
    assert set(index["weight_map"]) == set(got) == set(expected_tensors(TINY))
    for name, f in index["weight_map"].items():
        names = [t[0] for t in safetensors.deserialize((out / f).read_bytes())]
        assert name in names
    assert index["metadata"]["total_size"] == sum(a.nbytes // 2 for _, _, a in got.values())
    # the same weights as the unsharded file with the same seed
    single = read_tensors(write(tmp_path, TINY, "--seed", "2", name="single"))
    for k in single:
        assert np.array_equal(single[k][2], got[k][2])
    info = json.loads(run_tandem(["info", "--model", out, "--json"]).stdout)
    assert info["n_tensors"] == len(got)


def test_determinism(tmp_path, tandem_bin):
    a = write(tmp_path, TINY, "--seed", "9", "--threads", "1", name="a")
    b = write(tmp_path, TINY, "--seed", "9", "--threads", "2", name="b")
    c = write(tmp_path, TINY, "--seed", "10", name="c")
    assert sha(a) == sha(b)
    assert sha(a) != sha(c)
    ta, tc = read_tensors(a), read_tensors(c)
    assert not np.array_equal(ta["lm_head.weight"][2], tc["lm_head.weight"][2])


def test_smollm2_shape(tmp_path, tandem_bin):
    out = tmp_path / "smol"
    run_tandem(["checkpoint", "--shape", "smollm2-135m", "--out", out])
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"],
            cfg["tie_word_embeddings"], cfg["rope_theta"]) == (576, 30, 9, 3, 1536, 49152, True,
                                                               100000.0)
    info = json.loads(run_tandem(["info", "--model", out, "--json"]).stdout)
    assert info["n_params"] == 134_515_008
    cp = run_tandem(["generate", "--model", out, "--prompt-tokens", "1,2,3", "--max-tokens", "2",
                     "--temperature", "0", "--print-token-ids"])
    assert len(cp.stdout.split()) == 2


@pytest.mark.parametrize("shape,params,total,shards,tied,rope_factor,hidden", [
    ("llama-3.1-8b", 8_030_261_248, 16_060_522_496, 4, False, 8.0, 4096),
    ("llama-3.2-1b", 1_235_814_400, 2_471_628_800, 1, True, 32.0, 2048),
])
def test_named_shapes_plan(tandem_bin, shape, params, total, shards, tied, rope_factor, hidden):
    plan = json.loads(run_tandem(["checkpoint", "--shape", shape, "--dry-run"]).stdout)
    assert plan["n_params"] == params
    assert plan["metadata"]["total_size"] == total
    assert plan["n_shards"] == shards
    cfg = plan["config"]
    assert cfg["hidden_size"] == hidden and cfg["tie_word_embeddings"] is tied
    assert cfg["num_attention_heads"] == 32 and cfg["num_key_value_heads"] == 8
    assert cfg["vocab_size"] == 128256 and cfg["rope_theta"] == 500000.0
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["max_position_embeddings"] == 131072
    assert cfg["rope_scaling"] == {"factor": rope_factor, "high_freq_factor": 4.0,
                                   "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192,
                                   "rope_type": "llama3"}
    assert cfg["torch_dtype"] == "bfloat16"
    assert set(plan["weight_map"]) == set(expected_tensors(cfg))
    assert len(set(plan["weight_map"].values())) == shards


def test_refuses_to_overwrite(tmp_path, tandem_bin):
    out = write(tmp_path, TINY)
    cfg_path = tmp_path / "ck-config.json"
    cp = run_tandem(["checkpoint", "--config", cfg_path, "--out", out], check=False)
    assert cp.returncode == 1 and "--force" in cp.stderr
    run_tandem(["checkpoint", "--config", cfg_path, "--out", out, "--force"])


BAD = [
    (["--out", "X"], "--shape or --config"),
    (["--shape", "llama-3.2-1b"], "--out"),
    (["--shape", "llama-3.2-1b", "--config", "C", "--out", "X"], "--shape or --config"),
    (["--shape", "gpt-5", "--out", "X"], "--shape"),
    (["--config", "C", "--out", "X", "--dtype", "f64"], "--dtype"),
    (["--config", "C", "--out", "X", "--seed", "-1"], "--seed"),
    (["--config", "C", "--out", "X", "--std", "0"], "--std"),
    (["--config", "C", "--out", "X", "--max-shard-bytes", "0"], "--max-shard-bytes"),
    (["--config", "/nonexistent.json", "--out", "X"], "--config"),
    (["--config", "C", "--out", "X", "--bogus"], "unknown"),
    (["--config", "C", "--out", "X", "extra"], "unexpected"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_args_exit_2(tmp_path, tandem_bin, args, needle):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(TINY))
    args = [str(cfg) if a == "C" else str(tmp_path / "out") if a == "X" else a for a in args]
    cp = run_tandem(["checkpoint", *args], check=False)
    assert cp.returncode == 2, cp.stderr
    assert needle in cp.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cfg,needle", [
    ([1, 2], "not a JSON object"),
    (dict(TINY, model_type="gpt2"), "model_type"),
    ({k: v for k, v in TINY.items() if k != "hidden_size"}, "hidden_size"),
    (dict(TINY, num_key_value_heads=3), "num_key_value_heads"),
    (dict(TINY, vocab_size=0), "vocab_size"),
    (dict(TINY, num_hidden_layers="2"), "num_hidden_layers"),
    (dict(TINY, tie_word_embeddings="yes"), "tie_word_embeddings"),
])
def test_bad_configs_exit_2(tmp_path, tandem_bin, cfg, needle):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg))
    cp = run_tandem(["checkpoint", "--config", p, "--out", tmp_path / "out"], check=False)
    assert cp.returncode == 2, cp.stderr
    assert needle in cp.stderr
    assert not (tmp_path / "out").exists()
