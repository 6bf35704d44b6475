"""A Python engine that serves whatever version a Refit trainer published last.

    REFIT_TOKEN_FILE=token python engine.py policy.spec --updates 3 [--verify]

The spec file is what the trainer wrote (`refit serve --spec-file`, `trainer.py`); the token
is needed by the tcp and broadcast transports only.
"""

import argparse

import numpy as np

# ANCHOR: receive
import refit


def serve(spec: str, updates: int) -> None:
    receiver = refit.Receiver(spec, timeout=60)
    weights = receiver.current().arrays()  # version 1, already acknowledged
    print(f"connected over {receiver.transport}: version {receiver.version()}")
    while updates > 0:
        update = receiver.receive(timeout=1.0)  # None: nothing new this second
        if update is None:
            continue
        weights = update.arrays()  # zero-copy, read-only numpy views
        update.ack()  # the trainer's send() returns once every engine acked
        updates -= 1
        print(f"serving version {update.version()}: sum {sum(float(np.sum(w)) for w in weights.values()):.1f}")
    receiver.close()
# ANCHOR_END: receive


def total(weights) -> float:
    return sum(float(np.sum(w)) for w in weights.values())


# ANCHOR: verify
def serve_copies(spec: str, updates: int) -> None:
    """Serves copies of its own (as an engine on a GPU does), and proves each copy whole after
    the apply, and unchanged while it was served before the next one."""
    receiver = refit.Receiver(spec, timeout=60)
    applied = receiver.current()
    served = {n: a.copy() for n, a in applied.arrays().items()}
    refit.verify_served(applied, served)  # refit.Damaged names the tensor that differs
    print(f"connected over {receiver.transport}: version {receiver.version()}")
    while updates > 0:
        update = receiver.receive(timeout=1.0)
        if update is None:
            continue
        refit.verify_served(applied, served)  # nothing changed it while it was served
        served = {n: a.copy() for n, a in update.arrays().items()}
        refit.verify_served(update, served)  # the copy landed whole
        update.ack()
        applied, updates = update, updates - 1
        print(f"serving version {update.version()}: sum {total(served):.1f} (verified)")
    receiver.close()
# ANCHOR_END: verify


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="the file holding the trainer's spec")
    ap.add_argument("--updates", type=int, default=3, help="versions to serve before leaving")
    ap.add_argument("--verify", action="store_true", help="serve verified copies")
    a = ap.parse_args()
    (serve_copies if a.verify else serve)(a.spec, a.updates)
