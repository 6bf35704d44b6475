"""What an engine's memory does during a weight update over TCP, staged against streamed.

A trainer (this process) publishes versions of a model of ``--size`` bytes over TCP; an
engine process holding the model's parameters of its own (numpy arrays, written in place)
receives them, once as ``refit.Receiver.receive`` stages them (every version lands whole in
the receiver's memory, then is copied into the parameters) and once as
``refit.Receiver.stream`` applies them (each tensor copied into its parameter as soon as its
buckets are verified; the receiver keeps nothing). Each engine reports its peak resident
memory above its parameters; the trainer times each update from publish to the engine's
acknowledgement (the engine's copies into its parameters included)::

    python python/examples/stream_memory.py --size 512MiB --versions 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

import refit

MIB = 1 << 20
#: Bytes per bucket of Refit's TCP sender (its default).
BUCKET = 16 * MIB
#: Elements per tensor: 4 MiB of f32, as a layer of a small LLM holds.
TENSOR = MIB


def vm(field: str) -> int:
    """This process's ``VmRSS`` or ``VmHWM`` (peak resident) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def model(size: int, version: int) -> dict[str, np.ndarray]:
    """``size`` bytes of f32 tensors of 4 MiB; every element of version ``v`` is ``v``."""
    n = max(1, size // (TENSOR * 4))
    return {f"layers.{i}.weight": np.full(TENSOR, float(version), np.float32) for i in range(n)}


def put_into(params: dict[str, np.ndarray]) -> Callable[[str, np.ndarray], None]:
    """What an engine does with a tensor: copies it into its parameter (made at the first)."""
    def put(name: str, array: np.ndarray) -> None:
        if name not in params:
            params[name] = np.empty_like(array)
        np.copyto(params[name], array)
    return put


# ANCHOR: stream
def stream_into(spec: str, versions: int, params: dict[str, np.ndarray]) -> None:
    """Streams the version in force and ``versions`` more into ``params``, in place."""
    put = put_into(params)
    receiver = refit.Receiver(spec, stream=True, timeout=60)  # nothing received yet
    for _ in range(versions + 1):  # the version in force, then each next one
        # put(name, array) runs for each tensor as soon as its buckets are verified; the
        # array's memory goes once put returns; the version is acknowledged once all are in
        if receiver.stream(put, timeout=60) is None:
            raise TimeoutError("a version did not come")
    receiver.close()
# ANCHOR_END: stream


def stage_into(spec: str, versions: int, params: dict[str, np.ndarray]) -> None:
    """Receives the version in force and ``versions`` more whole, each then copied into
    ``params``."""
    put = put_into(params)
    receiver = refit.Receiver(spec, timeout=60)
    for name, a in receiver.current().items():
        put(name, a)
    for _ in range(versions):
        update = receiver.receive(timeout=60)
        if update is None:
            raise TimeoutError("a version did not come")
        for name, a in update.items():
            put(name, a)
        update.ack()
    receiver.close()


def engine(spec: str, mode: str, versions: int) -> None:
    """The engine process: every version received by ``mode`` into parameters of its own;
    prints its peak memory above them."""
    before = vm("VmRSS")
    params: dict[str, np.ndarray] = {}
    (stream_into if mode == "stream" else stage_into)(spec, versions, params)
    served = {float(p[0]) for p in params.values()}
    assert served == {float(versions + 1)}, f"served {served}"
    size = sum(p.nbytes for p in params.values())
    print(json.dumps({"mode": mode, "model": size, "extra": vm("VmHWM") - before - size}),
          flush=True)


def run(mode: str, size: int, versions: int) -> dict:
    """One engine of ``mode`` fed ``versions`` versions after the first: its report, with
    the median time from publish to acknowledgement."""
    sender = refit.Sender("tcp", model(size, 1), receivers=1)
    child = subprocess.Popen([sys.executable, __file__, "--engine", mode, "--spec", sender.spec,
                              "--versions", str(versions)], stdout=subprocess.PIPE, text=True)
    try:
        sender.start(timeout=60)
        times = []
        for v in range(2, versions + 2):
            weights = model(size, v)
            t = time.perf_counter()
            sender.publish(weights)
            sender.wait(timeout=60)
            times.append(time.perf_counter() - t)
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
        sender.close()
    if child.returncode != 0:
        raise SystemExit(f"the {mode} engine failed ({child.returncode})")
    return {**json.loads(out.strip().splitlines()[-1]), "update_s": statistics.median(times)}


def size_of(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, n in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * n)
    return int(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="512MiB", help="model size (KiB, MiB, GiB)")
    p.add_argument("--versions", type=int, default=4, help="versions after the first")
    p.add_argument("--engine", choices=["staged", "stream"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ.setdefault("REFIT_TOKEN", os.urandom(16).hex())
    if a.engine:
        engine(a.spec, a.engine, a.versions)
        return 0
    size = size_of(a.size)
    print(f"model {size / MIB:.0f} MiB in tensors of {TENSOR * 4 / MIB:.0f} MiB, "
          f"buckets of {BUCKET / MIB:.0f} MiB, {a.versions} versions over TCP (loopback)")
    for mode in ("staged", "stream"):
        r = run(mode, size, a.versions)
        print(f"{mode:>7}: peak memory above the model {r['extra'] / MIB:7.1f} MiB "
              f"({r['extra'] / r['model']:.2f}x the model, {r['extra'] / BUCKET:.1f} buckets); "
              f"update {r['update_s'] * 1000:.0f} ms (median)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
