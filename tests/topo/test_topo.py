"""Placement of ranks on a machine's topology (issue 17, item 3): `tandem topo` against a reference
that reads the same hwloc XML with xml.etree and applies the placement rule written out in
include/tandem/topo.h (GPUs in PCI bus order; the NICs below the GPU's nearest ancestor that has
any, RDMA devices first; NUMA nodes when GPUs are fewer than ranks; ranks sharing a set start on
different NICs of it). The fixtures describe a 2-socket node with 4 GPUs and 4 RDMA NICs behind
PCIe switches (one GPU without a NIC on its switch), and a 2-socket host with one Ethernet port;
this machine's own topology is checked against /sys and the process's CPU affinity."""
import json
import os
import pathlib
import subprocess
import xml.etree.ElementTree as ET

import pytest

from conftest import build_dir

FIX = pathlib.Path(__file__).parent / "fixtures"


def tandem():
    return str(build_dir() / "tandem")


def topo(*args, env=None):
    return subprocess.run([tandem(), "topo", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def topo_json(*args):
    r = topo(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ---- the reference: the rule applied to the XML tree ----

def cpulist(mask):
    bits = [i for i in range(64) if int(mask, 16) >> i & 1]
    out, i = [], 0
    while i < len(bits):
        j = i
        while j + 1 < len(bits) and bits[j + 1] == bits[j] + 1:
            j += 1
        out.append(str(bits[i]) if i == j else f"{bits[i]}-{bits[j]}")
        i = j + 1
    return ",".join(out)


def reference(xml_path, n_ranks, gpus=None):
    root = ET.parse(xml_path).getroot()
    parent = {c: p for p in root.iter() for c in p}
    objs = [o for o in root.iter("object")]
    numa_of = {}  # a normal object -> (numa os index or -1, cpulist)

    def normal_ancestor(o):
        while o.get("type") in ("Bridge", "PCIDev", "OSDev"):
            o = parent[o]
        return o

    def locality(o):
        ns = int(o.get("nodeset"), 16)
        numa = ns.bit_length() - 1 if ns and ns & (ns - 1) == 0 else -1
        return numa, cpulist(o.get("cpuset"))

    pcis = [o for o in objs if o.get("type") == "PCIDev"]
    all_gpus = sorted(o.get("pci_busid") for o in pcis
                      if o.get("pci_type").startswith("03") and "[10de:" in o.get("pci_type"))
    osdevs = [o for o in objs if o.get("type") == "OSDev"]
    rdma = [o for o in osdevs if o.get("osdev_type") == "3"]
    nics = rdma or [o for o in osdevs if o.get("osdev_type") == "2"]
    by_bus = {o.get("pci_busid"): o for o in pcis}

    def ancestors(o):
        while o in parent and parent[o].tag == "object":
            o = parent[o]
            yield o

    if gpus is None and len(all_gpus) >= n_ranks:
        gpus = all_gpus[:n_ranks]
    nodes = sorted((o for o in objs if o.get("type") == "NUMANode"),
                   key=lambda o: int(o.get("os_index")))
    out = []
    for r in range(n_ranks):
        if gpus:
            g = by_bus[gpus[r]]
            numa, cpus = locality(normal_ancestor(g))
            chosen, near = [], "none"
            for a in ancestors(g):
                chosen = [n for n in nics if a in set(ancestors(n))]
                if chosen:
                    if a.get("type") == "Bridge":
                        near = "pcie-root" if a.get("bridge_type").startswith("0-") else "pcie-switch"
                    elif a.get("type") == "PCIDev":
                        near = "pcie-switch"
                    else:
                        ns = int(a.get("nodeset"), 16)
                        near = "numa" if bin(ns).count("1") <= 1 else "host"
                    break
            out.append(dict(gpu=gpus[r], numa=numa, cpus=cpus, nics=[n.get("name") for n in chosen],
                            near=near))
        else:
            node = nodes[r * len(nodes) // n_ranks]
            cpus = cpulist(node.get("cpuset"))
            mask = int(node.get("cpuset"), 16)
            local = [n for n in nics
                     if int(normal_ancestor(n).get("cpuset"), 16) & ~mask == 0]
            chosen = local or nics
            near = "numa" if local else ("host" if nics else "none")
            out.append(dict(gpu=None, numa=int(node.get("os_index")), cpus=cpus,
                            nics=[n.get("name") for n in chosen], near=near))
    orig = [list(p["nics"]) for p in out]
    for r, p in enumerate(out):  # ranks sharing a set start on different NICs of it
        k = sum(1 for q in orig[:r] if q == orig[r])
        n = len(orig[r])
        p["nics"] = [orig[r][(i + k) % n] for i in range(n)]
    return out


def check(got, want):
    assert len(got["ranks"]) == len(want)
    for g, w in zip(got["ranks"], want):
        assert g["gpu"] == w["gpu"], (g, w)
        assert g["numa"] == w["numa"], (g, w)
        assert g["cpus"] == w["cpus"], (g, w)
        assert [n["name"] for n in g["nics"]] == w["nics"], (g, w)
        assert g["near"] == w["near"], (g, w)


def test_gpus_take_the_nics_behind_their_switch():
    xml = FIX / "4gpu-2socket.xml"
    got = topo_json("--xml", str(xml), "--ranks", "4")
    assert got["this_system"] is False
    want = reference(xml, 4)
    check(got, want)
    # what the fixture was drawn to show, stated outright
    assert [r["near"] for r in got["ranks"]] == ["pcie-switch"] * 3 + ["pcie-root"]
    assert [n["name"] for n in got["ranks"][1]["nics"]] == ["mlx5_1", "mlx5_2"]
    assert all(n["rdma"] for r in got["ranks"] for n in r["nics"])  # not ib0 or eth0


def test_named_gpus_in_any_order():
    xml = FIX / "4gpu-2socket.xml"
    gpus = ["0000:ab:00.0", "0000:2a:00.0"]
    got = topo_json("--xml", str(xml), "--ranks", "2", "--gpus", ",".join(gpus))
    check(got, reference(xml, 2, gpus))
    assert got["ranks"][0]["numa"] == 1 and got["ranks"][1]["numa"] == 0


def test_more_ranks_than_gpus_spread_over_numa_nodes_and_rotate_nics():
    xml = FIX / "4gpu-2socket.xml"
    got = topo_json("--xml", str(xml), "--ranks", "8")
    check(got, reference(xml, 8))
    firsts = [r["nics"][0]["name"] for r in got["ranks"][:3]]
    assert firsts == ["mlx5_0", "mlx5_1", "mlx5_2"]  # three ranks, three different first NICs


def test_a_node_without_a_nic_uses_the_hosts():
    xml = FIX / "2socket-eth.xml"
    got = topo_json("--xml", str(xml), "--ranks", "2")
    check(got, reference(xml, 2))
    assert [r["near"] for r in got["ranks"]] == ["numa", "host"]
    text = topo("--xml", str(xml), "--ranks", "2")
    assert text.returncode == 0
    assert "rank 1: GPU none, NUMA node 1 (cores 2-3), NIC eth0" in text.stdout


def test_this_machine():
    got = topo_json("--ranks", "2")
    assert got["this_system"] is True
    allowed = set(os.sched_getaffinity(0))
    for r in got["ranks"]:
        cores = set()
        for part in r["cpus"].split(","):
            a, _, b = part.partition("-")
            cores |= set(range(int(a), int(b or a) + 1))
        assert cores and cores <= set(range(os.cpu_count() or 1)), r
        assert cores & allowed, r
        names = set(os.listdir("/sys/class/net")) | (
            set(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband")
            else set())
        assert {n["name"] for n in r["nics"]} <= names, r
        assert r["near"] in ("numa", "host", "none", "pcie-switch", "pcie-root")


@pytest.mark.parametrize("args, rc, words", [
    (["--ranks", "0"], 2, "ranks"),
    (["--ranks", "65"], 2, "ranks"),
    (["--ranks", "2", "--gpus", "0000:18:00.0"], 2, "1 GPU for 2 ranks"),
    (["--ranks", "1", "--gpus", "0000:18:00.0,0000:2a:00.0"], 2, "more GPUs"),
    (["--xml", "/nonexistent/topo.xml"], 1, "/nonexistent/topo.xml"),
    (["--xml", str(FIX / "4gpu-2socket.xml"), "--gpus", "0000:ff:00.0"], 1, "0000:ff:00.0"),
    (["--bogus"], 2, "bogus"),
])
def test_bad_arguments(args, rc, words):
    r = topo(*args)
    assert r.returncode == rc, (r.stdout, r.stderr)
    assert words in r.stderr
    assert "Traceback" not in r.stderr and "Sanitizer" not in r.stderr


def test_garbage_xml_is_refused(tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_bytes(b"<topology version=\"2.0\"><object type=\"Machine\" cpuset=\"zz\"")
    r = topo("--xml", str(bad))
    assert r.returncode == 1 and str(bad) in r.stderr
