"""End-to-end tests of the `tandem` CLI on the default model: the token-id contract, chat
coherence, sampling determinism, stop strings, `info`, and bad input (a clear message and a
non-zero exit, never a crash)."""
import json
import os
import signal

import numpy as np
import pytest

from conftest import run_tandem
from lib.sanitize import SLOW


def test_contract_token_ids(default_model, tmp_path):
    logits = tmp_path / "l.f32"
    cp = run_tandem(["generate", "--model", default_model, "--prompt-tokens", "1,504,3458,314",
                     "--max-tokens", "6", "--temperature", "0", "--print-token-ids",
                     "--dump-logits", logits])
    lines = cp.stdout.splitlines()
    assert len(lines) == 1, cp.stdout
    ids = [int(x) for x in lines[0].split(" ")]
    assert len(ids) == 6 and all(0 <= i < 49152 for i in ids)
    arr = np.fromfile(logits, dtype="<f4")
    assert arr.shape == (49152,) and np.isfinite(arr).all()
    assert int(arr.argmax()) == ids[0]  # the first token is the argmax of the dumped logits


def test_contract_no_eos_stop_unless_asked(default_model):
    # "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\nHello! How can I help you
    # today?": the model ends its turn with <|im_end|> (id 2), the EOS, right away.
    prompt = "1,4093,198,36218,33662,2,198,1,520,9531,198,19556,17,1073,416,339,724,346,1834,47"
    args = ["generate", "--model", default_model, "--prompt-tokens", prompt,
            "--max-tokens", "12", "--temperature", "0", "--print-token-ids"]
    full = run_tandem(args).stdout.split()
    assert len(full) == 12
    assert "2" in full, full
    stopped = run_tandem(args + ["--stop-at-eos"]).stdout.split()
    assert stopped == full[: full.index("2") + 1]


def test_chat_answers_coherently(default_model):
    cp = run_tandem(["chat", "--model", default_model, "--prompt",
                     "What is the capital of France?", "--max-tokens", "48"], timeout=300 * SLOW)
    assert "Paris" in cp.stdout, cp.stdout


def test_generate_default_model_without_flag(default_model):
    env = {"TANDEM_MODEL": str(default_model)}
    cp = run_tandem(["generate", "--prompt", "The capital of France is", "--max-tokens", "8"],
                    env=env)
    assert cp.stdout.strip(), "no text generated"


def test_sampling_is_seeded(default_model):
    base = ["generate", "--model", default_model, "--prompt", "Once upon a time",
            "--max-tokens", "24", "--temperature", "1.0", "--top-p", "0.95", "--print-token-ids"]
    a = run_tandem(base + ["--seed", "7"]).stdout
    b = run_tandem(base + ["--seed", "7", "--threads", "1"]).stdout
    c = run_tandem(base + ["--seed", "8"]).stdout
    assert a == b
    assert a != c


def test_stop_string(default_model):
    base = ["generate", "--model", default_model, "--prompt", "Count: 1, 2, 3, 4,",
            "--max-tokens", "24", "--temperature", "0"]
    full = run_tandem(base).stdout
    assert " 6" in full, full
    cut = run_tandem(base + ["--stop", " 6"]).stdout
    assert cut.rstrip("\n") == full[: full.index(" 6")]


def test_info_json(default_model):
    info = json.loads(run_tandem(["info", "--model", default_model, "--json"]).stdout)
    assert info["arch"] == "llama"
    assert (info["n_layers"], info["d_model"], info["n_heads"], info["n_kv_heads"]) == (30, 576, 9, 3)
    assert (info["head_dim"], info["d_ff"], info["vocab_size"]) == (64, 1536, 49152)
    assert info["tied_embeddings"] is True
    assert info["chat_template"] == "chatml"
    assert info["tensor_types"] == {"f32": 61, "q4_1": 210, "q8_0": 1}
    assert 134_000_000 < info["n_params"] < 135_000_000


