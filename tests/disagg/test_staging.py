"""Host staging (issue 16, item 2: GPU pages between hosts whose fabric cannot register GPU
memory), run on host pools with `--kv-staging always`: host memory stands in for device memory,
and a memcpy copier for the GPU's copy kernels. Every page then takes the path it takes between
two GPU hosts:

  prefill pool --copy--> pinned staging ring --RDMA write + immediate--> decoder's landing pages
  --copy, once every immediate has landed--> decoder's pool

- Greedy output (tokens and log-probabilities) is the colocated server's, over 4-byte and
  2-byte pages, with every page staged (the metrics say so on both sides).
- A staging ring smaller than a layer's write cuts it into pieces and pushes back on the
  messenger; output unchanged, the ring empty afterwards.
- A decoder whose landing pages cannot hold a prompt prefills it itself (counted); one that
  fits is staged.
- Under the fault injection of the transfer engine (lost, duplicated, late, reordered
  immediates; failed writes), a prefill node killed mid-transfer: every request completes with
  the colocated output, and the pools, the landing pages and the ring are back to baseline.
- A CPU prefill node with staging off writes straight into a staging decoder's landing pages
  (a CPU prefill node serving a GPU decode node on another host).
"""
import concurrent.futures as cf
import time

import pytest

from lib.models import SHORT_LAYERS
from test_disagg import (FAULTS, SANITIZED, colocated, colocated_server,  # noqa: F401
                         decode_idle, decode_node, faults_never_hang, kill_mid_transfer,
                         prefill_idle, prefill_node, prompts, run)

STAGE = ["--kv-staging", "always"]
LENS = [1, 2, 16, 17, 63, 65, 129, 200] if not SANITIZED else [2, 17, 65, 129]


def staging_idle(p, d):
    """Both pools at baseline, no landing page lent, the staging ring empty."""
    m = decode_idle(d)
    assert m[("tandem_disagg_landing_pages_used", ())] == 0
    deadline = time.time() + 30
    while True:
        mp = prefill_idle(p)
        if mp[("tandem_disagg_staging_ring_used_bytes", ())] == 0:
            return mp, m
        assert time.time() < deadline, "the staging ring is not empty"
        time.sleep(0.05)


