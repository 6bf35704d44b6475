"""Bad input gets a typed exception naming the culprit, and loses nothing: the previous
version stays in force and the receiver goes on."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import refit
from conftest import TRANSPORTS, assert_same, weights


def _read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_version(dir: Path, header: dict, data: bytes, version: int) -> None:
    """Writes `policy.v{version}.safetensors` and points CURRENT at it, as a sender would
    (a forged one: tests only)."""
    header["__metadata__"] = {
        k: (str(version) if v == str(version - 1) else v)
        for k, v in header.get("__metadata__", {}).items()
    }
    head = json.dumps(header).encode()
    head += b" " * (-(8 + len(head)) % 64)
    name = f"policy.v{version}.safetensors"
    tmp = dir / f".{name}.tmp"
    tmp.write_bytes(struct.pack("<Q", len(head)) + head + data)
    tmp.rename(dir / name)
    pointer = json.loads((dir / "CURRENT").read_text())
    pointer["seq"] += 1
    pointer["models"] = [{"model": "policy", "version": version, "file": name}]
    (dir / ".CURRENT.tmp").write_text(json.dumps(pointer))
    (dir / ".CURRENT.tmp").rename(dir / "CURRENT")


def test_a_corrupt_version_is_refused_and_the_previous_one_kept(pair, tmp_path):
    p = pair("file")
    p.sender.send(weights(2), timeout=20) if False else p.sender.publish(weights(2))
    u = p.receiver.receive(timeout=20)
    u.ack()
    p.sender.wait(timeout=20)
    files = tmp_path / "files"
    header, data = _read_header(files / "policy.v2.safetensors")
    bad = bytearray(data)
    bad[5] ^= 0xFF  # one flipped bit pattern in the first tensor's bytes
    _write_version(files, header, bytes(bad), 3)
    with pytest.raises(refit.Refused) as e:
        p.receiver.receive(timeout=20)
    assert "policy.v3.safetensors" in str(e.value) or "checksum" in str(e.value)
    assert p.receiver.version() == 2
    assert_same(p.receiver.current().arrays(), weights(2))
    # the sender goes on; the receiver takes its next versions
    p.sender.publish(weights(3))
    p.sender.publish(weights(4))
    got = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (got is None or got.version() < 4):
        got = p.receiver.receive(timeout=1) or got
    assert got is not None and got.version() == 4
    assert_same(got.arrays(), weights(4))


def test_a_wrong_shape_version_is_refused_naming_the_tensor(pair, tmp_path):
    p = pair("file")
    files = tmp_path / "files"
    header, data = _read_header(files / "policy.v1.safetensors")
    meta = header["embed.weight"]
    meta["shape"] = [16, 33]  # same bytes, another shape
    _write_version(files, header, data, 2)
    with pytest.raises(refit.Refused, match="embed.weight"):
        p.receiver.receive(timeout=20)
    assert p.receiver.version() == 1
    assert_same(p.receiver.current().arrays(), weights(1))


def test_the_sender_refuses_arrays_that_do_not_fit_its_manifest(pair):
    p = pair("shm")
    wrong = weights(2)
    wrong["embed.weight"] = wrong["embed.weight"][:5]
    with pytest.raises(refit.Refused, match="embed.weight"):
        p.sender.publish(wrong)
    extra = weights(2) | {"stranger": np.zeros(3, np.float32)}
    with pytest.raises(refit.Refused, match="stranger"):
        p.sender.publish(extra)
    missing = weights(2)
    del missing["steps"]
    with pytest.raises(refit.Refused, match="steps"):
        p.sender.publish(missing)
    # nothing of those went out: the next good version is version 2
    p.sender.publish(weights(2))
    u = p.receiver.receive(timeout=20)
    assert u.version() == 2
    assert_same(u.arrays(), weights(2))


def test_a_dtype_refit_lacks_is_named():
    with pytest.raises(refit.DTypeError, match="`c`"):
        refit.Sender("shm", {"c": np.zeros(3, np.complex64)})


def test_bad_specs_and_tokens_are_named(monkeypatch, tmp_path):
    with pytest.raises(refit.ConfigError, match="not a refit receiver spec"):
        refit.Receiver("00ff00ff")
    with pytest.raises(refit.ConfigError, match="reading the receiver spec"):
        refit.Receiver(tmp_path / "no-such.spec")
    s = refit.Sender("tcp", weights(1))
    try:
        monkeypatch.delenv("REFIT_TOKEN")
        with pytest.raises(refit.ConfigError, match="REFIT_TOKEN"):
            refit.Receiver(s.spec, timeout=2)
        with pytest.raises(refit.ConfigError, match="is 5 bytes long: a cluster token is 16 to 256"):
            refit.Receiver(s.spec, timeout=2, token="short")
    finally:
        s.close()


def test_a_wrong_token_is_refused_by_the_sender(tmp_path):
    s = refit.Sender("tcp", weights(1), token="the-senders-token-0123456789")
    t = threading.Thread(target=lambda: s.start(timeout=5))
    t.start()
    try:
        with pytest.raises(refit.Unauthorized):
            refit.Receiver(s.spec, timeout=5, token="another-token-0123456789ab")
    finally:
        t.join()
        s.close()


SENDER = """
import sys, time, numpy as np, refit
sys.path.insert(0, {tests!r})
from conftest import weights
s = refit.Sender({transport!r}, weights(1), receivers=1, dir={dir!r})
print(s.spec, flush=True)
s.start(timeout=30)
time.sleep(600)
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_sender_is_an_exception_not_a_hang(transport, tmp_path):
    code = SENDER.format(
        tests=str(Path(__file__).parent),
        transport=transport,
        dir=str(tmp_path / "files") if transport == "file" else None,
    )
    # run from elsewhere: the source tree's `refit` (without its compiled module) must not
    # shadow the installed package
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        spec = proc.stdout.readline().strip()
        r = refit.Receiver(spec, timeout=30)
        assert r.version() == 1
        proc.kill()
        proc.wait()
        started = time.monotonic()
        with pytest.raises(refit.PeerGone):
            while time.monotonic() - started < 30:
                r.receive(timeout=1)
        # the last version stays readable
        assert_same(r.current().arrays(), weights(1))
        r.close()
    finally:
        proc.kill()


