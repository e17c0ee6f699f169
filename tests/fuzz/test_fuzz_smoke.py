"""Short libFuzzer runs of every fuzz target (tests/fuzz/fuzz_*.c, built by scripts/test.sh into
build-fuzz/ with clang, ASan and UBSan). Each run starts from the committed seed corpus in
tests/fuzz/corpus/<target>/ and must end without a crash, leak, timeout or out-of-memory.

Runs once per suite (in the Release pass); the seconds per target come from
$TANDEM_FUZZ_SECONDS (default 5). Longer campaigns: run the binaries by hand.
"""
import os
import pathlib
import shutil
import subprocess

import pytest

from lib.sanitize import release_only

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
FUZZ_DIR = ROOT / "build-fuzz" / "fuzz"
SOURCES = sorted((ROOT / "tests" / "fuzz").glob("fuzz_*.c"))


@release_only("fuzz targets run once, and carry their own ASan")
@pytest.mark.parametrize("src", SOURCES, ids=[s.stem for s in SOURCES])
def test_fuzz_target(src, tmp_path):
    exe = FUZZ_DIR / src.stem
    assert exe.exists(), f"{exe} was not built (scripts/test.sh builds build-fuzz/ with clang)"
    corpus = tmp_path / "corpus"
    base = ROOT / "tests" / "fuzz" / "corpus"
    seeds = next((d for d in (base / src.stem, base / src.stem.removeprefix("fuzz_"))
                  if d.is_dir()), None)
    if seeds:
        shutil.copytree(seeds, corpus)
    else:
        corpus.mkdir()
    seconds = int(os.environ.get("TANDEM_FUZZ_SECONDS", "5"))
    cp = subprocess.run(
        [str(exe), f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=2048",
         "-malloc_limit_mb=1024", f"-artifact_prefix={tmp_path}/", "-print_final_stats=1",
         str(corpus)],
        capture_output=True, text=True, timeout=seconds + 120, cwd=tmp_path)
    assert cp.returncode == 0, f"{src.stem} found a problem:\n{cp.stderr[-5000:]}"