def counter(m, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return m.get(key, 0)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_staged_pages_identical_to_colocated(dtype):
    kvd = ["--kv-dtype", dtype]
    col = colocated_server(kvd)
    p = d = None
    try:
        p = prefill_node(STAGE + kvd)
        d = decode_node([p], STAGE + kvd)
        ps = prompts(len(LENS), 41, LENS)
        want = [run(col, x) for x in ps]
        got = [run(d, x) for x in ps]
        assert got == want, "staged pages: disaggregated output differs from colocated"
        mp, md = staging_idle(p, d)
        n_remote = sum(1 for x in ps if len(x) >= 2)  # a 1-token prompt has nothing to prefill
        assert md[("tandem_disagg_staged_prefills_total", ())] == n_remote
        assert md[("tandem_disagg_remote_prefills_total", ())] == n_remote
        assert md[("tandem_disagg_local_fallbacks_total", ())] == 0
        assert counter(md, "tandem_disagg_peer_staged", peer="0") == 1
        # every KV write of the prefill node went through the ring (the context does not)
        staged = counter(mp, "tandem_disagg_staged_writes_total", result="ok")
        assert staged > 0 and counter(mp, "tandem_disagg_staged_writes_total",
                                      result="failed") == 0
        assert staged == mp[("tandem_disagg_writes_total", ())] - n_remote
        assert 0 < mp[("tandem_disagg_staging_ring_high_bytes", ())] <= \
            mp[("tandem_disagg_staging_ring_bytes", ())]
        assert "KV pages by pinned host staging, from host memory here to host memory there" \
            in p.logs(), p.logs()
        assert "host landing pages" in d.logs()
    finally:
        for s in (d, p, col):
            if s:
                s.stop()


def test_small_ring_pieces_and_backpressure(colocated):
    """A 128 KiB ring: a layer's write of 4 pages (96 KiB) is more than a quarter of it, so it
    travels in pieces, and four concurrent requests wait for room."""
    p = d = None
    try:
        p = prefill_node(STAGE + ["--staging-memory", "128K"])
        d = decode_node([p], STAGE)
        ps = prompts(4, 43, [200, 150, 100, 70] if not SANITIZED else [100, 70])
        want = [run(colocated, x) for x in ps]
        with cf.ThreadPoolExecutor(len(ps)) as ex:
            got = list(ex.map(lambda x: run(d, x), ps))
        assert got == want
        mp, _ = staging_idle(p, d)
        writes = counter(mp, "tandem_disagg_staged_writes_total", result="ok")
        assert mp[("tandem_disagg_staged_pieces_total", ())] >= 2 * writes
        assert mp[("tandem_disagg_staging_ring_bytes", ())] == 128 * 1024
        assert mp[("tandem_disagg_staging_ring_high_bytes", ())] <= 128 * 1024
    finally:
        for s in (d, p):
            if s:
                s.stop()


def test_landing_pages_too_few(colocated):
    """Landing pages for one page of every layer: a prompt of one page is staged, a longer
    one is prefilled on the decode node (counted), both with the colocated output."""
    p = d = None
    try:
        p = prefill_node(STAGE)
        # SHORT_LAYERS x 24 KiB (f32, 3 kv heads of 64, 16 tokens, K and V) a page: room for one
        page = SHORT_LAYERS * 24
        d = decode_node([p], STAGE + ["--staging-memory", f"{page * 3 // 2}K"])
        assert "the host landing pages hold 16 tokens" in d.logs()
        short, long_ = prompts(2, 44, [12, 40])
        assert run(d, short) == run(colocated, short)
        assert run(d, long_) == run(colocated, long_)
        _, md = staging_idle(p, d)
        assert md[("tandem_disagg_landing_pages", ())] == 1
        assert md[("tandem_disagg_staged_prefills_total", ())] == 1
        assert md[("tandem_disagg_landing_full_total", ())] == 1
    finally:
        for s in (d, p):
            if s:
                s.stop()


def test_cpu_prefill_into_landing_pages(colocated):
    """The prefill node does not stage (its pool is host memory the fabric registers): it
    writes straight into the decoder's landing pages, which the decoder copies in."""
    p = d = None
    try:
        p = prefill_node(["--kv-staging", "off"])
        d = decode_node([p], STAGE)
        ps = prompts(3, 45, [17, 65, 129])
        want = [run(colocated, x) for x in ps]
        assert [run(d, x) for x in ps] == want
        md = decode_idle(d)
        assert md[("tandem_disagg_staged_prefills_total", ())] == len(ps)
        assert md[("tandem_disagg_landing_pages_used", ())] == 0
        mp = prefill_idle(p)
        assert ("tandem_disagg_staging_ring_bytes", ()) not in mp  # nothing staged there
        assert "KV pages by libfabric, from host memory here to host memory there" in p.logs()
    finally:
        for s in (d, p):
            if s:
                s.stop()


@pytest.mark.parametrize("side,spec", FAULTS, ids=[f"{a}-{b.split(',')[0]}" for a, b in FAULTS])
def test_staged_faults_never_hang(colocated, side, spec):
    faults_never_hang(colocated, side, spec, 47, STAGE, staging_idle)


def test_staged_prefill_killed_mid_transfer(colocated):
    """SIGKILL the prefill node while it stages a long prompt: the decoder fences the pool and
    landing pages, prefills locally, and gives every landing page back once the peer is gone."""
    d, p = kill_mid_transfer(colocated, 48, STAGE)
    try:
        deadline = time.time() + 60
        while True:  # the fenced landing pages come back once the peer is found gone
            m = decode_idle(d)
            if m[("tandem_disagg_landing_pages_used", ())] == 0:
                break
            assert time.time() < deadline, "landing pages still lent"
            time.sleep(0.1)
        assert m[("tandem_disagg_local_fallbacks_total", ())] >= 1
    finally:
        d.stop()
        p.stop()
