"""Trainer shards publishing the parts they hold and engines pulling the parts they serve,
from Python, over real sockets: bit for bit, each engine only its slice, bad plans and
missing versions refused naming the culprit."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import refit

MANIFEST = [("w", "f32", [8, 6]), ("b", "f32", [6])]


def whole(version: int) -> dict[str, np.ndarray]:
    return {
        "w": (np.arange(48, dtype=np.float32).reshape(8, 6) + 100 * version),
        "b": (np.arange(6, dtype=np.float32) - version),
    }


def test_row_shards_feed_column_engines_each_their_half():
    held = [[("w", ("slice", 0, r, 2)), ("b", ("flat", 3 * r, 3 * r + 3))] for r in range(2)]
    senders = [refit.MeshSender(MANIFEST, h) for h in held]
    cards = [s.card for s in senders]
    wants = [[("w", ("slice", 1, r, 2)), ("b", "whole")] for r in range(2)]
    receivers = [refit.MeshReceiver(MANIFEST, cards, w) for w in wants]
    # each engine reads half of w and all of b, plus a checksum per shard
    assert [r.bytes_per_pull for r in receivers] == [24 * 4 + 6 * 4 + 16] * 2
    for v in (1, 2):
        got: dict[int, dict[str, np.ndarray]] = {}

        def pull(i: int) -> None:
            got[i] = receivers[i].pull(v, timeout=20)

        threads = [threading.Thread(target=pull, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        w = whole(v)
        for r, s in enumerate(senders):
            s.publish(v, {"w": w["w"][4 * r : 4 * r + 4], "b": w["b"][3 * r : 3 * r + 3]})
        for t in threads:
            t.join(30)
        for r in range(2):
            assert got[r]["w"].shape == (8, 3)
            assert np.array_equal(got[r]["w"], w["w"][:, 3 * r : 3 * r + 3])
            assert np.array_equal(got[r]["b"], w["b"])


def test_a_gap_in_the_shards_and_a_missing_version_are_refused_naming_them():
    only_top = refit.MeshSender(MANIFEST, [("w", ("slice", 0, 0, 2))])
    with pytest.raises(refit.ConfigError, match=r"`w`.*24\.\.48.*no sender"):
        refit.MeshReceiver(MANIFEST, [only_top.card], [("w", "whole")])
    with pytest.raises(refit.ConfigError, match="part is"):
        refit.MeshReceiver(MANIFEST, [only_top.card], [("w", ("rows", 1))])
    r = refit.MeshReceiver(MANIFEST, [only_top.card], [("w", ("slice", 0, 0, 2))])
    with pytest.raises(refit.TransportError, match="not published"):
        r.pull(1, timeout=0.3)
    with pytest.raises(refit.Refused, match="`w`"):
        only_top.publish(1, {"w": np.zeros(5, np.float32)})
    only_top.publish(1, {"w": whole(1)["w"][:4]})
    assert np.array_equal(r.pull(1)["w"], whole(1)["w"][:4])


def test_pull_into_fills_the_callers_arrays_version_after_version_and_refuses_bad_ones():
    held = [[("w", ("slice", 0, r, 2)), ("b", ("flat", 3 * r, 3 * r + 3))] for r in range(2)]
    senders = [refit.MeshSender(MANIFEST, h) for h in held]
    r = refit.MeshReceiver(MANIFEST, [s.card for s in senders], [("w", ("slice", 1, 1, 2)), ("b", "whole")])
    parts = r.empty_parts()
    assert parts["w"].shape == (8, 3) and parts["b"].shape == (6,)
    at = {n: a.ctypes.data for n, a in parts.items()}
    for v in (1, 2):
        w = whole(v)
        for i, s in enumerate(senders):
            s.publish(v, {"w": w["w"][4 * i : 4 * i + 4], "b": w["b"][3 * i : 3 * i + 3]})
        r.pull_into(v, parts, timeout=20)
        assert np.array_equal(parts["w"], w["w"][:, 3:6])
        assert np.array_equal(parts["b"], w["b"])
        assert {n: a.ctypes.data for n, a in parts.items()} == at  # the same memory
    with pytest.raises(refit.Refused, match="no array for b"):
        r.pull_into(2, {"w": parts["w"]})
    with pytest.raises(refit.Refused, match="`b`"):
        r.pull_into(2, {"w": parts["w"], "b": np.empty(5, np.float32)})
    frozen = parts["b"].copy()
    frozen.flags.writeable = False
    with pytest.raises(refit.Refused, match="writable"):
        r.pull_into(2, {"w": parts["w"], "b": frozen})
    with pytest.raises(refit.Refused, match="C-contiguous"):
        r.pull_into(2, {"w": np.empty((3, 8), np.float32).T, "b": parts["b"]})
    both = np.empty(24 + 6, np.float32)
    with pytest.raises(refit.Refused, match="overlap"):
        r.pull_into(2, {"w": both[:24], "b": both[20:26]})
    # an empty buffer between two that overlap does not hide them (the native call, whose
    # buffers the wrapper has not checked)
    views = [memoryview(both[:24]).cast("B"), memoryview(both[10:10]).cast("B"), memoryview(both[20:26]).cast("B")]
    with pytest.raises(refit.Refused, match="buffers 0 and 2 overlap"):
        r._r.pull_into(2, views)
    # refused before anything was pulled: the arrays still hold version 2
    assert np.array_equal(parts["w"], whole(2)["w"][:, 3:6])
