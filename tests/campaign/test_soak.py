"""The soak's one-minute version (tests/campaign/soak.py): 1,000 concurrent streaming clients
through the router to a prefill/decode pair for 60 s (as many waves of 1,000 as end within
it, at least one: one wave of about 65 s on two cores, where letting a second wave start
before 60 s had the run last 110 s), with no failed request, no wrong probe answer and no
leaked page. Its requests are short (8-token prompts, 4 tokens out): the load is
the 1,000 streams in flight at once; with the soak's 32 + 16 tokens one wave alone took 270 s
on two cores. The ten-minute run is made by hand and kept in bench/RESULTS.md.
Release pass only: under the sanitizers the same paths run in the router and disaggregation
tests at a load the sanitizers can carry."""
import pathlib
import subprocess
import sys

import pytest

from lib.sanitize import release_only

HERE = pathlib.Path(__file__).resolve().parent


@release_only("1,000 clients for a minute: too slow under the sanitizers")
def test_soak_one_minute(default_model):
    cp = subprocess.run([sys.executable, str(HERE / "soak.py"), "--clients", "1000",
                         "--duration", "60", "--sample-s", "5",
                         "--input-len", "8", "--output-len", "4"], capture_output=True,
                        text=True, timeout=900)
    print(cp.stdout)
    assert cp.returncode == 0, f"{cp.stdout[-4000:]}\n{cp.stderr[-4000:]}"
    assert "soak: passed" in cp.stdout
