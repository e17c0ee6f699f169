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
