"""The `startup` and `hashes` levels of `refit.vllm`'s engine (init info `verify`), without vLLM:
the digests in vLLM's weight-checker format, the corrupt-then-restore self-test of an update
path, and the check that finds weights changed while served. With vLLM itself,
`python/examples/vllm_engine.py` (run by `scripts/vllm-check.sh`) checks that the digests equal
vLLM's own `compute_weight_checksums`, that the self-test passes on a real Llama, and that a
parameter changed in a worker is named at the next update."""

from __future__ import annotations

import hashlib
import struct

import pytest
from conftest import require

import refit.vllm
from refit import errors
from refit.vllm import VERIFY, _changed, _checksum_prefix, _digests, _self_test, _served_damage

torch = require("torch")


def tiny(tied: bool = True) -> torch.nn.Module:
    """A model shaped like a (very) small Llama: an embedding, one layer's linear and norm,
    an lm_head tied to the embedding."""

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(11, 4)
            self.proj = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)
            self.lm_head = torch.nn.Linear(4, 11, bias=False)
            if tied:
                self.lm_head.weight = self.embed.weight

    torch.manual_seed(0)
    return Tiny()


def version_of(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A version for ``model``: other values, same names and shapes."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in model.named_parameters()}


def loader(model: torch.nn.Module, version: dict[str, torch.Tensor], *, skip: str | None = None, rows: str | None = None):
    """An update path: copies ``version`` into ``model``'s parameters, except ``skip`` (left
    as it was) and only the first row of ``rows``."""

    def load() -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in version.items():
                if name == skip:
                    continue
                if name == rows:
                    params[name][0].copy_(t[0])
                else:
                    params[name].copy_(t)

    return load


# -- the weight-checker format ---------------------------------------------------------------


def test_the_prefix_is_vllms_worker_key():
    assert _checksum_prefix(0, 0, 0, 0) == "dp0:pp0:pcp0:tp0:"
    assert _checksum_prefix(3, 1, 0, 2) == "dp3:pp1:pcp0:tp2:"


def test_a_digest_is_the_sha256_of_the_raw_bytes():
    t = torch.tensor([1.0, -2.5, 3.25], dtype=torch.float32)
    assert refit.vllm._digest(t) == hashlib.sha256(struct.pack("<3f", 1.0, -2.5, 3.25)).hexdigest()
    b = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert refit.vllm._digest(b) == hashlib.sha256(b.view(torch.int16).numpy().tobytes()).hexdigest()
    # a non-contiguous tensor digests as its contiguous copy; no bytes as sha256 of nothing
    m = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    assert refit.vllm._digest(m.t()) == hashlib.sha256(m.t().contiguous().numpy().tobytes()).hexdigest()
    assert refit.vllm._digest(torch.empty(0)) == hashlib.sha256(b"").hexdigest()


def test_digests_are_keyed_by_prefix_and_parameter_name_a_tied_parameter_once():
    model = tiny(tied=True)
    d = _digests(model, _checksum_prefix(0, 0, 0, 1))
    assert list(d) == [f"dp0:pp0:pcp0:tp1:{n}" for n in ("embed.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias")]
    assert d["dp0:pp0:pcp0:tp1:proj.bias"] == hashlib.sha256(model.proj.bias.detach().numpy().tobytes()).hexdigest()
    assert "dp0:pp0:pcp0:tp1:lm_head.weight" in _digests(tiny(tied=False), _checksum_prefix(0, 0, 0, 1))


# -- the startup self-test -------------------------------------------------------------------


def test_the_self_test_passes_for_a_path_that_writes_everything_and_leaves_the_version():
    model = tiny()
    v = version_of(model, 7)
    bad, costs = _self_test(model, loader(model, v))
    assert bad == []
    assert set(costs) == {"fill_s", "load_s", "digest_s"}
    for n, p in model.named_parameters():
        assert torch.equal(p, v[n]), n  # the version is in force afterwards


def test_the_self_test_names_a_parameter_the_path_skips_even_when_it_already_held_the_version():
    model = tiny()
    v = version_of(model, 7)
    loader(model, v)()  # the model serves the version already: a plain comparison sees nothing
    assert _self_test(model, loader(model, v, skip="norm.bias"))[0] == ["norm.bias"]


def test_the_self_test_names_a_parameter_the_path_writes_in_part_and_one_whose_version_is_zeros():
    model = tiny()
    v = version_of(model, 7)
    assert _self_test(model, loader(model, v, rows="proj.weight"))[0] == ["proj.weight"]
    v["proj.bias"] = torch.zeros_like(v["proj.bias"])  # equal to the first pattern
    assert _self_test(model, loader(model, v, skip="proj.bias"))[0] == ["proj.bias"]


def test_the_self_test_covers_integer_and_boolean_tensors():
    model = torch.nn.Module()
    model.steps = torch.nn.Parameter(torch.tensor([5, 6], dtype=torch.int64), requires_grad=False)
    model.mask = torch.nn.Parameter(torch.tensor([True, False]), requires_grad=False)
    v = {"steps": torch.tensor([7, 8]), "mask": torch.tensor([False, True])}
    assert _self_test(model, loader(model, v))[0] == []
    assert _self_test(model, loader(model, v, skip="mask"))[0] == ["mask"]


# -- hashes: weights changed while served ---------------------------------------------------


def test_hashes_name_a_parameter_changed_between_updates():
    model = tiny()
    loader(model, version_of(model, 3))()
    prefix = _checksum_prefix(0, 0, 0, 0)
    recorded = _digests(model, prefix)
    what = "version 4 of `policy` (refit spec policy.spec)"
    assert _served_damage(recorded, _digests(model, prefix), what) is None
    with torch.no_grad():
        model.proj.weight[1, 2] += 1  # a stray write
    key, message = _served_damage(recorded, _digests(model, prefix), what)
    assert key == "dp0:pp0:pcp0:tp0:proj.weight"
    assert message.startswith("version 4 of `policy` (refit spec policy.spec): weights changed while served: `dp0:pp0:pcp0:tp0:proj.weight` now digests to ")
    assert "tensors differ" not in message
    with torch.no_grad():
        model.norm.bias[0] += 1
    key, message = _served_damage(recorded, _digests(model, prefix), what)
    assert key == "dp0:pp0:pcp0:tp0:proj.weight" and message.endswith("(2 tensors differ)")


def test_a_parameter_gone_or_new_counts_as_changed():
    assert _changed({"a": "1", "b": "2"}, {"a": "1", "c": "3"}) == ["b", "c"]
    key, message = _served_damage({"a": "1", "b": "2"}, {"a": "1"}, "v")
    assert key == "b" and "`b` is no longer served" in message


# -- the API -------------------------------------------------------------------------------


def test_verify_is_a_ladder_and_init_engine_sends_it():
    assert VERIFY == ("off", "names", "startup", "hashes")
    sent = []

    class Client:
        def init_weight_transfer_engine(self, init_info):
            sent.append(init_info)

    for v in ("startup", "hashes"):
        refit.vllm.init_engine(Client(), "spec", verify=v)
    assert [i["verify"] for i in sent] == ["startup", "hashes"]


def test_weight_checksums_merges_the_workers_and_refuses_what_it_cannot_ask():
    class Engine:
        def __init__(self, d):
            self.d = d

        def served_checksums(self):
            return self.d

    class Worker:
        def __init__(self, d):
            self.weight_transfer_engine = Engine(d)

    class LLM:
        def __init__(self, *answers):
            self.workers = [Worker(a) for a in answers]

        def collective_rpc(self, fn):
            return [fn(w) for w in self.workers]

    got = refit.vllm.weight_checksums(LLM({"dp0:pp0:pcp0:tp0:a": "x"}, {"dp0:pp0:pcp0:tp1:a": "y"}))
    assert got == {"dp0:pp0:pcp0:tp0:a": "x", "dp0:pp0:pcp0:tp1:a": "y"}
    with pytest.raises(errors.ConfigError, match="same keys"):
        refit.vllm.weight_checksums(LLM({"k": "x"}, {"k": "y"}))
    with pytest.raises(errors.ConfigError, match="weight_checker"):
        refit.vllm.weight_checksums(refit.vllm.Server("http://127.0.0.1:1"))


def test_a_damaged_error_crosses_vllms_rpc_typed():
    wrapped = Exception("Worker failed with error '[refit.errors.Damaged] version 2 of `policy`: weights changed while served: `k`', "
                        "please check the stack trace above for the root cause")
    typed = refit.vllm._typed(wrapped)
    assert isinstance(typed, errors.Damaged) and "weights changed while served: `k`" in str(typed)
    assert typed.tensor == "k"
