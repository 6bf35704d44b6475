"""Refit from Python: receive a trainer's weights in an engine, or publish them from a trainer.

A receiver connects from the spec its sender gave out (text, or a file holding it) and reads
each version in place: the arrays and tensors it hands out are zero-copy, read-only views of
the received memory (a shared-memory slot, a mapped file, an arena), valid while the update
is held::

    import refit

    receiver = refit.Receiver(open("policy.spec").read())   # REFIT_TOKEN for tcp
    while True:
        update = receiver.receive(timeout=1.0)           # None when nothing new came
        if update is not None:
            model.load_state_dict(update.state_dict())   # torch tensors, no copy
            update.ack()                                 # the trainer may go on

A sender publishes a dict of arrays (numpy, or torch CPU tensors: a ``state_dict``)::

    sender = refit.Sender("shm", model.state_dict(), receivers=1)
    print(sender.spec)        # hand it to the engines
    sender.start()            # waits for them, publishes version 1
    sender.send(model.state_dict())   # version 2, once every engine acknowledged it

Errors are :mod:`refit.errors` classes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from . import _native
from .errors import (
    Closed,
    ConfigError,
    Damaged,
    DTypeError,
    ManifestMismatch,
    NeedsFullResend,
    PeerGone,
    ReceiversGone,
    ReceiversLate,
    Refused,
    RefitError,
    Timeout,
    TransportError,
    Unauthorized,
)
from .errors import __all__ as _error_names

__version__ = _native.__version__

#: Refit dtypes numpy represents, and the numpy dtype of each.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "u8": np.dtype(np.uint8),
    "i8": np.dtype(np.int8),
    "i16": np.dtype("<i2"),
    "u16": np.dtype("<u2"),
    "i32": np.dtype("<i4"),
    "u32": np.dtype("<u4"),
    "i64": np.dtype("<i8"),
    "u64": np.dtype("<u8"),
    "f16": np.dtype("<f2"),
    "f32": np.dtype("<f4"),
    "f64": np.dtype("<f8"),
}
_FROM_NUMPY = {v: k for k, v in NUMPY_DTYPES.items()}
#: The dtypes numpy cannot represent, as unsigned integers of their width.
_RAW_DTYPES = {"bf16": np.dtype("<u2"), "f8_e4m3": np.dtype("u1"), "f8_e5m2": np.dtype("u1")}

_TORCH_NAMES = {
    "bool": "bool",
    "u8": "uint8",
    "i8": "int8",
    "i16": "int16",
    "u16": "uint16",
    "i32": "int32",
    "u32": "uint32",
    "i64": "int64",
    "u64": "uint64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "f8_e4m3": "float8_e4m3fn",
    "f8_e5m2": "float8_e5m2",
}


def transports() -> list[str]:
    """The transports a spec may name (``shm``, ``tcp``, ``file``, ``broadcast``...)."""
    return list(_native.transports())


def _spec_text(spec: str | os.PathLike) -> str:
    if isinstance(spec, os.PathLike):
        path = Path(spec)
    elif isinstance(spec, str) and ("/" in spec or os.path.isfile(spec)):
        path = Path(spec)
    else:
        return str(spec)
    try:
        return path.read_text()
    except OSError as e:
        raise ConfigError(f"reading the receiver spec {str(path)!r}: {e}") from e


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DTypeError("torch is not installed: use Update.items() for numpy arrays") from e
    return torch


def _numpy_of(t: Any, raw: bool) -> np.ndarray:
    """A read-only numpy view of the native tensor ``t`` (see :meth:`Update.items`)."""
    if not raw and t.dtype not in NUMPY_DTYPES:
        raise DTypeError(
            f"tensor `{t.name}` of `{t.model}` (version {t.version}) is {t.dtype}, "
            "which numpy cannot represent: use Update.torch(), or items(raw=True) for its bits"
        )
    return np.asarray(t)


def _streamed(apply: Callable[[str, Any], None], layouts: Callable[[], list[tuple[str, list]]], torch: bool,
              raw: bool) -> Callable[[Any], None]:
    """``apply(name, tensor)`` as a native stream calls it, with each native tensor: a torch
    tensor (``torch``) or a numpy array (``raw`` as for :meth:`Update.items`). A dtype that
    the library cannot hold is refused here, before anything streams, naming the tensor of
    ``layouts()`` (``(model, [(name, dtype, shape)])``, asked only when there is a dtype to
    check)."""
    if torch:
        t = _torch()
        for model, layout in layouts():
            for name, dtype, _ in layout:
                if getattr(t, _TORCH_NAMES.get(dtype, ""), None) is None:
                    raise DTypeError(f"tensor `{name}` of `{model}`: torch has no {dtype}")

        def call(x: Any) -> None:
            apply(x.name, _torch_of(t, x))
        return call
    if not raw:
        for model, layout in layouts():
            for name, dtype, _ in layout:
                if dtype not in NUMPY_DTYPES:
                    raise DTypeError(f"tensor `{name}` of `{model}` is {dtype}, which numpy cannot "
                                     "represent: stream with torch=True, or raw=True for its bits")

    def call_numpy(x: Any) -> None:
        apply(x.name, _numpy_of(x, raw))
    return call_numpy


def _torch_dtype(torch: Any, dtype: str, name: str = "?") -> Any:
    """torch's dtype for Refit's dtype name ``dtype`` (of tensor ``name``, for the error)."""
    attr = _TORCH_NAMES.get(dtype)
    target = getattr(torch, attr, None) if attr else None
    if target is None:
        raise DTypeError(f"tensor `{name}`: torch has no {dtype}")
    return target


def _torch_view(torch: Any, dtype: str, name: str, array: Any) -> Any:
    """A read-only torch view of ``array`` (numpy, or anything ``np.asarray`` takes) as
    Refit's ``dtype``: same-width raw integers are reinterpreted (bf16, fp8)."""
    target = _torch_dtype(torch, dtype, name)
    with warnings.catch_warnings():
        # the views are read-only on purpose; torch warns that it cannot enforce that
        warnings.filterwarnings("ignore", message=".*not writable.*")
        x = torch.from_numpy(np.asarray(array))
    return x if x.dtype == target else x.view(target)


