"""Receive of a large model into Python against the same receive in Rust, in one run.

One Python sender (Refit's Rust core) publishes `--size` bytes as float32 over each
transport to one receiver process at a time: a Rust receiver (`refit __bench-child link`,
the bench's own receiver, which copies every version into its memory) or a Python one
(`refit.Receiver`: receive, numpy views of every tensor, ack). The figure is the time from
the start of a publish to the receiver's acknowledgement, median of `--iters`; the
publish alone (filling the sender's slot or arena) is shown beside it. Python runs twice on
shared memory: with `copy=True`, the same work as the Rust receiver, and in its default
zero-copy mode.

    python python/examples/bench_receive.py --size 512MiB --iters 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import refit

REPO = Path(__file__).resolve().parents[2]
TOKEN = "bench-receive-0123456789abcdef"

PY_RECEIVER = """
import sys, refit
r = refit.Receiver(sys.argv[2], timeout=60, copy=sys.argv[1] == "copy")
while True:
    try:
        u = r.receive(timeout=60)
    except refit.PeerGone:
        break
    if u is None:
        sys.exit("no update within 60 s")
    arrays = u.arrays()
    u.ack()
    del arrays, u
"""


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    t = text.strip().lower()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def run(transport: str, receiver: list[str], size: int, iters: int, warmup: int):
    n = size // 4
    versions = [np.full(n, float(i), dtype=np.float32) for i in range(2)]
    s = refit.Sender(transport, {"w": versions[0]}, receivers=1)
    proc = subprocess.Popen(receiver + [s.spec], env=os.environ | {"REFIT_TOKEN": TOKEN}, cwd="/")
    try:
        s.start(timeout=60)
        e2e, publish = [], []
        for i in range(warmup + iters):
            t = time.perf_counter()
            s.publish({"w": versions[i % 2]}, timeout=60)
            p = time.perf_counter() - t
            s.wait(timeout=60)
            d = time.perf_counter() - t
            if i >= warmup:
                e2e.append(d)
                publish.append(p)
    finally:
        s.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return statistics.median(e2e), statistics.median(publish)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="512MiB")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--refit-bin", default=os.environ.get("REFIT_BIN", str(REPO / "target/release/refit")))
    args = ap.parse_args()
    os.environ["REFIT_TOKEN"] = TOKEN
    size = parse_size(args.size)
    rust = [args.refit_bin, "__bench-child", "link"]
    print(f"# {size / 2**20:.0f} MiB, median of {args.iters} (after {args.warmup} warm-up), publish to ack")
    print(f"{'transport':<10} {'receiver':<22} {'end-to-end':>11} {'publish':>9} {'receive':>9} {'vs rust':>8}")
    for transport in args.transports.split(","):
        arms = [("rust", rust)]
        if transport == "shm":
            arms += [("python copy=True", [sys.executable, "-c", PY_RECEIVER, "copy"])]
            arms += [("python (zero-copy)", [sys.executable, "-c", PY_RECEIVER, "zero"])]
        else:
            arms += [("python", [sys.executable, "-c", PY_RECEIVER, "copy"])]
        # every receiver command gets the spec as its last argument
        base = None
        for name, cmd in arms:
            e2e, pub = run(transport, cmd, size, args.iters, args.warmup)
            recv = e2e - pub
            base = base or recv
            print(
                f"{transport:<10} {name:<22} {e2e * 1e3:>9.1f}ms {pub * 1e3:>7.1f}ms "
                f"{recv * 1e3:>7.1f}ms {recv / base:>7.3f}x"
            )


if __name__ == "__main__":
    main()
