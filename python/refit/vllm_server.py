"""A ``vllm serve`` as an engine rank of a topology ``refit launch`` starts: the controller
drives vLLM's OpenAI server over HTTP through the engine contract of :mod:`refit.engine`.

The rank is Refit's (rendezvous, keepalive, restarts, its rollout workers, the report); the
model is a ``vllm serve`` the rank starts (:func:`start_server`) or one already running::

    import refit.engine                       # answers refit launch's check at once
    from refit.vllm_server import VllmServerEngine, start_server

    def build(model, layout, params):         # once per model, before the run
        return start_server("/path/to/model", dtype="float32", load_format="dummy")

    refit.engine.join(VllmServerEngine(build), roles="grpo")

An update goes:

1. Refit pulls the version and checks it whole, beside generation;
2. :meth:`VllmServerEngine.stage` publishes it under the checkpoint's names to a Refit
   sender of this rank over shared memory, still beside generation (the server's workers
   were connected to that sender through the ``refit`` weight-transfer backend at the
   first version);
3. :meth:`VllmServerEngine.commit` pauses vLLM (``POST /pause``, vLLM's
   ``pause_generation``), has its workers load the staged version
   (``/start_weight_update``, ``/update_weights``: a copy out of shared memory and the
   load; ``/finish_weight_update`` labels what the weights make with the version), drops
   the KV entries the previous weights computed, and resumes (``POST /resume``): the pause.

Under the topology's ``pause_mode = "keep"`` (the default) the pause is vLLM's
``mode="keep"``: the running sequences are held where they are, and go on under the new
weights (their KV entries recomputed), so a sequence may carry two versions; under
``"abort"`` Refit first interrupts the batch (:meth:`VllmServerEngine.interrupt`, vLLM's
``/abort_requests``): its requests end at once, answered ``"aborted"`` with the tokens made
so far, and the pause is vLLM's ``mode="abort"``. Each completion's per-token versions come
from vLLM's ``weight_versions`` spans.

Requests go to vLLM's tokens-in, tokens-out route (``/inference/v1/generate``), one HTTP
request per completion, all of a batch at once (vLLM batches them). A server this module
does not start must have been started with what :func:`server_command` gives it: the
development routes (``VLLM_SERVER_DEV_MODE=1``), the ``refit`` weight-transfer backend, the
tokens route (``--tokens-only``), no tokenizer, and the sampled distribution's
log-probabilities (``--logprobs-mode processed_logprobs``). Importing this module imports
neither vLLM nor torch.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import refit
import refit.engine
import refit.errors
import refit.vllm
from refit.engine import Completion, Request

from .vllm_engine import Checkpoint, _check_finite, token_versions

_log = logging.getLogger(__name__)


def server_command(model: str | os.PathLike, port: int, *, host: str = "127.0.0.1",
                   python: str | None = None, **options: Any) -> list[str]:
    """The ``vllm serve`` command line a :class:`VllmServerEngine` drives: ``model`` (a
    Hugging Face model folder) on ``host:port`` with the ``refit`` weight-transfer backend,
    vLLM's tokens route and no tokenizer (token ids in, token ids out), and the sampled
    distribution's log-probabilities, with vLLM's asynchronous scheduling off (so that the
    step running when vLLM pauses is not labelled with the version loaded during the
    pause). ``options`` add or override vLLM's own (``dtype="float32"`` is ``--dtype
    float32``; ``True`` a bare flag, ``False`` its negation ``--no-...`` for the flags vLLM
    has one of, ``None`` none). It runs the server through its module (the CPU wheel's
    ``vllm`` command looks for a package called ``vllm``); the environment needs
    ``VLLM_SERVER_DEV_MODE=1`` (:func:`start_server` sets it)."""
    flags: dict[str, Any] = {
        "weight_transfer_config": json.dumps({"backend": refit.vllm.BACKEND}),
        "tokens_only": True,
        "skip_tokenizer_init": True,
        "logprobs_mode": "processed_logprobs",
        "async_scheduling": False,
        **options,
    }
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", os.fspath(model),
           "--host", host, "--port", str(port)]
    for key, value in flags.items():
        flag = key.replace("_", "-")
        if value is None:
            continue
        if value is False:
            cmd.append(f"--no-{flag}")
        elif value is True:
            cmd.append(f"--{flag}")
        else:
            cmd += [f"--{flag}", str(value)]
    return cmd


#: Run as ``python -c WATCH PARENT CMD...``: starts the server in a session of its own and
#: ends it (the whole session: the API server and its engine core) when the rank that
#: started it is gone, or on SIGTERM; exits with the server's status.
_WATCH = """
import os, signal, subprocess, sys, time
parent = int(sys.argv[1])
server = subprocess.Popen(sys.argv[2:], start_new_session=True)
# a Ctrl-C or hang-up of the rank's terminal reaches this process too: the server goes when
# the rank does, by the loop below (set after the start: the server keeps its own handlers)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
def session():
    # the server's processes (its session: the API server, its engine core and workers)
    # and the shared memory they map (vLLM's CPU build leaves its tensor-parallel segments
    # behind when it ends)
    pids, segments = [], set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[3]) != server.pid:
                    continue
            pids.append(int(pid))
            with open(f"/proc/{pid}/maps") as f:
                segments.update(l.split(None, 5)[5].strip() for l in f if "/dev/shm/vllm_" in l)
        except (OSError, ValueError, IndexError):
            pass
    return pids, segments
