"""Issue 25's part of docs/validation.md: the op model against the published kernel tables, and the MoE
development set (bench/reference/, sources in its README) against the cost model, with their targets."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from fivefold.cost.compute import flash_attention_time
from fivefold.cost.fp8 import recipe_time_factor
from fivefold.cost.kernels import benchmark_device, gemm_tflops
from fivefold.spec.devices import CATALOG

HEADING = "## Kernels and MoE (issue 25)"
MOE_TARGET = 0.15  # every modelled dev-set MoE row within 15% of tokens/s
# Further TorchTitan tables (FP8 recipes, async TP, H200), read like shared/reference/torchtitan_h100.csv with the
# optional columns `float8_recipe` and `device` (bench/reference/README.md).
TORCHTITAN_TABLES = ("torchtitan_asynctp_h100.csv", "torchtitan_h200.csv")
# Megatron-Core MoE tables, read by reference_rows.megatron_moe_rows (TFLOP/s-only rows through Megatron's FLOPs).
MEGATRON_TABLES = ("megatron_moe_h100.csv", "megatron_moe_long_h100.csv", "megatron_moe_folding_h100.csv")


def _csv(path: Path) -> list[dict]:
    with open(path) as handle:
        return list(csv.DictReader(handle))


def kernel_errors(reference: Path) -> dict[str, list[float]]:
    """Relative errors of the op model (benchmark clocks) on every row of each kernel table."""
    h100 = CATALOG["H100-SXM"]
    bf16, fp8 = benchmark_device(h100, "bf16"), benchmark_device(h100, "fp8")
    out = {"OpenXLA sm_90 BF16 GEMMs": [
               gemm_tflops(bf16, int(r["m"]), int(r["n"]), int(r["k"])) / float(r["tflops"]) - 1
               for r in _csv(reference / "xla_h100_bf16_gemm.csv")],
           "DeepGEMM FP8 GEMMs (dense and grouped)": [
               gemm_tflops(fp8, int(r["m"]), int(r["n"]), int(r["k"]), int(r["groups"]), True) / float(r["tflops"]) - 1
               for r in _csv(reference / "deepgemm_h800_fp8.csv")]}
    attention = []
    for row in _csv(reference / "flash_attention_h100.csv"):
        seq, d, causal = int(row["seq_len"]), int(row["head_dim"]), row["causal"] == "yes"
        heads = 16384 // seq * 2048 // d
        flops = 4 * seq * seq * d * heads * (0.5 if causal else 1.0)
        attention.append(flops / flash_attention_time(bf16, heads, seq, seq, d, causal, False) / 1e12
                         / float(row["tflops"]) - 1)
    out["FlashAttention-3 forward"] = attention
    return out


def te_layer_gemm_shapes(tokens: int = 31 * 512, hidden: int = 4096, inner: int = 16384) -> list[tuple[int, int, int]]:
    """(m, n, k) of the 12 GEMMs of one layer as TransformerEngine's benchmarks/gemm/benchmark_gemm.py derives
    them (bench/reference/te_h200nvl_gemm_layer.csv): QKV, attention out, MLP up, MLP down; Dgrad swaps n and k,
    Wgrad contracts over the tokens."""
    fprop = [(tokens, 3 * hidden, hidden), (tokens, hidden, hidden), (tokens, inner, hidden), (tokens, hidden, inner)]
    return fprop + [(m, k, n) for m, n, k in fprop] + [(k, n, m) for m, n, k in fprop]


def te_fp8_speedups(reference: Path) -> list[tuple[str, float, float]]:
    """(recipe, measured per-layer GEMM speed-up over BF16, op-model speed-up) for the autocast rows of the
    TransformerEngine table. The op model runs at the H100 SXM benchmark clocks (the H200's SM90 compute; the
    table's H200 NVL is power-limited), so only the ratio is compared. Its delayed and blockwise recipes are
    current scaling's curve times their layer time over current's in this same table (cost/fp8.py), so those two
    rows match by construction; current is the check."""
    rows = {r["recipe"]: float(r["layer_ms"]) for r in _csv(reference / "te_h200nvl_gemm_layer.csv")
            if r["mode"] == "autocast"}
    h100 = CATALOG["H100-SXM"]
    bf16, fp8 = benchmark_device(h100, "bf16"), benchmark_device(h100, "fp8")
    shapes = te_layer_gemm_shapes()
    predicted = (sum(2 * m * n * k / gemm_tflops(bf16, m, n, k) for m, n, k in shapes)
                 / sum(2 * m * n * k / gemm_tflops(fp8, m, n, k, 1, True) for m, n, k in shapes))
    return [(recipe, rows["bf16"] / ms, predicted / recipe_time_factor(recipe.removeprefix("fp8-")))
            for recipe, ms in rows.items() if recipe != "bf16"]


def moe_lines(rows: list[dict]) -> list[str]:
    """Console lines for the MoE rows."""
    out = []
    for row in rows:
        if row["predicted"] is None:
            out.append(f"megatron-moe {row['model']} {row['note']}: not modelled ({row['layout']})")
            continue
        error = row["predicted"] / row["measured"] - 1
        out.append(f"megatron-moe {row['model']:<18} s={row['seq_len']:<6} {row['dispatcher'] or '-':<8} "
                   f"{row['layout']:<62} "
                   f"tokens/s/GPU measured "
                   f"{row['measured']:6.0f} predicted {row['predicted']:6.0f} ({error:+.0%})"
                   + ("" if row["modelled"] else f"  [{row['note']}]"))
    return out


# Rows the FP8 target leaves aside, with the reason their sources give. The Float8 rowwise rows of TorchTitan's
# async-TP benchmark (torchtitan 820504e, torchao 6243040, June 2025) ran torchao's rowwise recipe before its
# per-recipe layer filter: the file itself calls the vanilla-TP rowwise baseline known to be slow (torchtitan issue
# 1207), whose root cause (pytorch/ao PR 2410, 2025-06-18) is that converting the small attention.wk / wv linears
# to rowwise FP8 made them ~40% slower, cancelling the gain of the large ones; with async TP rowwise runs at about
# vanilla TP's speed (torchtitan issue 866). A recipe slowed by which layers it converts is not a GEMM-speed term.
ROWWISE_2025_06 = ("torchao rowwise before its layer filter: known slow (torchtitan #1207; root cause "
                   "pytorch/ao #2410: small wk/wv linears ~40% slower in rowwise FP8)")


def set_aside(row: dict) -> str:
    """Why a TorchTitan dev-set row is not held to the target ('' when it is)."""
    return ROWWISE_2025_06 if row.get("float8_recipe") == "rowwise" else ""


def torchtitan_lines(name: str, rows: list[dict]) -> list[str]:
    """Console lines for one of TORCHTITAN_TABLES (predicted with the `torchtitan` stack)."""
    out = []
    for row in rows:
        memory = (f"; memory {row['measured_memory']:.1f} / {row['predicted_memory']:.1f} GiB"
                  if row["measured_memory"] is not None else "")
        aside = f"  [set aside: {set_aside(row)}]" if set_aside(row) else ""
        out.append(f"{name} {row['model']:>13} {row['layout']:<48} async_tp={row['async_tp']:<3} "
                   f"float8={row['float8_recipe']:<10} tokens/s/GPU measured {row['measured']:7.1f} predicted "
                   f"{row['predicted']:7.1f} ({row['predicted'] / row['measured'] - 1:+.1%}){memory}{aside}")
    return out


def torchtitan_summary(tables: dict[str, list[dict]]) -> str:
    """How many held-to-target TorchTitan FP8 / async-TP rows are within MOE_TARGET, and how many are set aside."""
    rows = [row for table in tables.values() for row in table]
    held = [abs(row["predicted"] / row["measured"] - 1) for row in rows if not set_aside(row)]
    return (f"TorchTitan FP8 / async-TP rows: {sum(e <= MOE_TARGET for e in held)}/{len(held)} within "
            f"{MOE_TARGET:.0%}, MAPE {statistics.fmean(held):.1%}; {len(rows) - len(held)} set aside (rowwise)")


def torchtitan_table_rows(reference: Path) -> dict[str, list[dict]]:
    from reference_rows import torchtitan_rows

    return {name: torchtitan_rows(reference / name) for name in TORCHTITAN_TABLES}


def deepseek_v3_rows(reference: Path) -> list[dict]:
    """The DeepSeek-V3 report's pre-training throughput (bench/reference/deepseek_v3_h800.csv): tokens/s per GPU
    = 1e12 tokens / (GPU-hours per trillion tokens x 3600 s). Reported for the record: no Plan expresses it."""
    return [{**row, "measured": 1e12 / (float(row["gpu_hours_per_trillion_tokens"]) * 3600), "predicted": None,
             "modelled": False, "layout": row["note"].split(";")[0]}
            for row in _csv(reference / "deepseek_v3_h800.csv")]


def megatron_moe_table_rows(reference: Path) -> list[dict]:
    """The rows of every MEGATRON_TABLES file, in order (the MoE target counts the modelled ones)."""
    from reference_rows import megatron_moe_rows

    return [row for name in MEGATRON_TABLES for row in megatron_moe_rows(reference / name)]


def dev_set_tables(reference: Path) -> dict[str, list[dict]]:
    """Every training table of bench/reference/ (those with a `source` column), each read and predicted by its
    own reader; tests/test_reference_tables.py checks that no such table is left without one."""
    from reference_rows import megatron_moe_rows

    return {**{name: megatron_moe_rows(reference / name) for name in MEGATRON_TABLES},
            **torchtitan_table_rows(reference), "deepseek_v3_h800.csv": deepseek_v3_rows(reference)}


def moe_summary(rows: list[dict]) -> str:
    errors = [abs(r["predicted"] / r["measured"] - 1) for r in rows if r["modelled"] and r["predicted"]]
    inside = sum(e <= MOE_TARGET for e in errors)
    return (f"MoE dev set: {inside}/{len(errors)} modelled rows within {MOE_TARGET:.0%} (target: all), "
            f"MAPE {statistics.fmean(errors):.1%}")


def torchtitan_section(tables: dict[str, list[dict]]) -> list[str]:
    lines = ["", "FP8 and async-TP development rows (TorchTitan, `bench/reference/`, sources in its README), predicted "
             "with the `torchtitan` stack, `--dtype fp8` and the recipe each row ran (`--fp8-recipe`, cost/fp8.py). The "
             "rowwise rows are set aside, for the reason in the note. " + torchtitan_summary(tables) + ".", "",
             "| table | model | layout | device | async TP | float8 | measured tokens/s/GPU | predicted | error | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in tables.items():
        for row in rows:
            lines.append(f"| {name} | {row['model']} | {row['layout']} | {row.get('device') or 'H100-96GB'} | "
                         f"{row['async_tp']} | {row['float8_recipe']} | {row['measured']:.0f} | "
                         f"{row['predicted']:.0f} | {row['predicted'] / row['measured'] - 1:+.1%} | "
                         f"{('set aside: ' + set_aside(row)) if set_aside(row) else ''} |")
    return lines


def write_residual_plot(folder: Path, rows: list[dict]) -> str:
    """The modelled MoE rows' residuals (predicted / measured - 1) against measured tokens/s, one colour per
    source, with the 15% target; the PNG's file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, axis = plt.subplots(figsize=(7, 3.6))
    sources = sorted({row["source"].split(" (")[0] for row in rows})
    for index, source in enumerate(sources):
        kept = [r for r in rows if r["modelled"] and r["predicted"] and r["source"].split(" (")[0] == source]
        axis.scatter([r["measured"] for r in kept], [100 * (r["predicted"] / r["measured"] - 1) for r in kept],
                     s=12, color=f"C{index}", label=source[:60])
    for level in (-15, 0, 15):
        axis.axhline(level, color="black", linewidth=0.8 if level == 0 else 0.5, linestyle="-" if level == 0 else ":")
    axis.set_xscale("log")
    axis.set_xlabel("measured tokens/s per GPU")
    axis.set_ylabel("predicted / measured - 1 (%)")
    axis.set_title("MoE development set (megatron-core stack, H100)", fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    fig.tight_layout()
    file = "residuals-megatron-moe-tokens.png"
    fig.savefig(folder / file, dpi=90)
    plt.close(fig)
    return file


def section(reference: Path, rows: list[dict], titan: dict[str, list[dict]] | None = None,
            images: Path | None = None) -> str:
    lines = [HEADING, "", "Produced by `bench/validate_cost_model.py --write docs/validation.md` with the tables in "
             "`bench/reference/` (sources in its README). Kernels: the op model of `cost/compute.py` at the "
             "tables' benchmark clocks (`cost/kernels.py`), row by row (`tests/test_cost_kernels.py`).", "",
             "| kernel table | rows | mean abs error | worst |", "|---|---|---|---|"]
    for name, errors in kernel_errors(reference).items():
        lines.append(f"| {name} | {len(errors)} | {statistics.fmean(map(abs, errors)):.1%} | "
                     f"{max(errors, key=abs):+.1%} |")
    lines += ["", "MoE development set: Megatron-Core on H100: Megatron-MoE-ModelZoo (Qwen3-235B-A22B on 256 "
              "GPUs, sequence 4096 and 16K-128K) and the MoE Parallel Folding paper's Tables 3-5 (Mixtral-8x22B, "
              "Qwen2-57B-A14B, Mixtral-8x22B-G8T8 on 64-1024 GPUs; their micro batch, vpp and recompute are not "
              "stated, so the fastest plan that fits; as the paper states, tokens dropped at capacity factor 1 "
              "(`moe_drops_tokens`: the router's capacity mask, the host sync before the first permutation), and "
              "its `mcore` baseline with Megatron-Core 0.9's sequence-level dispatcher (`alltoall_seq`, "
              "`moe_sequence_dispatch`: tp all-to-alls around the dispatch, logits gathered over tp; "
              "`reference_rows.megatron_moe_rows`)). Rows reported as TFLOP/s or MFU only are converted to "
              "tokens/s with Megatron's FLOPs count (`reference_rows.megatron_flops_per_token`), predicted with the "
              "`megatron-core` stack "
              "(DeepEP rows with `moe_dispatch_per_node`: one network copy per destination node). Target: every "
              "modelled row within 15% of tokens/s.", "",
              "| model | seq | layout | dispatcher | measured tokens/s/GPU | predicted | error | note |",
              "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["predicted"] is None:
            lines.append(f"| {row['model']} | {row['seq_len']} | (not expressible: {row['layout']}) | "
                         f"{row['dispatcher']} | "
                         f"{row['measured']:.0f} | - | - | {row['note']} |")
            continue
        lines.append(f"| {row['model']} | {row['seq_len']} | {row['layout']} | {row['dispatcher']} | "
                     f"{row['measured']:.0f} | "
                     f"{row['predicted']:.0f} | {row['predicted'] / row['measured'] - 1:+.1%} | {row['note'] or ''} |")
    lines += ["", moe_summary(rows) + ". Qwen3-235B-A22B tp4 pp8 ep8 (vpp 4, 1024 tokens per rank and "
              "micro-batch) was +70% with 8 us per op: its MoE layers are launch-bound, so it moves with the CPU "
              "seconds per op (now TransformerEngine issue #2053's 13.5 us for one Python-issued op on a DGX H100: "
              "+16%) and with the run-ahead the host sync ends (`passwork.synced_forward`: +9%); the dense and "
              "GPU-bound MoE rows do not move (docs/predictions.md, \"MoE, term by term\")."]
    if images is not None:
        file = write_residual_plot(images, rows)
        lines += ["", f"![{file}](images/{file})"]
    lines += ["", "FP8 GEMM speed-up over BF16 per layer (TransformerEngine GEMM profiling guide, H200 NVL, 12 GEMMs "
              "of a hidden-4096 layer at 15,872 tokens, quantization included; op model at H100 SXM benchmark "
              "clocks; delayed and blockwise are current scaling's curve times their layer time over current's in "
              "this same table (cost/fp8.py), so they match by construction and current is the check):", "", "| recipe | measured | op model |",
              "|---|---|---|"]
    lines += [f"| {recipe} | {measured:.2f}x | {predicted:.2f}x |" for recipe, measured, predicted
              in te_fp8_speedups(reference)]
    for row in deepseek_v3_rows(reference):
        lines += ["", f"DeepSeek-V3 pre-training (report, 2,048 H800, FP8, pp16 DualPipe, ep64, ZeRO-1 dp128): "
                  f"{row['gpu_hours_per_trillion_tokens']} GPU-hours per trillion tokens = {row['measured']:.0f} "
                  f"tokens/s per GPU, reported only ({row['layout']})."]
    if titan:
        lines += torchtitan_section(titan)
    return "\n".join(lines) + "\n"
