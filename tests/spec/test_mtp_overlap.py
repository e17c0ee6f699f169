"""The seed's single-token MTP schedule (`--spec mtp --spec-overlap`, issue 14 item 6).

The head runs over every row the target just verified (its input tokens the target's choices,
shifted in, accepted or not) on a thread of its own while the scheduler commits; the next step
draws draft 1 from the row its acceptance ended on instead of running the head's catch-up. On
the CPU, a batch-invariant backend, that row's logits are the catch-up's bit for bit, so:
- the output is bit-identical to no speculation (exact acceptance), greedy and sampled, with
  the shipped head (k 1) and with an echo head accepted deep (k 4) (so the accepted rows, the rewind past a
  rejected one and the stale rows past it all run; k 1 is the seed's case), also over a
  prompt long enough for the head's eager catch-up over prefill chunks;
- the drafts are the synchronous chain's: drafted, accepted and acceptance by position equal
  those of the same command without --spec-overlap (at a fixed k, which the adaptive
  controller's timing does not move), and so does a run in rejection mode, tokens included;
- the overlap really drafts: overlap_drafts (first drafts drawn from a launched pass) covers
  most steps, and its rows are at least those steps';
- a server with the overlap gives a concurrent mix the tokens and log-probabilities of a server
  without speculation, with its pool back at baseline and the overlap's counters in /metrics;
- --spec-overlap with another method is refused with a message.
"""
import concurrent.futures as cf
import pathlib

import pytest

from conftest import run_tandem
from lib.heads import write_head
from lib.server import Server
from lib.sanitize import SANITIZED, SLOW
from test_eagle import (D_MODEL, HEAD_DIM, LONG, LONG_CHUNKS, REPEAT, VOCAB, complete, mix,
                        stats)

N_GEN = 16 if SANITIZED else 40


@pytest.fixture(scope="module")
def heads(default_model, tmp_path_factory):
    p = tmp_path_factory.mktemp("overlap_heads") / "echo.safetensors"
    write_head(p, d=D_MODEL, head_dim=HEAD_DIM, vocab=VOCAB, n_heads=9, n_kv_heads=3, d_ff=1536,
               kind="echo", seed=11)
    shipped = pathlib.Path(str(default_model)[:-len(".gguf")] + ".mtp.safetensors")
    assert shipped.exists(), f"{shipped}: scripts/fetch_model.sh installs the shipped head"
    return {"echo": p, "shipped": shipped}


def gen(model, extra, prompt, chat):
    args = ["generate", "--model", model, "--prompt", prompt, "--max-tokens", str(N_GEN),
            "--print-token-ids", "--threads", "2", *extra]
    if chat:
        args.append("--chat")
    cp = run_tandem(args, timeout=300 * SLOW)
    return cp.stdout.split(), cp.stderr


SAME = ("drafted", "accepted", "target_steps", "tokens", "accept_by_position")


@pytest.mark.parametrize("head,prompt,chat,setting,k", [
    ("shipped", "Tell me about the moon.", True, ["--temperature", "0"], "1"),
    ("shipped", "Write a poem about rain.", True, ["--temperature", "0.8", "--seed", "3"], "1"),
    ("echo", REPEAT, False, ["--temperature", "0"], "4"),
    ("echo", LONG, False, ["--temperature", "0"] + LONG_CHUNKS, "4"),
])
def test_overlap_drafts_what_the_chain_drafts(default_model, heads, head, prompt, chat, setting,
                                              k):
    base, _ = gen(default_model, setting, prompt, chat)
    assert len(base) == N_GEN
    spec = setting + ["--spec", "mtp", "--spec-draft", str(heads[head]), "--spec-k", k,
                      "--spec-stats"]
    sync_ids, sync_err = gen(default_model, spec, prompt, chat)
    ids, err = gen(default_model, spec + ["--spec-overlap"], prompt, chat)
    assert ids == base, f"--spec-overlap ({head} head, k {k}) changed the output"
    assert sync_ids == base
    a, b = stats(sync_err), stats(err)
    assert {f: a[f] for f in SAME} == {f: b[f] for f in SAME}, (a, b)
    assert "overlap_rows" not in a
    # every decode step but the first (after the prefill's catch-up) drafts from a launched
    # pass, whose rows are each step's verified span
    assert b["overlap_drafts"] >= b["target_steps"] - 2, b
    assert b["overlap_rows"] >= b["overlap_drafts"], b
    assert "launched before each commit (overlap)" in err


def test_rejection_mode_is_the_chains(default_model, heads):
    setting = ["--temperature", "0.8", "--seed", "2", "--spec", "mtp", "--spec-draft",
               str(heads["echo"]), "--spec-k", "3", "--spec-accept", "rejection",
               "--spec-stats"]
    sync_ids, sync_err = gen(default_model, setting, REPEAT, False)
    ids, err = gen(default_model, setting + ["--spec-overlap"], REPEAT, False)
    assert ids == sync_ids and len(ids) == N_GEN
    a, b = stats(sync_err), stats(err)
    assert {f: a[f] for f in SAME} == {f: b[f] for f in SAME}, (a, b)
    assert a["accepted"] > 0 and b["overlap_drafts"] > 0, b


def test_server_concurrent_exact_and_pool(default_model, heads):
    reqs = mix(8 if SANITIZED else 16, seed=9)
    common = ["--threads", "2", "--max-seqs", "16", "--max-batch-tokens", "256"]
    plain = Server(common)
    try:
        ref = [complete(plain, b) for b in reqs]
    finally:
        assert plain.stop() == 0
    s = Server(common + ["--spec", "mtp", "--spec-draft", str(heads["echo"]), "--spec-k", "3",
                         "--spec-overlap"])
    try:
        with cf.ThreadPoolExecutor(len(reqs)) as ex:
            got = list(ex.map(lambda b: complete(s, b), reqs))
        for i, (a, b) in enumerate(zip(ref, got)):
            assert a[0] == b[0], f"request {i}: tokens differ with --spec-overlap"
            assert a[1] == b[1], f"request {i}: logprobs differ with --spec-overlap"
        m = s.wait_idle()
        assert m[("tandem_spec_overlap_drafts_total", ())] > 0
        assert m[("tandem_spec_overlap_rows_total", ())] >= m[
            ("tandem_spec_overlap_drafts_total", ())]
        assert m[("tandem_spec_accepted_tokens_total", ())] > 0
        assert m[("tandem_kv_pages_used", ())] == 0
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("flags", [["--spec", "self", "--spec-overlap"],
                                   ["--spec", "eagle", "--spec-overlap"],
                                   ["--spec-overlap"]])
def test_overlap_is_for_mtp(default_model, flags):
    cp = run_tandem(["generate", "--model", default_model, "--prompt", "hi", "--max-tokens", "2",
                     *flags], check=False)
    assert cp.returncode == 2, cp.stderr
    assert "--spec-overlap is for --spec mtp" in cp.stderr or "need --spec" in cp.stderr