def end(*_):
    pids, segments = session()
    # the API server first, which ends its engine core and workers; whatever of its
    # session is left after 20 s is killed
    server.terminate()
    try:
        server.wait(20)
    except subprocess.TimeoutExpired:
        pass
    for pid in pids + session()[0]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for path in segments:
        try:
            os.unlink(path)
        except OSError:
            pass
    code = server.wait()
    sys.exit(code if code >= 0 else 128 - code)
signal.signal(signal.SIGTERM, end)
while server.poll() is None:
    if os.getppid() != parent:
        end()
    time.sleep(0.5)
end()
"""


class ServerProcess:
    """A ``vllm serve`` this process started (:func:`start_server`): its :attr:`url`, its
    log, and :meth:`close`. It ends with this process, whatever ends it: a watcher process
    between the two sees this process gone within half a second (``kill -9`` included),
    gives vLLM 20 s to shut down, then kills what is left of it and removes the shared
    memory vLLM leaves behind."""

    def __init__(self, cmd: Sequence[str], url: str, log: Path, env: dict[str, str]) -> None:
        self.url = url
        self.log = log
        self._out = open(log, "ab")
        self._proc = subprocess.Popen([sys.executable, "-c", _WATCH, str(os.getpid()), *cmd], env=env,
                                      stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_healthy(self, deadline_s: float) -> float:
        """Waits for ``GET /health`` to answer; answers the seconds it took. Raises
        ``RuntimeError`` with the end of the server's log when it exits first or does not
        answer within ``deadline_s``."""
        start = time.monotonic()
        while True:
            if self._proc.poll() is not None:
                self.close()
                raise RuntimeError(f"vllm serve exited with status {self._proc.returncode} before it served "
                                   f"({self.log}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return time.monotonic() - start
            except OSError:
                pass
            if time.monotonic() - start > deadline_s:
                self.close()
                raise RuntimeError(f"vllm serve did not answer {self.url}/health within {deadline_s:g} s "
                                   f"({self.log}):\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, chars: int = 4000) -> str:
        """The end of the server's log."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(its log cannot be read: {e})"

    def close(self) -> None:
        """Ends the server: vLLM's own shutdown, what is left of it killed after 20 s."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)  # the watcher ends the server, then itself
            try:
                self._proc.wait(40)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._out.close()

    def __repr__(self) -> str:
        return f"ServerProcess({self.url!r})"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_server(model: str | os.PathLike, *, port: int | None = None, host: str = "127.0.0.1",
                 deadline_s: float = 600.0, log: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, **options: Any) -> ServerProcess:
    """Starts ``vllm serve`` for ``model`` (:func:`server_command`, ``options`` being vLLM's
    own) on a free port of ``host`` (or ``port``) and waits until it serves. Its output goes
    to ``log`` (a file in a fresh temporary folder by default). ``env`` is added to this
    process's environment.

    Raises ``RuntimeError`` with the end of the server's log when it exits before it serves
    or does not within ``deadline_s``, or when another server answers at its port."""
    path = Path(log) if log is not None else Path(tempfile.mkdtemp(prefix="refit-vllm-serve-")) / "vllm-serve.log"
    for attempt in range(3):
        # a free port may be taken by another process before the server binds it: then
        # (the server gone, or another one answering there) once more on another port
        at = _free_port(host) if port is None else port
        cmd = server_command(model, at, host=host, **options)
        server = ServerProcess(cmd, f"http://{host}:{at}", path,
                               {**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1"})
        try:
            took = server.wait_healthy(deadline_s)
        except RuntimeError:
            if port is None and attempt < 2 and "address already in use" in server.tail().lower():
                continue
            raise
        if os.fspath(model) in _models(server.url):
            _log.info("vllm serve for %s answers at %s (%.0f s)", model, server.url, took)
            return server
        server.close()
        if port is not None or attempt == 2:
            break
    raise RuntimeError(f"another server than the vllm serve of {model} answers at {server.url}")


def _models(url: str) -> list[str]:
    """The models the server at ``url`` serves (``GET /v1/models``; none when it does not
    answer as vLLM does)."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            return [str(m.get("id")) for m in json.load(r).get("data", [])]
    except (OSError, ValueError, AttributeError):
        return []


