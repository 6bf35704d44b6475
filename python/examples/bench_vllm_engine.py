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

    python python/examples/bench_vllm_engine.py                       # tiny
    python python/examples/bench_vllm_engine.py --hidden 512 --layers 6 --intermediate 1408 --vocab 8192 --heads 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("REFIT_TOKEN", "bench-vllm-engine-0123456789abcdef")

import refit  # noqa: E402
from refit.vllm_engine import VllmEngine, in_process_llm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_llama  # noqa: E402

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=7)
    for key in ("hidden", "layers", "intermediate", "vocab", "heads"):
        p.add_argument(f"--{key}", type=int)
    args = p.parse_args()
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
        size = sum(t.numel() * t.element_size() for t in versions[0].values())
        engine = VllmEngine(in_process_llm(model=str(model_dir), dtype="float32", max_model_len=256, seed=0))
        layout = [(n, "f32", list(t.shape)) for n, t in versions[0].items()]
        engine.manifest(MODEL, layout, {})
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
        finally:
            receiver.close()
            sender.close()
    copy = statistics.median(copy_s)
    print(f"vLLM engine rank, a Llama of {size / 2**20:.1f} MiB (float32), medians of {args.iters} versions:")
    print(f"  copy of the bytes (baseline)   {copy * 1e3:9.2f} ms")
    for what, xs in (("transfer (shm, publish->received)", transfer_s), ("stage (copy to the model's dtype)", stage_s),
                     ("pause (vLLM's load)", pause_s)):
        m = statistics.median(xs)
        print(f"  {what:<33}{m * 1e3:9.2f} ms  {m / copy:6.1f}x the copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
