"""Plan-independent initialisation: every tensor is drawn from a generator seeded by (seed, its name).

The name is the fully-qualified name in the whole model ("layers.3.attention.wq.weight"), which a
pipeline stage, FSDP or tensor parallelism never changes. The full tensor is drawn on CPU in fp32 and
each rank keeps its own shard of it, so the initial weights are the same under every plan.
"""

from __future__ import annotations

import hashlib
import math
from itertools import chain

import torch
from torch import nn

from fivefold.models.transformer import Transformer

INIT_STD = 0.02  # GPT-2 / Llama initialiser range
# Untied token embeddings of Llama-style (RoPE) MoE models: std 1, as TorchTitan initialises its Llama and MoE
# models (nn.init.normal_). At 0.02 the embeddings are drowned at init by the attention branch, whose output is
# nearly the same average for every token, so every token reaches the MoE router with nearly the same input and
# all go to the same experts; the auxiliary loss cannot undo that (docs/moe.md, "Why the expert load collapsed",
# bench/moe_routing.py). Dense models keep GPT-2's 0.02 (measured both ways on the built-in corpus: tiny learns a
# little slower at std 1, small faster; nothing to mend there), as do GPT-style models (learned positions, whose
# 0.02 table would be drowned instead) and tied embeddings (the LM head's logits would grow with sqrt(hidden)).
EMBEDDING_STD = 1.0

# Wrappers that insert a path component without changing the model (activation checkpointing,
# torch.compile, DDP); stripped so the seed name is the plain model's FQN.
WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "module"})


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name) that is the same in every process and Python run (unlike hash())."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def canonical_name(name: str) -> str:
    """The parameter's name in the plain model, without wrapper path components."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def _find_transformer(model: nn.Module) -> Transformer:
    for module in model.modules():
        if isinstance(module, Transformer):
            return module
    raise TypeError(f"init_weights expects a model containing a fivefold Transformer, got {type(model).__name__}")


def embedding_std(spec) -> float:
    """The std of the token embedding's initial values (EMBEDDING_STD's rule)."""
    return EMBEDDING_STD if spec.is_moe and spec.position == "rope" and not spec.tied_embeddings else INIT_STD


def _full_tensor(name: str, module: nn.Module, leaf: str, shape: torch.Size, seed: int, layers: int,
                 token_embedding_std: float = INIT_STD) -> torch.Tensor:
    """The whole (unsharded) initial value of module.<leaf>, fp32 on CPU."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf in ("bias", "expert_bias"):
        return torch.zeros(shape)
    # Residual-branch output projections get a smaller std so the residual stream does not grow with
    # depth (GPT-2 paper, section 2.3; nanoGPT c_proj).
    std = INIT_STD / math.sqrt(2 * layers) if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else INIT_STD
    if name == "tok_embeddings.weight":
        std = token_embedding_std
    generator = torch.Generator(device="cpu")
    generator.manual_seed(stable_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Initialise every parameter and buffer of `model` (whole, a pipeline stage, or parallelized) in place."""
    spec = _find_transformer(model).spec
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for leaf, tensor in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))  # a tied weight is drawn once, under its first name
            name = canonical_name(f"{module_name}.{leaf}" if module_name else leaf)
            if spec.tied_embeddings and name == "output.weight":
                name = "tok_embeddings.weight"  # a stage that holds only the head still draws the shared matrix
            # tensor.shape of a DTensor is the global shape, so `full` is the unsharded value.
            full = _full_tensor(name, module, leaf, tensor.shape, seed, spec.layers, embedding_std(spec))
            _copy_into(tensor, full)


def _copy_into(tensor: torch.Tensor, full: torch.Tensor) -> None:
    local = tensor
    if _is_dtensor(tensor):
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank drew the same full tensor, so each keeps its shard without
        # any communication (torch.distributed.tensor._api.distribute_tensor).
        full = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
        local = tensor.to_local()
    local.copy_(full.to(device=local.device, dtype=local.dtype))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(tensor, DTensor)
