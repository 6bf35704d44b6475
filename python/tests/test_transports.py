"""Every transport of the link factory, received in Python: bytes identical to the
sender's, versions in order, `None` at the deadline, acknowledgements counted only after
`ack()`, zero-copy views."""

from __future__ import annotations

import numpy as np
import pytest

import refit
from conftest import TRANSPORTS, assert_same, weights


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_versions_arrive_whole_and_in_order(pair, transport):
    p = pair(transport)
    first = p.receiver.current()
    assert first.entries == [("policy", 1)]
    assert first.acked
    assert_same(first.arrays(), weights(1))
    for v in range(2, 6):
        want = weights(v)
        p.sender.publish(want)
        u = p.receiver.receive(timeout=20)
        assert u is not None, f"version {v} did not arrive"
        assert u.version() == v
        assert_same(u.arrays(), want)
        u.ack()
        p.sender.wait(timeout=20)
    assert p.receiver.version() == 5
    assert p.sender.version() == 5


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_nothing_new_is_none_at_the_deadline(pair, transport):
    p = pair(transport)
    assert p.receiver.receive(timeout=0.2) is None
    assert p.receiver.version() == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_sender_counts_an_ack_only_after_python_acks(pair, transport):
    p = pair(transport)
    p.sender.publish(weights(2))
    with pytest.raises(refit.Timeout):
        p.sender.wait(timeout=0.3)
    u = p.receiver.receive(timeout=20)
    assert u is not None and not u.acked
    # received and applied to the receiver, but not acknowledged: the sender still waits
    with pytest.raises(refit.Timeout):
        p.sender.wait(timeout=0.3)
    u.ack()
    assert u.acked
    p.sender.wait(timeout=20)
    u.ack()  # a second ack does nothing


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_arrays_are_read_only_views_of_the_received_memory(pair, transport):
    p = pair(transport)
    p.sender.publish(weights(2))
    u = p.receiver.receive(timeout=20)
    start, length = u.memory()
    for name, a in u.items():
        assert not a.flags.writeable, name
        addr = a.__array_interface__["data"][0]
        assert start <= addr and addr + a.nbytes <= start + length, name
        with pytest.raises(ValueError):
            a.flat[0] = a.flat[0]
    # the views keep the version alive after the update object and the receiver are gone
    arrays = u.arrays()
    checksums = u.checksums()
    u.ack()
    del u
    p.receiver.close()
    assert_same(arrays, weights(2))
    assert len(checksums) == len(arrays)


def mapping_of(addr: int) -> str:
    """The file mapped at `addr` in this process ("" for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5] if len(parts) > 5 else ""
    raise AssertionError(f"{addr:#x} is not mapped")


def test_shared_memory_arrays_lie_in_the_senders_slot(pair):
    """Zero-copy proof: the array's buffer is inside a mapping of a /dev/shm file."""
    p = pair("shm")
    p.sender.publish(weights(2))
    u = p.receiver.receive(timeout=20)
    addr = u.arrays()["embed.weight"].__array_interface__["data"][0]
    assert mapping_of(addr).startswith("/dev/shm/"), mapping_of(addr)


def test_copy_mode_reads_shared_memory_into_private_memory(pair):
    p = pair("shm", copy=True)
    p.sender.publish(weights(2))
    u = p.receiver.receive(timeout=20)
    assert_same(u.arrays(), weights(2))
    addr = u.arrays()["embed.weight"].__array_interface__["data"][0]
    assert not mapping_of(addr).startswith("/dev/shm/"), mapping_of(addr)
    u.ack()
    p.sender.wait(timeout=20)


def test_several_models_land_together(tmp_path):
    initial = {"policy": weights(1), "critic": {"v": np.arange(6, dtype=np.float32)}}
    s = refit.Sender("shm", initial, receivers=1)
    import threading

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", refit.Receiver(s.spec, timeout=20)))
    t.start()
    s.start(timeout=20)
    t.join()
    r = box["r"]
    try:
        assert sorted(r.models) == ["critic", "policy"]
        s.publish({"policy": weights(2), "critic": {"v": np.arange(6, dtype=np.float32) * 3}})
        u = r.receive(timeout=20)
        assert sorted(u.entries) == [("critic", 2), ("policy", 2)]
        assert_same(u.arrays("policy"), weights(2))
        assert (u.arrays("critic")["v"] == np.arange(6) * 3).all()
        with pytest.raises(refit.ConfigError, match="name one"):
            u.arrays()
        u.ack()
        s.wait(timeout=20)
    finally:
        r.close()
        s.close()


def test_element_deltas_put_what_changed_on_the_wire(pair):
    base = {"w": np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)}
    p = pair("tcp", base, delta="elements")
    landed0, wire0 = p.receiver.wire
    assert landed0 == wire0 == base["w"].nbytes, "the first version travels whole"
    new = {"w": base["w"].copy()}
    new["w"][::50] += 1.0  # 2% of the elements
    p.sender.publish(new)
    u = p.receiver.receive(timeout=20)
    assert u is not None
    assert_same(u.arrays(), new)
    u.ack()
    p.sender.wait(timeout=20)
    landed, wire = p.receiver.wire
    assert landed - landed0 == new["w"].nbytes
    assert (wire - wire0) * 20 < new["w"].nbytes, f"{wire - wire0} bytes on the wire"


def test_an_unknown_delta_mode_is_refused_naming_the_choices(pair):
    p = pair("tcp")
    with pytest.raises(refit.ConfigError, match='"elements"'):
        refit.Receiver(p.sender.spec, timeout=2, delta="xor")
    assert refit.Receiver is not None and p.receiver.wire is not None
