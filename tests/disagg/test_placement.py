"""Placement in `tandem serve` (issue 17, item 3): a prefill or decode node logs where each rank's
transfers run and exports it as tandem_rank_placement_info; the threads its transfer side starts
run on the leader's cores (or --transfer-cpus), which the test reads back from /proc as the
kernel reports them, while the process's other threads keep every core; a topology that is not
this machine's (hwloc's HWLOC_XMLFILE) is reported and never pinned to."""
import os
import pathlib
import subprocess

import pytest

from conftest import build_dir
from test_disagg import decode_node, prefill_idle, prefill_node, run  # noqa: F401

FIX = pathlib.Path(__file__).parent.parent / "topo" / "fixtures"


def cores(text):
    out = set()
    for part in text.strip().split(","):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def thread_cores(pid):
    """{tid: allowed cores} of every thread of pid, from /proc."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = open(f"/proc/{pid}/task/{tid}/status").read()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(tid)] = cores(line.split(":", 1)[1])
    return out


def placement(server):
    m = server.metrics()
    rows = [dict(labels) for (name, labels), v in m.items()
            if name == "tandem_rank_placement_info" and v == 1]
    return sorted(rows, key=lambda r: int(r["rank"]))


def test_transfer_threads_on_the_given_cores():
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores to tell pinned threads from the others")
    core = allowed[-1]
    p = prefill_node(["--transfer-cpus", str(core)])
    try:
        # the decoder's progress thread also spins (--xfer-busy-poll): the same answer
        d = decode_node([p], ["--transfer-cpus", str(core), "--xfer-busy-poll"])
        try:
            run(d, list(range(200, 300)))  # a remote prefill through the pinned threads
            for s in (p, d):
                tc = thread_cores(s.proc.pid)
                pinned = [t for t, c in tc.items() if c == {core}]
                assert pinned, (tc, s.logs())
                assert tc[s.proc.pid] == set(allowed), tc  # the main thread keeps every core
                assert len(pinned) < len(tc)  # compute and HTTP threads are not pinned
                assert f"transfer threads on cores {core}" in s.logs()
                rows = placement(s)
                assert [r["rank"] for r in rows] == ["0"], rows
                assert rows[0]["gpu"] == "" and rows[0]["near"] in ("numa", "host", "none")
            prefill_idle(p)
        finally:
            d.stop()
    finally:
        p.stop()


def test_a_foreign_topology_is_reported_not_pinned():
    xml = FIX / "4gpu-2socket.xml"
    p = prefill_node(env={"HWLOC_XMLFILE": str(xml)})
    try:
        rows = placement(p)
        # a CPU node places its rank on the fixture's first NUMA node, whose NICs are
        # mlx5_0..2 (tests/topo/test_topo.py checks the rule itself)
        assert rows == [{"rank": "0", "gpu": "", "numa": "0", "cpus": "0-3", "nic": "mlx5_0",
                         "nics": "3", "near": "numa"}], rows
        logs = p.logs()
        assert "placement: rank 0: GPU none, NUMA node 0 (cores 0-3)" in logs
        assert "not this machine's" in logs and "transfer threads on cores" not in logs
        tc = thread_cores(p.proc.pid)
        assert all(c == set(os.sched_getaffinity(0)) for c in tc.values()), tc
    finally:
        p.stop()


@pytest.mark.parametrize("args, words", [
    (["--transfer-cpus", "0"], "--transfer-cpus is for --role prefill or decode"),
    (["--xfer-busy-poll"], "--xfer-busy-poll is for --role prefill or decode"),
    (["--role", "prefill", "--transfer-cpus", "zz"], "--transfer-cpus zz"),
    (["--role", "prefill", "--transfer-cpus", "4000-4001"], "--transfer-cpus 4000-4001"),
])
def test_bad_transfer_cpus(args, words):
    r = subprocess.run([str(build_dir() / "tandem"), "serve", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert words in r.stderr
