"""A PyTorch trainer as rank 0 of ``refit launch`` (:mod:`refit.trainer`,
``python/examples/torch_trainer_rank.py``): ``examples/topologies/grpo-torch.toml`` run as a
user runs it (the real binary, Refit's generating engines on ranks 1 and 2), learning digit
reversal; what the adapter checks of an export; GRPO's group advantages in torch."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, SHORT, launch_command, launch_solves, require

torch = require("torch")

import refit  # noqa: E402
import refit.trainer  # noqa: E402
from refit.trainer import Sequence, _Adapter  # noqa: E402

sys.path.insert(0, str(REPO / "python/examples"))
import torch_trainer_rank as example  # noqa: E402

sys.path.pop(0)

LAYOUT = [("w", "f32", [2, 3]), ("b", "f32", [3])]


def test_a_pytorch_trainer_rank_learns_grpo_with_refits_engines(refit_bin, tmp_path):
    """Rank 0 is the torch learner (controller, pool, evaluator: Refit's rank code through
    the binding); each export is converted to the Rust engines' layout and served; the run
    solves and rank 0 prints the run's summary as the Rust trainer does."""
    cmd, env = launch_command(refit_bin, tmp_path, SHORT, topology="grpo-torch.toml",
                              script="torch_trainer_rank.py")
    out = launch_solves(cmd, env, tmp_path)
    assert "[rank 0 learner] engine pauses" in out, out[-6000:]


def test_an_export_that_does_not_fit_the_layout_ends_the_run_naming_the_tensor(refit_bin, tmp_path):
    """A learner whose export lacks a tensor: rank 0 fails at the first export, the launch
    ends and says which tensor, of which model."""
    script = tmp_path / "lacking.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'python/examples')!r})\n"
        "import refit.trainer\n"
        "import torch_trainer_rank as ex\n"
        "class Lacking(ex.TorchGrpo):\n"
        "    def export(self, model):\n"
        "        out = super().export(model)\n"
        "        del out['head.weight']\n"
        "        return out\n"
        "refit.trainer.join(Lacking())\n")
    cmd, env = launch_command(refit_bin, tmp_path, SHORT + [f'process.learner.command=["python3", "{script}"]'],
                              topology="grpo-torch.toml", script="torch_trainer_rank.py")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-4000:]
    assert "tensor `head.weight` of `policy` is missing" in out, out[-4000:]


def test_a_pytorch_trainer_rank_takes_its_kl_term_to_the_reference_the_engines_serve(refit_bin, tmp_path):
    """``reference_every`` with a Python learner: Refit's engines serve a reference beside
    the policy (refreshed every 4 versions), every sequence of every batch reaches the
    torch learner with its log-probabilities under it, aligned token for token with the
    learner's own (the first batch's KL term, policy and reference both version 1, is
    near zero), the learner builds no frozen copy, and the run solves; without
    ``kl_coef`` the topology is refused before the run, naming both settings."""
    script = tmp_path / "served.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'python/examples')!r})\n"
        "import refit.trainer\n"
        "import torch_trainer_rank as ex\n"
        "class Served(ex.TorchGrpo):\n"
        "    def start(self, model, layout, params, seed):\n"
        "        super().start(model, layout, params, seed)\n"
        "        assert params['reference_every'] == 4 and self.served and self.reference is None, params\n"
        "        self.updates = 0\n"
        "    def update(self, model, batch):\n"
        "        assert all(s.ref_logprobs is not None and len(s.ref_logprobs) == len(s.tokens) for s in batch)\n"
        "        stats = super().update(model, batch)\n"
        "        self.updates += 1\n"
        "        # the first batch: the policy is still the reference's version 1, token for token\n"
        "        assert self.updates > 1 or stats['kl'] < 1e-4, stats\n"
        "        return stats\n"
        "refit.trainer.join(Served())\n")
    sets = SHORT + [f'process.learner.command=["python3", "{script}"]', "model.policy.params.reference_every=4",
                    "model.policy.params.kl_coef=0.02"]
    cmd, env = launch_command(refit_bin, tmp_path, sets, topology="grpo-torch.toml", script="torch_trainer_rank.py")
    launch_solves(cmd, env, tmp_path)
    cmd, env = launch_command(refit_bin, tmp_path, SHORT + ["model.policy.params.reference_every=4"],
                              topology="grpo-torch.toml", script="torch_trainer_rank.py")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "params.kl_coef is 0 (set it above 0" in out, out[-4000:]
    assert "before any rank started" in out, out[-4000:]


