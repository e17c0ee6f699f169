"""The head trainer (`tandem train-mtp`, src/spec/train.c).

Gradients: tests/tools/train_grad computes the loss and gradient of a random head on a random
batch; the numpy objective (lib.train_ref, float64, written apart) must give the same loss, and
its central differences the same gradient at sampled coordinates of every tensor, for plain
teacher forcing, unrolled passes (training-time test), a reduced draft vocabulary, qwen2 biases,
qwen3 q/k norms and GQA. The tool's own float32 central differences of the trainer's loss must
agree with the analytic gradient too (teacher forcing, where the two objectives coincide).
"""
import json
import subprocess

import numpy as np
import pytest

from conftest import build_dir
from lib import reference as ref
from lib import train_ref
from lib.checkpoints import make_hf_checkpoint
from lib.sanitize import SANITIZED, SLOW


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_targets")
    out = {}
    for name, arch, opts in (("llama", "llama", dict(seed=31, num_hidden_layers=1)),
                             ("qwen2", "qwen2", dict(seed=32, num_hidden_layers=1)),
                             ("qwen3", "qwen3", dict(seed=33, num_hidden_layers=1))):
        path = make_hf_checkpoint(root / name, arch, **opts)
        out[name] = (path, ref.load(path))
    return out


def train_grad(model, out, **opts):
    tool = build_dir() / "tests" / "tools" / "train_grad"
    args = [str(tool), str(model), str(out)]
    for k, v in opts.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    cp = subprocess.run(args, capture_output=True, text=True, timeout=300 * SLOW)
    if cp.returncode == 77:  # --gpu 1 without a GPU
        pytest.skip(cp.stdout.strip())
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


CASES = {
    "teacher-forcing": ("llama", dict(unroll=1)),
    "unrolled-3": ("llama", dict(unroll=3, seqs=3, max_len=9)),
    "draft-vocab": ("llama", dict(unroll=2, draft_vocab=40)),
    "gqa": ("llama", dict(unroll=2, heads=4, kv_heads=2, d_ff=24)),
    "qwen2-biases": ("qwen2", dict(unroll=1)),
    "qwen3-qk-norm": ("qwen3", dict(unroll=2)),
}


def unpack_grads(info, path):
    flat = np.fromfile(path, dtype=np.float32).astype(np.float64)
    out, off = [], 0
    for name, rows, cols, half in info["tensors"]:
        n = rows * cols
        out.append(flat[off:off + n].reshape(rows, cols) if rows > 1 else flat[off:off + n])
        off += n
    assert off == flat.size
    return out


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_matches_numpy_central_differences(targets, tmp_path, case, device):
    """cuda: the same trainer with its GEMMs on the GPU (--train-backend cuda); skipped
    without one."""
    target, opts = CASES[case]
    path, model = targets[target]
    reg = 0.5  # the tool's --reg default
    extra = {"gpu": 1} if device == "cuda" else {}
    info = train_grad(path, tmp_path / "g", seed=7, fd=6, **opts, **extra)
    decay = info["decay"]  # the trainer's default
    d, k = model.d_model, info["top_k"]
    w = train_ref.read_head(tmp_path / "g.safetensors", d)
    n_seqs = opts.get("seqs", 3)
    seqs = train_ref.read_data(tmp_path / "g.data", n_seqs, d, k)
    dv = info["draft_vocab"]
    if opts.get("draft_vocab"):
        assert "d2t" in w and len(dv) == opts["draft_vocab"]
        assert (np.arange(len(dv)) + w["d2t"] == np.array(dv)).all(), "d2t is EAGLE-3's offsets"
    kw = dict(reg_weight=reg, unroll=opts.get("unroll", 1), decay=decay)
    base, frozen = train_ref.loss(model, w, seqs, dv, **kw)
    assert abs(base - info["loss"]) <= 1e-4 * abs(base), (base, info["loss"])

    grads = unpack_grads(info, tmp_path / "g.grad")
    rng = np.random.default_rng(3)
    eps = 1e-5
    worst = 0.0
    for (name, rows, cols, half), g in zip(info["tensors"], grads):
        key = name if not half else ("fc_e" if half == 1 else "fc_h")
        arr = w[key]
        flat_g = g.reshape(-1)
        scale = max(np.abs(flat_g).max(), 1e-6)
        # the largest gradient and a few random coordinates
        picks = {int(np.abs(flat_g).argmax())} | set(rng.integers(0, flat_g.size, 3).tolist())
        for i in picks:
            idx = np.unravel_index(i, arr.shape)
            keep = arr[idx]
            arr[idx] = keep + eps
            lp, _ = train_ref.loss(model, w, seqs, dv, frozen=frozen, **kw)
            arr[idx] = keep - eps
            lm, _ = train_ref.loss(model, w, seqs, dv, frozen=frozen, **kw)
            arr[idx] = keep
            num = (lp - lm) / (2 * eps)
            err = abs(num - flat_g[i]) / scale
            worst = max(worst, err)
            assert err <= 2e-3, f"{name}[{idx}]: numeric {num:.6g}, trainer {flat_g[i]:.6g}"
    # the trainer's own float32 central differences at its largest gradients (its loss
    # function recomputes earlier passes, which its gradient holds fixed: teacher forcing only)
    assert len(info["fd"]) == 6
    for ti, idx, analytic, numeric in info["fd"] if kw["unroll"] == 1 else []:
        assert abs(analytic - numeric) <= 3e-2 * abs(analytic) + 1e-4, (ti, idx, analytic,
                                                                         numeric)
    print(f"{case} ({device}): worst relative gradient error {worst:.2e}")


