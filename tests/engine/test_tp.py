"""Tensor parallelism inside one process (`--tp N`, issue 17 item 1; DESIGN.md section 5).

A sharded engine runs N ranks, each with its query and KV heads and its MLP columns, summing
the partial output projections after attention and after the MLP. Sums in another order give
other floats, so the contract checked here is:
  - greedy tokens identical to --tp 1, and to the independent numpy reference (whose greedy run
    has no near tie: tie_free_prompt);
  - logits of the last prompt position within TOL_TP1 of --tp 1's (measured: below 1e-6
    relative on these models) and within the fidelity bound (1e-4) of the reference.
The matrix: N in {1, 2, 4} over KV heads H in {1, 2, 4, 8} (N > H: replica sets, each KV
head's query heads split over its replicas), an uneven split (3 KV heads over 2 ranks: 2 + 1,
the default model's case), qwen2 biases and qwen3 q/k norms, and quantised weights whose
output-projection slices are (Q8_0, head_dim 32) or are not (Q4_1, head_dim 16: the slice is
dequantised) whole blocks. Then the default model, speculation under --tp (exact acceptance:
self-drafting on the sharded engine, a draft model whole on the leader, MTP/EAGLE heads sharded
like the target: tests/engine/test_tp_heads.py checks those against --tp 1 in depth),
`tandem serve --tp 2` answering OpenAI requests with the pool back at its baseline, and
the combinations that are refused, by name. Every comparison with --tp 1 runs with
--exact-activations; the default int8 activations are checked for closeness only.
"""
import json
import re
import shutil

import numpy as np
import pytest

from conftest import run_tandem
from lib import reference as ref
from lib.checkpoints import make_gguf_checkpoint, make_hf_checkpoint
from lib.server import Server
from test_fidelity import N_GREEDY, check_fidelity, tie_free_prompt

TOL_TP1 = 1e-5  # max|tp N - tp 1| / max|tp 1|


def generate(model_path, prompt, n, tmp_path, tp, extra=(), exact=True):
    """(greedy token ids, float32 logits of the last prompt position) from tandem generate;
    exact: with --exact-activations (fp32 activations: the path the token-for-token contract is
    for; the CPU's default quantises them for Q8_0/Q4_0/Q4_1 weights, below)."""
    dump = tmp_path / f"logits-tp{tp}-{'exact' if exact else 'int8'}.bin"
    args = ["generate", "--model", model_path, "--prompt-tokens", ",".join(map(str, prompt)),
            "--max-tokens", n, "--temperature", 0, "--print-token-ids", "--dump-logits", dump,
            "--threads", 2, "--tp", tp] + list(extra)
    if exact:
        args.append("--exact-activations")
    cp = run_tandem(args)
    return [int(t) for t in cp.stdout.split()], np.fromfile(dump, dtype="<f4")


def check_tp(path, tmp_path, tps=(2, 4), lengths=(7, 40), what=""):
    m = ref.load(path)
    for length in lengths:
        prompt = tie_free_prompt(m, length, N_GREEDY)
        t1, l1 = generate(path, prompt, N_GREEDY, tmp_path, 1)
        check_fidelity(m, prompt, l1, t1, f"{what} tp 1 prompt[{length}]")
        for tp in tps:
            tn, ln = generate(path, prompt, N_GREEDY, tmp_path, tp)
            w = f"{what} --tp {tp} prompt[{length}]"
            assert tn == t1, f"{w}: tokens {tn}, --tp 1 gave {t1}"
            err = ref.rel_err(ln, l1)
            assert err <= TOL_TP1, f"{w}: logits {err:.3g} relative from --tp 1's"
            check_fidelity(m, prompt, ln, tn, w)


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_tp_matches_tp1_and_reference(kv_heads, tandem_bin, tmp_path):
    path = make_hf_checkpoint(tmp_path / f"kv{kv_heads}", "llama", seed=70 + kv_heads,
                              hidden_size=128, num_attention_heads=8,
                              num_key_value_heads=kv_heads, head_dim=16, intermediate_size=256)
    check_tp(path, tmp_path, what=f"H={kv_heads}")


