"""The development set as plans and residuals (shared by bench/validate_cost_model.py and the tests).

TorchTitan (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1-6): Llama 3.1 on 96 GB H100s at 500 W
(`H100-96GB`), predicted with the `torchtitan` stack, switched per row to what the row ran: eager or
torch.compile (`fused_elementwise`), async TP or not (`overlap_tp_comm`), Float8 (`--dtype fp8`). FSDP2 is
ZeRO-3. With pp a data-parallel rank's local batch is split into pp micro-batches: the benchmark ran
TorchTitan 9dec370 (its versions table), whose pipeline_llama.py builds the schedule with
`job_config.experimental.pipeline_parallel_microbatches or parallel_dims.pp` micro-batches (config help: "The
default value will be the number of pipeline stages, if unspecified"), and train_configs/llama3_405b.toml
sets no count. So Table 5 (local batch 32) runs 8 micro-batches of 4 sequences, Table 6 (local batch 8) 8 of
one; the throughput agrees (1F1B's (p-1)/m bubble is 7/8, not 7/32). Its memory column is the allocator's
peak reading, which the CUDA context (the stack's `reserved_bytes`) is not part of.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

from fivefold.cost import STACKS, estimate
from fivefold.cost.fp8 import with_fp8_recipe
from fivefold.errors import FivefoldError
from fivefold.spec import PRESETS, ModelSpec, Plan, TrainSpec, parse_cluster

GIB = 2**30
TITAN_MODELS = {"llama3.1-8b": "llama3-8b", "llama3.1-70b": "llama3-70b", "llama3.1-405b": "llama3-405b"}


def torchtitan_plan(row: dict) -> tuple[Plan, object]:
    """The plan and stack variant of one TorchTitan row."""
    gpus, tp, pp, cp, fsdp = (int(row[k]) for k in ("gpus", "tp", "pp", "cp", "fsdp"))
    seq = int(row["seq_len"])
    model = replace(PRESETS[TITAN_MODELS[row["model"]]], max_seq_len=seq)
    train = TrainSpec(seq_len=seq, global_batch=int(row["global_batch"]),
                      dtype="fp8" if row["float8"] == "yes" else "bf16")
    schedule = row["schedule"] or "1f1b"
    device = row.get("device") or "H100-96GB"  # the 2024 tables ran on Grand Teton's 96 GB H100s
    plan = Plan(model=model, cluster=parse_cluster(f"{max(1, gpus // 8)}x{min(8, gpus)}x{device}"), train=train,
                dp=fsdp, tp=tp, pp=pp, cp=cp, zero=3, micro_batch=int(row["local_batch"]) // pp,  # pp micro-batches
                schedule=schedule, virtual_stages=2 if schedule == "interleaved-1f1b" else 1,
                recompute=row["activation_checkpoint"], sequence_parallel=tp > 1)
    stack = replace(STACKS["torchtitan"], overlap_tp_comm=row["async_tp"] == "yes",
                    fused_elementwise=row["compile"] == "yes")
    recipe = row.get("float8_recipe") or "none"
    return plan, with_fp8_recipe(stack, recipe if recipe != "none" else None)


def torchtitan_rows(path: Path) -> list[dict]:
    out = []
    with open(path) as handle:
        for row in csv.DictReader(handle):
            plan, stack = torchtitan_plan(row)
            result = estimate(plan, stack)
            # fivefold's own stack on the eager rows: the same FSDP2 / DTensor / SDPA blocks without compile.
            fivefold = estimate(plan, STACKS["fivefold"]) if row["compile"] == "no" and row["float8"] == "no" else None
            out.append({**row, "plan": plan, "layout": plan.describe(), "measured": float(row["tokens_per_s_per_gpu"]),
                        "predicted_fivefold": fivefold.tokens_per_s / plan.world_size if fivefold else None,
                        "predicted": result.tokens_per_s / plan.world_size,
                        "measured_memory": float(row["memory_gib"]) if row.get("memory_gib") else None,
                        "predicted_memory": (result.memory.total - stack.reserved_bytes) / GIB,
                        "mfu": result.mfu, "measured_mfu": float(row["tokens_per_s_per_gpu"]) / result.tokens_per_s
                        * plan.world_size * result.mfu})
    return out


def mcore_plan(row: dict, recompute: str, virtual: int) -> Plan:
    gpus, tp, pp, dp = int(row["gpus"]), int(row["tp"]), int(row["pp"]), int(row["dp"])

    model = ModelSpec(name=row["model"], layers=int(row["layers"]), hidden=int(row["hidden"]), heads=int(row["heads"]),
                      mlp="gelu", norm="layernorm", position="rope", vocab=131072, max_seq_len=4096)
    return Plan(model=model, cluster=parse_cluster(f"{gpus // 8}x8xH100-SXM"),
                train=TrainSpec(seq_len=4096, global_batch=int(row["global_batch"]), dtype="bf16"), dp=dp, tp=tp,
                pp=pp, micro_batch=1, schedule="interleaved-1f1b" if virtual > 1 else "1f1b", virtual_stages=virtual,
                recompute=recompute, sequence_parallel=tp > 1, zero=1)


def megatron_core_rows(path: Path) -> list[dict]:
    """Per row the table gives tp, pp, dp; recompute and schedule are not stated: the fastest that fits,
    among the layouts Megatron-Core runs: it builds num_layers / pp layers per stage and, interleaved, the
    same number in every chunk (arguments.py asserts the layers per stage divide by the layers per virtual
    stage), so 2 chunks only where the layers per stage are even (not 119B: 23, nor 462B: 7). More chunks
    (1-21 layers each) are legal too but left out: the model predicts them 13-21% faster than measured."""
    out = []
    stack = STACKS["megatron-core"]
    with open(path) as handle:
        for row in csv.DictReader(handle):
            best = None
            for recompute in ("none", "selective", "full"):
                per_stage = int(row["layers"]) // int(row["pp"])
                for virtual in [v for v in (1, 2) if per_stage % v == 0] if int(row["pp"]) > 1 else (1,):
                    try:
                        plan = mcore_plan(row, recompute, virtual)
                    except FivefoldError:
                        continue
                    result = estimate(plan, stack)
                    if result.fits and (best is None or result.step_time_s < best[1].step_time_s):
                        best = (plan, result)
            plan, result = best
            out.append({"model": row["model"], "gpus": int(row["gpus"]), "plan": plan, "layout": plan.describe(),
                        "measured_tflops": float(row["tflops_per_gpu"]),
                        "predicted_tflops": result.hardware_tflops_per_gpu, "predicted_mfu": result.mfu,
                        "measured_mfu": float(row["mfu_pct"]) / 100})
    return out


MIN_OWN_ROWS = 5  # rows a (stack, device class) needs for an error band of its own


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))
    return ordered[index]


def credibility_tables(vtrain: list[dict], bubble: list[dict], core: list[dict], titan: list[dict],
                       plans: dict) -> tuple[dict, dict]:
    """(coverage per device class, error band per (stack, class)) from the predicted development set.
    `plans[name]` lists the Plans of each source's rows (vtrain, bubble, core, titan), predicted in order."""
    residuals: dict[tuple[str, str], list[float]] = {}

    def add(key: tuple[str, str], value: float) -> None:
        residuals.setdefault(key, []).append(abs(value))

    for row in vtrain:
        add(("megatron-lm-2022", "A100"), row["measured_s"] / row["predicted_s"] - 1)  # throughput residual
    for row in bubble:
        if row.get("predicted") is not None:
            add(("megatron-lm-2022", "A100"), row["predicted"] / row["measured"] - 1)
    for row in core:
        add(("megatron-core", "H100"), row["predicted_tflops"] / row["measured_tflops"] - 1)
    for row in titan:
        add(("torchtitan", "H100"), row["predicted"] / row["measured"] - 1)
        if row.get("predicted_fivefold") is not None:
            add(("fivefold", "H100"), row["predicted_fivefold"] / row["measured"] - 1)
    bands = {key: round(percentile(values, 0.9), 2) for key, values in residuals.items()}
    # Too few rows of its own for a 90th percentile: fivefold's stack keeps the band of the stack whose rows
    # (TorchTitan's eager ones) it is checked on, when that is wider.
    for key, parent in ((("fivefold", "H100"), ("torchtitan", "H100")),):
        if key in bands and len(residuals[key]) < MIN_OWN_ROWS:
            bands[key] = max(bands[key], bands[parent])
    coverage = {}
    for cls, names, stacks in (("A100", ("vtrain", "bubble"), ("megatron-lm-2022",)),
                               ("H100", ("core", "titan"), ("megatron-core", "torchtitan", "fivefold"))):
        rows = [plan for name in names for plan in plans[name]]
        coverage[cls] = dict(
            stacks=stacks, max_gpus=max(p.world_size for p in rows), max_tp=max(p.tp for p in rows),
            max_pp=max(p.pp for p in rows), max_cp=max(p.cp for p in rows),
            seq_len=(min(p.train.seq_len for p in rows), max(p.train.seq_len for p in rows)),
            schedules=tuple(sorted({p.schedule for p in rows if p.pp > 1}, key=_SCHEDULE_ORDER.index)),
            zero_levels=tuple(sorted({p.zero for p in rows if p.dp * p.cp > 1})),
            dtypes=tuple(sorted({p.train.dtype for p in rows})), recompute=tuple(sorted({p.recompute for p in rows})),
            params_billions=(round(min(p.model.num_params() for p in rows) / 1e9 - 0.05, 1),
                             round(max(p.model.num_params() for p in rows) / 1e9 + 0.05, 1)))
    return coverage, bands


