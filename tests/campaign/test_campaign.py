"""The failure campaign's short version (tests/campaign/campaign.py, one run of the cases that
no other test covers the same way; prefill SIGKILL and the fault modes have their own tests in
tests/disagg/): 0 hung, 0 wrong answers, 0 leaked pages. The full campaign (--runs 100) is run by hand and its
table kept in bench/RESULTS.md. Release pass only: under the sanitizers the same code paths run
in the disaggregation, watchdog and hardening tests."""
import pathlib
import subprocess
import sys

import pytest

from lib.sanitize import release_only

HERE = pathlib.Path(__file__).resolve().parent


@release_only("its code paths run under the sanitizers in the disaggregation, watchdog and "
              "hardening tests")
def test_campaign_short(default_model):
    cases = "prefill-stop,decode-restart,slowloris,stall,forged-imm,unauth-peer"
    cp = subprocess.run([sys.executable, str(HERE / "campaign.py"), "--runs", "1",
                         "--cases", cases], capture_output=True, text=True, timeout=1200)
    print(cp.stdout)
    assert cp.returncode == 0, f"{cp.stdout[-4000:]}\n{cp.stderr[-4000:]}"
    assert "| prefill SIGSTOP 3 s mid-transfer, SIGCONT | 1 |" in cp.stdout
    assert "| a peer without the key: flood and a free prefill | 1 | 3 | 3 |" in cp.stdout
    assert "control: with the key the same prefill wrote" in cp.stdout
