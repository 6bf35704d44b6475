"""Two trainer shards, each holding half the rows of a layer (as a row-sharded trainer
does), publish their halves; two tensor-parallel engines, each serving half the columns,
pull exactly their half from both shards at once. One process here (threads); across
processes or hosts, hand each engine the shards' cards and a shared REFIT_TOKEN.

    python python/examples/mesh.py [--versions 3]
"""

from __future__ import annotations

import argparse
import threading

import numpy as np

import refit

# ANCHOR: mesh
MANIFEST = [("layer.weight", "f32", [1024, 256]), ("layer.bias", "f32", [1024])]


def shard_parts(rank: int) -> list:
    """What trainer shard `rank` of 2 holds: its rows of the weight, its half of the bias."""
    return [("layer.weight", ("slice", 0, rank, 2)), ("layer.bias", ("slice", 0, rank, 2))]


def engine_wants(rank: int) -> list:
    """What tensor-parallel engine `rank` of 2 serves: its columns of the weight, the bias."""
    return [("layer.weight", ("slice", 1, rank, 2)), ("layer.bias", "whole")]


def main(versions: int) -> None:
    shards = [refit.MeshSender(MANIFEST, shard_parts(r)) for r in range(2)]
    cards = [s.card for s in shards]  # address and parts of each shard, no secret
    engines = [refit.MeshReceiver(MANIFEST, cards, engine_wants(r)) for r in range(2)]
    rng = np.random.default_rng(0)
    for v in range(1, versions + 1):
        weight = rng.standard_normal((1024, 256), dtype=np.float32)  # "a training step"
        bias = rng.standard_normal(1024, dtype=np.float32)
        got = {}
        pulls = [threading.Thread(target=lambda r=r: got.__setitem__(r, engines[r].pull(v)))
                 for r in range(2)]
        for t in pulls:
            t.start()
        for r, shard in enumerate(shards):  # each shard publishes only what it holds
            shard.publish(v, {"layer.weight": weight[512 * r: 512 * (r + 1)],
                              "layer.bias": bias[512 * r: 512 * (r + 1)]})
        for t in pulls:
            t.join()
        for r in range(2):
            assert np.array_equal(got[r]["layer.weight"], weight[:, 128 * r: 128 * (r + 1)])
            assert np.array_equal(got[r]["layer.bias"], bias)
        print(f"version {v}: each engine pulled {engines[0].bytes_per_pull} bytes "
              f"of a {1024 * 256 * 4 + 1024 * 4}-byte model")
# ANCHOR_END: mesh


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=3)
    main(parser.parse_args().versions)
