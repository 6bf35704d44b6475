"""A ``vllm serve`` as an engine rank (:mod:`refit.vllm_server`, ``vllm_engine_rank.py
--serve``): a real vLLM OpenAI server (the CPU build), started by the engine and driven over
HTTP, computes what Refit's generator computes, pauses with vLLM's own ``pause_generation``
(keep: a sequence carries two versions; abort: the tokens made so far), refuses a version
that leaves a parameter unwritten, passes the engine contract's conformance suite, and
learns GRPO under ``refit launch`` (``examples/topologies/grpo-vllm.toml``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from conftest import (MODEL, REPO, SHORT, Held, completions_check, launch_command, launch_solves, layout_of,
                      non_finite_refused, replaces_check, require_vllm, scores_check)

require_vllm()
torch = pytest.importorskip("torch")  # vLLM's own dependency

import refit.engine  # noqa: E402
import refit.errors  # noqa: E402
from refit.engine import Request, ScoreRequest  # noqa: E402
from refit.vllm_server import VllmServerEngine, server_command, start_server  # noqa: E402

sys.path.insert(0, str(REPO / "python/examples"))
import vllm_engine_rank as example  # noqa: E402

sys.path.pop(0)

PARAMS = {"heads": 2}  # head size 32: vLLM's CPU attention takes 32 and more
LLAMA = {"arch": "llama", "heads": 2, "rope_theta": 2.0}


def served_engine(weights: dict, params: dict, checkpoint=example.checkpoint, layout=None) -> VllmServerEngine:
    """An engine whose ``vllm serve`` (the example's) serves ``weights`` as v1."""
    e = VllmServerEngine(example.build_server, checkpoint=checkpoint)
    layout = layout or layout_of(weights)
    assert e.manifest(MODEL, layout, params) == layout
    e.stage(MODEL, 1, Held(weights))
    assert e.commit(MODEL, 1) >= 0.0
    return e


@pytest.fixture(scope="module")
def engine(golden):
    weights, _ = golden
    e = served_engine(weights, PARAMS)
    yield e
    e.close()


def llama_weights(seed: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=14, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
                                      rms_norm_eps=1e-5, rope_theta=2.0))
    return {n: t.detach().clone() for n, t in hf.state_dict().items()}


