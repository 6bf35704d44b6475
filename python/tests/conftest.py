"""Fixtures of the Python package's tests: a cluster token in the environment, the `refit`
binary (built by cargo beside the package), and a sender/receiver pair on any transport."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
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


#: The methods of an engine class (for :func:`wrap_engine`) that refuse every stage and
#: commit: with a topology's ``apply = "streaming"``, only ``load_streamed`` serves.
STREAMING_ONLY = ("    def stage(self, *a):\n        raise RuntimeError('a stage for a streaming model')\n"
                  "    def commit(self, *a):\n        raise RuntimeError('a commit for a streaming model')\n")


def wrap_engine(cmd: list[str], tmp_path: Path, script: str, base: str, make: str, body: str) -> None:
    """Has the launch ``cmd`` (of :func:`launch_command`) run, where it runs the example
    ``script``, a program whose engine is ``make`` (an expression): a ``Sub`` of ``base``
    (an expression over the example's module, ``m``) with the methods ``body`` (indented
    as in a class)."""
    wrapper = tmp_path / f"wrapped_{script}"
    wrapper.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'python/examples')!r})\n"
        "import refit.engine\n"
        f"import {Path(script).stem} as m\n"
        f"class Sub({base}):\n{body}\n"
        f"sys.exit(refit.engine.main({make}, roles='grpo'))\n")
    topo = Path(cmd[2])
    example = str(REPO / "python/examples" / script)
    assert example in topo.read_text(), f"the topology runs no {script}"
    topo.write_text(topo.read_text().replace(example, str(wrapper)))


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


#: The engine ranks restarted on failure, and a dead one seen within seconds.
RESTARTS = ["process.engine.restart=on-failure", "process.engine.max_restarts=2",
            "run.keepalive_s=0.5", "run.dead_after_s=3.0"]


def killed_rank_rejoins(cmd: list[str], env: dict, cwd: Path, kill_at: str = "policy v4:",
                        solves: bool = True) -> str:
    """Runs a launch whose engine ranks restart on failure (:data:`RESTARTS`), ``kill -9``s
    rank 2 once a line holds ``kill_at``, and checks that the launcher started it again,
    that its new incarnation rejoined the running job, loaded versions and stopped cleanly,
    that the report counts its loads, and that the run ended: solved when ``solves``, else
    unsolved at its budget (status 1, rank 0 named as the cause, not the rank the restart
    made good). Answers the output."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # lines come through a reader thread, so a silent run cannot hang the test past its
    # deadline
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True)
    reader.start()
    seen: list[str] = []
    pid = killed = None
    deadline = time.monotonic() + 600
    try:
        while reader.is_alive() or not lines.empty():
            assert time.monotonic() < deadline, "".join(seen[-40:])
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            seen.append(line)
            if pid is None and "rank 2 (process `engine`, replica 1): pid " in line:
                pid = int(line.split(": pid ")[1].split(",")[0])
            if killed is None and pid is not None and kill_at in line:
                os.kill(pid, signal.SIGKILL)
                killed = pid
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(seen)
    assert killed is not None, out[-6000:]
    if solves:
        assert proc.returncode == 0 and "solved: policy held-out reward" in out, out[-6000:]
        assert "NOT solved" not in out, out[-6000:]
    else:
        assert proc.returncode == 1 and "NOT solved: policy held-out reward" in out, out[-6000:]
        assert "refit launch: error: rank 0 (learner) failed: the run ended unsolved" in out, out[-6000:]
        assert "refit launch: error: rank 2" not in out, out[-6000:]
    assert "rank 2 (process `engine`, replica 1) rejoined (incarnation 1)" in out, out[-6000:]
    after = out.split("rejoined (incarnation 1)", 1)[1]
    assert "rank 2 (process `engine`, replica 1): stopped; engine loaded" in after, out[-6000:]
    # the report counts the new incarnation's loads and the tokens it made for rollouts
    counts = re.search(r"rank 2 \(incarnation 1\): (\d+) loads, .*; (\d+) tokens;", after)
    assert counts and int(counts.group(1)) > 0 and int(counts.group(2)) > 0, out[-6000:]
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
