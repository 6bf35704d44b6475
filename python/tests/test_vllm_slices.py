"""Which part of each checkpoint tensor a tensor-parallel vLLM worker pulls from a mesh
(`refit.vllm._tp_wants`), without vLLM: a tiny Llama's layers as vLLM names and splits them,
stood in for by classes of vLLM's names. With vLLM itself, `python/examples/vllm_tp.py`
(run by `test_vllm_backend.py`) loads the slices into a two-worker vLLM and generates its
own tokens bit for bit."""

from __future__ import annotations

import pytest

from refit.vllm import _tp_wants, _Wide

torch = pytest.importorskip("torch")


class UnquantizedLinearMethod:
    pass


class UnquantizedEmbeddingMethod:
    pass


class Fp8LinearMethod:
    pass


def layer(kind: str, rank: int, world: int, **attrs):
    """A module of class `kind` (vLLM's layer names are what the rules read)."""
    quant = attrs.pop("quant", UnquantizedEmbeddingMethod if "Vocab" in kind or "LMHead" in kind
                      else UnquantizedLinearMethod)
    cls = type(kind, (torch.nn.Module,), {})
    m = cls()
    m.tp_rank, m.tp_size, m.quant_method = rank, world, quant()
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


class Rows:
    def __init__(self, start: int, end: int):
        self.org_vocab_start_index, self.org_vocab_end_index = start, end


def llama(rank: int, world: int, kv_replicas: int = 1, vocab: int = 500, padded: int = 512):
    """vLLM's Llama modules for worker `rank` of `world` (vocabulary padded to `padded`)."""
    per = padded // world
    rows = Rows(min(rank * per, vocab), min((rank + 1) * per, vocab))
    model = type("LlamaForCausalLM", (torch.nn.Module,), {"load_weights": lambda self, weights: set()})()
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                    "gate_up_proj": ["gate_proj", "up_proj"]}
    inner = torch.nn.Module()
    model.model = inner
    inner.embed_tokens = layer("VocabParallelEmbedding", rank, world, shard_indices=rows, org_vocab_size=vocab)
    attn, mlp, block = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    attn.qkv_proj = layer("QKVParallelLinear", rank, world, num_kv_head_replicas=kv_replicas)
    attn.o_proj = layer("RowParallelLinear", rank, world, input_is_parallel=True)
    mlp.gate_up_proj = layer("MergedColumnParallelLinear", rank, world)
    mlp.down_proj = layer("RowParallelLinear", rank, world, input_is_parallel=True, quant=Fp8LinearMethod)
    block.self_attn, block.mlp = attn, mlp
    block.input_layernorm = torch.nn.Module()
    inner.layers = torch.nn.ModuleList([block])
    model.lm_head = layer("ParallelLMHead", rank, world, shard_indices=rows, org_vocab_size=vocab)
    return model


MANIFEST = [
    ("model.embed_tokens.weight", "f32", [500, 8]),
    ("model.layers.0.self_attn.q_proj.weight", "f32", [8, 8]),
    ("model.layers.0.self_attn.k_proj.weight", "f32", [4, 8]),
    ("model.layers.0.self_attn.v_proj.bias", "f32", [4]),
    ("model.layers.0.self_attn.o_proj.weight", "f32", [8, 8]),
    ("model.layers.0.self_attn.o_proj.bias", "f32", [8]),
    ("model.layers.0.mlp.gate_proj.weight", "f32", [16, 8]),
    ("model.layers.0.mlp.up_proj.weight", "f32", [16, 8]),
    ("model.layers.0.mlp.down_proj.weight", "f32", [8, 16]),
    ("model.layers.0.input_layernorm.weight", "f32", [8]),
    ("model.layers.0.mlp.unknown_proj.weight", "f32", [8, 8]),
    ("lm_head.weight", "f32", [500, 8]),
]