_SCHEDULE_ORDER = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"]


# Module recompute of norm/act is ~free; "norm+moe" (Megatron's `--recompute-modules layernorm moe`) repeats the
# MoE layers' forward, which no Plan recompute level describes: costed as none, and such rows carry a note.
MOE_RECOMPUTE = {"none": "none", "norm+act": "none", "full": "full", "norm+moe": "none"}


def megatron_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """FLOPs per token as Megatron-Core counts them for its TFLOP/s log (`num_floating_point_operations` in
    megatron/training/training.py, GQA + MoE branch): 3 x forward, 2 per multiply-add, QKV and output
    projections, the attention core halved for the causal mask, top_k experts' SwiGLU (no router), the
    logits. Check: with it the ModelZoo H100 table's own step times (19.7 / 17.6 s) give 246 / 276 TFLOP/s per
    GPU against the 245 / 276 it reports. Unlike fivefold's model FLOPs (cost/flops.py) it discounts causality."""
    h, q, kv = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim
    matrices = 3 if model.mlp == "swiglu" else 2
    mlp = (2 * matrices * h * model.expert_ffn_hidden * (model.top_k + model.shared_experts) if model.experts
           else 2 * matrices * h * model.ffn_hidden)
    layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * seq_len * q + mlp
    return 3.0 * (model.layers * layer + 2 * h * model.vocab)


