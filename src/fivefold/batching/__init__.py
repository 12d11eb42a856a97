"""Serving's scheduler: continuous batching, chunked prefill and a paged KV cache, as counts (no torch).
`fivefold serve` / `generate` run it with a model; `simulate --serve` runs it with predicted step times."""

from fivefold.batching.blocks import BlockPool
from fivefold.batching.scheduler import Scheduler, Sequence, Step, pick_replica

__all__ = ["BlockPool", "Scheduler", "Sequence", "Step", "pick_replica"]