def test_each_layer_kind_gets_the_slice_its_loader_narrows_to():
    wants = dict(_tp_wants(llama(1, 2), MANIFEST))
    assert wants == {
        # the padded vocabulary's second half of 512 rows holds the real rows 256..500
        "model.embed_tokens.weight": ("flat", 256 * 8, 500 * 8),
        "model.layers.0.self_attn.q_proj.weight": ("slice", 0, 1, 2),
        "model.layers.0.self_attn.k_proj.weight": ("slice", 0, 1, 2),
        "model.layers.0.self_attn.v_proj.bias": ("slice", 0, 1, 2),
        "model.layers.0.self_attn.o_proj.weight": ("slice", 1, 1, 2),
        "model.layers.0.self_attn.o_proj.bias": "whole",  # added once, after the reduce
        "model.layers.0.mlp.gate_proj.weight": ("slice", 0, 1, 2),
        "model.layers.0.mlp.up_proj.weight": ("slice", 0, 1, 2),
        "model.layers.0.mlp.down_proj.weight": "whole",  # quantized: its own rules
        "model.layers.0.input_layernorm.weight": "whole",
        "model.layers.0.mlp.unknown_proj.weight": "whole",  # no such layer
        "lm_head.weight": ("flat", 256 * 8, 500 * 8),
    }


def test_replicated_kv_heads_go_by_head_group_and_one_worker_takes_everything_whole():
    # 4 workers, kv heads replicated on 2 each: workers 2 and 3 share k's second half
    wants = dict(_tp_wants(llama(3, 4, kv_replicas=2), MANIFEST))
    assert wants["model.layers.0.self_attn.q_proj.weight"] == ("slice", 0, 3, 4)
    assert wants["model.layers.0.self_attn.k_proj.weight"] == ("slice", 0, 1, 2)
    assert wants["model.embed_tokens.weight"] == ("flat", 384 * 8, 500 * 8)
    assert all(part == "whole" for _, part in _tp_wants(llama(0, 1), MANIFEST))
    # another model's load_weights may reshape tensors first: everything whole, and so for a
    # model built on Llama's that brings a load_weights of its own; one that keeps it slices
    other = llama(1, 2)
    base = type(other)
    other.__class__ = type("GPT2LMHeadModel", (torch.nn.Module,), {})
    assert all(part == "whole" for _, part in _tp_wants(other, MANIFEST))
    other.__class__ = type("MistralForCausalLM", (base,), {"load_weights": lambda self, weights: set()})
    assert all(part == "whole" for _, part in _tp_wants(other, MANIFEST))
    other.__class__ = type("Phi3ForCausalLM", (base,), {})
    assert dict(_tp_wants(other, MANIFEST))["lm_head.weight"] == ("flat", 256 * 8, 500 * 8)
    # a slice that would not divide its dimension is taken whole
    odd = [("model.layers.0.self_attn.q_proj.weight", "f32", [7, 8])]
    assert _tp_wants(llama(0, 2), odd) == [(odd[0][0], "whole")]


def test_each_part_lands_where_its_layer_narrows_and_nan_fills_the_rest_once():
    manifest = [("rows", "f32", [4, 6]), ("cols", "f32", [4, 6]), ("flat", "f32", [4, 6]),
                ("whole", "f32", [2, 3]), ("ints", "i64", [4])]
    wants = [("rows", ("slice", 0, 1, 2)), ("cols", ("slice", 1, 1, 2)), ("flat", ("flat", 12, 24)),
             ("whole", "whole"), ("ints", ("slice", 0, 0, 2))]
    wide = _Wide(torch, manifest, wants)
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for version in (1, 2):  # the same memory, version after version
        pulled = {"rows": full[2:], "cols": full[:, 3:], "flat": full.reshape(-1)[12:],
                  "whole": full[0, :6].reshape(2, 3), "ints": torch.tensor([5, 6])}
        for name, t in pulled.items():
            target = wide.targets[name]
            assert target.nbytes == t.numel() * t.element_size()
            target[:] = (t * version if t.is_floating_point() else t).contiguous().view(torch.uint8).reshape(-1).numpy()
        wide.landed()
        got = dict(wide.pairs)
        assert torch.equal(got["rows"][2:], full[2:] * version) and torch.isnan(got["rows"][:2]).all()
        assert torch.equal(got["cols"][:, 3:], full[:, 3:] * version) and torch.isnan(got["cols"][:, :3]).all()
        assert torch.equal(got["flat"][2:], full[2:] * version) and torch.isnan(got["flat"][:2]).all()
        assert torch.equal(got["whole"], full[0, :6].reshape(2, 3) * version)
        assert got["ints"].tolist() == [5, 6, 0, 0]
