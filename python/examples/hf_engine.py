"""Any torch model with `load_state_dict` as a Refit engine: a Hugging Face transformers
model receives each version a trainer publishes, with no copy until `load_state_dict`.

    python hf_engine.py --transport shm --dtype bfloat16

The trainer (a thread here, a process or another host in a real run) publishes its
`state_dict()`; the engine loads every version and checks that its logits now equal the
trainer's, bit for bit. Needs torch and transformers.
"""

import argparse
import threading

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import refit


def tiny_llama(seed: int, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(config).to(dtype).eval()


# ANCHOR: engine
def engine(spec: str, model: torch.nn.Module, updates: int, on_loaded) -> None:
    receiver = refit.Receiver(spec, timeout=60)
    model.load_state_dict(receiver.current().state_dict())  # version 1
    on_loaded(receiver.version())
    while updates > 0:
        update = receiver.receive(timeout=1.0)
        if update is None:
            continue
        # torch tensors viewing the received memory; load_state_dict copies them in
        model.load_state_dict(update.state_dict(), strict=True)
        on_loaded(update.version())
        update.ack()
        updates -= 1
    receiver.close()
# ANCHOR_END: engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", default="shm", choices=refit.transports())
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--updates", type=int, default=2)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    trainer = tiny_llama(0, dtype)
    served = tiny_llama(1, dtype)  # other weights until the first version lands
    prompt = torch.arange(1, 17).unsqueeze(0)

    def logits(m):
        with torch.no_grad():
            return m(prompt).logits

    assert not torch.equal(logits(trainer), logits(served))
    sender = refit.Sender(a.transport, trainer.state_dict(), receivers=1)
    loaded = []

    def check(version: int) -> None:
        same = torch.equal(logits(served), logits(trainer))
        loaded.append((version, same))
        print(f"engine serves version {version}: logits equal the trainer's: {same}")

    t = threading.Thread(target=engine, args=(sender.spec, served, a.updates, check))
    t.start()
    sender.start(timeout=60)
    for _ in range(a.updates):
        # wait until the engine checked the previous version before the trainer moves on
        while len(loaded) < sender.version():
            threading.Event().wait(0.01)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.01)  # "a training step"
        sender.send(trainer.state_dict(), timeout=60)
    t.join(120)
    sender.close()
    ok = [v for v, same in loaded if same]
    if len(ok) != a.updates + 1 or len(loaded) != a.updates + 1:
        raise SystemExit(f"engine saw {loaded}")
    print(f"{a.transport} {a.dtype}: {len(ok)} versions loaded, every one equal to the trainer's")


if __name__ == "__main__":
    main()
