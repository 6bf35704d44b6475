"""A Python learner as the trainer rank of a topology ``refit launch`` starts.

The rank is Refit's own, run through the binding: the rendezvous, the weight-sync
controller (sync modes, the staleness bound, the version barrier, validation), the
trajectory pool, the evaluator, the links to every engine (converted to the engines'
layout on the way), supervision, restarts and the report. Only the learner is Python: a
:class:`Learner` whose methods Refit calls on a thread of its own::

    import refit.trainer

    class MyLearner(refit.trainer.Learner):
        def start(self, model, layout, params, seed):    # once per model, before the run
            self.policy = build(layout, params, seed)

        def update(self, model, batch):                   # one call per batch
            ...                                           # a gradient step on the sequences
            return {"loss": loss}

        def export(self, model):                          # each version, in `layout`
            return {name: t.detach() for name, t in self.policy.state_dict().items()}

    refit.trainer.join(MyLearner(), roles="grpo")

A version goes: :meth:`Learner.update` trains on a batch the pool assembled (completions
of the rollout workers, with each token's version and behaviour log-probability), then
:meth:`Learner.export` hands the weights over, Refit checks them against the layout
(every tensor, of its dtype and size, nothing else: a difference is refused naming the
tensor), numbers the version and publishes it to every engine.

Importing this module answers ``refit launch``'s check at once (``refit-check: started``),
so a program may import torch before :func:`join`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import _bytes_of, _native, _program

# `refit launch` runs every rank program once as a check and waits a few seconds for it to
# say so: say it now, before the program imports torch
_native.check_started()


@dataclass
class Sequence:
    """One completion of the batch: what a rollout worker collected."""

    #: The prompt's token ids.
    prompt: list[int]
    #: The generated tokens.
    tokens: list[int]
    #: The behaviour log-probability of each token (the engine's, at the sampling
    #: temperature).
    logprobs: list[float]
    #: The version of the weights that generated each token.
    versions: list[int]
    #: The completion's reward.
    reward: float
    #: Per-token credit, when the task gives one (one value per token).
    token_rewards: list[float] | None
    #: Completions of one prompt share a group id (GRPO's advantages are relative within it).
    group: int
    #: ``"length"``, ``"stop"``, ``"aborted"`` (a weight update ended it) or ``"cancelled"``.
    finish: str
    #: Each token's log-probability under the reference model the engines serve, when the
    #: model's params set ``reference_every`` (the learner's ``params`` then hold it);
    #: ``None`` otherwise.
    ref_logprobs: list[float] | None = None


class Learner:
    """The learner of a trainer rank: subclass it and override what your learner does."""

    #: A name for messages.
    name: str = "python learner"

    def start(self, model: str, layout: list[tuple[str, str, list[int]]], params: dict[str, Any],
              seed: int) -> None:
        """Builds the learner of ``model`` before the run: ``layout`` is what
        :meth:`export` must answer, as ``(name, dtype, shape)`` triples (the layout of
        GRPO's own learner, which the engines' link converts from), ``params`` the model's
        ``[model.params]`` of the topology file less the framework's keys (``group_size``,
        ``batch_frames``, ...), with ``reference_every`` when it is set (the sequences then
        carry ``ref_logprobs``), ``seed`` the model's seed. Raise to refuse
        the topology (the run does not start: a configuration error naming what was
        raised). A Python learner is not checkpointed: a topology with ``[checkpoint]`` is
        refused."""
        raise NotImplementedError

    def update(self, model: str, batch: list[Sequence]) -> Mapping[str, float] | None:
        """Trains on one batch; answers what to report of it (a loss, an entropy), by name
        (numbers; ``None`` for nothing).
        Raise to refuse the batch (the run ends with the error)."""
        raise NotImplementedError

    def export(self, model: str) -> Mapping[str, Any]:
        """The current weights of ``model`` by name, in :meth:`start`'s layout: numpy arrays
        or CPU torch tensors of the layout's dtype and shape."""
        raise NotImplementedError


class _Adapter:
    """What the binding calls: plain values in, plain values out."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self.layouts: dict[str, dict[str, tuple[str, list[int]]]] = {}

    def start(self, model: str, layout: list, params: str, seed: int) -> None:
        triples = [(n, d, list(s)) for n, d, s in layout]
        self.learner.start(model, triples, json.loads(params), int(seed))
        self.layouts[model] = {n: (d, s) for n, d, s in triples}

    def update(self, model: str, batch: list) -> dict[str, float]:
        seqs = [Sequence(list(p), list(t), list(lp), list(v), float(r), None if tr is None else list(tr),
                         int(g), str(f), None if rl is None else list(rl))
                for p, t, lp, v, r, tr, g, f, rl in batch]
        stats: dict[str, float] = {}
        for k, v in dict(self.learner.update(model, seqs) or {}).items():
            try:
                stats[str(k)] = float(v)
            except (TypeError, ValueError) as e:
                raise TypeError(f"the learner's update reported `{k}` = {v!r}, not a number") from e
        return stats

    def export(self, model: str) -> dict[str, Any]:
        """The exported tensors as flat byte buffers, each checked against the layout
        (a tensor missing or unknown is named by the binding)."""
        layout = self.layouts[model]
        out: dict[str, Any] = {}
        for name, value in dict(self.learner.export(model)).items():
            dtype, shape, buf = _bytes_of(model, name, value)
            want = layout.get(name)
            if want is not None and (dtype, shape) != want:
                raise ValueError(f"tensor `{name}` of `{model}` is {dtype} {shape}, the layout says {want[0]} {want[1]}")
            out[str(name)] = buf
        return out


def join(learner: Learner, roles: str = "grpo") -> dict[str, Any] | None:
    """Runs this process as its rank of the topology ``refit launch`` started, its learner
    being ``learner`` and its other roles (controller, evaluator, rollout workers) those of
    ``roles`` (``"grpo"``: Refit's GRPO on digit reversal). Blocks until the run ends.
    Returns the run's report (``solved``, ``elapsed_s``) on rank 0, ``None`` on the others
    and when ``refit launch`` runs the program as a check.

    Raises :class:`refit.errors.ConfigError` for a topology or launch variable that does
    not fit, and the rank's error otherwise (a learner call that raised, an export that does
    not fit the layout, rank 0 gone). From the run's start on, SIGINT and SIGTERM end the
    process through Refit's handlers, as in any Refit rank."""
    return _native.join_trainer(_Adapter(learner), roles)


def main(learner: Learner, roles: str = "grpo") -> int:
    """:func:`join` as a rank program's body (``sys.exit(refit.trainer.main(MyLearner()))``):
    0 when the run ends well; 1 after one ``error: ...`` line on stderr when it raised
    (what ``refit launch`` repeats as the rank's cause), or when rank 0's run ended
    unsolved."""
    return _program(join, learner, roles)


__all__ = ["Learner", "Sequence", "join", "main"]
