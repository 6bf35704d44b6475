"""A PyTorch trainer as rank 0 of ``refit launch``: GRPO in torch on Refit's transformer or
a Hugging Face Llama.

``examples/topologies/grpo-torch.toml`` starts rank 0 from this file (the trainer, with the
weight-sync controller, the trajectory pool and the evaluator, all Refit's own rank code
run through the binding: :func:`refit.trainer.join`) and two engine ranks of Refit's
generating engine; ``grpo-vllm.toml`` puts two vLLM engine ranks behind the same trainer.
Only the learner is here, in torch:

- :class:`Transformer` is Refit's GPT-style transformer (learned token and position
  embeddings, pre-norm blocks of causal self-attention and a tanh-GELU MLP, no biases in
  the linear layers, an untied head), its tensors named as Refit's learner names them, so
  the engines' link converts its exports as it converts the Rust learner's;
- :class:`HfLlama` is Hugging Face's ``LlamaForCausalLM`` of random initialisation (no
  download), for a model of ``params.arch = "llama"`` (``grpo-vllm.toml``): Refit gives its
  layout, :func:`refit.models.llama_config` its config (with ``params.rope_theta``), and
  the vLLM engines load its tensors under the names they have;
- :class:`TorchGrpo` is GRPO as Refit's Rust learner does it: group-relative advantages
  (per token when the task gives per-token credit), the clipped ratio against the behaviour
  log-probabilities (or against the learner's own, with ``correction = "truncated"`` or
  ``"ignore"``), an optional KL term (``kl_coef``) to a frozen copy of the first weights
  or to the reference Refit's generating engines serve (``reference_every``; Python and
  vLLM engines serve none), AdamW, the gradient norm clipped.

Run it under ``refit launch`` (``REFIT_PYTHON`` names an interpreter with torch and
``refit``)::

    cargo build --release --example grpo --bin refit
    REFIT_PYTHON=.venv/bin/python target/release/refit launch examples/topologies/grpo-torch.toml
"""

from __future__ import annotations

import copy
import math
import sys
from typing import Any

import refit.trainer  # answers refit launch's check before torch is imported
from refit.models import llama_config
from refit.trainer import Sequence

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

#: The layer norms' epsilon of Refit's transformer.
LN_EPS = 1e-5