def _torch_of(torch: Any, t: Any) -> Any:
    """A read-only torch view of the native tensor ``t`` (see :meth:`Update.torch`)."""
    return _torch_view(torch, t.dtype, t.name, t)


class Update:
    """One version (of one or several models published together), held in place.

    The arrays and tensors it gives out are read-only views of the received memory; they
    keep that memory alive (a shared-memory slot stays pinned, a file mapped) for as long as
    any of them lives. Copy what must outlive the next few updates.
    """

    def __init__(self, native: Any) -> None:
        self._u = native

    @property
    def entries(self) -> list[tuple[str, int]]:
        """``(model, version)`` of each model in the update."""
        return list(self._u.entries)

    @property
    def models(self) -> list[str]:
        """The models in the update."""
        return list(self._u.models)

    def version(self, model: str | None = None) -> int:
        """The version of ``model`` (default: the only one)."""
        return self._u.version(model)

    def tensors(self, model: str | None = None) -> list[Any]:
        """The tensors of ``model`` as Refit describes them (``name``, ``dtype``,
        ``shape``, ``nbytes``), in the sender's order."""
        return list(self._u.tensors(model))

    def items(self, model: str | None = None, *, raw: bool = False) -> list[tuple[str, np.ndarray]]:
        """``(name, array)`` pairs: zero-copy, read-only numpy views. numpy has no bf16 or
        fp8: such a tensor raises :class:`DTypeError` naming it, unless ``raw`` (then it
        comes as unsigned integers of the same width)."""
        return [(t.name, _numpy_of(t, raw)) for t in self._u.tensors(model)]

    def arrays(self, model: str | None = None, *, raw: bool = False) -> dict[str, np.ndarray]:
        """:meth:`items` as a dict."""
        return dict(self.items(model, raw=raw))

    def torch(self, model: str | None = None) -> list[tuple[str, Any]]:
        """``(name, torch.Tensor)`` pairs on the CPU, zero-copy (``torch.from_numpy`` of the
        views), every dtype including bf16 and fp8. Read-only memory: copy before writing
        (``load_state_dict`` and vLLM's ``load_weights`` copy)."""
        torch = _torch()
        return [(t.name, _torch_of(torch, t)) for t in self._u.tensors(model)]

    def state_dict(self, model: str | None = None) -> dict[str, Any]:
        """:meth:`torch` as a dict, for ``module.load_state_dict``."""
        return dict(self.torch(model))

    def memory(self, model: str | None = None) -> tuple[int, int]:
        """``(address, length)`` of the memory holding ``model``'s version."""
        return self._u.memory(model)

    def checksums(self, model: str | None = None) -> list[int]:
        """xxh3 of each tensor, in order (what the transports verify)."""
        return list(self._u.checksums(model))

    def ack(self) -> None:
        """Tells the sender this version is applied. Idempotent."""
        self._u.ack()

    @property
    def acked(self) -> bool:
        """True once acknowledged."""
        return self._u.acked

    def __repr__(self) -> str:
        return f"Update({self.entries})"