# MoE models of the development set that are not fivefold presets, as Megatron-Core ran them: the layer shapes
# of Megatron-MoE-ModelZoo's model_configs/benchmarking/{Mixtral-8x22B,Qwen2-57B-A14B}.yaml (e865051), vocabularies
# of the Hugging Face config.json files (mistralai/Mixtral-8x22B-v0.1: 32000; Qwen/Qwen2-57B-A14B: 151936).
# Qwen2's shared expert of width 20480 (--moe-shared-expert-intermediate-size) is 8 shared experts of 2560.
# Mixtral-8x22B-G8T8 (MoE Parallel Folding paper, section 4.1): Mixtral 8x22B re-parameterised to 64 experts, 8
# active, each one eighth of the original expert width (16384 / 8 = 2048).
_MIXTRAL_8X22B = ModelSpec(name="mixtral-8x22b", layers=56, hidden=6144, heads=48, kv_heads=8, ffn_hidden=16384,
                           vocab=32000, max_seq_len=65536, rope_theta=1e6, experts=8, top_k=2)
REFERENCE_MODELS: dict[str, ModelSpec] = {
    "mixtral-8x22b": _MIXTRAL_8X22B,
    "mixtral-8x22b-g8t8": replace(_MIXTRAL_8X22B, name="mixtral-8x22b-g8t8", experts=64, top_k=8,
                                  expert_ffn_hidden=2048),
    "qwen2-57b-a14b": ModelSpec(name="qwen2-57b-a14b", layers=28, hidden=3584, heads=28, kv_heads=4,
                                ffn_hidden=18944, vocab=151936, max_seq_len=131072, rope_theta=1e6, experts=64,
                                top_k=8, expert_ffn_hidden=2560, shared_experts=8),
}
H100_BF16_PEAK_TFLOPS = 989.5  # the MFU denominator of the MoE Parallel Folding paper (section 4.1)


def reference_model(name: str) -> ModelSpec:
    return REFERENCE_MODELS[name] if name in REFERENCE_MODELS else PRESETS[name]


def measured_tokens_per_s(row: dict) -> float:
    """Tokens/s per GPU of a Megatron-Core MoE row from what it reports: step time; else TFLOP/s per GPU; else
    MFU against the H100's 989.5 TFLOP/s. TFLOP/s go through Megatron's own FLOPs count."""
    seq, gpus = int(row["seq_len"]), int(row["gpus"])
    if row.get("step_time_s"):
        return int(row["global_batch"]) * seq / float(row["step_time_s"]) / gpus
    tflops = (float(row["tflops_per_gpu"]) if row.get("tflops_per_gpu")
              else float(row["mfu_pct"]) / 100 * H100_BF16_PEAK_TFLOPS)
    return tflops * 1e12 / megatron_flops_per_token(reference_model(row["model"]), seq)


