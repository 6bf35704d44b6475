"""A Python engine as a rank of a topology ``refit launch`` starts.

The rank is Refit's own, run through the binding: the rendezvous with rank 0's store, the
cluster token from the environment, keepalive both ways, exit when rank 0 is gone, restart
and rejoin, the rollout workers and evaluator of the rank's roles, the report. Only the
engine's model is Python: an :class:`Engine` whose methods Refit calls on two threads of
its own (one for the weights, one for the requests, so a stage overlaps a batch), never a
commit and a batch at once (unless the engine commits in flight:
:attr:`Engine.commits_in_flight`)::

    import refit.engine

    class MyEngine(refit.engine.Engine):
        name = "my engine"

        def stage(self, model, version, update):      # beside generation
            self.next = {k: v.to(torch.float32, copy=True) for k, v in update.torch(model)}

        def commit(self, model, version):              # the only pause
            self.weights = self.next

        def generate(self, requests):                  # one call per batch
            return [refit.engine.Completion(tokens=[...], logprobs=[...]) for r in requests]

    refit.engine.join(MyEngine(), roles="grpo")

An update goes: the version is pulled and checked whole (by Refit, beside generation), then
:meth:`Engine.stage` takes it into the engine's own form (still beside generation), then,
once the batch running ends, :meth:`Engine.commit` serves it (the pause the report shows),
then Refit acknowledges it to the trainer. A version ``stage`` or ``commit`` refuses
(raise) is not served: the engine keeps the one it has, and the controller handles the
failed load as it does any engine's (with ``commit = "all"`` the version is aborted
everywhere; with a quorum the engine is fenced from rollouts until a version loads whole).

A model with ``apply = "streaming"`` in the topology goes another way, for an engine that
must not hold the model twice: once the batch running ends, :meth:`Engine.load_streamed`
pulls the version and loads it tensor by tensor as its bytes are verified (the pause holds
the transfer), then Refit acknowledges it.

Importing this module answers ``refit launch``'s check at once (``refit-check: started``),
so a program may import heavy modules (torch) before :func:`join`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import Update, _native, _program, _streamed

# `refit launch` runs every rank program once as a check before it starts any, and waits a
# few seconds for it to say so: say it now, before the program imports torch
_native.check_started()


@dataclass
class Request:
    """One completion asked of the engine."""

    model: str
    #: The prompt's token ids.
    prompt: list[int]
    #: Tokens to generate at most.
    max_tokens: int
    #: Softmax temperature; ``0.0`` is greedy (the log-probability is then at temperature 1).
    temperature: float
    #: Seed of this request's sampling.
    seed: int
    #: A token that ends the completion when sampled (kept as its last token).
    stop: int | None
    #: The version of ``model`` served for this batch.
    served: int


@dataclass
class ScoreRequest:
    """The log-probabilities of ``tokens`` after ``prompt`` (teacher forcing)."""

    model: str
    prompt: list[int]
    tokens: list[int]
    temperature: float
    served: int


@dataclass
class Completion:
    """What the engine answers for one request."""

    #: The generated tokens (the prompt not included).
    tokens: list[int]
    #: The behaviour log-probability of each token: at the request's temperature, or at
    #: temperature 1 for a greedy request (temperature 0). Finite, at most 0.
    logprobs: list[float]
    #: The version that made each token (``None``: every token is the version served when
    #: the batch started; refused from an engine that commits in flight).
    versions: list[int] | None = None
    #: ``"length"`` (``max_tokens`` reached), ``"stop"`` (the stop token sampled) or
    #: ``"aborted"`` (:meth:`Engine.interrupt` ended it: the tokens made so far).
    finish: str = "length"


class Engine:
    """The model side of an engine rank: subclass it and override what your engine does."""

    #: A name for messages.
    name: str = "python engine"

    #: True when :meth:`commit` may be called while :meth:`generate` runs (under the
    #: topology's ``pause_mode = "keep"``, the default): the engine serves the version at
    #: its next step boundary, the running sequences going on under it, and labels each
    #: token it generates or scores with the version that made it
    #: (:attr:`Completion.versions`; an answer without versions is then refused). False: a
    #: commit waits for the running batch.
    commits_in_flight: bool = False

    def manifest(self, model: str, layout: list[tuple[str, str, list[int]]],
                 params: dict[str, Any]) -> list[tuple[str, str, list[int]]]:
        """The layout the engine loads for ``model``, as ``(name, dtype, shape)`` triples.
        ``layout`` is the one the rank's roles serve (what the trainer's link converts to)
        and ``params`` the model's ``[model.params]`` of the topology file. The default
        takes ``layout``; an engine that answers another one is refused before the run
        starts, naming the first tensor that differs."""
        return layout

    def stage(self, model: str, version: int, update: Update) -> None:
        """Takes ``version`` of ``model`` (checked whole) into the engine's own form, beside
        generation. ``update``'s arrays are read-only views of the received memory, valid
        while held; holding them keeps that memory (a shared-memory slot, an arena) from
        the next versions, so copy what the engine keeps. ``update.ack()`` does nothing:
        Refit acknowledges the version once :meth:`commit` served it. Raise to refuse the
        version (the served one stays)."""
        raise NotImplementedError

    def commit(self, model: str, version: int) -> float | None:
        """Serves the version :meth:`stage` took last: the pause. No batch runs meanwhile,
        unless :attr:`commits_in_flight`. An engine committed in flight may answer the
        seconds generation stopped for it (it first waits for a step boundary while tokens
        are still made: that wait is not the pause the report shows); otherwise, or with
        ``None``, the whole call is the pause. Any engine's answer is ``None`` or a number
        at least 0: another fails the commit, naming it."""
        raise NotImplementedError

    def load_streamed(self, model: str, version: int, stream: Callable[..., int]) -> None:
        """Serves ``version`` of ``model`` (or a newer one) for a model with
        ``apply = "streaming"`` in the topology, pulling it inside the call: no
        :meth:`stage` comes before it, and no batch runs during it (the whole call is the
        pause the report shows, the transfer included). It ends the model's
        :meth:`interrupt`, as :meth:`commit` does. Call ``stream(apply, torch=True,
        raw=False)`` once: it pulls the version and calls ``apply(name, tensor)`` with each
        tensor (a read-only torch tensor, or a numpy
        array with ``torch=False``) as soon as its bytes are verified, on this thread, and
        answers the version streamed. ``apply`` copies the tensor where the model serves
        it. The engine never holds a second copy of the model: over TCP, Refit holds a few
        buckets of it at a time.

        Raise to refuse the version. ``stream`` raises what failed (what ``apply`` raised,
        a timeout, the sender gone) as itself while nothing was applied (the model is as it
        was), and :class:`refit.errors.NeedsFullResend` once part of it was; a
        ``KeyboardInterrupt`` or ``SystemExit`` goes through as itself either way. So count
        what ``apply`` wrote: once it wrote anything, a failure leaves the model mixed
        (answer no request for it until a version loads whole; the controller fences the
        engine meanwhile). Not overridden in the engine's class, a model with
        ``apply = "streaming"`` is refused before the run starts."""
        raise NotImplementedError

    def abort(self, model: str) -> None:
        """Drops what :meth:`stage` took of ``model``, and ends its :meth:`interrupt`: the
        fleet did not commit it, its hold ran out, a newer load took its place, a commit
        named another version or failed, or the commit's wait for the running batch ran
        out."""

    def interrupt(self, model: str, version: int) -> None:
        """Under the topology's ``pause_mode = "abort"``, before ``version`` of ``model`` is
        committed: ends the :meth:`generate` call's sequences of ``model`` at the engine's
        next step boundary, each answered with the tokens made so far and
        ``finish = "aborted"`` (a rollout worker asks again, under the new version), so that
        the commit waits for a step, not for the batch (other models' sequences in the call
        still run to their end). It holds until the model's next :meth:`commit`,
        :meth:`load_streamed` or :meth:`abort`, one of which always follows it on the same
        thread (that of :meth:`stage`): the call running when it comes, or one that starts
        before that commit, ends; no call starts after the commit until the commit returns, and none
        after it is interrupted. Called whether or not a batch runs. The default does
        nothing: the commit waits for the batch, as under ``"wait"``."""

    def generate(self, requests: list[Request]) -> list[Completion | BaseException]:
        """One :class:`Completion` per request, in order (or the exception that request
        raised). Requests that arrive while a batch runs come in the next call."""
        raise NotImplementedError

    def score(self, requests: list[ScoreRequest]) -> list[Completion | BaseException]:
        """Scores (a KL reference): the default refuses."""
        raise NotImplementedError(f"{self.name} does not score")


class _Adapter:
    """What the binding calls: plain values in, plain values out."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # the layout each model's engine loads, as its manifest answered it
        self.layouts: dict[str, list] = {}

    def name(self) -> str:
        return str(getattr(self.engine, "name", type(self.engine).__name__))

    def commits_in_flight(self) -> bool:
        return bool(getattr(self.engine, "commits_in_flight", False))

    def streams(self) -> bool:
        # an engine that is no Engine streams when it has the method
        mine = getattr(type(self.engine), "load_streamed", None)
        return mine is not None and mine is not Engine.load_streamed

    def manifest(self, model: str, layout: list, params: str) -> list:
        triples = [(n, d, list(s)) for n, d, s in layout]
        answer = self.engine.manifest(model, triples, json.loads(params))
        out = [(str(n), str(d), [int(x) for x in s]) for n, d, s in answer]
        self.layouts[model] = out
        return out

    def load_streamed(self, model: str, version: int, native: Any) -> None:
        def layouts() -> list[tuple[str, list]]:
            return [(model, self.layouts[model])]  # the engine's manifest, asked before the run

        def stream(apply: Callable[[str, Any], None], torch: bool = True, raw: bool = False) -> int:
            return int(native.run(_streamed(apply, layouts, torch, raw)))
        self.engine.load_streamed(model, version, stream)

    def stage(self, native: Any) -> None:
        update = Update(native)
        (model, version), = update.entries
        self.engine.stage(model, version, update)

    def commit(self, model: str, version: int) -> float | None:
        return self.engine.commit(model, version)

    def abort(self, model: str) -> None:
        self.engine.abort(model)

    def interrupt(self, model: str, version: int) -> None:
        interrupt = getattr(self.engine, "interrupt", None)  # an engine that is no Engine may lack it
        if interrupt is not None:
            interrupt(model, version)

    def generate(self, requests: list, served: dict[str, int]) -> list:
        asked = [Request(m, list(p), n, t, s, stop, served.get(m, 0))
                 for m, p, n, t, s, stop in requests]
        return self._answers(self.engine.generate(asked))

    def score(self, requests: list, served: dict[str, int]) -> list:
        asked = [ScoreRequest(m, list(p), list(toks), t, served.get(m, 0))
                 for m, p, toks, t in requests]
        return self._answers(self.engine.score(asked))

    @staticmethod
    def _answers(answers: list) -> list:
        # one answer that does not convert fails alone; more answers than requests are
        # passed on, and refused by the engine
        out: list = []
        for a in list(answers):
            if isinstance(a, BaseException):
                out.append(f"{type(a).__name__}: {a}")
            elif isinstance(a, Completion):
                try:
                    versions = None if a.versions is None else [int(v) for v in a.versions]
                    out.append(([int(t) for t in a.tokens], [float(x) for x in a.logprobs],
                                 versions, str(a.finish)))
                except (TypeError, ValueError) as e:
                    out.append(f"TypeError: a Completion that does not convert: {e}")
            else:
                out.append(f"TypeError: the engine answered {type(a).__name__}, "
                           "not a refit.engine.Completion")
        return out


