"""A Python engine that serves whatever version a Refit trainer published last.

    REFIT_TOKEN_FILE=token python engine.py policy.spec --updates 3

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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="the file holding the trainer's spec")
    ap.add_argument("--updates", type=int, default=3, help="versions to serve before leaving")
    a = ap.parse_args()
    serve(a.spec, a.updates)
