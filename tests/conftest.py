"""Shared pytest fixtures for tandem's test suite.

The suite is driven by pytest: C unit tests (cmocka programs built by CMake under
$TANDEM_BUILD/tests) run as one pytest item each (tests/test_c_units.py), and the Python tests
check tandem against independent references (gguf, safetensors, tokenizers, numpy, jinja2).

Environment:
  TANDEM_BUILD  build folder holding the `tandem` binary (default: build)
  TANDEM_MODEL  the default GGUF model (default: ~/.cache/tandem/models/...)
  TANDEM_POOL_SPIN_US  how long an idle compute thread spins (default here: 20, the binary's own
                default 300): the suite runs several processes of two or more threads each on
                a machine of few cores, where spinning threads take the cores the working ones
                need (two test files on 2 cores, -n 2: 109 s with 300, 87-99 s with 20)
"""
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("TANDEM_POOL_SPIN_US", "20")
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_dir() -> pathlib.Path:
    return (ROOT / os.environ.get("TANDEM_BUILD", "build")).resolve()


def default_model_path() -> pathlib.Path:
    if os.environ.get("TANDEM_MODEL"):
        return pathlib.Path(os.environ["TANDEM_MODEL"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "tandem" / "models" / MODEL_FILE


@pytest.fixture(scope="session")
def tandem_bin() -> pathlib.Path:
    p = build_dir() / "tandem"
    if not p.exists():
        pytest.fail(f"{p} not built; run scripts/test.sh or cmake --build {build_dir()}")
    return p


@pytest.fixture(scope="session")
def default_model() -> pathlib.Path:
    p = default_model_path()
    if not p.exists():
        pytest.fail(f"default model missing at {p}; run scripts/fetch_model.sh")
    return p


def run_tandem(args, timeout=300, check=True, env=None, input=None):
    """Runs the tandem binary; returns CompletedProcess (text mode)."""
    exe = build_dir() / "tandem"
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    cp = subprocess.run([str(exe)] + [str(a) for a in args], capture_output=True, text=True,
                        timeout=timeout, env=full_env, input=input)
    if check and cp.returncode != 0:
        raise AssertionError(f"tandem {' '.join(map(str, args))} exited {cp.returncode}:\n"
                             f"{cp.stderr[-4000:]}")
    return cp


# ---- the server tests (tests/server/): one shared `tandem serve` per module, and a check after
# every test that uses it that the server is idle with its KV page pool back at baseline ----

@pytest.fixture(scope="module")
def server(default_model):
    from lib.server import Server
    s = Server(["--threads", "2"])
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def pool_back_to_baseline(request):
    yield
    if "server" in request.fixturenames:
        s = request.getfixturevalue("server")
        if s.proc.poll() is None:
            s.wait_idle()
