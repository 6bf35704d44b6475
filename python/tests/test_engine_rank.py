"""A Python engine as a rank of ``refit launch``: ``examples/topologies/grpo-python.toml`` run
as a user runs it (the real binary, rank 0 from the Rust GRPO example, two engine ranks of
``python/examples/torch_engine_rank.py`` started through ``REFIT_PYTHON``), learning digit
reversal; and what the adapter between the binding and an engine does with its answers."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import (REPO, RESTARTS, SHORT, STREAMING_ONLY, grpo_example, killed_rank_rejoins,
                      launch_command, launch_solves, require, wrap_engine)

import refit.engine
from refit.engine import Completion, _Adapter


def torch_engine() -> type:
    """The PyTorch engine of ``python/examples/torch_engine_rank.py`` (the launch tests'),
    imported from the examples folder."""
    sys.path.insert(0, str(REPO / "python/examples"))
    try:
        from torch_engine_rank import TorchTransformer
    finally:
        sys.path.pop(0)
    return TorchTransformer


def test_python_engine_ranks_learn_grpo_under_refit_launch(refit_bin, tmp_path):
    require("torch")
    cmd, env = launch_command(refit_bin, tmp_path, SHORT)
    out = launch_solves(cmd, env, tmp_path)
    # the Python ranks end cleanly (no call left running in Python when it finalizes)
    assert "terminate called" not in out and "Fatal Python error" not in out, out[-6000:]


def test_python_engine_ranks_learn_grpo_when_updates_abort_their_batches(refit_bin, tmp_path):
    """``pause_mode = "abort"``: each commit first interrupts the batch the torch engine is
    decoding (``interrupt``), whose requests end ``aborted`` at their next token; the
    rollout workers ask them again under the new version, the run learns, and the report
    counts the sequences the updates aborted."""
    require("torch")
    cmd, env = launch_command(refit_bin, tmp_path, SHORT + ["sync.pause_mode=abort"])
    out = launch_solves(cmd, env, tmp_path)
    aborted = [int(n) for n in re.findall(r"tokens; (\d+) sequences aborted", out)]
    assert len(aborted) == 2 and sum(aborted) > 0, out[-6000:]


#: The example engine's subclass made as the example's main makes it (torch on one thread:
#: the ranks share the machine's cores).
ONE_THREAD = "(m.torch.set_num_threads(1), Sub())[1]"


def test_python_engine_ranks_learn_grpo_with_streaming_apply_over_tcp(refit_bin, tmp_path):
    """``apply = "streaming"``: each engine rank's commit pulls the version inside its pause
    and the torch engine copies each tensor into its served weights as it arrives
    (``load_streamed``; no ``stage``, no second copy), over TCP, whose streaming receivers
    hold a few buckets of it, not the model; the run learns as a staged one does."""
    require("torch")
    sets = SHORT + ["model.policy.apply=streaming", "links.weights=tcp"]
    cmd, env = launch_command(refit_bin, tmp_path, sets)
    # the example's engine, refusing every stage and commit: only load_streamed serves
    wrap_engine(cmd, tmp_path, "torch_engine_rank.py", "m.TorchTransformer", ONE_THREAD, STREAMING_ONLY)
    out = launch_solves(cmd, env, tmp_path)
    assert out.count("weights over tcp, streaming") == 2, out[-6000:]


def test_a_streaming_model_is_refused_before_the_run_by_an_engine_that_does_not_stream(refit_bin, tmp_path):
    """An engine without ``load_streamed`` serving a model with ``apply = "streaming"``
    fails its rank before the run starts, naming the model and what to write instead."""
    require("torch")
    sets = SHORT + ["model.policy.apply=streaming"]
    cmd, env = launch_command(refit_bin, tmp_path, sets)
    # the engine of the example, without its load_streamed
    wrap_engine(cmd, tmp_path, "torch_engine_rank.py", "m.TorchTransformer", ONE_THREAD,
                "    load_streamed = refit.engine.Engine.load_streamed\n")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-6000:]
    assert 'apply = "streaming"' in out and 'use "staged"' in out, out[-6000:]
    assert "`policy`" in out and "does not" in out, out[-6000:]


def test_a_killed_python_engine_rank_is_restarted_and_rejoins(refit_bin, tmp_path):
    """``kill -9`` of a Python engine rank with ``restart = "on-failure"``: the launcher
    starts it again, its new incarnation rejoins the running job with the current weights
    (through the same Rust rank code as a Rust engine's), and the run solves."""
    require("torch")
    sets = SHORT + RESTARTS + ["stop.target_eval=0.7"]
    cmd, env = launch_command(refit_bin, tmp_path, sets)
    killed_rank_rejoins(cmd, env, tmp_path)


def test_the_torch_engine_scores_as_refits_own_generator(tmp_path):
    """The PyTorch engine of the launch test computes what Refit's generator computes: the
    same version (``grpo scores``: the learner's first version, sharpened, in the engines'
    layout) gives each token of a few sequences the same log-probability after its prefix,
    within float rounding. The scores spread over several nats, so a forward that differs
    (a head split, a norm, the GELU) would not pass."""
    torch = require("torch")
    from safetensors.torch import load_file

    subprocess.run([str(grpo_example()), "scores", str(tmp_path)], check=True,
                   capture_output=True, timeout=300)
    golden = json.loads((tmp_path / "scores.json").read_text())
    TorchTransformer = torch_engine()
    engine = TorchTransformer()
    model = golden["model"]
    weights = load_file(str(tmp_path / "engine.safetensors"))
    layout = [(n, "bf16", list(t.shape)) for n, t in weights.items()]
    assert engine.manifest(model, layout, {}) == layout  # the roles' default heads
    engine.served[model] = {n: t.float() for n, t in weights.items()}
    want_all, worst = [], 0.0
    for s in golden["sequences"]:
        seq = list(s["prompt"])
        for token, want in zip(s["tokens"], s["logprobs"]):
            got = float(engine.logits(model, seq).double().log_softmax(-1)[token])
            worst = max(worst, abs(got - want))
            want_all.append(want)
            seq.append(token)
    assert max(want_all) - min(want_all) > 5.0, want_all  # the check can fail
    print(f"the PyTorch engine's log-probabilities differ from Refit's by up to {worst:.1e}")
    assert worst < 2e-3, f"log-probabilities differ by up to {worst}"
    assert torch.isfinite(torch.tensor(want_all)).all()


def test_the_torch_engine_passes_the_conformance_suite_and_a_failing_engine_is_named():
    """The engine contract's conformance suite, the one Refit's own engines pass, run on the
    PyTorch engine of the launch test through the backend a rank puts it behind; an engine
    whose commit of a staged version raises fails it, the check named."""
    require("torch")
    TorchTransformer = torch_engine()
    params = {"heads": 4}
    # ANCHOR: conformance
    passed = refit.engine.conformance(TorchTransformer(), params)
    assert passed == refit.engine.CONFORMANCE_CHECKS
    # ANCHOR_END: conformance
    assert refit.engine.CONFORMANCE_CHECKS[:3] == ["load", "load-served", "stage-then-commit"]

    class RefusesV2(TorchTransformer):
        def commit(self, model, version):
            if version == 2:
                raise RuntimeError("v2 does not fit")
            return super().commit(model, version)

    with pytest.raises(refit.RefitError, match="stage-then-commit") as e:
        refit.engine.conformance(RefusesV2(), params)
    assert "v2 does not fit" in str(e.value)

    class NegativePause(TorchTransformer):
        def commit(self, model, version):
            super().commit(model, version)
            return -1.0

    # a commit's answer is seconds paused or None: another fails the first load, named
    with pytest.raises(refit.RefitError, match="load") as e:
        refit.engine.conformance(NegativePause(), params)
    assert "commit answered -1.0" in str(e.value)
    # params the roles refuse are a configuration error, named
    with pytest.raises(refit.ConfigError, match="nope"):
        refit.engine.conformance(TorchTransformer(), {"nope": 1})


def test_the_conformance_suite_runs_a_streaming_engine_through_load_streamed():
    """``apply="streaming"``: the same checks, every version pulled inside its commit and
    handed to ``load_streamed`` tensor by tensor, never staged; an engine without
    ``load_streamed`` is refused before any check, and one whose ``load_streamed`` answers
    without taking the stream fails the first load, named."""
    require("torch")
    TorchTransformer = torch_engine()
    params = {"heads": 4}

    class Counted(TorchTransformer):
        def __init__(self):
            super().__init__()
            self.streamed: list[int] = []

        def stage(self, model, version, update):
            raise AssertionError("a streaming model was staged")

        def load_streamed(self, model, version, stream):
            self.streamed.append(version)
            super().load_streamed(model, version, stream)

    engine = Counted()
    # ANCHOR: conformance_streaming
    passed = refit.engine.conformance(engine, params, apply="streaming")
    assert passed == refit.engine.CONFORMANCE_CHECKS
    # ANCHOR_END: conformance_streaming
    # versions 1 to 3 (the suite's loads and its commit), each asked once, then 9: the load
    # that times out after v4, published and never served, came in whole (and is served)
    assert engine.streamed == [1, 2, 3, 9], engine.streamed

    class Staged(TorchTransformer):
        load_streamed = None

    with pytest.raises(refit.ConfigError, match='apply = "streaming"'):
        refit.engine.conformance(Staged(), params, apply="streaming")

    class Ignores(TorchTransformer):
        def load_streamed(self, model, version, stream):
            pass

    with pytest.raises(refit.RefitError, match="check `load`") as e:
        refit.engine.conformance(Ignores(), params, apply="streaming")
    assert "answered without streaming it" in str(e.value)
    with pytest.raises(refit.ConfigError, match="staged"):
        refit.engine.conformance(TorchTransformer(), params, apply="lazily")


def test_the_adapter_says_an_engine_streams_when_its_class_has_load_streamed():
    class Staged(refit.engine.Engine):
        pass

    class Streams(refit.engine.Engine):
        def load_streamed(self, model, version, stream):
            stream(lambda name, t: None)

    class DuckStreams:  # no Engine: it streams when it has the method
        def load_streamed(self, model, version, stream):
            pass

    assert not _Adapter(Staged()).streams()
    assert _Adapter(Streams()).streams()
    assert _Adapter(DuckStreams()).streams()
    assert not _Adapter(object()).streams()


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
                elif r.prompt == [7]:
                    out.append(Completion(tokens=None, logprobs=[]))
                else:
                    out.append(Completion(tokens=[r.prompt[-1]] * r.max_tokens,
                                          logprobs=[-0.5] * r.max_tokens,
                                          versions=[r.served] * r.max_tokens))
            return out

    a = _Adapter(Echo())
    assert a.name() == "echo"
    asked = [("policy", [3], 2, 0.0, 7, None), ("policy", [9], 2, 1.0, 7, 4),
             ("policy", [8], 1, 1.0, 7, None), ("policy", [7], 1, 1.0, 7, None)]
    ok, bad, wrong, broken = a.generate(asked, {"policy": 5})
    assert ok == ([3, 3], [-0.5, -0.5], [5, 5], "length")
    assert bad == "ValueError: no nines"
    assert wrong.startswith("TypeError:") and "Completion" in wrong
    # one completion that does not convert fails alone
    assert broken.startswith("TypeError: a Completion that does not convert")
    # the default layout is the roles' own; scores are refused by default
    layout = [("w", "bf16", [2, 3])]
    assert a.manifest("policy", layout, '{"heads": 2}') == [("w", "bf16", [2, 3])]
    with pytest.raises(NotImplementedError, match="echo does not score"):
        a.score([("policy", [1], [2], 1.0)], {"policy": 1})
    # an interrupt is passed on; an engine without one (the default, or an object that is
    # no Engine) lets the commit wait for the batch
    a.interrupt("policy", 6)
    _Adapter(object()).interrupt("policy", 6)
    seen = []

    class Interrupted(Echo):
        def interrupt(self, model, version):
            seen.append((model, version))

    _Adapter(Interrupted()).interrupt("policy", 6)
    assert seen == [("policy", 6)]


def test_join_outside_refit_launch_says_what_is_missing(monkeypatch, capsys):
    monkeypatch.delenv("REFIT_TOPOLOGY", raising=False)
    with pytest.raises(refit.ConfigError, match="REFIT_TOPOLOGY"):
        refit.engine.join(refit.engine.Engine())
    # as a program's body: one `error: ...` line naming the cause, and status 1
    assert refit.engine.main(refit.engine.Engine()) == 1
    assert "REFIT_TOPOLOGY" in capsys.readouterr().err
    with pytest.raises(refit.ConfigError, match="roles `ppo`"):
        refit.engine.join(refit.engine.Engine(), roles="ppo")
