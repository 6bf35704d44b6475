"""Fixtures of the Python package's tests: a cluster token in the environment, the `refit`
binary (built by cargo beside the package), and a sender/receiver pair on any transport."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


def grpo_example() -> Path:
    """The GRPO example of the workspace's debug build (built if missing)."""
    path = REPO / "target" / "debug" / "examples" / "grpo"
    if not path.exists():
        subprocess.run(["cargo", "build", "--example", "grpo"], cwd=REPO, check=True)
    return path


#: The shorter task of the launch tests (a debug build learns it in seconds).
SHORT = ["model.policy.params.min_len=3", "model.policy.params.max_len=3",
         "model.policy.params.heldout=64", "stop.target_eval=0.6"]


def launch_command(refit_bin: Path, tmp_path: Path, sets: list[str], topology: str = "grpo-python.toml",
                   script: str = "torch_engine_rank.py") -> tuple[list[str], dict]:
    """``refit launch`` of a shipped topology whose ranks run Python examples (``script``
    among them), run as this build's: the GRPO example of this build, every example by its
    path, this interpreter as REFIT_PYTHON."""
    text = (REPO / "examples/topologies" / topology).read_text()
    assert f'"python/examples/{script}"' in text
    text = text.replace('"target/release/examples/grpo"', f'"{grpo_example()}"')
    text = re.sub(r'"python/examples/([a-z_]+\.py)"', lambda m: f'"{REPO / "python/examples" / m.group(1)}"', text)
    topo = tmp_path / topology
    topo.write_text(text)
    env = dict(os.environ, REFIT_PYTHON=sys.executable)
    env.pop("REFIT_TOKEN", None)  # refit launch makes the run's token
    cmd = [str(refit_bin), "launch", str(topo)]
    for s in sets:
        cmd += ["--set", s]
    return cmd, env


def launch_solves(cmd: list[str], env: dict, cwd: Path, low: float = 0.3, high: float = 0.6) -> str:
    """Runs a GRPO launch to its end and checks that it solved: held-out reward from at most
    ``low`` to at least ``high``, both engine ranks stopped after loading versions, the
    update lines naming what each engine rank serves, the report's pauses printed, no
    Python traceback. Answers the launch's output."""
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    solved = [l for l in out.splitlines() if "solved: policy held-out reward" in l]
    assert solved, out[-6000:]
    # "held-out reward (greedy) A -> B in N updates"
    first, last = (float(x) for x in solved[0].split("(greedy) ")[1].split(" in ")[0].split(" -> "))
    assert first <= low and last >= high, solved[0]
    for r in (1, 2):
        assert f"rank {r} (process `engine`, replica {r - 1}): stopped; engine loaded" in out, out[-6000:]
    assert "engine pauses" in out and "Traceback" not in out, out[-6000:]
    # each update's line names the version each engine rank serves and its pause per load
    served = r"engines serve rank 1 v\d+ \(pause [\d.]+ (us|ms|s) per load\), rank 2 v\d+ \(pause"
    assert re.search(served, out), out[-6000:]
    return out


def require(module: str):
    """Imports ``module`` (torch, torchrl, ray): a test module that needs it is skipped where
    it is not installed, except under ``REFIT_REQUIRE_EXTRAS=1`` (CI's Python environment has
    them all), where its absence fails the run."""
    if os.environ.get("REFIT_REQUIRE_EXTRAS") == "1":
        return __import__(module)
    return pytest.importorskip(module)


def require_vllm():
    """Imports vLLM: a test module that needs it is skipped where it is not installed (CI's
    main Python environment: vLLM's CPU build pins another torch), except under
    ``REFIT_REQUIRE_VLLM=1`` (CI's vLLM environment, ``scripts/vllm-env.sh``), where its
    absence fails the run."""
    if os.environ.get("REFIT_REQUIRE_VLLM") == "1":
        return __import__("vllm")
    return pytest.importorskip("vllm")


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
