"""TorchRL's weight-sync schemes beside Refit's, measured in one run.

For each scheme (TorchRL's ``SharedMemWeightSyncScheme`` and ``MultiProcessWeightSyncScheme``,
Refit's ``RefitWeightSyncScheme("shm")``), each number of workers of a ``MultiSyncCollector``
and each policy size, it times the collector's setup and ``update_policy_weights_()`` (the
trainer's weights changed before each update, every worker serving them when it returns),
and prints each median beside a one-thread memcpy of the same bytes measured in this run.

Two ways a trainer hands its weights over (``--source``):

- ``separate``: the trainer learns on a model of its own and passes its weights,
  ``update_policy_weights_(TensorDict.from_module(trainer))`` (a trainer on a GPU, a
  learner apart from the acting policy);
- ``own``: the trainer learns on the very module given to the collector and calls
  ``update_policy_weights_()``. TorchRL's CPU schemes then move nothing: the workers'
  parameters are the trainer's own storage, so they see every optimizer step as it is
  written, mid-batch (no version isolation); Refit's workers serve the published version
  until the next one.

    python examples/scripts/torchrl_schemes_bench.py               # 64 and 512 MiB, 1/2/4 workers
    python examples/scripts/torchrl_schemes_bench.py --sizes-mib 64 --workers 1,4 --updates 9

Needs torch, torchrl, gymnasium and the refit package (``scripts/python-env.sh`` makes such
an environment).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import MultiSyncCollector
from torchrl.envs import GymEnv
from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

from refit.torchrl import RefitWeightSyncScheme

SCHEMES = {
    "torchrl-shared": SharedMemWeightSyncScheme,
    "torchrl-process": MultiProcessWeightSyncScheme,
    "refit-shm": lambda: RefitWeightSyncScheme("shm", timeout=120.0),
}


class Big(nn.Module):
    """A CartPole policy carrying ``mib`` MiB of weights it does not read when acting."""

    def __init__(self, mib: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.blob = nn.Parameter(torch.zeros(mib * 2**20 // 4))

    def forward(self, obs):
        return nn.functional.one_hot(self.lin(obs).argmax(-1), 2)


def make_env():
    return GymEnv("CartPole-v1")


def memcpy_ms(nbytes: int, reps: int) -> float:
    """Median of a one-thread copy of ``nbytes`` between two touched buffers."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(name: str, workers: int, mib: int, updates: int, warmup: int, source: str) -> tuple[float, float]:
    """``(setup seconds, median update ms)`` of one scheme, workers, size and source."""
    policy = TensorDictModule(Big(mib), in_keys=["observation"], out_keys=["action"])
    trainer = (
        TensorDictModule(Big(mib), in_keys=["observation"], out_keys=["action"])
        if source == "separate"
        else policy
    )
    t0 = time.perf_counter()
    collector = MultiSyncCollector(
        [make_env] * workers,
        policy,
        frames_per_batch=8 * workers,
        total_frames=-1,
        weight_sync_schemes={"policy": SCHEMES[name]()},
    )
    it = iter(collector)
    next(it)
    setup = time.perf_counter() - t0
    times = []
    try:
        for k in range(warmup + updates):
            with torch.no_grad():
                trainer.module.blob.add_(1.0)
            t0 = time.perf_counter()
            if source == "separate":
                collector.update_policy_weights_(TensorDict.from_module(trainer))
            else:
                collector.update_policy_weights_()
            if k >= warmup:
                times.append(time.perf_counter() - t0)
            next(it)
    finally:
        collector.shutdown()
    return setup, statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="64,512")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--updates", type=int, default=7, help="timed updates per case (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed updates first")
    p.add_argument("--source", default="separate,own", help="separate, own (see above)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'source':<9} {'scheme':<16} {'workers':>7} {'MiB':>5} {'setup s':>8} "
          f"{'update ms':>10} {'memcpy ms':>10} {'x memcpy':>9}")
    for source in args.source.split(","):
        for mib in [int(x) for x in args.sizes_mib.split(",")]:
            base = memcpy_ms(mib * 2**20, 7)
            for workers in [int(x) for x in args.workers.split(",")]:
                for name in args.schemes.split(","):
                    setup, ms = run(name, workers, mib, args.updates, args.warmup, source)
                    print(f"{source:<9} {name:<16} {workers:>7} {mib:>5} {setup:>8.1f} "
                          f"{ms:>10.1f} {base:>10.1f} {ms / base:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
