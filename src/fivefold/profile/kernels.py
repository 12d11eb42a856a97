"""Single-device measurements: GEMM throughput over shapes and dtypes, and memory bandwidth.

Decode GEMMs (a few rows against a weight matrix: every step of `fivefold serve`) stream their weights from memory
once per step: between two uses of a weight the rest of the model, the KV cache and the engine's Python have run,
and on this machine's 2-core VM the last-level cache is shared with the neighbours. Timing such a GEMM back to back
on one matrix keeps the weights in cache and measured 1x344x128 at 7 us where a served 4-layer model's step
spends 18 us on it (torch profiler, 27 Nov 2026). So on a CPU the decode shapes are timed as a model runs them:
F.linear over a rotation of distinct weight matrices filling DECODE_WORKING_SET bytes, beyond the last-level cache
(32 MiB here), and each call pays its weights' trip from memory. The matrices are 256 x 256 and 512 x 512 (a
layer's matrices of the small models a CPU serves): the time of such a call grows as a latency plus bytes at a
bandwidth (here 1 x 128^2: 19 us, 256^2: 39 us, 512^2: 123 us, i.e. ~12 us + bytes at ~9.5 GB/s), which
cost/serving.py fits on the one-row points. A GPU profile leaves them out: a GPU serves large models, whose decode GEMMs cost/serving.py prices
by the memory roofline, and there a 512-wide GEMV would only time a kernel launch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class GemmPoint:
    m: int  # rows of A and C
    n: int  # columns of B and C
    k: int  # the reduced dimension
    dtype: str  # fp32 | bf16 | fp16
    seconds: float  # median time of one GEMM
    flops_per_s: float  # 2*m*n*k / seconds


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(work: Callable[[], object], device: torch.device, repeats: int, min_seconds: float,
                   agree: Callable[[int], int] = lambda count: count,
                   before_sample: Callable[[], None] = lambda: None,
                   after_sample: Callable[[], None] = lambda: None) -> float:
    """Median over `repeats` timed batches; each batch runs the work often enough to last min_seconds.

    For collectives every rank must make the same number of calls: `agree` turns this rank's loop count
    into the one all ranks use, and `before_sample` lines the ranks up before each batch; `after_sample`,
    timed with the batch, waits for the last rank to finish it.
    """
    work()
    synchronize(device)
    start = time.perf_counter()
    work()
    synchronize(device)
    once = max(time.perf_counter() - start, 1e-7)
    inner = agree(max(1, int(min_seconds / once)))
    samples = []
    for _ in range(repeats):
        before_sample()
        start = time.perf_counter()
        for _ in range(inner):
            work()
        synchronize(device)
        after_sample()
        samples.append((time.perf_counter() - start) / inner)
    samples.sort()
    return samples[len(samples) // 2]


# Decode GEMMs with their weights in memory, not in cache (module docstring): 1 and 4 rows, the decode steps of
# one and a few requests; their arithmetic intensity (0.5-2 FLOP/byte in fp32) is below every other shape's, so
# they set the measured curve's low end without moving the rates of the training shapes. The one-row GEMMs at two
# sizes give cost/serving.cold_stream its latency per call and bandwidth.
DECODE_SHAPES = ((1, 256, 256), (1, 512, 512), (4, 512, 512))
DECODE_WORKING_SET = 64 * 2**20


def gemm_shapes(quick: bool, cpu: bool = True) -> list[tuple[int, int, int]]:
    """Square GEMMs of growing size plus the skinny shapes of a transformer layer (tokens x h x 4h) and, on a
    CPU, the decode shapes. The smallest squares give the rate of the small models' GEMMs (hidden 64-256), where
    the per-call cost shows."""
    squares = [32, 64, 128, 256, 512, 1024] if quick else [32, 64, 128, 256, 512, 1024, 2048, 4096]
    skinny = [(256, 1024, 256), (1024, 256, 1024)] if quick else [(512, 4096, 1024), (4096, 1024, 4096),
                                                                  (2048, 2048, 8192)]
    return [(s, s, s) for s in squares] + skinny + (list(DECODE_SHAPES) if cpu else [])


def _gemm_work(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], object], int]:
    """(work, GEMMs it runs): one matrix product, or for a decode shape F.linear over a rotation of weights
    filling DECODE_WORKING_SET (module docstring)."""
    if (m, n, k) not in DECODE_SHAPES:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        return (lambda: torch.mm(a, b)), 1
    x = torch.randn(m, k, device=device, dtype=dtype)
    count = max(2, -(-DECODE_WORKING_SET // (n * k * x.element_size())))
    weights = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(count)]
    return (lambda: [torch.nn.functional.linear(x, w) for w in weights]), count


def measure_gemm(device: torch.device, dtypes: list[str], quick: bool,
                 on_point: Callable[[GemmPoint], None] | None = None,
                 line_up: Callable[[], None] = lambda: None,
                 agree: Callable[[int], int] = lambda count: count) -> list[GemmPoint]:
    """Every shape of gemm_shapes in every dtype. When several ranks measure together, `line_up` (a
    barrier) starts every timed batch on every rank at once, `agree` gives them all the same number of
    GEMMs and the batch ends when the last rank is done (as a step's collectives wait for it): with more
    ranks than cores, a rank the scheduler favours would otherwise time its GEMMs at a larger share of
    the machine than the ranks of a training step get on average."""
    points = []
    for dtype in dtypes:
        for m, n, k in gemm_shapes(quick, device.type == "cpu"):
            line_up()
            work, calls = _gemm_work(m, n, k, DTYPES[dtype], device)
            seconds = median_seconds(work, device, repeats=3 if quick else 5, min_seconds=0.02 if quick else 0.1,
                                     agree=agree, before_sample=line_up, after_sample=line_up) / calls
            del work
            point = GemmPoint(m, n, k, dtype, seconds, 2 * m * n * k / seconds)
            points.append(point)
            if on_point:
                on_point(point)
    return points


def measure_memory_bandwidth(device: torch.device, quick: bool, line_up: Callable[[], None] = lambda: None,
                             agree: Callable[[int], int] = lambda count: count) -> float:
    """Bytes/s of a large copy (one read + one write per element), the STREAM 'copy' kernel; several
    ranks copy at once as they compute GEMMs at once (measure_gemm)."""
    elements = (32 if quick else 128) * 2**20 // 4
    source = torch.ones(elements, device=device, dtype=torch.float32)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), device, repeats=5, min_seconds=0.05, agree=agree,
                             before_sample=line_up, after_sample=line_up)
    return 2 * source.numel() * source.element_size() / seconds
