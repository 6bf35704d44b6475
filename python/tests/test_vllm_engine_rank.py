"""vLLM as an engine rank (:mod:`refit.vllm_engine`, ``python/examples/vllm_engine_rank.py``):
a real vLLM (the CPU build) computes what Refit's generator computes, labels each token with
the version that sampled it, refuses a version that leaves a parameter unwritten, and learns
GRPO under ``refit launch`` (``examples/topologies/grpo-vllm.toml``): a Hugging Face Llama
behind the PyTorch trainer in both sync modes, and Refit's transformer behind the Rust
one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from conftest import (MODEL, REPO, RESTARTS, SHORT, STREAMING_ONLY, Held, completions_check, grpo_example,
                      killed_rank_rejoins, launch_command, launch_solves, layout_of, replaces_check, require_vllm,
                      non_finite_refused, scores_check, wrap_engine)

require_vllm()
torch = pytest.importorskip("torch")  # vLLM's own dependency

import refit.engine  # noqa: E402
from refit.engine import Request, ScoreRequest  # noqa: E402
from refit.vllm_engine import VllmEngine, token_versions  # noqa: E402

sys.path.insert(0, str(REPO / "python/examples"))
import vllm_engine_rank as example  # noqa: E402

sys.path.pop(0)

PARAMS = {"heads": 2}  # head size 32: vLLM's CPU attention takes 32 and more

#: The shipped file's model as Refit's transformer (its comment's override): the params
#: without the Llama's.
TRANSFORMER = "model.policy.params={ heads = 2, batch_frames = 128, group_size = 8, prompts_per_fragment = 4 }"
#: The shipped file's Llama on the shorter task, solved: from its first held-out reward
#: (after 5 updates: about 0.3 for three digits) to 0.9.
LLAMA = SHORT + ["stop.target_eval=0.9"]
SOLVES = {"low": 0.4, "high": 0.9}


@pytest.fixture(scope="module")
def engine(golden):
    weights, _ = golden
    e = VllmEngine(example.build, checkpoint=example.checkpoint)
    assert e.manifest(MODEL, layout_of(weights), PARAMS) == layout_of(weights)
    e.stage(MODEL, 1, Held(weights))
    e.commit(MODEL, 1)
    return e


def test_the_vllm_engine_scores_as_refits_own_generator(engine, golden):
    """vLLM's GPT-2, loaded through the example's checkpoint names, gives each token the
    log-probability Refit's generator gives it."""
    print(f"vLLM's log-probabilities differ from Refit's by up to {scores_check(engine, golden):.1e}")


def test_each_version_replaces_what_is_served(engine, golden):
    """The staging buffers are reused from version to version: a version of other weights
    changes every score, and the first weights staged again give the golden scores back."""
    replaces_check(engine, golden)


def test_completions_carry_vllms_versions_stop_tokens_and_behaviour_logprobs(engine, golden):
    """After a commit of v2, every token is labelled v2 (from vLLM's weight_versions spans);
    a sampled stop token ends the completion and is kept; a greedy completion's
    log-probabilities are the temperature-1 scores of its tokens."""
    completions_check(engine, golden[0])