def running(e: VllmServerEngine) -> float:
    """vLLM's count of requests running (its metrics)."""
    with urllib.request.urlopen(f"{e._served(MODEL).server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(x) for x in found)


def held(e: VllmServerEngine, asked: Request) -> tuple[threading.Thread, list]:
    """``asked`` generating on a thread of its own; returns once vLLM ran a step of it and
    holds it (``POST /pause?mode=keep``, as a commit does first): its sequence is cut in
    the middle whatever the machine's speed."""
    answer: list = []
    runner = threading.Thread(target=lambda: answer.extend(e.generate([asked])))
    runner.start()
    deadline = time.monotonic() + 60
    while running(e) < 1:
        assert runner.is_alive() and time.monotonic() < deadline, f"vLLM never ran the request: {answer}"
        time.sleep(0.002)
    e._served(MODEL).server.pause("keep")
    assert runner.is_alive(), f"the request ended before vLLM held it: {answer}"
    return runner, answer


def test_the_server_scores_as_refits_own_generator_and_each_version_replaces_the_last(engine, golden):
    """vLLM's GPT-2 behind HTTP, loaded through the example's checkpoint names from this
    rank's shared memory, gives each token the log-probability Refit's generator gives it;
    a version of other weights changes every score, and the first weights again give the
    golden scores back."""
    print(f"vllm serve's log-probabilities differ from Refit's by up to {scores_check(engine, golden):.1e}")
    replaces_check(engine, golden)


def test_completions_carry_vllms_versions_stop_tokens_and_behaviour_logprobs(engine, golden):
    """After a commit of v2, every token is labelled v2 (vLLM's weight_versions spans); a
    sampled stop token ends the completion and is kept; a greedy completion's
    log-probabilities are the temperature-1 scores of its tokens; a seed gives the same
    completion again; a request vLLM refuses fails alone."""
    asked, answers = completions_check(engine, golden[0])
    long, fine = engine.generate([Request(MODEL, [1] * 20, 3, 1.0, 0, None, 2), asked[0]])
    assert isinstance(long, ValueError) and "refused" in str(long), long
    assert fine.tokens == answers[0].tokens


def test_the_server_engine_passes_the_conformance_suite():
    """The engine contract's conformance suite, the one Refit's own engines and the
    in-process vLLM pass, run on a fresh ``vllm serve`` behind the backend a rank puts it
    behind, committed in flight (keep, the default)."""
    e = VllmServerEngine(example.build_server, checkpoint=example.checkpoint)
    try:
        assert refit.engine.conformance(e, PARAMS) == refit.engine.CONFORMANCE_CHECKS
    finally:
        e.close()


def test_vllms_pause_keeps_a_sequence_across_a_commit_and_abort_ends_it():
    """On a Hugging Face Llama behind ``vllm serve``. Keep (vLLM's ``pause_generation(mode=
    "keep")``): a commit made while a sequence is generated holds it, loads, and resumes it
    under the new weights; its tokens carry v1 then v2 (vLLM's spans), each token's
    log-probability the one its version's weights give it. Abort (:meth:`interrupt`, vLLM's
    ``/abort_requests``): the running sequence ends ``"aborted"`` with the tokens made so
    far, a request asked after it ends at once, and once the interrupt is spent the same
    request runs whole, its first tokens those made before."""
    w1, w2 = llama_weights(3), llama_weights(4)
    layout = [(n, "f32", list(t.shape)) for n, t in w1.items()]
    e = served_engine(w1, LLAMA, layout=layout)
    try:
        e.stage(MODEL, 2, Held(w2))
        prompt = [1, 2, 3]
        asked = Request(MODEL, prompt, 60, 1.0, 7, None, 1)
        runner, answer = held(e, asked)
        paused = e.commit(MODEL, 2)  # pauses (held already), loads, resumes
        runner.join(120)
        assert not runner.is_alive(), "the sequence did not end"
        (c,) = answer
        assert not isinstance(c, BaseException), c
        ones = c.versions.count(1)
        print(f"keep: {ones} of {len(c.tokens)} tokens under v1, paused {paused * 1000:.0f} ms")
        assert len(c.tokens) == 60 and c.versions == [1] * ones + [2] * (60 - ones) and 1 <= ones < 60, c.versions
        (under2,) = e.score([ScoreRequest(MODEL, prompt, c.tokens, 1.0, 2)])
        assert under2.versions == [2] * 60
        e.stage(MODEL, 3, Held(w1))
        e.commit(MODEL, 3)
        (under1,) = e.score([ScoreRequest(MODEL, prompt, c.tokens, 1.0, 3)])
        assert under1.versions == [3] * 60
        want = under1.logprobs[:ones] + under2.logprobs[ones:]
        assert max(abs(a - b) for a, b in zip(c.logprobs, want)) < 1e-4, (c.logprobs, want)
        # the other version's scores differ: the check can fail
        assert max(abs(a - b) for a, b in zip(c.logprobs[ones:], under1.logprobs[ones:])) > 1e-3

        asked = Request(MODEL, prompt, 60, 1.0, 9, None, 3)
        runner, answer = held(e, asked)
        e.interrupt(MODEL, 4)
        runner.join(60)
        e._served(MODEL).server.resume()  # as the commit after an interrupt does
        (cut,) = answer
        assert not isinstance(cut, BaseException), cut
        assert cut.finish == "aborted" and len(cut.tokens) < 60 and cut.versions == [3] * len(cut.tokens), cut
        (again,) = e.generate([asked])
        assert again.finish == "aborted" and not again.tokens, again
        e.abort(MODEL)
        (whole,) = e.generate([asked])
        assert whole.finish == "length" and len(whole.tokens) == 60, whole
        n = len(cut.tokens)
        assert whole.tokens[:n] == cut.tokens
        assert max((abs(a - b) for a, b in zip(whole.logprobs[:n], cut.logprobs)), default=0.0) < 1e-5
    finally:
        e.close()


def test_a_tensor_parallel_server_loads_each_version_as_transformers_computes_it():
    """A ``vllm serve`` of two tensor-parallel workers (``tensor_parallel_size=2``, a core
    each): both pull each staged version from the rank's shared memory and load their
    slices; the server scores every token as ``transformers`` does under each version, and
    labels it with that version."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(model, layout, params):
        folder, context = example.model_folder(model, layout, params)
        return start_server(folder, load_format="dummy", dtype="float32", max_model_len=context, enforce_eager=True,
                            tensor_parallel_size=2, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})

    e = VllmServerEngine(build)
    try:
        prompt, tokens = [1, 2, 3, 4], [5, 6, 7, 8, 9]
        for version, seed in ((1, 3), (2, 4)):
            torch.manual_seed(seed)
            hf = LlamaForCausalLM(LlamaConfig(vocab_size=14, hidden_size=64, intermediate_size=256,
                                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                              tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=2.0))
            weights = {n: t.detach().clone() for n, t in hf.state_dict().items()}
            if version == 1:
                e.manifest(MODEL, [(n, "f32", list(t.shape)) for n, t in weights.items()], LLAMA)
            e.stage(MODEL, version, Held(weights))
            e.commit(MODEL, version)
            (a,) = e.score([ScoreRequest(MODEL, prompt, tokens, 1.0, version)])
            assert not isinstance(a, BaseException), a
            with torch.no_grad():
                logp = hf(input_ids=torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
            want = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]
            assert max(abs(x - y) for x, y in zip(a.logprobs, want)) < 1e-4, (a.logprobs, want)
            assert a.versions == [version] * len(tokens)
            assert max(want) - min(want) > 0.05, want  # random weights: the scores differ
    finally:
        e.close()


def test_a_version_that_leaves_a_parameter_unwritten_is_refused_naming_it(golden):
    """A checkpoint mapping that misses a tensor: the server's workers report the parameter
    not written (vLLM's names check), the commit raises ``NeedsFullResend`` naming it, and
    the engine generates nothing on the mixed weights."""
    weights, _ = golden

    def partial(name, tensor):
        return [] if name == "head.weight" else example.checkpoint(name, tensor)

    e = VllmServerEngine(example.build_server, checkpoint=partial)
    try:
        e.manifest(MODEL, layout_of(weights), PARAMS)
        e.stage(MODEL, 1, Held(weights))
        with pytest.raises(refit.errors.NeedsFullResend, match="lm_head.weight"):
            e.commit(MODEL, 1)
        (refused,) = e.generate([Request(MODEL, [1, 2], 3, 1.0, 0, None, 1)])
        assert isinstance(refused, RuntimeError) and "mixed weights" in str(refused), refused
        non_finite_refused(e, weights, 2)
    finally:
        e.close()


def test_the_server_command_asks_for_what_the_engine_needs():
    cmd = server_command("/m", 8123, dtype="float32", enforce_eager=True, tokens_only=None)
    assert cmd[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
    text = " ".join(cmd)
    for flag in ("--port 8123", "--skip-tokenizer-init", "--logprobs-mode processed_logprobs", "--dtype float32",
                 "--enforce-eager", '--weight-transfer-config {"backend": "refit"}', "--no-async-scheduling"):
        assert flag in text, text
    assert "tokens-only" not in text  # an option set to None is left out
    assert "--async-scheduling" in " ".join(server_command("/m", 1, async_scheduling=True))


def test_vllm_serve_engine_ranks_learn_grpo_under_refit_launch(refit_bin, tmp_path):
    """The shipped grpo-vllm.toml with each engine rank's model behind a ``vllm serve`` it
    starts (``vllm_engine_rank.py --serve``): the PyTorch GRPO trainer's Llama learns digit
    reversal; every update's report names the engines' pause; when the launch ends, no
    server is left running."""
    engine = f'process.engine.command=["python3", "{REPO / "python/examples/vllm_engine_rank.py"}", "--serve"]'
    cmd, env = launch_command(refit_bin, tmp_path, SHORT + ["stop.target_eval=0.9", engine],
                              topology="grpo-vllm.toml", script="vllm_engine_rank.py")
    before = servers()
    out = launch_solves(cmd, env, tmp_path, low=0.4, high=0.9)
    assert "Traceback" not in out, out[-6000:]
    deadline = time.monotonic() + 30  # the watchers end their servers within seconds
    while servers() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not servers() - before, f"vllm serve left running: {servers() - before}"


def servers() -> set[str]:
    """What of ``vllm serve`` is on this machine: its processes (the API server, its engine
    core and workers, which vLLM names ``VLLM::...``) and its shared memory."""
    found = subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai.api_server|VLLM::"], capture_output=True,
                           text=True)
    shm = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith("vllm_")]
    return {f"pid {p}" for p in found.stdout.split()} | set(shm)
