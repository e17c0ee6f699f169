"""Speculative decoding on the default model, through the CLI and the server.

- `tandem generate --spec self --spec-accept exact` prints the same token ids as the same command
  without --spec, greedy and sampled (the issue's acceptance command: T=0.8, seed 3), with every
  penalty and truncation setting, for a shallow and a full self drafter; --spec-stats prints the
  JSON line with the fields external tools read.
- The server with --spec self gives every request of a concurrent mix exactly the tokens and
  log-probabilities of a server without speculation; a request's spec_k caps or turns off its
  drafts, and a bad spec_k is a 400; /metrics has the speculation families; the KV pool is back
  at its baseline afterwards.
- Bad speculation flags end with a message and exit status 2.
"""
import concurrent.futures as cf
import json
import random

import pathlib
import subprocess
import sys

import pytest

from conftest import run_tandem
from lib.server import Server
from lib.sanitize import SANITIZED, SLOW


# Sanitizer builds are many times slower: the same checks on shorter generations.
N_GEN = 16 if SANITIZED else 40


def gen(model, extra, prompt="Tell me about the moon.", n=N_GEN):
    cp = run_tandem(["generate", "--model", model, "--prompt", prompt, "--chat", "--max-tokens",
                     str(n), "--print-token-ids", *extra], timeout=300 * SLOW)
    return cp.stdout.split(), cp.stderr


SETTINGS = [
    ["--temperature", "0"],
    ["--temperature", "0.8", "--seed", "3"],
    ["--temperature", "1.1", "--seed", "9", "--top-k", "40", "--top-p", "0.9", "--min-p", "0.02",
     "--repetition-penalty", "1.2", "--presence-penalty", "0.4", "--frequency-penalty", "0.3"],
]


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_generate_exact_is_bit_identical(default_model, setting):
    base, _ = gen(default_model, SETTINGS[setting])
    assert len(base) == N_GEN
    for layers in (("30",) if SANITIZED else ("20", "30")):
        ids, err = gen(default_model, SETTINGS[setting] + [
            "--spec", "self", "--spec-self-layers", layers, "--spec-accept", "exact",
            "--spec-k", "3", "--spec-stats"])
        assert ids == base, f"--spec self --spec-self-layers {layers} changed the output"
        st = json.loads(err.strip().splitlines()[-1])
        assert set(st) == {"drafted", "accepted", "target_steps", "tokens", "tau",
                           "accept_by_position"}
        assert st["drafted"] > 0 and 0 <= st["accepted"] <= st["drafted"]
        assert st["tokens"] == N_GEN - 1  # every output but the prompt step's
        assert abs(st["tau"] - st["tokens"] / st["target_steps"]) < 1e-3
        assert len(st["accept_by_position"]) == 3
        if layers == "30":  # the model drafting for itself: all kept, sampled or not
            assert st["accepted"] == st["drafted"] and st["tau"] > 2.5


@pytest.fixture(scope="module")
def draft8(default_model, tmp_path_factory):
    """A real draft model: the default model's first 8 layers (same vocabulary and head)."""
    out = tmp_path_factory.mktemp("draft") / "smol8.gguf"
    root = pathlib.Path(__file__).resolve().parent.parent.parent
    subprocess.run([sys.executable, str(root / "scripts" / "truncate_gguf.py"), str(default_model),
                    str(out), "8"], check=True, capture_output=True, timeout=300)
    return out


@pytest.mark.parametrize("setting", [0, 1])
def test_generate_draft_model_is_bit_identical(default_model, draft8, setting):
    base, _ = gen(default_model, SETTINGS[setting])
    for draft, full in ((draft8, False), (default_model, True)):
        ids, err = gen(default_model, SETTINGS[setting] + [
            "--spec", "draft", "--spec-draft", draft, "--spec-k", "3", "--spec-stats"])
        assert ids == base, f"--spec draft {draft} changed the output"
        st = json.loads(err.strip().splitlines()[-1])
        assert st["drafted"] > 0
        if full:  # the model as its own draft, with its own copy of the KV
            assert st["accepted"] == st["drafted"] and st["tau"] > 2.5


def test_draft_model_refusals(default_model, draft8):
    cp = run_tandem(["generate", "--model", default_model, "--prompt", "hi", "--max-tokens", "2",
                     "--spec", "draft", "--spec-draft", "/nonexistent.gguf"], check=False)
    assert cp.returncode != 0 and "nonexistent" in cp.stderr, cp.stderr


def test_issue_command_and_adaptive_default(default_model):
    args = ["--temperature", "0.8", "--seed", "3"]
    n = 24 if SANITIZED else 64
    base, _ = gen(default_model, args, n=n)
    ids, err = gen(default_model, args + ["--spec", "self", "--spec-accept", "exact",
                                          "--spec-stats"], n=n)
    assert ids == base
    st = json.loads(err.strip().splitlines()[-1])
    assert st["target_steps"] >= 1 and st["tau"] >= 1.0
    # without --spec, --spec-stats still prints the line: nothing drafted, tau 1
    _, err = gen(default_model, args + ["--spec-stats"], n=8)
    st = json.loads(err.strip().splitlines()[-1])
    assert st["drafted"] == 0 and st["tau"] == 1.0


