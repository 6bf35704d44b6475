"""A vLLM engine as a rank of a topology ``refit launch`` starts: the controller drives an
in-process ``vllm.LLM`` through the engine contract of :mod:`refit.engine`.

The rank is Refit's (rendezvous, keepalive, restarts, its rollout workers, the report); the
model is vLLM's::

    import refit.engine                       # answers refit launch's check at once
    from refit.vllm_engine import VllmEngine, in_process_llm

    def build(model, layout, params):         # once per model, before the run
        return in_process_llm(model="/path/to/model", dtype="float32")

    refit.engine.join(VllmEngine(build), roles="grpo")

An update goes:

1. Refit pulls the version and checks it whole, beside generation;
2. :meth:`VllmEngine.stage` copies it into tensors of the model's dtype under the
   checkpoint's names (``checkpoint`` maps Refit's names to them), still beside generation;
3. :meth:`VllmEngine.commit` loads the staged tensors into the model through vLLM's
   layerwise reload (``load_weights``, as a checkpoint): the only pause. It checks that
   every parameter of the model was written, drops the prefix cache and labels vLLM's
   outputs with the version (``set_weight_version``).

A model with ``apply = "streaming"`` in the topology is not staged: once the running batch
ends (interrupted first under ``pause_mode = "abort"``), :meth:`VllmEngine.load_streamed`
pulls the version and loads each tensor through the layerwise reload as soon as its bytes
are verified, with the same checks. The pause holds the transfer; no buffer holds the
model a second time (over TCP, Refit holds a few buckets of it).

The engine commits in flight (:attr:`refit.engine.Engine.commits_in_flight`): under the
topology's ``pause_mode = "keep"`` (the default) a commit lands between two of vLLM's steps
while a batch runs, as vLLM's ``pause_generation(mode="keep")`` does: the running sequences
go on under the new weights (their KV entries recomputed with them, vLLM's cache being
cleared), so a sequence may carry two versions. Under ``"wait"`` a commit waits for the
running batch to end; under ``"abort"`` it first interrupts the batch
(:meth:`VllmEngine.interrupt`): at the next step its unfinished requests are aborted and
answered ``"aborted"`` with the tokens made so far, and the rollout workers ask again.
The engine drives vLLM's steps itself to do so (``LLMEngine.add_request`` / ``step``,
each step's new tokens taken as they come), with vLLM's asynchronous scheduling off, so
that each step's tokens are labelled with the weights that sampled them.

Each completion's per-token versions come from vLLM's ``weight_versions`` spans, so the
pool's staleness filter and the learner see the version that sampled each token.

vLLM must run its engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which
:func:`in_process_llm` sets) with one worker (no tensor parallelism), and report the
log-probabilities of the sampled distribution (``logprobs_mode="processed_logprobs"``): the
behaviour log-probability of a token at the request's temperature. Importing this module
imports neither vLLM nor torch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import refit.engine
import refit.errors
from refit.engine import Completion, Request

from .vllm import _expected_params, _not_loaded, _reset_caches

_log = logging.getLogger(__name__)

#: ``(name, tensor)`` → the checkpoint tensors ``load_weights`` takes for it.
Checkpoint = Callable[[str, Any], Iterable[tuple[str, Any]]]


def in_process_llm(**kwargs: Any) -> Any:
    """A ``vllm.LLM`` that :class:`VllmEngine` can drive: its engine in this process, the
    sampled distribution's log-probabilities, token ids in and out (no tokenizer needed).
    ``kwargs`` go to ``LLM`` and override those defaults (``skip_tokenizer_init=True``,
    ``logprobs_mode="processed_logprobs"``, ``enforce_eager=True``, ``async_scheduling=False``:
    with it on, the tokens of the step in flight at a commit are labelled with the new
    version)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    args = {"skip_tokenizer_init": True, "logprobs_mode": "processed_logprobs", "enforce_eager": True,
            "async_scheduling": False}
    args.update(kwargs)
    return LLM(**args)


