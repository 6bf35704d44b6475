"""A Ray trainer actor publishes three versions to two Ray engine actors through Refit, then
one engine is killed and the next update names it.

    python python/examples/ray_engines.py --transport tcp

Each engine loads a version into its torch model and acknowledges it; the trainer prints
each version with the weight sum every engine serves. Needs ray and torch.
"""

from __future__ import annotations

import argparse
import sys
import time

import ray
import torch
from torch import nn

import refit
from refit.ray import RaySender, RefitReceiver


# ANCHOR: engine
@ray.remote
class Engine(RefitReceiver):
    """An inference engine: its model gets each version the trainer publishes."""

    def __init__(self) -> None:
        self.model = nn.Linear(64, 64)

    def load_weights(self, update: refit.Update) -> None:
        self.model.load_state_dict(update.state_dict())  # copies out of the link's memory

    def served(self) -> tuple[int, float]:
        return self.refit_version(), self.model.weight.sum().item()
# ANCHOR_END: engine


# ANCHOR: trainer
@ray.remote
class Trainer:
    def __init__(self, transport: str, engines: dict, timeout: float) -> None:
        self.model = nn.Linear(64, 64)
        self.sender = RaySender(transport, self.model.state_dict(), engines, timeout=timeout)
        self.sender.connect()

    def step(self) -> tuple[int, float]:
        with torch.no_grad():
            self.model.weight.add_(0.01)  # a training step
        version = self.sender.send(self.model.state_dict())
        return version, self.model.weight.sum().item()
# ANCHOR_END: trainer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", default="tcp", help="tcp, shm, file or broadcast")
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args()

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    engines = {f"engine-{i}": Engine.remote() for i in range(2)}
    trainer = Trainer.remote(args.transport, engines, args.timeout)
    for _ in range(args.versions):
        version, want = ray.get(trainer.step.remote())
        served = ray.get([e.served.remote() for e in engines.values()])
        for name, (v, s) in zip(engines, served):
            ok = v == version and abs(s - want) < 1e-3
            print(f"version {version}: {name} serves version {v} ({'same' if ok else 'DIFFERENT'} weights)")
            if not ok:
                return 1
    ray.kill(engines["engine-1"])
    t0 = time.monotonic()
    try:
        ray.get(trainer.step.remote())
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(e.cause, refit.errors.RefitError) else e
        print(f"after {time.monotonic() - t0:.1f} s: {type(cause).__name__}: {cause}")
        return 0 if "engine-1" in str(cause) else 1
    print("error: the update to a dead engine did not fail", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