def test_a_topology_the_python_learner_cannot_serve_is_refused_before_the_run(refit_bin, tmp_path):
    """A ``[checkpoint]`` (a Python learner's state is not Refit's to save) and a param the
    torch learner does not take are refused at ``refit launch``'s check, naming them; no
    rank starts."""
    for extra, cause in ((['checkpoint.dir="ckpt"', "checkpoint.every=5"], "a Python learner is not checkpointed"),
                         (["model.policy.params.epochs=2"], "params.epochs = 2")):
        cmd, env = launch_command(refit_bin, tmp_path, SHORT + extra, topology="grpo-torch.toml",
                                  script="torch_trainer_rank.py")
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        out = done.stdout + done.stderr
        assert done.returncode != 0 and cause in out, out[-4000:]
        assert "before any rank started" in out, out[-4000:]


def test_the_adapter_checks_each_exported_tensor_against_the_layout():
    class Fixed(refit.trainer.Learner):
        def start(self, model, layout, params, seed):
            self.started = (model, layout, params, seed)

        def update(self, model, batch):
            self.batch = batch
            return {"loss": torch.tensor(0.5)}

        def export(self, model):
            return self.weights

    learner = Fixed()
    a = _Adapter(learner)
    a.start("pi", LAYOUT, '{"lr": 0.1}', 7)
    assert learner.started == ("pi", [("w", "f32", [2, 3]), ("b", "f32", [3])], {"lr": 0.1}, 7)
    learner.weights = {"w": torch.ones(2, 3), "b": np.zeros(3, np.float32)}
    out = a.export("pi")
    assert out["w"].nbytes == 24 and out["b"].nbytes == 12
    learner.weights = {"w": torch.ones(3, 2), "b": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"tensor `w` of `pi` is f32 \[3, 2\], the layout says f32 \[2, 3\]"):
        a.export("pi")
    learner.weights = {"w": torch.ones(2, 3, dtype=torch.float64), "b": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="is f64"):
        a.export("pi")
    stats = a.update("pi", [([1, 2], [3], [-0.5], [4], 1.0, None, 9, "stop", None)])
    assert stats == {"loss": 0.5}
    learner.update = lambda model, batch: {"loss": "high"}
    with pytest.raises(TypeError, match="reported `loss` = 'high', not a number"):
        a.update("pi", [])
    learner.update = lambda model, batch: None
    assert a.update("pi", []) == {}
    (s,) = learner.batch
    assert s == Sequence([1, 2], [3], [-0.5], [4], 1.0, None, 9, "stop", None)


def seq(group: int, reward: float, tokens: int, credit: list[float] | None = None) -> Sequence:
    return Sequence([1], [2] * tokens, [-0.1] * tokens, [1] * tokens, reward, credit, group, "length")


def test_group_advantages_are_relative_within_each_group():
    """As the Rust learner computes them: a sequence's reward less its group's mean (every
    token), or, when every member has per-token credit, each position's credit less the
    mean at that position over the members that reach it; divided by the standard deviation
    when asked."""
    batch = [seq(0, 1.0, 2), seq(0, 0.0, 3), seq(1, 0.5, 1), seq(1, 0.5, 1)]
    adv = example.group_advantages(batch, scale_by_std=False, token_credit=True)
    assert [a.tolist() for a in adv] == [[0.5, 0.5], [-0.5, -0.5, -0.5], [0.0], [0.0]]
    scaled = example.group_advantages(batch, scale_by_std=True, token_credit=True)
    assert scaled[0].tolist() == pytest.approx([1.0, 1.0], rel=1e-5)
    credit = [seq(0, 0.0, 2, [1.0, 0.0]), seq(0, 0.0, 3, [0.0, 0.0, 1.0])]
    per_token = example.group_advantages(credit, scale_by_std=False, token_credit=True)
    assert [a.tolist() for a in per_token] == [[0.5, 0.0], [-0.5, 0.0, 0.0]]
    # credit off: the (equal) rewards decide, so nothing is learned from this group
    assert [a.tolist() for a in example.group_advantages(credit, False, False)] == [[0.0, 0.0], [0.0, 0.0, 0.0]]


