"""Refit versions into an SGLang server, through its ``/update_weights_from_disk`` endpoint.

SGLang reloads a model in place from a directory in the Hugging Face layout
(``config.json`` and ``*.safetensors``), and puts its previous weights back when the load
fails. :class:`SGLangServer` turns each Refit version into such a directory and asks the
server to load it::

    import refit
    from refit.sglang import SGLangServer

    server = SGLangServer("http://127.0.0.1:30000", base="/models/my-llama",
                          staging="/dev/shm/refit-sglang")
    receiver = refit.Receiver("policy.spec")
    for update in receiver:
        server.load(update)     # writes the version's directory, SGLang loads it, then ack

The directory holds the non-weight files of ``base`` (config, tokenizer, generation
config) and one ``model.safetensors`` written straight from the received memory (one write
of the bytes; on ``/dev/shm`` that costs a memcpy). A successful load acknowledges the
version to the trainer; a refused one raises :class:`~refit.errors.Refused` with SGLang's
message, and SGLang serves the previous weights (it rolls back itself). The version reaches
SGLang as ``weight_version`` (``"refit:<model>:<version>"``), which it reports with each
generation.

Only the standard library is used: no SGLang, torch or requests import.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from . import errors

__all__ = ["SGLangServer", "write_model_dir", "SAFETENSORS_DTYPES"]

#: Refit dtype → safetensors dtype name.
SAFETENSORS_DTYPES = {
    "bool": "BOOL",
    "u8": "U8",
    "i8": "I8",
    "i16": "I16",
    "u16": "U16",
    "i32": "I32",
    "u32": "U32",
    "i64": "I64",
    "u64": "U64",
    "f16": "F16",
    "bf16": "BF16",
    "f32": "F32",
    "f64": "F64",
    "f8_e4m3": "F8_E4M3",
    "f8_e5m2": "F8_E5M2",
}

# files of a model directory that hold weights: never copied from `base`
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def write_model_dir(update: Any, directory: str | os.PathLike, *, base: str | os.PathLike | None = None,
                    model: str | None = None) -> Path:
    """Writes ``model``'s version of ``update`` (a :class:`refit.Update`) as a Hugging Face
    model directory: the non-weight files of ``base`` and ``model.safetensors``.

    The tensors are written from the received memory as they lie (every dtype, bf16 and
    fp8 included), in the sender's order, with the model and version in the file's
    metadata. The directory is written under a temporary name and renamed into place, so a
    reader never sees half of it.

    Raises:
    :class:`~refit.errors.ConfigError` (``base`` is not a directory or has no
    ``config.json``), :class:`~refit.errors.DTypeError` (a dtype safetensors lacks),
    :class:`~refit.errors.TransportError` (the directory cannot be written).
    """
    directory = Path(directory)
    model = model if model is not None else _only(update)
    version = update.version(model)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "refit_model": model, "refit_version": str(version)}}
    views = []
    offset = 0
    for t in update.tensors(model):
        dtype = SAFETENSORS_DTYPES.get(t.dtype)
        if dtype is None:
            raise errors.DTypeError(f"tensor `{t.name}` of `{model}` (version {version}) is {t.dtype}, which safetensors cannot hold")
        data = np.asarray(t).reshape(-1).view(np.uint8)
        header[t.name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        views.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = directory.with_name(f".{directory.name}.incoming")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        if base is not None:
            _copy_config(Path(base), tmp)
        with open(tmp / "model.safetensors", "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for data in views:
                f.write(memoryview(data))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise errors.TransportError(f"writing version {version} of `{model}` to {directory}: {e}") from e
    return directory


def _copy_config(base: Path, into: Path) -> None:
    if not base.is_dir():
        raise errors.ConfigError(f"the base model directory {base} does not exist")
    if not (base / "config.json").is_file():
        raise errors.ConfigError(f"the base model directory {base} has no config.json: SGLang needs the model's configuration")
    for entry in base.iterdir():
        if entry.is_file() and not entry.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(entry, into / entry.name)


def _only(update: Any) -> str:
    models = update.models
    if len(models) != 1:
        raise errors.ConfigError(f"the update holds {len(models)} models ({', '.join(models)}): name one")
    return models[0]


class SGLangServer:
    """Loads Refit versions into a running SGLang server (``python -m sglang.launch_server``).

    ``url``: the server's address. ``base``: a directory with the model's configuration
    (the one the server was started from will do; its weight files are not read).
    ``staging``: where version directories are written; it must be a path the server can
    read (same host, or a shared file system); ``/dev/shm`` keeps it in memory. ``keep``:
    how many loaded version directories to keep (the newest; older ones are removed once a
    newer one is in force). ``api_key``: SGLang's admin key (``--admin-api-key``), sent as a
    bearer token. ``timeout``: seconds a load may take.
    """

    def __init__(self, url: str, *, base: str | os.PathLike, staging: str | os.PathLike,
                 api_key: str | None = None, timeout: float = 600.0, keep: int = 1,
                 load_format: str | None = None) -> None:
        if keep < 1:
            raise errors.ConfigError(f"keep must be ≥ 1, got {keep}")
        self.url = url.rstrip("/")
        self.base = Path(base)
        self.staging = Path(staging)
        self.api_key = api_key
        self.timeout = timeout
        self.keep = keep
        self.load_format = load_format
        #: ``(model, version)`` in force on the server after the last successful load
        self.loaded: tuple[str, int] | None = None
        self._dirs: list[Path] = []

    def load(self, update: Any, model: str | None = None) -> None:
        """Writes ``model``'s version of ``update`` as a model directory, asks the server
        to load it, and acknowledges the version once the server says it is in force.

        Raises:
        :class:`~refit.errors.Refused`: the server refused the weights (its message says
        why; it put its previous weights back); the version is not acknowledged.
        :class:`~refit.errors.PeerGone`: the server cannot be reached.
        :class:`~refit.errors.Timeout`: no answer within ``timeout``.
        :class:`~refit.errors.Unauthorized`: the server refused the admin key.
        And what :func:`write_model_dir` raises.
        """
        model = model if model is not None else _only(update)
        version = update.version(model)
        directory = write_model_dir(update, self.staging / f"{model}-v{version}", base=self.base, model=model)
        body = {"model_path": str(directory), "weight_version": f"refit:{model}:{version}", "flush_cache": True}
        if self.load_format is not None:
            body["load_format"] = self.load_format
        try:
            answer = self._post("/update_weights_from_disk", body, f"version {version} of `{model}`")
        except errors.RefitError:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        if not answer.get("success", False):
            shutil.rmtree(directory, ignore_errors=True)
            served = f"version {self.loaded[1]} of `{self.loaded[0]}`" if self.loaded else "the weights it had"
            message = " ".join(str(answer.get("message", answer)).split())
            raise errors.Refused(f"SGLang at {self.url} refused version {version} of `{model}`: {message} (it still serves {served})")
        self.loaded = (model, version)
        self._dirs.append(directory)
        while len(self._dirs) > self.keep:
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)
        update.ack()

    def _post(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        if self.api_key is not None:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                return _json(r.read(), self.url + path)
        except urllib.error.HTTPError as e:
            text = e.read()
            if e.code in (401, 403):
                raise errors.Unauthorized(f"SGLang at {self.url} refused the admin key loading {what} (HTTP {e.code})") from e
            answer = _json(text, self.url + path, strict=False)
            if answer is None:
                raise errors.Refused(f"SGLang at {self.url} answered HTTP {e.code} loading {what}: {text[:500].decode(errors='replace')}") from e
            return answer
        except TimeoutError as e:
            raise errors.Timeout(f"SGLang at {self.url} did not answer within {self.timeout:g} s loading {what}") from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise errors.Timeout(f"SGLang at {self.url} did not answer within {self.timeout:g} s loading {what}") from e
            raise errors.PeerGone(f"SGLang at {self.url} cannot be reached loading {what}: {e.reason}") from e
        except OSError as e:
            raise errors.PeerGone(f"SGLang at {self.url} closed the connection loading {what}: {e}") from e


def _json(raw: bytes, where: str, strict: bool = True) -> Any:
    try:
        value = json.loads(raw)
    except ValueError as e:
        if not strict:
            return None
        raise errors.Refused(f"{where} answered something that is not JSON: {raw[:200]!r}") from e
    if not isinstance(value, dict):
        if not strict:
            return None
        raise errors.Refused(f"{where} answered {value!r}, not an object")
    return value
