"""The sanitized pass, told apart in one place.

scripts/test.sh runs the Python suite twice: on the Release build, then on the ASan+UBSan build
with TANDEM_SANITIZED=1. Under the sanitizers every process runs several times slower, so tests
scale themselves down there (fewer requests, longer timeouts) or leave it to the Release pass when
they add processes or load but no code path of their own. Every file reads the pass from here.
"""
import os

import pytest

SANITIZED = bool(os.environ.get("TANDEM_SANITIZED"))

# What a wall-clock timeout is multiplied by under the sanitizers.
SLOW = 3 if SANITIZED else 1


def release_only(reason: str):
    """Marks a test that runs in the Release pass only; reason says what covers its code paths
    under the sanitizers."""
    return pytest.mark.skipif(SANITIZED, reason=f"Release pass only: {reason}")