@pytest.mark.parametrize("flags,needle", [
    (["--spec", "bogus"], "--spec takes"),
    (["--spec", "draft"], "needs --spec-draft"),
    (["--spec", "self", "--spec-k", "99"], "--spec-k takes"),
    (["--spec", "self", "--spec-self-layers", "99"], "the model has 30 layers"),
    (["--spec", "self", "--spec-accept", "sometimes"], "--spec-accept takes"),
    (["--spec-k", "3"], "need --spec"),
    (["--spec", "self", "--spec-draft", "x.gguf"], "--spec-draft is for"),
])
def test_bad_spec_flags(default_model, flags, needle):
    cp = run_tandem(["generate", "--model", default_model, "--prompt", "hi", "--max-tokens", "2",
                     *flags], check=False)
    assert cp.returncode == 2, cp.stderr
    assert needle in cp.stderr, cp.stderr


def mix(n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = {"prompt": [rng.randrange(100, 49000) for _ in range(rng.choice([3, 9, 30]))],
                "max_tokens": rng.randrange(6, 14), "ignore_eos": True, "logprobs": 0,
                "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(1000)}
        if i % 4 == 1:
            body["spec_k"] = 0  # this one does not speculate
        if i % 4 == 2:
            body["spec_k"] = 1
        if i % 4 == 3:  # a logit bias: the verify rows must see it as the plain rows do
            body["logit_bias"] = {str(rng.randrange(100, 49000)): rng.choice([-100, 4, 9]),
                                  str(body["prompt"][-1]): rng.choice([-3, 6])}
        out.append(body)
    return out


def complete(server, body):
    st, r = server.post("/v1/completions", body)
    assert st == 200, r
    lp = r["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def test_server_concurrent_exact_and_metrics(default_model):
    reqs = mix(8 if SANITIZED else 16, seed=5)
    common = ["--threads", "2", "--max-seqs", "16", "--max-batch-tokens", "256"]
    plain = Server(common)
    try:
        ref = [complete(plain, b) for b in reqs]
    finally:
        assert plain.stop() == 0
    s = Server(common + ["--spec", "self", "--spec-self-layers", "30", "--spec-k", "3"])
    try:
        with cf.ThreadPoolExecutor(len(reqs)) as ex:
            got = list(ex.map(lambda b: complete(s, b), reqs))
        for i, (a, b) in enumerate(zip(ref, got)):
            assert a[0] == b[0], f"request {i}: tokens differ with speculation"
            assert a[1] == b[1], f"request {i}: logprobs differ with speculation"
        st, r = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "spec_k": 99})
        assert st == 400 and "spec_k" in json.dumps(r), r
        st, r = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "spec_k": "three"})
        assert st == 400, r
        m = s.wait_idle()
        drafted = m[("tandem_spec_drafted_tokens_total", ())]
        accepted = m[("tandem_spec_accepted_tokens_total", ())]
        assert drafted > 0 and accepted == drafted  # the model drafting for itself
        assert m[("tandem_spec_tokens_per_step_count", ())] > 0
        assert ("tandem_spec_k_chosen_count", ()) in m
        assert m[("tandem_kv_pages_used", ())] == 0
        assert "speculation: self (30 layers of 30)" in s.logs()
    finally:
        assert s.stop() == 0


def test_serve_refuses_spec_on_a_prefill_node(default_model):
    cp = run_tandem(["serve", "--model", default_model, "--role", "prefill", "--spec", "self"],
                    check=False, timeout=60)
    assert cp.returncode == 2 and "--spec is for the decoding side" in cp.stderr, cp.stderr


def test_bench_spec_json(default_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"What is the capital of France?"\n\n"Name a primary color."\n'
                       '"Why is the sea salty?"\n')
    batches = ["1"] if SANITIZED else ["1", "2"]
    cp = run_tandem(["bench", "spec", "--model", default_model, "--prompts", prompts,
                     "--max-tokens", "8", "--batch", ",".join(batches), "--spec", "self",
                     "--spec-self-layers", "30", "--spec-k", "auto,2", "--json"],
                    timeout=600 * SLOW)
    out = json.loads(cp.stdout)
    assert out["prompts"] == 3 and out["max_tokens"] == 8
    assert "self (30 layers of 30)" in out["spec"]
    rows = out["results"]
    assert [(r["batch"], r["k"]) for r in rows] == [
        (int(b), k) for b in batches for k in ("none", "auto", "k=2")]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["itl_p99_ms"] >= r["itl_p50_ms"] >= 0
        if r["k"] == "none":
            assert r["speedup"] == 1.0 and r["tau"] == 1.0
        else:
            assert r["identical"] is True  # exact acceptance
        if r["k"] == "k=2":  # the model drafting for itself keeps every draft
            assert r["drafted"] > 0 and r["accepted"] == r["drafted"] and r["tau"] > 2
            assert r["accept_by_position"] == [1.0, 1.0]


@pytest.mark.parametrize("args,needle", [
    ([], "--prompts FILE is required"),
    (["--prompts", "/nonexistent"], "cannot open"),
    (["--prompts", "BAD"], "not a non-empty JSON string"),
    (["--prompts", "GOOD"], "give the drafter"),
    (["--prompts", "GOOD", "--spec", "self", "--batch", "0"], "--batch"),
    (["--prompts", "GOOD", "--spec", "self", "--spec-k", "auto,99"], "--spec-k"),
])
def test_bench_spec_bad_input(default_model, tmp_path, args, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"not": "a string"}\n')
    good = tmp_path / "good.jsonl"
    good.write_text('"hello"\n')
    args = [str(bad) if a == "BAD" else str(good) if a == "GOOD" else a for a in args]
    cp = run_tandem(["bench", "spec", "--model", default_model, *args], check=False)
    assert cp.returncode == 2, cp.stderr
    assert needle in cp.stderr, cp.stderr
