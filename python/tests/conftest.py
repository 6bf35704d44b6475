"""Fixtures of the Python package's tests: a cluster token in the environment, the `refit`
binary (built by cargo beside the package), and a sender/receiver pair on any transport."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import refit

REPO = Path(__file__).resolve().parents[2]
TRANSPORTS = ["shm", "tcp", "file", "broadcast"]
TOKEN = "python-tests-0123456789abcdef"


@pytest.fixture(autouse=True)
def token(monkeypatch):
    """Every test runs with a cluster token in REFIT_TOKEN (TCP and broadcast need one)."""
    monkeypatch.setenv("REFIT_TOKEN", TOKEN)
    monkeypatch.delenv("REFIT_TOKEN_FILE", raising=False)
    return TOKEN


@pytest.fixture(scope="session")
def refit_bin() -> Path:
    """The `refit` binary: $REFIT_BIN, else the workspace's debug build (built if missing)."""
    if os.environ.get("REFIT_BIN"):
        return Path(os.environ["REFIT_BIN"])
    path = REPO / "target" / "debug" / "refit"
    if not path.exists():
        subprocess.run(["cargo", "build", "--bin", "refit"], cwd=REPO, check=True)
    return path


def require(module: str):
    """Imports ``module`` (torch, torchrl, ray): a test module that needs it is skipped where
    it is not installed, except under ``REFIT_REQUIRE_EXTRAS=1`` (CI's Python environment has
    them all), where its absence fails the run."""
    if os.environ.get("REFIT_REQUIRE_EXTRAS") == "1":
        return __import__(module)
    return pytest.importorskip(module)


def weights(seed: int) -> dict[str, np.ndarray]:
    """A small model with tensors of several dtypes and odd sizes."""
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((33, 16)).astype(np.float32),
        "layer.bias": rng.standard_normal(7).astype(np.float16),
        "layer.scale": np.array(rng.standard_normal(), dtype=np.float64),
        "steps": rng.integers(-(2**40), 2**40, size=3, dtype=np.int64),
        "mask": rng.integers(0, 2, size=(2, 5)).astype(np.bool_),
        "ids": rng.integers(0, 255, size=129, dtype=np.uint8),
    }


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want)
    for name, a in want.items():
        b = got[name]
        assert b.dtype == a.dtype, name
        assert b.shape == a.shape, name
        assert b.tobytes() == a.tobytes(), name


class Pair:
    """A started sender and a connected receiver of one transport."""

    def __init__(self, transport: str, tmp: Path, initial: dict[str, np.ndarray], **receiver_kw):
        self.sender = refit.Sender(transport, initial, receivers=1, dir=tmp / "files" if transport == "file" else None)
        box: dict = {}

        def connect():
            try:
                box["r"] = refit.Receiver(self.sender.spec, timeout=20, **receiver_kw)
            except Exception as e:  # surfaced below
                box["e"] = e

        t = threading.Thread(target=connect)
        t.start()
        self.sender.start(timeout=20)
        t.join(30)
        if "e" in box:
            raise box["e"]
        self.receiver: refit.Receiver = box["r"]

    def close(self):
        self.receiver.close()
        self.sender.close()


@pytest.fixture
def pair(tmp_path):
    made = []

    def make(transport: str, initial=None, **kw) -> Pair:
        p = Pair(transport, tmp_path, initial if initial is not None else weights(1), **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
