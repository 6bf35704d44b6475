"""A Python engine as a rank of ``refit launch``: ``examples/topologies/grpo-python.toml`` run
as a user runs it (the real binary, rank 0 from the Rust GRPO example, two engine ranks of
``python/examples/torch_engine_rank.py`` started through ``REFIT_PYTHON``), learning digit
reversal; and what the adapter between the binding and an engine does with its answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, require

import refit.engine
from refit.engine import Completion, _Adapter


def grpo_example() -> Path:
    """The GRPO example of the workspace's debug build (built if missing)."""
    path = REPO / "target" / "debug" / "examples" / "grpo"
    if not path.exists():
        subprocess.run(["cargo", "build", "--example", "grpo"], cwd=REPO, check=True)
    return path


def test_python_engine_ranks_learn_grpo_under_refit_launch(refit_bin, tmp_path):
    require("torch")
    text = (REPO / "examples/topologies/grpo-python.toml").read_text()
    assert 'command = ["python3", "python/examples/torch_engine_rank.py"]' in text
    text = text.replace('"target/release/examples/grpo"', f'"{grpo_example()}"')
    text = text.replace('"python/examples/torch_engine_rank.py"',
                        f'"{REPO / "python/examples/torch_engine_rank.py"}"')
    topo = tmp_path / "grpo-python.toml"
    topo.write_text(text)
    env = dict(os.environ, REFIT_PYTHON=sys.executable)
    env.pop("REFIT_TOKEN", None)  # refit launch makes the run's token
    sets = ["model.policy.params.min_len=3", "model.policy.params.max_len=3",
            "model.policy.params.heldout=64", "stop.target_eval=0.6"]
    cmd = [str(refit_bin), "launch", str(topo)]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    solved = [l for l in out.splitlines() if "solved: policy held-out reward" in l]
    assert solved, out[-6000:]
    # "held-out reward (greedy) A -> B in N updates"
    first, last = (float(x) for x in solved[0].split("(greedy) ")[1].split(" in ")[0].split(" -> "))
    assert first <= 0.3 and last >= 0.6, solved[0]
    for r in (1, 2):
        assert f"rank {r} (process `engine`, replica {r - 1}): stopped; engine loaded" in out, out[-6000:]
    assert "engine pauses" in out
    # the Python ranks end cleanly (no call left running in Python when it finalizes)
    assert "terminate called" not in out and "Fatal Python error" not in out, out[-6000:]


def test_the_adapter_hands_answers_over_and_names_what_is_wrong():
    class Echo(refit.engine.Engine):
        name = "echo"

        def generate(self, requests):
            out = []
            for r in requests:
                if r.prompt == [9]:
                    out.append(ValueError("no nines"))
                elif r.prompt == [8]:
                    out.append({"tokens": [1]})
                else:
                    out.append(Completion(tokens=[r.prompt[-1]] * r.max_tokens,
                                          logprobs=[-0.5] * r.max_tokens,
                                          versions=[r.served] * r.max_tokens))
            return out

    a = _Adapter(Echo())
    assert a.name() == "echo"
    asked = [("policy", [3], 2, 0.0, 7, None), ("policy", [9], 2, 1.0, 7, 4),
             ("policy", [8], 1, 1.0, 7, None)]
    ok, bad, wrong = a.generate(asked, {"policy": 5})
    assert ok == ([3, 3], [-0.5, -0.5], [5, 5], "length")
    assert bad == "ValueError: no nines"
    assert wrong.startswith("TypeError:") and "Completion" in wrong
    # the default layout is the roles' own; scores are refused by default
    layout = [("w", "bf16", [2, 3])]
    assert a.manifest("policy", layout, '{"heads": 2}') == [("w", "bf16", [2, 3])]
    with pytest.raises(NotImplementedError, match="echo engine does not score"):
        a.score([("policy", [1], [2], 1.0)], {"policy": 1})


def test_join_outside_refit_launch_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("REFIT_TOPOLOGY", raising=False)
    with pytest.raises(refit.RefitError, match="REFIT_TOPOLOGY"):
        refit.engine.join(refit.engine.Engine())
    with pytest.raises(refit.ConfigError, match="roles `ppo`"):
        refit.engine.join(refit.engine.Engine(), roles="ppo")
