"""`refit.torchrl.RefitWeightSyncScheme` under real TorchRL collectors (from PyPI): every
calling convention of `update_policy_weights_`, both strategies, isolation from the trainer's
edits, refusals naming the tensor, late and dead workers named by index, and a CartPole run
that learns exactly as with TorchRL's own scheme."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO, require

torch = require("torch")
require("torchrl")
from tensordict import TensorDict  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import MultiSyncCollector  # noqa: E402
from torchrl.envs import GymEnv  # noqa: E402

import refit  # noqa: E402
from refit.torchrl import RefitWeightSyncScheme  # noqa: E402


class Probe(nn.Module):
    """A CartPole policy whose output also carries the sum of its weights, so a batch shows
    which weights each worker served."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, obs):
        s = self.lin.weight.sum() + self.lin.bias.sum() + self.scale.sum()
        action = nn.functional.one_hot(self.lin(obs).argmax(-1), 2)
        return action, s.expand(obs.shape[:-1]).unsqueeze(-1).clone()


def make_env():
    return GymEnv("CartPole-v1")


def policy():
    return TensorDictModule(Probe(), in_keys=["observation"], out_keys=["action", "wsum"])


def wsum(p) -> float:
    m = p.module
    return (m.lin.weight.sum() + m.lin.bias.sum() + m.scale.sum()).item()


def collector(p, scheme, workers=2):
    return MultiSyncCollector(
        [make_env] * workers,
        p,
        frames_per_batch=16 * workers,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
    )


def served(batch) -> set[float]:
    return {round(x, 4) for x in batch["wsum"].flatten().tolist()}


@contextlib.contextmanager
def running(scheme):
    """A probe policy, its collector under ``scheme`` and the collector's iterator, the
    first batch taken; the collector shut down after."""
    p = policy()
    c = collector(p, scheme)
    try:
        it = iter(c)
        first = next(it)
        yield p, c, it, first
    finally:
        c.shutdown()


@pytest.mark.parametrize("strategy", ["tensordict", "state_dict"])
def test_every_calling_convention_reaches_every_worker(strategy):
    with running(RefitWeightSyncScheme("shm", strategy, timeout=20)) as (p, c, it, first):
        assert served(first) == {round(wsum(p), 4)}
        assert first["policy_version"].max().item() == 1
        calls = [
            lambda: c.update_policy_weights_(),
            lambda: c.update_policy_weights_(p),
            lambda: c.update_policy_weights_(TensorDict.from_module(p)),
            lambda: c.update_policy_weights_(weights=TensorDict.from_module(p), model_id="policy"),
            lambda: c.update_policy_weights_(policy=p),
            lambda: c.update_policy_weights_(weights_dict={"policy": TensorDict.from_module(p)}),
            lambda: c.update_policy_weights_(p.state_dict()),
        ]
        for k, call in enumerate(calls, start=2):
            with torch.no_grad():
                p.module.lin.weight.add_(1.0)
                p.module.scale.mul_(2.0)
            call()
            batch = next(it)
            # one version, whole, in every frame of every worker
            assert served(batch) == {round(wsum(p), 4)}, k
            # the frames after the first of each worker's batch carry the new version
            assert batch["policy_version"][:, 1:].unique().tolist() == [k], k


def test_torchrls_cpu_shared_scheme_shows_unpublished_edits_and_refits_does_not():
    # what the book says of TorchRL's own scheme: the workers read the trainer's storage
    from torchrl.weight_update import SharedMemWeightSyncScheme

    for scheme, isolated in ((SharedMemWeightSyncScheme(), False), (RefitWeightSyncScheme("shm"), True)):
        with running(scheme) as (p, c, it, first):
            assert served(first) == {round(wsum(p), 4)}
            with torch.no_grad():
                p.module.lin.weight.add_(5.0)  # an optimizer step, not published
            assert (served(next(it)) == served(first)) is isolated, type(scheme).__name__
            if isolated:
                c.update_policy_weights_()
                assert served(next(it)) == {round(wsum(p), 4)}


@pytest.mark.parametrize("transport,copy,checksum", [("shm", True, False), ("shm", False, True), ("tcp", False, False)])
def test_copy_mode_checksums_and_tcp_serve_each_version(transport, copy, checksum, monkeypatch):
    # tcp: no REFIT_TOKEN, the scheme makes one and hands it to the workers
    monkeypatch.delenv("REFIT_TOKEN", raising=False)
    scheme = RefitWeightSyncScheme(transport, timeout=20, copy=copy, checksum=checksum)
    with running(scheme) as (p, c, it, _):
        for _ in range(3):
            with torch.no_grad():
                p.module.lin.bias.add_(0.5)
            c.update_policy_weights_()
            assert served(next(it)) == {round(wsum(p), 4)}


