"""EAGLE-2 dynamic trees (--spec eagle) on the default model, through the CLI and the server.

- `tandem generate --spec eagle --spec-draft HEAD` prints the same token ids as without
  speculation (exact acceptance), greedy, sampled (T = 0.8 with a seed), and with top-k, top-p
  and every penalty, with a random head, an echo head and a confident echo head (lib.heads),
  at tree budgets 1, 8, 16, 32 and 64 (shared out over the cases: budgets_for), on prompts
  where the trees are accepted deep, on other branches than the head's first guess, and not
  at all; a prompt prefilled in four chunks makes the head catch up over them.
- The trees really branch: on an alternating prompt the echo head's best guess (the token it
  just saw) is always wrong and its second one right, so the tree keeps drafts from second
  children at nearly every step (accepted_other_branch) and beats the chain drafter on the same
  head; a confident head on a repetition is accepted several levels deep.
- Rejection acceptance (multi-draft rejection over each node's children) runs and keeps
  drafts; its distribution is tested in C (tests/spec/test_eagle.c, tests/sample).
- The server with --spec eagle gives every request of a concurrent mix the tokens and
  log-probabilities of a server without speculation (so the accepted paths' KV, moved into
  place, is the chain's: every later position reads it), counts trees in /metrics, and its KV
  pool is back at its baseline.
- `tandem bench spec` runs several tree budgets, and its attention micro-benchmark times a
  tree of T tokens against a chain of T tokens; bad tree flags end with a message.
"""
import concurrent.futures as cf
import json
import random

import pytest

from conftest import run_tandem
from lib.heads import write_head
from lib.server import Server
from lib.sanitize import SANITIZED, SLOW

N_GEN = 16 if SANITIZED else 40
BUDGETS = ("1", "8", "16", "32", "64")


def budgets_for(case):
    """The tree budgets that case number `case` of the bit-identity matrix runs. A step of
    budget B verifies B + 1 tokens, a prefill's work on the CPU, so the cases share the range
    rather than each running all of it: every case runs budget 1 (one draft a step, checked
    exactly) and one more, rotating over 8, 16, 32 and 64, so that each budget meets several
    heads and settings."""
    return ("1", BUDGETS[1 + case % (len(BUDGETS) - 1)])


D_MODEL, HEAD_DIM, VOCAB = 576, 64, 49152  # SmolLM2-135M

REPEAT = "!" * 24  # the target repeats one token (id 32) (also test_mtp's and test_mtp_overlap's)
ALTERNATE = " ".join(["a b"] * 10)                  # the target alternates two tokens
# about 320 tokens, prefilled in four chunks (LONG_CHUNKS): the head catches up over them
# (also test_mtp's and test_mtp_overlap's long prompt)
LONG = " ".join(f"item {i} is {i * 7 % 13}." for i in range(40))
LONG_CHUNKS = ["--max-batch-tokens", "96"]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """random, echo (proposes the token it just saw), and sharp: the echo head with its final
    norm scaled up, so that its guesses are confident and the trees go deep."""
    from safetensors.numpy import load_file, save_file
    root = tmp_path_factory.mktemp("eagle_heads")
    out = {}
    for kind in ("random", "echo"):
        p = root / f"{kind}.safetensors"
        write_head(p, d=D_MODEL, head_dim=HEAD_DIM, vocab=VOCAB, n_heads=9, n_kv_heads=3,
                   d_ff=1536, kind=kind, seed=11)
        out[kind] = p
    t = load_file(str(out["echo"]))
    t["norm.weight"] = t["norm.weight"] * 6
    out["sharp"] = root / "sharp.safetensors"
    save_file(t, str(out["sharp"]))
    return out


def gen(model, extra, prompt, chat=False, n=N_GEN):
    args = ["generate", "--model", model, "--prompt", prompt, "--max-tokens", str(n),
            "--print-token-ids", *extra]
    if chat:
        args.append("--chat")
    cp = run_tandem(args, timeout=300 * SLOW)
    return cp.stdout.split(), cp.stderr


def stats(err):
    return json.loads(err.strip().splitlines()[-1])


def eagle(head, *more, spec_stats=True):
    return ["--spec", "eagle", "--spec-draft", str(head), *more] + (
        ["--spec-stats"] if spec_stats else [])


PENALTIES = ["--temperature", "0.7", "--seed", "2", "--top-k", "20", "--top-p", "0.9",
             "--repetition-penalty", "1.1", "--presence-penalty", "0.5",
             "--frequency-penalty", "0.3"]


