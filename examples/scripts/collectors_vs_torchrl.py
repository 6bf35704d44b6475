#!/usr/bin/env python3
"""Collector speed, Refit's and TorchRL's, measured in one invocation.

Runs Refit's `collector_bench --json` (a bare Rust loop, one worker, two threads, worker
processes) and, when this Python has torchrl, TorchRL's collectors on the same task: Gymnasium
CartPole-v1, one environment per worker, a 4-64-64-2 tanh MLP sampling from a categorical
distribution, 1000 frames per batch, new weights after every batch. Beside TorchRL's
collectors it times a bare Python loop doing the same work with no collector (Gymnasium steps,
the same torch MLP forward and sampling, every transition kept), as Refit's side times a bare
Rust loop. Prints one markdown table stamped with the date, commit, versions, machine and load;
every figure in it was measured by this run.

    examples/scripts/collectors_vs_torchrl.py [--frames 200000] [--torchrl-frames 20000]

Run it with a Python that has torch, torchrl and gymnasium (a virtual environment's
`bin/python`); without torchrl it prints Refit's side alone and says so. The Rust example is
built with cargo unless --bench names a built `collector_bench`.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

BATCH = 1000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout.strip()


def refit_side(args):
    exe = args.bench
    if exe is None:
        log("building collector_bench (cargo build --release --example collector_bench)")
        subprocess.run(
            ["cargo", "build", "--release", "--example", "collector_bench"],
            cwd=ROOT,
            check=True,
            stdout=sys.stderr,
        )
        exe = os.path.join(ROOT, "target", "release", "examples", "collector_bench")
    log(f"refit: {exe} --frames {args.frames} --rounds {args.rounds} --json")
    out = run([exe, "--frames", str(args.frames), "--rounds", str(args.rounds), "--json"])
    return json.loads(out)


# --- TorchRL's side ---------------------------------------------------------------------

def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1", categorical_action_encoding=True)


def make_net():
    from torch import nn

    return nn.Sequential(
        nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)
    )


def make_policy():
    from tensordict.nn import TensorDictModule
    from torch.distributions import Categorical
    from torchrl.modules import ProbabilisticActor

    module = TensorDictModule(make_net(), in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(
        module,
        in_keys=["logits"],
        out_keys=["action"],
        distribution_class=Categorical,
        return_log_prob=True,
        spec=make_env().action_spec,
    )


def new_weights(module):
    """Fresh random weights in place (what a trainer's step would leave)."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            bound = 1.0 / (p.shape[-1] ** 0.5)
            p.uniform_(-bound, bound)


def bare_python_loop(frames):
    """The same work with no collector: one Gymnasium CartPole-v1, the torch MLP's forward and
    a categorical sample per step, every transition written into preallocated tensors."""
    import gymnasium as gym
    import torch

    torch.manual_seed(0)
    env = gym.make("CartPole-v1")
    net = make_net()
    obs_t = torch.empty(BATCH, 4)
    next_t = torch.empty(BATCH, 4)
    act_t = torch.empty(BATCH, dtype=torch.int64)
    logp_t = torch.empty(BATCH)
    rew_t = torch.empty(BATCH)
    term_t = torch.empty(BATCH, dtype=torch.bool)
    trunc_t = torch.empty(BATCH, dtype=torch.bool)
    obs, _ = env.reset(seed=0)
    obs = torch.as_tensor(obs)
    done_frames = 0
    start = time.perf_counter()
    with torch.no_grad():
        while done_frames < frames:
            for i in range(BATCH):
                dist = torch.distributions.Categorical(logits=net(obs))
                a = dist.sample()
                nxt, r, term, trunc, _ = env.step(int(a))
                nxt = torch.as_tensor(nxt)
                obs_t[i] = obs
                next_t[i] = nxt
                act_t[i] = a
                logp_t[i] = dist.log_prob(a)
                rew_t[i] = r
                term_t[i] = term
                trunc_t[i] = trunc
                if term or trunc:
                    obs = torch.as_tensor(env.reset()[0])
                else:
                    obs = nxt
            done_frames += BATCH
    return done_frames / (time.perf_counter() - start)


def drive(collector, policy, frames):
    """Takes batches until `frames`, new weights after each (as Refit's bench does); the
    frames per second of that loop alone (building and shutting down are not in it)."""
    got = 0
    start = time.perf_counter()
    for batch in collector:
        got += batch.numel()
        new_weights(policy)
        collector.update_policy_weights_()
        if got >= frames:
            break
    took = time.perf_counter() - start
    collector.shutdown()
    return got / took


def torchrl_side(args):
    import torch
    from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector

    rows = []
    log(f"torchrl: bare Python loop, {args.torchrl_frames} frames")
    bare = bare_python_loop(args.torchrl_frames)
    rows.append(("bare loop", bare))
    common = dict(total_frames=-1, auto_register_policy_transforms=False)
    configs = [
        ("1 worker", lambda p: Collector(make_env, p, frames_per_batch=BATCH, **common)),
        (
            "2 processes, sync",
            lambda p: MultiSyncCollector([make_env] * 2, p, frames_per_batch=BATCH, **common),
        ),
        (
            "2 processes, async",
            lambda p: MultiAsyncCollector([make_env] * 2, p, frames_per_batch=BATCH, **common),
        ),
    ]
    for name, build in configs:
        log(f"torchrl: {name}, {args.torchrl_frames} frames")
        torch.manual_seed(0)
        policy = make_policy()
        collector = build(policy)
        rows.append((name, drive(collector, policy, args.torchrl_frames)))
    return rows


def versions():
    import gymnasium
    import tensordict
    import torch
    import torchrl

    return {
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
        "gymnasium": gymnasium.__version__,
        "torch threads": str(torch.get_num_threads()),
    }


def machine():
    model = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f", {kb / (1 << 20):.0f} GiB memory"
    except (OSError, ValueError, IndexError):
        pass
    return f"{model}, {os.cpu_count()} cores{mem}, Linux {platform.release()}"


def stamp():
    try:
        commit = run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"])
        if run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"]):
            commit += " (with uncommitted changes)"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    try:
        rustc = run(["rustc", "--version"])
    except (OSError, subprocess.CalledProcessError):
        rustc = "rustc unknown"
    return commit, rustc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=200_000, help="frames per Refit measurement")
    ap.add_argument("--rounds", type=int, default=5, help="Refit's bare-loop/1-worker rounds")
    ap.add_argument(
        "--torchrl-frames", type=int, default=20_000, help="frames per TorchRL measurement"
    )
    ap.add_argument("--bench", help="a built collector_bench (default: cargo builds it)")
    args = ap.parse_args()

    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    refit = refit_side(args)
    try:
        import torchrl  # noqa: F401

        have_torchrl = True
    except ImportError:
        have_torchrl = False
    torchrl_rows = torchrl_side(args) if have_torchrl else []
    load_after = os.getloadavg()
    commit, rustc = stamp()

    print(f"Measured {started:%Y-%m-%d %H:%M} UTC, commit {commit}, on {machine()}.")
    print(
        f"Load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after. "
        f"{rustc}; Python {platform.python_version()}"
        + (
            "; " + ", ".join(f"{k} {v}" for k, v in versions().items())
            if have_torchrl
            else "; torchrl not installed in this Python: TorchRL's side not measured"
        )
        + "."
    )
    print(
        f"CartPole-v1, MLP 4-64-64-2 tanh, 1 env per worker, {BATCH} frames per batch, new "
        f"weights after every batch; Refit {args.frames} frames per measurement (bare loop and "
        f"1 worker: medians of {args.rounds} alternating rounds), TorchRL "
        f"{args.torchrl_frames}."
    )
    print()
    refit_bare = next(r["frames_per_s"] for r in refit if r["collector"] == "bare loop")
    torch_by_name = dict(torchrl_rows)
    torch_bare = torch_by_name.get("bare loop")
    print("| collector | Refit frames/s | x Refit bare loop | TorchRL frames/s | x Python bare loop | Refit / TorchRL |")
    print("| --- | --- | --- | --- | --- | --- |")
    names = [r["collector"] for r in refit]
    for name in names + [n for n in torch_by_name if n not in names]:
        r = next((x for x in refit if x["collector"] == name), None)
        t = torch_by_name.get(name)
        cells = [name]
        cells.append(f"{r['frames_per_s'] / 1e3:.0f}k" if r else "-")
        cells.append(f"{r['frames_per_s'] / refit_bare:.2f}x" if r else "-")
        cells.append(f"{t / 1e3:.2f}k" if t else "-")
        cells.append(f"{t / torch_bare:.2f}x" if t and torch_bare else "-")
        cells.append(f"{r['frames_per_s'] / t:.0f}x" if r and t else "-")
        print("| " + " | ".join(cells) + " |")
    one = next((r for r in refit if r["collector"] == "1 worker"), None)
    if one and "cpu_vs_bare" in one:
        print()
        print(
            f"Refit's 1 worker against its bare loop on CPU time: {one['cpu_vs_bare']:.3f}x "
            f"(wall: {one['vs_bare']:.3f}x)."
        )


if __name__ == "__main__":
    main()