def test_the_check_catches_a_wrong_shift(targets, tmp_path):
    """The reference fed t(p) instead of t(p+1) disagrees with the trainer's loss: the
    comparison above can fail on the shift it guards."""
    path, model = targets["llama"]
    info = train_grad(path, tmp_path / "g", seed=7)
    w = train_ref.read_head(tmp_path / "g.safetensors", model.d_model)
    seqs = train_ref.read_data(tmp_path / "g.data", 3, model.d_model, info["top_k"])
    shifted = [(np.concatenate([[0], tok[:-1]]).astype(np.int32), f, i, p, first)
               for tok, f, i, p, first in seqs]
    wrong, _ = train_ref.loss(model, w, shifted, info["draft_vocab"], reg_weight=0.5, unroll=1,
                              decay=0.8)
    assert abs(wrong - info["loss"]) > 1e-3 * abs(info["loss"])


# ---- `tandem train-mtp` on the default model: a short run end to end ----

SMALL = ["--limit", "8", "--val-prompts", "2", "--gen-tokens", "24", "--gen-batch", "8",
         "--max-len", "256", "--batch-rows", "512", "--draft-vocab", "2048", "--unroll", "2",
         "--warmup", "2", "--lr", "3e-3", "--val-tokens", "16", "--val-k", "1,3",
         "--threads", "2", "--self-prompts", "4"]


def train(out, *extra, check=True, timeout=600):
    from conftest import run_tandem
    return run_tandem(["train-mtp", "--out", out, *SMALL, *extra], timeout=timeout * SLOW,
                      check=check)


@pytest.fixture(scope="module")
def trained(default_model, tmp_path_factory):
    """One short run: 8 prompts (2 held out) and 4 the target writes itself, 12 steps."""
    d = tmp_path_factory.mktemp("train_mtp")
    cp = train(d / "head.safetensors", "--steps", "12", "--checkpoint-every", "5")
    return d, cp


def test_train_mtp_writes_head_curve_and_summary(trained):
    d, cp = trained
    summary = json.loads(cp.stdout.strip().splitlines()[-1])
    assert summary == json.loads((d / "head.json").read_text())
    assert summary["steps"] == 12 and summary["draft_vocab"] == 2048
    # 8 prompts and 4 self-prompts, each continued at 2 temperatures
    assert summary["sequences"] == 24 and "4 self-prompts written by the target" in cp.stderr
    assert set(summary["tau"]) == {"1", "3"} and all(1.0 <= t <= 4.0 for t in summary["tau"].values())
    assert not (d / "head.ckpt").exists(), "a finished run leaves no checkpoint"
    rows = [l.split(",") for l in (d / "head.csv").read_text().splitlines()]
    assert rows[0][:3] == ["step", "rows", "loss"] and [int(r[0]) for r in rows[1:]] == list(range(1, 13))
    held = [float(r[8]) for r in rows[1:] if r[8]]
    assert len(held) == 3, "held-out loss at steps 5, 10 and 12"
    import xml.etree.ElementTree as ET
    svg = ET.parse(d / "head.svg").getroot()
    lines = [e for e in svg.iter() if e.tag.endswith("polyline")]
    assert len(lines) == 2 and len(lines[0].get("points").split()) == 12
    # the progress line has tokens/s and the loss
    assert "tok/s" in cp.stderr and "loss" in cp.stderr and "tau on 2 held-out prompts" in cp.stderr


def test_train_mtp_learns(trained):
    """The loss falls over 12 steps (a head that does not learn fails this)."""
    d, _ = trained
    loss = [float(l.split(",")[2]) for l in (d / "head.csv").read_text().splitlines()[1:]]
    assert np.mean(loss[-3:]) < 0.8 * np.mean(loss[:3]), loss


