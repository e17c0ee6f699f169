"""The bad-input table: every file in bad_requests/ is one request and the status it must get.
Each answer must be an OpenAI-style error object, and the server must go on serving (a good
request right after each case succeeds)."""
import json
import pathlib

import pytest

from lib.rawhttp import raw_http

CASES = sorted((pathlib.Path(__file__).parent / "bad_requests").glob("*.json"))


def case_body(c):
    if "body" in c:
        return json.dumps(c["body"]).encode()
    if "body_text" in c:
        return c["body_text"].encode()
    if "body_hex" in c:
        return bytes.fromhex(c["body_hex"])
    if "body_size" in c:
        return b'{"prompt": "' + b"a" * c["body_size"] + b'"}'
    return b""


def test_there_are_many_cases():
    assert len(CASES) >= 50


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_bad_request(server, path):
    c = json.loads(path.read_text())
    status, _, payload = raw_http(server.port, c["method"], c["path"], case_body(c), timeout=30)
    assert status == c["status"], payload[:500]
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == {400: "invalid_request_error", 404: "not_found_error",
                           405: "invalid_request_error", 413: "invalid_request_error"}[status]
    if "param" in c:
        assert err["param"] == c["param"], err
    if "contains" in c:
        assert c["contains"].lower() in err["message"].lower(), err
    # the server keeps serving
    st, body = server.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})
    assert st == 200 and body["usage"]["completion_tokens"] == 1
