"""Two-process tests of the transfer engine (src/xfer/) through tests/tools/xfer_peer.

A target process registers a region and arms an immediate counter; an initiator process posts
paged writes of random pages into it. The byte-for-byte check is done here with numpy from the
dumps both processes write (the initiator's source region and page lists, the target's region),
independently of the C code. Covered: tcp;ofi_rxm on loopback, shm, two network namespaces joined
by a veth pair, counters firing exactly once, every fault-injection mode, stale epochs, timeouts,
and peer death (SIGKILL by PID) on either side. No test asserts a timing; every process has a
timeout and is killed by PID in a finally block.
"""
import os
import re
import shutil
import signal
import subprocess
import time
import uuid

import numpy as np
import pytest

from conftest import build_dir

TDM_OK, TDM_EIO, TDM_ETIMEDOUT, TDM_EPEER = 0, -3, -9, -11
PROVIDERS = [("tcp;ofi_rxm", "127.0.0.1"), ("shm", None)]


def peer_bin():
    p = build_dir() / "tests" / "tools" / "xfer_peer"
    if not p.exists():
        pytest.fail(f"{p} not built")
    return p


def _args(role, provider, node, extra):
    a = [str(peer_bin()), "--role", role, "--provider", provider]
    if node:
        a += ["--node", node]
    return a + [str(x) for x in extra]


def _read_addr(proc, timeout=15):
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("ADDR "):
            return line.split()[1], lines
    raise AssertionError(f"target printed no address: {lines} {proc.stderr.read()[-2000:]}")