def _load(worker: Any, pairs: list[tuple[str, Any]], expected: list[tuple[str, ...]]) -> list[str]:
    """In vLLM's worker: ``pairs`` loaded as a checkpoint through the layerwise reload;
    answers the parameters (first names) no pair wrote."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model = worker.model_runner.model
    initialize_layerwise_reload(model)
    try:
        loaded = model.load_weights(iter(pairs))
    finally:
        # also after a failure: layers that got nothing are given their tensors back
        finalize_layerwise_reload(model, worker.model_runner.model_config)
    return _not_loaded(expected, set(loaded or ()))


def _load_stream(worker: Any, stream: Callable[[Callable[[list], None]], int],
                 expected: list[tuple[str, ...]], touched: list[bool]) -> tuple[int, list[str]]:
    """In vLLM's worker (in this process): the layerwise reload begun, ``stream`` called
    with a function that loads each checkpoint-format list of pairs as it comes, the reload
    completed; answers the version streamed and the parameters (first names) no pair wrote.
    ``touched`` is set once a pair went to ``load_weights`` (the model may be mixed from
    then on, whatever is raised)."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model = worker.model_runner.model
    loaded: set[str] = set()

    def load(pairs: list) -> None:
        touched[0] = True
        loaded.update(model.load_weights(iter(pairs)) or ())

    initialize_layerwise_reload(model)
    try:
        version = stream(load)
    finally:
        # also after a failure: layers that got nothing are given their tensors back
        finalize_layerwise_reload(model, worker.model_runner.model_config)
    return version, _not_loaded(expected, loaded)


def _expected(worker: Any) -> list[tuple[str, ...]]:
    """In vLLM's worker: the parameters a whole version must write."""
    return _expected_params(worker.model_runner.model, worker.model_runner.model_config)


def _check_finite(t: Any, name: str, version: str, dtype: Any) -> None:
    """Raises ``ValueError`` when tensor ``t`` (``name`` of the version ``version`` says,
    in the model's ``dtype``) holds a value that is not finite."""
    import torch

    # a sum is finite when every value is (5x cheaper than isfinite per value); one that is
    # not may be an overflow of finite values: then each is looked at
    if t.is_floating_point() and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
        raise ValueError(f"tensor `{name}` of {version} holds a value that is not finite "
                         f"(in the model's dtype, {dtype})")


def token_versions(spans: Any, tokens: int) -> list[int] | None:
    """Each token's version from vLLM's ``weight_versions`` spans (labels ``str(version)``,
    contiguous from token 0); ``None`` when vLLM gave none.

    Raises ``ValueError`` for spans that are not contiguous over the tokens or a label that
    is not a Refit version (weights vLLM loaded from disk are labelled ``default``)."""
    if spans is None:
        return None
    versions: list[int] = []
    for span in spans:
        if span.start != len(versions) or span.end < span.start:
            raise ValueError(f"vLLM's weight_versions spans are not contiguous at token {len(versions)}: {spans}")
        try:
            v = int(span.version)
        except ValueError:
            v = 0
        if v < 1:
            raise ValueError(f"tokens {span.start}..{span.end} were sampled by weights labelled "
                             f"`{span.version}`, not a Refit version")
        versions.extend([v] * (span.end - span.start))
    if len(versions) != tokens:
        raise ValueError(f"vLLM's weight_versions spans cover {len(versions)} of {tokens} tokens")
    return versions


