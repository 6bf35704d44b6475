"""Feeds an SGLang server every version a Refit trainer publishes.

    REFIT_TOKEN_FILE=token python sglang_engine.py policy.spec \
        --server http://127.0.0.1:30000 --base /models/my-llama --staging /dev/shm/refit-sglang

`--base` is a directory with the model's configuration (the one SGLang was started from);
`--staging` a directory SGLang can read, where each version is written before it loads it.
"""

import argparse

# ANCHOR: sglang
import refit
from refit.sglang import SGLangServer


def feed(spec: str, url: str, base: str, staging: str, updates: int, api_key: str | None = None) -> None:
    server = SGLangServer(url, base=base, staging=staging, api_key=api_key)
    with refit.Receiver(spec, timeout=60) as receiver:
        server.load(receiver.current())  # the version in force now
        while updates > 0:
            update = receiver.receive(timeout=1.0)
            if update is None:
                continue
            try:
                server.load(update)  # SGLang loads it, then the trainer gets the ack
            except refit.Refused as e:  # SGLang kept its previous weights
                print(f"version {update.version()} refused: {e}")
            updates -= 1
# ANCHOR_END: sglang


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="the file holding the trainer's spec")
    ap.add_argument("--server", required=True, help="the SGLang server's address")
    ap.add_argument("--base", required=True, help="a directory with the model's config.json")
    ap.add_argument("--staging", required=True, help="where version directories are written")
    ap.add_argument("--updates", type=int, default=3, help="versions to load before leaving")
    ap.add_argument("--api-key", help="SGLang's admin key, if it has one")
    a = ap.parse_args()
    feed(a.spec, a.server, a.base, a.staging, a.updates, a.api_key)
