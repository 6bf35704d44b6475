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
    def __init__(self, fail_update_with: str | None = None, routes: bool = True, protocol: str = "HTTP/1.0",
                 drop_kept: bool = False, cache_drops: bool = True):
        self.calls: list[tuple[str, object]] = []
        # the client ports the tokens route was asked from (one per connection)
        self.peers: set[int] = set()
        self.cache_drops = cache_drops
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
                if route == "inference/v1/generate":
                    owner.peers.add(self.client_address[1])
                    if body["token_ids"][0] < 0:
                        return self.answer(400, {"error": {"message": "token_ids must not contain negative values",
                                                           "type": "BadRequestError", "code": 400}})
                    return self.answer(200, {"choices": [{"token_ids": body["token_ids"][::-1]}]})
                if route == "reset_prefix_cache?reset_running_requests=true":
                    return self.answer(200, {"success": owner.cache_drops})
                if route == "abort_requests":
                    return self.answer(200, {"status": "aborted", "aborted": 2})
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
                # a kept-alive connection the server drops once idle (without saying so)
                self.close_connection = self.close_connection or drop_kept

        Handler.protocol_version = protocol
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


@pytest.mark.parametrize(("protocol", "drop_kept"), [("HTTP/1.1", False), ("HTTP/1.0", False), ("HTTP/1.1", True)])
def test_the_rl_routes_and_the_tokens_route(protocol, drop_kept):
    """``pause``, ``resume``, ``abort_requests`` and a held requests' cache reset go to
    vLLM's routes; ``generate`` keeps one connection per thread where the server keeps it
    open (HTTP/1.1), makes a fresh one where the server closed it (HTTP/1.0), and asks
    again on a fresh one when the server dropped a kept connection silently; a request
    vLLM refuses raises ``ValueError`` with its message; the label of a version goes to
    ``finish_weight_update``."""
    s = StandIn(protocol=protocol, drop_kept=drop_kept)
    try:
        server = refit.vllm.Server(s.url)
        server.pause("keep")
        refit.vllm.update_weights(server, version=3, timeout=7, weight_version="12", running=True)
        server.resume()
        assert server.abort_requests() == 2
        for _ in range(3):
            assert server.generate({"token_ids": [1, 2, 3]})["choices"][0]["token_ids"] == [3, 2, 1]
        with pytest.raises(ValueError, match="refused /inference/v1/generate: token_ids must not contain negative"):
            server.generate({"token_ids": [-1]})
        routes = [r for r, _ in s.calls]
        assert routes[:7] == ["pause?mode=keep", "start_weight_update", "update_weights", "finish_weight_update",
                              "reset_prefix_cache?reset_running_requests=true", "resume", "abort_requests"], routes
        assert s.calls[3][1] == {"weight_version": "12"}
        # each request asked once, whoever closed the connections
        assert routes.count("inference/v1/generate") == 4, routes
        assert len(s.peers) == (1 if protocol == "HTTP/1.1" and not drop_kept else 4), s.peers
    finally:
        s.close()
    with pytest.raises(refit.PeerGone, match="cannot be reached"):
        refit.vllm.Server("http://127.0.0.1:9").generate({"token_ids": [1]})


def test_a_load_whose_held_requests_keep_stale_kv_entries_is_not_whole():
    """With requests held (``running=True``), vLLM must drop their KV entries computed with
    the previous weights: when it answers that it did not, the update raises
    ``NeedsFullResend``."""
    s = StandIn(protocol="HTTP/1.1", cache_drops=False)
    try:
        with pytest.raises(refit.NeedsFullResend, match="kept the KV entries"):
            refit.vllm.update_weights(refit.vllm.Server(s.url), version=3, timeout=7, running=True)
        # without held requests, a cache vLLM could not drop is not an error (no request used it)
        s.calls.clear()
        refit.vllm.update_weights(refit.vllm.Server(s.url), version=3, timeout=7)
        assert [r for r, _ in s.calls][-1] == "reset_prefix_cache"
    finally:
        s.close()


class Routes:
    """A `vllm serve` as :class:`refit.vllm_server.VllmServerEngine` sees it: the calls it
    gets, in order."""

    url = "http://stand-in"

    def __init__(self, resume_fails: bool = False):
        self.calls: list[str] = []
        self.resume_fails = resume_fails

    def pause(self, mode):
        self.calls.append(f"pause {mode}")

    def resume(self):
        self.calls.append("resume")
        if self.resume_fails:
            raise refit.PeerGone("vLLM at http://stand-in cannot be reached (/resume)")

    def abort_requests(self):
        self.calls.append("abort")
        return 1

    def generate(self, body, timeout=None):
        # one token, labelled with the version served before the failed commit
        return {"choices": [{"token_ids": [3], "logprobs": {"content": [{"token_id": 3, "logprob": -0.5}]},
                             "weight_versions": [{"version": "4", "start": 0, "end": 1}], "finish_reason": "length"}]}


@pytest.mark.parametrize(("raised", "mixed"), [(refit.Refused, False), (refit.Timeout, False),
                                               (refit.NeedsFullResend, True), (Exception, True)])
def test_a_server_commit_that_fails_resumes_vllm_and_aborts_the_held_requests_once_the_load_began(
        monkeypatch, raised, mixed):
    """A version refused before the load (``Refused``, ``Timeout``) leaves the held requests
    to go on under the weights they began with; a failure once the load began (a
    ``NeedsFullResend``, a route failing) aborts them before vLLM resumes, and the model
    answers no request until a version loads whole. vLLM resumes either way; a resume that
    fails after a load that worked fails the commit, the model fenced the same."""
    from refit.engine import Request
    from refit.vllm_server import VllmServerEngine, _Served

    def update(*a, **k):
        raise raised("the workers said no")

    monkeypatch.setattr(refit.vllm, "update_weights", update)
    e = VllmServerEngine("http://stand-in")
    routes = Routes()
    e._models["policy"] = served = _Served(routes, None, [])
    served.staged = (5, 2)
    with pytest.raises(raised, match="the workers said no"):
        e.commit("policy", 5)
    assert routes.calls == ["pause keep"] + (["abort"] if mixed else []) + ["resume"]
    (answer,) = e.generate([Request("policy", [1], 1, 1.0, 0, None, 4)])
    if mixed:
        assert isinstance(answer, RuntimeError) and "mixed weights (v5 failed to load part-way" in str(answer)
    else:  # the previous version still serves
        assert not isinstance(answer, BaseException) and answer.tokens == [3] and answer.versions == [4], answer
    # a load that works after vLLM failed to resume: the commit fails, the model fenced
    monkeypatch.setattr(refit.vllm, "update_weights", lambda *a, **k: None)
    e._models["policy"] = served = _Served(Routes(resume_fails=True), None, [])
    served.staged = (6, 3)
    with pytest.raises(RuntimeError, match="v6 loaded, but vLLM at http://stand-in did not resume"):
        e.commit("policy", 6)
    assert served.mixed is not None
    e.close()
