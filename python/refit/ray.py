"""Refit between Ray actors: the trainer triggers each receiver actor by a Ray call, and the
receiver pulls the version through a Refit link (TorchRL's Ray shape, with Refit's bytes).

A receiver is any Ray actor class that mixes in :class:`RefitReceiver` and says how it loads
a version::

    @ray.remote
    class Engine(RefitReceiver):
        def __init__(self):
            self.model = make_model()

        def load_weights(self, update):               # a refit.Update
            self.model.load_state_dict(update.state_dict())

The trainer (a driver or an actor) publishes through a :class:`RaySender`::

    engines = {"engine-0": Engine.remote(), "engine-1": Engine.remote()}
    sender = RaySender("tcp", model.state_dict(), engines)
    sender.connect()                  # each engine connects and loads version 1
    for step in ...:
        train(model)
        sender.send(model.state_dict())   # each engine pulls, loads, acknowledges

``send`` calls ``_receive_weights_scheme(version)`` on every receiver actor (the entry point
TorchRL's Ray schemes use), after which each pulls the version through the link and
acknowledges it; it returns once all did. A receiver that does not within ``timeout`` fails
it with :class:`~refit.errors.ReceiversLate`, a dead one with
:class:`~refit.errors.ReceiversGone`, both naming the actors.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from . import Receiver, Sender, Update
from .errors import ConfigError, PeerGone, ReceiversGone, ReceiversLate, RefitError, Timeout

__all__ = ["RaySender", "RefitReceiver"]

_NEEDS_TOKEN = {"tcp", "broadcast"}


class RefitReceiver:
    """Mixin for a Ray actor class that receives Refit versions. Define
    :meth:`load_weights`; the sender calls the rest through Ray."""

    def load_weights(self, update: Update) -> None:
        """Loads ``update`` (a :class:`refit.Update`: ``state_dict()``, ``arrays()``...) into
        the actor's model. Raising refuses the version: it is not acknowledged, the sender
        names this actor, and the actor keeps what it served."""
        raise NotImplementedError(f"{type(self).__name__} must define load_weights(update)")

    def _refit_connect(self, spec: str, token: str | None, timeout: float) -> int:
        """Connects to the sender and loads its first version; returns that version."""
        lock = self.__dict__.setdefault("_refit_lock", threading.Lock())
        with lock:
            if getattr(self, "_refit_receiver", None) is not None:
                self._refit_receiver.close()
            self._refit_receiver = Receiver(spec, timeout=timeout, token=token)
            first = self._refit_receiver.current()
            self.load_weights(first)
            self._refit_version = first.version()
            return self._refit_version

    def _receive_weights_scheme(self, model_version: int | None = None, timeout: float = 30.0) -> int:
        """Pulls versions until it holds ``model_version`` (the next one when ``None``),
        loads it, acknowledges it and returns it; raises :class:`~refit.errors.Timeout` when it
        does not come within ``timeout`` seconds."""
        receiver = getattr(self, "_refit_receiver", None)
        if receiver is None:
            raise ConfigError(f"{type(self).__name__}: not connected (the sender calls connect() first)")
        with self.__dict__["_refit_lock"]:
            have = getattr(self, "_refit_version", 0)
            want = have + 1 if model_version is None else model_version
            deadline = time.monotonic() + timeout
            while have < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(
                        f"{type(self).__name__}: version {want} did not come within {timeout:g} s "
                        f"(holding {have})"
                    )
                update = receiver.receive(min(left, 1.0))
                if update is None:
                    continue
                self.load_weights(update)
                update.ack()
                have = self._refit_version = update.version()
            return have

    def refit_version(self) -> int:
        """The version this actor serves (0 before it connected)."""
        return getattr(self, "_refit_version", 0)


def _names(receivers: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
    if isinstance(receivers, Mapping):
        return {str(k): v for k, v in receivers.items()}
    return {f"receiver-{i}": h for i, h in enumerate(receivers)}


class RaySender:
    """The trainer's end: publishes a ``state_dict`` (or dict of numpy arrays) to Ray actors
    that mix in :class:`RefitReceiver`.

    Args:
        transport: the Refit link (``"tcp"`` across hosts; ``"shm"`` when every receiver is on
            this host; ``"file"``, ``"broadcast"``).
        weights: the initial weights: they fix the manifest and are version 1.
        receivers: the receiver actor handles, as ``{name: handle}`` (names appear in errors)
            or a list (named ``receiver-0``...).
        model: the model's name in Refit (default ``policy``).
        timeout: seconds for each wait (connect, each receiver's pull and load).
        token: cluster token for ``tcp`` / ``broadcast`` (else ``REFIT_TOKEN``, else a random
            one, handed to the receivers by their Ray call).
        dir: where shared-memory segments or files go.
        checksum: a checksum per version, verified by every receiver before it loads it
            (shared memory; TCP checks every bucket whatever this says).
    """

    def __init__(
        self,
        transport: str,
        weights: Mapping[str, Any],
        receivers: Mapping[str, Any] | Sequence[Any],
        *,
        model: str = "policy",
        timeout: float = 30.0,
        token: str | None = None,
        dir: str | os.PathLike | None = None,
        checksum: bool = False,
    ) -> None:
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive seconds, got {timeout}")
        self.receivers = _names(receivers)
        if not self.receivers:
            raise ConfigError("RaySender: no receivers")
        self.model = model
        self.timeout = float(timeout)
        if transport in _NEEDS_TOKEN and token is None:
            token = os.environ.get("REFIT_TOKEN") or secrets.token_hex(16)
        self._token = token
        self._sender = Sender(
            transport,
            weights,
            model=model,
            receivers=len(self.receivers),
            dir=dir,
            token=token,
            checksum=checksum,
        )
        self.transport = transport
        self.version = 0

    @property
    def spec(self) -> str:
        """The text receivers connect with."""
        return self._sender.spec

    def connect(self) -> int:
        """Has every receiver connect and load version 1; returns 1.

        Raises:
            ReceiversLate: some receivers did not connect within ``timeout`` (named).
            ReceiversGone: some receiver actors died (named).
        """
        calls = {
            name: h._refit_connect.remote(self.spec, self._token, self.timeout)
            for name, h in self.receivers.items()
        }
        try:
            self._sender.start(self.timeout)
        except (Timeout, PeerGone) as e:
            self._gather(calls, 1, "connect", cause=e)
        self.version = 1
        self._gather(calls, 1, "connect")
        return 1

    def send(self, weights: Mapping[str, Any]) -> int:
        """Publishes ``weights`` as the next version and returns it once every receiver
        loaded and acknowledged it.

        Raises:
            Refused: the weights differ from the manifest (names the tensor).
            ReceiversLate, ReceiversGone: as for :meth:`connect`.
        """
        sent = dict(self._sender.publish(weights, self.timeout))
        self.version = sent[self.model]
        calls = {
            name: h._receive_weights_scheme.remote(self.version, self.timeout)
            for name, h in self.receivers.items()
        }
        self._gather(calls, self.version, "load")
        self._sender.wait(self.timeout)
        return self.version

    def _gather(
        self, calls: Mapping[str, Any], version: int, doing: str, cause: BaseException | None = None
    ) -> None:
        """Waits for every call within ``timeout``; raises naming the receivers that failed
        (dead first, then late or refusing)."""
        names = {ref: name for name, ref in calls.items()}
        done, pending = ray.wait(list(names), num_returns=len(names), timeout=self.timeout)
        gone, failed = [], []
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                gone.append(names[ref])
            except Exception as e:  # noqa: BLE001 - the receiver's own error, named below
                failed.append(f"{names[ref]}: {_cause(e)}")
        late = sorted(names[r] for r in pending)
        for ref in pending:
            ray.cancel(ref)
        where = f"version {version} of `{self.model}` over {self.transport}"
        if gone:
            raise ReceiversGone(
                f"receiver actor(s) {sorted(gone)} died before they could {doing} {where}",
                receivers=sorted(gone),
            )
        if late or failed or cause is not None:
            detail = "; ".join(failed + ([str(cause)] if cause is not None else []))
            who = late + [f.split(":", 1)[0] for f in failed]
            raise ReceiversLate(
                f"receiver actor(s) {who} did not {doing} {where} within {self.timeout:g} s"
                + (f": {detail}" if detail else ""),
                receivers=who,
            )

    def close(self) -> None:
        """Releases the link; receivers see the sender gone."""
        try:
            self._sender.close()
        except RefitError:
            pass

    def __enter__(self) -> RaySender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cause(e: BaseException) -> str:
    """The first line of a Ray task error's cause."""
    inner = getattr(e, "cause", None) or e
    return str(inner).strip().splitlines()[-1] if str(inner).strip() else type(inner).__name__
