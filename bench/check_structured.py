#!/usr/bin/env python3
"""Validates bench/gpu_structured_check.py's answers with `jsonschema` (formats included, as
tests/grammar/test_schema_suite.py checks them): every answer the grammar finished must
validate; one cut by max_tokens is counted apart.

    .venv/bin/python bench/check_structured.py OUT_DIR/structured.json
"""
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "grammar"))
sys.path.insert(0, str(ROOT / "tests"))
import jsonschema  # noqa: E402
from test_schema_suite import format_checker  # noqa: E402

data = json.loads(pathlib.Path(sys.argv[1]).read_text())
valid = invalid = cut = 0
for name, by_server in data.items():
    schema = json.loads((ROOT / "tests" / "grammar" / "schemas" / f"{name}.json").read_text())
    v = jsonschema.Draft202012Validator(schema, format_checker=format_checker())
    for srv, answers in by_server.items():
        for a in answers:
            if a["finish"] != "stop":
                cut += 1
                continue
            try:
                v.validate(json.loads(a["text"]))
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                invalid += 1
                print(f"INVALID {name} {srv}: {a['text'][:200]!r}: {str(e)[:200]}")
print(f"{valid} valid, {invalid} invalid, {cut} cut by max_tokens")
sys.exit(1 if invalid else 0)
