"""Several NICs per node (issue 17, item 4; src/xfer/rails.c): a prefill node and a decode node
with two rails each (`--xfer-nics`: two tcp;ofi_rxm endpoints on the loopback, one named by
address, one by interface, stand for two NICs), end to end.

Greedy output must be the colocated server's; the prefill node's KV writes are spread over both
rails (per-rail write counts both > 0, summing to every write it made), the decoder's one
counter per request took immediates from both rails, and both pools are back at their baseline
afterwards. A decoder of one NIC beside them (the compatible case) gets every write on rail 0,
with the same answers. The same with --kv-staging always (the staged writer's ring writes
through the rails), and between sharded nodes (--tp 2 both sides: every rank's pool registered
on both rails).

tests/xfer/test_rails.c checks the round robin exactly, the descriptor and message wire, and a
rail's peer dying (the request fenced, the rail paired again when it comes back)."""
import time

import pytest

from lib.server import Server
from test_disagg import (CHUNK, THREADS, colocated_server, decode_idle, decode_node, prefill_idle,
                         prefill_node, prompts, run, wait_peers_up)


def by_rail(m, name):
    out = {}
    for (n, labels), v in m.items():
        if n == name:
            rail = dict(labels)["rail"]
            out[rail] = out.get(rail, 0) + v
    return out


def wait_rails_paired(server, timeout=60):
    deadline = time.time() + timeout
    while by_rail(server.metrics(), "tandem_xfer_rail_peers_up").get("1", 0) < 1:
        assert time.time() < deadline, "rail 1 never paired"
        time.sleep(0.1)


@pytest.mark.parametrize("staging", [False, True], ids=["rma", "staged"])
def test_two_rails_each_side(default_model, staging):
    """With --kv-staging always the staged writer's ring writes through the rails too."""
    extra = ["--kv-staging", "always"] if staging else []
    colocated = colocated_server()
    procs = [colocated]
    try:
        p = prefill_node(["--xfer-nics", "127.0.0.1,lo"] + extra)
        procs.append(p)
        d = decode_node([p], ["--xfer-nics", "lo,127.0.0.1"] + extra)
        procs.append(d)
        wait_peers_up(d, 1)
        wait_rails_paired(p)
        wait_rails_paired(d)
        ps = prompts(6, 417, [40, 70, 130, 200, 3, 65])  # one to four chunks of CHUNK tokens
        want = [run(colocated, x) for x in ps]
        got = [run(d, x) for x in ps]
        for i, (w, g) in enumerate(zip(want, got)):
            assert w == g, f"prompt {i} ({len(ps[i])} tokens): output differs over two rails"
        md = decode_idle(d)
        mp = prefill_idle(p)
        assert md[("tandem_disagg_remote_prefills_total", ())] == len(ps)
        assert md[("tandem_disagg_local_fallbacks_total", ())] == 0
        for kind in ("timeout", "peer", "nack", "send", "other"):
            assert md[("tandem_disagg_transfer_errors_total", (("kind", kind),))] == 0, kind
        writes = by_rail(mp, "tandem_xfer_rail_writes_total")
        assert writes.get("0", 0) > 0 and writes.get("1", 0) > 0, writes
        assert sum(writes.values()) == mp[("tandem_disagg_writes_total", ())], writes
        assert by_rail(mp, "tandem_xfer_rail_bytes_total").get("1", 0) > 0
        imms = by_rail(md, "tandem_xfer_rail_immediates_total")
        assert imms.get("0", 0) > 0 and imms.get("1", 0) > 0, imms
        assert sum(imms.values()) == \
            md[("tandem_fabric_immediates_total", (("kind", "counted"),))]
        assert md[("tandem_kv_pages_used", ())] == 0
        if staging:
            assert md[("tandem_disagg_landing_pages_used", ())] == 0
            assert mp[("tandem_disagg_staging_ring_used_bytes", ())] == 0
            return

        # a decoder of one NIC (named by --xfer-nics: its one endpoint's address): everything on rail 0 of the prefill node, the same answers
        d1 = decode_node([p], ["--xfer-nics", "lo"])
        procs.append(d1)
        wait_peers_up(d1, 1)
        got = [run(d1, x) for x in ps[:3]]
        assert got == want[:3]
        decode_idle(d1)
        mp2 = prefill_idle(p)
        writes2 = by_rail(mp2, "tandem_xfer_rail_writes_total")
        assert writes2["1"] == writes["1"], (writes, writes2)
        assert writes2["0"] > writes["0"]
        assert ("tandem_xfer_rail_writes_total" not in {n for n, _ in d1.metrics()})
    finally:
        for s in reversed(procs):
            s.stop()


def test_two_rails_sharded(tmp_path):
    """A prefill node of --tp 2 and a decoder of --tp 2 (H = 2 KV heads: every rank's pool is
    registered on both rails, its descriptor in the SHARDED block carrying both keys), two
    rails each: greedy output as the colocated TP 1 server's, both rails used, pools back."""
    from lib.checkpoints import make_gguf_checkpoint
    from test_disagg import DECODE_SLACK, SLACK
    from test_disagg_tp import CHUNK as TP_CHUNK, EXACT, LP_TOL, run_named

    model = make_gguf_checkpoint(tmp_path / "kv2.gguf", "llama", seed=417, hidden_size=128,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                 intermediate_size=256, num_hidden_layers=2)
    procs = []
    try:
        colocated = Server(EXACT, model=model)
        procs.append(colocated)
        p = Server(EXACT + ["--role", "prefill", "--tp", 2, "--xfer-nics", "lo,lo"] + SLACK,
                   model=model)
        procs.append(p)
        d = Server(EXACT + ["--role", "decode", "--tp", 2, "--prefill-peers",
                            f"http://127.0.0.1:{p.port}", "--remote-chunk", TP_CHUNK,
                            "--xfer-nics", "lo,lo"] + DECODE_SLACK, model=model)
        procs.append(d)
        wait_peers_up(d, 1)
        wait_rails_paired(p)
        ps = [[t % 250 + 3 for t in x] for x in prompts(3, 418, [5, 40, 70])]
        for x in ps:
            want_tokens, want_lps = run(colocated, x)
            tokens, lps = run_named(d, x, f"127.0.0.1:{p.port}")
            assert tokens == want_tokens
            assert max(abs(a - b) for a, b in zip(lps, want_lps)) < LP_TOL
        md = decode_idle(d)
        mp = prefill_idle(p)
        assert md[("tandem_disagg_remote_prefills_total", ())] == len(ps)
        assert md[("tandem_disagg_local_fallbacks_total", ())] == 0
        writes = by_rail(mp, "tandem_xfer_rail_writes_total")
        assert writes.get("0", 0) > 0 and writes.get("1", 0) > 0, writes
        assert sum(writes.values()) == mp[("tandem_disagg_writes_total", ())], writes
    finally:
        for s in reversed(procs):
            s.stop()
