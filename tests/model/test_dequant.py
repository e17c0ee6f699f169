"""Dequantisation and GGUF tensor reading, checked bit-exactly against gguf-py.

For each of the 11 element types tandem dequantises, a GGUF file is written with gguf-py's
GGUFWriter holding tensors of several shapes (1-D to 4-D): data quantised by gguf.quants where
the package can quantise that type, and random raw blocks (with finite fp16 scales) for every
block type, which reach all code values. tests/tools/gguf_dump opens each file with tandem's
reader, dequantises a tensor with tdm_dequantize and writes float32; the result must equal
gguf.quants.dequantize of the same bytes bit for bit (NaN positions must match where NaN is
possible). The default model's tensor table and a sample of its tensors are checked the same
way against gguf-py's GGUFReader.
"""
import subprocess

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as T

from conftest import build_dir

BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
QUANTIZABLE = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16}
# byte offsets of the fp16 scales in each block (d, and m / dmin where present)
SCALE_OFFSETS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q5_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def gguf_dump():
    p = build_dir() / "tests" / "tools" / "gguf_dump"
    if not p.exists():
        pytest.fail(f"{p} not built")
    return p


def dump_tensor(path, name, tmp_path):
    out = tmp_path / (name.replace("/", "_") + ".f32")
    cp = subprocess.run([str(gguf_dump()), str(path), name, str(out)], capture_output=True,
                        text=True, timeout=300)
    assert cp.returncode == 0, f"gguf_dump {path} {name} failed:\n{cp.stderr}"
    return np.fromfile(out, dtype="<f4")


def list_tensors(path):
    cp = subprocess.run([str(gguf_dump()), str(path)], capture_output=True, text=True,
                        timeout=300)
    assert cp.returncode == 0, cp.stderr
    rows = {}
    for line in cp.stdout.splitlines():
        name, dtype, ne0, ne1, ne2, ne3, nbytes = line.split()
        rows[name] = (dtype, [int(ne0), int(ne1), int(ne2), int(ne3)], int(nbytes))
    return rows


def assert_bit_equal(ours, ref, what):
    ref = np.ascontiguousarray(ref, dtype=np.float32).reshape(-1)
    assert ours.shape == ref.shape, f"{what}: {ours.shape} vs {ref.shape}"
    nan_ours, nan_ref = np.isnan(ours), np.isnan(ref)
    assert np.array_equal(nan_ours, nan_ref), f"{what}: NaN positions differ"
    ok = ~nan_ref
    diff = np.nonzero(ours[ok].view(np.uint32) != ref[ok].view(np.uint32))[0]
    assert diff.size == 0, (f"{what}: {diff.size} of {ours.size} values differ, first at "
                            f"{diff[0]}: {ours[ok][diff[0]]!r} vs {ref[ok][diff[0]]!r}")


def random_f16(rng, shape):
    """Random finite fp16 values over the whole range (subnormals and +-0 included)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)
    return bits.view(np.float16)


def random_blocks(rng, qtype, rows, n_elems):
    """Random raw blocks (uint8, shape rows x bytes) with finite fp16 scales: half the rows
    with scales of ordinary size, half with scales from the whole fp16 range."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = n_elems // block
    raw = rng.integers(0, 256, size=(rows, n_blocks, type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        ordinary = rng.uniform(-0.1, 0.1, size=(rows, n_blocks)).astype(np.float16)
        wide = random_f16(rng, (rows, n_blocks))
        scale = np.where((np.arange(rows) % 2 == 0)[:, None], ordinary, wide)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, n_blocks, 2)
    return raw.reshape(rows, n_blocks * type_size)


def shapes_for(block):
    """numpy shapes (slowest dim first): 1-D, 2-D with several rows, 3-D and 4-D."""
    if block == 1:
        return [(7,), (5, 13), (2, 3, 5), (2, 1, 3, 4)]
    return [(block * 5,), (4, block * 3), (2, 3, block * 2), (2, 1, 2, block)]


def write_gguf(path, tensors):
    w = gguf.GGUFWriter(str(path), "llama")
    for name, arr, raw_dtype in tensors:
        if raw_dtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build_case(qtype, rng):
    """(name, bytes or array as stored, raw_dtype) for each tensor of one type."""
    tensors = []
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for i, shape in enumerate(shapes_for(block)):
        x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 10)
        if qtype == T.F32:
            tensors.append((f"f32.{i}", x, None))
            tensors.append((f"f32.bits.{i}", rng.integers(0, 1 << 32, size=shape,
                                                           dtype=np.uint32).view(np.float32),
                            None))
        elif qtype == T.F16:
            tensors.append((f"f16.{i}", x.astype(np.float16), None))
            tensors.append((f"f16.bits.{i}", random_f16(rng, shape), None))
        elif qtype == T.BF16:
            tensors.append((f"bf16.{i}", gguf.quants.quantize(x, T.BF16), T.BF16))
            bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
            tensors.append((f"bf16.bits.{i}", bits.view(np.uint8).reshape(*shape[:-1], -1),
                            T.BF16))
        else:
            if qtype in QUANTIZABLE:
                tensors.append((f"q.{i}", gguf.quants.quantize(x, qtype), qtype))
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            raw = random_blocks(rng, qtype, rows, shape[-1])
            tensors.append((f"raw.{i}", raw.reshape(*shape[:-1], raw.shape[-1]), qtype))
    if qtype == T.F16:  # specials: +-inf, a quiet NaN, -0, the smallest subnormal
        special = np.array([0x7C00, 0xFC00, 0x7E00, 0x8000, 0x0001, 0x3C00, 0xFBFF, 0x0400],
                           dtype=np.uint16).view(np.float16)
        tensors.append(("f16.special", special, None))
    return tensors