class _Served:
    """What the engine holds of one model: its server, the sender its workers pull from,
    the version staged."""

    def __init__(self, server: refit.vllm.Server, process: ServerProcess | None, layout: list) -> None:
        self.server = server
        self.process = process
        # the roles' layout of the model (what its versions hold)
        self.layout = layout
        self.sender: refit.Sender | None = None
        # the sender's version of each version staged: (Refit's version, the sender's)
        self.staged: tuple[int, int] | None = None
        # why the model serves mixed weights (a load failed part-way), until one loads whole
        self.mixed: str | None = None
        # the version whose interrupt ends the model's requests, until its next commit or abort
        self.interrupt: int | None = None


#: What ``build(model, layout, params)`` may answer: a server this process started, a URL,
#: or a :class:`refit.vllm.Server`.
Built = ServerProcess | str | refit.vllm.Server


class VllmServerEngine(refit.engine.Engine):
    """An engine rank whose model is a ``vllm serve`` per model, driven over HTTP.

    ``server``: the server's URL, a :class:`ServerProcess` or a :class:`refit.vllm.Server`
    (for a topology of one model), or ``build(model, layout, params)`` answering one per
    model (called before the run, and in ``refit launch``'s check). ``checkpoint(name,
    tensor)``: the checkpoint tensors vLLM's ``load_weights`` takes for a tensor of the
    roles' layout, as for :class:`refit.vllm_engine.VllmEngine`. ``transport``: how this
    rank hands each staged version to the server's workers (``"shm"``: the server runs on
    this host). ``request_timeout``: how long one completion may take.
    """

    name = "vllm serve"
    commits_in_flight = True
    #: How long the server's workers wait for a staged version (it is staged already).
    load_timeout_s: float = 60.0

    def __init__(self, server: Built | Callable[[str, list, dict[str, Any]], Built],
                 checkpoint: Checkpoint | None = None, *, transport: str = "shm",
                 request_timeout: float = 600.0, max_requests: int = 256) -> None:
        self._build = server if callable(server) and not isinstance(server, refit.vllm.Server) else None
        self._given = None if self._build is not None else server
        self._checkpoint = checkpoint or (lambda name, t: [(name, t)])
        self._transport = transport
        self._request_timeout = request_timeout
        self._models: dict[str, _Served] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_requests,
                                                           thread_name_prefix="refit-vllm-serve")

    # -- the weights ---------------------------------------------------------------------

    def manifest(self, model: str, layout: list, params: dict[str, Any]) -> list:
        if self._build is not None:
            built = self._build(model, layout, params)
        elif self._models:
            raise ValueError(f"one vLLM server was given, for `{next(iter(self._models))}`: "
                             f"give `build(model, layout, params)` to serve `{model}` too")
        else:
            built = self._given
        process = built if isinstance(built, ServerProcess) else None
        server = built if isinstance(built, refit.vllm.Server) else refit.vllm.Server(
            built.url if process is not None else str(built))
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=10):
                pass
        except OSError as e:
            raise ValueError(f"model `{model}`: no vLLM server answers at {server.url}: {e}") from e
        self._models[model] = _Served(server, process, layout)
        return layout

    def _connect(self, model: str, served: _Served) -> refit.Sender:
        """This rank's sender of ``model``, its server's workers connected to it: its first
        version (zeros in the checkpoint's layout) is what they hold at connect, never
        loaded; each version staged is a newer one. Made at the first stage, so that
        ``refit launch``'s check (a manifest, no stage) leaves no shared memory behind."""
        sender = refit.Sender(self._transport, self._tensors("the first version", _zeros(served.layout)), model=model)
        try:
            sender.start(timeout=self.load_timeout_s)
            refit.vllm.init_engine(served.server, sender.spec, timeout=self.load_timeout_s, model=model)
        except BaseException:
            sender.close()
            raise
        served.sender = sender
        return sender

    def _tensors(self, version: str, pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """The checkpoint's tensors of ``pairs`` (the roles' names), checked finite."""
        tensors: dict[str, Any] = {}
        for name, tensor in pairs:
            for key, t in self._checkpoint(name, tensor):
                _check_finite(t, name, version, t.dtype)
                # the sender copies it into shared memory: the update's memory is free after
                tensors[key] = t.contiguous()
        return tensors

    def stage(self, model: str, version: int, update: refit.Update) -> None:
        served = self._served(model)
        served.staged = None  # what was staged is replaced: a failure below leaves nothing staged
        tensors = self._tensors(f"v{version}", update.torch(model))
        sender = served.sender or self._connect(model, served)
        ((_, local),) = sender.publish(tensors, timeout=self.load_timeout_s)
        served.staged = (version, local)

    def commit(self, model: str, version: int) -> float:
        """Serves the staged ``version``: vLLM paused (its running sequences held, or ended
        after an :meth:`interrupt`), the version loaded, vLLM resumed. Answers the seconds
        vLLM was paused.

        Raises ``RuntimeError`` when ``version`` is not the one staged; the
        :mod:`refit.errors` class vLLM's workers raised when they refuse it
        (:class:`~refit.errors.Refused`, :class:`~refit.errors.Timeout`,
        :class:`~refit.errors.PeerGone`: nothing loaded, the sequences held go on under the
        previous weights); any other failure once the load began (a
        :class:`~refit.errors.NeedsFullResend`, a route that failed, vLLM not resuming)
        leaves the weights of unknown state: the sequences held are aborted, and the model
        answers no request until a version loads whole."""
        served = self._served(model)
        staged, served.staged = served.staged, None
        if staged is None or staged[0] != version:
            raise RuntimeError(f"v{version} of `{model}` is not the version staged "
                               f"({'none' if staged is None else f'v{staged[0]}'})")
        with self._lock:
            mode = "keep" if served.interrupt is None else "abort"
            served.interrupt = None
        start = time.perf_counter()
        try:
            served.server.pause(mode)
            refit.vllm.update_weights(served.server, version=staged[1], timeout=self.load_timeout_s,
                                      weight_version=str(version), running=mode == "keep")
        except (refit.errors.Refused, refit.errors.Timeout, refit.errors.PeerGone):
            self._resume(served, version, None)
            raise
        except BaseException as e:
            served.mixed = f"v{version} failed to load part-way ({type(e).__name__}: {e})"
            self._resume(served, version, e)
            raise
        self._resume(served, version, None)
        served.mixed = None
        return time.perf_counter() - start

    def _resume(self, served: _Served, version: int, failed: BaseException | None) -> None:
        """Resumes vLLM after the load of ``version``; the sequences it holds are aborted
        first when the load ``failed`` part-way (they would go on over mixed weights). A
        failure to resume is raised when the load did not fail, else logged (the load's
        error is the one to report)."""
        try:
            if failed is not None:
                served.server.abort_requests()
            served.server.resume()
        except Exception as e:
            if failed is not None:
                _log.warning("vLLM at %s: resuming after the failed load of v%d failed: %s", served.server.url,
                             version, e)
                return
            served.mixed = f"v{version} loaded, but vLLM did not resume ({e})"
            raise RuntimeError(f"v{version} loaded, but vLLM at {served.server.url} did not resume: {e}") from e

    def abort(self, model: str) -> None:
        served = self._served(model)
        served.staged = None
        with self._lock:
            served.interrupt = None

    def interrupt(self, model: str, version: int) -> None:
        """Under ``pause_mode = "abort"``: the model's requests in flight end now (vLLM's
        ``/abort_requests``), answered ``"aborted"`` with the tokens made so far, and those
        asked later end at once, until the model's next :meth:`commit` or :meth:`abort`."""
        served = self._served(model)
        with self._lock:
            served.interrupt = version
        served.server.abort_requests()

    def close(self) -> None:
        """Closes the senders and ends the servers this engine's ``build`` started."""
        for served in self._models.values():
            if served.sender is not None:
                served.sender.close()
            if served.process is not None:
                served.process.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _served(self, model: str) -> _Served:
        try:
            return self._models[model]
        except KeyError:
            raise KeyError(f"this vLLM engine serves no model `{model}`") from None

    # -- the requests --------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> list[Completion | BaseException]:
        return self._all([(self._complete, r) for r in requests])

    def score(self, requests: list[refit.engine.ScoreRequest]) -> list[Completion | BaseException]:
        """The log-probability of each of ``tokens`` after ``prompt`` and the tokens before
        it, from vLLM's prompt log-probabilities: at temperature 1 only (vLLM does not apply
        a temperature to them), another is refused."""
        return self._all([(self._score, r) for r in requests])

    def _all(self, calls: list[tuple[Callable[[Any], Completion], Any]]) -> list[Completion | BaseException]:
        """Each call's answer, or the exception it raised, all sent at once."""
        futures = [self._pool.submit(f, r) for f, r in calls]
        out: list[Completion | BaseException] = []
        for f in futures:
            try:
                out.append(f.result())
            except Exception as e:  # one request fails alone
                out.append(e)
        return out

    def _complete(self, r: Request) -> Completion:
        served = self._served(r.model)
        if served.mixed is not None:
            raise RuntimeError(f"`{r.model}` serves mixed weights ({served.mixed}): no completion until a "
                               "version loads whole")
        with self._lock:
            if served.interrupt is not None:  # asked after an interrupt: ends at once
                return Completion(tokens=[], logprobs=[], versions=[], finish="aborted")
        params = {"max_tokens": r.max_tokens, "temperature": r.temperature, "seed": r.seed, "logprobs": 0,
                  "stop_token_ids": [] if r.stop is None else [r.stop], "ignore_eos": True, "detokenize": False}
        answer = served.server.generate({"token_ids": list(r.prompt), "sampling_params": params,
                                         "output_mode": "tokens"}, timeout=self._request_timeout)
        return _completion(answer)

    def _score(self, r: refit.engine.ScoreRequest) -> Completion:
        if r.temperature != 1.0:
            raise ValueError(f"vLLM scores at temperature 1 only, asked {r.temperature}")
        if not r.prompt or not r.tokens:
            raise ValueError("a score needs a prompt and at least one token")
        served = self._served(r.model)
        if served.mixed is not None:
            raise RuntimeError(f"`{r.model}` serves mixed weights ({served.mixed})")
        params = {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}
        body = {"token_ids": list(r.prompt) + list(r.tokens), "sampling_params": params, "output_mode": "tokens"}
        for _ in range(3):  # a score an interrupt or a commit's abort ended is asked again
            answer = served.server.generate(body, timeout=self._request_timeout)
            if answer["choices"][0].get("finish_reason") != "abort":
                break
        else:
            raise RuntimeError(f"vLLM aborted the score of a sequence of `{r.model}` three times (updates under "
                               "pause_mode = \"abort\")")
        steps = (answer.get("prompt_logprobs") or [])[len(r.prompt):]
        if len(steps) != len(r.tokens):
            raise ValueError(f"vLLM gave {len(steps)} prompt log-probabilities for {len(r.tokens)} tokens")
        logprobs = []
        for step, token in zip(steps, r.tokens):
            entry = (step or {}).get(str(token))
            if entry is None:
                raise ValueError(f"vLLM gave no log-probability for token {token}")
            logprobs.append(float(entry["logprob"]))
        # the prompt's log-probabilities come from the step that sampled the first token
        # (vLLM prefills a prompt of up to its batch's tokens in that one step)
        (version,) = _versions(answer["choices"][0], 1)
        return Completion(tokens=list(r.tokens), logprobs=logprobs, versions=[version] * len(r.tokens))


def _zeros(layout: list) -> list[tuple[str, Any]]:
    """Zeros in ``layout`` (``(name, dtype, shape)`` triples) as torch tensors."""
    import torch

    return [(name, torch.zeros(shape, dtype=refit._torch_dtype(torch, dtype, name))) for name, dtype, shape in layout]


def _versions(choice: dict[str, Any], tokens: int) -> list[int]:
    spans = choice.get("weight_versions")
    versions = token_versions(None if spans is None else [SimpleNamespace(**s) for s in spans], tokens)
    if versions is None:
        raise ValueError("vLLM labelled no token with the version that made it (no weight_versions)")
    return versions


def _completion(answer: dict[str, Any]) -> Completion:
    """A :class:`Completion` from vLLM's answer to one ``/inference/v1/generate`` request."""
    (choice,) = answer["choices"]
    tokens = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(tokens):
        raise ValueError(f"vLLM gave {len(content)} logprobs for {len(tokens)} tokens")
    logprobs = []
    for entry, token in zip(content, tokens):
        lp = float(entry["logprob"])
        if int(entry["token_id"]) != token or not (math.isfinite(lp) and lp <= 0.0):
            raise ValueError(f"vLLM gave token {token} the log-probability {lp} of token {entry['token_id']}")
        logprobs.append(lp)
    finish = choice.get("finish_reason")
    if finish == "abort":
        finish = "aborted"
    elif finish not in ("stop", "length"):
        raise ValueError(f"vLLM ended the completion with `{finish}`, neither stop nor length")
    versions = _versions(choice, len(tokens)) if tokens else []
    return Completion(tokens=tokens, logprobs=logprobs, versions=versions, finish=finish)


__all__ = ["Built", "ServerProcess", "VllmServerEngine", "server_command", "start_server"]
