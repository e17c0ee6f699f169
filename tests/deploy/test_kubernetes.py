"""deploy/kubernetes/ (issue 19, item 2): the manifests of a prefill pool, a decode pool and the
router validate against Kubernetes' own schemas (kubernetes-validate, strict: no unknown field),
and agree with tandem: every flag they pass exists in that command's usage, the serving pods
have the readiness and liveness probes tandem answers, the decoders list exactly the prefill
StatefulSet's pods by their stable names (the http:// peers that ask a pod for its fabric
address), and every Secret and volume claim they mount is defined. No cluster is needed."""
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from conftest import run_tandem

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))


def docs():
    out = []
    for path in MANIFESTS:
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def by_kind(kind):
    return [d for d in docs() if d["kind"] == kind]


def containers():
    for d in docs():
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield d, c


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_validates(path):
    cp = subprocess.run([str(pathlib.Path(sys.executable).parent / "kubernetes-validate"),
                         "--strict", "--quiet", str(path)], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_flags_exist():
    usage = {cmd: run_tandem([cmd, "--help"], check=False) for cmd in ("serve", "router")}
    for d, c in containers():
        cmd, *args = c["args"]
        text = usage[cmd].stdout + usage[cmd].stderr
        for a in args:
            flag = a.split("=", 1)[0]
            assert re.search(rf"(^|\s){re.escape(flag)}(\s|$)", text, re.M), \
                f"{d['metadata']['name']}: {flag} is not a `tandem {cmd}` flag"


def test_probes():
    for d, c in containers():
        want = ("/ready", "/live") if c["args"][0] == "serve" else ("/health", "/health")
        assert c["readinessProbe"]["httpGet"]["path"] == want[0], d["metadata"]["name"]
        assert c["livenessProbe"]["httpGet"]["path"] == want[1], d["metadata"]["name"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]


def test_decoders_list_the_prefill_pods():
    (sts,) = [s for s in by_kind("StatefulSet") if s["metadata"]["name"] == "tandem-prefill"]
    svc = next(s for s in by_kind("Service") if s["metadata"]["name"] == sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    port = svc["spec"]["ports"][0]["port"]
    want = [f"http://{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{port}"
            for i in range(sts["spec"]["replicas"])]
    decoders = [c for d, c in containers() if "--role=decode" in c["args"]]
    assert decoders
    for c in decoders:
        peers = next(a for a in c["args"] if a.startswith("--prefill-peers="))
        assert peers.split("=", 1)[1].split(",") == want


def test_references_are_defined():
    secrets = {s["metadata"]["name"] for s in by_kind("Secret")}
    claims = {s["metadata"]["name"] for s in by_kind("PersistentVolumeClaim")}
    services = {s["metadata"]["name"] for s in by_kind("Service")}
    for d in docs():
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for v in d["spec"]["template"]["spec"].get("volumes", []):
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
        for c in d["spec"]["template"]["spec"]["containers"]:
            for a in c["args"]:
                if a.startswith("--backends="):
                    host = a.split("//", 1)[1].split(":")[0]
                    assert host in services, a
