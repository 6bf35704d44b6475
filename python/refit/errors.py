"""Refit's exceptions.

Every error Refit raises is a :class:`RefitError`; each kind also derives from the built-in
exception a caller would already catch (``TimeoutError``, ``ConnectionError``,
``ValueError``...). Messages come from Refit's Rust errors and name the culprit: the tensor,
model, version, peer, file or variable.
"""


class RefitError(Exception):
    """Any error raised by Refit."""


class Timeout(RefitError, TimeoutError):
    """A deadline passed: no sender, no acknowledgement, no free slot in time."""


class PeerGone(RefitError, ConnectionError):
    """The other end died or shut down (the sender of a receiver, a receiver of a sender)."""


class Refused(RefitError, ValueError):
    """An update refused whole (wrong shape, dtype, name, checksum, version, a malformed
    frame); the previous weights stay in force."""


class ManifestMismatch(Refused):
    """Weights whose names, dtypes or shapes differ from the manifest both ends agreed on;
    ``tensor`` names the first tensor that differs."""

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class ConfigError(RefitError, ValueError):
    """Bad configuration: a spec that does not decode, an unknown transport, a bad token."""


class Unauthorized(ConfigError, PermissionError):
    """The cluster token is missing or was refused by the other end."""


class DTypeError(RefitError, TypeError):
    """A dtype the requested library cannot represent (fp8 or bf16 as numpy)."""


class TransportError(RefitError, OSError):
    """An I/O failure of the transport (a file, a socket, a segment)."""


class Closed(RefitError, RuntimeError):
    """The receiver or sender is closed, or an operation came in the wrong order."""


class _NamesReceivers(RefitError):
    """An error about some of a sender's receivers: ``receivers`` names them (TorchRL
    worker indices, Ray actor names)."""

    def __init__(self, message: str, *, receivers: list | None = None) -> None:
        super().__init__(message)
        self.receivers = list(receivers or [])


class ReceiversLate(_NamesReceivers, Timeout):
    """Some receivers did not apply a version in time; ``receivers`` names them (TorchRL
    worker indices, Ray actor names)."""


class ReceiversGone(_NamesReceivers, PeerGone):
    """Some receivers died or shut down; ``receivers`` names them."""


class Damaged(RefitError):
    """What an engine serves differs from the version it applied (a stray write, a bad page,
    an apply that did not land whole); ``tensor`` names the first tensor that differs."""

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class NeedsFullResend(RefitError):
    """An update failed part-way through an engine's apply: the engine's weights are mixed
    and must be replaced whole by the next version before it serves again."""


__all__ = [
    "RefitError",
    "Timeout",
    "PeerGone",
    "Refused",
    "ManifestMismatch",
    "ConfigError",
    "Unauthorized",
    "DTypeError",
    "TransportError",
    "Closed",
    "NeedsFullResend",
    "Damaged",
    "ReceiversLate",
    "ReceiversGone",
]

