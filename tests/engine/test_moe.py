"""Mixture-of-experts models (issue 18, item 1): what the fidelity tests (test_fidelity.py, the
*qwen3moe*, *qwen2moe* and *mixtral* variants against the numpy reference) do not cover: configs that must be refused with a clear message, the model's
description, batch invariance of the routed FFN under concurrent requests, and the
tokens-per-expert metric."""
import concurrent.futures as cf
import json

import pytest

from conftest import run_tandem
from lib.checkpoints import make_gguf_checkpoint, make_hf_checkpoint
from lib.server import Server


def info(path):
    return json.loads(run_tandem(["info", "--model", str(path), "--json"]).stdout)


def refused(path):
    cp = run_tandem(["info", "--model", str(path)], check=False)
    assert cp.returncode != 0, cp.stdout
    return cp.stderr


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_describes_experts(tmp_path):
    hf = make_hf_checkpoint(tmp_path / "q", "qwen3_moe", seed=50, num_hidden_layers=4,
                            decoder_sparse_step=2, norm_topk_prob=False)
    d = info(hf)
    # transformers' rule: layer l is sparse when (l + 1) % decoder_sparse_step == 0
    assert (d["n_experts"], d["n_experts_used"], d["d_ff_expert"], d["sparse_layers"]) == \
        (4, 2, 48, 2)
    assert d["moe_norm_topk"] is False
    # gate, up and down of every expert of the two sparse layers, f32
    assert d["expert_weight_bytes"] == 2 * 4 * 3 * 48 * 64 * 4
    g = info(make_gguf_checkpoint(tmp_path / "m.gguf", "mixtral", seed=51))
    assert g["arch"] == "llama" and g["n_experts"] == 4 and g["moe_norm_topk"] is True
    assert g["sparse_layers"] == 2 and g["d_ff_expert"] == 128
    assert "n_experts" not in info(make_hf_checkpoint(tmp_path / "dense", "qwen3", seed=52))


