"""Refit as a vLLM weight-transfer backend: vLLM's workers pull each new version of the
trainer's weights from any Refit sender (``refit serve``, a Rust trainer, a Python
:class:`refit.Sender`) over shared memory, TCP, files or the broadcast chain.

Installing the ``refit`` package registers the backend in every vLLM process through the
``vllm.general_plugins`` entry point (:func:`register`). On the inference side::

    llm = LLM(model=..., weight_transfer_config={"backend": "refit"})
    refit.vllm.init_engine(llm, "/path/to/policy.spec")     # the sender's spec (or its text)

and each time the trainer has published a version::

    refit.vllm.update_weights(llm)          # waits for the next version, loads it, acks it

The cluster token (TCP, broadcast) is never part of the init info: the workers read it from
``REFIT_TOKEN`` or the file ``REFIT_TOKEN_FILE`` names, in their own environment.

A version lands whole or not at all. A receive that fails (:class:`~refit.errors.Timeout`,
:class:`~refit.errors.Refused`, :class:`~refit.errors.PeerGone`) applies nothing and vLLM
keeps serving the previous weights. A version the model refuses before any of it reached
the model's tensors is refused whole (:class:`~refit.errors.Refused`); one that fails after
part of it landed leaves mixed weights: the engine raises
:class:`~refit.errors.NeedsFullResend` and serves the mixture until the next version loads
completely (every Refit version is complete, so any next version repairs it).

A version that ``load_weights`` took without error but that left some of the model's
parameters unfilled (a tensor missing from the version, or one the model skipped) is caught
too: by default (init info ``verify="names"``) the engine compares the parameter names
``load_weights`` returns with the model's own and raises
:class:`~refit.errors.NeedsFullResend` naming the first parameter not loaded, since the rest
of the version did land.

``verify`` is a ladder, each value including the ones before it: ``"off"``, ``"names"``,
``"startup"``, ``"hashes"``. With ``"startup"`` the first version the engine loads is
loaded twice more, over zeros and over ones, and digested each time: a parameter the update
path does not write digests differently (it serves what was there before), and the engine
raises :class:`~refit.errors.NeedsFullResend` naming it. With ``"hashes"`` the engine also
records, after each load, the digests of what it serves, in vLLM's weight-checker format
(:func:`weight_checksums` returns them, to compare with vLLM's own
``compute_weight_checksums``), and digests again at the start of the next update: weights
changed while served raise :class:`~refit.errors.Damaged` naming the parameter, before
anything is loaded (vLLM serves them still; the next version loaded replaces them).

A tensor-parallel vLLM's workers are held to one version between them, and a step that
fails in one fails in all alike (the last worker raises, naming each failure). Fed from
trainer shards (:func:`init_mesh`), each worker of a Llama-built model pulls only the
slice of each weight its layers keep (other models pull every tensor whole).

Through vLLM's RPCs the worker's exception reaches the caller as a plain ``Exception``;
the helpers here (:func:`init_engine`, :func:`update_weights`) raise the
:mod:`refit.errors` class again, which every message names as ``[refit.errors.Kind]``.

Importing this module imports neither vLLM nor torch: the engine classes
(``RefitWeightTransferEngine``, ``RefitInitInfo``, ``RefitUpdateInfo``) are built on first
access. Logs go to the ``vllm.refit`` logger, so vLLM's logging settings apply to them.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
import urllib.parse
from typing import Any

from . import errors

__all__ = [
    "BACKEND",
    "register",
    "init_engine",
    "init_mesh",
    "mesh_stats",
    "update_weights",
    "weight_checksums",
    "shutdown_engine",
    "Server",
    "RefitWeightTransferEngine",
    "RefitInitInfo",
    "RefitUpdateInfo",
]

#: The name the backend registers under: ``weight_transfer_config={"backend": BACKEND}``.
BACKEND = "refit"

_log = logging.getLogger("vllm.refit")

# the engine classes, built by `_build` on first access (they subclass vLLM's)
_BUILT: dict[str, type] = {}
_LAZY = ("RefitWeightTransferEngine", "RefitInitInfo", "RefitUpdateInfo")


def register() -> None:
    """Registers the ``refit`` weight-transfer backend with vLLM (the
    ``vllm.general_plugins`` entry point; vLLM calls it in each of its processes).

    Idempotent. Does nothing, logging why at debug level, when this vLLM has no
    weight-transfer engines (``vllm.distributed.weight_transfer``, older vLLM). The engine
    module is registered lazily: vLLM imports the engine class only when a worker builds it.
    """
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as e:
        _log.debug("refit: not registering the `%s` weight-transfer backend: %s", BACKEND, e)
        return
    registry = getattr(WeightTransferEngineFactory, "_registry", None)
    if isinstance(registry, dict) and BACKEND in registry:
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RefitWeightTransferEngine")
    except ValueError as e:  # registered meanwhile (or by another plugin of that name)
        _log.debug("refit: the `%s` backend is already registered: %s", BACKEND, e)


# --- from the caller's side (the process holding the `LLM`) ------------------------------

_TAG = re.compile(r"\[refit\.errors\.([A-Za-z]+)\]\s*")
# the parameter key a Damaged message names first (refit.errors.Damaged.tensor)
_DAMAGED = re.compile(r"changed while served: `([^`]+)`")
# how vLLM's multiprocess executor wraps a worker's error message
_WRAPPED = re.compile(r"'?,? please check the stack trace above for the root cause\.?\s*$")


def _typed(e: BaseException) -> BaseException:
    """The :mod:`refit.errors` exception a worker raised, from the plain ``Exception``
    vLLM's RPC turned it into (its message names the class as ``[refit.errors.Kind]``);
    ``e`` itself when it is one already or names none."""
    if isinstance(e, errors.RefitError):
        return e
    text = str(e)
    m = _TAG.search(text)
    cls = getattr(errors, m.group(1), None) if m else None
    if not (isinstance(cls, type) and issubclass(cls, errors.RefitError)):
        return e
    typed = cls(_WRAPPED.sub("", text[m.start() :]))
    if isinstance(typed, errors.Damaged):
        named = _DAMAGED.search(text)
        typed.tensor = named.group(1) if named else None
    typed.__cause__ = e
    return typed


def _rpc(llm: Any, method: str, rpc_timeout: float | None, **kwargs: Any) -> None:
    """Calls the worker method ``method`` on every worker of ``llm`` (an ``LLM`` or
    anything with ``collective_rpc``), or the same-named method of a weight-sync client
    (``vllm.distributed.weight_transfer.clients``: HTTP, Ray), raising typed errors."""
    try:
        if hasattr(llm, "collective_rpc"):
            llm.collective_rpc(method, timeout=rpc_timeout, kwargs=kwargs or None)
        elif hasattr(llm, method):
            getattr(llm, method)(*kwargs.values())
        else:
            raise errors.ConfigError(
                f"{type(llm).__name__} is neither a vLLM `LLM` (collective_rpc) nor a "
                f"weight-sync client (no `{method}`)"
            )
    except errors.RefitError:
        raise
    except Exception as e:
        typed = _typed(e)
        if typed is e:
            raise
        raise typed from e


def init_engine(
    llm: Any,
    spec: str | os.PathLike,
    *,
    timeout: float = 60.0,
    copy: bool = False,
    model: str | None = None,
    load_initial: bool = False,
    verify: str = "names",
    stream: bool = False,
) -> None:
    """Connects every worker of ``llm`` (started with ``weight_transfer_config={"backend":
    "refit"}``) to the Refit sender ``spec`` describes (its text, or the path of a file
    holding it, read by the workers). See :class:`RefitInitInfo` for the other fields.

    Raises:
    :class:`~refit.errors.ConfigError` (a bad spec, an unknown ``model``),
    :class:`~refit.errors.Unauthorized` (no token in the workers' environment),
    :class:`~refit.errors.Timeout` (no sender within ``timeout``); with ``load_initial``
    also what :func:`update_weights` raises.
    """
    spec = os.fspath(spec) if isinstance(spec, os.PathLike) else spec
    info = {"spec": spec, "timeout": timeout, "copy": copy, "model": model, "load_initial": load_initial,
            "verify": verify, "stream": stream}
    _rpc(llm, "init_weight_transfer_engine", None, init_info=info)


def init_mesh(
    llm: Any,
    senders: list[str],
    manifest: list[tuple[str, str, list[int]]],
    *,
    model: str | None = None,
    verify: str = "names",
) -> None:
    """Connects every worker of ``llm`` to the trainer shards whose cards
    (:attr:`refit.MeshSender.card`) are ``senders``, publishing the model whose tensors
    ``manifest`` lists (``(name, dtype, shape)`` in the checkpoint's names). Each worker
    plans which bytes it needs from which shard once, here: a tensor-parallel worker only
    its slice of each weight its layers split. Then :func:`update_weights` with a
    ``version`` pulls and loads that version; :func:`mesh_stats` says what each worker pulls.

    Raises:
    :class:`~refit.errors.ConfigError` naming the tensor when the shards' parts leave a gap
    or overlap in it; :class:`~refit.errors.Unauthorized` (no token in the workers'
    environment).
    """
    info = {"mesh": list(senders), "manifest": [[n, d, list(shape)] for n, d, shape in manifest],
            "model": model, "verify": verify}
    _rpc(llm, "init_weight_transfer_engine", None, init_info=info)


def update_weights(
    llm: Any,
    version: int | None = None,
    *,
    timeout: float = 60.0,
    is_checkpoint_format: bool = True,
    rpc_margin: float = 300.0,
    weight_version: str | None = None,
    running: bool = False,
) -> None:
    """Loads the trainer's next version (or the first one ≥ ``version``) into every worker
    of ``llm``: ``start_weight_update``, ``update_weights``, ``finish_weight_update`` as vLLM
    requires, then drops vLLM's prefix cache (its KV entries were computed with the previous
    weights). Each worker waits up to ``timeout`` seconds for the version; the RPC itself
    may take ``rpc_margin`` seconds more (loading).

    ``weight_version``: the label vLLM gives the tokens these weights make (its
    ``weight_versions`` spans), passed to ``finish_weight_update`` (a :class:`Server`) or
    set on the engine (an ``LLM``). ``running``: requests are held in vLLM (paused with
    ``mode="keep"``); they go back to vLLM's queue and their KV entries are recomputed
    under the new weights.

    Raises:
    :class:`~refit.errors.Timeout`, :class:`~refit.errors.PeerGone`,
    :class:`~refit.errors.Refused`: nothing was applied, the previous weights stay in force.
    :class:`~refit.errors.NeedsFullResend`: part of the version landed; the next version
    that loads whole repairs the model (also a failed startup self-test, ``verify="startup"``).
    :class:`~refit.errors.Damaged` (``verify="hashes"``): the weights served changed since
    the last load; nothing was loaded, and the next update loads a version whole.
    """
    info = {"version": version, "timeout": timeout, "is_checkpoint_format": is_checkpoint_format}
    try:
        _rpc(llm, "start_weight_update", None)
    except errors.RefitError:
        _end_quiet_sessions(llm, rpc_margin)
        raise
    try:
        _rpc(llm, "update_weights", timeout + rpc_margin, update_info=info)
    except errors.RefitError as e:
        _end_quiet_sessions(llm, rpc_margin)
        if isinstance(e, errors.NeedsFullResend):
            _reset_caches(llm)
        raise
    # a failed update_weights ends vLLM's update session itself (and the engine has put the
    # previous weights back): finish is only for a success
    if weight_version is not None and not hasattr(llm, "collective_rpc"):
        _rpc(llm, "finish_weight_update", rpc_margin, weight_version=weight_version)
    else:
        _rpc(llm, "finish_weight_update", rpc_margin)
        if weight_version is not None:
            llm.llm_engine.set_weight_version(weight_version)
    if not _reset_caches(llm, running=running) and running:
        raise errors.NeedsFullResend("the version loaded, but vLLM kept the KV entries the previous weights "
                                     "computed for the requests it holds (its prefix cache was not dropped)")


def _end_quiet_sessions(llm: Any, rpc_timeout: float) -> None:
    """After a ``start_weight_update`` or ``update_weights`` that failed: ends vLLM's update
    session in the workers that returned quietly. (A step fails in every worker alike, but
    only the last raises, or vLLM would take the others' answers for those of its next
    call; vLLM ends the session of a worker that raised itself.) Through an ``LLM``'s
    ``collective_rpc`` or a weight-sync client's ``finish_weight_update``; a failure to end
    them is logged, the update's own error is what the caller gets."""
    try:
        if hasattr(llm, "collective_rpc"):
            llm.collective_rpc("finish_weight_update", timeout=rpc_timeout)
        elif hasattr(llm, "finish_weight_update"):
            llm.finish_weight_update()
    except Exception as e:
        # the last worker, whose session vLLM ended as it raised, answers last: the others'
        # sessions are ended by then
        if "without a matching start_weight_update" not in str(e):
            _log.warning("refit: ending vLLM's update session after a failed update: %s: %s", type(e).__name__, e)


def shutdown_engine(llm: Any) -> None:
    """Closes every worker's Refit receiver; vLLM goes on serving the weights in force."""
    _rpc(llm, "shutdown_weight_transfer_engine", None)


class Server:
    """A running ``vllm serve`` driven over HTTP, for :func:`init_engine`,
    :func:`update_weights` and :func:`shutdown_engine` in place of an ``LLM``.

    The server must be started with the backend and vLLM's development routes (where the
    weight-transfer and cache routes live)::

        VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "refit"}'

    then, from the trainer's side or any controller::

        server = refit.vllm.Server("http://127.0.0.1:8000")
        refit.vllm.init_engine(server, "policy.spec")
        refit.vllm.update_weights(server)

    A worker's error reaches the caller as the :mod:`refit.errors` class it raised (the
    server's error body carries its message). ``api_key`` is sent as a bearer token
    (``vllm serve --api-key``).
    """

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        # each thread's kept connection for :meth:`generate`
        self._local = threading.local()
        # where generate's connections go: host, port and path prefix (no trailing `/`, as
        # the URL has none), read once
        self._at = urllib.parse.urlsplit(self.url)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``POST /init_weight_transfer_engine``."""
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """``POST /start_weight_update``."""
        self._post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """``POST /update_weights``."""
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``POST /finish_weight_update``."""
        self._post("finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        """``POST /shutdown_weight_transfer_engine``."""
        self._post("shutdown_weight_transfer_engine")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """``POST /reset_prefix_cache``: whether vLLM dropped it (it does not while running
        requests hold blocks, unless ``reset_running_requests`` sends them back to its
        queue). Raises as every route does (:meth:`pause`)."""
        query = "?reset_running_requests=true" if reset_running_requests else ""
        answer = self._post(f"reset_prefix_cache{query}")
        return not isinstance(answer, dict) or answer.get("success") is not False

    def pause(self, mode: str = "keep") -> None:
        """``POST /pause?mode=...``: vLLM's ``pause_generation``. ``"keep"``: the requests
        running are held where they are and go on at :meth:`resume`; ``"abort"``: they end
        now, answered with the tokens made so far; ``"wait"``: they run to their end
        first. New requests wait for :meth:`resume` either way.

        Raises (as every route of this class does): :class:`~refit.errors.PeerGone` (no
        server), :class:`~refit.errors.Timeout` (no answer within the server's
        ``timeout``), :class:`~refit.errors.Unauthorized` (the API key refused),
        :class:`~refit.errors.ConfigError` (no such route: a server not in development
        mode), ``Exception`` naming the route and vLLM's message for another failure."""
        self._post(f"pause?mode={mode}")

    def resume(self) -> None:
        """``POST /resume``: vLLM's ``resume_generation``. Raises as :meth:`pause`."""
        self._post("resume")

    def abort_requests(self) -> int:
        """``POST /abort_requests``: every request in flight ends now, answered with the
        tokens made so far; answers how many. Raises as :meth:`pause`."""
        answer = self._post("abort_requests", {})
        return int(answer.get("aborted", 0)) if isinstance(answer, dict) else 0

    def generate(self, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """``POST /inference/v1/generate`` (vLLM's tokens in, tokens out route: ``vllm serve
        --tokens-only`` or ``--enable-scale-out``): ``body`` as that route takes it, its
        answer as it gives it, over a connection each calling thread keeps open (a batch
        sends one request per completion). A request vLLM refuses raises ``ValueError``
        with its message; ``timeout`` (the server's by default) bounds the answer.

        Raises:
        ``ValueError`` (the request refused, HTTP 400, or an answer that is no JSON object),
        :class:`~refit.errors.Timeout` (no answer within ``timeout``),
        :class:`~refit.errors.PeerGone` (no server), :class:`~refit.errors.Unauthorized`
        (the API key refused), :class:`~refit.errors.ConfigError` (no such route: a server
        without ``--tokens-only`` or ``--enable-scale-out``), ``Exception`` naming the
        route and vLLM's message for another failure.
        """
        import http.client
        import json

        route = "inference/v1/generate"
        timeout = self.timeout if timeout is None else timeout
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        while True:
            conn = self._connection(timeout)
            kept = conn.sock is not None  # a connection an earlier request opened
            try:
                conn.request("POST", f"{self._at.path}/{route}", body=data, headers=headers)
                response = conn.getresponse()
                text = response.read()
            except TimeoutError as e:
                self._drop(conn)
                raise errors.Timeout(f"vLLM at {self.url} did not answer /{route} within {timeout:g} s") from e
            except (http.client.HTTPException, OSError) as e:
                self._drop(conn)
                # a kept connection the server closed meanwhile, before it read the request:
                # once more on a fresh one (a fresh one failing is the server's answer)
                if kept and isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
                    continue
                raise errors.PeerGone(f"vLLM at {self.url} cannot be reached (/{route}): {e}") from e
            break
        if response.status != 200:
            raise self._error(route, response.status, text.decode(errors="replace"), ValueError)
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise ValueError(f"vLLM at {self.url} answered /{route} with no JSON object")
        return answer

    def _connection(self, timeout: float) -> Any:
        """This thread's kept connection to the server (made on first use)."""
        import http.client

        conn = getattr(self._local, "conn", None)
        if conn is None:
            make = http.client.HTTPSConnection if self._at.scheme == "https" else http.client.HTTPConnection
            conn = self._local.conn = make(self._at.hostname or "127.0.0.1", self._at.port, timeout=timeout)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _drop(self, conn: Any) -> None:
        conn.close()
        self._local.conn = None

    def _error(self, route: str, code: int, text: str, refused: type[Exception] = Exception) -> Exception:
        """What an answer of HTTP ``code`` to ``route`` means (``refused`` for 400)."""
        import json

        try:
            detail = json.loads(text)
            detail = detail.get("error", detail).get("message", text) if isinstance(detail, dict) else text
        except (ValueError, AttributeError):
            pass
        else:
            text = str(detail)
        if code in (401, 403):
            return errors.Unauthorized(f"vLLM at {self.url} refused the API key on /{route} (HTTP {code})")
        if code == 404 and route.startswith("inference/"):
            return errors.ConfigError(f"vLLM at {self.url} has no /{route}: start it with --tokens-only (or --enable-scale-out)")
        if code == 404:
            return errors.ConfigError(f"vLLM at {self.url} has no /{route}: start it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{{\"backend\": \"refit\"}}'")
        if code == 400 and refused is not Exception:
            return refused(f"vLLM at {self.url} refused /{route}: {text}")
        return Exception(f"vLLM at {self.url}: /{route} failed (HTTP {code}): {text}")

    def _post(self, route: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """POSTs ``body`` to ``route``; answers the JSON vLLM answers (``None`` for none)."""
        import json
        import urllib.error
        import urllib.request

        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(f"{self.url}/{route}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        if self.api_key is not None:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        timeout = self.timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            raise self._error(route.split("?")[0], e.code, e.read().decode(errors="replace")) from e
        except TimeoutError as e:
            raise errors.Timeout(f"vLLM at {self.url} did not answer /{route} within {timeout:g} s") from e
        except urllib.error.URLError as e:
            raise errors.PeerGone(f"vLLM at {self.url} cannot be reached (/{route}): {e.reason}") from e
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None

    def __repr__(self) -> str:
        return f"refit.vllm.Server({self.url!r})"


def _reset_caches(llm: Any, running: bool = False) -> bool:
    """Drops the caches computed with the previous weights (prefix KV, encoder outputs);
    answers whether vLLM dropped the prefix cache (``True`` where it has none). ``running``:
    requests are in flight, and go back to vLLM's queue to be recomputed."""
    reset = getattr(llm, "reset_prefix_cache", None)
    if not callable(reset):
        dropped = True
    else:
        dropped = (reset(reset_running_requests=True) if running else reset()) is not False
    engine = getattr(llm, "llm_engine", None)
    reset_encoder = getattr(engine, "reset_encoder_cache", None)
    if callable(reset_encoder):
        reset_encoder()
    return dropped


# --- the engine (in vLLM's workers) -------------------------------------------------------


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        if not _BUILT:
            _BUILT.update(_build())
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fail(cls: type[errors.RefitError], message: str) -> errors.RefitError:
    """``cls`` with ``message`` tagged ``[refit.errors.Kind]`` (the tag survives vLLM's RPC,
    which keeps only the text)."""
    return cls(f"[refit.errors.{cls.__name__}] {message}")


class _Unparsed:
    """An init or update info the engine's parse refused: ``error`` says why."""

    def __init__(self, error: errors.RefitError) -> None:
        self.error = error


def _as_refit(e: BaseException, what: str, cls: type[errors.RefitError] = errors.ConfigError) -> errors.RefitError:
    """``e`` as a :mod:`refit.errors` exception: itself, or ``cls`` about ``what`` (by
    default a ``ConfigError``: an init or update info vLLM or its ``__post_init__``
    refused)."""
    if isinstance(e, errors.RefitError):
        return e
    text = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    typed = _fail(cls, text if text.startswith(what) else f"{what}: {text}")
    typed.__cause__ = e
    return typed


def _described(failure: BaseException | None) -> tuple[str, str] | None:
    """``(class name, message without its tag)`` of a failure, as workers tell each other."""
    return None if failure is None else (type(failure).__name__, _TAG.sub("", str(failure)))


def _describe_spec(spec: str) -> str:
    text = spec.strip()
    if os.path.isfile(text):
        return text
    return text if len(text) <= 24 else text[:20] + "…"


#: ``verify`` values of the init info, a ladder (each includes the ones before it):
#: ``off``: no check; ``names``: after each checkpoint-format load, ``load_weights`` must
#: have filled every parameter of the model; ``startup``: also the corrupt-then-restore
#: self-test at the first version the engine loads (:func:`_self_test`); ``hashes``: also
#: the digests of what the engine serves, recorded after each load and compared at the start
#: of the next update (weights changed while served raise :class:`~refit.errors.Damaged`).
VERIFY = ("off", "names", "startup", "hashes")


def _param_groups(named: Any, skip: Any = ()) -> list[tuple[str, ...]]:
    """The model's parameters a full version must fill, each as the tuple of its names (a
    tensor registered under several names, tied weights such as ``lm_head.weight`` tied to
    the input embedding, is one entry), in the model's order. ``named`` is
    ``named_parameters(remove_duplicate=False)``; names in ``skip`` (parameters no
    checkpoint carries) are left out. A parameter's size does not matter: a kernel may keep
    a weight elsewhere and leave its parameter empty (vLLM's CPU GEMMs), yet the checkpoint
    tensor fills it."""
    groups: dict[int, list[str]] = {}
    for name, param in named:
        groups.setdefault(id(param), []).append(name)
    return [tuple(names) for names in groups.values() if not all(n in skip for n in names)]


def _not_loaded(groups: list[tuple[str, ...]], loaded: Any) -> list[str]:
    """The first name of each group of :func:`_param_groups` none of whose names is in
    ``loaded`` (the names ``load_weights`` returned: the model's parameter names, fused
    ones such as ``qkv_proj`` included), in the model's order."""
    return [names[0] for names in groups if not any(n in loaded for n in names)]


def _expected_params(model: Any, model_config: Any) -> list[tuple[str, ...]]:
    """:func:`_param_groups` of ``model`` as vLLM built it, less what no checkpoint
    carries: the KV-cache scales of a KV-cache quantization method, the parameters of
    online quantization, and ``lm_head`` when the config ties it to the embedding."""
    try:
        from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    except ImportError:  # pragma: no cover - another vLLM layout
        BaseKVCacheMethod = ()
    skip = set()
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if (BaseKVCacheMethod and isinstance(method, BaseKVCacheMethod)) or getattr(method, "uses_meta_device", False):
            skip.update(f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(remove_duplicate=False))
    named = list(model.named_parameters(remove_duplicate=False))
    hf = getattr(model_config, "hf_config", None)
    text = hf.get_text_config() if hf is not None and hasattr(hf, "get_text_config") else hf
    if getattr(text, "tie_word_embeddings", False):
        skip.update(n for n, _ in named if "lm_head" in n.split("."))
    return _param_groups(named, skip)


# --- a tensor-parallel worker's slice of each checkpoint tensor ---------------------------
#
# A worker of a tensor-parallel vLLM keeps a slice of most weights: vLLM's layers narrow each
# checkpoint tensor to the worker's rows (column-parallel layers, the vocabulary) or columns
# (row-parallel layers) as they load it. Pulled from a mesh (init info ``mesh``), a worker
# asks the senders for that slice alone and hands ``load_weights`` a tensor of the
# checkpoint's shape holding it where the layer will narrow (NaN elsewhere: a slice taken
# wrong loads NaN, which the first generation shows, never plausible numbers). Layers not
# recognised here, and models whose ``load_weights`` reshapes tensors before the layers see
# them, take the whole tensor: correct always, only not smaller.


def _tp_part(module: Any, index: int | None, param_name: str, shape: list[int]) -> Any:
    """The part (as :class:`refit.MeshReceiver` takes it) of a checkpoint tensor of
    ``shape`` that ``module``, the vLLM layer loading it into its ``param_name``, reads on
    this worker: its tensor-parallel slice, or ``"whole"``. ``index``: the tensor's place in
    a fused layer's inputs (``q``, ``k``, ``v`` of ``qkv_proj`` are 0, 1, 2; ``None``: not
    fused)."""
    tp_size, tp_rank = getattr(module, "tp_size", 1), getattr(module, "tp_rank", 0)
    if not isinstance(tp_size, int) or tp_size <= 1 or param_name not in ("weight", "bias"):
        return "whole"
    # Unquantized layers only (quantized ones pack and scale by rules of their own). Their
    # parameters cannot say how they split (a CPU kernel replaces a linear's weight by an
    # empty one): the layer's class does. A linear's weight is (out, in).
    method = type(getattr(module, "quant_method", None)).__name__
    if not method.startswith("Unquantized"):
        return "whole"
    kind = type(module).__name__
    part: Any = "whole"
    if kind == "QKVParallelLinear" and index is not None:
        # k and v are replicated across `num_kv_head_replicas` workers when heads are few
        replicas = 1 if index == 0 else max(1, int(getattr(module, "num_kv_head_replicas", 1)))
        part = ("slice", 0, tp_rank // replicas, tp_size // replicas)
    elif kind in ("MergedColumnParallelLinear", "ColumnParallelLinear") and (index is None) == (kind == "ColumnParallelLinear"):
        part = ("slice", 0, tp_rank, tp_size)
    elif kind == "RowParallelLinear" and index is None and param_name == "weight" \
            and getattr(module, "input_is_parallel", True):
        part = ("slice", 1, tp_rank, tp_size)  # its bias is added once, whole, after the reduce
    elif kind in ("VocabParallelEmbedding", "ParallelLMHead") and index is None and param_name == "weight":
        # the vocabulary is padded before it is split: a worker's rows are a range of it
        rows = getattr(module, "shard_indices", None)
        start, end = getattr(rows, "org_vocab_start_index", 0), getattr(rows, "org_vocab_end_index", 0)
        if shape and shape[0] == getattr(module, "org_vocab_size", None) and 0 <= start < end <= shape[0]:
            row = 1
            for n in shape[1:]:
                row *= n
            return ("flat", start * row, end * row)
    if part == "whole":
        return part
    _, dim, _, world = part
    return part if world > 1 and 0 <= dim < len(shape) and shape[dim] % world == 0 else "whole"


#: The vLLM models whose ``load_weights`` hands each checkpoint tensor to its layer as it is
#: (no transpose, no split before the layer's loader narrows it), so that the rules above
#: hold; they and their subclasses that keep that ``load_weights`` pull slices, every other
#: model every tensor whole. (vLLM's GPT-2, for one, transposes its MLP weights first;
#: Mistral permutes some of its own.)
_SLICED_MODELS = frozenset({"LlamaForCausalLM"})


def _tp_wants(model: Any, manifest: list[tuple[str, str, list[int]]]) -> list[tuple[str, Any]]:
    """``(name, part)`` for each tensor of ``manifest`` (checkpoint names): the part this
    worker of ``model`` loads (:func:`_tp_part`), for the models of :data:`_SLICED_MODELS`
    and their subclasses that keep its ``load_weights`` (every tensor whole for others). A name is found as the module that holds
    it, or, for the inputs of a fused layer, through the model's ``packed_modules_mapping``
    (``q_proj`` → the ``qkv_proj`` beside it)."""
    base = next((c for c in type(model).__mro__ if c.__name__ in _SLICED_MODELS), None)
    if base is None or getattr(type(model), "load_weights", None) is not getattr(base, "load_weights", None):
        return [(name, "whole") for name, _, _ in manifest]
    modules = dict(model.named_modules())
    packed = getattr(model, "packed_modules_mapping", None) or {}
    fused_of = {leaf: (fused, i) for fused, leaves in packed.items() for i, leaf in enumerate(leaves)}
    wants = []
    for name, _dtype, shape in manifest:
        holder, _, param = name.rpartition(".")
        owner, _, leaf = holder.rpartition(".")
        module, index = modules.get(holder), None
        if module is None and leaf in fused_of:
            fused, index = fused_of[leaf]
            module = modules.get(f"{owner}.{fused}" if owner else fused)
        wants.append((name, "whole" if module is None else _tp_part(module, index, param, list(shape))))
    return wants


class _Wide:
    """What a worker fed by a mesh hands ``load_weights``: a tensor of the checkpoint's
    shape per tensor of ``manifest``, made once, holding the worker's part (``wants``)
    where that part lies and NaN elsewhere (zero for integer dtypes), so that the layers
    narrow each back to the part. Each pull lands in :attr:`targets` (byte arrays for
    :meth:`refit.MeshReceiver.pull_into`): in place where the part is contiguous in its
    tensor (a whole tensor, rows, a flat range), else in a buffer of its own that
    :meth:`landed` copies into place (columns). The same memory serves every version:
    no allocation, no page fault, no filler written again."""

    def __init__(self, torch: Any, manifest: list, wants: list[tuple[str, Any]]) -> None:
        import refit

        shapes = {n: (d, list(shape)) for n, d, shape in manifest}
        self.pairs: list[tuple[str, Any]] = []
        self.targets: dict[str, Any] = {}
        self._spread: list[tuple[Any, Any]] = []
        for name, part in wants:
            dtype, shape = shapes[name]
            full = torch.empty(shape, dtype=refit._torch_dtype(torch, dtype, name))
            if part == "whole":
                land = full
            else:
                full.fill_(float("nan") if full.dtype.is_floating_point else 0)
                if part[0] == "flat":
                    land = full.view(-1)[part[1]:part[2]]
                else:
                    _, dim, rank, world = part
                    n = shape[dim] // world
                    land = full.narrow(dim, rank * n, n)
                    if not land.is_contiguous():  # columns: a buffer, copied into place
                        place, land = land, torch.empty(land.shape, dtype=full.dtype)
                        self._spread.append((place, land))
            self.pairs.append((name, full))
            self.targets[name] = land.reshape(-1).view(torch.uint8).numpy()

    def landed(self) -> None:
        """Copies the parts pulled into buffers of their own into their tensors."""
        for place, land in self._spread:
            place.copy_(land)


# --- what an engine serves, digested as vLLM's weight checker does ------------------------
#
# vLLM 0.32's weight checker (``POST /weight_checker {"action": "checksum"}``,
# ``collective_rpc("compute_weight_checksums")``) keys each digest by the worker's place in
# the parallel layout and the parameter's name, ``dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:{name}``,
# and digests a parameter as the SHA-256 (hex) of its raw bytes, on the CPU, contiguous; a
# tensor subclass (TorchAO) or a ``SharedWeightParameter`` is digested as its inner tensors
# (``{name}.{attr}``, ``{name}.{index}``). The functions here do the same without vLLM's
# private helpers (which older or newer vLLMs may lack), so that a user can cross-check
# what this backend recorded with what vLLM computes.


def _checksum_prefix(dp: int, pp: int, pcp: int, tp: int) -> str:
    """The key prefix of a worker's digests (``gpu_worker._weight_checksum_prefix``)."""
    return f"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:"


def _inner_tensors(name: str, tensor: Any, shared: Any, wrapper: Any):
    """``(name, tensor)`` for each plain tensor holding the bytes of parameter ``name``
    (``shared``: vLLM's ``SharedWeightParameter`` class, or ``()``; ``wrapper``: torch's
    ``is_traceable_wrapper_subclass``)."""
    if shared and isinstance(tensor, shared):
        for index, partition in tensor.partitions.items():
            yield from _inner_tensors(f"{name}.{index}", partition, shared, wrapper)
    elif wrapper(tensor):
        for attr in tensor.__tensor_flatten__()[0]:
            yield from _inner_tensors(f"{name}.{attr}", getattr(tensor, attr), shared, wrapper)
    else:
        yield name, tensor


def _served_tensors(model: Any):
    """The plain tensors a model serves, named as vLLM's weight checker names them (its
    ``named_parameters()``: a tied parameter once, under its first name)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    try:
        from vllm.model_executor.parameter import SharedWeightParameter
    except ImportError:  # no vLLM (tests), or another layout
        SharedWeightParameter = ()
    for name, param in model.named_parameters():
        yield from _inner_tensors(name, param, SharedWeightParameter, is_traceable_wrapper_subclass)


def _digest(tensor: Any) -> str:
    """SHA-256 (hex) of ``tensor``'s raw bytes, as vLLM's ``compute_tensor_digests``."""
    import hashlib

    import torch

    data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()


def _digests(model: Any, prefix: str = "") -> dict[str, str]:
    """``{prefix + name: digest}`` of every tensor ``model`` serves (vLLM's weight-checker
    format when ``prefix`` is :func:`_checksum_prefix`'s)."""
    return {prefix + name: _digest(t) for name, t in _served_tensors(model)}


def _changed(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """The keys whose digest differs between ``recorded`` and ``now`` (a key in only one of
    them included), in ``recorded``'s order, then the new ones."""
    return [k for k in recorded if now.get(k) != recorded[k]] + [k for k in now if k not in recorded]


def _served_damage(recorded: dict[str, str], now: dict[str, str], what: str) -> tuple[str, str] | None:
    """Compares the digests ``recorded`` after ``what`` (a version of a model, as messages
    name it) was loaded with those of what the engine serves ``now``: ``None`` when they are
    equal, else the first key that differs and the message that names it."""
    changed = _changed(recorded, now)
    if not changed:
        return None
    key = changed[0]
    was, found = recorded.get(key), now.get(key)
    how = (f"`{key}` now digests to {found[:16]}…, as loaded to {was[:16]}…" if was is not None and found is not None
           else f"`{key}` is {'no longer served' if found is None else 'served but was not when loaded'}")
    more = f" ({len(changed)} tensors differ)" if len(changed) > 1 else ""
    return key, f"{what}: weights changed while served: {how}{more}"


def _fill(model: Any, pattern: int) -> None:
    """Overwrites every tensor ``model`` serves: ``0``: zeros (vLLM's ``zero_weights``);
    ``1``: ones (each element's bytes differ from zero's, whatever the dtype)."""
    import torch

    with torch.no_grad():
        for _, t in _served_tensors(model):
            data = t.detach()
            if pattern == 0:
                data.zero_()
                continue
            try:
                data.fill_(1)
            except (RuntimeError, TypeError):  # a dtype without arithmetic (fp8, packed)
                data.view(torch.uint8).fill_(0x01)


def _self_test(model: Any, load: Any) -> tuple[list[str], dict[str, float]]:
    """The corrupt-then-restore self-test of an update path: every tensor the model serves
    is filled with zeros, ``load()`` loads a version (all of it), the model is digested; then
    filled with ones, the same version loaded again, digested again. A tensor whose digests
    differ is one the path does not fully write: what it serves depends on what was there
    before. Answers those tensors' names (none: the path writes everything the model serves)
    and what each step cost (``fill_s``, ``load_s``, ``digest_s``, seconds, both rounds).

    A tensor a kernel keeps outside the model's parameters (vLLM's CPU GEMMs leave the
    parameter empty) is not covered: its digest is that of no bytes, as in vLLM's checker."""
    costs = {"fill_s": 0.0, "load_s": 0.0, "digest_s": 0.0}
    rounds = []
    for pattern in (0, 1):
        t0 = time.perf_counter()
        _fill(model, pattern)
        t1 = time.perf_counter()
        load()
        t2 = time.perf_counter()
        rounds.append(_digests(model))
        t3 = time.perf_counter()
        costs["fill_s"] += t1 - t0
        costs["load_s"] += t2 - t1
        costs["digest_s"] += t3 - t2
    return _changed(rounds[0], rounds[1]), costs


def _worker_checksums(worker: Any) -> dict[str, str]:
    """In a vLLM worker (through ``collective_rpc``): the digests the refit engine recorded
    after its last load (``verify="hashes"``), else the digests of what it serves now."""
    engine = getattr(worker, "weight_transfer_engine", None)
    recorded = getattr(engine, "served_checksums", None)
    if callable(recorded):
        found = recorded()
        if found is not None:
            return found
    model = worker.model_runner.get_model()
    return _digests(model, _worker_prefix(getattr(worker, "parallel_config", None)))


def _worker_prefix(parallel_config: Any) -> str:
    """:func:`_checksum_prefix` of this process's place in vLLM's parallel groups."""
    from vllm.distributed import parallel_state as ps

    def rank(group: str) -> int:
        get = getattr(ps, f"get_{group}_group", None)
        return 0 if get is None else get().rank_in_group

    dp = getattr(parallel_config, "data_parallel_index", None)
    if dp is None:
        dp = getattr(parallel_config, "data_parallel_rank", 0) or 0
    return _checksum_prefix(dp, rank("pp"), rank("pcp"), rank("tp"))


def _in_workers(llm: Any, fn: Any, what: str, instead: str) -> list[Any]:
    """``fn`` run in every worker of ``llm`` (``collective_rpc``), one answer each.

    Raises :class:`~refit.errors.ConfigError` for an ``llm`` without ``collective_rpc``
    (``instead`` says what to do then) or a vLLM that refuses to send a callable."""
    if not hasattr(llm, "collective_rpc"):
        raise errors.ConfigError(f"{type(llm).__name__} has no collective_rpc: {instead}")
    try:
        return llm.collective_rpc(fn)
    except TypeError as e:
        if "INSECURE_SERIALIZATION" not in str(e):
            raise
        raise errors.ConfigError(
            f"refit.vllm.{what} runs a function in vLLM's workers: start vLLM with "
            f"VLLM_ALLOW_INSECURE_SERIALIZATION=1 in its environment ({e})") from e


def _worker_mesh_stats(worker: Any) -> dict[str, Any] | None:
    """In a vLLM worker: its refit engine's ``mesh_stats`` with its tensor-parallel rank."""
    engine = getattr(worker, "weight_transfer_engine", None)
    stats = getattr(engine, "mesh_stats", None)
    if stats is None:
        return None
    from vllm.distributed import parallel_state as ps

    return {**stats, "tp_rank": ps.get_tp_group().rank_in_group}


def mesh_stats(llm: Any) -> list[dict[str, Any]]:
    """What each worker of ``llm`` pulls from a mesh (:func:`init_mesh`), one dict per
    worker: ``tp_rank``, ``wants`` (``(name, part)`` per tensor: ``"whole"``, ``("slice",
    dim, rank, world)`` or ``("flat", start, end)``), ``bytes_per_pull`` (the bytes each
    version costs this worker, checksums included), ``bytes_pulled`` (so far) and
    ``model_bytes`` (the whole model's). Needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, as
    :func:`weight_checksums`.

    Raises :class:`~refit.errors.ConfigError` as :func:`weight_checksums`, or when a worker
    is not connected to a mesh."""
    answers = _in_workers(llm, _worker_mesh_stats, "mesh_stats", "a vLLM server's workers cannot be asked")
    if any(a is None for a in answers):
        raise errors.ConfigError("a vLLM worker's refit engine is not connected to a mesh: call refit.vllm.init_mesh first")
    return sorted(answers, key=lambda a: a["tp_rank"])


def weight_checksums(llm: Any) -> dict[str, str]:
    """The digests of the weights every worker of ``llm`` (an ``LLM``, or anything with
    ``collective_rpc``) serves, merged, in vLLM's weight-checker format: the key
    ``dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:{name}``, the SHA-256 hex of the parameter's raw bytes.
    Where the engine runs with ``verify="hashes"`` these are the digests it recorded after
    its last load (what it compares at the next update); elsewhere, those of what it serves
    now. Compare them with vLLM's own ``llm.collective_rpc("compute_weight_checksums")`` (or
    a server's ``POST /weight_checker {"action": "checksum"}``): a key that differs is a
    parameter changed since the engine loaded it.

    A multiprocess ``LLM`` runs the function in its workers only with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in its environment (vLLM's rule for a callable
    sent to ``collective_rpc``).

    Raises :class:`~refit.errors.ConfigError` for an ``llm`` without ``collective_rpc`` (a
    :class:`Server`: use its ``/weight_checker`` route), a callable vLLM refuses to send, or
    two workers answering the same key."""
    answers = _in_workers(llm, _worker_checksums, "weight_checksums",
                          "ask a vLLM server for its digests with POST /weight_checker {\"action\": \"checksum\"}")
    merged: dict[str, str] = {}
    for answer in answers:
        twice = merged.keys() & answer.keys()
        if twice:
            raise errors.ConfigError(f"two of vLLM's workers digest the same keys: {sorted(twice)[:3]}")
        merged.update(answer)
    return merged


def _build() -> dict[str, type]:
    """Defines the engine and its info classes on vLLM's base classes (imports vLLM)."""
    from dataclasses import dataclass

    import torch
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    import refit

    @dataclass
    class RefitInitInfo(WeightTransferInitInfo):
        """How a worker reaches the Refit sender (``init_weight_transfer_engine``'s dict).

        ``spec``: the sender's spec, its text or the path of a file holding it (this or
        ``mesh``).
        ``mesh``: instead of one sender, the cards (:attr:`refit.MeshSender.card`) of the
        trainer shards that together publish the model, and ``manifest``: the model's
        tensors as ``(name, dtype, shape)``, in the checkpoint's names and layout. Each
        worker plans once which bytes it needs from which shard and pulls only those: a
        tensor-parallel worker its own slice of each weight its layers split (rows of a
        column-parallel layer and of the vocabulary, columns of a row-parallel one), the
        rest whole. Versions are asked by number (``update_weights(version=...)``); not
        with ``stream``, ``copy`` or ``load_initial``.
        ``timeout``: seconds to wait for the sender when connecting.
        ``copy``: copy each version out of shared memory instead of reading it in place.
        ``model``: which model to load when the sender publishes several.
        ``load_initial``: also load the sender's version in force at once.
        ``verify``: one of :data:`VERIFY`, each including the ones before it.
        ``"off"``: no check. ``"names"`` (default): after a checkpoint-format version is
        loaded, check that ``load_weights`` filled every parameter of the model (a
        parameter it did not is named by a ``NeedsFullResend``). ``"startup"``: also, at
        the first version the engine loads, the corrupt-then-restore self-test (every
        parameter zeroed, the version loaded, digested; every parameter set to ones, the
        same version loaded again, digested: a parameter whose digests differ is one the
        update path does not write: ``NeedsFullResend`` naming it). ``"hashes"``: also,
        after each load, record the digests of what the engine serves (vLLM's
        weight-checker format, :func:`weight_checksums`) and compare them at the start of
        the next update: weights changed while served raise ``Damaged`` naming the
        parameter, before anything is loaded.
        ``stream``: apply each version as it arrives (:meth:`refit.Receiver.stream`): every
        tensor goes into the model as soon as its buckets are verified, and over TCP the
        worker keeps no copy of the version, so its memory during an update is the model
        plus a few buckets' worth of tensors (at least the largest) instead of the model plus
        whole versions. The model is mixed for the whole transfer (vLLM is paused for all of
        it, not only for the load), and a failure once a tensor reached it is
        ``NeedsFullResend``. Takes ``verify`` up to ``"names"`` (the
        self-test loads a version again from memory streaming does not keep).
        No secret: the token comes from the worker's ``REFIT_TOKEN`` / ``REFIT_TOKEN_FILE``.
        """

        spec: str | None = None
        timeout: float = 60.0
        copy: bool = False
        model: str | None = None
        load_initial: bool = False
        verify: str = "names"
        stream: bool = False
        mesh: list[str] | None = None
        manifest: list[tuple[str, str, list[int]]] | None = None

        def __post_init__(self) -> None:
            if self.mesh is not None:
                self._check_mesh()
            elif not isinstance(self.spec, str) or not self.spec.strip():
                raise ValueError("refit init_info: `spec` must be the sender's spec text or a path to it (or give `mesh`)")
            if self.verify not in VERIFY:
                raise ValueError(f"refit init_info: `verify` must be one of {', '.join(map(repr, VERIFY))}, got {self.verify!r}")
            if not self.timeout >= 0:
                raise ValueError(f"refit init_info: `timeout` must be ≥ 0 seconds, got {self.timeout}")
            if self.stream and VERIFY.index(self.verify) > VERIFY.index("names"):
                # typed, so that it crosses vLLM's RPC as itself
                raise _fail(errors.ConfigError, f"refit init_info: `stream` keeps no copy of a version, which "
                            f"verify={self.verify!r} loads a second time for its self-test: use verify=\"names\" "
                            "or \"off\" with `stream`")

        def _check_mesh(self) -> None:
            """Checks the ``mesh`` fields (typed errors: they cross vLLM's RPC as themselves)."""
            if self.spec is not None:
                raise _fail(errors.ConfigError, "refit init_info: give `spec` (one sender) or `mesh` (trainer shards), not both")
            if not isinstance(self.mesh, (list, tuple)) or not self.mesh or not all(isinstance(c, str) for c in self.mesh):
                raise _fail(errors.ConfigError, "refit init_info: `mesh` is a non-empty list of the senders' cards (MeshSender.card)")
            if not self.manifest:
                raise _fail(errors.ConfigError, "refit init_info: `mesh` needs `manifest`, the model's tensors as (name, dtype, shape)")
            try:
                self.manifest = [(str(n), str(d), [int(x) for x in shape]) for n, d, shape in self.manifest]
            except (TypeError, ValueError) as e:
                raise _fail(errors.ConfigError, f"refit init_info: `manifest` is a list of (name, dtype, shape): {e}") from e
            for key in ("stream", "copy", "load_initial"):
                if getattr(self, key):
                    raise _fail(errors.ConfigError, f"refit init_info: `{key}` is not for a mesh: its versions are pulled "
                                "by number, whole, with update_weights(version=...)")

    @dataclass
    class RefitUpdateInfo(WeightTransferUpdateInfo):
        """Which version to load (``update_weights``' dict).

        ``version``: wait for a version ≥ this one (default: the next one to arrive).
        ``timeout``: seconds to wait for it.
        ``is_checkpoint_format``: the tensors are in the checkpoint's format (names and
        layouts of the model's safetensors: loaded through ``load_weights`` inside vLLM's
        layerwise reload). ``False``: they are already in vLLM's kernel format (its own
        parameter names and shapes) and are copied into the parameters as they are.
        """

        version: int | None = None
        timeout: float = 60.0
        is_checkpoint_format: bool = True

        def __post_init__(self) -> None:
            if self.version is not None and (isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1):
                raise ValueError(f"refit update_info: `version` must be a version number ≥ 1, got {self.version!r}")
            if not self.timeout >= 0:
                raise ValueError(f"refit update_info: `timeout` must be ≥ 0 seconds, got {self.timeout}")

    class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
        """vLLM's ``refit`` weight-transfer backend: pulls each version from a Refit sender
        with a :class:`refit.Receiver` and loads it like a checkpoint (vLLM's layerwise
        reload: ``start_weight_update`` begins it, ``finish_weight_update`` completes it),
        acknowledging the version to the sender once it is in force.

        State a caller may read: :attr:`loaded_version` (the Refit version vLLM serves,
        ``None`` while it serves what it loaded from disk) and :attr:`needs_full_resend`
        (a version failed part-way; the weights are mixed until one loads whole).
        """

        init_info_cls = RefitInitInfo
        update_info_cls = RefitUpdateInfo
        # one receiver, one model: a draft model would need a sender of its own
        supports_draft_weight_update = False

        def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
            super().__init__(config, vllm_config, device, model)
            self._receiver: refit.Receiver | None = None
            self._mesh: refit.MeshReceiver | None = None  # instead of the receiver (init info `mesh`)
            self._mesh_wide: _Wide | None = None  # what the mesh's pulls land in
            self._init: RefitInitInfo | None = None
            #: with ``mesh``: ``{"wants": [(name, part)], "bytes_per_pull": n, "bytes_pulled":
            #: total}``, the part of each tensor this worker pulls and the bytes it read
            self.mesh_stats: dict[str, Any] | None = None
            self._model_id: str | None = None
            #: the version of the connected sender that vLLM serves (None: weights from
            #: elsewhere: the disk, or another sender connected before)
            self.loaded_version: int | None = None
            self._serving = "the weights it started with"  # for messages
            #: a version failed part-way: the weights are mixed until one loads whole
            self.needs_full_resend = False
            self._layerwise = False  # between initialize and finalize of a layerwise reload
            self._staged: tuple[Any, int, dict[str, float]] | None = None  # loaded, not acked
            # the parameters a full version fills (names per tensor), taken before the first
            # layerwise reload (which swaps the layers' tensors meanwhile); None: not yet
            self._expected: list[tuple[str, ...]] | None = None
            self._unchecked_said = False  # warned once that names cannot be checked
            self._tested = False  # the startup self-test passed (verify ≥ "startup")
            # (version, digests) of what vLLM served after the last load (verify="hashes")
            self._served: tuple[int, dict[str, str]] | None = None
            self._prefix: str | None = None  # the weight-checker key prefix of this worker
            #: what the last verification steps cost, in seconds: ``self_test_s`` (the
            #: whole self-test, at the first load), ``self_test_load_s``, ``self_test_fill_s``,
            #: ``self_test_digest_s``, ``hash_s`` (the digests after a load), ``check_s`` (the
            #: digests compared at the start of an update)
            self.verify_costs: dict[str, float] = {}

        # -- lifecycle ---------------------------------------------------------------------

        def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
            """Connects a :class:`refit.Receiver` to the sender (closing one connected
            before) and, with ``load_initial``, loads the sender's version in force; or,
            with ``mesh``, plans the pull from the trainer shards.

            Raises:
            ConfigError for an init info refused at parse, Closed during an update session:
            the connection is left as it was. ConfigError (a bad spec, an unknown or
            ambiguous model, ``stream`` with several workers), Unauthorized, Timeout: no
            worker is connected then. With ``load_initial`` as :meth:`receive_weights`.
            """
            refused = None
            if isinstance(init_info, _Unparsed):
                refused = init_info.error
            elif self._layerwise or self._staged is not None:
                refused = _fail(errors.Closed, "cannot reconnect the refit engine during a weight update: finish it first")
            # refused alike in every worker before anything changes: the connection and the
            # update session in progress stay as they were
            if self._settled(refused, None, applied=False, abandon=False):
                return
            if init_info.mesh is not None:
                self._connect_mesh(init_info)
                return
            failure: errors.RefitError | None = None
            try:
                self._connect(init_info)
            except Exception as e:
                failure = _as_refit(e, "connecting to the refit sender")
            try:
                quiet = self._settled(failure, None, applied=False)
            except errors.RefitError:
                self._disconnect()
                raise
            if quiet:
                self._disconnect()  # connected in no worker, as in the one that failed
                return
            if init_info.load_initial:
                from vllm.config import set_current_vllm_config

                assert self._receiver is not None
                with set_current_vllm_config(self.vllm_config):
                    started = time.perf_counter()
                    if init_info.stream:
                        self._stream_load(RefitUpdateInfo(timeout=init_info.timeout), started)
                    else:
                        current, failure = None, None
                        try:
                            current = self._receiver.current()
                        except Exception as e:
                            failure = _as_refit(e, f"receiving the version in force of {self._what()}",
                                                errors.TransportError)
                        self._load_agreed(current, failure, RefitUpdateInfo(timeout=init_info.timeout), started)
                    self._complete()

        def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
            """vLLM's parse, with an init info it refuses kept as :class:`_Unparsed`: the
            refusal is then raised by :meth:`init_transfer_engine` as every step's failure
            is, alike in every worker."""
            try:
                return super().parse_init_info(init_dict)
            except Exception as e:
                return _Unparsed(_as_refit(e, "refit init_info"))

        def _disconnect(self) -> None:
            """Closes the receiver or mesh and forgets the init info."""
            self._close()
            self._init, self.mesh_stats = None, None

        def _connect(self, init_info: RefitInitInfo) -> None:
            """:meth:`init_transfer_engine`'s connection to one sender (raises as it says)."""
            from vllm.distributed import parallel_state as ps

            if init_info.stream and ps.get_tp_group().world_size > 1:
                # each worker would stream on its own, into the model as it comes: several
                # could not be held to one version
                raise _fail(errors.ConfigError, "refit init_info: `stream` takes one worker; this vLLM runs "
                            "tensor-parallel workers: stream=False, or a mesh (init info `mesh`)")
            if init_info.load_initial:
                self._check_served()  # before anything changes: the weights served as loaded
            self._close()
            where = _describe_spec(init_info.spec)
            try:
                receiver = refit.Receiver(init_info.spec, timeout=init_info.timeout, copy=init_info.copy,
                                          stream=init_info.stream)
            except errors.RefitError as e:
                raise _fail(type(e), f"connecting to the refit sender (spec {where}): {e}") from e
            models = receiver.models
            model = init_info.model
            if model is None and len(models) != 1:
                receiver.close()
                raise _fail(errors.ConfigError, f"the refit sender (spec {where}) publishes {len(models)} models ({', '.join(models)}): name one as init_info `model`")
            if model is not None and model not in models:
                receiver.close()
                raise _fail(errors.ConfigError, f"the refit sender (spec {where}) publishes no model `{model}` (it publishes {', '.join(models)})")
            if self.loaded_version is not None:
                self._serving = f"{self._serving} (from the sender connected before)"
            # versions number one sender's updates: none of this sender's is in force yet
            self.loaded_version = None
            self._receiver, self._init, self._model_id = receiver, init_info, model or models[0]
            self.mesh_stats = None
            if init_info.stream:
                _log.info("refit: connected to the %s sender of `%s` (spec %s), streaming: the version in force "
                          "there comes with the first update", receiver.transport, self._model_id, where)
            else:
                _log.info("refit: connected to the %s sender of `%s` (spec %s), version %d in force there",
                          receiver.transport, self._model_id, where, receiver.version(self._model_id))

        def start_weight_update(self) -> None:
            """Begins vLLM's layerwise reload for the incoming checkpoint-format weights
            (as vLLM's own checkpoint-format engines do). With ``verify="hashes"`` first
            digests what vLLM serves and compares it with the digests recorded after the last
            load.

            Raises:
            Damaged when the weights changed while served (naming the parameter): nothing
            was loaded, vLLM serves them still; the next version loaded replaces them.
            """
            failure = None
            try:
                self._check_served()
                self._begin()
            except Exception as e:
                failure = _as_refit(e, "beginning the weight update", errors.Refused)
            self._settled(failure, None, applied=False)

        def served_checksums(self) -> dict[str, str] | None:
            """The digests of what vLLM served after the last load, in vLLM's weight-checker
            format (``verify="hashes"``; ``None`` otherwise, or after damage was found)."""
            return None if self._served is None else dict(self._served[1])

        def update_weights(self, update_info: dict[str, Any]) -> None:
            """Parses ``update_info`` and receives one version (:meth:`receive_weights`).

            vLLM's base method then synchronizes ``torch.accelerator``, which raises on a
            machine without one (vLLM's CPU build): this one synchronizes only where there is
            an accelerator.
            """
            try:
                info = self.parse_update_info(update_info)
            except Exception as e:
                # refused alike in every worker, as every step's failure is
                self._settled(_as_refit(e, "refit update_info"), None, applied=False)
                return
            self.receive_weights(info)
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: RefitUpdateInfo) -> None:
            """Waits (up to ``update_info.timeout``) for the version asked, hands its
            tensors to the model's ``load_weights`` (CPU views of the received memory,
            moved to the worker's device when it is not the CPU) and stages it: it is
            acknowledged to the sender by :meth:`finish_weight_update`, once in force.

            Raises:
            Timeout, PeerGone, Refused, Closed: nothing was applied, the previous weights
            were put back. NeedsFullResend: part of the version reached the model.
            """
            started = time.perf_counter()
            if self._receiver is None and self._mesh is None:
                closed = _fail(errors.Closed, "the refit engine is not connected: call init_weight_transfer_engine "
                               "with the sender's spec first")
                self._settled(closed, None, applied=False)
                return
            if self._mesh is not None:
                self._mesh_load(update_info, started)
                return
            if self._init is not None and self._init.stream:
                self._stream_load(update_info, started)
                return
            update, failure = None, None
            try:
                update = self._wait(update_info)
            except Exception as e:
                failure = _as_refit(e, f"receiving the next version of {self._what()}", errors.TransportError)
            self._load_agreed(update, failure, update_info, started)

        def _load_agreed(self, update: Any, failure: errors.RefitError | None, info: RefitUpdateInfo,
                         started: float) -> None:
            """Loads ``update`` (``None``: nothing to load; ``failure``: how receiving it
            failed) once every tensor-parallel worker holds the same version
            (:meth:`_same_version`), and stages it; a failure anywhere ends the step alike in
            every worker (:meth:`_settled`)."""
            update = self._same_version(update, failure, info)
            if update is None:
                return
            failure = None
            try:
                if self._staged is not None:
                    # a second version in one update session: complete the first, then begin again
                    self._complete()
                    self._begin()
                self._load(update, info, started)
            except Exception as e:
                failure = _as_refit(e, f"loading {self._what(update.version(self._model_id))}",
                                    errors.NeedsFullResend)
            self._settled(failure, update.version(self._model_id), applied=True)

        def _same_version(self, update: Any, failure: errors.RefitError | None, info: RefitUpdateInfo) -> Any:
            """The update every tensor-parallel worker is to load, the same version in each:
            each worker receives from the sender on its own, and one may get a version the
            trainer published after another's; the workers behind wait for the newest one
            among them (within ``info.timeout``), so that no version is served in part of
            the model. ``None``: nothing to load (already in force everywhere), or a failure
            that :meth:`_settled` ended (raised in the last worker)."""
            deadline = time.monotonic() + info.timeout
            for _ in range(8):
                mine = {"failure": _described(failure),
                        "version": None if update is None else update.version(self._model_id)}
                every = self._gathered(mine)
                if any(e["failure"] for e in every):
                    self._settled(failure, None, applied=False, every=[e["failure"] for e in every])
                    return None
                versions = {e["version"] for e in every}
                if len(versions) == 1:
                    return update
                newest = max(v for v in versions if v is not None)
                if update is None or mine["version"] < newest:
                    update = None  # not applied: not acknowledged (the newer one's ack covers it)
                    try:
                        update = self._wait(RefitUpdateInfo(version=newest, timeout=max(deadline - time.monotonic(), 0.0)))
                    except Exception as e:
                        failure = _as_refit(e, f"receiving version {newest} of {self._what()}", errors.TransportError)
            failure = _fail(errors.Timeout, f"the tensor-parallel workers received different versions of {self._what()} "
                            f"and did not come to one; nothing was applied: {self._in_force()}")
            self._settled(failure, None, applied=False)
            return None

        def _gathered(self, mine: Any) -> list[Any]:
            """``mine`` from every tensor-parallel worker of this step, in rank order (vLLM's
            CPU group of the tensor-parallel workers, which all run the same step)."""
            from vllm.distributed import parallel_state as ps

            group = ps.get_tp_group()
            if group.world_size <= 1:
                return [mine]
            every: list[Any] = [None] * group.world_size
            torch.distributed.all_gather_object(every, mine, group=group.cpu_group)
            return every

        def finish_weight_update(self) -> None:
            """Completes vLLM's layerwise reload and acknowledges the version loaded to the
            sender (it is in force from now on).

            Raises:
            NeedsFullResend when completing the reload fails (the weights are mixed).
            """
            self._complete()

        def shutdown(self) -> None:
            """Closes the receiver (vLLM keeps serving the weights in force)."""
            self._disconnect()

        # -- internals ---------------------------------------------------------------------

        def _what(self, version: int | None = None) -> str:
            v = "" if version is None else f"version {version} of "
            if self._init is not None and self._init.mesh is not None:
                return f"{v}`{self._model_id}` (refit mesh of {len(self._init.mesh)} sender(s))"
            spec = _describe_spec(self._init.spec) if self._init is not None and self._init.spec else "?"
            return f"{v}`{self._model_id}` (refit spec {spec})"

        def _connect_mesh(self, init_info: RefitInitInfo) -> None:
            """Plans this worker's pull from the trainer shards ``init_info.mesh`` names: the
            part of each tensor of ``init_info.manifest`` its layers load (:func:`_tp_wants`).

            Raises:
            ConfigError naming the tensor: senders whose parts leave a gap or overlap in
            it, or a bad card or manifest. Unauthorized: no cluster token.
            """
            self._disconnect()
            assert init_info.manifest is not None and init_info.mesh is not None
            failure, mesh, wide, wants, whole = None, None, None, [], 0
            what = f"planning this worker's pull from the refit mesh ({len(init_info.mesh)} sender(s))"
            try:
                wants = _tp_wants(self.model, init_info.manifest)
                mesh = refit.MeshReceiver(init_info.manifest, list(init_info.mesh), wants)
                # each version lands in these, the same memory every time
                wide = _Wide(torch, init_info.manifest, wants)
                whole = sum(math.prod(shape) * refit._torch_dtype(torch, dtype).itemsize
                            for _, dtype, shape in init_info.manifest)
            except errors.RefitError as e:
                failure = _fail(type(e), f"{what}: {e}")
                failure.__cause__ = e
            except Exception as e:
                failure = _as_refit(e, what)
            if self._settled(failure, None, applied=False) or mesh is None:
                return
            if self.loaded_version is not None:
                self._serving = f"{self._serving} (from the sender connected before)"
            self.loaded_version = None
            self._mesh, self._mesh_wide = mesh, wide
            self._init, self._model_id = init_info, init_info.model or "policy"
            self.mesh_stats = {"wants": wants, "bytes_per_pull": mesh.bytes_per_pull, "bytes_pulled": 0,
                               "model_bytes": whole}
            sliced = sum(1 for _, part in wants if part != "whole")
            _log.info("refit: planned the pull of `%s` from %d mesh sender(s): %d of %d tensors sliced for this "
                      "worker, %d of the model's %d bytes per version", self._model_id, len(init_info.mesh),
                      sliced, len(wants), mesh.bytes_per_pull, whole)

        def _mesh_load(self, info: RefitUpdateInfo, started: float) -> None:
            """Pulls ``info.version`` of this worker's parts from the mesh into tensors of
            the checkpoint's shapes (:class:`_Wide`: the layers narrow each back to the part)
            and loads them through ``load_weights``, staged for :meth:`finish_weight_update`
            as :meth:`_load` stages."""
            assert self._mesh is not None and self._init is not None and self._init.manifest is not None
            want = info.version
            failure: errors.RefitError | None = None
            in_force = False
            if want is None or not info.is_checkpoint_format:
                why = "asks for a version by number: update_weights(version=...)" if want is None else \
                    "carries the checkpoint's format only (is_checkpoint_format=True)"
                failure = _fail(errors.ConfigError, f"a refit mesh pull {why}; nothing was applied: {self._in_force()}")
            else:
                in_force = not self.needs_full_resend and self.loaded_version is not None and self.loaded_version >= want
            # nothing to load only where it is in force in every worker
            every = self._gathered({"failure": _described(failure), "in_force": in_force})
            if any(e["failure"] for e in every):
                self._settled(failure, None, applied=False, every=[e["failure"] for e in every])
                return
            if all(e["in_force"] for e in every):
                _log.info("refit: version %d ≥ %d already in force: nothing to load", self.loaded_version, want)
                return
            if self._staged is not None:
                # a second version in one update session: the first is completed before its
                # tensors are overwritten by the pull (a reload may hold them till then)
                try:
                    self._complete()
                    self._begin()
                except Exception as e:
                    failure = _as_refit(e, "completing the version loaded before", errors.NeedsFullResend)
                if self._settled(failure, want, applied=True):
                    return
            try:
                assert self._mesh_wide is not None
                self._mesh.pull_into(want, self._mesh_wide.targets, info.timeout)
                self._mesh_wide.landed()
            except errors.RefitError as e:
                failure = _fail(type(e), f"pulling {self._what(want)}: {e}; nothing was applied: {self._in_force()}")
                failure.__cause__ = e
            except Exception as e:
                failure = _as_refit(e, f"pulling {self._what(want)}", errors.TransportError)
            if self._settled(failure, want, applied=False):
                return
            received = time.perf_counter()
            assert self._mesh_wide is not None
            pairs = self._mesh_wide.pairs
            try:
                # on the CPU as they are: each layer narrows its tensor there, so only the
                # worker's slice goes to its device
                self._load_checkpoint(pairs, want, to_device=False)
                if self._at_least("startup") and not self._tested:
                    self._run_self_test(pairs, want, True)
            except Exception as e:
                failure = _as_refit(e, f"loading {self._what(want)}", errors.NeedsFullResend)
            if self._settled(failure, want, applied=True):
                return
            pulled = self._mesh.bytes_per_pull
            if self.mesh_stats is not None:
                self.mesh_stats["bytes_pulled"] += pulled
            timings = {"receive_s": received - started, "load_s": time.perf_counter() - received,
                       "tensors": len(pairs), "bytes": pulled}
            self._staged = (_Unacked(), want, timings)

        def _settled(self, failure: errors.RefitError | None, version: int | None, *, applied: bool,
                     every: list[Any] | None = None, abandon: bool = True) -> bool:
            """Tells the tensor-parallel workers of this step whether each went through
            (``failure``: how this one did not), so that they end it alike; answers whether
            this worker is to return quietly. vLLM reads its workers' answers in rank order
            and stops at the first failure, leaving the others' to be taken as the answers
            of its next call: so a step that failed anywhere raises in the last worker alone,
            naming every failure, and the others return. Where it failed, a step that
            ``applied`` nothing leaves every worker serving what it served (the update
            session abandoned); one that loaded weights leaves them mixed, unless every
            worker refused the version before any of it landed.

            ``every``: the workers' failures already gathered (:func:`_described`).
            ``abandon=False``: a refusal that changed nothing anywhere (the update session
            in progress is left as it is).

            Raises:
            the failure (the only worker's), or one naming each worker's (the last worker's);
            NeedsFullResend when ending the step failed in any worker too (putting the
            previous weights back, or completing the reload), naming those failures after the
            step's: the weights are then of unknown state, and the next version loads whole.
            """
            from vllm.distributed import parallel_state as ps

            group = ps.get_tp_group()
            world, rank = group.world_size, group.rank_in_group
            if every is None:
                every = self._gathered(_described(failure))
            failed = [(r, f) for r, f in enumerate(every) if f is not None]
            if not failed:
                return False
            refused = len(failed) == world and all(kind == "Refused" for _, (kind, _) in failed)
            undone = self._end_failed_step(applied=applied, refused=refused, abandon=abandon,
                                           whole_here=failure is None, version=version)
            # each worker's ending, told to all (every worker of the step gets here alike)
            ends = [(r, e) for r, e in enumerate(self._gathered(_described(undone))) if e is not None]
            if rank != world - 1:
                return True
            if world == 1 and failure is not None and not ends:
                raise failure
            if ends:
                cls = errors.NeedsFullResend
            elif not applied:
                cls = getattr(errors, failed[0][1][0], errors.RefitError)
            else:
                cls = errors.Refused if refused else errors.NeedsFullResend
            texts = {text for _, (_, text) in failed}
            if world == 1:
                kind, text = failed[0][1]
                detail = f"failed: {kind}: {text}"  # raised as NeedsFullResend: the step's own kind named
            elif len(failed) == world and len(texts) == 1:
                detail = f"failed in every tensor-parallel worker ({world}): {texts.pop()}"
            else:
                detail = "failed in " + "; ".join(f"tensor-parallel worker {r} of {world}: {text}" for r, (_, text) in failed)
            if not ends:
                raise _fail(cls, detail)
            undid = "; ".join(("" if world == 1 else f"in tensor-parallel worker {r} of {world}: ") + f"{kind}: {text}"
                              for r, (kind, text) in ends)
            if undone is not None and failure is not None and undone.__context__ is None:
                undone.__context__ = failure
            raise _fail(cls, f"{detail}; then ending the update failed too ({undid}), so that no longer "
                        "holds: the weights are of unknown state until a version loads whole") from (undone or failure)

        def _end_failed_step(self, *, applied: bool, refused: bool, abandon: bool, whole_here: bool,
                             version: int | None) -> Exception | None:
            """Ends this worker's part of a step that failed somewhere (:meth:`_settled`):
            the previous weights put back where nothing was applied, the weights marked mixed
            where part of the version landed. Answers ``None``, or what went wrong doing so
            (then this worker's weights are of unknown state: the next version must load
            whole, and a reconnect is refused until one did, vLLM's reload being left open):
            it is reported, never raised, so that every worker still answers the step as
            :meth:`_settled` says."""
            try:
                if not applied:
                    if abandon:
                        self._abandon()
                elif not refused:
                    if whole_here:  # in this worker's weights, not whole across the workers
                        self._staged = None
                        self._finalize()
                    self._mixed(version)
            except Exception as e:
                self._staged = None
                self.needs_full_resend = True
                self.loaded_version = None
                self._serving = (f"weights of unknown state (ending a failed update of `{self._model_id}` "
                                 f"raised {type(e).__name__})")
                _log.error("refit: ending a failed update of %s failed: %s: %s; %s", self._what(),
                           type(e).__name__, e, self._in_force())
                return e
            return None

        def _in_force(self) -> str:
            return f"vLLM still serves {self._serving}"

        def _at_least(self, level: str) -> bool:
            """Whether the init info's ``verify`` includes ``level`` (:data:`VERIFY`'s order)."""
            verify = self._init.verify if self._init is not None else "names"
            return VERIFY.index(verify) >= VERIFY.index(level)

        def _digests_now(self) -> dict[str, str]:
            """Digests of what vLLM serves, keyed as vLLM's weight checker keys them."""
            if self._prefix is None:
                try:
                    self._prefix = _worker_prefix(self.vllm_config.parallel_config)
                except Exception as e:  # no parallel groups (a bare model): one worker
                    _log.debug("refit: no vLLM parallel groups (%s): weight-checker prefix of worker 0", e)
                    self._prefix = _checksum_prefix(0, 0, 0, 0)
            return _digests(self.model, self._prefix)

        def _check_served(self) -> None:
            """Before an update loads anything: what vLLM serves must digest as it did after
            the last load (recorded with ``verify="hashes"``). A difference is logged at error
            level and raised as Damaged; the weights are then treated as mixed (the next
            version must load whole) and the record dropped, so the next update loads."""
            if self._served is None or self.needs_full_resend:
                return
            version, recorded = self._served
            t = time.perf_counter()
            now = self._digests_now()
            self.verify_costs["check_s"] = time.perf_counter() - t
            found = _served_damage(recorded, now, self._what(version))
            if found is None:
                return
            key, message = found
            self._served = None
            self.needs_full_resend = True
            self.loaded_version = None
            self._serving = f"weights that changed while served (version {version} of `{self._model_id}` as loaded, `{key}` changed since)"
            message += "; nothing was loaded: vLLM still serves them, and the next version loaded replaces them"
            _log.error("refit: %s", message)
            raise _fail(errors.Damaged, message)

        def _run_self_test(self, pairs: list, version: int, checkpoint: bool) -> None:
            """The startup self-test (:func:`_self_test`) on ``version``, just loaded (its
            reload completed first): loaded twice more from ``pairs`` (the tensors already
            received), over zeros then over ones. Passes with the version in force; a
            parameter it finds unwritten, or a load that fails, leaves the weights mixed:
            NeedsFullResend naming the parameters, the model and the version."""
            t = time.perf_counter()

            def load() -> None:
                if checkpoint:
                    self._load_checkpoint(pairs, version)
                    self._finalize()
                else:
                    self._load_kernel(pairs, version)

            try:
                self._finalize()  # the version's own load, completed
                bad, costs = _self_test(self.model, load)
            except Exception as e:
                try:
                    self._finalize()
                except Exception:  # pragma: no cover - already failing
                    self._layerwise = False
                self._mixed(version)
                raise _fail(errors.NeedsFullResend, f"the self-test at the first update (verify=\"{self._init.verify}\") of {self._what(version)} failed loading it: {type(e).__name__}: {e}: the weights are mixed until a version loads whole") from e
            took = time.perf_counter() - t
            self.verify_costs.update({"self_test_s": took, "self_test_load_s": costs["load_s"],
                                      "self_test_fill_s": costs["fill_s"], "self_test_digest_s": costs["digest_s"]})
            if bad:
                self._mixed(version)
                named = ", ".join(f"`{n}`" for n in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
                raise _fail(errors.NeedsFullResend,
                            f"the self-test at the first update (verify=\"{self._init.verify}\") of {self._what(version)} found "
                            f"{len(bad)} parameter(s) the update path does not fully write: {named} (loaded over zeros, then over ones, "
                            f"the same version digests differently there): the weights are not the version (those parameters hold "
                            f"the test's pattern) until a version loads whole")
            self._tested = True
            _log.info("refit: self-test of the update path passed at %s: loaded over zeros and over ones, every parameter "
                      "written, in %.3f s (loads %.3f s, fills %.3f s, digests %.3f s)", self._what(version), took,
                      costs["load_s"], costs["fill_s"], costs["digest_s"])

        def _mixed(self, version: int) -> None:
            """Records that part of ``version`` landed: the next version must load whole."""
            self.needs_full_resend = True
            self.loaded_version = None
            self._serving = f"mixed weights (part of version {version} of `{self._model_id}`, which failed)"

        def _wait(self, info: RefitUpdateInfo) -> Any | None:
            """The update to load (None: the version asked is already in force)."""
            want = info.version
            if want is not None and not self.needs_full_resend and self.loaded_version is not None and self.loaded_version >= want:
                _log.info("refit: version %d ≥ %d already in force: nothing to load", self.loaded_version, want)
                return None
            assert self._receiver is not None and self._model_id is not None
            deadline = time.monotonic() + info.timeout
            skipped = []
            while True:
                left = deadline - time.monotonic()
                try:
                    update = self._receiver.receive(max(left, 0.0))
                except errors.RefitError as e:
                    raise _fail(type(e), f"receiving the next version of {self._what()}: {e}; nothing was applied: {self._in_force()}") from e
                if update is None:
                    asked = f"a version ≥ {want}" if want is not None else "a new version"
                    seen = f" (skipped older version(s) {', '.join(map(str, skipped))})" if skipped else ""
                    raise _fail(errors.Timeout, f"{asked} of {self._what()} did not come within {info.timeout:g} s{seen}; nothing was applied: {self._in_force()}")
                if self._model_id not in update.models:
                    update.ack()  # nothing in it for this engine
                    continue
                version = update.version(self._model_id)
                if want is not None and version < want:
                    skipped.append(version)
                    del update  # not applied: not acknowledged (a newer ack covers it)
                    continue
                return update

        def _begin(self) -> None:
            if self._layerwise:
                return
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            if self._expected is None:
                self._expected = _expected_params(self.model, self.model_config)
            initialize_layerwise_reload(self.model)
            self._layerwise = True

        def _finalize(self) -> None:
            if not self._layerwise:
                return
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._layerwise = False
            finalize_layerwise_reload(self.model, self.model_config)

        def _abandon(self) -> None:
            """After a failure that applied nothing: puts the previous weights back (a
            layerwise reload finalized with nothing loaded restores them); a version loaded
            earlier in the same session is completed."""
            if self._staged is not None:
                self._complete()
            else:
                self._restore()

        def _restore(self) -> None:
            """Finalizes a layerwise reload that loaded nothing: every layer gets its
            previous tensors back. vLLM warns "Failed to load weights" for each layer then,
            which is the point here: those warnings are silenced meanwhile."""
            quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                self._finalize()
            finally:
                quiet.setLevel(level)

        def _load(self, update: Any, info: RefitUpdateInfo, started: float) -> None:
            assert self._model_id is not None
            version = update.version(self._model_id)
            received = time.perf_counter()
            try:
                pairs = update.torch(self._model_id)
            except errors.RefitError as e:
                self._abandon()
                raise _fail(type(e), f"reading {self._what(version)}: {e}; nothing was applied: {self._in_force()}") from e
            nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
            if info.is_checkpoint_format:
                self._load_checkpoint(pairs, version)
            else:
                self._load_kernel(pairs, version)
            if self._at_least("startup") and not self._tested:
                self._run_self_test(pairs, version, info.is_checkpoint_format)
            loaded = time.perf_counter()
            timings = {"receive_s": received - started, "load_s": loaded - received, "tensors": len(pairs), "bytes": nbytes}
            self._staged = (update, version, timings)

        def _stream_load(self, info: RefitUpdateInfo, started: float) -> None:
            """Streams the next version into the model (``stream``): each tensor, once
            verified, goes through ``load_weights`` inside the layerwise reload (checkpoint
            format) or is copied into its parameter (kernel format); nothing of the version
            is kept. Staged for :meth:`finish_weight_update` as :meth:`_load` stages. With
            ``info.version``, a version older than it streams in, is completed and
            acknowledged, and the wait goes on (a streamed version is in the model before its
            number is known)."""
            want = info.version
            if want is not None and not self.needs_full_resend and self.loaded_version is not None and self.loaded_version >= want:
                _log.info("refit: version %d ≥ %d already in force: nothing to load", self.loaded_version, want)
                return
            assert self._receiver is not None and self._model_id is not None
            if self._staged is not None:
                # a second version in one update session: complete the first, then begin again
                self._complete()
            deadline = time.monotonic() + info.timeout
            older: list[int] = []
            while True:
                got, seen, fresh, loaded = self._stream_once(info, max(deadline - time.monotonic(), 0.0))
                if got is None:
                    self._abandon()
                    asked = f"a version ≥ {want}" if want is not None else "a new version"
                    passed = f" (streamed in older version(s) {', '.join(map(str, older))} meanwhile)" if older else ""
                    raise _fail(errors.Timeout, f"{asked} of {self._what()} did not come within {info.timeout:g} s{passed}; "
                                f"nothing was applied: {self._in_force()}")
                entries = [(m, v) for m, v in got]
                version = dict(entries).get(self._model_id)
                if version is None:  # only other models of the sender's: nothing of this one
                    self._receiver.ack(entries)
                    self._abandon()
                    continue
                if info.is_checkpoint_format and self._at_least("names"):
                    self._check_names(loaded, version, fresh)
                timings = {"receive_s": time.perf_counter() - started, "load_s": 0.0, "tensors": seen["tensors"],
                           "bytes": seen["bytes"]}
                self._staged = (_Acked(self._receiver, entries), version, timings)
                if want is None or version >= want:
                    return
                older.append(version)
                self._complete()  # in the model already: in force until the one asked for

        def _stream_once(self, info: RefitUpdateInfo, timeout: float) -> tuple[Any, dict, set[int], Any]:
            """One :meth:`refit.Receiver.stream` into the model, unacknowledged: what it
            returned (``None``: nothing within ``timeout``), what it applied, the layers the
            reload waited for before it, and the names ``load_weights`` loaded."""
            checkpoint = info.is_checkpoint_format
            if checkpoint:
                self._begin()
            elif self._layerwise:
                self._restore()
            fresh = _loadable_layers(self.model) if checkpoint else set()
            on_cpu = self.device is None or torch.device(self.device).type == "cpu"
            seen: dict[str, Any] = {"tensors": 0, "bytes": 0, "name": None, "version": None, "raised": False}
            loaded: set[str] | None = set()

            def apply(native: Any) -> None:
                nonlocal loaded
                if native.model != self._model_id:
                    return  # another model of the sender's: not this engine's
                name = seen["name"] = native.name
                seen["version"] = native.version
                try:
                    t = refit._torch_of(torch, native)
                    t = t if on_cpu else t.to(self.device, non_blocking=True)
                    if checkpoint:
                        got = self.model.load_weights([(name, t)])
                        loaded = None if got is None or loaded is None else loaded | set(got)
                    else:
                        from vllm.model_executor.model_loader.reload.inplace import get_parameter_for_reload

                        param = get_parameter_for_reload(self.model, name)
                        if tuple(param.shape) != tuple(t.shape):
                            raise ValueError(f"tensor `{name}` is {list(t.shape)}, vLLM's parameter is {list(param.shape)}")
                        with torch.no_grad():
                            param.copy_(t)
                except BaseException:
                    seen["raised"] = True
                    raise
                seen["tensors"] += 1
                seen["bytes"] += t.numel() * t.element_size()

            try:
                from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
            except ImportError:  # pragma: no cover - older vLLM
                from contextlib import nullcontext as disable_mtp_completeness_check
            try:
                with disable_mtp_completeness_check():
                    got = self._receiver._r.stream(apply, timeout, False)
            except errors.RefitError as e:
                if seen["tensors"] == 0 and not seen["raised"]:
                    # the transfer failed before anything reached this model: its own class
                    # (a NeedsFullResend about another model's tensors: what caused it)
                    cls = type(e)
                    if isinstance(e, errors.NeedsFullResend):
                        cause = e.__cause__
                        cls = type(cause) if isinstance(cause, errors.RefitError) else errors.Refused
                    self._abandon()
                    raise _fail(cls, f"receiving the next version of {self._what()}: {e}; nothing was applied: "
                                f"{self._in_force()}") from e
                raise self._stream_failed(seen, fresh, checkpoint, e) from e
            except Exception as e:
                raise self._stream_failed(seen, fresh, checkpoint, e) from e
            except BaseException as e:
                # KeyboardInterrupt and the like go on as themselves, the reload ended first
                self._stream_failed(seen, fresh, checkpoint, e)
                raise
            return got, seen, fresh, loaded

        def _stream_failed(self, seen: dict, fresh: set[int], checkpoint: bool, e: BaseException) -> errors.RefitError:
            """The exception for a streamed version that failed with ``e`` after ``seen`` (as
            :meth:`_failed` says for the checkpoint format; for the kernel format, mixed once
            a tensor was copied)."""
            version = seen["version"]
            at = f" at tensor `{seen['name']}`" if seen["name"] else ""
            cause = f"streaming it into the model failed{at}: {type(e).__name__}: {e}"
            refused = "{what} refused before any of it reached vLLM's weights: {cause}; {in_force}"
            mixed = "{what} failed part-way into vLLM's weights ({cause}): the weights are mixed until the next version loads whole"
            if checkpoint:
                return self._failed(version, fresh, cause, refused=refused, mixed=mixed)
            if not seen["tensors"]:
                return _fail(errors.Refused, refused.format(what=self._what(version), cause=cause, in_force=self._in_force()))
            self._mixed(version)
            return _fail(errors.NeedsFullResend, mixed.format(what=self._what(version), cause=cause, in_force=self._in_force()))

        def _device_pairs(self, pairs: list, current: list, to_device: bool = True) -> Any:
            on_cpu = not to_device or self.device is None or torch.device(self.device).type == "cpu"
            for name, t in pairs:
                current[0] = name
                yield name, (t if on_cpu else t.to(self.device, non_blocking=True))

        def _load_checkpoint(self, pairs: list, version: int, to_device: bool = True) -> None:
            """``load_weights`` inside a layerwise reload (begun here if no session is);
            ``to_device=False`` hands the tensors over where they are."""
            self._begin()
            fresh = _loadable_layers(self.model)
            current = [None]
            try:
                from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
            except ImportError:  # pragma: no cover - older vLLM
                from contextlib import nullcontext as disable_mtp_completeness_check
            try:
                with disable_mtp_completeness_check():
                    loaded = self.model.load_weights(self._device_pairs(pairs, current, to_device))
            except Exception as e:
                cause = f"the model's load_weights failed at tensor `{current[0]}`: {type(e).__name__}: {e}"
                raise self._failed(
                    version, fresh, cause,
                    refused="{what} refused by vLLM before any of it was applied: {cause}; {in_force}",
                    mixed="{what} failed part-way into vLLM's weights ({cause}): the weights are mixed until the next version loads whole",
                ) from e
            if self._at_least("names"):
                self._check_names(loaded, version, fresh)

        def _check_names(self, loaded: Any, version: int, fresh: set[int]) -> None:
            """Checks that ``load_weights``, which returned ``loaded`` (the names of the
            parameters it filled), filled every parameter a full version fills. A parameter
            it did not is stale while the rest of the version landed: NeedsFullResend
            (Refused when none of the version reached the model)."""
            if self.model_config is not None and getattr(self.model_config, "quantization", None) is not None:
                why = f"the model is quantized ({self.model_config.quantization}): some of its parameters come from no checkpoint"
            elif loaded is None:
                why = f"{type(self.model).__name__}.load_weights returns no set of the parameters it loaded"
            elif self._expected is None:
                why = "the model's parameters were not recorded before the reload"
            else:
                why = None
            if why is not None:
                if not self._unchecked_said:
                    self._unchecked_said = True
                    _log.warning("refit: not checking that each version fills every parameter of `%s` (verify=\"names\"): %s", self._model_id, why)
                return
            assert self._expected is not None
            missing = _not_loaded(self._expected, loaded)
            if not missing:
                return
            cause = (f"load_weights filled {len(self._expected) - len(missing)} of the model's {len(self._expected)} parameters: "
                     f"not `{missing[0]}`" + (f" nor {len(missing) - 1} more" if len(missing) > 1 else "")
                     + " (a tensor missing from the version, or one the model skipped)")
            raise self._failed(
                version, fresh, cause,
                refused="{what} refused: {cause}; nothing was applied: {in_force}",
                mixed="{what} did not load whole: {cause} while the rest of the version landed: the weights are mixed until the next version loads whole",
            )

        def _failed(self, version: int, fresh: set[int], cause: str, *, refused: str, mixed: str) -> errors.RefitError:
            """Ends a ``load_weights`` of ``version`` that failed for ``cause`` and answers the
            exception to raise. A reload that touched no layer (of those ``fresh`` before
            it) is undone and answers Refused, worded by ``refused``; one that touched some
            is completed, the weights are recorded as mixed and it answers NeedsFullResend,
            worded by ``mixed``. A reload that cannot be completed counts as touched. Both
            wordings are ``str.format`` templates of ``what``, ``cause`` and ``in_force``."""
            touched = _touched(self.model, fresh)
            try:
                (self._finalize if touched else self._restore)()
            except Exception as f:  # the model is in an unknown state
                touched = True
                cause += f"; then completing the reload failed: {type(f).__name__}: {f}"
            if not touched:
                return _fail(errors.Refused, refused.format(what=self._what(version), cause=cause, in_force=self._in_force()))
            self._mixed(version)
            return _fail(errors.NeedsFullResend, mixed.format(what=self._what(version), cause=cause, in_force=self._in_force()))

        def _load_kernel(self, pairs: list, version: int) -> None:
            """Copies kernel-format tensors into the parameters of the same names, after
            checking every name and shape (a mismatch applies nothing)."""
            from vllm.model_executor.model_loader.reload.inplace import get_parameter_for_reload

            if self._layerwise:
                self._restore()  # nothing loaded yet: puts the kernel tensors back
            targets = []
            for name, t in pairs:
                try:
                    param = get_parameter_for_reload(self.model, name)
                except AttributeError as e:
                    raise _fail(errors.Refused, f"{self._what(version)} refused: vLLM has no parameter `{name}` ({e}); nothing was applied: {self._in_force()}") from e
                if tuple(param.shape) != tuple(t.shape):
                    raise _fail(errors.Refused, f"{self._what(version)} refused: tensor `{name}` is {list(t.shape)}, vLLM's parameter is {list(param.shape)}; nothing was applied: {self._in_force()}")
                targets.append((param, t))
            current = [None]
            try:
                with torch.no_grad():
                    for (param, _), (name, t) in zip(targets, self._device_pairs(pairs, current)):
                        param.copy_(t)
            except Exception as e:
                self._mixed(version)
                raise _fail(errors.NeedsFullResend, f"{self._what(version)} failed part-way at tensor `{current[0]}`: {type(e).__name__}: {e}: the weights are mixed until the next version loads whole") from e

        def _complete(self) -> None:
            """Finalizes the reload, then acknowledges the staged version (in force now)."""
            staged, self._staged = self._staged, None
            try:
                self._finalize()
            except Exception as e:
                if staged is None:
                    raise
                self._mixed(staged[1])
                raise _fail(errors.NeedsFullResend, f"completing the reload of {self._what(staged[1])} failed: {type(e).__name__}: {e}: the weights are mixed until the next version loads whole") from e
            if staged is None:
                return
            update, version, timings = staged
            self._served = None
            if self._at_least("hashes"):
                t = time.perf_counter()
                try:
                    self._served = (version, self._digests_now())
                except Exception as e:  # pragma: no cover - digests need only the parameters
                    _log.warning("refit: %s is in force but digesting it failed (verify=\"hashes\" checks nothing until the next load): %s: %s",
                                 self._what(version), type(e).__name__, e)
                self.verify_costs["hash_s"] = timings["hash_s"] = time.perf_counter() - t
            self.loaded_version = version
            self._serving = f"version {version}"
            self.needs_full_resend = False
            try:
                update.ack()
            except errors.RefitError as e:
                # in force all the same; the sender will see this receiver as late or gone
                _log.warning("refit: %s is in force but acknowledging it failed: %s", self._what(version), e)
            hashed = f", digested in {timings['hash_s']:.3f} s" if "hash_s" in timings else ""
            _log.info("refit: %s in force (%d tensors, %d bytes): received in %.3f s, loaded in %.3f s%s",
                      self._what(version), timings["tensors"], timings["bytes"], timings["receive_s"], timings["load_s"], hashed)

        def _close(self) -> None:
            self._mesh, self._mesh_wide = None, None  # holds no connection between pulls
            receiver, self._receiver = self._receiver, None
            if receiver is not None:
                try:
                    receiver.close()
                except Exception as e:
                    _log.warning("refit: closing the receiver of %s: %s", self._what(), e)

    class _Unacked:
        """A mesh version: the shards keep their newest versions, no acknowledgement."""

        def ack(self) -> None:
            pass

    class _Acked:
        """The acknowledgement of streamed ``entries``, sent once the version is in force."""

        def __init__(self, receiver: Any, entries: list) -> None:
            self._receiver, self._entries = receiver, entries

        def ack(self) -> None:
            self._receiver.ack(self._entries)

    def _loadable_layers(model: torch.nn.Module) -> set[int]:
        """The modules a layerwise reload is waiting to load (before ``load_weights``)."""
        try:
            from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        except ImportError:  # pragma: no cover - another vLLM layout: assume the worst
            return set()
        return {id(m) for m in model.modules() if get_layerwise_info(m).can_load()}

    def _touched(model: torch.nn.Module, fresh: set[int]) -> bool:
        """Whether a failed ``load_weights`` got any tensor into the model: a layer
        processed (copied into the served tensors) or holding buffered weights that
        finalizing would process. Unknown (another vLLM layout): True."""
        try:
            from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        except ImportError:  # pragma: no cover
            return True
        if not fresh:
            return True
        for m in model.modules():
            info = get_layerwise_info(m)
            if info.load_numel > 0 or (id(m) in fresh and not info.can_load()):
                return True
        return False

    for cls in (RefitInitInfo, RefitUpdateInfo, RefitWeightTransferEngine):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return {
        "RefitWeightTransferEngine": RefitWeightTransferEngine,
        "RefitInitInfo": RefitInitInfo,
        "RefitUpdateInfo": RefitUpdateInfo,
    }