class Receiver:
    """A receiver end of any Refit transport.

    ``spec`` is the text the sender gave out (``refit serve --spec-file``, a Refit sender's
    ``spec``, :attr:`Sender.spec`) or a path to a file holding it. The cluster token (TCP and
    the broadcast chain) comes from ``token``, else ``REFIT_TOKEN`` or the file
    ``REFIT_TOKEN_FILE`` names. Connecting waits up to ``timeout`` seconds for the sender's
    first version, which :meth:`current` then gives. Shared memory is read in place unless
    ``copy=True`` (then each version is copied out of the slot, which the sender may then
    reuse at once). ``delta`` says what a version after the first carries over TCP:
    ``"buckets"`` (default: the buckets holding a changed tensor), ``"elements"`` (those
    buckets as their element-level difference against the version held, compressed) or
    ``"off"`` (every byte); other transports ignore it.

    With ``stream=True`` the receiver is for :meth:`stream`: connecting does not receive the
    first version (the first :meth:`stream` hands it over), and over TCP no copy of any
    version is kept, so that a model as large as the host's memory can be updated in place
    (see :meth:`stream`).
    """

    def __init__(
        self,
        spec: str | os.PathLike,
        *,
        timeout: float = 30.0,
        token: str | None = None,
        copy: bool = False,
        delta: str = "buckets",
        stream: bool = False,
    ) -> None:
        self._r = _native.Receiver(_spec_text(spec), timeout, token, copy, delta, stream)

    @property
    def wire(self) -> tuple[int, int] | None:
        """``(landed, on_wire)``: the weight bytes this receiver's transfers landed and the
        bytes they read off the wire (fewer with ``delta="elements"``), where the transport
        counts them (TCP); ``None`` elsewhere."""
        return self._r.wire

    @property
    def transport(self) -> str:
        """The transport's name."""
        return self._r.transport

    @property
    def models(self) -> list[str]:
        """The models the sender publishes."""
        return list(self._r.models)

    def manifest(self, model: str | None = None) -> list[tuple[str, str, list[int]]]:
        """``(name, dtype, shape)`` of each tensor of ``model`` (default: the only one)."""
        return list(self._r.manifest(self._one(model)))

    def version(self, model: str | None = None) -> int:
        """The version in force for ``model`` (default: the only one)."""
        return self._r.version(self._one(model))

    def current(self) -> Update:
        """The weights in force (already acknowledged)."""
        return Update(self._r.current())

    def receive(self, timeout: float = 1.0) -> Update | None:
        """Waits up to ``timeout`` seconds for the next version; ``None`` if none came.

        The version is checked whole (manifest, checksums, order) before it is handed out;
        a refused one raises :class:`Refused` and the previous one stays in force. It is not
        acknowledged: call :meth:`Update.ack` once the engine serves it. The GIL is released
        while waiting and pulling; Ctrl-C interrupts the wait (a version that arrives
        meanwhile is given by the next call).
        """
        u = self._r.receive(timeout)
        return None if u is None else Update(u)

    def stream(self, apply: Callable[[str, Any], None], timeout: float = 1.0, *,
               torch: bool = False, raw: bool = False, ack: bool = True) -> list[tuple[str, int]] | None:
        """Waits up to ``timeout`` seconds for the next version and streams it into the
        caller's model: ``apply(name, tensor)`` is called for each tensor as soon as its
        bytes are in and verified (a read-only numpy array, or a torch tensor with
        ``torch=True``; ``raw`` as for :meth:`Update.items`), on this thread, while the
        rest of the version is still arriving. ``apply`` copies the tensor where the model
        serves it (``param.copy_(tensor)``, vLLM's ``load_weights([(name, tensor)])``); the
        tensor's memory is let go of once nothing refers to it.

        Over TCP with ``stream=True``, the receiver keeps no copy of the version: while it
        arrives, it holds the tensors of the buckets in flight and those waiting for or in
        ``apply`` (a few buckets' worth, and at least the largest tensor), not the model.
        Other transports (and TCP without ``stream=True``) receive the version whole first,
        then hand over a copy of each tensor.

        Returns the ``(model, version)`` pairs streamed, acknowledged to the sender once every
        tensor was applied (with ``ack=False``, once :meth:`ack` is called with them: an
        engine whose load completes after the last tensor); ``None`` if nothing came.

        The model is mixed while a version streams in. A failure once a tensor was applied
        (a damaged bucket, the sender gone, an exception of ``apply``) raises
        :class:`NeedsFullResend` (an exception of ``apply`` chained as its cause); over TCP
        with ``stream=True`` the next call streams the same version whole again while the
        sender keeps it. A failure before raises as itself, nothing applied. A dtype the
        arrays cannot represent is refused before anything streams. Ctrl-C is taken between
        two tensors. ``apply`` must not call this receiver.
        """
        def layouts() -> list[tuple[str, list]]:
            return [(model, self.manifest(model)) for model in self.models]
        got = self._r.stream(_streamed(apply, layouts, torch, raw), timeout, ack)
        return None if got is None else [(m, v) for m, v in got]

    def ack(self, entries: list[tuple[str, int]]) -> None:
        """Tells the sender these ``(model, version)`` pairs are applied (what
        ``stream(..., ack=False)`` returned). Acknowledging a version again does nothing;
        a version newer than the one in force (:meth:`version`) is refused."""
        for m, v in entries:
            if int(v) > self.version(m):
                raise ConfigError(f"`{m}` version {v} was not received (version {self.version(m)} is in force): "
                                  "acknowledge what stream returned")
        self._r.ack([(m, int(v)) for m, v in entries])

    def __iter__(self) -> Iterator[Update]:
        """Every next version, forever (until the sender is gone: :class:`PeerGone`)."""
        while True:
            u = self.receive(1.0)
            if u is not None:
                yield u

    def close(self) -> None:
        """Releases the transport. Idempotent."""
        self._r.close()

    @property
    def closed(self) -> bool:
        """True once closed."""
        return self._r.closed

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _one(self, model: str | None) -> str:
        if model is not None:
            return model
        models = self.models
        if len(models) != 1:
            raise ConfigError(f"the sender publishes {len(models)} models ({', '.join(models)}): name one")
        return models[0]

    def __repr__(self) -> str:
        return f"Receiver({self.transport}, models={self.models})"