class Transformer(torch.nn.Module):
    """Refit's transformer, its parameters named as Refit's learner exports them."""

    def __init__(self, layout: list, heads: int, seed: int) -> None:
        super().__init__()
        shapes = {name: shape for name, _, shape in layout}
        self.heads = heads
        self.w = torch.nn.ParameterDict()
        gen = torch.Generator().manual_seed(seed)
        layers = sum(1 for n in shapes if n.endswith(".attn.q.weight"))
        resid = 0.02 / math.sqrt(2 * layers)
        for name, shape in shapes.items():
            if len(shape) == 1:  # a layer norm: weight 1, bias 0
                t = torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
            else:  # uniform of standard deviation 0.02 (the residual projections smaller)
                std = resid if name.endswith(("attn.o.weight", "mlp.proj.weight")) else 0.02
                t = (torch.rand(shape, generator=gen) * 2 - 1) * std * math.sqrt(3)
            # ParameterDict keys cannot hold dots
            self.w[name.replace(".", "/")] = torch.nn.Parameter(t)
        self.layers = layers

    def p(self, name: str) -> torch.Tensor:
        return self.w[name.replace(".", "/")]

    def named(self) -> dict[str, torch.Tensor]:
        return {k.replace("/", "."): v for k, v in self.w.items()}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, n, vocab]`` of the token ids ``[batch, n]``."""
        b, n = ids.shape
        d = self.p("tok_emb.weight").shape[1]
        dh = d // self.heads
        x = self.p("tok_emb.weight")[ids] + self.p("pos_emb.weight")[:n]
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        for i in range(self.layers):
            blk = f"blocks.{i}."
            h = F.layer_norm(x, (d,), self.p(blk + "ln1.weight"), self.p(blk + "ln1.bias"), LN_EPS)
            q, k, v = (
                (h @ self.p(blk + f"attn.{s}.weight").T).view(b, n, self.heads, dh).transpose(1, 2)
                for s in "qkv"
            )
            att = ((q @ k.transpose(-1, -2)) / math.sqrt(dh)).masked_fill(~mask, float("-inf"))
            y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
            x = x + y @ self.p(blk + "attn.o.weight").T
            h = F.layer_norm(x, (d,), self.p(blk + "ln2.weight"), self.p(blk + "ln2.bias"), LN_EPS)
            x = x + F.gelu(h @ self.p(blk + "mlp.fc.weight").T, approximate="tanh") @ self.p(blk + "mlp.proj.weight").T
        x = F.layer_norm(x, (d,), self.p("ln_f.weight"), self.p("ln_f.bias"), LN_EPS)
        return x @ self.p("head.weight").T


class HfLlama(torch.nn.Module):
    """Hugging Face's ``LlamaForCausalLM`` of the layout Refit gives, initialised at random
    (``transformers``' own initialisation, seeded)."""

    def __init__(self, layout: list, params: dict[str, Any], seed: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(LlamaConfig(**llama_config(layout, params)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits

    def named(self) -> dict[str, torch.Tensor]:
        # the state dict's names are the layout's: LlamaForCausalLM's own
        return self.model.state_dict()


def group_advantages(batch: list[Sequence], scale_by_std: bool, token_credit: bool) -> list[torch.Tensor]:
    """Each sequence's per-token advantage: its reward (or, when every member of its group
    has per-token credit, each position's credit) less the group's mean at that position,
    divided by the standard deviation when asked."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(batch):
        groups.setdefault(s.group, []).append(i)
    adv = [torch.zeros(len(s.tokens)) for s in batch]

    def norm(vals: torch.Tensor) -> torch.Tensor:
        centred = vals - vals.mean()
        return centred / (vals.std(unbiased=False) + 1e-6) if scale_by_std else centred

    for members in groups.values():
        per_token = token_credit and all(
            batch[i].token_rewards is not None and len(batch[i].token_rewards) == len(batch[i].tokens)
            for i in members)
        if per_token:
            for t in range(max(len(batch[i].tokens) for i in members)):
                at = [i for i in members if t < len(batch[i].tokens)]
                for i, a in zip(at, norm(torch.tensor([batch[i].token_rewards[t] for i in at]))):
                    adv[i][t] = a
        else:
            for i, a in zip(members, norm(torch.tensor([batch[i].reward for i in members]))):
                adv[i].fill_(float(a))
    return adv


class TorchGrpo(refit.trainer.Learner):
    """GRPO in torch, with the Rust learner's params and defaults (`lr`, `beta2`,
    `weight_decay`, `clip`, `clip_high`, `correction`, `is_cap`, `kl_coef`, `scale_by_std`,
    `token_credit`, `max_grad_norm`, `temperature`, `heads`; for a Llama, `arch`, `kv_heads`
    and `rope_theta`, which shape its config); one gradient step per batch.
    With `kl_coef > 0` the loss adds `kl_coef` times the `k3` estimate of KL(policy ‖
    reference) on the sampled tokens, the reference a frozen copy of the first weights, or,
    with `reference_every`, the model Refit's generating engines serve beside the policy
    (its log-probabilities come with each sequence), as the Rust learner's. What it does
    not do is refused by name: several epochs or minibatches."""

    name = "torch grpo"

    def start(self, model: str, layout: list, params: dict[str, Any], seed: int) -> None:
        self.p = params
        arch = str(params.get("arch", "transformer"))
        if arch == "llama":
            self.policy: torch.nn.Module = HfLlama(layout, params, seed)
        else:
            self.policy = Transformer(layout, int(params.get("heads", 4)), seed)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=float(params.get("lr", 1e-3)),
                                     betas=(0.9, float(params.get("beta2", 0.99))), eps=1e-8,
                                     weight_decay=float(params.get("weight_decay", 0.0)))
        self.correction = str(params.get("correction", "behaviour"))
        if self.correction not in ("behaviour", "truncated", "ignore"):
            raise ValueError(f"params.correction = {self.correction!r}: behaviour, truncated or ignore")
        for key, default in (("epochs", 1), ("minibatch", 0)):
            if params.get(key, default) != default:
                raise ValueError(f"model `{model}`: params.{key} = {params[key]}: the torch learner takes "
                                 f"only {key} = {default} (one step per batch)")
        self.kl_coef = float(params.get("kl_coef", 0.0))
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0.0):
            raise ValueError(f"model `{model}`: params.kl_coef = {params['kl_coef']} is not a number >= 0")
        # the KL term's reference: the one the engines serve, or the first weights, frozen
        self.served = "reference_every" in params
        if self.served and self.kl_coef <= 0:
            raise ValueError(f"model `{model}`: params.reference_every asks the engines to serve a reference "
                             f"for the KL term, and params.kl_coef is {self.kl_coef} (set it above 0, or drop "
                             "reference_every)")
        self.reference = None
        if self.kl_coef > 0 and not self.served:
            self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()

    # ANCHOR: update
    def update(self, model: str, batch: list[Sequence]) -> dict[str, float]:
        seqs = [s for s in batch if s.tokens]
        if not seqs:
            raise ValueError("the batch has no generated token")
        adv = torch.cat([a for s, a in zip(batch, group_advantages(
            batch, bool(self.p.get("scale_by_std", False)), bool(self.p.get("token_credit", True)))) if s.tokens])
        behaviour = torch.tensor([lp for s in seqs for lp in s.logprobs])
        logp = self.logprobs(seqs)
        prox = logp.detach()  # one step per batch: the step's own forward is the proximal policy
        base, weight = behaviour, None
        if self.correction == "truncated":
            base, weight = prox, (prox - behaviour).exp().clamp(max=float(self.p.get("is_cap", 2.0)))
        elif self.correction == "ignore":
            base = prox
        ratio = (logp - base).exp()
        clip, clip_high = float(self.p.get("clip", 0.2)), float(self.p.get("clip_high", 0.2))
        per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip_high) * adv)
        loss = (per_token * weight if weight is not None else per_token).mean()
        kl = None
        if self.kl_coef > 0:
            ref = self.reference_logprobs(seqs)
            kl = ((ref - logp).exp() - (ref - logp) - 1).mean()  # k3, per sampled token
            loss = loss + self.kl_coef * kl
        self.opt.zero_grad()
        loss.backward()
        max_norm = self.p.get("max_grad_norm", 1.0)
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), float(max_norm) if max_norm else math.inf)
        self.opt.step()
        rewards = [s.reward for s in batch]
        stats = {"loss": loss.item(), "grad_norm": float(norm), "mean_reward": sum(rewards) / len(rewards),
                 "behaviour_ratio_mean": float((prox - behaviour).exp().mean()), "sequences": float(len(batch))}
        if kl is not None:
            stats["kl"] = kl.item()
        return stats
    # ANCHOR_END: update

    def logprobs(self, seqs: list[Sequence], model: torch.nn.Module | None = None) -> torch.Tensor:
        """Each generated token's log-probability under the policy (or ``model``), at the
        sampling temperature, flat over the sequences, with the gradient."""
        n = max(len(s.prompt) + len(s.tokens) for s in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s.prompt) + len(s.tokens)] = torch.tensor(s.prompt + s.tokens)
        logits = (self.policy if model is None else model)(ids) / float(self.p.get("temperature", 1.0))
        logp = logits.log_softmax(-1)
        out = []
        for i, s in enumerate(seqs):
            # the logits at position j predict token j + 1
            at = torch.arange(len(s.prompt) - 1, len(s.prompt) + len(s.tokens) - 1)
            out.append(logp[i, at, torch.tensor(s.tokens)])
        return torch.cat(out)

    def reference_logprobs(self, seqs: list[Sequence]) -> torch.Tensor:
        """Each generated token's log-probability under the KL term's reference, flat: the
        ones the engines' reference gave (``reference_every``), or the frozen first
        weights'. Raises ``ValueError`` naming a sequence that lacks the served ones."""
        if self.reference is not None:
            with torch.no_grad():
                return self.logprobs(seqs, self.reference)
        for i, s in enumerate(seqs):
            if s.ref_logprobs is None or len(s.ref_logprobs) != len(s.tokens):
                got = "none" if s.ref_logprobs is None else f"{len(s.ref_logprobs)} for {len(s.tokens)} tokens"
                raise ValueError(f"sequence {i} (group {s.group}) carries no reference log-probability per "
                                 f"token ({got}): the KL term reads the engines' reference (reference_every)")
        return torch.tensor([lp for s in seqs for lp in s.ref_logprobs])

    def export(self, model: str) -> dict[str, torch.Tensor]:
        return {name: t.detach() for name, t in self.policy.named().items()}


# ANCHOR: main
def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return refit.trainer.main(TorchGrpo(), roles="grpo")
# ANCHOR_END: main


if __name__ == "__main__":
    sys.exit(main())
