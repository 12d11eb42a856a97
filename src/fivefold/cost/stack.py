"""SoftwareStack: what the training software does that a Plan does not say.

The same plan runs at different speeds under different software: fused attention or not, gradient
reduction overlapped with backward or not, how much CPU time each kernel launch costs. These are
properties of the framework version, never of one measurement, so they live here as named presets.
`data_parallel_sync(stack, zero, pp)` turns a stack and a plan's ZeRO level into the concrete
collective schedule that both the estimate (cost/dataparallel.py) and the simulator (sim/) follow.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fivefold.cost.cache import IdentityCache
from fivefold.cost.moe import moe_share
from fivefold.errors import SpecError
from fivefold.spec.model import ModelSpec
from fivefold.spec.units import GIB

ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")


@dataclass(frozen=True)
class Features:
    """What a stack can run: the planner proposes nothing else, and `estimate` says when a plan asks more."""

    parallelisms: tuple[str, ...] = ("dp", "tp", "pp", "cp", "ep")
    schedules: tuple[str, ...] = ALL_SCHEDULES
    zero_levels: tuple[int, ...] = (0, 1, 2, 3)
    cp_methods: tuple[str, ...] = ("allgather", "ulysses")  # K/V all-gather (Llama 3), heads (Ulysses)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    fp8: bool = False  # FP8 GEMMs (Transformer Engine, torchao Float8)
    fp8_all_gather: bool = False  # ZeRO-3 / FSDP gathers the weights already cast to FP8
    fp8_recipes: tuple[str, ...] = ()  # the FP8 scaling recipes it runs (cost/fp8.py FP8_RECIPES); () = any
    gradient_accumulation: bool = True  # several micro-batches per replica without a pipeline
    moe_folding: bool = True  # MoE parallel folding: ep over tp x cp x dp (may span tp) and expert tensor parallel
    # Embedding, head and loss over the pp ranks (cost/vocab.py): not upstream in Megatron-Core nor TorchTitan.
    vocab_parallel: bool = False
    empty_end_stages: bool = True  # a first (last) stage of the embedding (head) alone: Megatron-Core's layout "E|..|L"
    built_on: str = ""  # the pieces, for `estimate --help`

    def describe(self) -> str:
        parts = [f"parallel {'/'.join(self.parallelisms)}", f"schedules {', '.join(self.schedules)}",
                 *([] if self.gradient_accumulation else ["no gradient accumulation without pp"]),
                 f"ZeRO {'/'.join(map(str, self.zero_levels))}",
                 *(["MoE folding (ep over tp x cp x dp, etp)"] if self.moe_folding and "ep" in self.parallelisms else []),
                 *(["vocabulary parallel"] if self.vocab_parallel else []),
                 f"CP {'/'.join(self.cp_methods)}" if "cp" in self.parallelisms else "no CP",
                 f"recompute {'/'.join(self.recompute)}",
                 ("FP8" + (f" {'/'.join(self.fp8_recipes)}" if self.fp8_recipes else "")
                  + (" (FP8 all-gather)" if self.fp8_all_gather else "")) if self.fp8 else "no FP8"]
        return "; ".join(parts) + (f" [{self.built_on}]" if self.built_on else "")


@dataclass(frozen=True)
class SoftwareStack:
    """Framework behaviour; the defaults describe current Megatron-Core / TorchTitan practice."""

    name: str = "modern"  # label for reports
    attention: str = "flash"  # "flash": fused kernel, no s x s scores kept; "unfused": scores materialized
    dropout: bool | None = None  # dropout after attention/residual branches; None: GPT-style (learned) yes
    overlap_grad_reduce: bool = True  # data-parallel gradient reduction runs in buckets during backward
    overlap_param_gather: bool = True  # ZeRO parameter all-gathers are prefetched under compute
    async_p2p: bool = True  # pipeline sends overlap compute in steady state (only fill/drain pay them)
    host_seconds_per_kernel: float = 8e-6  # CPU time to issue one kernel (Python, dispatcher, launch)
    host_serialization: float = 0.0  # share of min(CPU, GPU) time of a pass that does not overlap
    overlap_tp_backward: bool = True  # TP all-reduce of input gradients overlaps the weight-gradient GEMM
    overlap_tp_comm: bool = False  # every TP collective pipelined with its GEMMs (TE userbuffers, async TP)
    grad_reduce_bytes: int = 0  # bytes per gradient element on the wire; 0: 2 for fp16, 4 otherwise
    reserved_bytes: float = 1.0 * GIB  # CUDA context, cuBLAS and NCCL workspaces, allocator slack
    pipeline_defers_grad_sync: bool = False  # pp > 1: gradients reduced once, after a stage's last backward,
    #                                          while the rank waits; shards stay gathered after backward
    zero2_reshards_after_backward: bool = False  # ZeRO-2 frees gathered weights after every backward
    eager_host_costs: bool = False  # ops dispatched one by one from Python: with a profile's measured host
    #                                 costs (CPU), each pass costs eager_ops x seconds per op (step.py)
    collective_per_module: bool = False  # FSDP2 / replicate gather and reduce each wrapped module (each block
    #                                      and stage model) in its own collective, not in large buckets
    selective_saves_ops: bool = False  # selective recompute is op-level (TorchTitan's SAC): matmul and attention
    #                                    outputs kept (every other matmul's only), the element-wise ops redone;
    #                                    False: Korthikanti's, which redoes only the attention core
    loss_fp32_copies: int = 1  # fp32 tensors of the logits' size the loss holds: 1 for Megatron's fused
    #                            vocab-parallel cross-entropy, 2 for upcast + log-softmax (plain cross_entropy)
    optimizer_temporary_bytes: float = 0.0  # bytes per optimizer element the step allocates besides its states
    #                                        (torch's foreach AdamW: 4, one fp32 list; fused Adam kernels: 0)
    allocator_slack: float = 0.0  # caching-allocator reserve beyond what is allocated (block rounding and
    #                               fragmentation), a share of the activations and working memory that churn
    selective_saves_every_matmul: bool = False  # op-level selective recompute that keeps every matmul output and
    #                                            the TP collectives' outputs (fivefold's runtime/parallelize.py)
    tp_gathers_logits: bool = False  # the LM head's output is all-gathered over tp and the loss runs on the whole
    #                                  vocabulary on every tp rank (fivefold); False: a vocabulary shard each
    vocab_parallel_over_tp: bool = True  # vocabulary parallelism cuts the rows pp x tp ways (False: pp ways,
    #                                       each tp rank running its own tokens: runtime/vocab_parallel.py)
    pipeline_returns_outputs: bool = True  # the schedule is asked for the merged logits (fivefold passes
    #                                        return_outputs=False, so torch keeps no logits between micro-batches)
    pipeline_keeps_outputs: bool = False  # pp > 1, torch.distributed.pipelining: the schedule keeps every
    #                                      micro-batch's last-stage output (the logits) to return them merged, and
    #                                      each stage holds a receive buffer per micro-batch for its input and for
    #                                      its output's gradient, allocated once and kept
    logits_fp32_output: bool = False  # the model returns its logits upcast to fp32 (TorchTitan's Llama ends in
    #                                   `self.output(h).float()`): the output torch pipelining keeps is that tensor
    sdpa_flash2: bool = False  # attention through PyTorch SDPA's FlashAttention-2 (slower on Hopper than the
    #                            FA3 / cuDNN kernels Transformer Engine uses)
    unfused_cross_entropy: bool = False  # Megatron's vocab_parallel_cross_entropy (no --cross-entropy-loss-fusion):
    #                                    torch ops that each pass over the fp32 logits (layer.head_cost)
    loss_parallel_fp32_copies: int = 0  # with tp > 1, extra fp32 logit-sized tensors of DTensor's loss parallel
    #                                    (its log-softmax materializes x - max and exp(x - max))
    fused_elementwise: bool = True  # norms, RoPE, SwiGLU run as fused kernels (TE, Megatron, torch.compile);
    #                                 False: eager PyTorch ops, each reading and writing memory (eager_ops traffic)
    compiled_blocks: bool = False  # torch.compile per transformer block (`fivefold train --compile`): on a
    #                                profiled CPU a block dispatches COMPILED_BLOCK_OPS instead of its eager ops,
    #                                and its element-wise ops are fused (no unfused traffic)
    cp_repeats_kv: bool = False  # the model repeats K/V to every query head before attention (TorchTitan's
    #                              Llama: repeat_kv, then F.scaled_dot_product_attention): CP moves heads-wide K/V
    cp_ring_backward: bool = False  # torch's experimental CP (late 2024): the backward gathers K/V again and passes
    #                                 dK/dV around the ring in fp32, one hop per ring step (cost/context.py)
    moe_splits_tokens_over_tp: bool = False  # each tp rank routes its own tokens / tp even without SP (the
    #                                          output all-gathered over tp then), the etp group gathers the
    #                                          dispatched copies; router and shared-expert gradients summed over
    #                                          tp (runtime/expert_folding.py; cost/moe_block.py)
    moe_dispatch_syncs_host: bool = True  # MoE dispatch copies token counts to the host first (cost/moe_block.py)
    grouped_gemm_streams: int = 0  # MoE experts: 0, one grouped GEMM launch; k, a GEMM per expert, k streams (TE's
    #                                GroupedLinear: 4; fivefold's GroupedExperts, a Python loop over experts: 1)
    expert_gate_separate: bool = False  # SwiGLU experts launch gate and up as two GEMMs (fivefold's GroupedExperts)
    grouped_mm_experts: str = "never"  # fivefold's GroupedExperts (models/moe.py, --expert-gemm): "gpu", one
    #                                  torch._grouped_mm per projection on GPUs whose torch runs it (sm90+, bf16)
    #                                  and grouped_gemm_streams' loop elsewhere; "always"; "never" (the loop)
    fp8_experts: bool = True  # under FP8 training the routed experts' GEMMs run in FP8 too (fivefold: BF16)
    fp8_recipe: str = "tensorwise"  # FP8 scaling: tensorwise | rowwise (torchao), current | delayed | blockwise (TE)
    moe_dispatch_per_node: bool = False  # DeepEP: one network copy of a token per destination node, forwarded
    #                                      over NVLink to its experts there (cost/moe_block.py dispatch_time)
    moe_drops_tokens: bool = False  # MoE tokens over the experts' capacity are dropped, without padding (Megatron-
    #                                 Core's --moe-expert-capacity-factor): the capacity mask in the router and the
    #                                 host sync before the first permutation (cost/moe_block.py)
    moe_sequence_dispatch: bool = False  # Megatron-Core 0.8-0.9's all-to-all dispatcher (`alltoall_seq` later):
    #                                      with tp > 1 and experts at the attention's tp, every tp rank routes and
    #                                      dispatches the whole sequence on its hidden slice (cost/moe_block.py
    #                                      sequence_dispatch_copies / _exchanges)
    features: Features = Features()  # what the software can run at all

    def uses_dropout(self, model: ModelSpec) -> bool:
        # GPT recipes (Megatron, GPT-2/3) train with dropout 0.1; Llama-style recipes use none.
        return self.dropout if self.dropout is not None else model.position == "learned"

    def gradient_bytes(self, dtype: str) -> int:
        # Megatron reduces fp16 gradients in fp16 and accumulates/reduces bf16 ones in fp32.
        if self.grad_reduce_bytes:
            return self.grad_reduce_bytes
        return 2 if dtype == "fp16" else 4


STACKS: dict[str, SoftwareStack] = {
    # Everything current software offers somewhere (no single framework): no measured rows (UNMEASURED_BAND).
    "modern": SoftwareStack(features=Features(fp8=True, fp8_all_gather=True, vocab_parallel=True,
                                              built_on="any framework; no rows")),
    # Megatron-Core with Transformer Engine as NVIDIA benchmarks it: TP communication overlapped with GEMMs,
    # distributed optimizer with overlapped gradient reduce and parameter gather. 13.5 us per op: one PyTorch
    # Linear forward issued from Python on a DGX H100 (TransformerEngine issue #2053); experts as TE's
    # GroupedLinear, a cuBLAS GEMM per expert on TE's 4 compute streams (multi_stream.cpp); FP8 with delayed
    # scaling, TransformerConfig.fp8_recipe's default (Megatron-LM d98e8a6).
    "megatron-core": SoftwareStack(
        name="megatron-core", overlap_tp_comm=True, unfused_cross_entropy=True, host_seconds_per_kernel=13.5e-6,
        grouped_gemm_streams=4, fp8_recipe="delayed",
        features=Features(schedules=("1f1b", "interleaved-1f1b"), zero_levels=(0, 1, 3),
                          cp_methods=("allgather", "ulysses"), fp8=True,
                          built_on="Megatron-Core + Transformer Engine, distributed optimizer, Megatron-FSDP "
                                   "(ZeRO-3), MoE parallel folding")),
    # Megatron-LM of 2021-22 (the vTrain measurements): no FlashAttention (scores materialized, fused
    # scale-mask-softmax), the "local" DDP all-reduces gradients after backward, blocking pipeline p2p,
    # and a Python-heavy layer with tensor-parallel RNG tracking and activation-checkpoint wrappers.
    "megatron-lm-2022": SoftwareStack(name="megatron-lm-2022", attention="unfused", overlap_grad_reduce=False,
                                      overlap_param_gather=False, async_p2p=False,
                                      host_seconds_per_kernel=50e-6, host_serialization=0.1,
                                      unfused_cross_entropy=True,
                                      features=Features(parallelisms=("dp", "tp", "pp"), empty_end_stages=False,
                                                        schedules=("1f1b", "interleaved-1f1b"),
                                                        zero_levels=(0, 1), cp_methods=(), fp8=False,
                                                        built_on="Megatron-LM 2022: local DDP, no CP/MoE/FP8")),
    # fivefold's own runtime (runtime/parallelize.py, runtime/pipeline.py) on torch 2.13: SDPA (flash)
    # attention, no dropout in its models, DTensor TP whose input-gradient all-reduce is issued after the
    # whole matmul backward (no overlap with the weight gradient), FSDP2 / replicate with fp32 gradient
    # reduction. Without pp, FSDP2 reduces bucket by bucket under backward and prefetches gathers; ZeRO-2
    # (fully_shard, reshard_after_forward=False) frees its gathered weights after each backward. With
    # pp > 1, torch.distributed.pipelining's PipelineStage turns gradient sync and resharding after
    # backward off for every backward and runs REDUCE_GRAD once after the stage's last backward, and
    # the compute stream waits for it. Kernel-launch overhead is the default, not measured here; on a
    # profiled CPU the measured host costs of its eager ops, FSDP2 hooks and AdamW replace it (step.py).
    # Its memory terms as `fivefold dryrun` measured them (docs/validation.md, dry run): selective recompute
    # keeps every matmul and collective output; the plain cross-entropy holds the fp32 log-softmax, its
    # gradient and the input gradient at once (3 copies); no logits kept between micro-batches. On GPUs its
    # kernels are TorchTitan's eager ones (the same FSDP2 / DTensor / SDPA blocks without torch.compile): the
    # unfused element-wise traffic of eager_ops and SDPA's FlashAttention-2, the two terms that reproduce
    # TorchTitan's eager rows (Llama 3.1 8B, compile off: +0% and +4%, docs/validation.md); `--compile` fuses.
    # Experts as models/moe.py runs them: one torch._grouped_mm per projection on sm90+ GPUs in bf16, elsewhere a
    # GEMM per expert, one after the other (cost/moe_block.py). FP8 training as runtime/float8.py runs it:
    # torch._scaled_mm with tensorwise or rowwise scaling on the block linears, weights gathered in BF16, experts
    # in BF16.
    "fivefold": SoftwareStack(name="fivefold", dropout=False, overlap_tp_backward=False, grad_reduce_bytes=4,
                              fused_elementwise=False, sdpa_flash2=True, pipeline_keeps_outputs=True,
                              optimizer_temporary_bytes=4.0, selective_saves_ops=True,
                              selective_saves_every_matmul=True, loss_fp32_copies=3,
                              pipeline_returns_outputs=False, tp_gathers_logits=True, moe_splits_tokens_over_tp=True,
                              vocab_parallel_over_tp=False,
                              grouped_gemm_streams=1, expert_gate_separate=True, pipeline_defers_grad_sync=True,
                              grouped_mm_experts="gpu", fp8_experts=False,
                              zero2_reshards_after_backward=True, eager_host_costs=True, features=Features(
                                  vocab_parallel=True,  # runtime: --vocab-parallel (issue 26)
                                  fp8=True, fp8_recipes=("tensorwise", "rowwise"),  # runtime/float8.py
                                  built_on="FSDP2, DTensor TP, torch.distributed.pipelining, own CP, MoE folding, "
                                           "vocabulary parallel, eager")),
    # TorchTitan as benchmarked at the end of 2024 (benchmarks/llama3_h100_202412_torchtitan.md; its
    # schedules: GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble (zb-h1 here); no ZBV yet, and no
    # gradient accumulation without a pipeline): FSDP2 (ZeRO-3, or ZeRO-2 with
    # reshard_after_forward=False; DDP for ZeRO-0), DTensor TP with sequence parallel and async TP
    # (collectives pipelined with the GEMMs), torch.distributed.pipelining schedules, context parallel
    # (K/V all-gather), torchao Float8 with FP8 all-gather under FSDP2, torch.compile per block. Gradients
    # reduced in fp32 (bf16 params, fp32 reduce under MixedPrecisionPolicy).
    "torchtitan": SoftwareStack(name="torchtitan", dropout=False, grad_reduce_bytes=4, overlap_tp_comm=True,
                                pipeline_defers_grad_sync=True, zero2_reshards_after_backward=True,
                                selective_saves_ops=True, loss_fp32_copies=2, loss_parallel_fp32_copies=1,
                                pipeline_keeps_outputs=True, optimizer_temporary_bytes=4.0,
                                logits_fp32_output=True, sdpa_flash2=True, allocator_slack=0.25,
                                cp_repeats_kv=True, cp_ring_backward=True,
                                features=Features(parallelisms=("dp", "tp", "pp", "cp"), zero_levels=(0, 2, 3),
                                                  schedules=("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"),
                                                  gradient_accumulation=False, empty_end_stages=False,
                                                  cp_methods=("allgather",), fp8=True, fp8_all_gather=True,
                                                  built_on="FSDP2, DTensor TP, async TP, torch pipelining, "
                                                           "Float8 (torchao), torch.compile")),
}
# The same runtime on CPU ranks (a profile with host costs selects it, see on_host_profiled_cpu): the CPU
# that computes is the one that issues, so nothing runs ahead and FSDP2's gathers and reductions do not
# hide under compute (gloo runs them on the same busy cores); each wrapped module's collective pays gloo's
# latency. On GPUs the bucketed form is kept, so GPU predictions do not depend on it.
STACKS["fivefold-cpu"] = replace(STACKS["fivefold"], name="fivefold-cpu", overlap_grad_reduce=False,
                                 overlap_param_gather=False, collective_per_module=True)


# What `plan`, `estimate`, `simulate` and the Python API assume without --stack: what `fivefold train` runs.
DEFAULT_STACK = "fivefold"


def on_host_profiled_cpu(stack: SoftwareStack) -> SoftwareStack:
    """The stack's CPU variant (`NAME-cpu`), used when the ranks are CPUs profiled with host costs."""
    if not stack.eager_host_costs or f"{stack.name}-cpu" not in STACKS:
        return stack
    return replace(STACKS[f"{stack.name}-cpu"], compiled_blocks=stack.compiled_blocks,
                   fused_elementwise=stack.fused_elementwise)


