"""`tandem bench model` on the CPU: it runs on a tiny random checkpoint, with a decode context
longer than one forward call's batch (the context is filled in chunks), on each KV element type,
and refuses a bad one."""
import re

import pytest

from conftest import run_tandem
from lib.checkpoints import make_gguf_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_gguf_checkpoint(tmp_path_factory.mktemp("bench-model") / "tiny.gguf", "llama",
                                seed=41, num_hidden_layers=2, max_position_embeddings=2048)


@pytest.mark.parametrize("kv", ["f32", "bf16", "f16"])
def test_bench_model_long_context(tiny, kv):
    # 8 sequences of 600 positions: 4,800 tokens, nine times the engine's 512-token batch
    cp = run_tandem(["bench", "model", "--model", tiny, "--threads", "1", "--prompt-len", "16",
                     "--gen", "2", "--context", "600", "--kv-dtype", kv])
    assert f"KV cache: {kv}," in cp.stdout, cp.stdout
    rows = re.findall(r"^\s+batch (\d+)\s+([\d.]+)", cp.stdout, re.M)
    assert [b for b, _ in rows] == ["1", "8"], cp.stdout
    assert all(float(r) > 0 for _, r in rows), cp.stdout


def test_bench_model_exact_activations(tmp_path):
    """--exact-activations: the CPU's fp32 activations for quantised matrices, said in the
    header; without it, the default quantised ones (src/backend/cpu/qdot.c). Greedy decoding on
    a random model: the two paths' token checksums may differ; each is the same run to run."""
    path = make_gguf_checkpoint(tmp_path / "q4.gguf", "llama", seed=43, wtype="Q4_1",
                                num_hidden_layers=2)
    args = ["bench", "model", "--model", path, "--threads", "2", "--prompt-len", "8", "--gen",
            "4", "--context", "8"]
    runs = {}
    for exact in (False, True, False):
        cp = run_tandem(args + (["--exact-activations"] if exact else []))
        want = "fp32 (--exact-activations)" if exact else "quantised (16-bit)"
        assert f"activations of Q8_0/Q4_0/Q4_1 matrices: {want}" in cp.stdout, cp.stdout
        runs.setdefault(exact, []).append(re.search(r"checksum of greedy tokens: (\w+)",
                                                    cp.stdout).group(1))
    assert runs[False][0] == runs[False][1], runs


def test_bench_model_bad_kv_dtype(tiny):
    cp = run_tandem(["bench", "model", "--model", tiny, "--kv-dtype", "q8"], check=False)
    assert cp.returncode == 2
    assert "--kv-dtype: 'q8' is not f32, bf16 or f16" in cp.stderr


def test_bench_model_counts_expert_passes(tmp_path):
    """A mixture-of-experts model: the roofline counts the experts the steps ran. At batch 1 a
    token runs exactly k experts in each sparse layer; at batch 8 at least that many and at
    most every expert of every sparse layer."""
    path = make_gguf_checkpoint(tmp_path / "moe.gguf", "qwen3_moe", seed=42, num_hidden_layers=3,
                                num_experts=6, num_experts_per_tok=2)
    cp = run_tandem(["bench", "model", "--model", path, "--threads", "1", "--prompt-len", "8",
                     "--gen", "4", "--context", "16"])
    assert "(2 of 6 experts a token, 3 sparse layers)" in cp.stdout, cp.stdout
    passes = dict(re.findall(r"^\s+batch (\d+) .*\(([\d.]+) expert passes a step", cp.stdout,
                             re.M))
    assert float(passes["1"]) == 2 * 3, cp.stdout
    assert 2 * 3 <= float(passes["8"]) <= 6 * 3, cp.stdout


@pytest.mark.parametrize("shape,layers,experts,want", [
    # Qwen3-30B-A3B: every layer sparse, 8 experts a token
    ("qwen3-30b-a3b", 1, 12, "(8 of 12 experts a token, 1 sparse layers)"),
    # DeepSeek-V2-Lite: the first layer dense, 6 experts a token, a latent row a position
    ("deepseek-v2-lite", 2, 8, "(6 of 8 experts a token, 1 sparse layers)"),
])
def test_bench_model_shapes(shape, layers, experts, want):
    """--shape builds the real widths with random weights (fewer layers and experts), runs,
    and counts the experts a batch-1 token takes in each sparse layer."""
    cp = run_tandem(["bench", "model", "--shape", shape, "--layers", str(layers), "--experts",
                     str(experts), "--threads", "2", "--prompt-len", "8", "--gen", "2",
                     "--context", "4"])
    assert f"random {shape} shape ({layers} of " in cp.stdout, cp.stdout
    assert want in cp.stdout, cp.stdout
    passes = dict(re.findall(r"^\s+batch (\d+) .*\(([\d.]+) expert passes a step", cp.stdout,
                             re.M))
    assert float(passes["1"]) == (8 if shape.startswith("qwen3") else 6), cp.stdout
    assert "kv pages after the run: 0 used" in cp.stdout
    if shape == "deepseek-v2-lite":  # one latent row of 512 + 64 f32 a layer and position
        assert "KV cache: f32, 4 KiB a position" in cp.stdout, cp.stdout


@pytest.mark.parametrize("args,needle", [
    (["--shape", "llama-9000"], "unknown --shape 'llama-9000'"),
    (["--shape", "qwen3-30b-a3b", "--model", "x.gguf"], "give --model or --shape, not both"),
    (["--layers", "2"], "--layers and --experts go with --shape"),
])
def test_bench_model_shape_errors(args, needle):
    cp = run_tandem(["bench", "model"] + args, check=False)
    assert cp.returncode == 2 and needle in cp.stderr, cp.stderr
