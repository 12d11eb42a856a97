"""Why an MoE run's expert load collapses: the busiest expert's tokens over the mean, per step, for a small but
representative MoE (64 experts, top-8, as Qwen3-30B-A3B's layer) trained on CPU, one change at a time:

    data       the built-in byte corpus, or uniformly random bytes
    router     fp32 routing (the runtime's), or the logits in bf16 as under CUDA autocast before the fix
    init       token embeddings at std 1 (fivefold's init) or 0.02 (its init before: drowned at init by the attention
               branch's nearly token-independent output); the router at std 0.02 or a quarter of it
    aux        the auxiliary loss coefficient (0 or 0.01)

It prints, per variant, the worst layer's load each step (1 = balanced, experts / top_k = every token to the same
top_k experts) and the share of tokens whose chosen set equals the most common set. Single process, fp32 on CPU.

    PYTHONPATH=src python bench/moe_routing.py            # ~4 minutes on 2 cores
    SMALL=1 PYTHONPATH=src python bench/moe_routing.py    # 3 steps, a smaller model
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

from fivefold.data import load_tokenizer, open_data
from fivefold.data.loader import GlobalBatchLoader
from fivefold.models import MoE, build_model, init_weights
from fivefold.runtime.optim import build_optimizer
from fivefold.spec import ModelSpec

SMALL = bool(os.environ.get("SMALL"))
SPEC = ModelSpec(name="moe-64x8", layers=2 if SMALL else 4, hidden=128 if SMALL else 256, heads=4, kv_heads=2,
                 head_dim=64, vocab=256, max_seq_len=512, experts=64, top_k=8, expert_ffn_hidden=32 if SMALL else 64,
                 aux_loss_coef=0.01)
SEQ, BATCH, STEPS, LR = (128, 4, 3, 3e-3) if SMALL else (256, 8, 12, 3e-3)


class RandomBytes:
    """Uniformly random token ids: routing then sees no structure of text at all."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> torch.Tensor:
        return torch.randint(0, 256, (BATCH, SEQ + 1), generator=self.generator)


@contextlib.contextmanager
def bf16_router_logits():
    """The router's logits rounded to bf16, as torch.autocast('cuda') computed F.linear before the fix."""
    original = F.linear

    def rounded(x, weight, bias=None):
        out = original(x, weight, bias)
        return out.to(torch.bfloat16).float() if weight.shape[0] == SPEC.experts else out

    F.linear = rounded
    try:
        yield
    finally:
        F.linear = original


def chosen_sets(block: MoE, inputs: torch.Tensor) -> float:
    """Share of tokens whose top-k set is the most common one (1.0: every token picks the same experts)."""
    with torch.no_grad():
        logits = F.linear(inputs.reshape(-1, inputs.shape[-1]).float(), block.router.weight.float())
        chosen = logits.softmax(-1).topk(block.top_k, dim=-1).indices.sort(dim=-1).values
    _, counts = torch.unique(chosen, dim=0, return_counts=True)
    return counts.max().item() / chosen.shape[0]


def run(name: str, data: str, router: str, init: str, aux: float) -> list[tuple[float, float]]:
    spec = dataclasses.replace(SPEC, aux_loss_coef=aux)
    torch.manual_seed(0)
    model = build_model(spec, device="cpu")
    init_weights(model, 0)
    if init == "scaled":
        with torch.no_grad():
            for block in (m for m in model.modules() if isinstance(m, MoE)):
                block.router.weight.mul_(0.25)
    if init in ("embedding-0.02", "scaled"):  # fivefold's init before: token embeddings at std 0.02 like the rest
        with torch.no_grad():
            model.tok_embeddings.weight.mul_(0.02 / model.tok_embeddings.weight.std())
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    for block in blocks:
        block.aux_loss_scale = 1.0 / (spec.moe_layers * BATCH)
    captured: dict[int, torch.Tensor] = {}
    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda module, args, index=index: captured.__setitem__(index, args[0]))
    loader = (GlobalBatchLoader(open_data(None, load_tokenizer(None)), SEQ, BATCH, seed=0) if data == "corpus"
              else RandomBytes(0))
    optimizer = build_optimizer(list(model.parameters()), LR)
    history = []
    for step in range(STEPS):
        batch = loader.next_batch()
        with bf16_router_logits() if router == "bf16" else contextlib.nullcontext():
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loads = [block.take_stats()[0] for block in blocks]
        worst = max(range(len(blocks)), key=lambda i: (loads[i].max() / loads[i].mean()).item())
        history.append(((loads[worst].max() / loads[worst].mean()).item(), chosen_sets(blocks[worst], captured[worst])))
    print(f"{name:<38} load per step: " + " ".join(f"{load:4.1f}" for load, _ in history)
          + f" | same top-k set, last step: {100 * history[-1][1]:.0f}% of tokens", flush=True)
    return history


VARIANTS = {  # name -> (data, router, init, aux); "embeddings 1" is fivefold's init (models/init.py EMBEDDING_STD)
    "corpus, embeddings 0.02, aux 0.01": ("corpus", "fp32", "embedding-0.02", 0.01),
    "corpus, embeddings 0.02, aux 0": ("corpus", "fp32", "embedding-0.02", 0.0),
    "random, embeddings 0.02, aux 0.01": ("random", "fp32", "embedding-0.02", 0.01),
    "corpus, embeddings 0.02, bf16 logits": ("corpus", "bf16", "embedding-0.02", 0.01),
    "corpus, embeddings 0.02, router / 4": ("corpus", "fp32", "scaled", 0.01),
    "corpus, embeddings 1, aux 0.01": ("corpus", "fp32", "default", 0.01),
    "corpus, embeddings 1, aux 0": ("corpus", "fp32", "default", 0.0),
    "random, embeddings 1, aux 0.01": ("random", "fp32", "default", 0.01),
}


def main() -> int:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    print(f"{SPEC.experts} experts, top-{SPEC.top_k}, hidden {SPEC.hidden}, {SPEC.layers} layers, seq {SEQ}, batch "
          f"{BATCH}, lr {LR}: worst MoE layer's busiest expert / mean (1 = balanced, {SPEC.experts // SPEC.top_k} = "
          "collapsed)")
    for name, variant in VARIANTS.items():
        run(name, *variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
