"""A TorchRL collector trains CartPole with its weights moved by Refit.

Two collector workers run the policy; the trainer (this process) learns with REINFORCE and
publishes each new policy through the scheme given by ``--scheme``: ``refit`` (Refit's
shared memory, ``RefitWeightSyncScheme("shm")``) or TorchRL's own ``shared`` / ``process``
schemes, so the same run can be compared. It prints one line per update and ends with
``solved: ...`` once the mean return of the last batch reaches ``--target``.

    python python/examples/torchrl_cartpole.py --scheme refit
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import MultiSyncCollector
from torchrl.envs import GymEnv, RewardSum, TransformedEnv
from torchrl.modules import OneHotCategorical, ProbabilisticActor
from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

from refit.torchrl import RefitWeightSyncScheme


def make_env():
    return TransformedEnv(GymEnv("CartPole-v1"), RewardSum())


def make_scheme(name: str):
    # ANCHOR: scheme
    if name == "refit":
        return RefitWeightSyncScheme("shm", timeout=30.0)
    # ANCHOR_END: scheme
    if name == "shared":
        return SharedMemWeightSyncScheme()
    if name == "process":
        return MultiProcessWeightSyncScheme()
    raise SystemExit(f"error: unknown scheme {name!r} (refit, shared, process)")


def returns_to_go(reward: torch.Tensor, done: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted returns along the last dimension, restarted after each done."""
    out = torch.zeros_like(reward)
    running = torch.zeros_like(reward[..., 0])
    for t in range(reward.shape[-1] - 1, -1, -1):
        running = reward[..., t] + gamma * running * (~done[..., t]).float()
        out[..., t] = running
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default="refit", help="refit, shared or process")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--frames", type=int, default=1000, help="frames per batch, all workers")
    p.add_argument("--target", type=float, default=150.0, help="mean return that solves it")
    p.add_argument("--max-updates", type=int, default=150)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(args.seed)

    env = make_env()
    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
    policy = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=OneHotCategorical,
        spec=env.action_spec,
    )
    env.close()
    optim = torch.optim.Adam(net.parameters(), lr=1e-2)

    t0 = time.perf_counter()
    # ANCHOR: collector
    collector = MultiSyncCollector(
        [make_env] * args.workers,
        policy,
        frames_per_batch=args.frames,
        total_frames=-1,
        weight_sync_schemes={"policy": make_scheme(args.scheme)},
        track_policy_version=True,
    )
    # ANCHOR_END: collector
    collector.set_seed(args.seed)
    print(f"{args.scheme}: {args.workers} workers ready in {time.perf_counter() - t0:.1f} s")

    solved = False
    for update, batch in enumerate(collector, start=1):
        done = batch["next", "done"].squeeze(-1)
        finished = batch["next", "episode_reward"][done]
        mean_return = finished.mean().item() if finished.numel() else float("nan")
        version = batch["policy_version"].max().item()
        print(f"update {update}: mean return {mean_return:.1f} over {finished.numel()} "
              f"episodes, collected with policy version {version}")
        if finished.numel() and mean_return >= args.target:
            solved = True
            break
        if update >= args.max_updates:
            break
        g = returns_to_go(batch["next", "reward"].squeeze(-1), done, 0.99)
        g = (g - g.mean()) / (g.std() + 1e-8)
        logits = net(batch["observation"])
        logp = torch.distributions.Categorical(logits=logits).log_prob(
            batch["action"].argmax(-1)
        )
        loss = -(logp * g).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        # ANCHOR: update
        collector.update_policy_weights_(policy)
        # ANCHOR_END: update
    collector.shutdown()
    if solved:
        print(f"solved: mean return {mean_return:.1f} >= {args.target:g} after {update} updates "
              f"({args.scheme}, {time.perf_counter() - t0:.1f} s)")
        return 0
    print(f"error: not solved in {args.max_updates} updates ({args.scheme})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