class VllmEngine(refit.engine.Engine):
    """An engine rank whose model is an in-process ``vllm.LLM`` per model.

    ``llm``: the ``LLM`` (for a topology of one model), or ``build(model, layout, params)``
    answering one per model (called before the run, and in ``refit launch``'s check, so a
    model vLLM cannot build fails the check). ``checkpoint(name, tensor)``: the checkpoint
    tensors (name, tensor) vLLM's ``load_weights`` takes for a tensor of the roles' layout;
    by default the tensor under its own name (a trainer that publishes Hugging Face names).
    """

    name = "vllm"
    commits_in_flight = True
    #: How long a commit waits for the step vLLM is running to end.
    step_deadline_s: float = 60.0

    def __init__(self, llm: Any, checkpoint: Checkpoint | None = None) -> None:
        self._build = llm if callable(llm) else None  # an LLM is not callable
        self._given = None if self._build is not None else llm
        self._checkpoint = checkpoint or (lambda name, t: [(name, t)])
        self._llms: dict[str, Any] = {}
        self._expected: dict[str, list[tuple[str, ...]]] = {}
        self._staged: dict[str, tuple[int, list[tuple[str, Any]]]] = {}
        # each model's staging tensors, by checkpoint name, reused from version to version
        self._buffers: dict[str, dict[str, Any]] = {}
        # models whose last load failed part-way: they serve mixed weights until a version
        # loads whole, and generate nothing meanwhile
        self._mixed: dict[str, str] = {}
        # who drives vLLM now: the requests' step loop (one step at a time) or a commit;
        # a commit waiting goes before the loop's next step
        self._turn = threading.Condition()
        self._driving = False
        self._commits_waiting = 0
        self._ids = itertools.count()
        # the version each model serves (what its scores are labelled with)
        self._versions: dict[str, int] = {}
        # the version whose interrupt ends each model's batch, until the model's next commit
        # or abort (under the turn's lock)
        self._interrupts: dict[str, int] = {}

    # -- the weights ---------------------------------------------------------------------

    def manifest(self, model: str, layout: list, params: dict[str, Any]) -> list:
        if self._build is not None:
            llm = self._build(model, layout, params)
        elif self._llms:
            raise ValueError(f"one vLLM LLM was given, for `{next(iter(self._llms))}`: "
                             f"give `build(model, layout, params)` to serve `{model}` too")
        else:
            llm = self._given
        workers = llm.llm_engine.vllm_config.parallel_config.world_size
        if workers != 1:
            raise ValueError(f"model `{model}`: vLLM runs {workers} workers (tensor or pipeline parallel): "
                             "this engine loads through one, in this process")
        client = type(llm.llm_engine.engine_core).__name__
        if client != "InprocClient":
            raise ValueError(f"model `{model}`: vLLM runs its engine in another process ({client}): "
                             "build the LLM with refit.vllm_engine.in_process_llm "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        if getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", False):
            raise ValueError(f"model `{model}`: vLLM schedules asynchronously: the tokens of the step in flight "
                             "at a commit would be labelled with the new version "
                             "(LLM(..., async_scheduling=False), as in_process_llm builds it)")
        mode = getattr(llm.llm_engine.model_config, "logprobs_mode", "processed_logprobs")
        if str(getattr(mode, "value", mode)) != "processed_logprobs":
            raise ValueError(f"model `{model}`: vLLM reports `{mode}` log-probabilities: the behaviour "
                             "log-probability is the sampled distribution's "
                             "(LLM(..., logprobs_mode=\"processed_logprobs\"))")
        (expected,) = llm.collective_rpc(_expected)
        self._llms[model], self._expected[model] = llm, expected
        return layout

    def stage(self, model: str, version: int, update: refit.Update) -> None:
        llm = self._llm(model)
        dtype = llm.llm_engine.model_config.dtype
        import torch

        # what was staged is replaced (a failure below leaves nothing staged); the buffers
        # are the model's from one version to the next: the commit copied them into vLLM
        self._staged.pop(model, None)
        buffers = self._buffers.setdefault(model, {})
        staged: list[tuple[str, Any]] = []
        for name, tensor in update.torch(model):
            for key, t in self._checkpoint(name, tensor):
                buf = buffers.get(key)
                if buf is None or buf.shape != t.shape or buf.dtype != dtype:
                    buf = buffers[key] = torch.empty_like(t, dtype=dtype)
                buf.copy_(t)
                _check_finite(buf, name, f"v{version}", dtype)
                staged.append((key, buf))
        self._staged[model] = (version, staged)

    def commit(self, model: str, version: int) -> float:
        """Serves the staged ``version``: between two of vLLM's steps when a batch runs (its
        sequences go on under it), at once otherwise. Answers the seconds no step ran
        (the load and the cache reset; the wait for the running step is not a pause, nor,
        with several models, the wait behind another model's commit, though no step runs
        then either: that one is reported by the other model).
        Raises ``TimeoutError`` when vLLM's running step does not end within
        :attr:`step_deadline_s` (the staged version is not served)."""
        with self._loading(model, version):
            loading = time.perf_counter()
            self._commit(model, version)
            return time.perf_counter() - loading

    def load_streamed(self, model: str, version: int, stream: Any) -> None:
        """Serves ``version`` (or a newer one) of a model with ``apply = "streaming"``
        (Refit calls it once the running batch ended): the version is pulled and each
        tensor goes through vLLM's layerwise reload as soon as its bytes are verified, in
        the model's dtype; no staging buffer holds the model a second time. A failure once
        a tensor went to vLLM leaves it serving mixed weights: the model answers no request
        until a version loads whole. Raises ``TimeoutError`` as :meth:`commit`."""
        with self._loading(model, version):
            self._load_streamed(model, version, stream)

    @contextlib.contextmanager
    def _loading(self, model: str, version: int) -> Iterator[None]:
        """Holds vLLM between two of its steps (a commit waiting goes before the step
        loop's next step) for a load of ``version`` of ``model``."""
        with self._turn:
            self._commits_waiting += 1
            try:
                turned = self._turn.wait_for(lambda: not self._driving, timeout=self.step_deadline_s)
            finally:
                self._commits_waiting -= 1
            if not turned:
                raise TimeoutError(f"v{version} of `{model}` waited {self.step_deadline_s} s for vLLM's "
                                   "running step to end")
            self._driving = True
        try:
            yield
        finally:
            with self._turn:
                self._driving = False
                self._interrupts.pop(model, None)  # spent: the batches after are not ended
                self._turn.notify_all()

    def _load_streamed(self, model: str, version: int, stream: Any) -> None:
        llm = self._llm(model)
        dtype = llm.llm_engine.model_config.dtype

        def pairs(name: str, tensor: Any) -> list[tuple[str, Any]]:
            out = []
            for key, t in self._checkpoint(name, tensor):
                t = t.to(dtype)
                # the stream may carry a newer version than the one asked (or an older one
                # that came whole first): the message cannot name it
                _check_finite(t, name, f"the version streaming (v{version} asked)", dtype)
                out.append((key, t))
            return out

        def in_worker(load: Callable[[list], None]) -> int:
            return stream(lambda name, tensor: load(pairs(name, tensor)), torch=True)

        touched = [False]
        try:
            (streamed, missing), = llm.collective_rpc(
                _load_stream, kwargs={"stream": in_worker, "expected": self._expected[model], "touched": touched})
        except BaseException as e:
            if touched[0] or isinstance(e, refit.errors.NeedsFullResend):
                self._mixed[model] = f"v{version} or newer failed to load part-way ({type(e).__name__}: {e})"
            raise
        self._served_whole(llm, model, int(streamed), missing)

    def _commit(self, model: str, version: int) -> None:
        staged = self._staged.pop(model, None)
        if staged is None or staged[0] != version:
            raise RuntimeError(f"v{version} of `{model}` is not the version staged "
                               f"({'none' if staged is None else f'v{staged[0]}'})")
        llm = self._llm(model)
        try:
            (missing,) = llm.collective_rpc(_load, kwargs={"pairs": staged[1], "expected": self._expected[model]})
        except Exception as e:
            self._mixed[model] = f"v{version} failed to load part-way ({type(e).__name__}: {e})"
            raise RuntimeError(f"loading v{version} of `{model}` into vLLM failed: {e}; "
                               "it serves mixed weights until a version loads whole") from e
        self._served_whole(llm, model, version, missing)

    def _served_whole(self, llm: Any, model: str, version: int, missing: list[str]) -> None:
        """After ``version`` of ``model`` loaded into ``llm``: refused when it left
        parameters ``missing``, else served (vLLM's caches of the previous weights dropped,
        its version label set)."""
        if missing:
            self._mixed[model] = f"v{version} left {len(missing)} parameter(s) unwritten"
            named = ", ".join(f"`{n}`" for n in missing[:5])
            raise RuntimeError(f"v{version} of `{model}` wrote no tensor into {len(missing)} parameter(s) of "
                               f"vLLM's model ({named}): the checkpoint names do not cover the model")
        self._mixed.pop(model, None)
        # the KV entries of the prefix cache (and encoder outputs) came from the previous
        # weights; sequences running go back to vLLM's queue and are recomputed under these
        if not _reset_caches(llm, running=llm.llm_engine.has_unfinished_requests()):
            self._mixed[model] = f"v{version} loaded, but vLLM kept KV entries of the previous weights"
            raise RuntimeError(f"v{version} of `{model}` loaded, but vLLM did not drop its prefix cache")
        llm.llm_engine.set_weight_version(str(version))
        self._versions[model] = version

    def abort(self, model: str) -> None:
        # stage, commit and abort come one after another on the rank's weights thread, an
        # abort before the next stage: what is staged now is the version aborted
        self._staged.pop(model, None)
        self._interrupt_spent(model)

    def _llm(self, model: str) -> Any:
        try:
            return self._llms[model]
        except KeyError:
            raise KeyError(f"this vLLM engine serves no model `{model}`") from None

    # -- the requests --------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> list[Completion | BaseException]:
        out: list[Completion | BaseException | None] = [None] * len(requests)
        by_model: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            by_model.setdefault(r.model, []).append(i)
        for model, idx in by_model.items():
            try:
                answers = self._generate(model, [requests[i] for i in idx])
            except Exception as e:  # the model's batch fails as a whole
                answers = [e] * len(idx)
            for i, a in zip(idx, answers):
                out[i] = a
        return out  # type: ignore[return-value]

    def _generate(self, model: str, requests: list[Request]) -> list[Completion | BaseException]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self._llm(model)
        if model in self._mixed:
            raise RuntimeError(f"`{model}` serves mixed weights ({self._mixed[model]}): "
                               "no completion until a version loads whole")
        answers: list[Completion | BaseException | None] = [None] * len(requests)
        prompts, params, where = [], [], []
        config = llm.llm_engine.model_config
        context, vocab = config.max_model_len, config.get_vocab_size()
        for i, r in enumerate(requests):
            # what vLLM would refuse for the whole call fails the request alone
            if not r.prompt or len(r.prompt) + r.max_tokens > context:
                answers[i] = ValueError(f"a prompt of {len(r.prompt)} tokens and {r.max_tokens} more do not fit "
                                        f"`{model}`'s context of {context}")
                continue
            if any(t < 0 or t >= vocab for t in r.prompt):
                answers[i] = ValueError(f"a prompt token is outside `{model}`'s vocabulary of {vocab}")
                continue
            try:
                params.append(SamplingParams(
                    max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed, logprobs=0,
                    stop_token_ids=[] if r.stop is None else [r.stop], ignore_eos=True, detokenize=False))
            except Exception as e:  # a request vLLM refuses fails alone
                answers[i] = e
                continue
            prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt)))
            where.append(i)
        if prompts:
            for i, o in zip(where, self._run(model, prompts, params)):
                try:
                    answers[i] = self._completion(o)
                except Exception as e:
                    answers[i] = e
        return answers  # type: ignore[return-value]

    def _take_turn(self) -> None:
        with self._turn:  # a commit waiting goes first
            self._turn.wait_for(lambda: not self._driving and not self._commits_waiting)
            self._driving = True

    def _give_turn(self) -> None:
        with self._turn:
            self._driving = False
            self._turn.notify_all()

    def _run(self, model: str, prompts: list, params: list, held: bool = False) -> list[_Sequence]:
        """The sequences of ``prompts``, in order: the requests added and stepped to their
        end one step at a time, a commit waiting taking its turn between two steps (none
        when the caller ``held`` the turn for the whole run: a score is of one version), each
        step's tokens labelled with the version that made them. An :meth:`interrupt` of the
        model ends the run at the next step boundary (not a ``held`` one): the requests not
        finished are aborted, answered with the tokens made so far. A commit that leaves the
        model's weights mixed ends the batch (its requests aborted). One thread at a time
        runs requests (the rank's requests thread): the engine's other requests are this
        call's."""
        from vllm.sampling_params import RequestOutputKind

        engine = self._llm(model).llm_engine
        ids = [f"refit-{next(self._ids)}" for _ in prompts]
        seqs = {rid: _Sequence() for rid in ids}
        finished = 0
        added: list[str] = []
        try:
            while finished < len(ids):
                if not held:
                    self._take_turn()
                try:
                    if model in self._mixed:
                        raise RuntimeError(f"`{model}` serves mixed weights ({self._mixed[model]}): "
                                           "the batch is ended")
                    by = None if held else self._interrupts.get(model)
                    if by is not None:
                        left = [rid for rid in added if seqs[rid].final is None]
                        if left:
                            engine.abort_request(left)
                        for rid in ids:
                            if seqs[rid].final is None:
                                seqs[rid].aborted_by = by
                        break
                    if not added:
                        for rid, prompt, p in zip(ids, prompts, params):
                            # each step's new tokens, labelled with the version that made them
                            # (a held run, a score, is one version: its final output alone)
                            p.output_kind = RequestOutputKind.FINAL_ONLY if held else RequestOutputKind.DELTA
                            engine.add_request(rid, prompt, p)
                            added.append(rid)
                    elif not engine.has_unfinished_requests():
                        raise RuntimeError(f"vLLM finished {finished} of {len(ids)} requests")
                    else:
                        version = self._versions.get(model, 0)
                        for o in engine.step():
                            seq = seqs.get(o.request_id)
                            if seq is not None:
                                finished += seq.add(o, version)
                finally:
                    if not held:
                        self._give_turn()
        except BaseException:
            left = [rid for rid in added if seqs[rid].final is None]
            if left:
                with self._turn:
                    self._turn.wait_for(lambda: held or not self._driving)
                    try:
                        engine.abort_request(left)
                    except Exception as e:  # the original error is the one to report
                        _log.warning("aborting %d requests of `%s` failed: %s", len(left), model, e)
            raise
        return [seqs[rid] for rid in ids]

    def interrupt(self, model: str, version: int) -> None:
        """Under ``pause_mode = "abort"``: the batch of ``model`` ends at vLLM's next step
        boundary, its unfinished requests aborted and answered ``"aborted"`` with the tokens
        made so far, until the model's next :meth:`commit` or :meth:`abort`."""
        with self._turn:
            self._interrupts[model] = version

    def _interrupt_spent(self, model: str) -> None:
        with self._turn:
            self._interrupts.pop(model, None)

    def score(self, requests: list[refit.engine.ScoreRequest]) -> list[Completion | BaseException]:
        """The log-probability of each of ``tokens`` after ``prompt`` and the tokens before
        it, from vLLM's prompt log-probabilities: at temperature 1 only (vLLM does not apply
        a temperature to them), another is refused."""
        out: list[Completion | BaseException] = []
        for r in requests:
            try:
                out.append(self._score(r))
            except Exception as e:  # one request fails alone
                out.append(e)
        return out

    def _score(self, r: refit.engine.ScoreRequest) -> Completion:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if r.temperature != 1.0:
            raise ValueError(f"vLLM scores at temperature 1 only, asked {r.temperature}")
        if not r.prompt or not r.tokens:
            raise ValueError("a score needs a prompt and at least one token")
        if r.model in self._mixed:
            raise RuntimeError(f"`{r.model}` serves mixed weights ({self._mixed[r.model]})")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        # scored whole under one version (the turn held: no commit lands inside), labelled with it
        self._take_turn()
        try:
            version = self._versions.get(r.model, 0)
            if version < 1:
                raise RuntimeError(f"`{r.model}` serves no version yet")
            (seq,) = self._run(r.model, [TokensPrompt(prompt_token_ids=list(r.prompt) + list(r.tokens))], [params],
                               held=True)
        finally:
            self._give_turn()
        steps = seq.final.prompt_logprobs[len(r.prompt):]
        logprobs = [float(step[t].logprob) for step, t in zip(steps, r.tokens)]
        return Completion(tokens=list(r.tokens), logprobs=logprobs, versions=[version] * len(r.tokens))

    @staticmethod
    def _completion(seq: _Sequence) -> Completion:
        tokens = seq.tokens
        if len(seq.logprobs) != len(tokens):
            raise ValueError(f"vLLM gave {len(seq.logprobs)} logprobs for {len(tokens)} tokens")
        logprobs = []
        for step, token in zip(seq.logprobs, tokens):
            lp = float(step[token].logprob)
            if not math.isfinite(lp):  # -inf: a token the sampled distribution excluded
                raise ValueError(f"vLLM gave token {token} a log-probability of {lp}")
            logprobs.append(lp)
        if seq.aborted_by is not None:
            # no spans for a request vLLM did not finish: each step's own label
            return Completion(tokens=tokens, logprobs=logprobs, versions=seq.versions, finish="aborted")
        c = seq.final.outputs[0]
        if c.finish_reason not in ("stop", "length"):
            raise ValueError(f"vLLM ended the completion with `{c.finish_reason}`, neither stop nor length")
        return Completion(tokens=tokens, logprobs=logprobs,
                          versions=token_versions(c.weight_versions, len(tokens)), finish=str(c.finish_reason))


class _Sequence:
    """One request's tokens as vLLM's steps give them (``DELTA`` outputs): the tokens, each
    one's log-probabilities and the version served at its step; its final output once
    vLLM finished it, or the version whose interrupt aborted it."""

    __slots__ = ("aborted_by", "final", "logprobs", "tokens", "versions")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[Any] = []
        self.versions: list[int] = []
        self.final: Any = None
        self.aborted_by: int | None = None

    def add(self, output: Any, version: int) -> bool:
        """Takes one step's output, made by ``version``: true when it finished the request."""
        c = output.outputs[0]
        new = [int(t) for t in c.token_ids]
        self.tokens.extend(new)
        self.logprobs.extend(c.logprobs or ())
        self.versions.extend([version] * len(new))
        if output.finished:
            self.final = output
        return bool(output.finished)


__all__ = ["Checkpoint", "VllmEngine", "in_process_llm", "token_versions"]
