"""Fixtures for the server tests: one shared server per module, and a check after every test
that the server is idle with its KV page pool back at baseline (every page free)."""
import pytest

from lib.server import Server


@pytest.fixture(scope="module")
def server(default_model):
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