def join(engine: Engine, roles: str = "grpo") -> dict[str, Any] | None:
    """Runs this process as its rank of the topology ``refit launch`` started, its engine
    being ``engine`` and its other roles (rollout workers, evaluator) those of ``roles``
    (``"grpo"``: Refit's GRPO on digit reversal). Blocks until the run ends. Returns the
    run's report (``solved``, ``elapsed_s``) on rank 0, ``None`` on the others and when
    ``refit launch`` runs the program as a check.

    Raises :class:`refit.errors.ConfigError` for a topology, launch variable or layout
    that does not fit, and the rank's error otherwise (rank 0 gone, a timeout). From the
    run's start on, SIGINT and SIGTERM end the process through Refit's handlers (which
    release shared memory), as in any Refit rank; Python's own handling of them does not
    come back after the run."""
    return _native.join_engine(_Adapter(engine), roles)


#: The checks :func:`conformance` runs, in order.
CONFORMANCE_CHECKS: list[str] = list(_native.CONFORMANCE_CHECKS)


def conformance(engine: Engine, params: dict[str, Any] | None = None, model: str = "policy",
                apply: str = "staged") -> list[str]:
    """Runs the engine contract's conformance suite on ``engine``, in this process: Refit's
    own engine drives it as the controller does a rank's, through loads, a stage then its
    commit, an abort, a stage whose hold runs out, a commit of another version than the
    one staged, a fetch that times out, and cancellation epochs, checking after each what
    it serves. The versions are zeros in the engine's layout (:meth:`Engine.manifest`) of
    the ``"grpo"`` roles' model of ``params`` (a topology's ``[model.params]``): the suite
    checks what is served, not what is computed; ``model`` is the id it loads. An engine
    committed in flight (:attr:`Engine.commits_in_flight`) is committed so, as under a
    topology's default ``pause_mode = "keep"``. It calls :meth:`Engine.manifest` first,
    as a rank does: give it an engine that serves nothing yet. Blocks until it ends.

    ``apply``: how the model is taken in, as the topology key ``[[model]] apply`` says.
    Under ``"streaming"`` every version is pulled inside its commit and handed to
    :meth:`Engine.load_streamed` tensor by tensor (never staged), through the same checks:
    what the controller sees of the weight plane is the same.

    Returns the checks passed (:data:`CONFORMANCE_CHECKS`, all of them). Raises
    :class:`refit.errors.RefitError` naming the first check that fails (what was asked,
    what the engine answered), or what the engine raised; ``ConfigError`` for params or an
    ``apply`` that do not fit (``"streaming"`` for an engine without ``load_streamed``)."""
    return list(_native.engine_conformance(_Adapter(engine), model, json.dumps(params or {}), apply))


def main(engine: Engine, roles: str = "grpo") -> int:
    """:func:`join` as a rank program's body (``sys.exit(refit.engine.main(MyEngine()))``):
    0 when the run ends well; 1 after one ``error: ...`` line on stderr when it raised
    (what ``refit launch`` repeats as the rank's cause), or when rank 0's run ended
    unsolved."""
    return _program(join, engine, roles)


__all__ = ["CONFORMANCE_CHECKS", "Completion", "Engine", "Request", "ScoreRequest", "conformance", "join", "main"]