def test_the_vllm_engine_passes_the_conformance_suite():
    """The engine contract's conformance suite, the one Refit's own engines pass, run on a
    fresh vLLM engine through the backend a rank puts it behind, committed in flight (keep,
    the default): loads, a stage then its commit, an abort, a hold that runs out, a commit
    of another version, a fetch that times out, cancellation epochs; then on another, its
    model taken in as ``apply = "streaming"`` (vLLM's layerwise reload fed tensor by tensor
    inside each commit). After the tests of the
    module's engine: a second vLLM in this process takes the first one's parallel groups
    with it when it goes."""
    e = VllmEngine(example.build, checkpoint=example.checkpoint)
    assert refit.engine.conformance(e, PARAMS) == refit.engine.CONFORMANCE_CHECKS
    # and taken in as apply = "streaming" (each version through load_streamed), in a process
    # of its own: a third vLLM here would find its parallel groups gone with the second
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import vllm_engine_rank as example, refit.engine; "
            "from refit.vllm_engine import VllmEngine; "
            "e = VllmEngine(example.build, checkpoint=example.checkpoint); "
            "print('passed:', json.dumps(refit.engine.conformance(e, json.loads(sys.argv[2]), apply='streaming')))")
    done = subprocess.run([sys.executable, "-c", code, str(REPO / "python/examples"), json.dumps(PARAMS)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (line,) = [l for l in done.stdout.splitlines() if l.startswith("passed: ")]
    assert json.loads(line.removeprefix("passed: ")) == refit.engine.CONFORMANCE_CHECKS, done.stdout[-2000:]


def test_a_version_that_leaves_a_parameter_unwritten_is_refused_naming_it(golden):
    """A checkpoint mapping that misses a tensor: the commit raises naming vLLM's parameter,
    the engine generates nothing on the mixed weights, and the next version that loads whole
    serves again."""
    weights, _ = golden
    dropped: set[str] = set()

    def partial(name, tensor):
        return [] if name in dropped else example.checkpoint(name, tensor)

    e = VllmEngine(example.build, checkpoint=partial)
    e.manifest(MODEL, layout_of(weights), PARAMS)
    e.stage(MODEL, 1, Held(weights))
    e.commit(MODEL, 1)
    dropped.add("head.weight")
    e.stage(MODEL, 2, Held(weights))
    with pytest.raises(RuntimeError, match=r"v2 of `policy` wrote no tensor into 1 parameter.*`lm_head.weight`"):
        e.commit(MODEL, 2)
    (refused,) = e.generate([Request(MODEL, [1, 2], 3, 1.0, 0, None, 1)])
    assert isinstance(refused, RuntimeError) and "mixed weights" in str(refused)
    dropped.clear()
    e.stage(MODEL, 3, Held(weights))
    e.commit(MODEL, 3)
    (served,) = e.generate([Request(MODEL, [1, 2], 3, 1.0, 0, None, 3)])
    assert served.versions == [3, 3, 3], served
    # a commit of a version not staged is refused, and a non-finite version at the stage
    with pytest.raises(RuntimeError, match="not the version staged"):
        e.commit(MODEL, 4)
    non_finite_refused(e, weights, 5)
    # refused whole: v3 still serves
    (still,) = e.generate([Request(MODEL, [1, 2], 3, 1.0, 0, None, 3)])
    assert still.versions == [3, 3, 3] and still.tokens == served.tokens, still
    # a request vLLM would refuse fails alone
    long, fine = e.generate([Request(MODEL, [1] * 20, 3, 1.0, 0, None, 3), Request(MODEL, [1, 2], 3, 1.0, 0, None, 3)])
    assert isinstance(long, ValueError) and "context" in str(long), long
    assert fine.tokens == served.tokens


def test_a_commit_during_a_batch_lands_between_steps_and_its_sequence_carries_two_versions(golden):
    """Keep mode (``commits_in_flight``): a commit made while a sequence is being generated
    waits for the next step boundary only; the sequence goes on under the new weights. Its
    tokens carry v1 then v2 (vLLM's spans), and each token's behaviour log-probability is
    the one the weights of its label give it (scored afterwards under each version), so the
    learner sees which policy sampled what."""
    import threading
    import time

    weights, _ = golden
    other = {n: t * 0.5 if t.dim() == 2 else t for n, t in weights.items()}
    e = VllmEngine(example.build, checkpoint=example.checkpoint)
    assert e.commits_in_flight
    e.manifest(MODEL, layout_of(weights), PARAMS)
    e.stage(MODEL, 1, Held(weights))
    e.commit(MODEL, 1)
    e.stage(MODEL, 2, Held(other))
    engine = e._llm(MODEL).llm_engine
    step, steps, midway, stepping, overlaps = engine.step, [], threading.Event(), threading.Event(), []
    commit = e._commit

    def counted_step():
        # after the third step, the fourth waits until the commit has queued for its turn
        # (so it lands mid-sequence); a load during a step would be an overlap
        if len(steps) == 3:
            midway.set()
            deadline = time.monotonic() + 30
            while not e._commits_waiting and time.monotonic() < deadline:
                time.sleep(0.001)
        stepping.set()
        try:
            out = step()
        finally:
            stepping.clear()
        steps.append(len(out))
        return out

    def watched_commit(model, version):
        overlaps.append(stepping.is_set())
        return commit(model, version)

    engine.step, e._commit = counted_step, watched_commit
    prompt = [1, 2, 3]
    answer: list = []
    asked = Request(MODEL, prompt, 8, 1.0, 7, None, 1)
    runner = threading.Thread(target=lambda: answer.extend(e.generate([asked])))
    runner.start()
    assert midway.wait(60)
    e.commit(MODEL, 2)  # returns once loaded, between two steps
    runner.join(60)
    assert not runner.is_alive(), "the batch did not end"
    engine.step, e._commit = step, commit
    assert overlaps == [False], "a commit ran during one of vLLM's steps"
    (c,) = answer
    assert not isinstance(c, BaseException), c
    assert len(c.tokens) == 8, c
    ones = c.versions.count(1)
    assert c.versions == [1] * ones + [2] * (8 - ones) and 3 <= ones < 8, c.versions
    # each token's log-probability is its own version's: scored under v2 now, under v1 again
    (under2,) = e.score([ScoreRequest(MODEL, prompt, c.tokens, 1.0, 2)])
    e.stage(MODEL, 3, Held(weights))
    e.commit(MODEL, 3)
    (under1,) = e.score([ScoreRequest(MODEL, prompt, c.tokens, 1.0, 3)])
    want = under1.logprobs[:ones] + under2.logprobs[ones:]
    worst = max(abs(a - b) for a, b in zip(c.logprobs, want))
    assert worst < 1e-4, (c.logprobs, want)
    # the other version's scores differ: the check can fail
    assert max(abs(a - b) for a, b in zip(c.logprobs[ones:], under1.logprobs[ones:])) > 1e-3


def test_an_interrupt_aborts_the_running_batch_at_a_step_with_the_tokens_made_so_far(golden):
    """Abort mode (:meth:`VllmEngine.interrupt`, which Refit calls before a commit under
    ``pause_mode = "abort"``): the running batch ends at the next step boundary, its
    unfinished request aborted by vLLM and answered ``"aborted"`` with the tokens made so
    far, each labelled with the version that made it, their log-probabilities the ones the
    same request makes when it runs to its end. An interrupt when no batch runs ends
    nothing."""
    import threading

    weights, _ = golden
    e = VllmEngine(example.build, checkpoint=example.checkpoint)
    e.manifest(MODEL, layout_of(weights), PARAMS)
    e.stage(MODEL, 1, Held(weights))
    e.commit(MODEL, 1)
    engine = e._llm(MODEL).llm_engine
    step, steps, midway = engine.step, [], threading.Event()

    def counted_step():
        out = step()
        steps.append(len(out))
        if len(steps) == 4:  # a prefill and three tokens, then the interrupt comes
            midway.set()
            deadline = time.monotonic() + 30
            while MODEL not in e._interrupts and time.monotonic() < deadline:
                time.sleep(0.001)
        return out

    engine.step = counted_step
    asked = Request(MODEL, [1, 2, 3], 9, 1.0, 7, None, 1)  # the context is 12
    answer: list = []
    runner = threading.Thread(target=lambda: answer.extend(e.generate([asked])))
    runner.start()
    assert midway.wait(60)
    e.interrupt(MODEL, 2)
    runner.join(60)
    engine.step = step
    assert not runner.is_alive(), "the batch did not end"
    (c,) = answer
    assert not isinstance(c, BaseException), c
    assert c.finish == "aborted" and 3 <= len(c.tokens) < 9, c
    assert c.versions == [1] * len(c.tokens)
    assert not engine.has_unfinished_requests(), "vLLM still runs the aborted request"
    # until the abort (or commit) that follows it, a batch that starts ends at once
    (again,) = e.generate([asked])
    assert not isinstance(again, BaseException) and again.finish == "aborted" and not again.tokens, again
    e.abort(MODEL)
    # spent: the same request now runs to its end, and the tokens made before the
    # interrupt are its first ones (same seed), with the same log-probabilities
    (whole,) = e.generate([asked])
    assert not isinstance(whole, BaseException), whole
    assert whole.finish == "length" and len(whole.tokens) == 9, whole
    n = len(c.tokens)
    assert whole.tokens[:n] == c.tokens
    assert max(abs(a - b) for a, b in zip(whole.logprobs[:n], c.logprobs)) < 1e-5
    # a commit spends it too: the batch after it runs whole under the new version
    e.interrupt(MODEL, 2)
    e.stage(MODEL, 2, Held(weights))
    e.commit(MODEL, 2)
    (after,) = e.generate([asked])
    assert not isinstance(after, BaseException), after
    assert after.finish == "length" and after.versions == [2] * 9, after


def test_vllm_serves_the_trainers_llama_as_transformers_computes_it():
    """``params.arch = "llama"``: the torch learner's ``transformers`` LlamaForCausalLM
    (random, seeded) exported as it is, loaded by vLLM's Llama built from the config
    :func:`refit.models.llama_config` derives from the layout, scores every token as
    ``transformers`` does, under the rotary base the params set (the shipped file's 2.0;
    vLLM taking another would score otherwise). The config round-trips the sizes (grouped
    key/value heads included); a layout that is not a Llama's, and a rotary base that is not
    above 0, are refused by name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from refit.models import llama_config

    params = {"arch": "llama", "heads": 2, "rope_theta": 2.0}
    torch.manual_seed(3)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=14, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                      rms_norm_eps=1e-5, rope_theta=2.0))
    weights = hf.state_dict()
    layout = [(n, "f32", list(t.shape)) for n, t in weights.items()]
    config = llama_config(layout, params)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads"):
        assert config[key] == getattr(hf.config, key), key
    assert LlamaConfig(**config).rope_parameters["rope_theta"] == 2.0
    assert llama_config(layout, {"heads": 2})["rope_theta"] == 10000.0  # Hugging Face's default
    with pytest.raises(ValueError, match="not a LlamaForCausalLM's"):
        llama_config([("tok_emb.weight", "f32", [14, 64])], params)
    with pytest.raises(ValueError, match="rope_theta = 0.0 is not above 0"):
        llama_config(layout, {**params, "rope_theta": 0})
    e = VllmEngine(example.build, checkpoint=example.checkpoint)
    assert e.manifest(MODEL, layout, params) == layout
    e.stage(MODEL, 1, Held(weights))
    e.commit(MODEL, 1)
    prompts = [([1, 2, 3, 4], [5, 6, 7]), ([9, 8], [7, 6, 5, 4, 3])]
    answers = e.score([ScoreRequest(MODEL, p, t, 1.0, 1) for p, t in prompts])
    worst, spread = 0.0, []
    with torch.no_grad():
        for (p, t), a in zip(prompts, answers):
            assert not isinstance(a, BaseException), a
            logp = hf(input_ids=torch.tensor([p + t])).logits[0].log_softmax(-1)
            want = [float(logp[len(p) - 1 + i, tok]) for i, tok in enumerate(t)]
            worst = max([worst] + [abs(x - y) for x, y in zip(a.logprobs, want)])
            spread += want
    print(f"vLLM's Llama differs from transformers' by up to {worst:.1e}")
    assert max(spread) - min(spread) > 0.05, spread  # random weights: the scores differ
    assert worst < 1e-4, f"log-probabilities differ by up to {worst}"


def test_token_versions_read_vllms_spans_and_refuse_what_does_not_fit():
    span = lambda v, s, e: SimpleNamespace(version=v, start=s, end=e)  # noqa: E731
    assert token_versions(None, 3) is None
    assert token_versions([span("4", 0, 2), span("5", 2, 3)], 3) == [4, 4, 5]
    with pytest.raises(ValueError, match="not contiguous at token 2"):
        token_versions([span("4", 0, 2), span("5", 3, 4)], 4)
    with pytest.raises(ValueError, match="labelled `default`, not a Refit version"):
        token_versions([span("default", 0, 2)], 2)
    with pytest.raises(ValueError, match="cover 2 of 3 tokens"):
        token_versions([span("4", 0, 2)], 3)


@pytest.mark.parametrize(("mode", "trainer"), [("sync", "torch"), ("batch-async", "rust")])
def test_vllm_engine_ranks_learn_grpo_under_refit_launch(refit_bin, tmp_path, mode, trainer):
    """The shipped grpo-vllm.toml as a user runs it: rank 0 the PyTorch GRPO trainer of a
    Hugging Face Llama, two ranks each with an in-process vLLM serving it, learning digit
    reversal in sync mode (batch-async is the next test's, whose updates also abort their
    batches); the pool trained on tokens whose versions vLLM gave. Or (batch-async),
    with the model's params replaced by the transformer's (the file's comment) and the
    learner's command set to Refit's GRPO example, the Rust learner training Refit's
    transformer, which the engines serve as GPT-2."""
    sets, bounds = LLAMA + [f"sync.sync_mode={mode}"], SOLVES
    if trainer == "rust":
        sets = [TRANSFORMER] + SHORT + [f"sync.sync_mode={mode}",
                                        f'process.learner.command=["{grpo_example()}", "topology"]']
        bounds = {}
    cmd, env = launch_command(refit_bin, tmp_path, sets, topology="grpo-vllm.toml", script="vllm_engine_rank.py")
    launch_solves(cmd, env, tmp_path, **bounds)


def test_vllm_engine_ranks_learn_grpo_when_updates_abort_their_batches(refit_bin, tmp_path):
    """The shipped file in batch-async mode with ``pause_mode = "abort"``: each commit first
    interrupts the vLLM batch running on its rank, whose sequences end aborted at the next
    step and are asked again by the rollout workers under the new version; the run still
    learns, and the report counts the sequences the updates aborted."""
    sets = LLAMA + ["sync.pause_mode=abort"]
    cmd, env = launch_command(refit_bin, tmp_path, sets, topology="grpo-vllm.toml", script="vllm_engine_rank.py")
    out = launch_solves(cmd, env, tmp_path, **SOLVES)
    aborted = [int(n) for n in re.findall(r"tokens; (\d+) sequences aborted", out)]
    assert len(aborted) == 2 and sum(aborted) > 0, out[-6000:]


def test_vllm_engine_ranks_learn_grpo_with_streaming_apply_over_tcp(refit_bin, tmp_path):
    """``apply = "streaming"`` over TCP: each vLLM engine rank's commit lands between two
    of vLLM's steps, pulls the version there and loads each tensor through the layerwise
    reload as it arrives (no staging buffer); the run learns, the engines' names check
    (``verify = "names"``) holding at every version."""
    sets = LLAMA + ["model.policy.apply=streaming", "links.weights=tcp"]
    cmd, env = launch_command(refit_bin, tmp_path, sets, topology="grpo-vllm.toml", script="vllm_engine_rank.py")
    # the example's engine, refusing every stage and commit: only load_streamed serves
    wrap_engine(cmd, tmp_path, "vllm_engine_rank.py", "m.VllmEngine", "Sub(m.build, checkpoint=m.checkpoint)",
                STREAMING_ONLY)
    out = launch_solves(cmd, env, tmp_path, **SOLVES)
    assert out.count("weights over tcp, streaming") == 2, out[-6000:]


def test_a_killed_vllm_engine_rank_is_restarted_and_rejoins(refit_bin, tmp_path):
    """``kill -9`` of a vLLM engine rank with ``restart = "on-failure"``: the launcher starts
    it again, its new vLLM rejoins the running job with the current weights and serves
    rollouts, and the report counts the new incarnation's loads. The run goes to its update
    budget (a reward is at most 1: the target is never met), so the restarted rank, whose
    vLLM takes seconds to start, rejoins before the end; it ends unsolved, and the launcher
    names rank 0's end as the cause, not the rank the restart made good."""
    sets = SHORT + RESTARTS + ["stop.target_eval=2.0", "stop.max_updates=250"]
    cmd, env = launch_command(refit_bin, tmp_path, sets, topology="grpo-vllm.toml", script="vllm_engine_rank.py")
    out = killed_rank_rejoins(cmd, env, tmp_path, kill_at="policy v2:", solves=False)
    assert "Traceback" not in out, out[-6000:]


def test_refits_own_learner_refuses_the_llama_and_the_transformer_its_rotary_base(refit_bin, tmp_path):
    """The shipped file's Llama (``params.arch = "llama"``) is trained by a Python learner:
    Refit's own learner refuses it before any rank starts, naming the architecture; and
    Refit's transformer, whose positions are learned, refuses the Llama's ``rope_theta``
    naming the key, so that a file switched to it does not keep a setting that does
    nothing."""
    rust = SHORT + [f'process.learner.command=["{grpo_example()}", "topology"]']
    cmd, env = launch_command(refit_bin, tmp_path, rust, topology="grpo-vllm.toml", script="vllm_engine_rank.py")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and 'params.arch = "llama" is trained by a Python learner' in done.stderr, done.stderr[-3000:]
    assert "before any rank started" in done.stderr, done.stderr[-3000:]
    switched = rust + ['model.policy.params.arch="transformer"']
    cmd, env = launch_command(refit_bin, tmp_path, switched, topology="grpo-vllm.toml", script="vllm_engine_rank.py")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "params.rope_theta must be unset" in done.stderr, done.stderr[-3000:]
    assert "before any rank started" in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("serve", [False, True])
def test_the_update_cost_benchmark_runs_and_reports_against_the_copy(serve):
    """``bench_vllm_engine.py`` (the book's figures) on the tiny Llama, in process and
    behind a ``vllm serve``: each phase with its ratio to the copy of the same bytes
    measured in the same run, and a rollout batch's time."""
    done = subprocess.run([sys.executable, str(REPO / "python/examples/bench_vllm_engine.py"), "--iters", "3"]
                          + (["--serve"] if serve else []), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = done.stdout.splitlines()
    kind = "a `vllm serve` over HTTP" if serve else "an in-process LLM"
    assert any(l.startswith(f"vLLM engine rank ({kind}), a Llama of 1.8 MiB") for l in lines), done.stdout
    phases = (["stage (to the server's sender)", "pause (/pause to /resume)"] if serve
              else ["stage (copy to the model's dtype)", "pause (vLLM's load)"])
    for phase in ["transfer (shm"] + phases:
        (line,) = [l for l in lines if phase in l]
        assert float(line.split("ms")[1].split("x")[0]) > 0, line
    (batch,) = [l for l in lines if "a batch of 32 completions" in l]
    assert float(batch.split()[-2]) > 0, batch


def test_the_apply_benchmark_sets_staged_and_streaming_side_by_side():
    """``bench_vllm_engine.py --apply`` (the topology chapter's figures) on the tiny Llama:
    a staged and a streaming engine, each in a process of its own fed over TCP, each
    printing its pause and its peak memory above itself."""
    done = subprocess.run([sys.executable, str(REPO / "python/examples/bench_vllm_engine.py"), "--apply",
                           "--iters", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = done.stdout.splitlines()
    assert any(l.startswith("vLLM engine rank, a Llama of 1.8 MiB (float32) over TCP") for l in lines), done.stdout
    for mode, pause in (("staged:", "pause (load)"), ("streaming:", "pause (transfer and load)")):
        (line,) = [l for l in lines if l.strip().startswith(mode)]
        assert float(line.split(pause)[1].split("ms")[0]) > 0, line
        # the staged engine holds the receiver's copy and its staging buffers at least, the
        # streaming one the buckets in flight and vLLM's reload (about 11 MiB here)
        extra = float(line.split("peak memory above the engine")[1].split("MiB")[0])
        assert extra > 0, line
