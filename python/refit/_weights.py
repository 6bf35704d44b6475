"""Weights as the schemes move them: a flat ``name → torch.Tensor`` dict, its manifest, the
check of one against the other, and the zero-copy apply of a received version to a module.

Shared by :mod:`refit.torchrl` and :mod:`refit.ray`; torch (and, for TensorDicts, tensordict)
is imported by the caller's side, never by ``import refit``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from .errors import ManifestMismatch

#: One tensor of a manifest: ``(name, torch dtype name, shape)``.
Entry = tuple[str, str, tuple[int, ...]]


def flatten(weights: Any, what: str = "weights") -> dict[str, Any]:
    """``name → tensor`` of a TensorDict (nested keys joined by ``.``, as ``state_dict``
    names them), a ``state_dict`` (nested dicts joined the same way) or an ``nn.Module``.

    Raises :class:`ManifestMismatch` for a leaf that is not a tensor, naming it.
    """
    import torch

    if isinstance(weights, torch.nn.Module):
        from tensordict import TensorDict

        weights = TensorDict.from_module(weights)
    if hasattr(weights, "flatten_keys") and hasattr(weights, "items"):
        flat = weights.flatten_keys(".")
        items = list(flat.items())
    elif isinstance(weights, Mapping):
        items = []

        def walk(prefix: str, m: Mapping[str, Any]) -> None:
            for k, v in m.items():
                name = f"{prefix}{k}"
                if isinstance(v, Mapping):
                    walk(f"{name}.", v)
                else:
                    items.append((name, v))

        walk("", weights)
    else:
        raise ManifestMismatch(
            f"{what}: expected a TensorDict, a state_dict or an nn.Module, got {type(weights).__name__}"
        )
    out: dict[str, Any] = {}
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise ManifestMismatch(
                f"{what}: `{name}` is a {type(value).__name__}, not a tensor", tensor=name
            )
        out[name] = value.detach()
    return out


def manifest_of(flat: Mapping[str, Any]) -> list[Entry]:
    """The manifest of a flat dict: each tensor's name, dtype and shape, in order."""
    return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in flat.items()]


def check(manifest: list[Entry], flat: Mapping[str, Any], what: str) -> None:
    """Refuses ``flat`` unless it has exactly the tensors of ``manifest`` with their dtypes and
    shapes; the error names the first tensor that differs (missing, unexpected, wrong dtype
    or shape)."""
    want = {n: (d, s) for n, d, s in manifest}
    for n, d, s in manifest_of(flat):
        if n not in want:
            raise ManifestMismatch(
                f"{what}: tensor `{n}` is not in the manifest ({len(want)} tensors, "
                f"first `{manifest[0][0] if manifest else '-'}`)",
                tensor=n,
            )
        wd, ws = want.pop(n)
        if (d, s) != (wd, ws):
            raise ManifestMismatch(
                f"{what}: tensor `{n}` is {d} {list(s)}, the manifest says {wd} {list(ws)}",
                tensor=n,
            )
    if want:
        n = next(iter(want))
        raise ManifestMismatch(f"{what}: tensor `{n}` of the manifest is missing", tensor=n)


def received(update: Any, model: str | None = None) -> dict[str, Any]:
    """``name → torch.Tensor`` of a received :class:`refit.Update`: zero-copy, read-only views
    that keep the update's memory (a pinned shared-memory slot, an arena) alive."""
    return dict(update.torch(model))


def alias_into(module: Any, flat: Mapping[str, Any], strategy: Any = None) -> None:
    """Makes ``module``'s parameters and buffers *be* the tensors of ``flat`` (no copy): each
    is swapped for its received view, so the module serves the new version the moment the
    swap is done, and the memory of the version it served before is let go as soon as
    nothing else holds it (no reference cycle keeps it: a shared-memory slot returns to the
    sender at once). Dotted names follow the module's hierarchy; ``__extra_state__``
    entries go through ``strategy`` (TorchRL's out-of-place apply, which calls
    ``set_extra_state``).

    Raises :class:`ManifestMismatch` for a name the module does not have.
    """
    from torch import nn

    if strategy is not None and any(n.startswith("__extra_state__") for n in flat):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            strategy.apply_weights(module, dict(flat), inplace=False)
        return
    for name, tensor in flat.items():
        owner_path, _, leaf = name.rpartition(".")
        try:
            owner = module.get_submodule(owner_path) if owner_path else module
        except AttributeError:
            owner = None
        if owner is not None and leaf in owner._parameters:
            old = owner._parameters[leaf]
            owner._parameters[leaf] = nn.Parameter(
                tensor, requires_grad=bool(old is not None and old.requires_grad)
            )
        elif owner is not None and leaf in owner._buffers:
            owner._buffers[leaf] = tensor
        else:
            raise ManifestMismatch(f"the module has no parameter or buffer `{name}`", tensor=name)


def copy_into(module: Any, flat: Mapping[str, Any]) -> None:
    """Copies ``flat`` into ``module``'s own parameters and buffers, in place (for a module
    whose tensors live on a device the received memory is not on)."""
    import torch

    own = dict(module.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, src in flat.items():
            dst = own.get(name)
            if dst is None:
                raise ManifestMismatch(f"the module has no tensor `{name}`", tensor=name)
            dst.data.copy_(src, non_blocking=False)