def _bytes_of(model: str, name: str, value: Any) -> tuple[str, list[int], Any]:
    """``(refit dtype, shape, flat uint8 buffer)`` of a numpy array or a torch tensor."""
    mod = type(value).__module__
    if mod.startswith("torch"):
        torch = _torch()
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        names = {v: k for k, v in _TORCH_NAMES.items()}
        dtype = names.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise DTypeError(f"tensor `{name}` of `{model}`: refit has no {t.dtype}")
        shape = list(t.shape)
        flat = t.contiguous().reshape(-1)
        buf = flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)
        return dtype, shape, buf
    a = np.asarray(value)
    dtype = _FROM_NUMPY.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
    if dtype is None or a.dtype.byteorder == ">":
        raise DTypeError(f"tensor `{name}` of `{model}`: refit has no numpy dtype {a.dtype}")
    return dtype, list(a.shape), np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _program(join: Any, part: Any, roles: str) -> int:
    """``join(part, roles)`` as a rank program's body: 0 when the run ends well; 1 after one
    ``error: ...`` line on stderr (what ``refit launch`` repeats as the rank's cause), or
    when rank 0's run ended unsolved (as Refit's own trainer programs do)."""
    import sys

    try:
        report = join(part, roles)
    except Exception as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if report is not None and not report.get("solved", True):
        print(f"error: {_native.UNSOLVED}", file=sys.stderr)
        return 1
    return 0



