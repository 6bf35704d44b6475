"""A vLLM engine as a rank of ``refit launch``: the GRPO roles' model (a Hugging Face Llama,
or Refit's transformer) served by vLLM.

``examples/topologies/grpo-vllm.toml`` starts rank 0 (the PyTorch GRPO trainer of
``torch_trainer_rank.py``, the controller, the evaluator) and two engine ranks from this
file. Each engine rank
is Refit's own rank run through the binding (:func:`refit.engine.join`); its model is an
in-process ``vllm.LLM`` driven by :class:`refit.vllm_engine.VllmEngine`:

- Refit's transformer is GPT-2's architecture (learned positions, pre-norm blocks, tanh-GELU,
  layer norms with biases) without biases in its linear layers and with an untied head, so
  vLLM serves it as ``GPT2LMHeadModel``: :func:`gpt2_config` writes the config from the
  roles' layout (no weights: vLLM starts with dummy ones, the trainer's first version
  replaces them), and :func:`checkpoint` names each tensor as GPT-2's checkpoint does
  (``Conv1D`` weights transposed, zero biases beside the linear layers);
- a model of ``params.arch = "llama"`` (the file's) is Hugging Face's
  ``LlamaForCausalLM``: vLLM serves it from the config :func:`refit.models.llama_config`
  writes (its rotary base ``params.rope_theta``), its tensors under the names they come
  with;
- updates are staged beside generation and loaded in the pause; completions carry vLLM's
  per-token versions.

With ``--serve`` the model is not in the rank's process: the rank starts a ``vllm serve``
of it (:func:`refit.vllm_server.start_server`, ended with the rank) and drives it over HTTP
through :class:`refit.vllm_server.VllmServerEngine` (vLLM's ``pause_generation`` around
each load, its tokens route for completions).

vLLM's CPU attention takes head sizes of 32 and more: the topology sets ``heads = 2`` for
``d_model = 64``. Run it under ``refit launch`` (``REFIT_PYTHON`` names an interpreter with
vLLM, torch and ``refit``, such as the one ``scripts/vllm-env.sh`` makes)::

    cargo build --release --example grpo --bin refit
    REFIT_PYTHON=$(scripts/vllm-env.sh) target/release/refit launch examples/topologies/grpo-vllm.toml
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import sys
import tempfile
from typing import Any

import refit.engine  # answers refit launch's check before vLLM is imported
from refit.models import llama_config
from refit.vllm_engine import VllmEngine, in_process_llm
from refit.vllm_server import VllmServerEngine, start_server

# a small KV cache (the completions are a dozen tokens); the ranks share the machine's
# cores, so vLLM does not pin its threads to them, and uses one
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM says only its errors

#: Refit's block tensor → GPT-2's, and whether it is a linear layer (``Conv1D``: stored
#: transposed, with a bias).
BLOCK = {
    "ln1.weight": ("ln_1.weight", False),
    "ln1.bias": ("ln_1.bias", False),
    "ln2.weight": ("ln_2.weight", False),
    "ln2.bias": ("ln_2.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.o.weight": ("attn.c_proj.weight", True),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
}
TOP = {
    "tok_emb.weight": "transformer.wte.weight",
    "pos_emb.weight": "transformer.wpe.weight",
    "ln_f.weight": "transformer.ln_f.weight",
    "ln_f.bias": "transformer.ln_f.bias",
    "head.weight": "lm_head.weight",
}


def gpt2_config(layout: list, params: dict[str, Any]) -> dict[str, Any]:
    """The GPT-2 ``config.json`` of the transformer whose layout is ``layout``: the shapes
    give every size but the heads, which the model's params give (4 by default)."""
    shapes = {name: shape for name, _, shape in layout}
    vocab, d = shapes["tok_emb.weight"]
    heads = int(params.get("heads", 4))
    if heads < 1 or d % heads:
        raise ValueError(f"params.heads = {heads} does not divide d_model {d}")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": vocab, "n_positions": shapes["pos_emb.weight"][0], "n_embd": d,
        "n_layer": sum(1 for n in shapes if n.endswith(".attn.qkv.weight")), "n_head": heads,
        "n_inner": shapes["blocks.0.mlp.fc.weight"][0], "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32",
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "bos_token_id": None, "eos_token_id": None,  # the task's stop token is per request
    }


@functools.cache
def zeros(n: int) -> Any:
    """A bias of `n` zeros, made once per size (read, never written, by the loads)."""
    import torch

    return torch.zeros(n)


# ANCHOR: checkpoint
def checkpoint(name: str, tensor: Any):
    """GPT-2's checkpoint tensors for one tensor of Refit's layout (a Llama's tensors
    already have their checkpoint names)."""
    if name in TOP:
        return [(TOP[name], tensor)]
    if not name.startswith("blocks."):  # a Llama's
        return [(name, tensor)]
    _, layer, rest = name.split(".", 2)  # blocks.{i}.{rest}
    gpt2, linear = BLOCK[rest]
    key = f"transformer.h.{layer}.{gpt2}"
    if not linear:
        return [(key, tensor)]
    # Conv1D stores [in, out]: vLLM's loader transposes it back; Refit has no biases
    return [(key, tensor.t()), (key[: -len("weight")] + "bias", zeros(tensor.shape[0]))]
# ANCHOR_END: checkpoint


def model_folder(model: str, layout: list, params: dict[str, Any]) -> tuple[str, int]:
    """A fresh Hugging Face model folder for ``model`` (its ``config.json`` only: vLLM starts
    with dummy weights, the trainer's first version replaces them) and its context."""
    llama = params.get("arch") == "llama"
    config = llama_config(layout, params) if llama else gpt2_config(layout, params)
    directory = tempfile.mkdtemp(prefix=f"refit-vllm-{model}-")
    atexit.register(shutil.rmtree, directory, True)  # vLLM may read it again: kept until exit
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory, int(config["max_position_embeddings" if llama else "n_positions"])


def build(model: str, layout: list, params: dict[str, Any]) -> Any:
    """The in-process LLM of ``model``."""
    directory, context = model_folder(model, layout, params)
    return in_process_llm(model=directory, load_format="dummy", dtype="float32", max_model_len=context, seed=0)


# ANCHOR: serve
def build_server(model: str, layout: list, params: dict[str, Any]) -> Any:
    """A ``vllm serve`` of ``model`` that this rank starts (and ends with it)."""
    directory, context = model_folder(model, layout, params)
    return start_server(directory, load_format="dummy", dtype="float32", max_model_len=context, seed=0,
                        enforce_eager=True)
# ANCHOR_END: serve


# ANCHOR: main
def main() -> int:
    if "--serve" in sys.argv[1:]:  # the model behind a `vllm serve` of this rank, over HTTP
        return refit.engine.main(VllmServerEngine(build_server, checkpoint=checkpoint), roles="grpo")
    return refit.engine.main(VllmEngine(build, checkpoint=checkpoint), roles="grpo")
# ANCHOR_END: main


if __name__ == "__main__":
    sys.exit(main())
