"""A PyTorch engine as a rank of ``refit launch``: Refit's GRPO transformer served by torch.

``examples/topologies/grpo-python.toml`` starts rank 0 (Refit's GRPO trainer, the controller,
the evaluator) from the Rust example, and two engine ranks from this file. Each engine rank
is Refit's own rank run through the binding (:func:`refit.engine.join`: rendezvous, keepalive,
orphan exit, restarts, its rollout workers); only the model is here, in torch:

- :meth:`TorchTransformer.stage` copies the version Refit pulled (``bf16``, fused ``qkv``,
  the layout the trainer's link converts to) into ``float32`` torch tensors, beside
  generation;
- :meth:`TorchTransformer.commit` swaps them in: the pause;
- :meth:`TorchTransformer.load_streamed` (a model with ``apply = "streaming"``) pulls the
  version inside the pause and copies each tensor into the served weights as it arrives;
- :meth:`TorchTransformer.generate` decodes each request (greedy or sampled at its
  temperature) and answers its tokens with their behaviour log-probabilities;
- :meth:`TorchTransformer.interrupt` (under ``pause_mode = "abort"``) ends the running
  batch at its next token, its requests answered ``"aborted"``.

Run it under ``refit launch`` (``REFIT_PYTHON`` names the interpreter that has torch and
``refit``)::

    cargo build --release --example grpo --bin refit
    REFIT_PYTHON=.venv/bin/python target/release/refit launch examples/topologies/grpo-python.toml
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.nn.functional as F

import refit
import refit.engine
from refit.engine import Completion, Request

#: The layer norms' epsilon of Refit's transformer.
LN_EPS = 1e-5


class TorchTransformer(refit.engine.Engine):
    """Refit's GPT-style transformer (learned token and position embeddings, pre-norm
    blocks of causal self-attention and a tanh-GELU MLP, no biases in the linear layers, a
    final layer norm, an untied head), forward in torch on the CPU."""

    name = "torch transformer"

    def __init__(self) -> None:
        self.heads: dict[str, int] = {}
        self.staged: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        self.served: dict[str, dict[str, torch.Tensor]] = {}
        # the version whose interrupt ends each model's batch, until its next commit or abort
        self.interrupted: dict[str, int] = {}
        # models a streamed version left mixed (part of it loaded)
        self.mixed: set[str] = set()

    def manifest(self, model: str, layout: list, params: dict[str, Any]) -> list:
        # the shapes give every size but the number of heads: the model's params do (4 is
        # the GRPO roles' default, `GrpoRoles::new`)
        heads = int(params.get("heads", 4))
        d = dict((name, shape) for name, _, shape in layout)["tok_emb.weight"][1]
        if heads < 1 or d % heads:
            raise ValueError(f"model `{model}`: params.heads = {heads} does not divide d_model {d}")
        self.heads[model] = heads
        return layout

    # ANCHOR: weights
    def stage(self, model: str, version: int, update: refit.Update) -> None:
        # one copy (a view of the received memory is not kept)
        weights = {name: t.to(torch.float32, copy=True) for name, t in update.torch(model)}
        for name, t in weights.items():
            if not torch.isfinite(t).all():
                raise ValueError(f"tensor `{name}` of v{version} holds a value that is not finite")
        self.staged[model] = (version, weights)

    def commit(self, model: str, version: int) -> None:
        self.interrupted.pop(model, None)  # no batch runs now: the next ones go on
        staged, weights = self.staged.pop(model)
        if staged != version:
            raise RuntimeError(f"v{version} is not the version staged (v{staged})")
        self.served[model] = weights

    def load_streamed(self, model: str, version: int, stream: Any) -> None:
        # `apply = "streaming"`: each tensor goes into the served weights as it arrives
        # (no batch runs meanwhile); no second copy of the model is made
        self.interrupted.pop(model, None)
        served = self.served.setdefault(model, {})
        written = 0

        def apply(name: str, tensor: torch.Tensor) -> None:
            nonlocal written
            t = tensor.to(torch.float32, copy=True)
            if not torch.isfinite(t).all():
                # the stream may carry another version than the one asked
                raise ValueError(f"tensor `{name}` of the version streaming (v{version} asked) "
                                 "holds a value that is not finite")
            if name in served:
                served[name].copy_(t)
            else:
                served[name] = t
            written += 1

        try:
            stream(apply)
        except BaseException:
            if written:  # part of a version landed: no completion until one lands whole
                self.mixed.add(model)
            raise
        self.mixed.discard(model)

    def abort(self, model: str) -> None:
        self.interrupted.pop(model, None)
        self.staged.pop(model, None)

    def interrupt(self, model: str, version: int) -> None:
        # the batch decoding now (or about to) stops at its next token
        self.interrupted[model] = version

    # ANCHOR_END: weights

    @torch.no_grad()
    def logits(self, model: str, tokens: list[int]) -> torch.Tensor:
        """The next-token logits after ``tokens``."""
        w = self.served[model]
        heads = self.heads[model]
        ids = torch.tensor(tokens)
        x = w["tok_emb.weight"][ids] + w["pos_emb.weight"][: len(tokens)]
        n, d = x.shape
        dh = d // heads
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        i = 0
        while f"blocks.{i}.attn.qkv.weight" in w:
            b = f"blocks.{i}."
            h = F.layer_norm(x, (d,), w[b + "ln1.weight"], w[b + "ln1.bias"], LN_EPS)
            q, k, v = (h @ w[b + "attn.qkv.weight"].T).split(d, dim=1)
            q, k, v = (t.view(n, heads, dh).transpose(0, 1) for t in (q, k, v))
            scores = (q @ k.transpose(1, 2)) / math.sqrt(dh)
            att = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
            x = x + att.transpose(0, 1).reshape(n, d) @ w[b + "attn.o.weight"].T
            h = F.layer_norm(x, (d,), w[b + "ln2.weight"], w[b + "ln2.bias"], LN_EPS)
            x = x + F.gelu(h @ w[b + "mlp.fc.weight"].T, approximate="tanh") @ w[b + "mlp.proj.weight"].T
            i += 1
        last = F.layer_norm(x[-1], (d,), w["ln_f.weight"], w["ln_f.bias"], LN_EPS)
        return last @ w["head.weight"].T

    def complete(self, r: Request) -> Completion:
        if r.model in self.mixed:
            raise RuntimeError(f"`{r.model}` serves mixed weights: no completion until a version loads whole")
        gen = torch.Generator().manual_seed(r.seed)
        seq = list(r.prompt)
        tokens: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        for _ in range(r.max_tokens):
            if r.model in self.interrupted:  # an update in abort mode: the tokens so far
                finish = "aborted"
                break
            logits = self.logits(r.model, seq).double()
            t = r.temperature if r.temperature > 0 else 1.0
            logp = (logits / t).log_softmax(-1)
            if r.temperature > 0:
                token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            else:
                token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
            seq.append(token)
            if r.stop is not None and token == r.stop:
                finish = "stop"
                break
        return Completion(tokens=tokens, logprobs=logprobs, finish=finish)

    def generate(self, requests: list[Request]) -> list[Completion | BaseException]:
        out: list[Completion | BaseException] = []
        for r in requests:
            try:
                out.append(self.complete(r))
            except Exception as e:  # one bad request does not fail the batch
                out.append(e)
        return out


# ANCHOR: main
def main() -> int:
    torch.set_num_threads(1)
    # join, with an error as one `error: ...` line (what `refit launch` repeats) and status 1
    return refit.engine.main(TorchTransformer(), roles="grpo")
# ANCHOR_END: main


if __name__ == "__main__":
    sys.exit(main())
