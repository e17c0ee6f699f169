"""Continuous batching: batch invariance with 64 concurrent clients, and preemption by
recompute when the KV pool runs dry (the preempted requests resume and finish with the same
tokens).

Batch invariance and preemption are the scheduler's and the kernels', whatever the model: those
two tests serve the default model cut to its first layers (lib.models), whose log-probabilities,
compared bit for bit, show any difference a batch makes."""
import concurrent.futures as cf
import random
import time

from lib.models import short_model_path
from lib.server import Server
from lib.sanitize import SANITIZED


# Sanitizer builds are unoptimised and many times slower: they run the same checks on a smaller
# mix (16 concurrent clients), which still exercises every concurrent path.
N_CLIENTS = 16 if SANITIZED else 64


def requests_mix(n, seed):
    rng = random.Random(seed)
    out = []
    lens = [1, 2, 3, 7, 16, 17, 40, 129] if SANITIZED else [1, 2, 3, 7, 16, 17, 40, 100, 129, 257]
    for i in range(n):
        # lengths from 1 token to a few chunks of the 128-token prefill chunk used below
        plen = rng.choice(lens)
        out.append({"prompt": [rng.randrange(100, 49000) for _ in range(plen)],
                    "max_tokens": rng.randrange(4, 9 if SANITIZED else 17), "temperature": 0,
                    "ignore_eos": True, "logprobs": 0})
    return out


def run(server, body):
    st, r = server.post("/v1/completions", body)
    assert st == 200, r
    lp = r["choices"][0]["logprobs"]
    return r["choices"][0]["text"], lp["tokens"], lp["token_logprobs"], r["usage"]


def test_64_concurrent_match_alone_bit_for_bit(default_model):
    s = Server(["--threads", "2", "--max-seqs", "64", "--prefill-chunk", "128",
                "--max-batch-tokens", "256"], model=short_model_path())
    try:
        reqs = requests_mix(N_CLIENTS, seed=7)
        alone = [run(s, b) for b in reqs]
        with cf.ThreadPoolExecutor(N_CLIENTS) as ex:
            together = list(ex.map(lambda b: run(s, b), reqs))
        for i, (a, t) in enumerate(zip(alone, together)):
            assert a[3]["completion_tokens"] == reqs[i]["max_tokens"]
            assert a[1] == t[1], f"request {i}: tokens differ alone vs in a batch of 64"
            assert a[2] == t[2], f"request {i}: logprobs differ (not bit-identical)"
            assert a[0] == t[0]
        m = s.wait_idle()
        # the batch really was shared: some step ran many sequences
        b = [(le, c) for (name, lab), c in m.items() if name == "tandem_batch_sequences_bucket"
             for le in [dict(lab)["le"]] if le not in ("+Inf",)]
        many = 8 if SANITIZED else 16
        assert any(float(le) < many and c < m[("tandem_batch_sequences_count", ())]
                   for le, c in b), f"no step ran more than {many // 2} sequences"
    finally:
        assert s.stop() == 0