def megatron_moe_plan(row: dict, micro_batch: int | None = None, vpp: int | None = None,
                      recompute: str | None = None) -> Plan:
    """A Megatron-Core MoE row (bench/reference/megatron_moe_*.csv) as a Plan: the distributed optimizer
    (ZeRO-1) or Megatron-FSDP (ZeRO-3), interleaved when vpp > 1, sequence parallel with tp; the recompute of
    layernorm and the MoE activation only is costed as none (it repeats element-wise work of ~1% of a layer).
    A field the row leaves blank (not stated by its source) comes from the arguments."""
    gpus, seq = int(row["gpus"]), int(row["seq_len"])
    tp, cp, ep, pp, etp, dp = (int(row[k]) for k in ("tp", "cp", "ep", "pp", "etp", "dp"))
    vpp = int(row["vpp"]) if row["vpp"] else vpp
    base = reference_model(row["model"])
    model = replace(base, max_seq_len=max(seq, base.max_seq_len))
    return Plan(model=model, cluster=parse_cluster(f"{gpus // 8}x8xH100-SXM"),
                train=TrainSpec(seq_len=seq, global_batch=int(row["global_batch"]), dtype="bf16"),
                dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, zero=3 if row["fsdp"] == "yes" else 1,
                micro_batch=int(row["micro_batch"]) if row["micro_batch"] else micro_batch,
                schedule="interleaved-1f1b" if vpp > 1 else "1f1b", virtual_stages=vpp,
                recompute=MOE_RECOMPUTE[row["recompute"]] if row["recompute"] else recompute,
                sequence_parallel=tp > 1)


def _unstated_choices(row: dict) -> list[dict]:
    """The (micro batch, vpp, recompute) a row's source leaves open, as megatron_core_rows does for its table:
    micro batch 1, every vpp that gives each stage equal chunks (Megatron-Core's requirement), each recompute
    level; the reader keeps the fastest plan that fits."""
    per_stage = reference_model(row["model"]).layers // int(row["pp"])
    vpps = [int(row["vpp"])] if row["vpp"] else [v for v in range(1, per_stage + 1) if per_stage % v == 0
                                                  and (v == 1 or int(row["pp"]) > 1)]
    recomputes = [None] if row["recompute"] else ["none", "selective", "full"]
    return [dict(micro_batch=1, vpp=v, recompute=r) for v in vpps for r in recomputes]


def _paper_dispatcher(row: dict) -> str:
    """The all-to-all dispatcher a MoE Parallel Folding row ran, where the table leaves it blank: the paper's own
    token-level one with folding, Megatron-Core 0.9's sequence-level one (`alltoall_seq`) for its `mcore`
    baseline (megatron_moe_rows)."""
    return {"mcore": "alltoall_seq", "mcore-folding": "alltoall"}.get(row.get("method", ""), "")


def megatron_moe_rows(path: Path) -> list[dict]:
    """Measured and predicted tokens/s per GPU of the Megatron-Core MoE rows (megatron-core stack); a row that
    a Plan cannot express, or that ran what the model does not cost (its note), has `predicted` None or
    `modelled` False. The MoE Parallel Folding paper's `mcore` baseline (method column) is Megatron-Core before
    its token-level dispatcher: the paper's section 3.3 introduces that dispatcher and the sub-sequence dropping
    it defaults to, against the full-sequence dropping that gathers the logits over the ranks of a sequence, and
    its appendix 6.1 compares against Megatron-Core 0.9, whose all-to-all dispatcher is the sequence-level one
    (`moe_sequence_dispatch`: cost/moe_block.py sequence_dispatch_copies)."""
    out = []
    stack = STACKS["megatron-core"]
    with open(path) as handle:
        for row in csv.DictReader(handle):
            measured = measured_tokens_per_s(row)
            variant = replace(stack, moe_dispatch_per_node=row["dispatcher"] == "deepep",
                              moe_sequence_dispatch=row.get("method") == "mcore",
                              moe_drops_tokens=row.get("routing", "").startswith("drop"))
            best, error = None, None
            for choice in _unstated_choices(row):
                try:
                    plan = megatron_moe_plan(row, **choice)
                except FivefoldError as exc:
                    error = error or exc
                    continue
                result = estimate(plan, variant)
                key = (result.fits, -result.step_time_s)
                if best is None or key > best[0]:
                    best = (key, plan, result)
            if best is None:
                out.append({**row, "measured": measured, "predicted": None, "modelled": False,
                            "layout": str(error).split(":")[0]})
                continue
            _, plan, result = best
            out.append({**row, "dispatcher": row["dispatcher"] or _paper_dispatcher(row), "plan": plan,
                        "layout": plan.describe(), "measured": measured,
                        "predicted": result.tokens_per_s / plan.world_size, "mfu": result.mfu, "fits": result.fits,
                        "measured_mfu": result.mfu * measured * plan.world_size / result.tokens_per_s,
                        "modelled": not row["note"] or row["note"] == "Megatron-FSDP"})
    return out