def test_weights_unlike_the_manifest_are_refused_naming_the_tensor():
    with running(RefitWeightSyncScheme("shm", timeout=20)) as (p, c, it, first):
        good = round(wsum(p), 4)
        bad = TensorDict.from_module(p).clone()
        bad["module", "lin", "weight"] = torch.zeros(3, 4)
        with pytest.raises(refit.errors.ManifestMismatch, match=r"`module\.lin\.weight` is float32 \[3, 4\]") as e:
            c.update_policy_weights_(bad)
        assert e.value.tensor == "module.lin.weight"
        missing = TensorDict.from_module(p).clone().exclude(("module", "scale"))
        with pytest.raises(refit.errors.ManifestMismatch, match=r"`module\.scale` of the manifest is missing"):
            c.update_policy_weights_(missing)
        cast = TensorDict.from_module(p).clone()
        cast["module", "lin", "bias"] = cast["module", "lin", "bias"].double()
        with pytest.raises(refit.errors.ManifestMismatch, match="float64"):
            c.update_policy_weights_(cast)
        # nothing was published: the workers serve what they served, and the next good
        # update goes through
        assert served(next(it)) == {good}
        with torch.no_grad():
            p.module.lin.bias.add_(1.0)
        c.update_policy_weights_()
        assert served(next(it)) == {round(wsum(p), 4)}


# -- standalone use (TorchRL's documented two-phase pattern), with processes we control ------


def _worker(scheme, idx, out, hold):
    out.put((idx, "ready"))
    model = nn.Linear(4, 2)
    scheme.init_on_receiver(model_id="policy", model=model, worker_idx=idx)
    scheme.connect(worker_idx=idx)
    out.put((idx, model.weight.sum().item()))
    while not hold.is_set():
        time.sleep(0.05)
        out.put((idx, model.weight.sum().item()))
    scheme.shutdown()


def _standalone(workers, start, timeout=3.0):
    ctx = mp.get_context("spawn")
    model = nn.Linear(4, 2)
    scheme = RefitWeightSyncScheme("shm", timeout=timeout)
    scheme.init_on_sender(
        model_id="policy", weights=TensorDict.from_module(model), num_workers=workers, ctx=ctx
    )
    out, hold = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(scheme, i, out, hold)) for i in range(start)]
    for pr in procs:
        pr.start()
    ready = set()
    while len(ready) < start:  # torch imported in every worker started
        i, what = out.get(timeout=60)
        assert what == "ready"
        ready.add(i)
    return model, scheme, procs, out, hold


def _stop(scheme, procs, hold):
    hold.set()
    scheme.shutdown()
    for pr in procs:
        pr.join(10)
        if pr.is_alive():
            pr.kill()


def test_standalone_workers_get_each_version_and_a_dead_worker_is_named():
    model, scheme, procs, out, hold = _standalone(2, 2)
    try:
        scheme.connect()
        with torch.no_grad():
            model.weight.fill_(0.5)
        scheme.send(TensorDict.from_module(model))
        want = model.weight.sum().item()
        seen = {}
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            i, s = out.get(timeout=10)
            if abs(s - want) < 1e-5:
                seen[i] = s
        assert sorted(seen) == [0, 1]
        procs[1].kill()
        procs[1].join(10)
        with torch.no_grad():
            model.weight.fill_(0.25)
        t0 = time.monotonic()
        with pytest.raises((refit.errors.ReceiversLate, refit.errors.ReceiversGone)) as e:
            scheme.send(TensorDict.from_module(model))
        assert time.monotonic() - t0 < 3.0 + 2.0
        assert e.value.receivers == [1], e.value
        assert "worker(s) [1]" in str(e.value)
    finally:
        _stop(scheme, procs, hold)


def test_a_worker_that_never_connects_fails_connect_naming_it():
    model, scheme, procs, out, hold = _standalone(2, 1, timeout=2.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(refit.errors.ReceiversLate) as e:
            scheme.connect()
        assert time.monotonic() - t0 < 2.0 + 2.0
        assert e.value.receivers == [1], e.value
    finally:
        _stop(scheme, procs, hold)


def _solve(scheme: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(REPO / "python" / "examples" / "torchrl_cartpole.py"),
         "--scheme", scheme, "--target", "120", "--max-updates", "60"],
        capture_output=True, text=True, timeout=600, env={**os.environ},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "solved: mean return" in out.stdout, out.stdout
    return re.findall(r"mean return ([0-9.]+) over", out.stdout)


def test_cartpole_learns_as_with_torchrls_own_scheme():
    # same seed, same weights delivered: the same returns, update after update
    ours = _solve("refit")
    theirs = _solve("shared")
    assert ours == theirs
    assert float(ours[-1]) >= 120