def test_join_outside_refit_launch_says_what_is_missing(monkeypatch, capsys):
    monkeypatch.delenv("REFIT_TOPOLOGY", raising=False)
    with pytest.raises(refit.ConfigError, match="REFIT_TOPOLOGY"):
        refit.trainer.join(refit.trainer.Learner())
    # as a program's body: one `error: ...` line and status 1
    assert refit.trainer.main(refit.trainer.Learner()) == 1
    assert capsys.readouterr().err.startswith("error: ")
    with pytest.raises(refit.ConfigError, match="roles `ppo`"):
        refit.trainer.join(refit.trainer.Learner(), roles="ppo")


def tiny_layout(vocab: int = 5, d: int = 8, ctx: int = 6, mlp: int = 32) -> list:
    """The learner layout of a one-block transformer (as Refit's learner names it)."""
    b = "blocks.0."
    shapes = [("tok_emb.weight", [vocab, d]), ("pos_emb.weight", [ctx, d]), (b + "ln1.weight", [d]),
              (b + "ln1.bias", [d])] + [(b + f"attn.{p}.weight", [d, d]) for p in "qkvo"] + [
        (b + "ln2.weight", [d]), (b + "ln2.bias", [d]), (b + "mlp.fc.weight", [mlp, d]),
        (b + "mlp.proj.weight", [d, mlp]), ("ln_f.weight", [d]), ("ln_f.bias", [d]), ("head.weight", [vocab, d])]
    return [(n, "f32", s) for n, s in shapes]


@pytest.mark.parametrize("correction", ["behaviour", "truncated", "ignore"])
def test_the_torch_objective_is_the_clipped_ratio_of_the_rust_learner(correction):
    """One update's loss, from the policy's own log-probabilities: behaviour samples e times
    less likely than the policy (ratio e) are clipped at 1 + clip_high for a positive
    advantage and not for a negative one (``behaviour``); against the learner's own policy
    the ratio is 1, weighted by min(e, is_cap) with ``truncated``; the step changes the
    weights."""
    learner = example.TorchGrpo()
    learner.start("pi", tiny_layout(), {"heads": 2, "correction": correction, "is_cap": 2.0,
                                         "token_credit": False}, 3)
    seqs = [Sequence([1, 2], [3, 4], [0.0, 0.0], [1, 1], 1.0, None, 0, "length"),
            Sequence([1, 2], [4, 0, 1], [0.0] * 3, [1] * 3, 0.0, None, 0, "length")]
    with torch.no_grad():
        logp = learner.logprobs(seqs)
    behaviour = logp - 1.0  # each token e times less likely under the behaviour policy
    at = 0
    for s in seqs:
        s.logprobs = behaviour[at: at + len(s.tokens)].tolist()
        at += len(s.tokens)
    adv = torch.tensor([0.5, 0.5, -0.5, -0.5, -0.5])
    e = math.e
    if correction == "behaviour":
        per_token = torch.minimum(e * adv, torch.clamp(torch.tensor(e), 0.8, 1.2) * adv)
    elif correction == "truncated":
        per_token = adv * min(e, 2.0)
    else:
        per_token = adv
    before = {n: t.clone() for n, t in learner.export("pi").items()}
    stats = learner.update("pi", seqs)
    assert stats["loss"] == pytest.approx(float(-per_token.mean()), rel=1e-4)
    assert stats["behaviour_ratio_mean"] == pytest.approx(e, rel=1e-4)
    after = learner.export("pi")
    assert any(not torch.equal(before[n], after[n]) for n in before)
    with pytest.raises(ValueError, match="params.epochs = 2"):
        example.TorchGrpo().start("pi", tiny_layout(), {"heads": 2, "epochs": 2}, 0)
    with pytest.raises(ValueError, match="params.kl_coef = -0.1 is not a number >= 0"):
        example.TorchGrpo().start("pi", tiny_layout(), {"heads": 2, "kl_coef": -0.1}, 0)