def test_tp_thread_groups_and_chunks(tandem_bin, tmp_path):
    """Ranks of two threads each (--threads 4 --tp 2: each rank's ops fan out over its own
    pool), and a prompt prefilled in 16-token chunks (steps with no logit row, which end at a
    barrier of their own): still --tp 1's tokens."""
    path = make_hf_checkpoint(tmp_path / "groups", "llama", seed=79, hidden_size=128,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                              intermediate_size=256)
    m = ref.load(path)
    prompt = tie_free_prompt(m, 53, N_GREEDY)
    t1, l1 = generate(path, prompt, N_GREEDY, tmp_path, 1)
    for extra in (["--threads", 4], ["--max-batch-tokens", 16]):
        tn, ln = generate(path, prompt, N_GREEDY, tmp_path, 2, extra)
        assert tn == t1, f"--tp 2 {extra}: tokens {tn}, --tp 1 gave {t1}"
        assert ref.rel_err(ln, l1) <= TOL_TP1, f"--tp 2 {extra}: logits"


def test_tp_uneven_kv_heads(tandem_bin, tmp_path):
    """3 KV heads over 2 ranks: rank 0 holds 2 (and their 4 query heads), rank 1 holds 1."""
    path = make_hf_checkpoint(tmp_path / "kv3", "llama", seed=80, hidden_size=96,
                              num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                              intermediate_size=192)
    check_tp(path, tmp_path, tps=(2, 3), lengths=(40,), what="H=3")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tp_biases_and_qk_norms(arch, tandem_bin, tmp_path):
    path = make_hf_checkpoint(tmp_path / arch, arch, seed=81, num_attention_heads=4,
                              num_key_value_heads=2)
    check_tp(path, tmp_path, tps=(2, 4), lengths=(40,), what=arch)


@pytest.mark.parametrize("wtype,head_dim", [("Q8_0", 32), ("Q4_1", 16)])
def test_tp_quantised(wtype, head_dim, tandem_bin, tmp_path):
    """Q8_0 with 32-wide heads: the output projection's column slices are whole blocks (copied
    as blocks); Q4_1 with 16-wide heads at --tp 4 (one query head a rank): the slices of ranks
    2 and 3 start inside a block (dequantised to F32)."""
    path = make_gguf_checkpoint(tmp_path / f"{wtype}.gguf", "llama", wtype=wtype, seed=82,
                                hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=head_dim, intermediate_size=256, tied=False)
    check_tp(path, tmp_path, tps=(2, 4), lengths=(40,), what=wtype)


def test_tp_default_model(default_model, tandem_bin, tmp_path):
    """SmolLM2-135M: 9 query heads over 3 KV heads, d_ff 1536 in Q4_1 blocks. --tp 2 splits the
    KV heads 2 + 1, --tp 3 one each; the tokens are --tp 1's."""
    prompt = [1, 504, 3458, 282, 4649, 314, 4114, 28, 253, 1345, 5512, 2910, 30]
    t1, l1 = generate(default_model, prompt, 16, tmp_path, 1)
    for tp in (2, 3):
        tn, ln = generate(default_model, prompt, 16, tmp_path, tp)
        assert tn == t1, f"--tp {tp}: tokens {tn}, --tp 1 gave {t1}"
        err = ref.rel_err(ln, l1)
        assert err <= TOL_TP1, f"--tp {tp}: logits {err:.3g} relative from --tp 1's"


# The CPU's default for Q8_0/Q4_0/Q4_1 weights quantises each activation row to int8 blocks of
# 32 (src/backend/cpu/qdot.c). The blocks a rank quantises are TP = 1's (every split is on a
# block), but a sum in another order moves a value by an ulp, which can move an int8 level, and
# that rounding (up to 1/254 of a block's largest value) then spreads through the layers: the
# two runs are two roundings of the same model, each as far from the fp32 path as the other.
# Measured on the default model's first position, two prompts: TP = 1 0.043 and 0.048 from
# --exact-activations, TP = 2 0.033 and 0.034, TP = 3 0.021 to 0.046; the tolerance leaves about
# twice that. Greedy tokens are not compared (a 4e-2 error flips close pairs).
QUANT_TP_TOL = 0.1


def test_tp_quantised_activations(default_model, tandem_bin, tmp_path):
    for prompt in ([1, 504, 3458, 282, 4649, 314, 4114, 28, 253, 1345, 5512, 2910, 30],
                   [1, 9690, 2114, 253, 655, 28, 281, 253, 1165, 6079, 411, 260, 3338]):
        _, exact = generate(default_model, prompt, 1, tmp_path, 1)
        for tp in (1, 2, 3):
            _, quant = generate(default_model, prompt, 1, tmp_path, tp, exact=False)
            err = ref.rel_err(quant, exact)
            assert 0 < err <= QUANT_TP_TOL, f"--tp {tp} int8 activations: {err:.3g} from fp32"


