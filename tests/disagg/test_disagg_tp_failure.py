"""A sharded prefill node dying mid-transfer (issue 17, item 5): a TP = 2 prefill node is killed
with SIGKILL while it streams a long prompt's KV into a TP = 2 decoder (the default model's 3 KV
heads split 2 + 1 on both sides: each rank writes its own slice of every layer). The decoder
fences the request on every rank (no rank's pages are reused while a write may still land),
prefills it locally, and the client gets the answer a colocated TP = 2 server gives; afterwards
the decoder's pool, every rank's shard of it included, is back at baseline with nothing fenced,
and the dead peer is marked down."""
import pytest

from test_disagg import colocated_server, decode_idle, kill_mid_transfer  # noqa: F401

TP2 = ["--tp", "2"]


@pytest.fixture(scope="module")
def colocated_tp2(default_model):
    s = colocated_server(TP2)
    try:
        yield s
    finally:
        s.stop()


def test_sharded_prefill_killed_mid_transfer(colocated_tp2):
    d, p = kill_mid_transfer(colocated_tp2, 17, TP2)
    try:
        m = decode_idle(d)
        errs = sum(v for (name, _), v in m.items()
                   if name == "tandem_disagg_transfer_errors_total")
        assert errs >= 1 and m[("tandem_disagg_local_fallbacks_total", ())] >= 1
        assert m[("tandem_disagg_peer_up", (("peer", "0"),))] == 0
        assert m[("tandem_disagg_fenced_pages", ())] == 0
        assert m[("tandem_kv_pages_used", ())] == 0
        assert m[("tandem_kv_pages_in_flight", ())] == 0
    finally:
        d.stop()
        p.stop()
