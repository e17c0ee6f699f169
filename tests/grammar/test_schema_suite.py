"""The grammar engine's outputs against independent checkers, on the default model's vocabulary.

grammar_walk (tests/tools) makes random outputs the way a sampler would: tokens drawn among
those the mask allows, then a shortest way to the end, then the end token. Every output must
validate: JSON Schemas with the `jsonschema` package (formats checked, the ones jsonschema
leaves to optional packages with the standard library), regular expressions with Python's `re`,
GBNF grammars with `json` where they describe JSON. 100% is the bar; one invalid output fails.
"""
import datetime
import ipaddress
import json
import pathlib
import re
import subprocess
import urllib.parse
import uuid

import jsonschema
import pytest

from conftest import build_dir
from lib.sanitize import SANITIZED

HERE = pathlib.Path(__file__).parent
SCHEMAS = sorted((HERE / "schemas").glob("*.json"))
WALKS = 25 if SANITIZED else 150


def format_checker():
    fc = jsonschema.FormatChecker()

    @fc.checks("date-time", raises=ValueError)
    def date_time(s):
        if not isinstance(s, str):
            return True
        if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", s):
            raise ValueError(s)
        datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))
        return True

    @fc.checks("time", raises=ValueError)
    def time_(s):
        if not isinstance(s, str):
            return True
        if not re.fullmatch(r"\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", s):
            raise ValueError(s)
        datetime.time.fromisoformat(s.replace("Z", "+00:00"))
        return True

    @fc.checks("uri", raises=ValueError)
    def uri(s):
        if not isinstance(s, str):
            return True
        u = urllib.parse.urlsplit(s)
        if not u.scheme or not u.netloc:
            raise ValueError(s)
        return True

    @fc.checks("uuid", raises=ValueError)
    def uuid_(s):
        return not isinstance(s, str) or bool(uuid.UUID(s))

    @fc.checks("ipv4", raises=ValueError)
    def ipv4(s):
        return not isinstance(s, str) or bool(ipaddress.IPv4Address(s))

    return fc


def walk(default_model, kind, source, n, seed, tmp_path):
    src = tmp_path / "grammar.src"
    src.write_text(source)
    exe = build_dir() / "tests" / "tools" / "grammar_walk"
    cp = subprocess.run([str(exe), str(default_model), kind, str(src), str(n), str(seed)],
                        capture_output=True, text=True, timeout=600)
    assert cp.returncode == 0, cp.stderr[-3000:]
    lines = [json.loads(x) for x in cp.stdout.splitlines()]
    assert lines and "error" not in lines[0], lines[:1]
    assert len(lines) == n
    for x in lines:
        assert "invalid_utf8" not in x, x
    return [x["text"] for x in lines]


def test_there_is_a_suite():
    assert len(SCHEMAS) >= 20


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: p.stem)
def test_schema_outputs_validate(default_model, path, tmp_path):
    schema = json.loads(path.read_text())
    validator = jsonschema.Draft202012Validator(schema, format_checker=format_checker())
    texts = walk(default_model, "json_schema", path.read_text(), WALKS, 17, tmp_path)
    bad = []
    for t in texts:
        try:
            validator.validate(json.loads(t))
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append((t, str(e)[:300]))
    assert not bad, f"{len(bad)} of {len(texts)} invalid; first: {bad[0]}"
    # the walks are not all alike (the mask lets the sampler choose)
    assert len(set(texts)) > 1 or path.stem in ("tuple",)


def test_json_object_outputs_parse(default_model, tmp_path):
    for t in walk(default_model, "json_object", "", WALKS, 3, tmp_path):
        assert isinstance(json.loads(t), dict), t


REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)( because [a-z ]{1,20})?\.",
    r"\w+@\w+\.(com|org)",
    r"[A-Z][a-z]*( [A-Z][a-z]*){0,3}",
    r"(0|[1-9][0-9]*)(\.[0-9]+)?",
    r"[^\n]{0,12}!",
    r"é+[àâ]?\u00e7",
]


@pytest.mark.parametrize("rx", REGEXES)
def test_regex_outputs_match(default_model, rx, tmp_path):
    for t in walk(default_model, "regex", rx, WALKS, 5, tmp_path):
        assert re.fullmatch(rx, t), (rx, t)


def test_choice_outputs(default_model, tmp_path):
    choices = ["red", "green", "blue sky", "é"]
    for t in walk(default_model, "choice", json.dumps(choices), WALKS, 9, tmp_path):
        assert t in choices


JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}"
array  ::= "[" ws ( value ("," ws value)* )? "]"
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]{1,3})? ws
ws     ::= | " " # at most one space
"""

ARITH_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= "0" | [1-9] [0-9]{0,2} | "(" expr ")"
"""


def test_gbnf_json_outputs_parse(default_model, tmp_path):
    for t in walk(default_model, "gbnf", JSON_GBNF, WALKS, 21, tmp_path):
        assert isinstance(json.loads(t), dict), t


def test_gbnf_arithmetic_outputs_evaluate(default_model, tmp_path):
    texts = walk(default_model, "gbnf", ARITH_GBNF, WALKS, 23, tmp_path)
    for t in texts:
        assert re.fullmatch(r"[0-9+\-*/()]+", t), t
        compile(t, "<gbnf>", "eval")  # Python's parser agrees it is an expression