def test_tp_spec_self(tandem_bin, tmp_path):
    """Self-speculation (early-exit drafts on the same sharded engine, exact acceptance) gives
    the tokens of plain decoding."""
    path = make_hf_checkpoint(tmp_path / "spec", "llama", seed=83, hidden_size=128,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                              intermediate_size=256, num_hidden_layers=4)
    m = ref.load(path)
    prompt = tie_free_prompt(m, 20, 24)
    t1, _ = generate(path, prompt, 24, tmp_path, 1)
    t2, _ = generate(path, prompt, 24, tmp_path, 2,
                     ["--spec", "self", "--spec-self-layers", 2, "--spec-k", 3])
    assert t2 == t1, f"--tp 2 --spec self: {t2}, plain --tp 1: {t1}"


def test_tp_spec_draft_on_leader(default_model, tandem_bin, tmp_path):
    """A draft model runs on the leader rank alone, its KV a layer group of the leader's pool:
    the default model drafting for itself keeps every draft, and the tokens are plain --tp 1's."""
    prompt = [1, 504, 3458, 282, 4649, 314, 4114, 28, 253]
    t1, _ = generate(default_model, prompt, 16, tmp_path, 1)
    dump = tmp_path / "spec-draft.bin"
    cp = run_tandem(["generate", "--model", default_model, "--prompt-tokens",
                     ",".join(map(str, prompt)), "--max-tokens", 16, "--temperature", 0,
                     "--print-token-ids", "--dump-logits", dump, "--threads", 2, "--tp", 2,
                     "--exact-activations", "--spec", "draft", "--spec-draft", default_model,
                     "--spec-k", 3, "--spec-stats"])
    ids = [int(t) for t in cp.stdout.split()]
    assert ids == t1, f"--tp 2 --spec draft: {ids}, plain --tp 1: {t1}"
    st = json.loads(cp.stderr.strip().splitlines()[-1])
    assert st["drafted"] > 0 and st["accepted"] == st["drafted"], st


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_tp_spec_heads_sharded(method, default_model, tandem_bin, tmp_path):
    """A speculation head (an MTP chain, EAGLE trees) is sharded like the target, reading the
    leader's final-normed hidden states (every rank holds the whole residual stream); its KV
    is a layer group of every rank's pool (the rank's share of the head's KV heads), and a
    verified tree's accepted path is moved into place in every rank's pool. An echo head on an
    alternating prompt drafts (its first guess is always wrong: the chain keeps nothing, the
    trees keep their second children); the tokens
    are plain --tp 1's, and both --tp 1 and 2 draft (and the trees keep other branches). The
    statistics are not compared: they were the same at --tp 1 and 2 on a quiet machine, and not
    under the parallel suite's load (the chain or tree drafted on fewer steps at --tp 2), which
    is noted as open in the closing note of 2026-12-05."""
    from lib.heads import write_head
    head = tmp_path / "echo.safetensors"
    write_head(head, d=576, head_dim=64, vocab=49152, n_heads=9, n_kv_heads=3, d_ff=1536,
               kind="echo", seed=11)
    prompt = " ".join(["a b"] * 10)
    base = ["generate", "--model", default_model, "--prompt", prompt, "--max-tokens", 24,
            "--temperature", 0, "--print-token-ids", "--threads", 2, "--exact-activations"]
    want = run_tandem(base).stdout.split()
    stats = {}
    for tp in (1, 2):
        cp = run_tandem(base + ["--tp", tp, "--spec", method, "--spec-draft", head,
                                "--spec-k", 3, "--spec-stats"])  # fixed k: no timing gate
        assert cp.stdout.split() == want, f"--tp {tp} --spec {method}: {cp.stdout}"
        stats[tp] = json.loads(cp.stderr.strip().splitlines()[-1])
        assert stats[tp]["drafted"] > 0, stats[tp]
        if method == "eagle":  # the echo head's second guess: kept from other branches
            assert stats[tp]["accepted_other_branch"] > 0, stats[tp]


