"""What an update costs a vLLM engine rank, against copying the same bytes, in one run.

A random-init Llama (``tiny_llama.py``: the 1.8 MB default, or ``--hidden 512 --layers 6
--intermediate 1408 --vocab 8192 --heads 8`` for about 110 MB) is served by an in-process
vLLM through :class:`refit.vllm_engine.VllmEngine`, as an engine rank runs it. Each
version goes as a rank's does: a Refit sender publishes it over shared memory, a
:class:`refit.Receiver` takes it (the *transfer*), :meth:`VllmEngine.stage` copies it into
the model's dtype (the *stage*, which a rank runs beside generation; here nothing
generates meanwhile), :meth:`VllmEngine.commit` loads it
through vLLM's layerwise reload (the *pause*). The baseline is the fastest simple program
for the bytes: one ``copy_`` of every tensor into tensors already allocated. Figures are
medians of ``--iters`` versions.

With ``--serve`` the model is behind a ``vllm serve`` driven over HTTP
(:class:`refit.vllm_server.VllmServerEngine`): the stage publishes the version to the
sender the server's workers pull from, the pause runs from vLLM's ``/pause`` to its
``/resume``. Either way the run ends with the time of a rollout worker's batch of 32
completions.

With ``--apply``, the two ways an engine rank takes a version in (a topology's ``apply``)
are set side by side over TCP, each in an engine process of its own fed by this one:
``staged`` (received whole, staged, then loaded: the pause holds the load) and
``streaming`` (:meth:`VllmEngine.load_streamed`: pulled inside the pause, each tensor
loaded as it arrives). Each engine prints its peak resident memory above itself before it
connected (vLLM and the model loaded), and its pause; this process times each version from
publish to served (acknowledged).

    python python/examples/bench_vllm_engine.py                       # tiny
    python python/examples/bench_vllm_engine.py --serve               # tiny, behind a `vllm serve`
    python python/examples/bench_vllm_engine.py --hidden 512 --layers 6 --intermediate 1408 --vocab 8192 --heads 8
    python python/examples/bench_vllm_engine.py --apply --hidden 512 --layers 6 --intermediate 1408 --vocab 8192 --heads 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("REFIT_TOKEN", "bench-vllm-engine-0123456789abcdef")

import refit  # noqa: E402
from refit.vllm_engine import VllmEngine, in_process_llm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_llama  # noqa: E402
from stream_memory import vm  # noqa: E402

MODEL = "policy"


def connected(weights: dict) -> tuple[refit.Sender, refit.Receiver]:
    """A started shared-memory sender of ``weights`` and its connected receiver."""
    sender = refit.Sender("shm", weights, receivers=1, model=MODEL)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", refit.Receiver(sender.spec, timeout=60)))
    t.start()
    sender.start(timeout=60)
    t.join(60)
    return sender, box["r"]


def serving(model_dir: Path, layout: list, serve: bool = False) -> Any:
    """A vLLM engine of the model in ``model_dir``, its layout ``layout`` declared: an
    in-process ``LLM``, or with ``serve`` a ``vllm serve`` driven over HTTP."""
    if serve:
        from refit.vllm_server import VllmServerEngine, start_server

        # its threads not pinned to the cores this process times its copies on
        engine = VllmServerEngine(start_server(model_dir, dtype="float32", max_model_len=256, seed=0,
                                               enforce_eager=True,
                                               env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}))
    else:
        engine = VllmEngine(in_process_llm(model=str(model_dir), dtype="float32", max_model_len=256, seed=0))
    engine.manifest(MODEL, layout, {})
    return engine


def batch_ms(engine: Any, version: int, iters: int) -> float:
    """The median time of a rollout worker's batch: 32 completions of 6 tokens, sampled."""
    from refit.engine import Request

    took = []
    for i in range(iters + 1):  # the first warms vLLM up
        asked = [Request(MODEL, [1, 3, 4, 5, 6, 7, 2], 6, 1.0, 100 * i + j, None, version) for j in range(32)]
        t = time.perf_counter()
        answers = engine.generate(asked)
        took.append(time.perf_counter() - t)
        failed = [a for a in answers if isinstance(a, BaseException)]
        if failed:
            raise failed[0]
    return statistics.median(took[1:]) * 1e3


