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

Through vLLM's RPCs the worker's exception reaches the caller as a plain ``Exception``;
the helpers here (:func:`init_engine`, :func:`update_weights`) raise the
:mod:`refit.errors` class again, which every message names as ``[refit.errors.Kind]``.

Importing this module imports neither vLLM nor torch: the engine classes
(``RefitWeightTransferEngine``, ``RefitInitInfo``, ``RefitUpdateInfo``) are built on first
access. Logs go to the ``vllm.refit`` logger, so vLLM's logging settings apply to them.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from . import errors

__all__ = [
    "BACKEND",
    "register",
    "init_engine",
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


def update_weights(
    llm: Any,
    version: int | None = None,
    *,
    timeout: float = 60.0,
    is_checkpoint_format: bool = True,
    rpc_margin: float = 300.0,
) -> None:
    """Loads the trainer's next version (or the first one ≥ ``version``) into every worker
    of ``llm``: ``start_weight_update``, ``update_weights``, ``finish_weight_update`` as vLLM
    requires, then drops vLLM's prefix cache (its KV entries were computed with the previous
    weights). Each worker waits up to ``timeout`` seconds for the version; the RPC itself
    may take ``rpc_margin`` seconds more (loading).

    Raises:
    :class:`~refit.errors.Timeout`, :class:`~refit.errors.PeerGone`,
    :class:`~refit.errors.Refused`: nothing was applied, the previous weights stay in force.
    :class:`~refit.errors.NeedsFullResend`: part of the version landed; the next version
    that loads whole repairs the model (also a failed startup self-test, ``verify="startup"``).
    :class:`~refit.errors.Damaged` (``verify="hashes"``): the weights served changed since
    the last load; nothing was loaded, and the next update loads a version whole.
    """
    info = {"version": version, "timeout": timeout, "is_checkpoint_format": is_checkpoint_format}
    _rpc(llm, "start_weight_update", None)
    try:
        _rpc(llm, "update_weights", timeout + rpc_margin, update_info=info)
    except errors.NeedsFullResend:
        _reset_caches(llm)
        raise
    # a failed update_weights ends vLLM's update session itself (and the engine has put the
    # previous weights back): finish is only for a success
    _rpc(llm, "finish_weight_update", rpc_margin)
    _reset_caches(llm)


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

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache``."""
        self._post("reset_prefix_cache")

    def _post(self, route: str, body: dict[str, Any] | None = None) -> None:
        import json
        import urllib.error
        import urllib.request

        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(f"{self.url}/{route}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        if self.api_key is not None:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                r.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                detail = json.loads(text)
                detail = detail.get("error", detail).get("message", text) if isinstance(detail, dict) else text
            except (ValueError, AttributeError):
                pass
            else:
                text = str(detail)
            if e.code in (401, 403):
                raise errors.Unauthorized(f"vLLM at {self.url} refused the API key on /{route} (HTTP {e.code})") from e
            if e.code == 404:
                raise errors.ConfigError(f"vLLM at {self.url} has no /{route}: start it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{{\"backend\": \"refit\"}}'") from e
            raise Exception(f"vLLM at {self.url}: /{route} failed (HTTP {e.code}): {text}") from e
        except TimeoutError as e:
            raise errors.Timeout(f"vLLM at {self.url} did not answer /{route} within {self.timeout:g} s") from e
        except urllib.error.URLError as e:
            raise errors.PeerGone(f"vLLM at {self.url} cannot be reached (/{route}): {e.reason}") from e

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
    if not hasattr(llm, "collective_rpc"):
        raise errors.ConfigError(
            f"{type(llm).__name__} has no collective_rpc: ask a vLLM server for its digests with "
            "POST /weight_checker {\"action\": \"checksum\"}")
    try:
        answers = llm.collective_rpc(_worker_checksums)
    except TypeError as e:
        if "INSECURE_SERIALIZATION" not in str(e):
            raise
        raise errors.ConfigError(
            "refit.vllm.weight_checksums runs a function in vLLM's workers: start vLLM with "
            f"VLLM_ALLOW_INSECURE_SERIALIZATION=1 in its environment ({e})") from e
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

        ``spec``: the sender's spec, its text or the path of a file holding it (required).
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

        spec: str
        timeout: float = 60.0
        copy: bool = False
        model: str | None = None
        load_initial: bool = False
        verify: str = "names"
        stream: bool = False

        def __post_init__(self) -> None:
            if not isinstance(self.spec, str) or not self.spec.strip():
                raise ValueError("refit init_info: `spec` must be the sender's spec text or a path to it")
            if self.verify not in VERIFY:
                raise ValueError(f"refit init_info: `verify` must be one of {', '.join(map(repr, VERIFY))}, got {self.verify!r}")
            if not self.timeout >= 0:
                raise ValueError(f"refit init_info: `timeout` must be ≥ 0 seconds, got {self.timeout}")
            if self.stream and VERIFY.index(self.verify) > VERIFY.index("names"):
                # typed, so that it crosses vLLM's RPC as itself
                raise _fail(errors.ConfigError, f"refit init_info: `stream` keeps no copy of a version, which "
                            f"verify={self.verify!r} loads a second time for its self-test: use verify=\"names\" "
                            "or \"off\" with `stream`")

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
            self._init: RefitInitInfo | None = None
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
            before) and, with ``load_initial``, loads the sender's version in force.

            Raises:
            ConfigError (bad spec, unknown or ambiguous model), Unauthorized, Timeout;
            with ``load_initial`` as :meth:`receive_weights`.
            """
            if self._layerwise or self._staged is not None:
                raise _fail(errors.Closed, "cannot reconnect the refit engine during a weight update: finish it first")
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
            if init_info.stream:
                _log.info("refit: connected to the %s sender of `%s` (spec %s), streaming: the version in force "
                          "there comes with the first update", receiver.transport, self._model_id, where)
            else:
                _log.info("refit: connected to the %s sender of `%s` (spec %s), version %d in force there",
                          receiver.transport, self._model_id, where, receiver.version(self._model_id))
            if init_info.load_initial:
                from vllm.config import set_current_vllm_config

                with set_current_vllm_config(self.vllm_config):
                    if init_info.stream:
                        self._stream_load(RefitUpdateInfo(timeout=init_info.timeout), time.perf_counter())
                    else:
                        self._load(receiver.current(), RefitUpdateInfo(), time.perf_counter())
                    self._complete()

        def start_weight_update(self) -> None:
            """Begins vLLM's layerwise reload for the incoming checkpoint-format weights
            (as vLLM's own checkpoint-format engines do). With ``verify="hashes"`` first
            digests what vLLM serves and compares it with the digests recorded after the last
            load.

            Raises:
            Damaged when the weights changed while served (naming the parameter): nothing
            was loaded, vLLM serves them still; the next version loaded replaces them.
            """
            self._check_served()
            self._begin()

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
            self.receive_weights(self.parse_update_info(update_info))
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
            if self._receiver is None:
                raise _fail(errors.Closed, "the refit engine is not connected: call init_weight_transfer_engine with the sender's spec first")
            started = time.perf_counter()
            if self._init is not None and self._init.stream:
                self._stream_load(update_info, started)
                return
            try:
                update = self._wait(update_info)
            except errors.RefitError:
                self._abandon()
                raise
            if update is None:
                return
            if self._staged is not None:
                # a second version in one update session: complete the first, then begin again
                self._complete()
                self._begin()
            self._load(update, update_info, started)

        def finish_weight_update(self) -> None:
            """Completes vLLM's layerwise reload and acknowledges the version loaded to the
            sender (it is in force from now on).

            Raises:
            NeedsFullResend when completing the reload fails (the weights are mixed).
            """
            self._complete()

        def shutdown(self) -> None:
            """Closes the receiver (vLLM keeps serving the weights in force)."""
            self._close()

        # -- internals ---------------------------------------------------------------------

        def _what(self, version: int | None = None) -> str:
            v = "" if version is None else f"version {version} of "
            spec = _describe_spec(self._init.spec) if self._init is not None else "?"
            return f"{v}`{self._model_id}` (refit spec {spec})"

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

        def _device_pairs(self, pairs: list, current: list) -> Any:
            on_cpu = self.device is None or torch.device(self.device).type == "cpu"
            for name, t in pairs:
                current[0] = name
                yield name, (t if on_cpu else t.to(self.device, non_blocking=True))

        def _load_checkpoint(self, pairs: list, version: int) -> None:
            """``load_weights`` inside a layerwise reload (begun here if no session is)."""
            self._begin()
            fresh = _loadable_layers(self.model)
            current = [None]
            try:
                from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
            except ImportError:  # pragma: no cover - older vLLM
                from contextlib import nullcontext as disable_mtp_completeness_check
            try:
                with disable_mtp_completeness_check():
                    loaded = self.model.load_weights(self._device_pairs(pairs, current))
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
            receiver, self._receiver = self._receiver, None
            if receiver is not None:
                try:
                    receiver.close()
                except errors.RefitError as e:
                    _log.warning("refit: closing the receiver of %s: %s", self._what(), e)

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