def test_tp_serve_openai(tandem_bin):
    """`tandem serve --tp 2` answers chat and completion requests, several at once (batched
    steps; `n` = 2 shares a prompt's pages, copying its partial page on every rank's pool; a
    repeated prompt takes its pages from the prefix cache), with the greedy text of `--tp 1`,
    and every KV page back once the cache is dropped."""
    body = {"model": "smol", "prompt": "The three primary colours are", "max_tokens": 12,
            "temperature": 0, "n": 2}
    chat = {"model": "smol", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a large city in Japan."}]}
    answers = {}
    for tp in (1, 2):
        s = Server(["--threads", 2, "--tp", tp, "--prefix-caching", "--exact-activations"])
        try:
            st, r = s.post("/v1/completions", body)
            assert st == 200, r
            texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
            assert texts[0] == texts[1] and texts[0], texts
            st, c = s.post("/v1/chat/completions", chat)
            assert st == 200, c
            answer = c["choices"][0]["message"]["content"]
            # again: the prompt's whole pages now come from the prefix cache, on every rank
            st, c = s.post("/v1/chat/completions", chat)
            assert st == 200, c
            assert c["choices"][0]["message"]["content"] == answer, "a cache hit changed it"
            answers[tp] = (texts[0], answer)
            assert s.metrics()[("tandem_prefix_cache_hit_tokens_total", ())] > 0
            st, _ = s.post("/reset_prefix_cache", {})
            assert st == 200
            m = s.wait_idle()
            assert m[("tandem_kv_pages_used", ())] == 0
        finally:
            s.stop()
    assert answers[2] == answers[1], f"--tp 2 answered {answers[2]}, --tp 1 {answers[1]}"


def test_tp_bench_model(tandem_bin, tmp_path):
    """`tandem bench model --tp 2` measures --tp 1 first in the same run (its reference): both
    sections, the same greedy checksum, and both pools back to 0 pages."""
    path = make_hf_checkpoint(tmp_path / "bench", "llama", seed=87, hidden_size=128,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                              intermediate_size=256)
    cp = run_tandem(["bench", "model", "--model", path, "--threads", 2, "--tp", 2,
                     "--prompt-len", 24, "--gen", 6, "--context", 8, "--exact-activations"])
    out = cp.stdout
    assert "--tp 1 (the reference)" in out and "--tp 2 (2 ranks of 1 thread(s))" in out, out
    sums = re.findall(r"checksum of greedy tokens: (\w+)", out)
    assert len(sums) == 2 and sums[0] == sums[1], out
    assert re.findall(r"kv pages after the run: (\d+) used", out) == ["0", "0"], out


def test_tp_refusals(default_model, tandem_bin, tmp_path):
    """What --tp does not run says so, naming the combination."""
    def refused(args, rc, words):
        cp = run_tandem(args, check=False)
        assert cp.returncode == rc, f"{args}: exit {cp.returncode}\n{cp.stderr}"
        for w in words:
            assert w in cp.stderr, f"{args}: {w!r} not in {cp.stderr!r}"

    gen = ["generate", "--prompt-tokens", "1,2,3", "--max-tokens", 1]
    # CUDA ranks need a GPU (backend.h, cuda_tp.c; tests/backend_cuda runs them on one)
    gpu = shutil.which("nvidia-smi") is not None
    if not gpu:
        refused(gen + ["--tp", 2, "--backend", "cuda"], 2, ["--tp 2", "no GPU", "--backend cpu"])
    # sharded disaggregation runs (tests/disagg/test_disagg_tp.py); host staging does not yet
    refused(["serve", "--tp", 2, "--role", "prefill", "--kv-staging", "always"], 2,
            ["--tp 2", "--kv-staging always"])
    if not gpu:
        refused(["bench", "model", "--backend", "cuda", "--tp", 2], 2, ["--tp 2", "no GPU"])
    # the default model: 3 KV heads, so 4 ranks are neither a split nor replica sets of them
    refused(gen + ["--model", default_model, "--tp", 4], 1, ["--tp 4", "3 KV heads"])
    two = make_hf_checkpoint(tmp_path / "h2", "llama", seed=84)  # 4 query heads, 2 KV heads
    refused(gen + ["--model", two, "--tp", 8], 1, ["--tp 8", "query heads", "replicas"])
    moe = make_hf_checkpoint(tmp_path / "moe", "qwen3_moe", seed=85)
    refused(gen + ["--model", moe, "--tp", 2], 1, ["--tp 2", "mixture-of-experts"])
    mla = make_hf_checkpoint(tmp_path / "mla", "deepseek_v2", seed=86)
    refused(gen + ["--model", mla, "--tp", 2], 1, ["--tp 2", "latent attention"])
