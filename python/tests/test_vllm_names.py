"""The names check of `refit.vllm`'s engine (init info `verify="names"`), without vLLM: which of
a model's parameters a `load_weights` that returned the set of names it loaded did not fill.
With vLLM itself, `python/examples/vllm_engine.py` (run by `scripts/vllm-check.sh`) sends a
version lacking a tensor and checks the engine's `NeedsFullResend` names it."""

from __future__ import annotations

import pytest

import refit.vllm
from refit.vllm import _not_loaded, _param_groups


class Param:
    """A parameter: only its identity matters (tied names share one)."""


def model(tied: bool):
    """`named_parameters(remove_duplicate=False)` of a tiny Llama as vLLM builds it: fused
    qkv_proj and gate_up_proj, and an lm_head that is the embedding when tied."""
    embed = Param()
    named = [("model.embed_tokens.weight", embed)]
    for i in range(2):
        for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            named.append((f"model.layers.{i}.{p}.weight", Param()))
        named += [(f"model.layers.{i}.input_layernorm.weight", Param()),
                  (f"model.layers.{i}.post_attention_layernorm.weight", Param())]
    named.append(("model.norm.weight", Param()))
    named.append(("lm_head.weight", embed if tied else Param()))
    return named


def loaded_by(named, drop: str | None = None, tied: bool = False) -> set[str]:
    """What vLLM's `load_weights` returns for a whole checkpoint (the model's names, fused
    ones included; a tied lm_head is skipped), less `drop`."""
    names = {n for n, _ in named if not (tied and n.startswith("lm_head."))}
    return names - {drop}


@pytest.mark.parametrize("tied", [False, True])
def test_a_whole_version_leaves_nothing_unloaded(tied):
    named = model(tied)
    groups = _param_groups(named)
    assert len(groups) == len(named) - (1 if tied else 0)  # a tied lm_head is the embedding
    assert _not_loaded(groups, loaded_by(named, tied=tied)) == []


def test_a_parameter_not_loaded_is_named_first_in_the_models_order():
    named = model(False)
    loaded = loaded_by(named) - {"model.layers.1.mlp.down_proj.weight", "model.norm.weight"}
    assert _not_loaded(_param_groups(named), loaded) == ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"]


def test_a_fused_parameter_counts_under_its_own_name():
    named = model(False)
    loaded = loaded_by(named, drop="model.layers.0.self_attn.qkv_proj.weight")
    # the checkpoint's q/k/v names are not the model's: only qkv_proj's own name counts
    loaded |= {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    assert _not_loaded(_param_groups(named), loaded) == ["model.layers.0.self_attn.qkv_proj.weight"]


def test_tied_lm_head_is_filled_by_the_embedding_and_a_missing_embedding_is_named():
    named = model(True)
    groups = _param_groups(named)
    assert ("model.embed_tokens.weight", "lm_head.weight") in groups
    assert _not_loaded(groups, loaded_by(named, drop="model.embed_tokens.weight", tied=True)) == ["model.embed_tokens.weight"]


def test_skipped_parameters_are_not_expected_and_empty_ones_are():
    # a parameter no checkpoint carries (a KV-cache scale) is skipped; one a kernel emptied
    # after loading (vLLM's CPU GEMMs keep the weight elsewhere) is still filled by the version
    named = model(False) + [("model.layers.0.self_attn.attn.k_scale", Param()), ("model.layers.0.mlp.extra.weight", Param())]
    groups = _param_groups(named, skip={"model.layers.0.self_attn.attn.k_scale"})
    assert _not_loaded(groups, loaded_by(model(False))) == ["model.layers.0.mlp.extra.weight"]


def test_init_engine_sends_verify_names_by_default():
    sent = []

    class Client:
        def init_weight_transfer_engine(self, init_info):
            sent.append(init_info)

    refit.vllm.init_engine(Client(), "spec")
    refit.vllm.init_engine(Client(), "spec", verify="off")
    assert [i["verify"] for i in sent] == ["names", "off"]
