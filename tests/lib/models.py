"""The default model cut to its first SHORT_LAYERS transformer blocks, for tests whose subject is
not the model's answers: transfers, failures, pools, protocols.

The cut keeps the real tokenizer, the Q8_0 tied embedding and LM head and the Q4_1 blocks, so
every code path of the full model runs, on a fifth of the layers (a prompt's prefill costs about
a quarter, a decode step under half: the LM head stays whole). Its greedy text is degenerate
("and, and, and"): such tests compare log-probabilities bit for bit against a reference run on
the same cut, which any difference in a KV row changes. Tests that need the model to answer
sensibly (a capital, a repeated pattern, a trained head's acceptance) keep the full model.

The file is written once per source model (its path, size and mtime name it) into the temporary
directory, under a lock, so that the workers of a pytest-xdist run share it.
"""
import fcntl
import functools
import hashlib
import importlib.util
import os
import pathlib
import tempfile

from lib.server import ROOT, default_model_path

SHORT_LAYERS = 6


def _truncate_module():
    spec = importlib.util.spec_from_file_location("truncate_gguf",
                                                  ROOT / "scripts" / "truncate_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=None)
def short_model_path(layers=SHORT_LAYERS) -> pathlib.Path:
    """The default model's first `layers` blocks as a GGUF file (written on first use)."""
    src = default_model_path()
    st = src.stat()  # a missing default model fails here, naming the path
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}:{layers}".encode())
    out_dir = pathlib.Path(tempfile.gettempdir()) / "tandem-test-models"
    out = out_dir / f"{src.stem}.first{layers}.{key.hexdigest()[:12]}.gguf"
    out_dir.mkdir(exist_ok=True)
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            _truncate_module().truncate(str(src), str(tmp), layers)
            os.replace(tmp, out)
    return out