TYPES = [T.F32, T.F16, T.BF16] + BLOCK_TYPES


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequant_matches_gguf_py(qtype, tmp_path):
    rng = np.random.default_rng(1234 + int(qtype))
    tensors = build_case(qtype, rng)
    path = tmp_path / f"{qtype.name}.gguf"
    write_gguf(path, tensors)
    table = list_tensors(path)
    assert len(table) == len(tensors)
    for name, stored, raw_dtype in tensors:
        ref = gguf.quants.dequantize(np.ascontiguousarray(stored), qtype)
        dtype, ne, nbytes = table[name]
        assert dtype.lower() == qtype.name.lower(), name
        assert ne[:ref.ndim] == list(reversed(ref.shape)), name
        assert all(d == 1 for d in ne[ref.ndim:]), name
        assert nbytes == stored.nbytes, name
        ours = dump_tensor(path, name, tmp_path)
        assert_bit_equal(ours, ref, f"{qtype.name} {name}")


def test_dequant_catches_a_wrong_value(tmp_path):
    """The comparison is not vacuous: a one-bit change in a block's data is seen."""
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, T.Q4_1, 2, 64)
    path = tmp_path / "q41.gguf"
    write_gguf(path, [("w", raw, T.Q4_1)])
    ours = dump_tensor(path, "w", tmp_path)
    changed = raw.copy()
    changed[1, 5] ^= 0x01  # one quant of row 1, block 0
    with pytest.raises(AssertionError):
        assert_bit_equal(ours, gguf.quants.dequantize(changed, T.Q4_1), "changed")
    assert_bit_equal(ours, gguf.quants.dequantize(raw, T.Q4_1), "unchanged")


def test_dump_errors(tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "k.gguf"
    write_gguf(path, [("q2", rng.integers(0, 256, size=(1, 84), dtype=np.uint8), T.Q2_K)])
    out = tmp_path / "o.f32"
    cp = subprocess.run([str(gguf_dump()), str(path), "q2", str(out)], capture_output=True,
                        text=True)
    assert cp.returncode != 0 and "q2_K" in cp.stderr  # listed, but no dequantiser
    cp = subprocess.run([str(gguf_dump()), str(path), "nope", str(out)], capture_output=True,
                        text=True)
    assert cp.returncode != 0 and "nope" in cp.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:40])
    cp = subprocess.run([str(gguf_dump()), str(bad)], capture_output=True, text=True)
    assert cp.returncode != 0 and "bad.gguf" in cp.stderr


def test_default_model_tensor_table(default_model):
    reader = gguf.GGUFReader(str(default_model))
    table = list_tensors(default_model)
    assert len(table) == len(reader.tensors)
    for t in reader.tensors:
        dtype, ne, nbytes = table[t.name]
        assert dtype.lower() == t.tensor_type.name.lower(), t.name
        shape = [int(d) for d in t.shape]
        assert ne[:len(shape)] == shape and all(d == 1 for d in ne[len(shape):]), t.name
        assert nbytes == int(t.n_bytes), t.name


def test_default_model_tensors(default_model, tmp_path):
    reader = gguf.GGUFReader(str(default_model))
    by_name = {t.name: t for t in reader.tensors}
    names = ["token_embd.weight", "output_norm.weight"]
    names += sorted(n for n in by_name if n.startswith("blk.0."))
    names += ["blk.29.ffn_down.weight", "blk.29.attn_norm.weight"]
    types_seen = set()
    for name in names:
        t = by_name[name]
        types_seen.add(t.tensor_type)
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        ours = dump_tensor(default_model, name, tmp_path)
        assert_bit_equal(ours, ref, name)
        (tmp_path / (name + ".f32")).unlink()
    assert {T.F32, T.Q4_1, T.Q8_0} <= types_seen
