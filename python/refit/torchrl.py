"""Refit as a TorchRL weight-sync scheme.

``RefitWeightSyncScheme`` plugs into TorchRL wherever a ``WeightSyncScheme`` is asked for::

    from refit.torchrl import RefitWeightSyncScheme

    collector = MultiSyncCollector(
        [make_env] * 4,
        policy,
        frames_per_batch=200,
        total_frames=-1,
        weight_sync_schemes={"policy": RefitWeightSyncScheme("shm")},
    )
    for batch in collector:
        ...  # train
        collector.update_policy_weights_()   # every calling convention of TorchRL works

It follows TorchRL's life-cycle: ``init_on_sender`` opens a Refit sender for the policy's
manifest (no communication), the scheme is pickled to the workers, ``init_on_receiver`` keeps
each worker's module, and ``connect`` is the rendezvous: the sender publishes version 1, each
worker connects its Refit receiver and serves it. ``send`` publishes the next version and
waits until every worker applied it.

What it does beyond TorchRL's own schemes:

- **One copy per update, whatever the number of workers**: the trainer's tensors are copied
  once into a shared-memory slot; each worker's parameters *are* that slot's memory (read-only
  views), swapped for the next slot's at each update, never written while a worker reads them.
- **Never torn**: a worker reads one whole version per tensor; the trainer's optimizer steps
  are not visible to the workers until published (TorchRL's CPU shared-memory scheme shares
  the trainer's own storage).
- **Versions**: each worker's ``policy_version`` is Refit's version of what it serves.
- **Errors**: weights whose names, dtypes or shapes differ from the manifest raise
  :class:`~refit.errors.ManifestMismatch` naming the tensor; a worker that does not apply a
  version in time fails ``update_policy_weights_()`` with
  :class:`~refit.errors.ReceiversLate` naming the worker indices, never a hang.

``transport`` is any Refit transport a Python sender opens (``shm``, ``tcp``, ``file``,
``broadcast``). TCP and the broadcast chain use ``token`` (else ``REFIT_TOKEN``), else a
random token made at ``init_on_sender`` and handed to the workers with the scheme.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import time
from typing import Any

from torchrl._utils import logger as torchrl_logger
from torchrl.weight_update.utils import _resolve_model
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme

from . import Receiver, Sender, _weights
from .errors import (
    ConfigError,
    ManifestMismatch,
    PeerGone,
    ReceiversGone,
    ReceiversLate,
    RefitError,
    Timeout,
)

__all__ = ["RefitWeightSyncScheme"]

_NEEDS_TOKEN = {"tcp", "broadcast"}


class _RefitTransport:
    """The scheme's one transport, for TorchRL's code that iterates transports: sending goes
    through the scheme (a Refit version reaches every worker at once)."""

    def __init__(self, scheme: RefitWeightSyncScheme) -> None:
        self._scheme = scheme

    def send_weights(self, weights: Any) -> None:
        self._scheme._publish(weights)

    def wait_ack(self) -> None:
        self._scheme._wait_applied()

    def receive_weights(self, timeout: float | None = None, **_: Any) -> Any:
        return self._scheme._receive_once(timeout)

    def setup_connection_and_weights_on_sender(self) -> None:
        pass

    def setup_connection_and_weights_on_receiver(self, **_: Any) -> None:
        return None


class RefitWeightSyncScheme(WeightSyncScheme):
    """A TorchRL weight-sync scheme whose bytes move through a Refit link.

    Args:
        transport: the Refit transport (``"shm"`` by default; ``"tcp"``, ``"file"``,
            ``"broadcast"``).
        strategy: TorchRL's weight format, ``"tensordict"`` (default) or ``"state_dict"``;
            either reaches the workers as the same flat tensors.
        sync: ``send`` waits until every worker applied the version (default ``True``).
        timeout: seconds for each wait: the rendezvous, a free slot, the workers'
            acknowledgements (default 60).
        dir: where shared-memory segments or files go (default: the transport's).
        token: the cluster token for ``tcp`` and ``broadcast``.
        copy: ``True`` copies each version into the workers' own tensors instead of making
            their parameters views of the received memory (the default for a worker whose
            module lives on a GPU).
        checksum: the trainer checksums each version and every worker verifies it before
            serving it (shared memory; a damaged version is refused whole, and the workers
            keep the previous one).
    """

    def __init__(
        self,
        transport: str = "shm",
        strategy: str = "tensordict",
        *,
        sync: bool = True,
        timeout: float = 60.0,
        dir: str | os.PathLike | None = None,
        token: str | None = None,
        copy: bool = False,
        checksum: bool = False,
    ) -> None:
        super().__init__(strategy)
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive seconds, got {timeout}")
        self.transport = transport
        self.sync = sync
        self.timeout = float(timeout)
        self.dir = None if dir is None else os.fspath(dir)
        self.copy = copy
        self.checksum = checksum
        self._token = token
        self._spec: str | None = None
        self._manifest: list[_weights.Entry] = []
        self._num_workers = 0
        self._applied = None  # worker index -> version it serves (shared memory)
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        self._published = 0
        self._served: tuple[int, dict[str, Any]] | None = None
        self._devices: tuple[Any, set[str]] | None = None  # (module, its device types)
        self.setup_seconds: float | None = None

    # -- TorchRL's hooks ---------------------------------------------------------------------

    @property
    def context(self) -> Any | None:
        """The collector this scheme serves (TorchRL's ``context``)."""
        return self._context_ref() if self._context_ref is not None else None

    @context.setter
    def context(self, context: Any) -> None:
        # a worker's collector arrives after the first version was applied (TorchRL builds
        # the policy, connects, then the collector): it learns the version it serves now
        WeightSyncScheme.context.fset(self, context)
        served = getattr(self, "_served", None)
        if context is not None and served is not None:
            self._bump(*served)

    def create_transport(self, **kwargs: Any) -> _RefitTransport:
        return _RefitTransport(self)

    def _init_on_sender_impl(
        self,
        *,
        model_id: str | None = None,
        context: Any = None,
        weights: Any = None,
        model: Any = None,
        num_workers: int | None = None,
        ctx: Any = None,
        **_: Any,
    ) -> None:
        t0 = time.perf_counter()
        self.model_id = model_id or "policy"
        if context is not None:
            self.context = context
            if num_workers is None:
                num_workers = getattr(context, "num_workers", None)
        if num_workers is None or num_workers < 1:
            raise ConfigError(
                "RefitWeightSyncScheme.init_on_sender: num_workers is needed (or a collector "
                "as context)"
            )
        source = self._sender_source(weights, model, context)
        flat = _weights.flatten(self._strategy.extract_weights(source), "the sender's weights")
        if not flat:
            raise ManifestMismatch(f"model `{self.model_id}` has no tensors to publish")
        self._manifest = _weights.manifest_of(flat)
        self._num_workers = int(num_workers)
        if self.transport in _NEEDS_TOKEN and self._token is None:
            if not (os.environ.get("REFIT_TOKEN") or os.environ.get("REFIT_TOKEN_FILE")):
                self._token = secrets.token_hex(16)
        ctx = ctx if ctx is not None else mp.get_context()
        self._applied = ctx.Array("q", self._num_workers, lock=False)
        self._sender = Sender(
            self.transport,
            flat,
            model=self.model_id,
            receivers=self._num_workers,
            dir=self.dir,
            token=self._token,
            checksum=self.checksum,
        )
        self._spec = self._sender.spec
        self._register_worker_sender(worker_idx=0)
        self.setup_seconds = time.perf_counter() - t0

    def _sender_source(self, weights: Any, model: Any, context: Any) -> Any:
        if weights is not None:
            return weights
        if model is not None:
            return model
        if context is not None:
            for get in (
                lambda: context.get_model(self.model_id),
                lambda: _resolve_model(context, self.model_id),
                lambda: getattr(context, "_fallback_policy", None),
            ):
                try:
                    found = get()
                except (AttributeError, KeyError, RuntimeError, ValueError):
                    found = None
                if found is not None:
                    return found
        raise ConfigError(
            f"RefitWeightSyncScheme.init_on_sender: no weights for `{self.model_id}` "
            "(give weights=, model= or a collector as context)"
        )

    def _init_on_receiver_impl(
        self,
        model_id: str,
        context: Any = None,
        *,
        model: Any = None,
        worker_idx: int | None = None,
        **_: Any,
    ) -> None:
        self.model_id = model_id
        if context is not None:
            self.context = context
            worker_idx = getattr(context, "worker_idx", worker_idx)
            if model is None:
                model = context.get_model(model_id) if hasattr(context, "get_model") else None
        if model is not None:
            self.model = model
        if worker_idx is None:
            raise ConfigError("RefitWeightSyncScheme.init_on_receiver: worker_idx is needed")
        self.worker_idx = worker_idx
        self._register_transport_receiver()

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any = None
    ) -> None:
        t0 = time.perf_counter()
        sender = self._sender_or_raise()
        first = None
        if weights is not None:
            first = {self.model_id: self._flat_checked(weights, "connect(weights=...)")}
        try:
            sender.start(self.timeout, first)
        except (Timeout, PeerGone) as e:
            raise self._late(e, 1, "connect to the workers") from e
        self._published = 1
        self.setup_seconds = (self.setup_seconds or 0.0) + time.perf_counter() - t0

    def _setup_connection_and_weights_on_receiver_impl(
        self, *, worker_idx: int | None = None
    ) -> None:
        if self._spec is None:
            raise ConfigError(
                "RefitWeightSyncScheme: this scheme was not initialized on a sender before it "
                "was handed to the worker"
            )
        model = self.model
        if model is None:
            raise ConfigError(f"worker {self.worker_idx}: no module to load `{self.model_id}` into")
        own = _weights.flatten(model, f"worker {self.worker_idx}'s module")
        _weights.check(
            self._manifest,
            own,
            f"worker {self.worker_idx}'s module against the sender's `{self.model_id}`",
        )
        self._receiver = Receiver(self._spec, timeout=self.timeout, token=self._token)
        # the first version is copied: TorchRL connects the policy it built before its
        # collector exists, and may keep that object after it made the collector's own; a
        # view held there would pin its slot for good (the sender would then mark this
        # worker behind and it would copy every later version)
        self._apply(self._receiver.current(), private=True)
        self._start_background_receiver()

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Publishes the next version (extracted from the collector's policy when
        ``weights`` is None) and, with ``sync``, waits until every worker serves it.

        A Refit version reaches every worker: ``worker_ids`` is checked, then every worker
        gets the version (TorchRL's subsets exist to save copies Refit does not make).

        Raises:
            ManifestMismatch: the weights differ from the manifest (names the tensor).
            ReceiversLate: some workers did not apply it within ``timeout`` (names them).
            ReceiversGone: some workers died (names them).
        """
        if not self.initialized_on_sender:
            raise RuntimeError("Must be initialized on sender before sending weights")
        if not self.synchronized_on_sender:
            raise RuntimeError("Must be synchronized on sender before sending weights")
        if worker_ids is not None:
            ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
            unknown = [i for i in ids if not 0 <= int(i) < self._num_workers]
            if unknown:
                raise ValueError(f"Worker {unknown[0]} not registered")
        prepared = self.prepare_weights(
            weights=weights, model_id=self.model_id, strategy=self._strategy, context=self.context
        )
        self._publish(prepared)
        if self.sync:
            self._wait_applied()

    # -- sender ------------------------------------------------------------------------------

    def _sender_or_raise(self) -> Sender:
        if self._sender is None:
            raise RuntimeError("RefitWeightSyncScheme: no sender here (not init_on_sender)")
        return self._sender

    def _flat_checked(self, weights: Any, what: str) -> dict[str, Any]:
        if weights is None:
            raise ConfigError(f"{what}: no weights for `{self.model_id}`")
        flat = _weights.flatten(self._strategy.extract_weights(weights), what)
        _weights.check(self._manifest, flat, what)
        return flat

    def _publish(self, weights: Any) -> None:
        flat = self._flat_checked(weights, f"the weights sent for `{self.model_id}`")
        sent = self._sender_or_raise().publish(flat, self.timeout)
        self._published = dict(sent).get(self.model_id, self._published + 1)

    def _wait_applied(self) -> None:
        try:
            self._sender_or_raise().wait(self.timeout)
        except (Timeout, PeerGone) as e:
            raise self._late(e, self._published, "apply") from e
        # a receiver that died is let go by the transport (it does not hold the trainer):
        # every worker writes the version it serves before it acknowledges, so one that is
        # behind now is gone
        gone = self._behind(self._published)
        if gone:
            raise ReceiversGone(
                f"worker(s) {gone} did not apply version {self._published} of "
                f"`{self.model_id}`: gone from the {self.transport} link",
                receivers=gone,
            )

    def _behind(self, version: int) -> list[int]:
        applied = list(self._applied) if self._applied is not None else []
        return [i for i, v in enumerate(applied) if v < version]

    def _late(self, cause: RefitError, version: int, doing: str) -> RefitError:
        late = self._behind(version)
        kind = ReceiversGone if isinstance(cause, PeerGone) else ReceiversLate
        return kind(
            f"worker(s) {late} did not {doing} version {version} of `{self.model_id}` "
            f"within {self.timeout:g} s over {self.transport}: {cause}",
            receivers=late,
        )

    # -- receiver ----------------------------------------------------------------------------

    def _apply(self, update: Any, private: bool = False) -> None:
        flat = _weights.received(update, self.model_id)
        model = self.model
        devices = self._devices_of(model)
        if "meta" in devices:
            # a stateless policy (TorchRL ships one to its workers): it gets tensors of its
            # own, on the CPU; the collector moves them where it runs the policy
            private = True
            self._devices = None  # on the CPU from now on: looked at again next time
        if private:
            flat = {n: t.clone() for n, t in flat.items()}
        if not private and (self.copy or devices != {"cpu"}):
            _weights.copy_into(model, flat)
        else:
            _weights.alias_into(model, flat, self._strategy)
        version = update.version(self.model_id)
        if self._applied is not None and self.worker_idx is not None:
            self._applied[self.worker_idx] = version
        self._served = (version, flat)
        self._bump(version, flat)

    def _devices_of(self, model: Any) -> set[str]:
        """The device types of the worker's module, looked at once per module object (the
        weights Refit swaps in stay on the devices they replace)."""
        cached = self._devices
        if cached is not None and cached[0] is model:
            return cached[1]
        devices = {t.device.type for t in _weights.flatten(model).values()}
        self._devices = (model, devices)
        return devices

    def _bump(self, version: int, flat: dict[str, Any]) -> None:
        """Tells the worker's collector which version it serves: sub-collectors of its own get
        the weights (the cascade), a leaf only its version (TorchRL's cascade would copy the
        weights onto themselves)."""
        ctx = self.context
        if ctx is None:
            return
        if getattr(ctx, "_weight_sync_schemes", None):
            ctx.update_policy_weights_(model_id=self.model_id, policy_or_weights=dict(flat))
        elif hasattr(ctx, "_set_received_policy_version"):
            ctx._set_received_policy_version(version)

    def _receive_once(self, timeout: float | None) -> Any:
        receiver = self._receiver
        if receiver is None:
            return None
        update = receiver.receive(self.timeout if timeout is None else timeout)
        if update is None:
            return None
        self._apply(update)
        update.ack()
        return update

    def receive(self, timeout: float | None = None) -> Any:
        """Applies the next version if one comes within ``timeout`` seconds; the worker's
        background thread calls it, so a user rarely does."""
        if not self.initialized_on_receiver or not self.synchronized_on_receiver:
            raise RuntimeError("Must be initialized and connected on a receiver first")
        return self._receive_once(timeout)

    def _background_receive_loop(self) -> None:
        while not self._stop_event.is_set():
            try:
                self._receive_once(0.25)
            except PeerGone:
                return  # the trainer shut down
            except RefitError as e:
                # refused whole: the previous version stays served; the trainer's wait
                # names this worker
                if not self._stop_event.is_set():
                    torchrl_logger.warning(f"worker {self.worker_idx}: {e}")
                    time.sleep(0.05)

    # -- life-cycle --------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_sender"] = None
        state["_receiver"] = None
        state["_served"] = None
        state["_devices"] = None
        return state

    def shutdown(self) -> None:
        super().shutdown()
        for end in ("_receiver", "_sender"):
            obj = getattr(self, end, None)
            if obj is not None:
                setattr(self, end, None)
                try:
                    obj.close()
                except RefitError:
                    pass