def test_trained_head_loads_and_is_lossless(trained, default_model):
    """The head written loads with its d2t map and drafts without changing the output."""
    from conftest import run_tandem
    d, _ = trained
    with open(d / "head.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert header["d2t"]["dtype"] == "I64" and header["d2t"]["shape"] == [2048]
    assert header["fc.weight"]["dtype"] == "BF16"
    assert header["__metadata__"]["trained_by"] == "tandem train-mtp"
    for temp in ("0", "0.8"):
        base = ["generate", "--chat", "--prompt", "Tell me about the moon.", "--max-tokens", "24",
                "--temperature", temp, "--seed", "5", "--print-token-ids"]
        want = run_tandem(base).stdout
        got = run_tandem(base + ["--spec", "mtp", "--spec-draft", d / "head.safetensors",
                                 "--spec-k", "3", "--spec-stats"])
        assert got.stdout == want
        stats = json.loads(got.stderr.strip().splitlines()[-1])
        assert stats["drafted"] > 0


def test_minutes_ends_the_run_by_its_deadline(trained, tmp_path):
    """--minutes plans the last step from the measured step time: a schedule of 200 epochs
    ends after a fraction of it, with a head, and the cosine schedule ends with it."""
    import re
    d, _ = trained
    out = tmp_path / "timed.safetensors"
    cp = train(out, "--data", str(d / "head.data"), "--epochs", "200", "--minutes", "0.25",
               "--no-val")
    planned = int(re.search(r"(\d+) steps of up to", cp.stderr).group(1))
    summary = json.loads(cp.stdout.strip().splitlines()[-1])
    assert 0 < summary["steps"] < planned and out.exists()
    rows = [l.split(",") for l in (tmp_path / "timed.csv").read_text().splitlines()[1:]]
    assert len(rows) == summary["steps"]
    lr = [float(r[6]) for r in rows]
    assert lr[-1] < 0.3 * max(lr), "the cosine schedule was planned to end with the run"


def test_resume_after_interrupt_is_bit_identical(trained, tmp_path):
    """SIGINT saves a checkpoint; --resume continues it to the same head, byte for byte, as a
    run that was never interrupted (batches and weights are functions of the step)."""
    import signal
    import time
    d, _ = trained
    data = ["--data", str(d / "head.data"), "--steps", "12", "--checkpoint-every", "100",
            "--no-val"]
    straight = tmp_path / "straight.safetensors"
    train(straight, *data)
    out = tmp_path / "cut.safetensors"
    from conftest import build_dir
    args = [str(build_dir() / "tandem"), "train-mtp", "--out", str(out), *SMALL, *data]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        csv = tmp_path / "cut.csv"
        deadline = time.time() + 300 * SLOW
        while time.time() < deadline and proc.poll() is None:
            if csv.exists() and len(csv.read_text().splitlines()) >= 4:  # 3 steps done
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300 * SLOW)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal (too fast to interrupt)")
    assert proc.returncode == 130 and "--resume" in err, err
    assert (tmp_path / "cut.ckpt").exists()
    # resuming with other settings is refused, naming the setting
    cp = train(out, *data, "--resume", "--lr", "1e-3", check=False)
    assert cp.returncode == 2 and "lr" in cp.stderr, cp.stderr
    cp = train(out, *data, "--resume")
    assert "resuming from" in cp.stderr
    assert out.read_bytes() == straight.read_bytes()
    steps = [int(l.split(",")[0]) for l in (tmp_path / "cut.csv").read_text().splitlines()[1:]]
    assert steps == list(range(1, 13)), "the CSV holds each step once"


def test_bad_options_and_files(trained, tmp_path):
    from conftest import run_tandem
    d, _ = trained
    cp = run_tandem(["train-mtp"], check=False)
    assert cp.returncode == 2 and "--out" in cp.stderr
    cp = run_tandem(["train-mtp", "--out", tmp_path / "h.safetensors", "--gen-temperature", "x"],
                    check=False)
    assert cp.returncode == 2 and "gen-temperature" in cp.stderr
    cp = run_tandem(["train-mtp", "--out", tmp_path / "h.safetensors", "--prompts",
                     tmp_path / "none.jsonl"], check=False)
    assert cp.returncode == 2 and "none.jsonl" in cp.stderr
    # a corrupt cache is refused, naming the file
    bad = tmp_path / "bad.data"
    raw = bytearray((d / "head.data").read_bytes())
    raw[200] ^= 0xFF  # inside the sequence table
    bad.write_bytes(bytes(raw[:len(raw) // 2]))
    cp = train(tmp_path / "h.safetensors", "--data", bad, "--steps", "2", check=False)
    assert cp.returncode == 2 and "bad.data" in cp.stderr, cp.stderr
    # a cache made with other settings is refused by its fingerprint
    cp = train(tmp_path / "h.safetensors", "--data", d / "head.data", "--gen-tokens", "25",
               "--steps", "2", check=False)
    assert cp.returncode == 2 and "fingerprint" in cp.stderr, cp.stderr
    # a file that is not a checkpoint is refused, naming it
    args = ["--data", d / "head.data", "--steps", "4", "--no-val"]
    (tmp_path / "h4.ckpt").write_bytes(b"not a checkpoint")
    cp = train(tmp_path / "h4.safetensors", *args, "--resume", check=False)
    assert cp.returncode == 2 and "h4.ckpt" in cp.stderr, cp.stderr