def checksums(weights: Mapping[str, Any]) -> dict[str, int]:
    """The checksum (xxh3-64) of each tensor of ``weights`` (name → numpy array or torch
    tensor, on any device), as :meth:`Update.checksums` computes a version's: an engine hashes
    what it serves and compares (see :func:`verify_served`)."""
    bufs = {n: _bytes_of("served", n, v)[2] for n, v in weights.items()}
    return dict(zip(bufs, _native.checksums(list(bufs.values()))))


def verify_served(update: Update, served: Mapping[str, Any], model: str | None = None) -> None:
    """Checks that ``served`` (name → array or tensor: what the engine serves, in the
    version's names) holds exactly the bytes of ``update``'s version of ``model`` (the only
    model when left out), tensor by tensor. Run after an apply, it proves the apply landed
    whole; run again before the next one, that nothing changed the weights while they were
    served.

    Raises :class:`~refit.errors.Damaged` naming the first tensor whose bytes differ, or that
    is missing from ``served``."""
    names = [t.name for t in update.tensors(model)]
    expected = dict(zip(names, update.checksums(model)))
    which = update.models[0] if model is None else model
    version = update.version(model)
    missing = [n for n in names if n not in served]
    if missing:
        raise Damaged(f"model `{which}` v{version}: tensor `{missing[0]}` is not served", tensor=missing[0])
    found = checksums({n: served[n] for n in names})
    bad = [n for n in names if found[n] != expected[n]]
    if bad:
        more = f" ({len(bad)} tensors differ)" if len(bad) > 1 else ""
        raise Damaged(
            f"model `{which}` v{version}: tensor `{bad[0]}` as served hashes to "
            f"{found[bad[0]]:#018x}, as applied to {expected[bad[0]]:#018x}{more}",
            tensor=bad[0],
        )


def _by_model(weights: Mapping[str, Any], model: str) -> dict[str, Mapping[str, Any]]:
    if weights and all(isinstance(v, Mapping) for v in weights.values()):
        return dict(weights)
    return {model: weights}


