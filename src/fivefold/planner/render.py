"""Terminal output of `fivefold estimate` and `fivefold plan` (rich tables; imported by the CLI only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fivefold.spec.units import GIB

if TYPE_CHECKING:
    from fivefold.cost.results import Estimate
    from fivefold.planner.candidates import SearchResult
    from fivefold.spec import ClusterSpec, ModelSpec, Plan, TrainSpec

BREAKDOWN_LABELS = {
    "compute": "compute (GEMMs, attention, element-wise)", "recompute": "activation recompute",
    "tp_comm": "tensor-parallel communication", "cp_comm": "context-parallel communication",
    "ep_comm": "expert-parallel all-to-all", "host_overhead": "waiting on kernel launches (CPU)",
    "vocab_comm": "vocabulary-parallel collectives (pp group)",
    "pp_comm": "pipeline transfers (fill/drain)", "bubble": "pipeline bubble",
    "dp_comm": "data-parallel / ZeRO communication (exposed)", "optimizer": "optimizer step",
    "moe_router": "MoE router (GEMM, fp32 softmax / top-k)", "moe_permute": "MoE token permute / unpermute",
    "moe_experts": "MoE expert GEMMs (grouped, per-expert tokens)", "moe_shared_experts": "MoE shared experts",
    "moe_host_sync": "MoE host sync on token counts",
}


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e6:.2f}M" if tokens_per_s >= 1e6 else f"{tokens_per_s:,.0f}"


def estimate_renderables(estimate: Estimate, title: str) -> list:
    """Summary, time breakdown, memory and (with a pipeline) per-stage tables."""
    from rich.table import Table

    summary = Table(title=title, show_header=False, title_justify="left")
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    band = f"+-{estimate.error_band:.0%}" if estimate.error_band is not None else "unknown (no measured rows)"
    summary.add_row("step time", f"{_time(estimate.step_time_s)}  (expected error {band}, {estimate.stack} stack)")
    summary.add_row("tokens/s", f"{_rate(estimate.tokens_per_s)}  ({_rate(estimate.tokens_per_s / estimate.world_size)}"
                    " per GPU)")
    summary.add_row("model TFLOP/s per GPU", f"{estimate.model_tflops_per_gpu:.1f}  (with recompute "
                    f"{estimate.hardware_tflops_per_gpu:.1f})")
    summary.add_row("MFU", f"{estimate.mfu:.1%}" + (f"  (of the {estimate.mfu_basis})" if estimate.mfu_basis else ""))
    summary.add_row("pipeline bubble", f"{estimate.bubble_fraction:.1%} of the step")
    verdict = "[green]fits[/green]" if estimate.fits else "[red]does NOT fit[/red]"
    summary.add_row("memory per GPU", f"{estimate.memory.total / GIB:.1f} GiB of {estimate.capacity_bytes / GIB:.1f}"
                    f" GiB on pipeline stage {estimate.peak_pp_rank}: {verdict}")

    breakdown = Table(title="where the step time goes (slowest pipeline rank)", title_justify="left")
    breakdown.add_column("part")
    breakdown.add_column("time", justify="right")
    breakdown.add_column("share", justify="right")
    for key, seconds in estimate.breakdown_s.items():
        if seconds > 0:
            breakdown.add_row(BREAKDOWN_LABELS.get(key, key), _time(seconds), f"{seconds / estimate.step_time_s:.1%}")

    memory = Table(title=f"memory of the fullest GPU (pipeline stage {estimate.peak_pp_rank})", title_justify="left")
    memory.add_column("part")
    memory.add_column("GiB", justify="right")
    for key, value in estimate.memory.to_dict().items():
        memory.add_row(key, f"{value:.2f}")
    out: list = [summary, breakdown, memory]
    out.extend(f"note: {line}" for line in estimate.notes)
    if len(estimate.stage_costs) > 1:
        stages = Table(title="per stage, one micro-batch", title_justify="left")
        for column in ("stage", "rank", "layers", "forward", "backward (B)", "backward (W)", "send", "act. GiB",
                       "states GiB"):
            stages.add_column(column, justify="right")
        indexed = list(enumerate(estimate.stage_costs))
        shown = indexed if len(indexed) <= 16 else indexed[:8] + indexed[-8:]
        for index, stage in shown:
            stages.add_row(str(index), str(stage.pp_rank), str(stage.layers), _time(stage.forward),
                           _time(stage.backward_input), _time(stage.backward_weight), _time(stage.send_activation),
                           f"{stage.activation_bytes / GIB:.2f}", f"{stage.static_bytes / GIB:.2f}")
        out.append(stages)
    return out


def _work_split(plan) -> str:
    """Layers per stage and micro-batches per replica when uneven, e.g. "layers 11/11/30/28"."""
    parts = []
    if len(set(plan.layers_per_stage)) > 1:
        layers = plan.layers_per_stage
        parts.append("layers " + "/".join(map(str, layers if len(layers) <= 8 else layers[:4] + ("..",) + layers[-3:])))
    if len(set(plan.replica_micro_batches)) > 1:
        parts.append("micro-batches " + "/".join(map(str, plan.replica_micro_batches)))
    return ", ".join(parts) or "even"


def plan_renderables(result: SearchResult, title: str) -> list:
    """The ranked table of a search; on a mixed cluster with each plan's split of the work."""
    from rich.table import Table

    mixed = bool(result.placement)
    table = Table(title=title, title_justify="left")
    columns: list[tuple[str, Any]] = [("#", "right"), ("plan", "left")] + ([("work split", "left")] if mixed else []) + [
        ("tokens/s", "right"), ("per GPU", "right"), ("MFU", "right"), ("GiB/GPU", "right"), ("bubble", "right"),
        ("step", "right"), ("error", "right")]
    for column, justify in columns:
        table.add_column(column, justify=justify)
    for rank, candidate in enumerate(result.candidates, 1):
        e = candidate.estimate
        split = [_work_split(candidate.plan)] if mixed else []
        table.add_row(str(rank), candidate.plan.describe(), *split, _rate(e.tokens_per_s),
                      _rate(e.tokens_per_s / e.world_size), f"{e.mfu:.1%}", f"{e.memory.total / GIB:.1f}",
                      f"{e.bubble_fraction:.1%}", _time(e.step_time_s),
                      f"+-{e.error_band:.0%}" if e.error_band is not None else "?")
    out: list = [table]
    if result.candidates[0].estimate.mfu_basis:
        out.append(f"MFU is of the {result.candidates[0].estimate.mfu_basis}")
    out.extend(f"#1 note: {line}" for line in result.candidates[0].estimate.notes)
    simulated = [f"#{i} {c.simulated_step_time_s:.3f} s" for i, c in enumerate(result.candidates, 1)
                 if c.simulated_step_time_s is not None]
    if simulated:
        out.append(f"re-ranked the best {len(simulated)} by simulated step time: " + ", ".join(simulated))
    out.append(f"why #1: {result.explanation}")
    out.extend(f"#1 {line}" for line in result.placement)  # mixed clusters: which group holds what, and why
    if result.diloco is not None:
        out.append(result.diloco.line())
    out.append(f"searched {result.examined:,} candidate plans ({result.costed:,} costed in full) in "
               f"{result.seconds:.2f} s: {result.candidates_per_s:,.0f} candidates/s")
    return out


