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
        assert f"activations of Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices: {want}" in cp.stdout, cp.stdout
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


# --compare-llama-cpp: the user's llama-bench (and llama-batched-bench beside it) on the same
# GGUF. Stand-ins here print canned -o json / jsonl and log their arguments, so the test checks
# the commands tandem runs, the parsing, the interleaving and the ratios of the medians.
FAKE_BENCH = r"""#!/bin/sh
echo "$0 $*" >> "$(dirname "$0")/calls.log"
case " $* " in
  *" -n 0 "*) ts=$PP ;;
  *) ts=$TG ;;
esac
printf '[{"build_commit": "abc1234", "build_number": 42, "n_threads": 1, "avg_ts": %s}]\n' "$ts"
"""
FAKE_BATCHED = r"""#!/bin/sh
echo "$0 $*" >> "$(dirname "$0")/calls.log"
echo 'some log line'
echo '{"pp": 8, "tg": 2, "pl": 1, "n_kv": 10, "speed_tg": 1.5}'
echo '{"pp": 8, "tg": 2, "pl": 8, "n_kv": 80, "speed_tg": 40.0}'
"""


def _fake(dirpath, name, text):
    p = dirpath / name
    p.write_text(text)
    p.chmod(0o755)
    return p


def test_bench_model_compare_llama_cpp(tiny, tmp_path, monkeypatch):
    bench = _fake(tmp_path, "llama-bench", FAKE_BENCH)
    _fake(tmp_path, "llama-batched-bench", FAKE_BATCHED)
    monkeypatch.setenv("PP", "1000")
    monkeypatch.setenv("TG", "20")
    cp = run_tandem(["bench", "model", "--model", tiny, "--threads", "1", "--prompt-len", "16",
                     "--gen", "2", "--context", "8", "--compare-llama-cpp", bench, "--rounds",
                     "3"])
    out = cp.stdout
    # interleaved: tandem first in rounds 1 and 3, llama.cpp first in round 2
    order = re.findall(r"^  round (\d), (tandem|llama\.cpp)", out, re.M)
    assert order == [("1", "tandem"), ("1", "llama.cpp"), ("2", "llama.cpp"), ("2", "tandem"),
                     ("3", "tandem"), ("3", "llama.cpp")], out
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 9, calls
    want = [f"{bench} -m {tiny} -t 1 -r 1 -o json -p 16 -n 0",
            f"{bench} -m {tiny} -t 1 -r 1 -o json -p 0 -n 2 -d 8",
            f"{tmp_path}/llama-batched-bench -m {tiny} -t 1 -c 144 -npp 8 -ntg 2 -npl 8 "
            "--output-format jsonl"]
    assert calls == want * 3, calls
    ours = {}
    for key, pat in (("prefill", r"prefill: 16 tokens in [\d.]+ s = ([\d.]+)"),
                     ("1", r"^\s+batch 1\s+([\d.]+)"), ("8", r"^\s+batch 8\s+([\d.]+)")):
        vals = sorted(float(v) for v in re.findall(pat, out, re.M))
        assert len(vals) == 3, out
        ours[key] = vals[1]
    rows = dict((name, (float(a), float(b), float(r))) for name, a, b, r in re.findall(
        r"^  (prefill, 16 tokens|decode, batch [18])\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", out,
        re.M))
    assert set(rows) == {"prefill, 16 tokens", "decode, batch 1", "decode, batch 8"}, out
    for name, key, theirs in (("prefill, 16 tokens", "prefill", 1000.0),
                              ("decode, batch 1", "1", 20.0), ("decode, batch 8", "8", 40.0)):
        a, b, r = rows[name]
        assert b == theirs and abs(a - ours[key]) <= 0.051, (name, rows[name], ours)
        assert abs(r - a / b) <= 0.006 + 0.051 / b, (name, rows[name])
    assert "llama.cpp build: abc1234 (build 42)" in out


def test_bench_model_compare_llama_cpp_without_batched(tiny, tmp_path, monkeypatch):
    """No llama-batched-bench beside llama-bench: no batch-8 figure for llama.cpp."""
    bench = _fake(tmp_path, "llama-bench", FAKE_BENCH)
    monkeypatch.setenv("PP", "1000")
    monkeypatch.setenv("TG", "20")
    cp = run_tandem(["bench", "model", "--model", tiny, "--threads", "1", "--prompt-len", "8",
                     "--gen", "2", "--context", "4", "--compare-llama-cpp", bench, "--rounds",
                     "1"])
    assert re.search(r"^  decode, batch 8\s+[\d.]+\s+n/a\s+n/a$", cp.stdout, re.M), cp.stdout
    assert "no llama-batched-bench beside it" in cp.stdout


@pytest.mark.parametrize("case", ["missing", "not-executable", "fails", "bad-json", "shape",
                                  "rounds-alone"])
def test_bench_model_compare_llama_cpp_errors(tiny, tmp_path, monkeypatch, case):
    bench = tmp_path / "llama-bench"
    args = ["bench", "model", "--model", tiny, "--threads", "1", "--prompt-len", "8", "--gen",
            "2", "--context", "4", "--compare-llama-cpp", bench]
    want_rc, want = 2, None
    if case == "missing":
        want = f"{bench}: No such file or directory"
    elif case == "not-executable":
        bench.write_text("#!/bin/sh\n")
        want = f"{bench} is not an executable file"
    elif case == "fails":
        _fake(tmp_path, "llama-bench", "#!/bin/sh\necho 'error: unknown argument' >&2\nexit 3\n")
        want_rc, want = 1, "failed (exit status 3)"
    elif case == "bad-json":
        _fake(tmp_path, "llama-bench", "#!/bin/sh\necho '| model | size |'\n")
        want_rc, want = 1, "llama-bench's output is not one test's -o json"
    elif case == "shape":
        _fake(tmp_path, "llama-bench", FAKE_BENCH)
        args = ["bench", "model", "--shape", "qwen3-30b-a3b", "--compare-llama-cpp", bench]
        want = "--compare-llama-cpp runs one engine on a GGUF file: not with --shape"
    else:
        args = ["bench", "model", "--model", tiny, "--rounds", "2"]
        want = "--rounds goes with --compare-llama-cpp"
    cp = run_tandem(args, check=False)
    assert cp.returncode == want_rc, (cp.returncode, cp.stderr)
    assert want in cp.stderr, cp.stderr
    if case == "fails":
        assert "error: unknown argument" in cp.stderr, cp.stderr
