"""The examples the book shows, run as a user runs them: a trainer process and engine
processes, on every transport."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import TRANSPORTS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_python_trainer_feeds_two_python_engines(transport, tmp_path):
    spec = tmp_path / "policy.spec"
    trainer = subprocess.Popen(
        [sys.executable, EXAMPLES / "trainer.py", "--transport", transport,
         "--spec-file", spec, "--engines", "2", "--updates", "3"],
        stdout=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    deadline = time.monotonic() + 60
    while not spec.exists():
        assert trainer.poll() is None and time.monotonic() < deadline, "trainer did not start"
        time.sleep(0.05)
    # the second engine serves verified copies (refit.verify_served)
    engines = [
        subprocess.Popen([sys.executable, EXAMPLES / "engine.py", spec, "--updates", "3", *flags],
                         stdout=subprocess.PIPE, text=True, cwd=tmp_path)
        for flags in ([], ["--verify"])
    ]
    outs = [e.communicate(timeout=120)[0] for e in engines]
    t_out = trainer.communicate(timeout=60)[0]
    assert trainer.returncode == 0, t_out
    assert "version 4 acknowledged" in t_out
    for e, out in zip(engines, outs):
        assert e.returncode == 0, out
        # 256*64 + 256 elements; version v adds v-1 to each of them
        assert f"connected over {transport}: version 1" in out
        for v in (2, 3, 4):
            assert f"serving version {v}: sum {expected_sum(v):.1f}" in out, out


def expected_sum(version: int) -> float:
    """What trainer.py's version `version` sums to, computed as the engine computes it."""
    rng = np.random.default_rng(0)
    state = {"layer.weight": rng.standard_normal((256, 64), dtype=np.float32),
             "layer.bias": np.zeros(256, np.float32)}
    for _ in range(version - 1):
        state = {name: w + 1.0 for name, w in state.items()}
    return sum(float(np.sum(w)) for w in state.values())


def test_two_trainer_shards_feed_two_tensor_parallel_engines(tmp_path):
    out = subprocess.run([sys.executable, EXAMPLES / "mesh.py", "--versions", "2"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    # half the weight and the whole bias, plus a checksum per shard
    assert "version 2: each engine pulled 528400 bytes of a 1052672-byte model" in out.stdout, out.stdout


def test_a_streaming_engine_holds_a_few_buckets_where_a_staged_one_holds_versions():
    out = subprocess.run([sys.executable, EXAMPLES / "stream_memory.py", "--size", "128MiB", "--versions", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    extra = {}
    for line in out.stdout.splitlines():
        mode, _, rest = line.strip().partition(":")
        if mode in ("staged", "stream"):
            extra[mode] = float(rest.split("above the model")[1].split("MiB")[0])
    assert set(extra) == {"staged", "stream"}, out.stdout
    # staged: the receiver holds whole versions beside the engine's parameters (128 MiB
    # each); streamed: the tensors of the buckets in flight (16 MiB each, two streams) and
    # those waiting to be applied, with the allocator's own slack
    assert extra["staged"] > 128, out.stdout
    assert extra["stream"] < 4 * 16, out.stdout
    assert extra["stream"] < extra["staged"] / 4, out.stdout
