"""A Python trainer that publishes its weights to Refit receivers (Rust or Python).

    python trainer.py --transport shm --spec-file policy.spec --engines 1 --updates 3
"""

import argparse
from pathlib import Path

import numpy as np

# ANCHOR: send
import refit


def train(transport: str, spec_file: Path, engines: int, updates: int) -> None:
    rng = np.random.default_rng(0)
    state = {"layer.weight": rng.standard_normal((256, 64), dtype=np.float32),
             "layer.bias": np.zeros(256, np.float32)}
    sender = refit.Sender(transport, state, receivers=engines)
    spec_file.write_text(sender.spec)  # no secret in it
    sender.start(timeout=60)  # waits for the engines, publishes version 1
    for _ in range(updates):
        state = {name: w + 1.0 for name, w in state.items()}  # "a training step"
        sender.send(state, timeout=60)  # next version; returns once every engine acked
        print(f"version {sender.version()} acknowledged")
    sender.close()
# ANCHOR_END: send


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", default="shm", choices=refit.transports())
    ap.add_argument("--spec-file", type=Path, required=True)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--updates", type=int, default=3)
    a = ap.parse_args()
    train(a.transport, a.spec_file, a.engines, a.updates)