MATRIX = [  # id: (head, prompt, chat template, sampling)
    ("random-greedy", "random", "Tell me about the moon.", True, ["--temperature", "0"]),
    ("random-t0.8", "random", "Tell me about the moon.", True,
     ["--temperature", "0.8", "--seed", "3"]),
    ("random-penalties", "random", "Tell me about the moon.", True, PENALTIES),
    ("echo-alt-greedy", "echo", ALTERNATE, False, ["--temperature", "0"]),
    ("echo-alt-t0.8", "echo", ALTERNATE, False, ["--temperature", "0.8", "--seed", "4"]),
    ("sharp-repeat-greedy", "sharp", REPEAT, False, ["--temperature", "0"]),
    ("sharp-repeat-t0.8", "sharp", REPEAT, False, ["--temperature", "0.8", "--seed", "5"]),
    ("sharp-repeat-penalties", "sharp", REPEAT, False, PENALTIES),
    ("echo-long", "echo", LONG, False, ["--temperature", "0"] + LONG_CHUNKS),
]


# The cases the sanitized pass runs: every budget (8 to 64 by the rotation, 1 in each), every
# head, greedy, temperature with the penalties, and the long prompt's chunked prefill. The
# other five are the same code paths with other numbers, and run in the Release pass.
SANITIZED_CASES = ("random-penalties", "echo-alt-greedy", "sharp-repeat-greedy", "echo-long")


@pytest.mark.parametrize("case", [
    pytest.param(i, marks=() if m[0] in SANITIZED_CASES else pytest.mark.skipif(
        SANITIZED, reason="the same paths as the sanitized cases; runs in the Release pass"))
    for i, m in enumerate(MATRIX)], ids=[m[0] for m in MATRIX])
def test_generate_eagle_is_bit_identical(default_model, heads, case):
    _, kind, prompt, chat, setting = MATRIX[case]
    base, _ = gen(default_model, setting, prompt, chat)
    assert len(base) == N_GEN
    for budget in budgets_for(case):
        ids, err = gen(default_model, setting + eagle(heads[kind], "--spec-k", "6",
                                                      "--spec-tree-budget", budget),
                       prompt, chat)
        assert ids == base, f"--spec eagle ({kind} head, budget {budget}) changed the output"
        st = stats(err)
        assert st["drafted"] > 0 and st["tree_steps"] > 0, st
        assert st["tokens"] == N_GEN - 1
        # a tree of budget 1 is one draft a step, at depth 1
        if budget == "1":
            assert st["drafted"] == st["tree_steps"] and len(st["accept_by_position"]) == 1
        assert f"budget {budget}, top-k 8, depth 6" in err


def test_budget_rotation_covers_the_range():
    """Every budget runs somewhere in the matrix, 64 included, and in its sanitized cases."""
    seen = {b for case in range(len(MATRIX)) for b in budgets_for(case)}
    assert seen == set(BUDGETS)
    ids = [m[0] for m in MATRIX]
    assert {b for c in SANITIZED_CASES for b in budgets_for(ids.index(c))} == set(BUDGETS)


def test_tree_accepts_other_branches(default_model, heads):
    """The echo head's best guess on an alternating text is the token it just saw (wrong); its
    second guess is right. A chain of its best guesses is never kept; the tree keeps the second
    children, a draft or more at nearly every step."""
    base, _ = gen(default_model, ["--temperature", "0"], ALTERNATE)
    assert len(set(base[2:])) == 2, "the target no longer alternates on this prompt"
    ids, err = gen(default_model, ["--temperature", "0"] + eagle(heads["echo"], "--spec-k", "6"),
                   ALTERNATE)
    assert ids == base
    tree = stats(err)
    assert tree["accepted_other_branch"] >= tree["tree_steps"] // 2, tree
    assert tree["tau"] > 2.0, tree
    _, err = gen(default_model, ["--temperature", "0", "--spec", "mtp", "--spec-draft",
                                 str(heads["echo"]), "--spec-k", "4", "--spec-stats"], ALTERNATE)
    chain = stats(err)
    assert chain["tau"] < 1.5 and tree["tau"] > chain["tau"] + 0.5, (chain, tree)


def test_confident_head_is_accepted_deep(default_model, heads):
    base, _ = gen(default_model, ["--temperature", "0"], REPEAT)
    ids, err = gen(default_model, ["--temperature", "0"] + eagle(heads["sharp"], "--spec-k", "6"),
                   REPEAT)
    assert ids == base
    st = stats(err)
    assert st["tau"] > 3.0, st
    assert len(st["accept_by_position"]) >= 4 and st["accept_by_position"][3] >= 0.5, st


def test_auto_k_gates_and_stays_exact(default_model, heads):
    """k auto: the gate measures drafting against none and may turn it off; never the output."""
    base, _ = gen(default_model, ["--temperature", "0"], REPEAT)
    ids, err = gen(default_model, ["--temperature", "0"] + eagle(heads["sharp"]), REPEAT)
    assert ids == base
    assert "gated" in err


