"""Runs every cmocka unit-test program that CMake built, one pytest item per program."""
import subprocess

import pytest

from conftest import build_dir

PROGRAMS = sorted(p for p in (build_dir() / "tests").glob("test_*") if p.is_file()
                  and p.stat().st_mode & 0o111)


@pytest.mark.parametrize("prog", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_c_unit(prog, tmp_path):
    cp = subprocess.run([str(prog)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert cp.returncode == 0, f"{prog.name} failed:\n{cp.stdout[-6000:]}\n{cp.stderr[-6000:]}"


def test_c_units_were_built():
    assert PROGRAMS, f"no cmocka programs under {build_dir() / 'tests'}"
