#!/usr/bin/env python3
"""Writes a copy of a llama-family GGUF that keeps only its first N transformer blocks.

Used to carry a real (tokenizer, quantised weights) model onto a machine where the whole file
does not fit (the GPU smoke test of scripts/gpu_test.sh). The output is a valid, smaller model:
same vocabulary, embedding and output head, fewer layers. Usage: truncate_gguf.py IN OUT N
"""
import sys

import gguf


def truncate(src, dst, keep: int) -> None:
    """Writes to dst the model at src with only its first `keep` transformer blocks."""
    r = gguf.GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = gguf.GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = field.types[0]
        if name == f"{arch}.block_count":
            w.add_uint32(name, keep)
            continue
        if vt == gguf.GGUFValueType.ARRAY:
            et = field.types[1]
            if et == gguf.GGUFValueType.STRING:
                vals = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                vals = [field.parts[i][0].item() for i in field.data]
            w.add_array(name, vals)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_string(name, bytes(field.parts[-1]).decode("utf-8", "surrogateescape"))
        else:
            w.add_key_value(name, field.parts[-1][0].item(), vt)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= keep:
            continue
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    truncate(sys.argv[1], sys.argv[2], int(sys.argv[3]))
