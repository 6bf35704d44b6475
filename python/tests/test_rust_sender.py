"""Python receives from Refit's own sender (`refit serve`, a Rust process) on every
transport: the bytes of the served safetensors file, then each version published when the
file changes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import refit
from conftest import TRANSPORTS, assert_same, weights


class Serve:
    def __init__(self, refit_bin: Path, file: Path, link: str, spec: Path):
        self.proc = subprocess.Popen(
            [str(refit_bin), "serve", str(file), "--watch", "--link", link, "--spec-file", str(spec)]
            + (["--receivers", "1"] if link == "broadcast" else []),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not spec.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"refit serve did not start: {self.proc.stderr.read()}")
            time.sleep(0.05)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _replace(path: Path, tensors: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(".next.safetensors")
    save_file(tensors, str(tmp))
    tmp.rename(path)


@pytest.mark.parametrize("transport", [*TRANSPORTS, "tcp-endpoint"])
def test_python_receives_what_refit_serve_publishes(refit_bin, tmp_path, transport):
    file = tmp_path / "model.safetensors"
    save_file(weights(1), str(file))
    spec = tmp_path / "model.spec"
    serve = Serve(refit_bin, file, "tcp" if transport == "tcp-endpoint" else transport, spec)
    try:
        # `refit serve --link tcp` writes the sender agent's endpoint (what `refit pull` reads);
        # every other link writes the link factory's spec: the receiver takes both
        r = refit.Receiver(spec, timeout=30)
        assert r.transport == ("tcp" if transport == "tcp-endpoint" else transport)
        assert_same(r.current().arrays(), load_file(str(file)))
        _replace(file, weights(2))
        u = None
        deadline = time.monotonic() + 30
        while u is None and time.monotonic() < deadline:
            u = r.receive(timeout=1)
        assert u is not None and u.version() == 2
        assert_same(u.arrays(), weights(2))
        u.ack()
        r.close()
    finally:
        serve.stop()


def test_shared_memory_needs_no_token(refit_bin, tmp_path, monkeypatch):
    monkeypatch.delenv("REFIT_TOKEN")
    file = tmp_path / "model.safetensors"
    save_file(weights(1), str(file))
    serve = Serve(refit_bin, file, "shm", tmp_path / "spec")
    try:
        with refit.Receiver(tmp_path / "spec", timeout=30) as r:
            assert_same(r.current().arrays(), weights(1))
    finally:
        serve.stop()


def _write_fp8(path: Path, raw: bytes) -> None:
    header = {"w8": {"dtype": "F8_E4M3", "shape": [len(raw)], "data_offsets": [0, len(raw)]}}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw)


def test_fp8_crosses_and_numpy_refuses_it_by_name(refit_bin, tmp_path):
    file = tmp_path / "fp8.safetensors"
    raw = bytes(range(0, 250, 3))  # e4m3fn bit patterns, none of them NaN (0x7f/0xff)
    _write_fp8(file, raw)
    spec = tmp_path / "fp8.spec"
    serve = Serve(refit_bin, file, "shm", spec)
    try:
        r = refit.Receiver(spec, timeout=30)
        cur = r.current()
        assert cur.tensors()[0].dtype == "f8_e4m3"
        with pytest.raises(refit.DTypeError, match="w8"):
            cur.items()
        bits = cur.arrays(raw=True)["w8"]
        assert bits.dtype == np.uint8 and bits.tobytes() == raw
        r.close()
    finally:
        serve.stop()


def test_refit_pull_takes_what_a_python_trainer_publishes(refit_bin, tmp_path):
    """The other direction: a Python sender, a Rust receiver (`refit pull` over tcp)."""
    s = refit.Sender("tcp", weights(1))
    try:
        s.start(timeout=10)
        s.publish(weights(2))
        spec = tmp_path / "spec"
        spec.write_text(s.spec)
        out = tmp_path / "pulled.safetensors"
        subprocess.run(
            [str(refit_bin), "pull", str(out), "--spec-file", str(spec), "--timeout", "30"],
            check=True,
            capture_output=True,
        )
        s.wait(timeout=10)  # the pull acknowledged version 2
        assert_same(load_file(str(out)), weights(2))
    finally:
        s.close()