def _kill(proc):
    if proc and proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def run_pair(provider, node, target_extra=(), init_extra=(), tmp_path=None, kill=None,
             target_prefix=(), init_prefix=(), init_node=None):
    """Runs target and initiator; returns (target_stdout, initiator_stdout, dump prefix).
    kill: None, "initiator" or "target": SIGKILL that process once the initiator is posting."""
    dump = str(tmp_path / "d") if tmp_path else None
    dump_args = ["--dump", dump] if dump else []
    target = init = None
    try:
        target = subprocess.Popen(list(target_prefix) +
                                  _args("target", provider, node, list(target_extra) + dump_args),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        addr, t_lines = _read_addr(target)
        init = subprocess.Popen(list(init_prefix) +
                                _args("initiator", provider, init_node or node,
                                      ["--peer", addr] + list(init_extra) + dump_args),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if kill:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                line = init.stdout.readline()
                if not line or line.startswith("POSTING"):
                    break
            time.sleep(0.5)
            _kill(init if kill == "initiator" else target)
        i_out, i_err = init.communicate(timeout=60)
        t_out, t_err = target.communicate(timeout=60)
        err = t_err + i_err
        for marker in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
            assert marker not in err, err[-6000:]
        # a process that was not killed must exit cleanly
        for name, proc in (("initiator", init), ("target", target)):
            if kill != name:
                assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{err[-4000:]}"
        return "".join(t_lines) + (t_out or ""), i_out or "", dump, err
    finally:
        _kill(init)
        _kill(target)


def fields(out, key):
    """The key=value fields of the last line starting with `key`."""
    lines = [l for l in out.splitlines() if l.startswith(key + " ")]
    assert lines, f"no {key} line in:\n{out}"
    return {k: v for k, v in re.findall(r"(\w+)=(\S*)", lines[-1])}


def firings(out):
    return [int(m) for m in re.findall(r"^FIRED code=(-?\d+)", out, re.M)]


def verify_dump(dump, n_posts, k, page_bytes, region_pages):
    src = np.fromfile(dump + ".src", dtype=np.uint8).reshape(region_pages, page_bytes)
    dst = np.fromfile(dump + ".dst", dtype=np.uint8).reshape(region_pages, page_bytes)
    sp = np.fromfile(dump + ".srcpages", dtype="<u4").reshape(n_posts, k)
    dp = np.fromfile(dump + ".dstpages", dtype="<u4").reshape(n_posts, k)
    expect = np.zeros_like(dst)
    written = np.zeros(region_pages, dtype=bool)
    for w in range(n_posts):  # destinations are distinct, except stale twins (same bytes)
        for s, d in zip(sp[w], dp[w]):
            expect[d] = src[s]
            written[d] = True
    assert written.any()
    bad = np.nonzero((expect != dst).any(axis=1))[0]
    assert bad.size == 0, f"{bad.size} pages differ, first {bad[:8]}"
    assert not dst[~written].any(), "bytes landed outside the written pages"


@pytest.mark.all_cases_sanitized  # each transport at each page size: its own paths
@pytest.mark.parametrize("provider,node", PROVIDERS, ids=["tcp", "shm"])
@pytest.mark.parametrize("page_bytes", [4096, 65536])
def test_paged_writes_land_byte_for_byte(provider, node, page_bytes, tmp_path):
    n, k, pages = 12, 16, 256
    common = ["--writes", n, "--pages-per-write", k, "--page-bytes", page_bytes,
              "--region-pages", pages, "--seed", 11]
    t, i, dump, err = run_pair(provider, node, common, common, tmp_path)
    assert firings(t) == [TDM_OK], t + err
    c = fields(t, "COUNTERS")
    assert int(c["counted"]) == n and int(c["fired_ok"]) == 1
    assert fields(i, "WRITES")["code"] == "0", i + err
    verify_dump(dump, n, k, page_bytes, pages)
    # merging: fewer fabric writes than pages (odd writes carry a 4-page contiguous run)
    assert int(fields(i, "STATS")["writes_posted"]) < n * k


@pytest.mark.parametrize("provider,node", PROVIDERS, ids=["tcp", "shm"])
def test_duplicated_immediates_count_once(provider, node, tmp_path):
    common = ["--writes", 16, "--pages-per-write", 4, "--seed", 3]
    t, i, dump, err = run_pair(provider, node, common + ["--faults", "dup_imm=0.5,seed=5"],
                               common, tmp_path)
    assert firings(t) == [TDM_OK], t + err
    s, c = fields(t, "STATS"), fields(t, "COUNTERS")
    assert int(s["imm_duplicated"]) > 0
    assert int(c["counted"]) == 16 and int(c["duplicate"]) >= 1
    verify_dump(dump, 16, 4, 4096, 256)


def test_dropped_immediate_ends_in_timeout(tmp_path):
    common = ["--writes", 16, "--pages-per-write", 4]
    t, i, _, err = run_pair("tcp;ofi_rxm", "127.0.0.1",
                            common + ["--faults", "drop_imm=0.3,seed=9", "--counter-timeout-ms",
                                      1500], common, tmp_path)
    assert int(fields(t, "STATS")["imm_dropped"]) > 0
    assert firings(t) == [TDM_ETIMEDOUT], t + err


def test_delayed_immediates_still_fire(tmp_path):
    common = ["--writes", 10, "--pages-per-write", 4]
    t, i, dump, err = run_pair("tcp;ofi_rxm", "127.0.0.1",
                               common + ["--faults", "delay_imm_ms=80"], common, tmp_path)
    assert firings(t) == [TDM_OK], t + err
    assert int(fields(t, "STATS")["imm_delayed"]) == 10
    verify_dump(dump, 10, 4, 4096, 256)


def test_reordered_immediates_still_fire(tmp_path):
    common = ["--writes", 16, "--pages-per-write", 4]
    t, i, dump, err = run_pair("shm", None, common + ["--faults", "reorder_imm=0.5,seed=2"],
                               common, tmp_path)
    assert firings(t) == [TDM_OK], t + err
    assert int(fields(t, "STATS")["imm_reordered"]) > 0
    verify_dump(dump, 16, 4, 4096, 256)


def test_injected_write_failure(tmp_path):
    common = ["--writes", 16, "--pages-per-write", 4]
    t, i, _, err = run_pair("tcp;ofi_rxm", "127.0.0.1", common + ["--counter-timeout-ms", 1500],
                            common + ["--faults", "fail_write=0.3,seed=4"], tmp_path)
    w = fields(i, "WRITES")
    assert int(w["code"]) == TDM_EIO and "injected" in i, i + err
    assert int(fields(i, "STATS")["injected_failures"]) > 0
    assert firings(t) == [TDM_ETIMEDOUT], t + err


def test_stale_epoch_is_ignored(tmp_path):
    common = ["--writes", 6, "--pages-per-write", 4, "--stale", 3]
    t, i, dump, err = run_pair("tcp;ofi_rxm", "127.0.0.1", common, common, tmp_path)
    assert firings(t) == [TDM_OK], t + err
    c = fields(t, "COUNTERS")
    assert int(c["stale"]) == 3 and int(c["counted"]) == 6
    verify_dump(dump, 9, 4, 4096, 256)


def test_counter_times_out_when_short(tmp_path):
    common = ["--writes", 5, "--pages-per-write", 2]
    t, i, _, err = run_pair("shm", None, common + ["--expect", 6, "--counter-timeout-ms", 1000],
                            common, tmp_path)
    assert firings(t) == [TDM_ETIMEDOUT], t + err
    assert int(fields(t, "COUNTERS")["counted"]) == 5


@pytest.mark.parametrize("provider,node", PROVIDERS, ids=["tcp", "shm"])
def test_initiator_killed_mid_transfer(provider, node, tmp_path):
    common = ["--writes", 200, "--pages-per-write", 4, "--interval-ms", 50,
              "--region-pages", 1024]
    t, i, _, err = run_pair(provider, node,
                            common + ["--counter-timeout-ms", 60000, "--peer-timeout-ms", 1000],
                            common, tmp_path, kill="initiator")
    # the counter is bound to the peer: it fails with EPEER, long before its own timeout
    assert firings(t) == [TDM_EPEER], t + err
    assert "PEER 0 down" in t


@pytest.mark.parametrize("provider,node", PROVIDERS, ids=["tcp", "shm"])
def test_target_killed_mid_transfer(provider, node, tmp_path):
    common = ["--writes", 200, "--pages-per-write", 4, "--interval-ms", 50,
              "--region-pages", 1024]
    t, i, _, err = run_pair(provider, node, common,
                            common + ["--peer-timeout-ms", 1000, "--op-timeout-ms", 3000,
                                      "--counter-timeout-ms", 1000],
                            tmp_path, kill="target")
    w = fields(i, "WRITES")
    assert int(w["code"]) in (TDM_EPEER, TDM_ETIMEDOUT), i + err
    assert "PEER 0 down" in i, i + err


def _sh(*cmd):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


def test_two_network_namespaces_over_veth(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root); skipped here")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is missing; cannot make network namespaces")
    tag = uuid.uuid4().hex[:6]
    na, nb = f"tdmxa{tag}", f"tdmxb{tag}"
    va, vb = f"tva{tag}", f"tvb{tag}"
    made = []
    try:
        for ns in (na, nb):
            cp = _sh("ip", "netns", "add", ns)
            if cp.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {cp.stderr.strip()}")
            made.append(ns)
        steps = [("ip", "link", "add", va, "type", "veth", "peer", "name", vb),
                 ("ip", "link", "set", va, "netns", na), ("ip", "link", "set", vb, "netns", nb),
                 ("ip", "-n", na, "addr", "add", "10.231.0.1/24", "dev", va),
                 ("ip", "-n", nb, "addr", "add", "10.231.0.2/24", "dev", vb),
                 ("ip", "-n", na, "link", "set", va, "up"), ("ip", "-n", nb, "link", "set", vb, "up"),
                 ("ip", "-n", na, "link", "set", "lo", "up"),
                 ("ip", "-n", nb, "link", "set", "lo", "up")]
        for s in steps:
            cp = _sh(*s)
            if cp.returncode != 0:
                pytest.skip(f"cannot build the veth pair ({' '.join(s)}): {cp.stderr.strip()}")
        n, k = 10, 8
        common = ["--writes", n, "--pages-per-write", k, "--page-bytes", 65536,
                  "--region-pages", 128]
        t, i, dump, err = run_pair("tcp;ofi_rxm", "10.231.0.1", common, common, tmp_path,
                                   target_prefix=("ip", "netns", "exec", na),
                                   init_prefix=("ip", "netns", "exec", nb), init_node="10.231.0.2")
        assert firings(t) == [TDM_OK], t + err
        assert fields(i, "WRITES")["code"] == "0", i + err
        verify_dump(dump, n, k, 65536, 128)
    finally:
        for ns in made:  # deleting a namespace removes its end of the veth pair, and the pair
            _sh("ip", "netns", "del", ns)
