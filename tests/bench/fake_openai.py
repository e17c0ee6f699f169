"""A fake OpenAI-compatible server with scripted timing and failures, for testing the load generator.

Standard library only (http.server). It streams exactly ceil(max_tokens / tokens_per_chunk) token
chunks per request, sleeping --ttft-ms before the first and --itl-ms between the others, so the
statistics `tandem bench serve` reports can be checked against hand-derived expectations.

Failures are scripted by arrival order (the n-th request the server sees, 1-based), so counts are
exact whatever the client's timing:
  --fail-every K         every K-th request gets HTTP 500 with an OpenAI-style JSON error
  --cut-every K          every K-th request's connection is closed after 2 token chunks
  --error-event-every K  every K-th request streams 1 token chunk then data: {"error": ...}
  --garbage-every K      every K-th request streams 1 token chunk then data: {not json
Other knobs: --no-usage (never send usage), --no-done (never send [DONE]), --framing
chunked|close (how the SSE body is delimited), --ignore-stream (answer with one JSON body with a
Content-Length), --api-key KEY (401 without "Authorization: Bearer KEY"), --log FILE (one JSON
line per request: arrival time, path, authorization, body, and the number of requests in flight
when it arrived).

Prints "PORT <n>" on stdout once listening. Stops on SIGTERM/SIGINT.
"""
import argparse
import json
import math
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.count = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.log = open(args.log, "a", buffering=1) if args.log else None


def every(k, n):
    return k > 0 and n % k == 0


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: State = None

    def log_message(self, fmt, *a):  # quiet
        pass

    def _json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def _authorized(self):
        key = self.state.args.api_key
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            self._leave()
            self._json(401, {"error": {"message": "bad api key", "type": "invalid_request_error"}})
            return False
        return True

    def do_GET(self):
        if not self._authorized():
            return
        if self.path == "/v1/models":
            self._json(200, {"object": "list",
                             "data": [{"id": self.state.args.model, "object": "model"}]})
        elif self.path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self):
        st = self.state
        a = st.args
        n_body = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(n_body)
        with st.lock:
            st.count += 1
            n = st.count
            st.in_flight += 1
            st.max_in_flight = max(st.max_in_flight, st.in_flight)
            in_flight = st.in_flight
        self._counted = True
        try:
            body = json.loads(raw)
            if st.log:
                st.log.write(json.dumps({"n": n, "t": time.monotonic(), "path": self.path,
                                         "authorization": self.headers.get("Authorization"),
                                         "in_flight": in_flight, "body": body}) + "\n")
            if not self._authorized():
                return
            if every(a.fail_every, n):
                self._leave()
                self._json(500, {"error": {"message": f"scripted failure {n}",
                                           "type": "server_error"}})
                return
            self._stream(body, n)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self._leave()

    def _leave(self):
        """Leaves the in-flight count; called before the bytes that let the client finish, so
        that a client starting its next request cannot be seen overlapping this one."""
        if getattr(self, "_counted", False):
            self._counted = False
            with self.state.lock:
                self.state.in_flight -= 1

    def _stream(self, body, n):
        a = self.state.args
        chat = self.path == "/v1/chat/completions"
        max_tokens = int(body.get("max_tokens", 16))
        prompt = body.get("prompt") if not chat else body["messages"][-1]["content"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        chunks = math.ceil(max_tokens / a.tokens_per_chunk)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                 "total_tokens": prompt_tokens + max_tokens}
        include_usage = (body.get("stream_options") or {}).get("include_usage") and not a.no_usage

        def piece(k):
            return "tok " * min(a.tokens_per_chunk, max_tokens - k * a.tokens_per_chunk)

        if a.ignore_stream or not body.get("stream"):
            time.sleep(a.ttft_ms / 1000)
            self._leave()
            text = "".join(piece(k) for k in range(chunks))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                      else {"index": 0, "text": text})
            self._json(200, {"object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": usage})
            return

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        chunked = a.framing == "chunked"
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def send(data: str):
            b = data.encode()
            if chunked:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
            else:
                self.wfile.write(b)
            self.wfile.flush()

        def event(obj):
            send("data: " + json.dumps(obj) + "\n\n")

        def chunk(text):
            if chat:
                return {"object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"content": text}}]}
            return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}

        if chat:  # role-only first chunk with empty content: not a token
            event({"object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        time.sleep(a.ttft_ms / 1000)
        for k in range(chunks):
            if k:
                time.sleep(a.itl_ms / 1000)
            event(chunk(piece(k)))
            if every(a.cut_every, n) and k == 1:
                self._leave()
                self.wfile.flush()
                self.connection.shutdown(2)
                return
            if every(a.error_event_every, n):
                self._leave()
                event({"error": {"message": f"scripted error event {n}", "code": 500}})
                break
            if every(a.garbage_every, n):
                self._leave()
                send("data: {not json\n\n")
                break
        self._leave()
        if include_usage:
            event({"object": "chunk", "choices": [], "usage": usage})
        if not a.no_done:
            send("data: [DONE]\n\n")
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--ttft-ms", type=float, default=0)
    ap.add_argument("--itl-ms", type=float, default=0)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--cut-every", type=int, default=0)
    ap.add_argument("--error-event-every", type=int, default=0)
    ap.add_argument("--garbage-every", type=int, default=0)
    ap.add_argument("--no-usage", action="store_true")
    ap.add_argument("--no-done", action="store_true")
    ap.add_argument("--ignore-stream", action="store_true")
    ap.add_argument("--framing", choices=["chunked", "close"], default="chunked")
    ap.add_argument("--api-key")
    ap.add_argument("--log")
    a = ap.parse_args()

    Handler.state = State(a)
    ThreadingHTTPServer.request_queue_size = 1024
    ThreadingHTTPServer.daemon_threads = True
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)

    def stop(*_):
        threading.Thread(target=srv.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"PORT {srv.server_address[1]}", flush=True)
    srv.serve_forever()
    print(f"MAX_IN_FLIGHT {Handler.state.max_in_flight}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
