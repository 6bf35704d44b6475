"""`refit.ray` between real Ray actors (Ray's CPU wheel from PyPI): the example's three
versions reach both engines, each loaded and acknowledged, and a killed engine is named
within the timeout; a receiver that refuses a version is named with its reason."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, require

ray = require("ray")
require("torch")

import refit  # noqa: E402
from refit.ray import RaySender, RefitReceiver  # noqa: E402


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_example_versions_reach_both_engines_and_a_dead_one_is_named(transport):
    out = subprocess.run(
        [sys.executable, str(REPO / "python" / "examples" / "ray_engines.py"),
         "--transport", transport, "--timeout", "5"],
        capture_output=True, text=True, timeout=300, env={**os.environ},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for v in (1 + 1, 1 + 2, 1 + 3):  # version 1 is the initial one
        for e in ("engine-0", "engine-1"):
            assert f"version {v}: {e} serves version {v} (same weights)" in out.stdout, out.stdout
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("after ")][-1]
    assert "ReceiversGone" in line and "['engine-1']" in line, line
    assert float(line.split()[1]) < 5.0, line


@ray.remote
class Picky(RefitReceiver):
    def __init__(self, slow=False):
        self.w = None
        self.slow = slow

    def load_weights(self, update):
        w = update.arrays()["w"]
        if w[0] < 0:
            raise ValueError("negative weights refused")
        if w[0] == 7 and self.slow:
            time.sleep(8)
        self.w = w.copy()

    def first(self):
        return float(self.w[0]), self.refit_version()


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_refusing_receiver_is_named_and_keeps_its_version(cluster):
    actors = {"a": Picky.remote(), "b": Picky.remote()}
    with RaySender("tcp", {"w": np.ones(4, np.float32)}, actors, timeout=3) as s:
        assert s.connect() == 1
        assert s.send({"w": np.full(4, 2.0, np.float32)}) == 2
        t0 = time.monotonic()
        with pytest.raises(refit.errors.ReceiversLate) as e:
            s.send({"w": np.full(4, -1.0, np.float32)})
        assert time.monotonic() - t0 < 3 + 3
        assert sorted(e.value.receivers) == ["a", "b"], e.value
        assert "negative weights refused" in str(e.value)
        assert ray.get(actors["a"].first.remote()) == (2.0, 2)
        with pytest.raises(refit.errors.Refused, match="`w`"):
            s.send({"w": np.ones(5, np.float32)})


def test_a_stuck_receiver_is_named_within_the_timeout(cluster):
    actors = {"quick": Picky.remote(), "stuck": Picky.remote(slow=True)}
    with RaySender("shm", {"w": np.ones(4, np.float32)}, actors, timeout=2) as s:
        s.connect()
        t0 = time.monotonic()
        with pytest.raises(refit.errors.ReceiversLate) as e:
            s.send({"w": np.full(4, 7.0, np.float32)})
        assert 2 <= time.monotonic() - t0 < 2 + 2
        assert e.value.receivers == ["stuck"], e.value
        assert ray.get(actors["quick"].first.remote()) == (7.0, 2)