def engine_process(spec: str, mode: str, model_dir: Path, iters: int) -> None:
    """An engine of ``mode`` fed over ``spec``: one version each time a line comes on stdin
    (the version in force first), loaded as a rank loads it; prints its pause and phases
    (medians) and its peak memory above itself before it connected, as JSON."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        layout = [(n, "f32", list(f.get_slice(n).get_shape())) for n in f.keys()]
    engine = serving(model_dir, layout)
    # the peak from here on: vLLM's start is not the update's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = peak = vm("VmRSS")
    phases: dict[str, list[float]] = {}

    def timed(what: str, f: Any) -> Any:
        t = time.perf_counter()
        out = f()
        phases.setdefault(what, []).append(time.perf_counter() - t)
        return out

    if mode == "streaming":
        receiver = refit.Receiver(spec, stream=True, timeout=60)

        def stream(apply: Any, torch: bool = True, raw: bool = False) -> int:
            got = receiver.stream(apply, timeout=60, torch=torch, raw=raw, ack=False)
            if got is None:
                raise TimeoutError("a version did not come")
            stream.entries = got  # type: ignore[attr-defined]
            return got[0][1]
        for v in range(1, iters + 2):  # the version in force, then one per line
            sys.stdin.readline()
            timed("pause", lambda: engine.load_streamed(MODEL, v, stream))
            receiver.ack(stream.entries)  # type: ignore[attr-defined]
        phases["pause"].pop(0)  # the version in force, which the first stream took
    else:
        receiver = refit.Receiver(spec, timeout=60)
        for i in range(iters):
            sys.stdin.readline()
            update = timed("transfer", lambda: receiver.receive(timeout=60))
            version = update.version(MODEL)
            timed("stage", lambda: engine.stage(MODEL, version, update))
            # what vLLM's load itself adds while it runs (its layerwise reload): the peak
            # so far kept, the peak reset to what is resident now
            peak = max(peak, vm("VmHWM"))
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            resident = vm("VmRSS")
            timed("pause", lambda: engine.commit(MODEL, version))
            phases.setdefault("load_extra", []).append(vm("VmHWM") - resident)
            update.ack()
            del update
    receiver.close()
    print(json.dumps({"extra": max(peak, vm("VmHWM")) - before,
                      **{k: statistics.median(v) for k, v in phases.items()}}), flush=True)


def compare_applies(model_dir: Path, versions: list, iters: int) -> None:
    """Each ``apply`` in an engine process of its own, fed from here over TCP."""
    size = sum(t.numel() * t.element_size() for t in versions[0].values())
    print(f"vLLM engine rank, a Llama of {size / 2**20:.1f} MiB (float32) over TCP, medians of {iters} versions:")
    for mode in ("staged", "streaming"):
        sender = refit.Sender("tcp", versions[0], receivers=1, model=MODEL)
        child = subprocess.Popen([sys.executable, __file__, "--engine", mode, "--spec", sender.spec,
                                  "--model-dir", str(model_dir), "--iters", str(iters)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdin is not None
        served, published = [], []
        try:
            if mode == "streaming":  # the version in force streams in at the first load
                child.stdin.write("go\n")
                child.stdin.flush()
            # returns once the engine acknowledged the version in force: the next come one by one
            sender.start(timeout=120)
            for i in range(iters):
                t = time.perf_counter()
                sender.publish(versions[(i + 1) % 2])
                published.append(time.perf_counter() - t)
                child.stdin.write("go\n")
                child.stdin.flush()
                sender.wait(timeout=120)
                served.append(time.perf_counter() - t)
            out, _ = child.communicate(timeout=300)
        finally:
            if child.poll() is None:
                child.kill()
            sender.close()
        if child.returncode != 0:
            raise SystemExit(f"the {mode} engine failed ({child.returncode})")
        r = json.loads(out.strip().splitlines()[-1])
        phases = "" if mode == "streaming" else \
            f"transfer {r['transfer'] * 1e3:.1f} ms, stage {r['stage'] * 1e3:.1f} ms (beside generation), "
        load = "" if mode == "streaming" else \
            f", of which vLLM's load adds {r['load_extra'] / 2**20:.1f} MiB while it runs"
        what = "pause (transfer and load)" if mode == "streaming" else "pause (load)"
        print(f"  {mode:>9}: {phases}{what} {r['pause'] * 1e3:.1f} ms; publish to served "
              f"{statistics.median(served) * 1e3:.1f} ms (the sender's publish "
              f"{statistics.median(published) * 1e3:.1f} ms); peak memory above the engine "
              f"{r['extra'] / 2**20:.1f} MiB ({r['extra'] / size:.2f}x the model){load}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=7)
    for key in ("hidden", "layers", "intermediate", "vocab", "heads"):
        p.add_argument(f"--{key}", type=int)
    p.add_argument("--apply", action="store_true", help="staged against streaming, over TCP")
    p.add_argument("--serve", action="store_true", help="the model behind a `vllm serve` (refit.vllm_server)")
    p.add_argument("--engine", choices=["staged", "streaming"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        engine_process(args.spec, args.engine, args.model_dir, args.iters)
        return 0
    if args.serve:
        # torch's threads here would spin against the server's processes on the same cores
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from safetensors.torch import load_file

    arch = {k: v for k, v in {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                               "intermediate_size": args.intermediate, "vocab_size": args.vocab,
                               "num_attention_heads": args.heads, "num_key_value_heads": args.heads}.items()
            if v is not None}
    with tempfile.TemporaryDirectory(prefix="refit-bench-vllm-") as tmp:
        model_dir = tiny_llama.write_model(Path(tmp) / "model", seed=1, **arch)
        versions = [load_file(str(tiny_llama.write_weights(Path(tmp) / f"v{s}.safetensors", s, model_dir)))
                    for s in (2, 3)]
        if args.apply:
            compare_applies(model_dir, versions, args.iters)
            return 0
        size = sum(t.numel() * t.element_size() for t in versions[0].values())
        layout = [(n, "f32", list(t.shape)) for n, t in versions[0].items()]
        engine = serving(model_dir, layout, args.serve)
        sender, receiver = connected(versions[0])
        copy_s, transfer_s, stage_s, pause_s = [], [], [], []
        targets = {n: torch.empty_like(t) for n, t in versions[0].items()}
        try:
            for i in range(args.iters):
                weights = versions[i % 2]
                t = time.perf_counter()
                for n, src in weights.items():
                    targets[n].copy_(src)
                copy_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                sender.publish(weights, timeout=60)
                update = receiver.receive(timeout=60)
                transfer_s.append(time.perf_counter() - t)
                version = update.version(MODEL)
                t = time.perf_counter()
                engine.stage(MODEL, version, update)
                stage_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                engine.commit(MODEL, version)
                pause_s.append(time.perf_counter() - t)
                update.ack()
                del update
            batch = batch_ms(engine, version, args.iters)
        finally:
            receiver.close()
            sender.close()
            if args.serve:
                engine.close()
    copy = statistics.median(copy_s)
    kind = "a `vllm serve` over HTTP" if args.serve else "an in-process LLM"
    print(f"vLLM engine rank ({kind}), a Llama of {size / 2**20:.1f} MiB (float32), medians of {args.iters} versions:")
    print(f"  copy of the bytes (baseline)   {copy * 1e3:9.2f} ms")
    stage = "stage (to the server's sender)" if args.serve else "stage (copy to the model's dtype)"
    pause = "pause (/pause to /resume)" if args.serve else "pause (vLLM's load)"
    for what, xs in (("transfer (shm, publish->received)", transfer_s), (stage, stage_s), (pause, pause_s)):
        m = statistics.median(xs)
        print(f"  {what:<33}{m * 1e3:9.2f} ms  {m / copy:6.1f}x the copy")
    print(f"  a batch of 32 completions of 6 tokens {batch:6.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
