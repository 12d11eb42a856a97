"""Choosing the next token from the logits: greedy at temperature 0, else temperature and top-p (nucleus).

The random draw of a token is a function of (seed, request key, position) only, made with numpy's SeedSequence
(a well-kept counter-free hash of a key to a random stream): the same request gets the same tokens whichever
batch, replica, tp/pp layout or preemption it went through, which makes sampling testable like greedy decoding."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    key: int = 0  # the request's own number in the seed: its line of --input, or a server counter


def uniform_draw(seed: int, key: int, position: int) -> float:
    """A number in [0, 1) fixed by (seed, key, position)."""
    return float(np.random.default_rng([seed & 0xFFFFFFFF, key & 0xFFFFFFFF, position]).random())


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token at `position` from fp32 logits [vocab]."""
    if params.temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    ordered, order = torch.sort(probs, descending=True, stable=True)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        keep = (torch.cumsum(ordered, 0) - ordered) < params.top_p
        ordered = ordered * keep
    cumulative = torch.cumsum(ordered, 0)
    target = uniform_draw(params.seed, params.key, position) * float(cumulative[-1])
    chosen = int(torch.searchsorted(cumulative, torch.tensor(target, dtype=cumulative.dtype), right=True))
    return int(order[min(chosen, len(order) - 1)])