def with_expert_gemm(stack: SoftwareStack, ran: str | None) -> SoftwareStack:
    """`stack` with its MoE experts run as a run ran them ("grouped" or "loop"; None: as the stack says)."""
    if ran is None or stack.grouped_mm_experts == "never" and ran == "loop":
        return stack
    return replace(stack, grouped_mm_experts="always" if ran == "grouped" else "never")


def with_compile(stack: SoftwareStack, compiled: bool = True) -> SoftwareStack:
    """`stack` running with torch.compile per transformer block (`fivefold train --compile`) or without."""
    return replace(stack, compiled_blocks=compiled, fused_elementwise=True) if compiled else stack


@dataclass(frozen=True)
class TensorParallelCollectives:
    """Collectives the runtime's tensor parallelism issues per micro-batch (counted on torch 2.13: DTensor
    does not merge the input-gradient all-reduces of wq, wk, wv and of w1, w3 without sequence parallelism)."""

    layer_forward: float  # an average block for a model mixing dense and MoE layers
    layer_backward: float
    embedding_forward: int
    embedding_backward: int
    head_forward: int  # with the logits gathered whole for the loss
    head_backward: int


def tensor_parallel_collectives(sequence_parallel: bool, model: ModelSpec) -> TensorParallelCollectives:
    """SP: all-gather before and reduce-scatter after attention and the dense MLP, both ways; else one
    all-reduce after each forward, and the input gradients' all-reduces (3 attention, 2 MLP). An MoE block
    instead routes this rank's tokens (runtime/expert_folding.py): no SP, one all-gather of its output forward
    and of its input's gradient backward; then one gradient all-reduce per router and shared-expert weight."""
    share = moe_share(model)
    shared = (3 if model.mlp == "swiglu" else 2) if model.shared_experts else 0
    mlp, moe = ((2, 2), (0, 1 + shared)) if sequence_parallel else ((1, 2), (1, 2 + shared))
    attention = (2, 2) if sequence_parallel else (1, 3)
    forward, backward = (attention[i] + (1 - share) * mlp[i] + share * moe[i] for i in (0, 1))
    return TensorParallelCollectives(forward, backward, 1, 1 if sequence_parallel else 0, 2 if sequence_parallel
                                     else 1, 1)


