"""`refit.sglang`: versions into an SGLang server through `/update_weights_from_disk`.

SGLang itself does not run here (its wheels need CUDA kernels), so the server is a stand-in
that keeps SGLang's HTTP contract for this endpoint (the request's `model_path`,
`weight_version` and `load_format`; `{"success", "message"}` with HTTP 200 or 400; the
previous weights kept when a load fails) and loads the directory as a Hugging Face loader
does: `config.json` present, every `*.safetensors` file read with the `safetensors` library.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import refit
from conftest import assert_same, weights
from refit.sglang import SGLangServer, write_model_dir

KEY = "admin-key-for-tests"


class StandIn:
    """An HTTP server with SGLang's `/update_weights_from_disk`, holding `names` tensors."""

    def __init__(self, names: list[str]):
        self.names = set(names)
        self.weights: dict[str, np.ndarray] | None = None
        self.requests: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    return self.answer(401, {"error": "unauthorized"})
                if self.path != "/update_weights_from_disk":
                    return self.answer(404, {"error": self.path})
                ok, message = owner.load(Path(body["model_path"]))
                self.answer(200 if ok else 400, {"success": ok, "message": message, "num_paused_requests": 0})

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

    def load(self, path: Path) -> tuple[bool, str]:
        if not (path / "config.json").is_file():
            return False, f"Failed to get weights iterator: no config.json in {path}."
        loaded = {}
        for f in sorted(path.glob("*.safetensors")):
            loaded.update(load_file(str(f)))
        unknown = set(loaded) - self.names
        if unknown:
            return False, f"Failed to update weights: unknown parameter {sorted(unknown)[0]}.\nRolling back to original weights."
        self.weights = loaded
        return True, "Succeeded to update model weights."

    def close(self):
        self.http.shutdown()


@pytest.fixture
def base(tmp_path):
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["TinyForCausalLM"]}')
    (d / "tokenizer_config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"old weights, never copied")
    return d


@pytest.fixture
def standin():
    s = StandIn(list(weights(1)))
    yield s
    s.close()


def test_each_version_lands_in_sglang_and_is_acked_after(pair, tmp_path, base, standin):
    p = pair("shm")
    server = SGLangServer(standin.url, base=base, staging=tmp_path / "staging", api_key=KEY)
    server.load(p.receiver.current())
    assert_same(standin.weights, weights(1))
    for v in (2, 3):
        p.sender.publish(weights(v))
        u = p.receiver.receive(timeout=20)
        assert u is not None
        with pytest.raises(refit.Timeout):
            p.sender.wait(timeout=0.2)  # not loaded yet: not acknowledged
        server.load(u)
        assert u.acked
        p.sender.wait(timeout=20)
        assert_same(standin.weights, weights(v))
        assert server.loaded == ("policy", v)
    req = standin.requests[-1]
    assert req["weight_version"] == "refit:policy:3"
    # the directory SGLang loaded: the base's configuration, the new weights, nothing else
    loaded = Path(req["model_path"])
    assert sorted(x.name for x in loaded.iterdir()) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    # older version directories are removed once a newer one is in force (keep=1)
    assert sorted(x.name for x in (tmp_path / "staging").iterdir()) == ["policy-v3"]


def test_every_dtype_is_written_as_safetensors_reads_it(tmp_path):
    p = refit.Sender("shm", weights(5), receivers=0)
    p.start()
    with refit.Receiver(p.spec) as r:
        d = write_model_dir(r.current(), tmp_path / "m")
        assert_same(load_file(str(d / "model.safetensors")), weights(5))
    p.close()


def test_a_refused_version_is_not_acked_and_sglang_keeps_the_previous(pair, tmp_path, base, standin):
    p = pair("shm")
    server = SGLangServer(standin.url, base=base, staging=tmp_path / "staging", api_key=KEY)
    server.load(p.receiver.current())
    bogus = refit.Sender("shm", {"bogus.weight": np.ones(4, np.float32)}, receivers=0)
    bogus.start()
    with refit.Receiver(bogus.spec) as r:
        u = r.current()
        with pytest.raises(refit.Refused, match=r"refused version 1 of `policy`.*bogus\.weight.*still serves version 1"):
            server.load(u)
    bogus.close()
    assert_same(standin.weights, weights(1))
    assert server.loaded == ("policy", 1)


def test_no_server_no_key_no_config_are_named(pair, tmp_path, base, standin):
    p = pair("shm")
    u = p.receiver.current()
    with pytest.raises(refit.Unauthorized, match="admin key"):
        SGLangServer(standin.url, base=base, staging=tmp_path / "s", api_key="wrong").load(u)
    with pytest.raises(refit.PeerGone, match="cannot be reached"):
        SGLangServer("http://127.0.0.1:9", base=base, staging=tmp_path / "s").load(u)
    (base / "config.json").unlink()
    with pytest.raises(refit.ConfigError, match="no config.json"):
        SGLangServer(standin.url, base=base, staging=tmp_path / "s", api_key=KEY).load(u)
    assert standin.weights is None


def test_the_book_example_feeds_sglang_as_a_trainer_publishes(tmp_path, base, standin, refit_bin):
    """`examples/sglang_engine.py` as a process, fed by `refit serve --watch` (Rust)."""
    import subprocess
    import sys
    import time

    from safetensors.numpy import save_file

    from conftest import REPO

    served = tmp_path / "model.safetensors"
    save_file(weights(1), str(served))
    spec = tmp_path / "policy.spec"
    serve = subprocess.Popen([str(refit_bin), "serve", str(served), "--link", "shm", "--watch",
                              "--spec-file", str(spec), "--model", "policy"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (spec.exists() and spec.stat().st_size > 0):
            assert serve.poll() is None and time.monotonic() < deadline, "refit serve did not start"
            time.sleep(0.05)
        feeder = subprocess.Popen([sys.executable, str(REPO / "python/examples/sglang_engine.py"), str(spec),
                                   "--server", standin.url, "--base", str(base), "--staging",
                                   str(tmp_path / "staging"), "--updates", "2", "--api-key", KEY],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for v in (2, 3):
            deadline = time.monotonic() + 30
            while len(standin.requests) < v - 1:  # the feeder loaded the version before
                assert feeder.poll() is None and time.monotonic() < deadline, feeder.stdout.read()
                time.sleep(0.05)
            tmp = tmp_path / "incoming.safetensors"
            save_file(weights(v), str(tmp))
            tmp.replace(served)
        out, _ = feeder.communicate(timeout=60)
        assert feeder.returncode == 0, out
        assert [r["weight_version"] for r in standin.requests] == ["refit:policy:1", "refit:policy:2", "refit:policy:3"]
        assert_same(standin.weights, weights(3))
    finally:
        serve.terminate()
        serve.wait(10)
