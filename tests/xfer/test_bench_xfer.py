"""Smoke test of `tandem bench xfer`: a tiny run over shm must verify every page size, print the
reference next to each figure, and report a latency next to libfabric's own ping-pong
(fi_pingpong, which setup installs; a missing one is said so). (No timing is asserted.)"""
import re
import shutil

from conftest import run_tandem


def test_bench_xfer_small_run(tandem_bin):
    cp = run_tandem(["bench", "xfer", "--provider", "shm", "--region-mib", "8", "--round-mib", "4",
                     "--rounds", "1", "--pings", "20", "--pages-per-write", "8"], timeout=300)
    out = cp.stdout
    assert "reference: memcpy" in out, out
    rows = re.findall(r"^\s+(\d+) KiB\s+\d+\s+([\d.]+)\s+([\d.]+)\s+\d+%\s+(\w+) [0-9a-f]{16}$", out,
                      re.M)
    assert [r[0] for r in rows] == ["4", "16", "64", "256", "1024"], out
    assert all(r[3] == "verified" for r in rows), out
    # figures are printed for every row (their size depends on the machine's load, not checked)
    assert all(float(r[1]) >= 0 and float(r[2]) > 0 for r in rows), out
    assert re.search(r"one-way latency \(median of 20\): [\d.]+ us", out), out
    if shutil.which("fi_pingpong"):
        assert re.search(r"reference: fi_pingpong, RDM, 8-byte messages, 20 round trips: [\d.]+ us "
                         r"one-way; tandem / reference [\d.]+x", out), out
    else:
        assert "reference: fi_pingpong unavailable" in out, out


def test_bench_xfer_without_its_latency_reference(tandem_bin):
    cp = run_tandem(["bench", "xfer", "--provider", "shm", "--region-mib", "4", "--round-mib", "1",
                     "--rounds", "1", "--pings", "10", "--fi-pingpong", "/no/such/fi_pingpong"],
                    timeout=300)
    assert "reference: /no/such/fi_pingpong unavailable" in cp.stdout, cp.stdout
    cp = run_tandem(["bench", "xfer", "--provider", "shm", "--region-mib", "4", "--round-mib", "1",
                     "--rounds", "1", "--pings", "10", "--fi-pingpong", "none"], timeout=300)
    assert "fi_pingpong" not in cp.stdout and "one-way latency" in cp.stdout, cp.stdout


def test_bench_xfer_rejects_bad_options(tandem_bin):
    cp = run_tandem(["bench", "xfer", "--window", "0"], check=False)
    assert cp.returncode == 2
    cp = run_tandem(["bench", "xfer", "--provider", "no-such-provider", "--pings", "10",
                     "--round-mib", "1", "--region-mib", "4"], check=False, timeout=120)
    assert cp.returncode == 1 and "no-such-provider" in cp.stderr