def test_the_torch_kl_term_pulls_the_policy_back_to_its_first_weights():
    """``kl_coef > 0``: the loss adds ``kl_coef`` times the k3 estimate of KL(policy ‖ first
    weights) on the sampled tokens, reported as ``kl``. With every advantage zero (one group,
    equal rewards) the loss is that term alone, and updates shrink it; the reference is
    scored at the sampling temperature as the policy is (zero at the first step); without
    ``kl_coef`` no ``kl`` is reported."""
    learner = example.TorchGrpo()
    learner.start("pi", tiny_layout(), {"heads": 2, "kl_coef": 0.5, "correction": "ignore", "lr": 0.01,
                                         "temperature": 2.0}, 3)
    seqs = [Sequence([1, 2], [3, 4], [0.0, 0.0], [1, 1], 1.0, None, 0, "length"),
            Sequence([1, 2], [4, 0, 1], [0.0] * 3, [1] * 3, 1.0, None, 0, "length")]
    assert learner.update("pi", seqs)["kl"] == pytest.approx(0.0, abs=1e-9)  # the policy is its reference
    with torch.no_grad():  # move the policy away from its first weights
        gen = torch.Generator().manual_seed(1)
        for t in learner.policy.parameters():
            t.add_(torch.randn(t.shape, generator=gen) * 0.5)
    kls = []
    for _ in range(5):
        stats = learner.update("pi", seqs)
        assert stats["loss"] == pytest.approx(0.5 * stats["kl"], rel=1e-5)
        kls.append(stats["kl"])
    assert kls[0] > 0.01 and kls[4] < kls[0] * 0.8, kls
    plain = example.TorchGrpo()
    plain.start("pi", tiny_layout(), {"heads": 2}, 3)
    assert "kl" not in plain.update("pi", seqs)


def test_the_torch_kl_term_reads_the_served_reference_log_probabilities():
    """With ``reference_every`` the KL term's reference is the one the engines serve: a
    token e^d times less likely under it gives k3 = e^-d + d - 1, averaged over every token
    of the batch (d = 0.5 for the first sequence's two, -0.3 for the second's three), times
    ``kl_coef``: the whole loss when advantages are zero, the truncated importance weight
    (here 2: behaviour e times less likely) weighing the policy term only; a sequence
    without them is refused naming it, and the setting without ``kl_coef`` is refused at
    the start."""
    learner = example.TorchGrpo()
    learner.start("pi", tiny_layout(), {"heads": 2, "kl_coef": 0.5, "correction": "truncated", "is_cap": 2.0,
                                         "reference_every": 4}, 3)
    assert learner.reference is None
    seqs = [Sequence([1, 2], [3, 4], [0.0, 0.0], [1, 1], 1.0, None, 0, "length"),
            Sequence([1, 2], [4, 0, 1], [0.0] * 3, [1] * 3, 1.0, None, 0, "length")]
    with torch.no_grad():
        logp = learner.logprobs(seqs)
    at = 0
    for s, d in zip(seqs, (0.5, -0.3)):
        s.ref_logprobs = (logp[at: at + len(s.tokens)] - d).tolist()
        s.logprobs = (logp[at: at + len(s.tokens)] - 1.0).tolist()
        at += len(s.tokens)
    stats = learner.update("pi", seqs)
    k3 = (2 * (math.exp(-0.5) + 0.5 - 1) + 3 * (math.exp(0.3) - 0.3 - 1)) / 5
    assert stats["kl"] == pytest.approx(k3, rel=1e-4) and stats["loss"] == pytest.approx(0.5 * k3, rel=1e-4)
    seqs[1].ref_logprobs = seqs[1].ref_logprobs[:2]
    with pytest.raises(ValueError, match=r"sequence 1 \(group 0\) carries no reference log-probability per token "
                                         r"\(2 for 3 tokens\)"):
        learner.update("pi", seqs)
    with pytest.raises(ValueError, match="params.kl_coef is 0.0"):
        example.TorchGrpo().start("pi", tiny_layout(), {"heads": 2, "reference_every": 4}, 0)