class Sender:
    """A sender end of any Refit transport, publishing a Python trainer's arrays.

    ``weights`` is a ``state_dict`` (name → numpy array or torch CPU tensor) for one model
    called ``model``, or a dict model → ``state_dict`` for several published together. Its
    names, dtypes and shapes are the manifest receivers agree to; its values are published
    as version 1 by :meth:`start`. ``receivers`` is how many receivers :meth:`start` waits
    for. ``dir``: where shared-memory segments or files go. ``token``: as for
    :class:`Receiver` (TCP; a sender without one makes a random token, which then must be
    given to receivers). ``checksum``: the sender computes a checksum of each version as it
    writes it, and every receiver verifies it before it admits the version (shared memory,
    where it is off by default: a damaged version is then refused whole; TCP checks every
    bucket whatever this says).
    """

    def __init__(
        self,
        transport: str,
        weights: Mapping[str, Any],
        *,
        model: str = "policy",
        receivers: int = 0,
        dir: str | os.PathLike | None = None,
        token: str | None = None,
        checksum: bool = False,
    ) -> None:
        self._initial = _by_model(weights, model)
        self._model = model
        manifests = {}
        for m, sd in self._initial.items():
            manifests[m] = [(n, *_bytes_of(m, n, v)[:2]) for n, v in sd.items()]
        self._s = _native.Sender(
            transport,
            manifests,
            receivers,
            None if dir is None else os.fspath(dir),
            token,
            checksum,
        )
        self._started = False

    @property
    def spec(self) -> str:
        """The text receivers connect with (no secret in it)."""
        return self._s.spec

    @property
    def transport(self) -> str:
        """The transport's name."""
        return self._s.transport

    def start(self, timeout: float = 30.0, weights: Mapping[str, Any] | None = None) -> None:
        """Publishes version 1, after waiting up to ``timeout`` seconds for the receivers
        asked for: ``weights`` (as in the constructor) when given, else the weights given at
        construction."""
        if weights is not None:
            self._initial = _by_model(weights, self._model)
        self._s.start(self._flat(self._initial), timeout)
        self._initial = {}
        self._started = True

    def publish(self, weights: Mapping[str, Any], timeout: float = 30.0) -> list[tuple[str, int]]:
        """Publishes ``weights`` (as in the constructor) as the next version, without
        waiting for acknowledgements; returns ``(model, version)`` of each. Every tensor of
        the manifest must be given, with its dtype and shape."""
        if not self._started:
            self.start(timeout)
        return list(self._s.publish(self._flat(_by_model(weights, self._model)), timeout))

    def wait(self, timeout: float = 30.0) -> None:
        """Waits for every receiver to acknowledge the last version published."""
        self._s.wait(timeout)

    def send(self, weights: Mapping[str, Any], timeout: float = 30.0) -> list[tuple[str, int]]:
        """:meth:`publish`, then :meth:`wait`."""
        sent = self.publish(weights, timeout)
        self.wait(timeout)
        return sent

    def version(self, model: str | None = None) -> int:
        """The version in force for ``model`` (0 before :meth:`start`)."""
        return self._s.version(model or self._model)

    def close(self) -> None:
        """Releases the transport; receivers see the sender gone."""
        self._s.close()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _flat(by_model: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for m, sd in by_model.items():
            out[m] = {}
            for n, v in sd.items():
                dtype, shape, buf = _bytes_of(m, n, v)
                out[m][n] = buf
        return out


def _part_shape(shape: list[int], part: Any) -> list[int]:
    """The shape of ``part`` of a tensor of ``shape`` (a slice keeps its rank, a flat range
    is one-dimensional)."""
    if part == "whole":
        return list(shape)
    if isinstance(part, tuple) and len(part) == 4 and part[0] == "slice":
        _, dim, _, world = part
        out = list(shape)
        if 0 <= dim < len(out) and world > 0:
            out[dim] //= world
        return out
    if isinstance(part, tuple) and len(part) == 3 and part[0] == "flat":
        return [part[2] - part[1]]
    raise ConfigError(f'a part is "whole", ("slice", dim, rank, world) or ("flat", start, end), not {part!r}')


class MeshSender:
    """A trainer shard's end of a mesh: it holds ``parts`` of the tensors of ``manifest``
    (the whole model, ``(name, dtype, shape)`` per tensor, dtypes as Refit names them:
    ``"f32"``, ``"bf16"``, ...) and serves them, for each version it publishes, to every
    :class:`MeshReceiver` that wants a piece of them; no shard gathers the others' parts.
    A part is ``"whole"``, ``("slice", dim, rank, world)`` (a tensor-parallel shard) or
    ``("flat", start, end)`` (elements of the flattened tensor: an FSDP flat shard).
    :attr:`card` is what receivers are given (address and parts, no secret); the cluster
    token comes from ``token``, else ``REFIT_TOKEN``, else a random one. ``bind``: the
    address of its node (default loopback, any port). ``model`` names the model in errors.
    """

    def __init__(
        self,
        manifest: list[tuple[str, str, list[int]]],
        parts: list[tuple[str, Any]],
        *,
        token: str | None = None,
        bind: str | None = None,
        model: str = "policy",
    ) -> None:
        self._parts = list(parts)
        self._s = _native.MeshSender(list(manifest), self._parts, token, bind, model)

    @property
    def card(self) -> str:
        """What receivers are given to find this sender and know what it holds."""
        return self._s.card

    def publish(self, version: int, arrays: Mapping[str, Any]) -> None:
        """Publishes ``version``: ``arrays`` maps each part's tensor name to that part (a
        numpy array or torch CPU tensor holding the part in row-major order). A buffer of
        the wrong size is refused naming the tensor; the version must be newer than the
        last one."""
        missing = [n for n, _ in self._parts if n not in arrays]
        if missing:
            raise Refused(f"publish of version {version}: no array for {', '.join(missing)}")
        self._s.publish(version, [_bytes_of("mesh", n, arrays[n])[2] for n, _ in self._parts])


class MeshReceiver:
    """An engine's end of a mesh: it wants ``wants`` (parts, as for :class:`MeshSender`, in
    its own layout: a tensor-parallel worker wants its slice) of the tensors of
    ``manifest`` from the senders whose :attr:`MeshSender.card` are in ``senders``. The
    plan of which bytes come from which sender is made and checked once, here: senders
    whose parts leave a gap or overlap in a wanted tensor, or a slice that does not divide
    its dimension, raise :class:`ConfigError` naming the tensor and the elements.
    """

    def __init__(
        self,
        manifest: list[tuple[str, str, list[int]]],
        senders: list[str],
        wants: list[tuple[str, Any]],
        *,
        token: str | None = None,
    ) -> None:
        self._shapes = {n: (d, s) for n, d, s in manifest}
        self._wants = list(wants)
        self._r = _native.MeshReceiver(list(manifest), list(senders), self._wants, token)

    @property
    def bytes_per_pull(self) -> int:
        """Bytes each pull reads: the wanted parts, plus an 8-byte checksum per sender."""
        return self._r.bytes_per_pull

    def empty_parts(self) -> dict[str, np.ndarray]:
        """One new array per wanted part, of its shape and dtype (bf16 and fp8 as unsigned
        integers of the same width), for :meth:`pull_into` to fill version after version."""
        out = {}
        for name, part in self._wants:
            dtype, shape = self._shapes[name]
            np_dtype = NUMPY_DTYPES.get(dtype) or _RAW_DTYPES.get(dtype)
            if np_dtype is None:
                raise DTypeError(f"tensor `{name}` is {dtype}, which has no array dtype here")
            out[name] = np.empty(_part_shape(shape, part), dtype=np_dtype)
        return out

    def pull_into(self, version: int, parts: Mapping[str, Any], timeout: float = 30.0) -> None:
        """As :meth:`pull`, into ``parts`` (as :meth:`empty_parts` makes them: a writable,
        C-contiguous array of the part's size per wanted part, none overlapping another),
        with no new memory and no copy. On failure the arrays hold a mix of versions.

        Raises as :meth:`pull`; :class:`Refused` for a missing, read-only, non-contiguous or
        wrongly sized array (naming the tensor), or two overlapping (naming their places in
        the order of the wants)."""
        missing = [n for n, _ in self._wants if n not in parts]
        if missing:
            raise Refused(f"pull_into of version {version}: no array for {', '.join(missing)}")
        views = []
        for (name, _), size in zip(self._wants, self._r.part_bytes):
            try:
                view = memoryview(parts[name]).cast("B")  # its bytes, in place
            except (TypeError, ValueError) as e:
                raise Refused(f"pull_into of version {version}: the array for `{name}` is not a "
                              f"C-contiguous buffer ({e})") from e
            if view.nbytes != size:
                raise Refused(f"pull_into of version {version}: the array for `{name}` holds {view.nbytes} "
                              f"bytes, its part {size}")
            if view.readonly:
                raise Refused(f"pull_into of version {version}: the array for `{name}` is not writable")
            views.append(view)
        self._r.pull_into(version, views, timeout)

    def pull(self, version: int, timeout: float = 30.0, *, raw: bool = False) -> dict[str, np.ndarray]:
        """Pulls ``version`` of the wanted parts from every sender holding a piece of them
        at once, waiting up to ``timeout`` seconds for each to publish it; answers each
        wanted part as an array of its shape. The version comes whole or not at all: a
        sender that does not publish in time, no longer keeps it, or sends bytes that do
        not hash to its checksum raises, naming the sender. numpy has no bf16 or fp8: such
        a part raises :class:`DTypeError` unless ``raw`` (then unsigned integers of the
        same width)."""
        out = {}
        for (name, part), data in zip(self._wants, self._r.pull(version, timeout)):
            dtype, shape = self._shapes[name]
            np_dtype = NUMPY_DTYPES.get(dtype)
            if np_dtype is None:
                if not raw:
                    raise DTypeError(f"tensor `{name}` is {dtype}, which numpy cannot represent: pull(raw=True)")
                count = max(1, int(np.prod(_part_shape(shape, part))))
                np_dtype = np.dtype(f"<u{max(1, len(data) // count)}")
            out[name] = np.frombuffer(data, dtype=np_dtype).reshape(_part_shape(shape, part))
        return out


__all__ = [
    "MeshReceiver",
    "MeshSender",
    "Receiver",
    "Sender",
    "Update",
    "transports",
    "NUMPY_DTYPES",
    *_error_names,  # every error type, also at the top level: refit.Timeout is refit.errors.Timeout
    "checksums",
    "verify_served",
]
