"""The Hugging Face configs of the models a topology names, from their layout.

A model of ``params.arch = "llama"`` is Hugging Face's ``LlamaForCausalLM``: Refit derives
its layout (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
..., ``lm_head.weight``, ``float32``) from the model's params on every rank, and hands it
to the learner (:meth:`refit.trainer.Learner.start`) and to the engines
(:meth:`refit.engine.Engine.manifest`). :func:`llama_config` turns that layout back into
the ``config.json`` both build their model from, so the trainer's ``transformers`` model
and the engines' vLLM model are the same network under the same names::

    from transformers import LlamaConfig, LlamaForCausalLM
    policy = LlamaForCausalLM(LlamaConfig(**refit.models.llama_config(layout, params)))
"""

from __future__ import annotations

from typing import Any

#: The RMSNorm epsilon of every Llama a topology names, and its rotary base unless the
#: model's ``params.rope_theta`` sets one.
RMS_EPS = 1e-5
ROPE_THETA = 10000.0
#: ``max_position_embeddings``: rotary positions need no table, so the longest sequence is
#: a bound, far above the task's (prompt and answer) context.
POSITIONS = 2048


def llama_config(layout: list[tuple[str, str, list[int]]], params: dict[str, Any]) -> dict[str, Any]:
    """The ``LlamaForCausalLM`` config of the model whose layout is ``layout``: the shapes
    give every size but the heads and the rotary base, which ``params`` give (``heads``, 4
    by default; the key and value heads follow from the shapes; ``rope_theta``,
    :data:`ROPE_THETA` by default). Raises ``ValueError`` for a layout that is not a
    Llama's, heads that do not divide its width or a rotary base that is not above 0."""
    shapes = {name: list(shape) for name, _, shape in layout}
    try:
        vocab, d = shapes["model.embed_tokens.weight"]
        kv_rows = shapes["model.layers.0.self_attn.k_proj.weight"][0]
        intermediate = shapes["model.layers.0.mlp.gate_proj.weight"][0]
    except (KeyError, ValueError) as e:
        raise ValueError(f"the layout is not a LlamaForCausalLM's (params.arch = \"llama\"): {e}") from e
    heads = int(params.get("heads", 4))
    if heads < 1 or d % heads:
        raise ValueError(f"params.heads = {heads} does not divide the Llama's width {d}")
    kv_heads, rest = divmod(kv_rows, d // heads)
    if rest or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"the Llama's key/value rows {kv_rows} are not a number of heads of size "
                         f"{d // heads} that divides params.heads = {heads}")
    theta = float(params.get("rope_theta", ROPE_THETA))
    if not theta > 0:
        raise ValueError(f"params.rope_theta = {theta} is not above 0")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": d, "intermediate_size": intermediate,
        "num_hidden_layers": sum(1 for n in shapes if n.endswith(".self_attn.q_proj.weight")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "hidden_act": "silu", "max_position_embeddings": POSITIONS, "rms_norm_eps": RMS_EPS,
        "rope_theta": theta, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": "float32",
        # the task's stop token is per request; no tokenizer
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }


__all__ = ["llama_config"]
