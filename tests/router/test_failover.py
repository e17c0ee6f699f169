"""Backends dying behind `tandem router`: one backend SIGKILLed -> the router marks it down and
every later request succeeds on the other (a request already sent to the dead one is retried);
both dead -> /health 503 and requests get a 503 OpenAI-style error. Reference: the surviving
backend's own /metrics."""
import json

from lib.server import Server
from routerlib import Router, assert_openai_error, proxy_errors, up


def test_backend_killed_then_both(default_model):
    backends, router = [], None
    try:
        backends = [Server(["--threads", "1"]) for _ in range(2)]
        router = Router([b.url for b in backends])
        dead, alive = backends
        body = {"prompt": "One, two,", "max_tokens": 2, "temperature": 0}
        st, raw, _ = router.request("POST", "/v1/completions", body)
        assert st == 200
        want = json.loads(raw)["choices"][0]["text"]

        before = alive.metrics()[("tandem_prompt_tokens_total", ())]
        dead.proc.kill()  # SIGKILL by PID
        dead.proc.wait()
        for _ in range(6):  # at once: the router has not seen the death yet
            st, raw, _ = router.request("POST", "/v1/completions", body)
            assert st == 200, raw
            assert json.loads(raw)["choices"][0]["text"] == want
        m = router.wait_for(lambda m: up(m, dead.url) == 0, "dead backend marked down")
        assert up(m, alive.url) == 1
        usage = json.loads(raw)["usage"]["prompt_tokens"]
        assert alive.metrics()[("tandem_prompt_tokens_total", ())] - before == 6 * usage
        st, raw, _ = router.request("GET", "/health")
        assert st == 200 and json.loads(raw)["backends_up"] == 1

        alive.proc.kill()
        alive.proc.wait()
        router.wait_for(lambda m: up(m, alive.url) == 0, "both down")
        st, raw, _ = router.request("GET", "/health")
        assert st == 503 and json.loads(raw)["backends_up"] == 0
        for path in ("/v1/completions", "/v1/chat/completions"):
            st, raw, _ = router.request("POST", path, body)
            assert st == 503
            assert "no healthy backend" in assert_openai_error(raw)["message"]
        st, raw, _ = router.request("GET", "/v1/models")
        assert st == 503
        assert proxy_errors(router.metrics(), "no_healthy_backend") == 3
    finally:
        try:
            if router:
                router.stop_clean()
        finally:
            for b in backends:
                b.stop()