def stack_named(name: str) -> SoftwareStack:
    if name not in STACKS:
        raise SpecError("--stack", name, f"unknown software stack; known: {', '.join(STACKS)}")
    return STACKS[name]


def stack_help() -> str:
    """One line per user-facing stack: its name and what it can run (for `--help`)."""
    return "; ".join(f"{name}: {stack.features.describe()}" for name, stack in STACKS.items()
                     if not name.endswith("-cpu"))


def unsupported_features(stack: SoftwareStack, plan: object) -> list[str]:
    """What a plan (or Layout) asks that the stack cannot run, one phrase each; empty when it can."""
    features, out = stack.features, []
    for dim in ("tp", "pp", "cp", "ep"):
        if getattr(plan, dim, 1) > 1 and dim not in features.parallelisms:
            out.append(f"{dim} > 1")
    if getattr(plan, "pp", 1) > 1 and plan.schedule not in features.schedules:  # type: ignore[attr-defined]
        out.append(f"schedule {plan.schedule}")  # type: ignore[attr-defined]
    if plan.zero not in features.zero_levels and plan.dp * getattr(plan, "cp", 1) > 1:  # type: ignore[attr-defined]
        out.append(f"ZeRO-{plan.zero}")  # type: ignore[attr-defined]
    if plan.recompute not in features.recompute:  # type: ignore[attr-defined]
        out.append(f"recompute {plan.recompute}")  # type: ignore[attr-defined]
    method = getattr(plan, "cp_method", None)
    if getattr(plan, "cp", 1) > 1 and "cp" in features.parallelisms and method and method not in features.cp_methods:
        out.append(f"CP method {method}")
    if plan.train.dtype == "fp8" and not features.fp8:  # type: ignore[attr-defined]
        out.append("FP8")
    elif plan.train.dtype == "fp8" and features.fp8_recipes and stack.fp8_recipe not in features.fp8_recipes:  # type: ignore[attr-defined]
        out.append(f"FP8 recipe {stack.fp8_recipe}")
    ep, etp = getattr(plan, "ep", 1), getattr(plan, "etp", 1)
    if not features.moe_folding and "ep" in features.parallelisms and (
            etp > 1 or (plan.dp * plan.cp) % ep):  # type: ignore[attr-defined]
        out.append("MoE folding (etp > 1 or ep spanning tp)")
    if getattr(plan, "vocab_parallel", False) and getattr(plan, "pp", 1) > 1 and not features.vocab_parallel:
        out.append("vocabulary parallelism")
    return out


