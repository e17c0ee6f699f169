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

from lib.sanitize import SANITIZED

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


# ---- the order of the files, and the sanitized pass: every value of every parameter, not every
# combination ----

def _dimensions(item):
    """{dimension: value} of a parametrized item: a dimension is one @pytest.mark.parametrize
    (its argnames; a row of a multi-name table is one value) or one parametrized fixture."""
    params = item.callspec.params
    dims, named = {}, set()
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if all(n in params for n in names):
            dims[tuple(names)] = tuple(repr(params[n]) for n in names)
            named.update(names)
    for n in params:
        if n not in named:
            dims[(n,)] = (repr(params[n]),)
    return dims


# The test files that take a minute or more of a worker on a 2-core machine, longest first.
# pytest-xdist's --dist loadfile hands files out in collection order; started first, they run
# beside the many short files instead of being the last ones left, each on one worker while the
# others idle (the Release pass's last minutes ran a core at 50-70% before this order).
LONGEST_FIRST = [
    "spec/test_eagle.py", "test_c_units.py", "disagg/test_disagg.py", "disagg/test_disagg_spec.py",
    "spec/test_train.py", "spec/test_mtp.py", "fuzz/test_fuzz_smoke.py", "engine/test_tp_heads.py",
    "spec/test_mtp_overlap.py", "spec/test_spec_e2e.py", "campaign/test_soak.py",
    "engine/test_fidelity.py", "disagg/test_staging.py", "disagg/test_disagg_eagle3.py",
    "campaign/test_campaign.py", "server/test_prefix_cache.py", "disagg/test_disagg_prefix.py",
    "server/test_concurrency.py", "engine/test_tp.py",
]


def pytest_collection_modifyitems(config, items):
    """Puts the LONGEST_FIRST files first (the rest keep their order). Under the sanitizers
    (TANDEM_SANITIZED=1), a test parametrized over two or more dimensions (stacked
    @pytest.mark.parametrize, or a parametrized fixture beside one) runs a covering
    subset of its product: in collection order, a case runs if it brings a value of some
    dimension that no earlier case of the test brought. Every value of every dimension still runs
    under ASan and UBSan, and with it every code path that one value selects; the remaining
    combinations run in the Release pass. A table of cases (one parametrize of several names) is
    one dimension, so all its rows run. A test whose combinations select paths of their own
    opts out with @pytest.mark.all_cases_sanitized."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(ROOT / "tests").as_posix(),
                                         len(rank)))
    if not SANITIZED:
        return
    skip = pytest.mark.skip(reason="sanitized pass: each of its values ran in another case; this "
                                   "combination runs in the Release pass")
    seen = {}
    for item in items:
        if (getattr(item, "callspec", None) is None
                or item.get_closest_marker("all_cases_sanitized")):
            continue
        dims = _dimensions(item)
        if len(dims) < 2:
            continue
        key = (str(item.path), item.cls.__name__ if item.cls else "", item.originalname)
        covered = seen.setdefault(key, set())
        pairs = set(dims.items())
        if pairs <= covered:
            item.add_marker(skip)
        else:
            covered |= pairs
