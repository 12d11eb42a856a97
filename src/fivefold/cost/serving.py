"""Time of one serving step (one forward pass of a continuous batch) on one replica, term by term.

A step computes `tokens` tokens: one per decoding request plus the prefill chunks (chunked prefill). Each term
is named with its source:
- linear layers (`gemm_s`): every block's GEMMs with m = tokens, priced by cost/compute.gemm_time — the
  training model's tile/wave efficiencies and its roofline. At small m the roofline's memory term wins: the
  weights (params / tp of the stage, in the weight dtype) are read once per step whatever the batch (Pope et
  al. 2022, "Efficiently Scaling Transformer Inference", §2; gpt-fast's bandwidth accounting). `crossover_batch`
  is the m where the GEMMs turn compute-bound: gemm rate x bytes per weight / (2 x memory bandwidth).
  Skinny GEMMs (a few rows: decode) run as split-K / GEMV kernels that keep every SM streaming weights
  (gpt-fast's and TensorRT-LLM's decode kernels), so the tile model's wasted rows do not apply: `skinny_gemm_time`
  is the plain roofline, and a GEMM costs the faster of the two.
- attention (`attention_s`): prefill chunks run FlashAttention forward over their context
  (cost/compute.flash_attention_time, as training); decoding requests read their whole KV cache
  (`kv_bytes_per_token`, spec/serve.py: K and V of the stage's layers and the rank's kv heads, in the KV
  dtype) at the achievable memory bandwidth (PagedAttention, Kwon et al. 2023).
- tensor parallel (`tp_comm_s`): two all-reduces of tokens x hidden per layer (Megatron-LM, Shoeybi et al.
  2019), each paying the collective's per-hop latency (cost/comm.all_reduce_time): for decode messages of a few
  KiB the latency dominates, and on a slow link (Wi-Fi between laptops) it dominates the step (TPI-LLM, Li et
  al. 2024, §3). Inside a node serving engines replace NCCL's ring/tree for small messages with a one-shot
  all-reduce (every rank reads its peers' buffers over NVLink, one hop: vLLM's custom_all_reduce, TensorRT-LLM's
  and gpt-fast's custom collectives): `tp_all_reduce_time` takes the faster of the two.
- pipeline parallel (`pp_send_s`): each stage boundary sends tokens x hidden (cost/comm.p2p_time); pp steps of
  disjoint requests are in flight at once (batching/scheduler.py), so a step's latency is the sum of its
  stages and a replica starts a step every busiest-stage time.
- element-wise work and the LM head (`other_s`): norms, rotary, residuals, activation, sampling — memory-bound
  kernels (cost/compute.elementwise_time); the LM head is one more GEMM on the last stage's sampled rows.
- the engine's per-step host work (`host_s`): scheduling, input preparation, sampling, detokenization,
  CUDA-graph replay — STEP_HOST_S, fitted on the development set (bench/validate_serving.py). On a device whose
  profile measured fivefold's own serving engine (HostCosts.serving: `fivefold profile` on CPU, profile/serving.py)
  the measured costs replace it: per step, per request in the step and, when the layout runs on worker processes,
  one step's trip through a worker process (`host_s`, paid once per step); each stage boundary of a pipeline of
  workers pays another such trip (`pp_send_s`: the next stage's inbox and wake-up, beside the gloo send/recv);
  per layer of the stage, with an extra
  attention call per prefill chunk beyond the first group (`stage_host_s`, paid on every stage: eager module
  calls, no CUDA graphs). Such a device is costed as training costs a profiled CPU rank (cost/compute.Device with
  the calibration): the measured GEMM rates and memory bandwidth, no per-kernel latency of its own.
On a profiled CPU a decode step also reads what is not in cache: each weight matrix once per step (the rest of
the model, the KV cache and the engine's Python ran in between) and each decoding request's KV blocks (the
engine gathers them with one index_select per layer, serve/kv_cache.py). `ColdStream` prices such a read as a
latency per call plus bytes at a bandwidth, both fitted on the profile's one-row GEMMs timed with their weights
out of cache at two matrix sizes (profile/kernels.py DECODE_SHAPES: here 256 x 256 in 39 us and 512 x 512 in
123 us, i.e. ~12 us + bytes at ~9.5 GB/s); a GEMM costs at least its weights' read.
FP8 (`dtype=fp8`) runs the block GEMMs on FP8 tensor cores with 1-byte weights (cost/compute.gemm_time's FP8
path); `kv_dtype=fp8` halves the KV read and doubles the cache capacity. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fivefold.cost.comm import SELF, GroupLink, all_reduce_time, p2p_time
from fivefold.cost.compute import Device, elementwise_time, flash_attention_time, gemm_time
from fivefold.spec.cluster import Calibration, HostCosts
from fivefold.spec.devices import DeviceSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.serve import DTYPE_BYTES, kv_heads_per_device

# The engine's host work per step (scheduling, sampling, launch of the captured graph): fitted on the
# development set's batch-1 decode rows (gpt-fast, torch.compile + CUDA graphs) and TensorRT-LLM's in-flight
# batching rows; see bench/validate_serving.py.
STEP_HOST_S = 0.6e-3
# A frontend's host work per request per step (streamed token's detokenization and output processing in
# Python): 0 for an engine that does it off the step's critical path; ReplicaCost.host_per_request_s sets it.
HOST_PER_REQUEST_S = 0.0
# Paged decode attention reads scattered KV blocks (gather by block table, one query row per head): it
# reaches this share of the streaming bandwidth (fitted on the development set's long-output rows).
PAGED_ATTENTION_EFFICIENCY = 0.9
# CUDA graphs remove the host launch of every kernel; what stays is each kernel's ramp-up and tail on the
# device (~2 us, about half the eager per-kernel latency of cost/compute.py's profiles).
GRAPH_KERNEL_LATENCY_S = 2e-6
# Element-wise kernels of one block with CUDA graphs (two norms, rotary, two residual adds, the SwiGLU product,
# KV-cache write) and the bytes each moves per token per hidden unit (read + write, 2-byte activations).
ELEMENTWISE_KERNELS = 7
ELEMENTWISE_BYTES_PER_HIDDEN = 14 * 2


@dataclass(frozen=True)
class ColdStream:
    """Reading bytes that are not in cache on a profiled CPU: a latency per call plus bytes at a bandwidth
    (module docstring)."""

    latency_s: float
    bandwidth: float  # bytes/s

    def seconds(self, num_bytes: float, calls: int = 1) -> float:
        return calls * self.latency_s + num_bytes / self.bandwidth


def cold_stream(calibration: Calibration | None, dtype: str) -> ColdStream | None:
    """The fit of seconds = latency + bytes / bandwidth over the profile's one-row GEMMs of `dtype` (their weights'
    bytes); None without two sizes of them."""
    if calibration is None:
        return None
    element = DTYPE_BYTES[dtype]
    points = sorted({(n * k * element, 2.0 * n * k / rate) for m, n, k, point_dtype, rate in calibration.gemm
                     if m == 1 and point_dtype == dtype and rate > 0})
    if len({size for size, _ in points}) < 2:
        return None
    mean_size = sum(size for size, _ in points) / len(points)
    mean_time = sum(time for _, time in points) / len(points)
    slope = (sum((size - mean_size) * (time - mean_time) for size, time in points)
             / sum((size - mean_size) ** 2 for size, _ in points))
    if slope <= 0:
        return None
    return ColdStream(max(0.0, mean_time - slope * mean_size), 1.0 / slope)


def skinny_gemm_time(device: Device, m: int, n: int, k: int, batch: int = 1, fp8: bool = False,
                     stream: ColdStream | None = None, matrices: int = 1) -> float:
    """The faster of cost/compute.gemm_time and a split-K kernel at the roofline (weights streamed once); on a
    profiled CPU, the measured rate of the shape, and with `stream` at least the read of the weights, held in
    `matrices` separate matrices (each a call)."""
    tiled = gemm_time(device, m, n, k, batch, fp8)
    if m <= 0 or n <= 0 or k <= 0:
        return tiled
    if device.host is not None and device.gemm_curve is not None:
        # A profiled CPU: the measured rate of this shape (small GEMMs run far below the best one).
        return tiled if stream is None else max(tiled, stream.seconds(n * k * device.element_bytes * batch,
                                                                          matrices * batch))
    rate = device.fp8_gemm_peak if fp8 and device.fp8_gemm_peak else device.gemm_peak
    weight_bytes = 1 if fp8 and device.fp8_gemm_peak else device.element_bytes
    memory = (k * n * weight_bytes + (m * k + m * n) * 2) * batch / device.bandwidth
    return min(tiled, max(memory, 2.0 * m * n * k * batch / rate) + device.latency)


def tp_all_reduce_time(num_bytes: float, link: GroupLink) -> float:
    """A serving engine's tp all-reduce: NCCL's ring/tree, or inside one node the one-shot all-reduce (one hop of
    latency each way, every rank reading the n-1 peer buffers), whichever is faster (module docstring)."""
    nccl = all_reduce_time(num_bytes, link)
    if link.size <= 1 or link.nodes > 1 or link.measured is not None:
        return nccl
    one_shot = 2 * link.latency + (link.size - 1) * num_bytes / link.intra_bandwidth
    return min(nccl, one_shot)


@dataclass
class StepCost:
    """Seconds of one step on the busiest stage, by term (the module docstring names each source)."""

    gemm_s: float = 0.0
    attention_s: float = 0.0
    tp_comm_s: float = 0.0
    other_s: float = 0.0
    pp_send_s: float = 0.0
    host_s: float = 0.0
    stages: int = 1
    stage_host_s: float = 0.0  # measured engines only: host work of each stage's layers (module docstring)

    @property
    def stage_s(self) -> float:
        """Busiest stage: the interval at which a replica can start steps with pp steps in flight."""
        return (self.gemm_s + self.attention_s + self.tp_comm_s + self.other_s + self.pp_send_s + self.host_s
                + self.stage_host_s)

    @property
    def latency_s(self) -> float:
        """Start to end of one step through every stage (the host work is paid once)."""
        return (self.stage_s - self.host_s) * self.stages + self.host_s

    def to_dict(self) -> dict:
        return {"gemm_s": self.gemm_s, "attention_s": self.attention_s, "tp_comm_s": self.tp_comm_s,
                "other_s": self.other_s, "pp_send_s": self.pp_send_s, "host_s": self.host_s,
                "stage_host_s": self.stage_host_s, "stage_s": self.stage_s, "latency_s": self.latency_s}


@dataclass
class ReplicaCost:
    """The step-time model of one replica: tp x pp devices of one kind (the slowest, on a mixed replica)."""

    model: ModelSpec
    device_spec: DeviceSpec
    tp: int
    pp: int
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    ep: int = 1
    tp_link: GroupLink = SELF
    pp_link: GroupLink = SELF  # the slowest stage boundary
    host_s: float = STEP_HOST_S
    host_per_request_s: float = HOST_PER_REQUEST_S
    calibration: Calibration | None = None  # a profiled device (`fivefold profile`): measured rates and host costs
    on_workers: bool = False  # the engine runs it on worker processes (serve/executor.make_executor: > 1 device)
    _linear_cache: dict[int, tuple[float, float, float]] = field(default_factory=dict, repr=False)
    _attention_cache: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)
    _head_cache: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.device = Device(self.device_spec, self.dtype, self.calibration)
        self.device.latency = min(self.device.latency, GRAPH_KERNEL_LATENCY_S)  # decode runs as CUDA graphs
        host = self.device.host
        # fivefold's own engine, measured (module docstring); None: the development set's fitted STEP_HOST_S.
        self.engine_host: HostCosts | None = host if host is not None and host.serving else None
        # What a step reads out of cache on such a device (module docstring); None elsewhere.
        self.stream = cold_stream(self.calibration, self.dtype) if self.engine_host is not None else None
        self.layers = -(-self.model.layers // self.pp)  # busiest stage (the first stages take the remainder)
        m, tp = self.model, self.tp
        self.q_local = m.heads * m.head_dim // tp
        self.kv_local = kv_heads_per_device(m, tp) * m.head_dim
        self.activation_bytes = 2  # bf16 activations, also under FP8 GEMMs
        self.kv_token_bytes = 2 * self.kv_local * DTYPE_BYTES[self.kv_dtype]  # one layer's K and V of a token

    # -- the terms -------------------------------------------------------------------------------------
    def _block_gemms(self, tokens: int) -> float:
        """One block's GEMMs for `tokens` rows (QKV, output, gate+up, down; MoE: the experts hit)."""
        m, d, tp, fp8, stream = self.model, self.device, self.tp, self.dtype == "fp8", self.stream
        h = m.hidden
        up = 2 if m.mlp == "swiglu" else 1
        # fivefold's blocks hold q, k, v and gate, up as separate Linears (models/transformer.py): a call each.
        seconds = skinny_gemm_time(d, tokens, self.q_local + 2 * self.kv_local, h, fp8=fp8, stream=stream, matrices=3)
        seconds += skinny_gemm_time(d, tokens, h, self.q_local, fp8=fp8, stream=stream)
        if m.is_moe:
            # Experts on this rank (ep splits them, else tp splits each); each hit expert reads its weights.
            local = m.experts // self.ep
            width = m.expert_ffn_hidden // (1 if self.ep > 1 else tp)
            routed = tokens * m.top_k / self.ep
            hit = max(1, min(local, round(routed)))
            rows = max(1, round(routed / hit))
            seconds += skinny_gemm_time(d, rows, up * width, h, batch=hit, fp8=fp8, stream=stream, matrices=up)
            seconds += skinny_gemm_time(d, rows, h, width, batch=hit, fp8=fp8, stream=stream)
            seconds += skinny_gemm_time(d, tokens, m.experts, h, stream=stream)  # router
            if m.shared_experts:
                shared = m.shared_experts * m.expert_ffn_hidden // tp
                seconds += (skinny_gemm_time(d, tokens, up * shared, h, fp8=fp8, stream=stream, matrices=up)
                            + skinny_gemm_time(d, tokens, h, shared, fp8=fp8, stream=stream))
        else:
            ffn = m.ffn_hidden // tp
            seconds += (skinny_gemm_time(d, tokens, up * ffn, h, fp8=fp8, stream=stream, matrices=up)
                        + skinny_gemm_time(d, tokens, h, ffn, fp8=fp8, stream=stream))
        return seconds

    def _linear(self, tokens: int) -> tuple[float, float, float]:
        """(gemm, tp all-reduces, element-wise + head) seconds of the busiest stage for `tokens` rows; cached
        by token count (the simulator asks for the same counts over and over)."""
        cached = self._linear_cache.get(tokens)
        if cached is not None:
            return cached
        m, d = self.model, self.device
        message = tokens * m.hidden * self.activation_bytes
        gemm = self.layers * self._block_gemms(tokens)
        comm = self.layers * 2 * tp_all_reduce_time(message, self.tp_link)
        other = self.layers * elementwise_time(d, tokens * m.hidden * ELEMENTWISE_BYTES_PER_HIDDEN,
                                               ELEMENTWISE_KERNELS)
        result = (gemm, comm, other)
        if len(self._linear_cache) < 65536:
            self._linear_cache[tokens] = result
        return result

    def head_s(self, samples: int) -> float:
        """LM head over the rows that sample a token (last stage; counted on the busiest stage's time)."""
        if samples <= 0:
            return 0.0
        cached = self._head_cache.get(samples)
        if cached is None:
            # Vocab-parallel logits: gathering samples x vocab / tp floats is small next to the GEMM; not counted.
            cached = skinny_gemm_time(self.device, samples, self.model.vocab // self.tp, self.model.hidden,
                                      stream=self.stream)
            if len(self._head_cache) < 65536:
                self._head_cache[samples] = cached
        return cached

    def decode_attention_s(self, kv_tokens: int, requests: int) -> float:
        """Decoding requests read their KV cache (all `kv_tokens` of them) once per layer of the stage."""
        if requests <= 0:
            return 0.0
        if self.stream is not None:  # a profiled CPU engine: one gather of the blocks per layer (module docstring)
            return self.layers * self.stream.seconds(kv_tokens * self.kv_token_bytes)
        return self.layers * elementwise_time(self.device, kv_tokens * self.kv_token_bytes / PAGED_ATTENTION_EFFICIENCY,
                                              1)

    def prefill_attention_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """FlashAttention forward of prefill chunks, each (start, length): queries attend to start + length keys."""
        m, seconds, cache = self.model, 0.0, self._attention_cache
        heads = self.q_local // m.head_dim
        for chunk in chunks:
            one = cache.get(chunk)
            if one is None:
                start, length = chunk
                one = flash_attention_time(self.device, heads, length, start + length, m.head_dim, causal=True,
                                           backward=False)
                if len(cache) < 65536:
                    cache[chunk] = one
            seconds += one
        return self.layers * seconds

    def step(self, tokens: int, decode_requests: int, decode_kv_tokens: int,
             prefill_chunks: Sequence[tuple[int, int]] = (), samples: int | None = None) -> StepCost:
        """One step: `tokens` rows in all; `decode_requests` of them decode with `decode_kv_tokens` cached in all;
        `prefill_chunks` (start, length) are the prefill parts; `samples` rows sample (default: the decodes)."""
        if tokens <= 0:
            return StepCost(stages=self.pp)
        gemm, comm, other = self._linear(tokens)
        samples = decode_requests if samples is None else samples
        other += self.head_s(samples)
        attention = self.decode_attention_s(decode_kv_tokens, decode_requests)
        attention += self.prefill_attention_s(prefill_chunks)
        send = p2p_time(tokens * self.model.hidden * self.activation_bytes, self.pp_link) if self.pp > 1 else 0.0
        engine = self.engine_host
        if engine is not None and self.pp > 1:  # the next stage's inbox and wake-up (module docstring)
            send += engine.serve_worker_step
        requests = decode_requests + len(prefill_chunks)
        if engine is None:
            host = self.host_s + self.host_per_request_s * requests
            return StepCost(gemm, attention, comm, other, send, host, self.pp)
        host = engine.serve_step + engine.serve_request * requests + (engine.serve_worker_step if self.on_workers
                                                                         else 0.0)
        groups = (1 if decode_requests else 0) + len(prefill_chunks)  # serve/batch.py: attention calls per layer
        stage_host = self.layers * (engine.serve_layer + engine.serve_attention_group * max(0, groups - 1))
        return StepCost(gemm, attention, comm, other, send, host, self.pp, stage_host)

    @property
    def wake_s(self) -> float:
        """What the first step after the engine slept costs more (a profiled engine's serve_wake; else 0: GPU
        engines on the development set busy-poll)."""
        return self.engine_host.serve_wake if self.engine_host is not None else 0.0

    # -- what the planner reports -----------------------------------------------------------------------
    @property
    def weight_bytes(self) -> float:
        """Weights on the busiest device: its stage's blocks / tp, plus the embedding or head (first/last stage)."""
        m = self.model
        per_param = 1 if self.dtype == "fp8" else DTYPE_BYTES[self.dtype]
        blocks = m.layer_params_total() / m.layers * self.layers / self.tp
        ends = max(m.embedding_params(), m.head_params()) / self.tp if self.pp > 1 else (
            m.embedding_params() + m.head_params()) / self.tp
        return (blocks + ends) * per_param

    @property
    def crossover_batch(self) -> float:
        """Tokens per step where the block GEMMs turn from memory-bound (weights) to compute-bound (Pope et
        al. 2022): gemm rate x bytes per weight / (2 FLOPs per weight x achievable bandwidth)."""
        d = self.device
        rate = d.fp8_gemm_peak if self.dtype == "fp8" and d.fp8_gemm_peak else d.gemm_peak
        per_param = 1 if self.dtype == "fp8" else DTYPE_BYTES[self.dtype]
        return rate * per_param / (2 * d.bandwidth)