@pytest.mark.parametrize("changes,needle", [
    (dict(num_experts=0), "num_experts 0 must be >= 1"),
    (dict(num_experts_per_tok=5), "experts per token = 5 outside [1, 4]"),
    (dict(num_experts_per_tok=0), "experts per token = 0 outside [1, 4]"),
    (dict(moe_intermediate_size=0), "expert FFN width = 0"),
    (dict(mlp_only_layers=[7]), "mlp_only_layers[0] is not a layer index below 2"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step 0 must be >= 1"),
    (dict(model_type="mamba"), 'model_type "mamba" is not supported'),
    (dict(moe_intermediate_size=40), "expected [40, 64], got [48, 64]"),
])
def test_bad_configs_refused(tmp_path, changes, needle):
    path = make_hf_checkpoint(tmp_path / "q", "qwen3_moe", seed=53)
    edit_config(path, **changes)
    err = refused(path)
    assert needle in err, err


def test_missing_expert_refused(tmp_path):
    from safetensors.numpy import load_file, save_file
    path = make_hf_checkpoint(tmp_path / "q", "qwen3_moe", seed=54)
    w = load_file(str(path / "model.safetensors"))
    del w["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(w, str(path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.down_proj.weight: tensor missing" in refused(path)


def test_gguf_bad_expert_count(tmp_path):
    import gguf
    path = make_gguf_checkpoint(tmp_path / "m.gguf", "qwen3_moe", seed=55)
    # the same tensors, with more experts a token than there are
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "qwen3moe")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        if f.name == "qwen3moe.expert_used_count":
            w.add_uint32(f.name, 9)
            continue
        v = f.contents()
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(f.name, v)
        else:
            w.add_key_value(f.name, v, vt)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "experts per token = 9 outside [1, 4]" in refused(tmp_path / "bad.gguf")


def test_qwen2moe_needs_its_shared_expert(tmp_path):
    path = make_hf_checkpoint(tmp_path / "q", "qwen2_moe", seed=57)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["shared_expert_intermediate_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert '"shared_expert_intermediate_size" is missing' in refused(path)
    d = info(make_hf_checkpoint(tmp_path / "ok", "qwen2_moe", seed=57))
    assert d["arch"] == "qwen2" and d["qkv_bias"] is True and d["n_experts"] == 4


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_routed_rows_are_batch_invariant(tmp_path, arch):
    """Four requests at once give the tokens and log-probabilities each gets alone: a row's
    experts run on whatever rows share them, and its result must not depend on them
    (--batch-invariant: our kernels, not OpenBLAS; DeepSeek: its grouped sigmoid routing and
    the latent attention too). Every token a forward step ran went through k experts in each
    sparse layer, which the metric counts."""
    extra = dict(first_k_dense_replace=0, kv_b_split=True) if arch == "deepseek_v3" else {}
    path = make_gguf_checkpoint(tmp_path / "q.gguf", arch, seed=56, num_hidden_layers=2,
                                num_experts=8, num_experts_per_tok=2, **extra)
    s = Server(["--model", str(path), "--threads", "2", "--batch-invariant"])
    try:
        prompts = [[(7 * i + 13 * j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(4)]

        def run(p):
            st, r = s.post("/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True, "logprobs": 0})
            assert st == 200, r
            lp = r["choices"][0]["logprobs"]
            return lp["tokens"], lp["token_logprobs"]

        # the memory plan's line: the experts held, and what a token reads of them
        assert "experts: 8 in each of 2 sparse layers, 2 a token:" in s.logs(), s.logs()
        alone = [run(p) for p in prompts]
        with cf.ThreadPoolExecutor(4) as ex:
            together = list(ex.map(run, prompts))
        assert together == alone
        m = s.metrics()
        counts = [v for (name, _), v in m.items() if name == "tandem_moe_expert_tokens_total"]
        assert len(counts) == 8
        total = sum(counts)
        # 2 sparse layers x 2 experts a token, and at least every prompt token twice
        assert total % 4 == 0 and total >= 4 * 2 * sum(len(p) for p in prompts)
        assert sum(1 for c in counts if c) >= 4  # the router spreads tokens
    finally:
        s.stop()


def test_describes_deepseek(tmp_path):
    d = info(make_hf_checkpoint(tmp_path / "v3", "deepseek_v3", seed=70, num_hidden_layers=3))
    assert d["arch"] == "deepseek2" and d["n_kv_heads"] == 1 and d["head_dim"] == 32 + 8
    assert d["mla"] == dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16)
    assert (d["n_experts"], d["sparse_layers"], d["moe_scoring"], d["moe_groups"],
            d["moe_groups_used"], d["d_ff_shared"]) == (8, 2, "sigmoid", 4, 2, 48)
    assert d["moe_routed_scale"] == 2.5 and d["rope_neox"] is False
    g = info(make_gguf_checkpoint(tmp_path / "v2.gguf", "deepseek_v2", seed=71,
                                  kv_b_split=True))
    assert g["arch"] == "deepseek2" and g["mla"]["q_lora_rank"] == 0
    assert (g["moe_scoring"], g["moe_groups"], g["moe_routed_scale"]) == ("softmax", 0, 1.5)
    text = run_tandem(["info", "--model", str(tmp_path / "v2.gguf")]).stdout
    assert "mla          q_lora 0, kv_lora 32, heads of 16 + 8 (rope), values 16" in text


@pytest.mark.parametrize("changes,needle", [
    (dict(n_routed_experts=0), "n_routed_experts 0 must be >= 1"),
    (dict(num_experts_per_tok=9), "experts per token = 9 outside [1, 8]"),
    (dict(topk_group=5), "expert groups a token takes = 5 outside [1, 4]"),
    (dict(n_group=3), "8 experts do not split into 3 groups"),
    (dict(num_experts_per_tok=5, topk_group=2), "5 experts a token, but its 2 groups hold only 4"),
    (dict(n_group=8, topk_group=4), "groups of one expert cannot be scored by their best two"),
    (dict(kv_lora_rank=0), "kv_lora_rank 0 must be >= 1"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim 7 is odd"),
    (dict(kv_lora_rank=2000), "kv_lora_rank = 2000 outside [1, 1024]"),
    (dict(scoring_func="tanh"), 'scoring_func "tanh" (softmax, sigmoid)'),
    (dict(topk_method="random"), 'topk_method "random"'),
    (dict(routed_scaling_factor=-1.0), "routed_scaling_factor -1 must be > 0"),
    (dict(v_head_dim=20), "self_attn.o_proj.weight: expected [64, 80], got [64, 64]"),
    (dict(q_lora_rank=None), "model.layers.0.self_attn.q_proj.weight: tensor missing"),
])
def test_bad_deepseek_configs_refused(tmp_path, changes, needle):
    path = make_hf_checkpoint(tmp_path / "v3", "deepseek_v3", seed=72)
    edit_config(path, **changes)
    err = refused(path)
    assert needle in err, err