def test_rejection_acceptance_runs(default_model, heads):
    ids, err = gen(default_model, ["--temperature", "0.8", "--seed", "2"] +
                   eagle(heads["sharp"], "--spec-k", "6", "--spec-accept", "rejection"), REPEAT)
    assert len(ids) == N_GEN
    st = stats(err)
    assert st["drafted"] > 0 and st["accepted"] > 0 and st["tree_steps"] > 0, st
    assert "multi-draft rejection" in err


@pytest.mark.parametrize("flags,needle", [
    (["--spec", "mtp", "--spec-tree-budget", "8"], "are for --spec eagle"),
    (["--spec", "eagle", "--spec-tree-budget", "65"], "--spec-tree-budget"),
    (["--spec", "eagle", "--spec-tree-topk", "17"], "--spec-tree-topk"),
    (["--spec", "eagle", "--spec-tree-depth", "0"], "--spec-tree-depth"),
])
def test_bad_tree_flags(default_model, heads, flags, needle):
    cp = run_tandem(["generate", "--model", default_model, "--prompt", "hi", "--max-tokens", "2",
                     "--spec-draft", heads["echo"], *flags], check=False)
    assert cp.returncode == 2, cp.stderr
    assert needle in cp.stderr, cp.stderr


def test_head_tree_too_large_is_refused(default_model, heads):
    cp = run_tandem(["generate", "--model", default_model, "--prompt", "hi", "--max-tokens", "2",
                     *eagle(heads["echo"], "--spec-tree-topk", "16", "--spec-tree-depth", "6")],
                    check=False)
    assert cp.returncode != 0 and "expands 80 nodes" in cp.stderr, cp.stderr


def mix(n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.choice([[32] * 12, [64, 65] * 8,
                             [rng.randrange(100, 49000) for _ in range(rng.choice([3, 9]))]])
        body = {"prompt": prompt, "max_tokens": rng.randrange(6, 14), "ignore_eos": True,
                "logprobs": 0, "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(1000)}
        if i % 4 == 1:
            body["spec_k"] = 0  # this one does not speculate
        if i % 4 == 2:
            body["spec_k"] = 3  # a smaller tree
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


def test_server_concurrent_exact_and_pool(default_model, heads):
    reqs = mix(8 if SANITIZED else 16, seed=7)
    common = ["--threads", "2", "--max-seqs", "16", "--max-batch-tokens", "256"]
    plain = Server(common)
    try:
        ref = [complete(plain, b) for b in reqs]
    finally:
        assert plain.stop() == 0
    s = Server(common + eagle(heads["sharp"], "--spec-k", "4", "--spec-tree-budget", "12",
                              spec_stats=False))
    try:
        with cf.ThreadPoolExecutor(len(reqs)) as ex:
            got = list(ex.map(lambda b: complete(s, b), reqs))
        for i, (a, b) in enumerate(zip(ref, got)):
            assert a[0] == b[0], f"request {i}: tokens differ with --spec eagle"
            assert a[1] == b[1], f"request {i}: logprobs differ with --spec eagle"
        m = s.wait_idle()
        assert m[("tandem_spec_tree_steps_total", ())] > 0
        assert m[("tandem_spec_accepted_tokens_total", ())] > 0
        assert m[("tandem_kv_pages_used", ())] == 0
        assert "speculation: eagle trees" in s.logs()
    finally:
        assert s.stop() == 0


def test_bench_spec_tree_budgets(default_model, heads, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"Count: 1 2 1 2 1 2 1 2"\n"Say ! ten times: !!!!!!!!"\n')
    cp = run_tandem(["bench", "spec", "--model", default_model, "--prompts", prompts,
                     "--max-tokens", "8", "--batch", "1",
                     *eagle(heads["sharp"], "--spec-k", "4", "--spec-tree-budget", "4,16",
                            spec_stats=False), "--json"],
                    timeout=600 * SLOW)
    out = json.loads(cp.stdout)
    rows = out["results"]
    assert [(r["k"], r.get("budget")) for r in rows] == [("none", None), ("k=4", 4),
                                                         ("k=4", 16)]
    for r in rows[1:]:
        assert r["identical"] is True and r["drafted"] > 0 and r["tree_steps"] > 0


def test_bench_attention_tree_vs_chain():
    cp = run_tandem(["bench", "spec", "--attention", "--attention-prefix", "256,1024",
                     "--attention-tokens", "8,32", "--json"], timeout=300 * SLOW)
    out = json.loads(cp.stdout)
    assert out["backend"].startswith("cpu")
    cases = out["cases"]
    assert [(c["prefix"], c["tokens"]) for c in cases] == [
        (p, t) for p in (256, 1024) for t in (8, 32)]
    for c in cases:
        assert c["chain_us"] > 0 and c["tree_us"] > 0
        assert c["ratio"] == pytest.approx(c["tree_us"] / c["chain_us"], rel=1e-6)
        # each tree token's output equals the chain's for a token that sees the same KV
        assert c["tree_matches_reference"] is True
