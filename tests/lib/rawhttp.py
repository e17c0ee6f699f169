"""A raw HTTP/1.1 client over a plain socket, for the server and router tests.

It sends exactly the bytes a test asks for (bodies urllib or json would refuse to produce:
invalid UTF-8, oversized, a missing header) and depends on nothing in the code under test. One
request per connection (`Connection: close`); the whole answer is read until the peer closes.
"""
import json
import socket


def exchange_bytes(port, head: bytes, body: bytes = b"", timeout=60):
    """Sends head then body as they are, and reads the whole answer until the peer closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        try:
            s.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the peer may answer (413) and close before reading it all
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    return data


def raw_http(port, method, path, body: bytes, headers=None, timeout=60):
    """One exchange; returns (status, head bytes, body with chunked framing removed). A header
    given as None is left out."""
    hdr = {"Host": "127.0.0.1", "Content-Type": "application/json",
           "Content-Length": str(len(body)), "Connection": "close", **(headers or {})}
    hdr = {k: v for k, v in hdr.items() if v is not None}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdr.items())
    data = exchange_bytes(port, head.encode() + b"\r\n", body, timeout)
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
    return status, head, payload


def open_stream(port, path, body):
    """Sends a POST of `body` (JSON) and returns the socket, for reading the answer piece by
    piece (a stream) or hanging up mid-way. The caller closes it."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


# Requests that libmicrohttpd refuses on its own, before the handler: (raw bytes, its status,
# words of its page's text). Each answer is checked for JSON, so each fails with the HTML pages.
LIBRARY_REFUSALS = [
    (b"GET /v1/models HTTP/1.1\r\nHost: a\r\nthis line has no colon\r\n\r\n", 400,
     "syntactically incorrect"),
    (b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * (200 * 1024) + b"\r\n\r\n", 431,
     "too big"),
    (b"GET /v1/models HTTP/2.0\r\nHost: a\r\n\r\n", 505, "not supported"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 12abc\r\n\r\n", 400,
     "Content-Length"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999999\r\n"
     b"\r\n", 413, "Content-Length"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"zz\r\nab\r\n0\r\n\r\n", 400, "chunked"),
]


def assert_library_refusals_are_json(port):
    """Each request of LIBRARY_REFUSALS gets its status and an OpenAI error in JSON; then
    GET /v1/models still answers 200 (a server's or a router's own page)."""
    for raw, status, words in LIBRARY_REFUSALS:
        data = exchange_bytes(port, raw, b"", 30)
        # libmicrohttpd 0.9.75 writes the head of a Content-Length refusal twice (its bug, HTML
        # or not): the body is what follows the last blank line
        head, body = data.partition(b"\r\n\r\n")[0], data.rpartition(b"\r\n\r\n")[2]
        assert int(head.split(b" ", 2)[1]) == status, (raw[:60], head)
        assert b"content-type: application/json" in head.lower(), (raw[:60], head, body)
        err = json.loads(body)["error"]
        assert words in err["message"] and err["type"] == "invalid_request_error", err
        assert "<" not in err["message"], err
    # the server is still fine, and its own pages were not touched
    st, _, body = raw_http(port, "GET", "/v1/models", b"")
    assert st == 200, body