@dataclass(frozen=True)
class DataParallelSync:
    """Which data-parallel collectives a step runs, when, and what waits for them (FSDP2's own terms)."""

    reduce_every_micro_batch: bool  # gradients reduced after every micro-batch's backward (else once)
    reduce_overlapped: bool  # bucket by bucket during the weight-gradient pass; else after it, rank waits
    gathers_weights: bool  # ZeRO >= 1: updated weights are all-gathered (once per step unless resharded)
    reshard_after_forward: bool  # weights freed after a forward: the next pass gathers them again
    reshard_after_backward: bool  # weights freed after a backward: the next forward gathers them again
    gather_overlapped: bool  # layer by layer ahead of compute; else the pass waits for its whole gather
    grads_sharded: bool  # gradient memory is 1/N (ZeRO-2/3 reduce-scatter as they go)
    keeps_gathered: bool  # ZeRO-3 weights stay gathered from a backward to the next forward (memory: all)

    @property
    def gathers_once(self) -> bool:
        return self.gathers_weights and not (self.reshard_after_forward or self.reshard_after_backward)


def data_parallel_sync(stack: SoftwareStack, zero: int, pp: int) -> DataParallelSync:
    """The collective schedule of one ZeRO level under one stack.

    ZeRO-0 all-reduces gradients once per step; ZeRO-1 reduce-scatters them once and all-gathers the
    updated weights once; ZeRO-2 reduce-scatters every micro-batch; ZeRO-3 also frees the weights after
    every pass and gathers them again (FSDP). A stack with `pipeline_defers_grad_sync` under pp > 1
    reduces once per step at every level, blocking, and keeps weights gathered from a backward until the
    next forward."""
    cached = _SYNC.get(stack, (zero, pp > 1))
    if isinstance(cached, DataParallelSync):
        return cached
    defer = stack.pipeline_defers_grad_sync and pp > 1
    after_backward = not defer and (zero == 3 or (zero == 2 and stack.zero2_reshards_after_backward))
    sync = DataParallelSync(
        reduce_every_micro_batch=zero >= 2 and not defer, reduce_overlapped=stack.overlap_grad_reduce and not defer,
        gathers_weights=zero >= 1, reshard_after_forward=zero == 3, reshard_after_backward=after_backward,
        gather_overlapped=stack.overlap_param_gather, grads_sharded=zero >= 2 and not defer,
        keeps_gathered=zero == 3 and defer)
    return _SYNC.put(stack, (zero, pp > 1), sync)


_SYNC: IdentityCache[DataParallelSync] = IdentityCache(4096)  # the planner asks ~10^5 times
