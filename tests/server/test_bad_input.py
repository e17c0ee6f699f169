"""The bad-input table: every file in bad_requests/ is one request and the status it must get.
Each answer must be an OpenAI-style error object, and the server must go on serving (a good
request right after each case succeeds)."""
import json
import pathlib
import socket

import pytest

CASES = sorted((pathlib.Path(__file__).parent / "bad_requests").glob("*.json"))


def raw_http(port, method, path, body: bytes, headers=None, timeout=30):
    """A minimal HTTP/1.1 exchange over a socket, so that bodies json/urllib would refuse to
    produce (invalid UTF-8, oversized) can be sent."""
    hdr = {"Host": "127.0.0.1", "Content-Type": "application/json",
           "Content-Length": str(len(body)), "Connection": "close", **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdr.items())
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\n")
        try:
            s.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer (413) and close before reading it all
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", payload
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        payload = out
    return status, payload


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
    status, payload = raw_http(server.port, c["method"], c["path"], case_body(c))
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
