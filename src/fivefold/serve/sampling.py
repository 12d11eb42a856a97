"""Choosing each request's next token from one step's logits, for every sampled row at once, on the device where
the logits are: greedy below a tiny temperature, else temperature, top-k and top-p (nucleus).

`sample_rows` is a pure function of the logits and each row's parameters, so it runs wherever the logits live (the
engine's process, or the last pipeline stage's worker) and hands back one tensor of token ids: the step's only copy
to the host is the caller's `.tolist()` of it.

Seeded draws come from a counter-based hash of (seed, request key, position) computed with integer tensor ops on
the device (murmur3's 32-bit finaliser, Appleby, public domain). torch's own generators are stateful streams: a
request's tokens would then depend on which other requests shared its batches and in what order. With the hash, a
request gets the same tokens whichever batch, replica, tp/pp layout or preemption it went through, which makes
sampling as testable as greedy decoding. The draw picks the token by inverse CDF over the kept probabilities (in
float64, so a probability of 1e-12 keeps its share)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Temperatures below this sample greedily: dividing logits by less would overflow float32 (vLLM uses the same
# threshold, _SAMPLING_EPS, for the same reason).
GREEDY_BELOW = 1e-5

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_BELOW: greedy
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose mass reaches top_p
    top_k: int = 0  # keep the k most likely tokens (0: all)
    seed: int = 0
    key: int = 0  # the request's own number in the seed: its line of --input, or a server counter

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass
class Sampled:
    """One step's choices, on the logits' device."""

    token_ids: torch.Tensor  # [S] int64


def _mul32(h: torch.Tensor, constant: int) -> torch.Tensor:
    """(h * constant) mod 2^32 for h in [0, 2^32), in int64 without overflowing it (split into 16-bit halves)."""
    low = h * (constant & 0xFFFF)
    high = ((h * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_draws(seeds: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 numbers in [0, 1), one per row, fixed by (seed, key, position) (int64 tensors on any device)."""
    h = _fmix32((positions & _MASK32) ^ 0x9E3779B9)
    h = _fmix32(h ^ (keys & _MASK32))
    h = _fmix32(h ^ (seeds & _MASK32))
    low = _fmix32(h ^ 0x7F4A7C15)  # a second word for 53 bits of resolution
    return ((h >> 5).double() * 67108864.0 + (low >> 6).double()) / 9007199254740992.0


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> torch.Tensor:
    """Sampled tokens [S] for rows that all sample (none greedy)."""
    device = logits.device
    rows, vocab = logits.shape
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device)
    probs = torch.softmax(logits.double() / temperature[:, None], dim=-1)
    uniform = uniform_draws(torch.tensor([p.seed for p in params], dtype=torch.long, device=device),
                            torch.tensor([p.key for p in params], dtype=torch.long, device=device),
                            torch.tensor(list(positions), dtype=torch.long, device=device))
    if any(p.top_p < 1.0 or 0 < p.top_k < vocab for p in params):
        ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        rank = torch.arange(vocab, device=device)
        # The mass before a token is under top_p (so the first token always stays), and it is among the top k.
        keep = ((torch.cumsum(ordered, -1) - ordered) < top_p[:, None]) & (rank[None, :] < top_k[:, None])
        ordered = ordered * keep
    else:
        ordered, order = probs, None
    cumulative = torch.cumsum(ordered, -1)
    target = (uniform * cumulative[:, -1])[:, None]
    chosen = torch.searchsorted(cumulative, target, right=True).clamp_(max=vocab - 1)[:, 0]
    if order is not None:
        chosen = order.gather(1, chosen[:, None])[:, 0]
    return chosen


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> Sampled:
    """The next token of each row of fp32 `logits` [S, vocab]: row i under params[i], at its request's position
    positions[i] (the index of the token being chosen). Everything stays on the logits' device."""
    greedy = logits.argmax(-1)
    sampling = [i for i, p in enumerate(params) if not p.greedy]
    if not sampling:
        return Sampled(greedy)
    if len(sampling) == len(params):
        return Sampled(_draw(logits, params, positions))
    index = torch.tensor(sampling, dtype=torch.long, device=logits.device)
    drawn = _draw(logits.index_select(0, index), [params[i] for i in sampling], [positions[i] for i in sampling])
    return Sampled(greedy.index_copy(0, index, drawn))
