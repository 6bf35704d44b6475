"""`Receiver.stream`: each tensor handed to the caller's `apply` as soon as it is verified,
into a model the caller holds; acknowledged once whole; a failure part-way raised as
NeedsFullResend, the version streamed whole by the next call."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import refit
from conftest import TRANSPORTS, assert_same, weights


class Model:
    """The caller's model: its own arrays, written in place by `apply`."""

    def __init__(self, like: dict[str, np.ndarray]) -> None:
        self.params = {n: np.zeros_like(a) for n, a in like.items()}
        self.calls: list[str] = []

    def apply(self, name: str, array: np.ndarray) -> None:
        assert not array.flags.writeable, "the streamed memory is read-only"
        np.copyto(self.params[name], array)
        self.calls.append(name)


def streaming_pair(transport: str, tmp_path, **kw):
    """A sender of weights(1) and a receiver made with `stream=True` that streamed it into a
    model (the sender's start waits for that acknowledgement)."""
    sender = refit.Sender(transport, weights(1), receivers=1, dir=tmp_path / "files" if transport == "file" else None)
    box: dict = {}

    def connect() -> None:
        try:
            r = refit.Receiver(sender.spec, timeout=20, stream=True, **kw)
            model = Model(weights(1))
            box["got"] = r.stream(model.apply, timeout=20)
            box["r"], box["model"] = r, model
        except Exception as e:  # surfaced below
            box["e"] = e

    t = threading.Thread(target=connect)
    t.start()
    sender.start(timeout=20)
    t.join(30)
    if "e" in box:
        sender.close()
        raise box["e"]
    assert box["got"] == [("policy", 1)]
    return sender, box["r"], box["model"]


@pytest.fixture
def tcp(tmp_path):
    """A TCP sender and a streaming receiver holding its version 1 in a model; closed after."""
    sender, r, model = streaming_pair("tcp", tmp_path)
    yield sender, r, model
    r.close()
    sender.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_version_streams_into_the_callers_model(transport, tmp_path):
    sender, r, model = streaming_pair(transport, tmp_path)
    try:
        assert_same(model.params, weights(1))
        assert sorted(model.calls) == sorted(weights(1))
        for v in range(2, 5):
            sender.publish(weights(v))
            assert r.stream(model.apply, timeout=20) == [("policy", v)]
            # acknowledged by stream: the sender's wait returns
            sender.wait(timeout=20)
            assert_same(model.params, weights(v))
        assert r.version() == 4
        assert r.stream(model.apply, timeout=0.2) is None
    finally:
        r.close()
        sender.close()


def test_torch_tensors_stream_into_torch_parameters(tcp):
    sender, r, model = tcp
    torch = pytest.importorskip("torch")
    sender.publish(weights(2))
    params = {n: torch.zeros(a.shape, dtype=torch.from_numpy(a).dtype) for n, a in weights(2).items()}
    r.stream(lambda n, t: params[n].copy_(t), timeout=20, torch=True)
    assert_same({n: t.numpy() for n, t in params.items()}, weights(2))


def test_a_dtype_numpy_cannot_hold_is_refused_before_anything_streams(tmp_path):
    torch = pytest.importorskip("torch")
    w = {"bf": torch.arange(6, dtype=torch.bfloat16), "f": torch.ones(3)}
    sender = refit.Sender("tcp", w, receivers=1)
    box: dict = {}

    def connect() -> None:
        r = refit.Receiver(sender.spec, timeout=20, stream=True)
        box["params"] = {}
        r.stream(lambda n, t: box["params"].__setitem__(n, t.clone()), timeout=20, torch=True)
        box["r"] = r

    t = threading.Thread(target=connect)
    t.start()
    sender.start(timeout=20)
    t.join(30)
    r = box["r"]
    try:
        assert torch.equal(box["params"]["bf"], w["bf"])
        sender.publish({n: x + 1 for n, x in w.items()})
        with pytest.raises(refit.DTypeError, match="`bf`.*bf16"):
            r.stream(lambda n, a: None, timeout=20)
        assert r.version() == 1  # nothing streamed
        assert r.stream(lambda n, t: None, timeout=20, raw=True) == [("policy", 2)]
        with pytest.raises(refit.ConfigError, match="not received"):
            r.ack([("policy", 9)])
    finally:
        r.close()
        sender.close()


def test_an_exception_of_apply_part_way_is_needs_full_resend_and_the_next_call_repairs(tcp):
    sender, r, model = tcp
    sender.publish(weights(2))
    seen = []

    def failing(name: str, array: np.ndarray) -> None:
        seen.append(name)
        if len(seen) == 2:
            raise ValueError("the engine refused it")
        model.apply(name, array)

    with pytest.raises(refit.NeedsFullResend, match="1 of the update's 6 tensors applied.*apply raised ValueError") as e:
        r.stream(failing, timeout=20)
    assert isinstance(e.value.__cause__, ValueError)
    assert r.version() == 1
    with pytest.raises(refit.Timeout):
        sender.wait(timeout=0.3)
    # nothing applied: the exception itself
    with pytest.raises(ValueError, match="refused"):
        r.stream(lambda n, a: (_ for _ in ()).throw(ValueError("refused at once")), timeout=20)
    assert r.stream(model.apply, timeout=20) == [("policy", 2)]
    sender.wait(timeout=20)
    assert_same(model.params, weights(2))


def test_apply_cannot_call_its_receiver(tcp):
    sender, r, model = tcp
    sender.publish(weights(2))

    def nosy(name: str, array: np.ndarray) -> None:
        r.version()

    with pytest.raises(refit.Closed, match="streaming"):
        r.stream(nosy, timeout=20)
    assert r.version() == 1


def test_a_stream_acknowledged_later_holds_the_sender_until_ack(tcp):
    sender, r, model = tcp
    sender.publish(weights(2))
    entries = r.stream(model.apply, timeout=20, ack=False)
    assert entries == [("policy", 2)]
    assert_same(model.params, weights(2))
    # applied, not acknowledged: the sender still waits (an engine completing its load)
    with pytest.raises(refit.Timeout):
        sender.wait(timeout=0.3)
    r.ack(entries)
    sender.wait(timeout=20)
    r.ack(entries)  # again: nothing
