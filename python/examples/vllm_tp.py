"""Two trainer shards feed a tensor-parallel vLLM through a Refit mesh: each vLLM worker
pulls only its slice of each weight, straight from both shards, and generates exactly what
vLLM generates from its own load of the same weights.

What it does (on a CPU; about a minute on two cores):

1. writes a tiny random Llama (seed 1, vLLM loads it from disk) and the weights of seed 2;
2. starts two trainer shards (:class:`refit.MeshSender`), each holding one flat half of
   every tensor, as FSDP shards hold them: no shard has a whole tensor;
3. starts ``LLM(..., tensor_parallel_size=2, weight_transfer_config={"backend": "refit"})``
   and connects its workers to the shards (:func:`refit.vllm.init_mesh`): each worker plans
   the part of every tensor its layers load (rows of ``q/k/v/gate/up`` and of the
   vocabulary, columns of ``o/down``, norms whole) and prints what it pulls;
4. generates greedy tokens and their logprobs from vLLM's own load, publishes seed 2 as
   version 1, loads it (:func:`refit.vllm.update_weights`), generates (other tokens),
   publishes seed 1 again as version 2, loads it, and checks the tokens and logprobs are
   those of vLLM's own load, bit for bit;
5. asks for a version no shard published: ``TransportError`` within the timeout, and vLLM
   still generates version 2's tokens;
6. checks that the workers pulled less than the model each, and together less than two
   models;
7. connects the same workers to one TCP :class:`refit.Sender` of seed 2 instead
   (:func:`refit.vllm.init_engine`, each worker pulls the whole model, the workers held to
   one version between them): the tokens and logprobs equal those of seed 2's slices; a
   version never published times out in both workers alike, ``stream=True`` is refused
   (each worker would stream on its own), vLLM's next calls work, and a next version loads;
8. makes one worker fail to put its weights back after a failed update: the update raises
   ``NeedsFullResend`` naming that worker, and the next version loads whole in both.

Exits 0 when every check passes, 1 otherwise. Run it with the Python that has vLLM and
``refit`` installed::

    python python/examples/vllm_tp.py [--arch hidden_size=1024,intermediate_size=4096]
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

# before vLLM is imported: a small KV cache, one core per worker on the CPU build, and
# functions sent to the workers (refit.vllm.mesh_stats) allowed through collective_rpc
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tiny_llama  # noqa: E402

PROMPT = [1, 17, 230, 45, 99, 311, 7, 128]
#: Refit's names of the dtypes the example's tensors have.
DTYPES = {"torch.float32": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16"}


def manifest_of(weights: dict) -> list[tuple[str, str, list[int]]]:
    """The model's tensors as the mesh takes them: ``(name, dtype, shape)``."""
    return [(n, DTYPES[str(t.dtype)], list(t.shape)) for n, t in weights.items()]