def test_preemption_by_recompute_resumes_and_completes(default_model):
    # 48 pages of 16 tokens = 768 token slots; 6 requests of ~100 + 40 tokens need 840.
    # (Sanitizers: 16 pages = 256 slots; 3 requests of ~60 + 40 tokens need 300.)
    n, plen, pages = (3, 60, 16) if SANITIZED else (6, 100, 48)
    s = Server(["--threads", "2", "--kv-pages", str(pages), "--max-seqs", "8"],
               model=short_model_path())
    try:
        rng = random.Random(3)
        reqs = [{"prompt": [rng.randrange(100, 49000) for _ in range(plen + 5 * i)],
                 "max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 0}
                for i in range(n)]
        alone = [run(s, b) for b in reqs]
        assert s.metrics()[("tandem_preemptions_total", ())] == 0
        with cf.ThreadPoolExecutor(n) as ex:
            together = list(ex.map(lambda b: run(s, b), reqs))
        m = s.wait_idle()
        assert m[("tandem_preemptions_total", ())] > 0, "the test did not cause preemption"
        for a, t in zip(alone, together):
            assert a[1] == t[1] and a[2] == t[2]
    finally:
        assert s.stop() == 0


def test_request_larger_than_the_pool_is_refused(default_model):
    s = Server(["--threads", "1", "--kv-pages", "8"])
    try:
        st, r = s.post("/v1/completions", {"prompt": [5] * 100, "max_tokens": 100})
        assert st == 400 and "KV pages" in r["error"]["message"]
        st, r = s.post("/v1/completions", {"prompt": [5] * 10, "max_tokens": 4})
        assert st == 200
    finally:
        assert s.stop() == 0


def test_overlap_on_the_cpu_gives_the_same_tokens(default_model):
    """--overlap on plans step N+1 and runs its forward pass before step N is committed, and
    samples it after; on the CPU each part runs whole, and a token not committed yet travels
    as TDM_TOKEN_PREV (the engine's host copy). Greedy and seeded sampled requests, penalties,
    a JSON grammar, stop tokens (EOS) and a pool that runs dry give bit-identical tokens and
    logprobs to --overlap off; the steps did overlap, and the pool ends at its baseline."""
    n = 8 if SANITIZED else 12
    rng = random.Random(11)
    # Two long requests go first, and the rest only once both run: together they need 18 of
    # the 12 pages before either can finish (each a 40-token prompt and 90 tokens out, 9 pages
    # of 16; both hold 7 by their 57th token), so the pool runs dry whatever the timing.
    reqs = [{"prompt": [rng.randrange(100, 49000) for _ in range(40)], "max_tokens": 90,
             "logprobs": 1, "ignore_eos": True, "temperature": t, "seed": 5}
            for t in (0, 0.9)]
    for i in range(n):
        body = {"prompt": [rng.randrange(100, 49000) for _ in range(rng.choice([1, 5, 40, 90]))],
                "max_tokens": rng.randrange(8, 24), "logprobs": 1}
        if i % 3 == 0:
            body.update(temperature=0.9, seed=100 + i)
        else:
            body.update(temperature=0)
        if i % 4 == 1:  # penalties: sampled after the commit of the token before
            body.update(frequency_penalty=0.5, presence_penalty=0.3)
        if i % 4 == 3:  # a grammar: its mask is made after that commit too
            body.update(response_format={"type": "json_object"})
        if i % 2:
            body.update(ignore_eos=True)
        reqs.append(body)

    def serve(mode):
        s = Server(["--threads", "2", "--kv-pages", "12", "--max-seqs", "16", "--overlap", mode])
        try:
            with cf.ThreadPoolExecutor(len(reqs)) as ex:
                first = [ex.submit(run, s, b) for b in reqs[:2]]
                deadline = time.time() + 60
                while s.metrics()[("tandem_requests_running", ())] < 2:
                    assert not any(f.done() for f in first), "a long request ended alone"
                    assert time.time() < deadline, "the two long requests did not both run"
                    time.sleep(0.005)
                rest = [ex.submit(run, s, b) for b in reqs[2:]]
                out = [f.result() for f in first + rest]
            return out, s.wait_idle()
        finally:
            assert s.stop() == 0

    off, m_off = serve("off")
    on, m_on = serve("on")
    assert m_off[("tandem_sched_overlapped_steps_total", ())] == 0
    assert m_on[("tandem_sched_overlapped_steps_total", ())] > 0, "no step overlapped"
    assert m_on[("tandem_preemptions_total", ())] > 0, "the pool did not run dry"
    for i, (a, b) in enumerate(zip(off, on)):
        assert a[1] == b[1], f"request {i}: tokens differ with --overlap on"
        assert a[2] == b[2], f"request {i}: logprobs differ with --overlap on"
        assert a[3] == b[3]