BAD_ARGS = [
    (["generate", "--model", "/nonexistent.gguf", "--prompt", "x"], 1, "nonexistent"),
    (["generate", "--max-tokens", "0", "--prompt", "x"], 2, "max-tokens"),
    (["generate", "--max-tokens", "abc", "--prompt", "x"], 2, "max-tokens"),
    (["generate", "--temperature", "-1", "--prompt", "x"], 2, "temperature"),
    (["generate", "--top-p", "1.5", "--prompt", "x"], 2, "top-p"),
    (["generate", "--prompt-tokens", "1,,2", "--print-token-ids"], 2, "prompt-tokens"),
    (["generate", "--prompt-tokens", "1,99999999", "--print-token-ids"], 2, "vocabulary"),
    (["generate", "--prompt", ""], 2, "empty"),
    (["generate", "--prompt", "x", "--prompt-tokens", "1"], 2, "not both"),
    (["generate", "--bogus"], 2, "unknown"),
    (["chat", "--prompt-tokens", "1"], 2, "text"),
    (["frobnicate"], 2, "unknown command"),
    (["serve", "--role", "prefill", "--kv-staging", "sometimes"], 2,
     "--kv-staging: 'sometimes' is not auto, always or off"),
    (["serve", "--role", "prefill", "--staging-memory", "lots"], 2,
     "--staging-memory: 'lots' is not a size"),
    (["serve", "--kv-staging", "always"], 2, "are for --role prefill or decode"),
    (["generate", "--prompt", "x", "--gpu-weights", "int4"], 2,
     "--gpu-weights: 'int4' is not native or bf16"),
    (["serve", "--gpu-weights", "fp8"], 2, "--gpu-weights: 'fp8' is not native or bf16"),
    (["bench", "model", "--backend", "cuda", "--weights", "q5_k"], 2,
     "--weights: 'q5_k' is not bf16, q8_0, q4_0, q4_1, q4_k or q6_k"),
]


@pytest.mark.parametrize("args,code,needle", BAD_ARGS, ids=[" ".join(a[0][:2]) + f"-{i}" for i, a in enumerate(BAD_ARGS)])
def test_bad_arguments(default_model, args, code, needle):
    env = {"TANDEM_MODEL": str(default_model)}
    cp = run_tandem(args, check=False, env=env)
    assert cp.returncode == code, (cp.returncode, cp.stderr)
    assert needle.lower() in cp.stderr.lower(), cp.stderr


def test_invalid_utf8_prompt(default_model):
    import subprocess
    from conftest import build_dir
    cp = subprocess.run([str(build_dir() / "tandem"), "generate", "--model", str(default_model),
                         "--max-tokens", "2"], input=b"ab\xff\xfecd", capture_output=True,
                        timeout=120)
    assert cp.returncode == 2, cp.stderr
    assert b"utf-8" in cp.stderr.lower()


def test_corrupt_model_files(default_model, tmp_path):
    data = default_model.read_bytes()
    cases = {
        "truncated_header.gguf": data[:100],
        "truncated_tensors.gguf": data[: len(data) // 2],
        "bad_magic.gguf": b"GGUX" + data[4:4096],
        "empty.gguf": b"",
    }
    for name, blob in cases.items():
        p = tmp_path / name
        p.write_bytes(blob)
        cp = run_tandem(["generate", "--model", p, "--prompt-tokens", "1", "--print-token-ids",
                         "--max-tokens", "1"], check=False)
        assert cp.returncode == 1, (name, cp.returncode, cp.stderr)
        assert cp.returncode != -signal.SIGSEGV
        assert "cannot load model" in cp.stderr, (name, cp.stderr)


def _run_on_pty(args, timeout=120):
    """Runs tandem with stderr on a pseudo-terminal; returns what the terminal received."""
    import os
    import pty
    import select
    import subprocess
    from conftest import build_dir
    master, slave = pty.openpty()
    proc = subprocess.Popen([str(build_dir() / "tandem")] + [str(a) for a in args],
                            stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    try:
        while True:
            r, _, _ = select.select([master], [], [], timeout)
            if not r:
                break
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        proc.wait(timeout=timeout)
        os.close(master)
    assert proc.returncode == 0
    return out.decode(errors="replace")


def test_progress_bar_only_on_a_terminal(default_model):
    on_tty = _run_on_pty(["info", "--model", default_model])
    assert "loading [" in on_tty and "100%" in on_tty, on_tty
    piped = run_tandem(["info", "--model", default_model])
    assert "loading" not in piped.stderr
