"""Fixtures of the Python package's tests: a cluster token in the environment, the `refit`
binary (built by cargo beside the package), and a sender/receiver pair on any transport."""

from __future__ import annotations

import json
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


#: The model id of the vLLM engine tests.
MODEL = "policy"


class Held:
    """What a vLLM engine's ``stage`` reads of a :class:`refit.Update`: ``torch(model)``."""

    def __init__(self, weights: dict):
        self.weights = weights

    def torch(self, model: str):
        assert model == MODEL
        return list(self.weights.items())


def layout_of(weights: dict) -> list:
    """The engines' layout of ``weights`` (bf16, as the GRPO roles serve it)."""
    return [(n, "bf16", list(t.shape)) for n, t in weights.items()]


@pytest.fixture(scope="session")
def golden(tmp_path_factory):
    """``grpo scores --param heads=2``: a version in the engines' layout (torch tensors) and
    the scores Refit's generator gives a few sequences."""
    from safetensors.torch import load_file

    d = tmp_path_factory.mktemp("scores")
    subprocess.run([str(grpo_example()), "scores", str(d), "--param", "heads=2"], check=True,
                   capture_output=True, timeout=300)
    weights = load_file(str(d / "engine.safetensors"))
    return weights, json.loads((d / "scores.json").read_text())


def scores_check(engine, golden) -> float:
    """A vLLM engine serving the golden weights gives each token the log-probability
    Refit's generator gives it (the scores spread over several nats, so a name, a transpose
    or a head split gone wrong would not pass); another temperature is refused by name,
    alone. Answers the largest difference."""
    from refit.engine import ScoreRequest

    _, scores = golden
    asked = [ScoreRequest(MODEL, s["prompt"], s["tokens"], 1.0, 1) for s in scores["sequences"]]
    answers = engine.score(asked)
    assert all(not isinstance(a, BaseException) for a in answers), answers
    want = [lp for s in scores["sequences"] for lp in s["logprobs"]]
    worst = max(abs(a - b) for a, b in zip([lp for a in answers for lp in a.logprobs], want))
    assert max(want) - min(want) > 5.0, want
    assert worst < 1e-4, f"log-probabilities differ by up to {worst}"
    (hot,) = engine.score([ScoreRequest(MODEL, [1, 2], [3], 0.5, 1)])
    assert isinstance(hot, ValueError) and "temperature 1 only" in str(hot)
    return worst


def replaces_check(engine, golden) -> None:
    """Each version a vLLM engine commits replaces what it serves: a version of other
    weights changes every score, and the golden weights committed again give the golden
    scores back."""
    from refit.engine import ScoreRequest

    weights, scores = golden
    other = {n: t * 0.5 if t.dim() == 2 else t for n, t in weights.items()}
    want = [lp for s in scores["sequences"] for lp in s["logprobs"]]
    for version, served, close in ((11, other, False), (12, weights, True)):
        engine.stage(MODEL, version, Held(served))
        engine.commit(MODEL, version)
        answers = engine.score([ScoreRequest(MODEL, s["prompt"], s["tokens"], 1.0, version)
                                for s in scores["sequences"]])
        got = [lp for a in answers for lp in a.logprobs]
        if close:
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        else:
            assert min(abs(a - b) for a, b in zip(got, want)) > 1e-3


def non_finite_refused(engine, weights: dict, version: int) -> None:
    """A version holding a value that is not finite is refused at the stage, naming the
    tensor, and nothing of it is staged (its commit is refused)."""
    import torch

    bad = dict(weights)
    bad["ln_f.weight"] = torch.full_like(bad["ln_f.weight"], float("nan"))
    with pytest.raises(ValueError, match=f"`ln_f.weight` of v{version} holds a value that is not finite"):
        engine.stage(MODEL, version, Held(bad))
    with pytest.raises(RuntimeError, match=f"v{version} of `{MODEL}` is not the version staged"):
        engine.commit(MODEL, version)


def completions_check(engine, weights: dict) -> tuple[list, list]:
    """A vLLM engine's completions after it committed ``weights`` as v2: every token is
    labelled v2 (vLLM's weight_versions spans); a sampled stop token ends the completion
    and is kept; a greedy completion's log-probabilities are the temperature-1 scores of
    its tokens; a seed gives the same completion again. Answers the requests and their
    completions."""
    from refit.engine import Request, ScoreRequest

    engine.stage(MODEL, 2, Held(weights))
    engine.commit(MODEL, 2)
    stop = 4
    asked = [Request(MODEL, [1, 2, 3], 6, 1.0, seed, stop, 2) for seed in range(16)]
    asked.append(Request(MODEL, [5, 6, 7], 5, 0.0, 0, None, 2))
    answers = engine.generate(asked)
    assert all(not isinstance(a, BaseException) for a in answers), answers
    for r, a in zip(asked, answers):
        assert a.versions == [2] * len(a.tokens)
        assert all(lp <= 0.0 for lp in a.logprobs) and len(a.logprobs) == len(a.tokens)
        if a.finish == "stop":
            assert a.tokens[-1] == stop and stop not in a.tokens[:-1]
        else:
            assert len(a.tokens) == r.max_tokens and (r.stop is None or r.stop not in a.tokens)
    assert any(a.finish == "stop" for a in answers[:-1]), answers  # the check can fail
    greedy = answers[-1]
    (scored,) = engine.score([ScoreRequest(MODEL, [5, 6, 7], greedy.tokens, 1.0, 2)])
    assert max(abs(a - b) for a, b in zip(greedy.logprobs, scored.logprobs)) < 1e-4
    again = engine.generate(asked[:2])
    assert [a.tokens for a in again] == [a.tokens for a in answers[:2]]
    return asked, answers


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