def test_ctrl_c_interrupts_a_wait_and_loses_nothing(pair):
    p = pair("shm")
    # Python's own Ctrl-C handling, whatever this process inherited: a process started in
    # the background by a non-interactive shell inherits SIGINT ignored, and Python then
    # never raises KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            p.receiver.receive(timeout=30)
        assert time.monotonic() - started < 10
    finally:
        signal.signal(signal.SIGINT, previous)
    # a version published after the interrupt is given by the next call
    p.sender.publish(weights(2))
    u = p.receiver.receive(timeout=20)
    assert u is not None and u.version() == 2
    assert_same(u.arrays(), weights(2))


@pytest.mark.parametrize("checksum", [True, False])
def test_a_shm_version_damaged_in_its_slot_is_refused_when_the_sender_checksums(tmp_path, checksum):
    # a version whose bytes change in shared memory after the sender wrote them (a stray
    # write, a bad page) is refused whole with `checksum=True`; without it, it is served
    # as it is (what makes this test able to fail)
    import threading

    pattern = np.full(4096, 0x5A, np.uint8)
    sender = refit.Sender(
        "shm", {"w": np.zeros(4096, np.uint8)}, receivers=1, dir=tmp_path, checksum=checksum
    )
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("r", refit.Receiver(sender.spec, timeout=10)))
    t.start()
    sender.start(10)
    t.join()
    receiver = got["r"]
    try:
        sender.publish({"w": pattern})
        segment = next(p for p in tmp_path.iterdir() if p.name.endswith("-m0"))
        at = segment.read_bytes().find(pattern.tobytes())
        assert at > 0
        with open(segment, "r+b") as f:
            f.seek(at + 100)
            f.write(b"\x00")
        if checksum:
            with pytest.raises(refit.Refused, match="version 2 of model `policy` refused: .*sender's checksum .* damaged"):
                receiver.receive(5)
            assert receiver.version() == 1
            assert receiver.current().arrays()["w"].max() == 0  # the previous version, whole
        else:
            update = receiver.receive(5)
            assert update.version() == 2
            assert update.arrays()["w"][100] == 0  # the damage, served
    finally:
        receiver.close()
        sender.close()


def test_an_engine_verifies_what_it_serves_and_a_flipped_bit_is_named(pair):
    # an engine serving its own copy of a received version: refit.verify_served proves the
    # copy whole, then names the tensor once one bit of it changes while served
    p = pair("shm")
    p.sender.publish(weights(2))
    u = p.receiver.receive(timeout=20)
    served = {n: a.copy() for n, a in u.arrays().items()}
    refit.verify_served(u, served)
    assert refit.checksums(served) == dict(zip(served, u.checksums()))
    served["embed.weight"].view(np.uint32)[7, 3] ^= 1
    with pytest.raises(refit.Damaged, match=r"model `policy` v2: tensor `embed\.weight` as served hashes to") as e:
        refit.verify_served(u, served)
    assert e.value.tensor == "embed.weight"
    # a tensor the engine does not serve is named too
    del served["ids"]
    with pytest.raises(refit.Damaged, match="tensor `ids` is not served"):
        refit.verify_served(u, {n: a for n, a in served.items() if n != "embed.weight"} | {"embed.weight": u.arrays()["embed.weight"]})
    u.ack()


def test_checksums_of_torch_tensors_match_the_versions_they_were_sent_as(pair):
    # bf16 has no numpy dtype: refit.checksums reads torch tensors' bytes as they are
    from conftest import require

    torch = require("torch")
    sd = {"w": torch.randn(5, 3).to(torch.bfloat16), "b": torch.arange(4, dtype=torch.int32)}
    p = pair("inproc" if "inproc" in refit.transports() else "shm", initial=sd)
    p.sender.publish({k: v + 1 for k, v in sd.items()})
    u = p.receiver.receive(timeout=20)
    served = {n: t.clone() for n, t in u.torch()}
    assert refit.checksums(served) == dict(zip(served, u.checksums()))
    refit.verify_served(u, served)
    u.ack()


def test_every_error_type_is_also_at_the_top_level():
    """``refit.X`` and ``refit.errors.X`` are one class for every error the package raises,
    so ``except refit.ReceiversLate`` catches what ``refit.errors.ReceiversLate`` names."""
    import refit.errors

    for name in refit.errors.__all__:
        assert getattr(refit, name) is getattr(refit.errors, name), name
        assert name in refit.__all__, name
        assert issubclass(getattr(refit, name), refit.RefitError), name
