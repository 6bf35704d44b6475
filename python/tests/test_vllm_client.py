"""`refit.vllm` from the caller's side, without vLLM: `Server` speaks the HTTP routes of
`vllm serve` (development mode) and turns a worker's error body back into the
`refit.errors` class the worker raised. The real server is exercised by
`scripts/vllm-check.sh`; this stand-in answers as it does (vLLM's `ErrorResponse` body)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import refit
import refit.vllm


class StandIn:
    def __init__(self, fail_update_with: str | None = None, routes: bool = True):
        self.calls: list[tuple[str, object]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                route = self.path.lstrip("/")
                owner.calls.append((route, body))
                if not routes:
                    return self.answer(404, {"detail": "Not Found"})
                if route == "update_weights" and fail_update_with is not None:
                    message = f"Worker failed with error '{fail_update_with}', please check the stack trace above for the root cause"
                    return self.answer(500, {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}})
                self.answer(200, {"message": "ok"})

            def answer(self, code, body):
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()


def test_the_update_session_goes_through_the_routes_in_order():
    s = StandIn()
    try:
        server = refit.vllm.Server(s.url)
        refit.vllm.init_engine(server, "/some/policy.spec", timeout=5)
        refit.vllm.update_weights(server, version=3, timeout=7)
        refit.vllm.shutdown_engine(server)
        routes = [r for r, _ in s.calls]
        assert routes == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                          "finish_weight_update", "reset_prefix_cache", "shutdown_weight_transfer_engine"]
        init = s.calls[0][1]["init_info"]
        assert init["spec"] == "/some/policy.spec" and init["timeout"] == 5
        assert "token" not in json.dumps(init).lower()  # no secret travels
        assert s.calls[2][1]["update_info"]["version"] == 3
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["Refused", "Timeout", "PeerGone", "NeedsFullResend"])
def test_a_worker_error_comes_back_as_its_refit_class(kind):
    cls = getattr(refit.errors, kind)
    s = StandIn(fail_update_with=f"[refit.errors.{kind}] version 4 of `policy` (refit spec x): boom")
    try:
        with pytest.raises(cls, match=r"version 4 of `policy`.*boom") as e:
            refit.vllm.update_weights(refit.vllm.Server(s.url), timeout=1)
        assert "please check the stack trace" not in str(e.value)
        routes = [r for r, _ in s.calls]
        # after the failed update, finish once: it ends the session of the workers that
        # returned quietly (a tensor-parallel server's), and the update's own error is what
        # the caller gets; the prefix cache goes only after a mixed version
        assert routes[:3] == ["start_weight_update", "update_weights", "finish_weight_update"], routes
        assert routes.count("finish_weight_update") == 1
        assert ("reset_prefix_cache" in routes) == (kind == "NeedsFullResend")
    finally:
        s.close()


def test_a_server_without_the_routes_or_no_server_is_named():
    s = StandIn(routes=False)
    try:
        with pytest.raises(refit.ConfigError, match="VLLM_SERVER_DEV_MODE=1"):
            refit.vllm.init_engine(refit.vllm.Server(s.url), "spec")
    finally:
        s.close()
    with pytest.raises(refit.PeerGone, match="cannot be reached"):
        refit.vllm.init_engine(refit.vllm.Server("http://127.0.0.1:9"), "spec")