# ANCHOR: shards
def flat_halves(manifest: list[tuple[str, str, list[int]]]) -> list[list[tuple[str, tuple]]]:
    """Two shards' parts: each holds one flat half of every tensor (as FSDP holds them)."""
    halves: list[list[tuple[str, tuple]]] = [[], []]
    for name, _, shape in manifest:
        n = math.prod(shape)
        halves[0].append((name, ("flat", 0, n // 2)))
        halves[1].append((name, ("flat", n // 2, n)))
    return halves


def publish(shards, parts, version: int, weights: dict) -> None:
    """Each shard publishes ``version`` of what it holds: its half of each tensor."""
    for shard, held in zip(shards, parts):
        shard.publish(version, {n: weights[n].reshape(-1)[s:e] for n, (_, s, e) in held})
# ANCHOR_END: shards


# ANCHOR: engine
def start_engine(model_dir: Path, cards: list[str], manifest: list):
    """A tensor-parallel vLLM whose workers pull their slices from the trainer shards."""
    from vllm import LLM

    import refit.vllm

    llm = LLM(model=str(model_dir), tensor_parallel_size=2, dtype="float32", enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.1,
              weight_transfer_config={"backend": "refit"})
    refit.vllm.init_mesh(llm, cards, manifest)  # each worker plans its pull here
    return llm
# ANCHOR_END: engine


def generate(llm, max_tokens: int = 16) -> tuple[list[int], list[float]]:
    """Greedy tokens for :data:`PROMPT` and the logprob of each."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


class Checks:
    """Prints each check as it is made and keeps those that failed."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        print(("ok    " if ok else "FAIL  ") + what, flush=True)
        if not ok:
            self.failed.append(what)

    def raises(self, call, error: type, says: str, what: str) -> None:
        """Checks that ``call()`` raises ``error`` with ``says`` in its message."""
        try:
            call()
        except error as e:
            self(says in str(e), f"{what}: {e}")
        else:
            self(False, f"{what}: nothing raised")


def break_restore_in_tp1(worker) -> None:
    """In vLLM's worker (through ``collective_rpc``), tp1 alone: putting the previous
    weights back after a failed update raises."""
    from vllm.distributed import parallel_state as ps

    if ps.get_tp_group().rank_in_group == 1:
        def broken() -> None:
            raise RuntimeError("the restore broke")

        worker.weight_transfer_engine._restore = broken


def mend_restore(worker) -> None:
    """In vLLM's worker: the engine's own ``_restore`` again."""
    worker.weight_transfer_engine.__dict__.pop("_restore", None)


def timed_update(llm, version: int) -> float:
    """Loads ``version`` in every worker (:func:`refit.vllm.update_weights`): milliseconds."""
    import time

    import refit.vllm

    t = time.perf_counter()
    refit.vllm.update_weights(llm, version=version, timeout=60)
    return (time.perf_counter() - t) * 1e3


def run(work: Path, arch: dict | None = None) -> list[str]:
    """The whole example in ``work`` (the tiny Llama, ``arch`` overriding its
    :data:`tiny_llama.DEFAULT_ARCH` entries); answers the checks that failed."""
    from safetensors.torch import load_file

    import refit

    # the shards and vLLM's workers (processes started below) share one cluster token
    os.environ.setdefault("REFIT_TOKEN", os.urandom(16).hex())
    model_dir = tiny_llama.write_model(work / "model", seed=1, **(arch or {}))
    first = load_file(str(model_dir / "model.safetensors"))
    second = load_file(str(tiny_llama.write_weights(work / "v2.safetensors", seed=2, like=model_dir)))
    manifest = manifest_of(first)
    parts = flat_halves(manifest)
    shards = [refit.MeshSender(manifest, held) for held in parts]
    check = Checks()
    llm = start_engine(model_dir, [s.card for s in shards], manifest)
    try:
        seed2 = from_the_mesh(llm, shards, parts, first, second, check)
        from_one_sender(llm, second, seed2, check)
    finally:
        # stopped now: left to the garbage collector, the interpreter's exit waits for it
        llm.llm_engine.engine_core.shutdown()
    return check.failed


def from_the_mesh(llm, shards, parts, first: dict, second: dict, check: Checks) -> tuple:
    """Steps 4 to 6: versions pulled in slices from the shards; answers seed 2's output."""
    import refit
    import refit.vllm

    stats = refit.vllm.mesh_stats(llm)
    for w in stats:
        sliced = sum(1 for _, part in w["wants"] if part != "whole")
        print(f"worker tp{w['tp_rank']}: {sliced} of {len(w['wants'])} tensors sliced, pulls "
              f"{w['bytes_per_pull']} of the model's {w['model_bytes']} bytes per version "
              f"({w['bytes_per_pull'] / w['model_bytes']:.0%})", flush=True)
    from_disk = generate(llm)
    publish(shards, parts, 1, second)
    took = timed_update(llm, 1)
    seed2 = generate(llm)
    check(seed2[0] != from_disk[0], "version 1 (seed 2) generates other tokens than vLLM's load of seed 1")
    publish(shards, parts, 2, first)
    took = min(took, timed_update(llm, 2))
    print(f"update from the mesh (each worker its slices): {took:.1f} ms (the faster of two)", flush=True)
    check(generate(llm) == from_disk, "version 2 (seed 1 again, pulled in slices) generates vLLM's own tokens "
          "and logprobs, bit for bit")
    check.raises(lambda: refit.vllm.update_weights(llm, version=3, timeout=1), refit.errors.TransportError,
                 "not published", "a version no shard published is refused")
    check(generate(llm) == from_disk, "after the refusal vLLM still serves version 2")
    stats = refit.vllm.mesh_stats(llm)
    model_bytes = stats[0]["model_bytes"]
    check(all(w["bytes_per_pull"] < model_bytes for w in stats), "each worker pulls less than the model")
    check(sum(w["bytes_per_pull"] for w in stats) < 2 * model_bytes, "both workers together pull less than two models")
    check(all(w["bytes_pulled"] == 2 * w["bytes_per_pull"] for w in stats), "each worker pulled two versions")
    return seed2


def from_one_sender(llm, second: dict, seed2: tuple, check: Checks) -> None:
    """Step 7: the same workers fed by one sender (each pulls the whole model), held to one
    version between them, and failing alike."""
    import refit
    import refit.vllm

    sender = refit.Sender("tcp", second, model="policy")
    sender.start()
    try:
        refit.vllm.init_engine(llm, sender.spec, load_initial=True)
        check(generate(llm) == seed2, "seed 2 from one sender (each worker pulls it whole) generates what its slices "
              "from the mesh generate, bit for bit")
        check.raises(lambda: refit.vllm.update_weights(llm, version=9, timeout=1), refit.errors.Timeout,
                     "every tensor-parallel worker (2)", "a version the sender never publishes times out in both workers")
        check.raises(lambda: refit.vllm.init_engine(llm, sender.spec, verify="all"), refit.errors.ConfigError,
                     "every tensor-parallel worker (2): refit init_info: `verify` must be one of",
                     "an init info vLLM's parse refuses is refused in both workers alike")
        check.raises(lambda: refit.vllm.init_engine(llm, sender.spec, stream=True), refit.errors.ConfigError,
                     "every tensor-parallel worker (2): refit init_info: `stream` takes one worker",
                     "stream=True is refused with tensor-parallel workers")
        # vLLM's next calls get their own answers, not a worker's failure left over
        refit.vllm.init_engine(llm, sender.spec)
        check(generate(llm) == seed2, "after the failures both workers serve seed 2 still")
        sender.publish({n: -t for n, t in second.items()})
        took = timed_update(llm, 2)
        check(generate(llm)[0] != seed2[0], "the next version loads in both workers")
        sender.publish(second)
        took = min(took, timed_update(llm, 3))
        check(generate(llm) == seed2, "version 3 (seed 2 again) loads in both workers as seed 2")
        print(f"update from one sender (each worker the whole model): {took:.1f} ms (the faster of two)", flush=True)
        # step 8: a failed update that one worker cannot end either
        llm.collective_rpc(break_restore_in_tp1)
        try:
            check.raises(lambda: refit.vllm.update_weights(llm, version=9, timeout=1), refit.errors.NeedsFullResend,
                         "in tensor-parallel worker 1 of 2: RuntimeError: the restore broke",
                         "a failed update whose ending fails in one worker asks for a whole version, naming the worker")
        finally:
            llm.collective_rpc(mend_restore)
        sender.publish({n: -t for n, t in second.items()})
        refit.vllm.update_weights(llm, version=4, timeout=60)
        check(generate(llm)[0] != seed2[0], "then the next version loads whole in both workers")
    finally:
        sender.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="", metavar="KEY=N,...",
                        help="the tiny Llama's architecture, e.g. hidden_size=1024,intermediate_size=4096 "
                             "(keys of tiny_llama.DEFAULT_ARCH)")
    args = parser.parse_args(argv)
    arch = {}
    for item in filter(None, args.arch.split(",")):
        key, _, value = item.partition("=")
        if key not in tiny_llama.DEFAULT_ARCH or not value:
            parser.error(f"--arch: `{item}` is not KEY=N with KEY one of {', '.join(tiny_llama.DEFAULT_ARCH)}")
        arch[key] = float(value) if "." in value else int(value)
    with tempfile.TemporaryDirectory(prefix="refit-vllm-tp-") as tmp:
        failed = run(Path(tmp), arch)
    print("vllm_tp: all checks passed" if not failed else f"vllm_tp: {len(failed)} check(s) failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
