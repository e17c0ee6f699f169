"""Every symbol the tandem library exports carries the project's prefix (`tdm_`, or `TDM_` for
data), read with nm from the static library the build made. C++ symbols of anonymous namespaces
(the CUDA kernels' files) cannot collide with anything and are allowed, as is the compiler's
exception-personality reference; AddressSanitizer's one-definition-rule markers
(`__odr_asan.NAME`) are checked by the name they mark. One foreign name is defined on purpose:
libmicrohttpd's MHD_create_response_from_buffer, through which src/server/front.c turns the
library's HTML error pages into JSON (its design comment says how)."""
import re
import shutil
import subprocess

import pytest

from conftest import build_dir

ALLOWED = re.compile(r"^(tdm_|TDM_)|_GLOBAL__N_|^DW\.ref\.__gxx_personality_v0$"
                     r"|^MHD_create_response_from_buffer$")


def exported_symbols(lib):
    out = subprocess.run(["nm", "-g", "--defined-only", str(lib)], capture_output=True,
                         text=True, check=True).stdout
    syms = set()
    for line in out.splitlines():
        parts = line.split()
        # "<addr> <type> <name>"; an upper-case type (and u, V, W) is a global definition
        if len(parts) == 3 and (parts[1].isupper() or parts[1] in "uvw"):
            syms.add(parts[2])
    return syms


def test_every_exported_symbol_is_prefixed():
    if not shutil.which("nm"):
        pytest.skip("nm is not installed")
    lib = build_dir() / "libtandem_core_lib.a"
    assert lib.exists(), f"{lib} was not built"
    syms = exported_symbols(lib)
    assert any(s.startswith("tdm_engine_") for s in syms), "nm read no tandem symbols"
    bad = sorted(s for s in syms if not ALLOWED.search(s.removeprefix("__odr_asan.")))
    assert not bad, f"{len(bad)} exported symbols without the tdm_ prefix: {bad[:40]}"
