"""vLLM's ``refit`` weight-transfer backend with ``stream=True``, on a real vLLM (the CPU
build): each version streams over TCP into vLLM's weights tensor by tensor and generates what
the same version loaded whole generates; a version failing part-way raises
``NeedsFullResend`` and the next one repairs the model. (``scripts/vllm-check.sh`` runs the
whole backend example, ``python/examples/vllm_engine.py``, streaming included.)"""

from __future__ import annotations

import os
import sys

import pytest

from conftest import REPO, TOKEN, require_vllm

require_vllm()
torch = pytest.importorskip("torch")  # vLLM's own dependency
from safetensors.torch import load_file  # noqa: E402

import refit  # noqa: E402
import refit.vllm  # noqa: E402
from refit import errors  # noqa: E402

sys.path.insert(0, str(REPO / "python/examples"))
import tiny_llama  # noqa: E402
import vllm_engine as example  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-backend")
    # vLLM's workers are processes started here: they take the token the tests' senders use
    os.environ["REFIT_TOKEN"] = TOKEN
    os.environ.pop("REFIT_TOKEN_FILE", None)
    model_dir = tiny_llama.write_model(work / "model", seed=1)
    v2 = load_file(str(tiny_llama.write_weights(work / "v2.safetensors", seed=2, like=model_dir)))
    llm = example.llm_for(model_dir, weight_transfer_config={"backend": "refit"})
    yield llm, v2
    example.close(llm)


def test_versions_stream_into_vllm_and_generate_as_when_loaded_whole(llm):
    llm, v2 = llm
    whole = refit.Sender("shm", v2, model=example.MODEL_ID)
    whole.start()
    refit.vllm.init_engine(llm, whole.spec, load_initial=True)
    expected = example.generate(llm, 16)
    whole.close()

    flipped = {n: -t for n, t in v2.items()}
    streamer = refit.Sender("tcp", flipped, model=example.MODEL_ID)
    streamer.start()
    refit.vllm.init_engine(llm, streamer.spec, load_initial=True, stream=True)
    other = example.generate(llm, 16)
    assert other != expected, "the first streamed version is another model"
    streamer.publish(v2)
    refit.vllm.update_weights(llm, version=2, timeout=60)
    assert example.generate(llm, 16) == expected

    # an unknown tensor after others streamed in: mixed weights, NeedsFullResend
    names = list(v2)
    broken = {(n if n != names[-2] else "model.layers.0.mlp.bogus_proj.weight"): t for n, t in flipped.items()}
    bad = refit.Sender("tcp", broken, model=example.MODEL_ID)
    bad.start()
    with pytest.raises(errors.NeedsFullResend, match="part-way"):
        refit.vllm.init_engine(llm, bad.spec, load_initial=True, stream=True)
    bad.close()
    # the streamer's version in force streams in whole again
    refit.vllm.init_engine(llm, streamer.spec, load_initial=True, stream=True)
    assert example.generate(llm, 16) == expected
    with pytest.raises(errors.ConfigError, match="stream"):
        refit.vllm.init_engine(llm, streamer.spec, stream=True, verify="startup")
    streamer.close()


def _break_restore(worker) -> None:
    """In vLLM's worker: putting the previous weights back after a failed update raises."""
    def broken() -> None:
        raise RuntimeError("the restore broke")

    worker.weight_transfer_engine._restore = broken


def _mend_restore(worker) -> None:
    del worker.weight_transfer_engine._restore  # the class's own again


def test_an_update_whose_failure_cannot_be_undone_asks_for_a_whole_version_and_the_next_repairs(llm):
    llm, v2 = llm
    sender = refit.Sender("tcp", v2, model=example.MODEL_ID)
    sender.start()
    refit.vllm.init_engine(llm, sender.spec, load_initial=True)
    expected = example.generate(llm, 16)
    llm.collective_rpc(_break_restore)
    try:
        # a version that never comes, and putting the previous weights back fails too: the
        # step's own failure is named first, then the one that leaves the weights unknown
        with pytest.raises(errors.NeedsFullResend,
                           match=r"(?s)failed: Timeout: .* did not come .*then ending the update failed too \(RuntimeError: the restore broke\)"
                                 r".*unknown state"):
            refit.vllm.update_weights(llm, version=9, timeout=1)
    finally:
        llm.collective_rpc(_mend_restore)
    # the next version loads whole and is served; then the first one again
    sender.publish({n: -t for n, t in v2.items()})
    refit.vllm.update_weights(llm, timeout=60)
    assert example.generate(llm, 16) != expected
    sender.publish(v2)
    refit.vllm.update_weights(llm, timeout=60)
    assert example.generate(llm, 16) == expected
    sender.close()


def test_a_tensor_parallel_vllm_pulls_only_its_slices_from_two_trainer_shards():
    """``python/examples/vllm_tp.py`` in a process of its own (a second vLLM in this one
    would find its parallel groups taken): two workers, each pulling half the model from two
    flat shards, generate vLLM's own tokens and logprobs bit for bit; a version no shard
    published fails alike in both workers and leaves the weights served. Then fed by one
    sender (each worker pulls the whole model): the same output, a timeout and a refused
    ``stream=True`` in both workers alike, and the next version loads; an update that one
    worker cannot end either raises ``NeedsFullResend`` naming it, and the next loads whole."""
    import subprocess

    env = {**os.environ, "REFIT_TOKEN": TOKEN}
    done = subprocess.run([sys.executable, str(REPO / "python/examples/vllm_tp.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-4000:]
    assert "vllm_tp: all checks passed" in out, out
    # both workers report pulling half the model: the slices, not whole tensors
    for rank in (0, 1):
        assert f"worker tp{rank}: 16 of 21 tensors sliced" in out, out
    assert out.count("bytes per version (50%)") == 2, out
