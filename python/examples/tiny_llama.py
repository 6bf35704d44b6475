"""A tiny random-init Llama for trying Refit's vLLM backend on a laptop CPU.

Two commands::

    # a model directory vLLM loads (config.json + model.safetensors), seeded
    python tiny_llama.py model /tmp/tiny --seed 1

    # the weights of the same architecture drawn with another seed: the next "version"
    python tiny_llama.py weights /tmp/v2.safetensors --like /tmp/tiny --seed 2

The model is float32 with head dim 64 (vLLM's CPU attention kernels refuse 16): hidden
128, 2 heads, 2 layers, vocabulary 512, MLP 256 by default. Files are written under a
temporary name and renamed into place, so a watcher (``refit serve --watch``) never reads
half a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

#: The architecture written unless told otherwise.
DEFAULT_ARCH = {
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
    # wider than the usual 0.02: with tiny random weights the logits are nearly flat, and
    # greedy tokens of two different seeds could coincide by chance
    "initializer_range": 0.2,
}


def _config(arch: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        **arch,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )


def _model(arch: dict, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(arch))
    return model.to(torch.float32).eval()


def write_model(directory: str | os.PathLike, seed: int = 1, **arch: int | float) -> Path:
    """Writes a random-init Llama (``config.json`` and ``model.safetensors``, float32,
    drawn from ``seed``) into ``directory`` (created if missing); returns the directory.
    ``arch`` overrides entries of :data:`DEFAULT_ARCH`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    merged = {**DEFAULT_ARCH, **arch}
    with tempfile.TemporaryDirectory(dir=directory, prefix=".tiny-llama-") as tmp:
        _model(merged, seed).save_pretrained(tmp, safe_serialization=True)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), directory / name)
    return directory


def arch_of(directory: str | os.PathLike) -> dict:
    """The :data:`DEFAULT_ARCH` keys as read from ``directory/config.json``."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"tiny_llama: cannot read the config {path}: {e}") from e
    missing = [k for k in DEFAULT_ARCH if k not in config]
    if missing:
        raise SystemExit(f"tiny_llama: {path} lacks {', '.join(missing)}")
    return {k: config[k] for k in DEFAULT_ARCH}


def write_weights(path: str | os.PathLike, seed: int, like: str | os.PathLike | None = None) -> Path:
    """Writes only the safetensors of the architecture of the model directory ``like``
    (default: :data:`DEFAULT_ARCH`), drawn from ``seed``, to ``path``: written beside it
    under a temporary name, then renamed over it. Returns ``path``."""
    path = Path(path)
    arch = arch_of(like) if like is not None else dict(DEFAULT_ARCH)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".tiny-llama-") as tmp:
        _model(arch, seed).save_pretrained(tmp, safe_serialization=True)
        produced = Path(tmp) / "model.safetensors"
        if not produced.exists():  # pragma: no cover - a transformers that shards tiny models
            raise SystemExit(f"tiny_llama: transformers wrote no single model.safetensors in {tmp}")
        os.replace(produced, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="write a model directory (config.json + model.safetensors)")
    m.add_argument("directory")
    m.add_argument("--seed", type=int, default=1)
    for key, value in DEFAULT_ARCH.items():
        m.add_argument("--" + key.replace("_", "-"), type=type(value), default=value, dest=key)
    w = sub.add_parser("weights", help="write the safetensors of another seed")
    w.add_argument("path")
    w.add_argument("--seed", type=int, required=True)
    w.add_argument("--like", help="a model directory whose config.json gives the architecture")
    args = parser.parse_args(argv)
    if args.command == "model":
        arch = {k: getattr(args, k) for k in DEFAULT_ARCH}
        print(write_model(args.directory, args.seed, **arch))
    else:
        print(write_weights(args.path, args.seed, args.like))
    return 0


if __name__ == "__main__":
    sys.exit(main())