def plan_title(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, count: int) -> str:
    return (f"{model.name} on {cluster.label} ({cluster.world_size} GPUs), seq {train.seq_len}, "
            f"global batch {train.global_batch}, {train.dtype}: best {count} plans that fit")


def estimate_title(plan: Plan) -> str:
    return (f"{plan.model.name} on {plan.cluster.label}, seq {plan.train.seq_len}, global batch "
            f"{plan.train.global_batch}, {plan.train.dtype}: {plan.describe()}")


def diloco_lines(cost) -> list[str]:
    """`estimate --dp-sync diloco`: the outer exchange's bytes and exposure, the memory and the penalty."""
    spec = cost.spec
    return [f"DiLoCo, {spec.groups} outer groups, H={spec.sync_every}, {spec.fragments} fragment(s), overlap "
            f"{spec.overlap}, outer gradients in {spec.outer_dtype}:",
            f"  outer exchange: {cost.outer_bytes_per_rank / 1e6:,.1f} MB sent per rank per sync "
            f"({cost.outer_bytes_per_rank / spec.sync_every / 1e6:,.2f} MB per step; synchronous DP sends "
            f"{cost.sync_bytes_per_step / 1e6:,.1f} MB per step), {_time(cost.outer_exchange_s)} per full exchange",
            f"  step: {_time(cost.inner_step_s)} inner + {_time(cost.exposed_per_step_s)} exposed outer exchange = "
            f"{_time(cost.step_time_s)} (synchronous: {_time(cost.sync_step_time_s)})",
            f"  memory: +{cost.memory_bytes / GIB:.2f} GiB per GPU of outer weights and momentum "
            f"({'fits' if cost.fits else 'does NOT fit'})",
            f"  convergence penalty: loss {cost.loss_gap:+.2%} at equal tokens (Charles et al. 2025), "
            f"{(cost.token_factor - 1):+.1%} tokens to the same loss",
            f"  time to the same loss: {cost.time_to_loss_ratio:.2f}x synchronous DP's"]


def diloco_json(choice) -> dict | None:
    """`plan --json`'s "diloco": the DiLoCo setting the search weighed (planner/diloco.py), or null."""
    if choice is None:
        return None
    return {"recommended": choice.recommended, "flags": choice.flags(), "plan": choice.plan.describe(),
            **choice.cost.to_dict()}


def plan_json(result: SearchResult, model: str, cluster: str, out: str | None,
              dryruns: dict[int, dict] | None = None) -> dict:
    """`plan --json`: the ranked candidates (estimate without per-stage rows, simulated time when
    re-ranked, the dry run's verdict by id(plan) when checked, layout), why #1, the placement and the
    search's own numbers."""
    ranked = []
    for rank, candidate in enumerate(result.candidates, 1):
        entry = {k: v for k, v in candidate.estimate.to_dict().items() if k != "stages"}
        if candidate.simulated_step_time_s is not None:
            entry["simulated_step_time_s"] = candidate.simulated_step_time_s
        if dryruns and id(candidate.plan) in dryruns:
            entry["dryrun"] = dryruns[id(candidate.plan)]
        ranked.append({"rank": rank, **entry, "layout": candidate.plan.to_dict()["plan"]})
    return {"model": model, "cluster": cluster, "candidates": ranked, "explanation": result.explanation,
            "placement": result.placement, "diloco": diloco_json(result.diloco), "examined": result.examined, "costed": result.costed,
            "seconds": result.seconds, "candidates_per_s": result.candidates_per_s, "out": out}
